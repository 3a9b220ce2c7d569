//! `ProcessorHandle::health`: a host is ready only while registered, unfenced and running;
//! cut off from its store it becomes unready when it fences itself, and ready again once it
//! has registered again. Virtual time throughout; every wait is bounded.

use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{GroupName, HostName, Lease, LeaseKey, PartitionId, Position, Timestamp};
use changefeed::processor::{handler_fn, Health, Processor, ProcessorHandle};
use changefeed::source::MemoryFeed;
use changefeed::testkit::fleet::{FaultMode, Faulty};
use tokio::time::Instant;

/// The default timings: a host fences itself 8 s after its last successful heartbeat.
const LEASE_EXPIRY: Duration = Duration::from_secs(10);
const FENCE_AFTER: Duration = Duration::from_secs(8);
const RENEW: Duration = Duration::from_secs(2);

fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

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
    // /readyz's rule (issue 22): a host cut off from its store is not ready from the moment it
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
