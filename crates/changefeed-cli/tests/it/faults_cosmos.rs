//! Socket faults between real `changefeed run` hosts and their Cosmos DB lease store (the
//! local Cosmos DB server, each host through a `FaultProxy` of its own; the feed is a SQLite
//! file): one host black-holed past the lease expiry, healed forgetting its held flows, then
//! reset; then every host black-holed at once and healed. See `fault_fleet.rs` for what is
//! checked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::testkit::net::FaultProxy;
use changefeed_cosmos::{CosmosLeaseStore, CosmosOptions, DEFAULT_CONNECT_TIMEOUT};

use crate::fault_fleet::{
    black_hole_scenarios, host_port, Cut, FaultFleet, ACQUIRE_INTERVAL, LEASE_EXPIRY,
    RENEW_INTERVAL,
};
use crate::faults_dynamodb::{sqlite_feed, sqlite_writer};

const PARTITIONS: u32 = 6;

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_COSMOS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_COSMOS_URL is not set: start the local Cosmos DB server with \
             `eval \"$(bash .ci/cosmos-server.sh)\"` (or run `bash .ci/run`)"
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cosmos_hosts_cut_off_by_black_holes_and_resets_recover_within_the_stated_bounds() {
    let endpoint = endpoint();
    let container = format!(
        "faults-{}-{}",
        std::process::id(),
        crate::fault_fleet::now_ns()
    );
    let direct =
        CosmosLeaseStore::connect(&CosmosOptions::new(&endpoint, "changefeed-cli", &container))
            .await
            .unwrap_or_else(|e| {
                panic!("cannot reach the local Cosmos DB server at {endpoint}: {e}")
            });
    let mut f = FaultFleet::new("faults_cosmos", Arc::new(direct));
    let (source, db) = sqlite_feed(f.dir(), PARTITIONS).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writing = tokio::spawn(sqlite_writer(db, PARTITIONS, stop.clone()));
    for h in ["h1", "h2", "h3"] {
        let proxy = FaultProxy::start(host_port(&endpoint))
            .await
            .expect("proxy");
        let store = format!(
            "cosmos://local/changefeed-cli/{container}?endpoint=http://127.0.0.1:{}",
            proxy.port()
        );
        f.proxies.insert(h.to_string(), proxy);
        f.start(h, &store, &source);
    }
    f.settled(PARTITIONS as usize, "3 hosts share the 6 leases")
        .await;

    let heartbeat_bound = RENEW_INTERVAL + DEFAULT_CONNECT_TIMEOUT;
    // As for DynamoDB (see there): a few acquire cycles after the heartbeat.
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
