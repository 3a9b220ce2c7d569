//! The worker's lease row: its view of it, and the only path by which it writes it.
//!
//! Each write is a compare-and-swap on the version the cell last saw. A conflict is not a loss:
//! the cell adopts the current row and, if this host still owns it, writes again; when the row
//! carries a `next_owner`, that same write hands the lease over (design, "Balancing"). Only a
//! row owned by someone else means the lease was lost. The worker decides *when* to write
//! (`checkpoint.rs`); this file decides *how*.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{watch, Mutex};
use tracing::debug;

use crate::clock::Clock;
use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{Continuation, HostName, Lease, LeaseState};
use crate::processor::hooks::Hooks;

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
    /// Set once a write of this cell handed the lease to its next owner.
    handed: AtomicBool,
    /// The simulator's deliberately broken variants (inert in a normal build).
    pub(super) hooks: Hooks,
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
            handed: AtomicBool::new(false),
            hooks: Hooks::default(),
            clock,
        }
    }

    fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// Whether a write of this cell (a worker's, or the handler's own checkpoint) handed the
    /// lease to its next owner.
    pub(super) fn handed_off(&self) -> bool {
        self.handed.load(Ordering::Acquire)
    }

    /// Applies `change` to the row and writes it by CAS, adopting the current row and retrying
    /// while this host still owns it. A `next_owner` on the row turns the write into a
    /// hand-off (unless `change` finishes the lease, which also clears ownership).
    async fn write(&self, change: impl Fn(&mut Lease)) -> Result<WriteOutcome, LeaseError> {
        // A write that may hand off is never withheld.
        let outcome = self.write_as(change, true).await?;
        Ok(outcome.unwrap_or(WriteOutcome::Kept))
    }

    /// [`Self::write`], handing off only if `hand_off`. Otherwise a pending hand-off request
    /// withholds the write (`Ok(None)`), for the worker to honour between batches; the cell
    /// then keeps the row it had, so that the worker still learns of the request from the
    /// listing (a cell that adopted the newer row would hide it from the worker).
    async fn write_as(
        &self,
        change: impl Fn(&mut Lease),
        hand_off: bool,
    ) -> Result<Option<WriteOutcome>, LeaseError> {
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
            if handoff && !hand_off {
                return Ok(None);
            }
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
                        self.handed.store(true, Ordering::Release);
                        self.done.send_replace(true);
                        return Ok(Some(WriteOutcome::HandedOff));
                    }
                    if lease.state != LeaseState::Owned {
                        self.done.send_replace(true);
                    }
                    return Ok(Some(WriteOutcome::Kept));
                }
                Err(LeaseError::Conflict { current, .. })
                    if current.is_owned_by(&self.host) && current.keeps_continuation_of(&lease) =>
                {
                    if !hand_off && current.next_owner.is_some() {
                        return Ok(None);
                    }
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

    /// Moves the checkpoint to `continuation` without handing the lease off, while other
    /// handler calls of the batch still run (key-parallel delivery's done prefix). `Ok(false)`:
    /// not written, as a hand-off request is pending (see [`Self::write_as`]).
    pub(crate) async fn advance(&self, continuation: Continuation) -> Result<bool, LeaseError> {
        self.write_as(
            |l| {
                l.continuation = Some(continuation.clone());
                l.properties.remove(FAILURES_PROPERTY);
            },
            false,
        )
        .await
        .map(|outcome| outcome.is_some())
    }

    /// Marks the lease finished at `continuation` (its partition ended).
    pub(super) async fn finish(
        &self,
        continuation: Option<Continuation>,
    ) -> Result<WriteOutcome, LeaseError> {
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
    pub(super) async fn release(
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
    pub(super) fn shows_lost(&self, row: &Lease) -> bool {
        if row.is_owned_by(&self.host) {
            return false;
        }
        self.lease
            .try_lock()
            .map_or(true, |lease| row.version > lease.version)
    }

    /// Whether `row` is newer than the row this cell holds and carries a hand-off request.
    pub(super) fn shows_request(&self, row: &Lease) -> bool {
        row.next_owner.is_some()
            && self
                .lease
                .try_lock()
                .map_or(true, |lease| row.version > lease.version)
    }

    /// Takes in a newer row the host loop listed. Returns false if it shows the lease is no
    /// longer this host's.
    pub(super) async fn observe(&self, listed: &Lease) -> bool {
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
pub(super) fn carried_failures(lease: &Lease) -> u32 {
    lease
        .properties
        .get(FAILURES_PROPERTY)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
