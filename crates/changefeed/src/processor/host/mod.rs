//! The host's shell: every acquire interval it runs a cycle of [`HostState`], carrying out the
//! store calls and effects the state asks for, in its order; one worker per owned lease; the
//! bounded graceful stop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use super::builder::Processor;
use super::heartbeat::{self, ProcessorError};
use super::host_state::{HostState, Now, StateConfig};
use super::retry::{Backoff, Policy, Retry};
use super::{sync, worker};
use crate::error::LeaseError;
use crate::model::{Heartbeat, Lease, PartitionId};

mod exec;
mod feed;

/// A running worker's handles: how to stop it and how to tell it of a newer row.
struct WorkerSlot {
    cancel: CancellationToken,
    hint: watch::Sender<Option<Lease>>,
}

/// The async shell around [`HostState`]: store calls, the heartbeat task, workers.
pub(super) struct Host {
    processor: Processor,
    group_label: String,
    /// Every decision, and the state they are made on (pure).
    state: HostState,
    workers: HashMap<PartitionId, WorkerSlot>,
    /// The worker tasks. A `JoinSet` rather than a `TaskTracker`: dropping the host (a stop
    /// that gave up, a killed processor) aborts them, so no worker outlives its host and
    /// delivers on a lease nobody renews.
    worker_tasks: JoinSet<()>,
    worker_cancel: CancellationToken,
    exits_tx: mpsc::UnboundedSender<worker::WorkerExit>,
    exits_rx: mpsc::UnboundedReceiver<worker::WorkerExit>,
    fenced_tx: watch::Sender<bool>,
    fence_deadline: heartbeat::FenceDeadline,
    /// When this host last confirmed its workers know of every hand-off request.
    stamp: heartbeat::ViewStamp,
    /// Shared with the heartbeat task: the current incarnation, and whether it renews as the
    /// membership view's leader.
    heartbeat_link: heartbeat::ViewLink,
    /// The leader's partition sync and cleanup (runs only while this host leads).
    syncer: sync::Syncer,
    /// Lag per owned partition, for the `changefeed_lag_records` gauge.
    lag: Arc<worker::LagBook>,
    /// Load per owned lease, published with the heartbeat.
    loads: Arc<super::load::LoadBook>,
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
            fence_after: p.settings.fence_after(),
            sync_interval: p.settings.sync_interval,
            strategy: p.strategy.clone(),
            group: p.group.clone(),
        };
        let fence_deadline = heartbeat::FenceDeadline::new(fence_at, p.settings.unhealthy_after());
        // Registered: from now on the host's health reads its fence record.
        p.health.registered(fence_deadline.clone());
        Self {
            group_label: p.group.to_string(),
            state: HostState::new(p.host.clone(), config, p_now),
            syncer: sync::Syncer::new(p.callbacks.clone()),
            lag: Arc::new(worker::LagBook::new(p.settings.lag_per_partition)),
            loads: Arc::new(super::load::LoadBook::new(&p.settings)),
            processor: p,
            workers: HashMap::new(),
            worker_tasks: JoinSet::new(),
            worker_cancel: CancellationToken::new(),
            exits_tx,
            exits_rx,
            fenced_tx: watch::channel(false).0,
            fence_deadline,
            stamp: heartbeat::ViewStamp::new(p_now),
            heartbeat_link: heartbeat::ViewLink::new(Arc::from("")),
        }
    }

    pub(super) async fn run(
        mut self,
        cancel: CancellationToken,
        row: Heartbeat,
    ) -> Result<(), ProcessorError> {
        // Workers stop with the caller's token too (a child of it), and on their own when the
        // host stops for another reason (its heartbeat task ended).
        self.worker_cancel = cancel.child_token();
        self.state.registered_as(row.incarnation.clone());
        self.heartbeat_link = heartbeat::ViewLink::new(row.incarnation.clone());
        let hb_cancel = CancellationToken::new();
        let mut hb_task = JoinSet::new();
        let s = &self.processor.settings;
        hb_task.spawn(
            heartbeat::run(
                self.processor.store.clone(),
                self.processor.clock.clone(),
                row.clone(),
                s.renew_interval,
                s.fence_after(),
                self.fenced_tx.clone(),
                hb_cancel.clone(),
                // A renewal counts only if it completed within the safety margin of being sent.
                s.safety_margin.min(s.renew_interval),
                self.fence_deadline.clone(),
                self.processor.callbacks.clone(),
                self.heartbeat_link.clone(),
                self.loads.clone(),
            )
            .in_current_span(),
        );
        let mut next_cycle = self.processor.clock.now();
        let mut outcome = Ok(());
        let mut fence = self.fenced_tx.subscribe();
        loop {
            let wait = next_cycle.saturating_duration_since(self.processor.clock.now());
            let sleep = self.processor.clock.sleep(wait);
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
                        next_cycle = self.processor.clock.now();
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
                    next_cycle = self.processor.clock.now() + self.state.cycle_interval();
                }
            }
        }
        // Graceful stop, bounded by shutdown_timeout: workers release their leases first (the
        // batch in flight may run for half of it), then the heartbeat goes.
        self.processor.health.stopping();
        let stop_at = self.processor.clock.now() + self.processor.settings.shutdown_timeout;
        info!("stopping: releasing leases");
        self.worker_cancel.cancel();
        let workers_by = stop_at - self.processor.settings.shutdown_timeout / 4;
        let drained = {
            let tasks = &mut self.worker_tasks;
            let wait = async { while tasks.join_next().await.is_some() {} };
            let limit = self
                .processor
                .clock
                .sleep(workers_by.saturating_duration_since(self.processor.clock.now()));
            // Biased, as every select of the host: an unbiased one picks among ready branches
            // by a random draw the simulator's seed does not govern, and a run would not repeat.
            tokio::select! {
                biased;
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
            let left = stop_at.saturating_duration_since(self.processor.clock.now());
            let rng = SmallRng::seed_from_u64(self.processor.rng.gen());
            let remove = async {
                self.abdicate().await;
                self.remove_own_heartbeat(row, rng).await;
            };
            tokio::select! {
                biased;
                _ = remove => {}
                _ = self.processor.clock.sleep(left.max(Duration::from_millis(100))) => {
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
            .processor
            .store
            .write_view(&self.processor.group, &view, expected)
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
        let backoff = Backoff::new(&self.processor.settings);
        let mut retry = Retry::new(Policy::REMOVE_HEARTBEAT);
        loop {
            let err = match self
                .processor
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
                    self.processor
                        .clock
                        .sleep(backoff.delay(attempt, &mut rng))
                        .await;
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

    /// The fence as the state needs it, read now.
    fn now(&self) -> Now {
        let at = self.processor.clock.now();
        Now {
            at,
            fenced: self.fence_deadline.is_fenced(at),
            lapses: self.fence_deadline.lapses(),
        }
    }

    /// One cycle: the state decides each step; the shell carries out its effects and calls,
    /// in order, and answers each call.
    async fn cycle(&mut self) {
        while self.worker_tasks.try_join_next().is_some() {}
        self.state.registered_as(self.heartbeat_link.incarnation());
        self.state.tick(self.now());
        loop {
            let ready = self.state.ready(self.now());
            for effect in ready.effects {
                self.apply(effect);
            }
            let Some(call) = ready.call else {
                return;
            };
            let answer = self.execute(call).await;
            self.state.advance(answer, self.now());
        }
    }
}
