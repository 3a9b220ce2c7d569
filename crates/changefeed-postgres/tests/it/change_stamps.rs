//! How PostgreSQL answers `list_changes` from its change stamps, where that is PostgreSQL's
//! own: tables migrated from schema 1 answer from their counter at migration on, a writer that
//! does not stamp makes earlier counters unanswerable, and the deletion horizon is recorded by
//! the handle that deletes (`changes_kept`), so every reader obeys it. What every store
//! answering `list_changes` must do (exactly what changed hands, malformed rows, other
//! connections, the deletion horizon, racing writers) is checked by the core's conformance
//! suite in `store.rs`.

use changefeed::lease::{Changes, LeaseStore};
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
};
use changefeed_postgres::{PostgresLeaseStore, DEFAULT_CHANGES_KEPT, LEASE_SCHEMA_VERSION};

use crate::common::{raw_client, Prefixes};

fn group(name: &str) -> GroupName {
    GroupName::new(name).unwrap()
}

fn key(g: &str, p: &str) -> LeaseKey {
    LeaseKey::new(group(g), PartitionId::new(p).unwrap())
}

fn host(name: &str) -> HostName {
    HostName::new(name).unwrap()
}

async fn connect(prefixes: &Prefixes, prefix: &str) -> PostgresLeaseStore {
    PostgresLeaseStore::connect_with(prefixes.options(prefix))
        .await
        .unwrap()
}

async fn counter(store: &dyn LeaseStore, g: &GroupName) -> u64 {
    store.membership(g).await.unwrap().change_counter
}

/// `list_changes` must answer here: a store answering `None` passes the conformance check.
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

/// (partition, version, owner) of each changed lease, and the deleted partitions.
type Summary = (Vec<(String, u64, Option<String>)>, Vec<String>);

fn summary(c: &Changes) -> Summary {
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

fn row(p: &str, version: u64, owner: Option<&str>) -> (String, u64, Option<String>) {
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
        .expect("created")
}

async fn take(store: &dyn LeaseStore, lease: &Lease, by: &str) -> Lease {
    let mut next = lease.clone();
    next.state = LeaseState::Owned;
    next.owner = Some(host(by));
    next.next_owner = None;
    store.replace(&next, lease.version).await.unwrap()
}

async fn checkpoint(store: &dyn LeaseStore, lease: &Lease, at: &str) -> Lease {
    let mut next = lease.clone();
    next.continuation = Some(Continuation::new(at));
    store.replace(&next, lease.version).await.unwrap()
}

async fn count_rows(sql: &str) -> i64 {
    raw_client().await.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_reader_obeys_the_horizon_the_deleting_handle_recorded() {
    // `changes_kept` is a setting of the handle that deletes: it prunes the deletion records
    // and raises the group's oldest answerable counter in the same statement, so a reader with
    // the default setting answers `None` behind that horizon too, never missing a forgotten
    // deletion.
    const KEPT: u64 = 8;
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = connect(&prefixes, &prefix).await.changes_kept(KEPT);
    let reader = connect(&prefixes, &prefix).await;
    let g = group("g");
    let mut rows = Vec::new();
    for i in 0..30 {
        rows.push(create(&store, key("g", &format!("{i:02}"))).await);
    }
    for lease in &rows {
        store.delete(&lease.key, lease.version).await.unwrap();
    }
    let last = counter(&store, &g).await;
    assert_eq!(
        count_rows(&format!(
            "SELECT count(*) FROM \"{prefix}_lease_deletions\" WHERE grp = 'g'"
        ))
        .await as u64,
        KEPT
    );
    let since = last - KEPT;
    let expected: Vec<String> = (22..30).map(|i| format!("{i:02}")).collect();
    assert_eq!(
        summary(&answered(&reader, &g, since).await),
        (vec![], expected)
    );
    for s in [0, 30, since - 1] {
        unanswered(&reader, &g, s).await;
    }
    // The default bound keeps every deletion of a short history.
    assert_eq!(DEFAULT_CHANGES_KEPT, 16_384);
    prefixes.cleanup().await;
}

/// The lease store's released migration 1, verbatim: the tables as an old build left them.
fn schema_1(prefix: &str) -> String {
    let leases = format!("\"{prefix}_leases\"");
    let heartbeats = format!("\"{prefix}_heartbeats\"");
    let groups = format!("\"{prefix}_groups\"");
    let versions = format!("\"{prefix}_schema_versions\"");
    format!(
        r#"
        CREATE TABLE {leases} (
            grp          text COLLATE "C" NOT NULL,
            partition    text COLLATE "C" NOT NULL,
            state        text NOT NULL,
            owner        text,
            next_owner   text,
            continuation text,
            start        text NOT NULL,
            parents      text NOT NULL,
            properties   text NOT NULL,
            version      bigint NOT NULL,
            PRIMARY KEY (grp, partition)
        );
        CREATE TABLE {heartbeats} (
            grp         text COLLATE "C" NOT NULL,
            host        text COLLATE "C" NOT NULL,
            incarnation text NOT NULL,
            version     bigint NOT NULL,
            written_at  bigint NOT NULL,
            PRIMARY KEY (grp, host)
        );
        CREATE TABLE {groups} (
            grp            text COLLATE "C" PRIMARY KEY,
            change_counter bigint NOT NULL
        );
        CREATE TABLE {versions} (
            component text PRIMARY KEY,
            version integer NOT NULL
        );
        INSERT INTO {versions} VALUES ('lease_store', 1);
        "#
    )
}

#[tokio::test]
async fn a_schema_1_database_answers_from_its_counter_at_migration_on() {
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let client = raw_client().await;
    client.batch_execute(&schema_1(&prefix)).await.unwrap();
    // What an old build leaves: leases a, b (owned), c with counter 9 after some history, and
    // a group with a lease but no counter row (only a hand edit makes one).
    let leases = format!("\"{prefix}_leases\"");
    client
        .batch_execute(&format!(
            "INSERT INTO {leases} VALUES
                ('g', 'a', 'available', NULL, NULL, NULL, 'beginning', '[]', '{{}}', 3),
                ('g', 'b', 'owned', 'h1', NULL, 'b-7', 'beginning', '[]', '{{}}', 5),
                ('g', 'c', 'available', NULL, NULL, NULL, 'beginning', '[]', '{{}}', 1),
                ('lost', 'x', 'available', NULL, NULL, NULL, 'beginning', '[]', '{{}}', 1);
             INSERT INTO \"{prefix}_groups\" VALUES ('g', 9);"
        ))
        .await
        .unwrap();

    let store = connect(&prefixes, &prefix).await;
    let version = crate::common::lease_schema_version(&client, &prefix).await;
    assert_eq!(version, LEASE_SCHEMA_VERSION);
    let g = group("g");
    let listing = store.list(&g).await.unwrap();
    assert!(listing.malformed.is_empty(), "{:?}", listing.malformed);
    assert_eq!(listing.leases.len(), 3, "old rows still list");
    assert_eq!(
        counter(&store, &g).await,
        9,
        "the migration keeps the counter"
    );

    // Rows from before carry no stamp: nothing below the counter at migration is answered.
    for since in [0, 1, 8] {
        unanswered(&store, &g, since).await;
    }
    let none_yet = answered(&store, &g, 9).await;
    assert!(none_yet.leases.is_empty() && none_yet.deleted.is_empty());
    assert_eq!(none_yet.counter, 9);

    // From then on, writes to old rows are stamped like any other.
    let [a, b, c] = [&listing.leases[0], &listing.leases[1], &listing.leases[2]];
    let a = take(&store, a, "h2").await;
    checkpoint(&store, b, "b-8").await;
    store.delete(&c.key, c.version).await.unwrap();
    let d = create(&store, key("g", "d")).await;
    assert_eq!(counter(&store, &g).await, 12);
    assert_eq!(
        summary(&answered(&store, &g, 9).await),
        (
            vec![
                row("a", a.version.0, Some("h2")),
                row("d", d.version.0, None)
            ],
            names(&["c"])
        )
    );
    unanswered(&store, &g, 8).await;

    // The group without a counter row got counter 1: a host that saw it at 0 lists in full.
    let lost = group("lost");
    assert_eq!(counter(&store, &lost).await, 1);
    unanswered(&store, &lost, 0).await;
    assert!(answered(&store, &lost, 1).await.leases.is_empty());

    // Connecting again does not migrate again.
    let again = connect(&prefixes, &prefix).await;
    assert!(answered(&again, &g, 12).await.leases.is_empty());
    prefixes.cleanup().await;
}

#[tokio::test]
async fn a_writer_that_does_not_stamp_makes_earlier_counters_unanswerable() {
    // A process of the previous version still running against migrated tables moves the
    // counter without stamping the row: no answer may then miss its change.
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = connect(&prefixes, &prefix).await;
    let g = group("g");
    let a = create(&store, key("g", "a")).await;
    let b = create(&store, key("g", "b")).await;
    let before = counter(&store, &g).await;
    // The old build's replace of a, as one statement: owner and version, and the counter.
    raw_client()
        .await
        .batch_execute(&format!(
            "WITH upd AS (
                UPDATE \"{prefix}_leases\" SET state = 'owned', owner = 'old', version = version + 1
                WHERE grp = 'g' AND partition = 'a' RETURNING 1
             )
             INSERT INTO \"{prefix}_groups\" (grp, change_counter) SELECT 'g', 1 FROM upd
             ON CONFLICT (grp) DO UPDATE SET change_counter = \"{prefix}_groups\".change_counter + 1"
        ))
        .await
        .unwrap();
    let moved = counter(&store, &g).await;
    assert_eq!(moved, before + 1);
    unanswered(&store, &g, before).await;
    unanswered(&store, &g, moved).await;
    // This store's next write answers again from the counter it found on.
    let b = take(&store, &b, "h1").await;
    unanswered(&store, &g, before).await;
    assert_eq!(
        summary(&answered(&store, &g, moved).await),
        (vec![row("b", b.version.0, Some("h1"))], vec![])
    );
    assert_eq!(a.version.0, 1);
    prefixes.cleanup().await;
}
