use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;

use super::*;
use crate::model::Record;
use crate::processor::handler_fn;

/// One call the property test has in flight: its records.
type Call = Vec<usize>;

/// Drives a [`Dispatch`] with calls completing in an arbitrary order, some failing, checking
/// after every step the order and checkpoint rules. Returns the records delivered by calls
/// that succeeded, in completion order, and whether any call failed.
fn drive(
    keys: &[u8],
    already: &[bool],
    slots: usize,
    steps: &[(prop::sample::Index, bool)],
) -> (Vec<usize>, bool) {
    let names: Vec<String> = keys.iter().map(|k| format!("k{k}")).collect();
    let mut d = Dispatch::new(names.iter().map(String::as_str), already);
    let mut running: Vec<Call> = Vec::new();
    let mut delivered = Vec::new();
    let mut failed = false;
    let mut prefix = d.done_prefix();
    let mut step = steps.iter();
    loop {
        while running.len() < slots {
            let Some(call) = d.take() else { break };
            // A call holds one key's records not done yet, in batch order, and that key is in
            // no other call.
            assert!(!call.is_empty());
            assert!(
                call.windows(2).all(|w| w[0] < w[1]),
                "{call:?} out of order"
            );
            let key = keys[call[0]];
            assert!(call.iter().all(|&i| keys[i] == key && !d.done()[i]));
            assert!(running.iter().all(|c| keys[c[0]] != key), "key {key} twice");
            running.push(call);
        }
        if running.is_empty() {
            break;
        }
        let (pick, fail) = step
            .next()
            .map_or((0, false), |(i, f)| (i.index(running.len()), *f));
        let call = running.remove(pick);
        if fail {
            failed = true;
        } else {
            d.complete(&call);
            delivered.extend(call);
        }
        // The checkpoint rule: everything before the prefix is done, the record at it is not,
        // and the prefix never moves back.
        let p = d.done_prefix();
        assert!(
            p >= prefix,
            "the done prefix moved back from {prefix} to {p}"
        );
        assert!(d.done()[..p].iter().all(|&x| x));
        assert!(p == keys.len() || !d.done()[p]);
        prefix = p;
    }
    (delivered, failed)
}

/// Records of `keys` in `delivered` order, grouped by key.
fn per_key(keys: &[u8], delivered: &[usize]) -> BTreeMap<u8, Vec<usize>> {
    let mut m: BTreeMap<u8, Vec<usize>> = BTreeMap::new();
    for &i in delivered {
        m.entry(keys[i]).or_default().push(i);
    }
    m
}

proptest! {
    /// Each key's records are delivered in batch order, each at most once per attempt; the
    /// done prefix (the checkpoint) never passes a record not yet done; a batch is finished
    /// exactly when no call failed; and its retry delivers exactly the records not done
    /// before, each key in order.
    #[test]
    fn dispatch_keeps_key_order_and_the_checkpoint_rule(
        keys in prop::collection::vec(0u8..6, 0..60),
        slots in 1usize..6,
        steps in prop::collection::vec((any::<prop::sample::Index>(), prop::bool::weighted(0.15)), 0..120),
    ) {
        let (delivered, failed) = drive(&keys, &[], slots, &steps);
        let unique: HashSet<usize> = delivered.iter().copied().collect();
        prop_assert_eq!(unique.len(), delivered.len(), "a record delivered twice");
        for (key, got) in per_key(&keys, &delivered) {
            prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "key {} out of order: {:?}", key, got);
        }
        // A failed call's records stay not done in that attempt; without a failure, all are.
        prop_assert_eq!(failed, unique.len() < keys.len());
        // The retry: only what is not done, each key in order, all of it.
        let done: Vec<bool> = (0..keys.len()).map(|i| unique.contains(&i)).collect();
        let (again, failed_again) = drive(&keys, &done, slots, &[]);
        prop_assert!(!failed_again);
        let mut all: Vec<usize> = delivered.iter().chain(&again).copied().collect();
        all.sort_unstable();
        prop_assert_eq!(all, (0..keys.len()).collect::<Vec<_>>());
        prop_assert!(again.iter().all(|i| !unique.contains(i)));
        for (key, got) in per_key(&keys, &again) {
            prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "key {} out of order on retry", key);
        }
    }
}

fn batch(keys: &[&str]) -> Arc<Batch> {
    Arc::new(Batch {
        records: keys
            .iter()
            .enumerate()
            .map(|(i, k)| Record {
                key: (*k).to_string(),
                data: Bytes::from(i.to_string()),
                continuation: Continuation::new(i.to_string()),
                timestamp: None,
            })
            .collect(),
        continuation: Some(Continuation::new("end")),
        end_of_partition: false,
    })
}

/// Seen by the handler: the payloads of each call, and the most calls at once.
#[derive(Default)]
struct Seen {
    calls: Mutex<Vec<Vec<String>>>,
    running: AtomicUsize,
    most: AtomicUsize,
}

/// A handler taking `cost(key)` of (virtual) time per record and failing the first call of
/// key `fail_once`, if any.
fn recording(
    seen: Arc<Seen>,
    cost: fn(&str) -> Duration,
    fail_once: Option<&'static str>,
) -> Arc<dyn Handler> {
    let failed = Arc::new(Mutex::new(false));
    Arc::new(handler_fn(move |_ctx, sub: Arc<Batch>| {
        let seen = seen.clone();
        let failed = failed.clone();
        async move {
            let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
            seen.most.fetch_max(now, Ordering::SeqCst);
            let key = sub
                .records
                .first()
                .map(|r| r.key.clone())
                .unwrap_or_default();
            for _ in &sub.records {
                tokio::time::sleep(cost(&key)).await;
            }
            seen.running.fetch_sub(1, Ordering::SeqCst);
            let payloads = sub
                .records
                .iter()
                .map(|r| String::from_utf8_lossy(&r.data).into_owned())
                .collect();
            seen.calls.lock().expect("no panic holds it").push(payloads);
            let mut once = failed.lock().expect("no panic holds it");
            if fail_once == Some(key.as_str()) && !*once {
                *once = true;
                return Err(format!("key {key} failed").into());
            }
            Ok(())
        }
    }))
}

fn slots(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).expect("a positive slot count")
}

/// A slow key holds one slot only: the other keys finish through the other slots, never more
/// than N calls run at once, and the batch takes as long as its slowest key.
#[tokio::test(start_paused = true)]
async fn a_slow_key_holds_one_slot_and_the_others_go_on() {
    let seen = Arc::new(Seen::default());
    let cost = |key: &str| {
        if key == "slow" {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(10)
        }
    };
    let handler = KeyParallel::new(recording(seen.clone(), cost, None), slots(3));
    let keys = ["slow", "a", "b", "slow", "c", "d", "a", "e", "f", "b"];
    let started = tokio::time::Instant::now();
    handler
        .handle_shared(&Context::detached("0"), batch(&keys))
        .await
        .expect("every key succeeds");
    // Two slow records in a row: 200 ms; the eight others share two slots: 40 ms.
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    assert_eq!(seen.most.load(Ordering::SeqCst), 3);
    let calls = seen.calls.lock().expect("no panic holds it").clone();
    assert!(calls.contains(&vec!["0".to_string(), "3".to_string()]));
    assert!(calls.contains(&vec!["1".to_string(), "6".to_string()]));
    assert_eq!(calls.iter().map(Vec::len).sum::<usize>(), keys.len());
}

/// A failed key fails the batch without stopping the other keys, and the retry of the same
/// batch calls only the failed key's records.
#[tokio::test(start_paused = true)]
async fn a_retry_calls_only_the_keys_not_done() {
    let seen = Arc::new(Seen::default());
    let handler = KeyParallel::new(
        recording(seen.clone(), |_| Duration::from_millis(1), Some("b")),
        slots(2),
    );
    let ctx = Context::detached("0");
    let keys = ["a", "b", "c", "b", "a"];
    let err = handler
        .handle_shared(&ctx, batch(&keys))
        .await
        .expect_err("key b fails once");
    assert_eq!(err.to_string(), "key b failed");
    assert_eq!(seen.calls.lock().expect("no panic holds it").len(), 3);
    seen.calls.lock().expect("no panic holds it").clear();
    handler
        .handle_shared(&ctx, batch(&keys))
        .await
        .expect("the retry succeeds");
    let calls = seen.calls.lock().expect("no panic holds it").clone();
    assert_eq!(calls, vec![vec!["1".to_string(), "3".to_string()]]);
    // Once the batch succeeded nothing is remembered: delivered again, it is called in full.
    seen.calls.lock().expect("no panic holds it").clear();
    handler
        .handle_shared(&ctx, batch(&keys))
        .await
        .expect("a new delivery succeeds");
    assert_eq!(seen.calls.lock().expect("no panic holds it").len(), 3);
}

/// An idle tick (an empty batch) reaches the wrapped handler unchanged.
#[tokio::test]
async fn an_idle_tick_passes_through() {
    let seen = Arc::new(Seen::default());
    let handler = KeyParallel::new(recording(seen.clone(), |_| Duration::ZERO, None), slots(4));
    handler
        .handle_shared(&Context::detached("0"), batch(&[]))
        .await
        .expect("an idle tick succeeds");
    assert_eq!(
        *seen.calls.lock().expect("no panic holds it"),
        vec![Vec::<String>::new()]
    );
}

/// A builder with everything but the key concurrency under test.
fn builder() -> crate::processor::ProcessorBuilder {
    crate::processor::Processor::builder()
        .host("a")
        .group("g")
        .store(Arc::new(crate::lease::MemoryLeaseStore::new()))
        .source(Arc::new(crate::source::MemoryFeed::new(1)))
        .handler(handler_fn(|_, _| async { Ok(()) }))
}

/// `key_concurrency` 0, above the limit, or with manual checkpoints is refused, naming the
/// setting; 1 and 16 build.
#[test]
fn key_concurrency_is_validated_naming_the_setting() {
    for (n, mode, needle) in [
        (0, CheckpointMode::EveryBatch, "at least 1"),
        (MAX_KEY_CONCURRENCY + 1, CheckpointMode::EveryBatch, "limit"),
        (4, CheckpointMode::Manual, "checkpoint_mode"),
    ] {
        let err = builder()
            .checkpoint_mode(mode)
            .key_concurrency(n)
            .build()
            .expect_err("refused");
        assert!(
            matches!(&err, ConfigError::Invalid { setting: "key_concurrency", rule } if rule.contains(needle)),
            "{err}"
        );
        assert!(err.to_string().starts_with("key_concurrency: "), "{err}");
    }
    for n in [1, 16] {
        assert!(builder().key_concurrency(n).build().is_ok());
    }
    assert!(builder()
        .checkpoint_mode(CheckpointMode::Manual)
        .key_concurrency(1)
        .build()
        .is_ok());
}
