//! Share the work of reading a partitioned change feed across a fleet of processes.
//!
//! Each partition of a feed is owned by one host at a time through a lease kept in a shared
//! lease store. This crate holds the core: the model ([`model`]), the lease store seam
//! ([`lease`]), the feed source seam ([`source`]) and the injectable clock ([`clock`]), with
//! in-memory implementations of both seams. Backends (SQLite, PostgreSQL …) live in their own
//! crates and implement the traits; the `testkit` feature exposes the conformance suites they
//! all pass.
//!
//! ```
//! use changefeed::lease::{LeaseStore, MemoryLeaseStore};
//! use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryLeaseStore::new();
//! let group = GroupName::new("orders")?;
//! let key = LeaseKey::new(group.clone(), PartitionId::new("0")?);
//! // Creating is create-if-absent: the second call finds the lease there.
//! assert!(store.create(&Lease::new(key.clone(), Position::Beginning)).await?.is_some());
//! assert!(store.create(&Lease::new(key, Position::Beginning)).await?.is_none());
//! assert_eq!(store.list(&group).await?.leases.len(), 1);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod admin;
pub mod balance;
pub mod clock;
pub mod error;
#[cfg(any(feature = "testkit", feature = "sim"))]
pub mod fleet;
pub mod lag;
pub mod lease;
pub mod lineage;
pub mod model;
pub mod processor;
#[cfg(feature = "sim")]
pub mod sim;
pub mod source;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use error::{LeaseError, ModelError, SourceError};
