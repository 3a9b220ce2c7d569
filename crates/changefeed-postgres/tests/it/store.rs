//! The lease store on a real server: conformance suite and focused checks.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
use changefeed::testkit::{lease_store_conformance, Corruption, LeaseStoreFixture};
use changefeed::LeaseError;
use changefeed_postgres::{PgOptions, PostgresError, PostgresLeaseStore, LEASE_SCHEMA_VERSION};

use crate::common::{raw_client, url, Prefixes};

/// How many counter moves of deletions the suite's handles keep: short, so the suite's check
/// of the horizon runs it out in 144 writes, yet above the 32 moves its racing reader may lag.
const CHANGES_KEPT: u64 = 64;

/// Fresh tables; every `connect` opens a new pool, so racing handles race through the server.
struct Fixture {
    options: PgOptions,
    prefix: String,
}

#[async_trait]
impl LeaseStoreFixture for Fixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        Arc::new(
            PostgresLeaseStore::connect_with(self.options.clone())
                .await
                .unwrap()
                .changes_kept(CHANGES_KEPT),
        )
    }

    fn answers_changes(&self) -> bool {
        true
    }

    fn keeps_view(&self) -> bool {
        true
    }

    fn changes_horizon(&self) -> Option<u64> {
        Some(CHANGES_KEPT)
    }

    async fn deletion_records(&self, group: &GroupName) -> Option<u64> {
        let sql = format!(
            "SELECT count(*) FROM \"{}_lease_deletions\" WHERE grp = $1",
            self.prefix
        );
        let n: i64 = raw_client()
            .await
            .query_one(&sql, &[&group.as_str()])
            .await
            .unwrap()
            .get(0);
        Some(u64::try_from(n).unwrap())
    }

    async fn corrupt(&self, key: &LeaseKey, how: Corruption) {
        let client = raw_client().await;
        let t = format!("\"{}_leases\"", self.prefix);
        let sql = match how {
            Corruption::BadPropertiesJson => {
                format!("UPDATE {t} SET properties = '{{\"a\": ' WHERE grp = $1 AND partition = $2")
            }
            Corruption::UnknownState => {
                format!("UPDATE {t} SET state = 'borrowed' WHERE grp = $1 AND partition = $2")
            }
        };
        let n = client
            .execute(&sql, &[&key.group.as_str(), &key.partition.as_str()])
            .await
            .unwrap();
        assert_eq!(n, 1, "corrupted one row");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_passes_the_lease_store_conformance_suite() {
    let prefixes = Prefixes::new().await;
    lease_store_conformance(|| {
        let prefix = prefixes.fresh();
        let options = prefixes.options(&prefix);
        async move { Box::new(Fixture { options, prefix }) as Box<dyn LeaseStoreFixture> }
    })
    .await;
    prefixes.cleanup().await;
}

fn key(group: &str, partition: &str) -> LeaseKey {
    LeaseKey::new(
        GroupName::new(group).unwrap(),
        PartitionId::new(partition).unwrap(),
    )
}

#[tokio::test]
async fn concurrent_starters_migrate_once_and_a_newer_schema_is_refused() {
    // Schema migrations are serialised by an advisory lock; a newer schema is never touched.
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let mut starters = Vec::new();
    for _ in 0..6 {
        let options = prefixes.options(&prefix);
        starters.push(tokio::spawn(PostgresLeaseStore::connect_with(options)));
    }
    for s in starters {
        s.await.unwrap().expect("every concurrent starter connects");
    }
    let client = raw_client().await;
    let v = crate::common::lease_schema_version(&client, &prefix).await;
    assert_eq!(v, LEASE_SCHEMA_VERSION);
    client
        .execute(
            &format!("UPDATE \"{prefix}_schema_versions\" SET version = 99 WHERE component = 'lease_store'"),
            &[],
        )
        .await
        .unwrap();
    let err = PostgresLeaseStore::connect_with(prefixes.options(&prefix))
        .await
        .expect_err("a newer schema is refused");
    let source = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<PostgresError>())
        .unwrap();
    assert!(
        matches!(source, PostgresError::SchemaTooNew { found: 99, .. }),
        "{source}"
    );
    assert!(!err.is_retryable());
    prefixes.cleanup().await;
}

#[tokio::test]
async fn bad_prefixes_and_timeouts_are_refused_naming_the_setting() {
    // Invalid configuration is rejected with an error naming the setting and the rule.
    for bad in [
        "",
        "Upper",
        "1abc",
        "a-b",
        "x\"; DROP TABLE y; --",
        &"a".repeat(41),
    ] {
        let err = PostgresLeaseStore::connect_with(PgOptions::new(url()).prefix(bad))
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("prefix"), "{bad:?}: {err}");
    }
    let err = PostgresLeaseStore::connect_with(
        PgOptions::new(url())
            .statement_timeout(Duration::from_secs(10))
            .client_timeout(Duration::from_secs(1)),
    )
    .await
    .expect_err("refused");
    assert!(err.to_string().contains("client_timeout"), "{err}");
}

#[tokio::test]
async fn a_hung_server_is_a_retryable_store_error_not_a_stuck_host() {
    // Design, "Timeouts": a row locked by someone else for longer than the timeouts must fail
    // the call with a retryable error in bounded time.
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = PostgresLeaseStore::connect_with(
        prefixes
            .options(&prefix)
            .statement_timeout(Duration::from_millis(300))
            .client_timeout(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let lease = store
        .create(&Lease::new(key("g", "0"), Position::Beginning))
        .await
        .unwrap()
        .unwrap();
    let mut blocker = raw_client().await;
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        &format!("SELECT 1 FROM \"{prefix}_leases\" FOR UPDATE"),
        &[],
    )
    .await
    .unwrap();
    let err = store
        .replace(&lease, lease.version)
        .await
        .expect_err("blocked");
    assert!(err.is_retryable(), "{err}");
    assert!(matches!(err, LeaseError::Store { .. }), "{err}");
    tx.rollback().await.unwrap();
    store
        .replace(&lease, lease.version)
        .await
        .expect("works again once the lock is gone");
    prefixes.cleanup().await;
}

#[tokio::test]
async fn an_unreachable_server_is_a_retryable_error() {
    // A closed port must surface as a retryable store error, not a panic or a hang.
    let err = PostgresLeaseStore::connect_with(
        PgOptions::new("postgres://postgres@127.0.0.1:1/test")
            .statement_timeout(Duration::from_secs(1))
            .client_timeout(Duration::from_secs(2)),
    )
    .await
    .expect_err("nothing listens on port 1");
    assert!(err.is_retryable(), "{err}");
}

#[tokio::test]
async fn a_refused_login_names_what_the_server_said_in_the_message_itself() {
    // A log line prints only the top-level message (`%err`): it must say what the server
    // refused, not just "db error".
    let url = crate::common::url();
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host_and_db = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let err = PostgresLeaseStore::connect_with(
        PgOptions::new(format!("{scheme}://no_such_role_cf@{host_and_db}"))
            .client_timeout(Duration::from_secs(5)),
    )
    .await
    .expect_err("the role does not exist");
    let text = err.to_string();
    assert!(
        text.contains("role \"no_such_role_cf\" does not exist"),
        "{text}"
    );
}
