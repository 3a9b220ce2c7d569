//! The handle of a running processor: stopping it, its health and its store calls.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::health::{Health, HealthProbe};
use super::heartbeat::ProcessorError;

/// A running processor, from [`Processor::start`].
#[derive(Debug)]
pub struct ProcessorHandle {
    pub(super) cancel: CancellationToken,
    pub(super) task: tokio::task::JoinHandle<Result<(), ProcessorError>>,
    pub(super) stats: Arc<crate::lease::StoreStats>,
    pub(super) health: HealthProbe,
}

impl ProcessorHandle {
    /// Stops gracefully within `shutdown_timeout`: the batch in flight may finish for half of
    /// it, then is cancelled; every worker checkpoints what was done and releases its lease;
    /// the heartbeat row is removed. Returns once every task has ended.
    ///
    /// # Errors
    /// What the processor failed with, if it had already stopped on an error.
    pub async fn stop(self) -> Result<(), ProcessorError> {
        self.cancel.cancel();
        self.join().await
    }

    /// Waits for the processor to end by itself (it only does on an error, or when the
    /// cancellation token is cancelled).
    ///
    /// # Errors
    /// What the processor failed with.
    pub async fn join(self) -> Result<(), ProcessorError> {
        match self.task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Ok(()),
        }
    }

    /// Drops every task at once without releasing anything, as a crash would: no batch
    /// finishes, no checkpoint is written, the leases and the heartbeat row stay in the store
    /// until they expire. For fault-injection tests (feature `testkit`); a program stops with
    /// [`ProcessorHandle::stop`].
    #[cfg(feature = "testkit")]
    pub fn kill(self) {
        self.crash();
    }

    /// What [`ProcessorHandle::kill`] does, for the fleet harness: the simulator crashes
    /// hosts so without the test kit, and a program has no use for it.
    #[cfg(any(feature = "testkit", feature = "sim"))]
    pub(crate) fn crash(self) {
        self.task.abort();
    }

    /// Whether the processor has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Counts of the store calls this processor made.
    pub fn store_stats(&self) -> &crate::lease::StoreStats {
        &self.stats
    }

    /// This host's health now: whether it is registered, how old its last successful
    /// heartbeat is, whether it is fenced, and so whether it is
    /// [ready](Health::is_ready) (registered, not fenced, not stopping). A host cut off from
    /// its store becomes unready when it fences itself (`lease_expiry − safety_margin` after its
    /// last successful heartbeat) and ready again once a heartbeat succeeds (registering
    /// afresh if its row was removed meanwhile). See [`Health`].
    ///
    /// It also says whether the host is [healthy](Health::is_healthy): one that has stayed
    /// fenced or unregistered, without a break, for longer than
    /// [`max_unhealthy`](super::Settings::max_unhealthy) is not recovering by itself, and
    /// [`Health::unhealthy`] says since when and why (for a liveness probe: restart it). The
    /// host also logs an error once when it turns unhealthy, an info line when it is healthy
    /// again, and sets the gauge `changefeed_unhealthy_since_seconds`.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use changefeed::lease::MemoryLeaseStore;
    /// # use changefeed::processor::{handler_fn, Processor};
    /// # use changefeed::source::MemoryFeed;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let running = Processor::builder()
    ///     .host("host-a")
    ///     .group("orders")
    ///     .store(Arc::new(MemoryLeaseStore::new()))
    ///     .source(Arc::new(MemoryFeed::new(1)))
    ///     .handler(handler_fn(|_, _| async { Ok(()) }))
    ///     .build()?
    ///     .start();
    /// let health = running.health();
    /// // Nothing has run yet: the heartbeat row is not written.
    /// assert!(!health.is_ready());
    /// assert_eq!(health.to_string(), "not ready: not registered yet");
    /// assert!(health.is_healthy());
    /// running.stop().await?;
    /// # Ok(()) }
    /// ```
    pub fn health(&self) -> Health {
        let mut health = self.health.health();
        if self.task.is_finished() {
            // Ended, perhaps by a panic or an abort: nothing runs any more.
            health.registered = false;
            health.stopping = true;
            health.unhealthy = None;
        }
        health
    }

    /// A [`HealthProbe`] to read [`ProcessorHandle::health`] from elsewhere (an HTTP probe
    /// server, say) for as long as it is kept, also after the handle is gone.
    pub fn health_probe(&self) -> HealthProbe {
        self.health.clone()
    }
}
