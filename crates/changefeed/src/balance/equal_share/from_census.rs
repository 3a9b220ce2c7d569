//! [`EqualShare`]'s plan from a [`Census`]: the steps of [`BalanceStrategy::plan`], giving the
//! same plan, in O(hosts + the leases it hands out) rather than O(leases).
//!
//! The counts a plan ranks and shares by come from the sizes of the census's sets; only the
//! leases of hosts that are not live (whose hand-offs do not count) and the leases a step hands
//! out are walked. Which hosts are live is given per plan, so nothing here is kept between
//! plans.
//!
//! [`BalanceStrategy::plan`]: super::BalanceStrategy::plan

use std::collections::HashSet;

use imbl::OrdSet;

use super::slices::{donors, draws, free_slice, release_range, select_range};
use super::{EqualShare, Fleet, Shares};
use crate::balance::census::{holder, Census, CensusSnapshot, Row};
use crate::balance::{HandoffRequest, Plan};
use crate::model::{HostName, Lease, PartitionId};

impl EqualShare {
    /// [`super::BalanceStrategy::plan`] from a census: the same steps, the same plan, but each
    /// step reads only the leases it can hand out (the free ones, the donors' own, this host's
    /// own and the hand-offs asked for), never every lease.
    pub(super) fn plan_from_census(&self, s: &CensusSnapshot<'_>) -> Plan {
        let fleet = Fleet::new(s.live_hosts, self);
        let Some(me) = fleet.index_of(s.me) else {
            return Plan::default();
        };
        let hosts = fleet.hosts.len();
        let census = s.census;
        // A holder, given its index in the fleet if it has one.
        let class_of = |owner: &HostName, index: Option<usize>| match index {
            Some(h) => Holder::Live(h),
            None if s.dead_hosts.is_none_or(|dead| dead.contains(owner)) => Holder::Dead,
            None => Holder::Unknown,
        };
        let class = |owner: &HostName| class_of(owner, fleet.index_of(owner));
        let mut owned = vec![0usize; hosts];
        let mut eligible = census.len();
        let mut free_sets: Vec<&OrdSet<Row>> = vec![&census.unheld];
        let mut holders = fleet.in_order();
        for (owner, set) in &census.held {
            match class_of(owner, holders.index_of(owner)) {
                Holder::Live(h) => owned[h] = set.len(),
                Holder::Dead => free_sets.push(set),
                Holder::Unknown => eligible -= set.len(),
            }
        }
        let free: usize = free_sets.iter().map(|set| set.len()).sum();
        let asks = Asks::count(census, &fleet, class_of);
        let shares = Shares::new(
            &fleet,
            eligible,
            &owned,
            &asks.outgoing,
            &asks.incoming,
            &asks.claimed,
        );
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
        for (a, need) in need.iter_mut().enumerate() {
            let n = (*need).min(asks.claimed[a]);
            if n == 0 {
                continue;
            }
            *need -= n;
            taken_by_askers += n;
            let rows = asks.first_claimed(census, fleet.hosts[a], a, n);
            asked_and_taken.extend(rows.iter().map(|l| &l.key.partition));
            if a == me {
                plan.take.extend(rows.iter().map(|l| partition(l)));
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

        // 3. Hand-offs, as in `plan`.
        let donors = donors(&shares);
        for (donor, offset, n) in draws(&need, &donors, me) {
            let slice = requestable_range(census, &fleet, donor, offset, offset + n);
            plan.request_handoff
                .extend(slice.iter().map(|l| HandoffRequest {
                    partition: partition(l),
                    from: fleet.hosts[donor].clone(),
                }));
        }

        // 4. Above its maximum, give up what no host under quota asks for in step 3.
        if let Some((from, to)) = release_range(me, &shares, &fleet, &need, &donors) {
            let slice = requestable_range(census, &fleet, me, from, to);
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

/// The hand-offs live hosts asked for, per live host: those pending between two live hosts
/// (`outgoing` from the holder, `incoming` to the asker) and the free leases each asked for
/// (`claimed`).
struct Asks<'c> {
    outgoing: Vec<usize>,
    incoming: Vec<usize>,
    claimed: Vec<usize>,
    /// The leases a live asker (by index) asked for that are free because their holder is
    /// dead, by asker then partition (the unheld ones it asked for are the census's
    /// `asked_unheld`).
    claimed_of_dead: Vec<(usize, &'c Lease)>,
}

impl<'c> Asks<'c> {
    /// Counts every lease a live host asked for as if its holder were live, then takes back
    /// the leases of holders that are not live and the requests of askers that are not live,
    /// walking only those. `class_of` classifies a holder given its index in the fleet.
    fn count(
        census: &'c Census,
        fleet: &Fleet<'_>,
        class_of: impl Fn(&HostName, Option<usize>) -> Holder,
    ) -> Self {
        let hosts = fleet.hosts.len();
        let mut asks = Asks {
            outgoing: vec![0; hosts],
            incoming: vec![0; hosts],
            claimed: vec![0; hosts],
            claimed_of_dead: Vec::new(),
        };
        let self_asked = |host: &HostName| census.self_asked.get(host).copied().unwrap_or(0);
        let mut gone_askers: Vec<&OrdSet<Row>> = Vec::new();
        let mut askers = fleet.in_order();
        for (asker, set) in &census.asked {
            match askers.index_of(asker) {
                Some(a) => {
                    let unheld = census.asked_unheld.get(asker).map_or(0, OrdSet::len);
                    asks.claimed[a] = unheld;
                    asks.incoming[a] = set.len() - unheld - self_asked(asker);
                }
                None => gone_askers.push(set),
            }
        }
        let mut holders = fleet.in_order();
        for (owner, set) in &census.held_asked {
            let class = class_of(owner, holders.index_of(owner));
            if let Holder::Live(o) = class {
                asks.outgoing[o] = set.len() - self_asked(owner);
                continue;
            }
            for Row(lease) in set {
                let Some(a) = lease.next_owner.as_ref().and_then(|n| fleet.index_of(n)) else {
                    continue;
                };
                asks.incoming[a] -= 1;
                if let Holder::Dead = class {
                    asks.claimed[a] += 1;
                    asks.claimed_of_dead.push((a, lease));
                }
            }
        }
        for Row(lease) in gone_askers.into_iter().flatten() {
            if let Some(owner) = holder(lease) {
                if let Holder::Live(o) = class_of(owner, fleet.index_of(owner)) {
                    asks.outgoing[o] -= 1;
                }
            }
        }
        asks.claimed_of_dead.sort_unstable_by(|(a, x), (b, y)| {
            a.cmp(b).then_with(|| x.key.partition.cmp(&y.key.partition))
        });
        asks
    }

    /// The first `n` by partition of the free leases live host `a` (named `asker`) asked for.
    fn first_claimed(
        &self,
        census: &'c Census,
        asker: &HostName,
        a: usize,
        n: usize,
    ) -> Vec<&'c Lease> {
        let start = self.claimed_of_dead.partition_point(|(x, _)| *x < a);
        let end = self.claimed_of_dead.partition_point(|(x, _)| *x <= a);
        let of_dead = &self.claimed_of_dead[start..end];
        let mut rows: Vec<&Lease> = census
            .asked_unheld
            .get(asker)
            .into_iter()
            .flatten()
            .take(n)
            .map(|row| &*row.0)
            .chain(of_dead.iter().map(|(_, lease)| *lease))
            .collect();
        if !of_dead.is_empty() {
            rows.sort_unstable_by(|x, y| x.key.partition.cmp(&y.key.partition));
            rows.truncate(n);
        }
        rows
    }
}

/// Positions `from..to`, in hand-off order, of the leases `host` holds that no other live
/// host asked for: first those naming a `next_owner` that is not live or is `host` itself
/// (stale requests), then those naming none, each part by partition.
fn requestable_range<'c>(
    census: &'c Census,
    fleet: &Fleet<'_>,
    host: usize,
    from: usize,
    to: usize,
) -> Vec<&'c Lease> {
    let name = fleet.hosts[host];
    let stale: Vec<&Lease> = census
        .held_asked
        .get(name)
        .into_iter()
        .flatten()
        .map(|row| &*row.0)
        .filter(|l| {
            l.next_owner
                .as_ref()
                .and_then(|n| fleet.index_of(n))
                .is_none_or(|a| a == host)
        })
        .collect();
    let mut range: Vec<&Lease> = stale
        .iter()
        .copied()
        .skip(from)
        .take(to.saturating_sub(from))
        .collect();
    let (rest_from, rest_to) = (
        from.saturating_sub(stale.len()),
        to.saturating_sub(stale.len()),
    );
    if rest_to > rest_from {
        range.extend(
            census
                .held
                .get(name)
                .into_iter()
                .flatten()
                .map(|row| &*row.0)
                .filter(|l| l.next_owner.is_none())
                .skip(rest_from)
                .take(rest_to - rest_from),
        );
    }
    range
}
