//! Lease store conformance: the membership view (`MembershipStore::head`, `write_view`,
//! `lead_heartbeat`). A store whose `head` answers `None` keeps no view: its checks pass
//! vacuously (its `lead_heartbeat` must still renew like `heartbeat`), unless its fixture says
//! it keeps one ([`LeaseStoreFixture::keeps_view`]), and then they fail.

use crate::lease::HeartbeatRole;
use std::sync::Arc;

use super::store::LeaseStoreFixture;
use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{
    GroupHead, GroupName, HostLimits, HostName, Lease, LeaseKey, MembershipView, PartitionId,
    Position, Timestamp, Version, ViewHost,
};

fn group(name: &str) -> GroupName {
    GroupName::new(name).expect("suite group names are valid")
}

fn host(name: &str) -> HostName {
    HostName::new(name).expect("suite host names are valid")
}

/// A view led by `leader` (incarnation `inc-<leader>`) listing `live` live and `dead` dead;
/// host `b` publishes lease limits, which the view must keep.
fn view(leader: &str, leader_heartbeat: u64, live: &[&str], dead: &[&str]) -> MembershipView {
    MembershipView {
        version: 0,
        leader: host(leader),
        leader_incarnation: format!("inc-{leader}").into(),
        leader_heartbeat: Version(leader_heartbeat),
        live: live
            .iter()
            .map(|h| ViewHost {
                limits: (*h == "b").then_some(HostLimits {
                    min_leases: Some(1),
                    max_leases: Some(3),
                }),
                ..ViewHost::new(host(h), format!("inc-{h}").into())
            })
            .collect(),
        dead: dead.iter().map(|h| host(h)).collect(),
    }
}

/// The head of `g`, or `None` for a store that keeps no view (which the fixture must allow).
async fn head(
    f: &dyn LeaseStoreFixture,
    store: &dyn LeaseStore,
    g: &GroupName,
) -> Option<GroupHead> {
    let head = store.head(g).await.expect("head");
    assert!(
        head.is_some() || !f.keeps_view(),
        "the fixture says the store keeps a membership view, but head({g}) answered None"
    );
    head
}

fn stored(v: &MembershipView, version: u64) -> MembershipView {
    MembershipView {
        version,
        ..v.clone()
    }
}

/// A group never written to has counter 0 and no view; one written to only by heartbeats too.
pub(super) async fn head_of_an_empty_group_is_counter_zero_and_no_view(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let g = group("head-empty");
    let Some(h) = head(f, store.as_ref(), &g).await else {
        return;
    };
    assert_eq!(h, GroupHead::default(), "an untouched group");
    store
        .heartbeat(
            &g,
            &host("a"),
            "inc-a",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("heartbeat");
    let h = head(f, store.as_ref(), &g).await.expect("answered before");
    assert_eq!(
        h,
        GroupHead::default(),
        "heartbeats move neither counter nor view"
    );
}

/// `write_view` is a compare-and-swap on the view's version: at 0 it creates version 1, at a
/// stale version it returns `ViewConflict` with the current view; it never moves the change
/// counter, and ownership writes never move the view. Another connection reads the same head.
pub(super) async fn view_is_compare_and_swap_and_leaves_the_counter(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let other = f.connect().await;
    let g = group("view-cas");
    let Some(_) = head(f, store.as_ref(), &g).await else {
        return;
    };
    let key = LeaseKey::new(g.clone(), PartitionId::new("p").expect("valid"));
    store
        .create(&Lease::new(key, Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    let first = view("a", 1, &["a", "b"], &["z"]);
    let v1 = store.write_view(&g, &first, 0).await.expect("create view");
    assert_eq!(v1, stored(&first, 1), "written at version 1, as given");
    let h = head(f, other.as_ref(), &g).await.expect("answered before");
    assert_eq!(h.change_counter, 1, "the view write left the counter");
    assert_eq!(
        h.view.as_ref(),
        Some(&v1),
        "another connection reads the view"
    );

    let second = view("b", 7, &["b"], &["a", "z"]);
    match other.write_view(&g, &second, 0).await {
        Err(LeaseError::ViewConflict {
            expected, current, ..
        }) => {
            assert_eq!(expected, 0);
            assert_eq!(
                current.as_deref(),
                Some(&v1),
                "the conflict carries the view"
            );
        }
        got => panic!("creating a view that exists must conflict, got {got:?}"),
    }
    let v2 = other.write_view(&g, &second, 1).await.expect("replace");
    assert_eq!(v2, stored(&second, 2));
    match store.write_view(&g, &first, 1).await {
        Err(LeaseError::ViewConflict { current, .. }) => {
            assert_eq!(
                current.as_deref(),
                Some(&v2),
                "a stale writer sees the new view"
            )
        }
        got => panic!("a write at a stale view version must conflict, got {got:?}"),
    }
    // The same judgment written again (a leader renewing it) is a new version.
    let v3 = other.write_view(&g, &second, 2).await.expect("renew");
    assert_eq!(v3, stored(&second, 3));
    let h = head(f, store.as_ref(), &g).await.expect("answered before");
    assert_eq!(
        h.view.as_ref(),
        Some(&v3),
        "the first connection reads the newest view"
    );
    assert_eq!(
        h.change_counter, 1,
        "three view writes, the counter unmoved"
    );

    let lease = store
        .list(&g)
        .await
        .expect("list")
        .leases
        .pop()
        .expect("one lease");
    let mut taken = crate::model::Lease::clone(&lease);
    taken.state = crate::model::LeaseState::Owned;
    taken.owner = Some(host("b"));
    store.replace(&taken, lease.version).await.expect("take");
    let h = head(f, other.as_ref(), &g).await.expect("answered before");
    assert_eq!(h.change_counter, 2, "an ownership change moves the counter");
    assert_eq!(h.view, Some(v3), "and leaves the view");
}

/// `lead_heartbeat` renews like `heartbeat` and copies the new version into the view only
/// when the view names that host and incarnation as leader; `heartbeat` never copies.
pub(super) async fn lead_heartbeat_copies_only_for_the_leaders_incarnation(
    f: &dyn LeaseStoreFixture,
) {
    let store = f.connect().await;
    let g = group("view-lead");
    let (a, b) = (host("a"), host("b"));
    let a1 = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("a registers");
    let b1 = store
        .heartbeat(
            &g,
            &b,
            "inc-b",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("b registers");
    if head(f, store.as_ref(), &g).await.is_none() {
        // No view: a plain renewal, compare-and-swap as ever.
        let a2 = store
            .heartbeat(
                &g,
                &a,
                "inc-a",
                Timestamp(2),
                Some(a1.version),
                HeartbeatRole::Leader,
                None,
            )
            .await
            .expect("renew");
        assert_eq!(a2.version, a1.version.next());
        return;
    }
    // Without a view there is nothing to copy into: the renewal still lands.
    let a2 = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(2),
            Some(a1.version),
            HeartbeatRole::Leader,
            None,
        )
        .await
        .expect("renew without a view");
    assert_eq!(a2.version, a1.version.next());
    let v1 = store
        .write_view(&g, &view("a", a2.version.0, &["a", "b"], &[]), 0)
        .await
        .expect("view");
    let leader_heartbeat = |h: GroupHead| h.view.expect("a view").leader_heartbeat;

    let a3 = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(3),
            Some(a2.version),
            HeartbeatRole::Leader,
            None,
        )
        .await
        .expect("lead renew");
    assert_eq!(a3.version, a2.version.next());
    assert_eq!(a3.written_at, Timestamp(3));
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(
        h.view.as_ref().map(|v| v.version),
        Some(v1.version),
        "the copy is no view write"
    );
    assert_eq!(
        leader_heartbeat(h),
        a3.version,
        "the leader's renewal is copied"
    );

    let a4 = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(4),
            Some(a3.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("plain renew");
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(
        leader_heartbeat(h),
        a3.version,
        "a plain heartbeat is not copied"
    );

    let b2 = store
        .heartbeat(
            &g,
            &b,
            "inc-b",
            Timestamp(4),
            Some(b1.version),
            HeartbeatRole::Leader,
            None,
        )
        .await
        .expect("b renews as if it led");
    assert_eq!(
        b2.version,
        b1.version.next(),
        "another host's renewal lands"
    );
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(
        leader_heartbeat(h),
        a3.version,
        "but is not copied: b does not lead"
    );

    assert!(
        matches!(
            store
                .heartbeat(
                    &g,
                    &a,
                    "inc-a",
                    Timestamp(5),
                    Some(a3.version),
                    HeartbeatRole::Leader,
                    None,
                )
                .await,
            Err(LeaseError::HeartbeatConflict {
                current: Some(_),
                ..
            })
        ),
        "a stale lead renewal conflicts with the row"
    );
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(leader_heartbeat(h), a3.version, "and copies nothing");

    // The leader's name in another incarnation (a restart) is not the leader.
    store
        .remove_heartbeat(&g, &a, "inc-a", a4.version)
        .await
        .expect("a stops");
    let again = store
        .heartbeat(
            &g,
            &a,
            "inc-a2",
            Timestamp(6),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("a restarts");
    let again = store
        .heartbeat(
            &g,
            &a,
            "inc-a2",
            Timestamp(7),
            Some(again.version),
            HeartbeatRole::Leader,
            None,
        )
        .await
        .expect("renews");
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(
        leader_heartbeat(h),
        a3.version,
        "a new incarnation's renewal (version {}) is not copied",
        again.version.0
    );
    let members = store.membership(&g).await.expect("membership");
    assert_eq!(members.hosts.len(), 2, "both rows are still read");
}

/// A view of 10,000 hosts (the largest fleet the design plans for) round trips, on another
/// connection too, and replaces a smaller one.
pub(super) async fn a_view_of_ten_thousand_hosts_round_trips(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let g = group("view-big");
    let Some(_) = head(f, store.as_ref(), &g).await else {
        return;
    };
    let small = store
        .write_view(&g, &view("a", 1, &["a"], &[]), 0)
        .await
        .expect("small view");
    let names: Vec<String> = (0..10_000)
        .map(|i| format!("host-{i:05}.example.internal"))
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut big = view(
        "host-00000.example.internal",
        3,
        &refs[..9_900],
        &refs[9_900..],
    );
    for h in &mut big.live {
        h.incarnation = Arc::from(format!("{}-0123456789abcdef0123456789abcdef", h.host).as_str());
    }
    let written = store
        .write_view(&g, &big, small.version)
        .await
        .expect("big view");
    let other = f.connect().await;
    let h = head(f, other.as_ref(), &g).await.expect("answered");
    assert_eq!(h.view, Some(written.clone()), "every host read back");
    assert_eq!(h.view.map(|v| v.live.len()), Some(9_900));
    let back = other
        .write_view(&g, &view("b", 2, &["b"], &["a"]), written.version)
        .await
        .expect("smaller again");
    let h = head(f, store.as_ref(), &g).await.expect("answered");
    assert_eq!(h.view, Some(back));
}
