//! How SQLite answers `list_changes` from its change stamps, where that is SQLite's own: a
//! file migrated from schema 1 answers from its counter at migration on, a writer that does
//! not stamp makes earlier counters unanswerable, and partition ids edited by hand in the
//! lease rows or the deletion records are named by key. What every store answering
//! `list_changes` must do (exactly what changed hands, malformed rows, other connections, the
//! deletion horizon, racing writers) is checked by the core's conformance suite in `store.rs`.

use std::path::Path;

use changefeed::lease::{Changes, LeaseStore, MembershipStore};
use changefeed::model::{Continuation, GroupName, Lease, LeaseKey, Position};
use changefeed::LeaseError;
use changefeed_sqlite::{SqliteLeaseStore, SCHEMA_VERSION};

use crate::store::{key, owned_by, Fixture};

fn group(name: &str) -> GroupName {
    GroupName::new(name).unwrap()
}

/// Runs `sql` (several statements) in one transaction on a connection of its own, as another
/// program writing the file would.
async fn batch(path: &Path, sql: &'static str) {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut conn = rusqlite::Connection::open(path).unwrap();
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .unwrap();
        let tx = conn.transaction().unwrap();
        tx.execute_batch(sql).unwrap();
        tx.commit().unwrap();
    })
    .await
    .unwrap()
}

async fn count(path: &Path, sql: &'static str) -> i64 {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    })
    .await
    .unwrap()
}

async fn counter(store: &dyn LeaseStore, g: &GroupName) -> u64 {
    store.membership(g).await.unwrap().change_counter
}

/// `list_changes` must answer: the conformance check passes a store that says `None`.
async fn answered(store: &dyn LeaseStore, g: &GroupName, since: u64) -> Changes {
    store
        .list_changes(g, since)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("list_changes({g}, {since}) answered None"))
}

async fn unanswered(store: &dyn LeaseStore, g: &GroupName, since: u64) {
    let got = store.list_changes(g, since).await.unwrap();
    assert!(
        got.is_none(),
        "list_changes({g}, {since}) must be None: {got:?}"
    );
}

/// A changed lease as (partition, version, owner).
type Row = (String, u64, Option<String>);

/// The changed leases, and the deleted partitions.
fn summary(c: &Changes) -> (Vec<Row>, Vec<String>) {
    assert!(c.malformed.is_empty(), "{:?}", c.malformed);
    (
        c.leases
            .iter()
            .map(|l| {
                (
                    l.key.partition.to_string(),
                    l.version.0,
                    l.owner.as_ref().map(|h| h.to_string()),
                )
            })
            .collect(),
        c.deleted.iter().map(|k| k.partition.to_string()).collect(),
    )
}

fn row(p: &str, version: u64, owner: Option<&str>) -> Row {
    (p.to_string(), version, owner.map(str::to_string))
}

fn names(ps: &[&str]) -> Vec<String> {
    ps.iter().map(|p| p.to_string()).collect()
}

async fn create(store: &dyn LeaseStore, k: LeaseKey) -> Lease {
    store
        .create(&Lease::new(k, Position::Beginning))
        .await
        .unwrap()
        .unwrap()
}

async fn take(store: &dyn LeaseStore, lease: &Lease, by: &str) -> Lease {
    store
        .replace(&owned_by(lease.clone(), by), lease.version)
        .await
        .unwrap()
}

#[tokio::test]
async fn unreadable_partition_ids_of_changed_rows_and_deletion_records_are_named_by_key() {
    // A partition id edited by hand in a changed lease row or in a deletion record is reported
    // by key, and hides neither the readable rows nor the answer (the conformance suite breaks
    // the other columns).
    let fx = Fixture::new();
    let store = fx.store().await;
    let g = group("g");
    let mut rows = Vec::new();
    for p in ["a", "b", "c", "d"] {
        rows.push(create(&store, key("g", p)).await);
    }
    let since = counter(&store, &g).await;
    for lease in &rows[..3] {
        take(&store, lease, "h1").await;
    }
    store.delete(&rows[3].key, rows[3].version).await.unwrap();
    fx.edit(
        "UPDATE changefeed_leases SET partition = ' bad id' WHERE partition = 'b'",
        vec![],
    )
    .await;
    fx.edit(
        "UPDATE changefeed_deletions SET partition = ' gone' WHERE partition = 'd'",
        vec![],
    )
    .await;

    let changes = answered(&store, &g, since).await;
    let got: Vec<_> = changes
        .leases
        .iter()
        .map(|l| l.key.partition.to_string())
        .collect();
    assert_eq!(got, ["a", "c"], "the readable rows are still there");
    assert!(changes.deleted.is_empty());
    let mut bad: Vec<(String, String)> = changes
        .malformed
        .iter()
        .map(|e| match e {
            LeaseError::Malformed { key, reason } => (key.clone(), reason.clone()),
            other => panic!("expected Malformed, got {other:?}"),
        })
        .collect();
    bad.sort();
    let keys: Vec<&str> = bad.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["g/ bad id", "g/ gone"]);
    assert!(bad[1].1.contains("deletion record"), "{:?}", bad[1]);
}

/// Migration 1 as version 1 of this crate ran it, with the version table it kept: a file from
/// before change stamps.
const SCHEMA_1: &str = r#"
    CREATE TABLE changefeed_schema_version (version INTEGER NOT NULL);
    INSERT INTO changefeed_schema_version (version) VALUES (1);
    CREATE TABLE changefeed_leases (
        group_name   TEXT NOT NULL,
        partition    TEXT NOT NULL,
        state        TEXT NOT NULL,
        owner        TEXT,
        next_owner   TEXT,
        continuation TEXT,
        start        TEXT NOT NULL,
        parents      TEXT NOT NULL,
        properties   TEXT NOT NULL,
        version      INTEGER NOT NULL,
        PRIMARY KEY (group_name, partition)
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_heartbeats (
        group_name  TEXT NOT NULL,
        host        TEXT NOT NULL,
        incarnation TEXT NOT NULL,
        version     INTEGER NOT NULL,
        written_at  INTEGER NOT NULL,
        PRIMARY KEY (group_name, host)
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_groups (
        group_name     TEXT NOT NULL PRIMARY KEY,
        change_counter INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_partitions (
        id          TEXT NOT NULL PRIMARY KEY,
        parents     TEXT NOT NULL,
        closed      INTEGER NOT NULL,
        range_start TEXT NOT NULL,
        range_end   TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_records (
        partition    TEXT NOT NULL,
        seq          INTEGER NOT NULL,
        key          TEXT NOT NULL,
        data         BLOB NOT NULL,
        timestamp_ms INTEGER NOT NULL,
        PRIMARY KEY (partition, seq)
    ) WITHOUT ROWID;
    INSERT INTO changefeed_leases
        (group_name, partition, state, owner, start, parents, properties, version) VALUES
        ('old', 'a', 'owned', 'h1', 'beginning', '[]', '{}', 3),
        ('old', 'b', 'available', NULL, 'beginning', '[]', '{}', 1),
        ('old', 'c', 'available', NULL, 'beginning', '[]', '{}', 1),
        ('other', 'z', 'available', NULL, 'beginning', '[]', '{}', 1);
    INSERT INTO changefeed_groups (group_name, change_counter) VALUES ('old', 7), ('other', 1);
    INSERT INTO changefeed_heartbeats (group_name, host, incarnation, version, written_at)
        VALUES ('old', 'h1', 'i1', 4, 1000);
"#;

#[tokio::test]
async fn a_schema_1_database_answers_from_its_counter_at_migration_on() {
    // Rows written before the migration carry no stamp: what changed before the counter value
    // at migration cannot be told, so `since` below it is `None`; from it on the store answers.
    let fx = Fixture::new();
    batch(&fx.path, SCHEMA_1).await;
    let store = fx.store().await;
    assert_eq!(SCHEMA_VERSION, 4);
    assert_eq!(
        count(&fx.path, "SELECT version FROM changefeed_schema_version").await,
        SCHEMA_VERSION
    );
    let g = group("old");
    // A heartbeat row from before the report column reads as having none, and renews.
    let m = store.membership(&g).await.unwrap();
    assert_eq!(m.hosts.len(), 1);
    assert_eq!((m.hosts[0].version.0, m.hosts[0].report.clone()), (4, None));
    assert_eq!(store.list(&g).await.unwrap().leases.len(), 3);
    assert_eq!(counter(&store, &g).await, 7);
    let head = store
        .head(&g)
        .await
        .unwrap()
        .expect("schema 3 keeps a view");
    assert_eq!((head.change_counter, head.view), (7, None));
    for since in [0, 6] {
        unanswered(&store, &g, since).await;
    }
    let at_migration = answered(&store, &g, 7).await;
    assert_eq!(
        (at_migration.counter, summary(&at_migration)),
        (7, (vec![], vec![]))
    );
    unanswered(&store, &g, 8).await;

    let listed = store.list(&g).await.unwrap().leases;
    let listed: Vec<Lease> = listed
        .into_iter()
        .map(std::sync::Arc::unwrap_or_clone)
        .collect();
    let [a, b, c]: [Lease; 3] = listed.try_into().unwrap();
    let b = take(&store, &b, "h2").await; // counter 8
    let mut c_moved = c.clone(); // a checkpoint of an unstamped row stays unstamped
    c_moved.continuation = Some(Continuation::new("c-1"));
    store.replace(&c_moved, c.version).await.unwrap();
    store.delete(&a.key, a.version).await.unwrap(); // counter 9

    let changes = answered(&store, &g, 7).await;
    assert_eq!(changes.counter, 9);
    assert_eq!(
        summary(&changes),
        (vec![row("b", 2, Some("h2"))], names(&["a"]))
    );
    assert_eq!(*changes.leases[0], b);
    let since_8 = answered(&store, &g, 8).await;
    assert_eq!(summary(&since_8), (vec![], names(&["a"])));
    unanswered(&store, &g, 6).await;

    // Another group keeps its own counter at migration; a group born after it answers from 0.
    unanswered(&store, &group("other"), 0).await;
    assert!(answered(&store, &group("other"), 1).await.leases.is_empty());
    create(&store, key("new", "0")).await;
    let new = answered(&store, &group("new"), 0).await;
    assert_eq!(summary(&new), (vec![row("0", 1, None)], vec![]));

    // Opening again does not migrate again: the same answers.
    let again = SqliteLeaseStore::open(&fx.path).await.unwrap();
    assert_eq!(summary(&answered(&again, &g, 7).await), summary(&changes));
    unanswered(&again, &g, 6).await;
}

#[tokio::test]
async fn a_writer_that_does_not_stamp_makes_earlier_counters_unanswerable() {
    // A process of the previous version still running on a migrated file (or a hand edit)
    // moves the counter without stamping what it changed: from then the store answers `None`
    // until one of its own writes, and afterwards only from the counter that write found.
    let fx = Fixture::new();
    let store = fx.store().await;
    let g = group("g");
    let a = create(&store, key("g", "a")).await; // counter 1
                                                 // What version 1 of this crate wrote for a create: the row, then the counter.
    batch(
        &fx.path,
        "INSERT INTO changefeed_leases (group_name, partition, state, start, parents,
             properties, version) VALUES ('g', 'old', 'available', 'beginning', '[]', '{}', 1);
         UPDATE changefeed_groups SET change_counter = change_counter + 1
             WHERE group_name = 'g';",
    )
    .await;
    assert_eq!(counter(&store, &g).await, 2);
    for since in [0, 1, 2] {
        unanswered(&store, &g, since).await;
    }
    take(&store, &a, "h1").await; // counter 3
    unanswered(&store, &g, 1).await;
    let changes = answered(&store, &g, 2).await;
    assert_eq!(changes.counter, 3);
    assert_eq!(summary(&changes), (vec![row("a", 2, Some("h1"))], vec![]));

    // Its delete: the row goes, the counter moves, nothing is recorded.
    batch(
        &fx.path,
        "DELETE FROM changefeed_leases WHERE group_name = 'g' AND partition = 'a';
         UPDATE changefeed_groups SET change_counter = change_counter + 1
             WHERE group_name = 'g';",
    )
    .await;
    unanswered(&store, &g, 3).await;
    create(&store, key("g", "b")).await; // counter 5
    unanswered(&store, &g, 3).await;
    let changes = answered(&store, &g, 4).await;
    assert_eq!(summary(&changes), (vec![row("b", 1, None)], vec![]));
}
