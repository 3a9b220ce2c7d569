//! [`Kcl3Like`]: the lease assignment of the Kinesis Client Library 3.x, as a
//! [`BalanceStrategy`], so the simulator and the `rebalance` benchmark can compare it with
//! [`super::EqualShare`] and [`super::KclLike`] (KCL 2.x) under the same processor.
//!
//! What is modelled (KCL 3.x `LeaseAssignmentManager` with its variance-based decider):
//!
//! - **A leader assigns.** The leader is the first live host in name order (KCL 3.x elects one
//!   through a lock; any stable choice gives the same plans here). Every
//!   `leaseAssignmentIntervalMillis` (2 × `failoverTimeMillis`, 20 s at the defaults) it reads
//!   the whole lease table and decides, for the fleet, which worker should own each lease.
//! - **Free and expired leases go to the least-loaded workers**, one at a time, each to the
//!   worker with the fewest leases at that moment (ties by name), in partition order.
//! - **Over-loaded workers give leases to under-loaded ones** until every worker holds within
//!   one lease of every other. KCL 3.x measures load as throughput (or CPU); the simulated feed
//!   is uniform, so load here is the number of eligible leases.
//! - **Graceful hand-off**: a lease moved off a live worker is handed over when its owner has
//!   finished and checkpointed, and taken anyway once `gracefulLeaseHandoffTimeoutMillis`
//!   (30 s) has passed.
//!
//! How it maps onto our protocol, where the host taking a lease writes it: every host runs
//! this strategy on its snapshot and works out the leader's assignment; its own plan is the
//! leader's decisions that name it. "The leader assigns lease L to host H" becomes a `take` in
//! H's plan when L is free, a `request_handoff` (then a `steal` once
//! [`super::LeaseView::handoff_overdue`], the graceful hand-off timeout) when a live host holds it.
//! Nobody releases. On one snapshot every host computes the same assignment, so the plans never
//! name a lease twice; hosts that see different snapshots may collide and the compare-and-swap
//! decides, as with the leader's own conditional writes.
//!
//! What is approximated: a [`Snapshot`] carries no time, so the strategy cannot wait for the
//! leader's next assignment round. The leader's cadence is the acquire interval instead (the
//! benchmark runs this strategy with `acquire_interval` = 2 × failover), and a worker picks
//! up its assignment at its own next cycle rather than at the leader's write. KCL 3.x also
//! dampens each rebalance (`dampeningPercentage`, 60 %) and only rebalances workers whose
//! load is more than `reBalanceThresholdPercentage` (10 %) from the average; this model moves
//! the whole difference at once and balances to within one lease, which is at least as fast as
//! the real one.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{BalanceStrategy, HandoffRequest, Plan, Snapshot};
use crate::model::{HostName, LeaseState, PartitionId};

/// KCL 3.x's leader-driven lease assignment; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct Kcl3Like;

impl Kcl3Like {
    /// The host whose assignment every host follows: the first live host in name order.
    ///
    /// The plan does not depend on which host asks: every host works out the same fleet-wide
    /// assignment from the same snapshot, the one this host would write as leader.
    pub fn leader(live_hosts: &[HostName]) -> Option<&HostName> {
        live_hosts.iter().min()
    }
}

/// One eligible lease as the leader sees it.
#[derive(Debug, Clone, Copy)]
enum Seen {
    /// No live owner; `asker` is a live host named in `next_owner` (an assignment in flight
    /// whose owner died), which keeps it.
    Free { asker: Option<usize> },
    /// A live owner. `pending`: a live host other than the owner it is being handed to.
    Held {
        owner: usize,
        pending: Option<usize>,
    },
}

impl BalanceStrategy for Kcl3Like {
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        let mut hosts: Vec<&HostName> = snapshot.live_hosts.iter().collect();
        hosts.sort_unstable();
        hosts.dedup();
        let index = |h: &HostName| hosts.binary_search(&h).ok();
        let Some(me) = index(snapshot.me) else {
            return Plan::default();
        };
        let leases = snapshot.leases;
        let partition = |i: usize| -> &PartitionId { &leases[i].lease.key.partition };
        let mut plan = Plan::default();

        // The leader's census: what every live host holds, counting assignments in flight
        // (pending hand-offs) for the assignee.
        let mut load = vec![0usize; hosts.len()];
        let mut seen: Vec<(usize, Seen)> = Vec::new();
        for (i, view) in leases.iter().enumerate() {
            let lease = view.lease;
            if !view.eligible || lease.state == LeaseState::Finished {
                continue;
            }
            let owner = match (lease.state, &lease.owner) {
                (LeaseState::Owned, Some(o)) => index(o),
                _ => None,
            };
            let asker = lease.next_owner.as_ref().and_then(index);
            let s = match owner {
                None => {
                    if let Some(a) = asker {
                        load[a] += 1;
                    }
                    Seen::Free { asker }
                }
                Some(owner) => {
                    let pending = asker.filter(|&a| a != owner);
                    load[pending.unwrap_or(owner)] += 1;
                    if pending == Some(me) && view.handoff_overdue {
                        // The graceful hand-off timed out: take it.
                        plan.steal.push(partition(i).clone());
                    }
                    Seen::Held { owner, pending }
                }
            };
            seen.push((i, s));
        }
        seen.sort_by(|a, b| partition(a.0).cmp(partition(b.0)).then(a.0.cmp(&b.0)));

        // 1. Free and expired leases: an assignment in flight stands; the others go, one at a
        // time, to the least-loaded host.
        let mut lightest: BinaryHeap<Reverse<(usize, usize)>> =
            BinaryHeap::with_capacity(hosts.len());
        for &(i, s) in &seen {
            if let Seen::Free { asker: Some(a) } = s {
                if a == me {
                    plan.take.push(partition(i).clone());
                }
            }
        }
        lightest.extend(load.iter().enumerate().map(|(h, &l)| Reverse((l, h))));
        for &(i, s) in &seen {
            if let Seen::Free { asker: None } = s {
                let Some(Reverse((l, h))) = lightest.pop() else {
                    break;
                };
                load[h] = l + 1;
                lightest.push(Reverse((l + 1, h)));
                if h == me {
                    plan.take.push(partition(i).clone());
                }
            }
        }

        // 2. Equalise: the most-loaded host (ties: first by name) gives its first lease in
        // partition order with no assignment in flight to the least-loaded (ties: first by
        // name), until every host is within one lease of every other.
        let mut movable: Vec<Vec<usize>> = vec![Vec::new(); hosts.len()];
        for &(i, s) in seen.iter().rev() {
            if let Seen::Held {
                owner,
                pending: None,
            } = s
            {
                movable[owner].push(i); // reversed: pop() gives the first in partition order
            }
        }
        loop {
            let heaviest = (0..hosts.len()).max_by_key(|&h| (load[h], Reverse(h)));
            let lightest = (0..hosts.len()).min_by_key(|&h| (load[h], h));
            let (Some(from), Some(to)) = (heaviest, lightest) else {
                break;
            };
            if load[from] <= load[to] + 1 {
                break;
            }
            let Some(i) = movable[from].pop() else {
                // Everything the heaviest holds is already moving: nothing more to assign.
                break;
            };
            load[from] -= 1;
            load[to] += 1;
            if to == me {
                plan.request_handoff.push(HandoffRequest {
                    partition: partition(i).clone(),
                    from: hosts[from].clone(),
                });
            }
        }

        plan.take.sort_unstable();
        plan.steal.sort_unstable();
        plan.request_handoff.sort_unstable();
        plan
    }
}
