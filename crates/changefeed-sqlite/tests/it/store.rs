//! The lease store on a temporary SQLite file: conformance suite and focused checks.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
    Timestamp, Version,
};
use changefeed::testkit::{lease_store_conformance, Corruption, LeaseStoreFixture};
use changefeed::LeaseError;
use changefeed_sqlite::{SqliteError, SqliteLeaseStore, CHANGE_HORIZON, SCHEMA_VERSION};
use tempfile::TempDir;

/// A fresh database file; every `connect` opens a new connection to it.
pub struct Fixture {
    _dir: TempDir,
    pub path: PathBuf,
}

impl Fixture {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.db");
        Self { _dir: dir, path }
    }

    pub async fn store(&self) -> SqliteLeaseStore {
        SqliteLeaseStore::open(&self.path).await.unwrap()
    }

    /// Runs `sql` with `params` on a connection of its own, as a person editing the file would.
    pub async fn edit(&self, sql: &'static str, params: Vec<String>) -> usize {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(path).unwrap();
            conn.busy_timeout(std::time::Duration::from_secs(5))
                .unwrap();
            conn.execute(sql, rusqlite::params_from_iter(params))
                .unwrap()
        })
        .await
        .unwrap()
    }
}

#[async_trait]
impl LeaseStoreFixture for Fixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        Arc::new(self.store().await)
    }

    fn answers_changes(&self) -> bool {
        true
    }

    fn keeps_view(&self) -> bool {
        true
    }

    fn changes_horizon(&self) -> Option<u64> {
        Some(CHANGE_HORIZON)
    }

    async fn deletion_records(&self, group: &GroupName) -> Option<u64> {
        let (path, group) = (self.path.clone(), group.to_string());
        let n: i64 = tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(path).unwrap();
            conn.query_row(
                "SELECT COUNT(*) FROM changefeed_deletions WHERE group_name = ?1",
                [group],
                |r| r.get(0),
            )
            .unwrap()
        })
        .await
        .unwrap();
        Some(u64::try_from(n).unwrap())
    }

    async fn corrupt(&self, key: &LeaseKey, how: Corruption) {
        let params = vec![key.group.to_string(), key.partition.to_string()];
        // A row that is not there yet is inserted first, so there is something to break.
        self.edit(
            "INSERT INTO changefeed_leases (group_name, partition, state, start, parents,
             properties, version) VALUES (?1, ?2, 'available', 'beginning', '[]', '{}', 1)
             ON CONFLICT DO NOTHING",
            params.clone(),
        )
        .await;
        let sql = match how {
            Corruption::BadPropertiesJson => {
                "UPDATE changefeed_leases SET properties = '{\"a\": ' \
                 WHERE group_name = ?1 AND partition = ?2"
            }
            Corruption::UnknownState => {
                "UPDATE changefeed_leases SET state = 'borrowed' \
                 WHERE group_name = ?1 AND partition = ?2"
            }
        };
        assert_eq!(self.edit(sql, params).await, 1);
    }
}

pub fn key(group: &str, partition: &str) -> LeaseKey {
    LeaseKey::new(
        GroupName::new(group).unwrap(),
        PartitionId::new(partition).unwrap(),
    )
}

pub fn host(name: &str) -> HostName {
    HostName::new(name).unwrap()
}

pub fn owned_by(mut lease: Lease, owner: &str) -> Lease {
    lease.state = LeaseState::Owned;
    lease.owner = Some(host(owner));
    lease
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance() {
    // Every backend passes the core's lease store suite (DESIGN.md: conformance suite).
    lease_store_conformance(|| async { Box::new(Fixture::new()) as Box<dyn LeaseStoreFixture> })
        .await
}

#[tokio::test]
async fn stale_replace_conflicts_with_the_current_row() {
    // Checkpoints are compare-and-swap: a stale version never overwrites (rule 3).
    let fx = Fixture::new();
    let store = fx.store().await;
    let k = key("g", "0");
    let created = store
        .create(&Lease::new(k.clone(), Position::Beginning))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(created.version, Version::FIRST);

    let mut moved = owned_by(created.clone(), "a");
    moved.continuation = Some(Continuation::new("0:5"));
    let stored = store.replace(&moved, Version::FIRST).await.unwrap();
    assert_eq!(stored.version, Version(2));

    let mut stale = created.clone();
    stale.continuation = Some(Continuation::new("0:1"));
    match store.replace(&stale, Version::FIRST).await {
        Err(LeaseError::Conflict {
            expected, current, ..
        }) => {
            assert_eq!(expected, Version::FIRST);
            assert_eq!(*current, stored);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(store.get(&k).await.unwrap(), Some(stored.clone()));

    // Delete is conditional too, then the row is gone.
    assert!(matches!(
        store.delete(&k, Version::FIRST).await,
        Err(LeaseError::Conflict { .. })
    ));
    store.delete(&k, Version(2)).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap(), None);
    assert!(matches!(
        store.replace(&stored, Version(2)).await,
        Err(LeaseError::NotFound { .. })
    ));
}

#[tokio::test]
async fn a_checkpoint_waits_for_another_writer_instead_of_failing() {
    // A checkpoint is written on the calling thread only when no other writer holds the file;
    // one that finds the write lock taken waits for it, as every write does (up to the busy
    // timeout), and is stored once the lock is free, instead of failing with a busy error.
    let fx = Fixture::new();
    let store = fx.store().await;
    let k = key("g", "0");
    let created = store
        .create(&Lease::new(k.clone(), Position::Beginning))
        .await
        .unwrap()
        .unwrap();
    let owned = store
        .replace(&owned_by(created, "a"), Version::FIRST)
        .await
        .unwrap();

    // Another connection takes the write lock and holds it until told.
    let (locked, is_locked) = tokio::sync::oneshot::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let path = fx.path.clone();
    let writer = std::thread::spawn(move || {
        let mut conn = rusqlite::Connection::open(path).unwrap();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        locked.send(()).unwrap();
        released.recv().unwrap();
        tx.commit().unwrap();
    });
    is_locked.await.unwrap();

    let mut moved = owned.clone();
    moved.continuation = Some(Continuation::new("0:5"));
    use std::future::Future as _;
    let mut checkpoint = std::pin::pin!(store.replace(&moved, owned.version));
    let first = std::future::poll_fn(|cx| {
        std::task::Poll::Ready(checkpoint.as_mut().poll(cx).map(|r| r.map(|l| l.version)))
    })
    .await;
    assert!(
        first.is_pending(),
        "the checkpoint waits for the lock, it does not end: {first:?}"
    );
    release.send(()).unwrap();
    let stored = checkpoint.await.unwrap();
    writer.join().unwrap();
    assert_eq!(stored.version, owned.version.next());
    assert_eq!(store.get(&k).await.unwrap(), Some(stored));
}

#[tokio::test]
async fn change_counter_moves_on_ownership_changes_only() {
    // The counter is bumped by create, delete and ownership changes, not by checkpoints.
    let fx = Fixture::new();
    let store = fx.store().await;
    let group = GroupName::new("g").unwrap();
    let counter = || async { store.membership(&group).await.unwrap().change_counter };
    assert_eq!(counter().await, 0);

    let lease = store
        .create(&Lease::new(key("g", "0"), Position::Beginning))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counter().await, 1);
    // Creating again (absent-only) changes nothing.
    assert!(store.create(&lease).await.unwrap().is_none());
    assert_eq!(counter().await, 1);

    let taken = store
        .replace(&owned_by(lease, "a"), Version::FIRST)
        .await
        .unwrap();
    assert_eq!(counter().await, 2);

    let mut checkpoint = taken.clone();
    checkpoint.continuation = Some(Continuation::new("0:9"));
    checkpoint.properties.insert("note".into(), "x".into());
    let checkpoint = store.replace(&checkpoint, taken.version).await.unwrap();
    assert_eq!(counter().await, 2, "a checkpoint must not move the counter");

    let mut handoff = checkpoint.clone();
    handoff.next_owner = Some(host("b"));
    let handoff = store.replace(&handoff, checkpoint.version).await.unwrap();
    assert_eq!(counter().await, 3);

    store.delete(&handoff.key, handoff.version).await.unwrap();
    assert_eq!(counter().await, 4);

    // Groups are isolated.
    let other = GroupName::new("h").unwrap();
    assert_eq!(store.membership(&other).await.unwrap().change_counter, 0);
}

#[tokio::test]
async fn malformed_rows_are_listed_apart_and_never_hide_the_others() {
    // A malformed lease row is reported with its key and never panics (DESIGN.md: bad input).
    let fx = Fixture::new();
    let store = fx.store().await;
    for p in ["a", "b", "c", "d", "e", "f", "g"] {
        store
            .create(&Lease::new(key("grp", p), Position::Beginning))
            .await
            .unwrap();
    }
    fx.corrupt(&key("grp", "a"), Corruption::BadPropertiesJson)
        .await;
    fx.corrupt(&key("grp", "b"), Corruption::UnknownState).await;
    let set = |column: &str| match column {
        "parents" => "UPDATE changefeed_leases SET parents = '[\"\"]' WHERE partition = ?1",
        "owner" => "UPDATE changefeed_leases SET owner = 'x' WHERE partition = ?1",
        "start" => "UPDATE changefeed_leases SET start = 'later' WHERE partition = ?1",
        _ => "UPDATE changefeed_leases SET version = 'v' WHERE partition = ?1",
    };
    fx.edit(set("parents"), vec!["c".into()]).await;
    fx.edit(set("owner"), vec!["d".into()]).await; // available with an owner
    fx.edit(set("start"), vec!["e".into()]).await;
    fx.edit(set("version"), vec!["f".into()]).await;
    fx.edit(
        "UPDATE changefeed_leases SET partition = ' bad id' WHERE partition = 'g'",
        vec![],
    )
    .await;

    let listing = store.list(&GroupName::new("grp").unwrap()).await.unwrap();
    assert!(listing.leases.is_empty(), "{:?}", listing.leases);
    let mut keys: Vec<String> = listing
        .malformed
        .iter()
        .map(|e| match e {
            LeaseError::Malformed { key, .. } => key.clone(),
            other => panic!("expected Malformed, got {other:?}"),
        })
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "grp/ bad id",
            "grp/a",
            "grp/b",
            "grp/c",
            "grp/d",
            "grp/e",
            "grp/f"
        ]
    );

    // A good row among bad ones is still listed.
    store
        .create(&Lease::new(key("grp", "z"), Position::Beginning))
        .await
        .unwrap();
    let listing = store.list(&GroupName::new("grp").unwrap()).await.unwrap();
    assert_eq!(listing.leases.len(), 1);
    assert_eq!(listing.malformed.len(), 7);

    // `get` and `replace` name the row; an operator can delete it at its version.
    let err = store.get(&key("grp", "b")).await.unwrap_err();
    assert!(err.to_string().contains("grp/b"), "{err}");
    assert!(err.to_string().contains("borrowed"), "{err}");
    let good = Lease::new(key("grp", "a"), Position::Beginning);
    assert!(matches!(
        store.replace(&good, Version::FIRST).await,
        Err(LeaseError::Malformed { .. })
    ));
    store
        .delete(&key("grp", "a"), Version::FIRST)
        .await
        .unwrap();
    assert_eq!(store.get(&key("grp", "a")).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_creators_on_separate_connections_exactly_one_wins() {
    // Create is create-if-absent even with two leaders racing (DESIGN.md: lineage).
    let fx = Fixture::new();
    let mut stores = Vec::new();
    for _ in 0..8 {
        stores.push(fx.connect().await);
    }
    for round in 0..20 {
        let k = key("race", &round.to_string());
        let tasks: Vec<_> = stores
            .iter()
            .map(|s| {
                let (s, k) = (Arc::clone(s), k.clone());
                tokio::spawn(async move { s.create(&Lease::new(k, Position::Now)).await })
            })
            .collect();
        let mut winners = 0;
        for t in tasks {
            if t.await.unwrap().unwrap().is_some() {
                winners += 1;
            }
        }
        assert_eq!(winners, 1, "round {round}");
    }
    let group = GroupName::new("race").unwrap();
    assert_eq!(
        stores[0].membership(&group).await.unwrap().change_counter,
        20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_compare_and_swap_loses_no_update() {
    // Writers on separate connections each add 1 under CAS; the total must be exact.
    let fx = Fixture::new();
    let k = key("cas", "0");
    fx.connect()
        .await
        .create(&Lease::new(k.clone(), Position::Beginning))
        .await
        .unwrap();
    let (writers, each) = (4, 25);
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let store = fx.connect().await;
        let k = k.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            let mut lease = store.get(&k).await.unwrap().unwrap();
            while done < each {
                let n: u64 = lease
                    .continuation
                    .as_ref()
                    .map_or(0, |c| c.as_str().parse().unwrap());
                let mut next = lease.clone();
                next.continuation = Some(Continuation::new((n + 1).to_string()));
                match store.replace(&next, lease.version).await {
                    Ok(stored) => {
                        lease = stored;
                        done += 1;
                    }
                    Err(LeaseError::Conflict { current, .. }) => lease = *current,
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let end = fx.connect().await.get(&k).await.unwrap().unwrap();
    let total = writers * each;
    assert_eq!(end.continuation, Some(Continuation::new(total.to_string())));
    assert_eq!(end.version, Version(total + 1));
}

#[tokio::test]
async fn heartbeats_are_compare_and_swap_and_read_with_the_counter() {
    // Liveness is per host: one heartbeat row per host, versioned (DESIGN.md: lease store).
    let fx = Fixture::new();
    let store = fx.store().await;
    let group = GroupName::new("g").unwrap();
    let (a, b) = (host("a"), host("b"));
    let hb = store
        .heartbeat(
            &group,
            &b,
            "inc-1",
            Timestamp(10),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .unwrap();
    assert_eq!(hb.version, Version::FIRST);
    store
        .heartbeat(
            &group,
            &a,
            "inc-2",
            Timestamp(11),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .unwrap();
    // A second process with the same name cannot create the row again.
    match store
        .heartbeat(
            &group,
            &b,
            "inc-3",
            Timestamp(12),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
    {
        Err(LeaseError::HeartbeatConflict { current, .. }) => {
            assert_eq!(&*current.unwrap().incarnation, "inc-1")
        }
        other => panic!("expected a heartbeat conflict, got {other:?}"),
    }
    let hb2 = store
        .heartbeat(
            &group,
            &b,
            "inc-1",
            Timestamp(20),
            Some(hb.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .unwrap();
    assert_eq!(hb2.version, Version(2));
    assert_eq!(hb2.written_at, Timestamp(20));
    assert!(store
        .heartbeat(
            &group,
            &b,
            "inc-1",
            Timestamp(21),
            Some(hb.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .is_err());

    let m = store.membership(&group).await.unwrap();
    let names: Vec<_> = m.hosts.iter().map(|h| h.host.to_string()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(m.hosts[1], hb2);

    assert!(matches!(
        store
            .remove_heartbeat(&group, &b, "inc-1", Version::FIRST)
            .await,
        Err(LeaseError::HeartbeatConflict { .. })
    ));
    store
        .remove_heartbeat(&group, &b, "inc-1", hb2.version)
        .await
        .unwrap();
    store
        .remove_heartbeat(&group, &b, "inc-1", hb2.version)
        .await
        .unwrap(); // already gone: fine
    assert_eq!(store.membership(&group).await.unwrap().hosts.len(), 1);
}

#[tokio::test]
async fn a_database_from_a_newer_version_is_refused() {
    // Opening a schema we do not know could corrupt it: refuse, and say why.
    let fx = Fixture::new();
    drop(fx.store().await);
    fx.edit(
        "UPDATE changefeed_schema_version SET version = ?1",
        vec![(SCHEMA_VERSION + 1).to_string()],
    )
    .await;
    let err = SqliteLeaseStore::open(&fx.path).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("newer than version"), "{text}");
    assert!(!err.is_retryable());
    let source = std::error::Error::source(&err).unwrap();
    assert!(matches!(
        source.downcast_ref::<SqliteError>(),
        Some(SqliteError::SchemaTooNew { found, .. }) if *found == SCHEMA_VERSION + 1
    ));
}

#[tokio::test]
async fn reopening_keeps_the_leases() {
    // The store is durable across handles: a new connection sees what the old one wrote.
    let fx = Fixture::new();
    let lease = {
        let store = fx.store().await;
        let mut lease = Lease::new(key("g", "0"), Position::AtTime(Timestamp(200)))
            .with_parents(vec![PartitionId::new("p").unwrap()]);
        lease.properties.insert("weight".into(), "3".into());
        store.create(&lease).await.unwrap().unwrap()
    };
    let again = fx.store().await;
    assert_eq!(again.get(&lease.key).await.unwrap(), Some(lease));
}

#[tokio::test]
async fn an_invalid_lease_is_refused_before_writing() {
    // The store never writes a lease that breaks the model's rules.
    let fx = Fixture::new();
    let store = fx.store().await;
    let mut lease = Lease::new(key("g", "0"), Position::Beginning);
    lease.state = LeaseState::Owned;
    assert!(matches!(
        store.create(&lease).await,
        Err(LeaseError::Invalid(_))
    ));
    assert_eq!(store.get(&lease.key).await.unwrap(), None);
}

#[tokio::test]
async fn the_file_is_in_wal_mode_with_the_current_schema_version() {
    // WAL lets readers (membership, list) run while another process writes.
    let fx = Fixture::new();
    drop(fx.store().await);
    let conn = rusqlite::Connection::open(&fx.path).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let version: i64 = conn
        .query_row("SELECT version FROM changefeed_schema_version", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
}
