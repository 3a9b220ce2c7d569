//! `changefeed demo`: a fleet of real processes sharing one SQLite feed, with a failure, a new
//! host and a check that nothing was lost or reordered.
//!
//! The demo process creates a SQLite file holding the feed (`--partitions`), the leases and a
//! ledger table; it keeps appending records with keys `key-0 … key-K` whose payload is a
//! global sequence number, and starts `--hosts` hosts as separate OS processes of this same
//! binary (`changefeed run --handler internal:ledger`), whose built-in handler appends
//! `(host, partition, key, seq)` to the ledger. It draws the ownership table live, SIGKILLs one
//! host partway, adds a new one later, splits a partition (unless `--no-split`), then stops
//! writing, waits until everything is delivered, stops every host with SIGTERM, and checks the
//! ledger: every written record delivered, each key's records first delivered in order.
//! The last line is `RESULT written=… delivered=… duplicates=… lost=… reordered=…`; the exit
//! code is 1 if anything was lost or reordered. The database (and the hosts' logs beside it) is
//! made in a new temporary directory and removed at the end, unless `--keep` (or `--db PATH`):
//! the line before the result says which, and where. With `--console [ADDR]` it also serves
//! the live console (`changefeed console`) of its fleet while it runs, and prints what the
//! console's reads cost the store before the result.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use changefeed::clock::{Clock as _, SystemClock};
use changefeed::lease::LeaseStore;
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, LeaseState, PartitionId, Position};
use changefeed::processor::{Context, Handler, HandlerError};
use changefeed::source::FeedSource;
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rusqlite::{params, Connection};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The group the demo's hosts form.
const GROUP: &str = "demo";

/// Arguments of `changefeed demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Partitions of the feed.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    partitions: u32,
    /// Hosts started at the beginning (one more joins later).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=32))]
    hosts: u16,
    /// How long records are written: seconds (`45`) or a duration (`1m`).
    #[arg(long, default_value = "45", value_parser = parse_secs)]
    duration: Duration,
    /// Seeds every random choice (keys, which host dies, which partition splits).
    #[arg(long)]
    seed: Option<u64>,
    /// The SQLite file to create (must not exist); it is kept. Default: `demo.db` in a new
    /// temporary directory, removed at the end unless --keep.
    #[arg(long, value_name = "PATH")]
    db: Option<PathBuf>,
    /// Keep the temporary directory with the database and the hosts' logs, to look at with
    /// `status`, `hosts`, `lag` (`--group demo`) or to `run` more hosts on.
    #[arg(long)]
    keep: bool,
    /// Distinct record keys.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    keys: u32,
    /// Records written per second.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=5_000))]
    rate: u32,
    /// Serve each host's Prometheus metrics at 127.0.0.1:PORT+N-1 for host-N.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// Do not split a partition partway (by default one is split at 65 % of the run; its
    /// children are read only after it is finished).
    #[arg(long)]
    no_split: bool,
    /// Serve the live console (`changefeed console`) of the demo's fleet at ADDR while it
    /// runs (default 127.0.0.1:7070).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:7070")]
    console: Option<std::net::SocketAddr>,
}

fn parse_secs(text: &str) -> Result<Duration, String> {
    let d = match text.parse::<u64>() {
        Ok(s) => Duration::from_secs(s),
        Err(_) => humantime::parse_duration(text).map_err(|e| e.to_string())?,
    };
    if d < Duration::from_secs(4) {
        return Err("must be at least 4 seconds".into());
    }
    Ok(d)
}

/// Runs the demo.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(demo(args))
}

// ------------------------------------------------------------------------------------------
// The ledger: the built-in handler of the demo's hosts, and its verification.

const LEDGER_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS demo_ledger (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    host      TEXT NOT NULL,
    partition TEXT NOT NULL,
    key       TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    at_ms     INTEGER NOT NULL
)";

fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.execute_batch(LEDGER_SCHEMA)?;
    Ok(conn)
}

/// The `internal:ledger` handler: appends `(host, partition, key, seq)` of every delivered
/// record to the `demo_ledger` table of the feed's SQLite file, one transaction per batch.
/// Payloads must be decimal sequence numbers, as the demo writes them.
#[derive(Debug)]
pub struct LedgerHandler {
    host: String,
    conn: Arc<Mutex<Connection>>,
}

impl LedgerHandler {
    /// Opens the ledger in the SQLite file at `path`, creating its table if needed.
    ///
    /// # Errors
    /// If the file cannot be opened or the table created.
    pub async fn open(path: &Path, host: &str) -> anyhow::Result<Self> {
        let p = path.to_path_buf();
        let conn = tokio::task::spawn_blocking(move || open_connection(&p))
            .await?
            .with_context(|| format!("opening the ledger in {}", path.display()))?;
        Ok(Self {
            host: host.to_string(),
            conn: Arc::new(Mutex::new(conn)),
        })
    }
}

#[async_trait]
impl Handler for LedgerHandler {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let mut rows = Vec::with_capacity(batch.records.len());
        for r in &batch.records {
            let seq: i64 = std::str::from_utf8(&r.data)?.parse()?;
            rows.push((r.key.clone(), seq));
        }
        let (conn, host, partition) = (
            self.conn.clone(),
            self.host.clone(),
            ctx.partition().to_string(),
        );
        let now = SystemClock.wall().millis();
        tokio::task::spawn_blocking(move || -> rusqlite::Result<()> {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            {
                let mut stmt = tx.prepare_cached(
                    "INSERT INTO demo_ledger (host, partition, key, seq, at_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?;
                for (key, seq) in rows {
                    stmt.execute(params![host, partition, key, seq, now])?;
                }
            }
            tx.commit()
        })
        .await??;
        Ok(())
    }
}

/// What the ledger says about the run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Records written to the feed.
    pub written: u64,
    /// Distinct records delivered.
    pub delivered: u64,
    /// Deliveries beyond the first of a record.
    pub duplicates: u64,
    /// Written records never delivered.
    pub lost: u64,
    /// Records whose first delivery came after a later record of the same key.
    pub reordered: u64,
}

/// Compares what was written (`(key, seq)` in any order) with the ledger rows (`(key, seq)` in
/// delivery order).
pub fn verify(written: &[(String, i64)], ledger: &[(String, i64)]) -> Verdict {
    let mut seen: HashSet<i64> = HashSet::new();
    let mut newest: HashMap<&str, i64> = HashMap::new();
    let mut v = Verdict::default();
    for (key, seq) in ledger {
        if !seen.insert(*seq) {
            v.duplicates += 1;
            continue;
        }
        let top = newest.entry(key.as_str()).or_insert(i64::MIN);
        if *seq < *top {
            v.reordered += 1;
        }
        *top = (*top).max(*seq);
    }
    v.written = written.len() as u64;
    v.lost = written.iter().filter(|(_, s)| !seen.contains(s)).count() as u64;
    v.delivered = written.len() as u64 - v.lost;
    v
}

fn read_written(conn: &Connection) -> rusqlite::Result<Vec<(String, i64)>> {
    let mut stmt = conn.prepare("SELECT key, data FROM changefeed_records")?;
    let rows = stmt.query_map([], |r| {
        let key: String = r.get(0)?;
        let data: Vec<u8> = r.get(1)?;
        Ok((key, data))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (key, data) = row?;
        let seq = std::str::from_utf8(&data)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1);
        out.push((key, seq));
    }
    Ok(out)
}

fn read_ledger(conn: &Connection) -> rusqlite::Result<Vec<(String, i64)>> {
    let mut stmt = conn.prepare("SELECT key, seq FROM demo_ledger ORDER BY id")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect()
}

/// Written records and distinct delivered records so far.
fn counts(conn: &Connection) -> rusqlite::Result<(u64, u64)> {
    let written: i64 =
        conn.query_row("SELECT COUNT(*) FROM changefeed_records", [], |r| r.get(0))?;
    let delivered: i64 =
        conn.query_row("SELECT COUNT(DISTINCT seq) FROM demo_ledger", [], |r| {
            r.get(0)
        })?;
    Ok((written.max(0) as u64, delivered.max(0) as u64))
}

// ------------------------------------------------------------------------------------------
// The hosts: child processes of this binary.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcState {
    Running,
    Killed,
    Stopped,
}

#[derive(Debug)]
struct HostProc {
    name: String,
    child: tokio::process::Child,
    state: ProcState,
}

fn spawn_host(
    db: &Path,
    name: &str,
    log_dir: &Path,
    metrics: Option<u16>,
) -> anyhow::Result<HostProc> {
    let exe = std::env::current_exe().context("finding this program's path")?;
    let url = format!("sqlite://{}", db.display());
    let log = std::fs::File::create(log_dir.join(format!("{name}.log")))
        .with_context(|| format!("creating the log of {name}"))?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("run");
    if let Some(port) = metrics {
        cmd.arg("--metrics-addr").arg(format!("127.0.0.1:{port}"));
    }
    let child = cmd
        .args(["--store", &url, "--source", &url])
        .args([
            "--handler",
            "internal:ledger",
            "--group",
            GROUP,
            "--host",
            name,
        ])
        .args(["--lease-expiry", "3s", "--safety-margin", "1s"])
        .args(["--renew-interval", "1s", "--acquire-interval", "1s"])
        .args(["--handoff-timeout", "3s", "--poll-delay", "100ms"])
        .args([
            "--max-batch-size",
            "50",
            "--sync-interval",
            "1s",
            "--cleanup-delay",
            "2s",
        ])
        .env_remove("CHANGEFEED_CONFIG")
        .env_remove("CHANGEFEED_METRICS_ADDR")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting host {name}"))?;
    Ok(HostProc {
        name: name.to_string(),
        child,
        state: ProcState::Running,
    })
}

fn send_signal(host: &HostProc, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
    let Some(pid) = host.child.id() else {
        return Ok(()); // already reaped
    };
    let pid = i32::try_from(pid).context("pid out of range")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
        .with_context(|| format!("sending {signal} to {}", host.name))
}

// ------------------------------------------------------------------------------------------
// The screen.

struct Screen {
    tty: bool,
    drawn: usize,
    events: Vec<String>,
    origin: Instant,
    last_plain: Option<Instant>,
}

struct View {
    leases: Vec<(Lease, Option<u64>)>,
    malformed: usize,
    written: u64,
    delivered: u64,
    live: usize,
}

impl Screen {
    fn elapsed(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    fn event(&mut self, text: String) {
        let line = format!("[{:>5.1}s] {text}", self.elapsed());
        if self.tty {
            self.events.push(line);
            if self.events.len() > 6 {
                self.events.remove(0);
            }
        } else {
            println!("{line}");
        }
    }

    fn progress(v: &View, phase: &str, t: f64) -> String {
        let lag: u64 = v.leases.iter().filter_map(|(_, l)| *l).sum();
        format!(
            "{phase} t={t:.1}s written={} delivered={} lag={lag} hosts={}{}",
            v.written,
            v.delivered,
            v.live,
            if v.malformed > 0 {
                format!(" malformed={}", v.malformed)
            } else {
                String::new()
            }
        )
    }

    fn draw(&mut self, v: &View, phase: &str) {
        let t = self.elapsed();
        if !self.tty {
            // Plain lines: one progress line (with compact ownership) every two seconds.
            let due = self
                .last_plain
                .is_none_or(|l| l.elapsed() >= Duration::from_secs(2));
            if due {
                self.last_plain = Some(Instant::now());
                let owners: Vec<String> = v
                    .leases
                    .iter()
                    .map(|(l, _)| format!("{}={}", l.key.partition, owner_text(l)))
                    .collect();
                println!(
                    "{} owners: {}",
                    Self::progress(v, phase, t),
                    owners.join(" ")
                );
            }
            return;
        }
        let mut out = String::new();
        if self.drawn > 0 {
            out.push_str(&format!("\x1b[{}A\r\x1b[J", self.drawn));
        }
        let mut lines = vec![format!(
            "{:<10} {:<10} {:>10} {:>6}",
            "PARTITION", "OWNER", "CHECKPOINT", "LAG"
        )];
        for (l, lag) in &v.leases {
            let checkpoint = l
                .continuation
                .as_ref()
                .map(|c| {
                    c.as_str()
                        .rsplit(':')
                        .next()
                        .unwrap_or(c.as_str())
                        .to_string()
                })
                .unwrap_or_else(|| "-".into());
            lines.push(format!(
                "{:<10} {:<10} {:>10} {:>6}",
                l.key.partition.as_str(),
                owner_text(l),
                checkpoint,
                lag.map_or("?".into(), |n| n.to_string())
            ));
        }
        lines.extend(self.events.iter().cloned());
        lines.push(Self::progress(v, phase, t));
        for l in &lines {
            out.push_str(l);
            out.push('\n');
        }
        self.drawn = lines.len();
        print!("{out}");
        let _ = std::io::stdout().flush();
    }
}

fn owner_text(l: &Lease) -> String {
    match (l.state, &l.owner) {
        (LeaseState::Finished, _) => "finished".into(),
        (_, Some(o)) => o.to_string(),
        (_, None) => "-".into(),
    }
}

async fn snapshot(
    store: &dyn LeaseStore,
    feed: &dyn FeedSource,
    group: &GroupName,
    conn: &Arc<Mutex<Connection>>,
    live: usize,
) -> anyhow::Result<View> {
    let listing = store.list(group).await?;
    let mut leases = Vec::with_capacity(listing.leases.len());
    for l in listing.leases {
        let lag = if l.state == LeaseState::Finished {
            Some(0)
        } else {
            feed.remaining(&l.key.partition, l.continuation.as_ref())
                .await
                .ok()
                .flatten()
        };
        leases.push((Arc::unwrap_or_clone(l), lag));
    }
    let conn = conn.clone();
    let (written, delivered) = tokio::task::spawn_blocking(move || {
        let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
        counts(&conn)
    })
    .await??;
    Ok(View {
        leases,
        malformed: listing.malformed.len(),
        written,
        delivered,
        live,
    })
}

// ------------------------------------------------------------------------------------------
// The run.

async fn demo(args: Args) -> anyhow::Result<ExitCode> {
    let wall = SystemClock.wall();
    let seed = args.seed.unwrap_or(wall.millis() as u64);
    let mut rng = SmallRng::seed_from_u64(seed);
    // The temporary directory, removed when this is dropped (unless kept).
    let mut temporary = None;
    let db = match &args.db {
        Some(p) => {
            if p.exists() {
                eprintln!(
                    "error: --db: {} already exists; the demo creates a new database",
                    p.display()
                );
                return Ok(ExitCode::from(crate::usage::USAGE_EXIT));
            }
            p.clone()
        }
        None => {
            let dir = tempfile::Builder::new()
                .prefix("changefeed-demo-")
                .tempdir()
                .context("creating a temporary directory")?;
            if args.keep {
                dir.keep().join("demo.db")
            } else {
                let p = dir.path().join("demo.db");
                temporary = Some(dir);
                p
            }
        }
    };
    let kept = temporary.is_none();
    let log_dir = db
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let feed = SqliteFeed::open(&db).await.context("creating the feed")?;
    feed.create_partitions(args.partitions).await?;
    let store = SqliteLeaseStore::open(&db).await?;
    let group = GroupName::new(GROUP)?;
    for p in feed.partitions().await? {
        let lease = Lease::new(LeaseKey::new(group.clone(), p.id), Position::Beginning);
        store.create(&lease).await?;
    }
    let conn = {
        let p = db.clone();
        Arc::new(Mutex::new(
            tokio::task::spawn_blocking(move || open_connection(&p)).await??,
        ))
    };
    println!(
        "changefeed demo: {} partitions, {} hosts, {}s of writes at {}/s over {} keys, seed {seed}",
        args.partitions,
        args.hosts,
        args.duration.as_secs(),
        args.rate,
        args.keys
    );
    println!(
        "database {} (host logs beside it; {}); rerun with --seed {seed}",
        db.display(),
        if kept {
            "kept"
        } else {
            "removed at the end, --keep keeps it"
        }
    );
    if let Some(port) = args.metrics_port {
        println!("host-N serves Prometheus metrics at http://127.0.0.1:{port}+N-1/metrics");
    }

    let console_stop = CancellationToken::new();
    let console = match args.console {
        Some(addr) => {
            let console =
                crate::console::start_demo(&db, &group, addr, args.duration, console_stop.clone())
                    .await?;
            println!("console: http://{}/", console.addr);
            Some(console)
        }
        None => None,
    };

    let mut hosts = Vec::new();
    for i in 1..=args.hosts {
        let port = args.metrics_port.map(|p| p.saturating_add(i - 1));
        hosts.push(spawn_host(&db, &format!("host-{i}"), &log_dir, port)?);
    }

    // The writer: one record per tick, a global sequence number as payload.
    let written_seq = Arc::new(AtomicU64::new(0));
    let stop_writing = CancellationToken::new();
    let writer = {
        let feed = feed.clone();
        let stop = stop_writing.clone();
        let seq = written_seq.clone();
        let keys = args.keys;
        let mut wrng = SmallRng::seed_from_u64(rng.gen());
        let period = Duration::from_secs_f64(1.0 / f64::from(args.rate));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut next = 1u64;
            let mut key = format!("key-{}", wrng.gen_range(0..keys));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match feed.append(&key, next.to_string()).await {
                    Ok(_) => {
                        seq.store(next, Ordering::Relaxed);
                        next += 1;
                        key = format!("key-{}", wrng.gen_range(0..keys));
                    }
                    // Not written: the same record is tried again next tick.
                    Err(err) => tracing::debug!(error = %err, "append failed; retrying"),
                }
            }
        })
    };

    let interrupted = CancellationToken::new();
    {
        let interrupted = interrupted.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                interrupted.cancel();
            }
        });
    }

    let mut screen = Screen {
        tty: std::io::stdout().is_terminal(),
        drawn: 0,
        events: Vec::new(),
        origin: Instant::now(),
        last_plain: None,
    };
    screen.event(format!("started {} hosts", args.hosts));
    let d = args.duration;
    let kill_at = d.mul_f64(0.3);
    let add_at = d.mul_f64(0.5);
    let split_at = d.mul_f64(0.65);
    let (mut killed, mut added, mut split) = (false, false, args.no_split);
    let start = Instant::now();
    let live = |hosts: &[HostProc]| {
        hosts
            .iter()
            .filter(|h| h.state == ProcState::Running)
            .count()
    };

    // Phase 1: writing, with the failure, the new host and the split.
    while start.elapsed() < d && !interrupted.is_cancelled() {
        let t = start.elapsed();
        if !killed && t >= kill_at {
            killed = true;
            let running: Vec<usize> = (0..hosts.len())
                .filter(|i| hosts[*i].state == ProcState::Running)
                .collect();
            if running.len() > 1 {
                let i = running[rng.gen_range(0..running.len())];
                // `start_kill` sends SIGKILL: the host gets no chance to release anything.
                hosts[i].child.start_kill().context("killing a host")?;
                hosts[i].state = ProcState::Killed;
                screen.event(format!(
                    "killed {} with SIGKILL; its leases expire in 3s",
                    hosts[i].name
                ));
            } else {
                screen.event("only one host: not killing it".into());
            }
        }
        if !added && t >= add_at {
            added = true;
            let name = format!("host-{}", hosts.len() + 1);
            let port = args
                .metrics_port
                .map(|p| p.saturating_add(u16::try_from(hosts.len()).unwrap_or(u16::MAX)));
            hosts.push(spawn_host(&db, &name, &log_dir, port)?);
            screen.event(format!("added {name}"));
        }
        if !split && t >= split_at {
            split = true;
            let open: Vec<PartitionId> = feed
                .partitions()
                .await?
                .into_iter()
                .filter(|p| !p.closed)
                .map(|p| p.id)
                .collect();
            if !open.is_empty() {
                let p = &open[rng.gen_range(0..open.len())];
                match feed.split(p).await {
                    Ok((a, b)) => screen.event(format!("split partition {p} into {a} and {b}")),
                    Err(err) => screen.event(format!("split of {p} failed: {err}")),
                }
            }
        }
        let n = live(&hosts);
        match snapshot(&store, &feed, &group, &conn, n).await {
            Ok(v) => screen.draw(&v, "writing"),
            Err(err) => screen.event(format!("reading the state failed: {err:#}")),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = interrupted.cancelled() => {}
        }
    }
    stop_writing.cancel();
    let _ = writer.await;
    let total = written_seq.load(Ordering::Relaxed);
    screen.event(format!("stopped writing after {total} records; draining"));

    // Phase 2: wait (bounded) until every written record has been delivered.
    let drain_deadline = Instant::now() + Duration::from_secs(30).max(d / 2);
    loop {
        let n = live(&hosts);
        let v = snapshot(&store, &feed, &group, &conn, n).await;
        if let Ok(v) = &v {
            screen.draw(v, "draining");
            let lag: u64 = v.leases.iter().filter_map(|(_, l)| *l).sum();
            if v.delivered >= v.written && lag == 0 {
                break;
            }
        }
        if Instant::now() >= drain_deadline || interrupted.is_cancelled() {
            screen.event("drain deadline passed; stopping anyway".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // Phase 3: graceful stop of every host.
    for h in hosts.iter().filter(|h| h.state == ProcState::Running) {
        send_signal(h, nix::sys::signal::Signal::SIGTERM)?;
    }
    let mut stop_report = Vec::new();
    for h in hosts.iter_mut() {
        match h.state {
            ProcState::Killed => {
                let _ = h.child.wait().await;
                stop_report.push(format!("{} killed", h.name));
            }
            ProcState::Running | ProcState::Stopped => {
                let status = tokio::time::timeout(Duration::from_secs(15), h.child.wait()).await;
                h.state = ProcState::Stopped;
                match status {
                    Ok(Ok(s)) if s.success() => stop_report.push(format!("{} stopped", h.name)),
                    Ok(Ok(s)) => stop_report.push(format!("{} exited with {s}", h.name)),
                    Ok(Err(e)) => stop_report.push(format!("{}: {e}", h.name)),
                    Err(_) => {
                        let _ = h.child.kill().await;
                        stop_report.push(format!("{} did not stop in 15s; killed", h.name));
                    }
                }
            }
        }
    }
    if let Ok(v) = snapshot(&store, &feed, &group, &conn, 0).await {
        screen.draw(&v, "stopped");
    }
    screen.event(format!("hosts: {}", stop_report.join(", ")));
    if screen.tty {
        if let Ok(v) = snapshot(&store, &feed, &group, &conn, 0).await {
            screen.draw(&v, "stopped");
        }
    }

    // Phase 4: the verdict.
    let (written, ledger) = {
        let conn = conn.clone();
        tokio::task::spawn_blocking(move || {
            let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            Ok::<_, rusqlite::Error>((read_written(&conn)?, read_ledger(&conn)?))
        })
        .await??
    };
    let v = verify(&written, &ledger);
    let mut per_host: BTreeMap<String, u64> = BTreeMap::new();
    {
        let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut stmt = conn.prepare("SELECT host, COUNT(*) FROM demo_ledger GROUP BY host")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (h, n) = row?;
            per_host.insert(h, n.max(0) as u64);
        }
    }
    let shares: Vec<String> = per_host.iter().map(|(h, n)| format!("{h}={n}")).collect();
    println!("deliveries per host: {}", shares.join(" "));
    if interrupted.is_cancelled() {
        println!("interrupted: the run was cut short");
    }
    if kept {
        println!(
            "kept the database: {db} (host logs beside it); try `changefeed status --store sqlite://{db} --group demo --source sqlite://{db}`",
            db = db.display()
        );
    } else {
        println!("removing the database {} (--keep keeps it)", db.display());
    }
    if let Some(console) = &console {
        console_stop.cancel();
        println!("{}", console.cost_line());
    }
    println!(
        "RESULT written={} delivered={} duplicates={} lost={} reordered={}",
        v.written, v.delivered, v.duplicates, v.lost, v.reordered
    );
    if v.lost > 0 || v.reordered > 0 {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(v: &[(&str, i64)]) -> Vec<(String, i64)> {
        v.iter().map(|(k, s)| (k.to_string(), *s)).collect()
    }

    #[test]
    fn redelivery_is_a_duplicate_and_a_gap_filled_late_is_reordered() {
        // DESIGN rule 4: at least once, in order per key; redelivery after failover is allowed.
        let written = rows(&[("a", 1), ("a", 2), ("a", 3), ("b", 4)]);
        let ok = verify(
            &written,
            &rows(&[("a", 1), ("a", 2), ("a", 1), ("a", 2), ("a", 3), ("b", 4)]),
        );
        assert_eq!(
            ok,
            Verdict {
                written: 4,
                delivered: 4,
                duplicates: 2,
                lost: 0,
                reordered: 0
            }
        );
        let bad = verify(&written, &rows(&[("a", 1), ("a", 3), ("a", 2)]));
        assert_eq!((bad.lost, bad.reordered), (1, 1));
    }

    #[test]
    fn durations_are_seconds_or_humantime_and_not_too_short() {
        assert_eq!(parse_secs("8"), Ok(Duration::from_secs(8)));
        assert_eq!(parse_secs("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_secs("2").is_err());
        assert!(parse_secs("soon").is_err());
    }
}
