//! The host loop: every acquire interval, read membership, list what changed, balance, and
//! apply the plan by compare-and-swap; one worker per owned lease; the bounded graceful stop.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use super::builder::Processor;
use super::heartbeat::{self, Liveness, ProcessorError};
use super::host_state::{self, LeaseTable, Listing, Read, Requests, TakeConflict};
use super::{sync, worker};
use crate::error::LeaseError;
use crate::lineage::ParentsRule;
use crate::model::{HostName, Lease, LeaseState, PartitionId};

/// Why a lease is taken: free or expired (a take), or an unhonoured hand-off (a steal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TakeKind {
    Take,
    Steal,
}

struct WorkerSlot {
    cancel: CancellationToken,
    hint: watch::Sender<Option<Lease>>,
    known_version: crate::model::Version,
}

/// Tells the worker of `lease`, if one runs, about that row if it is newer than what the
/// worker knows.
fn hint(workers: &mut HashMap<PartitionId, WorkerSlot>, lease: &Lease) {
    if let Some(slot) = workers.get_mut(&lease.key.partition) {
        if lease.version > slot.known_version {
            slot.known_version = lease.version;
            slot.hint.send_replace(Some(lease.clone()));
        }
    }
}

pub(super) struct Host {
    p: Processor,
    group_label: String,
    liveness: Liveness,
    /// The listed leases and what they say of this host (pure).
    table: LeaseTable,
    /// When and at what counter the table was listed (pure).
    listing: Listing,
    workers: HashMap<PartitionId, WorkerSlot>,
    worker_tasks: JoinSet<()>,
    worker_cancel: CancellationToken,
    exits_tx: mpsc::UnboundedSender<worker::WorkerExit>,
    exits_rx: mpsc::UnboundedReceiver<worker::WorkerExit>,
    fenced_tx: watch::Sender<bool>,
    fence_deadline: heartbeat::FenceDeadline,
    /// When this host last confirmed its workers know of every hand-off request.
    view: heartbeat::ViewStamp,
    /// The hand-off requests this host waits on (pure).
    requests: Requests,
    /// When this host registered. Hand-off requests wait one renew interval after it, so that
    /// hosts started together see each other before computing shares (otherwise the first to
    /// run would ask for a share of a smaller fleet, and leases would move twice).
    registered_at: Instant,
    /// Set when the last plan was cut short (deferred requests): plan again next cycle even if
    /// nothing changed.
    replan: bool,
    /// The leader's partition sync and cleanup (runs only while this host leads).
    syncer: sync::Syncer,
    /// Lag per owned partition, for the `changefeed_lag_records` gauge.
    lag: Arc<worker::LagBook>,
    /// Keys of lease rows the store could not read, for the `changefeed_malformed_leases`
    /// gauge (published every cycle).
    malformed: BTreeSet<String>,
}

/// The key a [`LeaseError::Malformed`] names.
fn malformed_key(err: &LeaseError) -> Option<String> {
    match err {
        LeaseError::Malformed { key, .. } => Some(key.clone()),
        _ => None,
    }
}

impl Host {
    pub(super) fn new(p: Processor) -> Self {
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        let p_now = p.clock.now();
        let fence_at = p_now + p.settings.fence_after();
        let table = LeaseTable::new(p.host.clone());
        Self {
            group_label: p.group.to_string(),
            table,
            p,
            liveness: Liveness::default(),
            listing: Listing::default(),
            workers: HashMap::new(),
            worker_tasks: JoinSet::new(),
            worker_cancel: CancellationToken::new(),
            exits_tx,
            exits_rx,
            fenced_tx: watch::channel(false).0,
            fence_deadline: heartbeat::FenceDeadline::new(fence_at),
            view: heartbeat::ViewStamp::new(p_now),
            requests: Requests::default(),
            registered_at: p_now,
            replan: false,
            syncer: sync::Syncer::default(),
            lag: Arc::default(),
            malformed: BTreeSet::new(),
        }
    }

    pub(super) async fn run(
        mut self,
        cancel: CancellationToken,
        row: crate::model::Heartbeat,
    ) -> Result<(), ProcessorError> {
        let hb_cancel = CancellationToken::new();
        let mut hb_task = JoinSet::new();
        let s = &self.p.settings;
        hb_task.spawn(
            heartbeat::run(
                self.p.store.clone(),
                self.p.clock.clone(),
                row.clone(),
                s.renew_interval,
                s.fence_after(),
                self.fenced_tx.clone(),
                hb_cancel.clone(),
                // A renewal counts only if it completed within the safety margin of being sent.
                s.safety_margin.min(s.renew_interval),
                self.fence_deadline.clone(),
            )
            .in_current_span(),
        );
        let mut next_cycle = self.p.clock.now();
        let mut outcome = Ok(());
        loop {
            let wait = next_cycle.saturating_duration_since(self.p.clock.now());
            let sleep = self.p.clock.sleep(wait);
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                done = hb_task.join_next() => {
                    outcome = match done {
                        Some(Ok(Err(e))) => Err(e),
                        _ => Ok(()),
                    };
                    break;
                }
                Some(exit) = self.exits_rx.recv() => self.on_exit(exit),
                _ = sleep => {
                    // A stop must not wait for a cycle stuck on a hung store: the cycle is
                    // dropped, and whatever it took is released or expires with this host.
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break,
                        _ = self.cycle() => {}
                    }
                    next_cycle = self.p.clock.now() + self.p.settings.acquire_interval;
                }
            }
        }
        // Graceful stop, bounded by shutdown_timeout: workers release their leases first (the
        // batch in flight may run for half of it), then the heartbeat goes.
        let stop_at = self.p.clock.now() + self.p.settings.shutdown_timeout;
        info!("stopping: releasing leases");
        self.worker_cancel.cancel();
        let workers_by = stop_at - self.p.settings.shutdown_timeout / 4;
        let drained = {
            let tasks = &mut self.worker_tasks;
            let wait = async { while tasks.join_next().await.is_some() {} };
            let limit = self
                .p
                .clock
                .sleep(workers_by.saturating_duration_since(self.p.clock.now()));
            tokio::select! {
                _ = wait => true,
                _ = limit => false,
            }
        };
        if !drained {
            warn!(workers = self.worker_tasks.len(), "workers did not release their leases within shutdown_timeout; abandoning them (their leases expire with this host)");
            self.worker_tasks.shutdown().await;
        }
        while let Ok(exit) = self.exits_rx.try_recv() {
            self.on_exit(exit);
        }
        hb_cancel.cancel();
        let row = match hb_task.join_next().await {
            Some(Ok(Ok(row))) => Some(row),
            _ => None,
        };
        if let (Some(row), true) = (row, outcome.is_ok()) {
            let left = stop_at.saturating_duration_since(self.p.clock.now());
            let remove = self.remove_own_heartbeat(row);
            tokio::select! {
                _ = remove => {}
                _ = self.p.clock.sleep(left.max(Duration::from_millis(100))) => {
                    warn!("removing the heartbeat row took longer than shutdown_timeout; it will expire");
                }
            }
        }
        metrics::gauge!("changefeed_leases_owned", "group" => self.group_label.clone()).set(0.0);
        info!("stopped");
        outcome
    }

    /// Removes this host's heartbeat row. A renewal cut short by the stop may still have
    /// landed and moved the row's version: the removal then retries at the version the store
    /// reports, as long as the row is still this incarnation's.
    async fn remove_own_heartbeat(&self, mut row: crate::model::Heartbeat) {
        for _ in 0..5 {
            match self
                .p
                .store
                .remove_heartbeat(&row.group, &row.host, &row.incarnation, row.version)
                .await
            {
                Ok(()) => return,
                Err(LeaseError::HeartbeatConflict {
                    current: Some(cur), ..
                }) if cur.incarnation == row.incarnation => {
                    debug!(version = %cur.version, "heartbeat moved while stopping; removing it at its current version");
                    row = *cur;
                }
                Err(err) if err.is_retryable() => {
                    warn!(error = %err, "removing the heartbeat row failed; retrying");
                    self.p.clock.sleep(self.p.settings.min_backoff).await;
                }
                Err(err) => {
                    warn!(error = %err, "could not remove the heartbeat row; it will expire");
                    return;
                }
            }
        }
        warn!("could not remove the heartbeat row after 5 attempts; it will expire");
    }

    fn on_exit(&mut self, exit: worker::WorkerExit) {
        debug!(partition = %exit.partition, reason = ?exit.reason, "worker exited");
        self.workers.remove(&exit.partition);
        // Whatever the reason, the lease changed hands or state: plan next cycle. A hand-off,
        // release or finish moved the change counter; a worker stopped by the fence left the
        // lease ours, and `adopt_own_leases` resumes it.
        self.replan = true;
    }

    fn fenced(&self) -> bool {
        *self.fenced_tx.borrow() || self.p.clock.now() >= self.fence_deadline.get()
    }

    /// Whether this host has been fenced, or stalled past its fence (a lapse), since a cycle
    /// that began with `lapses` lapses: then that cycle's reads are stale.
    fn cut_short(&self, lapses: u64) -> bool {
        self.fenced() || self.fence_deadline.lapses() != lapses
    }

    async fn cycle(&mut self) {
        while self.worker_tasks.try_join_next().is_some() {}
        if self.fenced() {
            // A fenced host neither takes nor asks; its workers have stopped.
            return;
        }
        let lapses = self.fence_deadline.lapses();
        let sent = self.p.clock.now();
        let membership = match self.p.store.membership(&self.p.group).await {
            Ok(m) => m,
            Err(err) => {
                warn!(error = %err, "reading membership failed");
                return;
            }
        };
        // Read the clock after the read returns: a heartbeat version is first seen when the
        // read completes, however long the store took (rule 2 must not count a slow read's
        // wait as time the version stood still).
        let now = self.p.clock.now();
        self.liveness.observe(&membership, now);
        let mut live = host_state::live_hosts(
            self.liveness.live(now, self.p.settings.lease_expiry),
            &self.p.host,
        );
        let read = self.listing.next_read(
            membership.change_counter,
            &live,
            now,
            self.p.settings.full_list_interval,
        );
        let need_list = read != Read::Nothing;
        if need_list {
            // Rows that only moved their checkpoint are not in a list of changes, so a take may
            // find a newer version than the cached one: see `retry_takes`.
            let read_result = if read == Read::Full {
                self.full_list(membership.change_counter).await
            } else {
                self.list_changes(membership.change_counter).await
            };
            match read_result {
                Ok(counter) => {
                    // Workers learn of every request this list holds before the view stamp
                    // says they may: hints first, then the stamp.
                    self.send_hints();
                    self.view.confirm(sent);
                    // Judge liveness from a membership read made after the list. A host judged
                    // dead from the earlier read may have re-registered and taken leases since;
                    // its takes can show in the list only with its new heartbeat (it registers
                    // first), so this read sees it live and its leases are not taken as free.
                    match self.p.store.membership(&self.p.group).await {
                        Ok(m) => {
                            let now = self.p.clock.now();
                            self.liveness.observe(&m, now);
                            live = host_state::live_hosts(
                                self.liveness.live(now, self.p.settings.lease_expiry),
                                &self.p.host,
                            );
                        }
                        Err(err) => {
                            warn!(error = %err, "reading membership failed");
                            // The list was not balanced on: list again next cycle rather than
                            // skip balancing until the counter moves.
                            self.listing.invalidate();
                            return;
                        }
                    }
                    self.listing.listed(read, counter, &live, now);
                }
                Err(err) => {
                    warn!(error = %err, "listing leases failed");
                    return;
                }
            }
        } else {
            // The counter did not move since the last list, whose hints were sent: no request
            // was written before this read that the workers do not know of.
            self.view.confirm(sent);
        }
        let synced = self.sync(&live, now).await;
        self.forget_dead_hosts(&membership, &live, sent, lapses)
            .await;
        if !need_list && !synced {
            // Nothing changed hands: the cached list is accurate; only time-based decisions
            // (overdue hand-offs) can differ.
            if !self.requests.any() && !self.replan {
                self.publish_gauges();
                return;
            }
        }
        if self.cut_short(lapses) {
            // Stalled mid-cycle past the fence: what was read is stale, and a fenced host
            // neither takes nor asks.
            self.replan = true;
            return;
        }
        // Set again below by anything that wants another look next cycle.
        self.replan = false;
        self.send_hints();
        self.adopt_own_leases().await;
        self.balance(&live, now).await;
        self.publish_gauges();
    }

    /// The leader removes the heartbeat row of a host judged dead once it owns no lease any
    /// more (its leases have been taken). Otherwise a newcomer, which cannot yet tell a dead
    /// row from a live one, would count it as a host owed a share, and leases would move more
    /// than needed. The removal is a CAS on the version seen, so a host that renewed meanwhile
    /// keeps its row; one that was cut off and comes back registers again.
    ///
    /// A host that registers again starts its new row at version 1, so a removal sent on a
    /// stale view could hit the new row of a host that came back: rows are removed only while
    /// the membership read (sent at `sent`) is younger than the safety margin and this host
    /// has not stalled past its fence since the cycle began.
    async fn forget_dead_hosts(
        &mut self,
        membership: &crate::model::Membership,
        live: &[HostName],
        sent: Instant,
        lapses: u64,
    ) {
        for hb in host_state::dead_rows(&self.p.host, &membership.hosts, live, &self.table) {
            let age = self.p.clock.now().saturating_duration_since(sent);
            if self.cut_short(lapses) || age >= self.p.settings.safety_margin {
                debug!(
                    ?age,
                    "membership read too old to remove dead hosts' rows; next cycle"
                );
                return;
            }
            match self
                .p
                .store
                .remove_heartbeat(&hb.group, &hb.host, &hb.incarnation, hb.version)
                .await
            {
                Ok(()) => info!(host = %hb.host, "removed the heartbeat row of a dead host"),
                Err(err) => debug!(host = %hb.host, error = %err, "dead host's row not removed"),
            }
        }
    }

    /// Runs the partition sync when this host leads (the first live host by name) and it is
    /// due. Returns whether the lease table changed, after re-listing it.
    async fn sync(&mut self, live: &[HostName], now: Instant) -> bool {
        if !host_state::leads(&self.p.host, live) {
            self.syncer.reset();
            return false;
        }
        if !self.syncer.due(now, &self.p.settings) {
            return false;
        }
        let report = self
            .syncer
            .run(
                self.p.store.as_ref(),
                self.p.source.as_ref(),
                &self.p.group,
                &self.p.settings,
                self.table.rows(),
                now,
                self.listing.counter,
            )
            .await;
        match report {
            Ok(report) if report.changed() => {
                debug!(?report, "partition sync changed the lease table");
                match self.p.store.list(&self.p.group).await {
                    Ok(listing) => {
                        self.set_leases(listing.leases);
                        // The counter moved with our writes: list again next cycle too.
                        self.listing.invalidate();
                        true
                    }
                    Err(err) => {
                        warn!(error = %err, "listing leases after the sync failed");
                        self.listing.invalidate();
                        false
                    }
                }
            }
            Ok(_) => false,
            Err(err) => {
                warn!(error = %err, "partition sync failed; retrying at the next interval");
                false
            }
        }
    }

    fn publish_gauges(&self) {
        metrics::gauge!("changefeed_leases_owned", "group" => self.group_label.clone())
            .set(self.workers.len() as f64);
        metrics::gauge!("changefeed_malformed_leases", "group" => self.group_label.clone())
            .set(self.malformed.len() as f64);
    }

    /// Lists every lease. Returns the change counter the listing is at least as new as.
    async fn full_list(&mut self, counter: u64) -> Result<u64, LeaseError> {
        let listing = self.p.store.list(&self.p.group).await?;
        // Repeated at every full list while the rows stay unreadable: an operator fixes them
        // with `changefeed reset --force`.
        for bad in &listing.malformed {
            warn!(error = %bad, "unreadable lease row skipped; fix it with `changefeed reset --force`");
        }
        self.malformed = listing.malformed.iter().filter_map(malformed_key).collect();
        self.set_leases(listing.leases);
        self.stop_workers_of_deleted_leases(&listing.malformed);
        Ok(counter)
    }

    /// Reads only what changed hands since the last list, when the store can say; lists in
    /// full otherwise. Returns the change counter the cached leases are now at.
    async fn list_changes(&mut self, counter: u64) -> Result<u64, LeaseError> {
        let Some(since) = self.listing.counter else {
            return self.full_list(counter).await;
        };
        let Some(changes) = self.p.store.list_changes(&self.p.group, since).await? else {
            return self.full_list(counter).await;
        };
        for bad in &changes.malformed {
            warn!(error = %bad, "unreadable lease row skipped; fix it with `changefeed reset --force`");
        }
        self.malformed
            .extend(changes.malformed.iter().filter_map(malformed_key));
        for lease in &changes.leases {
            self.malformed.remove(lease.key.to_string().as_str());
        }
        for key in &changes.deleted {
            self.malformed.remove(key.to_string().as_str());
            self.table.remove(&key.partition);
            if let Some(slot) = self.workers.get(&key.partition) {
                info!(partition = %key.partition, "lease deleted; stopping its worker");
                slot.cancel.cancel();
            }
        }
        for lease in changes.leases {
            self.remember(lease);
        }
        Ok(changes.counter)
    }

    /// Puts a row newer than the cached one (or a new one) into the table, and tells its
    /// worker.
    fn remember(&mut self, lease: Lease) {
        if let Some(row) = self.table.remember(lease) {
            hint(&mut self.workers, row);
        }
    }

    /// Keeps a fresh listing (hints follow in `send_hints`).
    fn set_leases(&mut self, leases: Vec<Lease>) {
        self.table.replace_all(leases);
    }

    /// Stops the workers whose lease is gone from a fresh listing (a retired stream's lease
    /// deleted by the leader): an idle worker would otherwise only notice at its next write.
    /// A row that is only unreadable (listed as malformed) does not count as deleted.
    fn stop_workers_of_deleted_leases(&mut self, malformed: &[LeaseError]) {
        let unreadable: std::collections::HashSet<&str> = malformed
            .iter()
            .filter_map(|e| match e {
                LeaseError::Malformed { key, .. } => Some(key.as_str()),
                _ => None,
            })
            .collect();
        let mut gone: Vec<&PartitionId> = self
            .workers
            .keys()
            .filter(|p| self.table.get(p).is_none())
            .filter(|p| !unreadable.contains(format!("{}/{p}", self.p.group).as_str()))
            .collect();
        gone.sort_unstable();
        for partition in gone {
            info!(%partition, "lease deleted; stopping its worker");
            if let Some(slot) = self.workers.get(partition) {
                slot.cancel.cancel();
            }
        }
    }

    /// Tells each worker about a newer row of its lease (a hand-off request, or a new owner)
    /// that it has not been told of yet.
    fn send_hints(&mut self) {
        if !self.table.take_hint_all() {
            // Rows taken in one by one were hinted as they came (`remember`).
            return;
        }
        // In partition order, not the map's: the order workers wake in must not depend on
        // hashing (the simulator replays runs exactly).
        let mut partitions: Vec<PartitionId> = self.workers.keys().cloned().collect();
        partitions.sort_unstable();
        for p in partitions {
            if let Some(row) = self.table.get(&p) {
                hint(&mut self.workers, row);
            }
        }
    }

    /// Leases the store says are ours but no worker runs (a restart under the same name, or a
    /// fence that was lowered): claim them by CAS and start workers.
    async fn adopt_own_leases(&mut self) {
        let mine = self.table.to_adopt(|p| self.workers.contains_key(p));
        for lease in mine {
            match self.p.store.replace(&lease, lease.version).await {
                Ok(stored) => {
                    info!(lease = %stored.key, "resuming a lease this host owns");
                    self.start_worker(stored);
                }
                Err(LeaseError::Conflict { current, .. }) => {
                    // Our own checkpoints moved it since it was listed: retry next cycle
                    // with the current row, if it is still ours.
                    debug!(lease = %lease.key, "could not resume lease: it changed");
                    self.remember(*current);
                    self.replan = true;
                }
                Err(err) => debug!(lease = %lease.key, error = %err, "could not resume lease"),
            }
        }
    }

    async fn balance(&mut self, live: &[HostName], now: Instant) {
        // Track how long our hand-off requests have been pending, on our own clock.
        let seen = self.p.clock.now();
        let me = self.p.host.clone();
        self.requests.sync(self.table.asked(), seen);
        let parents = if self.p.hooks.child_before_parent() {
            ParentsRule::Ignore
        } else {
            ParentsRule::Wait
        };
        let (plan, held) = host_state::plan(
            &host_state::PlanInput {
                me: &me,
                live,
                table: &self.table,
                requests: &self.requests,
                now,
                registered_at: self.registered_at,
                handoff_timeout: self.p.settings.handoff_timeout,
                grace: self.p.settings.renew_interval,
                parents,
            },
            self.p.strategy.as_ref(),
        );
        if held {
            self.replan = true;
        }
        if plan.is_empty() {
            return;
        }
        debug!(?plan, "balance plan");
        let mut retry: Vec<Lease> = Vec::new();
        for (partition, kind) in plan
            .take
            .iter()
            .map(|p| (p, TakeKind::Take))
            .chain(plan.steal.iter().map(|p| (p, TakeKind::Steal)))
        {
            let Some(lease) = self.table.get(partition).cloned() else {
                continue;
            };
            if self.workers.contains_key(partition) {
                // Our worker of an earlier ownership has not stopped yet: it could adopt the
                // new row as its own and write its stale position. Take it once it has.
                self.replan = true;
                continue;
            }
            match self.take(&lease, kind).await {
                Ok(()) => {}
                Err(LeaseError::Conflict { current, .. }) => {
                    // The cached row is older than the store's. If only its checkpoint moved
                    // (the owner wrote one before it died, after we listed), take it at the
                    // current version once a fresh membership read still shows that owner
                    // dead; otherwise plan again next cycle with the current row.
                    debug!(lease = %lease.key, ?kind, "could not take lease: it changed");
                    match host_state::on_take_conflict(&lease, &current, kind == TakeKind::Steal) {
                        TakeConflict::RetryAfterMembership => retry.push(*current),
                        TakeConflict::Replan => {
                            self.remember(*current);
                            self.replan = true;
                        }
                    }
                }
                Err(err) => debug!(lease = %lease.key, error = %err, ?kind, "could not take lease"),
            }
        }
        if !retry.is_empty() {
            self.retry_takes(retry).await;
        }
        for req in &plan.request_handoff {
            let Some(mut lease) = self.table.get(&req.partition).cloned() else {
                continue;
            };
            // A conflict that only reflects a checkpoint of the owner is retried against the
            // current row, as long as the request still makes sense.
            for _attempt in 0..3 {
                if !host_state::may_request(&lease, &req.from, live) {
                    break;
                }
                let mut next = lease.clone();
                next.next_owner = Some(me.clone());
                match self.p.store.replace(&next, lease.version).await {
                    Ok(_) => {
                        info!(lease = %lease.key, from = %req.from, "asked for hand-off");
                        metrics::counter!("changefeed_handoffs_requested_total", "group" => self.group_label.clone()).increment(1);
                        // Timed from when the write returned: it landed by then, so the
                        // owner's workers stop delivering within handoff_timeout −
                        // safety_margin of it unless told (see `heartbeat::ViewStamp`).
                        self.requests
                            .written(req.partition.clone(), self.p.clock.now());
                        break;
                    }
                    Err(LeaseError::Conflict { current, .. }) => lease = *current,
                    Err(err) => {
                        debug!(lease = %lease.key, error = %err, "hand-off request not written");
                        break;
                    }
                }
            }
        }
        for partition in &plan.release {
            if let Some(slot) = self.workers.get(partition) {
                info!(%partition, "releasing lease by plan");
                slot.cancel.cancel();
            }
        }
    }

    /// Takes again, at their current version, leases whose take conflicted only because their
    /// checkpoint had moved. The owner must still be judged dead by a membership read made
    /// after the conflict: a host that came back registers before it writes a lease, so an
    /// owner that re-adopted its lease shows a new heartbeat here and keeps it.
    async fn retry_takes(&mut self, rows: Vec<Lease>) {
        let membership = match self.p.store.membership(&self.p.group).await {
            Ok(m) => m,
            Err(err) => {
                warn!(error = %err, "reading membership failed");
                for row in rows {
                    self.remember(row);
                }
                self.replan = true;
                return;
            }
        };
        let now = self.p.clock.now();
        self.liveness.observe(&membership, now);
        let live = self.liveness.live(now, self.p.settings.lease_expiry);
        for row in rows {
            if !host_state::may_retry_take(
                &row,
                &live,
                self.workers.contains_key(&row.key.partition),
            ) {
                self.remember(row);
                self.replan = true;
                continue;
            }
            match self.take(&row, TakeKind::Take).await {
                Ok(()) => {}
                Err(LeaseError::Conflict { current, .. }) => {
                    self.remember(*current);
                    self.replan = true;
                }
                Err(err) => {
                    debug!(lease = %row.key, error = %err, "could not take lease");
                    self.remember(row);
                    self.replan = true;
                }
            }
        }
    }

    /// Takes `row` for this host by CAS at its version (`kind`: "take" of a free or expired
    /// lease, or "steal" of an unhonoured hand-off), then caches the new row and starts its
    /// worker. The caller decides what a failure means.
    async fn take(&mut self, row: &Lease, kind: TakeKind) -> Result<(), LeaseError> {
        let mut next = row.clone();
        next.state = LeaseState::Owned;
        next.owner = Some(self.p.host.clone());
        next.next_owner = None;
        let stored = self.p.store.replace(&next, row.version).await?;
        info!(lease = %stored.key, previous = ?row.owner, kind = if kind == TakeKind::Steal { "steal" } else { "take" }, "took lease");
        let counter = if kind == TakeKind::Steal {
            "changefeed_leases_stolen_total"
        } else {
            "changefeed_leases_taken_total"
        };
        metrics::counter!(counter, "group" => self.group_label.clone()).increment(1);
        self.requests.taken(&row.key.partition);
        self.remember(stored.clone());
        self.start_worker(stored);
        Ok(())
    }

    fn start_worker(&mut self, lease: Lease) {
        let partition = lease.key.partition.clone();
        if self.workers.contains_key(&partition) {
            return;
        }
        let cancel = self.worker_cancel.child_token();
        // The first hint is the lease itself, so a pending hand-off request is honoured at once.
        let (hint_tx, hint_rx) = watch::channel(None);
        if lease.next_owner.is_some() {
            hint_tx.send_replace(Some(lease.clone()));
        }
        let mut hint_rx = hint_rx;
        if lease.next_owner.is_none() {
            hint_rx.mark_unchanged();
        }
        let seed = self.p.rng.gen::<u64>();
        self.workers.insert(
            partition,
            WorkerSlot {
                cancel: cancel.clone(),
                hint: hint_tx,
                known_version: lease.version,
            },
        );
        let args = worker::WorkerArgs {
            lease,
            store: self.p.store.clone(),
            source: self.p.source.clone(),
            handler: self.p.handler.clone(),
            host: self.p.host.clone(),
            settings: self.p.settings.clone(),
            clock: self.p.clock.clone(),
            cancel,
            fenced: self.fenced_tx.subscribe(),
            fence_deadline: self.fence_deadline.clone(),
            view: self.view.clone(),
            hint: hint_rx,
            exits: self.exits_tx.clone(),
            rng: SmallRng::seed_from_u64(seed),
            group_label: self.group_label.clone(),
            hooks: self.p.hooks,
            lag: self.lag.clone(),
            dead_letter: self.p.dead_letter.clone(),
        };
        self.worker_tasks.spawn(worker::run(args).in_current_span());
    }
}
