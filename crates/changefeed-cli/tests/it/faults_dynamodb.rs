//! Socket faults between real `changefeed run` hosts and their DynamoDB lease store (DynamoDB
//! Local, each host through a `FaultProxy` of its own; the feed is a SQLite file): one host
//! black-holed past the lease expiry, healed forgetting its held flows, then reset; then every
//! host black-holed at once and healed. See `fault_fleet.rs` for what is checked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::model::PartitionId;
use changefeed::testkit::net::FaultProxy;
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore, Timeouts};
use changefeed_sqlite::SqliteFeed;

use crate::fault_fleet::{
    black_hole_scenarios, host_port, Cut, FaultFleet, ACQUIRE_INTERVAL, LEASE_EXPIRY,
    RENEW_INTERVAL,
};

const PARTITIONS: u32 = 6;

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with \
             `eval \"$(bash .ci/aws-services.sh)\"` (or run `bash .ci/run`)"
        )
    })
}

/// Appends to each partition of the SQLite feed at `db` in turn, two keys a partition, one
/// record every 20 ms, until `stop`; returns how many records each key got.
pub(crate) async fn sqlite_writer(
    db: std::path::PathBuf,
    partitions: u32,
    stop: Arc<AtomicBool>,
) -> HashMap<String, i64> {
    let feed = SqliteFeed::open(&db).await.expect("open the feed");
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut i = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let p = i % partitions;
        let key = format!("p{p}-k{}", (i / partitions) % 2);
        let seq = *next.get(&key).unwrap_or(&0);
        feed.append_to(
            &PartitionId::new(p.to_string()).expect("id"),
            &key,
            seq.to_string(),
        )
        .await
        .expect("append");
        next.insert(key, seq + 1);
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    next
}

/// A SQLite feed of `partitions` partitions in `dir`; its URL and path.
pub(crate) async fn sqlite_feed(
    dir: &std::path::Path,
    partitions: u32,
) -> (String, std::path::PathBuf) {
    let db = dir.join("feed.db");
    let feed = SqliteFeed::open(&db).await.expect("open the feed");
    feed.create_partitions(partitions)
        .await
        .expect("partitions");
    (format!("sqlite://{}", db.display()), db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_hosts_cut_off_by_black_holes_and_resets_recover_within_the_stated_bounds() {
    let endpoint = endpoint();
    let table = format!(
        "faults-{}-{}",
        std::process::id(),
        crate::fault_fleet::now_ns()
    );
    let direct = DynamoLeaseStore::connect(&AwsOptions::local(&endpoint), &table)
        .await
        .unwrap_or_else(|e| panic!("cannot reach DynamoDB Local at {endpoint}: {e}"));
    let mut f = FaultFleet::new("faults_dynamodb", Arc::new(direct));
    let (source, db) = sqlite_feed(f.dir(), PARTITIONS).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writing = tokio::spawn(sqlite_writer(db, PARTITIONS, stop.clone()));
    for h in ["h1", "h2", "h3"] {
        let proxy = FaultProxy::start(host_port(&endpoint))
            .await
            .expect("proxy");
        let store = format!(
            "dynamodb://{table}?endpoint=http://127.0.0.1:{}&region=us-east-1",
            proxy.port()
        );
        f.proxies.insert(h.to_string(), proxy);
        f.start(h, &store, &source);
    }
    f.settled(PARTITIONS as usize, "3 hosts share the 6 leases")
        .await;

    let t = Timeouts::DYNAMODB;
    let heartbeat_bound = RENEW_INTERVAL + t.connect;
    // A host judged dead comes back under a new incarnation, and takes nothing until the
    // view's leader lists it live (one of the leader's cycles) and a peer hands it a lease
    // (the owner's next cycle): a few acquire cycles after its heartbeat.
    let lease_bound = heartbeat_bound + LEASE_EXPIRY + 3 * ACQUIRE_INTERVAL;
    black_hole_scenarios(
        &mut f,
        PARTITIONS as usize,
        Cut::Store,
        heartbeat_bound,
        lease_bound,
        Duration::ZERO,
    )
    .await;

    stop.store(true, Ordering::SeqCst);
    let written = writing.await.expect("writer");
    f.all_delivered(&written).await;
    f.stop_all().await;
    f.check_ledger(&written);
}
