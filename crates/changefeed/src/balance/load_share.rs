//! [`LoadShare`]: balance measured load against each host's capacity, with hysteresis, falling
//! back to [`EqualShare`]'s counts where no load is known.
//!
//! The loads are an input ([`LoadInput`]): per lease a measured cost (any one unit for all
//! leases, for example handler busy seconds per second), per host a capacity weight, and when
//! each lease last changed owner, on the caller's clock. This module does not measure them.
//!
//! Every host works out the same fleet-wide assignment from the same snapshot and input, as
//! [`super::Kcl3Like`] does, and its plan is the decisions that name it: a free lease assigned
//! to it is a `take`, a lease moved to it from a live host a `request_handoff` (a hand-off,
//! then a `steal` once overdue). Nobody releases.
//!
//! The rules, in order:
//!
//! 1. **Counts where no load is known.** A lease without a known load weighs the mean of the
//!    known ones. When every eligible lease then weighs the same and every live host has the
//!    same capacity, load is proportional to counts and the plan is [`EqualShare`]'s, exactly.
//! 2. **Free leases** (no live owner) go, heaviest first, each to the host whose utilisation
//!    (load ÷ capacity) after taking it is lowest; a hand-off in flight whose owner died stays
//!    with its asker. Dwell does not hold back a free lease: nobody reads it.
//! 3. **Act on overload, stop inside a tighter band.** Nothing held moves unless the most
//!    utilised host is above the fleet's mean utilisation (load ÷ capacity over all hosts) by
//!    more than `threshold`, or a live host holds no eligible lease while there are at least as
//!    many eligible leases as hosts. Once moving, moves go on while the most utilised host is
//!    above the mean by more than `settle` (below `threshold`), so the next noisy reading does
//!    not start again at once. A host below the mean is not a reason to move: a load that
//!    faded leaves its host with headroom, where the next hot lease can go in one move, rather
//!    than pulling leases back that the next hot spot would push out again.
//! 4. **Moves close the gap in few steps.** The most utilised host gives a lease to the least
//!    utilised one: of its leases, the one that lowers the higher utilisation of the pair the
//!    most, so one large lease goes where it closes the gap instead of many small ones. A host
//!    holding nothing is served first, from the most utilised host that has a lease it may
//!    give (the busiest may hold a single hot lease, or only leases within their dwell); where
//!    no lease passes the gain rule below (idle leases weigh nothing), by count: the lightest
//!    lease of a host holding two or more, whatever its gain, if it leaves the empty host no
//!    busier than the giver was. Any other move
//!    is made only if its gain, that lowering divided by the utilisation the lease carries off
//!    its host, is at least `min_gain` (1: the move relieves the busy host fully and overloads
//!    nobody; near 0: it mostly shifts the problem, and a few percent of noise could undo it),
//!    and it also lowers the sum over hosts of load² ÷ capacity (so repeated planning cannot
//!    cycle). A lease moves at most once per plan, never while a hand-off of it is in flight,
//!    and never within `dwell` of its last move.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{BalanceStrategy, EqualShare, HandoffRequest, Plan, Snapshot};
use crate::model::{HostName, LeaseState, PartitionId};

/// What a load-aware strategy is told besides the snapshot; see the module doc.
#[derive(Debug, Clone, Copy)]
pub struct LoadInput<'a> {
    /// Each lease's measured cost, in one unit for all leases. Missing, negative or not
    /// finite: unknown.
    pub lease_load: &'a BTreeMap<PartitionId, f64>,
    /// Each host's capacity weight. Missing, zero, negative or not finite: 1.
    pub capacity: &'a BTreeMap<HostName, f64>,
    /// When each lease last changed owner, on the caller's clock. Missing: long ago.
    pub moved_at: &'a BTreeMap<PartitionId, Duration>,
    /// Now, on the same clock.
    pub now: Duration,
}

static NO_LOADS: BTreeMap<PartitionId, f64> = BTreeMap::new();
static NO_CAPACITIES: BTreeMap<HostName, f64> = BTreeMap::new();
static NO_MOVES: BTreeMap<PartitionId, Duration> = BTreeMap::new();

impl LoadInput<'static> {
    /// Nothing known: no load, every capacity 1, no recent move.
    pub fn none() -> Self {
        LoadInput {
            lease_load: &NO_LOADS,
            capacity: &NO_CAPACITIES,
            moved_at: &NO_MOVES,
            now: Duration::ZERO,
        }
    }
}

/// One hand-off [`LoadShare`] decided, with its gain (see the module doc, rule 4).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Move {
    pub(crate) partition: PartitionId,
    pub(crate) from: HostName,
    pub(crate) to: HostName,
    pub(crate) gain: f64,
}

/// Balances measured load against host capacity with hysteresis; see the module doc.
#[derive(Debug, Clone)]
pub struct LoadShare {
    threshold: f64,
    settle: f64,
    min_gain: f64,
    dwell: Duration,
}

impl Default for LoadShare {
    /// `threshold` 0.15, `settle` 0.1, `min_gain` 0.5, `dwell` 60 s.
    ///
    /// The threshold is above 1 ÷ 7: in a fleet of eight, a host whose load faded leaves the
    /// other seven that far above the mean, and pulling leases back to it would be undone by
    /// the next hot spot. Half a lease's load of gain and a minute of dwell keep a ±10 % noisy
    /// signal from moving anything twice.
    fn default() -> Self {
        LoadShare {
            threshold: 0.15,
            settle: 0.1,
            min_gain: 0.5,
            dwell: Duration::from_secs(60),
        }
    }
}

impl LoadShare {
    /// How far (as a fraction of the mean) the most utilised host may be above the mean
    /// before leases move. Negative or not finite values count as 0.
    #[must_use]
    pub fn with_threshold(mut self, threshold: f64) -> Self {
        self.threshold = non_negative(threshold);
        self
    }

    /// Once leases move, how far (as a fraction of the mean) above the mean the most utilised
    /// host may stay when they stop; at most the threshold (a larger value counts as the
    /// threshold). Negative or not finite values count as 0.
    #[must_use]
    pub fn with_settle(mut self, settle: f64) -> Self {
        self.settle = non_negative(settle);
        self
    }

    /// The least gain a move must bring: the lowering of the pair's higher utilisation as a
    /// fraction of the utilisation the lease carries off its host (see the module doc).
    /// Negative or not finite values count as 0.
    #[must_use]
    pub fn with_min_gain(mut self, min_gain: f64) -> Self {
        self.min_gain = non_negative(min_gain);
        self
    }

    /// How long a lease stays put after it moved.
    #[must_use]
    pub fn with_dwell(mut self, dwell: Duration) -> Self {
        self.dwell = dwell;
        self
    }

    /// The least gain a move must bring.
    pub fn min_gain(&self) -> f64 {
        self.min_gain
    }

    /// How long a lease stays put after it moved.
    pub fn dwell(&self) -> Duration {
        self.dwell
    }

    /// `me`'s plan and the fleet's hand-offs this round.
    pub(crate) fn decide(
        &self,
        snapshot: &Snapshot<'_>,
        load: &LoadInput<'_>,
    ) -> (Plan, Vec<Move>) {
        let leases = snapshot.leases;
        let eligible: Vec<usize> = (0..leases.len())
            .filter(|&i| leases[i].eligible && leases[i].lease.state != LeaseState::Finished)
            .collect();
        let partition = |i: usize| -> &PartitionId { &leases[i].lease.key.partition };
        let known: Vec<f64> = eligible
            .iter()
            .filter_map(|&i| known_load(load, partition(i)))
            .collect();
        let mean_known = if known.is_empty() {
            1.0
        } else {
            known.iter().sum::<f64>() / known.len() as f64
        };
        let weight = |i: usize| known_load(load, partition(i)).unwrap_or(mean_known);
        let mut hosts: Vec<&HostName> = snapshot.live_hosts.iter().collect();
        hosts.sort_unstable();
        hosts.dedup();
        let capacity: Vec<f64> = hosts.iter().map(|h| capacity_of(load, h)).collect();
        let uniform_load = eligible.iter().all(|&i| weight(i) == weight(eligible[0]));
        let uniform_capacity = capacity.iter().all(|&c| c == capacity[0]);
        if eligible.is_empty() || (uniform_load && uniform_capacity) {
            return (EqualShare::default().plan(snapshot), Vec::new());
        }
        let index = |h: &HostName| hosts.binary_search(&h).ok();
        let Some(me) = index(snapshot.me) else {
            return (Plan::default(), Vec::new());
        };
        let mut plan = Plan::default();
        let mut moves = Vec::new();

        // Who holds what, a hand-off in flight counting for its asker.
        let mut held = vec![0.0f64; hosts.len()];
        // How many eligible leases each host holds, the same way.
        let mut holds = vec![0usize; hosts.len()];
        let mut free: Vec<usize> = Vec::new();
        let mut movable: Vec<Vec<usize>> = vec![Vec::new(); hosts.len()];
        for &i in &eligible {
            let lease = leases[i].lease;
            let owner = match (lease.state, &lease.owner) {
                (LeaseState::Owned, Some(o)) => index(o),
                _ => None,
            };
            let asker = lease.next_owner.as_ref().and_then(index);
            match (owner, asker) {
                (None, Some(a)) => {
                    held[a] += weight(i);
                    holds[a] += 1;
                    if a == me {
                        plan.take.push(partition(i).clone());
                    }
                }
                (None, None) => free.push(i),
                (Some(o), Some(a)) if a != o => {
                    held[a] += weight(i);
                    holds[a] += 1;
                    if a == me && leases[i].handoff_overdue {
                        plan.steal.push(partition(i).clone());
                    }
                }
                (Some(o), _) => {
                    held[o] += weight(i);
                    holds[o] += 1;
                    let since = load.moved_at.get(partition(i));
                    if since.is_none_or(|&t| load.now.saturating_sub(t) >= self.dwell) {
                        movable[o].push(i);
                    }
                }
            }
        }
        let utilisation = |held: &[f64], h: usize| held[h] / capacity[h];

        // Rule 2: free leases, heaviest first, to the lowest utilisation after taking.
        free.sort_by(|&a, &b| {
            weight(b)
                .total_cmp(&weight(a))
                .then(partition(a).cmp(partition(b)))
        });
        for i in free {
            let w = weight(i);
            let to = (0..hosts.len())
                .min_by(|&a, &b| {
                    ((held[a] + w) / capacity[a])
                        .total_cmp(&((held[b] + w) / capacity[b]))
                        .then(a.cmp(&b))
                })
                .unwrap_or(0);
            held[to] += w;
            holds[to] += 1;
            if to == me {
                plan.take.push(partition(i).clone());
            }
        }

        // Rules 3 and 4: move held leases from the most to the least utilised host.
        let total_capacity: f64 = capacity.iter().sum();
        let mean = held.iter().sum::<f64>() / total_capacity;
        let busiest = (0..hosts.len())
            .map(|h| utilisation(&held, h))
            .fold(0.0, f64::max);
        // Hosts holding no eligible lease, once the free ones are placed.
        let mut empty: Vec<bool> = holds
            .iter()
            .map(|&n| n == 0 && eligible.len() >= hosts.len())
            .collect();
        let triggered = busiest > mean * (1.0 + self.threshold) || empty.contains(&true);
        let settle = self.settle.min(self.threshold);
        if mean > 0.0 && triggered {
            for list in &mut movable {
                list.sort_by(|&a, &b| partition(a).cmp(partition(b)));
            }
            loop {
                let by_use = |a: &usize, b: &usize| {
                    utilisation(&held, *a)
                        .total_cmp(&utilisation(&held, *b))
                        .then(b.cmp(a))
                };
                // An empty host first: it is as little utilised as any, and is the reason
                // to move when no host is over the threshold.
                let (Some(busiest), Some(to)) = (
                    (0..hosts.len()).max_by(by_use),
                    (0..hosts.len())
                        .find(|&h| empty[h])
                        .or_else(|| (0..hosts.len()).min_by(by_use)),
                ) else {
                    break;
                };
                if utilisation(&held, busiest) <= mean * (1.0 + settle) && !empty[to] {
                    break;
                }
                // Moving lease `i` from `from` to `to`: how much it lowers the pair's higher
                // utilisation, its gain (that as a fraction of what it carries off `from`; 0
                // for a lease that weighs nothing), the change in sum(load² / capacity)
                // (negative when the pair evens out), and `to`'s utilisation after it.
                let effect = |from: usize, i: usize| {
                    let w = weight(i);
                    let (uf, ut) = (utilisation(&held, from), utilisation(&held, to));
                    let (nf, nt) = (
                        (held[from] - w) / capacity[from],
                        (held[to] + w) / capacity[to],
                    );
                    let carried = w / capacity[from];
                    let lowered = uf.max(ut) - nf.max(nt);
                    let gain = if carried > 0.0 {
                        lowered / carried
                    } else {
                        0.0
                    };
                    (lowered, gain, w * ((ut + nt) - (uf + nf)), nt)
                };
                // The best move from `from` to `to` by rule 4, if any.
                let best_from = |from: usize| {
                    movable[from]
                        .iter()
                        .enumerate()
                        .filter_map(|(k, &i)| {
                            let (lowered, gain, potential, _) = effect(from, i);
                            (weight(i) > 0.0 && gain >= self.min_gain && potential < 0.0)
                                .then_some((k, i, lowered, gain))
                        })
                        .max_by(|a, b| {
                            a.2.total_cmp(&b.2)
                                .then(a.3.total_cmp(&b.3))
                                .then(b.0.cmp(&a.0))
                        })
                        .map(|(k, i, _, gain)| (from, k, i, gain))
                };
                // The lightest lease `from` may give, by count (its gain, if it has one), if it
                // leaves `to` no busier than `from` was: then the move does not raise the sum
                // of load² ÷ capacity either, and the next plan has no reason to undo it.
                let lightest = |from: usize| {
                    let (k, &i) = movable[from]
                        .iter()
                        .enumerate()
                        .min_by(|a, b| weight(*a.1).total_cmp(&weight(*b.1)).then(a.0.cmp(&b.0)))?;
                    let (_, gain, _, to_after) = effect(from, i);
                    (to_after <= utilisation(&held, from)).then_some((from, k, i, gain))
                };
                // An empty host takes from the most utilised host that has a lease to give it
                // (the busiest may hold one hot lease, or only leases within their dwell). If
                // no lease passes rule 4 (those it could take weigh nothing, or each is all of
                // its host's load), it takes the lightest lease of a host holding two or more:
                // a host holding nothing is a reason by count. Any other move is from the
                // busiest host.
                let found = if empty[to] {
                    let mut donors: Vec<usize> = (0..hosts.len()).filter(|&h| h != to).collect();
                    donors.sort_by(|a, b| by_use(b, a));
                    donors.iter().copied().find_map(best_from).or_else(|| {
                        donors
                            .iter()
                            .copied()
                            .filter(|&h| holds[h] >= 2)
                            .find_map(lightest)
                    })
                } else {
                    best_from(busiest)
                };
                let Some((from, k, i, gain)) = found else {
                    break;
                };
                movable[from].remove(k);
                let w = weight(i);
                held[from] -= w;
                held[to] += w;
                holds[from] -= 1;
                holds[to] += 1;
                empty[to] = false;
                moves.push(Move {
                    partition: partition(i).clone(),
                    from: hosts[from].clone(),
                    to: hosts[to].clone(),
                    gain,
                });
                if to == me {
                    plan.request_handoff.push(HandoffRequest {
                        partition: partition(i).clone(),
                        from: hosts[from].clone(),
                    });
                }
            }
        }
        plan.sort();
        (plan, moves)
    }
}

fn non_negative(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

fn known_load(load: &LoadInput<'_>, partition: &PartitionId) -> Option<f64> {
    load.lease_load
        .get(partition)
        .copied()
        .filter(|l| l.is_finite() && *l >= 0.0)
}

fn capacity_of(load: &LoadInput<'_>, host: &HostName) -> f64 {
    load.capacity
        .get(host)
        .copied()
        .filter(|c| c.is_finite() && *c > 0.0)
        .unwrap_or(1.0)
}

impl BalanceStrategy for LoadShare {
    /// With no load known, [`EqualShare`]'s plan.
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        self.plan_with_load(snapshot, &LoadInput::none())
    }

    fn plan_with_load(&self, snapshot: &Snapshot<'_>, load: &LoadInput<'_>) -> Plan {
        self.decide(snapshot, load).0
    }

    fn wants_load(&self) -> bool {
        true
    }
}
