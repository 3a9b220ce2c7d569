//! The membership view, driven as the shell drives it: head reads, the leader's heartbeat
//! reads and view writes, admission, election.

use super::*;
use crate::model::{GroupHead, MembershipView, ViewHost};

/// A heartbeat row of `host` in `incarnation` at `version`.
fn hb(host: &str, incarnation: &str, version: u64) -> Heartbeat {
    Heartbeat {
        incarnation: incarnation.into(),
        version: Version(version),
        ..heartbeat(host)
    }
}

fn rows(hosts: &[(&str, &str, u64)]) -> Membership {
    Membership {
        hosts: hosts.iter().map(|(h, i, v)| hb(h, i, *v)).collect(),
        change_counter: 1,
    }
}

/// A view led by `leader` (incarnation "i") at `version`, with `live` (incarnation "i") and
/// `dead`.
fn view(
    version: u64,
    leader: &str,
    leader_hb: u64,
    live: &[&str],
    dead: &[&str],
) -> MembershipView {
    MembershipView {
        version,
        leader: h(leader),
        leader_incarnation: "i".into(),
        leader_heartbeat: Version(leader_hb),
        live: live
            .iter()
            .map(|n| ViewHost::new(h(n), "i".into()))
            .collect(),
        dead: dead.iter().map(|n| h(n)).collect(),
    }
}

fn head(v: Option<MembershipView>) -> GroupHead {
    GroupHead {
        change_counter: 1,
        view: v,
    }
}

/// A host `me` in incarnation "i" that has listed `rows`, on a store with views.
fn host(me: &str, rows: Vec<Lease>, start: Instant) -> HostState {
    let mut s = HostState::new(h(me), config(), start);
    s.registered_as("i".into());
    s.observe_head(&head(None), start);
    s.replace_table(rows, |_| false);
    s.note_listed(Read::Full, 1, start);
    s
}

#[test]
fn without_a_view_the_first_live_host_writes_one_listing_the_live_and_the_dead() {
    let start = t0();
    let mut s = host("a", vec![row("0", Some("c"), None, 1)], start);
    assert!(
        s.needs_heartbeats(start),
        "no view: every heartbeat is read"
    );
    assert!(s.admitted(), "no view yet: nobody waits to be admitted");
    let m = rows(&[("a", "i", 3), ("b", "i", 1)]);
    s.observe(&m, start, start);
    let (v, expected) = s
        .view_to_write(&m, start)
        .expect("a is the first live host");
    assert_eq!(expected, 0);
    assert_eq!(v.leader, h("a"));
    assert_eq!(v.leader_heartbeat, Version(3));
    assert_eq!(v.live_hosts(), hosts(&["a", "b"]));
    assert_eq!(
        v.dead,
        hosts(&["c"]),
        "an owner without a row left or was cleared"
    );
    // `b` is not the first live host: it does not write.
    let mut b = host("b", vec![], start);
    b.observe(&m, start, start);
    assert!(b.view_to_write(&m, start).is_none());
}

#[test]
fn a_follower_reads_only_the_head_and_goes_by_the_view() {
    let start = t0();
    let mut s = host(
        "b",
        vec![row("0", Some("x"), None, 1), row("1", Some("c"), None, 1)],
        start,
    );
    s.observe_head(&head(Some(view(1, "a", 1, &["a", "b"], &["c"]))), start);
    assert!(
        !s.needs_heartbeats(start),
        "a fresh view led by another host"
    );
    assert!(s.admitted());
    assert!(!s.leads());
    // `x` is in neither list: unknown, so its lease is left alone; `c` is dead, so its lease
    // is free.
    let actions = s.actions(start + 60 * SECOND, start, &EqualShare::default());
    let taken: Vec<PartitionId> = actions
        .takes
        .iter()
        .map(|(l, _)| l.key.partition.clone())
        .collect();
    assert_eq!(taken, vec![p("1")]);
}

#[test]
fn a_host_takes_nothing_until_a_view_lists_it_in_its_incarnation() {
    let start = t0();
    let leases = vec![
        row("0", None, None, 1),
        row("1", Some("b"), None, 1),
        row("2", None, None, 1),
    ];
    let mut s = host("b", leases, start);
    // The view knows `b` only in an earlier incarnation, and judged it dead.
    let mut v = view(1, "a", 1, &["a"], &["b"]);
    s.observe_head(&head(Some(v.clone())), start);
    assert!(!s.admitted());
    assert!(
        s.needs_heartbeats(start),
        "a host waiting to be admitted reads the heartbeats"
    );
    let actions = s.actions(start + 60 * SECOND, start, &EqualShare::default());
    assert!(actions.takes.is_empty() && actions.requests.is_empty());
    assert!(
        s.to_adopt().is_empty(),
        "no adoption either: an adoption is a take"
    );
    // The leader lists it live in this incarnation: it takes and adopts.
    v.version = 2;
    v.live.push(ViewHost::new(h("b"), "i".into()));
    v.dead.clear();
    s.observe_head(&head(Some(v)), start + 2 * SECOND);
    assert!(s.admitted());
    assert_eq!(s.to_adopt().len(), 1);
    let actions = s.actions(start + 4 * SECOND, start, &EqualShare::default());
    assert_eq!(actions.takes.len(), 1, "{actions:?}");
}

#[test]
fn the_view_stays_fresh_while_the_leader_renews_and_goes_stale_after_the_expiry() {
    let start = t0();
    let mut s = host("b", vec![], start);
    s.observe_head(&head(Some(view(1, "a", 1, &["a", "b"], &[]))), start);
    // The leader's renewals are copied into the view: fresh.
    s.observe_head(
        &head(Some(view(1, "a", 2, &["a", "b"], &[]))),
        start + 8 * SECOND,
    );
    assert!(!s.needs_heartbeats(start + 17 * SECOND));
    // No renewal for the expiry: stale; `b` reads the heartbeats and, `a`'s row standing
    // still since its copy was seen, judges it dead at once and takes over.
    let at = start + 18 * SECOND;
    s.observe_head(&head(Some(view(1, "a", 2, &["a", "b"], &[]))), at);
    assert!(s.needs_heartbeats(at));
    let m = rows(&[("a", "i", 2), ("b", "i", 9)]);
    s.observe(&m, at, at);
    let (v, expected) = s
        .view_to_write(&m, at)
        .expect("b is the first live candidate");
    assert_eq!(expected, 1);
    assert_eq!((v.leader.as_str(), v.dead.clone()), ("b", hosts(&["a"])));
    s.view_written(MembershipView { version: 2, ..v }, at);
    assert!(s.leads());
}

#[test]
fn a_leader_that_keeps_renewing_but_not_the_view_is_not_elected_again() {
    let start = t0();
    let mut s = host("b", vec![], start);
    s.observe_head(&head(Some(view(1, "a", 1, &["a", "b"], &[]))), start);
    let at = start + 11 * SECOND;
    s.observe_head(&head(Some(view(1, "a", 1, &["a", "b"], &[]))), at);
    // `a`'s heartbeat moves (it lives) but the view did not: `a` is no candidate.
    let m = rows(&[("a", "i", 7), ("b", "i", 9)]);
    s.observe(&m, at, at);
    let (v, _) = s.view_to_write(&m, at).expect("b leads in a's place");
    assert_eq!(v.leader, h("b"));
    assert_eq!(
        v.live_hosts(),
        hosts(&["a", "b"]),
        "a lives: listed live, not dead"
    );
}

#[test]
fn a_leader_that_stops_gives_the_view_up_and_the_others_elect_at_once() {
    let start = t0();
    let mut a = host("a", vec![], start);
    let m = rows(&[("a", "i", 1), ("b", "i", 1)]);
    a.observe(&m, start, start);
    let (v, _) = a.view_to_write(&m, start).unwrap();
    a.view_written(MembershipView { version: 1, ..v }, start);
    let (last, expected) = a.abdication().expect("the leader gives the view up");
    assert_eq!((expected, last.live_hosts()), (1, hosts(&["b"])));
    // `b` sees a view whose leader is not live: it elects without waiting for the expiry.
    let mut b = host("b", vec![], start);
    b.observe_head(
        &head(Some(MembershipView { version: 2, ..last })),
        start + SECOND,
    );
    assert!(b.needs_heartbeats(start + SECOND));
    let m = rows(&[("b", "i", 2)]);
    b.observe(&m, start + SECOND, start + SECOND);
    assert_eq!(
        b.view_to_write(&m, start + SECOND).unwrap().0.leader,
        h("b")
    );
}

#[test]
fn the_leader_writes_only_when_its_judgment_changes() {
    let start = t0();
    let mut a = host("a", vec![], start);
    let m = rows(&[("a", "i", 1), ("b", "i", 1)]);
    a.observe(&m, start, start);
    let (v, _) = a.view_to_write(&m, start).unwrap();
    a.view_written(MembershipView { version: 1, ..v }, start);
    assert!(
        a.needs_heartbeats(start),
        "the leader reads every heartbeat"
    );
    let m = rows(&[("a", "i", 2), ("b", "i", 2)]);
    a.observe(&m, start + 2 * SECOND, start + 2 * SECOND);
    assert!(
        a.view_to_write(&m, start + 2 * SECOND).is_none(),
        "nothing changed"
    );
    // `b` stands still for the expiry: judged dead, the view changes.
    let at = start + 13 * SECOND;
    a.observe(&m, at, at);
    let (v, expected) = a.view_to_write(&m, at).expect("b died");
    assert_eq!((expected, v.dead.clone()), (1, hosts(&["b"])));
}

/// A host waiting on another host's write (a view to admit it, an owner to grant its
/// hand-off request) looks four times as often, and at the acquire interval again once the
/// wait is over: each wait would otherwise add up to a whole interval before a host that
/// came back from a fault works again.
#[test]
fn a_host_waiting_to_be_admitted_or_granted_cycles_four_times_as_often() {
    let start = t0();
    let mut s = host("b", vec![row("0", Some("a"), None, 1)], start);
    let mut v = view(1, "a", 1, &["a"], &["b"]);
    s.observe_head(&head(Some(v.clone())), start);
    assert!(!s.admitted());
    assert_eq!(s.cycle_interval(), SECOND / 2, "waiting to be admitted");
    v.version = 2;
    v.live.push(ViewHost::new(h("b"), "i".into()));
    v.dead.clear();
    s.observe_head(&head(Some(v)), start + SECOND);
    assert!(s.admitted());
    assert_eq!(
        s.cycle_interval(),
        2 * SECOND,
        "admitted, asking for nothing"
    );
    s.requested(p("0"), start + SECOND);
    assert_eq!(s.cycle_interval(), SECOND / 2, "waiting on a hand-off");
}
