//! The heartbeat task's rules, each found by the simulator, on paused tokio time.

use crate::lease::{HeartbeatRole, MembershipStore};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use async_trait::async_trait;

use super::*;
use crate::clock::{Sleep, SystemClock};
use crate::lease::{ForwardingStore, MemoryLeaseStore};
use crate::model::{Timestamp, Version};
use crate::processor::host_state::Liveness;
use crate::processor::load::LoadBook;

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
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let written = self
            .inner
            .heartbeat(group, host, incarnation, written_at, expected, role, report)
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
        Arc::new(LoadBook::new(&crate::processor::Settings::default())),
    ));
    (record, raised)
}

/// A renewal whose reply comes back later than `write_timeout` after it was sent (the host
/// stalled meanwhile) does not move the fence deadline: it may have landed after observers
/// judged the host dead. The host fences, and the next renewal, at the adopted version, counts
/// again, as a lapse: a new incarnation, written at once.
#[tokio::test(start_paused = true)]
async fn late_renewal_does_not_extend_the_fence() {
    let t0 = Instant::now();
    let inner = MemoryLeaseStore::new();
    let row = inner
        .heartbeat(
            &group(),
            &host(),
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("registered");
    let clock = Arc::new(StallClock::default());
    // Renewal 1 is sent at 2 s; renewal 2 at 4 s lands, then the host stalls for 7 s: its
    // reply is seen at 11 s, past renewal 1's deadline (10 s).
    let store = Arc::new(StallAfterWrite {
        inner: inner.clone(),
        clock: clock.clone(),
        stall_on: 2,
        stall: Duration::from_secs(7),
        writes: AtomicU32::new(0),
    });
    let cancel = CancellationToken::new();
    let (record, mut raised) = start(store, clock.clone(), row, &cancel);

    tokio::time::sleep_until(t0 + Duration::from_millis(3500)).await;
    assert_eq!(
        record.get(),
        t0 + Duration::from_secs(2) + FENCE_AFTER,
        "the deadline is renewal 1's"
    );
    raised.borrow_and_update();

    // 11.5 s on the host's clock: the late reply did not count, so the host fenced; renewal 3,
    // sent at 11 s once the reply was seen, lapsed and lowered the fence, and renewal 4 wrote
    // the new incarnation right after.
    tokio::time::sleep_until(t0 + Duration::from_millis(4500)).await;
    assert!(
        raised.has_changed().expect("the task runs"),
        "the fence was raised"
    );
    assert!(!*raised.borrow(), "and lowered by the lapse");
    assert_eq!(record.lapses(), 1);
    assert_eq!(record.get(), t0 + Duration::from_secs(11) + FENCE_AFTER);
    assert!(
        record.fenced_since(clock.now(), 0),
        "a worker from before the lapse stops"
    );
    assert!(!record.fenced_since(clock.now(), 1));
    let m = inner.membership(&group()).await.expect("membership");
    assert_eq!(
        m.hosts[0].version,
        Version(5),
        "renewals 3 and 4 went on from the late one"
    );
    assert_eq!(&*m.hosts[0].incarnation, "inc.l1");
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
        .heartbeat(
            &group(),
            &host(),
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
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

/// A store behind a silent black hole: while `cut`, a heartbeat is not answered; with
/// `forget`, it hangs for good (its caller gives up; it stays dead after the heal, as a flow a
/// NAT forgot), without, it goes on once the path is back. Each answer comes `latency` late.
#[derive(Debug)]
struct BlackHole {
    inner: MemoryLeaseStore,
    latency: Duration,
    cut: std::sync::atomic::AtomicBool,
    forget: bool,
    /// While cut, refuse each try at once (a server resetting connections) instead of
    /// holding it.
    refuse: bool,
    sent: Mutex<Vec<Instant>>,
}

#[async_trait]
impl ForwardingStore for BlackHole {
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
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        self.sent.lock().expect("not poisoned").push(Instant::now());
        if self.refuse && self.cut.load(Ordering::SeqCst) {
            return Err(LeaseError::store(
                "heartbeat",
                None,
                true,
                "connection reset".to_owned(),
            ));
        }
        if self.forget && self.cut.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        while self.cut.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(self.latency).await;
        self.inner
            .heartbeat(group, host, incarnation, written_at, expected, role, report)
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
        .heartbeat(
            &group(),
            &host(),
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("registered");
    let store = Arc::new(BlackHole {
        inner: inner.clone(),
        latency: Duration::from_millis(300),
        cut: std::sync::atomic::AtomicBool::new(true),
        forget: false,
        refuse: false,
        sent: Mutex::default(),
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

/// Cut off by a black hole, each try hangs until the write timeout; the next one starts a
/// renew interval after the last was sent, not a renew interval after it gave up. Once the
/// path is back, the try in flight gives up within the write timeout and the next succeeds at
/// once: the fence is lowered within `write_timeout` + one answer of the heal, and the lapse's
/// new incarnation is in the row one answer after that.
#[tokio::test(start_paused = true)]
async fn a_host_cut_off_by_a_black_hole_renews_within_the_write_timeout_of_the_heal() {
    let t0 = Instant::now();
    let inner = MemoryLeaseStore::new();
    let row = inner
        .heartbeat(
            &group(),
            &host(),
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("registered");
    let latency = Duration::from_millis(300);
    let store = Arc::new(BlackHole {
        inner: inner.clone(),
        latency,
        cut: std::sync::atomic::AtomicBool::new(true),
        forget: true,
        refuse: false,
        sent: Mutex::default(),
    });
    let cancel = CancellationToken::new();
    let (record, raised) = start(store.clone(), Arc::new(SystemClock), row, &cancel);
    // Tries at 2, 4, 6 … s all hang; heal just after the one at 12 s was sent.
    tokio::time::sleep_until(t0 + Duration::from_millis(12_100)).await;
    assert!(*raised.borrow(), "fenced while cut off");
    {
        let sent = store.sent.lock().expect("not poisoned");
        let gaps: Vec<Duration> = sent.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(sent.len(), 6, "a try every renew interval: {gaps:?}");
        assert!(gaps.iter().all(|g| *g == RENEW), "{gaps:?}");
    }
    let healed = Instant::now();
    store.cut.store(false, Ordering::SeqCst);
    let renewed_by = healed + WRITE_TIMEOUT + latency;
    tokio::time::sleep_until(renewed_by).await;
    assert!(
        !*raised.borrow(),
        "renewed within {:?} of the heal",
        renewed_by - healed
    );
    tokio::time::sleep_until(renewed_by + latency + Duration::from_millis(1)).await;
    let m = inner.membership(&group()).await.expect("membership");
    assert_eq!(
        &*m.hosts[0].incarnation, "inc.l1",
        "the lapse's incarnation is written at once"
    );
    assert!(record.get() > healed);
    cancel.cancel();
}

/// At the default cadence a healthy host writes once per renew interval, and a try that
/// failed is followed half an interval later: four tries before the fence, not two.
#[tokio::test(start_paused = true)]
async fn a_failed_try_is_followed_half_a_renew_interval_later() {
    let settings = crate::processor::Settings::default();
    let renew = settings.renew_interval;
    let fence_after = settings.fence_after();
    let t0 = Instant::now();
    let inner = MemoryLeaseStore::new();
    let row = inner
        .heartbeat(
            &group(),
            &host(),
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("registered");
    let store = Arc::new(BlackHole {
        inner,
        latency: Duration::ZERO,
        cut: std::sync::atomic::AtomicBool::new(false),
        forget: false,
        refuse: true,
        sent: Mutex::default(),
    });
    let cancel = CancellationToken::new();
    let record = FenceDeadline::new(t0 + fence_after, fence_after * 4);
    let (doorbell, raised) = watch::channel(false);
    tokio::spawn(run(
        store.clone(),
        Arc::new(SystemClock),
        row,
        renew,
        fence_after,
        doorbell,
        cancel.clone(),
        settings.safety_margin.min(renew),
        record,
        Arc::default(),
        ViewLink::new(Arc::from("inc")),
        Arc::new(LoadBook::new(&settings)),
    ));
    // Healthy for three intervals: a try every interval.
    tokio::time::sleep_until(t0 + renew * 3 + Duration::from_millis(1)).await;
    store.cut.store(true, Ordering::SeqCst);
    let down_at = Instant::now();
    // Down long enough to fence.
    tokio::time::sleep_until(down_at + fence_after + renew).await;
    assert!(*raised.borrow(), "fenced while every try failed");
    let gaps: Vec<Duration> = {
        let sent = store.sent.lock().expect("not poisoned");
        sent.windows(2).map(|w| w[1] - w[0]).collect()
    };
    assert_eq!(&gaps[..2], &[renew, renew], "healthy: one try per interval");
    // The try at 3 × renew succeeded; the one at 4 × renew is the first refused; after it,
    // every gap is half an interval.
    assert_eq!(gaps[2], renew, "{gaps:?}");
    assert!(gaps[3..].iter().all(|g| *g == renew / 2), "{gaps:?}");
    let before_fence = 1 + gaps[3..]
        .iter()
        .scan(renew, |at, g| {
            *at += *g;
            Some(*at)
        })
        .take_while(|at| *at < fence_after)
        .count();
    assert_eq!(before_fence, 4, "tries before the fence: {gaps:?}");
    cancel.cancel();
}
