//! The worker's retry policy, seen from outside: what it retries, how long it waits (on the
//! injected clock), and when it gives up. Virtual time throughout.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use changefeed::error::{LeaseError, SourceError};
use changefeed::lease::{ForwardingStore, LeaseStore, MemoryLeaseStore, StoreOp};
use changefeed::model::{
    Batch, Continuation, GroupName, Lease, LeaseKey, LeaseState, Partition, PartitionId, Position,
};
use changefeed::processor::{CloseReason, Context, Handler, HandlerError, Processor};
use changefeed::source::{FeedSource, MemoryFeed, PartitionReader};
use tokio::time::Instant;

fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

fn p0() -> PartitionId {
    PartitionId::new("0").unwrap()
}

fn key() -> LeaseKey {
    LeaseKey::new(group(), p0())
}

fn offset(lease: &Lease) -> u64 {
    lease
        .continuation
        .as_ref()
        .map(|c| c.as_str().rsplit_once(':').unwrap().1.parse().unwrap())
        .unwrap_or(0)
}

/// Source errors to inject, in order: `true` retryable, `false` final.
#[derive(Debug, Default)]
struct Faults {
    open: Mutex<VecDeque<bool>>,
    read: Mutex<VecDeque<bool>>,
    /// When each failed call was made, and whether its error was retryable.
    failed: Mutex<Vec<(Instant, bool)>>,
    /// Whether readers restate the continuation they were opened at, once, on their first
    /// read that finds nothing (an empty batch carrying it), as Cosmos DB adds its span.
    restate: AtomicBool,
}

impl Faults {
    fn next(&self, queue: &Mutex<VecDeque<bool>>, op: &'static str) -> Result<(), SourceError> {
        match queue.lock().unwrap().pop_front() {
            None => Ok(()),
            Some(retryable) => {
                self.failed
                    .lock()
                    .unwrap()
                    .push((Instant::now(), retryable));
                Err(SourceError::source(
                    op,
                    Some("0".into()),
                    retryable,
                    "injected (test)",
                ))
            }
        }
    }

    fn failed(&self) -> Vec<(Instant, bool)> {
        self.failed.lock().unwrap().clone()
    }
}

/// A memory feed whose `open` and `next_batch` fail as [`Faults`] says.
#[derive(Debug, Clone)]
struct FlakyFeed {
    inner: MemoryFeed,
    faults: Arc<Faults>,
}

#[derive(Debug)]
struct FlakyReader {
    inner: Box<dyn PartitionReader>,
    faults: Arc<Faults>,
    /// The continuation to restate, until it is.
    restate: Option<Continuation>,
}

#[async_trait]
impl FeedSource for FlakyFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.inner.partitions().await
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        self.faults.next(&self.faults.open, "open")?;
        let restate = match from {
            Position::Continuation(c) if self.faults.restate.load(Ordering::SeqCst) => {
                Some(c.clone())
            }
            _ => None,
        };
        Ok(Box::new(FlakyReader {
            inner: self.inner.open(partition, from).await?,
            faults: self.faults.clone(),
            restate,
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        self.inner.remaining(partition, after).await
    }
}

#[async_trait]
impl PartitionReader for FlakyReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        self.faults.next(&self.faults.read, "read")?;
        let mut batch = self.inner.next_batch(max).await?;
        if batch.records.is_empty() {
            batch.continuation = batch.continuation.or(self.restate.take());
        } else {
            self.restate = None;
        }
        Ok(batch)
    }
}

/// Records what it was given and why each worker closed.
#[derive(Debug, Default)]
struct Recorder {
    delivered: Mutex<Vec<String>>,
    closes: Mutex<Vec<CloseReason>>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, _ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        self.delivered.lock().unwrap().extend(
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

impl Recorder {
    fn delivered(&self) -> Vec<String> {
        self.delivered.lock().unwrap().clone()
    }

    fn closes(&self) -> Vec<CloseReason> {
        self.closes.lock().unwrap().clone()
    }
}

struct Setup {
    store: Arc<dyn LeaseStore>,
    feed: MemoryFeed,
    faults: Arc<Faults>,
    handler: Arc<Recorder>,
}

async fn setup(store: Arc<dyn LeaseStore>) -> Setup {
    store
        .create(&Lease::new(key(), Position::Beginning))
        .await
        .unwrap();
    let feed = MemoryFeed::new(1);
    for i in 0..3 {
        feed.append_to(&p0(), "k", format!("r{i}")).unwrap();
    }
    Setup {
        store,
        feed,
        faults: Arc::default(),
        handler: Arc::default(),
    }
}

impl Setup {
    fn start(&self) -> changefeed::processor::ProcessorHandle {
        Processor::builder()
            .host("a")
            .group("g")
            .store(self.store.clone())
            .source(Arc::new(FlakyFeed {
                inner: self.feed.clone(),
                faults: self.faults.clone(),
            }))
            .shared_handler(self.handler.clone())
            .seed(7)
            .poll_delay(Duration::from_millis(100))
            .build()
            .unwrap()
            .start()
    }

    async fn lease(&self) -> Lease {
        self.store.get(&key()).await.unwrap().unwrap()
    }
}

#[tokio::test(start_paused = true)]
async fn retryable_read_errors_are_retried_with_growing_backoff() {
    // Retry policy, READ_BATCH: a retryable read error is retried after min_backoff × 2ⁿ with
    // jitter in [½, 1], slept on the injected clock, and the worker keeps its lease.
    let s = setup(Arc::new(MemoryLeaseStore::new())).await;
    s.faults.read.lock().unwrap().extend([true, true, true]);
    let running = s.start();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failed = s.faults.failed();
    assert_eq!(failed.len(), 3);
    let mut base = Duration::from_millis(100);
    for pair in failed.windows(2) {
        let waited = pair[1].0 - pair[0].0;
        assert!(
            waited >= base / 2 && waited <= base,
            "waited {waited:?}, backoff base {base:?}"
        );
        base *= 2;
    }
    assert_eq!(s.handler.delivered(), ["r0", "r1", "r2"]);
    assert!(s.handler.closes().is_empty(), "never gave the lease up");
    running.stop().await.expect("a clean stop");
}

#[tokio::test(start_paused = true)]
async fn final_read_error_releases_the_lease_at_its_checkpoint() {
    // Retry policy, READ_BATCH: an error the source calls final is not retried; the lease is
    // released at its checkpoint (SourceFailed), and nothing is skipped when it is taken again.
    let s = setup(Arc::new(MemoryLeaseStore::new())).await;
    let running = s.start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(offset(&s.lease().await), 3);
    s.faults.read.lock().unwrap().push_back(false);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.handler.closes(), [CloseReason::SourceFailed]);
    assert_eq!(s.faults.failed().len(), 1, "a final error is not retried");
    let l = s.lease().await;
    assert_eq!(offset(&l), 3, "released at its checkpoint");
    // The host takes the free lease again and goes on from the checkpoint.
    s.feed.append_to(&p0(), "k", "r3").unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(s.handler.delivered(), ["r0", "r1", "r2", "r3"]);
    assert_eq!(offset(&s.lease().await), 4);
    running.stop().await.expect("a clean stop");
}

#[tokio::test(start_paused = true)]
async fn open_retries_a_retryable_error_and_gives_up_on_a_final_one() {
    // Retry policy, OPEN_READER: retryable open errors are retried; a final one releases the
    // lease with its checkpoint unchanged (SourceFailed) instead.
    let s = setup(Arc::new(MemoryLeaseStore::new())).await;
    s.faults
        .open
        .lock()
        .expect("not poisoned")
        .extend([true, true, false]);
    let running = s.start();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let failed = s.faults.failed();
    assert_eq!(
        failed.iter().map(|f| f.1).collect::<Vec<_>>(),
        [true, true, false]
    );
    assert_eq!(s.handler.closes(), [CloseReason::SourceFailed]);
    assert!(s.handler.delivered().is_empty());
    // Taken again, it opens and delivers from the start.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(s.handler.delivered(), ["r0", "r1", "r2"]);
    running.stop().await.expect("a clean stop");
}

/// A store whose lease writes (`replace`) fail with a retryable error while switched on, and
/// counts them.
#[derive(Debug)]
struct FailingWrites {
    inner: MemoryLeaseStore,
    on: AtomicBool,
    failed: AtomicU32,
}

#[async_trait]
impl ForwardingStore for FailingWrites {
    fn inner(&self) -> &dyn LeaseStore {
        &self.inner
    }

    async fn before(&self, op: StoreOp) -> Result<(), LeaseError> {
        if op == StoreOp::Replace && self.on.load(Ordering::SeqCst) {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(LeaseError::store("replace", None, true, "injected (test)"));
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn release_on_stop_gives_up_after_three_attempts() {
    // Retry policy, RELEASE: a release that keeps failing is tried three times, its waits not
    // cut short by the stop; then the lease is left to expire and the stop completes.
    let store = Arc::new(FailingWrites {
        inner: MemoryLeaseStore::new(),
        on: AtomicBool::new(false),
        failed: AtomicU32::new(0),
    });
    let s = setup(store.clone()).await;
    let running = s.start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.handler.delivered(), ["r0", "r1", "r2"]);
    store.on.store(true, Ordering::SeqCst);
    let started = Instant::now();
    running.stop().await.expect("a clean stop");
    assert_eq!(store.failed.load(Ordering::SeqCst), 3);
    assert_eq!(s.handler.closes(), [CloseReason::Shutdown]);
    let waited = Instant::now() - started;
    assert!(
        waited >= Duration::from_millis(150),
        "backed off twice between the attempts: {waited:?}"
    );
    let l = s.lease().await;
    assert_eq!(l.state, LeaseState::Owned, "left to expire");
}

#[tokio::test(start_paused = true)]
async fn a_place_restated_without_records_is_checkpointed_and_finished_at() {
    // PartitionReader::next_batch: an empty batch carrying a continuation (the reader's place
    // restated, as Cosmos DB adds its range's span to it) is checkpointed without calling the
    // handler; at the end of the partition the lease is finished there.
    for closed in [false, true] {
        let s = setup(Arc::new(MemoryLeaseStore::new())).await;
        let mut reader = s.feed.open(&p0(), &Position::Beginning).await.unwrap();
        let at = reader.next_batch(3).await.unwrap().continuation.unwrap();
        let mut lease = s.lease().await;
        lease.start = Position::Continuation(at.clone());
        s.store.replace(&lease, lease.version).await.unwrap();
        if closed {
            s.feed.split(&p0()).unwrap();
        }
        s.faults.restate.store(true, Ordering::SeqCst);
        let running = s.start();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lease = s.lease().await;
        assert_eq!(lease.continuation, Some(at), "closed: {closed}");
        assert_eq!(
            lease.state,
            if closed {
                LeaseState::Finished
            } else {
                LeaseState::Owned
            }
        );
        assert!(s.handler.delivered().is_empty(), "nothing delivered");
        running.stop().await.expect("a clean stop");
    }
}

/// A handler that cannot be opened.
#[derive(Debug, Default)]
struct NeverOpens {
    attempts: AtomicU32,
}

#[async_trait]
impl Handler for NeverOpens {
    async fn open(&self, _ctx: &Context) -> Result<(), HandlerError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        Err("the handler cannot start (test)".into())
    }

    async fn handle(&self, _ctx: &Context, _batch: &Batch) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_stop_while_opening_releases_the_lease() {
    // DESIGN rule 6: a graceful stop releases the lease whatever state the worker is in, here
    // while it is still backing off between attempts to open the reader or the handler (a
    // record processor that exits at once), before anything was delivered.
    for failing in ["reader", "handler"] {
        let s = setup(Arc::new(MemoryLeaseStore::new())).await;
        let handler = Arc::new(NeverOpens::default());
        if failing == "reader" {
            s.faults
                .open
                .lock()
                .expect("not poisoned")
                .extend([true; 1000]);
        }
        let mut builder = Processor::builder()
            .host("a")
            .group("g")
            .store(s.store.clone())
            .source(Arc::new(FlakyFeed {
                inner: s.feed.clone(),
                faults: s.faults.clone(),
            }))
            .seed(7)
            .handler_max_retries(1000);
        builder = if failing == "reader" {
            builder.shared_handler(s.handler.clone())
        } else {
            builder.shared_handler(handler.clone())
        };
        let running = builder.build().expect("valid settings").start();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let tries = s.faults.failed().len() + handler.attempts.load(Ordering::SeqCst) as usize;
        assert!(tries >= 3, "{failing}: still retrying ({tries})");
        assert_eq!(
            s.lease().await.owner.map(|o| o.to_string()).as_deref(),
            Some("a")
        );
        running.stop().await.expect("a clean stop");
        let l = s.lease().await;
        assert_eq!(l.owner, None, "{failing}: released at the stop");
        assert_eq!(l.continuation, None, "{failing}: nothing checkpointed");
    }
}
