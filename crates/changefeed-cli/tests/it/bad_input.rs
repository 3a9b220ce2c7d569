//! Bad input: a usage error exits 2 naming the setting, before anything is written;
//! an operational error reads once, each cause named a single time.

use changefeed::lease::MembershipStore;
use changefeed::model::GroupName;

use crate::support::{bin, text, Fixture};

/// A store and feed with one partition, so a host that got past its settings would register.
fn fixture() -> Fixture {
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
    });
    fx
}

/// Runs `changefeed run` on `fx` with `extra` flags; returns the exit code and stderr.
fn run(fx: &Fixture, extra: &[&str]) -> (Option<i32>, String) {
    let out = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", "cat", "--host", "h1", "--group", "g"])
        .args(extra)
        .output()
        .expect("run changefeed run");
    (out.status.code(), text(&out).1)
}

/// Whether any heartbeat row of group `g` is in the store.
fn heartbeats(fx: &Fixture) -> usize {
    let group = GroupName::new("g").expect("group");
    fx.with_store(async |s| s.membership(&group).await.expect("membership").hosts.len())
}

#[test]
fn run_refuses_a_huge_or_zero_timing_setting_before_registering() {
    // These must be usage errors, not a panic (exit 101) after registering a heartbeat row.
    let fx = fixture();
    for (flag, value, setting) in [
        ("--lease-expiry", "500000000000y", "lease_expiry"),
        ("--acquire-interval", "100000000000y", "acquire_interval"),
        ("--renew-interval", "100000000000y", "renew_interval"),
        ("--handoff-timeout", "100000000000y", "handoff_timeout"),
        ("--poll-delay", "100000000000y", "poll_delay"),
        ("--checkpoint", "interval:100000000000y", "checkpoint"),
        ("--safety-margin", "0s", "safety_margin"),
    ] {
        let (code, stderr) = run(&fx, &[flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("error: {setting}: ")),
            "{flag} {value}: the message names the setting: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(heartbeats(&fx), 0, "{flag} {value}: no heartbeat row left");
    }
}

#[test]
fn a_huge_duration_from_the_environment_or_the_config_file_is_refused_alike() {
    // Every source of a setting is checked the same way: flag, environment, file.
    let fx = fixture();
    let out = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", "cat", "--host", "h1", "--group", "g"])
        .env("CHANGEFEED_RENEW_INTERVAL", "100000000000y")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.starts_with("error: renew_interval: "),
        "{:?}",
        text(&out)
    );
    let file = fx.path("cf.toml");
    std::fs::write(&file, "lease_expiry = \"500000000000y\"\n").expect("config file");
    let (code, stderr) = run(&fx, &["--config", &file.display().to_string()]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("error: lease_expiry: "), "{stderr}");
    assert_eq!(heartbeats(&fx), 0, "no heartbeat row left");
}

#[test]
fn a_sqlite_file_that_cannot_be_opened_is_named_once() {
    // Errors read once: not `unable to open database file: X: unable to open …`.
    let out = bin()
        .args(["status", "--store", "sqlite:///nonexistent/dir/x.db"])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out).1,
        "error: lease store open failed for /nonexistent/dir/x.db: unable to open database file\n"
    );
    let fx = Fixture::new();
    let out = bin()
        .args(["lag", "--store", &fx.url()])
        .args(["--source", "sqlite:///nonexistent/dir/y.db"])
        .output()
        .expect("lag");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out).1,
        "error: opening feed /nonexistent/dir/y.db: feed source open failed: unable to open database file\n"
    );
}

#[test]
fn postgres_url_mistakes_are_usage_errors_naming_the_part() {
    // `postgres://` without a host is a usage error; a bad part is named.
    for (url, message) in [
        (
            "postgres://",
            "error: --store: postgres:// needs a host, e.g. postgres://USER@HOST/DB (or ?host=/run/postgresql for a socket); got \"postgres://\"\n",
        ),
        (
            "postgres://u:secret@db:notaport/app",
            "error: --store: postgres://u:***@db:notaport/app: invalid connection string: invalid value for option `port`\n",
        ),
    ] {
        let out = bin()
            .args(["status", "--store", url])
            .output()
            .expect("status");
        assert_eq!(out.status.code(), Some(2), "{url}: {:?}", text(&out));
        assert_eq!(text(&out).1, message);
    }
}

#[test]
fn an_unreachable_postgres_server_is_reported_once() {
    // The pool's error appears once, not three times.
    let url = "postgres://nobody@127.0.0.1:1/x";
    let out = bin()
        .args(["status", "--store", url])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert_eq!(
        text(&out).1,
        format!(
            "error: opening lease store {url}: lease store connect failed: error connecting to server: Connection refused (os error 111)\n"
        )
    );
}

#[test]
fn a_postgres_server_refusing_the_login_is_reported_once() {
    // The server's own message, once; needs the test server (`bash .ci/run`).
    let base = crate::postgres::pg_url();
    let rest = base.split_once('@').map_or(base.as_str(), |(_, r)| r);
    let url = format!("postgres://no_such_role_16@{rest}");
    let out = bin()
        .args(["status", "--store", &url])
        .output()
        .expect("status");
    let stderr = text(&out).1;
    assert!(
        !stderr.contains("error connecting to server"),
        "PostgreSQL must run at {base} (start it with `bash .ci/run`): {stderr}"
    );
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "error: opening lease store {url}: lease store connect failed: db error: FATAL: role \"no_such_role_16\" does not exist\n"
        )
    );
}

#[test]
fn an_unreachable_dynamodb_endpoint_is_summarised() {
    // The cause in words, once, without the SDK's `DispatchFailure(…)` dump.
    let out = bin()
        .args([
            "status",
            "--store",
            "dynamodb://leases?endpoint=http://127.0.0.1:1&region=us-east-1",
        ])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert_eq!(
        text(&out).1,
        "error: opening DynamoDB lease table leases: lease store create_table failed for leases: dispatch failure: io error: client error (Connect): tcp connect error: Connection refused (os error 111)\n"
    );
    let out = bin()
        .args(["status", "--store", "dynamodb://leases?endpoint=notaurl"])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out)
            .1
            .starts_with("error: --store: dynamodb:// parameter endpoint: \"notaurl\""),
        "{:?}",
        text(&out)
    );
}

#[test]
fn run_refuses_bad_lease_limits_before_registering() {
    // --min-leases and --max-leases that break a rule are usage errors naming the
    // setting, before anything is written.
    let fx = fixture();
    for (flags, message) in [
        (
            &["--max-leases", "0"][..],
            "error: max_leases: must be at least 1",
        ),
        (
            &["--min-leases", "3", "--max-leases", "2"][..],
            "error: min_leases: 3 must not exceed max_leases (2)",
        ),
        (
            &["--max-leases", "lots"][..],
            "error: max_leases: \"lots\" is not a whole number",
        ),
    ] {
        let (code, stderr) = run(&fx, flags);
        assert_eq!(code, Some(2), "{flags:?}: {stderr}");
        assert!(stderr.starts_with(message), "{flags:?}: {stderr}");
        assert_eq!(heartbeats(&fx), 0, "{flags:?}: no heartbeat row left");
    }
}
