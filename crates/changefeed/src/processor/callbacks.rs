//! What a program may be told of, and asked, besides its batches: notifications when this host
//! acquires or releases a lease and when something fails (the Cosmos DB processor's
//! `WithLeaseAcquireNotification`, `WithLeaseReleaseNotification` and `WithErrorNotification`),
//! and where a partition the group starts on begins (Event Hubs' partition initialising
//! handler). Set on the builder: [`ProcessorBuilder::on_lease_acquired`],
//! [`ProcessorBuilder::on_lease_released`], [`ProcessorBuilder::on_error`] and
//! [`ProcessorBuilder::start_position_for`].
//!
//! The notifications are plain functions called on the processor's own tasks: keep them short
//! (count, log, send on a channel). A notification that panics is caught and logged; it never
//! stops the worker or the host that called it.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use changefeed::lease::MemoryLeaseStore;
//! use changefeed::model::Position;
//! use changefeed::processor::{handler_fn, Processor};
//! use changefeed::source::MemoryFeed;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let processor = Processor::builder()
//!     .host("host-a")
//!     .group("orders")
//!     .store(Arc::new(MemoryLeaseStore::new()))
//!     .source(Arc::new(MemoryFeed::new(4)))
//!     .handler(handler_fn(|ctx, batch| async move {
//!         if batch.records.is_empty() {
//!             // The idle tick: flush a time window of `ctx.partition()`.
//!         }
//!         Ok(())
//!     }))
//!     .max_wait_time(Some(Duration::from_secs(30)))
//!     .on_lease_acquired(|partition| tracing::info!(%partition, "reading"))
//!     .on_lease_released(|partition, reason| tracing::info!(%partition, ?reason, "stopped"))
//!     .on_error(|notice| {
//!         if notice.is_user_error() {
//!             tracing::error!(%notice, "our handler failed");
//!         }
//!     })
//!     // Partition 0 holds years of history nobody needs: it starts at the end.
//!     .start_position_for(|partition, group_start| match partition.as_str() {
//!         "0" => Position::Now,
//!         _ => group_start.clone(),
//!     })
//!     .build()?;
//! processor.start().stop().await?;
//! # Ok(()) }
//! ```
//!
//! [`ProcessorBuilder::on_lease_acquired`]: super::ProcessorBuilder::on_lease_acquired
//! [`ProcessorBuilder::on_lease_released`]: super::ProcessorBuilder::on_lease_released
//! [`ProcessorBuilder::on_error`]: super::ProcessorBuilder::on_error
//! [`ProcessorBuilder::start_position_for`]: super::ProcessorBuilder::start_position_for

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tracing::warn;

use super::handler::CloseReason;
use crate::model::{PartitionId, Position};

/// Whose part failed: the program's own code, or one of the processor's seams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorOrigin {
    /// The handler: `open` or `handle` returned an error or ran past `handler_timeout`. The
    /// batch is retried with backoff, never skipped (Cosmos DB's
    /// `ChangeFeedProcessorUserException`).
    Handler,
    /// The lease store: a checkpoint, a release, a lease read, listing the leases or the
    /// membership, or the heartbeat failed. Retried by the processor.
    Store,
    /// The feed source: opening or reading a partition, or listing the partitions, failed.
    Source,
}

impl ErrorOrigin {
    /// `handler`, `store` or `source`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Handler => "handler",
            Self::Store => "store",
            Self::Source => "source",
        }
    }
}

/// One failure, as [`ProcessorBuilder::on_error`](super::ProcessorBuilder::on_error) is told of
/// it. The processor has already logged it and will retry; the notification is for the
/// program's own alerting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorNotice {
    /// Whose part failed.
    pub origin: ErrorOrigin,
    /// The partition the failure concerns, when it concerns one (a worker's); `None` for the
    /// host's own calls (membership, listing, sync, heartbeat).
    pub partition: Option<PartitionId>,
    /// What failed, with the error's message.
    pub message: String,
}

impl ErrorNotice {
    /// Whether the program's own code failed (the handler), rather than the store or the
    /// source.
    pub fn is_user_error(&self) -> bool {
        self.origin == ErrorOrigin::Handler
    }
}

impl std::fmt::Display for ErrorNotice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.partition {
            Some(p) => write!(
                f,
                "{} error on partition {p}: {}",
                self.origin.as_str(),
                self.message
            ),
            None => write!(f, "{} error: {}", self.origin.as_str(), self.message),
        }
    }
}

type Acquired = dyn Fn(&PartitionId) + Send + Sync;
type Released = dyn Fn(&PartitionId, CloseReason) + Send + Sync;
type Errored = dyn Fn(&ErrorNotice) + Send + Sync;
type StartFor = dyn Fn(&PartitionId, &Position) -> Position + Send + Sync;

/// The callbacks a processor was built with; each is optional.
#[derive(Clone, Default)]
pub(crate) struct Callbacks {
    pub(crate) acquired: Option<Arc<Acquired>>,
    pub(crate) released: Option<Arc<Released>>,
    pub(crate) error: Option<Arc<Errored>>,
    pub(crate) start: Option<Arc<StartFor>>,
}

impl std::fmt::Debug for Callbacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Callbacks")
            .field("acquired", &self.acquired.is_some())
            .field("released", &self.released.is_some())
            .field("error", &self.error.is_some())
            .field("start", &self.start.is_some())
            .finish()
    }
}

/// Runs a program's callback, catching a panic so that it cannot end the task that called it.
fn guarded<T>(what: &'static str, f: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(_) => {
            warn!(callback = what, "the program's callback panicked; ignored");
            None
        }
    }
}

impl Callbacks {
    /// This host's worker started on `partition`'s lease.
    pub(crate) fn lease_acquired(&self, partition: &PartitionId) {
        if let Some(f) = &self.acquired {
            guarded("on_lease_acquired", || f(partition));
        }
    }

    /// This host's worker on `partition` stopped, for `reason`.
    pub(crate) fn lease_released(&self, partition: &PartitionId, reason: CloseReason) {
        if let Some(f) = &self.released {
            guarded("on_lease_released", || f(partition, reason));
        }
    }

    /// Something failed (and will be retried).
    pub(crate) fn error(
        &self,
        origin: ErrorOrigin,
        partition: Option<&PartitionId>,
        message: impl FnOnce() -> String,
    ) {
        if let Some(f) = &self.error {
            let notice = ErrorNotice {
                origin,
                partition: partition.cloned(),
                message: message(),
            };
            guarded("on_error", || f(&notice));
        }
    }

    /// Where the lease of `partition`, a partition the group starts on, begins: the program's
    /// answer, or `planned` (the group's start position) without a callback or if it panics.
    pub(crate) fn start_position(&self, partition: &PartitionId, planned: &Position) -> Position {
        self.start
            .as_ref()
            .and_then(|f| guarded("start_position_for", || f(partition, planned)))
            .unwrap_or_else(|| planned.clone())
    }
}
