//! The host's decisions, pure: [`HostState`]. No I/O, no clock reads, no async: time comes in
//! as an argument, in the style of raft-rs's `RawNode` (`Ready`/`advance`).
//!
//! The shell ([`super::host`]) reads the store and feeds what it read in here; asks what to
//! read next and what to do ([`HostState::next_read`], [`HostState::actions`]); carries the
//! actions out (store calls, starting workers) and feeds each outcome back
//! ([`HostState::took`], [`HostState::take_conflict`], …). Whatever the workers must be told
//! as a result (a newer row of their lease, or to stop) collects in an outbox the shell drains
//! after each step ([`HostState::signals`]).
//!
//! What it owns: the lease table and the version each running worker knows; the liveness
//! view and the live hosts judged from it; the listing state; the hand-off requests this host
//! waits on; its registration time; and whether the last plan was cut short.

mod table;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use table::*;

use super::heartbeat::Liveness;
use crate::balance::{BalanceStrategy, HandoffRequest};
use crate::clock::Instant;
use crate::lineage::ParentsRule;
use crate::model::{Heartbeat, HostName, Lease, LeaseState, Membership, PartitionId, Version};

/// Why a lease is taken: free or expired (a take), or an unhonoured hand-off (a steal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TakeKind {
    Take,
    Steal,
}

impl TakeKind {
    /// The counter a take of this kind increments.
    pub(crate) fn metric(self) -> &'static str {
        match self {
            TakeKind::Take => "changefeed_leases_taken_total",
            TakeKind::Steal => "changefeed_leases_stolen_total",
        }
    }
}

impl fmt::Display for TakeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TakeKind::Take => "take",
            TakeKind::Steal => "steal",
        })
    }
}

/// What a running worker must be told, in the order it was decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Signal {
    /// A newer row of its lease than it knows (a hand-off request, or a new owner).
    Hint(Lease),
    /// Stop: its lease was deleted, or the plan releases it.
    Stop(PartitionId),
}

/// The settings the host's decisions depend on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateConfig {
    pub lease_expiry: Duration,
    pub full_list_interval: Duration,
    pub handoff_timeout: Duration,
    /// The start-up grace (see [`PlanInput::grace`]).
    pub grace: Duration,
    pub parents: ParentsRule,
}

/// What the plan asks of this host now, to carry out in this order.
#[derive(Debug, Default)]
pub(crate) struct Actions {
    /// Leases to take by CAS at the listed version.
    pub takes: Vec<(Lease, TakeKind)>,
    /// Hand-off requests to write (see [`HostState::request_row`]).
    pub requests: Vec<HandoffRequest>,
    /// Leases to give up: their workers stop (after the takes and requests).
    pub releases: Vec<PartitionId>,
}

/// The host's state and decisions.
#[derive(Debug)]
pub(crate) struct HostState {
    me: HostName,
    config: StateConfig,
    table: LeaseTable,
    /// The version of its lease each running worker knows.
    running: BTreeMap<PartitionId, Version>,
    liveness: Liveness,
    /// The live hosts judged at the last membership read, this host included.
    live: Vec<HostName>,
    listing: Listing,
    requests: Requests,
    registered_at: Instant,
    /// Set when a plan was cut short or an outcome asks for another look: plan again next
    /// cycle even if nothing changed.
    replan: bool,
    /// Set when a lease became finished and no partition sync has succeeded since: the leader
    /// syncs in its next cycle, so the children get leases within an acquire interval of
    /// their parents' end instead of up to `sync_interval` later.
    sync_wanted: bool,
    outbox: Vec<Signal>,
}

impl HostState {
    /// The state of a host that registered at `now`.
    pub(crate) fn new(me: HostName, config: StateConfig, now: Instant) -> Self {
        Self {
            table: LeaseTable::new(me.clone(), config.parents),
            live: vec![me.clone()],
            me,
            config,
            running: BTreeMap::new(),
            liveness: Liveness::default(),
            listing: Listing::default(),
            requests: Requests::default(),
            registered_at: now,
            replan: false,
            sync_wanted: false,
            outbox: Vec::new(),
        }
    }

    /// What the workers must be told since the last call, in order.
    pub(crate) fn signals(&mut self) -> Vec<Signal> {
        std::mem::take(&mut self.outbox)
    }

    // --- membership and listing ----------------------------------------------------------

    /// Takes in a membership read that returned at `now`, and judges the live hosts from it.
    pub(crate) fn observe(&mut self, membership: &Membership, now: Instant) {
        self.liveness.observe(membership, now);
        self.live = live_hosts(self.liveness.live(now, self.config.lease_expiry), &self.me);
    }

    /// Whether this host leads the fleet (see [`leads`]).
    pub(crate) fn leads(&self) -> bool {
        leads(&self.me, &self.live)
    }

    /// What to read after a membership read at `now` showing `counter`.
    pub(crate) fn next_read(&self, counter: u64, now: Instant) -> Read {
        self.listing
            .next_read(counter, &self.live, now, self.config.full_list_interval)
    }

    /// The change counter the table is at, if it is trusted (the base of a list of changes).
    pub(crate) fn listed_counter(&self) -> Option<u64> {
        self.listing.counter
    }

    /// Takes in a full listing. Workers whose lease is gone from it are told to stop, unless
    /// `unreadable` says its row is only unreadable.
    pub(crate) fn listed_all(
        &mut self,
        leases: Vec<impl Into<Arc<Lease>>>,
        unreadable: impl Fn(&PartitionId) -> bool,
    ) {
        self.table.replace_all(leases);
        let gone: Vec<PartitionId> = self
            .running
            .keys()
            .filter(|p| self.table.get(p).is_none() && !unreadable(p))
            .cloned()
            .collect();
        self.outbox.extend(gone.into_iter().map(Signal::Stop));
    }

    /// Takes in a list of changes: rows deleted (their workers stop) and rows newer than the
    /// cached ones (their workers are told).
    pub(crate) fn listed_changes(
        &mut self,
        deleted: &[PartitionId],
        leases: Vec<impl Into<Arc<Lease>>>,
    ) {
        for partition in deleted {
            self.table.remove(partition);
            if self.running.contains_key(partition) {
                self.outbox.push(Signal::Stop(partition.clone()));
            }
        }
        for lease in leases {
            self.remember(lease);
        }
    }

    /// Tells each worker of a newer row after a full listing (rows taken in one by one were
    /// told as they came), in partition order.
    pub(crate) fn hint_all(&mut self) {
        if !self.table.take_hint_all() {
            return;
        }
        for (partition, known) in &mut self.running {
            if let Some(row) = self.table.get(partition) {
                if row.version > *known {
                    *known = row.version;
                    self.outbox.push(Signal::Hint(row.clone()));
                }
            }
        }
    }

    /// A read chosen by [`HostState::next_read`] succeeded at `counter`, at `now`; the live
    /// hosts are judged from a membership read made after it.
    pub(crate) fn listed(&mut self, read: Read, counter: u64, now: Instant) {
        self.listing.listed(read, counter, &self.live, now);
    }

    /// The table can no longer be trusted at its counter: list again next cycle.
    pub(crate) fn invalidate(&mut self) {
        self.listing.invalidate();
    }

    /// A list of changes read after this host's own writes (the leader's partition sync) took
    /// the trusted table to `counter`.
    pub(crate) fn advanced(&mut self, counter: u64) {
        self.listing.advanced(counter);
    }

    /// Takes in a full listing made after this host's own writes (the leader's partition
    /// sync), and distrusts the counter: list again next cycle too.
    pub(crate) fn relisted(&mut self, leases: Vec<impl Into<Arc<Lease>>>) {
        self.table.replace_all(leases);
        self.listing.invalidate();
    }

    /// Every listed row, sorted by partition.
    pub(crate) fn rows(&self) -> &[Arc<Lease>] {
        self.table.rows()
    }

    /// Whether the partition sync should run now, before its interval: a lease became
    /// finished since the last successful sync (its children may need leases). Two hosts
    /// that both sync are harmless: lease creation is create-if-absent.
    pub(crate) fn sync_wanted(&mut self) -> bool {
        self.sync_wanted |= self.table.take_finished();
        self.sync_wanted
    }

    /// A partition sync succeeded, or this host does not lead (a host that comes to lead
    /// syncs at once anyway).
    pub(crate) fn synced(&mut self) {
        self.sync_wanted = false;
    }

    /// The heartbeat rows of dead hosts the leader may remove (see [`dead_rows`]).
    pub(crate) fn dead_rows<'a>(&self, hosts: &'a [Heartbeat]) -> Vec<&'a Heartbeat> {
        dead_rows(&self.me, hosts, &self.live, &self.table)
    }

    // --- planning --------------------------------------------------------------------------

    /// Whether to plan this cycle: something was listed or synced, a hand-off request is
    /// pending (time alone can make it overdue), or an outcome asked for another look.
    pub(crate) fn wants_plan(&self, changed: bool) -> bool {
        changed || self.requests.any() || self.replan
    }

    /// The cycle was cut short before planning: plan next cycle.
    pub(crate) fn defer(&mut self) {
        self.replan = true;
    }

    /// Planning begins: clears the replan flag (what follows sets it again if it wants another
    /// look) and tells each worker of a newer row from a full listing.
    pub(crate) fn begin_plan(&mut self) {
        self.replan = false;
        self.hint_all();
    }

    /// Leases the table says are ours but no worker runs (a restart under the same name, or a
    /// fence that was lowered): to claim again by CAS at their version.
    pub(crate) fn to_adopt(&self) -> Vec<Lease> {
        self.table.to_adopt(|p| self.running.contains_key(p))
    }

    /// A claim of an owned row (an adoption) or a take conflicted with `current`, or a take
    /// was refused: keep the current row and plan again next cycle.
    pub(crate) fn keep_and_replan(&mut self, current: Lease) {
        self.remember(current);
        self.replan = true;
    }

    /// The plan at `now`. Hand-off requests are timed from `seen` when the table shows them
    /// for the first time. Takes of partitions whose worker of an earlier ownership still runs
    /// wait (it could adopt the new row and write its stale position).
    pub(crate) fn actions(
        &mut self,
        now: Instant,
        seen: Instant,
        strategy: &dyn BalanceStrategy,
    ) -> Actions {
        self.requests.sync(self.table.asked(), seen);
        let (plan, held) = plan(
            &PlanInput {
                me: &self.me,
                live: &self.live,
                dead: None,
                table: &self.table,
                requests: &self.requests,
                now,
                registered_at: self.registered_at,
                handoff_timeout: self.config.handoff_timeout,
                grace: self.config.grace,
                parents: self.config.parents,
            },
            strategy,
        );
        self.replan |= held;
        let mut actions = Actions::default();
        let wanted = plan
            .take
            .iter()
            .map(|p| (p, TakeKind::Take))
            .chain(plan.steal.iter().map(|p| (p, TakeKind::Steal)));
        for (partition, kind) in wanted {
            let Some(lease) = self.table.get(partition) else {
                continue;
            };
            if self.running.contains_key(partition) {
                self.replan = true;
                continue;
            }
            actions.takes.push((lease.clone(), kind));
        }
        actions.requests = plan.request_handoff;
        actions.releases = plan.release;
        actions
    }

    /// The row `row` becomes when this host takes it.
    pub(crate) fn taken_row(&self, row: &Lease) -> Lease {
        let mut next = row.clone();
        next.state = LeaseState::Owned;
        next.owner = Some(self.me.clone());
        next.next_owner = None;
        next
    }

    /// A take stored `stored`: cache it (its worker starts next).
    pub(crate) fn took(&mut self, stored: Lease) {
        self.requests.taken(&stored.key.partition);
        self.remember(stored);
    }

    /// A take of `listed` conflicted with the store's `current` row. Returns the row to take
    /// again after a fresh membership read (see [`on_take_conflict`]); otherwise the current
    /// row is kept and the plan runs again next cycle.
    pub(crate) fn take_conflict(
        &mut self,
        listed: &Lease,
        current: Lease,
        kind: TakeKind,
    ) -> Option<Lease> {
        match on_take_conflict(listed, &current, kind == TakeKind::Steal) {
            TakeConflict::RetryAfterMembership => Some(current),
            TakeConflict::Replan => {
                self.keep_and_replan(current);
                None
            }
        }
    }

    /// The hosts judged live from a membership read that returned at `now`, made after a take
    /// conflicted (for [`HostState::retry_take`]).
    pub(crate) fn live_after_conflict(
        &mut self,
        membership: &Membership,
        now: Instant,
    ) -> Vec<HostName> {
        self.liveness.observe(membership, now);
        self.liveness.live(now, self.config.lease_expiry)
    }

    /// Whether a take retried after a conflict may go ahead, given the hosts `live` after it
    /// (see [`may_retry_take`]). If not, the row is kept and the plan runs again next cycle.
    pub(crate) fn retry_take(&mut self, row: &Lease, live: &[HostName]) -> bool {
        let ok = may_retry_take(row, live, self.running.contains_key(&row.key.partition));
        if !ok {
            self.keep_and_replan(row.clone());
        }
        ok
    }

    /// The row to write for `request` starting from `current` (the cached row at first, the
    /// store's after a conflict), if the request may still be written (see [`may_request`]).
    pub(crate) fn request_row(
        &self,
        request: &HandoffRequest,
        current: Option<&Lease>,
    ) -> Option<(Lease, Lease)> {
        let lease = current.or_else(|| self.table.get(&request.partition))?;
        if !may_request(lease, &request.from, &self.live) {
            return None;
        }
        let mut next = lease.clone();
        next.next_owner = Some(self.me.clone());
        Some((lease.clone(), next))
    }

    /// A hand-off request for `partition` was written and returned at `now`.
    pub(crate) fn requested(&mut self, partition: PartitionId, now: Instant) {
        self.requests.written(partition, now);
    }

    // --- workers ----------------------------------------------------------------------------

    /// A worker started on `lease`.
    pub(crate) fn worker_started(&mut self, lease: &Lease) {
        self.running
            .insert(lease.key.partition.clone(), lease.version);
    }

    /// The worker of `partition` exited. Whatever the reason, the lease changed hands or
    /// state: plan next cycle (a worker stopped by the fence left the lease ours, and
    /// [`HostState::to_adopt`] resumes it).
    pub(crate) fn worker_exited(&mut self, partition: &PartitionId) {
        self.running.remove(partition);
        self.replan = true;
    }

    /// How many workers run.
    pub(crate) fn running(&self) -> usize {
        self.running.len()
    }

    /// Puts a row newer than the cached one (or a new one) into the table, and tells its
    /// worker if it does not know it yet.
    fn remember(&mut self, lease: impl Into<Arc<Lease>>) {
        let Some(row) = self.table.remember(lease) else {
            return;
        };
        if let Some(known) = self.running.get_mut(&row.key.partition) {
            if row.version > *known {
                *known = row.version;
                self.outbox.push(Signal::Hint(row.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
