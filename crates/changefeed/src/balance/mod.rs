//! Balancing: which leases this host should take, ask for, steal or give up, as a pure function
//! of one snapshot of the lease table and the live fleet.
//!
//! This module owns the decision and nothing else. It does no I/O, reads no clock and draws no
//! random numbers: the processor (the shell) reads the leases and heartbeats, judges which
//! hosts are live and which hand-off requests are overdue on its own clock, builds a
//! [`Snapshot`], calls a [`BalanceStrategy`], and applies the returned [`Plan`] through the
//! lease store, each action a compare-and-swap on the version it saw. A lost CAS is not an
//! error here: the next cycle plans again from a fresh snapshot.
//!
//! [`EqualShare`] is the default strategy (`DESIGN.md`, "Balancing"), optionally within
//! [`LeaseLimits`] (the fewest and most leases per host); [`quotas`] and
//! [`EqualShare::quotas`] expose its share computation for the CLI, tests and the simulator. [`KclLike`] and [`CosmosLike`]
//! implement the published lease-taking rules of the Kinesis Client Library and the Cosmos DB
//! change feed processor (bulk takes of expired leases, one steal per cycle), as baselines for
//! the simulator and for users who want that behaviour. [`LoadShare`] balances measured load
//! (a [`LoadInput`] given to [`BalanceStrategy::plan_with_load`]) against host capacity, with
//! hysteresis, and is [`EqualShare`] where no load is known. [`Kcl3Like`] models KCL 3.x's
//! leader-driven assignment (free leases to the least-loaded hosts, then over-loaded hosts hand
//! leases to under-loaded ones), with each host's plan being the leader's decisions that name it.
//!
//! ```
//! use changefeed::balance::{BalanceStrategy, EqualShare, LeaseView, Snapshot};
//! use changefeed::model::{GroupName, HostName, Lease, LeaseKey, PartitionId, Position};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let group = GroupName::new("orders")?;
//! let leases: Vec<Lease> = (0..4)
//!     .map(|p| Ok(Lease::new(LeaseKey::new(group.clone(), PartitionId::new(p.to_string())?), Position::Beginning)))
//!     .collect::<Result<_, changefeed::ModelError>>()?;
//! let views: Vec<LeaseView<'_>> = leases.iter().map(LeaseView::new).collect();
//! let hosts = [HostName::new("a")?, HostName::new("b")?];
//! let plan = EqualShare::default().plan(&Snapshot { me: &hosts[0], live_hosts: &hosts, leases: &views });
//! // Four free leases, two hosts: "a" takes its two, and leaves the other two to "b".
//! assert_eq!(plan.take.len(), 2);
//! assert!(plan.request_handoff.is_empty() && plan.steal.is_empty() && plan.release.is_empty());
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{HostName, Lease, PartitionId};

mod census;
mod cosmos;
mod equal_share;
mod kcl;
mod kcl3;
mod limits;
mod load_share;
#[cfg(test)]
mod tests;

pub(crate) use census::holder;
pub use census::{Census, CensusSnapshot};
pub use cosmos::CosmosLike;
pub use equal_share::EqualShare;
pub use kcl::KclLike;
pub use kcl3::Kcl3Like;
pub use limits::{LeaseLimits, LimitsError};
#[cfg(test)]
use load_share::Move;
pub use load_share::{LoadInput, LoadShare};

/// The lease property a custom strategy may read as a per-lease weight (see
/// [`LeaseView::weight`]).
pub const WEIGHT_PROPERTY: &str = "weight";

/// One lease as a balancer sees it: the stored row plus what the shell judged about it.
#[derive(Debug, Clone, Copy)]
pub struct LeaseView<'a> {
    /// The lease as stored: owner, next owner, state and properties.
    pub lease: &'a Lease,
    /// Whether the lease may be read now. False for finished leases and for children whose
    /// parents are not all finished (`DESIGN.md` rule 5). Ineligible leases are never taken and
    /// do not count toward any host's quota.
    pub eligible: bool,
    /// The shell has seen `lease.next_owner == me` unchanged for longer than the hand-off
    /// timeout, on its own monotonic clock: the owner did not honour the request, so the asker
    /// may steal it.
    pub handoff_overdue: bool,
}

impl<'a> LeaseView<'a> {
    /// A view of `lease` that is eligible exactly when it is not finished, with no overdue
    /// hand-off. Handy for tests and tools; the processor sets the flags itself.
    pub fn new(lease: &'a Lease) -> Self {
        Self {
            lease,
            eligible: lease.state != crate::model::LeaseState::Finished,
            handoff_overdue: false,
        }
    }

    /// The lease's weight for strategies that balance load rather than lease counts: the
    /// [`WEIGHT_PROPERTY`] property read as a positive integer. Missing, zero, negative or
    /// unparsable values count as 1, so a typo never makes a lease weightless.
    ///
    /// [`EqualShare`] does not use weights: it balances the number of eligible leases.
    pub fn weight(&self) -> u64 {
        self.lease
            .properties
            .get(WEIGHT_PROPERTY)
            .and_then(|w| w.trim().parse::<u64>().ok())
            .filter(|&w| w > 0)
            .unwrap_or(1)
    }
}

/// Everything a strategy may look at: who is asking, who is alive, and the lease table.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// The host the plan is for.
    pub me: &'a HostName,
    /// The hosts with a live heartbeat, sorted, including `me`. Hosts owning zero leases count.
    /// A lease whose owner is not listed here belongs to a dead host and is free to take.
    pub live_hosts: &'a [HostName],
    /// Every lease of the group.
    pub leases: &'a [LeaseView<'a>],
}

/// A request that `from` hand a lease over to the asking host.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct HandoffRequest {
    /// The lease's partition.
    pub partition: PartitionId,
    /// Its current owner, a live host over its quota.
    pub from: HostName,
}

/// What one host should do this cycle. Each list is sorted by partition, and no partition
/// appears twice in a plan.
///
/// The shell applies each action as a compare-and-swap on the version in the snapshot; one
/// that loses is simply dropped until the next cycle.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Free leases to take now: available, or owned by a host not in `live_hosts`. Write
    /// `owner = me`, `state = owned`, `next_owner = None`.
    pub take: Vec<PartitionId>,
    /// Leases a live host over its quota owns: write `next_owner = me`. The owner hands the
    /// lease over at its next checkpoint (`owner = next_owner` in the same write).
    pub request_handoff: Vec<HandoffRequest>,
    /// Leases whose hand-off to this host is overdue (`next_owner == me` and
    /// [`LeaseView::handoff_overdue`]): take by CAS on the owner, as the fallback when the
    /// owner did not honour the request.
    pub steal: Vec<PartitionId>,
    /// Leases this host owns and should give up: clear the owner, keep the continuation.
    pub release: Vec<PartitionId>,
}

impl Plan {
    /// Sorts each list by partition, as a plan's lists must be.
    pub fn sort(&mut self) {
        self.take.sort_unstable();
        self.steal.sort_unstable();
        self.request_handoff.sort_unstable();
        self.release.sort_unstable();
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.take.is_empty()
            && self.request_handoff.is_empty()
            && self.steal.is_empty()
            && self.release.is_empty()
    }
}

/// A balancing strategy: a pure function from a snapshot to one host's plan.
///
/// # Contract
///
/// Implementors must:
/// - be deterministic: the same snapshot gives the same plan, with no clock, I/O or randomness
///   (a strategy that wants randomness takes a seed in its constructor);
/// - never put a lease owned by a live host in `take`; reach such a lease only through
///   `request_handoff`, or through `steal` when its `next_owner` is `me` and the hand-off is
///   overdue;
/// - never plan to take or steal an ineligible lease;
/// - put only leases `me` owns in `release`, and never name a partition twice in one plan.
///
/// Callers (the processor) must give every host the same view rules: `live_hosts` is the set
/// of hosts whose heartbeat is judged live, sorted; a lease whose owner is not in it is free.
pub trait BalanceStrategy: Send + Sync + std::fmt::Debug {
    /// The plan for `snapshot.me`.
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan;

    /// The plan for `snapshot.me` from a [`Census`] kept up to date by the caller, if this
    /// strategy can plan from one: it must then be exactly the plan [`BalanceStrategy::plan`]
    /// gives on the equivalent snapshot (every lease of the group, the census's leases
    /// eligible and the others not, leases held by hosts neither live nor dead ineligible too).
    /// [`EqualShare`] can, in O(changed leases + hosts) per plan rather than O(leases); the
    /// default returns `None`, and the caller then builds a [`Snapshot`].
    fn plan_census(&self, snapshot: &CensusSnapshot<'_>) -> Option<Plan> {
        let _ = snapshot;
        None
    }

    /// The plan for `snapshot.me` knowing the measured `load` of leases and the capacity of
    /// hosts ([`LoadInput`]), with the same contract as [`BalanceStrategy::plan`]. Strategies
    /// that balance counts ignore the load: the default is [`BalanceStrategy::plan`].
    /// [`LoadShare`] uses it.
    fn plan_with_load(&self, snapshot: &Snapshot<'_>, load: &LoadInput<'_>) -> Plan {
        let _ = load;
        self.plan(snapshot)
    }

    /// Whether this strategy plans by measured load: the processor then reads every host's
    /// heartbeat report each cycle (one membership read per host per cycle, where a count
    /// strategy reads the membership view alone) and calls
    /// [`BalanceStrategy::plan_with_load`]. Default `false`; [`LoadShare`] says `true`.
    fn wants_load(&self) -> bool {
        false
    }

    /// This strategy with the lease limits hosts publish with their heartbeats (each host's
    /// own `min_leases` and `max_leases`, [`crate::model::HostReport`]), which take the place
    /// of any limits it gives those hosts; `None` if it applies no per-host limits (the
    /// default). [`EqualShare`] applies them. Every host reads the same published limits, so
    /// every host still plans for every host alike.
    fn with_published_limits(
        &self,
        limits: &BTreeMap<HostName, LeaseLimits>,
    ) -> Option<std::sync::Arc<dyn BalanceStrategy>> {
        let _ = limits;
        None
    }
}

/// Every live host's share of the eligible leases under [`EqualShare`] without limits.
///
/// With `E` eligible leases and `H` live hosts each host gets `E / H`, and the `E % H` extra
/// leases go to the hosts that currently hold the most eligible leases, ties broken by host
/// name, so every host computes the same quotas and the fewest leases move. A host "holds" the
/// eligible leases it owns, minus those it was asked to hand to another live host, plus those
/// it asked for (as `next_owner`) whose owner is live or dead: pending hand-offs count as done,
/// so the quotas do not shift while they complete.
///
/// Duplicate host names count once. Empty `live_hosts` gives an empty map. With limits, see
/// [`EqualShare::quotas`].
pub fn quotas(live_hosts: &[HostName], leases: &[LeaseView<'_>]) -> BTreeMap<HostName, usize> {
    EqualShare::default().quotas(live_hosts, leases)
}
