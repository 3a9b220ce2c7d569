//! `list_changes` on a real server: that it answers (the conformance check also passes a store
//! answering `None`), from which counter on (tables migrated from schema 1, deletions
//! forgotten past the horizon, writers that do not stamp), across separate connection pools,
//! and under racing writers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::{Changes, LeaseStore};
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
};
use changefeed::LeaseError;
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
async fn list_changes_answers_with_exactly_what_changed_hands() {
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = connect(&prefixes, &prefix).await;
    let g = group("g");

    // A group nothing was ever written to is at counter 0, and has not reached 1.
    let empty = answered(&store, &g, 0).await;
    assert_eq!(empty.counter, 0);
    assert!(empty.leases.is_empty() && empty.deleted.is_empty());
    unanswered(&store, &g, 1).await;

    let mut rows = BTreeMap::new();
    for p in ["a", "b", "c", "d", "e", "f"] {
        rows.insert(p, create(&store, key("g", p)).await);
    }
    let created = counter(&store, &g).await;
    assert_eq!(created, 6);
    let all = answered(&store, &g, 0).await;
    assert_eq!(all.counter, 6);
    assert_eq!(
        summary(&all)
            .0
            .iter()
            .map(|r| r.0.clone())
            .collect::<Vec<_>>(),
        names(&["a", "b", "c", "d", "e", "f"]),
        "every creation, in partition order"
    );
    // Creations stamp one counter value each: the changes after the third are the last three.
    assert_eq!(
        summary(&answered(&store, &g, 3).await).0,
        vec![row("d", 1, None), row("e", 1, None), row("f", 1, None)]
    );

    // a: taken then only checkpointed (listed at its latest version); b: only checkpointed
    // (not listed); c: properties only (not listed); d: deleted; e: deleted and created
    // again (both); f: handed off (next_owner set); g: created.
    let a = take(&store, &rows["a"], "h1").await;
    let a = checkpoint(&store, &a, "a-1").await;
    checkpoint(&store, &rows["b"], "b-1").await;
    let mut c = rows["c"].clone();
    c.properties.insert("k".into(), "v".into());
    store.replace(&c, c.version).await.unwrap();
    store
        .delete(&rows["d"].key, rows["d"].version)
        .await
        .unwrap();
    store
        .delete(&rows["e"].key, rows["e"].version)
        .await
        .unwrap();
    let e = create(&store, key("g", "e")).await;
    let f = take(&store, &rows["f"], "h1").await;
    let mut handoff = f.clone();
    handoff.next_owner = Some(host("h2"));
    let f = store.replace(&handoff, f.version).await.unwrap();
    let new = create(&store, key("g", "g")).await;

    let now = counter(&store, &g).await;
    assert_eq!(
        now,
        created + 7,
        "take, two deletes, two creates, take, hand-off"
    );
    let changes = answered(&store, &g, created).await;
    assert_eq!(changes.counter, now, "the counter as of the read");
    assert_eq!(
        summary(&changes),
        (
            vec![
                row("a", a.version.0, Some("h1")),
                row("e", e.version.0, None),
                row("f", f.version.0, Some("h1")),
                row("g", new.version.0, None),
            ],
            names(&["d", "e"]),
        )
    );
    assert_eq!(changes.leases[2].next_owner, Some(host("h2")));
    assert_eq!(
        changes.leases[0].continuation,
        Some(Continuation::new("a-1")),
        "the current row, checkpoint included"
    );
    // Only what came after the value asked about.
    assert_eq!(
        summary(&answered(&store, &g, now - 1).await),
        (vec![row("g", 1, None)], vec![])
    );
    let nothing = answered(&store, &g, now).await;
    assert_eq!(nothing.counter, now);
    assert!(nothing.leases.is_empty() && nothing.deleted.is_empty());
    unanswered(&store, &g, now + 1).await;
    unanswered(&store, &g, u64::MAX).await;
    // Groups are isolated.
    let other = answered(&store, &group("other"), 0).await;
    assert!(other.leases.is_empty() && other.deleted.is_empty() && other.counter == 0);
    prefixes.cleanup().await;
}

#[tokio::test]
async fn unreadable_changed_rows_are_named_by_key_and_never_hide_the_others() {
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = connect(&prefixes, &prefix).await;
    let g = group("g");
    let mut rows = Vec::new();
    for p in ["a", "b", "c"] {
        rows.push(create(&store, key("g", p)).await);
    }
    let since = counter(&store, &g).await;
    take(&store, &rows[0], "h1").await;
    let b = take(&store, &rows[1], "h1").await;
    let client = raw_client().await;
    // b changed hands and is then broken by hand; c is broken but did not change.
    for (p, sql) in [
        ("b", format!("UPDATE \"{prefix}_leases\" SET properties = '{{\"x\": ' WHERE grp = 'g' AND partition = $1")),
        ("c", format!("UPDATE \"{prefix}_leases\" SET state = 'borrowed' WHERE grp = 'g' AND partition = $1")),
    ] {
        assert_eq!(client.execute(&sql, &[&p]).await.unwrap(), 1);
    }
    let changes = answered(&store, &g, since).await;
    assert_eq!(
        changes
            .leases
            .iter()
            .map(|l| l.key.partition.to_string())
            .collect::<Vec<_>>(),
        names(&["a"])
    );
    assert_eq!(changes.malformed.len(), 1, "{:?}", changes.malformed);
    match &changes.malformed[0] {
        LeaseError::Malformed { key, reason } => {
            assert_eq!(key, "g/b");
            assert!(reason.contains("properties"), "{reason}");
        }
        other => panic!("expected Malformed, got {other}"),
    }
    // The full list names the same row (and the unchanged broken one), as list_changes does.
    let listing = store.list(&g).await.unwrap();
    assert_eq!(listing.malformed.len(), 2);
    assert!(b.version.0 > 1);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletions_are_kept_for_the_horizon_then_forgotten() {
    const KEPT: u64 = 8;
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let store = connect(&prefixes, &prefix).await.changes_kept(KEPT);
    // A reader with the default setting obeys the bound the deleting handle recorded.
    let reader = connect(&prefixes, &prefix).await;
    let g = group("g");
    let mut rows = Vec::new();
    for i in 0..30 {
        rows.push(create(&store, key("g", &format!("{i:02}"))).await);
    }
    // An unrelated group's deletions are neither counted nor pruned with these.
    let other = create(&store, key("other", "z")).await;
    store.delete(&other.key, other.version).await.unwrap();
    let deletions = format!("SELECT count(*) FROM \"{prefix}_lease_deletions\" WHERE grp = 'g'");
    let mut at = Vec::new();
    for lease in &rows {
        store.delete(&lease.key, lease.version).await.unwrap();
        let c = counter(&store, &g).await;
        at.push(c);
        let n = count_rows(&deletions).await;
        assert!(
            n as u64 <= KEPT,
            "{n} deletion records after the delete at {c}"
        );
    }
    let last = *at.last().unwrap();
    assert_eq!(count_rows(&deletions).await as u64, KEPT);
    // Within the horizon: exactly the keys deleted after the value asked about.
    let since = last - KEPT;
    let changes = answered(&reader, &g, since).await;
    let expected: Vec<String> = (22..30).map(|i| format!("{i:02}")).collect();
    assert_eq!(summary(&changes), (vec![], expected));
    // Behind it: not answered, whichever handle asks.
    for s in [0, 30, since - 1] {
        unanswered(&reader, &g, s).await;
        unanswered(&store, &g, s).await;
    }
    // Creations are stamped on the rows, which need no pruning: recreated keys list again.
    let back = create(&store, key("g", "05")).await;
    let changes = answered(&reader, &g, last).await;
    assert_eq!(
        summary(&changes),
        (vec![row("05", back.version.0, None)], vec![])
    );
    assert_eq!(
        count_rows(&format!(
            "SELECT count(*) FROM \"{prefix}_lease_deletions\" WHERE grp = 'other'"
        ))
        .await,
        1
    );
    // The default bound keeps every deletion of a short history.
    assert_eq!(DEFAULT_CHANGES_KEPT, 16_384);
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_pools_see_each_others_changes() {
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let one = connect(&prefixes, &prefix).await;
    let two = connect(&prefixes, &prefix).await;
    let g = group("g");
    let a = create(&one, key("g", "a")).await;
    let seen = answered(&two, &g, 0).await;
    assert_eq!(summary(&seen), (vec![row("a", 1, None)], vec![]));
    let a = take(&two, &a, "h2").await;
    let b = create(&two, key("g", "b")).await;
    let changes = answered(&one, &g, seen.counter).await;
    assert_eq!(
        summary(&changes),
        (
            vec![
                row("a", a.version.0, Some("h2")),
                row("b", b.version.0, None)
            ],
            vec![]
        )
    );
    one.delete(&b.key, b.version).await.unwrap();
    let gone = answered(&two, &g, changes.counter).await;
    assert_eq!(summary(&gone), (vec![], names(&["b"])));
    assert_eq!(gone.counter, counter(&one, &g).await);
    prefixes.cleanup().await;
}

/// A small deterministic generator, so the racing test needs no extra dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One racing write on a random partition: create it if absent, else take, hand off,
/// release or (rarely) delete it. Losing a race (conflict, gone) is expected and skipped.
async fn random_write(store: &dyn LeaseStore, me: &HostName, rng: &mut XorShift) -> bool {
    let p = format!("{:02}", rng.below(16));
    let k = key("race", &p);
    let current = match store.get(&k).await.unwrap() {
        None => {
            return store
                .create(&Lease::new(k, Position::Beginning))
                .await
                .unwrap()
                .is_some()
        }
        Some(l) => l,
    };
    let roll = rng.below(10);
    if roll == 0 {
        return match store.delete(&current.key, current.version).await {
            Ok(()) => true,
            Err(LeaseError::Conflict { .. } | LeaseError::NotFound { .. }) => false,
            Err(e) => panic!("delete {k}: {e}"),
        };
    }
    let mut next = current.clone();
    match (roll, current.state) {
        (1..=4, _) => {
            next.state = LeaseState::Owned;
            next.owner = Some(me.clone());
            next.next_owner = None;
        }
        (5..=7, LeaseState::Owned) => next.next_owner = Some(me.clone()),
        _ => {
            next.state = LeaseState::Available;
            next.owner = None;
            next.next_owner = None;
        }
    }
    if !current.ownership_differs(&next) {
        // Every write here changes hands, so the versions a copy kept from list_changes holds
        // are the current ones (a checkpoint-only write is not listed, by design).
        return false;
    }
    match store.replace(&next, current.version).await {
        Ok(_) => true,
        Err(LeaseError::Conflict { .. } | LeaseError::NotFound { .. }) => false,
        Err(e) => panic!("replace {k}: {e}"),
    }
}

/// Applies `changes` to `copy` as a host would: deletions first, then the current rows.
fn apply(copy: &mut BTreeMap<PartitionId, Lease>, changes: Changes) {
    assert!(changes.malformed.is_empty(), "{:?}", changes.malformed);
    for k in changes.deleted {
        copy.remove(&k.partition);
    }
    for lease in changes.leases {
        copy.insert(lease.key.partition.clone(), lease);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_and_an_incremental_reader_agree_with_a_full_list() {
    // Four writers, each with its own pool, take, hand off, release, delete and create 16
    // leases as fast as they can, while a reader on another pool keeps a copy of the group up
    // to date from list_changes alone. Every answer must be consistent with its counter: at
    // the end the copy equals a full list, field for field (versions included).
    let prefixes = Prefixes::new().await;
    let prefix = prefixes.fresh();
    let g = group("race");
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let store = connect(&prefixes, &prefix).await;
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let me = host(&format!("w{w}"));
            let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ (w + 1).wrapping_mul(0x2545_F491));
            let mut written = 0u32;
            while !stop.load(Ordering::Relaxed) {
                if random_write(&store, &me, &mut rng).await {
                    written += 1;
                }
            }
            written
        }));
    }
    let reader = connect(&prefixes, &prefix).await;
    let mut copy = BTreeMap::new();
    let mut last = 0u64;
    let mut reads = 0u32;
    let mut nonempty = 0u32;
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        let changes = answered(&reader, &g, last).await;
        assert!(changes.counter >= last, "the counter went back");
        if !changes.leases.is_empty() || !changes.deleted.is_empty() {
            nonempty += 1;
        }
        last = changes.counter;
        apply(&mut copy, changes);
        reads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    let changes = answered(&reader, &g, last).await;
    last = changes.counter;
    apply(&mut copy, changes);
    assert_eq!(last, counter(&reader, &g).await);
    let listing = reader.list(&g).await.unwrap();
    assert!(listing.malformed.is_empty());
    let copy: Vec<Lease> = copy.into_values().collect();
    assert_eq!(
        copy, listing.leases,
        "the copy kept from list_changes equals a full list"
    );
    eprintln!(
        "{written} writes, {reads} incremental reads ({nonempty} with changes), counter {last}"
    );
    assert!(
        written > 100 && reads > 20 && nonempty > 10,
        "the race was real: {written} writes, {reads} reads ({nonempty} with changes)"
    );
    prefixes.cleanup().await;
}
