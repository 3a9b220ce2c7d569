//! Recovery from network and server faults, with real `changefeed run` processes on
//! PostgreSQL, each host behind a fault proxy of its own (`changefeed-bench faults --quick`,
//! whose scenarios these are): a host black-holed past its lease expiry and healed with its
//! old flows dead, the same followed by a server restart, the whole fleet black-holed, a
//! store slower than the request timeout, and a cut source. Each checks that nothing was
//! lost or reordered, that no two hosts ran the handler on one partition at once, and that
//! every faulted host heartbeats and delivers again soon after the fault ends.

use std::time::Duration;

use changefeed_bench::faults::{self, Scenario, StoreBackend, Timings};

use crate::postgres::pg_url;

/// The quick timings: 3 s expiry, 0.5 s renewals, 1 s acquire cycles, 5 s requests.
async fn scenario(scenario: Scenario) {
    let timings = Timings::quick();
    // A heartbeat within renew_interval + the connect timeout (3 s) of the fault's end, with
    // room for a loaded machine; delivering within a few acquire cycles more.
    let heartbeat_bound = timings.renew_interval + Duration::from_secs(3) + Duration::from_secs(2);
    let setup = faults::setup(
        std::path::Path::new(env!("CARGO_BIN_EXE_changefeed")),
        StoreBackend::Postgres,
        &pg_url(),
        3,
        6,
        timings,
    )
    .await
    .expect("PostgreSQL (start it with `bash .ci/run`)");
    let outcome = faults::run(&setup, scenario, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", outcome.result_line("postgres"));
    let c = &outcome.checked;
    assert_eq!(
        c.lost,
        0,
        "every record delivered: {c:?} (logs in {})",
        setup.dir.display()
    );
    assert_eq!(c.reordered, 0, "each key in order: {c:?}");
    assert_eq!(
        c.overlapping, 0,
        "one deliverer per partition at a time: {c:?}"
    );
    assert!(
        outcome.heartbeat_s_max() <= heartbeat_bound.as_secs_f64(),
        "heartbeat again within {heartbeat_bound:?}: {:?}",
        outcome.heartbeat_s
    );
    if let Some(kept) = outcome.kept_leases {
        assert!(kept, "a host cut off from its source keeps its leases");
    }
    let _ = std::fs::remove_dir_all(&setup.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_black_holed_past_its_expiry_leases_again_after_the_heal() {
    scenario(Scenario::CutOne).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_black_holed_then_hit_by_a_server_restart_leases_again() {
    scenario(Scenario::CutThenRestart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_black_holed_at_once_resumes_by_itself() {
    scenario(Scenario::CutAll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_slower_than_the_request_timeout_is_survived() {
    scenario(Scenario::SlowStore).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_cut_off_from_its_source_keeps_its_leases_and_resumes() {
    scenario(Scenario::SourceCut).await;
}
