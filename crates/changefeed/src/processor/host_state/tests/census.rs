//! The lease table's census against a full recount: after any sequence of
//! rows taken in, deleted and listed whole (parents finishing and coming back included), and
//! any live set with or without a membership view's dead hosts, the census the table kept
//! equals a fresh count of its eligible rows, and the plan from it equals the snapshot plan.

use proptest::prelude::*;

use super::*;
use crate::balance::{BalanceStrategy, Census};

const HOSTS: [&str; 4] = ["a", "b", "c", "d"];
const PARTITIONS: usize = 12;

/// One step: a row taken in (partition, state, owner, next owner, parents, version step), a
/// deletion, a whole listing of the current rows with some changed, or a new live set.
#[derive(Debug, Clone)]
enum Step {
    Row(usize, u8, Option<usize>, Option<usize>, Vec<usize>, u64),
    Delete(usize),
    Relist(Vec<usize>),
    Live(Vec<bool>, Option<Vec<bool>>),
}

fn gen_step() -> impl Strategy<Value = Step> {
    let row = (
        0..PARTITIONS,
        0u8..3,
        proptest::option::weighted(0.8, 0..HOSTS.len()),
        proptest::option::weighted(0.3, 0..HOSTS.len()),
        proptest::collection::vec(0..PARTITIONS, 0..3),
        0u64..3,
    )
        .prop_map(|(i, s, o, n, ps, v)| Step::Row(i, s, o, n, ps, v));
    prop_oneof![
        8 => row,
        2 => (0..PARTITIONS).prop_map(Step::Delete),
        1 => proptest::collection::vec(0..PARTITIONS, 0..4).prop_map(Step::Relist),
        2 => (
            proptest::collection::vec(any::<bool>(), HOSTS.len()),
            proptest::option::of(proptest::collection::vec(any::<bool>(), HOSTS.len())),
        )
            .prop_map(|(l, d)| Step::Live(l, d)),
    ]
}

fn make(
    i: usize,
    state: u8,
    owner: Option<usize>,
    next: Option<usize>,
    parents: &[usize],
) -> Lease {
    let mut l = row(&format!("{i:02}"), None, next.map(|n| HOSTS[n]), 1);
    l.state = [
        LeaseState::Available,
        LeaseState::Owned,
        LeaseState::Finished,
    ][state as usize];
    l.owner = owner.map(|o| h(HOSTS[o]));
    l.parents = parents.iter().map(|q| p(&format!("{q:02}"))).collect();
    l
}

/// The census of `table` counted afresh.
fn recount(table: &LeaseTable) -> Census {
    let mut census = Census::new();
    for lease in table.rows() {
        if table.eligible(&lease, ParentsRule::Wait) {
            census.insert(lease.clone());
        }
    }
    census
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (a) The kept census equals a recount after every step, and every host's census plan
    /// equals its snapshot plan.
    #[test]
    fn kept_census_equals_a_recount_and_plans_alike(
        steps in proptest::collection::vec(gen_step(), 1..40),
        overdue in proptest::collection::vec(any::<bool>(), PARTITIONS),
    ) {
        let mut t = LeaseTable::new(h("a"), ParentsRule::Wait, None);
        let mut live = hosts(&HOSTS);
        let mut dead: Option<BTreeSet<HostName>> = None;
        for step in steps {
            match step {
                Step::Row(i, s, o, n, ps, v) => {
                    let mut l = make(i, s, o, n, &ps);
                    let current = t.get(&l.key.partition).map_or(0, |c| c.version.0);
                    l.version = Version(current + v);
                    t.remember(l);
                }
                Step::Delete(i) => t.remove(&p(&format!("{i:02}"))),
                Step::Relist(changed) => {
                    let mut rows: Vec<Lease> = t.rows().iter().map(|l| Lease::clone(l)).collect();
                    for (k, l) in rows.iter_mut().enumerate() {
                        if changed.contains(&k) {
                            l.state = LeaseState::Available;
                            l.owner = None;
                        }
                    }
                    t.replace_all(rows);
                }
                Step::Live(l, d) => {
                    live = HOSTS.iter().zip(&l).filter(|(_, &l)| l).map(|(x, _)| h(x)).collect();
                    dead = d.map(|d| {
                        HOSTS.iter().zip(&d).filter(|(_, &d)| d).map(|(x, _)| h(x)).collect()
                    });
                }
            }
            prop_assert_eq!(t.census(), &recount(&t));
            let start = t0();
            let mut requests = Requests::default();
            let asked: BTreeSet<PartitionId> = t
                .asked()
                .iter()
                .filter(|q| overdue[q.as_str().parse::<usize>().unwrap()])
                .cloned()
                .collect();
            requests.sync(&asked, start);
            for me in HOSTS {
                let me = h(me);
                let input = PlanInput {
                    me: &me,
                    live: &live,
                    dead: dead.as_ref(),
                    table: &t,
                    requests: &requests,
                    now: start + 60 * SECOND,
                    registered_at: start,
                    handoff_timeout: 10 * SECOND,
                    grace: 2 * SECOND,
                    parents: ParentsRule::Wait,
                    load: None,
                };
                let (by_census, _) = plan(&input, &EqualShare::default());
                let by_snapshot = snapshot_plan(&input, &EqualShare::default());
                prop_assert_eq!(&by_census, &by_snapshot);
                // A strategy without a census path gets the same snapshot.
                let strategy: &dyn BalanceStrategy = &crate::balance::KclLike::default();
                prop_assert_eq!(plan(&input, strategy).0, snapshot_plan(&input, strategy));
            }
        }
    }
}

#[test]
fn a_child_counts_once_its_last_parent_finishes_and_not_after_the_parent_comes_back() {
    // Design rule 5: a child is eligible only when every listed parent is finished; the
    // census follows the parent's row, not only the child's.
    let mut t = LeaseTable::new(h("a"), ParentsRule::Wait, None);
    t.replace_all(vec![row("p", Some("b"), None, 1), child("c", &["p"])]);
    assert_eq!(t.census().len(), 1, "only the parent");
    t.remember(finished("p", 2));
    assert_eq!(t.census().len(), 1, "only the child");
    assert_eq!(t.census(), &recount(&t));
    t.remove(&p("p"));
    assert_eq!(t.census().len(), 1, "a deleted parent counts as finished");
    let mut back = row("p", Some("b"), None, 1);
    back.version = Version(1);
    t.remember(back);
    assert_eq!(t.census().len(), 1, "the parent again, not the child");
    assert_eq!(t.census(), &recount(&t));
}

#[test]
fn an_unknown_owners_leases_are_neither_taken_nor_counted_on_either_path() {
    // With a membership view, an owner neither live nor dead is unknown: its leases are not
    // free (nobody takes them) and count in no quota. "x" is dead, "y" unknown.
    let rows = vec![
        row("0", Some("a"), None, 1),
        row("1", Some("x"), None, 1),
        row("2", Some("x"), None, 1),
        row("3", Some("y"), None, 1),
        row("4", Some("y"), None, 1),
        row("5", Some("y"), None, 1),
    ];
    let t = table("b", rows);
    let dead: BTreeSet<HostName> = [h("x")].into();
    let start = t0();
    let input = |dead| PlanInput {
        me: Box::leak(Box::new(h("b"))),
        live: Box::leak(Box::new(hosts(&["a", "b"]))),
        dead,
        table: &t,
        requests: Box::leak(Box::default()),
        now: start + 60 * SECOND,
        registered_at: start,
        handoff_timeout: 10 * SECOND,
        grace: 2 * SECOND,
        parents: ParentsRule::Wait,
        load: None,
    };
    let with_view = input(Some(&dead));
    // Three eligible leases (0, 1, 2): quotas a 2, b 1; a takes the dead host's first
    // lease and b the second. y's leases stay where they are.
    let (by_census, _) = plan(&with_view, &EqualShare::default());
    assert_eq!(by_census.take, vec![p("2")]);
    assert_eq!(snapshot_plan(&with_view, &EqualShare::default()), by_census);
    // Without a view every owner not live is dead: six leases, quota 3 each; a takes 1 and 2,
    // b takes y's three.
    let (by_census, _) = plan(&input(None), &EqualShare::default());
    assert_eq!(by_census.take, vec![p("3"), p("4"), p("5")]);
}

/// What a host decides from `t`: every host's plan, and this host's asked and own leases.
fn decisions(
    t: &LeaseTable,
    live: &[HostName],
    dead: Option<&BTreeSet<HostName>>,
) -> Vec<(Plan, BTreeSet<PartitionId>, Vec<PartitionId>)> {
    let start = t0();
    let requests = Requests::default();
    HOSTS
        .iter()
        .map(|me| {
            let me = h(me);
            let input = PlanInput {
                me: &me,
                live,
                dead,
                table: t,
                requests: &requests,
                now: start + 60 * SECOND,
                registered_at: start,
                handoff_timeout: 10 * SECOND,
                grace: 2 * SECOND,
                parents: ParentsRule::Wait,
                load: None,
            };
            let adopt = t.to_adopt(|_| false);
            (
                plan(&input, &EqualShare::default()).0,
                t.asked(),
                adopt.into_iter().map(|l| l.key.partition).collect(),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Hosts sharing their tables ([`TableShare`]) decide as hosts that do not: three hosts
    /// take in rows, deletions and whole listings of one store, each only some of them (so
    /// their tables part and meet again), and after every step each shared table gives the
    /// plans, requests and leases to resume its unshared twin gives, with a census equal to
    /// a recount.
    #[test]
    fn tables_shared_between_hosts_decide_as_tables_of_their_own(
        steps in proptest::collection::vec((gen_step(), 1u8..8), 1..40),
    ) {
        let share = TableShare::new();
        let mut shared: Vec<LeaseTable> = HOSTS[..3]
            .iter()
            .map(|me| LeaseTable::new(h(me), ParentsRule::Wait, Some(share.clone())))
            .collect();
        let mut alone: Vec<LeaseTable> = HOSTS[..3]
            .iter()
            .map(|me| LeaseTable::new(h(me), ParentsRule::Wait, None))
            .collect();
        // The store: every write of a row takes a version never used for that row before.
        let mut store: BTreeMap<usize, Lease> = BTreeMap::new();
        let mut versions = [0u64; PARTITIONS];
        let mut live = hosts(&HOSTS);
        let mut dead: Option<BTreeSet<HostName>> = None;
        for (step, mask) in steps {
            let hosts: Vec<usize> = (0..3).filter(|k| mask & (1 << k) != 0).collect();
            match step {
                Step::Row(i, s, o, n, ps, _) => {
                    let mut l = make(i, s, o, n, &ps);
                    versions[i] += 1;
                    l.version = Version(versions[i]);
                    store.insert(i, l.clone());
                    for &k in &hosts {
                        shared[k].remember(l.clone());
                        alone[k].remember(l.clone());
                    }
                }
                Step::Delete(i) => {
                    store.remove(&i);
                    for &k in &hosts {
                        shared[k].remove(&p(&format!("{i:02}")));
                        alone[k].remove(&p(&format!("{i:02}")));
                    }
                }
                Step::Relist(_) => {
                    let rows: Vec<Lease> = store.values().cloned().collect();
                    for &k in &hosts {
                        shared[k].replace_all(rows.clone());
                        alone[k].replace_all(rows.clone());
                    }
                }
                Step::Live(l, d) => {
                    live = HOSTS.iter().zip(&l).filter(|(_, &l)| l).map(|(x, _)| h(x)).collect();
                    dead = d.map(|d| {
                        HOSTS.iter().zip(&d).filter(|(_, &d)| d).map(|(x, _)| h(x)).collect()
                    });
                }
            }
            for k in 0..3 {
                prop_assert_eq!(shared[k].census(), &recount(&shared[k]));
                prop_assert_eq!(
                    decisions(&shared[k], &live, dead.as_ref()),
                    decisions(&alone[k], &live, dead.as_ref())
                );
            }
        }
    }
}

#[test]
fn hosts_listing_equal_rows_hold_one_table_and_part_when_one_changes() {
    let share = TableShare::new();
    let rows = vec![row("0", Some("a"), None, 1), row("1", Some("b"), None, 1)];
    let mut a = LeaseTable::new(h("a"), ParentsRule::Wait, Some(share.clone()));
    let mut b = LeaseTable::new(h("b"), ParentsRule::Wait, Some(share.clone()));
    a.replace_all(rows.clone());
    b.replace_all(rows.clone());
    assert!(a.shares_rows_with(&b), "equal listings are held once");
    // b takes lease 0: its table parts from a's, and a's is unchanged.
    b.remember(row("0", Some("b"), None, 2));
    assert!(!a.shares_rows_with(&b));
    assert_eq!(a.get(&p("0")).and_then(|l| l.owner.clone()), Some(h("a")));
    // a lists the take: both hold the one table again.
    a.remember(row("0", Some("b"), None, 2));
    assert!(
        a.shares_rows_with(&b),
        "tables that meet again are held once"
    );
    // A newer row that only moved its checkpoint is not replaced by an older one held.
    let mut newer = row("1", Some("b"), None, 5);
    newer.continuation = Some(Continuation::new("c5"));
    a.remember(newer);
    assert_eq!(a.get(&p("1")).map(|l| l.version), Some(Version(5)));
    b.remember(row("0", Some("b"), None, 2));
    assert_eq!(b.get(&p("1")).map(|l| l.version), Some(Version(1)));
}

#[test]
fn a_host_fast_forwards_to_the_table_another_listed_at_a_higher_counter() {
    let share = TableShare::new();
    let mut a = LeaseTable::new(h("a"), ParentsRule::Wait, Some(share.clone()));
    let mut b = LeaseTable::new(h("b"), ParentsRule::Wait, Some(share.clone()));
    b.replace_all(vec![row("0", Some("a"), None, 1)]);
    b.offer_table_at(3);
    a.replace_all(vec![
        row("0", Some("a"), None, 1),
        row("1", Some("b"), None, 1),
    ]);
    a.offer_table_at(7);
    assert_eq!(
        b.fast_forward(Some(3)),
        Some(7),
        "b takes a's table at counter 7"
    );
    assert!(a.shares_rows_with(&b));
    assert!(
        b.take_hint_all(),
        "workers are told of their rows, as after a full list"
    );
    assert_eq!(
        b.fast_forward(Some(7)),
        None,
        "nothing newer than its own counter"
    );
    let mut c = LeaseTable::new(h("c"), ParentsRule::Wait, None);
    assert_eq!(c.fast_forward(None), None, "no share, no fast-forward");
}

#[test]
fn tables_that_differ_in_a_request_are_not_shared() {
    // a has seen c ask for lease 1; b has not. When both take in the same row of lease 0,
    // b must not end up with a's table: it would see a request it never listed.
    let share = TableShare::new();
    let mut a = LeaseTable::new(h("a"), ParentsRule::Wait, Some(share.clone()));
    let mut b = LeaseTable::new(h("b"), ParentsRule::Wait, Some(share.clone()));
    a.replace_all(vec![
        row("0", Some("a"), None, 1),
        row("1", Some("b"), Some("c"), 2),
    ]);
    b.replace_all(vec![
        row("0", Some("a"), None, 1),
        row("1", Some("b"), None, 1),
    ]);
    a.remember(row("0", Some("b"), None, 2));
    b.remember(row("0", Some("b"), None, 2));
    assert!(!a.shares_rows_with(&b));
    assert_eq!(b.get(&p("1")).and_then(|l| l.next_owner.clone()), None);
    // Once b lists the request too, they meet.
    b.remember(row("1", Some("b"), Some("c"), 2));
    assert!(a.shares_rows_with(&b));
}
