//! [`CosmosLike`]: the Azure Cosmos DB change feed processor's `EqualPartitionsBalancingStrategy`
//! as a [`BalanceStrategy`], so the simulator can compare it with [`super::EqualShare`] under the
//! same processor and timings.
//!
//! What is modelled (`EqualPartitionsBalancingStrategy.SelectLeasesToTake`):
//!
//! - Workers are the hosts owning at least one live lease, plus the asking host.
//! - `target = ceil(leases / workers)` when there are more leases than workers, else 1.
//! - A host under target takes free and expired leases up to its target, in bulk (the real
//!   processor judges "expired" by the lease document's store timestamp; the shell here judges
//!   it by the owner's heartbeat, which expires after the same interval).
//! - Otherwise it steals **one** lease per acquire cycle from the most-loaded worker, if that
//!   worker holds more than `target` (or at least `target` when the asker needs more than one).
//!
//! As with [`super::KclLike`], a steal is a hand-off request (then a steal if overdue), the
//! only way the [`BalanceStrategy`] contract lets a strategy reach a live host's lease.

use super::kcl::{scramble, Census};
use super::{BalanceStrategy, HandoffRequest, Plan, Snapshot};
use crate::model::LeaseState;

/// The Cosmos DB processor's equal-partitions rule; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct CosmosLike;

impl BalanceStrategy for CosmosLike {
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        let me = snapshot.me;
        let mut plan = Plan::default();
        if snapshot.live_hosts.binary_search(me).is_err() {
            return plan;
        }
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
        let partitions = census.eligible;
        let workers = census.counts.len();
        if partitions == 0 {
            return plan;
        }
        let target = if partitions > workers {
            partitions.div_ceil(workers)
        } else {
            1
        };
        let mine = census.counts.get(me).copied().unwrap_or(0);
        let need = target.saturating_sub(mine);
        if need > 0 {
            if !census.expired.is_empty() {
                // Cosmos takes expired leases in the order it read them.
                plan.take = census
                    .expired
                    .iter()
                    .take(need)
                    .map(|&i| snapshot.leases[i].lease.key.partition.clone())
                    .collect();
            } else if let Some((victim, count)) = census.most_loaded(me) {
                let floor = target - usize::from(need > 1);
                if count > floor {
                    let candidates = census.held.get(victim).cloned().unwrap_or_default();
                    if let Some(&i) = candidates
                        .iter()
                        .min_by_key(|&&i| scramble(me, &snapshot.leases[i].lease.key.partition))
                    {
                        plan.request_handoff.push(HandoffRequest {
                            partition: snapshot.leases[i].lease.key.partition.clone(),
                            from: victim.clone(),
                        });
                    }
                }
            }
        }
        plan.take.sort_unstable();
        plan.steal.sort_unstable();
        plan
    }
}
