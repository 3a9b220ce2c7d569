//! `faults`: a fleet of real `changefeed run` processes, each reaching its lease store (and its
//! source) through a [`FaultProxy`] of its own, put through a network or server fault; measures
//! how long after the fault ends each host heartbeats and delivers again, and checks what was
//! delivered.
//!
//! The scenarios ([`Scenario`]) are the faults operators meet: one host black-holed past the
//! lease expiry (the path comes back, but flows that lived through the black hole stay dead,
//! as behind a NAT or load balancer that lost their state), the same followed by a server
//! restart (every connection reset, new ones refused for a moment) or by every connection of
//! that host's path reset just after the heal, every host black-holed at once, a store slower
//! than the request timeout for a while, and the source cut (one host's, with or without a
//! reset after the heal, or every host's) while the store is fine.
//!
//! What is checked, from a ledger the handler writes (one file per batch, stamped with this
//! machine's clock at the start and end of the handler): every record written is delivered,
//! each key's first deliveries are in order, and no two hosts run the handler on one
//! partition at the same time. What is measured, from the store read directly every 100 ms
//! and the ledger: the seconds from the fault's end to each faulted host's next heartbeat
//! (`heartbeat_s`) and to its next delivery (`recovery_s`). The fault ends with its last
//! disturbance: for `cut-then-restart` and the `…-then-reset` scenarios, when the restart or
//! the reset is done.
//!
//! The lease store is any backend `changefeed run` takes a URL for (given with the address the
//! proxies forward to); the source ([`SourceBackend`]) is a PostgreSQL outbox or a Kinesis
//! stream, either with any store.
//!
//! The hosts' logs, the handler and the ledger are kept in the temporary directory named in
//! [`Setup::dir`] (a failure's message quotes the logs' last lines and their paths).

mod ledger;
mod setup;
mod source;
mod watch;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use changefeed::lease::LeaseStore;
use changefeed::model::GroupName;
use changefeed::testkit::net::FaultProxy;
use tokio::time::Instant;

pub use ledger::Checked;
pub use setup::{setup, StoreBackend};
pub use source::SourceBackend;
use source::Writer;
use watch::Watcher;

/// A fault, played on the hosts' paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// One host's store path black-holed past the lease expiry, then back (forgetting held flows).
    CutOne,
    /// [`Scenario::CutOne`], then shortly after the heal the server restarts: every host's
    /// connections reset, new ones refused for a moment.
    CutThenRestart,
    /// Every host's store path black-holed at once past the expiry, then back.
    CutAll,
    /// Every host's store answers later than the request timeout for a while, then normally.
    SlowStore,
    /// One host's source path black-holed past the expiry while its store is fine, then back.
    SourceCut,
    /// [`Scenario::CutOne`], then [`Timings::reset`] after the heal every connection of that
    /// host's store path reset (a middlebox dropping the flows it had kept through the cut).
    CutThenReset,
    /// [`Scenario::SourceCut`], then [`Timings::reset`] after the heal every connection of
    /// that host's source path reset.
    SourceCutThenReset,
    /// Every host's source path black-holed at once past the expiry while the store is fine,
    /// then back.
    SourceCutAll,
}

impl Scenario {
    /// Every scenario, in the order `faults` runs them.
    pub const ALL: [Scenario; 8] = [
        Scenario::CutOne,
        Scenario::CutThenRestart,
        Scenario::CutAll,
        Scenario::SlowStore,
        Scenario::SourceCut,
        Scenario::CutThenReset,
        Scenario::SourceCutThenReset,
        Scenario::SourceCutAll,
    ];

    /// The name used on the command line and in RESULT lines.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::CutOne => "cut-one",
            Scenario::CutThenRestart => "cut-then-restart",
            Scenario::CutAll => "cut-all",
            Scenario::SlowStore => "slow-store",
            Scenario::SourceCut => "source-cut",
            Scenario::CutThenReset => "cut-then-reset",
            Scenario::SourceCutThenReset => "source-cut-then-reset",
            Scenario::SourceCutAll => "source-cut-all",
        }
    }

    /// Whether only the source is faulted (the store is fine throughout): the faulted hosts
    /// must keep their leases.
    pub fn cuts_the_source(self) -> bool {
        matches!(
            self,
            Scenario::SourceCut | Scenario::SourceCutThenReset | Scenario::SourceCutAll
        )
    }

    /// The scenario named `name`.
    pub fn parse(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// The processor's timings the hosts run with, and how long each fault lasts.
#[derive(Debug, Clone)]
pub struct Timings {
    /// `--lease-expiry`.
    pub lease_expiry: Duration,
    /// `--safety-margin`.
    pub safety_margin: Duration,
    /// `--renew-interval`.
    pub renew_interval: Duration,
    /// `--acquire-interval`.
    pub acquire_interval: Duration,
    /// How long a black hole lasts (past the expiry, so leases move).
    pub cut: Duration,
    /// How long a slow store stays slow, and by how much each answer is late.
    pub slow: (Duration, Duration),
    /// After the heal, when the server restarts, and for how long it refuses connections.
    pub restart: (Duration, Duration),
    /// After the heal, when the faulted path's connections are reset (the `…-then-reset`
    /// scenarios).
    pub reset: Duration,
    /// How long the handler takes per batch.
    pub handler_delay: Duration,
}

impl Timings {
    /// The processor's defaults (10 s expiry, 2 s renewals), with faults to match.
    pub fn defaults() -> Timings {
        Timings {
            lease_expiry: Duration::from_secs(10),
            safety_margin: Duration::from_secs(2),
            renew_interval: Duration::from_secs(2),
            acquire_interval: Duration::from_secs(2),
            cut: Duration::from_secs(15),
            slow: (Duration::from_secs(20), Duration::from_secs(8)),
            restart: (Duration::from_secs(5), Duration::from_secs(3)),
            reset: Duration::from_millis(500),
            handler_delay: Duration::from_millis(200),
        }
    }

    /// Short timings for a quick run (3 s expiry, 0.5 s renewals).
    pub fn quick() -> Timings {
        Timings {
            lease_expiry: Duration::from_secs(3),
            safety_margin: Duration::from_secs(1),
            renew_interval: Duration::from_millis(500),
            acquire_interval: Duration::from_secs(1),
            cut: Duration::from_secs(5),
            slow: (Duration::from_secs(6), Duration::from_secs(3)),
            restart: (Duration::from_secs(2), Duration::from_secs(1)),
            reset: Duration::from_millis(500),
            handler_delay: Duration::from_millis(100),
        }
    }

    fn args(&self) -> Vec<String> {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        [
            ("--lease-expiry", ms(self.lease_expiry)),
            ("--safety-margin", ms(self.safety_margin)),
            ("--renew-interval", ms(self.renew_interval)),
            ("--acquire-interval", ms(self.acquire_interval)),
            ("--sync-interval", ms(self.acquire_interval * 2)),
            ("--poll-delay", "200ms".to_string()),
            ("--max-batch-size", "50".to_string()),
            ("--handler-max-retries", "1000000".to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

/// Where the fleet runs.
pub struct Setup {
    /// The `changefeed` binary.
    pub changefeed: PathBuf,
    /// The backend's name, for RESULT lines.
    pub backend: String,
    /// The lease store URL with `{addr}` where the server's `host:port` goes.
    pub store_url: String,
    /// The server's `host:port` the store proxies forward to.
    pub store_upstream: String,
    /// The lease store, read directly (not through a proxy) to watch heartbeats and owners.
    pub store: Arc<dyn LeaseStore>,
    /// The source.
    pub source: SourceBackend,
    /// The source URL (`postgres-outbox://…`, `kinesis://…`) with `{addr}` where the server's
    /// `host:port` goes.
    pub source_url: String,
    /// A plain URL of the PostgreSQL database, for the outbox's writer.
    pub pg_url: String,
    /// `host:port` of the source's server.
    pub source_upstream: String,
    /// The group's table prefix (the outbox and, for PostgreSQL, the lease tables), and the
    /// Kinesis stream's name.
    pub prefix: String,
    /// Hosts in the fleet.
    pub hosts: usize,
    /// Partitions of the source (the outbox's, or the stream's shards).
    pub partitions: u32,
    /// Timings.
    pub timings: Timings,
    /// Where the ledger and logs go.
    pub dir: PathBuf,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("backend", &self.backend)
            .field("store_upstream", &self.store_upstream)
            .field("source", &self.source)
            .field("hosts", &self.hosts)
            .field("partitions", &self.partitions)
            .field("timings", &self.timings)
            .finish_non_exhaustive()
    }
}

/// What one scenario measured and found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The scenario.
    pub scenario: Scenario,
    /// The source's name (`--source`).
    pub source: &'static str,
    /// Per faulted host: seconds from the fault's end to its next heartbeat.
    pub heartbeat_s: BTreeMap<String, f64>,
    /// Per faulted host: seconds from the fault's end to its next delivery.
    pub recovery_s: BTreeMap<String, f64>,
    /// For the source cuts: whether every host cut off from its source kept every lease it
    /// held, releasing none, through the cut (`None`: not asked).
    pub kept_leases: Option<bool>,
    /// The ledger's verdict.
    pub checked: Checked,
    /// Hosts that did not exit 0 within 10 s of SIGTERM at the end.
    pub unclean_stops: Vec<String>,
}

impl Outcome {
    /// The slowest host's recovery (to delivering again).
    pub fn recovery_s_max(&self) -> f64 {
        self.recovery_s.values().copied().fold(0.0, f64::max)
    }

    /// The slowest host's first heartbeat after the fault.
    pub fn heartbeat_s_max(&self) -> f64 {
        self.heartbeat_s.values().copied().fold(0.0, f64::max)
    }

    /// The RESULT line.
    pub fn result_line(&self, backend: &str) -> String {
        format!(
            "RESULT backend={backend} scenario={} recovery_s_max={:.1} heartbeat_s_max={:.1} lost={} overlapping={} reordered={} duplicates={} written={} hosts_recovered={}/{}{} source={}",
            self.scenario.name(),
            self.recovery_s_max(),
            self.heartbeat_s_max(),
            self.checked.lost,
            self.checked.overlapping,
            self.checked.reordered,
            self.checked.duplicates,
            self.checked.written,
            self.recovery_s.len(),
            self.heartbeat_s.len().max(self.recovery_s.len()),
            self.kept_leases
                .map(|k| format!(" kept_leases={k}"))
                .unwrap_or_default(),
            self.source,
        )
    }
}

const GROUP: &str = "faults";

/// One host: its process and the proxies in front of its store and source.
struct Host {
    child: Child,
    store: FaultProxy,
    source: FaultProxy,
}

/// The fleet's processes; dropping it kills them.
struct Fleet {
    hosts: BTreeMap<String, Host>,
    dir: PathBuf,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for host in self.hosts.values_mut() {
            let _ = host.child.kill();
            let _ = host.child.wait();
        }
    }
}

impl Fleet {
    fn logs(&self) -> String {
        let mut out = String::new();
        for name in self.hosts.keys() {
            let path = self.dir.join(format!("{name}.log"));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(12)..];
            out.push_str(&format!(
                "--- {name} ({}):\n{}\n",
                path.display(),
                tail.join("\n")
            ));
        }
        out
    }
}

fn handler_script(dir: &Path, delay: Duration) -> anyhow::Result<String> {
    let ledger = dir.join("ledger");
    std::fs::create_dir_all(&ledger)?;
    let script = dir.join("handler.sh");
    // One file per batch: "<start_ms> <end_ms> <host> <json line>" per record.
    let text = format!(
        "#!/bin/sh\nstart=$(date +%s%3N)\nbatch=$(cat)\nsleep {delay}\nend=$(date +%s%3N)\n\
         printf '%s\\n' \"$batch\" | sed \"s/^/$start $end $CHANGEFEED_HOST /\" > '{ledger}/'\"$start-$$.txt\"\n",
        delay = delay.as_secs_f64(),
        ledger = ledger.display()
    );
    std::fs::write(&script, text)?;
    Ok(format!("sh '{}'", script.display()))
}

/// Runs `scenario` on a fresh fleet and returns what it measured and found. Fails (with the
/// hosts' logs) when the fleet does not settle before the fault or a host does not recover
/// within `recover_within` of the fault's end.
pub async fn run(
    setup: &Setup,
    scenario: Scenario,
    recover_within: Duration,
) -> anyhow::Result<Outcome> {
    let t = &setup.timings;
    let group = GroupName::new(GROUP).context("group name")?;
    let writer = Writer::prepare(setup).await?;
    let handler = handler_script(&setup.dir, t.handler_delay)?;
    let mut fleet = Fleet {
        hosts: BTreeMap::new(),
        dir: setup.dir.clone(),
    };
    for i in 0..setup.hosts {
        let name = format!("h{i}");
        let store = FaultProxy::start(setup.store_upstream.clone()).await?;
        let source = FaultProxy::start(setup.source_upstream.clone()).await?;
        let log = std::fs::File::create(setup.dir.join(format!("{name}.log")))?;
        let mut command = std::process::Command::new(&setup.changefeed);
        // Only the flags below configure the host, not this process's environment.
        for (k, _) in std::env::vars() {
            if k.starts_with("CHANGEFEED_") {
                command.env_remove(k);
            }
        }
        // Local AWS endpoints take any credentials; never ask the instance-metadata address.
        command
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_EC2_METADATA_DISABLED", "true");
        let child = command
            .arg("run")
            .arg("--store")
            .arg(setup.store_url.replace("{addr}", &store.addr().to_string()))
            .arg("--source")
            .arg(
                setup
                    .source_url
                    .replace("{addr}", &source.addr().to_string()),
            )
            .args(["--group", GROUP, "--host", &name, "--handler", &handler])
            .args(t.args())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_string()),
            )
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start changefeed run")?;
        fleet.hosts.insert(
            name,
            Host {
                child,
                store,
                source,
            },
        );
    }
    let names: Vec<String> = fleet.hosts.keys().cloned().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writing = tokio::spawn(writer.run(Arc::clone(&stop)));
    let mut watcher = Watcher::start(Arc::clone(&setup.store), group.clone(), names.clone());
    let settle = watcher
        .until(Duration::from_secs(60), |v| {
            // Balanced, so that no hand-off is still under way when the fault starts.
            v.owned_total() == setup.partitions as usize
                && names
                    .iter()
                    .all(|h| v.owns(h) >= setup.partitions as usize / setup.hosts.max(1))
        })
        .await;
    if !settle {
        bail!(
            "the fleet did not share the leases before the fault\n{}",
            fleet.logs()
        );
    }
    let victims: Vec<String> = match scenario {
        Scenario::CutAll | Scenario::SlowStore | Scenario::SourceCutAll => names.clone(),
        _ => vec![names[0].clone()],
    };
    let held_before: Vec<_> = victims.iter().map(|v| watcher.owned_by(v)).collect();
    let fault_start = Instant::now();
    let healed_at = match scenario {
        Scenario::CutOne | Scenario::CutThenRestart | Scenario::CutAll | Scenario::CutThenReset => {
            for v in &victims {
                fleet.hosts[v].store.black_hole();
            }
            tokio::time::sleep(t.cut).await;
            for v in &victims {
                fleet.hosts[v].store.pass_forgetting_held();
            }
            if scenario == Scenario::CutThenRestart {
                tokio::time::sleep(t.restart.0).await;
                for h in fleet.hosts.values() {
                    h.store.refuse();
                    h.store.reset_all();
                }
                tokio::time::sleep(t.restart.1).await;
                for h in fleet.hosts.values() {
                    h.store.pass();
                }
            }
            if scenario == Scenario::CutThenReset {
                tokio::time::sleep(t.reset).await;
                for v in &victims {
                    fleet.hosts[v].store.reset_all();
                }
            }
            Instant::now()
        }
        Scenario::SlowStore => {
            for h in fleet.hosts.values() {
                h.store.delay(t.slow.1);
            }
            tokio::time::sleep(t.slow.0).await;
            for h in fleet.hosts.values() {
                h.store.pass();
            }
            Instant::now()
        }
        Scenario::SourceCut | Scenario::SourceCutThenReset | Scenario::SourceCutAll => {
            for v in &victims {
                fleet.hosts[v].source.black_hole();
            }
            tokio::time::sleep(t.cut).await;
            for v in &victims {
                fleet.hosts[v].source.pass_forgetting_held();
            }
            if scenario == Scenario::SourceCutThenReset {
                tokio::time::sleep(t.reset).await;
                for v in &victims {
                    fleet.hosts[v].source.reset_all();
                }
            }
            Instant::now()
        }
    };
    // Asked at the fault's end: every lease held at its start is still held, and none was
    // seen released (or taken) in between.
    let kept_leases = scenario.cuts_the_source().then(|| {
        victims.iter().zip(&held_before).all(|(v, held)| {
            let now = watcher.owned_by(v);
            held.iter().all(|p| now.contains(p)) && watcher.lost_since(v, fault_start).is_none()
        })
    });
    let healed_wall_ms = ledger::now_ms() - i64::try_from(healed_at.elapsed().as_millis())?;
    let fault_s = healed_at.duration_since(fault_start).as_secs_f64();
    // Each victim heartbeats, and delivers, again.
    let mut heartbeat_s = BTreeMap::new();
    let mut recovery_s = BTreeMap::new();
    let deadline = healed_at + recover_within;
    let ledger_dir = setup.dir.join("ledger");
    let mut ledger = ledger::Ledger::default();
    loop {
        ledger.refresh(&ledger_dir)?;
        for v in &victims {
            if !heartbeat_s.contains_key(v) {
                if let Some(at) = watcher.heartbeat_after(v, healed_at) {
                    heartbeat_s.insert(v.clone(), at.duration_since(healed_at).as_secs_f64());
                }
            }
            if !recovery_s.contains_key(v) {
                if let Some(ms) = ledger::first_start_after(&ledger, v, healed_wall_ms) {
                    recovery_s.insert(v.clone(), (ms - healed_wall_ms).max(0) as f64 / 1000.0);
                }
            }
        }
        if recovery_s.len() == victims.len() && heartbeat_s.len() == victims.len() {
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "{}: after {fault_s:.1} s of fault, {:?} of {victims:?} delivered and {:?} heartbeat again within {recover_within:?} of its end\n{}",
                scenario.name(),
                recovery_s.keys().collect::<Vec<_>>(),
                heartbeat_s.keys().collect::<Vec<_>>(),
                fleet.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let records flow a little after recovery, stop writing, and wait for every record.
    tokio::time::sleep(t.renew_interval * 2).await;
    stop.store(true, Ordering::SeqCst);
    let written = writing.await.context("writer task")??;
    let drain_by = Instant::now() + Duration::from_secs(60);
    let checked = loop {
        ledger.refresh(&ledger_dir)?;
        let checked = ledger::check(&ledger, &written);
        if checked.lost == 0 || Instant::now() >= drain_by {
            break checked;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    watcher.stop();
    let mut unclean_stops = Vec::new();
    for (name, host) in fleet.hosts.iter_mut() {
        if !terminate(&mut host.child) {
            unclean_stops.push(name.clone());
        }
    }
    Ok(Outcome {
        scenario,
        source: setup.source.name(),
        heartbeat_s,
        recovery_s,
        kept_leases,
        checked,
        unclean_stops,
    })
}

/// SIGTERM, then a bounded wait (the fleet's drop kills what is left); whether it exited 0.
fn terminate(child: &mut Child) -> bool {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::Scenario;

    #[test]
    fn every_scenario_is_found_by_its_name() {
        for s in Scenario::ALL {
            assert_eq!(Scenario::parse(s.name()), Some(s));
        }
        assert_eq!(Scenario::parse("cut-some"), None);
    }

    #[test]
    fn the_source_cuts_and_only_they_ask_whether_leases_were_kept() {
        let asked: Vec<&str> = Scenario::ALL
            .into_iter()
            .filter(|s| s.cuts_the_source())
            .map(Scenario::name)
            .collect();
        assert_eq!(
            asked,
            ["source-cut", "source-cut-then-reset", "source-cut-all"]
        );
    }
}
