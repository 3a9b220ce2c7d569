//! The handler API: the user's code that receives batches.

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;

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
    /// fenced itself); nothing more was checkpointed.
    LeaseLost,
    /// The partition is closed and fully processed; the lease is marked finished.
    PartitionEnded,
    /// The lease was handed to the host that asked for it, at the last checkpoint.
    HandedOff,
    /// The handler failed more times than allowed; the lease was released at its last
    /// checkpoint so another host may try.
    HandlerFailed,
}

/// What a handler knows about the partition it is called for.
#[derive(Clone, Debug)]
pub struct Context {
    pub(crate) partition: PartitionId,
    pub(crate) key: LeaseKey,
    pub(crate) host: HostName,
    pub(crate) cell: Arc<LeaseCell>,
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
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        (self.0)(ctx.clone(), Arc::new(batch.clone())).await
    }
}
