//! What the worker knows of its lease between its own writes, and the hand-off
//! confirmations a delivery needs.
//!
//! A row may change under the worker in two ways it must react to: another host now owns it
//! (stop), or a host asked for it (hand it off between batches). The host loop lists rows and
//! hints newer ones to the worker; it also stamps when it last made sure every hand-off
//! request is known ([`ViewStamp`](crate::processor::heartbeat::ViewStamp)). A delivery may start only within half of
//! `handoff_timeout − safety_margin` of such a confirmation (or of the worker's own lease
//! write or read), since after the whole of it the asker may steal the lease.

use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{Next, Worker};
use crate::model::Lease;
use crate::processor::callbacks::ErrorOrigin;
use crate::processor::handler::CloseReason;
use crate::processor::retry::{Policy, Retry};

impl Worker {
    /// Reacts to a row the host loop listed: lost, or a hand-off to honour.
    pub(super) async fn apply_hint(&mut self) -> Option<CloseReason> {
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
            // A planned move: the handler may checkpoint what it did first (KCL's graceful
            // hand-off); a checkpoint written now passes the lease over at that checkpoint.
            self.stopping(true).await;
            if self.cell.handed_off() {
                metrics::counter!("changefeed_handoffs_given_total", "group" => self.args.group_label.clone()).increment(1);
                return Some(CloseReason::HandedOff);
            }
            return Some(self.hand_off().await);
        }
        None
    }

    /// Before a delivery: makes sure this worker would know of a hand-off request written
    /// more than `handoff_timeout − safety_margin` ago, after which the asker may steal the
    /// lease. The host loop confirms that every cycle (its [`ViewStamp`](crate::processor::heartbeat::ViewStamp));
    /// when it has not lately (a slow or cut-off store, a stall), the worker reads its own
    /// lease row and does not deliver until a read succeeds. Then it applies any hint.
    /// Returns a reason to stop, if any.
    pub(super) async fn ensure_current(&mut self) -> Option<CloseReason> {
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
        let mut retry = Retry::new(Policy::READ_LEASE);
        loop {
            if self.fence.is_up() {
                return Some(CloseReason::LeaseLost);
            }
            let sent = self.args.clock.now();
            let read = tokio::select! {
                biased;
                _ = self.args.cancel.cancelled() => return Some(CloseReason::Shutdown),
                _ = self.fence.raised() => return Some(CloseReason::LeaseLost),
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
                    self.notify(ErrorOrigin::Store, || {
                        format!("reading the lease failed: {err}")
                    });
                    match self.after_failure(&mut retry, err.is_retryable()).await {
                        Next::Retry => {}
                        Next::Interrupted | Next::GaveUp(_) => return Some(self.stop_reason()),
                    }
                }
            }
        }
    }

    /// Latest confirmation that this worker knows of every hand-off request.
    pub(super) fn confirmed(&self) -> Instant {
        self.confirmed_at
            .map_or(self.args.view.get(), |c| c.max(self.args.view.get()))
    }

    /// After this much time from a confirmation, a hand-off request unknown to this worker may
    /// have been stolen.
    pub(super) fn handoff_horizon(&self) -> Duration {
        self.args
            .settings
            .handoff_timeout
            .saturating_sub(self.args.settings.safety_margin)
    }
}
