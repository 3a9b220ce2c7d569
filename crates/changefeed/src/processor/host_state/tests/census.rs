//! The lease table's census (issue 19, item 4) against a full recount: after any sequence of
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
        if table.eligible(lease, ParentsRule::Wait) {
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
        let mut t = LeaseTable::new(h("a"), ParentsRule::Wait);
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
    let mut t = LeaseTable::new(h("a"), ParentsRule::Wait);
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
