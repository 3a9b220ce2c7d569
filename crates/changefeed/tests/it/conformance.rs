//! The in-memory store and feed pass the conformance suites every backend runs.

use std::sync::Arc;

use async_trait::async_trait;
use changefeed::clock::VirtualClock;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{LeaseKey, PartitionId, Timestamp};
use changefeed::source::{FeedSource, MemoryFeed};
use changefeed::testkit::{
    feed_source_conformance, lease_store_conformance, Corruption, FeedFixture, LeaseStoreFixture,
};

struct MemoryStoreFixture(MemoryLeaseStore);

#[async_trait]
impl LeaseStoreFixture for MemoryStoreFixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        Arc::new(self.0.clone())
    }

    fn answers_changes(&self) -> bool {
        true
    }

    fn keeps_view(&self) -> bool {
        true
    }

    fn changes_horizon(&self) -> Option<u64> {
        // The store's log of counter moves (docs/backends.md).
        Some(16_384)
    }

    async fn corrupt(&self, key: &LeaseKey, how: Corruption) {
        // The reasons a real store would give for such a row.
        let reason = match how {
            Corruption::BadPropertiesJson => "properties: not a JSON object of strings",
            Corruption::UnknownState => "state: unknown state `borrowed`",
        };
        self.0.corrupt(key, reason);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_lease_store_passes_the_conformance_suite() {
    lease_store_conformance(|| async {
        Box::new(MemoryStoreFixture(MemoryLeaseStore::new())) as Box<dyn LeaseStoreFixture>
    })
    .await;
}

struct MemoryFeedFixture(MemoryFeed);

#[async_trait]
impl FeedFixture for MemoryFeedFixture {
    fn source(&self) -> Arc<dyn FeedSource> {
        Arc::new(self.0.clone())
    }

    async fn append(&self, partition: &PartitionId, key: &str, data: &[u8]) {
        self.0
            .append_to(partition, key, data.to_vec())
            .expect("append to an open partition");
    }

    async fn split(&self, partition: &PartitionId) -> (PartitionId, PartitionId) {
        self.0.split(partition).expect("split")
    }

    async fn merge(&self, a: &PartitionId, b: &PartitionId) -> PartitionId {
        self.0.merge(a, b).expect("merge")
    }

    fn tells_oldest_unread(&self) -> bool {
        true
    }

    async fn advance_wall_clock(&self, ms: u64) {
        tokio::time::advance(std::time::Duration::from_millis(ms)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn memory_feed_passes_the_conformance_suite() {
    feed_source_conformance(|| async {
        let clock = Arc::new(VirtualClock::new(Timestamp(1_700_000_000_000)));
        Box::new(MemoryFeedFixture(MemoryFeed::with_clock(4, clock))) as Box<dyn FeedFixture>
    })
    .await;
}
