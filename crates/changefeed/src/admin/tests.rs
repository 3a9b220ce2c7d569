//! The operator actions on the in-memory store, on paused time.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use super::*;
use crate::clock::SystemClock;
use crate::lease::{HeartbeatRole, MembershipStore, MemoryLeaseStore};
use crate::model::{PartitionId, Timestamp};

fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

fn host(name: &str) -> HostName {
    HostName::new(name).unwrap()
}

/// Leases 0..n, owned by `owner` where given, with a hand-off request from `asker` on 0.
async fn leases(store: &MemoryLeaseStore, owners: &[Option<&str>], asker: Option<&str>) {
    for (i, owner) in owners.iter().enumerate() {
        let key = LeaseKey::new(group(), PartitionId::new(i.to_string()).unwrap());
        let created = store
            .create(&Lease::new(key, Position::Beginning))
            .await
            .unwrap()
            .unwrap();
        let mut next = created.clone();
        if let Some(o) = owner {
            next.state = LeaseState::Owned;
            next.owner = Some(host(o));
            next.continuation = Some(Continuation::new(format!("{i}:7")));
        }
        if i == 0 {
            next.next_owner = asker.map(host);
        }
        store.replace(&next, created.version).await.unwrap();
    }
}

async fn beat(store: &MemoryLeaseStore, name: &str, last: Option<&Heartbeat>) -> Heartbeat {
    store
        .heartbeat(
            &group(),
            &host(name),
            "i",
            Timestamp(0),
            last.map(|h| h.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_dead_host_is_released_with_its_checkpoints_and_its_row_removed() {
    let store = MemoryLeaseStore::new();
    leases(
        &store,
        &[Some("dead"), Some("alive"), Some("dead")],
        Some("dead"),
    )
    .await;
    beat(&store, "dead", None).await;
    let watched = watch_heartbeat(
        &store,
        &group(),
        &host("dead"),
        Duration::from_secs(5),
        &SystemClock,
    )
    .await
    .unwrap();
    assert!(matches!(watched, Watched::StoodStill(_)), "{watched:?}");
    let report = release_host(&store, &group(), &host("dead"), watched.last())
        .await
        .unwrap();
    let released: Vec<&str> = report
        .released
        .iter()
        .map(|l| l.key.partition.as_str())
        .collect();
    assert_eq!(released, ["0", "2"]);
    assert!(report.failed.is_empty() && report.cleared.is_empty());
    assert!(matches!(report.heartbeat, Some(Ok(()))));
    let rows = store.list(&group()).await.unwrap().leases;
    assert!(rows[0].owner.is_none() && rows[0].next_owner.is_none());
    assert_eq!(
        rows[0].continuation,
        Some(Continuation::new("0:7")),
        "the checkpoint is kept"
    );
    assert_eq!(rows[1].owner, Some(host("alive")));
    assert!(store.membership(&group()).await.unwrap().hosts.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_that_moves_while_watched_shows_the_host_alive() {
    let store = Arc::new(MemoryLeaseStore::new());
    let first = beat(&store, "h", None).await;
    let renewer = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            beat(&store, "h", Some(&first)).await
        })
    };
    let watched = watch_heartbeat(
        store.as_ref(),
        &group(),
        &host("h"),
        Duration::from_secs(3),
        &SystemClock,
    )
    .await
    .unwrap();
    let renewed = renewer.await.unwrap();
    match watched {
        Watched::Moved { from, to } => {
            assert_eq!(from.version.0 + 1, renewed.version.0);
            assert_eq!(to, Some(renewed));
        }
        other => panic!("a moving heartbeat judged {other:?}"),
    }
    let absent = watch_heartbeat(
        store.as_ref(),
        &group(),
        &host("x"),
        Duration::from_secs(3),
        &SystemClock,
    )
    .await
    .unwrap();
    assert_eq!(absent, Watched::NoRow);
}

#[tokio::test]
async fn a_hand_off_request_of_the_host_is_cleared_and_nothing_else_changes() {
    let store = MemoryLeaseStore::new();
    leases(&store, &[Some("owner")], Some("gone")).await;
    let report = release_host(&store, &group(), &host("gone"), None)
        .await
        .unwrap();
    assert!(report.released.is_empty());
    assert_eq!(report.cleared.len(), 1);
    assert!(report.heartbeat.is_none());
    let row = &store.list(&group()).await.unwrap().leases[0];
    assert_eq!(
        (row.owner.clone(), row.next_owner.clone()),
        (Some(host("owner")), None)
    );
}

#[tokio::test]
async fn reset_refuses_an_owned_lease_unless_forced_and_then_frees_it() {
    let store = MemoryLeaseStore::new();
    leases(&store, &[Some("a"), None], None).await;
    let key = |p: &str| LeaseKey::new(group(), PartitionId::new(p).unwrap());
    let refused = reset_lease(&store, &key("0"), None, Position::Now, false).await;
    assert!(
        matches!(&refused, Err(ResetError::Owned { owner, .. }) if owner == "a"),
        "{refused:?}"
    );
    assert_eq!(
        store.get(&key("0")).await.unwrap().unwrap().continuation,
        Some(Continuation::new("0:7"))
    );

    let (before, after) = reset_lease(
        &store,
        &key("0"),
        Some(Continuation::new("0:3")),
        Position::Beginning,
        true,
    )
    .await
    .unwrap();
    assert_eq!(before.owner, Some(host("a")));
    assert_eq!(
        (after.state, after.owner.clone()),
        (LeaseState::Available, None)
    );
    assert_eq!(after.continuation, Some(Continuation::new("0:3")));

    let (_, free) = reset_lease(&store, &key("1"), None, Position::Now, false)
        .await
        .unwrap();
    assert_eq!(free.start, Position::Now);
    let missing = reset_lease(&store, &key("9"), None, Position::Now, false).await;
    assert!(matches!(missing, Err(ResetError::NotFound(_))));
}
