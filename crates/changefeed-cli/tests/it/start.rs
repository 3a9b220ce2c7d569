//! Faults at start (`changefeed run`): a store or source that cannot be reached yet (a name
//! that does not resolve, a refused connection) is retried for `--start-timeout`, each failure
//! logged in one line naming the URL without its password, then the host exits with 75; one
//! that refuses the host (authentication) exits at once with 78; one that comes up within the
//! window is joined. Real processes and a real PostgreSQL (`bash .ci/run`); every wait is
//! bounded.

use changefeed::lease::MembershipStore;
use std::process::Stdio;
use std::time::{Duration, Instant};

use changefeed::model::GroupName;
use changefeed::testkit::net::FaultProxy;
use changefeed_postgres::{PgOptions, PostgresLeaseStore};

use crate::health::{free_port, get};
use crate::pg_failure::via_proxy;
use crate::postgres::{drop_tables, pg_url, store_url, unique_prefix};
use crate::support::{bin, read, terminate, text, wait_exit, wait_for, Fixture};

/// Exit code: the store or source stayed unreachable for `--start-timeout`.
const TRANSIENT: i32 = 75;
/// Exit code: the store or source refused the host.
const PERMANENT: i32 = 78;

/// `pg_url()` as user `user` with password `password`, at `hostport` if given.
fn pg_as(scheme: &str, user: &str, password: Option<&str>, hostport: Option<&str>) -> String {
    let base = pg_url();
    let rest = base.split_once("://").map_or(base.as_str(), |(_, r)| r);
    let rest = rest.split_once('@').map_or(rest, |(_, r)| r);
    let (server, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let auth = match password {
        Some(p) => format!("{user}:{p}"),
        None => user.to_string(),
    };
    format!("{scheme}://{auth}@{}{tail}", hostport.unwrap_or(server))
}

/// A store and feed with one partition.
fn fixture() -> Fixture {
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
    });
    fx
}

/// Runs `changefeed run` with `store` and `source` and `extra`; returns the exit code, stderr
/// and how long it took.
fn run(store: &str, source: &str, extra: &[&str]) -> (Option<i32>, String, Duration) {
    let started = Instant::now();
    let out = bin()
        .args(["run", "--store", store, "--source", source])
        .args(["--handler", "cat", "--host", "h1", "--group", "g"])
        .args(extra)
        .output()
        .expect("run changefeed run");
    (out.status.code(), text(&out).1, started.elapsed())
}

/// The last line of `stderr`.
fn last_line(stderr: &str) -> &str {
    stderr.lines().last().unwrap_or_default()
}

#[test]
fn an_unreachable_store_or_source_is_retried_for_the_start_timeout_then_exits_75() {
    // A name that does not resolve and a port nobody listens on are transient faults: each
    // failure is one warning naming the URL (the password hidden), retried with backoff until
    // --start-timeout, then the host exits with 75 and one line saying so.
    let fx = fixture();
    let unresolvable = pg_as(
        "postgres",
        "u",
        Some("s3cret"),
        Some("nosuchhost.invalid:5432"),
    );
    let refused_source = pg_as("postgres-outbox", "u", Some("s3cret"), Some("127.0.0.1:1"));
    for (store, source, shown, what) in [
        (
            unresolvable.clone(),
            fx.url(),
            unresolvable.replace("s3cret", "***"),
            "lease store",
        ),
        (
            fx.url(),
            refused_source.clone(),
            refused_source
                .replace("s3cret", "***")
                .replace("postgres-outbox://", "postgres://"),
            "feed source",
        ),
    ] {
        let (code, stderr, took) = run(&store, &source, &["--start-timeout", "3s"]);
        assert_eq!(code, Some(TRANSIENT), "{store} {source}: {stderr}");
        assert!(
            !stderr.contains("s3cret"),
            "the password is never printed: {stderr}"
        );
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(15),
            "retried for about the start timeout: {took:?}"
        );
        let retries: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains(&format!("{what} unavailable at start; retrying")))
            .collect();
        assert!(
            retries.len() >= 2,
            "each failure logged once, several within 3 s: {stderr}"
        );
        assert!(
            retries.iter().all(|l| l.contains(&shown)),
            "each names the URL {shown}: {retries:?}"
        );
        let last = last_line(&stderr);
        assert!(
            last.starts_with("error: opening ")
                && last.contains(&shown)
                && last.contains("(still failing after ")
                && last.ends_with("; start_timeout 3s)"),
            "one line naming the URL: {last}"
        );
    }
    // A start timeout of zero tries once.
    let (code, stderr, took) = run(&unresolvable, &fx.url(), &["--start-timeout", "0s"]);
    assert_eq!(code, Some(TRANSIENT), "{stderr}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(
        last_line(&stderr).contains("(still failing after 1 attempt in "),
        "{stderr}"
    );
}

#[test]
fn a_store_or_source_refusing_the_login_exits_78_at_once() {
    // Authentication refused is permanent: no retries, even with the default 60 s window;
    // exit 78 with the server's reason and the URL, once.
    let fx = fixture();
    let store = pg_as("postgres", "nosuchuser", None, None);
    let (code, stderr, took) = run(&store, &fx.url(), &[]);
    assert!(
        !stderr.contains("error connecting to server"),
        "PostgreSQL must run at {} (start it with `bash .ci/run`): {stderr}",
        pg_url()
    );
    assert_eq!(code, Some(PERMANENT), "{stderr}");
    assert!(took < Duration::from_secs(10), "at once: {took:?}");
    assert!(!stderr.contains("retrying"), "not retried: {stderr}");
    assert_eq!(
        last_line(&stderr),
        format!(
            "error: opening lease store {store}: lease store connect failed: db error: FATAL: role \"nosuchuser\" does not exist (not retried: the lease store refused it; fix the URL, the credentials or the server)"
        )
    );
    let source = pg_as("postgres-outbox", "nosuchuser", Some("pw"), None);
    let (code, stderr, took) = run(&fx.url(), &source, &[]);
    assert_eq!(code, Some(PERMANENT), "{stderr}");
    assert!(took < Duration::from_secs(10), "at once: {took:?}");
    let last = last_line(&stderr);
    assert!(
        last.starts_with("error: opening outbox postgres://nosuchuser:***@")
            && last.contains("role \"nosuchuser\" does not exist")
            && last.ends_with("(not retried: the feed source refused it; fix the URL, the credentials or the server)"),
        "{last}"
    );
    assert!(!stderr.contains(":pw@"), "{stderr}");
    let heartbeats = fx.with_store(async |s| {
        s.membership(&GroupName::new("g").expect("group"))
            .await
            .expect("membership")
            .hosts
            .len()
    });
    assert_eq!(heartbeats, 0, "nothing registered");
}

#[test]
fn a_store_that_comes_up_within_the_start_window_is_joined() {
    // The PostgreSQL store is behind a proxy that refuses connections (a server not listening
    // yet); once the host has logged its first failure the proxy lets them through, and the
    // host opens the store, registers and runs; a SIGTERM then stops it with 0.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let prefix = unique_prefix("st");
    let store = store_url(&prefix);
    let proxy = rt
        .block_on(FaultProxy::start(via_proxy(&pg_url(), 0).1))
        .expect("proxy");
    proxy.refuse();
    let (proxied, _) = via_proxy(&store, proxy.port());
    let fx = fixture();
    let log = fx.path("h1.log");
    let port = free_port();
    let mut host = bin()
        .args(["run", "--store", &proxied, "--source", &fx.url()])
        .args([
            "--handler",
            "cat > /dev/null",
            "--host",
            "h1",
            "--group",
            "g",
        ])
        .args([
            "--start-timeout",
            "60s",
            "--http",
            &format!("127.0.0.1:{port}"),
        ])
        .args(crate::support::FAST)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start run");
    wait_for(Duration::from_secs(20), "the first failure logged", || {
        read(&log)
            .contains("lease store unavailable at start; retrying")
            .then_some(())
    });
    let starting = get(port, "/readyz").expect("/readyz answers while starting");
    assert_eq!(
        (starting.status, starting.body.as_str()),
        (503, "not ready: starting\n")
    );
    let alive = get(port, "/healthz").expect("/healthz answers while starting");
    assert_eq!(alive.status, 200, "{alive:?}");
    assert!(
        host.try_wait().expect("try_wait").is_none(),
        "still retrying"
    );

    proxy.pass();
    wait_for(Duration::from_secs(30), "h1 ready", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });
    let leases = rt
        .block_on(PostgresLeaseStore::connect_with(
            PgOptions::new(pg_url()).prefix(prefix.clone()),
        ))
        .expect("the store directly");
    let members = rt
        .block_on(leases.membership(&GroupName::new("g").expect("group")))
        .expect("membership");
    assert!(
        members.hosts.iter().any(|hb| hb.host.as_str() == "h1"),
        "h1 registered: {members:?}"
    );
    assert!(
        read(&log).contains("lease store reachable; starting"),
        "{}",
        read(&log)
    );
    terminate(&host);
    let status = wait_exit(&mut host, Duration::from_secs(20));
    assert!(
        status.success(),
        "graceful stop exits 0: {status}\n{}",
        read(&log)
    );
    rt.block_on(drop_tables(&prefix));
}
