//! Recovery from network and server faults, with real `changefeed run` processes on
//! PostgreSQL, each host behind a fault proxy of its own (`changefeed-bench faults --quick`,
//! whose scenarios these are): a host black-holed past its lease expiry and healed with its
//! old flows dead, the same followed by a server restart, the whole fleet black-holed, a
//! store slower than the request timeout, and a cut source. Each checks that nothing was
//! lost or reordered, that no two hosts ran the handler on one partition at once, and that
//! every faulted host heartbeats and delivers again soon after the fault ends.
//!
//! [`check`] runs one scenario on any store and source; `faults_dynamodb`, `faults_cosmos` and
//! `faults_kinesis` run theirs through it.

use std::time::Duration;

use changefeed_bench::faults::{self, Scenario, SourceBackend, StoreBackend, Timings};

use crate::postgres::pg_url;

/// How soon after the fault's end each faulted host must heartbeat and deliver again.
pub(crate) struct Bounds {
    pub(crate) heartbeat: Duration,
    pub(crate) recovery: Duration,
}

/// Room on top of a stated bound for a loaded 2-core machine (the fleets run two at a time
/// beside other tests) and the harness's 100 ms polls.
pub(crate) const SLACK: Duration = Duration::from_secs(2);

/// Runs `scenario` with the quick timings ([`Timings::quick`]) on a fleet of three hosts and
/// six partitions, and asserts what every scenario must show: nothing lost or reordered, one
/// deliverer per partition at a time, every faulted host heartbeating and delivering again
/// within `bounds`, a cut source's hosts keeping their leases, and every host stopping
/// cleanly. `servers` says how to start the servers when one cannot be reached.
pub(crate) async fn check(
    store: StoreBackend,
    source: SourceBackend,
    scenario: Scenario,
    bounds: Bounds,
    servers: &str,
) {
    let backend = store.name();
    let setup = faults::setup(
        std::path::Path::new(env!("CARGO_BIN_EXE_changefeed")),
        store,
        source,
        &pg_url(),
        3,
        6,
        Timings::quick(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}: {servers}"));
    let outcome = faults::run(&setup, scenario, bounds.recovery)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", outcome.result_line(backend));
    let logs = format!("logs in {}", setup.dir.display());
    let c = &outcome.checked;
    assert_eq!(c.lost, 0, "every record delivered: {c:?} ({logs})");
    assert_eq!(c.reordered, 0, "each key in order: {c:?} ({logs})");
    assert_eq!(
        c.overlapping, 0,
        "one deliverer per partition at a time: {c:?} ({logs})"
    );
    assert!(
        outcome.heartbeat_s_max() <= bounds.heartbeat.as_secs_f64(),
        "heartbeat again within {:?}: {:?} ({logs})",
        bounds.heartbeat,
        outcome.heartbeat_s
    );
    assert!(
        outcome.recovery_s_max() <= bounds.recovery.as_secs_f64(),
        "delivering again within {:?}: {:?} ({logs})",
        bounds.recovery,
        outcome.recovery_s
    );
    if let Some(kept) = outcome.kept_leases {
        assert!(
            kept,
            "a host cut off from its source keeps its leases and releases none ({logs})"
        );
    }
    assert!(
        outcome.unclean_stops.is_empty(),
        "every host exits 0 soon after SIGTERM, not {:?} ({logs})",
        outcome.unclean_stops
    );
    let _ = std::fs::remove_dir_all(&setup.dir);
}

/// The quick timings: 3 s expiry, 0.5 s renewals, 1 s acquire cycles, 5 s requests.
async fn scenario(scenario: Scenario) {
    let timings = Timings::quick();
    // A heartbeat within renew_interval + the connect timeout (3 s) of the fault's end, with
    // room for a loaded machine; delivering within a few acquire cycles more.
    let heartbeat = timings.renew_interval + Duration::from_secs(3) + SLACK;
    check(
        StoreBackend::Postgres,
        SourceBackend::Outbox,
        scenario,
        Bounds {
            heartbeat,
            recovery: Duration::from_secs(30),
        },
        "start PostgreSQL with `bash .ci/run`",
    )
    .await;
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
