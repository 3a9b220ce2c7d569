//! [`EqualShare`]'s plan from a [`Census`]: the steps of [`BalanceStrategy::plan`], giving the
//! same plan, without a pass over every lease.
//!
//! [`BalanceStrategy::plan`]: super::BalanceStrategy::plan
//! [`Census`]: crate::balance::Census

use std::collections::HashSet;

use super::{
    donors, draws, free_slice, handoff_order, release_range, select_range, EqualShare, Fleet,
    Shares,
};
use crate::balance::census::{holder, CensusSnapshot, Row};
use crate::balance::{HandoffRequest, Plan};
use crate::model::{HostName, Lease, PartitionId};

impl EqualShare {
    /// [`super::BalanceStrategy::plan`] from a census: the same steps, the same plan, but each step
    /// reads only the leases it can hand out (the free ones, the donors' own, this host's own
    /// and the hand-offs asked for), never every lease.
    pub(super) fn plan_from_census(&self, s: &CensusSnapshot<'_>) -> Plan {
        let fleet = Fleet::new(s.live_hosts, self);
        let Some(me) = fleet.index_of(s.me) else {
            return Plan::default();
        };
        let hosts = fleet.hosts.len();
        let census = s.census;
        let class = |owner: &HostName| match fleet.index_of(owner) {
            Some(h) => Holder::Live(h),
            None if s.dead_hosts.is_none_or(|dead| dead.contains(owner)) => Holder::Dead,
            None => Holder::Unknown,
        };
        let mut owned = vec![0usize; hosts];
        let mut eligible = census.len();
        let mut free_sets: Vec<&imbl::OrdSet<Row>> = vec![&census.unheld];
        for (owner, set) in &census.held {
            match class(owner) {
                Holder::Live(h) => owned[h] = set.len(),
                Holder::Dead => free_sets.push(set),
                Holder::Unknown => eligible -= set.len(),
            }
        }
        let free: usize = free_sets.iter().map(|set| set.len()).sum();
        // The leases a live host asked for: free ones it claims (by partition), held ones
        // pending to it.
        let mut claimed_rows: Vec<Vec<&Lease>> = vec![Vec::new(); hosts];
        let mut outgoing = vec![0usize; hosts];
        let mut incoming = vec![0usize; hosts];
        for (asker, set) in &census.asked {
            let Some(a) = fleet.index_of(asker) else {
                continue;
            };
            for Row(lease) in set {
                match holder(lease).map(class) {
                    None | Some(Holder::Dead) => claimed_rows[a].push(lease),
                    Some(Holder::Live(o)) if o != a => {
                        outgoing[o] += 1;
                        incoming[a] += 1;
                    }
                    Some(_) => {}
                }
            }
        }
        let claimed: Vec<usize> = claimed_rows.iter().map(Vec::len).collect();
        let shares = Shares::new(&fleet, eligible, &owned, &outgoing, &incoming, &claimed);
        let mut plan = Plan::default();
        let partition = |lease: &Lease| lease.key.partition.clone();

        // 1. Steal overdue hand-offs to me.
        for Row(lease) in census.asked.get(s.me).into_iter().flatten() {
            if let Some(Holder::Live(o)) = holder(lease).map(class) {
                if o != me && (s.handoff_overdue)(&lease.key.partition) {
                    plan.steal.push(partition(lease));
                }
            }
        }

        let mut need = shares.need();

        // 2a. Each live asker takes the first of the free leases it asked for, by partition,
        // while it is under quota; the others join the rest.
        let mut taken_by_askers = 0usize;
        let mut asked_and_taken: HashSet<&PartitionId> = HashSet::new();
        for (a, rows) in claimed_rows.iter().enumerate() {
            let n = need[a].min(rows.len());
            need[a] -= n;
            taken_by_askers += n;
            asked_and_taken.extend(rows[..n].iter().map(|l| &l.key.partition));
            if a == me {
                plan.take.extend(rows[..n].iter().map(|l| partition(l)));
            }
        }

        // 2b. The rest of the free leases, in partition order, to hosts under quota in name
        // order.
        let (before, got) = free_slice(&mut need, free - taken_by_askers, me);
        if got > 0 {
            let mut rest: Vec<&Lease> = free_sets
                .iter()
                .flat_map(|set| set.iter())
                .map(|row| &*row.0)
                .filter(|l| !asked_and_taken.contains(&l.key.partition))
                .collect();
            let slice = select_range(&mut rest, before, before + got, |x, y| {
                x.key.partition.cmp(&y.key.partition)
            });
            plan.take.extend(slice.iter().map(|l| partition(l)));
        }

        // The leases `host` holds that no other live host asked for.
        let requestable = |host: usize| -> Vec<&Lease> {
            census
                .held
                .get(fleet.hosts[host])
                .into_iter()
                .flatten()
                .map(|row| &*row.0)
                .filter(|l| {
                    l.next_owner
                        .as_ref()
                        .and_then(|n| fleet.index_of(n))
                        .is_none_or(|a| a == host)
                })
                .collect()
        };

        // 3. Hand-offs, as in `plan`.
        let donors = donors(&shares);
        for (donor, offset, n) in draws(&need, &donors, me) {
            let mut offered = requestable(donor);
            let slice = select_range(&mut offered, offset, offset + n, |x, y| handoff_order(x, y));
            plan.request_handoff
                .extend(slice.iter().map(|l| HandoffRequest {
                    partition: partition(l),
                    from: fleet.hosts[donor].clone(),
                }));
        }

        // 4. Above its maximum, give up what no host under quota asks for in step 3.
        if let Some((from, to)) = release_range(me, &shares, &fleet, &need, &donors) {
            let mut mine = requestable(me);
            let slice = select_range(&mut mine, from, to, |x, y| handoff_order(x, y));
            plan.release.extend(slice.iter().map(|l| partition(l)));
        }

        plan.sort();
        plan
    }
}

/// How the census path classifies a lease's holder.
#[derive(Debug, Clone, Copy)]
enum Holder {
    /// A live host (its index in the fleet).
    Live(usize),
    /// A host judged dead: its leases are free.
    Dead,
    /// Neither live nor judged dead: its leases count for nobody.
    Unknown,
}
