//! What every test needs: the server URL, a fresh table prefix, a raw client, cleanup.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::clock::{Clock, Sleep};
use changefeed::model::Timestamp;
use changefeed_postgres::PgOptions;

/// The server under test.
pub fn url() -> String {
    std::env::var("CHANGEFEED_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A plain connection for editing tables by hand. Fails loudly, saying how to start the
/// server, when it is unreachable: these tests never skip.
pub async fn raw_client() -> tokio_postgres::Client {
    let url = url();
    match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(async move {
                let _ = connection.await;
            });
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

/// The lease store's schema version recorded under `prefix`.
pub async fn lease_schema_version(client: &tokio_postgres::Client, prefix: &str) -> i32 {
    client
        .query_one(
            &format!(
                "SELECT version FROM \"{prefix}_schema_versions\" WHERE component = 'lease_store'"
            ),
            &[],
        )
        .await
        .expect("reading the schema version")
        .get(0)
}

/// Names unique to one test run: `t{millis}{pid}`, and `…_{n}` for each fixture in it.
#[derive(Debug)]
pub struct Prefixes {
    base: String,
    next: AtomicU64,
}

impl Prefixes {
    pub async fn new() -> Self {
        // Reach the server first, so an unreachable one fails here with the how-to message.
        raw_client().await;
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
            % 10_000_000_000;
        // Tests of one process may start in the same millisecond: a process-wide counter
        // keeps their prefixes apart (one test's cleanup must never drop another's tables).
        static INSTANCES: AtomicU64 = AtomicU64::new(0);
        let n = INSTANCES.fetch_add(1, Ordering::SeqCst);
        Self {
            base: format!("t{ms}p{}i{n}", std::process::id()),
            next: AtomicU64::new(0),
        }
    }

    pub fn fresh(&self) -> String {
        format!("{}_{}", self.base, self.next.fetch_add(1, Ordering::SeqCst))
    }

    pub fn options(&self, prefix: &str) -> PgOptions {
        PgOptions::new(url()).prefix(prefix).pool_size(4)
    }

    /// Drops every table this run created.
    pub async fn cleanup(&self) {
        let client = raw_client().await;
        let rows = client
            .query(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() \
                 AND tablename LIKE $1",
                &[&format!("{}\\_%", self.base)],
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

/// A clock whose wall time moves only when the test says so.
#[derive(Debug)]
pub struct ManualClock {
    wall_ms: std::sync::atomic::AtomicI64,
}

impl ManualClock {
    pub fn new(start_ms: i64) -> Arc<Self> {
        Arc::new(Self {
            wall_ms: std::sync::atomic::AtomicI64::new(start_ms),
        })
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
