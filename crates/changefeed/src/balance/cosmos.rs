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

use super::kcl::{anchor_plan, ExpiredOrder};
use super::{BalanceStrategy, Plan, Snapshot};

/// The Cosmos DB processor's equal-partitions rule; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct CosmosLike;

impl BalanceStrategy for CosmosLike {
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        anchor_plan(snapshot, ExpiredOrder::AsRead, |count, target, need| {
            // One lease, from a worker over target (or at target when this host needs more
            // than one).
            usize::from(count > target - usize::from(need > 1))
        })
    }
}
