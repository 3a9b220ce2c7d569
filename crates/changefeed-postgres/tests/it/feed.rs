//! The outbox feed source on a real server: conformance suite, the late-commit gap against a
//! naive reader, concurrent writers, and re-partitioning.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::model::{PartitionId, Position, Record};
use changefeed::source::{FeedSource, PartitionReader};
use changefeed::testkit::{feed_source_conformance, FeedFixture};
use changefeed_postgres::{append, append_to, OutboxTable, PostgresOutbox};

use crate::common::{raw_client, ManualClock, Prefixes};

/// Waits until every transaction that was running when `xid` committed has finished, so
/// the row is readable (the reader only reads below the snapshot's `xmin`). This polls the
/// server's own state, with no timer: each round trip is the wait.
async fn wait_readable(client: &tokio_postgres::Client, xid: i64) {
    for _ in 0..200_000 {
        let ready: bool = client
            .query_one(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint > $1",
                &[&xid],
            )
            .await
            .unwrap()
            .get(0);
        if ready {
            return;
        }
    }
    panic!("transactions older than {xid} are still running on the server");
}

struct Fixture {
    outbox: PostgresOutbox,
    table: OutboxTable,
    clock: Arc<ManualClock>,
    client: tokio::sync::Mutex<tokio_postgres::Client>,
}

#[async_trait]
impl FeedFixture for Fixture {
    fn source(&self) -> Arc<dyn FeedSource> {
        Arc::new(self.outbox.clone())
    }

    async fn append(&self, partition: &PartitionId, key: &str, data: &[u8]) {
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.unwrap();
        let a = append_to(&tx, &self.table, partition, key, data)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        wait_readable(&client, a.xid).await;
    }

    async fn split(&self, partition: &PartitionId) -> (PartitionId, PartitionId) {
        self.outbox.split(partition).await.unwrap()
    }

    async fn merge(&self, a: &PartitionId, b: &PartitionId) -> PartitionId {
        self.outbox.merge(a, b).await.unwrap()
    }

    fn tells_oldest_unread(&self) -> bool {
        true
    }

    async fn advance_wall_clock(&self, ms: u64) {
        self.clock.advance(ms);
    }
}

async fn outbox(prefixes: &Prefixes, partitions: u32) -> (PostgresOutbox, OutboxTable) {
    let prefix = prefixes.fresh();
    let clock = ManualClock::new(1_700_000_000_000);
    let table = OutboxTable::new(&prefix).unwrap().with_clock(clock);
    let outbox = PostgresOutbox::connect(prefixes.options(&prefix), table.clone())
        .await
        .unwrap();
    assert!(outbox.create_partitions(partitions).await.unwrap());
    (outbox, table)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outbox_passes_the_feed_source_conformance_suite() {
    let prefixes = Prefixes::new().await;
    feed_source_conformance(|| async {
        let prefix = prefixes.fresh();
        let clock = ManualClock::new(1_700_000_000_000);
        let table = OutboxTable::new(&prefix).unwrap().with_clock(clock.clone());
        let outbox = PostgresOutbox::connect(prefixes.options(&prefix), table.clone())
            .await
            .unwrap();
        assert!(outbox.create_partitions(4).await.unwrap());
        Box::new(Fixture {
            outbox,
            table,
            clock,
            client: tokio::sync::Mutex::new(raw_client().await),
        }) as Box<dyn FeedFixture>
    })
    .await;
    prefixes.cleanup().await;
}

fn data(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| String::from_utf8_lossy(&r.data).into_owned())
        .collect()
}

/// The classic outbox reader this source is measured against: `seq > last`, with no
/// visibility guard, on its own connection. It skips the rows of a transaction that commits
/// late with a lower sequence.
struct NaiveReader {
    client: tokio_postgres::Client,
    query: String,
    partition: String,
    last: i64,
}

impl NaiveReader {
    async fn new(table: &OutboxTable, partition: &str) -> Self {
        Self {
            client: raw_client().await,
            query: format!(
                "SELECT seq, data FROM \"{}_outbox\" WHERE partition = $1 AND seq > $2
                 ORDER BY seq LIMIT 100",
                table.prefix()
            ),
            partition: partition.to_string(),
            last: 0,
        }
    }

    /// The payloads of the rows after the last one read.
    async fn next(&mut self) -> Vec<String> {
        let rows = self
            .client
            .query(&self.query, &[&self.partition, &self.last])
            .await
            .unwrap();
        rows.iter()
            .map(|row| {
                self.last = row.get(0);
                String::from_utf8_lossy(row.get::<_, &[u8]>(1)).into_owned()
            })
            .collect()
    }
}

/// Reads until `want` records came, or the reader has been empty for many polls in a row.
async fn read_until(reader: &mut dyn PartitionReader, want: usize) -> Vec<Record> {
    let mut out = Vec::new();
    for _ in 0..100_000 {
        out.extend(reader.next_batch(100).await.unwrap().records);
        if out.len() >= want {
            break;
        }
    }
    out
}

#[tokio::test]
async fn a_late_committing_writer_is_never_skipped_though_a_naive_reader_skips_it() {
    // Design rule 4 (at least once, in order): T1 takes the lower sequence but commits after
    // T2; a reader that read T2 in between must still deliver T1.
    let prefixes = Prefixes::new().await;
    let (ours, table) = outbox(&prefixes, 1).await;
    let p = PartitionId::new("1.0").unwrap();
    let mut ours_r = ours.open(&p, &Position::Beginning).await.unwrap();
    let mut naive_r = NaiveReader::new(&table, p.as_str()).await;

    let mut c1 = raw_client().await;
    let mut c2 = raw_client().await;
    let t1 = c1.transaction().await.unwrap();
    let a1 = append(&t1, &table, "k", b"t1").await.unwrap();
    let t2 = c2.transaction().await.unwrap();
    let a2 = append(&t2, &table, "k", b"t2").await.unwrap();
    assert!(a1.seq < a2.seq, "T1 took the lower sequence");
    t2.commit().await.unwrap();

    // The reader reads while T1 is still open.
    let ours_first = ours_r.next_batch(100).await.unwrap().records;
    let naive_first = naive_r.next().await;
    assert!(
        ours_first.is_empty(),
        "ours holds back T2's row while T1, which could still commit below it, runs: {:?}",
        data(&ours_first)
    );
    assert_eq!(naive_first, ["t2"], "the naive reader takes T2 at once");

    t1.commit().await.unwrap();
    let ours_all = read_until(ours_r.as_mut(), 2).await;
    assert_eq!(
        data(&ours_all),
        ["t1", "t2"],
        "ours delivers both, in order"
    );
    let naive_rest = naive_r.next().await;
    let naive_all: Vec<String> = naive_first.into_iter().chain(naive_rest).collect();
    assert_eq!(
        naive_all,
        ["t2"],
        "the naive `seq > last` reader skips T1 for ever: the gap this source closes"
    );
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_committing_out_of_order_lose_nothing() {
    // At least once, in order: 8 writers each hold a transaction open across several appends
    // and commit in an order unrelated to their sequences, while a reader polls throughout.
    let prefixes = Prefixes::new().await;
    let (ours, table) = outbox(&prefixes, 1).await;
    let p = PartitionId::new("1.0").unwrap();
    let mut reader = ours.open(&p, &Position::Beginning).await.unwrap();
    let writers = 8usize;
    let per_tx = 5usize;
    let rounds = 6usize;
    let mut clients = Vec::new();
    for _ in 0..writers {
        clients.push(raw_client().await);
    }
    let mut got: Vec<Record> = Vec::new();
    for round in 0..rounds {
        let mut txs = Vec::new();
        for c in clients.iter_mut() {
            txs.push(c.transaction().await.unwrap());
        }
        // Interleave the appends: writer w's i-th record, for every i, for every w.
        for i in 0..per_tx {
            for (w, tx) in txs.iter().enumerate() {
                append(
                    tx,
                    &table,
                    &format!("k{w}"),
                    format!("{round}-{w}-{i}").as_bytes(),
                )
                .await
                .unwrap();
            }
            got.extend(reader.next_batch(7).await.unwrap().records);
        }
        // Commit in a shuffled order (reverse on even rounds, odd writers first on odd ones),
        // reading between commits; one writer in each round rolls back.
        let mut order: Vec<usize> = (0..writers).collect();
        if round % 2 == 0 {
            order.reverse();
        } else {
            order.sort_by_key(|w| (w % 2 == 0, *w));
        }
        let mut txs: Vec<Option<_>> = txs.into_iter().map(Some).collect();
        for w in order {
            let tx = txs[w].take().unwrap();
            if w == round % writers {
                tx.rollback().await.unwrap();
            } else {
                tx.commit().await.unwrap();
            }
            got.extend(reader.next_batch(7).await.unwrap().records);
        }
    }
    let expected = rounds * (writers - 1) * per_tx;
    let rest = read_until(reader.as_mut(), expected - got.len()).await;
    got.extend(rest);
    let names = data(&got);
    let unique: BTreeSet<&String> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "no duplicates within one reader");
    assert_eq!(
        names.len(),
        expected,
        "every committed record, nothing rolled back"
    );
    for round in 0..rounds {
        for w in 0..writers {
            let mine: Vec<&String> = names
                .iter()
                .filter(|n| n.starts_with(&format!("{round}-{w}-")))
                .collect();
            if w == round % writers {
                assert!(mine.is_empty(), "rolled-back records never appear");
            } else {
                let want: Vec<String> = (0..per_tx).map(|i| format!("{round}-{w}-{i}")).collect();
                assert_eq!(
                    mine.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                    want.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                    "one transaction's records stay in insert order"
                );
            }
        }
    }
    prefixes.cleanup().await;
}

#[tokio::test]
async fn repartition_closes_the_old_generation_and_children_name_their_parents() {
    // Design, "Partition lineage": 2 -> 3 partitions; the old ones end after their last row,
    // the new ones list every old partition whose key range they overlap, and new writes go to
    // the new generation only.
    let prefixes = Prefixes::new().await;
    let (outbox, _table) = outbox(&prefixes, 2).await;
    for i in 0..20 {
        outbox
            .append_one(&format!("key-{i}"), format!("old{i}").as_bytes())
            .await
            .unwrap();
    }
    let children = outbox.repartition(3).await.unwrap();
    assert_eq!(children.len(), 3);
    let all = outbox.partitions().await.unwrap();
    let (old, new): (Vec<_>, Vec<_>) = all.iter().partition(|p| p.parents.is_empty());
    assert_eq!(old.len(), 2);
    assert!(old.iter().all(|p| p.closed), "the old generation is closed");
    assert!(new.iter().all(|p| !p.closed));
    let id = |s: &str| PartitionId::new(s).unwrap();
    assert_eq!(new[0].parents, vec![id("1.0")]);
    assert_eq!(
        new[1].parents,
        vec![id("1.0"), id("1.1")],
        "the middle child straddles both"
    );
    assert_eq!(new[2].parents, vec![id("1.1")]);
    let mut old_total = 0;
    for p in &old {
        let mut r = outbox.open(&p.id, &Position::Beginning).await.unwrap();
        let mut n = 0;
        loop {
            let b = r.next_batch(6).await.unwrap();
            n += b.records.len();
            if b.end_of_partition {
                break;
            }
        }
        old_total += n;
    }
    assert_eq!(old_total, 20, "every old record is read before the end");
    for i in 0..30 {
        let a = outbox
            .append_one(&format!("key-{i}"), b"new")
            .await
            .unwrap();
        assert!(
            children.contains(&a.partition),
            "new writes go to the new generation"
        );
    }
    // Re-partitioning again works and chains the lineage.
    let grandchildren = outbox.repartition(1).await.unwrap();
    let all = outbox.partitions().await.unwrap();
    let g = all.iter().find(|p| p.id == grandchildren[0]).unwrap();
    assert_eq!(g.parents, children);
    prefixes.cleanup().await;
}

#[tokio::test]
async fn repartition_waits_for_a_writer_of_the_old_generation() {
    // A writer holding the old generation finishes in the old partitions before they close:
    // nothing lands in a closed partition.
    let prefixes = Prefixes::new().await;
    let (outbox, table) = outbox(&prefixes, 1).await;
    let mut c = raw_client().await;
    let tx = c.transaction().await.unwrap();
    let a = append(&tx, &table, "k", b"inflight").await.unwrap();
    assert_eq!(a.partition.as_str(), "1.0");
    let repart = tokio::spawn({
        let outbox = outbox.clone();
        async move { outbox.repartition(2).await }
    });
    // The re-partition cannot finish while the writer holds the generation row.
    tokio::task::yield_now().await;
    assert!(!repart.is_finished());
    tx.commit().await.unwrap();
    repart.await.unwrap().unwrap();
    let mut r = outbox
        .open(&PartitionId::new("1.0").unwrap(), &Position::Beginning)
        .await
        .unwrap();
    let b = r.next_batch(10).await.unwrap();
    assert_eq!(data(&b.records), ["inflight"]);
    assert!(b.end_of_partition, "closed and fully read");
    prefixes.cleanup().await;
}

#[tokio::test]
async fn records_are_routed_by_key_hash_and_remaining_counts_lag() {
    // One key always lands in one partition; remaining() is the lag after a continuation.
    let prefixes = Prefixes::new().await;
    let (outbox, _table) = outbox(&prefixes, 4).await;
    let first = outbox.append_one("order-1", b"a").await.unwrap();
    for _ in 0..9 {
        let a = outbox.append_one("order-1", b"b").await.unwrap();
        assert_eq!(a.partition, first.partition);
    }
    let p = first.partition.clone();
    assert_eq!(outbox.remaining(&p, None).await.unwrap(), Some(10));
    assert_eq!(
        outbox
            .remaining(&p, Some(&first.continuation()))
            .await
            .unwrap(),
        Some(9)
    );
    let _ = Duration::ZERO;
    prefixes.cleanup().await;
}
