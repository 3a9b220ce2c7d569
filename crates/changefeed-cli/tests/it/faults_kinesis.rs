//! Socket faults between real `changefeed run` hosts and their Kinesis source (kinesis-mock,
//! each host through a `FaultProxy` of its own) while their lease store (a SQLite file) is
//! fine: one host's source black-holed past the lease expiry, healed forgetting its held
//! flows, then reset; then every host's source black-holed at once and healed. The hosts keep
//! heartbeating and their leases throughout, and read again soon after the path is back. See
//! `fault_fleet.rs` for what is checked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::testkit::net::FaultProxy;
use changefeed_kinesis::{AwsOptions, KinesisFeed, Timeouts};
use changefeed_sqlite::SqliteLeaseStore;

use crate::fault_fleet::{black_hole_scenarios, host_port, Cut, FaultFleet, RENEW_INTERVAL};

const SHARDS: i32 = 4;
const KEYS: usize = 8;

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_KINESIS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_KINESIS_URL is not set: start kinesis-mock with \
             `eval \"$(bash .ci/aws-services.sh)\"` (or run `bash .ci/run`)"
        )
    })
}

/// Puts records round-robin over `KEYS` keys, one every 20 ms, until `stop`; returns how many
/// records each key got.
async fn kinesis_writer(feed: KinesisFeed, stop: Arc<AtomicBool>) -> HashMap<String, i64> {
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let key = format!("k{}", i % KEYS);
        let seq = *next.get(&key).unwrap_or(&0);
        feed.put(&key, seq.to_string().into_bytes(), None)
            .await
            .expect("put");
        next.insert(key, seq + 1);
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    next
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_whose_kinesis_source_is_cut_keep_their_leases_and_read_again_within_the_stated_bound(
) {
    let endpoint = endpoint();
    let stream = format!(
        "faults-{}-{}",
        std::process::id(),
        crate::fault_fleet::now_ns()
    );
    let direct = KinesisFeed::connect(&AwsOptions::local(&endpoint), &stream).await;
    direct
        .create_stream(SHARDS)
        .await
        .unwrap_or_else(|e| panic!("cannot create a stream on kinesis-mock at {endpoint}: {e}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let db = dir.path().join("leases.db");
    let store = SqliteLeaseStore::open(&db).await.expect("the lease store");
    let store_url = format!("sqlite://{}", db.display());
    let mut f = FaultFleet::new("faults_kinesis", Arc::new(store));
    let stop = Arc::new(AtomicBool::new(false));
    let writing = tokio::spawn(kinesis_writer(direct.clone(), stop.clone()));
    for h in ["h1", "h2", "h3"] {
        let proxy = FaultProxy::start(host_port(&endpoint))
            .await
            .expect("proxy");
        let source = format!(
            "kinesis://{stream}?endpoint=http://127.0.0.1:{}&region=us-east-1",
            proxy.port()
        );
        f.proxies.insert(h.to_string(), proxy);
        f.start(h, &store_url, &source);
    }
    f.settled(SHARDS as usize, "3 hosts share the 4 leases")
        .await;

    let t = Timeouts::KINESIS;
    // A read in flight when the path comes back may be on a connection the fault left dead:
    // it is abandoned after `request`, and sent again on a new connection; a worker whose
    // reads failed waits out its back-off (the processor's max_backoff, 10 s) first.
    let read_bound = t.request + t.max_backoff + t.connect + Duration::from_secs(10);
    black_hole_scenarios(
        &mut f,
        SHARDS as usize,
        Cut::Source,
        RENEW_INTERVAL + t.connect,
        Duration::ZERO,
        read_bound,
    )
    .await;

    stop.store(true, Ordering::SeqCst);
    let written = writing.await.expect("writer");
    f.all_delivered(&written).await;
    f.stop_all().await;
    f.check_ledger(&written);
}
