//! The seams every simulated host talks through: a store, a source, a handler and a clock per
//! host, each wrapping the shared in-memory one and injecting that host's faults (switched by
//! its [`HostCtl`]), and logging what it does to the shared [`World`].

use crate::lease::{HeartbeatRole, MembershipStore};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::pool::{Lent, Pool};
use super::world::{lock, Delivery, World, WriteOp};
use crate::clock::{Clock, Sleep, VirtualClock};
use crate::error::{LeaseError, SourceError};
use crate::lease::{LeaseStore, Listing, MemoryLeaseStore};
use crate::model::{
    Batch, Continuation, GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership,
    MembershipView, Partition, PartitionId, Position, Timestamp, Version,
};
use crate::processor::{CloseReason, Context, Handler, HandlerError};
use crate::source::{FeedSource, MemoryFeed, PartitionReader};

/// How a host's store connection is cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Connected.
    None,
    /// Every call fails at once with a retryable error.
    Fail,
    /// Every call hangs until the cut ends, then fails (a client-side timeout) or, half the
    /// time, reaches the store late.
    Hang,
    /// The host's network is black-holed (store and feed alike): every call hangs as in
    /// [`Cut::Hang`] while it lasts, and when it ends every connection that was open during it
    /// is dead: a request on one hangs until its caller gives up (a flow the server or a
    /// middlebox forgot, with no reset to tell the client). See `sim::pool`.
    Forget,
}

/// A flag tasks can wait on, waking them in a fixed order. (A `tokio::sync::watch` spreads
/// its waiters over eight queues at random, so the order its waiters wake in, and with it the
/// run, would differ between runs.)
#[derive(Debug)]
struct Flag<T> {
    value: Mutex<T>,
    changed: Notify,
}

impl<T: Copy + PartialEq> Flag<T> {
    fn new(value: T) -> Self {
        Self {
            value: Mutex::new(value),
            changed: Notify::new(),
        }
    }

    fn get(&self) -> T {
        *lock(&self.value)
    }

    fn set(&self, value: T) {
        *lock(&self.value) = value;
        self.changed.notify_waiters();
    }

    /// Waits until the value is not `value`.
    async fn wait_while(&self, value: T) {
        loop {
            let changed = self.changed.notified();
            if self.get() != value {
                return;
            }
            changed.await;
        }
    }
}

/// The fault switches of one host, shared by its seams across restarts.
#[derive(Debug)]
pub(crate) struct HostCtl {
    pub name: String,
    world: Arc<World>,
    paused: Flag<bool>,
    cut: Flag<Cut>,
    latency_ms: AtomicU64,
    /// Handler calls begun and not yet returned or dropped.
    calls: AtomicU64,
    /// [`Cut::Forget`]s begun: a connection opened before the latest one is dead.
    forgets: AtomicU64,
    /// Whether the host's processor runs (started, not crashed or stopping).
    up: AtomicBool,
    /// Whether the host's path was last logged healthy ([`World::health`]).
    healthy: AtomicBool,
}

impl HostCtl {
    pub(crate) fn new(name: &str, world: Arc<World>) -> Self {
        Self {
            name: name.to_string(),
            world,
            paused: Flag::new(false),
            cut: Flag::new(Cut::None),
            latency_ms: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            forgets: AtomicU64::new(0),
            up: AtomicBool::new(false),
            healthy: AtomicBool::new(false),
        }
    }

    /// Logs a change of the host's path health: healthy while it is up, not stalled, not cut
    /// off and without a latency spike.
    fn note_health(&self) {
        let healthy = self.up.load(Ordering::Relaxed)
            && !self.paused.get()
            && self.cut.get() == Cut::None
            && self.latency_ms.load(Ordering::Relaxed) == 0;
        if self.healthy.swap(healthy, Ordering::Relaxed) != healthy {
            self.world.health(&self.name, healthy);
        }
    }

    /// Adds a line about this host to the trace.
    pub(crate) fn trace(&self, args: std::fmt::Arguments<'_>) {
        let at = self.world.now();
        let mut log = self.world.log();
        if log.trace.on() {
            log.trace.push(at, format_args!("{} {args}", self.name));
        }
    }

    /// The host's processor started (`true`), or crashed, began stopping or ended (`false`).
    pub(crate) fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Relaxed);
        self.note_health();
    }

    pub(crate) fn set_paused(&self, on: bool) {
        self.paused.set(on);
        self.note_health();
    }

    pub(crate) fn is_paused(&self) -> bool {
        self.paused.get()
    }

    pub(crate) fn set_cut(&self, cut: Cut) {
        if cut == Cut::Forget {
            self.forgets.fetch_add(1, Ordering::Relaxed);
        }
        self.cut.set(cut);
        self.note_health();
    }

    /// The cut now.
    pub(crate) fn cut(&self) -> Cut {
        self.cut.get()
    }

    /// Waits until the cut is no longer `cut`.
    pub(crate) async fn cut_changed_from(&self, cut: Cut) {
        self.cut.wait_while(cut).await;
    }

    /// [`Cut::Forget`]s begun so far.
    pub(crate) fn forgets(&self) -> u64 {
        self.forgets.load(Ordering::Relaxed)
    }

    /// A timer of the host's process: `d`, then any stall (a stalled process runs no timers).
    pub(crate) async fn timer(&self, d: Duration) {
        tokio::time::sleep(d).await;
        self.gate().await;
    }

    pub(crate) fn set_latency(&self, max_ms: u64) {
        self.latency_ms.store(max_ms, Ordering::Relaxed);
        self.note_health();
    }

    /// Whether a handler call of this host is in progress.
    pub(crate) fn in_call(&self) -> bool {
        self.calls.load(Ordering::Relaxed) > 0
    }

    /// Waits while the host is stalled.
    pub(crate) async fn gate(&self) {
        self.paused.wait_while(true).await;
    }
}

/// Attempts of an ownership write on the shared change counter, as the DynamoDB store's.
const COUNTER_ATTEMPTS: u32 = 60;

/// A host's store: the shared memory store behind its faults and its client's connection pool
/// (if it has one), logging every write.
#[derive(Debug, Clone)]
pub(crate) struct SimStore {
    pub inner: MemoryLeaseStore,
    pub ctl: Arc<HostCtl>,
    pub world: Arc<World>,
    /// The client's connections; `None`: calls reach the store directly.
    pub pool: Option<Arc<Pool>>,
}

impl SimStore {
    fn fail(&self, op: &'static str, why: &'static str) -> LeaseError {
        LeaseError::store(
            op,
            None,
            true,
            format!("{why} (simulated, host {})", self.ctl.name),
        )
    }

    /// Makes one call: through the pool if there is one (a connection lent for the call, the
    /// client's own timeout around it), then the host's faults ([`SimStore::pre`]), then
    /// `body`, the call itself.
    async fn call<T>(
        &self,
        op: &'static str,
        body: impl Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        let Some(pool) = &self.pool else {
            self.pre(op, None).await?;
            return body.await;
        };
        let attempt = async {
            let mut lent = pool
                .checkout(&self.ctl)
                .await
                .map_err(|()| self.fail(op, "connection refused"))?;
            self.pre(op, Some((pool, &mut lent))).await?;
            let r = body.await;
            lent.answered();
            r
        };
        pool.timed(&self.ctl, attempt, || {
            self.fail(op, "client timeout: no answer")
        })
        .await
    }

    /// The host's faults before a call reaches the store: a stall, a cut (on the connection
    /// lent, if any: a dead one hangs for ever), latency, a transient error.
    async fn pre(
        &self,
        op: &'static str,
        mut lent: Option<(&Pool, &mut Lent<'_>)>,
    ) -> Result<(), LeaseError> {
        self.ctl.gate().await;
        if let Some((_, l)) = &lent {
            if l.is_dead(&self.ctl) {
                l.dead_request();
                return std::future::pending().await;
            }
        }
        let cut = match &lent {
            Some((pool, _)) => pool.path(&self.ctl),
            None => self.ctl.cut(),
        };
        match cut {
            Cut::None => {}
            Cut::Fail => {
                if let Some((_, l)) = &mut lent {
                    l.failed();
                }
                return Err(self.fail(op, "store unreachable"));
            }
            Cut::Hang | Cut::Forget => {
                // The request hangs until the cut ends; then it either fails (the client timed
                // out) or reaches the store late, as a delayed request may (a caller that gave
                // up on it drops it instead). After a forget, the connection is dead.
                match &lent {
                    Some((pool, _)) => pool.wait_out_hang(&self.ctl).await,
                    None => loop {
                        let cut = self.ctl.cut();
                        if !matches!(cut, Cut::Hang | Cut::Forget) {
                            break;
                        }
                        self.ctl.cut_changed_from(cut).await;
                    },
                }
                if let Some((_, l)) = &mut lent {
                    if l.is_dead(&self.ctl) {
                        l.dead_request();
                        return std::future::pending().await;
                    }
                }
                if self.world.roll(0.5) {
                    if let Some((_, l)) = &mut lent {
                        l.failed();
                    }
                    return Err(self.fail(op, "store call timed out"));
                }
                self.ctl.gate().await;
            }
        }
        let latency = self.ctl.latency_ms.load(Ordering::Relaxed);
        if latency > 0 {
            let ms = self.world.below(latency);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            self.ctl.gate().await;
        }
        let base = self.world.conditions().latency;
        if !base.1.is_zero() {
            tokio::time::sleep(self.world.between(base)).await;
            self.ctl.gate().await;
        }
        if self.world.roll(self.world.rates().store_error) {
            if let Some((_, l)) = &mut lent {
                l.answered();
            }
            return Err(self.fail(op, "transient store error"));
        }
        Ok(())
    }

    /// With the shared change counter on ([`StoreConditions::counter`]), an ownership write
    /// first gets the counter item: while another write holds it (for the shortest round trip
    /// after it got it) the write fails with a transaction conflict, backs off as the DynamoDB
    /// store does (up to 5 ms × 2^attempt, at most 160 ms) and pays another round trip; after
    /// [`COUNTER_ATTEMPTS`] it fails as that store does.
    ///
    /// [`StoreConditions::counter`]: super::world::StoreConditions::counter
    async fn through_counter(&self, op: &'static str) -> Result<(), LeaseError> {
        let conditions = self.world.conditions();
        if !conditions.counter {
            return Ok(());
        }
        for attempt in 1..COUNTER_ATTEMPTS {
            let now = self.world.now();
            {
                let mut item = self.world.counter();
                if item.busy_until <= now {
                    item.busy_until = now + conditions.latency.0;
                    return Ok(());
                }
                item.conflicts += 1;
            }
            let backoff = Duration::from_millis(1 + self.world.below((5u64 << attempt.min(5)) - 1));
            tokio::time::sleep(backoff + self.world.between(conditions.latency)).await;
            self.ctl.gate().await;
        }
        Err(self.fail(op, "transaction conflicts on the change counter"))
    }

    /// After a write was applied: maybe lose the reply.
    fn post<T>(&self, op: &'static str, r: T) -> Result<T, LeaseError> {
        if self.world.roll(self.world.rates().lost_reply) {
            return Err(self.fail(op, "reply lost after the write was applied"));
        }
        Ok(r)
    }
}

#[async_trait]
impl crate::lease::ForwardingStore for SimStore {
    fn inner(&self) -> &dyn LeaseStore {
        &self.inner
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        self.call("get", self.inner.get(key)).await
    }

    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        self.call("list", async {
            let at = self.world.now();
            self.world
                .log()
                .trace
                .push(at, format_args!("list {}", self.ctl.name));
            self.inner.list(group).await
        })
        .await
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        self.call("create", async {
            self.through_counter("create").await?;
            let r = self.inner.create(lease).await?;
            if let Some(stored) = &r {
                self.world.write(
                    &self.ctl.name,
                    WriteOp::Create,
                    &stored.key.partition,
                    Some(stored),
                    None,
                );
            }
            self.post("create", r)
        })
        .await
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        self.call("replace", async {
            if self.world.roll(self.world.rates().conflict) {
                if let Some(current) = self.inner.get(&lease.key).await? {
                    return Err(LeaseError::Conflict {
                        key: lease.key.to_string(),
                        expected,
                        current: Box::new(current),
                    });
                }
            }
            let mut before = self.inner.get(&lease.key).await.ok().flatten();
            let owner_changes = |b: &Option<Lease>| {
                b.as_ref().is_none_or(|b| {
                    (b.state, &b.owner, &b.next_owner)
                        != (lease.state, &lease.owner, &lease.next_owner)
                })
            };
            if owner_changes(&before) && self.world.conditions().counter {
                self.through_counter("replace").await?;
                before = self.inner.get(&lease.key).await.ok().flatten();
            }
            let stored = self.inner.replace(lease, expected).await?;
            self.world.write(
                &self.ctl.name,
                WriteOp::Replace,
                &stored.key.partition,
                Some(&stored),
                before.as_ref(),
            );
            self.post("replace", stored)
        })
        .await
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        self.call("delete", async {
            self.through_counter("delete").await?;
            let before = self.inner.get(key).await.ok().flatten();
            self.inner.delete(key, expected).await?;
            self.world.write(
                &self.ctl.name,
                WriteOp::Delete,
                &key.partition,
                None,
                before.as_ref(),
            );
            self.post("delete", ())
        })
        .await
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
        // The trace names the leader's renewals apart, as they also renew the view.
        let op = match role {
            HeartbeatRole::Member => "heartbeat",
            HeartbeatRole::Leader => "lead_heartbeat",
        };
        self.call(op, async {
            let hb = self
                .inner
                .heartbeat(group, host, incarnation, written_at, expected, role, report)
                .await?;
            self.world.heartbeat(&self.ctl.name);
            self.post(op, hb)
        })
        .await
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        self.call("remove_heartbeat", async {
            self.inner
                .remove_heartbeat(group, host, incarnation, expected)
                .await?;
            let at = self.world.now();
            self.world.log().trace.push(
                at,
                format_args!("remove_heartbeat {} {host} {expected}", self.ctl.name),
            );
            Ok(())
        })
        .await
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<crate::lease::Changes>, LeaseError> {
        self.call("list_changes", async {
            let at = self.world.now();
            self.world.log().trace.push(
                at,
                format_args!("list_changes {} since {since}", self.ctl.name),
            );
            self.inner.list_changes(group, since).await
        })
        .await
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        self.call("head", async {
            let head = self.inner.head(group).await?;
            let at = self.world.now();
            let mut log = self.world.log();
            if log.trace.on() {
                let view = head
                    .as_ref()
                    .and_then(|h| h.view.as_ref())
                    .map(|v| format!("v{}/{}", v.version, v.leader_heartbeat))
                    .unwrap_or_else(|| "none".into());
                log.trace
                    .push(at, format_args!("head {} view={view}", self.ctl.name));
            }
            Ok(head)
        })
        .await
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        self.call("write_view", async {
            let stored = self.inner.write_view(group, view, expected).await?;
            let at = self.world.now();
            let mut log = self.world.log();
            if log.trace.on() {
                let live: Vec<String> = stored
                    .live
                    .iter()
                    .map(|h| format!("{}/{}", h.host, h.incarnation))
                    .collect();
                let dead: Vec<&str> = stored.dead.iter().map(|h| h.as_str()).collect();
                log.trace.push(
                    at,
                    format_args!(
                        "write_view {} v{} leader={}/{} live=[{}] dead=[{}]",
                        self.ctl.name,
                        stored.version,
                        stored.leader,
                        stored.leader_incarnation,
                        live.join(" "),
                        dead.join(" ")
                    ),
                );
            }
            drop(log);
            self.post("write_view", stored)
        })
        .await
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        self.call("membership", async {
            let m = self.inner.membership(group).await?;
            let at = self.world.now();
            let mut log = self.world.log();
            if log.trace.on() {
                let hs: Vec<String> = m
                    .hosts
                    .iter()
                    .map(|h| format!("{}={}", h.host, h.version))
                    .collect();
                log.trace.push(
                    at,
                    format_args!("membership {} {}", self.ctl.name, hs.join(" ")),
                );
            }
            Ok(m)
        })
        .await
    }
}

/// A host's view of the feed: the shared memory feed behind its stalls, source errors and its
/// client's connection pool (if it has one; only a [`Cut::Forget`] cuts the feed off).
#[derive(Debug, Clone)]
pub(crate) struct SimSource {
    pub inner: MemoryFeed,
    pub ctl: Arc<HostCtl>,
    pub world: Arc<World>,
    /// The client's connections; `None`: calls reach the feed directly.
    pub pool: Option<Arc<Pool>>,
}

impl SimSource {
    fn fail(op: &'static str, partition: Option<&PartitionId>, why: &'static str) -> SourceError {
        SourceError::source(
            op,
            partition.map(|p| p.to_string()),
            true,
            format!("{why} (simulated)"),
        )
    }

    /// Makes one call: through the pool if there is one (see [`SimStore::call`]), then the
    /// host's faults (a transient error only if `roll`), then `body`.
    async fn call<T>(
        &self,
        op: &'static str,
        partition: Option<&PartitionId>,
        roll: bool,
        body: impl Future<Output = Result<T, SourceError>>,
    ) -> Result<T, SourceError> {
        let Some(pool) = &self.pool else {
            self.pre(op, partition, roll, None).await?;
            return body.await;
        };
        let attempt = async {
            let mut lent = pool
                .checkout(&self.ctl)
                .await
                .map_err(|()| Self::fail(op, partition, "connection refused"))?;
            self.pre(op, partition, roll, Some((pool, &mut lent)))
                .await?;
            let r = body.await;
            lent.answered();
            r
        };
        pool.timed(&self.ctl, attempt, || {
            Self::fail(op, partition, "client timeout: no answer")
        })
        .await
    }

    async fn pre(
        &self,
        op: &'static str,
        partition: Option<&PartitionId>,
        roll: bool,
        lent: Option<(&Pool, &mut Lent<'_>)>,
    ) -> Result<(), SourceError> {
        self.ctl.gate().await;
        if let Some((pool, l)) = lent {
            if !l.is_dead(&self.ctl) && pool.path(&self.ctl) == Cut::Forget {
                pool.wait_out_hang(&self.ctl).await;
                self.ctl.gate().await;
            }
            if l.is_dead(&self.ctl) {
                l.dead_request();
                return std::future::pending().await;
            }
            if roll && self.world.roll(self.world.rates().source_error) {
                l.answered();
                return Err(Self::fail(op, partition, "transient source error"));
            }
            return Ok(());
        }
        if roll && self.world.roll(self.world.rates().source_error) {
            return Err(Self::fail(op, partition, "transient source error"));
        }
        Ok(())
    }
}

#[async_trait]
impl FeedSource for SimSource {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.call("partitions", None, true, self.inner.partitions())
            .await
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let reader = self
            .call(
                "open",
                Some(partition),
                true,
                self.inner.open(partition, from),
            )
            .await?;
        Ok(Box::new(SimReader {
            inner: reader,
            source: self.clone(),
            partition: partition.clone(),
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        self.call(
            "remaining",
            Some(partition),
            true,
            self.inner.remaining(partition, after),
        )
        .await
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<crate::source::OldestUnread, SourceError> {
        // No fault roll: lag in time is observation only, and rolling here would change what
        // every recorded seed does. (It still needs a connection.)
        self.call(
            "oldest_unread",
            Some(partition),
            false,
            self.inner.oldest_unread(partition, after),
        )
        .await
    }
}

#[derive(Debug)]
struct SimReader {
    inner: Box<dyn PartitionReader>,
    source: SimSource,
    partition: PartitionId,
}

#[async_trait]
impl PartitionReader for SimReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        self.source
            .call(
                "read",
                Some(&self.partition),
                true,
                self.inner.next_batch(max),
            )
            .await
    }
}

/// A host's handler: logs every record it applies with the time, its call and its ownership
/// epoch.
///
/// A call applies its batch at once, unless the slow-handler fault makes it slow: then it
/// applies the records one by one, spread over a length drawn when the call begins, waiting
/// out the host's stalls before each. A call the processor drops stops applying; what it
/// applied stays delivered.
#[derive(Debug)]
pub(crate) struct SimHandler {
    pub ctl: Arc<HostCtl>,
    pub world: Arc<World>,
    pub epochs: Mutex<BTreeMap<PartitionId, u64>>,
}

/// Counts a handler call in progress until it returns or is dropped.
struct InCall<'a>(&'a HostCtl);

impl<'a> InCall<'a> {
    fn new(ctl: &'a HostCtl) -> Self {
        ctl.calls.fetch_add(1, Ordering::Relaxed);
        Self(ctl)
    }
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a handler call is, for the ledger.
struct CallInfo<'a> {
    host: &'a str,
    partition: &'a PartitionId,
    epoch: u64,
    call: u64,
    call_at: Duration,
}

impl SimHandler {
    /// Applies `records` now, logging each as a delivery. Returns the first and last ids.
    fn apply(
        &self,
        c: &CallInfo<'_>,
        records: &[crate::model::Record],
    ) -> Result<(Option<u64>, u64), HandlerError> {
        let at = self.world.now();
        let mut log = self.world.log();
        let mut first = None;
        let mut last = 0;
        for r in records {
            let id: u64 = std::str::from_utf8(&r.data)?.parse()?;
            first.get_or_insert(id);
            last = id;
            let slot = usize::try_from(id)?;
            if log.delivered.len() <= slot {
                log.delivered.resize(slot + 1, false);
            }
            if !log.delivered[slot] {
                log.delivered[slot] = true;
                log.delivered_count += 1;
            }
            log.next_seq += 1;
            let seq = log.next_seq;
            if log.keep_history {
                log.deliveries.push(Delivery {
                    seq,
                    at,
                    call: c.call,
                    call_at: c.call_at,
                    host: c.host.to_string(),
                    epoch: c.epoch,
                    partition: c.partition.clone(),
                    record: id,
                });
            }
        }
        Ok((first, last))
    }
}

#[async_trait]
impl Handler for SimHandler {
    async fn open(&self, ctx: &Context) -> Result<(), HandlerError> {
        self.ctl.gate().await;
        if self.world.roll(self.world.rates().handler_error) {
            return Err("handler open failed (simulated)".into());
        }
        let at = self.world.now();
        let mut log = self.world.log();
        let epoch = log.next_epoch;
        log.next_epoch += 1;
        log.trace.push(
            at,
            format_args!("open {} {} epoch={epoch}", self.ctl.name, ctx.partition()),
        );
        drop(log);
        lock(&self.epochs).insert(ctx.partition().clone(), epoch);
        Ok(())
    }

    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let _in_call = InCall::new(&self.ctl);
        let call_at = self.world.now();
        let call = self.world.next_seq();
        // Drawn when the call begins, so the draws keep the order of the calls.
        let rates = self.world.rates();
        let slow = self
            .world
            .roll(rates.slow_handler)
            .then(|| self.world.call_length(rates.slow_handler_max));
        self.ctl.gate().await;
        if self.world.roll(self.world.rates().handler_error) {
            return Err("handler failed (simulated)".into());
        }
        let epoch = lock(&self.epochs)
            .get(ctx.partition())
            .copied()
            .ok_or("handle before open")?;
        let c = CallInfo {
            host: &self.ctl.name,
            partition: ctx.partition(),
            epoch,
            call,
            call_at,
        };
        let Some(length) = slow else {
            let (first, last) = self.apply(&c, &batch.records)?;
            let at = self.world.now();
            self.world.log().trace.push(
                at,
                format_args!(
                    "deliver {} {} epoch={epoch} records={:?}..={last} n={}",
                    self.ctl.name,
                    ctx.partition(),
                    first,
                    batch.records.len()
                ),
            );
            return Ok(());
        };
        {
            let at = self.world.now();
            self.world.log().trace.push(
                at,
                format_args!(
                    "slow-call {} {} epoch={epoch} n={} ms={}",
                    self.ctl.name,
                    ctx.partition(),
                    batch.records.len(),
                    length.as_millis()
                ),
            );
        }
        let n = u32::try_from(batch.records.len().max(1)).unwrap_or(u32::MAX);
        let step = length / n;
        for r in &batch.records {
            tokio::time::sleep(step).await;
            self.ctl.gate().await;
            let (_, id) = self.apply(&c, std::slice::from_ref(r))?;
            let at = self.world.now();
            self.world.log().trace.push(
                at,
                format_args!(
                    "apply {} {} epoch={epoch} record={id}",
                    self.ctl.name,
                    ctx.partition()
                ),
            );
        }
        Ok(())
    }

    async fn close(&self, _ctx: &Context, _reason: CloseReason) {
        // Not traced: workers fenced at one instant are woken through a `tokio::sync::watch`,
        // whose wake order is random, and closing is all they then do.
    }
}

/// A host's clock: virtual time with its skew and drift, whose sleeps also wait out a stall
/// (a stalled process runs no timers).
#[derive(Debug)]
pub(crate) struct SimClock {
    pub inner: VirtualClock,
    pub ctl: Arc<HostCtl>,
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        self.inner.now()
    }

    fn wall(&self) -> Timestamp {
        self.inner.wall()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        let sleep = self.inner.sleep(duration);
        let ctl = self.ctl.clone();
        Box::pin(async move {
            sleep.await;
            ctl.gate().await;
        })
    }
}
