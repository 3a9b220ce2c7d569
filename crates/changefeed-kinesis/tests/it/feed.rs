//! The feed source conformance suite and Kinesis-specific checks.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::model::{PartitionId, Position};
use changefeed::source::FeedSource;
use changefeed::testkit::{feed_source_conformance, FeedFixture};
use changefeed_kinesis::{KinesisFeed, Retrieval};

use crate::fresh_feed;

struct Fixture {
    feed: KinesisFeed,
}

#[async_trait]
impl FeedFixture for Fixture {
    fn source(&self) -> Arc<dyn FeedSource> {
        Arc::new(self.feed.clone())
    }

    async fn append(&self, partition: &PartitionId, key: &str, data: &[u8]) {
        // Route to `partition` by its first hash key, as a producer with ExplicitHashKey does.
        let start = self
            .feed
            .partitions()
            .await
            .expect("list shards")
            .into_iter()
            .find(|p| &p.id == partition)
            .and_then(|p| p.key_range)
            .unwrap_or_else(|| panic!("shard {partition} is listed with a range"))
            .start;
        let (shard, _) = self
            .feed
            .put(key, data.to_vec(), Some(start))
            .await
            .expect("put record");
        assert_eq!(
            &shard, partition,
            "the explicit hash key routes to the shard"
        );
    }

    async fn split(&self, partition: &PartitionId) -> (PartitionId, PartitionId) {
        self.feed.split(partition).await.expect("SplitShard")
    }

    async fn merge(&self, a: &PartitionId, b: &PartitionId) -> PartitionId {
        self.feed.merge(a, b).await.expect("MergeShards")
    }

    fn tells_oldest_unread(&self) -> bool {
        true
    }

    async fn advance_wall_clock(&self, ms: u64) {
        // kinesis-mock stamps records with its own real clock: the only faithful way to move
        // it is to let that much real time pass (a short step, see wall_clock_step_ms).
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    fn wall_clock_step_ms(&self) -> u64 {
        1_500
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_fanout() {
    // The same suite with every shard read by enhanced fan-out (SubscribeToShard).
    feed_source_conformance(|| async {
        let feed = fresh_feed("conf-efo", 4).await;
        let consumer_name = format!("{}-consumer", feed.stream());
        Box::new(Fixture {
            feed: feed.with_retrieval(Retrieval::FanOut { consumer_name }),
        }) as Box<dyn FeedFixture>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance() {
    // Every source passes the core's feed suite against its real server (DESIGN.md).
    feed_source_conformance(|| async {
        Box::new(Fixture {
            feed: fresh_feed("conf", 4).await,
        }) as Box<dyn FeedFixture>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shards_pages_and_reports_lineage() {
    // ListShards is paginated; parents and adjacent parents become the partition's parents.
    let feed = fresh_feed("page", 3).await;
    let ps = feed.partitions().await.expect("partitions");
    assert_eq!(ps.len(), 3);
    let (a, b) = (ps[0].id.clone(), ps[1].id.clone());
    let child = feed.merge(&a, &b).await.expect("merge");
    let ps = feed.partitions().await.expect("partitions");
    let c = ps.iter().find(|p| p.id == child).expect("child listed");
    assert_eq!(
        c.parents,
        vec![a.clone(), b.clone()],
        "parent then adjacent parent"
    );
    assert!(ps.iter().filter(|p| p.closed).count() == 2);
    let mut reader = feed.open(&a, &Position::Beginning).await.expect("open");
    let batch = reader.next_batch(10).await.expect("read");
    assert!(
        batch.end_of_partition,
        "a merged parent ends (null next iterator)"
    );
}
