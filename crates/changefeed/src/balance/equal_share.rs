//! [`EqualShare`], the default strategy: every live host gets an equal share of the eligible
//! leases, within optional per-host limits, and every host computes the same assignment from
//! the same snapshot.
//!
//! The plan is worked out for the whole fleet and then cut down to the asking host. Every host
//! that sees the same snapshot computes the same fleet-wide assignment, so two hosts never go
//! for the same free lease or ask for the same lease, and a fleet that sees one snapshot
//! reaches its balance in one cycle (plus one for hand-offs the owner does not honour, which
//! the asker then steals). Hosts that see different snapshots may collide; the compare-and-swap
//! decides, and the loser plans again next cycle.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use super::census::CensusSnapshot;
use super::limits::{share, LeaseLimits};
use super::{BalanceStrategy, HandoffRequest, LeaseView, Plan, Snapshot};
use crate::model::{HostName, LeaseState};

mod from_census;
mod slices;

use slices::{
    by_handoff_order, by_partition, donors, draws, free_slice, release_range, select_range,
};

/// Equal share of the eligible leases for every live host (`DESIGN.md`, "Balancing"), within
/// optional [`LeaseLimits`].
///
/// With `E` eligible leases and `H` live hosts, each host's quota is `E / H`, plus one for the
/// `E % H` hosts that hold the most leases now (ties by name); see [`super::quotas`]. Weights
/// ([`LeaseView::weight`]) are ignored: this strategy balances lease counts.
///
/// A host's plan, from one snapshot:
///
/// 1. **Steal** every eligible lease whose `next_owner` is this host, whose owner is live, and
///    whose hand-off is overdue. Pending hand-offs (overdue or not) count toward the asker's
///    share and against the owner's, so nobody asks twice for the same move.
/// 2. **Take** free leases (no owner, or a dead owner) up to the quota, in one pass. Free leases
///    go first to the live host named in their `next_owner` (it had asked for them), then, in
///    partition order, to the hosts under quota in name order: each host takes its own slice,
///    so hosts of one snapshot never race for the same lease.
/// 3. **Request hand-offs** for the rest of the shortfall, from hosts over their quota, the
///    most over-quota first (ties by name), each giving no more than its excess. Leases
///    already asked for by a live host are never asked for again; a `next_owner` naming a dead
///    host (or the owner itself) is a stale request and may be overwritten, and such leases
///    are asked for first so they move once instead of twice.
/// 4. **Release** nothing, unless this host holds more than its maximum (see "Limits"). An
///    over-quota host waits to be asked: a release would leave the partition unread until
///    someone takes it, while a hand-off moves it with no gap and no duplicates. Releasing on
///    shutdown is the processor's job (`DESIGN.md` rule 6), not the balancer's.
///
/// Because the extra leases go to the hosts holding the most, a fleet where every host holds
/// its quota plans nothing: if every host holds `E / H` or `E / H + 1` leases and none is free,
/// the hosts holding `E / H + 1` are exactly the ones whose quota is `E / H + 1`. Hosts one
/// lease apart are therefore balanced and nothing oscillates.
///
/// A host not in `live_hosts` (its own heartbeat is not live) plans nothing.
///
/// # Limits
///
/// [`EqualShare::with_limits`] gives every host a minimum and a maximum number of eligible
/// leases (Cosmos's `MinPartitionCount` / `MaxPartitionCount`, KCL's `maxLeasesForWorker`), and
/// [`EqualShare::with_host_limits`] other limits to named hosts. The quotas then follow three
/// rules, in this order (the whole computation is in [`EqualShare::quotas`]):
///
/// - **A host under its minimum asks first.** If the eligible leases do not cover every host's
///   minimum, hosts fill up to their minimum one after another (the hosts holding most first,
///   ties by name) and the hosts after them get nothing, rather than every host getting a share
///   below its minimum. If they do, a host whose minimum is above the equal share gets its
///   minimum and the others' shares shrink to make room.
/// - **A host at its maximum takes no more.** Its quota is at most its maximum, and what it
///   cannot hold is spread over the others: every host's quota is `clamp(level, min, max)` for
///   one common level, the highest at which the quotas fit, and the leases left over go one
///   each, holders first, to hosts below their maximum.
/// - **Leases nobody may hold stay free**, and only then: when every live host's quota is its
///   maximum and the maximums add up to fewer than the eligible leases. Those partitions are
///   not read until a host joins or a limit is raised.
///
/// A host holding more than its maximum (its limit was lowered, or it adopted its leases after
/// a restart) gives up the excess through the same hand-off as any over-quota host: the hosts
/// under quota ask for what they need. Only what none of them asks for in this plan is
/// released (step 4, stale requests first, then by partition), and then stays free while
/// every host is at its maximum.
///
/// Every host must plan with the same limits for every host, as it must see the same live
/// hosts: a host that believes other limits computes another assignment, and leases it counts
/// for another host may stay free. So each host publishes its own limits
/// ([`crate::processor::Settings::min_leases`], [`crate::processor::Settings::max_leases`])
/// with its heartbeat, and the processor gives every host's to every host
/// ([`BalanceStrategy::with_published_limits`]). Without limits ([`EqualShare::default`]) the
/// plans are exactly those of plain equal share.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EqualShare {
    /// Every host's limits, unless `host_limits` names it.
    limits: LeaseLimits,
    /// Hosts with limits of their own.
    host_limits: BTreeMap<HostName, LeaseLimits>,
}

impl EqualShare {
    /// Equal share with `limits` for every host.
    pub fn with_limits(limits: LeaseLimits) -> Self {
        Self {
            limits,
            host_limits: BTreeMap::new(),
        }
    }

    /// The same, with `limits` for `host` instead of the fleet's. Every host of the fleet must
    /// be given the same table (see "Limits" above).
    pub fn with_host_limits(mut self, host: HostName, limits: LeaseLimits) -> Self {
        self.host_limits.insert(host, limits);
        self
    }

    /// The limits `host` plans with.
    pub fn limits_of(&self, host: &HostName) -> LeaseLimits {
        self.host_limits.get(host).copied().unwrap_or(self.limits)
    }

    /// Whether no host has a limit: the plans are those of plain equal share.
    pub fn is_unlimited(&self) -> bool {
        self.limits.is_none() && self.host_limits.values().all(LeaseLimits::is_none)
    }

    /// Every live host's quota of the eligible leases under this strategy: [`super::quotas`]
    /// within the limits (see "Limits" above). The quotas add up to the eligible leases, or,
    /// when every host's quota is its maximum, to less.
    ///
    /// Duplicate host names count once. Empty `live_hosts` gives an empty map.
    pub fn quotas(
        &self,
        live_hosts: &[HostName],
        leases: &[LeaseView<'_>],
    ) -> BTreeMap<HostName, usize> {
        let fleet = Fleet::new(live_hosts, self).indexed();
        let tally = Tally::new(&fleet, leases);
        fleet
            .hosts
            .iter()
            .zip(tally.shares.quota.iter())
            .map(|(h, q)| ((*h).clone(), *q))
            .collect()
    }
}

impl BalanceStrategy for EqualShare {
    fn with_published_limits(
        &self,
        limits: &BTreeMap<HostName, LeaseLimits>,
    ) -> Option<std::sync::Arc<dyn BalanceStrategy>> {
        let mut with = self.clone();
        with.host_limits
            .extend(limits.iter().map(|(h, l)| (h.clone(), *l)));
        Some(std::sync::Arc::new(with))
    }

    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        let fleet = Fleet::new(snapshot.live_hosts, self).indexed();
        let Some(me) = fleet.index_of(snapshot.me) else {
            return Plan::default();
        };
        let tally = Tally::new(&fleet, snapshot.leases);
        let shares = &tally.shares;
        let leases = snapshot.leases;
        let mut plan = Plan::default();

        // 1. Steal overdue hand-offs to me.
        for (i, status) in tally.status.iter().enumerate() {
            if let Status::Held {
                owner,
                pending: Some(asker),
            } = *status
            {
                if asker == me && owner != me && leases[i].handoff_overdue {
                    plan.steal.push(leases[i].lease.key.partition.clone());
                }
            }
        }

        // Shortfall of every host, after pending hand-offs.
        let mut need = shares.need();

        // 2a. Free leases a live host asked for go to it first, while it is under quota.
        let mut asked: Vec<(usize, usize)> = Vec::new(); // (lease, asker)
        let mut rest: Vec<usize> = Vec::new(); // free leases nobody live asked for
        for (i, status) in tally.status.iter().enumerate() {
            match *status {
                Status::Free { asker: Some(a) } => asked.push((i, a)),
                Status::Free { asker: None } => rest.push(i),
                _ => {}
            }
        }
        asked.sort_unstable_by(|x, y| by_partition(leases, x.0, y.0));
        for (i, a) in asked {
            if need[a] > 0 {
                need[a] -= 1;
                if a == me {
                    plan.take.push(leases[i].lease.key.partition.clone());
                }
            } else {
                rest.push(i);
            }
        }

        // 2b. The other free leases, in partition order, to hosts under quota in name order.
        // Only this host's slice is materialised; the others' sizes follow from `need`.
        let (before, got) = free_slice(&mut need, rest.len(), me);
        if got > 0 {
            let slice = select_range(&mut rest, before, before + got, |x, y| {
                by_partition(leases, *x, *y)
            });
            plan.take
                .extend(slice.iter().map(|&i| leases[i].lease.key.partition.clone()));
        }

        // 3. Hand-offs: hosts under quota, in name order, draw from the hosts over quota, most
        // over first. Only this host's draws are materialised.
        let donors = donors(shares);
        let draws = draws(&need, &donors, me);
        if !draws.is_empty() {
            let mut slot: Vec<Option<usize>> = vec![None; fleet.hosts.len()];
            for (k, &(donor, _, _)) in draws.iter().enumerate() {
                slot[donor] = Some(k);
            }
            let mut offered: Vec<Vec<usize>> = vec![Vec::new(); draws.len()];
            for (i, status) in tally.status.iter().enumerate() {
                if let Status::Held {
                    owner,
                    pending: None,
                } = *status
                {
                    if let Some(k) = slot[owner] {
                        offered[k].push(i);
                    }
                }
            }
            for (&(donor, offset, n), mut list) in draws.iter().zip(offered) {
                let slice = select_range(&mut list, offset, offset + n, |x, y| {
                    by_handoff_order(leases, *x, *y)
                });
                plan.request_handoff
                    .extend(slice.iter().map(|&i| HandoffRequest {
                        partition: leases[i].lease.key.partition.clone(),
                        from: fleet.hosts[donor].clone(),
                    }));
            }
        }

        // 4. Above its maximum, give up what no host under quota asks for in step 3.
        if let Some((from, to)) = release_range(me, shares, &fleet, &need, &donors) {
            let mut mine: Vec<usize> = tally
                .status
                .iter()
                .enumerate()
                .filter(|(_, status)| {
                    **status
                        == Status::Held {
                            owner: me,
                            pending: None,
                        }
                })
                .map(|(i, _)| i)
                .collect();
            let slice = select_range(&mut mine, from, to, |x, y| by_handoff_order(leases, *x, *y));
            plan.release
                .extend(slice.iter().map(|&i| leases[i].lease.key.partition.clone()));
        }

        plan.sort();
        plan
    }

    fn plan_census(&self, snapshot: &CensusSnapshot<'_>) -> Option<Plan> {
        Some(self.plan_from_census(snapshot))
    }
}

/// The live hosts, sorted and deduplicated, with their limits, and a name → index map when
/// names are looked up one per lease.
struct Fleet<'s> {
    /// Live hosts in name order.
    hosts: Vec<&'s HostName>,
    /// Built by [`Fleet::indexed`]; without it a name is found by binary search.
    index: Option<HashMap<&'s str, usize>>,
    /// Per host: its `(min, max)` eligible leases (`(0, usize::MAX)` without limits).
    bounds: Vec<(usize, usize)>,
}

impl<'s> Fleet<'s> {
    fn new(live_hosts: &'s [HostName], strategy: &EqualShare) -> Self {
        let mut hosts: Vec<&HostName> = live_hosts.iter().collect();
        hosts.sort_unstable();
        hosts.dedup();
        let bounds = hosts
            .iter()
            .map(|h| strategy.limits_of(h).bounds())
            .collect();
        Self {
            hosts,
            index: None,
            bounds,
        }
    }

    /// With a name → index map, for callers that look up a name per lease.
    fn indexed(mut self) -> Self {
        self.index = Some(
            self.hosts
                .iter()
                .enumerate()
                .map(|(i, h)| (h.as_str(), i))
                .collect(),
        );
        self
    }

    fn index_of(&self, host: &HostName) -> Option<usize> {
        match &self.index {
            Some(index) => index.get(host.as_str()).copied(),
            None => self.hosts.binary_search(&host).ok(),
        }
    }

    /// Looks up names given in ascending order (an `OrdMap`'s keys) in one pass over the
    /// hosts, instead of a search each.
    fn in_order(&self) -> InOrder<'_, 's> {
        InOrder {
            hosts: &self.hosts,
            at: 0,
        }
    }
}

/// [`Fleet::in_order`]: a cursor over the fleet's hosts.
struct InOrder<'f, 's> {
    hosts: &'f [&'s HostName],
    at: usize,
}

impl InOrder<'_, '_> {
    /// `host`'s index, for a `host` not below any name asked before.
    fn index_of(&mut self, host: &HostName) -> Option<usize> {
        while self.hosts.get(self.at).is_some_and(|h| *h < host) {
            self.at += 1;
        }
        (self.hosts.get(self.at) == Some(&host)).then_some(self.at)
    }
}

/// How the balancer classifies one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// Ineligible: never taken, counts for nobody.
    Ignored,
    /// Eligible with no live owner. `asker`: the live host in its `next_owner`, if any.
    Free { asker: Option<usize> },
    /// Eligible and owned by a live host. `pending`: the live host (other than the owner) that
    /// asked for it by hand-off, if any.
    Held {
        owner: usize,
        pending: Option<usize>,
    },
}

/// One pass over the leases: each lease's status, and every host's shares.
struct Tally {
    status: Vec<Status>,
    shares: Shares,
}

impl Tally {
    fn new(fleet: &Fleet<'_>, leases: &[LeaseView<'_>]) -> Self {
        let hosts = fleet.hosts.len();
        let mut owned = vec![0usize; hosts];
        let mut incoming = vec![0usize; hosts];
        let mut outgoing = vec![0usize; hosts];
        let mut claimed = vec![0usize; hosts];
        let mut eligible = 0usize;
        // Leases are mostly held in runs by one owner, whose name they share: remember the
        // last name looked up and skip hashing it again.
        let mut last: Option<(&HostName, Option<usize>)> = None;
        let status: Vec<Status> = leases
            .iter()
            .map(|view| {
                let lease = view.lease;
                if !view.eligible || lease.state == LeaseState::Finished {
                    return Status::Ignored;
                }
                eligible += 1;
                let owner = match (lease.state, &lease.owner) {
                    (LeaseState::Owned, Some(o)) => match last {
                        Some((name, index)) if name.same_allocation(o) => index,
                        _ => {
                            let index = fleet.index_of(o);
                            last = Some((o, index));
                            index
                        }
                    },
                    _ => None,
                };
                let asker = lease.next_owner.as_ref().and_then(|n| fleet.index_of(n));
                match owner {
                    None => {
                        if let Some(a) = asker {
                            claimed[a] += 1;
                        }
                        Status::Free { asker }
                    }
                    Some(owner) => {
                        owned[owner] += 1;
                        let pending = asker.filter(|&a| a != owner);
                        if let Some(a) = pending {
                            outgoing[owner] += 1;
                            incoming[a] += 1;
                        }
                        Status::Held { owner, pending }
                    }
                }
            })
            .collect();
        let shares = Shares::new(fleet, eligible, &owned, &outgoing, &incoming, &claimed);
        Self { status, shares }
    }
}

/// Every live host's counts and quota.
struct Shares {
    /// Per host: eligible leases owned, minus pending hand-offs out, plus pending hand-offs in.
    /// (The quota ranking also counts the free leases a host asked for; see [`super::quotas`].)
    effective: Vec<usize>,
    /// Per host: eligible leases owned with no pending hand-off to a live host.
    requestable: Vec<usize>,
    /// Per host: its quota.
    quota: Vec<usize>,
}

impl Shares {
    /// The shares of `eligible` leases, from each host's eligible leases `owned`, hand-offs
    /// pending from it (`outgoing`) and to it (`incoming`), and free leases it asked for
    /// (`claimed`).
    fn new(
        fleet: &Fleet<'_>,
        eligible: usize,
        owned: &[usize],
        outgoing: &[usize],
        incoming: &[usize],
        claimed: &[usize],
    ) -> Self {
        let hosts = fleet.hosts.len();
        let effective: Vec<usize> = (0..hosts)
            .map(|h| owned[h] - outgoing[h] + incoming[h])
            .collect();
        let requestable = (0..hosts).map(|h| owned[h] - outgoing[h]).collect();
        // Ties go to the hosts holding most (counting the free leases they asked for), then
        // by name: see `super::quotas`.
        let mut keyed: Vec<(Reverse<usize>, usize)> = (0..hosts)
            .map(|h| (Reverse(effective[h] + claimed[h]), h))
            .collect();
        keyed.sort_unstable();
        let rank: Vec<usize> = keyed.into_iter().map(|(_, h)| h).collect();
        let quota = share(eligible, &rank, &fleet.bounds);
        Self {
            effective,
            requestable,
            quota,
        }
    }

    /// Every host's shortfall, after pending hand-offs.
    fn need(&self) -> Vec<usize> {
        self.quota
            .iter()
            .zip(&self.effective)
            .map(|(q, e)| q.saturating_sub(*e))
            .collect()
    }
}
