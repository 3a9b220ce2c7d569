//! What a host knows of the others from the reports their heartbeats carry ([`HostReport`]):
//! the lease limits each publishes, and for a host planning by measured load, the leases'
//! loads and when each lease last changed owner, as [`LoadShare`]'s [`LoadInput`] wants them.
//!
//! [`LoadShare`]: crate::balance::LoadShare

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tracing::debug;

use super::table::LeaseTable;
use crate::balance::LoadInput;
use crate::clock::Instant;
use crate::model::{HostLimits, HostName, HostReport, Membership, PartitionId};

/// The reports last read and the owner changes seen; see the module doc.
#[derive(Debug, Clone)]
pub(crate) struct LoadView {
    /// The clock's origin for [`LoadInput`]'s durations.
    origin: Instant,
    reports: BTreeMap<HostName, HostReport>,
    /// Each lease's holder when last planned, to see it change.
    holders: HashMap<PartitionId, Option<HostName>>,
    /// When `holders` was taken (since `origin`).
    holders_at: Duration,
    moved_at: BTreeMap<PartitionId, Duration>,
}

/// The maps a [`LoadInput`] borrows.
#[derive(Debug, Default)]
pub(crate) struct LoadMaps {
    lease_load: BTreeMap<PartitionId, f64>,
    capacity: BTreeMap<HostName, f64>,
    moved_at: BTreeMap<PartitionId, Duration>,
    now: Duration,
}

impl LoadMaps {
    pub(crate) fn input(&self) -> LoadInput<'_> {
        LoadInput {
            lease_load: &self.lease_load,
            capacity: &self.capacity,
            moved_at: &self.moved_at,
            now: self.now,
        }
    }
}

impl LoadView {
    pub(crate) fn new(origin: Instant) -> Self {
        LoadView {
            origin,
            reports: BTreeMap::new(),
            holders: HashMap::new(),
            holders_at: Duration::ZERO,
            moved_at: BTreeMap::new(),
        }
    }

    /// Takes in the reports of a membership read. A host without a readable report keeps
    /// none: its leases' loads are unknown, and its capacity is 1.
    pub(crate) fn observe(&mut self, membership: &Membership) {
        self.reports = membership
            .hosts
            .iter()
            .filter_map(|hb| {
                let text = hb.report.as_deref()?;
                match HostReport::parse(text) {
                    Ok(report) => Some((hb.host.clone(), report)),
                    Err(err) => {
                        debug!(host = %hb.host, error = %err, "ignoring a heartbeat report");
                        None
                    }
                }
            })
            .collect();
    }

    /// The lease limits the reports last read publish, by host (hosts publishing none are
    /// left out).
    pub(crate) fn published_limits(&self) -> BTreeMap<HostName, HostLimits> {
        self.reports
            .iter()
            .filter_map(|(h, r)| Some((h.clone(), r.limits()?)))
            .collect()
    }

    /// The limits `host`'s last report read publishes, if any.
    pub(crate) fn limits_of(&self, host: &HostName) -> Option<HostLimits> {
        self.reports.get(host)?.limits()
    }

    /// The load input at `now` over `table`: each lease's handler busy time per second as its
    /// owner last reported it (unknown when its owner's report does not name it), each
    /// reporting host's capacity, and when each lease last changed owner as far as this host
    /// can tell: no earlier than its last look before it saw the change (a lease seen for the
    /// first time has not moved, as far as this host knows).
    pub(crate) fn maps(&mut self, table: &LeaseTable, now: Instant) -> LoadMaps {
        let now = now.saturating_duration_since(self.origin);
        let mut lease_load = BTreeMap::new();
        let mut holders = HashMap::with_capacity(self.holders.len());
        for lease in table.rows() {
            let partition = &lease.key.partition;
            let holder = lease.owner.clone();
            match self.holders.get(partition) {
                // It changed hands after the last look, which is the earliest it can have
                // moved: dated then, a change seen late (this host was cut off or stalled for
                // a while) does not hold the lease for a whole dwell after this host is back.
                Some(before) if *before != holder => {
                    self.moved_at.insert(partition.clone(), self.holders_at);
                }
                _ => {}
            }
            holders.insert(partition.clone(), holder.clone());
            let reported = holder
                .as_ref()
                .and_then(|h| self.reports.get(h))
                .and_then(|r| r.leases.get(partition));
            if let Some(load) = reported {
                lease_load.insert(partition.clone(), load.busy);
            }
        }
        // Leases gone from the table are forgotten.
        self.moved_at.retain(|p, _| holders.contains_key(p));
        self.holders = holders;
        self.holders_at = now;
        let capacity = self
            .reports
            .iter()
            .map(|(h, r)| (h.clone(), r.capacity))
            .collect();
        LoadMaps {
            lease_load,
            capacity,
            moved_at: self.moved_at.clone(),
            now,
        }
    }
}
