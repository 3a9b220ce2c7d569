//! One worker per owned lease: read → deliver to the handler → checkpoint → repeat.
//!
//! The worker owns every write to its lease row while it runs ([`LeaseCell`], in `cell.rs`).
//! It stops when the lease is lost, handed off, finished or released, when the processor stops,
//! or when its host is fenced. The parts:
//!
//! - this file: the worker's state, its read → deliver → checkpoint loop, and opening the
//!   reader and the handler;
//! - `call.rs`: delivering a batch, the handler call raced against every deadline that may end
//!   it, and the dead-letter sink;
//! - `confirm.rs`: what the worker knows of its lease between writes (the host loop's hints,
//!   its own reads), and the hand-off confirmations a delivery needs;
//! - `checkpoint.rs`: checkpointing, finishing, releasing and handing the lease off;
//! - `lag.rs`: the lag of the partitions this host reads, published as gauges;
//! - `../retry.rs`: the one retry policy every retried operation follows (the host's too);
//! - `cell.rs`: the lease row and its compare-and-swap writes.
//!
//! Whether the host is fenced is asked of one place, [`Fence`]; the host's heartbeat task
//! keeps the record ([`FenceDeadline`]).

mod call;
mod cell;
mod checkpoint;
mod confirm;
mod lag;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

pub(crate) use cell::LeaseCell;
pub(crate) use lag::{LagBook, PartitionLag};

use self::call::Delivered;
use self::cell::carried_failures;
use super::callbacks::{Callbacks, ErrorOrigin};
use super::config::Settings;
use super::handler::{CloseReason, Context, DeadLetterSink, Handler};
use super::heartbeat::{FenceDeadline, ViewStamp};
use super::hooks::Hooks;
use super::retry::{Backoff, GaveUp, Policy, Retry};
use crate::clock::Clock;
use crate::lease::LeaseStore;
use crate::model::{Batch, Continuation, HostName, Lease, PartitionId};
use crate::source::{FeedSource, PartitionReader};

/// How often a worker refreshes its partition's lag estimate, at most.
const LAG_REFRESH: Duration = Duration::from_secs(10);

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
    /// Rings when the heartbeat task raises the fence (read through [`Fence`]).
    pub fenced: watch::Receiver<bool>,
    /// The host's fence (read through [`Fence`]).
    pub fence_deadline: FenceDeadline,
    pub view: ViewStamp,
    pub hint: watch::Receiver<Option<Lease>>,
    pub exits: mpsc::UnboundedSender<WorkerExit>,
    pub rng: SmallRng,
    pub group_label: String,
    pub hooks: Hooks,
    pub lag: Arc<LagBook>,
    pub loads: Arc<super::load::LoadBook>,
    pub dead_letter: Option<Arc<dyn DeadLetterSink>>,
    pub callbacks: Arc<Callbacks>,
}

/// Sent to the host loop when a worker stops.
#[derive(Debug)]
pub(crate) struct WorkerExit {
    pub partition: PartitionId,
    pub reason: CloseReason,
}

/// The worker's one answer to "is my host fenced?", and a wake-up for when it may have
/// become so.
///
/// The answer is the host's [`FenceDeadline`] (raised by the heartbeat task, or past its
/// deadline on this worker's own reading of the clock, or lapsed since this worker started:
/// see [`FenceDeadline::fenced_since`]). The heartbeat task's watch only wakes a worker that
/// waits; it is never read for the answer.
struct Fence {
    record: FenceDeadline,
    /// The record's lapses when this worker started: any later one stops it.
    lapses: u64,
    doorbell: watch::Receiver<bool>,
    clock: Arc<dyn Clock>,
    /// The simulator's `NoFencing` bug: the worker ignores the fence.
    ignored: bool,
}

impl Fence {
    fn new(args: &WorkerArgs) -> Self {
        Self {
            record: args.fence_deadline.clone(),
            lapses: args.fence_deadline.lapses(),
            doorbell: args.fenced.clone(),
            clock: args.clock.clone(),
            ignored: args.hooks.no_fencing(),
        }
    }

    /// Whether this worker must stop delivering and writing now.
    fn is_up(&self) -> bool {
        !self.ignored && self.record.fenced_since(self.clock.now(), self.lapses)
    }

    /// When the host is fenced unless a renewal moves the deadline first (`None` if ignored).
    fn deadline(&self) -> Option<Instant> {
        (!self.ignored).then(|| self.record.get())
    }

    /// Completes once the heartbeat task has raised the fence; never when the fence is
    /// ignored or the heartbeat task is gone (the deadline still holds then: see
    /// [`Fence::is_up`]).
    fn raised(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut doorbell = self.doorbell.clone();
        let ignored = self.ignored;
        async move {
            if ignored || doorbell.wait_for(|raised| *raised).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

enum Step {
    Continue,
    Stop(CloseReason),
}

/// What follows a failed attempt of a retried operation.
enum Next {
    /// The backoff was waited out: try again.
    Retry,
    /// A stop or the fence ended the wait.
    Interrupted,
    /// The policy gives up.
    GaveUp(GaveUp),
}

struct Worker {
    args: WorkerArgs,
    cell: Arc<LeaseCell>,
    ctx: Context,
    fence: Fence,
    backoff: Backoff,
    /// Delivered to the handler but not yet checkpointed.
    pending: Option<Continuation>,
    last_checkpoint_at: Instant,
    last_lag_at: Option<Instant>,
    /// When the worker last asked the source for its first unread record's time while idle.
    last_age_at: Option<Instant>,
    /// When this worker's own lease write or read last showed no hand-off request (the time
    /// it was sent).
    confirmed_at: Option<Instant>,
    /// Failed calls of the batch after the checkpoint, by every owner (from the lease row).
    failures: u32,
    /// The last checkpoint this worker knows of.
    checkpointed: Option<Continuation>,
    /// When the handler was last called (or the worker started): the idle tick's clock.
    last_call_at: Instant,
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
        let mut worker = Worker {
            fence: Fence::new(&args),
            backoff: Backoff::new(&args.settings),
            last_checkpoint_at: args.clock.now(),
            last_call_at: args.clock.now(),
            failures: carried_failures(&args.lease),
            checkpointed: args.lease.continuation.clone(),
            args,
            cell,
            ctx,
            pending: None,
            last_lag_at: None,
            last_age_at: None,
            confirmed_at: None,
        };
        worker.args.callbacks.lease_acquired(&worker.ctx.partition);
        let reason = worker.run().await;
        worker.args.loads.forget(&worker.ctx.partition);
        worker.args.lag.remove(
            &worker.args.group_label,
            &worker.ctx.partition,
            worker.args.clock.wall(),
        );
        worker.args.handler.close(&worker.ctx, reason).await;
        worker
            .args
            .callbacks
            .lease_released(&worker.ctx.partition, reason);
        info!(reason = ?reason, "worker stopped");
        reason
    }
    .instrument(span)
    .await;
    // The host loop may already be gone during shutdown; nothing to tell then.
    let _ = exits.send(WorkerExit { partition, reason });
}

impl Worker {
    /// Sleeps `d` unless stopped or fenced first. Returns false if interrupted.
    async fn pause(&mut self, d: Duration) -> bool {
        let sleep = self.args.clock.sleep(d);
        tokio::select! {
            biased;
            _ = self.args.cancel.cancelled() => false,
            _ = self.fence.raised() => false,
            _ = sleep => true,
        }
    }

    /// Waits out the backoff before retry `attempt` of what `policy` retries.
    async fn back_off(&mut self, policy: Policy, attempt: u32) -> bool {
        let d = self.backoff.delay(attempt, &mut self.args.rng);
        debug!(lease = %self.ctx.key, what = policy.what(), attempt, delay = ?d, "backing off before retrying");
        if policy.stop_ends_wait() {
            self.pause(d).await
        } else {
            self.args.clock.sleep(d).await;
            true
        }
    }

    /// After a failed attempt of `retry`'s operation (`retryable`: what the error's seam says
    /// of it): gives up by its policy, or waits out the backoff before the next attempt.
    async fn after_failure(&mut self, retry: &mut Retry, retryable: bool) -> Next {
        match retry.failed(retryable, || self.fence.is_up()) {
            Err(why) => Next::GaveUp(why),
            Ok(attempt) => {
                if self.back_off(retry.policy(), attempt).await {
                    Next::Retry
                } else {
                    Next::Interrupted
                }
            }
        }
    }

    async fn run(&mut self) -> CloseReason {
        // A stop that comes while the reader or the handler is still being opened (a handler
        // that keeps failing to start spends its time in the backoff between attempts) still
        // releases the lease: the host removes its heartbeat row next, and a lease whose
        // owner left no row would otherwise stay owned by nobody alive.
        let mut reader = match self.open_reader().await {
            Ok(Some(r)) => r,
            Ok(None) => return self.stopped_before_delivering(self.stop_reason()).await,
            Err(reason) => return reason,
        };
        if let Err(reason) = self.open_handler().await {
            return self.stopped_before_delivering(reason).await;
        }
        self.refresh_age().await;
        loop {
            match self.step(reader.as_mut()).await {
                Step::Continue => {}
                Step::Stop(CloseReason::Shutdown) => {
                    self.stopping(false).await;
                    return self.shutdown().await;
                }
                Step::Stop(reason) => return reason,
            }
        }
    }

    /// Tells the program's [`on_error`](super::ProcessorBuilder::on_error) of a failure on
    /// this worker's partition.
    fn notify(&self, origin: ErrorOrigin, message: impl FnOnce() -> String) {
        self.args
            .callbacks
            .error(origin, Some(&self.ctx.partition), message);
    }

    /// Ends a worker that stopped before its first delivery: a graceful stop releases the
    /// lease (nothing was delivered, so there is nothing to checkpoint); any other reason is
    /// returned as it is.
    async fn stopped_before_delivering(&mut self, reason: CloseReason) -> CloseReason {
        match reason {
            CloseReason::Shutdown => self.shutdown().await,
            other => other,
        }
    }

    fn stop_reason(&self) -> CloseReason {
        if self.args.cancel.is_cancelled() {
            CloseReason::Shutdown
        } else {
            CloseReason::LeaseLost
        }
    }

    /// Opens the partition at the lease's position ([`Policy::OPEN_READER`]). `Ok(None)`: a
    /// stop or the fence came first.
    async fn open_reader(&mut self) -> Result<Option<Box<dyn PartitionReader>>, CloseReason> {
        let position = self.args.lease.resume_position();
        let mut retry = Retry::new(Policy::OPEN_READER);
        loop {
            let err = match self
                .args
                .source
                .open(&self.args.lease.key.partition, &position)
                .await
            {
                Ok(r) => return Ok(Some(r)),
                Err(err) => err,
            };
            if err.is_retryable() {
                warn!(lease = %self.args.lease.key, error = %err, "opening the partition failed; retrying");
            }
            self.notify(ErrorOrigin::Source, || {
                format!("opening the partition failed: {err}")
            });
            match self.after_failure(&mut retry, err.is_retryable()).await {
                Next::Retry => {}
                Next::Interrupted => return Ok(None),
                Next::GaveUp(_) => {
                    // An unknown continuation or partition: report it with the key, keep the
                    // checkpoint as it is, and give the lease back.
                    tracing::error!(lease = %self.args.lease.key, error = %err, "cannot read the partition; releasing the lease with its checkpoint unchanged");
                    metrics::counter!("changefeed_source_errors_total", "group" => self.args.group_label.clone()).increment(1);
                    return Err(self.release_or_lost(None, CloseReason::SourceFailed).await);
                }
            }
        }
    }

    /// Calls [`Handler::open`] ([`Policy::open_handler`]).
    async fn open_handler(&mut self) -> Result<(), CloseReason> {
        let mut retry = Retry::new(Policy::open_handler(self.args.settings.handler_max_retries));
        loop {
            let Err(err) = self.args.handler.open(&self.ctx).await else {
                return Ok(());
            };
            warn!(lease = %self.ctx.key, error = %err, "handler open failed");
            self.notify(ErrorOrigin::Handler, || {
                format!("Handler::open failed: {err}")
            });
            match self.after_failure(&mut retry, true).await {
                Next::Retry => {}
                Next::Interrupted => return Err(self.stop_reason()),
                Next::GaveUp(_) => {
                    return Err(self.release_or_lost(None, CloseReason::HandlerFailed).await)
                }
            }
        }
    }

    async fn step(&mut self, reader: &mut dyn PartitionReader) -> Step {
        if self.args.cancel.is_cancelled() {
            return Step::Stop(CloseReason::Shutdown);
        }
        if self.fence.is_up() {
            warn!(lease = %self.ctx.key, "host fenced; stopping without further writes");
            return Step::Stop(CloseReason::LeaseLost);
        }
        if self.args.hint.has_changed().unwrap_or(false) {
            if let Some(reason) = self.apply_hint().await {
                return Step::Stop(reason);
            }
        }
        let batch = match self.read(reader).await {
            Ok(b) => Arc::new(b),
            Err(reason) => return Step::Stop(reason),
        };
        if batch.records.is_empty() && batch.continuation.is_some() {
            // The reader restated its place (PartitionReader::next_batch): nothing to deliver,
            // a position to keep, checkpointed as a batch's would be (and finished at).
            if self.fence.is_up() {
                warn!(lease = %self.ctx.key, "host fenced; the place restated is not checkpointed");
                return Step::Stop(CloseReason::LeaseLost);
            }
            self.pending = batch.continuation.clone();
            if let Some(reason) = self.maybe_checkpoint(false).await {
                return Step::Stop(reason);
            }
        }
        let idle_tick = batch.records.is_empty() && !batch.end_of_partition && self.tick_due();
        if !batch.records.is_empty() || idle_tick {
            if self.fence.is_up() {
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
            self.last_call_at = self.args.clock.now();
            if idle_tick {
                // An empty batch moves no position: nothing to checkpoint.
                return Step::Continue;
            }
            self.pending = batch.continuation.clone();
            if let Some(reason) = self.maybe_checkpoint(force).await {
                return Step::Stop(reason);
            }
        }
        if batch.end_of_partition {
            return Step::Stop(self.finish().await);
        }
        if batch.records.is_empty() {
            self.refresh_age().await;
            // Idle: wait, but wake for shutdown, fencing or news about the lease.
            let sleep = self.args.clock.sleep(self.idle_wait());
            tokio::select! {
                biased;
                _ = self.args.cancel.cancelled() => {}
                _ = self.fence.raised() => {}
                _ = self.args.hint.changed() => {
                    // Re-mark it changed so the next step applies it.
                    self.args.hint.mark_changed();
                }
                _ = sleep => {}
            }
        }
        Step::Continue
    }

    /// Whether the idle tick is due: [`Settings::max_wait_time`] has passed since the handler
    /// was last called.
    fn tick_due(&self) -> bool {
        self.args.settings.max_wait_time.is_some_and(|d| {
            self.args
                .clock
                .now()
                .saturating_duration_since(self.last_call_at)
                >= d
        })
    }

    /// How long an idle worker waits before reading again: `poll_delay`, or less when the idle
    /// tick falls due sooner.
    fn idle_wait(&self) -> Duration {
        let poll = self.args.settings.poll_delay;
        match self.args.settings.max_wait_time {
            Some(d) => {
                let due = self.last_call_at + d;
                poll.min(due.saturating_duration_since(self.args.clock.now()))
                    .max(Duration::from_millis(1))
            }
            None => poll,
        }
    }

    /// Reads the next batch ([`Policy::READ_BATCH`]). An error the source calls final (an
    /// unknown continuation, a partition gone) gives the lease back at its checkpoint, as a
    /// failed open does.
    async fn read(&mut self, reader: &mut dyn PartitionReader) -> Result<Batch, CloseReason> {
        let mut retry = Retry::new(Policy::READ_BATCH);
        loop {
            let err = match reader.next_batch(self.args.settings.max_batch_size).await {
                Ok(b) => return Ok(b),
                Err(err) => err,
            };
            let retryable = err.is_retryable();
            warn!(lease = %self.ctx.key, error = %err, retryable, "reading the partition failed");
            self.notify(ErrorOrigin::Source, || {
                format!("reading the partition failed: {err}")
            });
            metrics::counter!("changefeed_source_errors_total", "group" => self.args.group_label.clone()).increment(1);
            match self.after_failure(&mut retry, retryable).await {
                Next::Retry => {}
                Next::Interrupted => return Err(self.stop_reason()),
                Next::GaveUp(_) => {
                    tracing::error!(lease = %self.ctx.key, error = %err, "cannot read the partition; releasing the lease at its checkpoint");
                    let pending = self.pending.take();
                    return Err(self
                        .release_or_lost(pending, CloseReason::SourceFailed)
                        .await);
                }
            }
        }
    }
}
