//! Socket faults between real `changefeed run` hosts and their Cosmos DB lease store (the
//! local Cosmos DB server, each host through a fault proxy of its own; the source a PostgreSQL
//! outbox), with the quick timings of `changefeed-bench faults --backend cosmos --quick`,
//! whose scenarios these are: one host black-holed past the lease expiry, healed forgetting
//! its held flows, and every connection of its path reset half a second later; every host
//! black-holed at once and healed. See `faults.rs` for what each checks.

use changefeed_bench::faults::{Scenario, SourceBackend, StoreBackend, Timings};
use changefeed_cosmos::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT};

use crate::faults::{check, Bounds, SLACK};

const SERVERS: &str = "start the local Cosmos DB server with \
                       `eval \"$(bash .ci/cosmos-server.sh)\"` and PostgreSQL (the source) with \
                       `bash .ci/run`";

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_COSMOS_URL")
        .unwrap_or_else(|_| panic!("CHANGEFEED_TEST_COSMOS_URL is not set: {SERVERS}"))
}

/// As for DynamoDB (see `faults_dynamodb.rs`), with the Cosmos DB client's request and connect
/// timeouts.
fn bounds() -> Bounds {
    let t = Timings::quick();
    let heartbeat = t.renew_interval + DEFAULT_REQUEST_TIMEOUT + DEFAULT_CONNECT_TIMEOUT;
    Bounds {
        heartbeat: heartbeat + SLACK,
        recovery: heartbeat + t.lease_expiry + 3 * t.acquire_interval + t.handler_delay + SLACK,
    }
}

async fn scenario(scenario: Scenario) {
    check(
        StoreBackend::Cosmos(endpoint()),
        SourceBackend::Outbox,
        scenario,
        bounds(),
        SERVERS,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_black_holed_then_reset_after_the_heal_leases_again() {
    scenario(Scenario::CutThenReset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_black_holed_at_once_resumes_by_itself() {
    scenario(Scenario::CutAll).await;
}
