//! Tests of the balancing rules (`DESIGN.md`, "Balancing"): unit cases, then property tests
//! that run whole fleets round by round on one shared snapshot per round.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::model::{GroupName, LeaseKey, LeaseState, Position};

mod census;
mod kcl3;
mod limits;
mod load_share;

fn host(name: &str) -> HostName {
    HostName::new(name).expect("valid host name")
}

fn hosts(names: &[&str]) -> Vec<HostName> {
    names.iter().map(|n| host(n)).collect()
}

fn pid(i: usize) -> PartitionId {
    PartitionId::new(format!("{i:04}")).expect("valid partition id")
}

fn pids(ids: impl IntoIterator<Item = usize>) -> Vec<PartitionId> {
    ids.into_iter().map(pid).collect()
}

fn lease(i: usize, owner: Option<&str>) -> Lease {
    let key = LeaseKey::new(GroupName::new("g").expect("valid group"), pid(i));
    let mut lease = Lease::new(key, Position::Beginning);
    if let Some(owner) = owner {
        lease.state = LeaseState::Owned;
        lease.owner = Some(host(owner));
    }
    lease
}

/// A lease table plus the shell's judgements about each lease.
#[derive(Debug, Clone, Default)]
struct Table {
    leases: Vec<Lease>,
    eligible: Vec<bool>,
    overdue: Vec<bool>,
}

impl Table {
    /// Adds `count` leases owned by `owner` (`None`: available); partitions are numbered in
    /// insertion order.
    fn add(&mut self, count: usize, owner: Option<&str>) -> &mut Self {
        for _ in 0..count {
            let i = self.leases.len();
            self.leases.push(lease(i, owner));
            self.eligible.push(true);
            self.overdue.push(false);
        }
        self
    }

    fn views(&self) -> Vec<LeaseView<'_>> {
        self.leases
            .iter()
            .zip(self.eligible.iter().zip(&self.overdue))
            .map(|(lease, (&eligible, &handoff_overdue))| LeaseView {
                lease,
                eligible,
                handoff_overdue,
            })
            .collect()
    }

    fn plan(&self, me: &str, live: &[&str]) -> Plan {
        self.plan_with(&EqualShare::default(), me, live)
    }

    fn plan_with(&self, strategy: &EqualShare, me: &str, live: &[&str]) -> Plan {
        let live = hosts(live);
        let me = host(me);
        let views = self.views();
        strategy.plan(&Snapshot {
            me: &me,
            live_hosts: &live,
            leases: &views,
        })
    }

    fn quotas(&self, live: &[&str]) -> BTreeMap<String, usize> {
        quotas(&hosts(live), &self.views())
            .into_iter()
            .map(|(h, q)| (h.to_string(), q))
            .collect()
    }
}

/// Every partition the plans name (taken, stolen, asked for or released), failing if two
/// plans, or one plan twice, name the same partition.
fn claimed<'a>(plans: impl IntoIterator<Item = &'a Plan>) -> BTreeSet<PartitionId> {
    let mut all = BTreeSet::new();
    for plan in plans {
        let asked = plan.request_handoff.iter().map(|r| &r.partition);
        for p in plan
            .take
            .iter()
            .chain(&plan.steal)
            .chain(asked)
            .chain(&plan.release)
        {
            assert!(all.insert(p.clone()), "{p} is named twice: {plan:?}");
        }
    }
    all
}

fn handoffs(plan: &Plan) -> BTreeMap<String, usize> {
    let mut from = BTreeMap::new();
    for r in &plan.request_handoff {
        *from.entry(r.from.to_string()).or_insert(0) += 1;
    }
    from
}

#[test]
fn empty_snapshot_plans_nothing() {
    // No leases, or no fleet, or a host that is not itself live: nothing to do.
    let table = Table::default();
    assert!(table.plan("a", &["a", "b"]).is_empty());
    let mut table = Table::default();
    table.add(3, None);
    assert!(table.plan("a", &[]).is_empty());
    assert!(table.plan("a", &["b"]).is_empty(), "a is not live");
    assert!(table.quotas(&[]).is_empty());
}

#[test]
fn single_host_takes_every_free_lease() {
    // The only live host's quota is every eligible lease, free or held by the dead.
    let mut table = Table::default();
    table.add(5, None).add(3, Some("dead"));
    let plan = table.plan("a", &["a"]);
    assert_eq!(plan.take, pids(0..8));
    assert!(plan.request_handoff.is_empty() && plan.steal.is_empty() && plan.release.is_empty());
}

#[test]
fn new_host_among_ten_requests_its_whole_shortfall_in_one_cycle() {
    // DESIGN "Balancing": ask for every lease still needed in the same cycle, from hosts over
    // quota, each giving exactly its excess.
    let old: Vec<String> = (0..9).map(|i| format!("h{i}")).collect();
    let mut table = Table::default();
    for i in 0..1000 {
        table.add(1, Some(&old[i % 9]));
    }
    let mut live: Vec<&str> = old.iter().map(String::as_str).collect();
    live.push("new");
    live.sort_unstable();
    let plan = table.plan("new", &live);
    assert!(plan.take.is_empty() && plan.steal.is_empty());
    assert_eq!(plan.request_handoff.len(), 100);
    let mut expected = BTreeMap::new();
    for (i, h) in old.iter().enumerate() {
        // h0 owns 112 leases, the others 111; every quota is 100.
        expected.insert(h.clone(), if i == 0 { 12 } else { 11 });
    }
    assert_eq!(handoffs(&plan), expected);
    for h in &old {
        assert!(table.plan(h, &live).is_empty(), "{h} waits to be asked");
    }
}

#[test]
fn dead_hosts_leases_are_taken_in_one_pass() {
    // DESIGN "Balancing": take all free and expired leases up to quota in one pass; hosts of
    // one snapshot split them without racing.
    let mut table = Table::default();
    table
        .add(10, Some("a"))
        .add(10, Some("b"))
        .add(10, Some("c"))
        .add(30, Some("dead"));
    let live = ["a", "b", "c"];
    let mut taken = BTreeSet::new();
    for me in live {
        let plan = table.plan(me, &live);
        assert_eq!(plan.take.len(), 10, "{me} takes its shortfall at once");
        assert!(plan.request_handoff.is_empty());
        for p in plan.take {
            assert!(taken.insert(p), "two hosts take the same lease");
        }
    }
    assert_eq!(taken.into_iter().collect::<Vec<_>>(), pids(30..60));
}

#[test]
fn remainder_goes_to_current_holders_then_by_name() {
    // DESIGN "Balancing": the E % H extra leases go to the hosts holding most, ties by name.
    let mut table = Table::default();
    table.add(3, Some("a")).add(4, Some("b")).add(3, Some("c"));
    let q = table.quotas(&["a", "b", "c"]);
    assert_eq!(
        q,
        BTreeMap::from([("a".into(), 3), ("b".into(), 4), ("c".into(), 3)])
    );
    let mut fresh = Table::default();
    fresh.add(10, None);
    let q = fresh.quotas(&["a", "b", "c"]);
    assert_eq!(
        q,
        BTreeMap::from([("a".into(), 4), ("b".into(), 3), ("c".into(), 3)])
    );
    assert_eq!(fresh.plan("a", &["a", "b", "c"]).take, pids(0..4));
    assert_eq!(fresh.plan("b", &["a", "b", "c"]).take, pids(4..7));
    assert_eq!(fresh.plan("c", &["a", "b", "c"]).take, pids(7..10));
}

#[test]
fn balanced_fleet_plans_nothing() {
    // DESIGN "Balancing": no movement when every host is within one lease of its quota.
    let mut table = Table::default();
    table
        .add(4, Some("a"))
        .add(3, Some("b"))
        .add(4, Some("c"))
        .add(3, Some("d"));
    let live = ["a", "b", "c", "d"];
    for me in live {
        assert!(table.plan(me, &live).is_empty(), "{me} moves nothing");
    }
}

#[test]
fn lease_already_requested_by_another_host_is_not_requested_again() {
    // A lease whose next_owner is a live host is spoken for: nobody asks for it again, and the
    // asker counts it toward its share.
    let mut table = Table::default();
    table.add(4, Some("a"));
    table.leases[0].next_owner = Some(host("c"));
    let live = ["a", "b", "c"];
    let plan = table.plan("b", &live);
    assert_eq!(plan.request_handoff.len(), 1);
    assert_ne!(plan.request_handoff[0].partition, pid(0));
    assert!(table.plan("c", &live).is_empty(), "c's request is pending");
}

#[test]
fn overdue_handoff_is_stolen_and_a_pending_one_is_waited_for() {
    // DESIGN "Balancing": fall back to stealing only if the hand-off is not honoured in time.
    let mut table = Table::default();
    table.add(2, Some("a"));
    table.leases[1].next_owner = Some(host("b"));
    assert!(
        table.plan("b", &["a", "b"]).is_empty(),
        "still within the timeout"
    );
    table.overdue[1] = true;
    let plan = table.plan("b", &["a", "b"]);
    assert_eq!(plan.steal, pids([1]));
    assert!(plan.take.is_empty() && plan.request_handoff.is_empty());
}

#[test]
fn requested_lease_whose_owner_died_is_taken() {
    // A lease whose owner is not live is free; the host that asked for it gets it first.
    let mut table = Table::default();
    table.add(1, Some("dead")).add(1, Some("c"));
    table.leases[0].next_owner = Some(host("b"));
    let live = ["a", "b", "c"];
    assert_eq!(table.plan("b", &live).take, pids([0]));
    assert!(table.plan("a", &live).is_empty());
}

#[test]
fn stale_request_from_a_dead_host_is_overwritten_first() {
    // A next_owner naming a dead host is stale: the lease may be asked for, and is asked for
    // first, so it moves once rather than to the dead host and back.
    let mut table = Table::default();
    table.add(4, Some("a"));
    table.leases[2].next_owner = Some(host("dead"));
    let plan = table.plan("b", &["a", "b"]);
    let asked: Vec<_> = plan
        .request_handoff
        .iter()
        .map(|r| r.partition.clone())
        .collect();
    assert_eq!(asked, pids([0, 2]));
}

#[test]
fn ineligible_leases_are_never_taken_and_count_for_nobody() {
    // DESIGN rule 5 / "Balancing": quotas divide eligible leases only.
    let mut table = Table::default();
    table.add(4, None).add(2, Some("a"));
    table.eligible[0] = false;
    table.eligible[1] = false;
    table.leases[2].state = LeaseState::Finished;
    let q = table.quotas(&["a", "b"]);
    assert_eq!(q, BTreeMap::from([("a".into(), 2), ("b".into(), 1)]));
    assert_eq!(table.plan("b", &["a", "b"]).take, pids([3]));
    assert!(table.plan("a", &["a", "b"]).is_empty());
}

#[test]
fn over_quota_host_waits_to_be_asked() {
    // EqualShare never releases: an over-quota host hands off only when asked.
    let mut table = Table::default();
    table.add(6, Some("a"));
    assert!(table.plan("a", &["a", "b"]).is_empty());
    assert_eq!(table.plan("b", &["a", "b"]).request_handoff.len(), 3);
}

#[test]
fn weight_reads_the_property_and_defaults_to_one() {
    // Custom strategies read per-lease weights; anything but a positive integer counts as 1.
    let mut l = lease(0, None);
    assert_eq!(LeaseView::new(&l).weight(), 1);
    for (text, weight) in [("5", 5), (" 7 ", 7), ("0", 1), ("-3", 1), ("heavy", 1)] {
        l.properties.insert(WEIGHT_PROPERTY.into(), text.into());
        assert_eq!(LeaseView::new(&l).weight(), weight, "weight {text:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Property tests: a fleet runs round by round. Every live host plans on the same snapshot; the
// plans are applied in host order as compare-and-swaps on the version each host saw; then every
// responsive live owner honours the hand-off requests on its leases.

/// One generated lease: owner, next owner (host indices in the universe), eligible, overdue.
type GenLease = (Option<usize>, Option<usize>, bool, bool);

#[derive(Debug, Clone)]
struct Fleet {
    universe: Vec<HostName>,
    live: Vec<HostName>,
    /// Live hosts that never honour a hand-off request.
    unresponsive: BTreeSet<HostName>,
    table: Table,
    /// What every host plans with.
    strategy: EqualShare,
}

impl Fleet {
    fn new(universe: usize, live: &[bool], unresponsive: &[bool], leases: &[GenLease]) -> Self {
        let names: Vec<HostName> = (0..universe).map(|i| host(&format!("h{i:02}"))).collect();
        let mut live_hosts: Vec<HostName> = names
            .iter()
            .zip(live)
            .filter(|(_, &l)| l)
            .map(|(h, _)| h.clone())
            .collect();
        if live_hosts.is_empty() {
            live_hosts.push(names[0].clone());
        }
        let unresponsive = names
            .iter()
            .zip(unresponsive)
            .filter(|(_, &u)| u)
            .map(|(h, _)| h.clone())
            .collect();
        let mut table = Table::default();
        for (i, &(owner, next, eligible, overdue)) in leases.iter().enumerate() {
            let mut l = lease(i, None);
            if let Some(o) = owner {
                l.state = LeaseState::Owned;
                l.owner = Some(names[o].clone());
                l.next_owner = next.map(|n| names[n].clone());
            }
            table.leases.push(l);
            table.eligible.push(eligible);
            table.overdue.push(overdue && next.is_some());
        }
        Self {
            universe: names,
            live: live_hosts,
            unresponsive,
            table,
            strategy: EqualShare::default(),
        }
    }

    fn is_live(&self, h: &HostName) -> bool {
        self.live.binary_search(h).is_ok()
    }

    fn plans(&self) -> Vec<(HostName, Plan)> {
        let views = self.table.views();
        self.live
            .iter()
            .map(|me| {
                let plan = self.strategy.plan(&Snapshot {
                    me,
                    live_hosts: &self.live,
                    leases: &views,
                });
                (me.clone(), plan)
            })
            .collect()
    }

    fn index(&self, p: &PartitionId) -> usize {
        self.table
            .leases
            .iter()
            .position(|l| &l.key.partition == p)
            .expect("planned partition exists")
    }

    /// Applies `plans` (made on the current snapshot), then the honouring of hand-offs.
    /// Returns, per lease, how many times its owner changed.
    fn apply(&mut self, plans: &[(HostName, Plan)]) -> Vec<usize> {
        let seen: Vec<_> = self.table.leases.iter().map(|l| l.version).collect();
        let mut moves = vec![0usize; seen.len()];
        for (me, plan) in plans {
            for p in plan.take.iter().chain(&plan.steal) {
                let i = self.index(p);
                let l = &mut self.table.leases[i];
                if l.version == seen[i] {
                    l.state = LeaseState::Owned;
                    l.owner = Some(me.clone());
                    l.next_owner = None;
                    l.version = l.version.next();
                    moves[i] += 1;
                }
            }
            for r in &plan.request_handoff {
                let i = self.index(&r.partition);
                let l = &mut self.table.leases[i];
                if l.version == seen[i] {
                    l.next_owner = Some(me.clone());
                    l.version = l.version.next();
                }
            }
            for p in &plan.release {
                let i = self.index(p);
                let l = &mut self.table.leases[i];
                if l.version == seen[i] {
                    l.state = LeaseState::Available;
                    l.owner = None;
                    l.next_owner = None;
                    l.version = l.version.next();
                    moves[i] += 1;
                }
            }
        }
        let (live, unresponsive) = (&self.live, &self.unresponsive);
        for (l, moved) in self.table.leases.iter_mut().zip(&mut moves) {
            let honours = l.state == LeaseState::Owned
                && l.owner
                    .as_ref()
                    .is_some_and(|o| live.binary_search(o).is_ok() && !unresponsive.contains(o));
            if !honours {
                continue;
            }
            if let Some(next) = l.next_owner.take() {
                if l.owner.as_ref() != Some(&next) {
                    *moved += 1;
                }
                l.owner = Some(next);
                l.version = l.version.next();
            }
        }
        // Every request still standing has now outlived an honouring phase: it is overdue.
        for (overdue, l) in self.table.overdue.iter_mut().zip(&self.table.leases) {
            *overdue = l.next_owner.is_some();
        }
        moves
    }

    /// Every eligible lease is owned by a live host, and every live host owns its quota.
    fn balanced(&self) -> Result<(), String> {
        let quotas = quotas(&self.live, &self.table.views());
        let mut owned: BTreeMap<&HostName, usize> = self.live.iter().map(|h| (h, 0)).collect();
        for (l, &eligible) in self.table.leases.iter().zip(&self.table.eligible) {
            if !eligible {
                continue;
            }
            match l.owner.as_ref().filter(|o| self.is_live(o)) {
                Some(o) if l.state == LeaseState::Owned => {
                    *owned.entry(o).or_insert(0) += 1;
                }
                _ => return Err(format!("lease {} has no live owner", l.key)),
            }
        }
        for (h, q) in &quotas {
            let o = owned.get(h).copied().unwrap_or(0);
            if o != *q {
                return Err(format!("{h} owns {o}, quota {q}"));
            }
        }
        Ok(())
    }
}

fn gen_fleet(with_requests: bool) -> impl Strategy<Value = Fleet> {
    (1usize..=8).prop_flat_map(move |n| {
        let lease = (
            proptest::option::of(0..n),
            proptest::option::weighted(0.3, 0..n),
            proptest::bool::weighted(0.9),
            any::<bool>(),
        );
        (
            Just(n),
            proptest::collection::vec(any::<bool>(), n),
            proptest::collection::vec(proptest::bool::weighted(0.25), n),
            proptest::collection::vec(lease, 0..80),
        )
            .prop_map(move |(n, live, unresponsive, mut leases)| {
                if !with_requests {
                    for l in &mut leases {
                        l.1 = None;
                    }
                }
                Fleet::new(n, &live, &unresponsive, &leases)
            })
    })
}

/// Runs rounds until a round plans nothing and changes nothing (no owner honours a request, no
/// request becomes overdue); returns the rounds
/// that moved something and the owner changes of each lease over the whole rebalance.
fn run_to_rest(fleet: &mut Fleet, max_rounds: usize) -> Result<(usize, Vec<usize>), String> {
    let mut moves = vec![0usize; fleet.table.leases.len()];
    for round in 0..=max_rounds {
        let plans = fleet.plans();
        let before = (fleet.table.leases.clone(), fleet.table.overdue.clone());
        let moved = fleet.apply(&plans);
        let after = (&fleet.table.leases, &fleet.table.overdue);
        if plans.iter().all(|(_, p)| p.is_empty()) && (&before.0, &before.1) == after {
            return Ok((round, moves));
        }
        if round == max_rounds {
            return Err(format!("still moving after {max_rounds} rounds: {plans:?}"));
        }
        for (i, m) in moved.into_iter().enumerate() {
            moves[i] += m;
        }
    }
    unreachable!("the loop returns")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (a) A fleet sharing one snapshot per round is balanced within 3 rounds, and then plans
    /// nothing (re-planning after a plan is applied moves nothing).
    #[test]
    fn fleet_converges_within_three_rounds_and_then_rests(mut fleet in gen_fleet(true)) {
        let (rounds, _) = run_to_rest(&mut fleet, 3).map_err(TestCaseError::fail)?;
        prop_assert!(rounds <= 3);
        fleet.balanced().map_err(TestCaseError::fail)?;
    }

    /// (b) A plan takes only free leases, steals only overdue hand-offs to itself, asks only
    /// over-quota live hosts for unclaimed leases, and names no partition twice.
    #[test]
    fn plan_never_takes_a_lease_a_live_host_owns(fleet in gen_fleet(true)) {
        let views = fleet.table.views();
        let by_partition: BTreeMap<&PartitionId, &LeaseView<'_>> =
            views.iter().map(|v| (&v.lease.key.partition, v)).collect();
        let quotas = quotas(&fleet.live, &views);
        // Each host's holding: owned eligible leases, less those a live host asked for, plus
        // those it asked a live owner for.
        let mut holding: BTreeMap<&HostName, i64> = BTreeMap::new();
        for v in views.iter().filter(|v| v.eligible) {
            let l = v.lease;
            let Some(o) = l.owner.as_ref().filter(|o| fleet.is_live(o)) else { continue };
            *holding.entry(o).or_insert(0) += 1;
            if let Some(n) = l.next_owner.as_ref().filter(|n| fleet.is_live(n) && *n != o) {
                *holding.entry(o).or_insert(0) -= 1;
                *holding.entry(n).or_insert(0) += 1;
            }
        }
        for (me, plan) in fleet.plans() {
            let mut named = BTreeSet::new();
            for p in &plan.take {
                let l = by_partition[p];
                prop_assert!(l.eligible, "{me} takes ineligible {p}");
                let held = l.lease.state == LeaseState::Owned
                    && l.lease.owner.as_ref().is_some_and(|o| fleet.is_live(o));
                prop_assert!(!held, "{me} takes {p} owned by live {:?}", l.lease.owner);
                prop_assert!(named.insert(p));
            }
            for p in &plan.steal {
                let l = by_partition[p];
                prop_assert!(l.eligible && l.handoff_overdue, "{me} steals {p} not overdue");
                prop_assert_eq!(l.lease.next_owner.as_ref(), Some(&me));
                prop_assert!(named.insert(p));
            }
            for r in &plan.request_handoff {
                let l = by_partition[&r.partition];
                prop_assert!(l.eligible);
                prop_assert!(fleet.is_live(&r.from) && r.from != me);
                prop_assert_eq!(l.lease.owner.as_ref(), Some(&r.from));
                prop_assert!(
                    l.lease.next_owner.as_ref().is_none_or(|n| !fleet.is_live(n) || *n == r.from),
                    "{} already requested by a live host", r.partition
                );
                let over = holding.get(&r.from).copied().unwrap_or(0) - quotas[&r.from] as i64;
                prop_assert!(over > 0, "{me} asks {} which is within quota", r.from);
                prop_assert!(named.insert(&r.partition));
            }
            prop_assert!(plan.release.is_empty());
        }
    }

    /// (c) The same snapshot gives the same plan, whatever order the hosts and leases are
    /// listed in.
    #[test]
    fn same_snapshot_gives_same_plan(fleet in gen_fleet(true)) {
        let views = fleet.table.views();
        let mut shuffled_views = views.clone();
        shuffled_views.reverse();
        let mut shuffled_live = fleet.live.clone();
        shuffled_live.reverse();
        shuffled_live.extend(fleet.live.iter().cloned());
        for me in &fleet.universe {
            let snapshot = Snapshot { me, live_hosts: &fleet.live, leases: &views };
            let plan = EqualShare::default().plan(&snapshot);
            prop_assert_eq!(&plan, &EqualShare::default().plan(&snapshot));
            let other = Snapshot { me, live_hosts: &shuffled_live, leases: &shuffled_views };
            prop_assert_eq!(&plan, &EqualShare::default().plan(&other));
        }
    }

    /// (d) In one rebalance (hosts joining and dying, no requests pending at the start) every
    /// lease changes owner at most once.
    #[test]
    fn each_lease_moves_at_most_once_per_rebalance(mut fleet in gen_fleet(false)) {
        let (_, moves) = run_to_rest(&mut fleet, 3).map_err(TestCaseError::fail)?;
        for (i, m) in moves.iter().enumerate() {
            prop_assert!(*m <= 1, "lease {} moved {} times", fleet.table.leases[i].key, m);
        }
        fleet.balanced().map_err(TestCaseError::fail)?;
    }

    /// Hosts planning on one snapshot never go for the same lease, so no partition is given
    /// two owners by one round.
    #[test]
    fn plans_of_one_snapshot_are_disjoint(fleet in gen_fleet(true)) {
        let mut claimed = BTreeMap::new();
        for (me, plan) in fleet.plans() {
            let asked = plan.request_handoff.iter().map(|r| &r.partition);
            for p in plan.take.iter().chain(&plan.steal).chain(asked) {
                if let Some(other) = claimed.insert(p.clone(), me.clone()) {
                    prop_assert!(false, "{p} claimed by {other} and {me}");
                }
            }
        }
    }

    /// Quotas add up to the eligible leases and differ by at most one.
    #[test]
    fn quotas_share_every_eligible_lease_within_one(fleet in gen_fleet(true)) {
        let q = quotas(&fleet.live, &fleet.table.views());
        let eligible = fleet.table.eligible.iter().filter(|e| **e).count();
        prop_assert_eq!(q.values().sum::<usize>(), eligible);
        let (min, max) = (q.values().min(), q.values().max());
        prop_assert!(max.zip(min).is_none_or(|(max, min)| max - min <= 1));
    }
}
