//! `changefeed console` against a fleet of real `changefeed run` processes on a SQLite store,
//! in a real browser: Debian's headless `chromium`, driven over WebDriver by Debian's
//! `chromedriver`. The page must show every partition, then, by its own refresh
//! (no reload), the partitions of a host killed with SIGKILL changing owner. And its API must
//! say what the console costs the store, next to what a follower host costs it. Every wait is a poll
//! with a deadline.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use changefeed::source::FeedSource as _;
use fantoccini::{Client, ClientBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};

use crate::health::{free_port, get};
use crate::support::{bin, wait_for, Fixture, FAST};

const CHROMIUM: &str = "/usr/bin/chromium";
const INSTALL: &str =
    "install Debian's browser and driver: apt-get install -y chromium chromium-driver \
     (.ci/run does)";

/// Child processes killed (SIGKILL) and reaped when dropped, so a failing test leaves none.
#[derive(Default)]
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn add(&mut self, name: &str, child: Child) {
        self.0.push((name.to_string(), child));
    }

    fn kill(&mut self, name: &str) {
        let (_, child) = self
            .0
            .iter_mut()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"));
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `cmd` and waits (bounded) for a line of its standard output that `pick` accepts;
/// the later lines arrive on the receiver (the output is drained to its end either way, so the
/// process never writes into a full or closed pipe).
fn start_and_read(
    mut cmd: Command,
    what: &str,
    pick: fn(&str) -> Option<String>,
) -> (Child, String, mpsc::Receiver<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}; {INSTALL}"));
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(found) = pick(&line) {
                    return (child, found, rx);
                }
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what} did not say where it listens within 30s");
            }
        }
    }
}

/// Debian's chromedriver on a port of its choosing; fails loudly if it or chromium is missing.
fn chromedriver() -> (Child, u16) {
    assert!(
        std::path::Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: {INSTALL}"
    );
    let mut cmd = Command::new("chromedriver");
    cmd.arg("--port=0");
    let (child, port, _) = start_and_read(cmd, "chromedriver", |line| {
        line.split("started successfully on port ")
            .nth(1)
            .map(|p| p.trim_end_matches('.').to_string())
    });
    (child, port.parse().expect("chromedriver's port"))
}

async fn browser(driver_port: u16) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"],
        }),
    );
    ClientBuilder::new(HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{driver_port}"))
        .await
        .unwrap_or_else(|e| panic!("starting a headless chromium session: {e}; {INSTALL}"))
}

/// The lease table as the page shows it: partition → owner (`–` when none).
const LEASE_TABLE: &str = "return [...document.querySelectorAll('#leases tbody tr')]
    .map(r => [r.dataset.partition, r.querySelector('.owner').textContent]);";

async fn shown_owners(client: &Client) -> BTreeMap<String, String> {
    let rows = client
        .execute(LEASE_TABLE, vec![])
        .await
        .expect("reading the page's lease table");
    rows.as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| Some((r[0].as_str()?.to_string(), r[1].as_str()?.to_string())))
        .collect()
}

/// Polls the page (every 100 ms, up to `limit`) until `done` accepts its lease table.
async fn until_page(
    client: &Client,
    limit: Duration,
    what: &str,
    done: impl Fn(&BTreeMap<String, String>) -> bool,
) -> BTreeMap<String, String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let owners = shown_owners(client).await;
        if done(&owners) {
            return owners;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}; the page shows {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the page (every 100 ms, up to `limit`) until its hosts table marks a leader that
/// `accept` accepts; returns it.
async fn page_leader(client: &Client, limit: Duration, accept: impl Fn(&str) -> bool) -> String {
    const LEADER: &str = "const r = document.querySelector('#hosts tbody tr:has(.leader)');
        return r ? r.dataset.host : null;";
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let shown = client
            .execute(LEADER, vec![])
            .await
            .expect("reading the page's hosts table");
        if let Some(leader) = shown.as_str().filter(|l| accept(l)) {
            return leader.to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for the page to mark a leader; it marks {shown}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A 3-host fleet on a 6-partition SQLite feed (each host also gets `host_args(host)`), and
/// the console on it, refreshing every 200 ms like the hosts' acquire cycle, with
/// `console_args`; returns the processes, the partitions and the console's port.
fn fleet(
    fx: &Fixture,
    host_args: impl Fn(&str) -> Vec<String>,
    console_args: &[&str],
) -> (Procs, Vec<String>, u16) {
    let url = fx.url();
    let partitions: Vec<String> = fx.with_feed(async |feed| {
        feed.create_partitions(6).await.expect("partitions");
        let listed = feed.partitions().await.expect("partitions");
        listed.into_iter().map(|p| p.id.to_string()).collect()
    });
    let mut procs = Procs::default();
    for host in ["h1", "h2", "h3"] {
        let child = bin()
            .args(["run", "--store", &url, "--source", &url, "--group", "g"])
            .args(["--host", host, "--handler", "cat > /dev/null"])
            .args(FAST)
            .args(host_args(host))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start run");
        procs.add(host, child);
    }
    let mut cmd = bin();
    cmd.args(["console", "--store", &url, "--source", &url, "--group", "g"])
        .args(["--listen", "127.0.0.1:0", "--refresh", "200ms"])
        .args([
            "--lease-expiry",
            "3s",
            "--safety-margin",
            "1s",
            "--handoff-timeout",
            "3s",
        ])
        .args(console_args);
    let (console, addr, _) = start_and_read(cmd, "changefeed console", served_at);
    procs.add("console", console);
    (procs, partitions, port_of(&addr))
}

/// The address in a line `… http://ADDR/`.
fn served_at(line: &str) -> Option<String> {
    line.split("http://")
        .nth(1)
        .map(|a| a.trim_end_matches('/').to_string())
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {addr}"))
}

#[test]
fn the_page_shows_a_killed_hosts_partitions_change_owner() {
    // A real browser sees every partition, then, without reloading, the partitions
    // of a host killed with SIGKILL (the membership view's leader) taken by the others, the
    // kill as one expiry in the events, and the fleet's new leader.
    let fx = Fixture::new();
    let (mut procs, partitions, port) = fleet(&fx, |_| Vec::new(), &["--list-every", "2s"]);
    let (driver, driver_port) = chromedriver();
    procs.add("chromedriver", driver);
    crate::support::rt().block_on(async {
        let client = browser(driver_port).await;
        client
            .goto(&format!("http://127.0.0.1:{port}/"))
            .await
            .expect("loading the console");
        let all_owned = |o: &BTreeMap<String, String>| {
            partitions
                .iter()
                .all(|p| o.get(p).is_some_and(|h| h.starts_with('h')))
        };
        let before = until_page(
            &client,
            Duration::from_secs(30),
            "every partition owned",
            |o| {
                // Spread over the three hosts, so the victim's loss is a move, not a start.
                let hosts: std::collections::BTreeSet<&String> = o.values().collect();
                all_owned(o) && hosts.len() == 3
            },
        )
        .await;
        // A mark that a reload would wipe out.
        client
            .execute("window.consoleProbe = 'same page'; return null;", vec![])
            .await
            .expect("marking the page");
        // The victim is the membership view's leader as the page marks it: its view goes
        // stale, the console judges the heartbeats itself until the fleet elects another
        // leader, whose view lists the victim dead.
        let victim = page_leader(&client, Duration::from_secs(30), |_| true).await;
        let lost: Vec<&String> = before
            .iter()
            .filter(|(_, h)| **h == victim)
            .map(|(p, _)| p)
            .collect();
        procs.kill(&victim);
        let after = until_page(
            &client,
            Duration::from_secs(30),
            &format!("{victim}'s partitions {lost:?} to change owner on the page"),
            |o| all_owned(o) && o.values().all(|h| *h != victim),
        )
        .await;
        assert!(lost.iter().all(|p| after[*p] != victim), "{after:?}");
        let leader = page_leader(&client, Duration::from_secs(30), |l| l != victim).await;
        assert_ne!(leader, victim, "the page names the new leader");
        let probe = client
            .execute("return window.consoleProbe || null;", vec![])
            .await
            .expect("reading the mark");
        assert_eq!(
            probe,
            json!("same page"),
            "the page refreshed itself, without a reload"
        );
        // The events feed and the timeline say what happened.
        let said = client
            .execute(
                "return [document.querySelector('#events').textContent,
                         document.querySelector('#timeline').innerHTML];",
                vec![],
            )
            .await
            .expect("reading events and timeline");
        let (events, timeline) = (
            said[0].as_str().unwrap_or(""),
            said[1].as_str().unwrap_or(""),
        );
        let taken = format!("from {victim} (expired)");
        assert!(events.contains(&taken), "events feed: {events}");
        // The kill itself: judged dead by the membership view (or, if the victim led it, by
        // the console from the heartbeats until a new leader's view lists it dead).
        let expired = format!("{victim} expired: ");
        assert_eq!(
            events.matches(&expired).count(),
            1,
            "one expiry of {victim} in the events feed: {events}"
        );
        assert!(
            timeline.contains(&taken) && timeline.contains("<svg"),
            "timeline: {timeline}"
        );
        client.close().await.expect("closing the browser");
    });
}

/// The sum of a Prometheus counter's samples.
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn the_console_costs_the_store_no_more_than_a_host() {
    // With a membership view, the console reads the store as a host that does not
    // lead (the head row each cycle, then only what changed hands; every heartbeat only when
    // the view's version moves or every --heartbeats-every), so over the same stretch it makes
    // no more store calls and reads no more rows than a follower of the fleet (whose counts
    // its /metrics gives), at the same cycle (200 ms) and the console's defaults (full list
    // every 30 s, heartbeats every 20 s). Head rows count as rows; a console that read every
    // heartbeat each refresh (3 rows) would read about three times the follower's rows.
    let fx = Fixture::new();
    let ports: BTreeMap<String, u16> = ["h1", "h2", "h3"]
        .into_iter()
        .map(|h| (h.to_string(), free_port()))
        .collect();
    let http = |host: &str| vec!["--http".to_string(), format!("127.0.0.1:{}", ports[host])];
    let (_procs, _, port) = fleet(&fx, http, &[]);
    let console = || -> Value {
        let answer = get(port, "/api/stats").expect("the console answers");
        serde_json::from_str(&answer.body).expect("stats JSON")
    };
    let field = |v: &Value, name: &str| v[name].as_f64().unwrap_or_else(|| panic!("{name} in {v}"));
    // Calls: reads + writes. Rows: head, lease and heartbeat rows read + rows written.
    let console_cost = || {
        let v = console();
        let rows = field(&v, "lease_rows_read")
            + field(&v, "heartbeat_rows_read")
            + field(&v, "head_rows_read");
        (
            field(&v, "reads") + field(&v, "writes"),
            rows + field(&v, "writes"),
        )
    };
    let host_cost = |host_port: u16| -> Option<(f64, f64)> {
        let m = get(host_port, "/metrics")?.body;
        let writes = counter(&m, "changefeed_store_writes_total");
        let reads = counter(&m, "changefeed_store_reads_total");
        let rows = counter(&m, "changefeed_store_lease_rows_read_total")
            + counter(&m, "changefeed_store_heartbeat_rows_read_total")
            + counter(&m, "changefeed_store_head_rows_read_total");
        (reads > 0.0).then_some((reads + writes, rows + writes))
    };
    // Compare the next stretch, once all three hosts have joined and balanced under a view;
    // the follower compared is the first host by name that does not lead it.
    let leader = wait_for(
        Duration::from_secs(30),
        "three hosts balanced under a membership view in the console",
        || {
            let answer = get(port, "/api/hosts")?;
            let v: Value = serde_json::from_str(&answer.body).ok()?;
            let hosts = v["hosts"].as_array()?;
            let balanced = hosts.len() == 3
                && hosts
                    .iter()
                    .all(|h| h["leases_owned"] == 2 && h["status"] == "live");
            let leader = hosts.iter().find(|h| h["leader"] == true)?["name"].as_str()?;
            (balanced && v["judged_by"] == "view").then(|| leader.to_string())
        },
    );
    let follower = ["h1", "h2", "h3"]
        .into_iter()
        .find(|h| *h != leader)
        .expect("a follower");
    let host_port = ports[follower];
    let refreshes = field(&console(), "refreshes");
    let (c_calls, c_rows) = console_cost();
    let (h_calls, h_rows) = wait_for(Duration::from_secs(30), "the follower's metrics", || {
        host_cost(host_port)
    });
    wait_for(Duration::from_secs(30), "25 more console refreshes", || {
        (field(&console(), "refreshes") >= refreshes + 25.0).then_some(())
    });
    let (c_calls2, c_rows2) = console_cost();
    let (h_calls2, h_rows2) = host_cost(host_port).expect("the follower's metrics");
    let n = field(&console(), "refreshes") - refreshes;
    let (console_calls, console_rows) = (c_calls2 - c_calls, c_rows2 - c_rows);
    let (host_calls, host_rows) = (h_calls2 - h_calls, h_rows2 - h_rows);
    eprintln!(
        "over {n} refreshes: console {console_calls} store calls ({:.2}/refresh), {console_rows} \
         rows ({:.2}/refresh); follower {follower} (leader {leader}) {host_calls} calls, \
         {host_rows} rows",
        console_calls / n,
        console_rows / n
    );
    assert!(
        console_calls <= host_calls,
        "console {console_calls} store calls, follower {follower} {host_calls}"
    );
    assert!(
        console_rows <= host_rows,
        "console {console_rows} rows, follower {follower} {host_rows}"
    );
    assert_eq!(field(&console(), "writes"), 0.0, "the console never writes");
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    // Bad input: a usage error (exit 2) naming the setting, or an operational one (exit 1)
    // naming the address in use; never a panic.
    let fx = Fixture::new();
    fx.with_feed(async |feed| feed.create_partitions(1).await.expect("partitions"));
    let url = fx.url();
    let console = |extra: &[&str]| {
        let out = bin()
            .args(["console", "--store", &url, "--group", "g"])
            .args(extra)
            .output()
            .expect("run console");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = console(&["--safety-margin", "20s"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--safety-margin (20s) must be below --lease-expiry (10s)"),
        "{err}"
    );
    let (code, err) = console(&["--refresh", "soon"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--refresh: \"soon\" is not a duration"),
        "{err}"
    );
    let (code, err) = console(&["--heartbeats-every", "often"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--heartbeats-every: \"often\" is not a duration"),
        "{err}"
    );
    let (code, err) = console(&["--group", "a/b"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--group"), "{err}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let (code, err) = console(&["--listen", &addr]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("--listen: serving the console on {addr}")),
        "{err}"
    );
}

#[test]
fn demo_console_serves_the_demo_fleet_and_says_what_it_cost() {
    // `changefeed demo --console`: the console of the demo's own fleet while it runs, and its
    // store cost before the result; the demo's verdict is unchanged.
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut cmd = bin();
    cmd.args([
        "demo",
        "--duration",
        "6",
        "--partitions",
        "4",
        "--hosts",
        "2",
    ])
    .args(["--seed", "5", "--console", "127.0.0.1:0", "--db"])
    .arg(dir.path().join("demo.db"));
    let (demo, addr, lines) = start_and_read(cmd, "changefeed demo --console", |l| {
        l.strip_prefix("console: ").and_then(served_at)
    });
    let mut procs = Procs::default();
    procs.add("demo", demo);
    let port = port_of(&addr);
    wait_for(
        Duration::from_secs(30),
        "the demo's 4 leases owned in the console",
        || {
            let v: Value = serde_json::from_str(&get(port, "/api/leases")?.body).ok()?;
            let leases = v["leases"].as_array()?;
            (leases.iter().filter(|l| l["owner"].is_string()).count() >= 4).then_some(())
        },
    );
    // The rest of its output, to its end (bounded: the demo drains and stops within 60 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut rest: Vec<String> = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => rest.push(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("the demo did not end: {rest:?}"),
        }
    }
    let cost = rest
        .iter()
        .find(|l| l.starts_with("console store cost: "))
        .unwrap_or_else(|| panic!("no cost line: {rest:?}"));
    assert!(
        cost.contains(" refreshes, ") && cost.contains(" full lists"),
        "{cost}"
    );
    let last = rest.last().map(String::as_str).unwrap_or_default();
    assert!(
        last.starts_with("RESULT written=") && last.contains(" lost=0 reordered=0"),
        "{rest:?}"
    );
}
