//! SQLite lease store and feed source for changefeed: the embedded default backend.
//!
//! [`SqliteLeaseStore`] implements the core's [`LeaseStore`](changefeed::lease::LeaseStore)
//! and [`SqliteFeed`] its [`FeedSource`](changefeed::source::FeedSource), both in one database
//! file that several processes on one machine may share. This crate owns the file's schema
//! (created on first open and versioned, see [`SCHEMA_VERSION`]) and the mapping of rows to
//! the core's model; the lease protocol, balancing and lineage stay in the core.
//!
//! Schema version 2 adds the change stamps behind
//! [`LeaseStore::list_changes`](changefeed::lease::LeaseStore::list_changes): a `changed_at`
//! counter value on each lease row, a bounded table of recent deletions (see
//! [`CHANGE_HORIZON`]) and, per group, the oldest counter value it can answer from. A file of
//! version 1 is migrated on open; its groups answer from their counter as of the migration on.
//! Version 3 adds the membership view to each group's row, version 4 the `report` of each
//! heartbeat row (the host's capacity, limits and measured loads, JSON); an older file is
//! migrated on open, its rows reading as having none.
//! [`SqliteLeaseStore`] says what it answers.
//!
//! # Why rusqlite on the blocking pool
//!
//! SQLite is a synchronous C library: an "async" driver (sqlx) runs it on a worker thread
//! anyway, and adds a pool and a query layer we do not need. rusqlite is the mature, thin,
//! synchronous binding, and its `bundled` feature compiles SQLite in, so there is no system
//! library to install or mismatch. Each handle holds **one connection** behind a mutex, and
//! every call runs as **one short transaction** inside `tokio::task::spawn_blocking`, so the
//! async runtime is never blocked, not even while another process holds the file's write lock
//! (a call waits up to 5 s for it, then fails with a retryable error). Two exceptions keep the
//! per-batch cost of small batches down, where the hop to a blocking thread and back costs
//! more than the SQL: a checkpoint (one single-row `UPDATE`) runs on the calling thread when
//! the connection is free and no other writer holds the lock (else it goes to the blocking pool
//! and waits there), and a reader reads up to 1,000 records ahead in one transaction.
//!
//! # Concurrency and durability
//!
//! The file is in WAL mode: readers never block the writer. Every write is a
//! `BEGIN IMMEDIATE` transaction that takes the write lock first, then reads the row, checks
//! the expected version and writes, so compare-and-swap holds across connections and
//! processes. `synchronous = NORMAL` keeps every commit across a process crash; a power loss
//! may lose the last commits. Every host sharing the file is on that machine and restarts
//! with it, and a lost checkpoint only means some records are delivered again (at least once).
//!
//! # Example
//!
//! ```
//! use changefeed::lease::LeaseStore;
//! use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
//! use changefeed::source::FeedSource;
//! use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("changefeed.db");
//!
//! // The feed: four partitions, one record routed by its key.
//! let feed = SqliteFeed::open(&path).await?;
//! feed.create_partitions(4).await?;
//! let (partition, _) = feed.append("order-17", &b"created"[..]).await?;
//! let mut reader = feed.open(&partition, &Position::Beginning).await?;
//! assert_eq!(reader.next_batch(10).await?.records.len(), 1);
//!
//! // The leases, in the same file: creating is create-if-absent.
//! let store = SqliteLeaseStore::open(&path).await?;
//! let key = LeaseKey::new(GroupName::new("orders")?, partition);
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_some());
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_none());
//! assert_eq!(store.list(&key.group).await?.leases.len(), 1);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod db;
mod dead_letter;
mod error;
mod feed;
mod store;

pub use db::SCHEMA_VERSION;
pub use dead_letter::SqliteDeadLetters;
pub use error::SqliteError;
pub use feed::SqliteFeed;
pub use store::{SqliteLeaseStore, CHANGE_HORIZON};
