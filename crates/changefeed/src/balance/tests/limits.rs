//! Tests of lease limits under [`EqualShare`]: the minimum and maximum
//! counterparts of Cosmos's balancing tests, then property tests over fleets with fleet-wide
//! and per-host limits, run round by round as in the parent module.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn limits(min: usize, max: Option<usize>) -> LeaseLimits {
    LeaseLimits::new(min, max).expect("valid limits")
}

fn fleet_wide(min: usize, max: Option<usize>) -> EqualShare {
    EqualShare::with_limits(limits(min, max))
}

#[test]
fn a_host_with_a_minimum_takes_it_even_above_its_equal_share() {
    // Cosmos's minimum-count test: a peer owns one live lease and ten leases of a dead host are
    // free. Alone, "me" would take its equal share (5); with a minimum of 7 it takes 7, and the
    // peer's share shrinks to make room.
    let mut table = Table::default();
    table.add(1, Some("peer")).add(10, Some("dead"));
    let live = ["me", "peer"];
    assert_eq!(table.plan("me", &live).take.len(), 5, "equal share");
    let strategy = EqualShare::default().with_host_limits(host("me"), limits(7, None));
    let mine = table.plan_with(&strategy, "me", &live);
    let theirs = table.plan_with(&strategy, "peer", &live);
    assert_eq!(mine.take.len(), 7);
    assert_eq!(theirs.take.len(), 3);
    assert_eq!(
        claimed([&mine, &theirs]).len(),
        10,
        "every free lease, once"
    );
    let q = strategy.quotas(&hosts(&live), &table.views());
    assert_eq!(q, BTreeMap::from([(host("me"), 7), (host("peer"), 4)]));
}

#[test]
fn a_host_at_its_maximum_takes_no_more_and_the_rest_goes_to_the_others() {
    // Cosmos's maximum-count test, same table: with a maximum of 3, "me" takes 3, and what it
    // may not hold goes to the peer instead of staying free.
    let mut table = Table::default();
    table.add(1, Some("peer")).add(10, Some("dead"));
    let live = ["me", "peer"];
    let strategy = EqualShare::default().with_host_limits(host("me"), limits(0, Some(3)));
    let mine = table.plan_with(&strategy, "me", &live);
    let theirs = table.plan_with(&strategy, "peer", &live);
    assert_eq!(mine.take.len(), 3);
    assert_eq!(theirs.take.len(), 7);
    assert_eq!(
        claimed([&mine, &theirs]).len(),
        10,
        "every free lease, once"
    );
    assert!(mine.release.is_empty() && theirs.release.is_empty());
}

#[test]
fn a_fleet_wide_minimum_fills_hosts_one_after_another_when_leases_are_short() {
    // Ten leases cannot give three hosts four each: the host already holding most fills up
    // first, then the others by name, and the last gets what is left (4, 4, 2), rather than
    // every host getting a share below its minimum (4, 3, 3).
    let mut table = Table::default();
    table.add(3, Some("c")).add(7, None);
    let live = ["a", "b", "c"];
    let strategy = fleet_wide(4, None);
    let q = strategy.quotas(&hosts(&live), &table.views());
    assert_eq!(
        q,
        BTreeMap::from([(host("a"), 4), (host("b"), 2), (host("c"), 4)])
    );
    let plans: Vec<Plan> = live
        .iter()
        .map(|me| table.plan_with(&strategy, me, &live))
        .collect();
    let taken: Vec<usize> = plans.iter().map(|p| p.take.len()).collect();
    assert_eq!(taken, [4, 2, 1]);
    assert_eq!(claimed(&plans).len(), 7);
}

#[test]
fn leases_beyond_every_hosts_maximum_stay_free_and_nothing_moves() {
    // Two hosts with a maximum of 3 and ten leases: each takes 3, and the other four stay free
    // because no host may hold them; then the fleet plans nothing.
    let mut table = Table::default();
    table.add(10, None);
    let live = ["a", "b"];
    let strategy = fleet_wide(0, Some(3));
    let a = table.plan_with(&strategy, "a", &live);
    let b = table.plan_with(&strategy, "b", &live);
    assert_eq!((a.take.clone(), b.take.clone()), (pids(0..3), pids(3..6)));
    let mut after = Table::default();
    after.add(3, Some("a")).add(3, Some("b")).add(4, None);
    for me in live {
        assert!(after.plan_with(&strategy, me, &live).is_empty(), "{me}");
    }
}

#[test]
fn a_host_above_its_maximum_hands_off_what_is_asked_for_and_releases_the_rest() {
    // A maximum lowered to 4 under a host holding 10: the newcomer asks for its 4 by hand-off
    // (no gap), and the owner releases only the 2 nobody may take, not the asked-for ones.
    let mut table = Table::default();
    table.add(10, Some("a"));
    let live = ["a", "b"];
    let strategy = fleet_wide(0, Some(4));
    let a = table.plan_with(&strategy, "a", &live);
    let b = table.plan_with(&strategy, "b", &live);
    assert_eq!(handoffs(&b), BTreeMap::from([("a".to_string(), 4)]));
    assert!(a.take.is_empty() && a.request_handoff.is_empty());
    assert_eq!(a.release, pids([4, 5]));
    assert_eq!(claimed([&a, &b]).len(), 6);
    // Alone, it releases everything above its maximum.
    assert_eq!(table.plan_with(&strategy, "a", &["a"]).release, pids(0..6));
    // Without a maximum it waits to be asked, as ever.
    assert!(table.plan("a", &live).is_empty());
}

#[test]
fn a_lowered_maximum_moves_leases_by_handoff_when_others_have_room() {
    // 8 and 2 under a maximum of 5: the other host asks for all 3, nothing is released.
    let mut table = Table::default();
    table.add(8, Some("a")).add(2, Some("b"));
    let live = ["a", "b"];
    let strategy = fleet_wide(0, Some(5));
    assert!(table.plan_with(&strategy, "a", &live).is_empty());
    assert_eq!(
        handoffs(&table.plan_with(&strategy, "b", &live)),
        BTreeMap::from([("a".to_string(), 3)])
    );
}

#[test]
fn limits_that_break_a_rule_are_refused_naming_the_setting() {
    // DESIGN "Bad input": the error names the setting and the rule.
    let err = LeaseLimits::new(0, Some(0)).expect_err("max 0");
    assert_eq!(err.setting, "max_leases");
    assert!(
        err.to_string()
            .starts_with("max_leases: must be at least 1"),
        "{err}"
    );
    let err = LeaseLimits::new(5, Some(2)).expect_err("min above max");
    assert_eq!(
        err.to_string(),
        "min_leases: 5 must not exceed max_leases (2)"
    );
    assert_eq!(limits(2, Some(2)).max_leases(), Some(2));
    assert_eq!(limits(3, None).min_leases(), 3);
    assert!(LeaseLimits::default().is_none());
    assert_eq!(fleet_wide(0, None), EqualShare::default());
    assert!(EqualShare::default().is_unlimited());
    assert!(!fleet_wide(1, None).is_unlimited());
}

// ---------------------------------------------------------------------------------------------
// Property tests.

/// A minimum of 0 to 5 and, mostly, a maximum of 1 to 8 (at least the minimum): with up to 8
/// hosts and 80 leases, minimums and maximums both bind in many cases and not in others.
pub(super) fn gen_limits() -> impl Strategy<Value = LeaseLimits> {
    (0usize..=5, proptest::option::weighted(0.7, 1usize..=8))
        .prop_map(|(min, max)| limits(min, max.map(|m| m.max(min))))
}

/// A fleet (see [`gen_fleet`]) whose hosts plan with fleet-wide limits, and a third of the
/// hosts with limits of their own.
fn gen_limited_fleet(with_requests: bool) -> impl Strategy<Value = Fleet> {
    (
        gen_fleet(with_requests),
        gen_limits(),
        proptest::collection::vec(proptest::option::weighted(0.3, gen_limits()), 8),
    )
        .prop_map(|(mut fleet, every, own)| {
            let mut strategy = EqualShare::with_limits(every);
            for (h, l) in fleet.universe.iter().zip(own) {
                if let Some(l) = l {
                    strategy = strategy.with_host_limits(h.clone(), l);
                }
            }
            fleet.strategy = strategy;
            fleet
        })
}

/// Eligible leases per live host, and how many eligible leases no live host owns.
fn holdings(fleet: &Fleet) -> (BTreeMap<HostName, usize>, usize) {
    let mut owned: BTreeMap<HostName, usize> = fleet.live.iter().map(|h| (h.clone(), 0)).collect();
    let mut free = 0;
    for (l, &eligible) in fleet.table.leases.iter().zip(&fleet.table.eligible) {
        if !eligible {
            continue;
        }
        match l.owner.as_ref().filter(|o| fleet.is_live(o)) {
            Some(o) if l.state == LeaseState::Owned => *owned.entry(o.clone()).or_insert(0) += 1,
            _ => free += 1,
        }
    }
    (owned, free)
}

/// Eligible leases per live host as the planner counts them: owned by it, less those a live
/// host asked it for, plus those it asked a live owner for.
fn holding(fleet: &Fleet) -> BTreeMap<&HostName, usize> {
    let mut holding: BTreeMap<&HostName, usize> = fleet.live.iter().map(|h| (h, 0)).collect();
    for (l, &eligible) in fleet.table.leases.iter().zip(&fleet.table.eligible) {
        let Some(o) = l.owner.as_ref().filter(|o| eligible && fleet.is_live(o)) else {
            continue;
        };
        let to = l
            .next_owner
            .as_ref()
            .filter(|n| fleet.is_live(n))
            .unwrap_or(o);
        *holding.entry(to).or_insert(0) += 1;
    }
    holding
}

fn eligible(fleet: &Fleet) -> usize {
    fleet.table.eligible.iter().filter(|e| **e).count()
}

/// Runs the fleet to rest (limits can take a round more than plain equal share: a host above
/// its maximum may first have to steal, then release).
fn rest(fleet: &mut Fleet) -> Result<(), TestCaseError> {
    run_to_rest(fleet, 6).map_err(TestCaseError::fail)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// From a snapshot with no pending hand-offs, one round of plans leaves every host with
    /// exactly its quota, and so never above its maximum, once they are carried out.
    #[test]
    fn no_plan_puts_a_host_above_its_maximum(fleet in gen_limited_fleet(false)) {
        let (owned, _) = holdings(&fleet);
        let mut count: BTreeMap<HostName, i64> =
            owned.into_iter().map(|(h, n)| (h, n as i64)).collect();
        for (me, plan) in fleet.plans() {
            let gained = plan.take.len() + plan.steal.len() + plan.request_handoff.len();
            *count.entry(me.clone()).or_insert(0) += gained as i64 - plan.release.len() as i64;
            for r in &plan.request_handoff {
                *count.entry(r.from.clone()).or_insert(0) -= 1;
            }
        }
        let quotas = fleet.strategy.quotas(&fleet.live, &fleet.table.views());
        for (h, &n) in &count {
            let max = fleet.strategy.limits_of(h).max_leases().map_or(i64::MAX, |m| m as i64);
            prop_assert!(n <= max, "{} planned to hold {} above its maximum {}", h, n, max);
            prop_assert_eq!(n, quotas[h] as i64, "{} planned to hold {}, quota {}", h, n, quotas[h]);
        }
    }

    /// Whatever the starting table (pending and stale requests, unresponsive owners), a fleet
    /// comes to rest with no host above its maximum, holding its quota.
    #[test]
    fn at_rest_no_host_holds_more_than_its_maximum(mut fleet in gen_limited_fleet(true)) {
        rest(&mut fleet)?;
        let (owned, _) = holdings(&fleet);
        let quotas = fleet.strategy.quotas(&fleet.live, &fleet.table.views());
        for (h, n) in &owned {
            let max = fleet.strategy.limits_of(h).max_leases().unwrap_or(usize::MAX);
            prop_assert!(*n <= max, "{} holds {} above its maximum {}", h, n, max);
            prop_assert_eq!(*n, quotas[h], "{} holds {}, quota {}", h, n, quotas[h]);
        }
    }

    /// When the eligible leases cover every live host's minimum, every host reaches it.
    #[test]
    fn when_the_total_permits_every_host_reaches_its_minimum(mut fleet in gen_limited_fleet(true)) {
        rest(&mut fleet)?;
        let minimums: usize = fleet.live.iter().map(|h| fleet.strategy.limits_of(h).min_leases()).sum();
        prop_assume!(minimums <= eligible(&fleet));
        let (owned, _) = holdings(&fleet);
        for (h, n) in &owned {
            let min = fleet.strategy.limits_of(h).min_leases();
            prop_assert!(*n >= min, "{} holds {} below its minimum {}", h, n, min);
        }
    }

    /// Leases that no host may take stay free only when every live host is at its maximum.
    #[test]
    fn free_leases_stay_free_only_when_every_host_is_at_its_maximum(
        mut fleet in gen_limited_fleet(true),
    ) {
        rest(&mut fleet)?;
        let (owned, free) = holdings(&fleet);
        if free > 0 {
            for (h, n) in &owned {
                let max = fleet.strategy.limits_of(h).max_leases();
                prop_assert_eq!(Some(*n), max, "{} free leases while {} holds {}", free, h, n);
            }
        }
    }

    /// With limits that do not bind (a minimum no host's equal share is below, a maximum no
    /// host's share or holding is above), every host plans exactly what it plans today.
    #[test]
    fn limits_that_do_not_bind_plan_as_today(
        fleet in gen_fleet(true),
        min_pick in 0usize..=100,
        max_slack in proptest::option::of(0usize..3),
    ) {
        let views = fleet.table.views();
        let plain = EqualShare::default();
        let quotas = plain.quotas(&fleet.live, &views);
        let fewest = quotas.values().copied().min().unwrap_or(0);
        let most = quotas.values().copied().max().unwrap_or(0);
        let held = holding(&fleet).values().copied().max().unwrap_or(0);
        let min = min_pick % (fewest + 1);
        let max = max_slack.map(|s| most.max(held).max(1) + s);
        let limited = fleet_wide(min, max);
        prop_assert_eq!(limited.quotas(&fleet.live, &views), quotas);
        for me in &fleet.universe {
            let snapshot = Snapshot { me, live_hosts: &fleet.live, leases: &views };
            prop_assert_eq!(limited.plan(&snapshot), plain.plan(&snapshot), "{}", me);
        }
    }

    /// Plans with limits stay disjoint and deterministic, and a host releases only leases it
    /// owns that no live host asked for, and only when it holds more than its maximum
    /// (counting the hand-offs it asked for).
    #[test]
    fn plans_with_limits_are_disjoint_and_release_only_unasked_own_leases(
        fleet in gen_limited_fleet(true),
    ) {
        let views = fleet.table.views();
        let mut reversed = views.clone();
        reversed.reverse();
        let holding = holding(&fleet);
        let plans = fleet.plans();
        let mut named = BTreeMap::new();
        for (me, plan) in &plans {
            let again = fleet.strategy.plan(&Snapshot {
                me,
                live_hosts: &fleet.live,
                leases: &reversed,
            });
            prop_assert_eq!(plan, &again);
            let asked = plan.request_handoff.iter().map(|r| &r.partition);
            for p in plan.take.iter().chain(&plan.steal).chain(asked).chain(&plan.release) {
                if let Some(other) = named.insert(p.clone(), me.clone()) {
                    prop_assert!(false, "{} named by {} and {}", p, other, me);
                }
            }
            if !plan.release.is_empty() {
                let max = fleet.strategy.limits_of(me).max_leases();
                prop_assert!(
                    max.is_some_and(|max| holding[me] > max),
                    "{} releases within its maximum", me
                );
            }
            for p in &plan.release {
                let l = views.iter().find(|v| &v.lease.key.partition == p).expect("planned lease");
                prop_assert!(l.eligible && l.lease.is_owned_by(me), "{} releases {} it does not own", me, p);
                let pending = l.lease.next_owner.as_ref().is_some_and(|n| n != me && fleet.is_live(n));
                prop_assert!(!pending, "{} releases {} a live host asked for", me, p);
            }
        }
    }

    /// Quotas stay within every host's limits where the leases allow, and share every lease
    /// the maximums allow.
    #[test]
    fn quotas_with_limits_stay_within_them(fleet in gen_limited_fleet(true)) {
        let q = fleet.strategy.quotas(&fleet.live, &fleet.table.views());
        let bounds: Vec<(usize, usize)> = fleet
            .live
            .iter()
            .map(|h| {
                let l = fleet.strategy.limits_of(h);
                (l.min_leases(), l.max_leases().unwrap_or(usize::MAX))
            })
            .collect();
        let e = eligible(&fleet);
        let ceiling = bounds.iter().map(|b| b.1).fold(0usize, usize::saturating_add);
        prop_assert_eq!(q.values().sum::<usize>(), e.min(ceiling));
        let covered = bounds.iter().map(|b| b.0).sum::<usize>() <= e;
        for (h, &(min, max)) in fleet.live.iter().zip(&bounds) {
            prop_assert!(q[h] <= max, "{} quota {} above {}", h, q[h], max);
            if covered {
                prop_assert!(q[h] >= min, "{} quota {} below {}", h, q[h], min);
            } else {
                prop_assert!(q[h] <= min, "{} quota {} above its minimum {} when leases are short", h, q[h], min);
            }
        }
    }
}
