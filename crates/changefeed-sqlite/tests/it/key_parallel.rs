//! Key-parallel delivery on a real SQLite feed and lease store: with `key_concurrency(4)` one
//! partition's records run in up to four handler calls at once, each key's records in order,
//! nothing lost, and a key whose call fails is the only one delivered again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, LeaseKey, PartitionId};
use changefeed::processor::{handler_fn, Processor, Settings};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use super::dead_letter::{settings, wait_for};

const KEYS: usize = 8;
const PER_KEY: usize = 30;

/// Each key's records in order, none lost, at most four calls at once (and more than one),
/// the checkpoint at the last record; the one key whose first call fails is the only one
/// delivered twice. Rule 4 of DESIGN.md, kept per key when a partition runs key-parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_parallel_keeps_each_keys_order_on_sqlite_with_four_slots() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changefeed.db");
    let feed = SqliteFeed::open(&path).await.unwrap();
    feed.create_partitions(1).await.unwrap();
    let mut last = None;
    for seq in 0..PER_KEY {
        for k in 0..KEYS {
            let (_, c) = feed
                .append(&format!("k{k}"), format!("{seq}"))
                .await
                .unwrap();
            last = Some(c);
        }
    }
    let last = last.unwrap();
    let store = SqliteLeaseStore::open(&path).await.unwrap();

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
    let running = Processor::builder()
        .host("host-a")
        .group("orders")
        .settings(Settings {
            max_batch_size: 40,
            ..settings()
        })
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler)
        .key_concurrency(4)
        .build()
        .unwrap()
        .start();

    let key = LeaseKey::new(
        GroupName::new("orders").unwrap(),
        PartitionId::new("0").unwrap(),
    );
    wait_for(
        "the checkpoint to reach the last record",
        Duration::from_secs(30),
        || async {
            let at = store.get(&key).await.unwrap().and_then(|l| l.continuation);
            (at.as_ref() == Some(&last)).then_some(())
        },
    )
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
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changefeed.db");
    let feed = SqliteFeed::open(&path).await.unwrap();
    feed.create_partitions(1).await.unwrap();
    // a a a slow c c c: the prefix stops before `slow` until it is done.
    let mut at = Vec::new();
    for key in ["a", "a", "a", "slow", "c", "c", "c"] {
        at.push(feed.append(key, "x").await.unwrap().1);
    }
    let store = SqliteLeaseStore::open(&path).await.unwrap();
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
    let running = Processor::builder()
        .host("host-a")
        .group("orders")
        .settings(settings())
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler)
        .key_concurrency(4)
        .build()
        .unwrap()
        .start();
    let key = LeaseKey::new(
        GroupName::new("orders").unwrap(),
        PartitionId::new("0").unwrap(),
    );
    let checkpoint = || async { store.get(&key).await.unwrap().and_then(|l| l.continuation) };
    wait_for(
        "the checkpoint at the record before the slow key's",
        Duration::from_secs(30),
        || async { (checkpoint().await.as_ref() == Some(&at[2])).then_some(()) },
    )
    .await;
    // It cannot pass the slow key's record while that call runs (c's records, done, wait
    // behind it): only the batch's end moves it on.
    release.notify_one();
    wait_for(
        "the checkpoint at the batch's last record",
        Duration::from_secs(30),
        || async { (checkpoint().await.as_ref() == Some(&at[6])).then_some(()) },
    )
    .await;
    running.stop().await.unwrap();
}
