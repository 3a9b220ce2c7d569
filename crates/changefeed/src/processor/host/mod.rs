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
use super::callbacks::ErrorOrigin;
use super::heartbeat::{self, ProcessorError};
use super::host_state::{HostState, Read, Signal, StateConfig};
use super::retry::{Backoff, Policy, Retry};
use super::{sync, worker};
use crate::error::LeaseError;
use crate::model::{GroupHead, Heartbeat, Lease, Membership, PartitionId};

mod feed;
mod listing;
mod plan;

/// What a cycle reads first: the head row (the change counter and the membership view) from a
/// store that keeps a view, every heartbeat from one that does not.
enum Roll {
    Head(GroupHead),
    Heartbeats(Membership),
}

impl Roll {
    fn change_counter(&self) -> u64 {
        match self {
            Roll::Head(h) => h.change_counter,
            Roll::Heartbeats(m) => m.change_counter,
        }
    }
}

/// A running worker's handles: how to stop it and how to tell it of a newer row.
struct WorkerSlot {
    cancel: CancellationToken,
    hint: watch::Sender<Option<Lease>>,
}

/// The async shell around [`HostState`]: store calls, the heartbeat task, workers.
pub(super) struct Host {
    p: Processor,
    group_label: String,
    /// Every decision, and the state they are made on (pure).
    state: HostState,
    workers: HashMap<PartitionId, WorkerSlot>,
    worker_tasks: JoinSet<()>,
    worker_cancel: CancellationToken,
    exits_tx: mpsc::UnboundedSender<worker::WorkerExit>,
    exits_rx: mpsc::UnboundedReceiver<worker::WorkerExit>,
    fenced_tx: watch::Sender<bool>,
    fence_deadline: heartbeat::FenceDeadline,
    /// When this host last confirmed its workers know of every hand-off request.
    view: heartbeat::ViewStamp,
    /// Shared with the heartbeat task: the current incarnation, and whether it renews as the
    /// membership view's leader.
    link: heartbeat::ViewLink,
    /// The leader's partition sync and cleanup (runs only while this host leads).
    syncer: sync::Syncer,
    /// Lag per owned partition, for the `changefeed_lag_records` gauge.
    lag: Arc<worker::LagBook>,
    /// When the leader last estimated the lag of the partitions no host reads.
    unowned_lag_at: Option<Instant>,
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
        let config = StateConfig {
            lease_expiry: p.settings.lease_expiry,
            full_list_interval: p.settings.full_list_interval,
            handoff_timeout: p.settings.handoff_timeout,
            // Hand-off requests wait one renew interval after registering, so that hosts
            // started together see each other before computing shares.
            grace: p.settings.renew_interval,
            admission: !p.hooks.no_admission(),
            parents: p.hooks.parents_rule(),
            acquire_interval: p.settings.acquire_interval,
            safety_margin: p.settings.safety_margin,
            head_reads_per_second: p.store.head_reads_per_second(),
            share: p.share.clone(),
        };
        let fence_deadline = heartbeat::FenceDeadline::new(fence_at, p.settings.unhealthy_after());
        // Registered: from now on the host's health reads its fence record.
        p.health.registered(fence_deadline.clone());
        Self {
            group_label: p.group.to_string(),
            state: HostState::new(p.host.clone(), config, p_now),
            syncer: sync::Syncer::new(p.callbacks.clone()),
            lag: Arc::new(worker::LagBook::new(p.settings.lag_per_partition)),
            p,
            workers: HashMap::new(),
            worker_tasks: JoinSet::new(),
            worker_cancel: CancellationToken::new(),
            exits_tx,
            exits_rx,
            fenced_tx: watch::channel(false).0,
            fence_deadline,
            view: heartbeat::ViewStamp::new(p_now),
            link: heartbeat::ViewLink::new(Arc::from("")),
            unowned_lag_at: None,
            malformed: BTreeSet::new(),
        }
    }

    pub(super) async fn run(
        mut self,
        cancel: CancellationToken,
        row: Heartbeat,
    ) -> Result<(), ProcessorError> {
        self.state.registered_as(row.incarnation.clone());
        self.link = heartbeat::ViewLink::new(row.incarnation.clone());
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
                self.p.callbacks.clone(),
                self.link.clone(),
            )
            .in_current_span(),
        );
        let mut next_cycle = self.p.clock.now();
        let mut outcome = Ok(());
        let mut fence = self.fenced_tx.subscribe();
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
                // A fenced host skips its cycles; once its heartbeat lands again it takes its
                // share at once rather than up to an acquire interval later.
                Ok(()) = fence.changed() => {
                    if !*fence.borrow_and_update() {
                        next_cycle = self.p.clock.now();
                    }
                }
                _ = sleep => {
                    // A stop must not wait for a cycle stuck on a hung store: the cycle is
                    // dropped, and whatever it took is released or expires with this host.
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break,
                        _ = self.cycle() => {}
                    }
                    next_cycle = self.p.clock.now() + self.state.cycle_interval();
                }
            }
        }
        // Graceful stop, bounded by shutdown_timeout: workers release their leases first (the
        // batch in flight may run for half of it), then the heartbeat goes.
        self.p.health.stopping();
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
            let rng = SmallRng::seed_from_u64(self.p.rng.gen());
            let remove = async {
                self.abdicate().await;
                self.remove_own_heartbeat(row, rng).await;
            };
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

    /// A leader that stops gracefully gives the view up, so that the others elect a new
    /// leader at once (see `Members::abdication`). A failure only means they wait for the view
    /// to go stale.
    async fn abdicate(&self) {
        let Some((view, expected)) = self.state.abdication() else {
            return;
        };
        match self
            .p
            .store
            .write_view(&self.p.group, &view, expected)
            .await
        {
            Ok(_) => info!("gave up leading the membership view"),
            Err(err) => {
                debug!(error = %err, "could not give up the membership view; it goes stale instead")
            }
        }
    }

    /// Removes this host's heartbeat row ([`Policy::REMOVE_HEARTBEAT`]). A renewal cut short
    /// by the stop may still have landed and moved the row's version: the removal then goes on
    /// at the version the store reports, as long as the row is still this incarnation's.
    async fn remove_own_heartbeat(&self, mut row: Heartbeat, mut rng: SmallRng) {
        let backoff = Backoff::new(&self.p.settings);
        let mut retry = Retry::new(Policy::REMOVE_HEARTBEAT);
        loop {
            let err = match self
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
                    continue;
                }
                Err(err) => err,
            };
            match retry.failed(err.is_retryable(), || false) {
                Ok(attempt) => {
                    warn!(error = %err, "removing the heartbeat row failed; retrying");
                    self.p.clock.sleep(backoff.delay(attempt, &mut rng)).await;
                }
                Err(why) => {
                    warn!(error = %err, ?why, "could not remove the heartbeat row; it will expire");
                    return;
                }
            }
        }
    }

    fn on_exit(&mut self, exit: worker::WorkerExit) {
        debug!(partition = %exit.partition, reason = ?exit.reason, "worker exited");
        self.workers.remove(&exit.partition);
        self.state.worker_exited(&exit.partition);
    }

    /// Tells the workers what the state decided they must know, in order.
    fn flush(&mut self) {
        for signal in self.state.signals() {
            match signal {
                Signal::Hint(row) => {
                    if let Some(slot) = self.workers.get(&row.key.partition) {
                        slot.hint.send_replace(Some(row));
                    }
                }
                Signal::Stop(partition) => {
                    if let Some(slot) = self.workers.get(&partition) {
                        info!(%partition, "lease deleted; stopping its worker");
                        slot.cancel.cancel();
                    }
                }
            }
        }
    }

    fn fenced(&self) -> bool {
        self.fence_deadline.is_fenced(self.p.clock.now())
    }

    /// Whether this host has been fenced, or stalled past its fence (a lapse), since a cycle
    /// that began with `lapses` lapses: then that cycle's reads are stale.
    fn cut_short(&self, lapses: u64) -> bool {
        self.fence_deadline.fenced_since(self.p.clock.now(), lapses)
    }

    async fn cycle(&mut self) {
        while self.worker_tasks.try_join_next().is_some() {}
        if self.fenced() {
            // A fenced host neither takes nor asks; its workers have stopped.
            return;
        }
        let lapses = self.fence_deadline.lapses();
        self.state.registered_as(self.link.incarnation());
        let sent = self.p.clock.now();
        let Some(roll) = self.roll().await else {
            return;
        };
        // Read the clock after the read returns: a heartbeat version is first seen when the
        // read completes, however long the store took (rule 2 must not count a slow read's
        // wait as time the version stood still).
        let now = self.p.clock.now();
        self.take_in(&roll, sent, now);
        let read = self.state.next_read(roll.change_counter(), now);
        let listed = read != Read::Nothing;
        if listed {
            // Rows that only moved their checkpoint are not in a list of changes, so a take may
            // find a newer version than the cached one: see `retry_takes`. The safety net
            // (`Read::Full`) is a list of changes too on a store that can answer one: it reads
            // the rows that changed hands since the counter the table is at, however few (a
            // check of the counter and the change stamps), and lists in full only when the
            // store cannot say or the table is not trusted.
            let read_result = self.list_changes(roll.change_counter()).await;
            let (counter, exact) = match read_result {
                Ok(read) => read,
                Err(err) => {
                    warn!(error = %err, "listing leases failed");
                    self.p.callbacks.error(ErrorOrigin::Store, None, || {
                        format!("listing leases failed: {err}")
                    });
                    return;
                }
            };
            // Workers learn of every request this list holds before the view stamp says they
            // may: hints first, then the stamp.
            self.state.hint_all();
            self.flush();
            self.view.confirm(sent);
            // Judge liveness from a membership read made after the list. A host judged dead
            // from the earlier read may have re-registered and taken leases since; its takes
            // can show in the list only with its new heartbeat (it registers first), so this
            // read sees it live and its leases are not taken as free. With a view, the head
            // read after the list holds a view at least as new as the one that let every
            // owner in the list take (it takes only once a view lists it).
            // A list of changes read at the first read's counter shows nothing that changed
            // hands since that read (the safety net, in steady state): that read already
            // judged every owner it shows.
            if !exact || counter != roll.change_counter() {
                let after_sent = self.p.clock.now();
                let Some(after) = self.roll().await else {
                    // The list was not balanced on: list again next cycle rather than skip
                    // balancing until the counter moves.
                    self.state.invalidate();
                    return;
                };
                self.take_in(&after, after_sent, self.p.clock.now());
            }
            self.state.listed(read, counter, now);
        } else {
            // The counter did not move since the last list, whose hints were sent: no request
            // was written before this read that the workers do not know of.
            self.view.confirm(sent);
        }
        let membership = match roll {
            Roll::Heartbeats(m) => Some((m, sent)),
            Roll::Head(_) => match self.lead_view(lapses).await {
                Ok(read) => read,
                Err(()) => {
                    // Judged from no read made after the list: plan on nothing, and list
                    // again next cycle.
                    self.state.invalidate();
                    return;
                }
            },
        };
        // The heartbeat read judged the live hosts anew (the leader, or an election): a host
        // judged dead there frees its leases now, not at the next cycle. The table was listed
        // before that read, as the judgment must be.
        let rejudged = membership.is_some() && self.state.rejudged();
        let synced = self.sync(now).await;
        self.estimate_unowned(now).await;
        if let Some((membership, sent)) = &membership {
            self.forget_dead_hosts(membership, *sent, lapses).await;
        }
        if !self.state.wants_plan(listed || synced || rejudged) {
            // Nothing changed hands and no request waits: the cached list is accurate.
            self.publish_gauges();
            return;
        }
        if self.cut_short(lapses) {
            // Stalled mid-cycle past the fence: what was read is stale, and a fenced host
            // neither takes nor asks.
            self.state.defer();
            return;
        }
        self.state.begin_plan();
        self.flush();
        self.adopt_own_leases().await;
        self.balance(now).await;
        self.publish_gauges();
    }

    /// Reads the head row, or every heartbeat if the store keeps no view; a failure is logged
    /// and ends the cycle.
    async fn roll(&self) -> Option<Roll> {
        match self.p.store.head(&self.p.group).await {
            Ok(Some(head)) => Some(Roll::Head(head)),
            Ok(None) => self.membership().await.map(Roll::Heartbeats),
            Err(err) => {
                warn!(error = %err, "reading the group's head row failed");
                self.p.callbacks.error(ErrorOrigin::Store, None, || {
                    format!("reading the group's head row failed: {err}")
                });
                None
            }
        }
    }

    /// Takes in a first read of the cycle that returned at `now`.
    fn take_in(&mut self, roll: &Roll, sent: Instant, now: Instant) {
        match roll {
            Roll::Head(head) => self.state.observe_head(head, now),
            Roll::Heartbeats(membership) => self.state.observe(membership, sent, now),
        }
    }

    /// With a view: when this host leads, or no view is fresh (a leader is needed), reads
    /// every heartbeat, judges them, and writes the view if this host leads (or is the first
    /// live host by its own judgment) and the view changes. Returns the membership read and
    /// when it was sent, for the removal of dead hosts' rows; an error if the read was needed
    /// and failed (then the cycle must not plan: without a view to go by, liveness is judged
    /// from this read).
    ///
    /// The order is the safety argument's (`docs/protocol.md`, "The membership view"): the
    /// view's version and the table were read before the heartbeats, so a host the view
    /// replaced let in has its row in this read, and the write is a CAS on that version.
    async fn lead_view(&mut self, lapses: u64) -> Result<Option<(Membership, Instant)>, ()> {
        let now = self.p.clock.now();
        if !self.state.needs_heartbeats(now) {
            self.link.lead_until(None);
            return Ok(None);
        }
        let sent = now;
        let membership = self.membership().await.ok_or(())?;
        let now = self.p.clock.now();
        self.state.observe(&membership, sent, now);
        // Renew as the leader until the fence would fall if this host leads a view that stays
        // up to date (its judgment is unchanged, or written below): a leader whose cycles stop
        // keeping it stops looking alive in the view within `E − M`, and the fleet elects
        // another; a slow cycle does not make it look dead.
        let lead_until = Some(now + self.p.settings.fence_after());
        let Some((view, expected)) = self.state.view_to_write(&membership, now) else {
            self.link
                .lead_until(self.state.leads().then_some(lead_until).flatten());
            return Ok(Some((membership, sent)));
        };
        if self.cut_short(lapses) {
            // Stalled past the fence since the cycle began: the judgment is stale.
            return Ok(Some((membership, sent)));
        }
        let changed = !self.state.same_view(&view);
        match self
            .p
            .store
            .write_view(&self.p.group, &view, expected)
            .await
        {
            Ok(stored) => {
                if changed {
                    info!(
                        version = stored.version,
                        live = stored.live.len(),
                        dead = stored.dead.len(),
                        "wrote the membership view"
                    );
                } else {
                    debug!(version = stored.version, "renewed the membership view");
                }
                self.state.view_written(stored, self.p.clock.now());
                self.link.lead_until(lead_until);
            }
            Err(LeaseError::ViewConflict { current, .. }) => {
                debug!("another host wrote the membership view first");
                self.state
                    .view_conflict(current.as_deref(), self.p.clock.now());
            }
            Err(err) => {
                warn!(error = %err, "writing the membership view failed");
                self.p.callbacks.error(ErrorOrigin::Store, None, || {
                    format!("writing the membership view failed: {err}")
                });
            }
        }
        Ok(Some((membership, sent)))
    }

    /// Reads the group's membership; a failure is logged and ends the cycle.
    async fn membership(&self) -> Option<Membership> {
        match self.p.store.membership(&self.p.group).await {
            Ok(m) => Some(m),
            Err(err) => {
                warn!(error = %err, "reading membership failed");
                self.p.callbacks.error(ErrorOrigin::Store, None, || {
                    format!("reading membership failed: {err}")
                });
                None
            }
        }
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
    async fn forget_dead_hosts(&mut self, membership: &Membership, sent: Instant, lapses: u64) {
        for hb in self.state.dead_rows(&membership.hosts) {
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
}
