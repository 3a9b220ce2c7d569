//! DynamoDB for changefeed: the lease store (leases, heartbeats and the change counter in one
//! table), and a table's stream as a feed source.
//!
//! [`DynamoLeaseStore`] implements the core's [`LeaseStore`](changefeed::lease::LeaseStore) on
//! one DynamoDB table (created if absent, on-demand billing). This crate owns the table layout
//! and the mapping of items to the core's model; the lease protocol, balancing and lineage
//! stay in the core. [`import_kcl`] reads a KCL 2.x lease table and creates the same leases at
//! the same checkpoints.
//!
//! [`DynamoStreamsFeed`] implements the core's [`FeedSource`](changefeed::source::FeedSource)
//! on a table's DynamoDB stream: shards as partitions with their parents, each change one JSON
//! document with its keys and images as plain JSON (see `docs/backends.md`, "DynamoDB
//! Streams").
//!
//! # Cost
//!
//! Liveness is one heartbeat item per host, not one renewal per lease, spread over several
//! partition keys; each acquire cycle reads one small head item (the change counter and the
//! membership view), and only the view's leader reads the heartbeats; the lease partition is
//! queried only when the change counter moved. See `docs/benchmarks.md`, section `dynamodb-cost`, for the measured
//! cost against KCL's pattern on the same table. [`DynamoLeaseStore::capacity`] reports the
//! capacity units DynamoDB charged a handle.
//!
//! # Timeouts and recovery
//!
//! [`DynamoLeaseStore::connect`] builds its client with [`Timeouts::DYNAMODB`] (less what
//! [`AwsOptions`] overrides): connecting 1 s, one attempt of a call 1 s, 3 attempts (a timeout,
//! a connection error, throttling or a 5xx is tried again after 50 ms doubling to at most 1 s
//! with full jitter), 5 s for a whole call, and pooled connections closed after 5 s idle. A
//! connection whose request failed, timed out or was cancelled is never reused (see
//! `changefeed_aws`). So a store call cut off by a network fault fails, retryable, within 5 s,
//! and with the processor's defaults a host heartbeats again within `renew_interval +
//! connect` (3 s) of the path coming back. Socket faults are tested in `tests/it/faults.rs`
//! and, with real processes, in the CLI's `tests/it/faults_dynamodb.rs`; see
//! `docs/operations.md`, "Timeouts and recovery", for the recoveries measured.
//!
//! # Example
//!
//! ```no_run
//! use changefeed::lease::LeaseStore;
//! use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
//! use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // DynamoDB Local on loopback; `AwsOptions::default()` uses the standard AWS chain.
//! let options = AwsOptions::local("http://127.0.0.1:8000");
//! let store = DynamoLeaseStore::connect(&options, "changefeed-leases").await?;
//! let key = LeaseKey::new(GroupName::new("orders")?, PartitionId::new("shardId-000000000000")?);
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_some());
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_none());
//! assert_eq!(store.list(&key.group).await?.leases.len(), 1);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod aws;
mod error;
mod kcl;
mod shards;
mod store;
mod streams;
mod table;
mod view;

pub use aws::{AwsOptions, Timeouts};
pub use error::DynamoError;
pub use kcl::{
    export_kcl, import_kcl, kcl_holders, live_kcl_leases, ExportReport, ImportReport, KclHolder,
};
pub use shards::{
    heartbeat_shard_pk, A_SHARDS, DEFAULT_HEARTBEAT_SHARDS, DEFAULT_SHARDS_AT_HOSTS,
    MAX_HEARTBEAT_SHARDS,
};
pub use store::{
    heartbeat_pk, lease_pk, Capacity, DynamoLeaseStore, COUNTER_SK, DEFAULT_HEAD_READS_PER_SECOND,
    PK, SK,
};
pub use streams::{
    DynamoStreamsFeed, DynamoStreamsReader, RecordShape, StreamRef, StreamTable, StreamsOptions,
};
pub use view::view_pk;

/// The AWS SDK's DynamoDB Streams client, re-exported so callers need not depend on it.
pub use aws_sdk_dynamodbstreams as streams_sdk;

/// The AWS SDK's DynamoDB client, re-exported so callers need not depend on it.
pub use aws_sdk_dynamodb as sdk;
