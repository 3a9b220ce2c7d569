//! Amazon Kinesis Data Streams feed source for changefeed: shards as partitions, with lineage.
//!
//! [`KinesisFeed`] implements the core's [`FeedSource`](changefeed::source::FeedSource) on one
//! stream, read by polling `GetRecords` or, with [`Retrieval::FanOut`], by enhanced fan-out
//! (`SubscribeToShard`, see [`FanOutReader`]).
//! This crate owns the mapping of shards, iterators and sequence numbers to the core's
//! partitions, positions and continuations; leases, balancing and lineage stay in the core,
//! which starts a child shard only after its parents are finished.
//!
//! # Timeouts and recovery
//!
//! [`KinesisFeed::connect`] builds its client with [`Timeouts::KINESIS`] (less what
//! [`AwsOptions`] overrides): connecting 1 s, one attempt of a call 5 s (a `GetRecords` answer
//! may hold 10 MB), 3 attempts (a timeout, a connection error, throttling or a 5xx is tried
//! again after 50 ms doubling to at most 1 s with full jitter), 17 s for a whole call, and
//! pooled connections closed after 5 s idle. A connection whose request failed, timed out or
//! was cancelled is never reused (see `changefeed_aws`). So a read cut off by a network fault
//! fails, retryable, within 17 s, and the reader reads on from where it was once the path is
//! back. Socket faults are tested in `tests/it/faults.rs` and, with real processes, in the
//! CLI's `tests/it/faults_kinesis.rs`; see `docs/operations.md`, "Timeouts and recovery".
//!
//! # Example
//!
//! ```no_run
//! use changefeed::model::Position;
//! use changefeed::source::FeedSource;
//! use changefeed_kinesis::{AwsOptions, KinesisFeed};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // kinesis-mock on loopback; `AwsOptions::default()` uses the standard AWS chain.
//! let feed = KinesisFeed::connect(&AwsOptions::local("http://127.0.0.1:4568"), "orders").await;
//! feed.create_stream(4).await?;
//! let (shard, _) = feed.put("order-17", b"created".to_vec(), None).await?;
//! let mut reader = feed.open(&shard, &Position::Beginning).await?;
//! assert_eq!(reader.next_batch(10).await?.records.len(), 1);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod admin;
mod aws;
mod fanout;
mod feed;
mod kpl;
mod reader;

pub use aws::{AwsOptions, Timeouts};
pub use fanout::FanOutReader;
pub use feed::{KinesisError, KinesisFeed, ReadOptions, Retrieval};
pub use kpl::ExtendedSequenceNumber;
pub use reader::KinesisReader;

/// The AWS SDK's Kinesis client, re-exported so callers need not depend on it.
pub use aws_sdk_kinesis as sdk;
