//! Key-parallel delivery inside one lease: a batch's records go to up to N handler calls at
//! once, grouped by record key, each key's records in order.
//!
//! [`KeyParallel`] wraps a [`Handler`] and is itself one; [`super::ProcessorBuilder::key_concurrency`]
//! puts it in place. It owns the split of a batch into per-key queues ([`Dispatch`], pure) and
//! the N slots that take those queues; the worker still owns the batch as a whole: its
//! retries, fencing, hand-offs, dead letters and checkpoints.
//!
//! # The checkpoint rule
//!
//! The checkpoint stands at the last record before the oldest one not yet done. The adapter
//! reports `Ok` only once the done prefix ([`Dispatch::done_prefix`]) covers the whole batch,
//! and the worker then checkpoints the batch. Within the batch, with
//! [`super::CheckpointMode::EveryBatch`], the adapter itself checkpoints the done prefix each
//! time it grows while calls still run (one write at a time, beside the calls), so a crash
//! re-delivers only the records from the oldest one not done. Such a write never hands the
//! lease off (the worker does, between batches), and a failed one is left to the next. With
//! [`super::CheckpointMode::Interval`] it writes none: beside the worker's own deferred
//! checkpoint it could move the continuation backwards; a crash then re-delivers at most what
//! the interval and the batch in flight hold.
//!
//! # Errors, cancellation, dead letters
//!
//! - Every slot runs inside the adapter's one call: when the worker drops the call (fence,
//!   lost lease, hand-off, `handler_timeout`, stop), every slot is dropped with it, and every
//!   slot sees the same [`Context::cancelled`].
//! - A failed key does not stop the others: the remaining keys are still dispatched, then the
//!   batch fails with the first error. The keys that succeeded are remembered for this lease,
//!   so the worker's retry of the same batch calls only the keys not yet done (within this
//!   process; after an ownership change the whole batch is delivered again, as always). A call
//!   cut short remembers nothing: its retry delivers the whole batch again.
//! - The dead-letter policy counts failures of the batch; a dead letter holds the whole batch,
//!   the records already done included.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};

use super::config::{CheckpointMode, ConfigError, Settings};
use super::handler::{CloseReason, Context, Handler, HandlerError};
use crate::model::{Batch, Continuation, LeaseKey};

/// The split of one batch into per-key queues, taken by slots; pure, driven by the caller.
///
/// Keys are handed out in the order of their first record, so the oldest records start
/// first and the done prefix grows as early as it can. One key is in at most one call at a
/// time, and each call holds that key's records in batch order.
#[derive(Debug, Clone)]
pub(crate) struct Dispatch {
    /// Per key, in order of first appearance: the indices of its records not done before.
    queues: Vec<Vec<usize>>,
    /// The next queue not yet handed out.
    next: usize,
    done: Vec<bool>,
    /// How many leading records are done.
    prefix: usize,
}

impl Dispatch {
    /// Splits records with these `keys`, skipping those `already` done (an earlier attempt
    /// at the same batch); `already` shorter than `keys` counts the rest as not done.
    pub(crate) fn new<'a>(keys: impl IntoIterator<Item = &'a str>, already: &[bool]) -> Self {
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut queues: Vec<Vec<usize>> = Vec::new();
        let mut done = Vec::new();
        for (i, key) in keys.into_iter().enumerate() {
            let was_done = already.get(i).copied().unwrap_or(false);
            done.push(was_done);
            if was_done {
                continue;
            }
            let q = *index.entry(key).or_insert_with(|| {
                queues.push(Vec::new());
                queues.len() - 1
            });
            queues[q].push(i);
        }
        let mut dispatch = Dispatch {
            queues,
            next: 0,
            done,
            prefix: 0,
        };
        dispatch.advance();
        dispatch
    }

    /// The next key's records, in batch order; `None` once every key was handed out.
    pub(crate) fn take(&mut self) -> Option<Vec<usize>> {
        let q = self.queues.get_mut(self.next)?;
        self.next += 1;
        Some(std::mem::take(q))
    }

    /// Marks the records of a call that succeeded as done.
    pub(crate) fn complete(&mut self, records: &[usize]) {
        for &i in records {
            if let Some(d) = self.done.get_mut(i) {
                *d = true;
            }
        }
        self.advance();
    }

    fn advance(&mut self) {
        while self.done.get(self.prefix).copied().unwrap_or(false) {
            self.prefix += 1;
        }
    }

    /// How many leading records are done: the checkpoint may stand at the record before
    /// index `done_prefix()`, the oldest one not yet done.
    pub(crate) fn done_prefix(&self) -> usize {
        self.prefix
    }

    /// Whether every record is done.
    pub(crate) fn finished(&self) -> bool {
        self.prefix == self.done.len()
    }

    /// Which records are done.
    pub(crate) fn done(&self) -> &[bool] {
        &self.done
    }
}

/// What ended among the futures of one batch: a handler call with the records it held, or a
/// checkpoint of the done prefix.
enum Done {
    Call(Vec<usize>, Result<(), HandlerError>),
    Checkpoint(Result<bool, crate::error::LeaseError>),
}

/// What a lease's failed batch had done, so that its retry skips those records.
#[derive(Debug)]
struct Remembered {
    batch: BatchId,
    done: Vec<bool>,
}

/// Tells a retry of the same batch from a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BatchId {
    len: usize,
    first: Continuation,
    last: Continuation,
}

impl BatchId {
    fn of(batch: &Batch) -> Option<Self> {
        Some(BatchId {
            len: batch.records.len(),
            first: batch.records.first()?.continuation.clone(),
            last: batch.records.last()?.continuation.clone(),
        })
    }
}

/// A [`Handler`] that delivers each batch in up to N concurrent calls of the handler it wraps,
/// one call per key holding that key's records in order (see the module doc for the
/// checkpoint rule, errors and cancellation).
///
/// The wrapped handler gets sub-batches: records of one key, `continuation: None` (the
/// checkpoint is the worker's to move, at the end of the whole batch) and
/// `end_of_partition: false`. Empty batches (idle ticks) pass through unchanged. `open`,
/// `stopping` and `close` are called once per lease, as without the adapter.
pub struct KeyParallel {
    inner: Arc<dyn Handler>,
    slots: NonZeroUsize,
    /// Whether to checkpoint the done prefix while calls run (see the module doc).
    prefix_checkpoints: bool,
    remembered: Mutex<HashMap<LeaseKey, Remembered>>,
}

impl std::fmt::Debug for KeyParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyParallel")
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl KeyParallel {
    /// Wraps `inner`, running up to `slots` of its calls at once per lease.
    pub fn new(inner: Arc<dyn Handler>, slots: NonZeroUsize) -> Self {
        KeyParallel {
            inner,
            slots,
            prefix_checkpoints: false,
            remembered: Mutex::new(HashMap::new()),
        }
    }

    /// Also checkpoints each batch's done prefix while its calls run (see the module doc);
    /// right only where the worker keeps no deferred checkpoint of its own
    /// ([`CheckpointMode::EveryBatch`]).
    #[must_use]
    pub fn checkpointing_done_prefix(mut self) -> Self {
        self.prefix_checkpoints = true;
        self
    }

    /// The most calls run at once per lease.
    pub fn slots(&self) -> usize {
        self.slots.get()
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseKey, Remembered>> {
        // Only plain map operations run under the lock, so a poisoned map is still whole.
        self.remembered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What an earlier failed attempt at `batch` on this lease already did.
    fn already_done(&self, key: &LeaseKey, id: &BatchId) -> Vec<bool> {
        match self.remembered().get(key) {
            Some(r) if &r.batch == id => r.done.clone(),
            _ => Vec::new(),
        }
    }
}

/// Most calls [`super::ProcessorBuilder::key_concurrency`] accepts at once per lease.
pub const MAX_KEY_CONCURRENCY: usize = 4096;

/// `handler` as the builder runs it: wrapped in [`KeyParallel`] when `key_concurrency` asks
/// for more than one call at once.
pub(super) fn wrap(
    handler: Arc<dyn Handler>,
    key_concurrency: Option<usize>,
    settings: &Settings,
) -> Result<Arc<dyn Handler>, ConfigError> {
    let bad = |rule: String| ConfigError::Invalid {
        setting: "key_concurrency",
        rule,
    };
    let n = key_concurrency.unwrap_or(1);
    let slots = NonZeroUsize::new(n)
        .ok_or_else(|| bad("must be at least 1 (1 delivers each batch in one call)".into()))?;
    if n > MAX_KEY_CONCURRENCY {
        return Err(bad(format!(
            "{n} is above the limit of {MAX_KEY_CONCURRENCY} calls at once"
        )));
    }
    if n == 1 {
        return Ok(handler);
    }
    if settings.checkpoint_mode == CheckpointMode::Manual {
        return Err(bad(format!(
            "{n} needs checkpoint_mode EveryBatch or Interval: with Manual the handler would \
             checkpoint one key's record past other keys' records not yet done"
        )));
    }
    let keyed = KeyParallel::new(handler, slots);
    Ok(Arc::new(
        if settings.checkpoint_mode == CheckpointMode::EveryBatch {
            keyed.checkpointing_done_prefix()
        } else {
            keyed
        },
    ))
}

/// The records at `indices` as a sub-batch for the wrapped handler.
fn sub_batch(batch: &Batch, indices: &[usize]) -> Batch {
    Batch {
        records: indices
            .iter()
            .filter_map(|&i| batch.records.get(i).cloned())
            .collect(),
        continuation: None,
        end_of_partition: false,
    }
}

#[async_trait]
impl Handler for KeyParallel {
    async fn open(&self, ctx: &Context) -> Result<(), HandlerError> {
        self.inner.open(ctx).await
    }

    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        self.handle_shared(ctx, Arc::new(batch.clone())).await
    }

    async fn handle_shared(&self, ctx: &Context, batch: Arc<Batch>) -> Result<(), HandlerError> {
        let Some(id) = BatchId::of(&batch) else {
            return self.inner.handle_shared(ctx, batch).await;
        };
        let already = self.already_done(ctx.lease_key(), &id);
        let mut dispatch = Dispatch::new(batch.records.iter().map(|r| r.key.as_str()), &already);
        let mut running: FuturesUnordered<BoxFuture<'_, Done>> = FuturesUnordered::new();
        let mut calls = 0usize;
        // The done prefix a checkpoint was written (or is being written) at, and whether one
        // is in flight.
        let (mut written, mut writing) = (dispatch.done_prefix(), false);
        let mut prefix_checkpoints = self.prefix_checkpoints;
        let mut first_error: Option<HandlerError> = None;
        loop {
            while calls < self.slots.get() {
                let Some(indices) = dispatch.take() else {
                    break;
                };
                let sub = Arc::new(sub_batch(&batch, &indices));
                let inner = self.inner.clone();
                calls += 1;
                running.push(Box::pin(async move {
                    let result = inner.handle_shared(ctx, sub).await;
                    Done::Call(indices, result)
                }));
            }
            let prefix = dispatch.done_prefix();
            if prefix_checkpoints && !writing && prefix > written && !dispatch.finished() {
                if let Some(record) = prefix.checked_sub(1).and_then(|i| batch.records.get(i)) {
                    let at = record.continuation.clone();
                    (written, writing) = (prefix, true);
                    running.push(Box::pin(async move {
                        Done::Checkpoint(ctx.checkpoint_within_batch(at).await)
                    }));
                }
            }
            let Some(done) = running.next().await else {
                break;
            };
            match done {
                Done::Checkpoint(result) => {
                    writing = false;
                    match result {
                        Ok(true) => {}
                        // A hand-off request is pending: the worker honours it, and this batch
                        // writes no more.
                        Ok(false) => prefix_checkpoints = false,
                        // The next prefix, or the batch's own checkpoint, writes it again; a
                        // lost lease ends the call from the worker.
                        Err(err) => {
                            tracing::debug!(lease = %ctx.lease_key(), error = %err, "checkpoint of the done prefix failed");
                        }
                    }
                }
                Done::Call(indices, Ok(())) => {
                    calls -= 1;
                    dispatch.complete(&indices);
                }
                Done::Call(indices, Err(err)) => {
                    calls -= 1;
                    tracing::debug!(
                        lease = %ctx.lease_key(),
                        records = indices.len(),
                        done_prefix = dispatch.done_prefix(),
                        error = %err,
                        "one key's records failed; the other keys go on"
                    );
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            None if dispatch.finished() => {
                self.remembered().remove(ctx.lease_key());
                Ok(())
            }
            None => Err("key-parallel delivery ended with records not done".into()),
            Some(err) => {
                self.remembered().insert(
                    ctx.lease_key().clone(),
                    Remembered {
                        batch: id,
                        done: dispatch.done().to_vec(),
                    },
                );
                Err(err)
            }
        }
    }

    async fn stopping(&self, ctx: &Context) -> Result<(), HandlerError> {
        self.inner.stopping(ctx).await
    }

    async fn close(&self, ctx: &Context, reason: CloseReason) {
        self.remembered().remove(ctx.lease_key());
        self.inner.close(ctx, reason).await;
    }
}

#[cfg(test)]
#[path = "keyed_tests.rs"]
mod tests;
