//! The processor: one host of a fleet, from builder to graceful stop.
//!
//! A [`Processor`] registers this host's heartbeat, then every acquire interval reads the
//! group's membership (O(hosts) rows), lists the leases only when ownership changed, asks the
//! [`crate::balance::BalanceStrategy`] for a plan, and applies it by compare-and-swap: takes free and dead
//! hosts' leases, asks over-quota hosts for hand-offs, and runs one worker per owned lease. It
//! owns the shell; the decisions live in the pure [`crate::balance`] module.
//!
//! ```
//! use std::sync::Arc;
//! use changefeed::lease::MemoryLeaseStore;
//! use changefeed::processor::{handler_fn, Processor};
//! use changefeed::source::MemoryFeed;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let feed = MemoryFeed::new(4);
//! feed.append("customer-1", "hello");
//! let processor = Processor::builder()
//!     .host("host-a")
//!     .group("orders")
//!     .store(Arc::new(MemoryLeaseStore::new()))
//!     .source(Arc::new(feed))
//!     .handler(handler_fn(|ctx, batch| async move {
//!         println!("{}: {} records", ctx.partition(), batch.records.len());
//!         Ok(())
//!     }))
//!     .build()?;
//! let running = processor.start();
//! running.stop().await?;
//! # Ok(()) }
//! ```

mod bounded;
mod builder;
pub mod callbacks;
mod config;
mod handle;
mod handler;
mod health;
mod heartbeat;
mod hooks;
mod host;
mod host_state;
mod keyed;
mod load;
mod telemetry;

mod retry;
mod sync;
mod worker;

pub use builder::{Processor, ProcessorBuilder};
pub use callbacks::{ErrorNotice, ErrorOrigin};
pub use config::{CheckpointMode, ConfigError, Settings, MAX_BATCH_LIMIT, MAX_DURATION};
pub use handle::ProcessorHandle;
pub use handler::{
    handler_fn, CloseReason, Context, DeadLetter, DeadLetterSink, FnHandler, Handler, HandlerError,
};
pub use health::{Health, HealthProbe, Unhealthy, UnhealthyReason};
pub use heartbeat::ProcessorError;
#[cfg(feature = "sim-broken")]
pub use hooks::Broken;
#[cfg(feature = "sim")]
pub(crate) use host_state::TableShare;
pub use host_state::{GroupObserver, Liveness};
pub use keyed::{KeyParallel, MAX_KEY_CONCURRENCY};
pub use telemetry::describe_metrics;
