//! Tests of [`LoadShare`]: its hysteresis (gain, dwell), convergence on static loads, and its
//! equality with [`EqualShare`] where loads are uniform or unknown.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

/// A fleet whose every lease is owned by a live host, with static loads and capacities.
#[derive(Debug, Clone)]
struct Loaded {
    live: Vec<HostName>,
    table: Table,
    loads: BTreeMap<PartitionId, f64>,
    capacity: BTreeMap<HostName, f64>,
}

impl Loaded {
    fn input<'a>(
        &'a self,
        moved_at: &'a BTreeMap<PartitionId, Duration>,
        now: Duration,
    ) -> LoadInput<'a> {
        LoadInput {
            lease_load: &self.loads,
            capacity: &self.capacity,
            moved_at,
            now,
        }
    }

    /// The fleet's hand-offs this round, the same whichever host works them out.
    fn moves(&self, s: &LoadShare, input: &LoadInput<'_>) -> Vec<Move> {
        let views = self.table.views();
        let all: Vec<Vec<Move>> = self
            .live
            .iter()
            .map(|me| {
                let snapshot = Snapshot {
                    me,
                    live_hosts: &self.live,
                    leases: &views,
                };
                s.decide(&snapshot, input).1
            })
            .collect();
        assert!(
            all.windows(2).all(|w| w[0] == w[1]),
            "hosts disagree: {all:?}"
        );
        all.into_iter().next().unwrap_or_default()
    }

    /// Hands every moved lease over at once.
    fn apply(&mut self, moves: &[Move]) {
        for m in moves {
            let l = self
                .table
                .leases
                .iter_mut()
                .find(|l| l.key.partition == m.partition)
                .expect("a moved lease exists");
            assert_eq!(
                l.owner.as_ref(),
                Some(&m.from),
                "{} moved from a host not holding it",
                m.partition
            );
            l.owner = Some(m.to.clone());
        }
    }

    fn held(&self) -> BTreeMap<HostName, f64> {
        let mut held: BTreeMap<HostName, f64> =
            self.live.iter().map(|h| (h.clone(), 0.0)).collect();
        for l in &self.table.leases {
            if let Some(o) = &l.owner {
                *held.entry(o.clone()).or_default() += self.loads[&l.key.partition];
            }
        }
        held
    }

    fn cap(&self, h: &HostName) -> f64 {
        self.capacity[h]
    }
}

/// Up to 5 live hosts of capacity 1 to 4, up to 40 leases each owned by one of them, loads 0
/// to 100 with a few hot ones.
fn gen_loaded() -> impl Strategy<Value = Loaded> {
    (1usize..=5).prop_flat_map(|n| {
        (
            proptest::collection::vec(1u8..=4, n),
            proptest::collection::vec((0..n, prop_oneof![4 => 0u32..10, 1 => 50u32..100]), 0..40),
        )
            .prop_map(move |(caps, leases)| {
                let names: Vec<String> = (0..n).map(|i| format!("h{i}")).collect();
                let live = hosts(&names.iter().map(String::as_str).collect::<Vec<_>>());
                let mut table = Table::default();
                let mut loads = BTreeMap::new();
                for (owner, load) in leases {
                    let i = table.leases.len();
                    table.add(1, Some(&names[owner]));
                    loads.insert(pid(i), f64::from(load));
                }
                let capacity = live
                    .iter()
                    .cloned()
                    .zip(caps.iter().map(|&c| f64::from(c)))
                    .collect();
                Loaded {
                    live,
                    table,
                    loads,
                    capacity,
                }
            })
    })
}

#[test]
fn a_hot_pair_on_one_host_is_split() {
    // Two hot leases on one host, two cold ones on another: one hot lease moves.
    let mut l = Loaded {
        live: hosts(&["a", "b"]),
        table: Table::default(),
        loads: BTreeMap::new(),
        capacity: [(host("a"), 1.0), (host("b"), 1.0)].into_iter().collect(),
    };
    l.table.add(2, Some("a")).add(2, Some("b"));
    for (i, load) in [10.0, 10.0, 1.0, 1.0].into_iter().enumerate() {
        l.loads.insert(pid(i), load);
    }
    let none = BTreeMap::new();
    let s = LoadShare::default();
    let moves = l.moves(&s, &l.input(&none, Duration::ZERO));
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!((moves[0].from.as_str(), moves[0].to.as_str()), ("a", "b"));
    // Only b asks, and for the lease it is given.
    let views = l.table.views();
    let plan = s.plan_with_load(
        &Snapshot {
            me: &host("b"),
            live_hosts: &l.live,
            leases: &views,
        },
        &l.input(&none, Duration::ZERO),
    );
    assert_eq!(plan.request_handoff.len(), 1);
    // Within the dwell of its last move the lease stays.
    let moved: BTreeMap<PartitionId, Duration> = [
        (pid(0), Duration::from_secs(100)),
        (pid(1), Duration::from_secs(100)),
    ]
    .into_iter()
    .collect();
    assert!(l
        .moves(&s, &l.input(&moved, Duration::from_secs(130)))
        .is_empty());
}

#[test]
fn a_host_holding_nothing_is_given_a_lease_by_a_host_that_has_one_to_give() {
    // The busiest host holds one hot lease, which would only move the problem; the next host
    // gives one of its leases, one of which is still within its dwell.
    let mut l = Loaded {
        live: hosts(&["a", "b", "c"]),
        table: Table::default(),
        loads: BTreeMap::new(),
        capacity: ["a", "b", "c"].iter().map(|h| (host(h), 1.0)).collect(),
    };
    l.table.add(1, Some("a")).add(3, Some("b"));
    for (i, load) in [10.0, 1.0, 1.0, 1.0].into_iter().enumerate() {
        l.loads.insert(pid(i), load);
    }
    let moved: BTreeMap<PartitionId, Duration> =
        [(pid(1), Duration::from_secs(100))].into_iter().collect();
    let s = LoadShare::default();
    let moves = l.moves(&s, &l.input(&moved, Duration::from_secs(130)));
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!((moves[0].from.as_str(), moves[0].to.as_str()), ("b", "c"));
    assert_ne!(moves[0].partition, pid(1), "a lease within its dwell stays");
    l.apply(&moves);
    let after = l.input(&moved, Duration::from_secs(130));
    assert!(l.moves(&s, &after).is_empty(), "then it rests");
}

#[test]
fn a_host_holding_nothing_gets_an_idle_lease_by_count() {
    // Idle leases weigh nothing, so no move of one passes the gain rule; a host holding
    // nothing still gets one, the lightest of a host holding two or more.
    let l = Loaded {
        live: hosts(&["a", "b", "c"]),
        table: {
            let mut t = Table::default();
            t.add(4, Some("a")).add(1, Some("b"));
            t
        },
        loads: [0.0, 0.0, 5.0, 0.0, 1.0]
            .into_iter()
            .enumerate()
            .map(|(i, x)| (pid(i), x))
            .collect(),
        capacity: ["a", "b", "c"].iter().map(|h| (host(h), 1.0)).collect(),
    };
    let none = BTreeMap::new();
    let moves = l.moves(&LoadShare::default(), &l.input(&none, Duration::ZERO));
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!((moves[0].from.as_str(), moves[0].to.as_str()), ("a", "c"));
    assert_eq!(l.loads[&moves[0].partition], 0.0, "the lightest: {moves:?}");
}

#[test]
fn free_leases_go_heaviest_first_to_the_least_used_host() {
    // Rule 2: a big host (capacity 3) takes three times the load of a small one.
    let live = hosts(&["big", "small"]);
    let mut table = Table::default();
    table.add(8, None);
    let loads: BTreeMap<PartitionId, f64> = (0..8)
        .map(|i| (pid(i), if i == 0 { 6.0 } else { 1.0 }))
        .collect();
    let capacity: BTreeMap<HostName, f64> = [(host("big"), 3.0), (host("small"), 1.0)]
        .into_iter()
        .collect();
    let none = BTreeMap::new();
    let input = LoadInput {
        lease_load: &loads,
        capacity: &capacity,
        moved_at: &none,
        now: Duration::ZERO,
    };
    let views = table.views();
    let plan = |me: &HostName| {
        LoadShare::default().plan_with_load(
            &Snapshot {
                me,
                live_hosts: &live,
                leases: &views,
            },
            &input,
        )
    };
    let (big, small) = (plan(&live[0]), plan(&live[1]));
    assert!(
        big.take.contains(&pid(0)),
        "the hot lease goes to the big host first"
    );
    let load = |p: &Plan| p.take.iter().map(|x| loads[x]).sum::<f64>();
    assert_eq!((load(&big), load(&small)), (10.0, 3.0));
    assert_eq!(big.take.len() + small.take.len(), 8);
}

#[test]
fn without_loads_it_is_equal_share() {
    // Rule 1: nothing known, the plan is EqualShare's.
    let mut table = Table::default();
    table.add(7, Some("a")).add(2, None);
    let live = hosts(&["a", "b", "c"]);
    let views = table.views();
    for me in &live {
        let snapshot = Snapshot {
            me,
            live_hosts: &live,
            leases: &views,
        };
        assert_eq!(
            LoadShare::default().plan(&snapshot),
            EqualShare::default().plan(&snapshot)
        );
    }
}

proptest! {
    /// Every hand-off brings at least `min_gain` (the pair's higher utilisation lowered by that
    /// fraction of what the lease carries off its host) and moves a lease from the host
    /// holding it, except one that gives a host holding nothing a lease of a host holding two
    /// or more (rule 4's count fallback).
    #[test]
    fn never_moves_a_lease_without_the_stated_gain(l in gen_loaded(), gain in 0.0f64..1.0) {
        let s = LoadShare::default().with_min_gain(gain);
        let none = BTreeMap::new();
        let moves = l.moves(&s, &l.input(&none, Duration::ZERO));
        let mut held = l.held();
        let mut l2 = l.clone();
        for m in &moves {
            let w = l.loads[&m.partition];
            let count = |h: &HostName| l2.table.leases.iter().filter(|x| x.owner.as_ref() == Some(h)).count();
            if count(&m.to) == 0 && count(&m.from) >= 2 {
                *held.get_mut(&m.from).expect("live") -= w;
                *held.get_mut(&m.to).expect("live") += w;
                l2.apply(std::slice::from_ref(m));
                continue;
            }
            let (f, t) = (held[&m.from], held[&m.to]);
            let before = (f / l.cap(&m.from)).max(t / l.cap(&m.to));
            let after = ((f - w) / l.cap(&m.from)).max((t + w) / l.cap(&m.to));
            let stated = (before - after) / (w / l.cap(&m.from));
            prop_assert!(stated >= gain - 1e-9, "{m:?}: gain {stated} < {gain}");
            prop_assert!((stated - m.gain).abs() < 1e-9, "{m:?}: recomputed {stated}");
            *held.get_mut(&m.from).expect("live") -= w;
            *held.get_mut(&m.to).expect("live") += w;
            l2.apply(std::slice::from_ref(m));
        }
    }

    /// On static loads, planning round after round (dwell passed each time) comes to rest.
    #[test]
    fn converges_on_static_loads(mut l in gen_loaded()) {
        let s = LoadShare::default();
        let mut moved_at = BTreeMap::new();
        let limit = l.table.leases.len() + 2;
        let mut rested = false;
        for round in 0..=limit {
            let now = s.dwell() * u32::try_from(round).expect("few rounds");
            let moves = l.moves(&s, &l.input(&moved_at, now));
            if moves.is_empty() {
                rested = true;
                break;
            }
            for m in &moves {
                moved_at.insert(m.partition.clone(), now);
            }
            l.apply(&moves);
        }
        prop_assert!(rested, "still moving after {} rounds", limit);
    }

    /// No lease moves twice within the dwell time, rounds a third of it apart.
    #[test]
    fn no_lease_moves_twice_within_the_dwell(mut l in gen_loaded()) {
        let s = LoadShare::default();
        let step = s.dwell() / 3;
        let mut moved_at: BTreeMap<PartitionId, Duration> = BTreeMap::new();
        for round in 0..12u32 {
            let now = step * round;
            let moves = l.moves(&s, &l.input(&moved_at, now));
            for m in &moves {
                if let Some(&last) = moved_at.get(&m.partition) {
                    prop_assert!(now - last >= s.dwell(), "{} moved at {last:?} and {now:?}", m.partition);
                }
                moved_at.insert(m.partition.clone(), now);
            }
            l.apply(&moves);
        }
    }

    /// With every lease's load the same (or unknown) and every capacity the same, every host's
    /// plan is EqualShare's, on any table (free, dead hosts', hand-offs in flight).
    #[test]
    fn equals_equal_share_on_uniform_loads(
        fleet in gen_fleet(true),
        load in proptest::option::of(0.0f64..50.0),
        capacity in 0.5f64..4.0,
    ) {
        let views = fleet.table.views();
        let loads: BTreeMap<PartitionId, f64> = match load {
            Some(x) => fleet.table.leases.iter().map(|l| (l.key.partition.clone(), x)).collect(),
            None => BTreeMap::new(),
        };
        let caps: BTreeMap<HostName, f64> = fleet.live.iter().map(|h| (h.clone(), capacity)).collect();
        let none = BTreeMap::new();
        let input = LoadInput { lease_load: &loads, capacity: &caps, moved_at: &none, now: Duration::ZERO };
        for me in &fleet.live {
            let snapshot = Snapshot { me, live_hosts: &fleet.live, leases: &views };
            prop_assert_eq!(
                LoadShare::default().plan_with_load(&snapshot, &input),
                EqualShare::default().plan(&snapshot)
            );
        }
    }
}
