//! [`KclLike`]: the lease taker of the Kinesis Client Library, as a [`BalanceStrategy`], so the
//! simulator can compare it with [`super::EqualShare`] under the same processor and timings.
//!
//! What is modelled (KCL 2.x `DynamoDBLeaseTaker.computeLeasesToTake`/`chooseLeasesToSteal`):
//!
//! - Workers are the hosts owning at least one live lease, plus the asking host.
//! - `target = ceil(leases / workers)` (1 when there are more workers than leases).
//! - A host under target takes expired leases (here: no live owner) up to its target, in bulk.
//! - Only when *no* lease is expired does it steal, from the most-loaded worker, at most
//!   `max_leases_to_steal` leases per cycle (KCL's `maxLeasesToStealAtOneTime`, default 1): as
//!   many as the most-loaded worker is over target, or one if it sits exactly at target and the
//!   asker needs more than one.
//!
//! KCL shuffles the candidates randomly; this strategy orders them by a hash of host and
//! partition instead, which spreads hosts over different leases in the same way while staying
//! deterministic. A steal is expressed as a hand-off request (and, if not honoured in time, a
//! steal), the only way the [`BalanceStrategy`] contract lets a strategy reach a lease a live
//! host owns; it moves one lease per cycle exactly as KCL's steal does. A pending request for
//! this host counts as already owned, as KCL's stolen lease would.
//!
//! [`super::CosmosLike`] makes the same scan and plan (`anchor_plan`), with its own order of
//! expired leases and its own number of steals.

use std::collections::BTreeMap;

use super::{BalanceStrategy, HandoffRequest, LeaseView, Plan, Snapshot};
use crate::model::{HostName, LeaseState, PartitionId};

/// KCL's lease-taking rule; see the module docs.
#[derive(Debug, Clone)]
pub struct KclLike {
    /// Most leases stolen per cycle (KCL's `maxLeasesToStealAtOneTime`). Default 1.
    pub max_leases_to_steal: usize,
}

impl Default for KclLike {
    fn default() -> Self {
        Self {
            max_leases_to_steal: 1,
        }
    }
}

/// A deterministic stand-in for a random shuffle: FNV-1a of host and partition.
fn scramble(me: &HostName, partition: &PartitionId) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in me
        .as_str()
        .bytes()
        .chain([0])
        .chain(partition.as_str().bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// How the anchors see a lease table: who holds what, and what is free.
struct Census<'s> {
    /// Live holders with their counts, including `me` (count 0 if it holds nothing). Pending
    /// hand-offs to a live asker count for the asker.
    counts: BTreeMap<&'s HostName, usize>,
    /// Eligible leases with no live owner, as indexes into the snapshot.
    expired: Vec<usize>,
    /// Eligible leases held by a live owner with no pending request, per owner.
    held: BTreeMap<&'s HostName, Vec<usize>>,
    /// Eligible leases.
    eligible: usize,
}

impl<'s> Census<'s> {
    fn new(snapshot: &Snapshot<'s>) -> Self {
        let live = |h: &HostName| snapshot.live_hosts.binary_search(h).is_ok();
        let mut counts: BTreeMap<&HostName, usize> = BTreeMap::new();
        let mut expired = Vec::new();
        let mut held: BTreeMap<&HostName, Vec<usize>> = BTreeMap::new();
        let mut eligible = 0;
        let leases: &'s [LeaseView<'s>] = snapshot.leases;
        for (i, view) in leases.iter().enumerate() {
            let lease = view.lease;
            if !view.eligible || lease.state == LeaseState::Finished {
                continue;
            }
            eligible += 1;
            let owner = lease
                .owner
                .as_ref()
                .filter(|o| lease.state == LeaseState::Owned && live(o));
            let asker = lease.next_owner.as_ref().filter(|n| live(n));
            match (owner, asker) {
                (None, _) => expired.push(i),
                (Some(o), Some(a)) if a != o => *counts.entry(a).or_default() += 1,
                (Some(o), _) => {
                    *counts.entry(o).or_default() += 1;
                    held.entry(o).or_default().push(i);
                }
            }
        }
        counts.entry(snapshot.me).or_default();
        Self {
            counts,
            expired,
            held,
            eligible,
        }
    }

    /// The most-loaded holder other than `me` (ties: the first by name), and its count.
    fn most_loaded(&self, me: &HostName) -> Option<(&'s HostName, usize)> {
        let mut best: Option<(&HostName, usize)> = None;
        for (h, c) in &self.counts {
            if *h != me && best.is_none_or(|(_, b)| *c > b) {
                best = Some((h, *c));
            }
        }
        best
    }
}

/// How an anchor orders the expired leases it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpiredOrder {
    /// Shuffled, as KCL does (deterministically, by [`scramble`]).
    Shuffled,
    /// In the order they were read, as Cosmos does.
    AsRead,
}

/// The plan both anchors make for `snapshot.me`, differing only in `order` and `steals`.
///
/// Overdue hand-offs to `me` are stolen (the second half of a steal). With `target =
/// ceil(leases / workers)` (1 when there are at least as many workers as leases), a host under
/// target takes expired leases up to its shortfall, in `order`; only when none is expired does
/// it ask the most-loaded worker for `steals(that worker's count, target, shortfall)` of its
/// leases, picked by [`scramble`]. Every list is sorted.
pub(super) fn anchor_plan(
    snapshot: &Snapshot<'_>,
    order: ExpiredOrder,
    steals: impl FnOnce(usize, usize, usize) -> usize,
) -> Plan {
    let me = snapshot.me;
    let mut plan = Plan::default();
    if snapshot.live_hosts.binary_search(me).is_err() {
        return plan;
    }
    let partition = |i: usize| &snapshot.leases[i].lease.key.partition;
    // Overdue hand-offs to me are the second half of a steal.
    for view in snapshot.leases {
        let l = view.lease;
        if view.eligible
            && view.handoff_overdue
            && l.next_owner.as_ref() == Some(me)
            && l.owner.as_ref().is_some_and(|o| o != me)
            && l.state == LeaseState::Owned
        {
            plan.steal.push(l.key.partition.clone());
        }
    }
    let census = Census::new(snapshot);
    let workers = census.counts.len();
    let leases = census.eligible;
    if leases == 0 {
        return plan;
    }
    let target = if workers >= leases {
        1
    } else {
        leases.div_ceil(workers)
    };
    let mine = census.counts.get(me).copied().unwrap_or(0);
    let need = target.saturating_sub(mine);
    if need == 0 {
        // At or above target: nothing to take or ask for.
    } else if !census.expired.is_empty() {
        let mut expired = census.expired.clone();
        if order == ExpiredOrder::Shuffled {
            expired.sort_by_key(|&i| scramble(me, partition(i)));
        }
        plan.take = expired
            .into_iter()
            .take(need)
            .map(|i| partition(i).clone())
            .collect();
    } else if let Some((victim, count)) = census.most_loaded(me) {
        let mut candidates = census.held.get(victim).cloned().unwrap_or_default();
        candidates.sort_by_key(|&i| scramble(me, partition(i)));
        plan.request_handoff = candidates
            .into_iter()
            .take(steals(count, target, need))
            .map(|i| HandoffRequest {
                partition: partition(i).clone(),
                from: victim.clone(),
            })
            .collect();
    }
    plan.take.sort_unstable();
    plan.steal.sort_unstable();
    plan.request_handoff.sort_unstable();
    plan
}

impl BalanceStrategy for KclLike {
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        anchor_plan(snapshot, ExpiredOrder::Shuffled, |count, target, need| {
            // As many as the most-loaded worker is over target, or one if it sits exactly at
            // target and this host needs more than one; at most `max_leases_to_steal`.
            if count < target {
                return 0;
            }
            match need.min(count - target) {
                0 if need > 1 => 1,
                n => n,
            }
            .min(self.max_leases_to_steal)
        })
    }
}
