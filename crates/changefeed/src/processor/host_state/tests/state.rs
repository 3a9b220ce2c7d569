//! The whole state: readings in, actions and signals out.

use super::*;

#[test]
fn a_newcomer_takes_free_leases_at_once_and_asks_after_the_grace() {
    let start = t0();
    let rows = vec![
        row("0", Some("a"), None, 1),
        row("1", Some("a"), None, 1),
        row("2", None, None, 1),
        row("3", Some("a"), None, 1),
    ];
    let mut s = state("b", &["a", "b"], rows, start);
    assert!(s.wants_plan(true));
    s.begin_plan();
    let early = s.actions(start, start, &EqualShare::default());
    assert_eq!(partitions(&early.takes), vec![(p("2"), TakeKind::Take)]);
    assert!(early.requests.is_empty(), "requests wait out the grace");
    assert!(
        s.wants_plan(false),
        "a held-back request plans again next cycle"
    );
    let later = start + 3 * SECOND;
    s.begin_plan();
    let asked = s.actions(later, later, &EqualShare::default());
    assert_eq!(asked.requests.len(), 1);
    assert_eq!(asked.requests[0].from, h("a"));
    let (listed, next) = s.request_row(&asked.requests[0], None).unwrap();
    assert_eq!(listed.version, Version(1));
    assert_eq!(next.next_owner, Some(h("b")));
}

#[test]
fn nothing_to_do_in_a_quiet_cycle() {
    let start = t0();
    let mut s = state("a", &["a"], vec![row("0", Some("a"), None, 1)], start);
    s.worker_started(&row("0", Some("a"), None, 1));
    s.begin_plan();
    assert!(s.to_adopt().is_empty());
    let a = s.actions(start, start, &EqualShare::default());
    assert!(a.takes.is_empty() && a.requests.is_empty() && a.releases.is_empty());
    assert_eq!(s.next_read(1, start + SECOND), Read::Nothing);
    assert!(!s.wants_plan(false));
    assert!(s.take_effects().is_empty());
}

#[test]
fn a_worker_exit_plans_again_and_its_lease_is_adopted_if_still_ours() {
    let start = t0();
    let mut s = state("a", &["a"], vec![row("0", Some("a"), None, 1)], start);
    s.worker_started(&row("0", Some("a"), None, 1));
    assert!(s.to_adopt().is_empty());
    s.worker_exited(&p("0"));
    assert!(s.wants_plan(false));
    assert_eq!(s.to_adopt(), vec![row("0", Some("a"), None, 1)]);
    s.begin_plan();
    assert!(!s.wants_plan(false));
}

#[test]
fn a_lease_deleted_in_a_list_of_changes_stops_its_worker() {
    let start = t0();
    let mut s = state("a", &["a"], vec![row("0", Some("a"), None, 1)], start);
    s.worker_started(&row("0", Some("a"), None, 1));
    s.update_table(&[p("0")], Vec::<Lease>::new());
    assert_eq!(s.take_effects(), vec![Effect::Stop(p("0"))]);
    assert!(s.rows().is_empty());
}

#[test]
fn a_lease_gone_from_a_full_list_stops_its_worker_unless_only_unreadable() {
    let start = t0();
    let rows = vec![row("0", Some("a"), None, 1), row("1", Some("a"), None, 1)];
    let mut s = state("a", &["a"], rows, start);
    s.worker_started(&row("0", Some("a"), None, 1));
    s.worker_started(&row("1", Some("a"), None, 1));
    s.replace_table(Vec::<Lease>::new(), |partition| partition == &p("1"));
    assert_eq!(s.take_effects(), vec![Effect::Stop(p("0"))]);
}

#[test]
fn workers_are_told_of_newer_rows_once_in_partition_order() {
    let start = t0();
    let rows = vec![row("0", Some("a"), None, 1), row("1", Some("a"), None, 1)];
    let mut s = state("a", &["a", "b"], rows, start);
    s.worker_started(&row("1", Some("a"), None, 1));
    s.worker_started(&row("0", Some("a"), None, 1));
    s.hint_all();
    assert!(
        s.take_effects().is_empty(),
        "the workers know these versions"
    );
    let asked = vec![
        row("0", Some("a"), Some("b"), 2),
        row("1", Some("a"), Some("b"), 2),
    ];
    s.replace_table(asked.clone(), |_| false);
    s.hint_all();
    assert_eq!(
        s.take_effects(),
        asked.into_iter().map(Effect::Hint).collect::<Vec<_>>()
    );
    s.hint_all();
    assert!(s.take_effects().is_empty(), "told once");
}

#[test]
fn a_row_from_a_list_of_changes_is_told_to_its_worker_at_once() {
    let start = t0();
    let mut s = state("a", &["a", "b"], vec![row("0", Some("a"), None, 1)], start);
    s.worker_started(&row("0", Some("a"), None, 1));
    s.update_table(&[], vec![row("0", Some("a"), Some("b"), 2)]);
    assert_eq!(
        s.take_effects(),
        vec![Effect::Hint(row("0", Some("a"), Some("b"), 2))]
    );
    s.update_table(&[], vec![row("0", Some("a"), Some("b"), 2)]);
    assert!(
        s.take_effects().is_empty(),
        "a row already known is not told again"
    );
}

#[test]
fn a_take_waits_while_a_worker_of_an_earlier_ownership_runs() {
    let start = t0();
    let mut s = state("a", &["a"], vec![row("0", None, None, 3)], start);
    // The worker of this host's earlier ownership has not exited yet.
    s.worker_started(&row("0", Some("a"), None, 2));
    s.begin_plan();
    let a = s.actions(start, start, &EqualShare::default());
    assert!(a.takes.is_empty());
    assert!(s.wants_plan(false), "plans again once the worker is gone");
    s.worker_exited(&p("0"));
    s.begin_plan();
    let a = s.actions(start, start, &EqualShare::default());
    assert_eq!(partitions(&a.takes), vec![(p("0"), TakeKind::Take)]);
}

#[test]
fn a_take_stores_the_row_and_forgets_the_request() {
    let start = t0();
    let mut s = state(
        "b",
        &["a", "b"],
        vec![row("0", Some("a"), Some("b"), 2)],
        start,
    );
    let later = start + 11 * SECOND;
    s.begin_plan();
    let a = s.actions(later, start, &EqualShare::default());
    assert_eq!(partitions(&a.takes), vec![(p("0"), TakeKind::Steal)]);
    let taken = s.taken_row(&a.takes[0].0);
    assert_eq!(
        (taken.owner.clone(), taken.next_owner.clone()),
        (Some(h("b")), None)
    );
    assert_eq!(taken.state, LeaseState::Owned);
    let mut stored = taken;
    stored.version = Version(3);
    s.took(stored.clone());
    s.worker_started(&stored);
    assert_eq!(s.rows(), &[Arc::new(stored)]);
    assert!(!s.wants_plan(false), "no request waits any more");
}

#[test]
fn a_conflicting_take_keeps_the_current_row_or_retries_after_membership() {
    let start = t0();
    let dead = row("0", Some("x"), None, 1);
    let mut s = state("a", &["a"], vec![dead.clone()], start);
    let mut checkpointed = dead.clone();
    checkpointed.version = Version(2);
    let retry = s.take_conflict(&dead, checkpointed.clone(), TakeKind::Take);
    assert_eq!(retry, Some(checkpointed.clone()));
    // The owner is still dead after the conflict: take it at the current version.
    let live = s.live_after_conflict(&membership(&["a"], 1), start + SECOND, start + SECOND);
    assert!(s.retry_take(&checkpointed, &live));
    // Had the owner come back, the row is kept and the plan runs again.
    let live = s.live_after_conflict(&membership(&["a", "x"], 1), start + SECOND, start + SECOND);
    assert!(!s.retry_take(&checkpointed, &live));
    assert!(s.wants_plan(false));
    assert_eq!(s.rows(), &[Arc::new(checkpointed)]);
}

#[test]
fn a_take_lost_to_another_host_is_not_retried() {
    let start = t0();
    let free = row("0", None, None, 1);
    let mut s = state("a", &["a", "b"], vec![free.clone()], start);
    let theirs = row("0", Some("b"), None, 2);
    assert_eq!(s.take_conflict(&free, theirs.clone(), TakeKind::Take), None);
    assert_eq!(s.rows(), &[Arc::new(theirs)]);
    assert!(s.wants_plan(false));
}

#[test]
fn a_request_conflict_is_retried_against_the_current_row_while_it_still_makes_sense() {
    let start = t0();
    let mut s = state(
        "b",
        &["a", "b", "c"],
        vec![row("0", Some("a"), None, 1)],
        start,
    );
    let req = crate::balance::HandoffRequest {
        partition: p("0"),
        from: h("a"),
    };
    assert!(s.request_row(&req, None).is_some());
    // The owner checkpointed meanwhile: ask again at its version.
    let moved = row("0", Some("a"), None, 2);
    let (listed, next) = s.request_row(&req, Some(&moved)).unwrap();
    assert_eq!(
        (listed.version, next.next_owner),
        (Version(2), Some(h("b")))
    );
    // Another live host asked first: leave its request standing.
    let asked = row("0", Some("a"), Some("c"), 3);
    assert!(s.request_row(&req, Some(&asked)).is_none());
    s.requested(p("0"), start);
    assert!(s.wants_plan(false), "a pending request can grow overdue");
}

#[test]
fn the_leader_is_judged_from_the_latest_membership_read() {
    let start = t0();
    let mut s = state("b", &["a", "b"], vec![], start);
    assert!(!s.leads());
    // `a` stops renewing: after the expiry only `b` is live, and leads.
    s.observe(
        &membership(&["a", "b"], 1),
        start + 11 * SECOND,
        start + 11 * SECOND,
    );
    assert!(s.leads());
    let hosts = vec![heartbeat("a"), heartbeat("b")];
    let dead: Vec<&HostName> = s.dead_rows(&hosts).iter().map(|hb| &hb.host).collect();
    assert_eq!(dead, vec![&h("a")]);
}

#[test]
fn own_writes_distrust_the_counter_until_listed_again() {
    let start = t0();
    let mut s = state("a", &["a"], vec![], start);
    assert_eq!(s.next_read(1, start), Read::Nothing);
    s.replace_table_after_sync(vec![row("0", None, None, 1)]);
    assert_eq!(s.table_counter(), None);
    assert_eq!(s.next_read(1, start), Read::Changes);
}

#[test]
fn a_lease_that_finishes_asks_for_a_sync_until_one_succeeds() {
    let start = t0();
    let mut s = state("a", &["a"], vec![row("0", Some("a"), None, 1)], start);
    assert!(!s.sync_wanted(), "no lease finished yet");
    // A checkpoint or a change of hands is no reason to sync.
    s.update_table(&[], vec![row("0", Some("b"), None, 2)]);
    assert!(!s.sync_wanted());
    s.update_table(&[], vec![finished("0", 3)]);
    assert!(s.sync_wanted(), "its children may need leases");
    assert!(s.sync_wanted(), "wanted until a sync succeeds");
    s.synced();
    assert!(!s.sync_wanted());
    // A full list showing the same finished lease again asks for nothing; a new one does.
    s.replace_table(vec![finished("0", 3), row("1", None, None, 1)], |_| false);
    assert!(!s.sync_wanted());
    s.replace_table(vec![finished("0", 3), finished("1", 2)], |_| false);
    assert!(s.sync_wanted());
}
