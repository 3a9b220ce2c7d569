//! The fenced sink of `examples/fenced_sink.rs` against a deposed owner frozen mid-write (the
//! fence must cover the batch in flight): two real processors on a PostgreSQL
//! lease store, one frozen with a write on the wire, the other taking over, then the frozen
//! write let go.
//!
//! The server comes from `CHANGEFEED_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); `.ci/run` starts one. Real time with short
//! lease timings: a real server cannot run on paused time (see
//! `crates/changefeed-postgres/tests/it/fleet.rs`).

// A failed unwrap in a test is a failed test with its cause: that is what we want here.
#![allow(clippy::unwrap_used)]

#[path = "../fenced_sink/sink.rs"]
mod sink;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use changefeed::model::Batch;
use changefeed::processor::{handler_fn, HandlerError, Processor, Settings};
use changefeed::source::MemoryFeed;
use changefeed::testkit::fleet::{FaultMode, Faulty};
use changefeed_postgres::{PgOptions, PostgresLeaseStore};
use sink::{FencedSink, Written};
use tokio::sync::{mpsc, watch};

fn url() -> String {
    std::env::var("CHANGEFEED_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A plain connection. Fails loudly, saying how to start the server, when it is unreachable:
/// this test never skips.
async fn raw_client() -> tokio_postgres::Client {
    let url = url();
    match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            client
        }
        Err(e) => panic!(
            "cannot reach PostgreSQL at {url}: {e}\n\
             Start it with `bash .ci/run` (it installs and starts PostgreSQL), or by hand:\n  \
             pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
             and make sure database `test` exists with trust auth on 127.0.0.1, or point \
             CHANGEFEED_TEST_POSTGRES_URL at another server."
        ),
    }
}

/// Short real-time settings: a host fences itself 2 s after its last heartbeat, and is
/// judged dead by the others after 3 s.
fn settings() -> Settings {
    Settings {
        lease_expiry: Duration::from_secs(3),
        safety_margin: Duration::from_secs(1),
        renew_interval: Duration::from_millis(500),
        acquire_interval: Duration::from_millis(200),
        handoff_timeout: Duration::from_secs(2),
        sync_interval: Duration::from_secs(1),
        poll_delay: Duration::from_millis(50),
        shutdown_timeout: Duration::from_secs(2),
        ..Settings::default()
    }
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

/// The same batch written without a guard: `key → value`, last writer wins. What a sink
/// without fencing tokens does.
async fn unguarded_write(
    client: &tokio_postgres::Client,
    table: &str,
    batch: &Batch,
) -> Result<(), HandlerError> {
    for r in &batch.records {
        let value: &str = &String::from_utf8_lossy(&r.data);
        client
            .execute(
                &format!(
                    "INSERT INTO {table} (key, value) VALUES ($1, $2)
                     ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
                ),
                &[&r.key, &value],
            )
            .await?;
    }
    Ok(())
}

async fn unguarded_values(client: &tokio_postgres::Client, table: &str) -> Vec<(String, String)> {
    client
        .query(&format!("SELECT key, value FROM {table} ORDER BY key"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// What host A's frozen write found when it was let go.
#[derive(Debug)]
struct LateWrite {
    token: u64,
    /// Whether the processor had cancelled A's call by then (it fenced A and dropped it).
    call_cancelled: bool,
    written: Written,
}

// A deposed owner frozen mid-write cannot overwrite its successor through the fenced sink:
// its late write carries a lower fencing token and the guard refuses it, while the
// same write through an unguarded upsert overwrites the successor's newer values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deposed_owner_frozen_mid_write_is_refused_by_the_fenced_sink() {
    let admin = raw_client().await;
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 10_000_000_000;
    let name = format!("fs{ms}p{}", std::process::id());
    let plain = format!("{name}_plain");
    admin
        .batch_execute(&format!(
            "CREATE TABLE {plain} (key text PRIMARY KEY, value text NOT NULL)"
        ))
        .await
        .unwrap();
    let store = PostgresLeaseStore::connect_with(PgOptions::new(url()).prefix(&name))
        .await
        .unwrap();
    let feed = MemoryFeed::new(1);
    for key in ["k0", "k1", "k2"] {
        feed.append(key, "old");
    }

    // Host A: its store can be cut off (calls hang, as for a frozen machine). Its handler
    // hands the batch's write to a task of its own that ignores cancellation and waits for
    // the test's "resume": a write already on the wire when the machine froze.
    let sink_a = Arc::new(FencedSink::connect(&url(), &name).await.unwrap());
    sink_a.create_tables().await.unwrap();
    let plain_a = Arc::new(raw_client().await);
    let (resume, resumed) = watch::channel(false);
    let (started_tx, mut started) = mpsc::unbounded_channel::<u64>();
    let (late_tx, mut late) = mpsc::unbounded_channel::<LateWrite>();
    let faulty_a = Faulty::new(Arc::new(store.clone()));
    let handler_a = {
        let plain = plain.clone();
        handler_fn(move |ctx, batch| {
            let (sink, client, plain) = (sink_a.clone(), plain_a.clone(), plain.clone());
            let (mut resumed, started, late) =
                (resumed.clone(), started_tx.clone(), late_tx.clone());
            async move {
                let token = ctx.fencing_token();
                let write = tokio::spawn(async move {
                    let _ = started.send(token);
                    let _ = resumed.wait_for(|go| *go).await; // frozen here
                    let call_cancelled = ctx.is_cancelled();
                    unguarded_write(&client, &plain, &batch).await?;
                    let written = sink.write(ctx.partition().as_str(), token, &batch).await?;
                    let _ = late.send(LateWrite {
                        token,
                        call_cancelled,
                        written,
                    });
                    Ok::<_, HandlerError>(())
                });
                write.await?
            }
        })
    };
    let a = Processor::builder()
        .host("host-a")
        .group("fenced")
        .settings(settings())
        .store(Arc::new(faulty_a.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler_a)
        .build()
        .unwrap()
        .start();
    let token_a = tokio::time::timeout(Duration::from_secs(30), started.recv())
        .await
        .expect("host A never started its first batch")
        .unwrap();

    // Freeze A: from now on none of its store calls returns, so it cannot renew its heartbeat.
    // Newer values arrive for the same keys.
    faulty_a.set(FaultMode::Hang);
    for key in ["k0", "k1", "k2"] {
        feed.append(key, "new");
    }

    // Host B takes the lease once A's heartbeat has been still for lease_expiry, delivers from
    // the last checkpoint (A's batch was never checkpointed) and writes the newer values.
    let sink_b = Arc::new(FencedSink::connect(&url(), &name).await.unwrap());
    let plain_b = Arc::new(raw_client().await);
    let tokens_b = Arc::new(Mutex::new(Vec::new()));
    let handler_b = {
        let (plain, tokens) = (plain.clone(), tokens_b.clone());
        handler_fn(move |ctx, batch| {
            let (sink, client, plain, tokens) = (
                sink_b.clone(),
                plain_b.clone(),
                plain.clone(),
                tokens.clone(),
            );
            async move {
                let token = ctx.fencing_token();
                unguarded_write(&client, &plain, &batch).await?;
                let written = sink.write(ctx.partition().as_str(), token, &batch).await?;
                assert_eq!(written, Written::Applied(batch.records.len()));
                tokens.lock().unwrap().push(token);
                Ok(())
            }
        })
    };
    let b = Processor::builder()
        .host("host-b")
        .group("fenced")
        .settings(settings())
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler_b)
        .build()
        .unwrap()
        .start();
    let new_values: Vec<(String, String)> = ["k0", "k1", "k2"]
        .iter()
        .map(|k| (k.to_string(), "new".to_string()))
        .collect();
    let reader = FencedSink::connect(&url(), &name).await.unwrap();
    let stored = wait_for(
        "host B to write the newer values",
        Duration::from_secs(30),
        || {
            let (reader, expected) = (&reader, &new_values);
            async move {
                let values = reader.values().await.unwrap();
                let kv: Vec<_> = values
                    .iter()
                    .map(|(k, v, _)| (k.clone(), v.clone()))
                    .collect();
                (&kv == expected).then_some(values)
            }
        },
    )
    .await;
    let token_b = *tokens_b.lock().unwrap().first().unwrap();
    assert!(
        token_b > token_a,
        "B's token {token_b} must exceed A's {token_a}"
    );
    assert!(
        stored.iter().all(|(_, _, t)| *t == token_b as i64),
        "{stored:?}"
    );
    assert_eq!(unguarded_values(&admin, &plain).await, new_values);

    // Let A's frozen write go. The processor had already cancelled A's call (A fenced itself
    // before B could take over), but a write on the wire is beyond its reach: only the sink
    // can refuse it.
    resume.send(true).unwrap();
    let late = tokio::time::timeout(Duration::from_secs(30), late.recv())
        .await
        .expect("A's frozen write never finished")
        .unwrap();
    assert_eq!(late.token, token_a);
    assert!(
        late.call_cancelled,
        "A's call should have been cancelled by the fence"
    );
    assert_eq!(
        late.written,
        Written::Refused(3),
        "the guard must refuse A's late write"
    );

    // The fenced table keeps B's values; the unguarded one went back to A's stale ones.
    assert_eq!(reader.values().await.unwrap(), stored);
    let old_values: Vec<(String, String)> = ["k0", "k1", "k2"]
        .iter()
        .map(|k| (k.to_string(), "old".to_string()))
        .collect();
    assert_eq!(unguarded_values(&admin, &plain).await, old_values);

    a.kill();
    b.stop().await.unwrap();
    let rows = admin
        .query(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() \
             AND tablename LIKE $1",
            &[&format!("{name}\\_%")],
        )
        .await
        .unwrap();
    for row in rows {
        let table: String = row.get(0);
        admin
            .batch_execute(&format!("DROP TABLE IF EXISTS \"{table}\" CASCADE"))
            .await
            .unwrap();
    }
}
