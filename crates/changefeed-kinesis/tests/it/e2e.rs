//! End to end: a fleet on the DynamoDB lease store reads a Kinesis stream through a split, a
//! merge and a host crash, and a ledger proves nothing was lost or reordered.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use changefeed::model::{Batch, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor, ProcessorHandle, Settings};
use changefeed::source::FeedSource;
use changefeed_dynamodb::{AwsOptions as DynamoOptions, DynamoLeaseStore};
use changefeed_kinesis::Retrieval;

use crate::fresh_feed;

/// Every delivery, in the order handlers saw them: (host, shard, key, n).
type Ledger = Arc<Mutex<Vec<(String, String, String, u64)>>>;

#[derive(Debug)]
struct Recorder(Ledger);

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let mut ledger = self.0.lock().expect("ledger lock");
        for r in &batch.records {
            let text = String::from_utf8_lossy(&r.data).into_owned();
            let n = text
                .rsplit_once('#')
                .and_then(|(_, n)| n.parse().ok())
                .unwrap_or(u64::MAX);
            ledger.push((
                ctx.host().to_string(),
                ctx.partition().to_string(),
                r.key.clone(),
                n,
            ));
        }
        Ok(())
    }
}

fn dynamodb_endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with `bash .ci/run` \
             (or `eval \"$(bash .ci/aws-services.sh)\"`)"
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleet_reads_through_split_merge_and_a_crash_without_loss_or_reordering() {
    // DESIGN.md rules 4 and 5: every record at least once, in order per key, parents first.
    fleet_through_split_merge_and_crash(Retrieval::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fan_out_fleet_reads_through_split_merge_and_a_crash_without_loss_or_reordering() {
    // The same with enhanced fan-out: a killed host's shards are subscribed to by the hosts
    // that take them over, children after their parents, nothing lost or reordered.
    fleet_through_split_merge_and_crash(Retrieval::FanOut {
        consumer_name: crate::fresh_stream("e2e-consumer"),
    })
    .await;
}

async fn fleet_through_split_merge_and_crash(retrieval: Retrieval) {
    let feed = fresh_feed("e2e", 4).await.with_retrieval(retrieval);
    let table = crate::fresh_stream("e2e-leases");
    let store = DynamoLeaseStore::connect(&DynamoOptions::local(dynamodb_endpoint()), table)
        .await
        .expect("DynamoDB Local reachable");
    let settings = Settings {
        start_position: Position::Beginning,
        lease_expiry: Duration::from_secs(4),
        renew_interval: Duration::from_millis(1000),
        safety_margin: Duration::from_millis(1500),
        acquire_interval: Duration::from_millis(500),
        sync_interval: Duration::from_secs(1),
        poll_delay: Duration::from_millis(250),
        handoff_timeout: Duration::from_secs(3),
        cleanup_delay: Duration::from_secs(1),
        shutdown_timeout: Duration::from_secs(2),
        ..Settings::default()
    };
    let ledger: Ledger = Arc::default();
    let start = |h: u32| -> ProcessorHandle {
        Processor::builder()
            .host(format!("host-{h}"))
            .group("e2e")
            .store(Arc::new(store.clone()))
            .source(Arc::new(feed.clone()))
            .handler(Recorder(ledger.clone()))
            .settings(settings.clone())
            .seed(u64::from(h))
            .build()
            .expect("valid settings")
            .start()
    };
    let keys: Vec<String> = (0..24).map(|k| format!("key-{k}")).collect();
    let mut written: BTreeMap<String, u64> = BTreeMap::new();
    let write = |round: usize, written: &mut BTreeMap<String, u64>| {
        let feed = feed.clone();
        let mut plan = Vec::new();
        for k in &keys {
            let n = written.entry(k.clone()).or_default();
            for _ in 0..round {
                plan.push((k.clone(), *n));
                *n += 1;
            }
        }
        async move {
            for (k, n) in plan {
                feed.put(&k, format!("{k}#{n}").into_bytes(), None)
                    .await
                    .expect("put record");
            }
        }
    };
    write(3, &mut written).await;
    let mut hosts: Vec<Option<ProcessorHandle>> = (0..3).map(|h| Some(start(h))).collect();
    let delivered = |ledger: &Ledger| ledger.lock().expect("ledger").len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while delivered(&ledger) < keys.len() * 3 {
        assert!(
            Instant::now() < deadline,
            "the fleet did not start delivering"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let shards = feed.partitions().await.expect("partitions");
    let mut open: Vec<_> = shards.into_iter().filter(|p| !p.closed).collect();
    open.sort_by_key(|p| p.key_range.map(|r| r.start));
    feed.split(&open[0].id).await.expect("SplitShard");
    write(2, &mut written).await;
    feed.merge(&open[2].id, &open[3].id)
        .await
        .expect("MergeShards");
    write(2, &mut written).await;
    if let Some(h) = hosts[0].take() {
        h.kill();
    }
    write(2, &mut written).await;

    let expected: BTreeSet<(String, u64)> = written
        .iter()
        .flat_map(|(k, n)| (0..*n).map(move |i| (k.clone(), i)))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let got: BTreeSet<(String, u64)> = ledger
            .lock()
            .expect("ledger")
            .iter()
            .map(|(_, _, k, n)| (k.clone(), *n))
            .collect();
        let missing: Vec<_> = expected.difference(&got).take(5).collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "records never delivered (first 5): {missing:?}; {} of {} delivered",
            got.len(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for h in hosts.into_iter().flatten() {
        h.stop().await.expect("graceful stop");
    }
    // Per key, first deliveries come in write order: across the split and the merge, the
    // parent's records of a key were all delivered before the child's.
    let ledger = ledger.lock().expect("ledger");
    let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
    let mut first: BTreeSet<(&str, u64)> = BTreeSet::new();
    for (host, shard, key, n) in ledger.iter() {
        if !first.insert((key.as_str(), *n)) {
            continue; // a redelivery after the crash: allowed (at least once)
        }
        let next = seen.entry(key.as_str()).or_default();
        assert_eq!(
            *n, *next,
            "key {key}: record {n} first delivered (by {host} from {shard}) before record {next}"
        );
        *next += 1;
    }
    let shards_used: BTreeSet<&str> = ledger.iter().map(|(_, s, _, _)| s.as_str()).collect();
    assert!(
        shards_used.len() >= 7,
        "parents and children were all read: {shards_used:?}"
    );
}
