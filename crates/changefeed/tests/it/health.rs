//! `ProcessorHandle::health`: a host is ready only while registered, unfenced and running;
//! cut off from its store it becomes unready when it fences itself, and ready again once it
//! has registered again. It is unhealthy once it has stayed fenced or unregistered for longer
//! than `max_unhealthy`, and healthy again once it recovers. Virtual time throughout; every
//! wait is bounded.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::lease::{ForwardingStore, LeaseStore, MemoryLeaseStore};
use changefeed::model::{
    GroupName, Heartbeat, HostName, Lease, LeaseKey, PartitionId, Position, Timestamp, Version,
};
use changefeed::processor::{handler_fn, Health, Processor, ProcessorHandle, UnhealthyReason};
use changefeed::source::MemoryFeed;
use changefeed::testkit::fleet::{FaultMode, Faulty};
use changefeed::LeaseError;
use tokio::time::Instant;

/// The default timings: a host fences itself 8 s after its last successful heartbeat.
const LEASE_EXPIRY: Duration = Duration::from_secs(10);
const FENCE_AFTER: Duration = Duration::from_secs(8);
const RENEW: Duration = Duration::from_secs(2);

fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

/// `max_unhealthy` in these tests.
const MAX_UNHEALTHY: Duration = Duration::from_secs(30);

fn start(store: Arc<dyn LeaseStore>, feed: &MemoryFeed, host: &str) -> ProcessorHandle {
    Processor::builder()
        .host(host)
        .group("g")
        .store(store)
        .source(Arc::new(feed.clone()))
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .seed(11)
        .lease_expiry(LEASE_EXPIRY)
        .safety_margin(LEASE_EXPIRY - FENCE_AFTER)
        .renew_interval(RENEW)
        .max_unhealthy(Some(MAX_UNHEALTHY))
        .build()
        .unwrap()
        .start()
}

/// Advances virtual time in 100 ms steps until `health` satisfies `want`, failing after
/// `limit` of virtual time. Returns the health seen and when.
async fn until(
    limit: Duration,
    what: &str,
    health: impl Fn() -> Health,
    want: impl Fn(&Health) -> bool,
) -> (Health, Instant) {
    let deadline = Instant::now() + limit;
    loop {
        let h = health();
        if want(&h) {
            return (h, Instant::now());
        }
        assert!(
            Instant::now() < deadline,
            "no {what} within {limit:?} (virtual); last: {h:?} ({h})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn host_is_ready_only_from_writing_its_heartbeat_row_until_it_stops() {
    // Health::registered: before its first heartbeat a host is not ready. A previous
    // incarnation's row under the same name is watched for lease_expiry before it is taken
    // over, so registration takes that long; a stop makes the host unready at once.
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(1);
    store
        .heartbeat(
            &group(),
            &HostName::new("a").unwrap(),
            "previous",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .unwrap();
    let t0 = Instant::now();
    let a = start(Arc::new(store.clone()), &feed, "a");
    let h = a.health();
    assert!(!h.registered && !h.is_ready(), "{h:?}");
    assert_eq!(h.heartbeat_age, None);
    assert_eq!(h.to_string(), "not ready: not registered yet");

    // Still waiting out the old row halfway through lease_expiry.
    tokio::time::sleep(LEASE_EXPIRY / 2).await;
    let h = a.health();
    assert!(!h.registered && !h.is_ready(), "{h:?}");

    let (h, ready_at) = until(LEASE_EXPIRY, "readiness", || a.health(), Health::is_ready).await;
    assert!(
        ready_at - t0 >= LEASE_EXPIRY,
        "registered {:?} after start, before the old row had been still for lease_expiry",
        ready_at - t0
    );
    assert!(h.registered && !h.fenced && !h.stopping, "{h:?}");
    assert!(h.to_string().starts_with("ready: heartbeat "), "{h}");

    // Ready stays ready while the heartbeat keeps succeeding.
    tokio::time::sleep(LEASE_EXPIRY * 3).await;
    let h = a.health();
    assert!(h.is_ready(), "{h:?}");
    assert!(
        h.heartbeat_age.is_some_and(|age| age <= RENEW),
        "renewed every {RENEW:?}: {h:?}"
    );

    let probe = a.health_probe();
    a.stop().await.unwrap();
    let h = probe.health();
    assert!(!h.registered && h.stopping && !h.is_ready(), "{h:?}");
    assert_eq!(h.to_string(), "not ready: stopping");
}

#[tokio::test(start_paused = true)]
async fn cut_off_host_is_unready_once_fenced_and_ready_again_after_registering_again() {
    // /readyz's rule: a host cut off from its store is not ready from the moment it
    // fences itself (lease_expiry − safety_margin after its last successful heartbeat), stays
    // unready while its row is removed by the leader, and is ready again once the store is back
    // and it has registered afresh.
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(2);
    for p in ["0", "1"] {
        let key = LeaseKey::new(group(), PartitionId::new(p).unwrap());
        store
            .create(&Lease::new(key, Position::Beginning))
            .await
            .unwrap();
    }
    let faulty = Faulty::new(Arc::new(store.clone()));
    let a = start(Arc::new(faulty.clone()), &feed, "a");
    let b = start(Arc::new(store.clone()), &feed, "b");
    until(RENEW * 2, "a ready", || a.health(), Health::is_ready).await;
    until(RENEW * 2, "b ready", || b.health(), Health::is_ready).await;
    tokio::time::sleep(LEASE_EXPIRY).await;
    assert!(a.health().is_ready() && b.health().is_ready());

    // The cut: every store call of a fails.
    let cut_at = Instant::now();
    faulty.set(FaultMode::Fail);
    let (h, fenced_at) = until(FENCE_AFTER, "a fenced", || a.health(), |h| h.fenced).await;
    assert!(!h.is_ready(), "{h:?}");
    assert!(h.registered, "a does not know its row is gone: {h:?}");
    assert!(
        h.heartbeat_age.is_some_and(|age| age >= FENCE_AFTER),
        "fenced only once the last heartbeat is lease_expiry − safety_margin old: {h:?}"
    );
    assert!(
        h.to_string()
            .starts_with("not ready: fenced: last successful heartbeat "),
        "{h}"
    );
    // Not unready early: up to the fence the last heartbeat was fresh.
    assert!(
        fenced_at - cut_at > FENCE_AFTER - RENEW - Duration::from_millis(200),
        "fenced {:?} after the cut",
        fenced_at - cut_at
    );
    assert!(b.health().is_ready(), "b is not affected");

    // b judges a dead and, once a owns nothing, removes its heartbeat row.
    let limit = Instant::now() + LEASE_EXPIRY * 3;
    loop {
        let members = store.membership(&group()).await.unwrap();
        if members.hosts.iter().all(|hb| hb.host.as_str() != "a") {
            break;
        }
        assert!(Instant::now() < limit, "a's row was never removed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let h = a.health();
    assert!(h.fenced && !h.is_ready(), "still cut off: {h:?}");

    // The store comes back: a finds its row gone, registers afresh, lowers its fence.
    faulty.set(FaultMode::Healthy);
    let (h, _) = until(RENEW * 2, "a ready again", || a.health(), Health::is_ready).await;
    assert!(h.registered && !h.fenced, "{h:?}");
    let members = store.membership(&group()).await.unwrap();
    let row = members
        .hosts
        .iter()
        .find(|hb| hb.host.as_str() == "a")
        .expect("a registered again");
    assert!(
        row.incarnation.ends_with(".r1"),
        "a new incarnation: {:?}",
        row.incarnation
    );
    // And it stays ready.
    tokio::time::sleep(LEASE_EXPIRY).await;
    assert!(a.health().is_ready(), "{:?}", a.health());

    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn cut_off_host_is_unhealthy_only_after_max_unhealthy_fenced_and_healthy_once_it_renews() {
    // The liveness rule: a host whose heartbeats keep failing is fenced after
    // lease_expiry − safety_margin, and unhealthy once it has been fenced for longer than
    // max_unhealthy: not a moment before (every 100 ms sample until then is healthy), and
    // healthy again as soon as a heartbeat succeeds.
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(1);
    let faulty = Faulty::new(Arc::new(store.clone()));
    let a = start(Arc::new(faulty.clone()), &feed, "a");
    until(RENEW * 2, "a ready", || a.health(), Health::is_ready).await;
    tokio::time::sleep(LEASE_EXPIRY).await;
    let h = a.health();
    assert!(h.is_ready() && h.is_healthy(), "{h:?}");

    faulty.set(FaultMode::Fail);
    let (h, _) = until(FENCE_AFTER, "a fenced", || a.health(), |h| h.fenced).await;
    assert!(h.is_healthy(), "fenced is not yet unhealthy: {h:?}");
    // When the fence fell: the last successful heartbeat's sending plus FENCE_AFTER.
    let fenced_at =
        Instant::now() - h.heartbeat_age.expect("a registered host has a heartbeat") + FENCE_AFTER;

    let (h, unhealthy_at) = until(
        MAX_UNHEALTHY + Duration::from_secs(1),
        "a unhealthy",
        || a.health(),
        |h| !h.is_healthy(),
    )
    .await;
    let spell = unhealthy_at - fenced_at;
    assert!(
        spell > MAX_UNHEALTHY && spell <= MAX_UNHEALTHY + Duration::from_millis(100),
        "unhealthy {spell:?} after the fence, max_unhealthy {MAX_UNHEALTHY:?}"
    );
    let u = h.unhealthy.clone().expect("unhealthy");
    assert!(matches!(u.reason, UnhealthyReason::Fenced { .. }), "{u:?}");
    assert_eq!(u.duration, spell);
    assert_eq!(u.max_unhealthy, MAX_UNHEALTHY);
    let text = u.to_string();
    assert!(
        text.starts_with("unhealthy: fenced: no successful heartbeat since ")
            && text.ends_with(", longer than max_unhealthy (30s)"),
        "{text}"
    );
    assert!(h.fenced && !h.is_ready(), "{h:?}");
    // It stays unhealthy while the store stays away.
    tokio::time::sleep(LEASE_EXPIRY).await;
    assert!(!a.health().is_healthy(), "{:?}", a.health());

    faulty.set(FaultMode::Healthy);
    let (h, _) = until(
        RENEW * 2,
        "a healthy again",
        || a.health(),
        |h| h.is_healthy() && h.is_ready(),
    )
    .await;
    assert!(h.registered && !h.fenced, "{h:?}");
    tokio::time::sleep(LEASE_EXPIRY).await;
    assert!(a.health().is_healthy(), "{:?}", a.health());
    a.stop().await.unwrap();
}

/// A store that, while `refuse` is set, refuses every registration (a heartbeat write that
/// expects no row) with a retryable error, as a server would that answers but cannot take
/// new rows; renewals of an existing row go through.
#[derive(Debug)]
struct RefuseRegistration {
    inner: MemoryLeaseStore,
    refuse: AtomicBool,
}

#[async_trait]
impl ForwardingStore for RefuseRegistration {
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
        if expected.is_none() && self.refuse.load(Ordering::SeqCst) {
            return Err(LeaseError::store(
                "heartbeat",
                Some(host.to_string()),
                true,
                "registration refused (test)",
            ));
        }
        self.inner
            .heartbeat(group, host, incarnation, written_at, expected, role, report)
            .await
    }
}

#[tokio::test(start_paused = true)]
async fn host_whose_row_is_gone_and_cannot_register_again_is_unhealthy_after_max_unhealthy() {
    // The other way recovery fails: the host's heartbeat row is removed (an operator released
    // it) and registering afresh keeps failing. From finding its row gone the host is
    // unregistered (and fenced once its deadline passes); after max_unhealthy of that it is
    // unhealthy, "not registered since …"; healthy again once it has registered.
    let memory = MemoryLeaseStore::new();
    let store = Arc::new(RefuseRegistration {
        inner: memory.clone(),
        refuse: AtomicBool::new(false),
    });
    let feed = MemoryFeed::new(1);
    let a = start(store.clone(), &feed, "a");
    until(RENEW * 2, "a ready", || a.health(), Health::is_ready).await;

    store.refuse.store(true, Ordering::SeqCst);
    let host = HostName::new("a").unwrap();
    loop {
        let members = memory.membership(&group()).await.unwrap();
        let row = members
            .hosts
            .iter()
            .find(|hb| hb.host == host)
            .expect("a's row");
        if memory
            .remove_heartbeat(&group(), &host, &row.incarnation, row.version)
            .await
            .is_ok()
        {
            break;
        }
    }
    let (h, unregistered_seen) = until(
        RENEW * 2,
        "a unregistered",
        || a.health(),
        |h| !h.registered,
    )
    .await;
    assert!(h.is_healthy(), "{h:?}");

    let (h, unhealthy_at) = until(
        MAX_UNHEALTHY + RENEW * 2,
        "a unhealthy",
        || a.health(),
        |h| !h.is_healthy(),
    )
    .await;
    // It found its row gone at most one 100 ms step before it was seen unregistered.
    let spell = unhealthy_at - unregistered_seen;
    assert!(
        spell > MAX_UNHEALTHY - Duration::from_millis(100)
            && spell <= MAX_UNHEALTHY + Duration::from_millis(100),
        "unhealthy {spell:?} after the row was found gone"
    );
    let u = h.unhealthy.clone().expect("unhealthy");
    assert!(
        matches!(u.reason, UnhealthyReason::NotRegistered { .. }),
        "{u:?}"
    );
    assert!(
        u.to_string()
            .starts_with("unhealthy: not registered since "),
        "{u}"
    );
    assert!(h.fenced && !h.registered, "{h:?}");

    store.refuse.store(false, Ordering::SeqCst);
    let (h, _) = until(
        RENEW * 2,
        "a healthy again",
        || a.health(),
        |h| h.is_healthy() && h.is_ready(),
    )
    .await;
    assert!(h.registered, "{h:?}");
    a.stop().await.unwrap();
}
