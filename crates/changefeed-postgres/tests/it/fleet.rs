//! Processor fleet scenarios with leases in PostgreSQL.
//!
//! The core runs these on paused tokio time. With a real server that cannot work: while a
//! host waits on a socket the runtime is idle, so paused time auto-advances and every timer
//! (lease expiry, the client-side timeout) fires at once. Tried: under
//! `#[tokio::test(start_paused = true)]` even connecting fails, with
//! `Pool(Timeout(Create))` after 0.15 s of real time, because the pool's 7 s create timeout
//! elapses in virtual time while the TCP handshake is in flight. So the scenarios whose
//! timing tolerates real time run here on real time (tens of seconds each); the others
//! (arrivals of 11 hosts, cut-off hosts) run on the in-memory store in the core.

use std::sync::Arc;

use changefeed::lease::LeaseStore;
use changefeed::testkit::fleet::{self, StoreFactory};
use changefeed_postgres::PostgresLeaseStore;

use crate::common::Prefixes;

async fn postgres(prefixes: &Prefixes) -> StoreFactory {
    let prefix = prefixes.fresh();
    let store = PostgresLeaseStore::connect_with(prefixes.options(&prefix).pool_size(16))
        .await
        .unwrap();
    Arc::new(move || Arc::new(store.clone()) as Arc<dyn LeaseStore>)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_time_killed_hosts_leases_are_taken_in_one_cycle() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_killed_host_leases_taken_in_one_cycle(postgres(&prefixes).await, [0, 0, 0])
        .await;
    prefixes.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_time_graceful_stop_releases_and_restart_resumes_exactly() {
    let prefixes = Prefixes::new().await;
    fleet::scenario_graceful_stop_and_resume(postgres(&prefixes).await).await;
    prefixes.cleanup().await;
}
