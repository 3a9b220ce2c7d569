//! The harness of the socket-fault fleet scenarios on real `changefeed run` processes
//! (`faults_dynamodb`, `faults_cosmos`, `faults_kinesis`): three hosts with the processor's
//! default timings, each reaching its lease store (or its feed source) through a
//! [`FaultProxy`] of its own, while a writer appends records.
//!
//! Every batch the handler gets is written to a file of its own, named by the machine's clock
//! in nanoseconds (`date +%s%N`, the clock the test reads) and the host, so that the ledger
//! needs no locking. At the end the ledger must show every record delivered, each key's first
//! deliveries in order, and duplicates only at the start of an ownership run, at most one batch
//! each: two hosts delivering one partition at once would deliver the same new records twice
//! in the middle of a run. A host cut off from its store must stop delivering before another
//! host starts on its partitions.
//!
//! Recovery is measured from the fault's end: to the host heartbeating again (its `/readyz`
//! is 200 only while its last counted heartbeat is fresh), to it holding a lease again (the
//! store's listing, read directly), and for a cut source to it delivering again.
//!
//! To look into a failure: `CHANGEFEED_TEST_FAULTS_KEEP=1` keeps the hosts' logs and the ledger
//! (the path is printed), and `CHANGEFEED_TEST_FAULTS_LOG` sets the hosts' `RUST_LOG` (e.g.
//! `info,aws_smithy_runtime=debug,hyper_util=trace`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, LeaseState};
use changefeed::testkit::net::FaultProxy;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::health::free_port;
use crate::support::bin;

/// The group every host runs in.
pub(crate) const GROUP: &str = "g";
/// The processor's defaults, which these scenarios check (`Settings::default()`).
pub(crate) const LEASE_EXPIRY: Duration = Duration::from_secs(10);
pub(crate) const RENEW_INTERVAL: Duration = Duration::from_secs(2);
pub(crate) const ACQUIRE_INTERVAL: Duration = Duration::from_secs(2);
/// `lease_expiry − safety_margin`.
pub(crate) const FENCE_AFTER: Duration = Duration::from_secs(8);
/// At most this many records a batch.
pub(crate) const MAX_BATCH: usize = 50;
/// Scheduling slack of a loaded 2-core machine and of the 100 ms polls, on top of a bound.
pub(crate) const SLACK: Duration = Duration::from_millis(1500);

/// Nanoseconds since the epoch, the handler's clock.
pub(crate) fn now_ns() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos(),
    )
    .expect("fits")
}

/// `url`'s `host:port` (an `http://` endpoint).
pub(crate) fn host_port(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_string()
}

/// One delivery as the handler recorded it.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    pub(crate) at_ns: i64,
    pub(crate) host: String,
    pub(crate) partition: String,
    pub(crate) key: String,
    pub(crate) seq: i64,
}

struct Host {
    child: Child,
    http: u16,
}

/// The hosts, their proxies, the ledger directory, a direct store handle and a timeline.
pub(crate) struct FaultFleet {
    pub(crate) name: &'static str,
    dir: tempfile::TempDir,
    handler: String,
    store: Arc<dyn LeaseStore>,
    group: GroupName,
    hosts: BTreeMap<String, Host>,
    pub(crate) proxies: BTreeMap<String, FaultProxy>,
    started: Instant,
    timeline: Vec<String>,
    /// Measured recoveries, for the report at the end.
    pub(crate) measured: Vec<String>,
}

impl FaultFleet {
    pub(crate) fn new(name: &'static str, store: Arc<dyn LeaseStore>) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let batches = dir.path().join("batches");
        std::fs::create_dir(&batches).expect("batch directory");
        let script = dir.path().join("handler.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n# One batch of JSON lines on stdin -> one file, named by the clock and the host.\n\
                 f='{}'/$(date +%s%N)-$CHANGEFEED_HOST-$$\n\
                 cat > \"$f.tmp\" && mv \"$f.tmp\" \"$f.batch\"\n",
                batches.display()
            ),
        )
        .expect("write the handler");
        Self {
            name,
            handler: format!("sh '{}'", script.display()),
            dir,
            store,
            group: GroupName::new(GROUP).expect("group"),
            hosts: BTreeMap::new(),
            proxies: BTreeMap::new(),
            started: Instant::now(),
            timeline: Vec::new(),
            measured: Vec::new(),
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn note(&mut self, what: impl Into<String>) {
        let line = format!(
            "{:>7.2}s {}",
            self.started.elapsed().as_secs_f64(),
            what.into()
        );
        eprintln!("{}: {line}", self.name);
        self.timeline.push(line);
    }

    /// Records a measured recovery (printed at the end, and in the timeline).
    pub(crate) fn measure(&mut self, what: String) {
        self.note(format!("measured: {what}"));
        self.measured.push(what);
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Starts host `name` on `store` and `source` with the processor's default timings, a
    /// 200 ms poll delay, batches of at most [`MAX_BATCH`] and `/readyz` on a port of its own.
    pub(crate) fn start(&mut self, name: &str, store: &str, source: &str) {
        let log = std::fs::File::create(self.log(name)).expect("log file");
        let http = free_port();
        let child = bin()
            .args(["run", "--store", store, "--source", source])
            .args(["--group", GROUP, "--host", name, "--handler", &self.handler])
            .args(["--http", &format!("127.0.0.1:{http}")])
            .args(["--poll-delay", "200ms", "--max-batch-size"])
            .arg(MAX_BATCH.to_string())
            .args(["--handler-max-retries", "1000"])
            .env(
                "RUST_LOG",
                std::env::var("CHANGEFEED_TEST_FAULTS_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("CHANGEFEED_COSMOS_KEY", "")
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start changefeed run");
        self.hosts.insert(name.to_string(), Host { child, http });
        self.note(format!("started {name}"));
    }

    /// Whether `name`'s `/readyz` is 200: registered, and its last counted heartbeat fresh.
    /// (Asynchronous, with a 1 s limit: a blocking probe would stall a worker of the test's
    /// runtime, which also runs the proxies.)
    pub(crate) async fn ready(&self, name: &str) -> bool {
        let port = self.hosts[name].http;
        let probe = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()?;
            s.write_all(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut text = Vec::new();
            s.read_to_end(&mut text).await.ok()?;
            Some(text.starts_with(b"HTTP/1.1 200"))
        };
        tokio::time::timeout(Duration::from_secs(1), probe)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    /// Partition → owner of every owned lease; empty while the store does not answer.
    pub(crate) async fn owners(&self) -> BTreeMap<String, String> {
        match self.store.list(&self.group).await {
            Ok(listing) => listing
                .leases
                .iter()
                .filter(|l| l.state == LeaseState::Owned)
                .filter_map(|l| Some((l.key.partition.to_string(), l.owner.as_ref()?.to_string())))
                .collect(),
            Err(_) => BTreeMap::new(),
        }
    }

    /// Every delivery so far, in the order delivered (by the handler's clock, then within a
    /// batch).
    pub(crate) fn deliveries(&self) -> Vec<Delivery> {
        let mut out = Vec::new();
        let dir = self.dir.path().join("batches");
        let mut files: Vec<(i64, String, PathBuf)> = std::fs::read_dir(&dir)
            .expect("batch directory")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "batch"))
            .filter_map(|p| {
                let stem = p.file_stem()?.to_str()?.to_string();
                let mut parts = stem.splitn(2, '-');
                let at: i64 = parts.next()?.parse().ok()?;
                let rest = parts.next()?;
                let host = rest.rsplit_once('-').map(|(h, _)| h.to_string())?;
                Some((at, host, p))
            })
            .collect();
        files.sort();
        for (at_ns, host, path) in files {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for line in text.lines().filter(|l| !l.is_empty()) {
                let v: serde_json::Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("{}: {e}: {line}", path.display()));
                out.push(Delivery {
                    at_ns,
                    host: host.clone(),
                    partition: v["partition"].as_str().unwrap_or_default().to_string(),
                    key: v["key"].as_str().unwrap_or_default().to_string(),
                    seq: v["data"]
                        .as_str()
                        .and_then(|d| d.parse().ok())
                        .unwrap_or_else(|| panic!("a sequence number as data: {line}")),
                });
            }
        }
        out
    }

    /// The last lines of every host's log, for a failure message.
    pub(crate) fn logs(&self) -> String {
        let mut out = String::new();
        for name in self.hosts.keys() {
            let text = std::fs::read_to_string(self.log(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(25)..];
            out.push_str(&format!(
                "--- {name} ({}):\n{}\n",
                self.log(name).display(),
                tail.join("\n")
            ));
        }
        out
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "{}: {what}\ntimeline:\n{}\n{}",
            self.name,
            self.timeline.join("\n"),
            self.logs()
        )
    }

    /// Polls `check` every 100 ms until it returns `Some`; fails after `limit` with the
    /// timeline and the hosts' logs.
    pub(crate) async fn until<T>(
        &mut self,
        limit: Duration,
        what: &str,
        mut check: impl AsyncFnMut(&Self) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check(self).await {
                self.note(format!("ok: {what}"));
                return v;
            }
            if Instant::now() >= deadline {
                let owners = self.owners().await;
                self.fail(&format!(
                    "timed out after {limit:?} waiting for {what}; owners {owners:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until all `partitions` are owned, each host owns at least one, and every host
    /// is ready.
    pub(crate) async fn settled(&mut self, partitions: usize, what: &str) {
        let hosts: Vec<String> = self.hosts.keys().cloned().collect();
        self.until(Duration::from_secs(90), what, async |f| {
            let owners = f.owners().await;
            let all = owners.len() == partitions
                && hosts.iter().all(|h| owners.values().any(|o| o == h))
                && futures_all_ready(f, &hosts).await;
            all.then_some(())
        })
        .await;
    }

    /// From `since` (the fault's end), how long until `host` is ready (heartbeating), and
    /// until it also owns a lease; fails after `limit`.
    pub(crate) async fn recovery(
        &mut self,
        host: &str,
        since: Instant,
        limit: Duration,
    ) -> (Duration, Duration) {
        let deadline = since + limit;
        let mut heartbeat = None;
        loop {
            if heartbeat.is_none() && self.ready(host).await {
                heartbeat = Some(since.elapsed());
            }
            if let Some(hb) = heartbeat {
                if self.owners().await.values().any(|o| o == host) {
                    return (hb, since.elapsed());
                }
            }
            if Instant::now() >= deadline {
                self.fail(&format!(
                    "{host} did not heartbeat (at {heartbeat:?}) and hold a lease again within {limit:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How long after `since_ns` (the machine's clock) `host` logged its first line
    /// containing `needle` (the log's RFC 3339 timestamps are the same clock).
    pub(crate) fn logged_after(&self, host: &str, needle: &str, since_ns: i64) -> Option<Duration> {
        let text = std::fs::read_to_string(self.log(host)).unwrap_or_default();
        text.lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| {
                let stamp = l.split_whitespace().next()?;
                let at = humantime::parse_rfc3339(stamp).ok()?;
                let at_ns = i64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_nanos()).ok()?;
                (at_ns > since_ns).then(|| Duration::from_nanos((at_ns - since_ns) as u64))
            })
            .next()
    }

    /// From `since_ns`, when `host` logged its first counted heartbeat: "fence lowered" (a
    /// renewal that counted after a fence) or "registered again" (its row had been removed).
    pub(crate) fn heartbeat_logged_after(&self, host: &str, since_ns: i64) -> Option<Duration> {
        let lowered = self.logged_after(host, "fence lowered", since_ns);
        let registered = self.logged_after(host, "registered again", since_ns);
        match (lowered, registered) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// From `since`, how long until `host` delivers a batch stamped after `since_ns`.
    pub(crate) async fn delivering_again(
        &mut self,
        host: &str,
        since: Instant,
        since_ns: i64,
        limit: Duration,
    ) -> Duration {
        let deadline = since + limit;
        loop {
            if self
                .deliveries()
                .iter()
                .any(|d| d.host == host && d.at_ns > since_ns)
            {
                return since.elapsed();
            }
            if Instant::now() >= deadline {
                self.fail(&format!("{host} did not deliver again within {limit:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every record `written` counts (key → records 0..n) was delivered.
    pub(crate) async fn all_delivered(&mut self, written: &HashMap<String, i64>) {
        let total: i64 = written.values().sum();
        self.note(format!("writer stopped after {total} records"));
        self.until(
            Duration::from_secs(60),
            "every record delivered",
            async |f| {
                let rows = f.deliveries();
                let seen: BTreeSet<(&str, i64)> =
                    rows.iter().map(|d| (d.key.as_str(), d.seq)).collect();
                written
                    .iter()
                    .all(|(k, n)| (0..*n).all(|q| seen.contains(&(k.as_str(), q))))
                    .then_some(())
            },
        )
        .await;
    }

    /// A host cut off from its store at `cut_ns` delivered none of the partitions it owned
    /// then after another host's first delivery of them after the cut (it fenced first).
    pub(crate) fn check_fenced_before_takeover(
        &mut self,
        host: &str,
        partitions: &BTreeSet<String>,
        cut_ns: i64,
    ) {
        let rows = self.deliveries();
        for p in partitions {
            let first_other = rows
                .iter()
                .filter(|d| &d.partition == p && d.host != host && d.at_ns > cut_ns)
                .map(|d| d.at_ns)
                .min();
            let last_cut = rows
                .iter()
                .filter(|d| &d.partition == p && d.host == host && d.at_ns > cut_ns)
                .map(|d| d.at_ns)
                .max();
            self.note(format!(
                "partition {p}: {host}'s last delivery {:?} ms after the cut, the next owner's first {:?} ms after",
                last_cut.map(|t| (t - cut_ns) / 1_000_000),
                first_other.map(|t| (t - cut_ns) / 1_000_000)
            ));
            if let (Some(last), Some(first)) = (last_cut, first_other) {
                if last >= first {
                    self.fail(&format!(
                        "cut-off {host} delivered partition {p} at {last}, after another host began at {first}"
                    ));
                }
            }
            if let Some(last) = last_cut {
                let fence_ns = i64::try_from(FENCE_AFTER.as_nanos()).expect("fits");
                if last - cut_ns > fence_ns {
                    self.fail(&format!(
                        "{host} delivered {} ms after its store was cut off, past its fence ({FENCE_AFTER:?})",
                        (last - cut_ns) / 1_000_000
                    ));
                }
            }
        }
    }

    /// The ledger's rules: each key's first deliveries in order 0..n, duplicates only at the
    /// start of an ownership run of a partition and at most one batch of them.
    pub(crate) fn check_ledger(&mut self, written: &HashMap<String, i64>) {
        let rows = self.deliveries();
        let mut firsts: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        let mut seen: BTreeSet<(&str, i64)> = BTreeSet::new();
        // partition → (host, duplicates in this run, past the run's duplicate prefix)
        let mut runs: BTreeMap<&str, (String, usize, bool)> = BTreeMap::new();
        let (mut duplicates, mut changes) = (0usize, 0usize);
        for d in &rows {
            let first = seen.insert((d.key.as_str(), d.seq));
            let run = runs
                .entry(d.partition.as_str())
                .or_insert_with(|| (d.host.clone(), 0, false));
            if run.0 != d.host {
                *run = (d.host.clone(), 0, false);
                changes += 1;
            }
            if first {
                firsts.entry(d.key.as_str()).or_default().push(d.seq);
                run.2 = true;
            } else {
                duplicates += 1;
                run.1 += 1;
                if run.2 {
                    self.fail(&format!(
                        "duplicate {}#{} by {} in partition {} after that host had delivered new records: not at an ownership change (two owners at once?)",
                        d.key, d.seq, d.host, d.partition
                    ));
                }
                if run.1 > MAX_BATCH {
                    self.fail(&format!(
                        "more than one batch ({MAX_BATCH}) of duplicates after an ownership change in partition {}",
                        d.partition
                    ));
                }
            }
        }
        for (key, n) in written {
            let expected: Vec<i64> = (0..*n).collect();
            let got = firsts.get(key.as_str()).cloned().unwrap_or_default();
            if got != expected {
                self.fail(&format!(
                    "key {key}'s first deliveries are not 0..{n} in order: {got:?}"
                ));
            }
        }
        self.note(format!(
            "ledger: {} deliveries, {duplicates} duplicates over {changes} ownership changes",
            rows.len()
        ));
    }

    /// SIGTERM to every host; each must exit 0 within 20 s.
    pub(crate) async fn stop_all(&mut self) {
        for host in self.hosts.values() {
            let pid = Pid::from_raw(i32::try_from(host.child.id()).expect("pid"));
            let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
        }
        let names: Vec<String> = self.hosts.keys().cloned().collect();
        for name in names {
            let deadline = Instant::now() + Duration::from_secs(20);
            let status = loop {
                let child = &mut self.hosts.get_mut(&name).expect("host").child;
                if let Some(status) = child.try_wait().expect("try_wait") {
                    break status;
                }
                if Instant::now() >= deadline {
                    self.fail(&format!("{name} did not stop within 20 s of SIGTERM"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            if !status.success() {
                self.fail(&format!("{name} exits 0 after SIGTERM, not {status}"));
            }
        }
        self.note("every host stopped gracefully");
    }
}

impl Drop for FaultFleet {
    fn drop(&mut self) {
        if std::env::var_os("CHANGEFEED_TEST_FAULTS_KEEP").is_some() {
            let kept = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            eprintln!("{}: kept {}", self.name, kept.keep().display());
        }
        for host in self.hosts.values_mut() {
            if let Ok(pid) = i32::try_from(host.child.id()) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = host.child.wait();
        }
        if !self.measured.is_empty() {
            eprintln!(
                "{}: recoveries measured:\n  {}",
                self.name,
                self.measured.join("\n  ")
            );
        }
    }
}

async fn futures_all_ready(f: &FaultFleet, hosts: &[String]) -> bool {
    for h in hosts {
        if !f.ready(h).await {
            return false;
        }
    }
    true
}

/// Which path the proxies cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Each host's path to its lease store.
    Store,
    /// Each host's path to its feed source (the store is reached directly).
    Source,
}

/// The two scenarios on a settled fleet of `h1`, `h2`, `h3` (each behind `fleet.proxies`):
///
/// 1. `h3` black-holed past the lease expiry, healed forgetting its held flows, and half a
///    second later every connection of its path reset;
/// 2. every host black-holed at once past the lease expiry, then healed.
///
/// `heartbeat_bound` and `lease_bound` are the stated recoveries from the fault's end.
pub(crate) async fn black_hole_scenarios(
    f: &mut FaultFleet,
    partitions: usize,
    cut: Cut,
    heartbeat_bound: Duration,
    lease_bound: Duration,
    read_bound: Duration,
) {
    // 1. One host.
    let before = f.owners().await;
    let h3_partitions: BTreeSet<String> = before
        .iter()
        .filter(|(_, o)| o.as_str() == "h3")
        .map(|(p, _)| p.clone())
        .collect();
    let cut_ns = now_ns();
    f.proxies["h3"].black_hole();
    f.note(format!(
        "black-holed h3 ({cut:?}); it owns {h3_partitions:?}"
    ));
    match cut {
        Cut::Store => {
            let taken = h3_partitions.clone();
            f.until(
                LEASE_EXPIRY + Duration::from_secs(30),
                "h3's leases taken by the others",
                async |f| {
                    let owners = f.owners().await;
                    taken
                        .iter()
                        .all(|p| owners.get(p).is_some_and(|o| o != "h3"))
                        .then_some(())
                },
            )
            .await;
            if f.ready("h3").await {
                f.fail("h3 cut off from its store still says it is ready");
            }
        }
        Cut::Source => {}
    }
    let past_expiry = Duration::from_nanos(u64::try_from(now_ns() - cut_ns).expect("positive"));
    tokio::time::sleep((LEASE_EXPIRY + Duration::from_secs(2)).saturating_sub(past_expiry)).await;
    if cut == Cut::Source {
        // The store is fine: h3 heartbeats and keeps its leases, though it reads nothing.
        let owners = f.owners().await;
        let kept = h3_partitions
            .iter()
            .all(|p| owners.get(p).is_some_and(|o| o == "h3"));
        if !kept || !f.ready("h3").await {
            f.fail("h3, whose source only was cut, lost its leases or its heartbeat");
        }
    }
    let healed = Instant::now();
    let healed_ns = now_ns();
    f.proxies["h3"].pass_forgetting_held();
    f.note("healed h3's path, forgetting its held flows");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reset = Instant::now();
    let reset_ns = now_ns();
    f.proxies["h3"].reset_all();
    f.note("reset every connection of h3's path");
    match cut {
        Cut::Store => {
            let (probe, lease) = f.recovery("h3", reset, lease_bound + SLACK).await;
            let hb = f
                .heartbeat_logged_after("h3", healed_ns)
                .unwrap_or_else(|| {
                    f.fail("h3 is ready but logged no counted heartbeat after the heal")
                });
            f.measure(format!(
                "one host black-holed {:.1} s then healed (forgetting held flows) and reset 0.5 s later: heartbeating {:.2} s after the heal (logged; /readyz 200 {:.2} s after the reset), holding a lease {:.2} s after the heal",
                (healed_ns - cut_ns) as f64 / 1e9,
                hb.as_secs_f64(),
                probe.as_secs_f64(),
                (reset - healed + lease).as_secs_f64()
            ));
            // The heartbeat is counted from the heal or the reset, whichever ended the fault
            // for the renewal that counted.
            let gap = Duration::from_nanos(u64::try_from(reset_ns - healed_ns).expect("after"));
            let hb = if hb > gap { hb - gap } else { hb };
            if hb > heartbeat_bound + SLACK {
                f.fail(&format!(
                    "h3 heartbeated again {hb:?} after the reset, past the stated {heartbeat_bound:?}"
                ));
            }
            f.check_fenced_before_takeover("h3", &h3_partitions, cut_ns);
        }
        Cut::Source => {
            let again = f
                .delivering_again("h3", healed, reset_ns, read_bound + SLACK)
                .await;
            f.measure(format!(
                "one host's source black-holed {:.1} s then healed (forgetting held flows) and reset 0.5 s later: delivering again {:.2} s after the heal; heartbeating and holding its leases throughout",
                (healed_ns - cut_ns) as f64 / 1e9,
                again.as_secs_f64()
            ));
        }
    }
    f.settled(partitions, "every host holds leases again after h3's fault")
        .await;

    // 2. Every host at once.
    let cut_ns = now_ns();
    for p in f.proxies.values() {
        p.black_hole();
    }
    f.note("black-holed every host");
    tokio::time::sleep(LEASE_EXPIRY + Duration::from_secs(2)).await;
    if cut == Cut::Store {
        for h in ["h1", "h2", "h3"] {
            if f.ready(h).await {
                f.fail(&format!(
                    "{h}, cut off from its store, still says it is ready"
                ));
            }
        }
    }
    let healed = Instant::now();
    let healed_ns = now_ns();
    for p in f.proxies.values() {
        p.pass();
    }
    f.note("healed every host's path");
    for h in ["h1", "h2", "h3"] {
        match cut {
            Cut::Store => {
                let (probe, lease) = f.recovery(h, healed, lease_bound + SLACK).await;
                let hb = f.heartbeat_logged_after(h, healed_ns).unwrap_or_else(|| {
                    f.fail(&format!(
                        "{h} is ready but logged no counted heartbeat after the heal"
                    ))
                });
                f.measure(format!(
                    "every host black-holed {:.1} s then healed: {h} heartbeating {:.2} s after the heal (logged; /readyz 200 at {:.2} s), holding a lease {:.2} s after",
                    (healed_ns - cut_ns) as f64 / 1e9,
                    hb.as_secs_f64(),
                    probe.as_secs_f64(),
                    lease.as_secs_f64()
                ));
                if hb > heartbeat_bound + SLACK {
                    f.fail(&format!(
                        "{h} heartbeated again {hb:?} after the heal, past the stated {heartbeat_bound:?}"
                    ));
                }
            }
            Cut::Source => {
                let again = f
                    .delivering_again(h, healed, healed_ns, read_bound + SLACK)
                    .await;
                f.measure(format!(
                    "every host's source black-holed {:.1} s then healed: {h} delivering again {:.2} s after the heal",
                    (healed_ns - cut_ns) as f64 / 1e9,
                    again.as_secs_f64()
                ));
            }
        }
    }
    f.settled(
        partitions,
        "every host holds leases again after the fleet's fault",
    )
    .await;
}
