//! Socket faults between real `changefeed run` hosts and their DynamoDB lease store (DynamoDB
//! Local, each host through a fault proxy of its own; the source a PostgreSQL outbox), with
//! the quick timings of `changefeed-bench faults --backend dynamodb --quick`, whose scenarios
//! these are: one host black-holed past the lease expiry, healed forgetting its held flows,
//! and every connection of its path reset half a second later; every host black-holed at once
//! and healed. See `faults.rs` for what each checks.

use changefeed_bench::faults::{Scenario, SourceBackend, StoreBackend, Timings};
use changefeed_dynamodb::Timeouts;

use crate::faults::{check, Bounds, SLACK};

const SERVERS: &str = "start DynamoDB Local with `eval \"$(bash .ci/aws-services.sh)\"` and \
                       PostgreSQL (the source) with `bash .ci/run`";

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL")
        .unwrap_or_else(|_| panic!("CHANGEFEED_TEST_DYNAMODB_URL is not set: {SERVERS}"))
}

/// A heartbeat in flight on a flow the fault left dead is abandoned after one attempt's
/// request timeout and sent again on a new connection: the next counted heartbeat comes
/// within a renew interval, a request and a connect of the fault's end. A host judged dead
/// comes back under a new incarnation and takes nothing until the view's leader lists it live
/// and a peer hands it a lease (or, after a fleet-wide cut, the leases expire and are taken):
/// the lease expiry and a few acquire cycles after its heartbeat.
fn bounds() -> Bounds {
    let t = Timings::quick();
    let store = Timeouts::DYNAMODB;
    let heartbeat = t.renew_interval + store.request + store.connect;
    Bounds {
        heartbeat: heartbeat + SLACK,
        recovery: heartbeat + t.lease_expiry + 3 * t.acquire_interval + t.handler_delay + SLACK,
    }
}

async fn scenario(scenario: Scenario) {
    check(
        StoreBackend::Dynamodb(endpoint()),
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
