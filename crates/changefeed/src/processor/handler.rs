//! The handler API: the user's code that receives batches.

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::worker::LeaseCell;
use crate::error::LeaseError;
use crate::model::{Batch, Continuation, HostName, LeaseKey, PartitionId};

/// An error returned by a handler; the batch is retried with backoff, never skipped.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a worker stopped delivering a partition to the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// The processor is stopping; the lease was checkpointed and released.
    Shutdown,
    /// Another host owns the lease now (taken after this host was judged dead, or the host
    /// fenced itself), or this host could not confirm in time that nobody may steal it (a
    /// call cut short); nothing more was checkpointed.
    LeaseLost,
    /// The partition is closed and fully processed; the lease is marked finished.
    PartitionEnded,
    /// The lease was handed to the host that asked for it, at the last checkpoint.
    HandedOff,
    /// The handler failed more times than allowed; the lease was released at its last
    /// checkpoint so another host may try.
    HandlerFailed,
    /// The source cannot read the partition from the lease's checkpoint (an unknown
    /// continuation or partition); the lease was released with its checkpoint unchanged.
    SourceFailed,
}

/// What a handler knows about the partition it is called for.
#[derive(Clone, Debug)]
pub struct Context {
    pub(crate) partition: PartitionId,
    pub(crate) key: LeaseKey,
    pub(crate) host: HostName,
    pub(crate) cell: Arc<LeaseCell>,
    pub(crate) fencing_token: u64,
    /// Cancelled when the current call must end (fence, lease lost, timeout, stop deadline).
    pub(crate) cancel: CancellationToken,
}

impl Context {
    /// The partition being read.
    pub fn partition(&self) -> &PartitionId {
        &self.partition
    }

    /// The lease's key.
    pub fn lease_key(&self) -> &LeaseKey {
        &self.key
    }

    /// This host's name.
    pub fn host(&self) -> &HostName {
        &self.host
    }

    /// A number that stays the same for this host's whole tenure of the lease and is strictly
    /// greater for every later owner of the partition: the lease's version when this worker
    /// started on it. Tokens of different partitions do not compare (a child's lease starts
    /// afresh).
    ///
    /// Pass it to a sink that keeps the highest token it has seen per partition and refuses
    /// writes with a lower one (for example `… ON CONFLICT (partition) DO UPDATE … WHERE
    /// stored.token <= EXCLUDED.token` in the batch's transaction): a deposed owner's late
    /// writes, even from a process that was frozen mid-batch, are then rejected by the sink
    /// itself (see `docs/protocol.md`, "The fencing guarantee", and `examples/fenced_sink.rs`).
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// Completes when the current call must stop: the host was fenced, the lease was lost,
    /// `handler_timeout` passed, or the stop deadline passed. The call's future is dropped
    /// right after; use this to stop work the handler spawned (writes on other tasks).
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Whether the current call must stop (see [`Context::cancelled`]).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The current call's cancellation token, to hand to tasks the handler spawns.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Writes `continuation` as the lease's checkpoint now (for
    /// [`super::CheckpointMode::Manual`]; allowed in every mode). The continuation must be one
    /// of a record already delivered to this handler.
    ///
    /// # Errors
    /// [`LeaseError::Conflict`] if the lease was lost; [`LeaseError::Store`] if the store
    /// failed (the checkpoint may be retried).
    pub async fn checkpoint(&self, continuation: Continuation) -> Result<(), LeaseError> {
        self.cell.checkpoint(continuation).await.map(|_| ())
    }

    /// Writes `continuation` as the checkpoint while other calls of the batch still run: never
    /// a hand-off, which waits for the batch's end. `Ok(false)`: not written, as a hand-off
    /// request is pending.
    pub(crate) async fn checkpoint_within_batch(
        &self,
        continuation: Continuation,
    ) -> Result<bool, LeaseError> {
        self.cell.advance(continuation).await
    }
}

/// The user's code: receives every batch of the partitions this host owns.
///
/// One handler value serves all partitions of a host, each call naming its partition in the
/// [`Context`]. Within a partition, calls never overlap and come in order.
///
/// # Contract
///
/// - `handle` returning `Ok` means the batch is done: the checkpoint may move past it.
/// - `handle` returning `Err` means nothing of the batch is done: it is retried with backoff,
///   and after `handler_max_retries` failures the lease is released (never skipped).
/// - Records may be delivered again after an ownership change (at-least-once): at most the
///   batches after the last checkpoint.
///
/// # Cancel safety
///
/// The future `handle` returns may be dropped at any await point: when this host is fenced
/// (its heartbeat could not be renewed for `lease_expiry − safety_margin`), when the lease
/// was lost or a hand-off request would otherwise be stolen from under the call, when
/// `handler_timeout` passes, or when a graceful stop has waited its grace for the batch. The
/// processor races the call against those deadlines and, biased towards the fence, drops it
/// the moment one passes, before anyone else may deliver the partition; nothing of the batch
/// is checkpointed then. So:
///
/// - Do the batch's effects so that a cut-short call leaves them retryable (idempotent
///   writes, or one transaction per batch), since the batch will be delivered again.
/// - Work the handler spawned on other tasks is not dropped with the future: stop it on
///   [`Context::cancelled`].
/// - A process or machine that can be frozen mid-write (a stalled VM, SIGSTOP) can still
///   have a write in flight on the network when it wakes; only the sink can refuse it. Pass
///   [`Context::fencing_token`] with every write and have the sink reject lower tokens.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Called once before the first batch of a partition on this host.
    ///
    /// # Errors
    /// An error is treated like a failed batch.
    async fn open(&self, _ctx: &Context) -> Result<(), HandlerError> {
        Ok(())
    }

    /// Processes one batch.
    ///
    /// # Errors
    /// Any error: the batch is retried, never skipped.
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError>;

    /// Processes one batch the caller shares: the processor calls this, and by default it
    /// calls [`Handler::handle`]. Override it (keeping the two equivalent) to keep the batch
    /// past the call or hand it to another task without copying it, as [`handler_fn`] does.
    ///
    /// # Errors
    /// As [`Handler::handle`].
    async fn handle_shared(&self, ctx: &Context, batch: Arc<Batch>) -> Result<(), HandlerError> {
        self.handle(ctx, &batch).await
    }

    /// Called once when the lease is about to leave this host in good order, between batches,
    /// while it is still held: a graceful stop reached this worker, or another host asked for
    /// the lease (a hand-off, from balancing). The last chance to checkpoint
    /// ([`Context::checkpoint`]) what was done (KCL's `shutdownRequested`); on a hand-off a
    /// checkpoint written now also passes the lease over, at that checkpoint. Raced, like a
    /// batch, against the fence, the loss of the lease, the stop's grace (half of
    /// `shutdown_timeout`) and, on a hand-off, the time the asker waits before it may steal
    /// (`handoff_timeout − safety_margin` from this host's last confirmation of its lease).
    /// Not called when the lease is lost, finished or failed, nor when the host is fenced, nor
    /// when the hand-off request was found only while a batch ran into that deadline. Then the
    /// lease is released or handed over and [`Handler::close`] follows with
    /// [`CloseReason::Shutdown`] or [`CloseReason::HandedOff`].
    ///
    /// # Errors
    /// Any error is logged and reported to `on_error`; the stop goes on.
    async fn stopping(&self, _ctx: &Context) -> Result<(), HandlerError> {
        Ok(())
    }

    /// Called once when the worker stops, with the reason.
    async fn close(&self, _ctx: &Context, _reason: CloseReason) {}
}

/// A handler from an async closure taking the context and the batch by value.
///
/// ```
/// use changefeed::processor::handler_fn;
/// let handler = handler_fn(|ctx, batch| async move {
///     println!("{}: {} records", ctx.partition(), batch.records.len());
///     Ok(())
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F, Fut>(f: F) -> FnHandler<F>
where
    F: Fn(Context, Arc<Batch>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    FnHandler(f)
}

/// See [`handler_fn`].
#[derive(Debug, Clone)]
pub struct FnHandler<F>(F);

#[async_trait]
impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(Context, Arc<Batch>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    /// Copies the batch for the closure, which takes it by value; the processor calls
    /// [`Handler::handle_shared`] instead, which does not.
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        (self.0)(ctx.clone(), Arc::new(batch.clone())).await
    }

    async fn handle_shared(&self, ctx: &Context, batch: Arc<Batch>) -> Result<(), HandlerError> {
        (self.0)(ctx.clone(), batch).await
    }
}

/// A batch that failed `dead_letter_after` times, handed to the [`DeadLetterSink`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The lease's key (group and partition).
    pub key: LeaseKey,
    /// The host that gave up on the batch.
    pub host: HostName,
    /// The batch's records.
    pub batch: Batch,
    /// The checkpoint the batch started after (`None`: the partition's start position).
    pub after: Option<Continuation>,
    /// The last error, as text.
    pub error: String,
    /// How many times the batch failed, across hosts.
    pub failures: u32,
}

impl DeadLetter {
    /// The letter's records as a JSON array, each as `changefeed run` pipes a record to its
    /// handler: `data` when the payload is UTF-8, `data_b64` (standard base64) otherwise.
    ///
    /// # Errors
    /// A serialisation error (not expected for these plain values).
    pub fn records_json(&self) -> Result<String, serde_json::Error> {
        use base64::Engine as _;
        let partition = self.key.partition.as_str();
        let records: Vec<serde_json::Value> = self
            .batch
            .records
            .iter()
            .map(|r| {
                let mut o = serde_json::Map::new();
                o.insert("partition".into(), partition.into());
                o.insert("key".into(), r.key.as_str().into());
                match std::str::from_utf8(&r.data) {
                    Ok(text) => o.insert("data".into(), text.into()),
                    Err(_) => o.insert(
                        "data_b64".into(),
                        base64::engine::general_purpose::STANDARD
                            .encode(&r.data)
                            .into(),
                    ),
                };
                o.insert("continuation".into(), r.continuation.as_str().into());
                o.insert("timestamp".into(), r.timestamp.map(|t| t.millis()).into());
                serde_json::Value::Object(o)
            })
            .collect();
        serde_json::to_string(&records)
    }
}

/// Where batches that keep failing go so that their partition can move on (opt-in: see
/// [`super::Settings::dead_letter_after`]). Once `dead_letter` returns `Ok`, the checkpoint
/// moves past the batch.
///
/// # Errors
/// An error keeps the batch where it is: it is retried with backoff, as a failed call is.
#[async_trait]
pub trait DeadLetterSink: Send + Sync + std::fmt::Debug + 'static {
    /// Stores `letter` durably.
    async fn dead_letter(&self, letter: &DeadLetter) -> Result<(), HandlerError>;
}

#[cfg(test)]
impl Context {
    /// A context for partition `partition` of group `g` on host `a`, over a memory store,
    /// for calling a handler directly.
    pub(crate) fn detached(partition: &str) -> Context {
        use crate::clock::SystemClock;
        use crate::lease::MemoryLeaseStore;
        use crate::model::{GroupName, Lease, Position};
        let partition = PartitionId::new(partition).expect("a valid partition");
        let key = LeaseKey::new(
            GroupName::new("g").expect("a valid group"),
            partition.clone(),
        );
        let host = HostName::new("a").expect("a valid host");
        let cell = LeaseCell::new(
            Lease::new(key.clone(), Position::Beginning),
            Arc::new(MemoryLeaseStore::new()),
            host.clone(),
            Arc::new(SystemClock),
        );
        Context {
            partition,
            key,
            host,
            cell: Arc::new(cell),
            fencing_token: 1,
            cancel: CancellationToken::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `handler_fn` hands its closure the batch the processor shares, not a copy of it.
    #[tokio::test]
    async fn handler_fn_gets_the_shared_batch_not_a_copy() {
        let ctx = Context::detached("0");
        let batch = Arc::new(Batch {
            records: Vec::new(),
            continuation: None,
            end_of_partition: false,
        });
        let shared = batch.clone();
        let handler = handler_fn(move |_, got: Arc<Batch>| {
            let same = Arc::ptr_eq(&got, &shared);
            async move {
                if same {
                    Ok(())
                } else {
                    Err("the closure got a copy".into())
                }
            }
        });
        let result = handler.handle_shared(&ctx, batch.clone()).await;
        assert!(result.is_ok(), "{result:?}");
        // Called by reference, it has to copy.
        assert!(handler.handle(&ctx, &batch).await.is_err());
    }
}
