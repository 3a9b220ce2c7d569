//! The host's decisions, pure: [`HostState`]. No I/O, no clock reads, no async: time comes in
//! as an argument, in the style of raft-rs's `RawNode` (`tick`/`ready`/`advance`).
//!
//! The shell ([`super::host`]) starts each acquire cycle with [`HostState::tick`], then loops:
//! [`HostState::ready`] hands back the [`Effect`]s decided so far, in order, and at most one
//! [`Call`] (a store or source request); the shell carries out the effects, makes the call and
//! answers it with [`HostState::advance`]. No call: the cycle is over. Which reads, writes and
//! effects happen, and in what order, is decided here (`cycle`), and the ordering rules are
//! tested as properties of random runs (`tests/ordering.rs`).
//!
//! What it owns: the lease table and the version each running worker knows; the liveness
//! view and the live hosts judged from it; the listing state; the hand-off requests this host
//! waits on; its registration time; the leader's sync and lag-estimate schedule; the malformed
//! rows seen; and whether the last plan was cut short.

mod cycle;
mod decide;
mod liveness;
mod loads;
mod observer;
mod plan;
mod share;
mod step;
mod table;
mod view;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use decide::*;
pub use liveness::Liveness;
pub use observer::GroupObserver;
pub use share::TableShare;
pub(crate) use step::{Answer, Call, Effect, HeadRead, Now, Why};
pub(crate) use table::*;

use crate::balance::{BalanceStrategy, HandoffRequest};
use crate::clock::Instant;
use crate::lineage::ParentsRule;
use crate::model::{
    GroupHead, GroupName, Heartbeat, HostLimits, HostName, Lease, Membership, MembershipView,
    PartitionId, Version,
};

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

/// The settings the host's decisions depend on.
#[derive(Debug, Clone)]
pub(crate) struct StateConfig {
    pub lease_expiry: Duration,
    pub full_list_interval: Duration,
    pub handoff_timeout: Duration,
    /// The start-up grace (see [`PlanInput::grace`]).
    pub grace: Duration,
    /// Whether a host waits for a membership view to list it live before it takes (false
    /// only in the simulator's broken variant `no-admission`).
    pub admission: bool,
    pub parents: ParentsRule,
    pub acquire_interval: Duration,
    pub safety_margin: Duration,
    /// The store's limit on the fleet's head reads ([`MembershipStore::head_reads_per_second`]).
    ///
    /// [`MembershipStore::head_reads_per_second`]: crate::lease::MembershipStore::head_reads_per_second
    pub head_reads_per_second: Option<f64>,
    /// The lease tables this host shares with the other hosts of its process, if any.
    pub share: Option<TableShare>,
    /// How long after a renewal was sent the host is fenced (`lease_expiry − safety_margin`).
    pub fence_after: Duration,
    /// How often the leader syncs the partitions when nothing asks for it sooner.
    pub sync_interval: Duration,
    pub strategy: Arc<dyn BalanceStrategy>,
    /// The group, as malformed rows' keys name it.
    pub group: GroupName,
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
    /// This process's incarnation (its heartbeat row's), once registered.
    incarnation: Arc<str>,
    config: StateConfig,
    table: LeaseTable,
    /// The version of its lease each running worker knows.
    running: BTreeMap<PartitionId, Version>,
    /// The membership view and the heartbeats, as this host has read them.
    observer: GroupObserver,
    /// The live hosts judged at the last membership read, this host included.
    judged: Arc<[HostName]>,
    /// Whether the store keeps a membership view (its head read answered): then the view's
    /// judgment, not this host's, decides who is live and dead.
    views: bool,
    /// The live hosts the plan and the listing go by: `judged` without a view; with one, the
    /// view's live hosts.
    live: Arc<[HostName]>,
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
    outbox: Vec<Effect>,
    /// The cycle in progress, if any.
    cycle: Option<cycle::Cycle>,
    /// Keys of lease rows the store could not read, for the malformed-rows gauge.
    malformed: BTreeSet<String>,
    /// When the leader last ran the partition sync (`None`: not leading, or never).
    sync_at: Option<Instant>,
    /// When the leader last estimated the lag of the partitions no host reads.
    unowned_lag_at: Option<Instant>,
    /// The rows of the running workers' leases in the last full listing, as listed, until
    /// [`HostState::hint_all`] tells the workers of them.
    listed_rows: Vec<Arc<Lease>>,
    /// The others' reports: their lease limits, and loads for a strategy that plans by load.
    loads: loads::LoadView,
    /// The lease limits published when the strategy was last given them, and the strategy
    /// they gave (see [`HostState::planning_strategy`]).
    limited: Option<(BTreeMap<HostName, HostLimits>, Arc<dyn BalanceStrategy>)>,
}

impl HostState {
    /// The state of a host that registered at `now`.
    pub(crate) fn new(me: HostName, config: StateConfig, now: Instant) -> Self {
        Self {
            table: LeaseTable::new(me.clone(), config.parents, config.share.clone()),
            live: Arc::from([me.clone()]),
            judged: Arc::from([me.clone()]),
            views: false,
            incarnation: Arc::from(""),
            me,
            config,
            running: BTreeMap::new(),
            observer: GroupObserver::default(),
            listing: Listing::default(),
            requests: Requests::default(),
            registered_at: now,
            replan: false,
            sync_wanted: false,
            outbox: Vec::new(),
            listed_rows: Vec::new(),
            cycle: None,
            malformed: BTreeSet::new(),
            sync_at: None,
            unowned_lag_at: None,
            loads: loads::LoadView::new(now),
            limited: None,
        }
    }

    /// What the shell must carry out since the last call, in order.
    pub(crate) fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.outbox)
    }

    // --- membership and listing ----------------------------------------------------------

    /// This host registered with `incarnation`.
    pub(crate) fn registered_as(&mut self, incarnation: Arc<str>) {
        self.incarnation = incarnation;
    }

    /// Takes in a membership read sent at `sent` that returned at `returned`, and judges the
    /// live hosts from it.
    ///
    /// A version first seen counts from when the read returned, and the judgment is made as of
    /// when it was sent: the store read the rows somewhere in between, so a host is judged dead
    /// only if its row stood still for the expiry up to the earliest moment the read can have
    /// seen it. Judged as of the return instead, a slow read could show a row as it was before
    /// a renewal that landed while the reply travelled, and judge dead a host that had not
    /// fenced itself (its renewal was sent before its deadline).
    pub(crate) fn observe(&mut self, membership: &Membership, sent: Instant, returned: Instant) {
        self.observer.observe_heartbeats(membership, returned);
        self.loads.observe(membership);
        let judged_at = sent.min(returned);
        self.judged = live_hosts(
            self.observer
                .liveness
                .live(judged_at, self.config.lease_expiry),
            &self.me,
        )
        .into();
        if !self.by_view(returned) {
            self.live = self.judged.clone();
        }
    }

    /// Whether the view's judgment decides who is live and dead: there is one, and a leader
    /// keeps it. Without a view, or while the fleet elects a new leader, this host reads every
    /// heartbeat and goes by its own judgment, which is sound on its own (an owner registers
    /// before it takes, and this host's read after the list sees its row).
    fn by_view(&self, now: Instant) -> bool {
        self.views
            && !self
                .observer
                .members
                .leaderless(now, self.config.lease_expiry)
    }

    /// Takes in a head read (the change counter and the membership view) that returned at
    /// `now`. The leader's heartbeat copied into the view counts as an observation of it, so
    /// a host that has to judge the leader itself (the view went stale) can do so at once.
    pub(crate) fn observe_head(&mut self, head: &GroupHead, now: Instant) {
        self.views = true;
        self.observer.observe_view(head.view.as_ref(), now);
        self.live = if self.by_view(now) {
            self.observer.members.live_shared()
        } else {
            self.judged.clone()
        };
    }

    /// Whether this cycle must read every heartbeat: always without a view; with one, when
    /// this host leads, or when there is no view or it went stale (a new leader is needed, and
    /// the first live host by this host's own judgment becomes it).
    pub(crate) fn needs_heartbeats(&self, now: Instant) -> bool {
        !self.views
            || self
                .observer
                .members
                .leaderless(now, self.config.lease_expiry)
            || self.observer.members.led_by(&self.me, &self.incarnation)
            || !self.admitted()
            || self.config.strategy.wants_load()
    }

    /// The view to write after a membership read at `now`, with the version to write it at,
    /// if this host leads (or should: no fresh view, and it is the first live host by its own
    /// judgment) and the view would change or its beat is due. The table's owners were listed
    /// before that membership read, and the version was read before it: see
    /// `docs/protocol.md`.
    pub(crate) fn view_to_write(
        &self,
        membership: &Membership,
        now: Instant,
    ) -> Option<(MembershipView, u64)> {
        if !self.views {
            return None;
        }
        let elected = self
            .observer
            .members
            .leaderless(now, self.config.lease_expiry)
            || self.observer.members.leader_gone(&membership.hosts);
        // A stale view's leader is not a candidate in the same incarnation: if it still
        // lives, it renews its heartbeat but does not keep the view (see
        // `heartbeat::ViewLink`). Started again, it is a new process and may lead again.
        let failed_leader = self.observer.members.view().and_then(|v| {
            membership
                .hosts
                .iter()
                .any(|hb| hb.host == v.leader && hb.incarnation == v.leader_incarnation)
                .then_some(&v.leader)
        });
        let candidates: Vec<HostName> = self
            .judged
            .iter()
            .filter(|h| Some(*h) != failed_leader)
            .cloned()
            .collect();
        let leading = self.observer.members.led_by(&self.me, &self.incarnation)
            || (elected && leads(&self.me, &candidates));
        if !leading {
            return None;
        }
        let my_row = membership
            .hosts
            .iter()
            .find(|hb| hb.host == self.me && hb.incarnation == self.incarnation)?;
        let owners = self.table.owners();
        let judged = view::judge(
            &self.me,
            my_row,
            &membership.hosts,
            &self.judged,
            &owners,
            |h| self.loads.limits_of(h),
        );
        self.observer
            .members
            .should_write(&judged)
            .then(|| (judged, self.observer.members.version()))
    }

    /// Whether `view` judges as the view last read does.
    pub(crate) fn same_view(&self, view: &MembershipView) -> bool {
        self.observer
            .members
            .view()
            .is_some_and(|v| v.same_judgment(view))
    }

    /// The last view to write when this host stops gracefully, if it leads (see
    /// [`Members::abdication`]).
    pub(crate) fn abdication(&self) -> Option<(MembershipView, u64)> {
        if self.views && self.leads() {
            self.observer.members.abdication()
        } else {
            None
        }
    }

    /// This host stored `view` at `now`.
    pub(crate) fn view_written(&mut self, view: MembershipView, now: Instant) {
        self.observer.members.wrote(view, now);
        self.live = self.observer.members.live_shared();
    }

    /// A view write conflicted with `current`, read at `now`: another host leads.
    pub(crate) fn view_conflict(&mut self, current: Option<&MembershipView>, now: Instant) {
        self.observer.members.observe(current, now);
        if self.by_view(now) {
            self.live = self.observer.members.live_shared();
        }
    }

    /// Whether this host may take and ask for leases: always without a view; with one, once
    /// the view lists it live in this incarnation (until then a host holding an older view
    /// would count its leases as a dead host's).
    pub(crate) fn admitted(&self) -> bool {
        !self.config.admission
            || !self.views
            || !self.observer.members.exists()
            || self.observer.members.admits(&self.me, &self.incarnation)
    }

    /// Whether this host leads the fleet: without a view, the first live host by name (see
    /// [`leads`]); with one, the host the view names.
    pub(crate) fn leads(&self) -> bool {
        if self.views {
            self.observer.members.led_by(&self.me, &self.incarnation)
        } else {
            leads(&self.me, &self.live)
        }
    }

    /// The hosts a retried take counts live, for `rows`: without a view, the judged live
    /// hosts; with one, the view's live hosts plus every owner of `rows` it lists neither
    /// live nor dead (unknown: its lease is not free).
    fn live_for(&self, now: Instant, rows: &[Lease]) -> Vec<HostName> {
        if !self.by_view(now) {
            return self.live.to_vec();
        }
        let mut live: BTreeSet<HostName> = self.live.iter().cloned().collect();
        for owner in rows.iter().filter_map(|l| l.owner.as_ref()) {
            if !self.observer.members.is_dead(owner) {
                live.insert(owner.clone());
            }
        }
        live.into_iter().collect()
    }

    /// How long until the next acquire cycle: the acquire interval, stretched when the store
    /// limits the fleet's head reads ([`StateConfig::head_reads_per_second`]) to the live
    /// hosts of the view divided by that limit, but never past 0.45 × (`handoff_timeout −
    /// safety_margin`): a worker delivers only within half of that horizon of the host's
    /// last confirmation that it knows every hand-off request, which each cycle renews
    /// (`docs/protocol.md`, "Pacing the head"). Only hosts of a store that keeps a view read
    /// the head, so only they are paced.
    ///
    /// A host waiting on others (a view to admit it, or owners to grant its hand-off
    /// requests) looks four times as often, pacing still applying: those waits end at another
    /// host's write, and each is otherwise up to a whole interval long, which after a fault
    /// adds up to seconds before the host works again. It lasts only while the host waits.
    pub(crate) fn cycle_interval(&self) -> Duration {
        let base = if self.awaiting() {
            (self.config.acquire_interval / 4)
                .max(Duration::from_millis(50))
                .min(self.config.acquire_interval)
        } else {
            self.config.acquire_interval
        };
        let Some(limit) = self
            .config
            .head_reads_per_second
            .filter(|l| l.is_finite() && *l > 0.0)
        else {
            return base;
        };
        if !self.views {
            return base;
        }
        let paced =
            Duration::try_from_secs_f64(self.live.len() as f64 / limit).unwrap_or(Duration::MAX);
        let cap = self
            .config
            .handoff_timeout
            .saturating_sub(self.config.safety_margin)
            .mul_f64(0.45);
        base.max(paced.min(cap))
    }

    /// Whether this host waits on another host's write: a view to admit it, or a hand-off
    /// it asked for.
    fn awaiting(&self) -> bool {
        !self.admitted() || self.requests.any()
    }

    /// What to read after a membership read at `now` showing `counter`.
    pub(crate) fn next_read(&self, counter: u64, now: Instant) -> Read {
        self.listing
            .next_read(counter, &self.live, now, self.config.full_list_interval)
    }

    /// The change counter the table is at, if it is trusted (the base of a list of changes).
    pub(crate) fn table_counter(&self) -> Option<u64> {
        self.listing.counter
    }

    /// Takes in a full listing. Workers whose lease is gone from it are told to stop, unless
    /// `unreadable` says its row is only unreadable.
    pub(crate) fn replace_table(
        &mut self,
        leases: Vec<impl Into<Arc<Lease>>>,
        unreadable: impl Fn(&PartitionId) -> bool,
    ) {
        self.replace_all(leases);
        let gone: Vec<PartitionId> = self
            .running
            .keys()
            .filter(|p| self.table.get(p).is_none() && !unreadable(p))
            .cloned()
            .collect();
        self.outbox.extend(gone.into_iter().map(Effect::Stop));
    }

    /// Takes in a list of changes: rows deleted (their workers stop) and rows newer than the
    /// cached ones (their workers are told).
    pub(crate) fn update_table(
        &mut self,
        deleted: &[PartitionId],
        leases: Vec<impl Into<Arc<Lease>>>,
    ) {
        for partition in deleted {
            if self.running.contains_key(partition) {
                self.outbox.push(Effect::Stop(partition.clone()));
            }
        }
        let leases = leases.into_iter().map(Into::into).collect();
        for row in self.table.apply(deleted, leases) {
            self.hint(&row);
        }
    }

    /// Takes the table a host sharing this one's tables listed up to a higher counter than
    /// this table's (see [`LeaseTable::fast_forward`]), as a full listing is taken in: workers
    /// whose lease is gone stop, the others are told of their rows. Returns whether it did.
    pub(crate) fn fast_forward(&mut self) -> bool {
        let Some(at) = self.table.fast_forward(self.listing.counter) else {
            return false;
        };
        self.listing.counter = Some(at);
        let mut gone = Vec::new();
        let mut rows = Vec::new();
        for partition in self.running.keys() {
            match self.table.row(partition) {
                Some(row) => rows.push(row.clone()),
                None => gone.push(partition.clone()),
            }
        }
        self.listed_rows = rows;
        self.outbox.extend(gone.into_iter().map(Effect::Stop));
        true
    }

    /// Notes the table as what a list of changes up to `counter` left, for the hosts sharing
    /// this one's tables.
    pub(crate) fn offer_table_at(&self, counter: u64) {
        self.table.offer_table_at(counter);
    }

    /// Takes in a full listing into the table, keeping the rows of the running workers' leases
    /// as listed, for [`HostState::hint_all`].
    fn replace_all(&mut self, leases: Vec<impl Into<Arc<Lease>>>) {
        let leases: Vec<Arc<Lease>> = leases.into_iter().map(Into::into).collect();
        self.listed_rows = leases
            .iter()
            .filter(|l| self.running.contains_key(&l.key.partition))
            .cloned()
            .collect();
        self.table.replace_all(leases);
    }

    /// Tells each worker of a newer row after a full listing (rows taken in one by one were
    /// told as they came), in partition order.
    pub(crate) fn hint_all(&mut self) {
        let rows = std::mem::take(&mut self.listed_rows);
        if !self.table.take_hint_all() {
            return;
        }
        for row in &rows {
            self.hint(row);
        }
    }

    /// A read chosen by [`HostState::next_read`] succeeded at `counter`, at `now`; the live
    /// hosts are judged from a membership read made after it.
    pub(crate) fn note_listed(&mut self, read: Read, counter: u64, now: Instant) {
        self.listing.listed(read, counter, &self.live, now);
    }

    /// Whether the live hosts changed since the table was last balanced on, by a judgment made
    /// after it was listed (the leader's heartbeat read, or an election's); if so, they count
    /// as balanced on from now.
    pub(crate) fn take_live_change(&mut self) -> bool {
        self.listing.take_live_change(&self.live)
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
    pub(crate) fn replace_table_after_sync(&mut self, leases: Vec<impl Into<Arc<Lease>>>) {
        self.replace_all(leases);
        self.listing.invalidate();
    }

    /// Every listed row, sorted by partition.
    pub(crate) fn rows(&self) -> Vec<Arc<Lease>> {
        self.table.rows()
    }

    /// The heartbeat rows of dead hosts the leader may remove (see [`dead_rows`]); none
    /// unless this host leads. With a view, only rows the view lists dead, so no host holding
    /// the view counts a removed row's host as unknown while it still owns leases.
    pub(crate) fn dead_rows<'a>(&self, hosts: &'a [Heartbeat]) -> Vec<&'a Heartbeat> {
        if !self.leads() {
            return Vec::new();
        }
        let mut rows = dead_rows(hosts, &self.judged, &self.table);
        if self.views {
            rows.retain(|hb| self.observer.members.is_dead(&hb.host));
        }
        rows
    }
}

#[cfg(test)]
mod tests;
