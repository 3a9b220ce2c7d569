//! Dead letters in the lease store's database: a batch that keeps failing goes to
//! `{prefix}_dead_letters` after `dead_letter_after` failures and the checkpoint moves past
//! it; without a dead-letter sink the checkpoint never moves (the default: never skip).
//!
//! Real time with short settings (see `fleet.rs` for why a real server cannot run on paused
//! time); the feed is this crate's outbox, on the same prefix.

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::model::{Continuation, GroupName, LeaseKey, PartitionId};
use changefeed::processor::{handler_fn, Handler, Processor, ProcessorBuilder, Settings};
use changefeed_postgres::{
    append, OutboxTable, PgOptions, PostgresDeadLetters, PostgresLeaseStore, PostgresOutbox,
};
use serde_json::json;

use crate::common::{raw_client, url};

/// Tables of one test: a prefix of its own, `dl{millis}p{pid}n{N}`, dropped at the end.
/// (`common::Prefixes` derives its base from the millisecond and the process, so tests
/// starting in the same millisecond share it, and one's cleanup drops the other's tables.)
#[derive(Debug)]
struct Tables {
    prefix: String,
}

impl Tables {
    async fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Reach the server first, so an unreachable one fails here with the how-to message.
        raw_client().await;
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
            % 10_000_000_000;
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        Self {
            prefix: format!("dl{ms}p{}n{n}", std::process::id()),
        }
    }

    fn options(&self) -> PgOptions {
        PgOptions::new(url()).prefix(&self.prefix).pool_size(4)
    }

    /// Drops every table with this prefix.
    async fn cleanup(&self) {
        let client = raw_client().await;
        let rows = client
            .query(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() \
                 AND tablename LIKE $1",
                &[&format!("{}\\_%", self.prefix)],
            )
            .await
            .unwrap();
        for row in rows {
            let name: String = row.get(0);
            client
                .batch_execute(&format!("DROP TABLE IF EXISTS \"{name}\" CASCADE"))
                .await
                .unwrap();
        }
    }
}

/// Short real-time settings that the builder accepts.
fn settings() -> Settings {
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
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
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

/// An outbox of one partition and a lease store on a fresh prefix, with three records (text
/// payloads) appended in one transaction, so that they are read as one batch.
struct Setup {
    tables: Tables,
    outbox: PostgresOutbox,
    store: PostgresLeaseStore,
    key: LeaseKey,
    appended: Vec<Continuation>,
}

async fn setup() -> Setup {
    let tables = Tables::new().await;
    let table = OutboxTable::new(&tables.prefix).unwrap();
    let outbox = PostgresOutbox::connect(tables.options(), table.clone())
        .await
        .unwrap();
    outbox.create_partitions(1).await.unwrap();
    let store = PostgresLeaseStore::connect_with(tables.options())
        .await
        .unwrap();
    let mut client = raw_client().await;
    let tx = client.transaction().await.unwrap();
    let mut appended = Vec::new();
    for (key, data) in [("k1", "one"), ("k2", "two"), ("k1", "three")] {
        let a = append(&tx, &table, key, data.as_bytes()).await.unwrap();
        appended.push(a.continuation());
    }
    tx.commit().await.unwrap();
    let key = LeaseKey::new(
        GroupName::new("orders").unwrap(),
        PartitionId::new("1.0").unwrap(),
    );
    Setup {
        tables,
        outbox,
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
            .source(Arc::new(self.outbox.clone()))
            .handler(failing(calls))
    }

    async fn checkpoint(&self) -> Option<Continuation> {
        self.store
            .get(&self.key)
            .await
            .unwrap()
            .and_then(|l| l.continuation)
    }

    /// The dead-letter rows, oldest first.
    async fn rows(&self) -> Vec<Row> {
        let client = raw_client().await;
        let sql = format!(
            "SELECT grp, partition, host, after_continuation, last_continuation, failures, \
             error, records::text FROM \"{}_dead_letters\" ORDER BY id",
            self.tables.prefix
        );
        client
            .query(&sql, &[])
            .await
            .unwrap()
            .iter()
            .map(|r| Row {
                group: r.get(0),
                partition: r.get(1),
                host: r.get(2),
                after: r.get(3),
                last: r.get(4),
                failures: r.get(5),
                error: r.get(6),
                records: serde_json::from_str(r.get(7)).unwrap(),
            })
            .collect()
    }

    async fn table_exists(&self) -> bool {
        let client = raw_client().await;
        let name = format!("{}_dead_letters", self.tables.prefix);
        client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&format!("\"{name}\"")],
            )
            .await
            .unwrap()
            .get(0)
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
    failures: i32,
    error: String,
    records: serde_json::Value,
}

// Opt-in dead letters: after 3 failures the batch, its partition, continuations and
// error are written to the lease store's database, and the checkpoint moves past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_batch_is_dead_lettered_after_three_failures_and_checkpoint_moves_past_it() {
    let s = setup().await;
    let calls = Arc::new(AtomicU32::new(0));
    let sink = PostgresDeadLetters::connect_with(s.tables.options())
        .await
        .unwrap();
    assert_eq!(sink.prefix(), s.tables.prefix);
    let running = s
        .builder(calls.clone())
        .dead_letter(Arc::new(sink), 3)
        .build()
        .unwrap()
        .start();

    let first_end = s.appended[2].clone();
    wait_for(
        "the checkpoint to pass the first batch",
        Duration::from_secs(30),
        || async { (s.checkpoint().await.as_ref() == Some(&first_end)).then_some(()) },
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "dead-lettered on the third failure"
    );
    let stored = s.rows().await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    let c = |i: usize| s.appended[i].as_str().to_string();
    assert_eq!(
        stored[0],
        Row {
            group: "orders".into(),
            partition: "1.0".into(),
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
            json!({"partition": "1.0", "key": "k1", "data": "one", "continuation": c(0)}),
            json!({"partition": "1.0", "key": "k2", "data": "two", "continuation": c(1)}),
            json!({"partition": "1.0", "key": "k1", "data": "three", "continuation": c(2)}),
        ]
    );

    // The next batch (a binary payload) starts after the dead-lettered one and goes the same way.
    let fourth = s
        .outbox
        .append_one("k3", &[0xff, 0x00])
        .await
        .unwrap()
        .continuation();
    wait_for(
        "the checkpoint to pass the second batch",
        Duration::from_secs(30),
        || async { (s.checkpoint().await.as_ref() == Some(&fourth)).then_some(()) },
    )
    .await;
    let stored = s.rows().await;
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(stored[1].after, Some(c(2)));
    assert_eq!(stored[1].last.as_deref(), Some(fourth.as_str()));
    assert_eq!(stored[1].records[0]["data_b64"], json!("/wA="));
    assert!(stored[1].records[0].get("data").is_none());
    running.stop().await.unwrap();
    s.tables.cleanup().await;
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
        !s.table_exists().await,
        "no dead-letter table without a sink"
    );
    running.stop().await.unwrap();
    assert_eq!(s.checkpoint().await, None);
    s.tables.cleanup().await;
}

// Connecting twice (two hosts, or a restart) keeps the table and its rows: the schema is
// versioned with the other components of the prefix and created once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_table_is_created_once_per_prefix() {
    let tables = Tables::new().await;
    let prefix = &tables.prefix;
    PostgresDeadLetters::connect_with(tables.options())
        .await
        .unwrap();
    PostgresDeadLetters::connect_with(tables.options())
        .await
        .unwrap();
    let client = raw_client().await;
    let version: i32 = client
        .query_one(
            &format!(
                "SELECT version FROM \"{prefix}_schema_versions\" WHERE component = 'dead_letters'"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, changefeed_postgres::DEAD_LETTER_SCHEMA_VERSION);
    tables.cleanup().await;
}
