//! An in-memory [`LeaseStore`]: the reference implementation, for tests and the simulator.

use crate::lease::{HeartbeatRole, MembershipStore};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::{Changes, LeaseStore, Listing};
use crate::error::LeaseError;
use crate::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    PartitionId, Timestamp, Version,
};

#[derive(Debug, Default)]
struct Group {
    leases: BTreeMap<PartitionId, Row>,
    hosts: BTreeMap<HostName, Heartbeat>,
    change_counter: u64,
    /// The partitions of the most recent moves of the change counter, oldest first, with the
    /// counter value each made: a lease created, deleted (`true`), or changing hands.
    changes: VecDeque<(u64, PartitionId, bool)>,
    /// Changes at or below this counter value are forgotten.
    forgotten: u64,
    view: Option<MembershipView>,
}

/// How many changes a group remembers for [`LeaseStore::list_changes`]; a host further behind
/// lists in full.
const CHANGES_KEPT: usize = 16_384;

impl Group {
    fn bump(&mut self, partition: &PartitionId, deleted: bool) {
        self.change_counter += 1;
        self.changes
            .push_back((self.change_counter, partition.clone(), deleted));
        if self.changes.len() > CHANGES_KEPT {
            if let Some((at, _, _)) = self.changes.pop_front() {
                self.forgotten = at;
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Row {
    /// The stored row, handed out as is by `list` and `list_changes` (readers share it).
    Lease(Arc<Lease>),
    /// A row made unreadable on purpose by a test (see [`MemoryLeaseStore::corrupt`]).
    Corrupt { version: Version, reason: String },
}

/// A [`LeaseStore`] in process memory. Cloning gives another handle to the same store.
///
/// Each call takes one mutex for a few map operations, so it serves millions of calls a second;
/// the simulator relies on that.
#[derive(Debug, Clone, Default)]
pub struct MemoryLeaseStore {
    groups: Arc<Mutex<HashMap<GroupName, Group>>>,
    head_reads_per_second: Option<f64>,
}

impl MemoryLeaseStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// This handle declares `limit` as its [`MembershipStore::head_reads_per_second`], as a store
    /// with a per-key read limit does. Feature `sim` only: the simulator and the benchmarks
    /// play such a store so; a program's in-memory store has no limit to declare.
    #[cfg(feature = "sim")]
    #[must_use]
    pub fn with_head_reads_per_second(mut self, limit: f64) -> Self {
        self.head_reads_per_second = Some(limit);
        self
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<GroupName, Group>> {
        // A panic while holding the lock cannot leave a half-applied write (each write is one
        // map operation), so a poisoned lock is still consistent.
        self.groups
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes the row of `key` unreadable, as a hand-edited row in a real store would be:
    /// `list` then reports it as [`LeaseError::Malformed`] with `reason`. For tests.
    pub fn corrupt(&self, key: &LeaseKey, reason: &str) {
        let mut groups = self.lock();
        let group = groups.entry(key.group.clone()).or_default();
        let version = match group.leases.get(&key.partition) {
            Some(Row::Lease(l)) => l.version,
            Some(Row::Corrupt { version, .. }) => *version,
            None => Version::FIRST,
        };
        group.leases.insert(
            key.partition.clone(),
            Row::Corrupt {
                version,
                reason: reason.to_string(),
            },
        );
    }

    /// A heartbeat write; with `lead`, also the copy into the view the host leads.
    #[allow(clippy::too_many_arguments)]
    fn write_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        lead: bool,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let mut groups = self.lock();
        let g = groups.entry(group.clone()).or_default();
        let current = g.hosts.get(host);
        let version = match (current, expected) {
            (None, None) => Version::FIRST,
            (Some(row), Some(v)) if row.version == v => v.next(),
            (current, _) => {
                return Err(LeaseError::HeartbeatConflict {
                    group: group.to_string(),
                    host: host.to_string(),
                    current: current.cloned().map(Box::new),
                })
            }
        };
        let row = Heartbeat {
            group: group.clone(),
            host: host.clone(),
            incarnation: incarnation.into(),
            version,
            written_at,
            report: report.map(Into::into),
        };
        g.hosts.insert(host.clone(), row.clone());
        if let Some(view) = g.view.as_mut().filter(|_| lead) {
            if &view.leader == host && &*view.leader_incarnation == incarnation {
                view.leader_heartbeat = version;
            }
        }
        Ok(row)
    }
}

fn malformed(key: &LeaseKey, reason: &str) -> LeaseError {
    LeaseError::Malformed {
        key: key.to_string(),
        reason: reason.to_string(),
    }
}

#[async_trait]
impl LeaseStore for MemoryLeaseStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let groups = self.lock();
        let mut listing = Listing::default();
        if let Some(g) = groups.get(group) {
            listing.leases.reserve(g.leases.len());
            for (partition, row) in &g.leases {
                match row {
                    Row::Lease(l) => listing.leases.push(l.clone()),
                    Row::Corrupt { reason, .. } => listing.malformed.push(malformed(
                        &LeaseKey::new(group.clone(), partition.clone()),
                        reason,
                    )),
                }
            }
        }
        Ok(listing)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        let groups = self.lock();
        match groups
            .get(&key.group)
            .and_then(|g| g.leases.get(&key.partition))
        {
            None => Ok(None),
            Some(Row::Lease(l)) => Ok(Some(Lease::clone(l))),
            Some(Row::Corrupt { reason, .. }) => Err(malformed(key, reason)),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        lease.validate()?;
        let mut groups = self.lock();
        let group = groups.entry(lease.key.group.clone()).or_default();
        if group.leases.contains_key(&lease.key.partition) {
            return Ok(None);
        }
        let mut stored = lease.clone();
        stored.version = Version::FIRST;
        group.leases.insert(
            lease.key.partition.clone(),
            Row::Lease(Arc::new(stored.clone())),
        );
        group.bump(&lease.key.partition, false);
        Ok(Some(stored))
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        lease.validate()?;
        let mut groups = self.lock();
        let group = groups
            .get_mut(&lease.key.group)
            .ok_or_else(|| LeaseError::NotFound {
                key: lease.key.to_string(),
            })?;
        let row =
            group
                .leases
                .get_mut(&lease.key.partition)
                .ok_or_else(|| LeaseError::NotFound {
                    key: lease.key.to_string(),
                })?;
        let current = match row {
            Row::Lease(l) => l,
            Row::Corrupt { reason, .. } => return Err(malformed(&lease.key, reason)),
        };
        if current.version != expected {
            return Err(LeaseError::Conflict {
                key: lease.key.to_string(),
                expected,
                current: Box::new(Lease::clone(current)),
            });
        }
        let bump = current.ownership_differs(lease);
        let mut stored = lease.clone();
        stored.version = expected.next();
        *current = Arc::new(stored.clone());
        if bump {
            group.bump(&lease.key.partition, false);
        }
        Ok(stored)
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        let mut groups = self.lock();
        let not_found = || LeaseError::NotFound {
            key: key.to_string(),
        };
        let group = groups.get_mut(&key.group).ok_or_else(not_found)?;
        let version = match group.leases.get(&key.partition).ok_or_else(not_found)? {
            Row::Lease(l) if l.version != expected => {
                return Err(LeaseError::Conflict {
                    key: key.to_string(),
                    expected,
                    current: Box::new(Lease::clone(l)),
                })
            }
            Row::Lease(l) => l.version,
            // A corrupt row can be deleted at its version, so an operator can clear it.
            Row::Corrupt { version, .. } => *version,
        };
        if version != expected {
            return Err(malformed(key, "version mismatch on a malformed row"));
        }
        group.leases.remove(&key.partition);
        group.bump(&key.partition, true);
        Ok(())
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        let groups = self.lock();
        let Some(g) = groups.get(group) else {
            // A group never written to is at counter 0.
            return Ok((since == 0).then(Changes::default));
        };
        if since < g.forgotten || since > g.change_counter {
            return Ok(None);
        }
        let mut changes = Changes {
            counter: g.change_counter,
            ..Changes::default()
        };
        let first = g.changes.partition_point(|(at, _, _)| *at <= since);
        // Per partition touched: whether it was deleted at some point in the window.
        let mut touched: Vec<(&PartitionId, bool)> = g
            .changes
            .range(first..)
            .map(|(_, p, deleted)| (p, *deleted))
            .collect();
        touched.sort_unstable();
        // Sorted by (partition, deleted): the last entry of a partition says whether any was a
        // deletion.
        touched.reverse();
        touched.dedup_by_key(|(p, _)| *p);
        touched.reverse();
        for (partition, was_deleted) in touched {
            let key = || LeaseKey::new(group.clone(), partition.clone());
            if was_deleted && g.leases.contains_key(partition) {
                // Deleted and created again: the new row restarts its versions, so a reader
                // must drop its cached row before taking this one.
                changes.deleted.push(key());
            }
            match g.leases.get(partition) {
                Some(Row::Lease(l)) => changes.leases.push(l.clone()),
                Some(Row::Corrupt { reason, .. }) => {
                    changes.malformed.push(malformed(&key(), reason));
                }
                None => changes.deleted.push(key()),
            }
        }
        Ok(Some(changes))
    }
}

#[async_trait]
impl MembershipStore for MemoryLeaseStore {
    fn head_reads_per_second(&self) -> Option<f64> {
        self.head_reads_per_second
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        self.write_heartbeat(
            group,
            host,
            incarnation,
            written_at,
            expected,
            role == HeartbeatRole::Leader,
            report,
        )
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let mut groups = self.lock();
        let Some(g) = groups.get_mut(group) else {
            return Ok(());
        };
        match g.hosts.get(host) {
            None => Ok(()),
            Some(row) if row.version == expected && &*row.incarnation == incarnation => {
                g.hosts.remove(host);
                Ok(())
            }
            Some(row) => Err(LeaseError::HeartbeatConflict {
                group: group.to_string(),
                host: host.to_string(),
                current: Some(Box::new(row.clone())),
            }),
        }
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let groups = self.lock();
        Ok(groups
            .get(group)
            .map(|g| Membership {
                hosts: g.hosts.values().cloned().collect(),
                change_counter: g.change_counter,
            })
            .unwrap_or_default())
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        let groups = self.lock();
        Ok(Some(
            groups
                .get(group)
                .map(|g| GroupHead {
                    change_counter: g.change_counter,
                    view: g.view.clone(),
                })
                .unwrap_or_default(),
        ))
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let mut groups = self.lock();
        let g = groups.entry(group.clone()).or_default();
        let current = g.view.as_ref().map_or(0, |v| v.version);
        if current != expected {
            return Err(LeaseError::ViewConflict {
                group: group.to_string(),
                expected,
                current: g.view.clone().map(Box::new),
            });
        }
        let mut stored = view.clone();
        stored.version = expected + 1;
        g.view = Some(stored.clone());
        Ok(stored)
    }
}
