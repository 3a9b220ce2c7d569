//! The feed source on a temporary SQLite file: conformance suite and focused checks.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::clock::{Clock, Sleep};
use changefeed::model::{Continuation, PartitionId, Position, Timestamp};
use changefeed::source::FeedSource;
use changefeed::testkit::{feed_source_conformance, FeedFixture};
use changefeed::SourceError;
use changefeed_sqlite::SqliteFeed;
use tempfile::TempDir;

/// A clock whose wall time moves only when the test says so.
#[derive(Debug)]
pub struct ManualClock {
    wall_ms: AtomicI64,
}

impl ManualClock {
    pub fn new(start_ms: i64) -> Self {
        Self {
            wall_ms: AtomicI64::new(start_ms),
        }
    }

    pub fn advance(&self, ms: u64) {
        self.wall_ms.fetch_add(ms as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }

    fn wall(&self) -> Timestamp {
        Timestamp(self.wall_ms.load(Ordering::SeqCst))
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// A fresh feed file with 4 open partitions and a manual wall clock.
pub struct Fixture {
    _dir: TempDir,
    path: PathBuf,
    feed: SqliteFeed,
    clock: Arc<ManualClock>,
}

impl Fixture {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("feed.db");
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let feed = SqliteFeed::open_with_clock(&path, clock.clone())
            .await
            .unwrap();
        assert!(feed.create_partitions(4).await.unwrap());
        Self {
            _dir: dir,
            path,
            feed,
            clock,
        }
    }
}

#[async_trait]
impl FeedFixture for Fixture {
    fn source(&self) -> Arc<dyn FeedSource> {
        Arc::new(self.feed.clone())
    }

    async fn append(&self, partition: &PartitionId, key: &str, data: &[u8]) {
        self.feed
            .append_to(partition, key, data.to_vec())
            .await
            .unwrap();
    }

    async fn split(&self, partition: &PartitionId) -> (PartitionId, PartitionId) {
        self.feed.split(partition).await.unwrap()
    }

    async fn merge(&self, a: &PartitionId, b: &PartitionId) -> PartitionId {
        self.feed.merge(a, b).await.unwrap()
    }

    fn tells_oldest_unread(&self) -> bool {
        true
    }

    async fn advance_wall_clock(&self, ms: u64) {
        self.clock.advance(ms);
    }
}

fn pid(id: &str) -> PartitionId {
    PartitionId::new(id).unwrap()
}

async fn read_all(feed: &SqliteFeed, p: &PartitionId, from: Position) -> Vec<String> {
    let mut reader = feed.open(p, &from).await.unwrap();
    let mut keys = Vec::new();
    loop {
        let batch = reader.next_batch(3).await.unwrap();
        if batch.records.is_empty() {
            return keys;
        }
        keys.extend(batch.records.into_iter().map(|r| r.key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance() {
    // Every source passes the core's feed suite (DESIGN.md: conformance suite).
    feed_source_conformance(|| async { Box::new(Fixture::new().await) as Box<dyn FeedFixture> })
        .await
}

#[tokio::test]
async fn records_route_by_key_and_read_back_in_order_from_a_continuation() {
    // Within a partition, records come back in append order, resuming after a continuation.
    let fx = Fixture::new().await;
    let feed = &fx.feed;
    let mut last = None;
    let mut routed = None;
    for i in 0..10 {
        let (p, c) = feed.append("same-key", format!("r{i}")).await.unwrap();
        assert!(
            routed.get_or_insert(p.clone()) == &p,
            "one key, one partition"
        );
        if i == 4 {
            last = Some(c);
        }
    }
    let p = routed.unwrap();
    assert_eq!(feed.len(&p).await.unwrap(), 10);

    let mut reader = feed.open(&p, &Position::Beginning).await.unwrap();
    let batch = reader.next_batch(4).await.unwrap();
    let data: Vec<_> = batch.records.iter().map(|r| r.data.clone()).collect();
    assert_eq!(data, ["r0", "r1", "r2", "r3"].map(bytes::Bytes::from));
    assert_eq!(
        batch.continuation,
        Some(batch.records[3].continuation.clone())
    );
    assert!(!batch.end_of_partition);

    let c = last.unwrap();
    let mut reader = feed
        .open(&p, &Position::Continuation(c.clone()))
        .await
        .unwrap();
    let batch = reader.next_batch(100).await.unwrap();
    assert_eq!(batch.records.len(), 5);
    assert_eq!(batch.records[0].data, bytes::Bytes::from("r5"));
    assert_eq!(feed.remaining(&p, Some(&c)).await.unwrap(), Some(5));
    assert_eq!(feed.remaining(&p, None).await.unwrap(), Some(10));

    // Nothing new yet: an empty batch that does not move the continuation.
    let empty = reader.next_batch(100).await.unwrap();
    assert!(empty.records.is_empty() && empty.continuation.is_none());
    assert!(!empty.end_of_partition);

    // `Now` starts after the newest record.
    let mut now = feed.open(&p, &Position::Now).await.unwrap();
    feed.append_to(&p, "late", &b"x"[..]).await.unwrap();
    assert_eq!(now.next_batch(10).await.unwrap().records[0].key, "late");
}

#[tokio::test]
async fn split_and_merge_close_parents_and_number_children_like_the_memory_feed() {
    // Resharding closes the parent and opens children atomically (DESIGN.md: lineage).
    let fx = Fixture::new().await;
    let feed = &fx.feed;
    feed.append_to(&pid("1"), "k", &b"a"[..]).await.unwrap();
    let (left, right) = feed.split(&pid("1")).await.unwrap();
    assert_eq!((left.as_str(), right.as_str()), ("4", "5"));
    let merged = feed.merge(&pid("2"), &pid("3")).await.unwrap();
    assert_eq!(merged.as_str(), "6");

    let parts = feed.partitions().await.unwrap();
    let ids: Vec<_> = parts.iter().map(|p| p.id.to_string()).collect();
    assert_eq!(ids, ["0", "1", "2", "3", "4", "5", "6"]);
    let by_id = |id: &str| parts.iter().find(|p| p.id.as_str() == id).unwrap().clone();
    assert!(by_id("1").closed && by_id("2").closed && by_id("3").closed);
    assert_eq!(by_id("4").parents, [pid("1")]);
    assert_eq!(by_id("6").parents, [pid("2"), pid("3")]);
    let (r1, r4, r5) = (
        by_id("1").key_range.unwrap(),
        by_id("4").key_range.unwrap(),
        by_id("5").key_range.unwrap(),
    );
    assert_eq!((r4.start, r4.end + 1, r5.end), (r1.start, r5.start, r1.end));
    // The merged child covers both parents exactly.
    let r6 = by_id("6").key_range.unwrap();
    assert_eq!(
        (r6.start, r6.end),
        (
            by_id("2").key_range.unwrap().start,
            by_id("3").key_range.unwrap().end
        )
    );

    // The closed parent's reader reaches its end; appending to it is refused.
    let mut reader = feed.open(&pid("1"), &Position::Beginning).await.unwrap();
    let batch = reader.next_batch(10).await.unwrap();
    assert_eq!(batch.records.len(), 1);
    assert!(batch.end_of_partition);
    assert!(matches!(
        feed.append_to(&pid("1"), "k", &b"b"[..]).await,
        Err(SourceError::Corrupt { .. })
    ));
    // Closed partitions cannot be split again; non-adjacent ones cannot merge.
    assert!(matches!(
        feed.split(&pid("1")).await,
        Err(SourceError::Corrupt { .. })
    ));
    assert!(matches!(
        feed.merge(&pid("0"), &pid("5")).await,
        Err(SourceError::Corrupt { .. })
    ));
    assert!(matches!(
        feed.split(&pid("99")).await,
        Err(SourceError::UnknownPartition { .. })
    ));

    // Records now route to the children only.
    for i in 0..50 {
        let (p, _) = feed.append(&format!("key-{i}"), &b"v"[..]).await.unwrap();
        assert!(["0", "4", "5", "6"].contains(&p.as_str()), "{p}");
    }
}

#[tokio::test]
async fn bad_continuations_are_refused_naming_the_partition() {
    // An unknown continuation is reported, never read from (DESIGN.md: bad input).
    let fx = Fixture::new().await;
    let feed = &fx.feed;
    let c0 = feed.append_to(&pid("0"), "k", &b"a"[..]).await.unwrap();
    feed.append_to(&pid("1"), "k", &b"a"[..]).await.unwrap();
    for (partition, token) in [
        ("1", c0.as_str().to_string()), // another partition's
        ("0", "garbage".to_string()),
        ("0", "0:x".to_string()),
        ("0", "0:2".to_string()), // past the end
    ] {
        let from = Position::Continuation(Continuation::new(token.clone()));
        match feed.open(&pid(partition), &from).await {
            Err(SourceError::InvalidContinuation {
                partition: p,
                continuation,
                ..
            }) => {
                assert_eq!(p, partition);
                assert_eq!(continuation, token);
            }
            other => panic!("{token}: expected InvalidContinuation, got {other:?}"),
        }
        assert!(feed
            .remaining(&pid(partition), Some(&Continuation::new(token)))
            .await
            .is_err());
    }
    assert!(matches!(
        feed.open(&pid("9"), &Position::Beginning).await,
        Err(SourceError::UnknownPartition { .. })
    ));
}

#[tokio::test]
async fn at_time_starts_at_the_first_record_written_then() {
    // AtTime(t) reads from the first record stamped at or after t by the feed's clock.
    let fx = Fixture::new().await;
    let feed = &fx.feed;
    let p = pid("2");
    feed.append_to(&p, "early", &b""[..]).await.unwrap();
    fx.advance_wall_clock(1_000).await;
    let t = fx.clock.wall();
    feed.append_to(&p, "on-time", &b""[..]).await.unwrap();
    fx.advance_wall_clock(1_000).await;
    feed.append_to(&p, "late", &b""[..]).await.unwrap();

    assert_eq!(
        read_all(feed, &p, Position::AtTime(t)).await,
        ["on-time", "late"]
    );
    assert_eq!(
        read_all(feed, &p, Position::AtTime(Timestamp(t.0 + 1))).await,
        ["late"]
    );
    assert!(read_all(feed, &p, Position::AtTime(Timestamp(t.0 + 5_000)))
        .await
        .is_empty());
    assert_eq!(read_all(feed, &p, Position::Beginning).await.len(), 3);
}

#[tokio::test]
async fn a_second_handle_on_the_file_sees_the_same_feed() {
    // The feed lives in the file: another connection (or process) reads what one wrote.
    let fx = Fixture::new().await;
    let (p, _) = fx.feed.append("k", &b"v"[..]).await.unwrap();
    let other = SqliteFeed::open(&fx.path).await.unwrap();
    assert!(
        !other.create_partitions(8).await.unwrap(),
        "already created"
    );
    assert_eq!(other.partitions().await.unwrap().len(), 4);
    assert_eq!(read_all(&other, &p, Position::Beginning).await, ["k"]);
}

#[tokio::test]
async fn each_batch_is_the_next_records_the_file_holds_whatever_was_read_ahead() {
    // A reader reads ahead of small batches in one transaction, yet each batch is the next
    // `max` records the file holds when it is asked for, as without reading ahead: records
    // appended after a read fill the batch up, every record comes once and in order across
    // the reads, and a partition closed after a read ends once what was read is delivered.
    let fx = Fixture::new().await;
    let (feed, p) = (&fx.feed, pid("1"));
    for i in 1..=5 {
        feed.append_to(&p, &format!("k{i}"), &b"v"[..])
            .await
            .unwrap();
    }
    let mut reader = feed.open(&p, &Position::Beginning).await.unwrap();
    let keys = |b: &changefeed::model::Batch| -> Vec<String> {
        b.records.iter().map(|r| r.key.clone()).collect()
    };
    assert_eq!(keys(&reader.next_batch(2).await.unwrap()), ["k1", "k2"]);
    for i in 6..=8 {
        feed.append_to(&p, &format!("k{i}"), &b"v"[..])
            .await
            .unwrap();
    }
    let batch = reader.next_batch(10).await.unwrap();
    assert_eq!(keys(&batch), ["k3", "k4", "k5", "k6", "k7", "k8"]);
    assert_eq!(batch.continuation, Some(Continuation::new("1:8")));

    // Far more records than one read takes ahead: full batches, in order, each once.
    for i in 9..=2_508 {
        feed.append_to(&p, &format!("k{i}"), &b"v"[..])
            .await
            .unwrap();
    }
    let mut next = 9;
    while next <= 2_508 {
        let batch = reader.next_batch(10).await.unwrap();
        let want: Vec<String> = (next..next + 10).map(|i| format!("k{i}")).collect();
        assert_eq!(keys(&batch), want);
        assert_eq!(
            batch.continuation,
            Some(Continuation::new(format!("1:{}", next + 9)))
        );
        assert!(!batch.end_of_partition);
        next += 10;
    }
    assert!(reader.next_batch(10).await.unwrap().records.is_empty());

    // Closed while the reader holds records it read ahead: those come first, the last batch
    // carries the end.
    feed.append_to(&p, "k2509", &b"v"[..]).await.unwrap();
    feed.append_to(&p, "k2510", &b"v"[..]).await.unwrap();
    assert_eq!(keys(&reader.next_batch(1).await.unwrap()), ["k2509"]);
    feed.split(&p).await.unwrap();
    let last = reader.next_batch(10).await.unwrap();
    assert_eq!(keys(&last), ["k2510"]);
    assert!(last.end_of_partition);
}
