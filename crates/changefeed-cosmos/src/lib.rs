//! Azure Cosmos DB lease store for changefeed: leases, heartbeats and the change counter as
//! documents in one container.
//!
//! [`CosmosLeaseStore`] implements the core's [`LeaseStore`](changefeed::lease::LeaseStore) on
//! one Cosmos DB (NoSQL API) container, through the documented REST API signed with the
//! account key. This crate owns the document layout and the mapping of documents to the core's
//! model; the lease protocol, balancing and lineage stay in the core. [`CosmosFeed`] is the
//! feed source on a container's change feed (partition key ranges as partitions). [`import`] takes over the lease container of a .NET
//! change feed processor (v3 SDK or v2 library): our leases at its continuations.
//!
//! # Documents
//!
//! The container's partition key is `/group`: all of a group's documents are one logical
//! partition, so listing is a single-partition query and an ownership change is a
//! transactional batch with the group's change counter.
//!
//! | document | id | fields |
//! |---|---|---|
//! | lease | `lease.` + the partition id, escaped | `partition`, `state`, `owner`, `next_owner`, `continuation`, `start`, `parents`, `properties`, `version`, `changed_at` |
//! | heartbeat | `host.` + the host name, escaped | `host`, `incarnation`, `version`, `written_at` |
//! | change counter | `counter` | `counter`, `deletions_from`, and the membership view's small fields (`view_version`, `view_leader`, `view_incarnation`, `view_leader_heartbeat`, `view_body`, `view_parts`) |
//! | deletion record | `deleted.` + the counter value (20 digits) | `partition`, `deleted_at` |
//! | view body | `view.` + the body id + `.` + the part | `data`: a slice of the view's host lists as JSON |
//!
//! `changed_at` is the counter value of the lease's last change of hands, which lets
//! [`list_changes`](changefeed::lease::LeaseStore::list_changes) answer with one query on it
//! (and on `deleted_at`); deletion records older than
//! [`CosmosOptions::changes_kept`] counter moves are removed, and `deletions_from` says from
//! which counter value on they are all there.
//!
//! # Timeouts and recovery
//!
//! Every request is bounded ([`CosmosOptions::connect_timeout`], [`CosmosOptions::timeout`]):
//! connecting (TCP) [`DEFAULT_CONNECT_TIMEOUT`] (1 s); one attempt of a request, from
//! connecting to the last byte of the answer, [`DEFAULT_REQUEST_TIMEOUT`] (1 s); a request
//! safe to send twice (a read, a query, a `PUT` with `If-Match`, as a heartbeat or checkpoint
//! is) gets [`REQUEST_ATTEMPTS`] (2) attempts when one got no answer, others one. Pooled
//! connections are closed after [`POOL_IDLE_TIMEOUT`] (5 s) idle and probed by TCP keepalive
//! after [`TCP_KEEPALIVE`] (10 s). A connection whose request failed, timed out or was
//! cancelled is never reused (the `rest` module's docs say why, from hyper's source). So a
//! store call cut off by a network fault fails, retryable, within about 2 s a request, and with
//! the processor's defaults a host heartbeats again within `renew_interval + connect` (3 s) of
//! the path coming back. Socket faults are tested in `tests/it/faults.rs` and, with real
//! processes, in the CLI's `tests/it/faults_cosmos.rs`; see `docs/operations.md`, "Timeouts
//! and recovery", for the recoveries measured.
//!
//! # Example
//!
//! ```no_run
//! use changefeed::lease::LeaseStore;
//! use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
//! use changefeed_cosmos::{CosmosLeaseStore, CosmosOptions};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A local server; for an account: https://ACCOUNT.documents.azure.com:443/ and .key(…).
//! let options = CosmosOptions::new("http://127.0.0.1:8081", "app", "leases");
//! let store = CosmosLeaseStore::connect(&options).await?;
//! let key = LeaseKey::new(GroupName::new("orders")?, PartitionId::new("0")?);
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_some());
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_none());
//! assert_eq!(store.list(&key.group).await?.leases.len(), 1);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod doc;
mod error;
mod feed;
pub mod import;
mod rest;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use error::CosmosError;
pub use feed::{CosmosFeed, CosmosReader};
pub use import::{
    import_dotnet_leases, DotnetLeaseContainer, ImportError, ImportOptions, ImportReport,
};
pub use rest::{Usage, API_VERSION};
pub use store::{
    CosmosLeaseStore, CosmosOptions, DEFAULT_CHANGES_KEPT, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT, EMULATOR_KEY, POOL_IDLE_TIMEOUT, REQUEST_ATTEMPTS, TCP_KEEPALIVE,
};
