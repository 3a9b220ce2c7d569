//! The lease store conformance suite.

use crate::lease::HeartbeatRole;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::view::{
    a_view_of_ten_thousand_hosts_round_trips, head_of_an_empty_group_is_counter_zero_and_no_view,
    lead_heartbeat_copies_only_for_the_leaders_incarnation,
    view_is_compare_and_swap_and_leaves_the_counter,
};
use crate::error::LeaseError;
use crate::lease::{Changes, LeaseStore};
use crate::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
    Timestamp, Version,
};

mod fixture;
mod report;

use report::heartbeat_reports_round_trip;

pub use fixture::{Corruption, LeaseStoreFixture};

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
        unreadable_changed_rows_are_named_and_never_hide_the_others,
        changes_made_on_one_connection_are_read_on_another_in_one_snapshot,
        deletions_are_kept_for_the_horizon_then_forgotten,
        an_incremental_reader_of_racing_writers_agrees_with_a_full_list,
        head_of_an_empty_group_is_counter_zero_and_no_view,
        view_is_compare_and_swap_and_leaves_the_counter,
        lead_heartbeat_copies_only_for_the_leaders_incarnation,
        a_view_of_ten_thousand_hosts_round_trips,
        heartbeat_reports_round_trip,
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
        .heartbeat(
            &group("alpha"),
            &host("h"),
            "inc",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
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
        .heartbeat(
            &g,
            &host("a"),
            "i",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("heartbeat");
    store
        .heartbeat(
            &g,
            &host("a"),
            "i",
            Timestamp(1),
            Some(hb.version),
            HeartbeatRole::Member,
            None,
        )
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
        .heartbeat(
            &g,
            &a,
            "inc-1",
            Timestamp(10),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("create");
    assert_eq!(first.version, Version::FIRST);
    assert_eq!(&*first.incarnation, "inc-1");
    // A second process with the same name sees the row and is refused.
    match store
        .heartbeat(
            &g,
            &a,
            "inc-2",
            Timestamp(11),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
    {
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
        .heartbeat(
            &g,
            &a,
            "inc-1",
            Timestamp(12),
            Some(first.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("renew");
    assert_eq!(second.version, first.version.next());
    assert_eq!(second.written_at, Timestamp(12));
    assert!(
        matches!(
            store
                .heartbeat(
                    &g,
                    &a,
                    "inc-1",
                    Timestamp(13),
                    Some(first.version),
                    HeartbeatRole::Member,
                    None,
                )
                .await,
            Err(LeaseError::HeartbeatConflict { .. })
        ),
        "a stale renew conflicts"
    );
    store
        .heartbeat(
            &g,
            &host("b"),
            "inc-b",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
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
        .heartbeat(
            &g,
            &a,
            "inc-1",
            Timestamp(14),
            Some(second.version),
            HeartbeatRole::Member,
            None,
        )
        .await
    {
        Err(LeaseError::HeartbeatConflict { current: None, .. }) => {}
        other => panic!("renewing a removed heartbeat must conflict with no row, got {other:?}"),
    }
    // After removal, a restart creates it anew.
    store
        .heartbeat(
            &g,
            &a,
            "inc-3",
            Timestamp(15),
            None,
            HeartbeatRole::Member,
            None,
        )
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
    let n = f.leases_at_scale().max(1);
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

// ---- list_changes -------------------------------------------------------------------------
//
// Every check below first asks the store for the changes at its current counter. A store that
// answers `None` there passes it vacuously, unless its fixture says it answers (then it fails).

async fn counter(store: &dyn LeaseStore, g: &GroupName) -> u64 {
    store
        .membership(g)
        .await
        .expect("membership")
        .change_counter
}

/// Whether the store answers `list_changes` for `g`; `false` only when the fixture does not
/// say it does.
async fn answers(f: &dyn LeaseStoreFixture, store: &dyn LeaseStore, g: &GroupName) -> bool {
    let now = counter(store, g).await;
    let answer = store.list_changes(g, now).await.expect("list_changes");
    assert!(
        answer.is_some() || !f.answers_changes(),
        "the fixture says the store answers list_changes, but it answered None for group {g} \
         at its current counter {now}"
    );
    answer.is_some()
}

async fn answered(store: &dyn LeaseStore, g: &GroupName, since: u64) -> Changes {
    store
        .list_changes(g, since)
        .await
        .expect("list_changes")
        .unwrap_or_else(|| panic!("list_changes({g}, {since}) must answer, got None"))
}

async fn unanswered(store: &dyn LeaseStore, g: &GroupName, since: u64) {
    let got = store.list_changes(g, since).await.expect("list_changes");
    assert!(
        got.is_none(),
        "list_changes({g}, {since}) must be None: {got:?}"
    );
}

/// A changed lease as (partition, version, owner).
type Row = (String, u64, Option<String>);

/// The changed leases and the deleted partitions of an answer with no malformed row.
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

async fn take(store: &dyn LeaseStore, lease: &Lease, by: &str) -> Lease {
    let mut next = owned(lease.clone(), by);
    next.next_owner = None;
    store
        .replace(&next, lease.version)
        .await
        .unwrap_or_else(|e| panic!("take {} by {by}: {e}", lease.key))
}

async fn checkpoint(store: &dyn LeaseStore, lease: &Lease, at: &str) -> Lease {
    let mut next = lease.clone();
    next.continuation = Some(Continuation::new(at));
    store
        .replace(&next, lease.version)
        .await
        .unwrap_or_else(|e| panic!("checkpoint {}: {e}", lease.key))
}

/// For a store that answers [`LeaseStore::list_changes`]: it returns exactly the leases
/// created or changing hands (state, owner, next owner) after the counter asked about, at
/// their current rows and in partition order, not those only checkpointed; the keys deleted;
/// a counter matching the membership's; and `None` for a counter it has not reached.
async fn changes_since_a_counter_hold_what_changed_hands(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let store = store.as_ref();
    let g = group("changes");
    if !answers(f, store, &g).await {
        return;
    }
    // A group nothing was ever written to is at counter 0, and has not reached 1.
    let empty = answered(store, &g, 0).await;
    assert_eq!((empty.counter, summary(&empty)), (0, (vec![], vec![])));
    unanswered(store, &g, 1).await;

    // Each creation moves the counter once; answers are in partition order.
    let mut rows = BTreeMap::new();
    for p in ["f", "a", "e", "b", "d", "c"] {
        let lease = Lease::new(key("changes", p), Position::Beginning);
        rows.insert(p, must_create(store, &lease).await);
    }
    let all = answered(store, &g, 0).await;
    assert_eq!(all.counter, 6, "one counter move per creation");
    let created: Vec<Row> = ["a", "b", "c", "d", "e", "f"]
        .iter()
        .map(|p| row(p, 1, None))
        .collect();
    assert_eq!(summary(&all), (created, vec![]));
    assert_eq!(
        summary(&answered(store, &g, 3).await),
        (
            vec![row("b", 1, None), row("c", 1, None), row("d", 1, None)],
            vec![]
        ),
        "only the creations after the third"
    );

    // c and e change hands before the counter asked about.
    let c = take(store, &rows["c"], "h0").await;
    let e = take(store, &rows["e"], "h0").await;
    let since = counter(store, &g).await;
    // a changes hands, then only checkpoints: listed once, as it is now.
    let a = take(store, &rows["a"], "h1").await;
    let after_a = counter(store, &g).await;
    let a = checkpoint(store, &a, "a-1").await;
    // b only checkpoints and gains a property: not listed.
    let mut b = rows["b"].clone();
    b.continuation = Some(Continuation::new("b-9"));
    b.properties.insert("note".into(), "x".into());
    store.replace(&b, b.version).await.expect("checkpoint b");
    // c is asked to hand off (its next owner changes): listed.
    let mut asked = c.clone();
    asked.next_owner = Some(host("h2"));
    let c = store.replace(&asked, c.version).await.expect("ask for c");
    // d is deleted: deleted only.
    store
        .delete(&rows["d"].key, rows["d"].version)
        .await
        .expect("delete d");
    // e, at version 2, is deleted and created again at version 1: in both lists, so a reader
    // applying deletions first drops the higher-versioned row it holds for the new one.
    store.delete(&e.key, e.version).await.expect("delete e");
    let e = must_create(store, &Lease::new(e.key.clone(), Position::Beginning)).await;
    // g is created and deleted: deleted only. h is created.
    let g_row = must_create(store, &Lease::new(key("changes", "g"), Position::Beginning)).await;
    store
        .delete(&g_row.key, g_row.version)
        .await
        .expect("delete g");
    let h = must_create(store, &Lease::new(key("changes", "h"), Position::Beginning)).await;
    // Another group's changes stay there.
    must_create(
        store,
        &Lease::new(key("changes-other", "a"), Position::Beginning),
    )
    .await;

    let now = counter(store, &g).await;
    assert_eq!(
        now,
        since + 8,
        "a take, a hand-off request, three deletions and three creations move the counter once \
         each; checkpoints and properties do not"
    );
    let changes = answered(store, &g, since).await;
    assert_eq!(changes.counter, now, "the counter as of the read");
    assert!(changes.malformed.is_empty(), "{:?}", changes.malformed);
    assert_eq!(
        plain(&changes.leases),
        vec![a, c, e.clone(), h.clone()],
        "the current rows (checkpoint and next owner included) of what was created or changed \
         hands, in partition order"
    );
    assert_eq!(summary(&changes).1, names(&["d", "e", "g"]));
    // Only what came after the value asked about.
    let later = answered(store, &g, after_a).await;
    assert_eq!(
        summary(&later),
        (
            vec![
                row("c", 3, Some("h0")),
                row("e", 1, None),
                row("h", 1, None)
            ],
            names(&["d", "e", "g"])
        )
    );
    assert_eq!(
        summary(&answered(store, &g, now - 1).await),
        (vec![row("h", 1, None)], vec![])
    );
    let nothing = answered(store, &g, now).await;
    assert_eq!(
        (nothing.counter, summary(&nothing)),
        (now, (vec![], vec![]))
    );
    for ahead in [now + 1, now + 1000, u64::MAX] {
        // A counter the store has not reached cannot be answered.
        unanswered(store, &g, ahead).await;
    }
    // Groups are isolated; a group never written to is at counter 0.
    let other = answered(store, &group("changes-other"), 0).await;
    assert_eq!(summary(&other), (vec![row("a", 1, None)], vec![]));
    let never = group("changes-never-written");
    let none = answered(store, &never, 0).await;
    assert_eq!((none.counter, summary(&none)), (0, (vec![], vec![])));
    unanswered(store, &never, 5).await;
}

/// An unreadable row that changed hands is reported by key in [`Changes::malformed`] and hides
/// neither the readable rows nor the deletions; an unreadable row that did not change is not
/// in the answer (a full list reports it).
async fn unreadable_changed_rows_are_named_and_never_hide_the_others(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let store = store.as_ref();
    let g = group("bad-changes");
    if !answers(f, store, &g).await {
        return;
    }
    let mut rows = Vec::new();
    for p in ["a", "b", "c", "d"] {
        let lease = Lease::new(key("bad-changes", p), Position::Beginning);
        rows.push(must_create(store, &lease).await);
    }
    let since = counter(store, &g).await;
    take(store, &rows[0], "h1").await;
    take(store, &rows[1], "h1").await;
    store
        .delete(&rows[2].key, rows[2].version)
        .await
        .expect("delete c");
    // b changed hands and is then broken by hand; d is broken but did not change.
    f.corrupt(&key("bad-changes", "b"), Corruption::BadPropertiesJson)
        .await;
    f.corrupt(&key("bad-changes", "d"), Corruption::UnknownState)
        .await;
    let changes = answered(store, &g, since).await;
    let readable: Vec<String> = changes
        .leases
        .iter()
        .map(|l| l.key.partition.to_string())
        .collect();
    assert_eq!(readable, ["a"], "the readable row is still there");
    let deleted: Vec<String> = changes.deleted.iter().map(|k| k.to_string()).collect();
    assert_eq!(deleted, ["bad-changes/c"], "the deletion is still there");
    assert_eq!(changes.malformed.len(), 1, "{:?}", changes.malformed);
    match &changes.malformed[0] {
        LeaseError::Malformed { key, reason } => {
            assert_eq!(key, "bad-changes/b");
            assert!(
                reason.to_lowercase().contains("properties"),
                "the reason names what is wrong: {reason}"
            );
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    let listing = store.list(&g).await.expect("list");
    assert_eq!(
        listing.malformed.len(),
        2,
        "a full list names both broken rows: {:?}",
        listing.malformed
    );
}

/// Changes written through one connection are answered on another, each answer one snapshot:
/// while one connection hands a lease from host to host, every answer read on another holds
/// the row written by the hand-over its counter counts.
async fn changes_made_on_one_connection_are_read_on_another_in_one_snapshot(
    f: &dyn LeaseStoreFixture,
) {
    let (one, two) = (f.connect().await, f.connect().await);
    let g = group("snap");
    if !answers(f, one.as_ref(), &g).await {
        return;
    }
    let mut rows = Vec::new();
    for p in ["0", "1", "2", "3"] {
        let lease = Lease::new(key("snap", p), Position::Beginning);
        rows.push(must_create(one.as_ref(), &lease).await);
    }
    let seen = answered(two.as_ref(), &g, 0).await;
    assert_eq!(seen.counter, 4);
    assert_eq!(plain(&seen.leases), rows, "created on one, read on two");
    let taken = take(one.as_ref(), &rows[1], "h1").await;
    let seen = answered(two.as_ref(), &g, 4).await;
    assert_eq!((seen.counter, plain(&seen.leases)), (5, vec![taken]));
    let taken = take(two.as_ref(), &rows[2], "h2").await;
    two.delete(&rows[3].key, rows[3].version)
        .await
        .expect("delete 3");
    let seen = answered(one.as_ref(), &g, 5).await;
    assert_eq!(seen.counter, 7);
    assert_eq!(seen.counter, counter(two.as_ref(), &g).await);
    assert_eq!(
        plain(&seen.leases),
        vec![taken],
        "changed on two, read on one"
    );
    assert_eq!(seen.deleted, vec![rows[3].key.clone()]);

    // The n-th hand-over moves the counter to base + n and the lease to version n + 1, owned
    // by h{n}: an answer at counter base + n must hold exactly that row. Every 20 hand-overs
    // the writer waits for a read counted after it began the hand-over, so reads interleave
    // with writes on any runtime (the reader always reads once more after the last one).
    const HANDOVERS: u64 = 200;
    let base = counter(one.as_ref(), &g).await;
    let (reads, mut reads_seen) = tokio::sync::watch::channel(0u64);
    let writer = tokio::spawn({
        let one = one.clone();
        let mut lease = rows[0].clone();
        async move {
            for n in 1..=HANDOVERS {
                let before = *reads_seen.borrow_and_update();
                lease = take(one.as_ref(), &lease, &format!("h{n}")).await;
                if n % 20 == 0 {
                    reads_seen
                        .wait_for(|r| *r > before)
                        .await
                        .expect("the reader keeps its end until the writer is done");
                }
            }
        }
    });
    loop {
        let seen = answered(two.as_ref(), &g, base).await;
        reads.send_modify(|r| *r += 1);
        let n = seen.counter - base;
        if n == 0 {
            assert!(seen.leases.is_empty(), "{seen:?}");
        } else {
            assert_eq!(seen.leases.len(), 1, "{seen:?}");
            let lease = &seen.leases[0];
            assert_eq!(lease.owner, Some(host(&format!("h{n}"))), "at counter {n}");
            assert_eq!(lease.version, Version(n + 1), "at counter {n}");
        }
        if n == HANDOVERS {
            break;
        }
        tokio::task::yield_now().await;
    }
    writer.await.expect("writer task");
    assert!(*reads.borrow() >= HANDOVERS / 20);
}

/// Deletion records are bounded: after more deletions in a row than the fixture's horizon,
/// exactly the last that many are answered, a `since` before them is `None` (whichever handle
/// asks), the store holds no more records than that, another group's deletion is neither
/// counted nor forgotten with them, and a key deleted then created again is answered again.
async fn deletions_are_kept_for_the_horizon_then_forgotten(f: &dyn LeaseStoreFixture) {
    let Some(horizon) = f.changes_horizon() else {
        return;
    };
    let (store, reader) = (f.connect().await, f.connect().await);
    let (store, reader) = (store.as_ref(), reader.as_ref());
    let g = group("churn");
    if !answers(f, store, &g).await {
        return;
    }
    // Another group's deletion, before the churn.
    let other_group = group("churn-other");
    let other = must_create(
        store,
        &Lease::new(key("churn-other", "z"), Position::Beginning),
    )
    .await;
    store
        .delete(&other.key, other.version)
        .await
        .expect("delete");

    let n = horizon + 8;
    let name = |i: u64| format!("{i:05}");
    let mut rows = Vec::new();
    for i in 0..n {
        let lease = Lease::new(key("churn", &name(i)), Position::Beginning);
        rows.push(must_create(store, &lease).await);
    }
    let created = counter(store, &g).await;
    assert_eq!(created, n);
    for (i, lease) in (0..).zip(&rows) {
        store
            .delete(&lease.key, lease.version)
            .await
            .expect("delete");
        // Counted at each delete once the records could exceed the bound (every delete for
        // a short horizon, the last few for a long one).
        if i + 1 >= horizon && (horizon <= 256 || i + 10 >= n) {
            if let Some(kept) = f.deletion_records(&g).await {
                assert!(
                    kept <= horizon,
                    "{kept} deletion records after {} deletes, more than the horizon {horizon}",
                    i + 1
                );
            }
        }
    }
    let now = counter(store, &g).await;
    assert_eq!(now, 2 * n);
    if let Some(kept) = f.deletion_records(&g).await {
        assert_eq!(
            kept, horizon,
            "the deletions of the last {horizon} moves are kept, no more"
        );
    }
    // Within the horizon: exactly the keys deleted after the value asked about.
    let oldest = now - horizon;
    let kept = answered(reader, &g, oldest).await;
    let expected: Vec<String> = (n - horizon..n).map(name).collect();
    assert_eq!(summary(&kept), (vec![], expected));
    assert_eq!(
        summary(&answered(reader, &g, now - 1).await),
        (vec![], vec![name(n - 1)])
    );
    // Behind it: not answered, whichever handle asks.
    for since in [0, 1, created, oldest - 1] {
        unanswered(reader, &g, since).await;
        unanswered(store, &g, since).await;
    }
    // Creations are answered as ever: a key deleted then created again lists again.
    let back = must_create(
        store,
        &Lease::new(key("churn", &name(5)), Position::Beginning),
    )
    .await;
    assert_eq!(
        summary(&answered(reader, &g, now).await),
        (vec![row(&name(5), back.version.0, None)], vec![])
    );
    // The other group's deletion was neither forgotten nor counted with these.
    assert_eq!(
        summary(&answered(reader, &other_group, 1).await),
        (vec![], names(&["z"]))
    );
    if let Some(kept) = f.deletion_records(&other_group).await {
        assert_eq!(kept, 1, "the other group's deletion record is kept");
    }
}

/// A small deterministic generator, so the racing check needs no RNG passed in.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One racing write on a random partition of group `race`: create it if absent, else take,
/// ask for, release or (rarely) delete it. Returns whether it moved the counter; losing a race
/// (conflict, gone) is expected and moves nothing.
async fn random_write(store: &dyn LeaseStore, me: &HostName, rng: &mut XorShift) -> bool {
    let k = key("race", &format!("{:02}", rng.below(16)));
    let current = match store.get(&k).await.expect("get") {
        None => {
            return store
                .create(&Lease::new(k, Position::Beginning))
                .await
                .expect("create")
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

/// Applies `changes` to `copy` as a host does: deletions first, then the current rows.
/// Listed rows as plain leases, to compare with the rows a test wrote.
fn plain(rows: &[Arc<Lease>]) -> Vec<Lease> {
    rows.iter().map(|l| Lease::clone(l)).collect()
}

fn apply(copy: &mut BTreeMap<PartitionId, Lease>, changes: Changes) {
    assert!(changes.malformed.is_empty(), "{:?}", changes.malformed);
    for k in changes.deleted {
        copy.remove(&k.partition);
    }
    for lease in changes.leases {
        copy.insert(lease.key.partition.clone(), Arc::unwrap_or_clone(lease));
    }
}

/// Four writers, each on its own connection, create, take, ask for, release and delete 16
/// leases as fast as they can, while a reader on another connection keeps a copy of the group
/// from `list_changes` alone. Every answer must be consistent with its counter: at the end the
/// copy equals a full list, field for field (versions included). The writers stay within 32
/// counter moves of the reader, so a short horizon never forgets what it has not read.
async fn an_incremental_reader_of_racing_writers_agrees_with_a_full_list(
    f: &dyn LeaseStoreFixture,
) {
    const LAG: u64 = 32;
    let reader = f.connect().await;
    let g = group("race");
    if !answers(f, reader.as_ref(), &g).await {
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    // The counter the reader has caught up with.
    let (caught_up, watch) = tokio::sync::watch::channel(0u64);
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let store = f.connect().await;
        let (stop, written, mut watch) = (stop.clone(), written.clone(), watch.clone());
        writers.push(tokio::spawn(async move {
            let me = host(&format!("w{w}"));
            let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ (w + 1).wrapping_mul(0x2545_F491));
            while !stop.load(Ordering::SeqCst) {
                let lag_ok =
                    |read: &u64| written.load(Ordering::SeqCst) <= read.saturating_add(LAG);
                if !lag_ok(&watch.borrow()) {
                    // Woken by the reader's progress, or by its last send when it stops.
                    let _ = watch.changed().await;
                    continue;
                }
                if random_write(store.as_ref(), &me, &mut rng).await {
                    written.fetch_add(1, Ordering::SeqCst);
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    let mut copy = BTreeMap::new();
    let (mut last, mut reads, mut nonempty) = (0u64, 0u32, 0u32);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while written.load(Ordering::SeqCst) < 200 || nonempty < 20 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the race never got going: {} writes, {reads} reads ({nonempty} with changes) in \
             60 s",
            written.load(Ordering::SeqCst)
        );
        let changes = answered(reader.as_ref(), &g, last).await;
        assert!(changes.counter >= last, "the counter went back");
        if !changes.leases.is_empty() || !changes.deleted.is_empty() {
            nonempty += 1;
        }
        last = changes.counter;
        apply(&mut copy, changes);
        reads += 1;
        caught_up.send_replace(last);
        tokio::task::yield_now().await;
    }
    stop.store(true, Ordering::SeqCst);
    caught_up.send_replace(u64::MAX);
    for w in writers {
        w.await.expect("writer task");
    }
    let changes = answered(reader.as_ref(), &g, last).await;
    last = changes.counter;
    apply(&mut copy, changes);
    assert_eq!(last, counter(reader.as_ref(), &g).await);
    assert_eq!(
        last,
        written.load(Ordering::SeqCst),
        "one move per write that won"
    );
    let listing = reader.list(&g).await.expect("list");
    assert!(listing.malformed.is_empty());
    let copy: Vec<Lease> = copy.into_values().collect();
    assert_eq!(
        copy,
        plain(&listing.leases),
        "the copy kept from list_changes equals a full list"
    );
    assert!(reads > 20, "{reads} reads");
}
