//! The handler API and builder: validation, failure handling, checkpoint modes, hand-off
//! timeout. Virtual time throughout.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{Batch, HostName, Lease, LeaseKey, PartitionId};
use changefeed::processor::{
    handler_fn, CheckpointMode, CloseReason, ConfigError, Context, Handler, HandlerError,
    Processor, ProcessorBuilder,
};
use changefeed::source::MemoryFeed;

use crate::common::{group, setup};

fn builder(store: &MemoryLeaseStore, feed: &MemoryFeed, host: &str) -> ProcessorBuilder {
    Processor::builder()
        .host(host)
        .group("g")
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .seed(7)
        .poll_delay(Duration::from_millis(100))
}

async fn lease(store: &MemoryLeaseStore, p: &str) -> Lease {
    store
        .get(&LeaseKey::new(group(), PartitionId::new(p).unwrap()))
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

#[tokio::test]
async fn invalid_settings_are_rejected_naming_the_setting() {
    // Design, "Bad input": a setting that breaks a rule is refused when built, by name.
    let (store, feed) = setup(1).await;
    let noop = || handler_fn(|_, _| async { Ok(()) });
    let cases: Vec<(ProcessorBuilder, &str)> = vec![
        (
            builder(&store, &feed, "a")
                .handler(noop())
                .renew_interval(Duration::from_secs(15))
                .lease_expiry(Duration::from_secs(10)),
            "renew_interval",
        ),
        (
            builder(&store, &feed, "a")
                .handler(noop())
                .safety_margin(Duration::from_secs(10))
                .lease_expiry(Duration::from_secs(10)),
            "safety_margin",
        ),
        (
            builder(&store, &feed, "a")
                .handler(noop())
                .max_batch_size(0),
            "max_batch_size",
        ),
        (builder(&store, &feed, "").handler(noop()), "host"),
        (
            builder(&store, &feed, &"h".repeat(300)).handler(noop()),
            "host",
        ),
        (
            builder(&store, &feed, "a").handler(noop()).group("a/b"),
            "group",
        ),
        (
            builder(&store, &feed, "a")
                .handler(noop())
                .acquire_interval(Duration::ZERO),
            "acquire_interval",
        ),
        (builder(&store, &feed, "a"), "handler"),
        (
            builder(&store, &feed, "a")
                .handler(noop())
                .handoff_timeout(Duration::from_secs(4)),
            "handoff_timeout",
        ),
    ];
    for (b, setting) in cases {
        let err = b.build().expect_err("invalid settings must be refused");
        assert!(
            err.to_string().starts_with(setting) || err.to_string().contains(setting),
            "error names {setting}: {err}"
        );
        if let ConfigError::Invalid { setting: s, .. } = &err {
            assert_eq!(*s, setting);
        }
    }
    let err = builder(&store, &feed, "a")
        .handler(noop())
        .renew_interval(Duration::from_secs(15))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "renew_interval: 15s must be below lease_expiry − safety_margin (8s), or the host fences itself between heartbeats"
    );
}

/// Fails every batch of partition 0 until told to succeed; records what it saw.
#[derive(Debug, Default)]
struct Flaky {
    fail: AtomicBool,
    attempts: AtomicU32,
    delivered: Mutex<Vec<String>>,
    closes: Mutex<Vec<CloseReason>>,
}

#[async_trait]
impl Handler for Flaky {
    async fn handle(&self, _ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err("downstream unavailable".into());
        }
        let mut d = self.delivered.lock().unwrap();
        d.extend(
            batch
                .records
                .iter()
                .map(|r| String::from_utf8(r.data.to_vec()).unwrap()),
        );
        Ok(())
    }

    async fn close(&self, _ctx: &Context, reason: CloseReason) {
        self.closes.lock().unwrap().push(reason);
    }
}

#[tokio::test(start_paused = true)]
async fn failing_handler_never_advances_the_checkpoint_and_releases_after_retries() {
    // Handler API: an error never advances the checkpoint; after the retry limit the lease is
    // released at its last checkpoint; nothing is skipped.
    let (store, feed) = setup(1).await;
    let p0 = PartitionId::new("0").unwrap();
    for i in 0..3 {
        feed.append_to(&p0, "k", format!("r{i}")).unwrap();
    }
    let handler = Arc::new(Flaky::default());
    let running = builder(&store, &feed, "a")
        .shared_handler(handler.clone())
        .handler_max_retries(3)
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        offset(&lease(&store, "0").await),
        3,
        "first batch checkpointed"
    );
    handler.fail.store(true, Ordering::SeqCst);
    for i in 3..6 {
        feed.append_to(&p0, "k", format!("r{i}")).unwrap();
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(
        handler.attempts.load(Ordering::SeqCst) > 4,
        "the first attempt and 4 retries"
    );
    assert!(
        handler
            .closes
            .lock()
            .unwrap()
            .contains(&CloseReason::HandlerFailed),
        "worker closed with HandlerFailed"
    );
    assert_eq!(
        offset(&lease(&store, "0").await),
        3,
        "a failing batch never moves the checkpoint"
    );
    // Once the handler recovers, the lease is taken again and the batch delivered.
    handler.fail.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(offset(&lease(&store, "0").await), 6);
    let d = handler.delivered.lock().unwrap().clone();
    assert_eq!(d, ["r0", "r1", "r2", "r3", "r4", "r5"], "nothing skipped");
    running.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn manual_mode_checkpoints_only_when_the_handler_says() {
    // Checkpoint modes: in manual mode only Context::checkpoint moves the checkpoint.
    let (store, feed) = setup(1).await;
    let p0 = PartitionId::new("0").unwrap();
    for i in 0..10 {
        feed.append_to(&p0, "k", format!("r{i}")).unwrap();
    }
    let running = builder(&store, &feed, "a")
        .checkpoint_mode(CheckpointMode::Manual)
        .max_batch_size(5)
        .handler(handler_fn(|ctx, batch| async move {
            // Checkpoint after the 4th record of the first batch only.
            if let Some(r) = batch.records.get(3) {
                if r.data.as_ref() == b"r3" {
                    ctx.checkpoint(r.continuation.clone()).await?;
                }
            }
            Ok(())
        }))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(offset(&lease(&store, "0").await), 4);
    running.stop().await.unwrap();
    let l = lease(&store, "0").await;
    assert_eq!(
        offset(&l),
        4,
        "stop keeps the manual checkpoint, not the delivered position"
    );
    assert_eq!(l.owner, None, "released");
}

#[tokio::test(start_paused = true)]
async fn interval_mode_writes_fewer_checkpoints_and_flushes_on_stop() {
    // Checkpoint modes: at most one checkpoint per interval; the pending one is written on stop.
    let (store, feed) = setup(1).await;
    let p0 = PartitionId::new("0").unwrap();
    let running = builder(&store, &feed, "a")
        .checkpoint_mode(CheckpointMode::Interval(Duration::from_secs(10)))
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let v0 = lease(&store, "0").await.version;
    for i in 0..40 {
        feed.append_to(&p0, "k", format!("r{i}")).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let l = lease(&store, "0").await;
    let writes = l.version.0 - v0.0;
    assert!(
        (1..=3).contains(&writes),
        "20 s of batches every 0.5 s make 1..=3 checkpoint writes at a 10 s interval, got {writes}"
    );
    running.stop().await.unwrap();
    assert_eq!(
        offset(&lease(&store, "0").await),
        40,
        "stop flushes the pending checkpoint"
    );
}

#[tokio::test(start_paused = true)]
async fn owner_stuck_in_a_call_cancels_it_and_hands_off_before_the_steal() {
    // Balancing and the fence over the call: an owner whose batch takes longer than the
    // hand-off timeout cancels the call before the asker may steal, and hands the lease over
    // at its last checkpoint (HandedOff): it never delivers after the asker took over.
    let (store, feed) = setup(2).await;
    for p in ["0", "1"] {
        feed.append_to(&PartitionId::new(p).unwrap(), "k", "first")
            .unwrap();
    }
    let stuck = Arc::new(AtomicBool::new(false));
    let closes = Arc::new(Mutex::new(Vec::new()));
    #[derive(Debug)]
    struct Slow {
        stuck: Arc<AtomicBool>,
        closes: Arc<Mutex<Vec<(PartitionId, CloseReason)>>>,
    }
    #[async_trait]
    impl Handler for Slow {
        async fn handle(&self, _ctx: &Context, _batch: &Batch) -> Result<(), HandlerError> {
            if self.stuck.load(Ordering::SeqCst) {
                // A batch that takes a minute: the owner cannot honour a hand-off meanwhile.
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            Ok(())
        }
        async fn close(&self, ctx: &Context, reason: CloseReason) {
            self.closes
                .lock()
                .unwrap()
                .push((ctx.partition().clone(), reason));
        }
    }
    let a = builder(&store, &feed, "a")
        .handler(Slow {
            stuck: stuck.clone(),
            closes: closes.clone(),
        })
        .handoff_timeout(Duration::from_secs(6))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(lease(&store, "0")
        .await
        .is_owned_by(&HostName::new("a").unwrap()));
    stuck.store(true, Ordering::SeqCst);
    for p in ["0", "1"] {
        feed.append_to(&PartitionId::new(p).unwrap(), "k", "slow")
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = builder(&store, &feed, "b")
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .handoff_timeout(Duration::from_secs(6))
        .build()
        .unwrap()
        .start();
    // b registers, asks after one renew interval, waits 6 s, then steals: well within 20 s.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let owners: Vec<_> = [lease(&store, "0").await, lease(&store, "1").await]
        .into_iter()
        .map(|l| l.owner.map(|o| o.to_string()))
        .collect();
    assert!(
        owners.contains(&Some("b".to_string())),
        "b got one lease despite a stuck owner: {owners:?}"
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        closes
            .lock()
            .unwrap()
            .iter()
            .any(|(_, r)| *r == CloseReason::HandedOff),
        "the old owner's stuck worker handed off: {:?}",
        closes.lock().unwrap()
    );
    stuck.store(false, Ordering::SeqCst);
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}
