//! `changefeed simulate` (this crate's binary): run the deterministic fleet simulator for one seed or many, check
//! every run's invariants, and optionally draw one run's ownership timeline as SVG.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use changefeed::sim::{self, Faults, SimConfig, StrategyKind, TraceMode};

/// Arguments of `changefeed simulate`, which are `changefeed-sim`'s.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The seed to run (with --seeds: the first seed).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run this many seeds (at least 1), from --seed on, in parallel on every core.
    #[arg(long)]
    seeds: Option<u64>,
    /// Faults: all, none, or a comma-separated list of crash, stop, restart, pause, cutoff,
    /// latency, conflict, store-error, source-error, skew, drift, split, merge, handler-error,
    /// slow-handler.
    #[arg(long, default_value = "all")]
    faults: String,
    /// Multiplies every fault's rate: a finite number from 0 to 100.
    #[arg(long, default_value_t = DEFAULT_FAULT_RATE, allow_negative_numbers = true)]
    fault_rate: f64,
    /// Hosts at the start (at least 1).
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// Partitions at the start (at least 1).
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// Virtual time with faults and writes (then a drain), e.g. 120s, 10m, 24h.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Records written per virtual second.
    #[arg(long, default_value_t = DEFAULT_RECORDS_PER_SEC)]
    records_per_sec: u64,
    /// Balancing strategy: ours (or equal: EqualShare), load (LoadShare, planning by the
    /// records each lease delivered per second in the run), kcl, kcl3 or cosmos.
    #[arg(long, default_value = "ours")]
    strategy: String,
    /// Handler calls at once per lease, one key per call (1 to 64; 1: each batch in one
    /// call); above 1 order is checked per key.
    #[arg(long, default_value_t = 1)]
    key_concurrency: usize,
    /// Run a deliberately broken processor: no-fencing, checkpoint-without-cas,
    /// child-before-parent, no-handler-fence, no-admission or no-timeouts (the checker should
    /// catch it).
    /// Only in a build
    /// with feature `sim-broken`.
    #[cfg(feature = "sim-broken")]
    #[arg(long, default_value = "none")]
    broken: String,
    /// Write the ownership timeline of the (single) run as SVG to this file.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Print the run's whole event trace (single seed only).
    #[arg(long)]
    trace: bool,
    /// Settings for large fleets: renew and acquire every 15 s, expiry 60 s, idle partitions
    /// polled every 5 min, full lists every 2 h, partition sync every 5 min, no trace; the
    /// timed host faults strike the fleet as often as 10 hosts, and the hosts share their
    /// lease tables.
    #[arg(long)]
    large: bool,
}

/// The highest `--fault-rate`: every per-call fault is then certain, and the timed ones
/// frequent enough that a run barely progresses.
const MAX_FAULT_RATE: f64 = 100.0;

/// `--fault-rate` when not given.
const DEFAULT_FAULT_RATE: f64 = 1.0;

/// With `--large`, the timed host faults strike the fleet as often as this many hosts.
const LARGE_TIMED_FAULT_HOSTS: usize = 10;

/// `--records-per-sec` when not given.
const DEFAULT_RECORDS_PER_SEC: u64 = 20;

/// Rejects values no run can be made with, naming the flag.
fn validate(args: &Args) -> anyhow::Result<()> {
    if !(args.fault_rate.is_finite() && (0.0..=MAX_FAULT_RATE).contains(&args.fault_rate)) {
        anyhow::bail!(
            "--fault-rate: must be a finite number between 0 and {MAX_FAULT_RATE} (got {})",
            args.fault_rate
        );
    }
    if args.seeds == Some(0) {
        anyhow::bail!("--seeds: must be at least 1 (got 0)");
    }
    if args.hosts == 0 {
        anyhow::bail!("--hosts: must be at least 1 (got 0)");
    }
    if args.partitions == 0 {
        anyhow::bail!("--partitions: must be at least 1 (got 0)");
    }
    if !(1..=changefeed::processor::MAX_KEY_CONCURRENCY).contains(&args.key_concurrency) {
        anyhow::bail!(
            "--key-concurrency: must be from 1 to {} (got {})",
            changefeed::processor::MAX_KEY_CONCURRENCY,
            args.key_concurrency
        );
    }
    Ok(())
}

fn config(args: &Args, seed: u64) -> anyhow::Result<SimConfig> {
    validate(args)?;
    let mut cfg = SimConfig::new(seed);
    cfg.faults = args
        .faults
        .parse::<Faults>()
        .map_err(|e| anyhow::anyhow!("--faults: {e}"))?;
    cfg.faults.rate = args.fault_rate;
    cfg.hosts = args.hosts;
    cfg.partitions = args.partitions;
    cfg.duration = args.duration;
    cfg.records_per_sec = args.records_per_sec;
    cfg.key_concurrency = args.key_concurrency;
    cfg.strategy = args
        .strategy
        .parse::<StrategyKind>()
        .map_err(|e| anyhow::anyhow!("--strategy: {e}"))?;
    #[cfg(feature = "sim-broken")]
    {
        cfg.broken =
            sim::parse_broken(&args.broken).map_err(|e| anyhow::anyhow!("--broken: {e}"))?;
    }
    if args.large {
        // The Cosmos DB processor's default cadence (renew 17 s, acquire 13 s, expiry 60 s),
        // rounded: a large fleet does not need 2 s cycles.
        cfg.settings.lease_expiry = Duration::from_secs(60);
        cfg.settings.safety_margin = Duration::from_secs(10);
        cfg.settings.renew_interval = Duration::from_secs(15);
        cfg.settings.acquire_interval = Duration::from_secs(15);
        cfg.settings.handoff_timeout = Duration::from_secs(60);
        cfg.settings.poll_delay = Duration::from_secs(300);
        // The full list is a safety net (every change of hands is read as it happens); at
        // 10,000 leases a host reads 10,000 rows for it, so it runs every 2 h.
        cfg.settings.full_list_interval = Duration::from_secs(7200);
        // KCL's periodic shard sync runs every few minutes too; over 10,000 partitions a
        // sync each minute is most of what a quiet fleet does.
        cfg.settings.sync_interval = Duration::from_secs(300);
        cfg.trace = TraceMode::Off;
        cfg.drain_limit = Duration::from_secs(1800);
        // Timed host faults strike the fleet as often as they strike 10 hosts: at their
        // per-host rates a thousand hosts would see a crash every 0.4 s and a host down every
        // 0.24 s, and every host would read every lease that moved (docs/simulation.md).
        cfg.timed_fault_hosts = Some(LARGE_TIMED_FAULT_HOSTS);
        // The hosts share their lease tables, so the fleet applies each change about once.
        cfg.share_tables = true;
    }
    if args.trace {
        cfg.trace = TraceMode::Full;
    }
    Ok(cfg)
}

/// The one-line command that reruns `cfg`'s seed: the seed, faults, hosts, partitions and
/// duration always, then each other flag whose value is not its default (`large`: whether
/// `--large` was given, which `cfg`'s settings do not say).
fn rerun_line(cfg: &SimConfig, large: bool) -> String {
    let duration = if cfg.duration.subsec_millis() == 0 {
        format!("{}s", cfg.duration.as_secs())
    } else {
        format!("{}ms", cfg.duration.as_millis())
    };
    let mut line = format!(
        "changefeed simulate --seed {} --faults {} --hosts {} --partitions {} --duration {duration}",
        cfg.seed, cfg.faults, cfg.hosts, cfg.partitions,
    );
    if cfg.faults.rate != DEFAULT_FAULT_RATE {
        line.push_str(&format!(" --fault-rate {}", cfg.faults.rate));
    }
    if cfg.records_per_sec != DEFAULT_RECORDS_PER_SEC {
        line.push_str(&format!(" --records-per-sec {}", cfg.records_per_sec));
    }
    if large {
        line.push_str(" --large");
    }
    if cfg.strategy != StrategyKind::EqualShare {
        line.push_str(&format!(" --strategy {}", cfg.strategy.name()));
    }
    if cfg.key_concurrency != 1 {
        line.push_str(&format!(" --key-concurrency {}", cfg.key_concurrency));
    }
    #[cfg(feature = "sim-broken")]
    if cfg.broken != sim::Broken::None {
        line.push_str(&format!(" --broken {}", sim::broken_name(cfg.broken)));
    }
    line
}

/// The `RESULT` fields on how long children waited after their parents ended, from the
/// later of the parents' end and the child's first record to its first delivery (the goal:
/// within two acquire intervals): how many children were read, the median, the 99th
/// percentile and the longest wait, and the share within `2 × acquire`.
fn child_waits(waits: &[Duration], acquire: Duration) -> String {
    let within = waits.iter().filter(|w| **w <= acquire * 2).count();
    let share = if waits.is_empty() {
        1.0
    } else {
        within as f64 / waits.len() as f64
    };
    format!(
        "children={} child_wait_p50_s={:.1} child_wait_p99_s={:.1} child_wait_max_s={:.1} child_wait_within_2_acquire={share:.3}",
        waits.len(),
        sim::children::quantile(waits, 0.5).as_secs_f64(),
        sim::children::quantile(waits, 0.99).as_secs_f64(),
        sim::children::quantile(waits, 1.0).as_secs_f64(),
    )
}

/// The longest stretches the liveness rule judged, over runs: a healthy host without a
/// heartbeat, without a lease it should hold, and the largest share of its window any
/// stretch took.
#[derive(Debug, Default, Clone, Copy)]
struct Liveness {
    heartbeat: Duration,
    lease: Duration,
    share: f64,
}

impl Liveness {
    fn add(&mut self, out: &sim::SimOutcome) {
        for gap in &out.longest_gaps {
            let (longest, window) = match gap.what {
                "heartbeat" => (&mut self.heartbeat, Some(out.liveness_windows.heartbeat)),
                _ => (&mut self.lease, out.liveness_windows.lease),
            };
            *longest = (*longest).max(gap.len());
            if let Some(w) = window.filter(|w| !w.is_zero()) {
                self.share = self.share.max(gap.len().as_secs_f64() / w.as_secs_f64());
            }
        }
    }

    /// The `RESULT` fields.
    fn fields(&self) -> String {
        format!(
            "heartbeat_gap_max_s={:.1} lease_gap_max_s={:.1} liveness_window_share_max={:.2}",
            self.heartbeat.as_secs_f64(),
            self.lease.as_secs_f64(),
            self.share
        )
    }
}

/// Runs the command. Exit status: 0 when every run kept every rule, 1 when some run broke one
/// (violations), 2 when the runs could not be made (bad arguments, a file that cannot be
/// written): a script can tell a found bug from a mistyped flag. Errors are printed.
pub fn run(args: Args) -> ExitCode {
    match simulate(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(crate::USAGE_EXIT)
        }
    }
}

fn simulate(args: Args) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let count = args.seeds.unwrap_or(1);
    let first = config(&args, args.seed)?;
    if count == 1 {
        let out = sim::run(&first)?;
        if args.trace {
            print!("{}", out.trace);
        }
        println!(
            "seed {}: {} records written, {} delivered ({} deliveries), {} events, {:.0} virtual s, trace {:016x}",
            out.seed,
            out.written,
            out.delivered,
            out.deliveries,
            out.events.len(),
            out.virtual_time.as_secs_f64(),
            out.trace_hash
        );
        for v in &out.violations {
            println!("  {v}");
        }
        if !out.violations.is_empty() {
            println!("reproduce: {}", rerun_line(&first, args.large));
        }
        if let Some(path) = &args.svg {
            let title = format!(
                "{}  —  ownership by host over virtual time",
                rerun_line(&first, args.large)
            );
            std::fs::write(path, crate::svg::render(&out, &title))
                .with_context(|| format!("writing {}", path.display()))?;
            println!("timeline written to {}", path.display());
        }
        let mut liveness = Liveness::default();
        liveness.add(&out);
        println!(
            "RESULT seeds=1 violations={} wall_s={:.2} {} {} {}",
            out.violations.len(),
            started.elapsed().as_secs_f64(),
            process_cost(),
            child_waits(&out.child_waits, first.settings.acquire_interval),
            liveness.fields()
        );
        return Ok(if out.violations.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    if args.svg.is_some() || args.trace {
        anyhow::bail!("--svg and --trace draw one run: use --seed N without --seeds");
    }
    let next = AtomicU64::new(0);
    let failures: Mutex<Vec<(u64, String)>> = Mutex::new(Vec::new());
    let waits: Mutex<Vec<Duration>> = Mutex::new(Vec::new());
    let liveness: Mutex<Liveness> = Mutex::new(Liveness::default());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let seed = args.seed + i;
                let cfg = match config(&args, seed) {
                    Ok(c) => c,
                    Err(e) => {
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string());
                        break;
                    }
                };
                let run = sim::run(&cfg);
                if let Ok(out) = &run {
                    waits
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend_from_slice(&out.child_waits);
                    liveness.lock().unwrap_or_else(|p| p.into_inner()).add(out);
                }
                match run {
                    Ok(out) if !out.violations.is_empty() => {
                        let lines: Vec<String> =
                            out.violations.iter().map(|v| format!("  {v}")).collect();
                        let text =
                            format!("{}\n{}", rerun_line(&cfg, args.large), lines.join("\n"));
                        failures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((seed, text));
                    }
                    Ok(_) => {}
                    Err(e) => errors
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(e.to_string()),
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = errors.first() {
        anyhow::bail!("{e}");
    }
    // Printed in seed order once all are done, so two runs of the same seeds print the same.
    let mut failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    failures.sort_unstable_by_key(|(seed, _)| *seed);
    for (_, text) in &failures {
        println!("{text}");
    }
    let waits = waits.into_inner().unwrap_or_else(|p| p.into_inner());
    let liveness = liveness.into_inner().unwrap_or_else(|p| p.into_inner());
    println!(
        "RESULT seeds={count} violations={} wall_s={:.1} {} {} {}",
        failures.len(),
        started.elapsed().as_secs_f64(),
        process_cost(),
        child_waits(&waits, first.settings.acquire_interval),
        liveness.fields()
    );
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The `RESULT` fields on what the run cost this process: user and system CPU seconds (all
/// threads; wall time on a shared machine says little) and the peak resident memory.
fn process_cost() -> String {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(usage) => {
            let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
            format!(
                "cpu_s={:.1} peak_rss_mb={}",
                secs(usage.user_time()) + secs(usage.system_time()),
                // Linux reports the peak in kilobytes.
                usage.max_rss() / 1024
            )
        }
        Err(_) => "cpu_s=? peak_rss_mb=?".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rerun_line_names_every_setting_that_differs() {
        let mut cfg = SimConfig::new(7);
        cfg.faults = Faults::all();
        cfg.duration = Duration::from_secs(120);
        assert_eq!(
            rerun_line(&cfg, false),
            "changefeed simulate --seed 7 --faults all --hosts 4 --partitions 8 --duration 120s"
        );
        cfg.duration = Duration::from_millis(1500);
        cfg.faults.rate = 0.5;
        cfg.records_per_sec = 3;
        cfg.strategy = StrategyKind::Load;
        cfg.key_concurrency = 4;
        let line = rerun_line(&cfg, true);
        for part in [
            " --strategy load",
            " --key-concurrency 4",
            "--duration 1500ms",
            "--fault-rate 0.5",
            "--records-per-sec 3",
            " --large",
        ] {
            assert!(line.contains(part), "{line} lacks {part}");
        }
        assert!(!line.contains("--broken"), "{line}");
    }

    #[cfg(feature = "sim-broken")]
    #[test]
    fn the_rerun_line_names_the_broken_variant() {
        let mut cfg = SimConfig::new(7);
        cfg.broken = sim::Broken::NoFencing;
        assert!(
            rerun_line(&cfg, false).ends_with(" --broken no-fencing"),
            "{}",
            rerun_line(&cfg, false)
        );
    }
}
