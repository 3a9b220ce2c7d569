//! The processor's fleet scenarios with leases in DynamoDB Local, every one of them, on real
//! time (paused time cannot wait on a socket: see `changefeed::testkit::fleet::Timing`).

use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::testkit::fleet::{self, FaultMode, StoreFactory, Timing};
use changefeed_dynamodb::DynamoLeaseStore;

use crate::fresh_store;

/// Twice as fast as written (10 s expiry becomes 5 s); the tight bounds get 5 s more.
/// DynamoDB Local answers in 10 to 15 ms a call, every call in sequence within a host: the
/// first host takes 200 leases one after the other, and the 11-host arrival settles within
/// 5 to 6 s of real time here, against 3.1 s written.
const TIMING: Timing = Timing::Real {
    speedup: 2,
    allowance: Duration::from_secs(5),
};

/// A fresh table; each host gets a handle of its own (its own cache of the rows it saw, as a
/// separate process would have) on one shared client.
async fn dynamodb() -> StoreFactory {
    let store = fresh_store("fleet").await;
    let (client, table) = (store.client().clone(), store.table().to_string());
    Arc::new(move || {
        Arc::new(DynamoLeaseStore::new(client.clone(), table.clone())) as Arc<dyn LeaseStore>
    })
}

/// 44 leases, four per host at 11 hosts: each move costs DynamoDB Local a few calls, one host's
/// in sequence, and 200 leases (the paused-time count) overran the window while the rest of
/// the test command loaded the 2-core machine (52 of 200 still free after the first window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_arriving_rebalance_within_two_cycles() {
    fleet::scenario_rebalance_on_arrivals(dynamodb().await, 44, TIMING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_hosts_leases_are_taken_in_one_cycle() {
    fleet::scenario_killed_host_leases_taken_in_one_cycle(
        dynamodb().await,
        [600_000, -600_000, 0],
        TIMING,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_whose_store_calls_hang_fences_before_takeover() {
    fleet::scenario_cut_off_host_fences_before_takeover(dynamodb().await, FaultMode::Hang, TIMING)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_blind_to_a_handoff_request_stops_before_the_steal() {
    fleet::scenario_owner_blind_to_request_stops_before_steal(dynamodb().await, TIMING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_releases_and_restart_resumes_exactly() {
    fleet::scenario_graceful_stop_and_resume(dynamodb().await, TIMING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_process_with_same_name_is_refused() {
    fleet::scenario_duplicate_host_refused_restart_takes_back(dynamodb().await, TIMING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newcomer_after_a_crash_moves_only_its_share() {
    fleet::scenario_newcomer_after_crash_moves_only_its_share(dynamodb().await, TIMING).await;
}
