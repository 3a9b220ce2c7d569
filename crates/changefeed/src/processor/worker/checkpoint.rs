//! The worker's lease writes: checkpoints, finishing the lease at the end of its partition,
//! releasing it, and handing it off. Each is retried by its [`Policy`]; how a write is done
//! (compare-and-swap, adopting a row that changed under it, handing off in the same write) is
//! [`LeaseCell`](super::LeaseCell)'s.

use tracing::{debug, info, warn};

use super::cell::WriteOutcome;
use super::{Next, Worker, LAG_REFRESH};
use crate::model::{Continuation, Position};
use crate::processor::callbacks::ErrorOrigin;
use crate::processor::config::CheckpointMode;
use crate::processor::handler::CloseReason;
use crate::processor::retry::{GaveUp, Policy, Retry};

impl Worker {
    /// A hand-off was requested: we are between batches, so write the position and pass it.
    pub(super) async fn hand_off(&mut self) -> CloseReason {
        let pending = self.pending.take();
        self.release_or_lost(pending, CloseReason::HandedOff).await
    }

    /// Writes the pending checkpoint if the mode says it is due, or if `force`d (a batch
    /// handed to the dead-letter sink is checkpointed past in every mode).
    pub(super) async fn maybe_checkpoint(&mut self, force: bool) -> Option<CloseReason> {
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
        let mut retry = Retry::new(Policy::CHECKPOINT);
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
                Err(err) => {
                    if err.is_retryable() {
                        warn!(lease = %self.ctx.key, error = %err, "checkpoint failed");
                        self.notify(ErrorOrigin::Store, || format!("checkpoint failed: {err}"));
                    }
                    match self.after_failure(&mut retry, err.is_retryable()).await {
                        Next::Retry => {}
                        Next::Interrupted => return Some(self.stop_reason()),
                        Next::GaveUp(_) => {
                            info!(lease = %self.ctx.key, error = %err, "checkpoint refused; lease lost");
                            metrics::counter!("changefeed_leases_lost_total", "group" => self.args.group_label.clone()).increment(1);
                            return Some(CloseReason::LeaseLost);
                        }
                    }
                }
            }
        }
    }

    /// Asks the source how far `checkpoint` is behind the end, in records and in time, at most
    /// every `LAG_REFRESH`.
    async fn refresh_lag(&mut self, checkpoint: &Continuation) {
        let now = self.args.clock.now();
        if self
            .last_lag_at
            .is_some_and(|t| now.saturating_duration_since(t) < LAG_REFRESH)
        {
            return;
        }
        self.last_lag_at = Some(now);
        self.last_age_at = Some(now);
        match self
            .args
            .source
            .remaining(&self.ctx.partition, Some(checkpoint))
            .await
        {
            Ok(records) => self.args.lag.update(
                &self.args.group_label,
                &self.ctx.partition,
                records,
                self.args.clock.wall(),
            ),
            Err(err) => debug!(lease = %self.ctx.key, error = %err, "lag estimate failed"),
        }
        self.ask_oldest_unread(Some(checkpoint)).await;
    }

    /// Asks the source when the first record after the last checkpoint (or the lease's start)
    /// was written, at most every `LAG_REFRESH`: at the start and while idle, when no
    /// checkpoint refreshes it.
    pub(super) async fn refresh_age(&mut self) {
        let now = self.args.clock.now();
        if self
            .last_age_at
            .is_some_and(|t| now.saturating_duration_since(t) < LAG_REFRESH)
        {
            return;
        }
        self.last_age_at = Some(now);
        match self.checkpointed.clone() {
            Some(c) => self.ask_oldest_unread(Some(&c)).await,
            None => match self.args.lease.start.clone() {
                Position::Beginning => self.ask_oldest_unread(None).await,
                Position::Continuation(c) => self.ask_oldest_unread(Some(&c)).await,
                // No continuation to ask after until the first checkpoint.
                Position::Now | Position::AtTime(_) => {}
            },
        }
    }

    async fn ask_oldest_unread(&mut self, after: Option<&Continuation>) {
        match self
            .args
            .source
            .oldest_unread(&self.ctx.partition, after)
            .await
        {
            Ok(oldest) => self.args.lag.update_oldest(
                &self.args.group_label,
                &self.ctx.partition,
                oldest,
                self.args.clock.wall(),
            ),
            Err(err) => debug!(lease = %self.ctx.key, error = %err, "lag in time estimate failed"),
        }
    }

    pub(super) async fn finish(&mut self) -> CloseReason {
        let pending = self.pending.take();
        let mut retry = Retry::new(Policy::FINISH);
        loop {
            let err = match self.cell.finish(pending.clone()).await {
                Ok(_) => return CloseReason::PartitionEnded,
                Err(err) => err,
            };
            match self.after_failure(&mut retry, err.is_retryable()).await {
                Next::Retry => {}
                Next::Interrupted => return self.stop_reason(),
                Next::GaveUp(_) => {
                    info!(lease = %self.ctx.key, error = %err, "could not mark the lease finished; lease lost");
                    return CloseReason::LeaseLost;
                }
            }
        }
    }

    /// Writes `pending` (if any) and gives the lease up (to its next owner if one asked).
    /// Returns `reason`, or `HandedOff` if the write handed it over, or `LeaseLost` if it was
    /// no longer ours.
    pub(super) async fn release_or_lost(
        &mut self,
        pending: Option<Continuation>,
        reason: CloseReason,
    ) -> CloseReason {
        let pending = match self.args.settings.checkpoint_mode {
            CheckpointMode::Manual => None,
            _ => pending,
        };
        let mut retry = Retry::new(Policy::RELEASE);
        loop {
            let err = match self.cell.release(pending.clone(), self.failures).await {
                Ok(WriteOutcome::HandedOff) => {
                    metrics::counter!("changefeed_handoffs_given_total", "group" => self.args.group_label.clone()).increment(1);
                    return CloseReason::HandedOff;
                }
                Ok(WriteOutcome::Kept) => return reason,
                Err(err) => err,
            };
            match self.after_failure(&mut retry, err.is_retryable()).await {
                Next::Retry => {}
                // The policy's waits are not cut short.
                Next::Interrupted => return reason,
                Next::GaveUp(GaveUp::OutOfRetries) => {
                    warn!(lease = %self.ctx.key, error = %err, "release failed; the lease will expire with this host");
                    self.notify(ErrorOrigin::Store, || {
                        format!("releasing the lease failed: {err}")
                    });
                    return reason;
                }
                Next::GaveUp(_) => {
                    info!(lease = %self.ctx.key, error = %err, "release refused; lease already lost");
                    return CloseReason::LeaseLost;
                }
            }
        }
    }

    pub(super) async fn shutdown(&mut self) -> CloseReason {
        if self.fence.is_up() {
            return CloseReason::LeaseLost;
        }
        let pending = self.pending.take();
        match self.release_or_lost(pending, CloseReason::Shutdown).await {
            CloseReason::HandedOff => CloseReason::Shutdown,
            other => other,
        }
    }
}
