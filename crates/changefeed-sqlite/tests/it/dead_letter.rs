//! Dead letters in the lease store's SQLite file: a batch that keeps failing goes to
//! `changefeed_dead_letters` after `dead_letter_after` failures and the checkpoint moves past
//! it; without a dead-letter sink the checkpoint never moves (the default: never skip).
//!
//! Real time with short settings: every step awaits SQLite on the blocking pool, and paused
//! time would auto-advance past the lease timings while a call is in flight.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::model::{Continuation, GroupName, LeaseKey, PartitionId};
use changefeed::processor::{handler_fn, Handler, Processor, ProcessorBuilder, Settings};
use changefeed_sqlite::{SqliteDeadLetters, SqliteFeed, SqliteLeaseStore};
use serde_json::json;

/// Short real-time settings that the builder accepts.
pub(super) fn settings() -> Settings {
    Settings {
        lease_expiry: Duration::from_secs(3),
        safety_margin: Duration::from_secs(1),
        renew_interval: Duration::from_millis(500),
        acquire_interval: Duration::from_millis(200),
        handoff_timeout: Duration::from_secs(2),
        sync_interval: Duration::from_secs(1),
        poll_delay: Duration::from_millis(50),
        min_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(100),
        shutdown_timeout: Duration::from_secs(2),
        ..Settings::default()
    }
}

/// A handler that fails every call, counting them.
fn failing(calls: Arc<AtomicU32>) -> impl Handler {
    handler_fn(move |_ctx, _batch| {
        calls.fetch_add(1, Ordering::SeqCst);
        async { Err("the downstream service rejected the batch".into()) }
    })
}

/// Polls `probe` every 50 ms until it answers `Some`, failing the test after `limit`.
pub(super) async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One partition in a fresh file, with three records (text payloads) already appended.
struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    feed: SqliteFeed,
    store: SqliteLeaseStore,
    key: LeaseKey,
    appended: Vec<Continuation>,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changefeed.db");
    let feed = SqliteFeed::open(&path).await.unwrap();
    feed.create_partitions(1).await.unwrap();
    let mut appended = Vec::new();
    for (key, data) in [("k1", "one"), ("k2", "two"), ("k1", "three")] {
        appended.push(feed.append(key, data).await.unwrap().1);
    }
    let store = SqliteLeaseStore::open(&path).await.unwrap();
    let key = LeaseKey::new(
        GroupName::new("orders").unwrap(),
        PartitionId::new("0").unwrap(),
    );
    Setup {
        _dir: dir,
        path,
        feed,
        store,
        key,
        appended,
    }
}

impl Setup {
    fn builder(&self, calls: Arc<AtomicU32>) -> ProcessorBuilder {
        Processor::builder()
            .host("host-a")
            .group("orders")
            .settings(settings())
            .store(Arc::new(self.store.clone()))
            .source(Arc::new(self.feed.clone()))
            .handler(failing(calls))
    }

    async fn checkpoint(&self) -> Option<Continuation> {
        self.store
            .get(&self.key)
            .await
            .unwrap()
            .and_then(|l| l.continuation)
    }
}

/// A dead-letter row as the operator reads it back.
#[derive(Debug, PartialEq)]
struct Row {
    group: String,
    partition: String,
    host: String,
    after: Option<String>,
    last: Option<String>,
    failures: i64,
    error: String,
    records: serde_json::Value,
}

fn rows(path: &Path) -> Vec<Row> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT group_name, partition, host, after_continuation, last_continuation, \
             failures, error, records FROM changefeed_dead_letters ORDER BY id",
        )
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok(Row {
                group: r.get(0)?,
                partition: r.get(1)?,
                host: r.get(2)?,
                after: r.get(3)?,
                last: r.get(4)?,
                failures: r.get(5)?,
                error: r.get(6)?,
                records: serde_json::from_str(&r.get::<_, String>(7)?).unwrap(),
            })
        })
        .unwrap();
    rows.map(Result::unwrap).collect()
}

fn table_exists(path: &Path) -> bool {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.query_row(
        "SELECT COUNT(*) FROM sqlite_master WHERE name = 'changefeed_dead_letters'",
        [],
        |r| r.get::<_, i64>(0),
    )
    .unwrap()
        > 0
}

// Opt-in dead letters: after 3 failures the batch, its partition, continuations and
// error are written to the lease store's file, and the checkpoint moves past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_batch_is_dead_lettered_after_three_failures_and_checkpoint_moves_past_it() {
    let s = setup().await;
    let calls = Arc::new(AtomicU32::new(0));
    let sink = SqliteDeadLetters::open(&s.path).await.unwrap();
    let running = s
        .builder(calls.clone())
        .dead_letter(Arc::new(sink), 3)
        .build()
        .unwrap()
        .start();

    let first_end = s.appended[2].clone();
    wait_for(
        "the checkpoint to pass the first batch",
        Duration::from_secs(20),
        || async { (s.checkpoint().await.as_ref() == Some(&first_end)).then_some(()) },
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "dead-lettered on the third failure"
    );
    let stored = rows(&s.path);
    assert_eq!(stored.len(), 1, "{stored:?}");
    let c = |i: usize| s.appended[i].as_str().to_string();
    assert_eq!(
        stored[0],
        Row {
            group: "orders".into(),
            partition: "0".into(),
            host: "host-a".into(),
            after: None,
            last: Some(c(2)),
            failures: 3,
            error: "the downstream service rejected the batch".into(),
            records: stored[0].records.clone(), // checked below, without the timestamps
        }
    );
    let records = stored[0].records.as_array().unwrap();
    let seen: Vec<_> = records
        .iter()
        .map(|r| {
            assert!(r["timestamp"].is_i64(), "{r}");
            json!({"partition": r["partition"], "key": r["key"], "data": r["data"], "continuation": r["continuation"]})
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            json!({"partition": "0", "key": "k1", "data": "one", "continuation": c(0)}),
            json!({"partition": "0", "key": "k2", "data": "two", "continuation": c(1)}),
            json!({"partition": "0", "key": "k1", "data": "three", "continuation": c(2)}),
        ]
    );

    // The next batch (a binary payload) starts after the dead-lettered one and goes the same way.
    let (_, fourth) = s.feed.append("k3", &[0xff_u8, 0x00][..]).await.unwrap();
    wait_for(
        "the checkpoint to pass the second batch",
        Duration::from_secs(20),
        || async { (s.checkpoint().await.as_ref() == Some(&fourth)).then_some(()) },
    )
    .await;
    let stored = rows(&s.path);
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(stored[1].after, Some(c(2)));
    assert_eq!(stored[1].last.as_deref(), Some(fourth.as_str()));
    assert_eq!(stored[1].records[0]["data_b64"], json!("/wA="));
    assert!(stored[1].records[0].get("data").is_none());
    running.stop().await.unwrap();
}

// The default stays "never skip": without a dead-letter sink a batch that always
// fails is retried (the lease released and taken again) and the checkpoint never moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_dead_letter_sink_a_failing_batch_is_never_skipped() {
    let s = setup().await;
    let calls = Arc::new(AtomicU32::new(0));
    let running = s
        .builder(calls.clone())
        .handler_max_retries(1)
        .build()
        .unwrap()
        .start();
    // Two calls per tenure: the lease is released and taken again at least twice.
    wait_for("six failed calls", Duration::from_secs(30), || async {
        (calls.load(Ordering::SeqCst) >= 6).then_some(())
    })
    .await;
    assert_eq!(s.checkpoint().await, None, "the failing batch was skipped");
    assert!(
        !table_exists(&s.path),
        "no dead-letter table without a sink"
    );
    running.stop().await.unwrap();
    assert_eq!(s.checkpoint().await, None);
}
