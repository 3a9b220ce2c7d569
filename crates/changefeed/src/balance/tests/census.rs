//! The census path of [`EqualShare`] against its snapshot path: for any
//! table, limits and hosts judged dead, every host gets the same plan from a [`Census`] as
//! from the equivalent [`Snapshot`], and a census kept up to date one change at a time equals
//! a fresh count.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use imbl::{OrdMap, OrdSet};
use proptest::prelude::*;

use super::limits::gen_limits;
use super::*;
use crate::balance::census::{holder, Row};

/// One generated row: state (0 available, 1 owned, 2 finished), owner and next owner (hosts
/// by index), eligible, hand-off overdue.
type GenRow = (u8, Option<usize>, Option<usize>, bool, bool);

fn gen_row(hosts: usize) -> impl Strategy<Value = GenRow> {
    (
        prop_oneof![2 => Just(0u8), 6 => Just(1u8), 1 => Just(2u8)],
        proptest::option::weighted(0.9, 0..hosts),
        proptest::option::weighted(0.3, 0..hosts),
        proptest::bool::weighted(0.9),
        any::<bool>(),
    )
}

/// A table over a universe of hosts: which are live, which of the others a membership view
/// judged dead (`None`: no view, every host not live is dead), the rows, and the limits.
#[derive(Debug, Clone)]
struct Case {
    universe: Vec<HostName>,
    live: Vec<HostName>,
    dead: Option<BTreeSet<HostName>>,
    rows: Vec<(Arc<Lease>, bool, bool)>,
    strategy: EqualShare,
}

fn row(i: usize, names: &[HostName], (state, owner, next, _, _): GenRow) -> Lease {
    let mut l = lease(i, None);
    l.state = match state {
        0 => LeaseState::Available,
        1 => LeaseState::Owned,
        _ => LeaseState::Finished,
    };
    l.owner = owner.map(|o| names[o].clone());
    l.next_owner = next.map(|n| names[n].clone());
    l
}

fn gen_case() -> impl Strategy<Value = Case> {
    (1usize..=8).prop_flat_map(|n| {
        (
            proptest::collection::vec(any::<bool>(), n),
            proptest::option::of(proptest::collection::vec(any::<bool>(), n)),
            proptest::collection::vec(gen_row(n), 0..80),
            proptest::option::weighted(0.4, gen_limits()),
            proptest::collection::vec(proptest::option::weighted(0.2, gen_limits()), n),
        )
            .prop_map(move |(live, dead, rows, every, own)| {
                let names: Vec<HostName> = (0..n).map(|i| host(&format!("h{i:02}"))).collect();
                let live: Vec<HostName> = names
                    .iter()
                    .zip(&live)
                    .filter(|(_, &l)| l)
                    .map(|(h, _)| h.clone())
                    .collect();
                let dead = dead.map(|dead| {
                    names
                        .iter()
                        .zip(dead)
                        .filter(|(h, d)| *d && !live.contains(h))
                        .map(|(h, _)| h.clone())
                        .collect()
                });
                let rows = rows
                    .into_iter()
                    .enumerate()
                    .map(|(i, g)| (Arc::new(row(i, &names, g)), g.3, g.4))
                    .collect();
                let mut strategy = every.map_or_else(EqualShare::default, EqualShare::with_limits);
                for (h, l) in names.iter().zip(own) {
                    if let Some(l) = l {
                        strategy = strategy.with_host_limits(h.clone(), l);
                    }
                }
                Case {
                    universe: names,
                    live,
                    dead,
                    rows,
                    strategy,
                }
            })
    })
}

impl Case {
    /// Whether `lease`'s holder is neither live nor judged dead.
    fn unknown(&self, lease: &Lease) -> bool {
        self.dead.as_ref().is_some_and(|dead| {
            lease.state == LeaseState::Owned
                && lease
                    .owner
                    .as_ref()
                    .is_some_and(|o| !self.live.contains(o) && !dead.contains(o))
        })
    }

    fn census(&self) -> Census {
        let mut census = Census::new();
        for (lease, eligible, _) in &self.rows {
            if *eligible {
                census.insert(lease.clone());
            }
        }
        census
    }

    /// The plans of every host of the universe (live or not), by census and by snapshot.
    fn plans(&self, census: &Census) -> Vec<(Plan, Plan)> {
        let views: Vec<LeaseView<'_>> = self
            .rows
            .iter()
            .map(|(lease, eligible, overdue)| LeaseView {
                lease,
                eligible: *eligible && !self.unknown(lease),
                handoff_overdue: *overdue,
            })
            .collect();
        let overdue: BTreeSet<&PartitionId> = self
            .rows
            .iter()
            .filter(|(_, _, overdue)| *overdue)
            .map(|(l, _, _)| &l.key.partition)
            .collect();
        let overdue = |p: &PartitionId| overdue.contains(p);
        self.universe
            .iter()
            .map(|me| {
                let by_census = self
                    .strategy
                    .plan_census(&CensusSnapshot {
                        me,
                        live_hosts: &self.live,
                        dead_hosts: self.dead.as_ref(),
                        census,
                        handoff_overdue: &overdue,
                    })
                    .expect("equal share plans from a census");
                let by_snapshot = self.strategy.plan(&Snapshot {
                    me,
                    live_hosts: &self.live,
                    leases: &views,
                });
                (by_census, by_snapshot)
            })
            .collect()
    }
}

/// Partitions per host, as a census index holds them.
type ByHost<'c> = BTreeMap<&'c HostName, BTreeSet<&'c PartitionId>>;

fn by_host(index: &OrdMap<HostName, OrdSet<Row>>) -> ByHost<'_> {
    index
        .iter()
        .map(|(h, set)| (h, set.iter().map(|row| &row.0.key.partition).collect()))
        .collect()
}

/// The census's hand-off indexes agree with its counted leases: each lease naming a next
/// owner is under that host in `asked`, and under it in `asked_unheld` when it has no holder
/// or under its holder in `held_asked` when it has one; `self_asked` counts, per holder, the
/// leases naming the holder itself.
fn indexes_agree(census: &Census) -> Result<(), TestCaseError> {
    let (mut asked, mut asked_unheld, mut held_asked) =
        (ByHost::new(), ByHost::new(), ByHost::new());
    let mut self_asked: BTreeMap<&HostName, usize> = BTreeMap::new();
    for lease in census.leases() {
        let Some(asker) = &lease.next_owner else {
            continue;
        };
        let partition = &lease.key.partition;
        asked.entry(asker).or_default().insert(partition);
        match holder(lease) {
            Some(owner) => {
                held_asked.entry(owner).or_default().insert(partition);
                if owner == asker {
                    *self_asked.entry(owner).or_default() += 1;
                }
            }
            None => {
                asked_unheld.entry(asker).or_default().insert(partition);
            }
        }
    }
    prop_assert_eq!(by_host(&census.asked), asked);
    prop_assert_eq!(by_host(&census.asked_unheld), asked_unheld);
    prop_assert_eq!(by_host(&census.held_asked), held_asked);
    let counted: BTreeMap<&HostName, usize> =
        census.self_asked.iter().map(|(h, n)| (h, *n)).collect();
    prop_assert_eq!(counted, self_asked);
    Ok(())
}

#[test]
fn an_unknown_holders_leases_are_neither_free_nor_counted() {
    // A membership view names "gone" dead and says nothing of "lost": gone's leases are free,
    // lost's are nobody's (not taken, not in any quota); without a view both are dead.
    let mut table = Table::default();
    table
        .add(2, Some("a"))
        .add(4, Some("gone"))
        .add(4, Some("lost"));
    let mut census = Census::new();
    for l in &table.leases {
        census.insert(Arc::new(l.clone()));
    }
    let live = hosts(&["a", "b"]);
    let dead: BTreeSet<HostName> = [host("gone")].into();
    let plan = |me: &str, dead: Option<&BTreeSet<HostName>>| {
        EqualShare::default()
            .plan_census(&CensusSnapshot {
                me: &host(me),
                live_hosts: &live,
                dead_hosts: dead,
                census: &census,
                handoff_overdue: &|_| false,
            })
            .expect("equal share plans from a census")
    };
    // With the view: 6 eligible leases (a's 2, gone's 4), quota 3 each.
    assert_eq!(plan("a", Some(&dead)).take, pids([2]));
    assert_eq!(plan("b", Some(&dead)).take, pids(3..6));
    // Without: all 10 count, and lost's are free too.
    assert_eq!(plan("a", None).take, pids(2..5));
    assert_eq!(plan("b", None).take, pids(5..10));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// (b) The census path gives every host exactly the snapshot path's plan.
    #[test]
    fn census_plan_equals_snapshot_plan(case in gen_case()) {
        for (by_census, by_snapshot) in case.plans(&case.census()) {
            prop_assert_eq!(by_census, by_snapshot);
        }
    }

    /// (a) A census kept up to date through changed rows (owner, next owner, state,
    /// eligibility) and removals equals a fresh count of the resulting table, its hand-off
    /// indexes agree with its leases after every change, and it plans alike.
    #[test]
    fn census_kept_by_changes_equals_a_fresh_count(
        mut case in gen_case(),
        changes in proptest::collection::vec((any::<prop::sample::Index>(), proptest::option::weighted(0.9, gen_row(8))), 0..40),
    ) {
        let mut census = case.census();
        indexes_agree(&census)?;
        for (at, change) in changes {
            if case.rows.is_empty() {
                break;
            }
            let i = at.index(case.rows.len());
            let (old, eligible, _) = case.rows[i].clone();
            if eligible {
                let counted = old.state != LeaseState::Finished;
                prop_assert_eq!(census.remove(&old), counted, "a counted row is removed");
            }
            match change {
                Some(g) => {
                    let n = case.universe.len();
                    let g = (g.0, g.1.map(|o| o % n), g.2.map(|a| a % n), g.3, g.4);
                    let fresh = row(0, &case.universe, g);
                    let mut new = Lease::clone(&old);
                    (new.state, new.owner, new.next_owner) = (fresh.state, fresh.owner, fresh.next_owner);
                    new.version = old.version.next();
                    let new = Arc::new(new);
                    if g.3 {
                        census.insert(new.clone());
                    }
                    case.rows[i] = (new, g.3, g.4);
                }
                None => {
                    case.rows.remove(i);
                }
            }
            indexes_agree(&census)?;
        }
        prop_assert_eq!(&census, &case.census());
        for (by_census, by_snapshot) in case.plans(&census) {
            prop_assert_eq!(by_census, by_snapshot);
        }
    }
}
