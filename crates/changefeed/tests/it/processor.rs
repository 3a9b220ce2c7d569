//! The fleet scenarios on the in-memory store, on paused time (every backend runs the same
//! scenarios with its own store: see `changefeed::testkit::fleet`).

use std::sync::Arc;

use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::testkit::fleet::{self, FaultMode, StoreFactory, Timing};

fn memory() -> StoreFactory {
    let store = MemoryLeaseStore::new();
    Arc::new(move || Arc::new(store.clone()) as Arc<dyn LeaseStore>)
}

#[tokio::test(start_paused = true)]
async fn arrivals_rebalance_within_two_cycles_without_duplicates() {
    fleet::scenario_rebalance_on_arrivals(memory(), 200, Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn killed_hosts_leases_are_taken_in_one_cycle() {
    fleet::scenario_killed_host_leases_taken_in_one_cycle(memory(), [0, 0, 0], Timing::Paused)
        .await;
}

#[tokio::test(start_paused = true)]
async fn wall_clock_skew_of_ten_minutes_changes_nothing() {
    // Rule 2: no clock agreement needed.
    fleet::scenario_killed_host_leases_taken_in_one_cycle(
        memory(),
        [600_000, -600_000, 0],
        Timing::Paused,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn host_whose_store_calls_fail_fences_before_takeover() {
    fleet::scenario_cut_off_host_fences_before_takeover(memory(), FaultMode::Fail, Timing::Paused)
        .await;
}

#[tokio::test(start_paused = true)]
async fn host_whose_store_calls_hang_fences_before_takeover() {
    fleet::scenario_cut_off_host_fences_before_takeover(memory(), FaultMode::Hang, Timing::Paused)
        .await;
}

#[tokio::test(start_paused = true)]
async fn owner_blind_to_a_handoff_request_stops_before_the_steal() {
    fleet::scenario_owner_blind_to_request_stops_before_steal(memory(), Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn graceful_stop_releases_and_restart_resumes_exactly() {
    fleet::scenario_graceful_stop_and_resume(memory(), Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn second_process_with_same_name_is_refused() {
    fleet::scenario_duplicate_host_refused_restart_takes_back(memory(), Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn newcomer_after_a_crash_moves_only_its_share() {
    fleet::scenario_newcomer_after_crash_moves_only_its_share(memory(), Timing::Paused).await;
}
