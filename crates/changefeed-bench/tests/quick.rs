//! Every `changefeed-bench` subcommand's `--quick` form, run once as a smoke test: it must end
//! well and print a `RESULT` line that parses, with its headline key. A benchmark that breaks
//! is then noticed the day it breaks, not when someone next runs it by hand.
//!
//! The benchmarks on a server run against the real one on loopback (`scripts/test` starts
//! them): without it the run fails, it does not skip.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use changefeed_bench::result::parse_last;

/// Runs `changefeed-bench ARGS --quick` and returns its `RESULT` fields, having checked that
/// the run succeeded, the line parses and it holds `key`.
fn quick(args: &[&str], key: &str) -> BTreeMap<String, String> {
    let mut args = args.to_vec();
    args.push("--quick");
    run(&args, key)
}

/// Runs `changefeed-bench ARGS` and returns its `RESULT` fields (see [`quick`]).
fn run(args: &[&str], key: &str) -> BTreeMap<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_changefeed-bench"))
        .args(args)
        // The AWS SDK never leaves the machine: static credentials, no metadata lookups.
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .expect("changefeed-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "changefeed-bench {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let fields =
        parse_last(&stdout).unwrap_or_else(|e| panic!("changefeed-bench {args:?}: {e}:\n{stdout}"));
    assert!(
        fields.contains_key(key),
        "changefeed-bench {args:?}: no `{key}` in its RESULT line:\n{stdout}"
    );
    fields
}

/// The `changefeed` binary of this build (the benchmarks that run it need it): beside this
/// test's directory of executables, built with cargo if this build has none yet.
fn changefeed_bin() -> String {
    let exe = std::env::current_exe().expect("the test's path");
    // target/<profile>/deps/<test> -> target/<profile>/changefeed
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let bin: PathBuf = dir.join("changefeed");
    if !bin.is_file() {
        let mut build = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        build.args(["build", "-p", "changefeed-cli", "--bin", "changefeed"]);
        if dir.file_name().is_some_and(|p| p == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "cargo build -p changefeed-cli failed");
    }
    assert!(bin.is_file(), "no changefeed binary at {}", bin.display());
    bin.display().to_string()
}

fn postgres_url() -> String {
    std::env::var("CHANGEFEED_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

#[test]
fn store_io() {
    let f = quick(&["store-io"], "rows_read_per_host_per_interval");
    for key in ["writes_per_host_per_interval", "cpu_s", "peak_rss_mb"] {
        assert!(f.contains_key(key), "store-io: no {key}");
    }
}

/// Hosts sharing their lease tables ask the store for what hosts with their own tables ask:
/// every count of the run is the same (only its cost differs).
#[test]
fn store_io_shared_tables_count_as_own_tables() {
    let cost = ["wall_s", "cpu_s", "peak_rss_mb"];
    let mut shared = quick(&["store-io"], "rows_read_per_host_per_interval");
    let mut own = quick(
        &["store-io", "--own-tables"],
        "rows_read_per_host_per_interval",
    );
    for key in cost {
        shared.remove(key);
        own.remove(key);
    }
    assert_eq!(shared, own);
}

#[test]
fn balance() {
    quick(&["balance"], "balance_ms");
}

#[test]
fn rebalance() {
    quick(&["rebalance"], "cycles_ours");
}

#[test]
fn store() {
    quick(&["store"], "sqlite_replace_per_s");
}

#[test]
fn store_postgres() {
    quick(
        &["store", "--url", &postgres_url()],
        "postgres_replace_per_s",
    );
}

#[test]
fn outbox() {
    quick(
        &["outbox", "--url", &postgres_url()],
        "postgres_read_rps_per_partition",
    );
}

#[test]
fn throughput() {
    quick(&["throughput"], "processor_rps");
}

#[test]
fn hotspots() {
    quick(&["hotspots"], "load_max_over_mean_p99_load");
}

#[test]
fn key_parallel() {
    quick(&["key-parallel"], "rps_n16");
}

#[test]
fn latency() {
    quick(&["latency"], "fanout_p99_ms");
}

#[test]
fn dynamodb_cost() {
    quick(&["dynamodb-cost"], "wcu_per_min_ours");
}

#[test]
fn dynamodb_keys() {
    quick(&["dynamodb-keys"], "max_key_wcu_per_s_at_10000");
}

#[test]
fn run_throughput() {
    let bin = changefeed_bin();
    quick(
        &["run-throughput", "--changefeed", &bin],
        "long_lived_cpu_ratio_b10",
    );
}

#[test]
fn faults() {
    let bin = changefeed_bin();
    quick(
        &["faults", "--changefeed", &bin, "--scenario", "cut-one"],
        "recovery_s_max",
    );
}

/// The report runs the quick forms itself; two of them are enough to show it reads them.
#[test]
fn report() {
    let f = run(
        &["report", "--bench", "store-io", "--bench", "balance"],
        "store_io_rows_read_per_host_per_interval",
    );
    assert!(
        f.contains_key("balance_balance_ms"),
        "report: no balance row"
    );
}
