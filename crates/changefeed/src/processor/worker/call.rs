//! Delivering a batch: the handler call raced against every deadline that may end it, retried
//! with backoff ([`Policy::handler_call`]), and handed to the dead-letter sink once it has
//! failed often enough.
//!
//! The race is the fence over the call in flight (`docs/protocol.md`, "The fencing
//! guarantee"): the call is dropped the moment the host is fenced, the lease is lost, a
//! hand-off request could be stolen from under it, `handler_timeout` passes or a graceful stop
//! has waited its grace, each checked on the host's own clock before the call is polled again.

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Next, Worker};
use crate::model::Batch;
use crate::processor::callbacks::ErrorOrigin;
use crate::processor::handler::{CloseReason, DeadLetter, HandlerError};
use crate::processor::retry::{Policy, Retry};

/// How a call (to the handler or the dead-letter sink) raced against the worker's deadlines
/// ended.
pub(super) enum CallEnd<T> {
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
pub(super) enum Delivered {
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
    confirmed: Instant,
    /// A hand-off request is known: `confirmed` no longer moves.
    frozen: bool,
    /// When a graceful stop cancels the call.
    stop_at: Option<Instant>,
    /// When `handler_timeout` cancels the call.
    timeout_at: Option<Instant>,
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

impl Worker {
    /// Delivers a batch, retrying failures with backoff ([`Policy::handler_call`], the
    /// failures of earlier owners included), and hands it to the dead-letter sink once it has
    /// failed `dead_letter_after` times.
    pub(super) async fn deliver(&mut self, batch: &Arc<Batch>) -> Delivered {
        let mut retry = Retry::carrying(
            Policy::handler_call(self.args.settings.handler_max_retries),
            self.failures,
        );
        if let Some(attempt) = retry.carried_attempt() {
            // Earlier owners failed this batch: back off from where they left off.
            if !self.back_off(retry.policy(), attempt).await {
                return Delivered::Stop(self.stop_reason());
            }
            if let Some(stop) = self.may_retry().await {
                return stop;
            }
        }
        loop {
            let started = self.args.clock.now();
            let end = self.call(batch).await;
            self.measure(batch, &end, started);
            let error = match end {
                CallEnd::Returned(Ok(())) if batch.records.is_empty() => {
                    // An idle tick: not a batch.
                    self.failures = 0;
                    return Delivered::Done;
                }
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
            self.notify(ErrorOrigin::Handler, || error.clone());
            if let Some(reason) = self.dead_letter(batch, &error).await {
                return reason;
            }
            match self.after_failure(&mut retry, true).await {
                Next::Retry => {
                    if let Some(stop) = self.may_retry().await {
                        return stop;
                    }
                }
                Next::Interrupted => return Delivered::Stop(self.stop_reason()),
                Next::GaveUp(_) => {
                    // Give the lease back at its last checkpoint; nothing is skipped.
                    let pending = self.pending.take();
                    return Delivered::Stop(
                        self.release_or_lost(pending, CloseReason::HandlerFailed)
                            .await,
                    );
                }
            }
        }
    }

    /// Adds a call that started at `started` to the lease's load: its time whatever its end,
    /// its records and bytes when it succeeded.
    fn measure<E>(&self, batch: &Batch, end: &CallEnd<Result<(), E>>, started: Instant) {
        let now = self.args.clock.now();
        let (records, bytes) = match end {
            CallEnd::Returned(Ok(())) => (
                batch.records.len(),
                batch.records.iter().map(|r| r.data.len()).sum(),
            ),
            _ => (0, 0),
        };
        self.args.loads.record(
            &self.ctx.partition,
            records,
            bytes,
            now.saturating_duration_since(started),
            now,
        );
    }

    /// Calls [`Handler::stopping`](crate::processor::Handler::stopping) between batches, once
    /// a graceful stop reached this worker or, `handing_off`, once a hand-off request did; raced
    /// like a batch call (the stop's grace, the fence, the loss of the lease, and a known
    /// request's steal horizon, counted from the confirmation before it). Whatever it ends
    /// with, the stop or the hand-off goes on.
    pub(super) async fn stopping(&mut self, handing_off: bool) {
        if self.fence.is_up() {
            return;
        }
        let token = CancellationToken::new();
        self.ctx.cancel = token.clone();
        let handler = self.args.handler.clone();
        let ctx = self.ctx.clone();
        match self.race_from(handler.stopping(&ctx), handing_off).await {
            CallEnd::Returned(Ok(())) => {}
            CallEnd::Returned(Err(err)) => {
                warn!(lease = %self.ctx.key, error = %err, "the handler's stopping call failed; stopping anyway");
                self.notify(ErrorOrigin::Handler, || {
                    format!("Handler::stopping failed: {err}")
                });
            }
            CallEnd::TimedOut(_) | CallEnd::Stop(_) | CallEnd::HandOff => {
                token.cancel();
                debug!(lease = %self.ctx.key, "the handler's stopping call was cut short");
            }
        }
    }

    /// After the backoff, before the handler is called again with a failed batch: a retry is
    /// a new delivery, so the host may have been fenced meanwhile, and a hand-off asked for is
    /// honoured at the last checkpoint instead.
    async fn may_retry(&mut self) -> Option<Delivered> {
        if self.fence.is_up() {
            return Some(Delivered::Stop(self.stop_reason()));
        }
        self.ensure_current().await.map(Delivered::Stop)
    }

    /// Hands `batch` to the dead-letter sink if it has failed often enough. Returns
    /// [`Delivered::DeadLettered`] once the sink took it.
    async fn dead_letter(&mut self, batch: &Batch, error: &str) -> Option<Delivered> {
        if batch.records.is_empty() {
            // An idle tick has nothing to set aside; it is retried like a batch.
            return None;
        }
        let after = self.args.settings.dead_letter_after?;
        let sink = self.args.dead_letter.clone()?;
        if self.failures < after || self.fence.is_up() {
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
    async fn call(&mut self, batch: &Arc<Batch>) -> CallEnd<Result<(), HandlerError>> {
        let token = CancellationToken::new();
        self.ctx.cancel = token.clone();
        let handler = self.args.handler.clone();
        let ctx = self.ctx.clone();
        let call = handler.handle_shared(&ctx, batch.clone());
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
        self.race_from(call, false).await
    }

    /// [`Self::race`], for a call made when a hand-off request is already known (`requested`):
    /// its horizon then runs from the last confirmation, which later ones do not move.
    async fn race_from<T>(
        &mut self,
        call: impl std::future::Future<Output = T>,
        requested: bool,
    ) -> CallEnd<T> {
        let now = self.args.clock.now();
        let guard = SharedGuard(std::sync::Mutex::new(CallGuard {
            confirmed: self.confirmed(),
            frozen: requested,
            stop_at: self
                .args
                .cancel
                .is_cancelled()
                .then(|| now + self.args.settings.stop_grace()),
            timeout_at: self.args.settings.handler_timeout.map(|d| now + d),
        }));
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
                _ = self.fence.raised() => {}
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

    /// Whether the call in progress must end now, and how.
    fn check_call<T>(&self, shared: &SharedGuard) -> Option<CallEnd<T>> {
        if self.fence.is_up() {
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
    fn next_check(&self, guard: &SharedGuard) -> Instant {
        let guard = guard.get();
        let mut at = guard.confirmed + self.handoff_horizon();
        if let Some(fence) = self.fence.deadline() {
            at = at.min(fence);
        }
        for t in [guard.stop_at, guard.timeout_at].into_iter().flatten() {
            at = at.min(t);
        }
        at
    }
}
