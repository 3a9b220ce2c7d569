//! Handlers that run external commands, for a changefeed host whose record processing lives in
//! another program (any language):
//!
//! - [`batch::CommandHandler`]: a fresh `sh -c CMD` per batch, the batch on its stdin as JSON
//!   lines, exit status 0 = done; [`batch::CommandDeadLetters`] pipes a batch that kept failing
//!   to a dead-letter command the same way;
//! - [`lines::LinesHandler`]: one long-lived process per owned partition, framed JSON lines
//!   both ways, with acknowledgements and checkpoint requests;
//! - [`kcl::KclHandler`]: the KCL MultiLangDaemon's protocol, so that record processors
//!   written for `amazon_kclpy` (or the KCL's other language clients) run unchanged.
//!
//! Every command runs as the leader of a process group of its own, registered in the host's
//! [`groups::ProcessGroups`]: when the library abandons a call (the host was fenced, the lease
//! lost, a timeout or the stop's grace passed) the whole group gets SIGTERM, then SIGKILL after
//! [`groups::KILL_GRACE`], and a host that exits stops whatever is left
//! ([`groups::ProcessGroups::finish`]). Nothing of a partition's processes outlives its
//! tenure. `changefeed run` is these handlers behind flags; a Rust service can hand one to its
//! own [`changefeed::processor::Processor`]:
//!
//! ```no_run
//! # async fn example(
//! #     store: std::sync::Arc<dyn changefeed::lease::LeaseStore>,
//! #     source: std::sync::Arc<dyn changefeed::source::FeedSource>,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use changefeed::processor::Processor;
//! use changefeed_exec::batch::CommandHandler;
//! use changefeed_exec::groups::ProcessGroups;
//!
//! let groups = ProcessGroups::default();
//! let handler = CommandHandler::new("./load-orders.sh".into(), "orders".into(), groups.clone());
//! let processor = Processor::builder()
//!     .host("host-1")
//!     .group("orders")
//!     .store(store)
//!     .source(source)
//!     .shared_handler(Arc::new(handler))
//!     .build()?;
//! let stop = tokio_util::sync::CancellationToken::new();
//! processor.run(stop).await?;
//! // Every call has ended; give what the commands left running 2 s, then SIGKILL it.
//! groups
//!     .finish(tokio::time::Instant::now() + changefeed_exec::groups::KILL_GRACE)
//!     .await;
//! # Ok(()) }
//! ```

pub mod batch;
mod child;
pub mod groups;
pub mod kcl;
pub mod lines;

/// The README's example, compiled as a doctest so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
