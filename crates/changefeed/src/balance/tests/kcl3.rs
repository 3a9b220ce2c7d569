//! Tests of [`Kcl3Like`], KCL 3.x's leader-driven assignment: unit cases on
//! one snapshot, then property tests over fleets run round by round as in the parent module.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn plan3(table: &Table, me: &str, live: &[&str]) -> Plan {
    let live = hosts(live);
    let me = host(me);
    let views = table.views();
    Kcl3Like.plan(&Snapshot {
        me: &me,
        live_hosts: &live,
        leases: &views,
    })
}

/// Every live host's plan on one snapshot.
fn plans3(table: &Table, live: &[&str]) -> Vec<(HostName, Plan)> {
    live.iter()
        .map(|me| (host(me), plan3(table, me, live)))
        .collect()
}

/// Every partition the plans name, failing if one is named twice.
fn named_once(plans: &[(HostName, Plan)]) -> BTreeSet<PartitionId> {
    claimed(plans.iter().map(|(_, plan)| plan))
}

#[test]
fn the_leader_is_the_first_live_host_by_name() {
    assert_eq!(Kcl3Like::leader(&hosts(&["c", "a", "b"])), Some(&host("a")));
    assert_eq!(Kcl3Like::leader(&[]), None);
}

#[test]
fn a_newcomer_gets_its_share_in_one_assignment_round() {
    // Ten hosts with 100 leases each; an eleventh joins. The leader moves 90 leases to it in
    // one round (1000 / 11 = 90 rest 10), from the most-loaded hosts, as hand-offs.
    let old: Vec<String> = (0..10).map(|i| format!("h{i}")).collect();
    let mut table = Table::default();
    for i in 0..1000 {
        table.add(1, Some(&old[i % 10]));
    }
    let mut live: Vec<&str> = old.iter().map(String::as_str).collect();
    live.push("new");
    live.sort_unstable();
    let plans = plans3(&table, &live);
    named_once(&plans);
    for (me, plan) in &plans {
        assert!(plan.take.is_empty() && plan.steal.is_empty() && plan.release.is_empty());
        if me.as_str() == "new" {
            assert_eq!(plan.request_handoff.len(), 90);
            let from = handoffs(plan);
            assert_eq!(from.len(), 10, "every old host gives: {from:?}");
            assert!(from.values().all(|&n| n == 9), "9 from each: {from:?}");
        } else {
            assert!(plan.is_empty(), "{me} is not under-loaded");
        }
    }
    // Once the hand-offs are honoured, the fleet is within one lease everywhere and rests.
    for (_, plan) in &plans {
        for r in &plan.request_handoff {
            let i = table
                .leases
                .iter()
                .position(|l| l.key.partition == r.partition)
                .expect("planned lease exists");
            table.leases[i].owner = Some(host("new"));
        }
    }
    assert!(plans3(&table, &live).iter().all(|(_, p)| p.is_empty()));
}

#[test]
fn a_dead_hosts_leases_are_reassigned_to_the_least_loaded() {
    // a holds 12, b 10, c 8; "dead" held 30. The leader assigns the 30 one at a time to the
    // least-loaded host: c first, then c and b, then all three, ending at 20 each.
    let mut table = Table::default();
    table
        .add(12, Some("a"))
        .add(10, Some("b"))
        .add(8, Some("c"))
        .add(30, Some("dead"));
    let live = ["a", "b", "c"];
    let plans = plans3(&table, &live);
    let taken = named_once(&plans);
    assert_eq!(taken.into_iter().collect::<Vec<_>>(), pids(30..60));
    let counts: BTreeMap<String, usize> = plans
        .iter()
        .map(|(h, p)| {
            assert!(p.request_handoff.is_empty() && p.steal.is_empty() && p.release.is_empty());
            (h.to_string(), p.take.len())
        })
        .collect();
    assert_eq!(
        counts,
        BTreeMap::from([("a".into(), 8), ("b".into(), 10), ("c".into(), 12)])
    );
}

#[test]
fn nothing_moves_at_balance() {
    let mut table = Table::default();
    table
        .add(4, Some("a"))
        .add(3, Some("b"))
        .add(4, Some("c"))
        .add(3, Some("d"));
    let live = ["a", "b", "c", "d"];
    for (me, plan) in plans3(&table, &live) {
        assert!(plan.is_empty(), "{me} moves nothing");
    }
}

#[test]
fn an_assignment_in_flight_stands_and_times_out_into_a_steal() {
    // The leader had moved lease 0 from a to b (next_owner = b): b counts it, nobody else asks
    // for it, b waits for the graceful hand-off, then takes it when it is overdue.
    let mut table = Table::default();
    table.add(2, Some("a"));
    table.leases[0].next_owner = Some(host("b"));
    let live = ["a", "b"];
    for (me, plan) in plans3(&table, &live) {
        assert!(plan.is_empty(), "{me}: the move is in flight");
    }
    table.overdue[0] = true;
    assert_eq!(plan3(&table, "b", &live).steal, pids([0]));
    assert!(plan3(&table, "a", &live).is_empty());
    // If a dies meanwhile, b takes the lease it was assigned; the other goes to b as well.
    assert_eq!(plan3(&table, "b", &["b"]).take, pids([0, 1]));
}

#[test]
fn ineligible_leases_are_never_taken() {
    let mut table = Table::default();
    table.add(4, None);
    table.eligible[0] = false;
    table.leases[1].state = LeaseState::Finished;
    let taken = named_once(&plans3(&table, &["a", "b"]));
    assert_eq!(taken.into_iter().collect::<Vec<_>>(), pids([2, 3]));
    assert!(plan3(&table, "x", &["a", "b"]).is_empty(), "x is not live");
}

/// Runs `fleet` round by round with [`Kcl3Like`] until a round changes nothing; returns the
/// rounds that changed something.
fn run3(fleet: &mut Fleet, max_rounds: usize) -> Result<usize, String> {
    for round in 0..=max_rounds {
        let views = fleet.table.views();
        let plans: Vec<(HostName, Plan)> = fleet
            .live
            .iter()
            .map(|me| {
                let plan = Kcl3Like.plan(&Snapshot {
                    me,
                    live_hosts: &fleet.live,
                    leases: &views,
                });
                (me.clone(), plan)
            })
            .collect();
        drop(views);
        let before = (fleet.table.leases.clone(), fleet.table.overdue.clone());
        fleet.apply(&plans);
        if plans.iter().all(|(_, p)| p.is_empty())
            && (&before.0, &before.1) == (&fleet.table.leases, &fleet.table.overdue)
        {
            return Ok(round);
        }
    }
    Err(format!("still moving after {max_rounds} rounds"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Plans made from one snapshot never name a lease twice, never take a lease a live host
    /// owns, and steal only overdue hand-offs to the planner.
    #[test]
    fn plans_of_one_snapshot_name_each_lease_once(fleet in gen_fleet(true)) {
        let views = fleet.table.views();
        let by_partition: BTreeMap<&PartitionId, &LeaseView<'_>> =
            views.iter().map(|v| (&v.lease.key.partition, v)).collect();
        let mut claimed: BTreeMap<PartitionId, HostName> = BTreeMap::new();
        for me in &fleet.live {
            let plan = Kcl3Like.plan(&Snapshot { me, live_hosts: &fleet.live, leases: &views });
            prop_assert!(plan.release.is_empty());
            for p in &plan.take {
                let l = by_partition[p];
                prop_assert!(l.eligible);
                let held = l.lease.state == LeaseState::Owned
                    && l.lease.owner.as_ref().is_some_and(|o| fleet.is_live(o));
                prop_assert!(!held, "{me} takes {p} owned by live {:?}", l.lease.owner);
            }
            for p in &plan.steal {
                let l = by_partition[p];
                prop_assert!(l.eligible && l.handoff_overdue);
                prop_assert_eq!(l.lease.next_owner.as_ref(), Some(me));
            }
            for r in &plan.request_handoff {
                let l = by_partition[&r.partition];
                prop_assert_eq!(l.lease.owner.as_ref(), Some(&r.from));
                prop_assert!(fleet.is_live(&r.from) && &r.from != me);
            }
            let asked = plan.request_handoff.iter().map(|r| &r.partition);
            for p in plan.take.iter().chain(&plan.steal).chain(asked) {
                if let Some(other) = claimed.insert(p.clone(), me.clone()) {
                    prop_assert!(false, "{p} claimed by {other} and {me}");
                }
            }
        }
    }

    /// A fleet sharing one snapshot per round comes to rest within four rounds with every
    /// eligible lease owned by a live host and every host within one lease of every other.
    #[test]
    fn fleet_comes_to_rest_within_one_lease(mut fleet in gen_fleet(true)) {
        let rounds = run3(&mut fleet, 4).map_err(TestCaseError::fail)?;
        prop_assert!(rounds <= 4);
        let mut owned: BTreeMap<&HostName, usize> = fleet.live.iter().map(|h| (h, 0)).collect();
        for (l, &eligible) in fleet.table.leases.iter().zip(&fleet.table.eligible) {
            if !eligible {
                continue;
            }
            let owner = l.owner.as_ref().filter(|o| fleet.is_live(o));
            prop_assert!(owner.is_some(), "lease {} has no live owner", l.key);
            if let Some(o) = owner {
                *owned.entry(o).or_insert(0) += 1;
            }
        }
        let (min, max) = (owned.values().min(), owned.values().max());
        prop_assert!(max.zip(min).is_none_or(|(max, min)| max - min <= 1), "{owned:?}");
    }
}
