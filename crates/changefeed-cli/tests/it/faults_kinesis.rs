//! Socket faults between real `changefeed run` hosts and their Kinesis source (kinesis-mock,
//! each host through a fault proxy of its own) while their lease store (PostgreSQL) is fine,
//! with the quick timings of `changefeed-bench faults --source kinesis --quick`, whose
//! scenarios these are: one host's source black-holed past the lease expiry, healed
//! forgetting its held flows, and every connection of its path reset half a second later;
//! every host's source black-holed at once and healed. The hosts keep heartbeating and their
//! leases throughout, release none, and read again soon after the path is back. See
//! `faults.rs` for what each checks.

use std::time::Duration;

use changefeed_bench::faults::{Scenario, SourceBackend, StoreBackend, Timings};
use changefeed_kinesis::Timeouts;

use crate::faults::{check, Bounds, SLACK};

const SERVERS: &str = "start kinesis-mock with `eval \"$(bash .ci/aws-services.sh)\"` and \
                       PostgreSQL (the lease store) with `bash .ci/run`";

/// The processor's `max_backoff` (not a flag of `changefeed run`): the longest a worker whose
/// reads failed waits before reading again.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_KINESIS_URL")
        .unwrap_or_else(|_| panic!("CHANGEFEED_TEST_KINESIS_URL is not set: {SERVERS}"))
}

/// The store is fine, so a heartbeat comes within a renew interval (and PostgreSQL's 3 s
/// connect timeout, as in `faults.rs`). A read in flight when the path comes back may be on a
/// flow the fault left dead: it is abandoned after one attempt's request timeout and sent
/// again on a new connection, after the worker's back-off (at most `MAX_BACKOFF`).
fn bounds() -> Bounds {
    let t = Timings::quick();
    let source = Timeouts::KINESIS;
    Bounds {
        heartbeat: t.renew_interval + Duration::from_secs(3) + SLACK,
        recovery: source.request + MAX_BACKOFF + source.connect + t.handler_delay + SLACK,
    }
}

async fn scenario(scenario: Scenario) {
    check(
        StoreBackend::Postgres,
        SourceBackend::Kinesis(endpoint()),
        scenario,
        bounds(),
        SERVERS,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_source_is_cut_then_reset_keeps_its_leases_and_reads_again() {
    scenario(Scenario::SourceCutThenReset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_whose_source_is_cut_at_once_keeps_its_leases_and_reads_again() {
    scenario(Scenario::SourceCutAll).await;
}
