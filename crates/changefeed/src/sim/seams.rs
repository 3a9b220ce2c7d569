//! The seams every simulated host talks through: a store, a source, a handler and a clock per
//! host, each wrapping the shared in-memory one and injecting that host's faults (switched by
//! its [`HostCtl`]), and logging what it does to the shared [`World`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

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
    paused: Flag<bool>,
    cut: Flag<Cut>,
    latency_ms: AtomicU64,
    /// Handler calls begun and not yet returned or dropped.
    calls: AtomicU64,
}

impl HostCtl {
    pub(crate) fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            paused: Flag::new(false),
            cut: Flag::new(Cut::None),
            latency_ms: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        }
    }

    pub(crate) fn set_paused(&self, on: bool) {
        self.paused.set(on);
    }

    pub(crate) fn is_paused(&self) -> bool {
        self.paused.get()
    }

    pub(crate) fn set_cut(&self, cut: Cut) {
        self.cut.set(cut);
    }

    pub(crate) fn set_latency(&self, max_ms: u64) {
        self.latency_ms.store(max_ms, Ordering::Relaxed);
    }

    /// Whether a handler call of this host is in progress.
    pub(crate) fn in_call(&self) -> bool {
        self.calls.load(Ordering::Relaxed) > 0
    }

    /// Waits while the host is stalled.
    async fn gate(&self) {
        self.paused.wait_while(true).await;
    }
}

/// Attempts of an ownership write on the shared change counter, as the DynamoDB store's.
const COUNTER_ATTEMPTS: u32 = 60;

/// A host's store: the shared memory store behind its faults, logging every write.
#[derive(Debug, Clone)]
pub(crate) struct SimStore {
    pub inner: MemoryLeaseStore,
    pub ctl: Arc<HostCtl>,
    pub world: Arc<World>,
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

    async fn pre(&self, op: &'static str) -> Result<(), LeaseError> {
        self.ctl.gate().await;
        let cut = self.ctl.cut.get();
        match cut {
            Cut::None => {}
            Cut::Fail => return Err(self.fail(op, "store unreachable")),
            Cut::Hang => {
                // The request hangs until the cut ends; then it either fails (the client timed
                // out) or reaches the store late, as a delayed request may (a caller that gave
                // up on it drops it instead).
                self.ctl.cut.wait_while(Cut::Hang).await;
                if self.world.roll(0.5) {
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

    /// Every call waits out a stall and may fail (`get` has nothing else to add).
    async fn before(&self, op: crate::lease::StoreOp) -> Result<(), LeaseError> {
        self.pre(op.as_str()).await
    }

    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        self.pre("list").await?;
        let at = self.world.now();
        self.world
            .log()
            .trace
            .push(at, format_args!("list {}", self.ctl.name));
        self.inner.list(group).await
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        self.pre("create").await?;
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
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        self.pre("replace").await?;
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
                (b.state, &b.owner, &b.next_owner) != (lease.state, &lease.owner, &lease.next_owner)
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
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        self.pre("delete").await?;
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
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
    ) -> Result<Heartbeat, LeaseError> {
        self.pre("heartbeat").await?;
        let hb = self
            .inner
            .heartbeat(group, host, incarnation, written_at, expected)
            .await?;
        self.post("heartbeat", hb)
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        self.pre("remove_heartbeat").await?;
        self.inner
            .remove_heartbeat(group, host, incarnation, expected)
            .await?;
        let at = self.world.now();
        self.world.log().trace.push(
            at,
            format_args!("remove_heartbeat {} {host} {expected}", self.ctl.name),
        );
        Ok(())
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<crate::lease::Changes>, LeaseError> {
        self.pre("list_changes").await?;
        let at = self.world.now();
        self.world.log().trace.push(
            at,
            format_args!("list_changes {} since {since}", self.ctl.name),
        );
        self.inner.list_changes(group, since).await
    }

    async fn lead_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
    ) -> Result<Heartbeat, LeaseError> {
        self.pre("lead_heartbeat").await?;
        let hb = self
            .inner
            .lead_heartbeat(group, host, incarnation, written_at, expected)
            .await?;
        self.post("lead_heartbeat", hb)
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        self.pre("head").await?;
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
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        self.pre("write_view").await?;
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
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        self.pre("membership").await?;
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
    }
}

/// A host's view of the feed: the shared memory feed behind its stalls and source errors.
#[derive(Debug, Clone)]
pub(crate) struct SimSource {
    pub inner: MemoryFeed,
    pub ctl: Arc<HostCtl>,
    pub world: Arc<World>,
}

impl SimSource {
    async fn pre(
        &self,
        op: &'static str,
        partition: Option<&PartitionId>,
    ) -> Result<(), SourceError> {
        self.ctl.gate().await;
        if self.world.roll(self.world.rates().source_error) {
            return Err(SourceError::source(
                op,
                partition.map(|p| p.to_string()),
                true,
                "transient source error (simulated)",
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl FeedSource for SimSource {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.pre("partitions", None).await?;
        self.inner.partitions().await
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        self.pre("open", Some(partition)).await?;
        let reader = self.inner.open(partition, from).await?;
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
        self.pre("remaining", Some(partition)).await?;
        self.inner.remaining(partition, after).await
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<crate::source::OldestUnread, SourceError> {
        // No fault roll: lag in time is observation only, and rolling here would change what
        // every recorded seed does.
        self.inner.oldest_unread(partition, after).await
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
        self.source.pre("read", Some(&self.partition)).await?;
        self.inner.next_batch(max).await
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
