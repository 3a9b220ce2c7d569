//! The pure decisions over the table: the live hosts and the leader, dead hosts' rows, the
//! hand-off requests this host waits on ([`Requests`]), the plan built from them ([`plan`]),
//! and what a conflicting take or hand-off request leads to.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use crate::balance::{
    holder, BalanceStrategy, CensusSnapshot, LeaseView, LoadInput, Plan, Snapshot,
};
use crate::clock::Instant;
use crate::lineage::ParentsRule;
use crate::model::{Heartbeat, HostName, Lease, PartitionId};

use super::table::LeaseTable;

/// The live hosts from `liveness_live` (those whose heartbeat moved within the expiry),
/// with this host always counted: it is alive by definition while it runs.
pub(crate) fn live_hosts(mut live: Vec<HostName>, me: &HostName) -> Vec<HostName> {
    if !live.contains(me) {
        live.push(me.clone());
        live.sort();
    }
    live
}

/// Whether `me` leads the fleet: the first live host by name (two hosts that both believe
/// they lead are harmless: every leader write is create-if-absent or a CAS).
pub(crate) fn leads(me: &HostName, live: &[HostName]) -> bool {
    live.iter().min() == Some(me)
}

/// The heartbeat rows the leader removes: hosts judged dead that own no listed lease any
/// more (a newcomer would otherwise count them as owed a share).
pub(crate) fn dead_rows<'a>(
    hosts: &'a [Heartbeat],
    live: &[HostName],
    table: &LeaseTable,
) -> Vec<&'a Heartbeat> {
    hosts
        .iter()
        .filter(|hb| !live.contains(&hb.host) && !table.owns_any(&hb.host))
        .collect()
}

/// The hand-off requests this host has made and waits on: when it first saw each, on its
/// own clock.
#[derive(Debug, Clone, Default)]
pub(crate) struct Requests {
    asked_at: BTreeMap<PartitionId, Instant>,
}

impl Requests {
    /// A request for `partition` was written and returned at `at`.
    pub(crate) fn written(&mut self, partition: PartitionId, at: Instant) {
        self.asked_at.insert(partition, at);
    }

    /// The lease was taken (no longer waited on).
    pub(crate) fn taken(&mut self, partition: &PartitionId) {
        self.asked_at.remove(partition);
    }

    /// Whether any request is pending (then time alone can change the plan).
    pub(crate) fn any(&self) -> bool {
        !self.asked_at.is_empty()
    }

    /// Keeps only the requests the table still shows (`asked`), timing those it shows for the
    /// first time from `seen` (no earlier than the list that showed them: a request of ours
    /// whose reply was lost landed before that list returned).
    pub(crate) fn sync(&mut self, asked: &BTreeSet<PartitionId>, seen: Instant) {
        self.asked_at.retain(|p, _| asked.contains(p));
        for p in asked {
            self.asked_at.entry(p.clone()).or_insert(seen);
        }
    }

    /// Whether the request for `partition` has waited `timeout` at `now`.
    pub(crate) fn overdue(&self, partition: &PartitionId, now: Instant, timeout: Duration) -> bool {
        self.asked_at
            .get(partition)
            .is_some_and(|at| now.saturating_duration_since(*at) >= timeout)
    }
}

/// What [`plan`] needs to know.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanInput<'a> {
    pub me: &'a HostName,
    pub live: &'a [HostName],
    /// The hosts judged dead, whose leases are free. `None`: every owner not in `live` is
    /// dead (judged from the heartbeats by this host). With `Some` (a membership view), an
    /// owner neither live nor dead is unknown: its leases are neither free nor counted in any
    /// quota, as if they were ineligible.
    pub dead: Option<&'a BTreeSet<HostName>>,
    pub table: &'a LeaseTable,
    pub requests: &'a Requests,
    /// Now, on this host's clock.
    pub now: Instant,
    /// When this host registered.
    pub registered_at: Instant,
    pub handoff_timeout: Duration,
    /// The start-up grace: hand-off requests wait this long after registering, so that hosts
    /// started together see each other before computing shares (otherwise the first to run
    /// would ask for a share of a smaller fleet, and leases would move twice).
    pub grace: Duration,
    pub parents: ParentsRule,
    /// The measured loads, for a strategy that plans by them
    /// ([`BalanceStrategy::wants_load`]).
    pub load: Option<&'a LoadInput<'a>>,
}

/// The strategy's plan over the table, with hand-offs marked overdue after the timeout and
/// requests held back during the start-up grace. Returns the plan and whether something was
/// held back (then plan again next cycle even if nothing changes).
///
/// A strategy that plans from the table's census ([`BalanceStrategy::plan_census`], the
/// default [`crate::balance::EqualShare`]) costs O(changed leases + hosts); any other gets a
/// snapshot of every lease ([`snapshot_plan`]).
pub(crate) fn plan(input: &PlanInput<'_>, strategy: &dyn BalanceStrategy) -> (Plan, bool) {
    let overdue = |partition: &PartitionId| {
        input
            .requests
            .overdue(partition, input.now, input.handoff_timeout)
    };
    let census = CensusSnapshot {
        me: input.me,
        live_hosts: input.live,
        dead_hosts: input.dead,
        census: input.table.census(),
        handoff_overdue: &overdue,
    };
    let by_census = if input.load.is_some() {
        None
    } else {
        strategy.plan_census(&census)
    };
    let mut plan = by_census.unwrap_or_else(|| snapshot_plan(input, strategy));
    let in_grace = input.now.saturating_duration_since(input.registered_at) < input.grace;
    let held = in_grace && !plan.request_handoff.is_empty();
    if held {
        plan.request_handoff.clear();
    }
    (plan, held)
}

/// The strategy's plan over a snapshot of every listed lease: eligible by the parents rule,
/// except leases whose owner is unknown (neither live nor dead, see [`PlanInput::dead`]).
pub(crate) fn snapshot_plan(input: &PlanInput<'_>, strategy: &dyn BalanceStrategy) -> Plan {
    let live: HashSet<&HostName> = input.live.iter().collect();
    let unknown = |lease: &Lease| {
        input.dead.is_some_and(|dead| {
            holder(lease).is_some_and(|owner| !live.contains(owner) && !dead.contains(owner))
        })
    };
    let rows = input.table.rows();
    let views: Vec<LeaseView<'_>> = rows
        .iter()
        .map(|lease| LeaseView {
            lease,
            eligible: input.table.eligible(lease, input.parents) && !unknown(lease),
            handoff_overdue: input.requests.overdue(
                &lease.key.partition,
                input.now,
                input.handoff_timeout,
            ),
        })
        .collect();
    let snapshot = Snapshot {
        me: input.me,
        live_hosts: input.live,
        leases: &views,
    };
    match input.load {
        Some(load) => strategy.plan_with_load(&snapshot, load),
        None => strategy.plan(&snapshot),
    }
}

/// Whether a hand-off request for `lease` from `owner` may be written now: the lease is still
/// owned by `owner`, and no request from another live host is pending (a request naming a
/// dead host is stale and may be overwritten).
pub(crate) fn may_request(lease: &Lease, owner: &HostName, live: &[HostName]) -> bool {
    let pending = lease
        .next_owner
        .as_ref()
        .is_some_and(|n| n != owner && live.contains(n));
    lease.is_owned_by(owner) && !pending
}

/// What to do with a take that conflicted with the store's `current` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TakeConflict {
    /// Only the checkpoint moved since the row was listed (its owner wrote one before it
    /// died): take it again at the current version once a fresh membership read still shows
    /// the owner dead.
    RetryAfterMembership,
    /// Ownership changed: keep the current row and plan again next cycle.
    Replan,
}

/// Decides what a conflicting take (`steal`: of an unhonoured hand-off) leads to.
pub(crate) fn on_take_conflict(listed: &Lease, current: &Lease, steal: bool) -> TakeConflict {
    if !steal && !current.ownership_differs(listed) {
        TakeConflict::RetryAfterMembership
    } else {
        TakeConflict::Replan
    }
}

/// Whether a take retried after a conflict may go ahead: its owner is still judged dead by a
/// membership read made after the conflict, and no worker of an earlier ownership of this
/// host still runs on it.
pub(crate) fn may_retry_take(row: &Lease, live: &[HostName], worker_running: bool) -> bool {
    !row.owner.as_ref().is_some_and(|o| live.contains(o)) && !worker_running
}
