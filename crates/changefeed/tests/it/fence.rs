//! The fence over the batch in flight: a handler call never outlives its owner's right to
//! deliver (fence, lease loss, timeout, stop), fencing tokens grow with every owner, a stop
//! always ends, and a failing batch backs off across hosts. Virtual time throughout.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{
    Batch, GroupName, Heartbeat, HostName, Lease, LeaseKey, PartitionId, Position, Timestamp,
    Version,
};
use changefeed::processor::{
    handler_fn, CloseReason, Context, DeadLetter, DeadLetterSink, Handler, HandlerError, Processor,
    ProcessorBuilder,
};
use changefeed::source::MemoryFeed;
use changefeed::testkit::fleet::{FaultMode, Faulty};
use tokio::time::Instant;

fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

fn p0() -> PartitionId {
    PartitionId::new("0").unwrap()
}

async fn setup() -> (MemoryLeaseStore, MemoryFeed) {
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(1);
    store
        .create(&Lease::new(
            LeaseKey::new(group(), p0()),
            Position::Beginning,
        ))
        .await
        .unwrap();
    (store, feed)
}

fn builder(store: Arc<dyn LeaseStore>, feed: &MemoryFeed, host: &str) -> ProcessorBuilder {
    Processor::builder()
        .host(host)
        .group("g")
        .store(store)
        .source(Arc::new(feed.clone()))
        .seed(7)
        .poll_delay(Duration::from_millis(100))
}

async fn lease(store: &MemoryLeaseStore) -> Lease {
    store
        .get(&LeaseKey::new(group(), p0()))
        .await
        .unwrap()
        .unwrap()
}

fn offset(lease: &Lease) -> u64 {
    lease
        .continuation
        .as_ref()
        .map(|c| c.as_str().rsplit_once(':').unwrap().1.parse().unwrap())
        .unwrap_or(0)
}

/// One handler call: (host, fencing token, first record, started, finished or None).
type Call = (String, u64, String, Instant, Option<Instant>);

/// What a handler saw, with virtual times.
#[derive(Debug, Default)]
struct Journal {
    calls: Mutex<Vec<Call>>,
    /// (host, when the call's context said it was cancelled).
    cancelled: Mutex<Vec<(String, Instant)>>,
    closes: Mutex<Vec<(String, CloseReason)>>,
}

/// A handler whose calls take `slow` while `slow_first` records are in the batch, then
/// return; it notes when its context is cancelled (from a task it spawned, as a handler that
/// writes from other tasks would).
#[derive(Debug)]
struct Recording {
    host: String,
    journal: Arc<Journal>,
    slow: Duration,
}

#[async_trait]
impl Handler for Recording {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let started = Instant::now();
        let i = {
            let mut calls = self.journal.calls.lock().unwrap();
            calls.push((
                self.host.clone(),
                ctx.fencing_token(),
                String::from_utf8(batch.records[0].data.to_vec()).unwrap(),
                started,
                None,
            ));
            calls.len() - 1
        };
        let token = ctx.cancellation_token();
        let journal = self.journal.clone();
        let host = self.host.clone();
        tokio::spawn(async move {
            token.cancelled().await;
            journal
                .cancelled
                .lock()
                .unwrap()
                .push((host, Instant::now()));
        });
        tokio::time::sleep(self.slow).await;
        self.journal.calls.lock().unwrap()[i].4 = Some(Instant::now());
        Ok(())
    }

    async fn close(&self, _ctx: &Context, reason: CloseReason) {
        self.journal
            .closes
            .lock()
            .unwrap()
            .push((self.host.clone(), reason));
    }
}

#[tokio::test(start_paused = true)]
async fn fenced_host_cancels_its_call_in_flight_before_another_host_delivers() {
    // Rules 1 and 3 over a slow call: a host cut off from the store mid-call drops the call
    // when its fence rises, before another host may take the lease; nothing is checkpointed.
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "r0").unwrap();
    let journal = Arc::new(Journal::default());
    let faulty_a = Faulty::new(Arc::new(store.clone()));
    let a = builder(Arc::new(faulty_a.clone()), &feed, "a")
        .handler(Recording {
            host: "a".into(),
            journal: journal.clone(),
            slow: Duration::from_secs(60),
        })
        .build()
        .unwrap()
        .start();
    // a takes the lease and starts its minute-long call.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(journal.calls.lock().unwrap().len(), 1, "a is in its call");
    faulty_a.set(FaultMode::Hang);
    let b = builder(Arc::new(store.clone()), &feed, "b")
        .handler(Recording {
            host: "b".into(),
            journal: journal.clone(),
            slow: Duration::from_millis(10),
        })
        .build()
        .unwrap()
        .start();
    // Long enough for a's call to have finished, had it not been cancelled.
    tokio::time::sleep(Duration::from_secs(70)).await;
    let calls = journal.calls.lock().unwrap().clone();
    let cancelled = journal.cancelled.lock().unwrap().clone();
    let (_, token_a, _, _, done_a) = &calls[0];
    assert_eq!(*done_a, None, "a's call never finished: {calls:?}");
    let cancelled_a = cancelled
        .iter()
        .find(|(h, _)| h == "a")
        .map(|(_, t)| *t)
        .expect("a's context was cancelled");
    let b_call = calls
        .iter()
        .find(|c| c.0 == "b")
        .expect("b delivered the partition");
    assert!(
        cancelled_a <= b_call.3,
        "a's call was cancelled ({cancelled_a:?}) before b's started ({:?})",
        b_call.3
    );
    assert!(b_call.1 > *token_a, "b's fencing token exceeds a's");
    assert_eq!(offset(&lease(&store).await), 1, "b checkpointed the batch");
    assert!(journal
        .closes
        .lock()
        .unwrap()
        .contains(&("a".to_string(), CloseReason::LeaseLost)));
    a.kill();
    b.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn fencing_token_stays_for_a_tenure_and_grows_with_every_owner() {
    // Context::fencing_token: one value per tenure, strictly greater for each later owner.
    let (store, feed) = setup().await;
    let journal = Arc::new(Journal::default());
    let start = |host: &str| {
        builder(Arc::new(store.clone()), &feed, host)
            .handler(Recording {
                host: host.into(),
                journal: journal.clone(),
                slow: Duration::ZERO,
            })
            .build()
            .unwrap()
            .start()
    };
    let a = start("a");
    for i in 0..3 {
        feed.append_to(&p0(), "k", format!("a{i}")).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    a.stop().await.unwrap();
    let b = start("b");
    for i in 0..3 {
        feed.append_to(&p0(), "k", format!("b{i}")).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    b.kill();
    let c = start("c");
    feed.append_to(&p0(), "k", "c0").unwrap();
    tokio::time::sleep(Duration::from_secs(20)).await;
    c.stop().await.unwrap();
    let calls = journal.calls.lock().unwrap().clone();
    let tokens = |h: &str| -> Vec<u64> {
        calls
            .iter()
            .filter(|c| c.0 == h)
            .map(|c| c.1)
            .collect::<Vec<_>>()
    };
    let (ta, tb, tc) = (tokens("a"), tokens("b"), tokens("c"));
    assert_eq!(ta.len(), 3, "{calls:?}");
    assert!(ta.windows(2).all(|w| w[0] == w[1]), "a's token: {ta:?}");
    assert!(tb.windows(2).all(|w| w[0] == w[1]), "b's token: {tb:?}");
    assert!(tb[0] > ta[0] && tc[0] > tb[0], "{ta:?} {tb:?} {tc:?}");
}

#[tokio::test(start_paused = true)]
async fn call_over_handler_timeout_is_cancelled_and_retried() {
    // handler_timeout: a hung call is cancelled, counts as a failure and the batch is retried.
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "r0").unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let cancelled = Arc::new(AtomicU32::new(0));
    let handler = {
        let calls = calls.clone();
        let cancelled = cancelled.clone();
        handler_fn(move |ctx, _| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let cancelled = cancelled.clone();
            async move {
                if n == 0 {
                    tokio::select! {
                        _ = ctx.cancelled() => { cancelled.fetch_add(1, Ordering::SeqCst); }
                        _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
                    }
                    // Still here only if dropped late: the test would see a second cancel.
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        })
    };
    let a = builder(Arc::new(store.clone()), &feed, "a")
        .handler(handler)
        .handler_timeout(Some(Duration::from_secs(3)))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one timed-out call, one retry"
    );
    assert_eq!(
        offset(&lease(&store).await),
        1,
        "the retry was checkpointed"
    );
    a.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn stop_with_a_hung_handler_ends_within_shutdown_timeout_and_frees_everything() {
    // A stop that always ends: the hung call is cancelled after half of shutdown_timeout, the
    // lease is released at its checkpoint and the heartbeat row removed, within the timeout.
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "r0").unwrap();
    feed.append_to(&p0(), "k", "r1").unwrap();
    let a = builder(Arc::new(store.clone()), &feed, "a")
        .max_batch_size(1)
        .handler(handler_fn(|_, batch| async move {
            if batch.records[0].data.as_ref() == b"r1" {
                std::future::pending::<()>().await;
            }
            Ok(())
        }))
        .shutdown_timeout(Duration::from_secs(4))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let started = Instant::now();
    a.stop().await.unwrap();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(4), "stop took {took:?}");
    let l = lease(&store).await;
    assert_eq!(l.owner, None, "released");
    assert_eq!(offset(&l), 1, "at its last checkpoint");
    let m = store.membership(&group()).await.unwrap();
    assert!(m.hosts.is_empty(), "heartbeat removed: {:?}", m.hosts);
}

/// A store whose heartbeat writes land at once but whose replies take a while, so a stop can
/// cut a renewal short after it changed the row.
#[derive(Debug)]
struct SlowHeartbeatReplies(MemoryLeaseStore);

#[async_trait]
impl changefeed::lease::ForwardingStore for SlowHeartbeatReplies {
    fn inner(&self) -> &dyn LeaseStore {
        &self.0
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
    ) -> Result<Heartbeat, changefeed::error::LeaseError> {
        let hb = self
            .0
            .heartbeat(group, host, incarnation, written_at, expected, role, report)
            .await;
        tokio::time::sleep(Duration::from_millis(900)).await;
        hb
    }
}

#[tokio::test(start_paused = true)]
async fn stop_removes_the_heartbeat_even_when_it_cuts_a_renewal_short() {
    // A stop cancels the heartbeat task, possibly after a renewal changed the row but before
    // its reply: the removal must still find the row, whatever instant the stop lands at.
    for offset_ms in (0..2000).step_by(100) {
        let (store, feed) = setup().await;
        let a = builder(Arc::new(SlowHeartbeatReplies(store.clone())), &feed, "a")
            .handler(handler_fn(|_, _| async { Ok(()) }))
            .build()
            .unwrap()
            .start();
        tokio::time::sleep(Duration::from_millis(6000 + offset_ms)).await;
        a.stop().await.unwrap();
        let m = store.membership(&group()).await.unwrap();
        assert!(
            m.hosts.is_empty(),
            "stop at +{offset_ms} ms left the heartbeat row: {:?}",
            m.hosts
        );
    }
}

#[tokio::test(start_paused = true)]
async fn failing_batch_backs_off_across_hosts() {
    // Failures are kept with the lease: a host that takes it next waits out the backoff they
    // earned instead of starting over (before: 66 calls in 40 s with two hosts).
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "poison").unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let failing = || {
        let calls = calls.clone();
        handler_fn(move |_, _| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), HandlerError>("downstream refuses the batch".into()) }
        })
    };
    let hosts: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|h| {
            builder(Arc::new(store.clone()), &feed, h)
                .handler(failing())
                .build()
                .unwrap()
                .start()
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(40)).await;
    let n = calls.load(Ordering::SeqCst);
    // 100 ms doubling to the 10 s maximum: 0.1 … 6.4 s then 10 s each, jittered to half.
    assert!((8..=20).contains(&n), "{n} calls in 40 s");
    let l = lease(&store).await;
    assert_eq!(offset(&l), 0, "never skipped");
    let failures: u32 = l
        .properties
        .get("changefeed.failures")
        .map(|v| v.parse().unwrap())
        .unwrap_or(0);
    assert!(failures >= 6, "the lease counts the failures: {l:?}");
    for h in hosts {
        h.stop().await.unwrap();
    }
}

/// Dead letters kept in memory.
#[derive(Debug, Default)]
struct Letters(Mutex<Vec<DeadLetter>>);

#[async_trait]
impl DeadLetterSink for Letters {
    async fn dead_letter(&self, letter: &DeadLetter) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(letter.clone());
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn batch_failing_n_times_is_dead_lettered_and_the_partition_moves_on() {
    // Opt-in dead letters: after N failures the batch goes to the sink and the checkpoint
    // moves past it; later batches are delivered.
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "poison").unwrap();
    let letters = Arc::new(Letters::default());
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let d = delivered.clone();
    let a = builder(Arc::new(store.clone()), &feed, "a")
        .max_batch_size(1)
        .handler(handler_fn(move |_, batch| {
            let d = d.clone();
            async move {
                let text = String::from_utf8(batch.records[0].data.to_vec()).unwrap();
                if text == "poison" {
                    return Err("cannot parse".into());
                }
                d.lock().unwrap().push(text);
                Ok(())
            }
        }))
        .dead_letter(letters.clone(), 3)
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    feed.append_to(&p0(), "k", "fine").unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let got = letters.0.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].failures, 3);
    assert_eq!(got[0].error, "cannot parse");
    assert_eq!(got[0].batch.records[0].data.as_ref(), b"poison");
    assert_eq!(got[0].after, None);
    assert_eq!(*delivered.lock().unwrap(), ["fine"]);
    assert_eq!(offset(&lease(&store).await), 2, "past the dead letter");
    a.stop().await.unwrap();
}

#[tokio::test]
async fn dead_letter_after_without_a_sink_is_refused() {
    let (store, feed) = setup().await;
    let err = builder(Arc::new(store), &feed, "a")
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .settings(changefeed::processor::Settings {
            dead_letter_after: Some(3),
            ..Default::default()
        })
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("dead_letter_after"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn stop_ends_within_shutdown_timeout_even_when_the_store_hangs() {
    // A stop that always ends: with every store call hanging (cycle, release, heartbeat
    // removal), stop still returns within shutdown_timeout; the lease then expires.
    let (store, feed) = setup().await;
    feed.append_to(&p0(), "k", "r0").unwrap();
    let faulty = Faulty::new(Arc::new(store.clone()));
    let a = builder(Arc::new(faulty.clone()), &feed, "a")
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .shutdown_timeout(Duration::from_secs(4))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(lease(&store)
        .await
        .is_owned_by(&HostName::new("a").unwrap()));
    faulty.set(FaultMode::Hang);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), a.stop())
        .await
        .expect("stop ended")
        .unwrap();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(4), "stop took {took:?}");
}
