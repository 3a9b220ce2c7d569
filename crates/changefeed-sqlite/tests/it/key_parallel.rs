//! Key-parallel delivery on a real SQLite feed and lease store: with `key_concurrency(4)` one
//! partition's records run in up to four handler calls at once, each key's records in order,
//! nothing lost, and a key whose call fails is the only one delivered again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::model::{Continuation, GroupName, LeaseKey, PartitionId};
use changefeed::processor::{handler_fn, Handler, Processor, ProcessorHandle, Settings};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use super::dead_letter::{settings, wait_for};

const KEYS: usize = 8;
const PER_KEY: usize = 30;

/// A SQLite file whose one partition holds the records given, with its feed, its lease store
/// and each record's continuation, in order.
struct OnePartition {
    _dir: tempfile::TempDir,
    feed: SqliteFeed,
    store: SqliteLeaseStore,
    at: Vec<Continuation>,
}

impl OnePartition {
    async fn new(records: impl IntoIterator<Item = (String, String)>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("changefeed.db");
        let feed = SqliteFeed::open(&path).await.unwrap();
        feed.create_partitions(1).await.unwrap();
        let mut at = Vec::new();
        for (key, data) in records {
            at.push(feed.append(&key, data).await.unwrap().1);
        }
        let store = SqliteLeaseStore::open(&path).await.unwrap();
        OnePartition {
            _dir: dir,
            feed,
            store,
            at,
        }
    }

    /// Host `host-a` of group `orders` running `handler` four keys at once.
    fn start(&self, settings: Settings, handler: impl Handler) -> ProcessorHandle {
        Processor::builder()
            .host("host-a")
            .group("orders")
            .settings(settings)
            .store(Arc::new(self.store.clone()))
            .source(Arc::new(self.feed.clone()))
            .handler(handler)
            .key_concurrency(4)
            .build()
            .unwrap()
            .start()
    }

    /// The partition's checkpoint now.
    async fn checkpoint(&self) -> Option<Continuation> {
        let key = LeaseKey::new(
            GroupName::new("orders").unwrap(),
            PartitionId::new("0").unwrap(),
        );
        self.store
            .get(&key)
            .await
            .unwrap()
            .and_then(|l| l.continuation)
    }

    /// Waits until the checkpoint stands at `at`.
    async fn wait_for_checkpoint(&self, what: &str, at: &Continuation) {
        wait_for(what, Duration::from_secs(30), || async {
            (self.checkpoint().await.as_ref() == Some(at)).then_some(())
        })
        .await;
    }
}

/// Each key's records in order, none lost, at most four calls at once (and more than one),
/// the checkpoint at the last record; the one key whose first call fails is the only one
/// delivered twice. Rule 4 of DESIGN.md, kept per key when a partition runs key-parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_parallel_keeps_each_keys_order_on_sqlite_with_four_slots() {
    let records =
        (0..PER_KEY).flat_map(|seq| (0..KEYS).map(move |k| (format!("k{k}"), seq.to_string())));
    let one = OnePartition::new(records).await;

    // Per key, the sequence numbers in the order the handler saw them.
    let seen: Arc<Mutex<BTreeMap<String, Vec<usize>>>> = Arc::default();
    let running_now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let failed_once = Arc::new(AtomicBool::new(false));
    let handler = {
        let (seen, running_now, most, failed_once) = (
            seen.clone(),
            running_now.clone(),
            most.clone(),
            failed_once.clone(),
        );
        handler_fn(move |_ctx, batch| {
            let (seen, running_now, most, failed_once) = (
                seen.clone(),
                running_now.clone(),
                most.clone(),
                failed_once.clone(),
            );
            async move {
                let now = running_now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // The handler's own work: long enough for the slots to overlap.
                tokio::time::sleep(Duration::from_millis(2 * batch.records.len() as u64)).await;
                running_now.fetch_sub(1, Ordering::SeqCst);
                let key = batch.records[0].key.clone();
                {
                    let mut seen = seen.lock().unwrap();
                    let got = seen.entry(key.clone()).or_default();
                    for r in &batch.records {
                        assert_eq!(r.key, key, "a call holds one key");
                        got.push(std::str::from_utf8(&r.data).unwrap().parse().unwrap());
                    }
                }
                if key == "k3" && !failed_once.swap(true, Ordering::SeqCst) {
                    return Err("k3's downstream refused the write".into());
                }
                Ok(())
            }
        })
    };
    let running = one.start(
        Settings {
            max_batch_size: 40,
            ..settings()
        },
        handler,
    );
    let last = one.at.last().unwrap();
    one.wait_for_checkpoint("the checkpoint to reach the last record", last)
        .await;
    running.stop().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), KEYS, "{seen:?}");
    let in_order: Vec<usize> = (0..PER_KEY).collect();
    for (key, got) in &seen {
        if key == "k3" {
            // Its failed call is delivered again: a repeat of a run already seen, then on.
            let mut firsts = got.clone();
            firsts.dedup_by(|b, a| b <= a);
            assert_eq!(firsts, in_order, "{key} out of order: {got:?}");
            assert!(got.len() > PER_KEY, "k3's failed call was not retried");
        } else {
            assert_eq!(got, &in_order, "{key} out of order, lost or repeated");
        }
    }
    let most = most.load(Ordering::SeqCst);
    assert!((2..=4).contains(&most), "{most} calls at once");
}

/// The checkpoint rule within a batch: while one key's call still runs, the checkpoint moves
/// to the last record before that key's oldest record (the done prefix), not further, so a
/// crash then re-delivers only what is not done before it; the batch's end follows once the
/// slow key is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_moves_to_the_record_before_the_oldest_not_done_while_a_key_runs() {
    // a a a slow c c c: the prefix stops before `slow` until it is done.
    let keys = ["a", "a", "a", "slow", "c", "c", "c"];
    let one = OnePartition::new(keys.map(|k| (k.to_string(), "x".to_string()))).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let release = release.clone();
        handler_fn(move |_ctx, batch| {
            let release = release.clone();
            async move {
                if batch.records.first().is_some_and(|r| r.key == "slow") {
                    release.notified().await;
                }
                Ok(())
            }
        })
    };
    let running = one.start(settings(), handler);
    one.wait_for_checkpoint(
        "the checkpoint at the record before the slow key's",
        &one.at[2],
    )
    .await;
    // It cannot pass the slow key's record while that call runs (c's records, done, wait
    // behind it): only the batch's end moves it on.
    release.notify_one();
    one.wait_for_checkpoint("the checkpoint at the batch's last record", &one.at[6])
        .await;
    running.stop().await.unwrap();
}
