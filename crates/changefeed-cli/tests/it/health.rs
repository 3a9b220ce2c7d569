//! `changefeed run --http`: `/healthz`, `/readyz` and `/metrics` on real host processes.
//! `/readyz` follows the host's health: 503 before the host has registered, 200
//! while it runs, 503 once a store cut-off has fenced it, and 200 again once it has registered
//! again. `/healthz` is 503 only once the host has stayed fenced for longer than
//! `--max-unhealthy`, and 200 again once it has recovered. Every wait is a bounded poll.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use changefeed::model::{GroupName, HostName, PartitionId, Timestamp};
use changefeed::testkit::net::FaultProxy;
use changefeed_postgres::{PgOptions, PostgresLeaseStore};

use crate::pg_failure::{via_proxy, Proxy};
use crate::postgres::{drop_tables, pg_url, store_url, unique_prefix};
use crate::support::{bin, read, terminate, wait_exit, wait_for, Fixture};

/// Fast timings (a host fences 2 s after its last successful heartbeat), without the expiry.
const TIMINGS: &[&str] = &[
    "--safety-margin",
    "1s",
    "--renew-interval",
    "500ms",
    "--acquire-interval",
    "200ms",
    "--poll-delay",
    "50ms",
];

pub(crate) fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// One answer: status code, headers and body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) head: String,
    pub(crate) body: String,
}

/// `GET path` on 127.0.0.1:`port`; `None` while nothing answers there.
pub(crate) fn get(port: u16, path: &str) -> Option<Answer> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(Answer {
        status,
        head: head.to_string(),
        body: body.to_string(),
    })
}

/// Host processes, killed if the test ends early.
struct Hosts(Vec<Child>);

impl Drop for Hosts {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if child.try_wait().ok().flatten().is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A one-partition SQLite feed with a few records, so that a host has a lease to read.
fn feed(fx: &Fixture) {
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for i in 0..3 {
            feed.append_to(&p, "k", format!("record {i}"))
                .await
                .expect("append");
        }
    });
}

#[test]
fn readyz_is_503_until_the_host_registers_then_200_with_healthz_and_metrics() {
    // A host restarted under its name waits out its previous incarnation's heartbeat row for
    // lease_expiry before registering: until then it is alive (/healthz 200) but not ready
    // (/readyz 503 naming why); then ready, and /metrics serves the Prometheus text.
    let fx = Fixture::new();
    feed(&fx);
    fx.with_store(async |store| {
        store
            .heartbeat(
                &GroupName::new("g").expect("group"),
                &HostName::new("h1").expect("host"),
                "previous",
                Timestamp(0),
                None,
                HeartbeatRole::Member,
                None,
            )
            .await
            .expect("the previous incarnation's row")
    });
    let port = free_port();
    let mut hosts = Hosts(vec![bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args([
            "--handler",
            "cat > /dev/null",
            "--host",
            "h1",
            "--group",
            "g",
        ])
        .args(["--http", &format!("127.0.0.1:{port}")])
        .args(["--lease-expiry", "6s"])
        .args(TIMINGS)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run")]);
    let waiting = wait_for(
        Duration::from_secs(6),
        "/readyz to say the host is not registered yet",
        || get(port, "/readyz").filter(|a| a.body.contains("not registered yet")),
    );
    assert_eq!(waiting.status, 503, "{waiting:?}");
    assert_eq!(waiting.body, "not ready: not registered yet\n");
    let alive = get(port, "/healthz").expect("/healthz answers");
    assert_eq!(
        (alive.status, alive.body.as_str()),
        (200, "ok\n"),
        "{alive:?}"
    );

    let ready = wait_for(Duration::from_secs(20), "/readyz 200", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });
    assert!(ready.body.starts_with("ready: heartbeat "), "{ready:?}");
    let alive = get(port, "/healthz").expect("/healthz answers");
    assert_eq!(alive.status, 200, "{alive:?}");

    let metrics = wait_for(
        Duration::from_secs(20),
        "a scrape with the 3 records",
        || {
            get(port, "/metrics")
                .filter(|a| a.body.contains("changefeed_records_total{group=\"g\"} 3"))
        },
    );
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert!(
        metrics
            .head
            .to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{metrics:?}"
    );
    assert!(
        metrics
            .body
            .contains("# TYPE changefeed_batches_total counter"),
        "{metrics:?}"
    );
    let missing = get(port, "/nothing").expect("an answer");
    assert_eq!(missing.status, 404, "{missing:?}");

    terminate(&hosts.0[0]);
    let status = wait_exit(&mut hosts.0[0], Duration::from_secs(15));
    assert!(status.success(), "graceful stop exits 0: {status}");
}

#[test]
fn readyz_is_503_while_a_store_cut_off_fences_the_host_and_200_once_it_registered_again() {
    // /readyz goes to 503 when a host is fenced (its PostgreSQL lease
    // store cut off by a proxy that stops forwarding) and back to 200 when it registers again
    // (its peer had removed its row meanwhile). /healthz stays 200 throughout.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let prefix = unique_prefix("hz");
    let url = pg_url();
    let store = store_url(&prefix);
    let proxy = rt.block_on(Proxy::start(via_proxy(&url, 0).1));
    let (proxied_store, _) = via_proxy(&store, proxy.port);
    let leases = rt
        .block_on(PostgresLeaseStore::connect_with(
            PgOptions::new(url.clone())
                .prefix(prefix.clone())
                .pool_size(1),
        ))
        .unwrap_or_else(|e| {
            panic!("cannot reach PostgreSQL at {url}: {e} (start it with `bash .ci/run`)")
        });
    let group = GroupName::new("g").expect("group");
    let fx = Fixture::new();
    feed(&fx);
    let port = free_port();
    let host = |name: &str, store: &str, extra: &[&str]| {
        bin()
            .args(["run", "--store", store, "--source", &fx.url()])
            .args([
                "--handler",
                "cat > /dev/null",
                "--host",
                name,
                "--group",
                "g",
            ])
            .args(["--lease-expiry", "3s"])
            .args(TIMINGS)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start run")
    };
    let http = format!("127.0.0.1:{port}");
    let mut hosts = Hosts(vec![host("h1", &proxied_store, &["--http", &http])]);
    hosts.0.push(host("h2", &store, &[]));
    wait_for(Duration::from_secs(30), "h1 ready", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });

    proxy.set_cut(true);
    let fenced = wait_for(
        Duration::from_secs(15),
        "/readyz 503 for the cut-off h1",
        || get(port, "/readyz").filter(|a| a.status == 503),
    );
    assert!(
        fenced
            .body
            .starts_with("not ready: fenced: last successful heartbeat "),
        "{fenced:?}"
    );
    // h2 judges h1 dead, takes what it owned, and removes its heartbeat row.
    wait_for(Duration::from_secs(30), "h1's row removed by h2", || {
        let members = rt.block_on(leases.membership(&group)).ok()?;
        members
            .hosts
            .iter()
            .all(|hb| hb.host.as_str() != "h1")
            .then_some(())
    });
    let still = get(port, "/readyz").expect("/readyz answers");
    assert_eq!(still.status, 503, "still cut off: {still:?}");
    let alive = get(port, "/healthz").expect("/healthz answers while fenced");
    assert_eq!(alive.status, 200, "{alive:?}");

    proxy.set_cut(false);
    let ready = wait_for(Duration::from_secs(30), "/readyz 200 after the cut", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });
    assert!(ready.body.starts_with("ready: heartbeat "), "{ready:?}");
    let members = rt.block_on(leases.membership(&group)).expect("membership");
    let row = members
        .hosts
        .iter()
        .find(|hb| hb.host.as_str() == "h1")
        .expect("h1 registered again");
    assert!(
        row.incarnation.ends_with(".r1"),
        "h1 wrote a new row: {:?}",
        row.incarnation
    );

    for child in &hosts.0 {
        terminate(child);
    }
    for child in &mut hosts.0 {
        let status = wait_exit(child, Duration::from_secs(20));
        assert!(status.success(), "graceful stop exits 0: {status}");
    }
    rt.block_on(drop_tables(&prefix));
}

/// The value of the gauge `changefeed_unhealthy_since_seconds` of group g in a scrape.
fn unhealthy_since(port: u16) -> Option<f64> {
    let scrape = get(port, "/metrics")?;
    let line = scrape
        .body
        .lines()
        .find(|l| l.starts_with("changefeed_unhealthy_since_seconds{group=\"g\"} "))?;
    line.rsplit(' ').next()?.parse().ok()
}

#[test]
fn healthz_is_503_once_a_black_holed_host_stays_fenced_past_max_unhealthy_and_200_once_it_recovers()
{
    // The production failure: a host cut off from PostgreSQL by a silent network fault (the
    // proxy holds every byte, closes nothing) stays alive doing nothing. It fences itself
    // 2 s after its last successful heartbeat (/readyz 503) but stays healthy until it has been
    // fenced for longer than --max-unhealthy (4 s); then /healthz is 503 with the reason, the
    // gauge says since when and the log says so once. Once the path is back the host recovers
    // (its peer h2 has removed its row meanwhile, so it registers again) and /healthz is 200.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let prefix = unique_prefix("hu");
    let url = pg_url();
    let store = store_url(&prefix);
    let proxy = rt
        .block_on(FaultProxy::start(via_proxy(&url, 0).1))
        .expect("proxy");
    let (proxied_store, _) = via_proxy(&store, proxy.port());
    let leases = rt
        .block_on(PostgresLeaseStore::connect_with(
            PgOptions::new(url.clone())
                .prefix(prefix.clone())
                .pool_size(1),
        ))
        .unwrap_or_else(|e| {
            panic!("cannot reach PostgreSQL at {url}: {e} (start it with `bash .ci/run`)")
        });
    let group = GroupName::new("g").expect("group");
    let fx = Fixture::new();
    feed(&fx);
    let port = free_port();
    let log = fx.path("h1.log");
    let host = |name: &str, store: &str, extra: &[&str], stderr: Stdio| {
        bin()
            .args(["run", "--store", store, "--source", &fx.url()])
            .args([
                "--handler",
                "cat > /dev/null",
                "--host",
                name,
                "--group",
                "g",
            ])
            .args(["--lease-expiry", "3s", "--max-unhealthy", "4s"])
            .args(TIMINGS)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start run")
    };
    let http = format!("127.0.0.1:{port}");
    let mut hosts = Hosts(vec![host(
        "h1",
        &proxied_store,
        &["--http", &http],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    )]);
    hosts.0.push(host("h2", &store, &[], Stdio::null()));
    wait_for(Duration::from_secs(30), "h1 ready", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });
    let healthy = get(port, "/healthz").expect("/healthz answers");
    assert_eq!((healthy.status, healthy.body.as_str()), (200, "ok\n"));
    assert_eq!(unhealthy_since(port), Some(0.0), "0 while healthy");

    let cut_at = Instant::now();
    proxy.black_hole();
    // Fenced (not ready) soon, but still healthy.
    wait_for(
        Duration::from_secs(10),
        "/readyz 503 for the black-holed h1",
        || get(port, "/readyz").filter(|a| a.status == 503),
    );
    let fenced = get(port, "/healthz").expect("/healthz answers while fenced");
    assert_eq!(
        fenced.status, 200,
        "fenced is not yet unhealthy: {fenced:?}"
    );
    let unhealthy = wait_for(Duration::from_secs(20), "/healthz 503", || {
        get(port, "/healthz").filter(|a| a.status == 503)
    });
    let after = cut_at.elapsed();
    // The last successful heartbeat was at most a renew interval (500 ms) before the cut; the
    // fence fell 2 s after it, and max_unhealthy is 4 s.
    assert!(
        after >= Duration::from_millis(5_500 - 500),
        "unhealthy only after max_unhealthy of fencing: {after:?} after the cut"
    );
    assert!(
        unhealthy
            .body
            .starts_with("unhealthy: fenced: no successful heartbeat since ")
            && unhealthy
                .body
                .ends_with(", longer than max_unhealthy (4s)\n"),
        "{unhealthy:?}"
    );
    let since = wait_for(Duration::from_secs(5), "the gauge set", || {
        unhealthy_since(port).filter(|v| *v > 0.0)
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    assert!(
        since < now - 4.0 && since > now - 60.0,
        "the gauge says when the spell began: {since} (now {now})"
    );
    wait_for(Duration::from_secs(5), "the error logged", || {
        read(&log)
            .contains("unhealthy: fenced: no successful heartbeat since ")
            .then_some(())
    });
    // h2 judges h1 dead, takes what it owned, and removes its heartbeat row.
    wait_for(Duration::from_secs(30), "h1's row removed by h2", || {
        let members = rt.block_on(leases.membership(&group)).ok()?;
        members
            .hosts
            .iter()
            .all(|hb| hb.host.as_str() != "h1")
            .then_some(())
    });
    let still = get(port, "/healthz").expect("/healthz answers");
    assert_eq!(still.status, 503, "still cut off: {still:?}");

    proxy.pass();
    let recovered = wait_for(
        Duration::from_secs(30),
        "/healthz 200 after the cut",
        || get(port, "/healthz").filter(|a| a.status == 200),
    );
    assert_eq!(recovered.body, "ok\n");
    wait_for(Duration::from_secs(30), "/readyz 200 after the cut", || {
        get(port, "/readyz").filter(|a| a.status == 200)
    });
    wait_for(Duration::from_secs(5), "the gauge back to 0", || {
        unhealthy_since(port).filter(|v| *v == 0.0)
    });
    let text = read(&log);
    assert_eq!(
        text.matches("unhealthy: fenced: no successful heartbeat since ")
            .count(),
        1,
        "said once: {text}"
    );
    assert!(text.contains("healthy again"), "{text}");

    for child in &hosts.0 {
        terminate(child);
    }
    for child in &mut hosts.0 {
        let status = wait_exit(child, Duration::from_secs(20));
        assert!(status.success(), "graceful stop exits 0: {status}");
    }
    rt.block_on(drop_tables(&prefix));
}

#[test]
fn a_bad_or_busy_http_address_is_refused_naming_it() {
    // DESIGN "Bad input": a malformed address is a usage error (2) naming the setting; one
    // that cannot be bound is an operational error (1) naming the address, before any
    // heartbeat is written.
    let fx = Fixture::new();
    let base = [
        "run",
        "--store",
        &fx.url(),
        "--source",
        &fx.url(),
        "--handler",
        "cat",
    ];
    let out = bin()
        .args(base)
        .args(["--http", "localhost"])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{:?}",
        crate::support::text(&out)
    );
    assert!(
        crate::support::text(&out)
            .1
            .contains("http: \"localhost\" is not HOST:PORT"),
        "{:?}",
        crate::support::text(&out)
    );
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = busy.local_addr().expect("addr").to_string();
    let out = bin()
        .args(base)
        .args(["--http", &addr])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{:?}",
        crate::support::text(&out)
    );
    assert!(
        crate::support::text(&out)
            .1
            .contains(&format!("serving HTTP on {addr}")),
        "{:?}",
        crate::support::text(&out)
    );
    let rows = fx.with_store(async |store| {
        store
            .membership(&GroupName::new("default").expect("group"))
            .await
            .map(|m| m.hosts.len())
            .unwrap_or(0)
    });
    assert_eq!(rows, 0, "no heartbeat row was written");
}
