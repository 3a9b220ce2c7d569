//! The lease store conformance suite.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
    Timestamp, Version,
};

/// How a fixture should make a stored lease row unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corruption {
    /// The properties column no longer holds valid JSON.
    BadPropertiesJson,
    /// The state column holds a state that does not exist.
    UnknownState,
}

/// One fresh, empty lease store for the suite.
#[async_trait]
pub trait LeaseStoreFixture: Send + Sync {
    /// A new handle to this fixture's store. For a server or a file, each call opens a new
    /// connection, so racing handles really race through the backend.
    async fn connect(&self) -> Arc<dyn LeaseStore>;
    /// Makes the stored row of `key` unreadable in the way `how` says, by writing the backend
    /// directly (as a person editing the table by hand would).
    async fn corrupt(&self, key: &LeaseKey, how: Corruption);
    /// Whether the store answers [`LeaseStore::list_changes`] (`Some`). A store that says so
    /// fails the suite when it answers `None`; one that does not (the default) passes the
    /// check of what the answer holds vacuously, and its hosts list in full on every move.
    fn answers_changes(&self) -> bool {
        false
    }
}

type Check = for<'a> fn(
    &'a dyn LeaseStoreFixture,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        [$((stringify!($name), (|f| Box::pin($name(f))) as Check)),*]
    };
}

/// Runs every lease store check, each on a fresh fixture from `factory`, and panics naming the
/// first check that fails.
pub async fn lease_store_conformance<F, Fut>(factory: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Box<dyn LeaseStoreFixture>>,
{
    let all = checks![
        create_is_create_if_absent,
        eight_racing_creators_one_wins,
        replace_is_compare_and_swap_with_current_row,
        version_strictly_increases,
        replace_of_missing_lease_is_not_found,
        delete_with_stale_version_is_refused,
        groups_are_isolated,
        fields_and_properties_round_trip,
        change_counter_moves_on_ownership_changes_only,
        racing_replacers_one_wins_per_version,
        heartbeats_are_compare_and_swap,
        malformed_rows_are_named_and_others_still_list,
        invalid_leases_are_refused,
        ten_thousand_leases_list,
        changes_since_a_counter_hold_what_changed_hands,
    ];
    for (name, check) in all {
        let fixture = factory().await;
        tracing::info!(check = name, "lease store conformance");
        eprintln!("lease store conformance: {name}");
        check(fixture.as_ref()).await;
    }
}

fn group(name: &str) -> GroupName {
    GroupName::new(name).expect("suite group names are valid")
}

fn host(name: &str) -> HostName {
    HostName::new(name).expect("suite host names are valid")
}

fn key(g: &str, p: &str) -> LeaseKey {
    LeaseKey::new(
        group(g),
        PartitionId::new(p).expect("suite partition ids are valid"),
    )
}

fn owned(mut lease: Lease, by: &str) -> Lease {
    lease.state = LeaseState::Owned;
    lease.owner = Some(host(by));
    lease
}

async fn must_create(store: &dyn LeaseStore, lease: &Lease) -> Lease {
    store
        .create(lease)
        .await
        .unwrap_or_else(|e| panic!("create {} failed: {e}", lease.key))
        .unwrap_or_else(|| panic!("create {} found it already there", lease.key))
}

async fn create_is_create_if_absent(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let lease = Lease::new(key("g", "0"), Position::Beginning);
    let stored = must_create(store.as_ref(), &lease).await;
    assert_eq!(
        stored.version,
        Version::FIRST,
        "a created lease is at version 1"
    );
    let again = owned(lease.clone(), "intruder");
    let second = store.create(&again).await.expect("second create succeeds");
    assert!(
        second.is_none(),
        "create of an existing key must not create"
    );
    let now = store.get(&lease.key).await.expect("get").expect("present");
    assert_eq!(
        now.owner, None,
        "create must never overwrite an existing lease"
    );
    assert_eq!(now.version, Version::FIRST);
}

async fn eight_racing_creators_one_wins(f: &dyn LeaseStoreFixture) {
    // Design: two leaders syncing at once are harmless because creation is create-if-absent.
    for round in 0..5 {
        let mut handles = Vec::new();
        for i in 0..8 {
            let store = f.connect().await;
            let lease = owned(
                Lease::new(key("race", &format!("p{round}")), Position::Beginning),
                &format!("h{i}"),
            );
            handles.push(tokio::spawn(async move { (i, store.create(&lease).await) }));
        }
        let mut winners = Vec::new();
        for h in handles {
            let (i, result) = h.await.expect("creator task does not panic");
            if result.expect("racing create must not fail").is_some() {
                winners.push(i);
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: exactly one creator wins, got {winners:?}"
        );
        let store = f.connect().await;
        let stored = store
            .get(&key("race", &format!("p{round}")))
            .await
            .expect("get")
            .expect("present");
        assert_eq!(
            stored.owner,
            Some(host(&format!("h{}", winners[0]))),
            "the stored row is the winner's"
        );
    }
}

async fn replace_is_compare_and_swap_with_current_row(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let v1 = must_create(
        store.as_ref(),
        &Lease::new(key("g", "0"), Position::Beginning),
    )
    .await;
    let v2 = store
        .replace(&owned(v1.clone(), "a"), v1.version)
        .await
        .expect("replace at the current version succeeds");
    assert_eq!(v2.version, v1.version.next());
    assert_eq!(v2.owner, Some(host("a")));
    match store.replace(&owned(v1.clone(), "b"), v1.version).await {
        Err(LeaseError::Conflict {
            key: k,
            expected,
            current,
        }) => {
            assert_eq!(k, "g/0", "the conflict names the lease key");
            assert_eq!(expected, v1.version);
            assert_eq!(*current, v2, "the conflict carries the current row");
        }
        other => panic!("a stale replace must be a Conflict, got {other:?}"),
    }
    let now = store.get(&v1.key).await.expect("get").expect("present");
    assert_eq!(now.owner, Some(host("a")), "a lost CAS changes nothing");
}

async fn version_strictly_increases(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let mut lease = must_create(store.as_ref(), &Lease::new(key("g", "v"), Position::Now)).await;
    for i in 0..20 {
        let mut next = lease.clone();
        next.continuation = Some(Continuation::new(format!("c{i}")));
        next.version = Version(999_999); // ignored by the store
        let stored = store.replace(&next, lease.version).await.expect("replace");
        assert!(stored.version > lease.version, "versions strictly increase");
        assert_eq!(stored.version, lease.version.next());
        lease = stored;
    }
}

async fn replace_of_missing_lease_is_not_found(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let lease = Lease::new(key("g", "ghost"), Position::Beginning);
    match store.replace(&lease, Version::FIRST).await {
        Err(LeaseError::NotFound { key }) => assert_eq!(key, "g/ghost"),
        other => panic!("replace of a missing lease must be NotFound, got {other:?}"),
    }
    match store.delete(&lease.key, Version::FIRST).await {
        Err(LeaseError::NotFound { key }) => assert_eq!(key, "g/ghost"),
        other => panic!("delete of a missing lease must be NotFound, got {other:?}"),
    }
}

async fn delete_with_stale_version_is_refused(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let v1 = must_create(
        store.as_ref(),
        &Lease::new(key("g", "d"), Position::Beginning),
    )
    .await;
    let v2 = store
        .replace(&owned(v1.clone(), "a"), v1.version)
        .await
        .expect("replace");
    match store.delete(&v1.key, v1.version).await {
        Err(LeaseError::Conflict { current, .. }) => assert_eq!(*current, v2),
        other => panic!("a stale delete must be a Conflict, got {other:?}"),
    }
    assert!(
        store.get(&v1.key).await.expect("get").is_some(),
        "still there"
    );
    store
        .delete(&v1.key, v2.version)
        .await
        .expect("delete at the current version");
    assert!(store.get(&v1.key).await.expect("get").is_none(), "gone");
    assert!(
        store
            .create(&Lease::new(v1.key.clone(), Position::Beginning))
            .await
            .expect("create")
            .is_some(),
        "a deleted key can be created again"
    );
}

async fn groups_are_isolated(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    must_create(
        store.as_ref(),
        &Lease::new(key("alpha", "0"), Position::Beginning),
    )
    .await;
    must_create(
        store.as_ref(),
        &Lease::new(key("alpha", "1"), Position::Beginning),
    )
    .await;
    must_create(
        store.as_ref(),
        &Lease::new(key("alphabet", "0"), Position::Beginning),
    )
    .await;
    // The same partition id in another group is another lease.
    must_create(
        store.as_ref(),
        &Lease::new(key("beta", "0"), Position::Beginning),
    )
    .await;
    let alpha = store.list(&group("alpha")).await.expect("list");
    assert_eq!(
        alpha.leases.len(),
        2,
        "alpha sees only its own leases (not alphabet's)"
    );
    assert!(alpha.leases.iter().all(|l| l.key.group == group("alpha")));
    let beta = store.list(&group("beta")).await.expect("list");
    assert_eq!(beta.leases.len(), 1);
    let before = store
        .membership(&group("beta"))
        .await
        .expect("membership")
        .change_counter;
    store
        .heartbeat(&group("alpha"), &host("h"), "inc", Timestamp(1), None)
        .await
        .expect("heartbeat");
    let l = store
        .get(&key("alpha", "0"))
        .await
        .expect("get")
        .expect("present");
    store
        .replace(&owned(l.clone(), "h"), l.version)
        .await
        .expect("take");
    let beta_m = store.membership(&group("beta")).await.expect("membership");
    assert!(beta_m.hosts.is_empty(), "beta sees no alpha heartbeats");
    assert_eq!(
        beta_m.change_counter, before,
        "alpha's changes do not move beta's counter"
    );
    let alpha_m = store.membership(&group("alpha")).await.expect("membership");
    assert_eq!(alpha_m.hosts.len(), 1);
    assert!(store
        .list(&group("gamma"))
        .await
        .expect("list")
        .leases
        .is_empty());
}

async fn fields_and_properties_round_trip(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let cases: Vec<BTreeMap<String, String>> = vec![
        BTreeMap::new(),
        [("weight".to_string(), "3".to_string())].into(),
        [
            ("région".to_string(), "東京 🚀".to_string()),
            ("empty".to_string(), String::new()),
            ("quote\"s".to_string(), "back\\slash\nnewline".to_string()),
        ]
        .into(),
    ];
    let starts = [
        Position::Beginning,
        Position::Now,
        Position::AtTime(Timestamp(1_700_000_000_123)),
        Position::Continuation(Continuation::new(
            "49590338271490256608559692538361571095921575989136588898",
        )),
    ];
    for (i, props) in cases.iter().enumerate() {
        for (j, start) in starts.iter().enumerate() {
            let mut lease = Lease::new(key("rt", &format!("p{i}-{j}")), start.clone());
            lease.properties = props.clone();
            lease.parents = vec![
                PartitionId::new("shardId-000000000001").expect("valid"),
                PartitionId::new("ünï").expect("valid"),
            ];
            let created = must_create(store.as_ref(), &lease).await;
            let mut expected = lease.clone();
            expected.version = Version::FIRST;
            assert_eq!(created, expected, "create returns the row as stored");
            let got = store.get(&lease.key).await.expect("get").expect("present");
            assert_eq!(got, expected, "every field round-trips");
            // Owned with a next owner and a continuation, too.
            let mut full = owned(got.clone(), "host-ä");
            full.next_owner = Some(host("host-b"));
            full.continuation = Some(Continuation::new("tok:{\"x\": 1}"));
            let stored = store.replace(&full, got.version).await.expect("replace");
            let mut expected = full.clone();
            expected.version = got.version.next();
            assert_eq!(stored, expected);
            assert_eq!(store.get(&lease.key).await.expect("get"), Some(expected));
        }
    }
    let listed = store.list(&group("rt")).await.expect("list");
    assert_eq!(listed.leases.len(), cases.len() * starts.len());
    assert!(listed.malformed.is_empty());
    let ids: Vec<_> = listed
        .leases
        .iter()
        .map(|l| l.key.partition.clone())
        .collect();
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(ids, sorted, "list is ordered by partition id");
}

async fn change_counter_moves_on_ownership_changes_only(f: &dyn LeaseStoreFixture) {
    // Design, "The lease store seam": ownership writes bump the counter, checkpoints do not.
    let store = f.connect().await;
    let g = group("cc");
    let counter = |s: Arc<dyn LeaseStore>| {
        let g = g.clone();
        async move { s.membership(&g).await.expect("membership").change_counter }
    };
    let c0 = counter(store.clone()).await;
    let l = must_create(
        store.as_ref(),
        &Lease::new(key("cc", "0"), Position::Beginning),
    )
    .await;
    let c1 = counter(store.clone()).await;
    assert!(c1 > c0, "create moves the counter");
    let l = store
        .replace(&owned(l.clone(), "a"), l.version)
        .await
        .expect("take");
    let c2 = counter(store.clone()).await;
    assert!(c2 > c1, "take moves the counter");
    let mut cp = l.clone();
    cp.continuation = Some(Continuation::new("5"));
    let l = store.replace(&cp, l.version).await.expect("checkpoint");
    let mut props = l.clone();
    props.properties.insert("k".into(), "v".into());
    let l = store.replace(&props, l.version).await.expect("properties");
    assert_eq!(
        counter(store.clone()).await,
        c2,
        "checkpoints and properties do not move it"
    );
    let hb = store
        .heartbeat(&g, &host("a"), "i", Timestamp(0), None)
        .await
        .expect("heartbeat");
    store
        .heartbeat(&g, &host("a"), "i", Timestamp(1), Some(hb.version))
        .await
        .expect("heartbeat");
    assert_eq!(
        counter(store.clone()).await,
        c2,
        "heartbeats do not move it"
    );
    let mut req = l.clone();
    req.next_owner = Some(host("b"));
    let l = store
        .replace(&req, l.version)
        .await
        .expect("hand-off request");
    let c3 = counter(store.clone()).await;
    assert!(c3 > c2, "a hand-off request moves the counter");
    let mut handed = l.clone();
    handed.owner = Some(host("b"));
    handed.next_owner = None;
    let l = store.replace(&handed, l.version).await.expect("hand-off");
    let c4 = counter(store.clone()).await;
    assert!(c4 > c3, "a hand-off moves the counter");
    let mut released = l.clone();
    released.state = LeaseState::Available;
    released.owner = None;
    let l = store.replace(&released, l.version).await.expect("release");
    let c5 = counter(store.clone()).await;
    assert!(c5 > c4, "a release moves the counter");
    let mut finished = l.clone();
    finished.state = LeaseState::Finished;
    let l = store.replace(&finished, l.version).await.expect("finish");
    let c6 = counter(store.clone()).await;
    assert!(c6 > c5, "finishing moves the counter");
    store.delete(&l.key, l.version).await.expect("delete");
    assert!(
        counter(store.clone()).await > c6,
        "delete moves the counter"
    );
    // A conflicting write moves nothing.
    let l = must_create(
        store.as_ref(),
        &Lease::new(key("cc", "1"), Position::Beginning),
    )
    .await;
    let c7 = counter(store.clone()).await;
    let _ = store.replace(&owned(l.clone(), "x"), Version(77)).await;
    assert_eq!(
        counter(store.clone()).await,
        c7,
        "a failed CAS does not move it"
    );
}

async fn racing_replacers_one_wins_per_version(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let l = must_create(
        store.as_ref(),
        &Lease::new(key("cas", "0"), Position::Beginning),
    )
    .await;
    let mut handles = Vec::new();
    for i in 0..8 {
        let s = f.connect().await;
        let lease = owned(l.clone(), &format!("h{i}"));
        handles.push(tokio::spawn(async move {
            s.replace(&lease, lease.version).await
        }));
    }
    let mut wins = 0;
    for h in handles {
        match h.await.expect("task") {
            Ok(_) => wins += 1,
            Err(LeaseError::Conflict { .. }) => {}
            Err(e) => panic!("racing replace failed with a non-conflict error: {e}"),
        }
    }
    assert_eq!(wins, 1, "exactly one of 8 racing CAS writes wins");
    let now = store.get(&l.key).await.expect("get").expect("present");
    assert_eq!(now.version, l.version.next());
}

async fn heartbeats_are_compare_and_swap(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let g = group("hb");
    let a = host("a");
    let first = store
        .heartbeat(&g, &a, "inc-1", Timestamp(10), None)
        .await
        .expect("create");
    assert_eq!(first.version, Version::FIRST);
    assert_eq!(&*first.incarnation, "inc-1");
    // A second process with the same name sees the row and is refused.
    match store.heartbeat(&g, &a, "inc-2", Timestamp(11), None).await {
        Err(LeaseError::HeartbeatConflict { host, current, .. }) => {
            assert_eq!(host, "a");
            assert_eq!(
                current.map(|c| c.incarnation.to_string()),
                Some("inc-1".to_string())
            );
        }
        other => panic!("creating an existing heartbeat must conflict, got {other:?}"),
    }
    let second = store
        .heartbeat(&g, &a, "inc-1", Timestamp(12), Some(first.version))
        .await
        .expect("renew");
    assert_eq!(second.version, first.version.next());
    assert_eq!(second.written_at, Timestamp(12));
    assert!(
        matches!(
            store
                .heartbeat(&g, &a, "inc-1", Timestamp(13), Some(first.version))
                .await,
            Err(LeaseError::HeartbeatConflict { .. })
        ),
        "a stale renew conflicts"
    );
    store
        .heartbeat(&g, &host("b"), "inc-b", Timestamp(1), None)
        .await
        .expect("b");
    let m = store.membership(&g).await.expect("membership");
    let names: Vec<_> = m.hosts.iter().map(|h| h.host.to_string()).collect();
    assert_eq!(
        names,
        ["a", "b"],
        "membership lists every host, ordered by name"
    );
    assert!(
        matches!(
            store.remove_heartbeat(&g, &a, "inc-1", first.version).await,
            Err(LeaseError::HeartbeatConflict { .. })
        ),
        "a stale remove conflicts"
    );
    assert!(
        matches!(
            store
                .remove_heartbeat(&g, &a, "inc-0", second.version)
                .await,
            Err(LeaseError::HeartbeatConflict { .. })
        ),
        "a remove naming another incarnation conflicts, even at the current version (a host \
         that registered again restarts its versions)"
    );
    store
        .remove_heartbeat(&g, &a, "inc-1", second.version)
        .await
        .expect("remove");
    store
        .remove_heartbeat(&g, &a, "inc-1", second.version)
        .await
        .expect("removing twice is fine");
    let m = store.membership(&g).await.expect("membership");
    assert_eq!(m.hosts.len(), 1);
    match store
        .heartbeat(&g, &a, "inc-1", Timestamp(14), Some(second.version))
        .await
    {
        Err(LeaseError::HeartbeatConflict { current: None, .. }) => {}
        other => panic!("renewing a removed heartbeat must conflict with no row, got {other:?}"),
    }
    // After removal, a restart creates it anew.
    store
        .heartbeat(&g, &a, "inc-3", Timestamp(15), None)
        .await
        .expect("re-create");
}

async fn malformed_rows_are_named_and_others_still_list(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    for p in ["0", "1", "2", "3"] {
        must_create(
            store.as_ref(),
            &Lease::new(key("bad", p), Position::Beginning),
        )
        .await;
    }
    f.corrupt(&key("bad", "1"), Corruption::BadPropertiesJson)
        .await;
    f.corrupt(&key("bad", "3"), Corruption::UnknownState).await;
    let listing = store
        .list(&group("bad"))
        .await
        .expect("list succeeds despite bad rows");
    let good: Vec<_> = listing
        .leases
        .iter()
        .map(|l| l.key.partition.to_string())
        .collect();
    assert_eq!(good, ["0", "2"], "the readable rows still list");
    assert_eq!(
        listing.malformed.len(),
        2,
        "each bad row is reported: {:?}",
        listing.malformed
    );
    for (err, k) in listing.malformed.iter().zip(["bad/1", "bad/3"]) {
        match err {
            LeaseError::Malformed { key, .. } => assert_eq!(key, k),
            other => panic!("expected Malformed, got {other:?}"),
        }
        assert!(
            err.to_string().contains(k),
            "the message names the key: {err}"
        );
    }
    match store.get(&key("bad", "1")).await {
        Err(LeaseError::Malformed { key, .. }) => assert_eq!(key, "bad/1"),
        other => panic!("get of a malformed row must be Malformed, got {other:?}"),
    }
}

async fn invalid_leases_are_refused(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let mut bad = Lease::new(key("inv", "0"), Position::Beginning);
    bad.state = LeaseState::Owned; // no owner
    match store.create(&bad).await {
        Err(LeaseError::Invalid(e)) => assert!(e.to_string().contains("inv/0"), "{e}"),
        other => panic!("an inconsistent lease must be refused, got {other:?}"),
    }
    let good = must_create(
        store.as_ref(),
        &Lease::new(key("inv", "0"), Position::Beginning),
    )
    .await;
    assert!(matches!(
        store.replace(&bad, good.version).await,
        Err(LeaseError::Invalid(_))
    ));
}

async fn ten_thousand_leases_list(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let n = 10_000;
    let mut handles = Vec::new();
    for chunk in 0..4 {
        let s = f.connect().await;
        handles.push(tokio::spawn(async move {
            for i in (chunk..n).step_by(4) {
                let mut lease = Lease::new(key("big", &format!("{i:05}")), Position::Beginning);
                if i % 3 == 0 {
                    lease = owned(lease, &format!("h{}", i % 10));
                }
                s.create(&lease).await.expect("create").expect("new");
            }
        }));
    }
    for h in handles {
        h.await.expect("creator task");
    }
    let listing = store.list(&group("big")).await.expect("list");
    assert_eq!(listing.leases.len(), n);
    assert!(listing.malformed.is_empty());
    for (i, lease) in listing.leases.iter().enumerate() {
        assert_eq!(lease.key.partition.as_str(), format!("{i:05}"));
        assert_eq!(lease.owner.is_some(), i % 3 == 0);
    }
}

/// For a store that answers [`LeaseStore::list_changes`]: it returns exactly the leases
/// created or changing hands after the counter asked about (not those only checkpointed), the
/// keys deleted, and a counter matching the membership's; and `None` for a counter it has not
/// reached. A store that answers `None` passes (the processor then lists in full).
async fn changes_since_a_counter_hold_what_changed_hands(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let g = group("changes");
    let mut rows = Vec::new();
    for p in ["a", "b", "c", "d"] {
        rows.push(
            must_create(
                store.as_ref(),
                &Lease::new(key("changes", p), Position::Beginning),
            )
            .await,
        );
    }
    let since = store
        .membership(&g)
        .await
        .expect("membership")
        .change_counter;
    let Some(none_yet) = store.list_changes(&g, since).await.expect("list_changes") else {
        assert!(
            !f.answers_changes(),
            "the fixture says the store answers list_changes, but it answered None at its \
             current counter {since}"
        );
        return;
    };
    assert!(
        none_yet.leases.is_empty() && none_yet.deleted.is_empty(),
        "nothing changed after {since}: {none_yet:?}"
    );
    assert_eq!(none_yet.counter, since);
    // b changes hands; c only moves its checkpoint; d is deleted; e is created.
    let b = store
        .replace(&owned(rows[1].clone(), "h1"), rows[1].version)
        .await
        .expect("take b");
    let mut c = rows[2].clone();
    c.continuation = Some(Continuation::new("c-1"));
    store.replace(&c, c.version).await.expect("checkpoint c");
    store
        .delete(&rows[3].key, rows[3].version)
        .await
        .expect("delete d");
    let e = must_create(
        store.as_ref(),
        &Lease::new(key("changes", "e"), Position::Beginning),
    )
    .await;
    let now = store
        .membership(&g)
        .await
        .expect("membership")
        .change_counter;
    let changes = store
        .list_changes(&g, since)
        .await
        .expect("list_changes")
        .expect("a store that answered once answers again");
    assert_eq!(changes.counter, now, "the counter as of the read");
    let got: Vec<(String, Version)> = changes
        .leases
        .iter()
        .map(|l| (l.key.partition.to_string(), l.version))
        .collect();
    assert_eq!(
        got,
        vec![("b".to_string(), b.version), ("e".to_string(), e.version)],
        "changed hands or created, in partition order, at their current version"
    );
    assert_eq!(changes.deleted, vec![rows[3].key.clone()]);
    assert!(changes.malformed.is_empty());
    let later = store.list_changes(&g, now).await.expect("list_changes");
    assert!(later.is_some_and(|c| c.leases.is_empty() && c.deleted.is_empty()));
    // A lease deleted and created again restarts its versions: a reader holding the old row
    // must see the deletion too, or it would keep its higher-versioned stale copy.
    store.delete(&b.key, b.version).await.expect("delete b");
    let b_again = must_create(
        store.as_ref(),
        &Lease::new(key("changes", "b"), Position::Beginning),
    )
    .await;
    let both = store
        .list_changes(&g, now)
        .await
        .expect("list_changes")
        .expect("answers");
    assert_eq!(both.deleted, vec![b.key.clone()], "{both:?}");
    let got: Vec<(String, Version)> = both
        .leases
        .iter()
        .map(|l| (l.key.partition.to_string(), l.version))
        .collect();
    assert_eq!(got, vec![("b".to_string(), b_again.version)]);
    let now = store
        .membership(&g)
        .await
        .expect("membership")
        .change_counter;
    assert!(
        store
            .list_changes(&g, now + 1000)
            .await
            .expect("list_changes")
            .is_none(),
        "a counter the store has not reached cannot be answered"
    );
    assert!(
        store
            .list_changes(&group("changes-never-written"), 5)
            .await
            .expect("list_changes")
            .is_none(),
        "a group never written to is at counter 0"
    );
}
