//! The processor's fleet scenarios on a real SQLite file, every one of them: several
//! processors in one test, each with its own connection, on paused time (SQLite's blocking
//! calls hold the paused clock until they return, so virtual time works here).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use changefeed::lease::LeaseStore;
use changefeed::testkit::fleet::{self, FaultMode, StoreFactory, Timing};
use changefeed_sqlite::SqliteLeaseStore;

/// A factory handing out connections to one temporary database file, round-robin.
async fn sqlite(dir: &tempfile::TempDir) -> StoreFactory {
    let path = dir.path().join("leases.db");
    let mut handles: Vec<Arc<dyn LeaseStore>> = Vec::new();
    for _ in 0..16 {
        handles.push(Arc::new(SqliteLeaseStore::open(&path).await.unwrap()));
    }
    let next = AtomicUsize::new(0);
    Arc::new(move || handles[next.fetch_add(1, Ordering::Relaxed) % handles.len()].clone())
}

#[tokio::test(start_paused = true)]
async fn sqlite_arrivals_rebalance_within_two_cycles_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_rebalance_on_arrivals(sqlite(&dir).await, 200, Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_killed_hosts_leases_are_taken_in_one_cycle() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_killed_host_leases_taken_in_one_cycle(
        sqlite(&dir).await,
        [600_000, -600_000, 0],
        Timing::Paused,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_cut_off_host_fences_before_takeover() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_cut_off_host_fences_before_takeover(
        sqlite(&dir).await,
        FaultMode::Hang,
        Timing::Paused,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_owner_blind_to_a_handoff_request_stops_before_the_steal() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_owner_blind_to_request_stops_before_steal(sqlite(&dir).await, Timing::Paused)
        .await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_graceful_stop_releases_and_restart_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_graceful_stop_and_resume(sqlite(&dir).await, Timing::Paused).await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_second_process_with_same_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_duplicate_host_refused_restart_takes_back(sqlite(&dir).await, Timing::Paused)
        .await;
}

#[tokio::test(start_paused = true)]
async fn sqlite_newcomer_after_a_crash_moves_only_its_share() {
    let dir = tempfile::tempdir().unwrap();
    fleet::scenario_newcomer_after_crash_moves_only_its_share(sqlite(&dir).await, Timing::Paused)
        .await;
}
