//! The lease table, the listing, the plan and the conflict rules, one by one.

use super::*;

// --- the lease table -------------------------------------------------------------------

#[test]
fn a_listing_marks_what_is_mine_and_what_i_was_asked_for() {
    let t = table(
        "a",
        vec![
            row("0", Some("a"), None, 1),
            row("1", Some("b"), Some("a"), 2),
            row("2", None, None, 1),
        ],
    );
    assert_eq!(t.to_adopt(|_| false), vec![row("0", Some("a"), None, 1)]);
    assert!(t.asked().contains(&p("1")) && t.asked().len() == 1);
}

#[test]
fn an_unsorted_listing_is_sorted_for_lookups() {
    let t = table(
        "a",
        vec![
            row("2", None, None, 1),
            row("0", None, None, 1),
            row("1", None, None, 1),
        ],
    );
    let rows = t.rows();
    let order: Vec<&str> = rows.iter().map(|l| l.key.partition.as_str()).collect();
    assert_eq!(order, ["0", "1", "2"]);
    assert!(t.get(&p("1")).is_some());
}

#[test]
fn an_older_row_does_not_replace_a_newer_one() {
    let mut t = table("a", vec![row("0", Some("a"), None, 5)]);
    assert!(t.remember(row("0", Some("b"), None, 4)).is_none());
    assert_eq!(t.get(&p("0")).unwrap().owner, Some(h("a")));
}

#[test]
fn a_newer_row_moves_the_marks() {
    // A lease this host owned, now handed to b: no longer mine; one b was asked for by me.
    let mut t = table("a", vec![row("0", Some("a"), None, 5)]);
    assert!(t.remember(row("0", Some("b"), None, 6)).is_some());
    assert!(t.to_adopt(|_| false).is_empty());
    t.remember(row("1", Some("b"), Some("a"), 3));
    assert!(t.asked().contains(&p("1")));
    t.remember(row("1", Some("a"), None, 4));
    assert!(t.asked().is_empty());
    assert_eq!(t.to_adopt(|_| false).len(), 1);
}

#[test]
fn a_deleted_lease_is_forgotten_with_its_marks() {
    let mut t = table(
        "a",
        vec![
            row("0", Some("a"), None, 1),
            row("1", Some("b"), Some("a"), 1),
        ],
    );
    t.remove(&p("0"));
    t.remove(&p("1"));
    assert!(t.rows().is_empty() && t.asked().is_empty() && t.to_adopt(|_| false).is_empty());
}

#[test]
fn a_lease_deleted_and_created_again_is_taken_in_afresh() {
    // Re-created at version 1 after a delete: the table must not keep the old row's marks.
    let mut t = table("a", vec![row("0", Some("a"), None, 9)]);
    t.remove(&p("0"));
    assert!(t.remember(row("0", None, None, 1)).is_some());
    assert_eq!(t.get(&p("0")).unwrap().version, Version(1));
    assert!(t.to_adopt(|_| false).is_empty());
}

#[test]
fn a_whole_listing_asks_for_every_worker_to_be_compared_once() {
    let mut t = table("a", vec![row("0", None, None, 1)]);
    assert!(t.take_hint_all());
    assert!(!t.take_hint_all());
    t.remember(row("1", None, None, 1));
    assert!(
        !t.take_hint_all(),
        "rows taken in one by one are hinted as they come"
    );
}

#[test]
fn leases_running_a_worker_are_not_adopted_again() {
    let t = table(
        "a",
        vec![row("0", Some("a"), None, 1), row("1", Some("a"), None, 1)],
    );
    let adopt = t.to_adopt(|q| q == &p("0"));
    assert_eq!(adopt.len(), 1);
    assert_eq!(adopt[0].key.partition, p("1"));
}

// --- what to read -----------------------------------------------------------------------

#[test]
fn the_first_cycle_lists_everything() {
    let l = Listing::default();
    assert_eq!(
        l.next_read(0, &std::sync::Arc::from(hosts(&["a"])), t0(), 300 * SECOND),
        Read::Full
    );
}

#[test]
fn an_unmoved_counter_with_the_same_hosts_reads_nothing() {
    let start = t0();
    let mut l = Listing::default();
    l.listed(
        Read::Full,
        7,
        &std::sync::Arc::from(hosts(&["a", "b"])),
        start,
    );
    assert_eq!(
        l.next_read(
            7,
            &std::sync::Arc::from(hosts(&["a", "b"])),
            start + 2 * SECOND,
            300 * SECOND
        ),
        Read::Nothing
    );
}

#[test]
fn a_moved_counter_reads_the_changes() {
    let start = t0();
    let mut l = Listing::default();
    l.listed(Read::Full, 7, &std::sync::Arc::from(hosts(&["a"])), start);
    assert_eq!(
        l.next_read(
            8,
            &std::sync::Arc::from(hosts(&["a"])),
            start + SECOND,
            300 * SECOND
        ),
        Read::Changes
    );
}

#[test]
fn changes_read_after_own_writes_advance_only_a_trusted_table() {
    let start = t0();
    let live: std::sync::Arc<[HostName]> = hosts(&["a"]).into();
    let mut l = Listing::default();
    l.advanced(9);
    assert_eq!(l.counter, None, "an untrusted table stays untrusted");
    l.listed(Read::Full, 7, &live, start);
    l.advanced(9);
    assert_eq!(
        l.next_read(9, &live, start + SECOND, 300 * SECOND),
        Read::Nothing,
        "the sync's own writes are not read again"
    );
    l.invalidate();
    l.advanced(10);
    assert_eq!(l.counter, None);
}

#[test]
fn a_host_dying_with_no_counter_move_reads_the_changes() {
    // Liveness changed the picture: its leases became free without any write.
    let start = t0();
    let mut l = Listing::default();
    l.listed(
        Read::Full,
        7,
        &std::sync::Arc::from(hosts(&["a", "b"])),
        start,
    );
    assert_eq!(
        l.next_read(
            7,
            &std::sync::Arc::from(hosts(&["a"])),
            start + SECOND,
            300 * SECOND
        ),
        Read::Changes
    );
}

#[test]
fn the_safety_list_comes_after_the_full_list_interval() {
    let start = t0();
    let mut l = Listing::default();
    l.listed(Read::Full, 7, &std::sync::Arc::from(hosts(&["a"])), start);
    l.listed(
        Read::Changes,
        8,
        &std::sync::Arc::from(hosts(&["a"])),
        start + 100 * SECOND,
    );
    assert_eq!(
        l.next_read(
            8,
            &std::sync::Arc::from(hosts(&["a"])),
            start + 299 * SECOND,
            300 * SECOND
        ),
        Read::Nothing
    );
    assert_eq!(
        l.next_read(
            8,
            &std::sync::Arc::from(hosts(&["a"])),
            start + 300 * SECOND,
            300 * SECOND
        ),
        Read::Full
    );
}

#[test]
fn a_listing_that_races_a_counter_move_is_not_trusted() {
    // The membership read after the list failed, or the host wrote itself: list again.
    let start = t0();
    let mut l = Listing::default();
    l.listed(Read::Full, 7, &std::sync::Arc::from(hosts(&["a"])), start);
    l.invalidate();
    assert_eq!(
        l.next_read(
            7,
            &std::sync::Arc::from(hosts(&["a"])),
            start + SECOND,
            300 * SECOND
        ),
        Read::Changes
    );
}

// --- leader, liveness, dead rows ---------------------------------------------------------

#[test]
fn this_host_always_counts_as_live() {
    assert_eq!(
        live_hosts(hosts(&["b", "c"]), &h("a")),
        hosts(&["a", "b", "c"])
    );
    assert_eq!(live_hosts(hosts(&["a", "b"]), &h("a")), hosts(&["a", "b"]));
}

#[test]
fn the_first_live_host_by_name_leads() {
    assert!(leads(&h("a"), &hosts(&["a", "b"])));
    assert!(!leads(&h("b"), &hosts(&["a", "b"])));
}

#[test]
fn the_leader_removes_dead_rows_that_own_nothing() {
    let rows = [heartbeat("a"), heartbeat("b"), heartbeat("c")];
    let t = table("a", vec![row("0", Some("c"), None, 1)]);
    let dead: Vec<&str> = dead_rows(&rows, &hosts(&["a"]), &t)
        .iter()
        .map(|hb| hb.host.as_str())
        .collect();
    assert_eq!(dead, ["b"], "c still owns a lease: kept until it is taken");
}

// --- plans ------------------------------------------------------------------------------

#[test]
fn a_newcomer_takes_free_leases_and_asks_for_its_share() {
    let rows = vec![
        row("0", Some("a"), None, 1),
        row("1", Some("a"), None, 1),
        row("2", Some("a"), None, 1),
        row("3", Some("a"), None, 1),
        row("4", None, None, 1),
        row("5", None, None, 1),
    ];
    let plan = plan_for("b", &["a", "b"], rows);
    assert_eq!(plan.take, vec![p("4"), p("5")]);
    assert_eq!(plan.request_handoff.len(), 1, "{plan:?}");
    assert_eq!(plan.request_handoff[0].from, h("a"));
}

#[test]
fn a_dead_hosts_leases_are_taken_in_one_cycle() {
    let rows = vec![
        row("0", Some("dead"), None, 1),
        row("1", Some("dead"), None, 1),
        row("2", Some("a"), None, 1),
    ];
    let plan = plan_for("a", &["a"], rows);
    assert_eq!(plan.take, vec![p("0"), p("1")]);
}

#[test]
fn a_host_cut_off_and_back_with_its_leases_resumes_them_and_takes_nothing() {
    // It is live again and still listed as the owner: it adopts, nobody takes.
    let rows = vec![row("0", Some("a"), None, 3), row("1", Some("b"), None, 3)];
    let t = table("a", rows.clone());
    assert_eq!(t.to_adopt(|_| false).len(), 1);
    assert!(plan_for("a", &["a", "b"], rows).is_empty());
}

#[test]
fn a_balanced_fleet_moves_nothing() {
    let rows = vec![
        row("0", Some("a"), None, 1),
        row("1", Some("b"), None, 1),
        row("2", Some("a"), None, 1),
    ];
    assert!(plan_for("a", &["a", "b"], rows.clone()).is_empty());
    assert!(plan_for("b", &["a", "b"], rows).is_empty());
}

#[test]
fn a_finished_lease_is_never_taken() {
    let plan = plan_for("a", &["a"], vec![finished("0", 4), row("1", None, None, 1)]);
    assert_eq!(plan.take, vec![p("1")]);
}

#[test]
fn children_wait_for_their_parents() {
    let rows = vec![row("0", Some("b"), None, 3), child("1", &["0"])];
    assert!(plan_for("a", &["a", "b"], rows).take.is_empty());
    let rows = vec![finished("0", 4), child("1", &["0"])];
    assert_eq!(plan_for("a", &["a", "b"], rows).take, vec![p("1")]);
}

#[test]
fn a_parent_no_longer_listed_counts_as_finished() {
    // Deleted after all its children started, or trimmed: the child may be read.
    assert_eq!(
        plan_for("a", &["a"], vec![child("1", &["0"])]).take,
        vec![p("1")]
    );
}

#[test]
fn the_broken_parents_rule_reads_children_early() {
    let t = table("a", vec![row("0", Some("b"), None, 3), child("1", &["0"])]);
    let c = t.get(&p("1")).unwrap().clone();
    assert!(!t.eligible(&c, ParentsRule::Wait));
    assert!(t.eligible(&c, ParentsRule::Ignore));
}

#[test]
fn requests_wait_out_the_start_up_grace() {
    // Hosts started together must see each other before asking for shares.
    let rows = vec![row("0", Some("a"), None, 1), row("1", Some("a"), None, 1)];
    let t = table("b", rows);
    let start = t0();
    let input = |now| PlanInput {
        me: Box::leak(Box::new(h("b"))),
        live: Box::leak(Box::new(hosts(&["a", "b"]))),
        dead: None,
        table: &t,
        requests: Box::leak(Box::default()),
        now,
        registered_at: start,
        handoff_timeout: 10 * SECOND,
        grace: 2 * SECOND,
        parents: ParentsRule::Wait,
        load: None,
    };
    let (early, held) = plan(&input(start + SECOND), &EqualShare::default());
    assert!(held && early.request_handoff.is_empty());
    let (later, held) = plan(&input(start + 3 * SECOND), &EqualShare::default());
    assert!(!held && later.request_handoff.len() == 1);
}

#[test]
fn an_unhonoured_request_is_stolen_after_the_hand_off_timeout() {
    let rows = vec![
        row("0", Some("a"), Some("b"), 2),
        row("1", Some("a"), None, 1),
    ];
    let t = table("b", rows);
    let start = t0();
    let mut requests = Requests::default();
    requests.sync(&t.asked(), start);
    let at = |now| {
        plan(
            &PlanInput {
                me: &h("b"),
                live: &hosts(&["a", "b"]),
                dead: None,
                table: &t,
                requests: &requests,
                now,
                registered_at: start - 60 * SECOND,
                handoff_timeout: 10 * SECOND,
                grace: 2 * SECOND,
                parents: ParentsRule::Wait,
                load: None,
            },
            &EqualShare::default(),
        )
        .0
    };
    assert!(at(start + 9 * SECOND).steal.is_empty());
    assert_eq!(at(start + 10 * SECOND).steal, vec![p("0")]);
}

#[test]
fn requests_are_timed_from_when_they_were_first_seen() {
    let start = t0();
    let mut r = Requests::default();
    let asked: BTreeSet<PartitionId> = [p("0")].into();
    r.sync(&asked, start);
    r.sync(&asked, start + 5 * SECOND);
    assert!(r.overdue(&p("0"), start + 10 * SECOND, 10 * SECOND));
    r.sync(&BTreeSet::new(), start + 11 * SECOND);
    assert!(!r.any(), "a request the table no longer shows is forgotten");
}

#[test]
fn a_request_written_is_timed_from_its_return_and_forgotten_once_taken() {
    let start = t0();
    let mut r = Requests::default();
    r.written(p("0"), start + 3 * SECOND);
    assert!(!r.overdue(&p("0"), start + 12 * SECOND, 10 * SECOND));
    assert!(r.overdue(&p("0"), start + 13 * SECOND, 10 * SECOND));
    r.taken(&p("0"));
    assert!(!r.any());
}

#[test]
fn a_stale_request_naming_a_dead_host_may_be_overwritten() {
    let lease = row("0", Some("a"), Some("gone"), 3);
    assert!(may_request(&lease, &h("a"), &hosts(&["a", "b"])));
}

#[test]
fn a_pending_request_of_a_live_host_stands() {
    let lease = row("0", Some("a"), Some("c"), 3);
    assert!(!may_request(&lease, &h("a"), &hosts(&["a", "b", "c"])));
}

#[test]
fn no_request_to_a_host_that_no_longer_owns_the_lease() {
    let lease = row("0", Some("c"), None, 3);
    assert!(!may_request(&lease, &h("a"), &hosts(&["a", "b", "c"])));
}

#[test]
fn a_take_that_conflicts_only_on_the_checkpoint_is_retried() {
    let listed = row("0", Some("dead"), None, 3);
    let mut current = listed.clone();
    current.continuation = Some(Continuation::new("0:9"));
    current.version = Version(4);
    assert_eq!(
        on_take_conflict(&listed, &current, false),
        TakeConflict::RetryAfterMembership
    );
}

#[test]
fn a_take_that_conflicts_on_ownership_plans_again() {
    let listed = row("0", Some("dead"), None, 3);
    let current = row("0", Some("c"), None, 4);
    assert_eq!(
        on_take_conflict(&listed, &current, false),
        TakeConflict::Replan
    );
}

#[test]
fn a_conflicting_steal_is_never_retried_blind() {
    let listed = row("0", Some("a"), Some("b"), 3);
    let mut current = listed.clone();
    current.version = Version(4);
    assert_eq!(
        on_take_conflict(&listed, &current, true),
        TakeConflict::Replan
    );
}

#[test]
fn a_retried_take_waits_for_the_owner_to_be_dead_and_the_old_worker_gone() {
    let r = row("0", Some("b"), None, 4);
    assert!(may_retry_take(&r, &hosts(&["a"]), false));
    assert!(
        !may_retry_take(&r, &hosts(&["a", "b"]), false),
        "the owner came back"
    );
    assert!(
        !may_retry_take(&r, &hosts(&["a"]), true),
        "our old worker still runs"
    );
}
