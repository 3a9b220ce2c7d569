//! The heartbeat task's rules, each found by the simulator, on paused tokio time.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use async_trait::async_trait;

use super::*;
use crate::clock::{Sleep, SystemClock};
use crate::lease::{ForwardingStore, MemoryLeaseStore};
use crate::model::{Timestamp, Version};

const RENEW: Duration = Duration::from_secs(2);
const FENCE_AFTER: Duration = Duration::from_secs(8);
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

fn group() -> GroupName {
    GroupName::new("g").expect("a valid group name")
}

fn host() -> HostName {
    HostName::new("a").expect("a valid host name")
}

/// A host's monotonic clock that a stall moves ahead of tokio's: seen from inside, a
/// frozen process finds that time jumped.
#[derive(Debug, Default)]
struct StallClock {
    ahead: Mutex<Duration>,
}

impl StallClock {
    fn stall(&self, d: Duration) {
        *self.ahead.lock().expect("not poisoned") += d;
    }
}

impl Clock for StallClock {
    fn now(&self) -> Instant {
        Instant::now() + *self.ahead.lock().expect("not poisoned")
    }

    fn wall(&self) -> Timestamp {
        Timestamp(0)
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// A store whose `stall_on`-th heartbeat write is applied, and then the host stalls for
/// `stall` before it sees the reply.
#[derive(Debug)]
struct StallAfterWrite {
    inner: MemoryLeaseStore,
    clock: Arc<StallClock>,
    stall_on: u32,
    stall: Duration,
    writes: AtomicU32,
}

#[async_trait]
impl ForwardingStore for StallAfterWrite {
    fn inner(&self) -> &dyn LeaseStore {
        &self.inner
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
    ) -> Result<Heartbeat, LeaseError> {
        let written = self
            .inner
            .heartbeat(group, host, incarnation, written_at, expected)
            .await;
        if self.writes.fetch_add(1, Ordering::SeqCst) + 1 == self.stall_on {
            self.clock.stall(self.stall);
        }
        written
    }
}

/// Starts the heartbeat task on `row`; returns the fence record and its watch.
fn start(
    store: Arc<dyn LeaseStore>,
    clock: Arc<dyn Clock>,
    row: Heartbeat,
    cancel: &CancellationToken,
) -> (FenceDeadline, watch::Receiver<bool>) {
    let record = FenceDeadline::new(clock.now() + FENCE_AFTER, FENCE_AFTER * 4);
    let (doorbell, raised) = watch::channel(false);
    let row_incarnation = Arc::clone(&row.incarnation);
    tokio::spawn(run(
        store,
        clock,
        row,
        RENEW,
        FENCE_AFTER,
        doorbell,
        cancel.clone(),
        WRITE_TIMEOUT,
        record.clone(),
        Arc::default(),
        ViewLink::new(Arc::clone(&row_incarnation)),
    ));
    (record, raised)
}

/// A renewal whose reply comes back later than `write_timeout` after it was sent (the host
/// stalled meanwhile) does not move the fence deadline: it may have landed after observers
/// judged the host dead. The host fences on time, and the next renewal, at the adopted
/// version, counts again (as a lapse).
#[tokio::test(start_paused = true)]
async fn late_renewal_does_not_extend_the_fence() {
    let t0 = Instant::now();
    let inner = MemoryLeaseStore::new();
    let row = inner
        .heartbeat(&group(), &host(), "inc", Timestamp(0), None)
        .await
        .expect("registered");
    let clock = Arc::new(StallClock::default());
    // Renewal 1 is sent at 2 s; renewal 2 at 4 s lands, then the host stalls for 5 s.
    let store = Arc::new(StallAfterWrite {
        inner: inner.clone(),
        clock: clock.clone(),
        stall_on: 2,
        stall: Duration::from_secs(5),
        writes: AtomicU32::new(0),
    });
    let cancel = CancellationToken::new();
    let (record, raised) = start(store, clock.clone(), row, &cancel);

    // 9.5 s on the host's clock: renewal 2 came back 5 s after it was sent.
    tokio::time::sleep_until(t0 + Duration::from_millis(4500)).await;
    assert_eq!(
        record.get(),
        t0 + Duration::from_secs(2) + FENCE_AFTER,
        "the deadline is renewal 1's"
    );
    assert!(!record.fenced_since(clock.now(), 0));

    // 10.5 s: past renewal 1's deadline.
    tokio::time::sleep_until(t0 + Duration::from_millis(5500)).await;
    assert!(*raised.borrow(), "the host fenced at renewal 1's deadline");
    assert!(record.fenced_since(clock.now(), 0));

    // 12.5 s: renewal 3, sent at 12 s, lowered the fence after the lapse.
    tokio::time::sleep_until(t0 + Duration::from_millis(7500)).await;
    assert!(!*raised.borrow());
    assert_eq!(record.lapses(), 1);
    assert_eq!(record.get(), t0 + Duration::from_secs(12) + FENCE_AFTER);
    assert!(
        record.fenced_since(clock.now(), 0),
        "a worker from before the lapse stops"
    );
    assert!(!record.fenced_since(clock.now(), 1));
    let m = inner.membership(&group()).await.expect("membership");
    assert_eq!(
        m.hosts[0].version,
        Version(4),
        "renewal 3 went on from the late one"
    );
    cancel.cancel();
}

/// When its row was removed, the host registers again under a new incarnation: the row
/// restarts at version 1, which an observer may already have seen, so only the new
/// incarnation shows it the host is alive.
#[tokio::test(start_paused = true)]
async fn reregistered_row_is_seen_to_change() {
    let t0 = Instant::now();
    let store = MemoryLeaseStore::new();
    let row = store
        .heartbeat(&group(), &host(), "inc", Timestamp(0), None)
        .await
        .expect("registered");
    let mut observer = Liveness::default();
    observer.observe(&store.membership(&group()).await.expect("membership"), t0);
    // Judged dead, or released by an operator, before its first renewal.
    store
        .remove_heartbeat(&group(), &host(), "inc", row.version)
        .await
        .expect("removed");
    let cancel = CancellationToken::new();
    let (record, _raised) = start(
        Arc::new(store.clone()),
        Arc::new(SystemClock),
        row.clone(),
        &cancel,
    );

    // The renewal at 2 s finds the row gone and registers again; the observer reads at 3 s.
    let seen_at = t0 + Duration::from_secs(3);
    tokio::time::sleep_until(seen_at).await;
    let m = store.membership(&group()).await.expect("membership");
    assert_eq!(
        m.hosts[0].version, row.version,
        "the row restarted at version 1"
    );
    assert_ne!(m.hosts[0].incarnation, row.incarnation);
    observer.observe(&m, seen_at);
    assert_eq!(observer.changed_at(&host()), Some(seen_at));
    let expiry = Duration::from_secs(10);
    assert_eq!(
        observer.live(t0 + expiry + Duration::from_millis(500), expiry),
        vec![host()],
        "still live one expiry after the first read"
    );
    assert_eq!(record.get(), t0 + Duration::from_secs(2) + FENCE_AFTER);
    cancel.cancel();
}

/// A store that answers every call `latency` late, and not at all while `cut`.
#[derive(Debug)]
struct SlowPath {
    inner: MemoryLeaseStore,
    latency: Duration,
    cut: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl ForwardingStore for SlowPath {
    fn inner(&self) -> &dyn LeaseStore {
        &self.inner
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
    ) -> Result<Heartbeat, LeaseError> {
        while self.cut.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(self.latency).await;
        self.inner
            .heartbeat(group, host, incarnation, written_at, expected)
            .await
    }
}

/// Once fenced, a renewal still gets the whole `write_timeout`: the fence deadline it must not
/// outlast has passed, and a renewal cut to nothing can never succeed on a store that takes
/// more than an instant (a new connection after a network fault), which left a host fenced
/// for ever with its store reachable again.
#[tokio::test(start_paused = true)]
async fn a_fenced_host_renews_again_once_its_store_answers_within_the_write_timeout() {
    let t0 = Instant::now();
    let inner = MemoryLeaseStore::new();
    let row = inner
        .heartbeat(&group(), &host(), "inc", Timestamp(0), None)
        .await
        .expect("registered");
    let store = Arc::new(SlowPath {
        inner: inner.clone(),
        latency: Duration::from_millis(300),
        cut: std::sync::atomic::AtomicBool::new(true),
    });
    let cancel = CancellationToken::new();
    let (record, raised) = start(store.clone(), Arc::new(SystemClock), row, &cancel);
    // Cut off past the fence deadline (8 s), then the path is back, each answer 300 ms late.
    tokio::time::sleep_until(t0 + FENCE_AFTER + Duration::from_secs(4)).await;
    assert!(*raised.borrow(), "fenced while cut off");
    let healed = Instant::now();
    store.cut.store(false, Ordering::SeqCst);
    // Within one renew interval plus the answer's latency (and the attempt cut off by the
    // heal, at most one write timeout), the fence is lowered.
    let bound = RENEW + WRITE_TIMEOUT + Duration::from_millis(300);
    tokio::time::sleep_until(healed + bound).await;
    assert!(!*raised.borrow(), "renewed within {bound:?} of the heal");
    assert!(record.get() > healed);
    cancel.cancel();
}
