//! The feed source conformance suite.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::SourceError;
use crate::model::{Continuation, Partition, PartitionId, Position, Record};
use crate::source::{FeedSource, OldestUnread, PartitionReader};

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
    /// How far the `AtTime` check moves the wall clock, in milliseconds (at least 1). The
    /// default, a minute, suits a clock the fixture controls; a real server that stamps records
    /// with its own clock is advanced by really waiting, so its fixture returns a short step.
    fn wall_clock_step_ms(&self) -> u64 {
        60_000
    }
    /// Whether the source tells when the first unread record was written
    /// ([`FeedSource::oldest_unread`]); the suite then requires the exact answers. Default: no
    /// (the suite still requires a source that answers to answer correctly).
    fn tells_oldest_unread(&self) -> bool {
        false
    }
    /// How many open partitions the fixture starts with (at least 1). Default 4, covering the
    /// key space; a source whose partitions the writer cannot choose (a DynamoDB stream of a
    /// small table has one shard) starts with fewer, and the checks that need a second
    /// partition check what one allows.
    fn partitions_at_start(&self) -> usize {
        4
    }
    /// Whether [`FeedFixture::split`] and [`FeedFixture::merge`] can be done on demand.
    /// Default: yes. A source whose service alone decides when a partition ends (DynamoDB
    /// Streams rolls its shards over by itself) skips the split and merge checks, and its
    /// lineage is checked on recorded listings instead.
    fn reshards(&self) -> bool {
        true
    }
    /// Whether the server refuses a well-formed continuation this partition never issued (a
    /// sequence number past its last record). Default: yes. A server that accepts one and
    /// reads nothing after it (moto's DynamoDB Streams) leaves the source nothing to refuse,
    /// so that one case is not checked against it; malformed and foreign continuations still
    /// are.
    fn server_refuses_unissued_continuations(&self) -> bool {
        true
    }
    /// What [`FeedFixture::append`] wrote, as the source's record carries it. Default: the
    /// record's data as text. A source whose records wrap the written value (DynamoDB Streams:
    /// a JSON document with the item's images) takes it back out.
    fn payload(&self, record: &Record) -> String {
        String::from_utf8_lossy(&record.data).into_owned()
    }
}

type Check = for<'a> fn(
    &'a dyn FeedFixture,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        [$((stringify!($name), (|f| Box::pin($name(f))) as Check)),*]
    };
}

/// Runs every feed source check, each on a fresh fixture from `factory`, and panics naming the
/// first check that fails. The fixture starts with at least 4 open partitions covering the key
/// space in order (adjacent ranges for the first two), and no records.
pub async fn feed_source_conformance<F, Fut>(factory: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Box<dyn FeedFixture>>,
{
    let all = checks![
        partitions_start_open_and_cover_the_key_space,
        records_come_back_in_order,
        batches_respect_the_maximum,
        continuation_resumes_exactly_after_its_record,
        beginning_now_and_at_time,
        split_ends_the_parent_and_lists_children,
        merge_ends_both_parents_and_lists_the_child,
        bad_continuations_are_named_errors,
        unknown_partition_is_a_named_error,
        remaining_counts_records_after_a_continuation,
        oldest_unread_is_the_first_record_after_a_continuation,
    ];
    for (name, check) in all {
        let fixture = factory().await;
        let resharding = name.starts_with("split_") || name.starts_with("merge_");
        if resharding && !fixture.reshards() {
            eprintln!("feed source conformance: {name}: skipped, the fixture cannot reshard");
            continue;
        }
        eprintln!("feed source conformance: {name}");
        check(fixture.as_ref()).await;
    }
}

async fn open_partitions(f: &dyn FeedFixture) -> Vec<Partition> {
    let mut ps: Vec<_> = f
        .source()
        .partitions()
        .await
        .expect("partitions")
        .into_iter()
        .filter(|p| !p.closed)
        .collect();
    ps.sort_by_key(|p| p.key_range.map(|r| r.start));
    ps
}

async fn read_all(reader: &mut dyn PartitionReader, max: usize) -> (Vec<Record>, bool) {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        let batch = reader.next_batch(max).await.expect("read");
        assert!(
            batch.records.len() <= max,
            "a batch holds at most max records"
        );
        if let (Some(last), Some(c)) = (batch.records.last(), &batch.continuation) {
            assert_eq!(
                &last.continuation, c,
                "the batch continuation is its last record's"
            );
        }
        let empty = batch.records.is_empty();
        out.extend(batch.records);
        if batch.end_of_partition {
            return (out, true);
        }
        if empty {
            return (out, false);
        }
    }
    panic!("reader never ran dry");
}

fn data(f: &dyn FeedFixture, records: &[Record]) -> Vec<String> {
    records.iter().map(|r| f.payload(r)).collect()
}

async fn partitions_start_open_and_cover_the_key_space(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let want = f.partitions_at_start().max(1);
    assert!(
        ps.len() >= want,
        "the fixture starts with at least {want} open partitions"
    );
    for p in &ps {
        assert!(p.parents.is_empty(), "original partitions have no parents");
    }
    if ps.iter().all(|p| p.key_range.is_some()) {
        let ranges: Vec<_> = ps.iter().filter_map(|p| p.key_range).collect();
        assert_eq!(ranges[0].start, 0, "ranges start at 0");
        assert_eq!(
            ranges[ranges.len() - 1].end,
            u128::MAX,
            "and end at the top"
        );
        for w in ranges.windows(2) {
            assert_eq!(w[0].end + 1, w[1].start, "ranges are contiguous");
        }
    }
}

async fn records_come_back_in_order(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let a = &ps[0].id;
    let b = ps.get(1).map(|p| &p.id);
    for i in 0..50 {
        f.append(a, &format!("k{}", i % 7), format!("a{i}").as_bytes())
            .await;
        if let (Some(b), 0) = (b, i % 2) {
            f.append(b, "kb", format!("b{i}").as_bytes()).await;
        }
    }
    let source = f.source();
    let mut ra = source.open(a, &Position::Beginning).await.expect("open");
    let (got, ended) = read_all(ra.as_mut(), 7).await;
    assert!(!ended, "an open partition does not end");
    assert_eq!(
        data(f, &got),
        (0..50).map(|i| format!("a{i}")).collect::<Vec<_>>()
    );
    assert_eq!(got[3].key, "k3", "keys round-trip");
    if let Some(b) = b {
        let mut rb = source.open(b, &Position::Beginning).await.expect("open");
        let (got, _) = read_all(rb.as_mut(), 100).await;
        assert_eq!(got.len(), 25, "partitions do not mix");
    }
    // New records appear to an open reader.
    f.append(a, "k", b"a50").await;
    let batch = ra.next_batch(10).await.expect("read");
    assert_eq!(data(f, &batch.records), ["a50"]);
}

async fn batches_respect_the_maximum(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let p = &ps[0].id;
    for i in 0..10 {
        f.append(p, "k", format!("{i}").as_bytes()).await;
    }
    let mut r = f
        .source()
        .open(p, &Position::Beginning)
        .await
        .expect("open");
    let b = r.next_batch(1).await.expect("read");
    assert_eq!(data(f, &b.records), ["0"]);
    let b = r.next_batch(4).await.expect("read");
    assert_eq!(data(f, &b.records), ["1", "2", "3", "4"]);
    let b = r.next_batch(100).await.expect("read");
    assert_eq!(b.records.len(), 5);
    let b = r.next_batch(100).await.expect("read");
    assert!(b.records.is_empty() && !b.end_of_partition && b.continuation.is_none());
}

async fn continuation_resumes_exactly_after_its_record(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let p = &ps[0].id;
    for i in 0..20 {
        f.append(p, "k", format!("{i}").as_bytes()).await;
    }
    let source = f.source();
    let mut r = source.open(p, &Position::Beginning).await.expect("open");
    let (all, _) = read_all(r.as_mut(), 20).await;
    for cut in [0usize, 1, 9, 19] {
        let c = all[cut].continuation.clone();
        let mut r = source
            .open(p, &Position::Continuation(c))
            .await
            .expect("open at continuation");
        let (rest, _) = read_all(r.as_mut(), 3).await;
        assert_eq!(
            data(f, &rest),
            (cut + 1..20).map(|i| i.to_string()).collect::<Vec<_>>(),
            "resuming after record {cut} returns exactly the records after it"
        );
    }
}

async fn beginning_now_and_at_time(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let p = &ps[0].id;
    for i in 0..3 {
        f.append(p, "k", format!("old{i}").as_bytes()).await;
    }
    let step = f.wall_clock_step_ms().max(1);
    f.advance_wall_clock(step).await;
    let source = f.source();
    let mut now = source.open(p, &Position::Now).await.expect("open now");
    for i in 0..2 {
        f.append(p, "k", format!("new{i}").as_bytes()).await;
    }
    let (got, _) = read_all(now.as_mut(), 10).await;
    assert_eq!(
        data(f, &got),
        ["new0", "new1"],
        "Now starts after what was there at open"
    );
    let mut begin = source.open(p, &Position::Beginning).await.expect("open");
    let (all, _) = read_all(begin.as_mut(), 10).await;
    assert_eq!(all.len(), 5, "Beginning returns everything");
    let t_new = all[3].timestamp.expect("this source stamps records");
    let t_old = all[2].timestamp.expect("this source stamps records");
    assert!(
        t_new.0 >= t_old.0 + step as i64,
        "the fixture advanced the clock"
    );
    let mut at = source
        .open(p, &Position::AtTime(t_new))
        .await
        .expect("open at time");
    let (got, _) = read_all(at.as_mut(), 10).await;
    assert_eq!(
        data(f, &got),
        ["new0", "new1"],
        "AtTime starts at the first record at or after it"
    );
}

async fn split_ends_the_parent_and_lists_children(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let parent = ps[0].id.clone();
    f.append(&parent, "k", b"before").await;
    let source = f.source();
    let mut reader = source
        .open(&parent, &Position::Beginning)
        .await
        .expect("open");
    let (left, right) = f.split(&parent).await;
    let all = source.partitions().await.expect("partitions");
    let find = |id: &PartitionId| {
        all.iter()
            .find(|p| &p.id == id)
            .unwrap_or_else(|| panic!("partition {id} is listed"))
            .clone()
    };
    assert!(find(&parent).closed, "the split parent is closed");
    for child in [&left, &right] {
        let c = find(child);
        assert_eq!(
            c.parents,
            vec![parent.clone()],
            "children are listed with their parent"
        );
        assert!(!c.closed);
    }
    if let (Some(p), Some(l), Some(r)) = (
        find(&parent).key_range,
        find(&left).key_range,
        find(&right).key_range,
    ) {
        assert_eq!(
            (l.start, r.end),
            (p.start, p.end),
            "children cover the parent's range"
        );
        assert_eq!(l.end + 1, r.start, "children are contiguous");
    }
    let (got, ended) = read_all(reader.as_mut(), 10).await;
    assert_eq!(data(f, &got), ["before"]);
    assert!(
        ended,
        "the reader of a split parent reaches end-of-partition"
    );
    let again = reader.next_batch(10).await.expect("read after end");
    assert!(
        again.records.is_empty() && again.end_of_partition,
        "the end is sticky"
    );
    f.append(&left, "k", b"child").await;
    let mut cr = source
        .open(&left, &Position::Beginning)
        .await
        .expect("open child");
    let (got, ended) = read_all(cr.as_mut(), 10).await;
    assert_eq!(data(f, &got), ["child"]);
    assert!(!ended);
}

async fn merge_ends_both_parents_and_lists_the_child(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let (a, b) = (ps[0].id.clone(), ps[1].id.clone());
    f.append(&a, "k", b"a").await;
    let source = f.source();
    let child = f.merge(&a, &b).await;
    let all = source.partitions().await.expect("partitions");
    for p in [&a, &b] {
        assert!(
            all.iter().any(|x| &x.id == p && x.closed),
            "merged parent {p} is closed"
        );
    }
    let c = all.iter().find(|x| x.id == child).expect("child is listed");
    let mut parents = c.parents.clone();
    parents.sort();
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    assert_eq!(parents, want, "the child names both parents");
    for (p, n) in [(&a, 1), (&b, 0)] {
        let mut r = source.open(p, &Position::Beginning).await.expect("open");
        let (got, ended) = read_all(r.as_mut(), 10).await;
        assert_eq!(got.len(), n);
        assert!(ended, "parent {p} reaches end-of-partition");
    }
}

async fn bad_continuations_are_named_errors(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let a = &ps[0].id;
    f.append(a, "k", b"x").await;
    let source = f.source();
    let mut bad = vec![Continuation::new("garbage"), Continuation::new("")];
    if f.server_refuses_unissued_continuations() {
        bad.push(Continuation::new("99999999999999999999999999"));
    }
    // A continuation of another partition, where there is one.
    if let Some(b) = ps.get(1).map(|p| &p.id) {
        f.append(b, "k", b"y").await;
        let mut rb = source.open(b, &Position::Beginning).await.expect("open");
        bad.push(
            rb.next_batch(1).await.expect("read").records[0]
                .continuation
                .clone(),
        );
    }
    for bad in bad {
        match source.open(a, &Position::Continuation(bad.clone())).await {
            Err(e @ SourceError::InvalidContinuation { .. }) => {
                assert!(
                    e.to_string().contains(a.as_str()),
                    "names the partition: {e}"
                );
            }
            other => panic!("continuation {bad:?} on partition {a} must be refused, got {other:?}"),
        }
    }
}

async fn unknown_partition_is_a_named_error(f: &dyn FeedFixture) {
    let ghost = PartitionId::new("no-such-partition").expect("valid");
    match f.source().open(&ghost, &Position::Beginning).await {
        Err(e @ SourceError::UnknownPartition { .. }) => {
            assert!(e.to_string().contains("no-such-partition"), "{e}")
        }
        other => panic!("an unknown partition must be refused, got {other:?}"),
    }
}

async fn remaining_counts_records_after_a_continuation(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let p = &ps[0].id;
    for i in 0..10 {
        f.append(p, "k", format!("{i}").as_bytes()).await;
    }
    let source = f.source();
    let Some(total) = source.remaining(p, None).await.expect("remaining") else {
        return; // this source cannot estimate; allowed by the contract
    };
    assert_eq!(total, 10);
    let mut r = source.open(p, &Position::Beginning).await.expect("open");
    let b = r.next_batch(4).await.expect("read");
    let c = b.continuation.expect("read something");
    assert_eq!(
        source.remaining(p, Some(&c)).await.expect("remaining"),
        Some(6)
    );
}

async fn oldest_unread_is_the_first_record_after_a_continuation(f: &dyn FeedFixture) {
    let ps = open_partitions(f).await;
    let p = &ps[0].id;
    let source = f.source();
    let before = source.oldest_unread(p, None).await.expect("oldest_unread");
    if before == OldestUnread::Unknown && !f.tells_oldest_unread() {
        return; // this source cannot tell; allowed by the contract
    }
    assert_eq!(
        before,
        OldestUnread::CaughtUp,
        "an empty partition has nothing unread"
    );
    for i in 0..3 {
        f.append(p, "k", format!("{i}").as_bytes()).await;
    }
    let mut r = source.open(p, &Position::Beginning).await.expect("open");
    let (all, _) = read_all(r.as_mut(), 10).await;
    assert_eq!(all.len(), 3);
    let stamp = |i: usize| all[i].timestamp.expect("this source stamps records");
    assert_eq!(
        source.oldest_unread(p, None).await.expect("oldest_unread"),
        OldestUnread::At(stamp(0)),
        "from the beginning, the first record is the oldest unread"
    );
    assert_eq!(
        source
            .oldest_unread(p, Some(&all[0].continuation))
            .await
            .expect("oldest_unread"),
        OldestUnread::At(stamp(1)),
        "after a continuation, the record after it is the oldest unread"
    );
    assert_eq!(
        source
            .oldest_unread(p, Some(&all[2].continuation))
            .await
            .expect("oldest_unread"),
        OldestUnread::CaughtUp,
        "after the last record, nothing is unread"
    );
}
