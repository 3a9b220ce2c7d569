//! A [`LeaseStore`] wrapper that counts calls and rows, and reports them as metrics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use super::{Changes, LeaseStore, Listing, StoreOp};
use crate::error::LeaseError;
use crate::model::{GroupHead, GroupName, Lease, LeaseKey, Membership};

/// Counts of store calls, shared between a [`CountingStore`] and whoever reads them.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Read calls (`list`, `list_changes`, `get`, `membership`).
    pub reads: AtomicU64,
    /// Write calls (`create`, `replace`, `delete`, `heartbeat`, `remove_heartbeat`).
    pub writes: AtomicU64,
    /// Lease rows returned by `list`, `list_changes` and `get`.
    pub lease_rows_read: AtomicU64,
    /// `list` calls.
    pub lists: AtomicU64,
    /// `heartbeat` calls, as member or leader.
    pub heartbeats: AtomicU64,
    /// Heartbeat rows returned by `membership`.
    pub heartbeat_rows_read: AtomicU64,
    /// Head rows (change counter and membership view) returned by `head`.
    pub head_rows_read: AtomicU64,
}

impl StoreStats {
    /// A copy of the counts as plain numbers.
    pub fn snapshot(&self) -> StoreCounts {
        StoreCounts {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            lease_rows_read: self.lease_rows_read.load(Ordering::Relaxed),
            lists: self.lists.load(Ordering::Relaxed),
            heartbeats: self.heartbeats.load(Ordering::Relaxed),
            heartbeat_rows_read: self.heartbeat_rows_read.load(Ordering::Relaxed),
            head_rows_read: self.head_rows_read.load(Ordering::Relaxed),
        }
    }
}

/// Plain counts from [`StoreStats::snapshot`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreCounts {
    /// Read calls.
    pub reads: u64,
    /// Write calls.
    pub writes: u64,
    /// Lease rows read.
    pub lease_rows_read: u64,
    /// `list` calls.
    pub lists: u64,
    /// `heartbeat` calls.
    pub heartbeats: u64,
    /// Heartbeat rows read (by `membership`).
    pub heartbeat_rows_read: u64,
    /// Head rows read (by `head`).
    pub head_rows_read: u64,
}

impl StoreCounts {
    /// What was counted between `earlier` and `self` (each count at least 0).
    pub fn since(&self, earlier: &StoreCounts) -> StoreCounts {
        StoreCounts {
            reads: self.reads.saturating_sub(earlier.reads),
            writes: self.writes.saturating_sub(earlier.writes),
            lease_rows_read: self.lease_rows_read.saturating_sub(earlier.lease_rows_read),
            lists: self.lists.saturating_sub(earlier.lists),
            heartbeats: self.heartbeats.saturating_sub(earlier.heartbeats),
            heartbeat_rows_read: self
                .heartbeat_rows_read
                .saturating_sub(earlier.heartbeat_rows_read),
            head_rows_read: self.head_rows_read.saturating_sub(earlier.head_rows_read),
        }
    }

    /// The sum of `self` and `other`.
    pub fn plus(&self, other: &StoreCounts) -> StoreCounts {
        StoreCounts {
            reads: self.reads + other.reads,
            writes: self.writes + other.writes,
            lease_rows_read: self.lease_rows_read + other.lease_rows_read,
            lists: self.lists + other.lists,
            heartbeats: self.heartbeats + other.heartbeats,
            heartbeat_rows_read: self.heartbeat_rows_read + other.heartbeat_rows_read,
            head_rows_read: self.head_rows_read + other.head_rows_read,
        }
    }
}

/// Wraps a store, counting every call in [`StoreStats`] and in the metrics
/// `changefeed_store_reads_total`, `changefeed_store_writes_total`,
/// `changefeed_store_lease_rows_read_total` (label `op`) and
/// `changefeed_store_heartbeat_rows_read_total` and `changefeed_store_head_rows_read_total`.
///
/// A `head` call to a store that keeps no view (it answers `None` without a round trip) is
/// not counted.
#[derive(Debug, Clone)]
pub struct CountingStore {
    inner: Arc<dyn LeaseStore>,
    stats: Arc<StoreStats>,
}

impl CountingStore {
    /// Wraps `inner`, counting into `stats`.
    pub fn new(inner: Arc<dyn LeaseStore>, stats: Arc<StoreStats>) -> Self {
        Self { inner, stats }
    }

    fn read(&self, op: &'static str, rows: u64) {
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .lease_rows_read
            .fetch_add(rows, Ordering::Relaxed);
        metrics::counter!("changefeed_store_reads_total", "op" => op).increment(1);
        if rows > 0 {
            metrics::counter!("changefeed_store_lease_rows_read_total", "op" => op).increment(rows);
        }
    }

    fn write(&self, op: &'static str) {
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("changefeed_store_writes_total", "op" => op).increment(1);
    }
}

#[async_trait]
impl super::ForwardingStore for CountingStore {
    fn inner(&self) -> &dyn LeaseStore {
        &*self.inner
    }

    /// Counts the calls that return no lease rows: writes, and `membership`.
    async fn before(&self, op: StoreOp) -> Result<(), LeaseError> {
        if op.is_write() {
            self.write(op.as_str());
            if matches!(op, StoreOp::Heartbeat) {
                self.stats.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            self.read(op.as_str(), 0);
        }
        Ok(())
    }

    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let r = self.inner.list(group).await;
        self.stats.lists.fetch_add(1, Ordering::Relaxed);
        let rows = r
            .as_ref()
            .map(|l| (l.leases.len() + l.malformed.len()) as u64)
            .unwrap_or(0);
        self.read("list", rows);
        r
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        let r = self.inner.list_changes(group, since).await;
        let rows = match &r {
            Ok(Some(c)) => (c.leases.len() + c.malformed.len()) as u64,
            _ => 0,
        };
        self.read("list_changes", rows);
        r
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let r = self.inner.membership(group).await;
        self.read("membership", 0);
        let rows = r.as_ref().map(|m| m.hosts.len() as u64).unwrap_or(0);
        self.stats
            .heartbeat_rows_read
            .fetch_add(rows, Ordering::Relaxed);
        if rows > 0 {
            metrics::counter!("changefeed_store_heartbeat_rows_read_total").increment(rows);
        }
        r
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        let r = self.inner.get(key).await;
        self.read("get", 1);
        r
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        let r = self.inner.head(group).await;
        if let Ok(Some(_)) = &r {
            self.read("head", 0);
            self.stats.head_rows_read.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("changefeed_store_head_rows_read_total").increment(1);
        }
        r
    }
}
