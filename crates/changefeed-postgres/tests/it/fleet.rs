//! The processor's fleet scenarios with leases in PostgreSQL, every one of them, on real time.
//!
//! The core runs these on paused tokio time. With a real server that cannot work: while a
//! host waits on a socket the runtime is idle, so paused time auto-advances and every timer
//! (lease expiry, the client-side timeout) fires at once. Tried: under
//! `#[tokio::test(start_paused = true)]` even connecting fails, with
//! `Pool(Timeout(Create))` after 0.15 s of real time, because the pool's 7 s create timeout
//! elapses in virtual time while the TCP handshake is in flight. So they run on real time
//! ([`Timing::Real`]), faster than written, each tight bound widened for round trips.

use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::testkit::fleet::{self, FaultMode, StoreFactory, Timing};
use changefeed_postgres::PostgresLeaseStore;

use crate::common::Prefixes;

/// Three times faster than written (10 s expiry becomes 3.3 s); the tight bounds get 2 s
/// more of real time, which the 11-host arrival over 200 leases needs on two busy cores (it
/// settled in up to 2.8 s of real time here, against 2.1 s written).
const TIMING: Timing = Timing::Real {
    speedup: 3,
    allowance: Duration::from_secs(2),
};

/// One pool of 16 connections on fresh tables, shared by every host.
async fn postgres(prefixes: &Prefixes) -> StoreFactory {
    let prefix = prefixes.fresh();
    let store = PostgresLeaseStore::connect_with(prefixes.options(&prefix).pool_size(16))
        .await
        .unwrap();
    Arc::new(move || Arc::new(store.clone()) as Arc<dyn LeaseStore>)
}

/// 44 leases, four per host at 11 hosts: with 200 (the paused-time count) the first host's
/// takes, one round trip after another, overran the sped-up window on a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_arriving_rebalance_within_two_cycles() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_rebalance_on_arrivals(postgres(&prefixes).await, 44, TIMING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_hosts_leases_are_taken_in_one_cycle() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_killed_host_leases_taken_in_one_cycle(
        postgres(&prefixes).await,
        [0, 0, 0],
        TIMING,
    )
    .await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_whose_store_calls_fail_fences_before_takeover() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_cut_off_host_fences_before_takeover(
        postgres(&prefixes).await,
        FaultMode::Fail,
        TIMING,
    )
    .await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_blind_to_a_handoff_request_stops_before_the_steal() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_owner_blind_to_request_stops_before_steal(postgres(&prefixes).await, TIMING)
        .await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_releases_and_restart_resumes_exactly() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_graceful_stop_and_resume(postgres(&prefixes).await, TIMING).await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_process_with_same_name_is_refused() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_duplicate_host_refused_restart_takes_back(postgres(&prefixes).await, TIMING)
        .await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newcomer_after_a_crash_moves_only_its_share() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_newcomer_after_crash_moves_only_its_share(postgres(&prefixes).await, TIMING)
        .await;
    prefixes.cleanup().await;
}
