//! The processor's bound on every store and source call: a call that has not answered within
//! [`Settings::call_timeout`](super::Settings::call_timeout) (`lease_expiry − safety_margin`)
//! is given up (its future dropped) and fails with a retryable error, which its caller handles
//! as any other failure of that call.
//!
//! A client library may hang a call for ever: a connection whose peer vanished without a reset
//! (a black-holed network, a server restarted behind a firewall that forgot the flow) answers
//! nothing, and a pool that hands such a connection out again hangs every later call too.
//! Without a bound, one such call stalls the host loop, or a worker, for ever while the host
//! stays up (a host cut off by a silent network fault and then a database restart would do
//! nothing until someone restarted it). With it, the host loop's next cycle, the worker's retry and
//! the heartbeat's next renewal each make a new call: a client that closes a connection whose
//! call was dropped then opens a fresh one and recovers. (A client that returns such a
//! connection to its pool cannot be saved from here; see `docs/simulation.md`, the `forget`
//! cut.)
//!
//! No answer that late is of use: by then a host whose heartbeat had waited as long would have
//! fenced itself, and every read it made is stale. The heartbeat's own renewals are bounded
//! more tightly still (`min(safety_margin, renew_interval)`).
//!
//! The bound runs on the processor's clock, so a stalled process (whose timers do not run)
//! does not give up a call that was answered while it stood still.

use crate::lease::{HeartbeatRole, MembershipStore};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Clock;
use crate::error::{LeaseError, SourceError};
use crate::lease::{Changes, LeaseStore, Listing};
use crate::lineage::ChildStart;
use crate::model::{
    Batch, Continuation, GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership,
    MembershipView, Partition, PartitionId, Position, Timestamp, Version,
};
use crate::source::{FeedSource, LeasedPartition, OldestUnread, PartitionReader};

/// The bound and the clock it runs on.
#[derive(Clone)]
struct Bound {
    clock: Arc<dyn Clock>,
    limit: Duration,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl Bound {
    /// Runs `call`, or gives it up with `gave_up(limit)` once the bound has passed.
    async fn within<T, E>(
        &self,
        seam: &'static str,
        op: &'static str,
        call: impl Future<Output = Result<T, E>>,
        gave_up: impl FnOnce(String) -> E,
    ) -> Result<T, E> {
        let limit = self.clock.sleep(self.limit);
        tokio::select! {
            biased;
            r = call => r,
            _ = limit => {
                metrics::counter!("changefeed_calls_given_up_total", "seam" => seam, "op" => op)
                    .increment(1);
                tracing::warn!(seam, op, limit = ?self.limit, "call gave no answer within lease_expiry − safety_margin; given up");
                Err(gave_up(format!(
                    "no answer within {:?} (lease_expiry − safety_margin); the call was given up",
                    self.limit
                )))
            }
        }
    }
}

/// A [`LeaseStore`] whose every call is bounded (see the module docs).
#[derive(Debug)]
pub(crate) struct BoundedStore {
    inner: Arc<dyn LeaseStore>,
    bound: Bound,
}

impl BoundedStore {
    pub(crate) fn new(inner: Arc<dyn LeaseStore>, clock: Arc<dyn Clock>, limit: Duration) -> Self {
        Self {
            inner,
            bound: Bound { clock, limit },
        }
    }

    async fn within<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        self.bound
            .within("store", op, call, |why| {
                LeaseError::store(op, None, true, why)
            })
            .await
    }
}

#[async_trait]
impl LeaseStore for BoundedStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        self.within("list", self.inner.list(group)).await
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        self.within("get", self.inner.get(key)).await
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        self.within("create", self.inner.create(lease)).await
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        self.within("replace", self.inner.replace(lease, expected))
            .await
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        self.within("delete", self.inner.delete(key, expected))
            .await
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        self.within("list_changes", self.inner.list_changes(group, since))
            .await
    }
}

#[async_trait]
impl MembershipStore for BoundedStore {
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
        self.within(
            "heartbeat",
            self.inner
                .heartbeat(group, host, incarnation, written_at, expected, role, report),
        )
        .await
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        self.within(
            "remove_heartbeat",
            self.inner
                .remove_heartbeat(group, host, incarnation, expected),
        )
        .await
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        self.within("membership", self.inner.membership(group))
            .await
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        self.within("head", self.inner.head(group)).await
    }

    fn head_reads_per_second(&self) -> Option<f64> {
        self.inner.head_reads_per_second()
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        self.within("write_view", self.inner.write_view(group, view, expected))
            .await
    }
}

/// A [`FeedSource`] whose every call, and every call of the readers it opens, is bounded (see
/// the module docs).
#[derive(Debug)]
pub(crate) struct BoundedSource {
    inner: Arc<dyn FeedSource>,
    bound: Bound,
}

impl BoundedSource {
    pub(crate) fn new(inner: Arc<dyn FeedSource>, clock: Arc<dyn Clock>, limit: Duration) -> Self {
        Self {
            inner,
            bound: Bound { clock, limit },
        }
    }
}

/// The error of a source call given up on.
fn source_gave_up(
    op: &'static str,
    partition: Option<&PartitionId>,
) -> impl FnOnce(String) -> SourceError {
    let partition = partition.map(|p| p.to_string());
    move |why| SourceError::source(op, partition, true, why)
}

#[async_trait]
impl FeedSource for BoundedSource {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.bound
            .within(
                "source",
                "partitions",
                self.inner.partitions(),
                source_gave_up("partitions", None),
            )
            .await
    }

    async fn partitions_for(
        &self,
        leased: &[LeasedPartition],
    ) -> Result<Vec<Partition>, SourceError> {
        self.bound
            .within(
                "source",
                "partitions",
                self.inner.partitions_for(leased),
                source_gave_up("partitions", None),
            )
            .await
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let reader = self
            .bound
            .within(
                "source",
                "open",
                self.inner.open(partition, from),
                source_gave_up("open", Some(partition)),
            )
            .await?;
        Ok(Box::new(BoundedReader {
            inner: reader,
            partition: partition.clone(),
            bound: self.bound.clone(),
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        self.bound
            .within(
                "source",
                "remaining",
                self.inner.remaining(partition, after),
                source_gave_up("remaining", Some(partition)),
            )
            .await
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        self.bound
            .within(
                "source",
                "oldest_unread",
                self.inner.oldest_unread(partition, after),
                source_gave_up("oldest_unread", Some(partition)),
            )
            .await
    }

    fn child_start(&self) -> ChildStart {
        self.inner.child_start()
    }

    fn retired(&self, partition: &PartitionId) -> bool {
        self.inner.retired(partition)
    }
}

/// A reader whose every read is bounded. A read given up on leaves the reader at its place
/// ([`PartitionReader::next_batch`]: the next call reads the same records again).
#[derive(Debug)]
struct BoundedReader {
    inner: Box<dyn PartitionReader>,
    partition: PartitionId,
    bound: Bound,
}

#[async_trait]
impl PartitionReader for BoundedReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        let gave_up = source_gave_up("read", Some(&self.partition));
        self.bound
            .within("source", "read", self.inner.next_batch(max), gave_up)
            .await
    }
}
