//! The handler options: the idle tick (`max_wait_time`), the lease acquired,
//! released and error notifications, the per-partition start position, and the per-partition
//! lag gauges' setting. Virtual time throughout.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{Lease, LeaseKey, PartitionId, Position};
use changefeed::processor::{
    handler_fn, CloseReason, ConfigError, ErrorNotice, ErrorOrigin, Processor, ProcessorBuilder,
};
use changefeed::source::MemoryFeed;
use changefeed::testkit::fleet::{FaultMode, Faulty};
use tokio::time::Instant;

use crate::common::{group, setup};

fn pid(p: &str) -> PartitionId {
    PartitionId::new(p).unwrap()
}

/// One partition, `0`, with a lease and one record, `r0`.
async fn one_record() -> (MemoryLeaseStore, MemoryFeed) {
    let (store, feed) = setup(1).await;
    feed.append_to(&pid("0"), "k", "r0").unwrap();
    (store, feed)
}

fn builder(store: Arc<dyn LeaseStore>, feed: &MemoryFeed) -> ProcessorBuilder {
    Processor::builder()
        .host("a")
        .group("g")
        .store(store)
        .source(Arc::new(feed.clone()))
        .seed(3)
        .poll_delay(Duration::from_millis(100))
}

/// Every handler call: when (since the test began), which partition, how many records.
type Calls = Arc<Mutex<Vec<(Duration, String, usize)>>>;

fn recording(calls: &Calls, t0: Instant) -> impl changefeed::processor::Handler {
    let calls = calls.clone();
    handler_fn(move |ctx, batch| {
        let calls = calls.clone();
        async move {
            calls.lock().unwrap().push((
                t0.elapsed(),
                ctx.partition().to_string(),
                batch.records.len(),
            ));
            Ok(())
        }
    })
}

#[tokio::test(start_paused = true)]
async fn idle_tick_calls_the_handler_with_an_empty_batch_after_max_wait_time_without_records() {
    let (store, feed) = setup(1).await;
    let calls: Calls = Arc::default();
    let t0 = Instant::now();
    let running = builder(Arc::new(store.clone()), &feed)
        .handler(recording(&calls, t0))
        .max_wait_time(Some(Duration::from_secs(5)))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(12)).await;
    // Records arrive: delivered at once, and the next tick counts from that call.
    feed.append_to(&pid("0"), "k", "r0").unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let delivered_at = {
        let calls = calls.lock().unwrap();
        let (at, _, n) = calls
            .iter()
            .find(|c| c.2 > 0)
            .expect("the record delivered");
        assert_eq!(*n, 1);
        *at
    };
    tokio::time::sleep(Duration::from_secs(8)).await;
    running.stop().await.unwrap();

    let calls = calls.lock().unwrap().clone();
    let ticks: Vec<Duration> = calls.iter().filter(|c| c.2 == 0).map(|c| c.0).collect();
    assert!(
        ticks.len() >= 3,
        "a tick about every 5 s of the 24 s, but not in the 4 s after the record: {calls:?}"
    );
    let mut last = Duration::ZERO;
    for (at, _, n) in &calls {
        if *n == 0 {
            let quiet = *at - last;
            assert!(
                quiet >= Duration::from_secs(5) && quiet < Duration::from_secs(6),
                "a tick only after max_wait_time without a call, and soon after: {quiet:?} in {calls:?}"
            );
        }
        last = *at;
    }
    assert!(
        !ticks
            .iter()
            .any(|t| *t > delivered_at && *t < delivered_at + Duration::from_secs(5)),
        "no tick within max_wait_time of a delivery: {calls:?}"
    );
    let lease = store
        .get(&LeaseKey::new(group(), pid("0")))
        .await
        .unwrap()
        .unwrap();
    assert!(
        lease.continuation.is_some(),
        "the record's checkpoint was written, and ticks did not clear it: {lease:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn without_max_wait_time_the_handler_never_sees_an_empty_batch() {
    let (store, feed) = one_record().await;
    let calls: Calls = Arc::default();
    let running = builder(Arc::new(store.clone()), &feed)
        .handler(recording(&calls, Instant::now()))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(60)).await;
    running.stop().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "only the record's batch: {calls:?}");
    assert_eq!(calls[0].2, 1);
}

#[tokio::test]
async fn max_wait_time_of_zero_is_refused_by_name() {
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(1);
    let err = builder(Arc::new(store), &feed)
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .max_wait_time(Some(Duration::ZERO))
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Invalid {
                setting: "max_wait_time",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn max_unhealthy_below_lease_expiry_or_zero_is_refused_by_name() {
    // max_unhealthy: none means 3 × lease_expiry; below lease_expiry (or zero) is refused,
    // naming the setting and the rule.
    let feed = MemoryFeed::new(1);
    let build = |max: Option<Duration>| {
        builder(Arc::new(MemoryLeaseStore::new()), &feed)
            .handler(handler_fn(|_, _| async { Ok(()) }))
            .lease_expiry(Duration::from_secs(10))
            .max_unhealthy(max)
            .build()
    };
    assert!(build(None).is_ok());
    assert!(build(Some(Duration::from_secs(10))).is_ok());
    for (max, rule) in [
        (
            Duration::from_secs(9),
            "9s must be at least lease_expiry (10s)",
        ),
        (Duration::ZERO, "must be greater than zero"),
    ] {
        let err = build(Some(max)).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { setting: "max_unhealthy", rule: r } if r.starts_with(rule)),
            "{err}"
        );
    }
    let defaults = changefeed::processor::Settings {
        lease_expiry: Duration::from_secs(7),
        ..Default::default()
    };
    assert_eq!(defaults.unhealthy_after(), Duration::from_secs(21));
}

/// What the notifications said, in order.
#[derive(Debug, Clone, PartialEq)]
enum Note {
    Acquired(String),
    Released(String, CloseReason),
    Error(ErrorNotice),
}

fn notified(b: ProcessorBuilder, notes: &Arc<Mutex<Vec<Note>>>) -> ProcessorBuilder {
    let (n1, n2, n3) = (notes.clone(), notes.clone(), notes.clone());
    b.on_lease_acquired(move |p| n1.lock().unwrap().push(Note::Acquired(p.to_string())))
        .on_lease_released(move |p, why| {
            n2.lock().unwrap().push(Note::Released(p.to_string(), why))
        })
        .on_error(move |e| n3.lock().unwrap().push(Note::Error(e.clone())))
}

#[tokio::test(start_paused = true)]
async fn notifications_tell_acquisitions_releases_and_whose_part_failed() {
    // Partition 0 is read; the handler fails on partition 1's records until its retries run
    // out; partition 9 is not in the feed, so the source cannot open it.
    let (store, feed) = setup(2).await;
    let gone = Lease::new(LeaseKey::new(group(), pid("9")), Position::Beginning);
    store.create(&gone).await.unwrap();
    feed.append_to(&pid("0"), "k", "fine").unwrap();
    feed.append_to(&pid("1"), "k", "poison").unwrap();
    let notes: Arc<Mutex<Vec<Note>>> = Arc::default();
    let faulty = Faulty::new(Arc::new(store.clone()));
    let running = notified(builder(Arc::new(faulty.clone()), &feed), &notes)
        .handler(handler_fn(|ctx, _| async move {
            if ctx.partition().as_str() == "1" {
                Err("the downstream service refused the record".into())
            } else {
                Ok(())
            }
        }))
        .handler_max_retries(2)
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(8)).await;
    {
        let notes = notes.lock().unwrap();
        for p in ["0", "1", "9"] {
            assert!(
                notes.contains(&Note::Acquired(p.into())),
                "{p} acquired: {notes:?}"
            );
        }
        let user: Vec<&ErrorNotice> = notes
            .iter()
            .filter_map(|n| match n {
                Note::Error(e) if e.is_user_error() => Some(e),
                _ => None,
            })
            .collect();
        assert!(!user.is_empty(), "the handler's failures: {notes:?}");
        for e in &user {
            assert_eq!(e.origin, ErrorOrigin::Handler);
            assert_eq!(e.partition, Some(pid("1")), "{e}");
            assert!(e.message.contains("refused the record"), "{e}");
        }
        assert!(
            notes.contains(&Note::Released("1".into(), CloseReason::HandlerFailed)),
            "released after its retries: {notes:?}"
        );
        assert!(
            notes.iter().any(|n| matches!(n, Note::Error(e)
                if e.origin == ErrorOrigin::Source && e.partition == Some(pid("9")))),
            "the source's failure on 9, not a user error: {notes:?}"
        );
        assert!(
            notes.contains(&Note::Released("9".into(), CloseReason::SourceFailed)),
            "{notes:?}"
        );
        assert!(
            !notes
                .iter()
                .any(|n| matches!(n, Note::Error(e) if e.origin == ErrorOrigin::Store)),
            "no store error yet: {notes:?}"
        );
    }
    // The store goes away for a moment: the host's own calls fail, told as store errors
    // without a partition.
    faulty.set(FaultMode::Fail);
    tokio::time::sleep(Duration::from_secs(3)).await;
    faulty.set(FaultMode::Healthy);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        notes
            .lock()
            .unwrap()
            .iter()
            .any(|n| matches!(n, Note::Error(e)
            if e.origin == ErrorOrigin::Store && !e.is_user_error())),
        "{:?}",
        notes.lock().unwrap()
    );
    running.stop().await.unwrap();
    let notes = notes.lock().unwrap();
    assert!(
        notes.contains(&Note::Released("0".into(), CloseReason::Shutdown)),
        "released at the stop: {notes:?}"
    );
    // Every acquisition is followed by exactly one release of the same partition.
    for p in ["0", "1", "9"] {
        let events: Vec<&Note> = notes
            .iter()
            .filter(|n| match n {
                Note::Acquired(q) | Note::Released(q, _) => q == p,
                Note::Error(_) => false,
            })
            .collect();
        for pair in events.chunks(2) {
            assert!(
                matches!(pair, [Note::Acquired(_), Note::Released(..)]),
                "acquired then released, in pairs, for {p}: {events:?}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_notification_does_not_stop_the_worker() {
    let (store, feed) = one_record().await;
    let calls: Calls = Arc::default();
    let running = builder(Arc::new(store.clone()), &feed)
        .handler(recording(&calls, Instant::now()))
        .on_lease_acquired(|_| panic!("a bug in the program's notification"))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(calls.lock().unwrap().len(), 1, "the record was delivered");
    running.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn start_position_for_chooses_where_each_partition_the_group_starts_on_begins() {
    // Two partitions with old records; the program starts partition 1 at its end and partition
    // 0 at the group's start (the beginning). The leases are created by the host itself (its
    // partition sync), asking the callback once per partition.
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(2);
    for p in ["0", "1"] {
        feed.append_to(&pid(p), "k", format!("old-{p}")).unwrap();
    }
    let asked: Arc<Mutex<Vec<(String, Position)>>> = Arc::default();
    let delivered: Arc<Mutex<Vec<String>>> = Arc::default();
    let (a, d) = (asked.clone(), delivered.clone());
    let running = builder(Arc::new(store.clone()), &feed)
        .start_position_for(move |p, planned| {
            a.lock().unwrap().push((p.to_string(), planned.clone()));
            if p.as_str() == "1" {
                Position::Now
            } else {
                planned.clone()
            }
        })
        .handler(handler_fn(move |_, batch| {
            let d = d.clone();
            async move {
                d.lock().unwrap().extend(
                    batch
                        .records
                        .iter()
                        .map(|r| String::from_utf8_lossy(&r.data).into_owned()),
                );
                Ok(())
            }
        }))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    for p in ["0", "1"] {
        feed.append_to(&pid(p), "k", format!("new-{p}")).unwrap();
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    running.stop().await.unwrap();
    let mut asked = asked.lock().unwrap().clone();
    asked.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        asked,
        [
            ("0".to_string(), Position::Beginning),
            ("1".to_string(), Position::Beginning)
        ],
        "asked once per partition, with the group's start"
    );
    let mut got = delivered.lock().unwrap().clone();
    got.sort();
    assert_eq!(
        got,
        ["new-0", "new-1", "old-0"],
        "partition 1 began at its end"
    );
    let lease = store
        .get(&LeaseKey::new(group(), pid("1")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        lease.start,
        Position::Now,
        "the choice is kept in the lease"
    );
}

/// Checkpoints nothing while handling (manual mode) and, when asked at a graceful stop, the
/// last record it was given.
#[derive(Default)]
struct LazyCheckpointer {
    last: Mutex<Option<changefeed::model::Continuation>>,
    stopping_calls: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl changefeed::processor::Handler for LazyCheckpointer {
    async fn handle(
        &self,
        _ctx: &changefeed::processor::Context,
        batch: &changefeed::model::Batch,
    ) -> Result<(), changefeed::processor::HandlerError> {
        *self.last.lock().unwrap() = batch.continuation.clone();
        Ok(())
    }

    async fn stopping(
        &self,
        ctx: &changefeed::processor::Context,
    ) -> Result<(), changefeed::processor::HandlerError> {
        self.stopping_calls
            .lock()
            .unwrap()
            .push(ctx.partition().to_string());
        let last = self.last.lock().unwrap().clone();
        if let Some(c) = last {
            ctx.checkpoint(c).await?;
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_graceful_stop_lets_an_idle_handler_checkpoint_before_the_release() {
    // KCL's shutdownRequested: a handler that checkpoints lazily is asked, once, while the
    // lease is still held, and its checkpoint is what the released lease keeps.
    let (store, feed) = setup(2).await;
    for i in 0..3 {
        feed.append_to(&pid("0"), "k", format!("r{i}")).unwrap();
    }
    let handler = Arc::new(LazyCheckpointer::default());
    let running = builder(Arc::new(store.clone()), &feed)
        .shared_handler(handler.clone())
        .checkpoint_mode(changefeed::processor::CheckpointMode::Manual)
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let key = LeaseKey::new(group(), pid("0"));
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().continuation,
        None,
        "manual mode: nothing checkpointed while handling"
    );
    running.stop().await.unwrap();
    let mut asked = handler.stopping_calls.lock().unwrap().clone();
    asked.sort();
    assert_eq!(asked, ["0", "1"], "each idle worker asked once");
    let lease = store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        lease.continuation,
        handler.last.lock().unwrap().clone(),
        "the checkpoint written at the stop is kept by the release"
    );
    assert!(lease.continuation.is_some());
    assert_eq!(lease.owner, None, "released");
}

/// Checkpoints nothing while handling (manual mode); asked to stop or hand off, checkpoints
/// the last record it was given on that partition. Records every delivery with its host.
#[derive(Default)]
struct HandOffCheckpointer {
    last: Mutex<std::collections::HashMap<String, changefeed::model::Continuation>>,
    stopping_calls: Mutex<Vec<String>>,
    delivered: Mutex<Vec<(String, String)>>,
}

#[async_trait::async_trait]
impl changefeed::processor::Handler for HandOffCheckpointer {
    async fn handle(
        &self,
        ctx: &changefeed::processor::Context,
        batch: &changefeed::model::Batch,
    ) -> Result<(), changefeed::processor::HandlerError> {
        for r in &batch.records {
            self.delivered.lock().unwrap().push((
                ctx.host().to_string(),
                String::from_utf8_lossy(&r.data).into_owned(),
            ));
        }
        if let Some(c) = &batch.continuation {
            self.last
                .lock()
                .unwrap()
                .insert(ctx.partition().to_string(), c.clone());
        }
        Ok(())
    }

    async fn stopping(
        &self,
        ctx: &changefeed::processor::Context,
    ) -> Result<(), changefeed::processor::HandlerError> {
        self.stopping_calls
            .lock()
            .unwrap()
            .push(format!("{}:{}", ctx.host(), ctx.partition()));
        let last = self
            .last
            .lock()
            .unwrap()
            .get(ctx.partition().as_str())
            .cloned();
        if let Some(c) = last {
            ctx.checkpoint(c).await?;
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_hand_off_lets_a_lazy_handler_checkpoint_so_the_new_owner_delivers_nothing_again() {
    // KCL 3.x's graceful lease hand-off: a host joining a running fleet asks for its share;
    // the current owner's handler is asked to finish first, and its checkpoint is where the
    // lease moves, so nothing the first host delivered is delivered again.
    let (store, feed) = setup(4).await;
    let mut written = Vec::new();
    for p in 0..4 {
        for i in 0..5 {
            let data = format!("p{p}-r{i}");
            feed.append_to(&pid(&p.to_string()), "k", data.clone())
                .unwrap();
            written.push(data);
        }
    }
    let store: Arc<dyn LeaseStore> = Arc::new(store);
    let handler = Arc::new(HandOffCheckpointer::default());
    let start = |host: &str| {
        builder(store.clone(), &feed)
            .host(host)
            .shared_handler(handler.clone())
            .checkpoint_mode(changefeed::processor::CheckpointMode::Manual)
            .build()
            .unwrap()
            .start()
    };
    let a = start("a");
    let delivered_all = |n: usize| {
        let handler = handler.clone();
        move || {
            let handler = handler.clone();
            async move { (handler.delivered.lock().unwrap().len() >= n).then_some(()) }
        }
    };
    within(
        Duration::from_secs(5),
        "host a delivered everything",
        delivered_all(written.len()),
    )
    .await;
    let b = start("b");
    let owners = || {
        let store = store.clone();
        async move {
            let mut owners = std::collections::BTreeMap::new();
            for p in 0..4 {
                let lease = store
                    .get(&LeaseKey::new(group(), pid(&p.to_string())))
                    .await
                    .unwrap()
                    .unwrap();
                *owners
                    .entry(lease.owner.map(|o| o.to_string()))
                    .or_insert(0) += 1;
            }
            let wanted: std::collections::BTreeMap<Option<String>, i32> =
                [(Some("a".to_string()), 2), (Some("b".to_string()), 2)].into();
            (owners == wanted).then_some(())
        }
    };
    within(
        Duration::from_secs(30),
        "b took its share by hand-offs",
        owners,
    )
    .await;
    let mut asked = handler.stopping_calls.lock().unwrap().clone();
    asked.sort();
    assert_eq!(
        asked.len(),
        2,
        "a's handler was asked once per lease it handed over: {asked:?}"
    );
    assert!(asked.iter().all(|c| c.starts_with("a:")), "{asked:?}");
    for p in 0..4 {
        feed.append_to(&pid(&p.to_string()), "k", format!("p{p}-late"))
            .unwrap();
        written.push(format!("p{p}-late"));
    }
    within(
        Duration::from_secs(5),
        "the new records delivered",
        delivered_all(written.len()),
    )
    .await;
    let delivered = handler.delivered.lock().unwrap().clone();
    let mut records: Vec<&str> = delivered.iter().map(|(_, r)| r.as_str()).collect();
    records.sort_unstable();
    let mut expected: Vec<&str> = written.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(
        records, expected,
        "every record once, none again after the move"
    );
    assert!(
        delivered
            .iter()
            .any(|(h, r)| h == "b" && r.ends_with("-late")),
        "b delivers its partitions' new records"
    );
    b.stop().await.unwrap();
    a.stop().await.unwrap();
}

/// Waits on virtual time, 100 ms a step, until `done` answers `Some`; fails naming `what` after
/// `limit`.
async fn within<F, Fut>(limit: Duration, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<()>>,
{
    let deadline = Instant::now() + limit;
    while done().await.is_none() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
