//! [`Census`]: the eligible leases indexed the way [`super::EqualShare`] counts them, kept up to
//! date one lease at a time, so that planning after a few leases changed costs O(changed leases
//! + hosts) rather than a pass over every lease.
//!
//! The census owns the indexes and nothing else: which leases are eligible is the caller's
//! judgement (the processor's lease table knows the parents of each lease, see
//! [`super::LeaseView::eligible`]), and who is live or dead is given at planning time
//! ([`CensusSnapshot`]). The indexes are keyed by owner and asker names, not by liveness, so a
//! host dying or joining changes no index: the planner classifies the owners again, in
//! O(hosts).

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::sync::Arc;

use imbl::{OrdMap, OrdSet};

use crate::model::{HostName, Lease, LeaseState, PartitionId};

/// A lease in a census set: ordered, compared and looked up by partition.
#[derive(Debug, Clone)]
pub(super) struct Row(pub(super) Arc<Lease>);

impl PartialEq for Row {
    fn eq(&self, other: &Self) -> bool {
        self.0.key.partition == other.0.key.partition
    }
}

impl Eq for Row {}

impl PartialOrd for Row {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Row {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.key.partition.cmp(&other.0.key.partition)
    }
}

impl Borrow<PartitionId> for Row {
    fn borrow(&self) -> &PartitionId {
        &self.0.key.partition
    }
}

/// The host holding `lease` as the balancer counts it: its owner while it is owned.
pub(crate) fn holder(lease: &Lease) -> Option<&HostName> {
    match (lease.state, &lease.owner) {
        (LeaseState::Owned, Some(owner)) => Some(owner),
        _ => None,
    }
}

/// The eligible leases of a group, indexed by holder and by asker.
///
/// The caller adds a lease when it becomes eligible ([`Census::insert`]) and removes it, with
/// the same row, before the row changes or stops being eligible ([`Census::remove`]).
/// Finished leases are never counted, whatever the caller says. Each lease is one shared row
/// (`Arc<Lease>`): the census holds no copy of it.
///
/// [`super::EqualShare`] plans from a census with
/// [`super::BalanceStrategy::plan_census`], giving exactly the plan
/// [`super::BalanceStrategy::plan`] gives on the equivalent [`super::Snapshot`].
#[derive(Debug, Clone, Default)]
pub struct Census {
    /// How many leases are counted.
    eligible: usize,
    /// Per holder: its counted leases.
    pub(super) held: OrdMap<HostName, OrdSet<Row>>,
    /// Counted leases with no holder.
    pub(super) unheld: OrdSet<Row>,
    /// Per host named as `next_owner`: the counted leases naming it (few: pending hand-offs).
    pub(super) asked: OrdMap<HostName, OrdSet<Row>>,
    /// Per asker: the part of its `asked` leases with no holder. With `held_asked` and
    /// `self_asked` it lets a plan count the hand-offs pending between live hosts from the
    /// sizes of these sets, walking only the leases of hosts that are not live.
    pub(super) asked_unheld: OrdMap<HostName, OrdSet<Row>>,
    /// Per holder: its counted leases that name a `next_owner` (itself included).
    pub(super) held_asked: OrdMap<HostName, OrdSet<Row>>,
    /// Per holder: how many of its counted leases name itself as `next_owner`.
    pub(super) self_asked: OrdMap<HostName, usize>,
}

impl Census {
    /// An empty census.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many leases are counted.
    pub fn len(&self) -> usize {
        self.eligible
    }

    /// Whether no lease is counted.
    pub fn is_empty(&self) -> bool {
        self.eligible == 0
    }

    /// Counts `lease`, which the caller judged eligible. A finished lease is not counted. A
    /// lease of a partition already counted replaces nothing: remove the old row first.
    pub fn insert(&mut self, lease: Arc<Lease>) {
        if lease.state == LeaseState::Finished {
            return;
        }
        if let Some(asker) = &lease.next_owner {
            self.asked
                .entry(asker.clone())
                .or_default()
                .insert(Row(lease.clone()));
            match holder(&lease) {
                Some(owner) => {
                    let added = self
                        .held_asked
                        .entry(owner.clone())
                        .or_default()
                        .insert(Row(lease.clone()))
                        .is_none();
                    if added && owner == asker {
                        *self.self_asked.entry(owner.clone()).or_default() += 1;
                    }
                }
                None => {
                    self.asked_unheld
                        .entry(asker.clone())
                        .or_default()
                        .insert(Row(lease.clone()));
                }
            }
        }
        let added = match holder(&lease) {
            Some(owner) => {
                let owner = owner.clone();
                self.held.entry(owner).or_default().insert(Row(lease))
            }
            None => self.unheld.insert(Row(lease)),
        }
        .is_none();
        self.eligible += usize::from(added);
    }

    /// Stops counting `lease`, given as it was counted (its holder and `next_owner` say where
    /// it is indexed). Returns whether it was counted.
    pub fn remove(&mut self, lease: &Lease) -> bool {
        let partition = &lease.key.partition;
        if let Some(asker) = &lease.next_owner {
            remove_from(&mut self.asked, asker, partition);
            match holder(lease) {
                Some(owner) => {
                    let removed = remove_from(&mut self.held_asked, owner, partition);
                    if removed && owner == asker {
                        if let Some(n) = self.self_asked.get_mut(owner) {
                            *n -= 1;
                            if *n == 0 {
                                self.self_asked.remove(owner);
                            }
                        }
                    }
                }
                None => {
                    remove_from(&mut self.asked_unheld, asker, partition);
                }
            }
        }
        let removed = match holder(lease) {
            Some(owner) => remove_from(&mut self.held, owner, partition),
            None => self.unheld.remove(partition).is_some(),
        };
        self.eligible -= usize::from(removed);
        removed
    }

    /// The counted leases, each once, in no particular order (for checks and tools).
    pub fn leases(&self) -> impl Iterator<Item = &Arc<Lease>> {
        self.held
            .values()
            .flatten()
            .chain(&self.unheld)
            .map(|row| &row.0)
    }
}

/// Two censuses are equal when they count the same rows (compared whole, not only by
/// partition) under the same holders and askers: an incrementally kept census must equal a
/// fresh count of the same table.
impl PartialEq for Census {
    fn eq(&self, other: &Self) -> bool {
        fn same(a: &OrdSet<Row>, b: &OrdSet<Row>) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| *x.0 == *y.0)
        }
        fn same_by_host(
            a: &OrdMap<HostName, OrdSet<Row>>,
            b: &OrdMap<HostName, OrdSet<Row>>,
        ) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|((h, x), (k, y))| h == k && same(x, y))
        }
        self.eligible == other.eligible
            && same(&self.unheld, &other.unheld)
            && same_by_host(&self.held, &other.held)
            && same_by_host(&self.asked, &other.asked)
            && same_by_host(&self.asked_unheld, &other.asked_unheld)
            && same_by_host(&self.held_asked, &other.held_asked)
            && self.self_asked == other.self_asked
    }
}

impl Eq for Census {}

/// Removes `partition` from `key`'s set, dropping the set when it empties.
fn remove_from(
    sets: &mut OrdMap<HostName, OrdSet<Row>>,
    key: &HostName,
    partition: &PartitionId,
) -> bool {
    let Some(set) = sets.get_mut(key) else {
        return false;
    };
    let removed = set.remove(partition).is_some();
    if set.is_empty() {
        sets.remove(key);
    }
    removed
}

/// What the census path plans from: a [`super::Snapshot`] with the leases given as a
/// [`Census`], and the hosts judged dead.
#[derive(Clone, Copy)]
pub struct CensusSnapshot<'a> {
    /// The host the plan is for.
    pub me: &'a HostName,
    /// The hosts with a live heartbeat, including `me` (as [`super::Snapshot::live_hosts`]).
    pub live_hosts: &'a [HostName],
    /// The hosts judged dead, whose leases are free. `None`: every holder not in `live_hosts`
    /// is dead. With `Some`, a holder neither live nor dead is unknown: its leases are neither
    /// free nor counted in any quota, as if they were ineligible.
    pub dead_hosts: Option<&'a BTreeSet<HostName>>,
    /// The eligible leases.
    pub census: &'a Census,
    /// Whether the hand-off of `partition` to `me` is overdue (see
    /// [`super::LeaseView::handoff_overdue`]).
    pub handoff_overdue: &'a dyn Fn(&PartitionId) -> bool,
}

impl std::fmt::Debug for CensusSnapshot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CensusSnapshot")
            .field("me", self.me)
            .field("live_hosts", &self.live_hosts)
            .field("dead_hosts", &self.dead_hosts)
            .field("census", &self.census.len())
            .finish_non_exhaustive()
    }
}
