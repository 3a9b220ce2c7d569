//! One worker per owned lease: read → deliver to the handler → checkpoint → repeat.
//!
//! The worker owns every write to its lease row while it runs ([`LeaseCell`]). Each write is a
//! compare-and-swap on the version it last saw. A conflict is not a loss: the worker adopts the
//! current row and, if it is still the owner, writes again; when the row carries a
//! `next_owner`, that same write hands the lease over (design, "Balancing"). Only a row owned by
//! someone else means the lease was lost.

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;
use tokio::sync::{mpsc, watch, Mutex};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use super::config::{CheckpointMode, Settings};
use super::handler::{CloseReason, Context, DeadLetter, DeadLetterSink, Handler};
use crate::clock::Clock;
use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{Batch, Continuation, HostName, Lease, LeaseState, PartitionId};
use crate::source::{FeedSource, PartitionReader};

/// What a lease write ended in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    /// Written; this host still owns the lease.
    Kept,
    /// Written, and the same write passed the lease to its `next_owner`.
    HandedOff,
}

/// The worker's view of its lease row, and the only path by which it writes it.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    lease: Mutex<Lease>,
    store: Arc<dyn LeaseStore>,
    host: HostName,
    /// Set once the lease has been handed off or lost: no more writes.
    done: watch::Sender<bool>,
    hooks: super::hooks::Hooks,
    /// Times the checkpoint latency histogram.
    clock: Arc<dyn Clock>,
}

impl LeaseCell {
    pub(crate) fn new(
        lease: Lease,
        store: Arc<dyn LeaseStore>,
        host: HostName,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            lease: Mutex::new(lease),
            store,
            host,
            done: watch::channel(false).0,
            hooks: super::hooks::Hooks::default(),
            clock,
        }
    }

    fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// Applies `change` to the row and writes it by CAS, adopting the current row and retrying
    /// while this host still owns it. A `next_owner` on the row turns the write into a
    /// hand-off (unless `change` finishes the lease, which also clears ownership).
    async fn write(&self, change: impl Fn(&mut Lease)) -> Result<WriteOutcome, LeaseError> {
        let mut lease = self.lease.lock().await;
        if self.is_done() {
            return Err(LeaseError::Conflict {
                key: lease.key.to_string(),
                expected: lease.version,
                current: Box::new(lease.clone()),
            });
        }
        loop {
            let mut next = lease.clone();
            change(&mut next);
            let handoff = next.state == LeaseState::Owned && next.next_owner.is_some();
            if handoff {
                next.owner = next.next_owner.take();
            }
            let started = self.clock.now();
            let result = self.store.replace(&next, lease.version).await;
            metrics::histogram!("changefeed_checkpoint_seconds").record(
                self.clock
                    .now()
                    .saturating_duration_since(started)
                    .as_secs_f64(),
            );
            match result {
                Ok(stored) => {
                    *lease = stored;
                    if handoff {
                        self.done.send_replace(true);
                        return Ok(WriteOutcome::HandedOff);
                    }
                    if lease.state != LeaseState::Owned {
                        self.done.send_replace(true);
                    }
                    return Ok(WriteOutcome::Kept);
                }
                Err(LeaseError::Conflict { current, .. })
                    if current.is_owned_by(&self.host) && current.keeps_continuation_of(&lease) =>
                {
                    debug!(lease = %lease.key, version = %current.version, "conflict; still the owner, retrying");
                    *lease = *current;
                }
                Err(LeaseError::Conflict { current, .. })
                    if self.hooks.checkpoint_without_cas() =>
                {
                    // Broken on purpose (simulator): overwrite whatever is there.
                    lease.version = current.version;
                }
                Err(err @ LeaseError::Conflict { .. }) => {
                    self.done.send_replace(true);
                    return Err(err);
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Moves the checkpoint to `continuation`.
    pub(crate) async fn checkpoint(
        &self,
        continuation: Continuation,
    ) -> Result<WriteOutcome, LeaseError> {
        self.write(|l| {
            l.continuation = Some(continuation.clone());
            // A checkpoint means the batches before it succeeded.
            l.properties.remove(FAILURES_PROPERTY);
        })
        .await
    }

    /// Marks the lease finished at `continuation` (its partition ended).
    async fn finish(&self, continuation: Option<Continuation>) -> Result<WriteOutcome, LeaseError> {
        self.write(|l| {
            if let Some(c) = &continuation {
                l.continuation = Some(c.clone());
            }
            l.state = LeaseState::Finished;
            l.owner = None;
            l.next_owner = None;
        })
        .await
    }

    /// Gives the lease up at `continuation` (or its last checkpoint): to its `next_owner` if
    /// one asked, otherwise to nobody. `failures` of the batch after it are recorded in the
    /// row, so the next owner keeps backing off.
    async fn release(
        &self,
        continuation: Option<Continuation>,
        failures: u32,
    ) -> Result<WriteOutcome, LeaseError> {
        self.write(|l| {
            if let Some(c) = &continuation {
                l.continuation = Some(c.clone());
                l.properties.remove(FAILURES_PROPERTY);
            }
            if failures > 0 {
                l.properties
                    .insert(FAILURES_PROPERTY.to_string(), failures.to_string());
            }
            if l.next_owner.is_none() {
                l.state = LeaseState::Available;
                l.owner = None;
            }
        })
        .await
    }

    /// Whether `row` is newer than the row this cell holds and owned by another host. When the
    /// cell is busy writing, a newer-looking row owned by another host is taken as lost.
    fn shows_lost(&self, row: &Lease) -> bool {
        if row.is_owned_by(&self.host) {
            return false;
        }
        self.lease
            .try_lock()
            .map_or(true, |lease| row.version > lease.version)
    }

    /// Whether `row` is newer than the row this cell holds and carries a hand-off request.
    fn shows_request(&self, row: &Lease) -> bool {
        row.next_owner.is_some()
            && self
                .lease
                .try_lock()
                .map_or(true, |lease| row.version > lease.version)
    }

    /// Takes in a newer row the host loop listed. Returns false if it shows the lease is no
    /// longer this host's.
    async fn observe(&self, listed: &Lease) -> bool {
        let mut lease = self.lease.lock().await;
        if listed.version <= lease.version {
            return true;
        }
        if listed.is_owned_by(&self.host) {
            *lease = listed.clone();
            true
        } else {
            false
        }
    }
}

impl Lease {
    /// Whether this row's continuation equals `other`'s, or `other` has none. A worker adopts
    /// a conflicting row only then: a continuation moved by anyone else (an operator's reset)
    /// means this worker's position is no longer the lease's.
    fn keeps_continuation_of(&self, other: &Lease) -> bool {
        other.continuation.is_none() || self.continuation == other.continuation
    }
}

/// The lease property counting failed calls of the batch after the checkpoint, across hosts.
pub(crate) const FAILURES_PROPERTY: &str = "changefeed.failures";

/// The failures recorded in `lease` by an earlier owner (0 if none or unreadable).
fn carried_failures(lease: &Lease) -> u32 {
    lease
        .properties
        .get(FAILURES_PROPERTY)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// How often a worker refreshes its partition's lag estimate, at most.
const LAG_REFRESH: Duration = Duration::from_secs(10);

/// The lag of every partition this host reads, summed into the `changefeed_lag_records`
/// gauge (label `group`).
#[derive(Debug, Default)]
pub(crate) struct LagBook {
    by_partition: std::sync::Mutex<std::collections::BTreeMap<PartitionId, u64>>,
}

impl LagBook {
    fn update(&self, group: &str, partition: &PartitionId, records: Option<u64>) {
        // The lock guards a small map whose every update is a single insert or remove.
        let mut map = self.by_partition.lock().unwrap_or_else(|p| p.into_inner());
        match records {
            Some(n) => map.insert(partition.clone(), n),
            None => map.remove(partition),
        };
        let total: u64 = map.values().sum();
        metrics::gauge!("changefeed_lag_records", "group" => group.to_string()).set(total as f64);
    }
}

/// Everything a worker needs.
pub(crate) struct WorkerArgs {
    pub lease: Lease,
    pub store: Arc<dyn LeaseStore>,
    pub source: Arc<dyn FeedSource>,
    pub handler: Arc<dyn Handler>,
    pub host: HostName,
    pub settings: Arc<Settings>,
    pub clock: Arc<dyn Clock>,
    pub cancel: CancellationToken,
    pub fenced: watch::Receiver<bool>,
    pub fence_deadline: super::heartbeat::FenceDeadline,
    pub view: super::heartbeat::ViewStamp,
    pub hint: watch::Receiver<Option<Lease>>,
    pub exits: mpsc::UnboundedSender<WorkerExit>,
    pub rng: SmallRng,
    pub group_label: String,
    pub hooks: super::hooks::Hooks,
    pub lag: Arc<LagBook>,
    pub dead_letter: Option<Arc<dyn DeadLetterSink>>,
}

/// Sent to the host loop when a worker stops.
#[derive(Debug)]
pub(crate) struct WorkerExit {
    pub partition: PartitionId,
    pub reason: CloseReason,
}

enum Step {
    Continue,
    Stop(CloseReason),
}

/// How a call (to the handler or the dead-letter sink) raced against the worker's deadlines
/// ended.
enum CallEnd<T> {
    /// The call returned.
    Returned(T),
    /// The call ran past `handler_timeout` and was cancelled.
    TimedOut(Duration),
    /// The call was cancelled: the worker must stop for this reason.
    Stop(CloseReason),
    /// The call was cancelled before a known hand-off request could be stolen: hand off.
    HandOff,
}

/// How delivering a batch ended.
enum Delivered {
    /// The handler accepted it.
    Done,
    /// It was handed to the dead-letter sink: checkpoint past it.
    DeadLettered,
    /// The worker must stop.
    Stop(CloseReason),
}

/// What a handler call in progress has confirmed of its lease, and its deadlines. Shared by
/// the check polled in the race and the race's branches, hence the interior mutability.
#[derive(Debug, Clone, Copy)]
struct CallGuard {
    /// Latest time by which every hand-off request written before it is known.
    confirmed: tokio::time::Instant,
    /// A hand-off request is known: `confirmed` no longer moves.
    frozen: bool,
    /// When a graceful stop cancels the call.
    stop_at: Option<tokio::time::Instant>,
    /// When `handler_timeout` cancels the call.
    timeout_at: Option<tokio::time::Instant>,
}

/// A [`CallGuard`] behind a lock that is only ever held for plain copies.
struct SharedGuard(std::sync::Mutex<CallGuard>);

impl SharedGuard {
    fn get(&self) -> CallGuard {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut CallGuard)) {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

struct Worker {
    args: WorkerArgs,
    cell: Arc<LeaseCell>,
    ctx: Context,
    /// Delivered to the handler but not yet checkpointed.
    pending: Option<Continuation>,
    last_checkpoint_at: tokio::time::Instant,
    last_lag_at: Option<tokio::time::Instant>,
    /// Fence lapses when this worker started; any later lapse stops it.
    lapses: u64,
    /// When this worker's own lease write or read last showed no hand-off request (the time
    /// it was sent).
    confirmed_at: Option<tokio::time::Instant>,
    /// Failed calls of the batch after the checkpoint, by every owner (from the lease row).
    failures: u32,
    /// The last checkpoint this worker knows of.
    checkpointed: Option<Continuation>,
}

/// Runs one worker to its end and reports why it stopped.
pub(crate) async fn run(args: WorkerArgs) {
    let partition = args.lease.key.partition.clone();
    let span = tracing::info_span!("worker", partition = %partition);
    let exits = args.exits.clone();
    let reason = async move {
        let mut cell = LeaseCell::new(
            args.lease.clone(),
            args.store.clone(),
            args.host.clone(),
            args.clock.clone(),
        );
        cell.hooks = args.hooks;
        let cell = Arc::new(cell);
        let ctx = Context {
            partition: args.lease.key.partition.clone(),
            key: args.lease.key.clone(),
            host: args.host.clone(),
            cell: cell.clone(),
            fencing_token: args.lease.version.0,
            cancel: CancellationToken::new(),
        };
        let now = args.clock.now();
        let fence_lapses = args.fence_deadline.lapses();
        let failures = carried_failures(&args.lease);
        let checkpointed = args.lease.continuation.clone();
        let mut worker = Worker {
            args,
            cell,
            ctx,
            pending: None,
            last_checkpoint_at: now,
            last_lag_at: None,
            lapses: fence_lapses,
            confirmed_at: None,
            failures,
            checkpointed,
        };
        let reason = worker.run().await;
        worker
            .args
            .lag
            .update(&worker.args.group_label, &worker.ctx.partition, None);
        worker.args.handler.close(&worker.ctx, reason).await;
        info!(reason = ?reason, "worker stopped");
        reason
    }
    .instrument(span)
    .await;
    // The host loop may already be gone during shutdown; nothing to tell then.
    let _ = exits.send(WorkerExit { partition, reason });
}

impl Worker {
    fn backoff(&mut self, attempt: u32) -> Duration {
        let s = &self.args.settings;
        let base = s
            .min_backoff
            .saturating_mul(2u32.saturating_pow(attempt.min(20)))
            .min(s.max_backoff);
        // Full jitter in [base/2, base].
        let jitter = self.args.rng.gen_range(0.5..=1.0);
        base.mul_f64(jitter)
    }

    /// Sleeps `d` unless cancelled or fenced first. Returns false if interrupted.
    async fn pause(&mut self, d: Duration) -> bool {
        let sleep = self.args.clock.sleep(d);
        let mut fenced = self.args.fenced.clone();
        tokio::select! {
            biased;
            _ = self.args.cancel.cancelled() => false,
            _ = fenced.wait_for(|f| *f), if !self.args.hooks.no_fencing() => false,
            _ = sleep => true,
        }
    }

    /// Fenced by the heartbeat task's flag, or past the deadline on our own reading of the
    /// clock (the heartbeat task may not have run yet after a stall).
    fn fenced(&self) -> bool {
        if self.args.hooks.no_fencing() {
            return false;
        }
        *self.args.fenced.borrow()
            || self.args.clock.now() >= self.args.fence_deadline.get()
            || self.args.fence_deadline.lapses() != self.lapses
    }

    async fn run(&mut self) -> CloseReason {
        let mut reader = match self.open_reader().await {
            Ok(Some(r)) => r,
            Ok(None) => return self.stop_reason(),
            Err(reason) => return reason,
        };
        if let Err(reason) = self.open_handler().await {
            return reason;
        }
        loop {
            match self.step(reader.as_mut()).await {
                Step::Continue => {}
                Step::Stop(CloseReason::Shutdown) => {
                    return self.shutdown().await;
                }
                Step::Stop(reason) => return reason,
            }
        }
    }

    fn stop_reason(&self) -> CloseReason {
        if self.args.cancel.is_cancelled() {
            CloseReason::Shutdown
        } else {
            CloseReason::LeaseLost
        }
    }

    async fn open_reader(&mut self) -> Result<Option<Box<dyn PartitionReader>>, CloseReason> {
        let position = self.args.lease.resume_position();
        let mut attempt = 0;
        loop {
            match self
                .args
                .source
                .open(&self.args.lease.key.partition, &position)
                .await
            {
                Ok(r) => return Ok(Some(r)),
                Err(err) if err.is_retryable() => {
                    warn!(lease = %self.args.lease.key, error = %err, "opening the partition failed; retrying");
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return Ok(None);
                    }
                }
                Err(err) => {
                    // An unknown continuation or partition: report it with the key, keep the
                    // checkpoint as it is, and give the lease back.
                    tracing::error!(lease = %self.args.lease.key, error = %err, "cannot read the partition; releasing the lease with its checkpoint unchanged");
                    metrics::counter!("changefeed_source_errors_total", "group" => self.args.group_label.clone()).increment(1);
                    return Err(self.release_or_lost(None, CloseReason::SourceFailed).await);
                }
            }
        }
    }

    async fn open_handler(&mut self) -> Result<(), CloseReason> {
        let mut attempt = 0;
        loop {
            match self.args.handler.open(&self.ctx).await {
                Ok(()) => return Ok(()),
                Err(err) => {
                    warn!(lease = %self.ctx.key, error = %err, "handler open failed");
                    if attempt >= self.args.settings.handler_max_retries {
                        return Err(self.release_or_lost(None, CloseReason::HandlerFailed).await);
                    }
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return Err(self.stop_reason());
                    }
                }
            }
        }
    }

    /// Reacts to a row the host loop listed: lost, or a hand-off to honour.
    async fn apply_hint(&mut self) -> Option<CloseReason> {
        let listed = self.args.hint.borrow_and_update().clone();
        let listed = listed?;
        self.react(&listed).await
    }

    /// Reacts to a newer row of this worker's lease, listed or read: stops if the lease
    /// belongs to another host now, hands it off if a hand-off is requested.
    async fn react(&mut self, row: &Lease) -> Option<CloseReason> {
        if !self.cell.observe(row).await {
            info!(lease = %row.key, owner = ?row.owner, "lease now belongs to another host");
            metrics::counter!("changefeed_leases_lost_total", "group" => self.args.group_label.clone()).increment(1);
            return Some(CloseReason::LeaseLost);
        }
        if row.next_owner.is_some() {
            return Some(self.hand_off().await);
        }
        None
    }

    /// A hand-off was requested: we are between batches, so write the position and pass it.
    async fn hand_off(&mut self) -> CloseReason {
        let pending = self.pending.take();
        self.release_or_lost(pending, CloseReason::HandedOff).await
    }

    /// Before a delivery: makes sure this worker would know of a hand-off request written
    /// more than `handoff_timeout − safety_margin` ago, after which the asker may steal the
    /// lease. The host loop confirms that every cycle (its [`super::heartbeat::ViewStamp`]);
    /// when it has not lately (a slow or cut-off store, a stall), the worker reads its own
    /// lease row and does not deliver until a read succeeds. Then it applies any hint.
    /// Returns a reason to stop, if any.
    async fn ensure_current(&mut self) -> Option<CloseReason> {
        // Half the horizon: a call started now may run for the other half before it must
        // see a newer confirmation (the host loop makes one every acquire cycle).
        if self.args.clock.now() >= self.confirmed() + self.handoff_horizon() / 2 {
            if let Some(reason) = self.refresh().await {
                return Some(reason);
            }
        }
        if self.args.hint.has_changed().unwrap_or(false) {
            return self.apply_hint().await;
        }
        None
    }

    /// Reads this worker's lease row until a read succeeds: stops if it is lost, hands it off
    /// if asked, and otherwise counts the read as a confirmation.
    async fn refresh(&mut self) -> Option<CloseReason> {
        debug!(lease = %self.ctx.key, "no recent confirmation of the lease; reading it before delivering");
        let mut attempt = 0;
        loop {
            if self.fenced() {
                return Some(CloseReason::LeaseLost);
            }
            let sent = self.args.clock.now();
            let mut fenced = self.args.fenced.clone();
            let read = tokio::select! {
                biased;
                _ = self.args.cancel.cancelled() => return Some(CloseReason::Shutdown),
                _ = fenced.wait_for(|f| *f), if !self.args.hooks.no_fencing() => {
                    return Some(CloseReason::LeaseLost)
                }
                r = self.args.store.get(&self.ctx.key) => r,
            };
            match read {
                Ok(Some(row)) => {
                    if let Some(reason) = self.react(&row).await {
                        return Some(reason);
                    }
                    self.confirmed_at = Some(sent);
                    return None;
                }
                Ok(None) => {
                    info!(lease = %self.ctx.key, "lease deleted; stopping");
                    return Some(CloseReason::LeaseLost);
                }
                Err(err) => {
                    warn!(lease = %self.ctx.key, error = %err, "reading the lease failed; not delivering until it succeeds");
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return Some(self.stop_reason());
                    }
                }
            }
        }
    }

    async fn step(&mut self, reader: &mut dyn PartitionReader) -> Step {
        if self.args.cancel.is_cancelled() {
            return Step::Stop(CloseReason::Shutdown);
        }
        if self.fenced() {
            warn!(lease = %self.ctx.key, "host fenced; stopping without further writes");
            return Step::Stop(CloseReason::LeaseLost);
        }
        if self.args.hint.has_changed().unwrap_or(false) {
            if let Some(reason) = self.apply_hint().await {
                return Step::Stop(reason);
            }
        }
        let batch = match self.read(reader).await {
            Ok(b) => b,
            Err(reason) => return Step::Stop(reason),
        };
        if !batch.records.is_empty() {
            if self.fenced() {
                warn!(lease = %self.ctx.key, "host fenced; the batch read is not delivered");
                return Step::Stop(CloseReason::LeaseLost);
            }
            if let Some(reason) = self.ensure_current().await {
                return Step::Stop(reason);
            }
            let force = match self.deliver(&batch).await {
                Delivered::Done => false,
                Delivered::DeadLettered => true,
                Delivered::Stop(reason) => return Step::Stop(reason),
            };
            self.pending = batch.continuation.clone();
            if let Some(reason) = self.maybe_checkpoint(force).await {
                return Step::Stop(reason);
            }
        }
        if batch.end_of_partition {
            return Step::Stop(self.finish().await);
        }
        if batch.records.is_empty() {
            // Idle: wait, but wake for shutdown, fencing or news about the lease.
            let sleep = self.args.clock.sleep(self.args.settings.poll_delay);
            let mut fenced = self.args.fenced.clone();
            tokio::select! {
                biased;
                _ = self.args.cancel.cancelled() => {}
                _ = fenced.wait_for(|f| *f), if !self.args.hooks.no_fencing() => {}
                _ = self.args.hint.changed() => {
                    // Re-mark it changed so the next step applies it.
                    self.args.hint.mark_changed();
                }
                _ = sleep => {}
            }
        }
        Step::Continue
    }

    /// Reads the next batch, retrying errors the source calls retryable with backoff. An
    /// error it does not (an unknown continuation, a partition gone) gives the lease back
    /// with its checkpoint, as a failed open does.
    async fn read(&mut self, reader: &mut dyn PartitionReader) -> Result<Batch, CloseReason> {
        let mut attempt = 0;
        loop {
            match reader.next_batch(self.args.settings.max_batch_size).await {
                Ok(b) => return Ok(b),
                Err(err) => {
                    let retryable = err.is_retryable();
                    warn!(lease = %self.ctx.key, error = %err, retryable, "reading the partition failed");
                    metrics::counter!("changefeed_source_errors_total", "group" => self.args.group_label.clone()).increment(1);
                    if !retryable {
                        tracing::error!(lease = %self.ctx.key, error = %err, "cannot read the partition; releasing the lease at its checkpoint");
                        let pending = self.pending.take();
                        return Err(self
                            .release_or_lost(pending, CloseReason::SourceFailed)
                            .await);
                    }
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return Err(self.stop_reason());
                    }
                }
            }
        }
    }

    /// Delivers a batch, retrying failures with backoff (the failures of earlier owners
    /// included), and hands it to the dead-letter sink once it has failed
    /// `dead_letter_after` times.
    async fn deliver(&mut self, batch: &Batch) -> Delivered {
        let mut calls = 0u32;
        loop {
            if self.failures > 0 {
                // Back off by every failure of this batch so far, on any host.
                let d = self.backoff(self.failures - 1);
                // A retry is a new delivery: the host may have been fenced meanwhile, and a
                // hand-off asked for is honoured at the last checkpoint instead.
                if !self.pause(d).await || self.fenced() {
                    return Delivered::Stop(self.stop_reason());
                }
                if let Some(reason) = self.ensure_current().await {
                    return Delivered::Stop(reason);
                }
            }
            calls += 1;
            let error = match self.call(batch).await {
                CallEnd::Returned(Ok(())) => {
                    let g = self.args.group_label.clone();
                    metrics::counter!("changefeed_batches_total", "group" => g.clone())
                        .increment(1);
                    metrics::counter!("changefeed_records_total", "group" => g)
                        .increment(batch.records.len() as u64);
                    self.failures = 0;
                    return Delivered::Done;
                }
                CallEnd::Returned(Err(err)) => err.to_string(),
                CallEnd::TimedOut(d) => {
                    metrics::counter!("changefeed_handler_timeouts_total", "group" => self.args.group_label.clone()).increment(1);
                    format!("the call ran longer than handler_timeout ({d:?}) and was cancelled")
                }
                CallEnd::Stop(reason) => return Delivered::Stop(reason),
                CallEnd::HandOff => return Delivered::Stop(self.hand_off().await),
            };
            metrics::counter!("changefeed_handler_errors_total", "group" => self.args.group_label.clone()).increment(1);
            self.failures = self.failures.saturating_add(1);
            warn!(lease = %self.ctx.key, %error, failures = self.failures, "handler failed; the batch will be retried");
            if let Some(reason) = self.dead_letter(batch, &error).await {
                return reason;
            }
            if calls > self.args.settings.handler_max_retries {
                // Give the lease back at its last checkpoint; nothing is skipped.
                let pending = self.pending.take();
                return Delivered::Stop(
                    self.release_or_lost(pending, CloseReason::HandlerFailed)
                        .await,
                );
            }
        }
    }

    /// Hands `batch` to the dead-letter sink if it has failed often enough. Returns
    /// [`Delivered::DeadLettered`] once the sink took it.
    async fn dead_letter(&mut self, batch: &Batch, error: &str) -> Option<Delivered> {
        let after = self.args.settings.dead_letter_after?;
        let sink = self.args.dead_letter.clone()?;
        if self.failures < after || self.fenced() {
            return None;
        }
        let letter = DeadLetter {
            key: self.ctx.key.clone(),
            host: self.args.host.clone(),
            batch: batch.clone(),
            after: self.pending.clone().or_else(|| self.checkpointed.clone()),
            error: error.to_string(),
            failures: self.failures,
        };
        match self.race(sink.dead_letter(&letter)).await {
            CallEnd::Returned(Ok(())) => {
                warn!(lease = %self.ctx.key, failures = self.failures, records = batch.records.len(), "batch dead-lettered; the checkpoint moves past it");
                metrics::counter!("changefeed_dead_letters_total", "group" => self.args.group_label.clone()).increment(1);
                self.failures = 0;
                Some(Delivered::DeadLettered)
            }
            CallEnd::Returned(Err(err)) => {
                warn!(lease = %self.ctx.key, error = %err, "writing the dead letter failed; the batch stays and is retried");
                None
            }
            CallEnd::TimedOut(d) => {
                warn!(lease = %self.ctx.key, "writing the dead letter took longer than handler_timeout ({d:?}); the batch stays and is retried");
                None
            }
            CallEnd::Stop(reason) => Some(Delivered::Stop(reason)),
            CallEnd::HandOff => Some(Delivered::Stop(self.hand_off().await)),
        }
    }

    /// Calls the handler, racing the call against the fence, the loss of the lease, a hand-off
    /// request that could be stolen, `handler_timeout` and the stop deadline. Biased towards
    /// those: every time the worker wakes, they are checked before the call is polled, so a
    /// host woken from a stall drops the call before it can do anything more.
    async fn call(&mut self, batch: &Batch) -> CallEnd<Result<(), super::HandlerError>> {
        let token = CancellationToken::new();
        self.ctx.cancel = token.clone();
        let handler = self.args.handler.clone();
        let ctx = self.ctx.clone();
        let call = handler.handle(&ctx, batch);
        if self.args.hooks.no_handler_fence() {
            // Broken on purpose (simulator): the call runs to its end.
            return CallEnd::Returned(call.await);
        }
        let end = self.race(call).await;
        if !matches!(end, CallEnd::Returned(_)) {
            // Tell work the handler spawned; the call itself was dropped by `race`.
            token.cancel();
            debug!(lease = %self.ctx.key, "handler call cancelled");
        }
        end
    }

    /// Runs `call` until it returns or one of the worker's deadlines passes (see [`Self::call`]),
    /// dropping it then.
    async fn race<T>(&mut self, call: impl std::future::Future<Output = T>) -> CallEnd<T> {
        let now = self.args.clock.now();
        let guard = SharedGuard(std::sync::Mutex::new(CallGuard {
            confirmed: self.confirmed(),
            frozen: false,
            stop_at: self
                .args
                .cancel
                .is_cancelled()
                .then(|| now + self.args.settings.stop_grace()),
            timeout_at: self.args.settings.handler_timeout.map(|d| now + d),
        }));
        let mut fenced = self.args.fenced.clone();
        let mut fence_open = !self.args.hooks.no_fencing();
        let mut hint = self.args.hint.clone();
        let mut hint_open = true;
        let cancel = self.args.cancel.clone();
        let clock = self.args.clock.clone();
        tokio::pin!(call);
        loop {
            if let Some(end) = self.check_call(&guard) {
                return end;
            }
            let wake = self.next_check(&guard);
            let sleep = clock.sleep(wake.saturating_duration_since(clock.now()));
            let check = std::future::poll_fn(|_| match self.check_call(&guard) {
                Some(end) => Poll::Ready(end),
                None => Poll::Pending,
            });
            tokio::select! {
                biased;
                end = check => return end,
                r = fenced.wait_for(|f| *f), if fence_open => fence_open = r.is_ok(),
                r = hint.changed(), if hint_open => hint_open = r.is_ok(),
                _ = cancel.cancelled(), if guard.get().stop_at.is_none() => {
                    let at = clock.now() + self.args.settings.stop_grace();
                    guard.update(|g| g.stop_at = Some(at));
                }
                _ = sleep => {}
                r = &mut call => return CallEnd::Returned(r),
            }
        }
    }

    /// Latest confirmation that this worker knows of every hand-off request.
    fn confirmed(&self) -> tokio::time::Instant {
        self.confirmed_at
            .map_or(self.args.view.get(), |c| c.max(self.args.view.get()))
    }

    /// After this much time from a confirmation, a hand-off request unknown to this worker may
    /// have been stolen.
    fn handoff_horizon(&self) -> Duration {
        self.args
            .settings
            .handoff_timeout
            .saturating_sub(self.args.settings.safety_margin)
    }

    /// Whether the call in progress must end now, and how.
    fn check_call<T>(&self, shared: &SharedGuard) -> Option<CallEnd<T>> {
        if self.fenced() {
            warn!(lease = %self.ctx.key, "host fenced during a handler call; cancelling it");
            return Some(CallEnd::Stop(CloseReason::LeaseLost));
        }
        // Read the view stamp before the hint: the host sends hints before it moves the stamp,
        // so a stamp that saw a request comes with a hint that shows it.
        let view = self.args.view.get();
        let mut guard = shared.get();
        if self.args.hint.has_changed().unwrap_or(false) {
            if let Some(row) = self.args.hint.borrow().as_ref() {
                if self.cell.shows_lost(row) {
                    info!(lease = %self.ctx.key, owner = ?row.owner, "lease now belongs to another host; cancelling the handler call");
                    return Some(CallEnd::Stop(CloseReason::LeaseLost));
                }
                if self.cell.shows_request(row) {
                    guard.frozen = true;
                }
            }
        }
        if !guard.frozen && view > guard.confirmed {
            guard.confirmed = view;
        }
        shared.update(|g| *g = guard);
        let now = self.args.clock.now();
        if now >= guard.confirmed + self.handoff_horizon() {
            if guard.frozen {
                info!(lease = %self.ctx.key, "a hand-off request is pending and the call ran until the asker may steal; cancelling it and handing off");
                return Some(CallEnd::HandOff);
            }
            warn!(lease = %self.ctx.key, "could not confirm the lease during a handler call; cancelling it");
            return Some(CallEnd::Stop(CloseReason::LeaseLost));
        }
        if guard.stop_at.is_some_and(|at| now >= at) {
            info!(lease = %self.ctx.key, "stopping: the batch in flight ran out of its grace; cancelling it");
            return Some(CallEnd::Stop(CloseReason::Shutdown));
        }
        if let (Some(at), Some(d)) = (guard.timeout_at, self.args.settings.handler_timeout) {
            if now >= at {
                return Some(CallEnd::TimedOut(d));
            }
        }
        None
    }

    /// When the next deadline of the call in progress falls.
    fn next_check(&self, guard: &SharedGuard) -> tokio::time::Instant {
        let guard = guard.get();
        let mut at = guard.confirmed + self.handoff_horizon();
        if !self.args.hooks.no_fencing() {
            at = at.min(self.args.fence_deadline.get());
        }
        for t in [guard.stop_at, guard.timeout_at].into_iter().flatten() {
            at = at.min(t);
        }
        at
    }

    /// Writes the pending checkpoint if the mode says it is due, or if `force`d (a batch
    /// handed to the dead-letter sink is checkpointed past in every mode).
    async fn maybe_checkpoint(&mut self, force: bool) -> Option<CloseReason> {
        let due = force
            || match self.args.settings.checkpoint_mode {
                CheckpointMode::EveryBatch => true,
                CheckpointMode::Interval(d) => {
                    self.args
                        .clock
                        .now()
                        .saturating_duration_since(self.last_checkpoint_at)
                        >= d
                }
                CheckpointMode::Manual => false,
            };
        if !due {
            return None;
        }
        let c = self.pending.clone()?;
        let mut attempt = 0;
        loop {
            let sent = self.args.clock.now();
            match self.cell.checkpoint(c.clone()).await {
                Ok(WriteOutcome::Kept) => {
                    // The CAS found no request on the row: as good as a read.
                    self.confirmed_at = Some(sent);
                    self.pending = None;
                    self.checkpointed = Some(c.clone());
                    self.last_checkpoint_at = self.args.clock.now();
                    self.refresh_lag(&c).await;
                    return None;
                }
                Ok(WriteOutcome::HandedOff) => {
                    self.pending = None;
                    metrics::counter!("changefeed_handoffs_given_total", "group" => self.args.group_label.clone()).increment(1);
                    return Some(CloseReason::HandedOff);
                }
                Err(err) if err.is_retryable() && !self.fenced() => {
                    warn!(lease = %self.ctx.key, error = %err, "checkpoint failed; retrying");
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return Some(self.stop_reason());
                    }
                }
                Err(err) => {
                    info!(lease = %self.ctx.key, error = %err, "checkpoint refused; lease lost");
                    metrics::counter!("changefeed_leases_lost_total", "group" => self.args.group_label.clone()).increment(1);
                    return Some(CloseReason::LeaseLost);
                }
            }
        }
    }

    /// Asks the source how far `checkpoint` is behind the end, at most every `LAG_REFRESH`.
    async fn refresh_lag(&mut self, checkpoint: &Continuation) {
        let now = self.args.clock.now();
        if self
            .last_lag_at
            .is_some_and(|t| now.saturating_duration_since(t) < LAG_REFRESH)
        {
            return;
        }
        self.last_lag_at = Some(now);
        match self
            .args
            .source
            .remaining(&self.ctx.partition, Some(checkpoint))
            .await
        {
            Ok(records) => {
                self.args
                    .lag
                    .update(&self.args.group_label, &self.ctx.partition, records)
            }
            Err(err) => debug!(lease = %self.ctx.key, error = %err, "lag estimate failed"),
        }
    }

    async fn finish(&mut self) -> CloseReason {
        let pending = self.pending.take();
        let mut attempt = 0;
        loop {
            match self.cell.finish(pending.clone()).await {
                Ok(_) => return CloseReason::PartitionEnded,
                Err(err) if err.is_retryable() && !self.fenced() => {
                    let d = self.backoff(attempt);
                    attempt += 1;
                    if !self.pause(d).await {
                        return self.stop_reason();
                    }
                }
                Err(err) => {
                    info!(lease = %self.ctx.key, error = %err, "could not mark the lease finished; lease lost");
                    return CloseReason::LeaseLost;
                }
            }
        }
    }

    /// Writes `pending` (if any) and gives the lease up (to its next owner if one asked).
    /// Returns `reason`, or `HandedOff` if the write handed it over, or `LeaseLost` if it was
    /// no longer ours.
    async fn release_or_lost(
        &mut self,
        pending: Option<Continuation>,
        reason: CloseReason,
    ) -> CloseReason {
        let pending = match self.args.settings.checkpoint_mode {
            CheckpointMode::Manual => None,
            _ => pending,
        };
        for attempt in 0..3 {
            match self.cell.release(pending.clone(), self.failures).await {
                Ok(WriteOutcome::HandedOff) => {
                    metrics::counter!("changefeed_handoffs_given_total", "group" => self.args.group_label.clone()).increment(1);
                    return CloseReason::HandedOff;
                }
                Ok(WriteOutcome::Kept) => return reason,
                Err(err) if err.is_retryable() && !self.fenced() => {
                    let d = self.backoff(attempt);
                    self.args.clock.sleep(d).await;
                }
                Err(err) => {
                    info!(lease = %self.ctx.key, error = %err, "release refused; lease already lost");
                    return CloseReason::LeaseLost;
                }
            }
        }
        warn!(lease = %self.ctx.key, "release failed; the lease will expire with this host");
        reason
    }

    async fn shutdown(&mut self) -> CloseReason {
        if self.fenced() {
            return CloseReason::LeaseLost;
        }
        let pending = self.pending.take();
        match self.release_or_lost(pending, CloseReason::Shutdown).await {
            CloseReason::HandedOff => CloseReason::Shutdown,
            other => other,
        }
    }
}
