//! `run-throughput`: records per second through `changefeed run` with a trivial external
//! handler on the SQLite feed, as a new user would run it: the per-batch
//! mode (`sh -c 'cat >/dev/null'` per batch, the baseline), the long-lived mode
//! (`--protocol lines`, a Python process per partition acknowledging each batch) and the KCL
//! protocol (`--protocol kcl`, a Python child per lease checkpointing each batch at its last
//! record, as a KCL application does), with batches of at most 10 and of 1,000 records.
//!
//! Each measurement gets a fresh lease database and feed (separate SQLite files) filled with
//! `records` records over `partitions` partitions, then starts the release `changefeed` binary
//! and polls the lease table until every partition is checkpointed at its last record; every
//! batch is checkpointed in every mode.
//!
//! The headline is CPU cost: the user and system CPU seconds of the host process and every
//! handler process it started (`getrusage(RUSAGE_CHILDREN)` around the host's whole life,
//! stopped with SIGTERM once done, so its handlers are reaped and counted), per million
//! records. CPU time does not depend on what else the machine runs, as a rate of records per
//! second does; the modes' ratios (`long_lived_cpu_ratio_b10`, `kcl_cpu_ratio_b10`: the
//! per-batch mode's CPU per record over each mode's) are taken on it, the modes at batch 10
//! alternating over `--rounds` rounds, each mode's median kept. Records per second are shown
//! beside it: that clock starts once every lease is owned (lease discovery and the first
//! acquisition are not counted, nor the records checkpointed by then; a SQLite continuation
//! `P:N` covers N records), or at the host's start when a small run is done before a poll saw
//! every lease owned.
//!
//! Real time is measured here with `std::time::Instant`: a benchmark is the one place that must
//! read the machine's clock rather than the library's injectable one.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use changefeed::lease::LeaseStore;
use changefeed::model::{Continuation, GroupName, PartitionId};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

/// Arguments of `changefeed-bench run-throughput`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The `changefeed` binary (default: next to this one; build it with `cargo build
    /// --release -p changefeed-cli`).
    #[arg(long)]
    changefeed: Option<PathBuf>,
    /// The Python interpreter for the long-lived handlers.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Partitions of the feed (default: one per core of the 2-core CI machine; with more
    /// partitions than cores the long-lived handlers compete with the host for the CPU).
    #[arg(long, default_value_t = 2)]
    partitions: u32,
    /// Records for the per-batch mode with batches of 10 (a process per 10 records is slow).
    #[arg(long, default_value_t = 8_000)]
    per_batch_records_b10: u64,
    /// Records for the long-lived modes with batches of 10.
    #[arg(long, default_value_t = 120_000)]
    records_b10: u64,
    /// Records for every mode with batches of 1,000.
    #[arg(long, default_value_t = 400_000)]
    records_b1000: u64,
    /// Longest one measurement may take.
    #[arg(long, default_value = "300")]
    timeout_secs: u64,
    /// Rounds of the three modes at batch 10, alternating; each mode's median CPU per record.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A smoke test under a minute: 1,000 records per mode at batch 10 and 20,000 at batch
    /// 1,000, one round (figures too small to quote).
    #[arg(long)]
    quick: bool,
}

/// What one measurement found.
#[derive(Debug, Clone, Copy)]
struct Measured {
    /// Seconds from every lease owned to every record checkpointed.
    secs: f64,
    /// Records per second over those seconds.
    rate: f64,
    /// User and system CPU seconds of the host and its handlers, over the host's whole life.
    cpu: f64,
    /// Records the host processed (all of the feed).
    records: u64,
}

impl Measured {
    /// CPU microseconds per record.
    fn cpu_us_per_record(&self) -> f64 {
        self.cpu * 1e6 / self.records.max(1) as f64
    }
}

/// The long-lived handler of `--protocol lines`: acknowledge each batch at its last record.
const LINES_HANDLER: &str = r#"import json, sys
for line in sys.stdin:
    last = json.loads(line)["records"][-1]["continuation"]
    sys.stdout.write(json.dumps({"ack": last}) + "\n")
    sys.stdout.flush()
"#;

/// A KCL child: checkpoint each batch at its last record (`checkpoint` with a null sequence
/// number, as `checkpointer.checkpoint()` in `amazon_kclpy` sends it), wait for the answer and
/// fail loudly if it carries an error (amazon_kclpy raises `CheckpointError`), and answer every
/// message with a status. Each message is written as amazon_kclpy writes it (a newline before
/// and after, then a flush); the two replies it sends never change, so they are encoded once,
/// as a trivial child would (the lines child's ack names a record, so it is encoded per batch).
const KCL_HANDLER: &str = r#"import json, sys
CHECKPOINT = "\n" + json.dumps({"action": "checkpoint", "sequenceNumber": None, "subSequenceNumber": None}) + "\n"
STATUS = {}
for line in sys.stdin:
    action = json.loads(line)["action"]
    if action == "processRecords":
        sys.stdout.write(CHECKPOINT)
        sys.stdout.flush()
        answer = sys.stdin.readline()
        if '"error"' in answer:
            sys.exit("checkpoint failed: " + answer)
    status = STATUS.get(action)
    if status is None:
        status = STATUS[action] = "\n" + json.dumps({"action": "status", "responseFor": action}) + "\n"
    sys.stdout.write(status)
    sys.stdout.flush()
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    PerBatch,
    Lines,
    Kcl,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::PerBatch => "per-batch",
            Mode::Lines => "long-lived",
            Mode::Kcl => "kcl",
        }
    }
}

/// Kills the host if a measurement ends early.
struct Host(Child);

impl Drop for Host {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let binary = match &args.changefeed {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the bench binary has no directory")?
            .join("changefeed"),
    };
    if !binary.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p changefeed-cli` or pass --changefeed",
            binary.display()
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (per_batch_b10, long_lived_b10, b1000, rounds) = if args.quick {
        (1_000, 1_000, 20_000, 1)
    } else {
        (
            args.per_batch_records_b10,
            args.records_b10,
            args.records_b1000,
            args.rounds.max(1),
        )
    };
    println!("mode        batch   records      seconds    records/s     CPU s  CPU µs/record");
    let show = |mode: Mode, batch: usize, m: &Measured| {
        println!(
            "{:<10} {batch:>6} {:>9} {:>12.2} {:>12.0} {:>9.2} {:>14.1}",
            mode.name(),
            m.records,
            m.secs,
            m.rate,
            m.cpu,
            m.cpu_us_per_record()
        );
    };
    // Batch 10: the modes alternate, so that whatever else the machine does falls on each.
    let b10 = [
        (Mode::PerBatch, per_batch_b10),
        (Mode::Lines, long_lived_b10),
        (Mode::Kcl, long_lived_b10),
    ];
    let mut at_b10: Vec<Vec<Measured>> = vec![Vec::new(); b10.len()];
    for _ in 0..rounds {
        for (i, (mode, records)) in b10.iter().enumerate() {
            let m = runtime.block_on(measure(&args, &binary, *mode, 10, *records))?;
            show(*mode, 10, &m);
            at_b10[i].push(m);
        }
    }
    let mut at_b1000 = Vec::new();
    for mode in [Mode::PerBatch, Mode::Lines, Mode::Kcl] {
        let m = runtime.block_on(measure(&args, &binary, mode, 1000, b1000))?;
        show(mode, 1000, &m);
        at_b1000.push(m);
    }
    let median = |ms: &[Measured], f: fn(&Measured) -> f64| {
        let mut v: Vec<f64> = ms.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let cpu = |i: usize| median(&at_b10[i], Measured::cpu_us_per_record);
    let rate = |i: usize| median(&at_b10[i], |m| m.rate);
    let spread = |i: usize| {
        let v: Vec<String> = at_b10[i]
            .iter()
            .map(|m| format!("{:.1}", m.cpu_us_per_record()))
            .collect();
        v.join(", ")
    };
    println!(
        "CPU µs per record at batch 10, per round: per-batch {}; long-lived {}; kcl {}",
        spread(0),
        spread(1),
        spread(2)
    );
    println!(
        "CPU cost ratio at batch 10 (per-batch / mode, medians of {rounds}): long-lived {:.1}, kcl {:.1} (goal: both at least 10)",
        cpu(0) / cpu(1),
        cpu(0) / cpu(2)
    );
    println!(
        "RESULT per_batch_rps_b10={:.0} long_lived_rps_b10={:.0} kcl_rps_b10={:.0} per_batch_rps_b1000={:.0} long_lived_rps_b1000={:.0} per_batch_cpu_us_b10={:.1} long_lived_cpu_us_b10={:.1} kcl_cpu_us_b10={:.1} long_lived_cpu_ratio_b10={:.1} kcl_cpu_ratio_b10={:.1}",
        rate(0),
        rate(1),
        rate(2),
        at_b1000[0].rate,
        at_b1000[1].rate,
        cpu(0),
        cpu(1),
        cpu(2),
        cpu(0) / cpu(1),
        cpu(0) / cpu(2)
    );
    Ok(())
}

/// Fills a fresh feed, runs one host in `mode` until every record is checkpointed, and returns
/// the seconds taken and records per second.
async fn measure(
    args: &Args,
    binary: &Path,
    mode: Mode,
    batch: usize,
    records: u64,
) -> anyhow::Result<Measured> {
    let dir = tempfile::tempdir()?;
    let feed_db = dir.path().join("feed.db");
    let lease_db = dir.path().join("leases.db");
    let ends = fill(&feed_db, args.partitions, records).await?;
    let store = SqliteLeaseStore::open(&lease_db).await?;
    let handler = match mode {
        Mode::PerBatch => "cat >/dev/null".to_string(),
        Mode::Lines | Mode::Kcl => {
            let script = dir.path().join("handler.py");
            let text = if mode == Mode::Lines {
                LINES_HANDLER
            } else {
                KCL_HANDLER
            };
            std::fs::write(&script, text)?;
            format!("{} {}", args.python, script.display())
        }
    };
    let protocol = match mode {
        Mode::PerBatch => "batch",
        Mode::Lines => "lines",
        Mode::Kcl => "kcl",
    };
    let cpu_before = children_cpu()?;
    let spawned = (Instant::now(), 0);
    let mut host = Host(
        Command::new(binary)
            .arg("run")
            .arg("--store")
            .arg(format!("sqlite://{}", lease_db.display()))
            .arg("--source")
            .arg(format!("sqlite://{}", feed_db.display()))
            .args(["--handler", &handler, "--protocol", protocol])
            .args(["--host", "bench", "--group", "g"])
            .args(["--max-batch-size", &batch.to_string()])
            .args(["--acquire-interval", "100ms", "--poll-delay", "20ms"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting changefeed run")?,
    );
    let group = GroupName::new("g")?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    // When every lease was first seen owned, and how many records were checkpointed then.
    let mut started: Option<(Instant, u64)> = None;
    loop {
        if Instant::now() > deadline {
            bail!("{} at batch {batch}: not done in time", mode.name());
        }
        if let Some(status) = host.0.try_wait()? {
            bail!(
                "{} at batch {batch}: changefeed run exited: {status}",
                mode.name()
            );
        }
        let leases = store.list(&group).await?.leases;
        let done = leases.len() == ends.len()
            && leases.iter().all(|l| {
                ends.iter()
                    .any(|(p, c)| *p == l.key.partition && l.continuation.as_ref() == Some(c))
            });
        if done {
            // A small run may be done before a poll saw every lease owned: then the clock
            // started with the host.
            let (from, before) = started.unwrap_or(spawned);
            let secs = from.elapsed().as_secs_f64();
            let rate = records.saturating_sub(before) as f64 / secs;
            stop(&mut host, mode, batch).await?;
            let cpu = children_cpu()? - cpu_before;
            return Ok(Measured {
                secs,
                rate,
                cpu,
                records,
            });
        }
        if started.is_none()
            && leases.len() == ends.len()
            && leases.iter().all(|l| l.owner.is_some())
        {
            let checkpointed = leases
                .iter()
                .map(|l| l.continuation.as_ref().map_or(0, position))
                .sum();
            started = Some((Instant::now(), checkpointed));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Stops the host with SIGTERM (a graceful stop: it ends its handlers and reaps them) and waits
/// for it, so that its CPU time and its handlers' count in [`children_cpu`].
async fn stop(host: &mut Host, mode: Mode, batch: usize) -> anyhow::Result<()> {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(host.0.id())?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while host.0.try_wait()?.is_none() {
        if Instant::now() > deadline {
            bail!(
                "{} at batch {batch}: changefeed run did not stop within 30 s of SIGTERM",
                mode.name()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// User and system CPU seconds of this process's children that have ended and been waited
/// for, with their own waited-for children (the host's handlers).
fn children_cpu() -> anyhow::Result<f64> {
    crate::usage::cpu_seconds(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
}

/// How many records of its partition a SQLite feed continuation (`PARTITION:N`) covers.
fn position(c: &Continuation) -> u64 {
    c.as_str()
        .rsplit_once(':')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// Creates `partitions` partitions with `records` records spread over them; returns each
/// partition's last continuation.
async fn fill(
    path: &Path,
    partitions: u32,
    records: u64,
) -> anyhow::Result<Vec<(PartitionId, Continuation)>> {
    let feed = SqliteFeed::open(path).await?;
    feed.create_partitions(partitions).await?;
    let mut ends = Vec::new();
    for p in 0..partitions {
        let id = PartitionId::new(p.to_string())?;
        let mut last = None;
        let share = records / u64::from(partitions)
            + u64::from(u64::from(p) < records % u64::from(partitions));
        for i in 0..share {
            last = Some(feed.append_to(&id, "k", format!("record {i}")).await?);
        }
        if let Some(c) = last {
            ends.push((id, c));
        }
    }
    Ok(ends)
}
