//! `store-io`: store reads and writes per host in steady state, on virtual time.
//!
//! Ten hosts (by default) share an idle feed and an in-memory store, each host running the real
//! processor behind the simulator's seams ([`SimFleet`]); once they have balanced, the
//! benchmark counts every store call each host makes over a long steady window and reports
//! them per host and fleet-wide: ours **measured**, the anchors **computed** from their
//! published pattern (every host renews each lease it owns once per renew interval and scans
//! the whole lease table once per taker/acquire cycle), at our timings and at each anchor's
//! own defaults: KCL 2.x with `failoverTimeMillis` 10 s renews every 10 s / 3 − 25 ms =
//! 3.308 s and scans every (10 s + 25 ms) × 2 = 20.05 s; the Cosmos DB processor renews every
//! 17 s and acquires every 13 s. The anchors read no heartbeat rows; on an idle feed nobody
//! checkpoints.
//!
//! The hosts share their lease tables as `changefeed simulate --large` does, so 1,000 hosts
//! over 100,000 leases hold one table, not 1,000. Sharing changes what a host keeps in
//! memory, not what it asks the store: in steady state no lease changes hands, so there is
//! no list of changes for a shared table to shorten, and every host still makes (and is
//! counted for) its own head reads, heartbeats and full lists. `--own-tables` runs the hosts
//! without sharing, to check that on a fleet small enough to afford it.

use std::collections::BTreeSet;
use std::time::Duration;

use changefeed::lease::StoreCounts;
use changefeed::processor::Settings;
use changefeed::sim::{FleetConfig, SimFleet, StrategyKind, TraceMode};

use crate::usage::RunCost;

/// Arguments of `changefeed-bench store-io`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases (partitions).
    #[arg(long, default_value_t = 1000)]
    leases: u32,
    /// Hosts.
    #[arg(long, default_value_t = 10)]
    hosts: u32,
    /// Virtual minutes of steady state measured: 300 intervals of 2 s, plenty on an idle
    /// feed, where every interval is like the last; the run's CPU grows with hosts × minutes.
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Each host builds and keeps its own lease table, as hosts in separate processes do
    /// (memory grows with hosts × leases); by default the hosts share them.
    #[arg(long)]
    own_tables: bool,
    /// A small run for a smoke test: 10 hosts, 1,000 leases, 2 virtual minutes.
    #[arg(long)]
    quick: bool,
}

/// Virtual time the fleet may take to balance before the run fails.
const BALANCE_LIMIT: Duration = Duration::from_secs(1800);

/// Runs the benchmark.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.hosts, args.leases, args.minutes) = (10, 1000, 2);
    }
    anyhow::ensure!(args.hosts > 0, "--hosts must be at least 1");
    anyhow::ensure!(args.leases > 0, "--leases must be at least 1");
    anyhow::ensure!(args.minutes > 0, "--minutes must be at least 1");
    let cost = RunCost::start()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let m = rt.block_on(measure(&args))?;
    report(&args, &m, &cost)
}

/// What one run counted.
struct Measured {
    settings: Settings,
    /// Virtual seconds the fleet took to balance.
    balance_s: f64,
    /// Every host's store calls over the steady window, summed.
    total: StoreCounts,
    window: Duration,
}

/// Our default settings but for the idle poll: on an idle feed a worker's poll reads the feed,
/// never the store, and at 100,000 leases polling every 500 ms would be most of the run's CPU.
fn settings() -> Settings {
    Settings {
        poll_delay: Duration::from_secs(300),
        ..Settings::default()
    }
}

async fn measure(args: &Args) -> anyhow::Result<Measured> {
    let settings = settings();
    let mut fleet = SimFleet::simulated(FleetConfig {
        seed: 1,
        partitions: args.leases,
        settings: settings.clone(),
        strategy: StrategyKind::EqualShare,
        anchor_costs: false,
        trace: TraceMode::Off,
        history: false,
        head_reads_per_second: None,
        share_tables: !args.own_tables,
        pool: None,
    })
    .await;
    let names: Vec<String> = (0..args.hosts).map(|h| format!("host-{h:04}")).collect();
    for name in &names {
        anyhow::ensure!(fleet.start(name), "host {name} did not start");
    }
    let balance_s = balance(&mut fleet).await?;
    let before: Vec<StoreCounts> = names.iter().map(|n| fleet.store_counts(n)).collect();
    let window = Duration::from_secs(args.minutes * 60);
    fleet.advance(window).await;
    let after: Vec<StoreCounts> = names.iter().map(|n| fleet.store_counts(n)).collect();
    let owners: BTreeSet<String> = fleet.owners().await.into_values().flatten().collect();
    anyhow::ensure!(
        owners.len() == names.len() && fleet.balanced().await,
        "the fleet did not stay balanced through the window ({} of {} hosts own leases)",
        owners.len(),
        names.len()
    );
    fleet.stop_all().await;
    let total = before
        .iter()
        .zip(&after)
        .fold(StoreCounts::default(), |sum, (b, a)| sum.plus(&a.since(b)));
    Ok(Measured {
        settings,
        balance_s,
        total,
        window,
    })
}

/// Advances the fleet until it is balanced; returns the virtual seconds that took.
async fn balance(fleet: &mut SimFleet) -> anyhow::Result<f64> {
    let t0 = fleet.now();
    // Listing 100,000 leases to check costs more than a cycle: check every 10 s.
    let step = Duration::from_secs(10);
    loop {
        fleet.advance(step).await;
        if fleet.balanced().await {
            return Ok((fleet.now() - t0).as_secs_f64());
        }
        anyhow::ensure!(
            fleet.now() - t0 < BALANCE_LIMIT,
            "the fleet did not balance within {} virtual seconds",
            BALANCE_LIMIT.as_secs()
        );
    }
}

fn report(args: &Args, m: &Measured, cost: &RunCost) -> anyhow::Result<()> {
    let settings = &m.settings;
    let total = &m.total;
    let hosts_n = f64::from(args.hosts);
    let leases = f64::from(args.leases);
    let minutes = args.minutes as f64;
    let renew_intervals = m.window.as_secs_f64() / settings.renew_interval.as_secs_f64();
    let acquire_intervals = m.window.as_secs_f64() / settings.acquire_interval.as_secs_f64();
    let per_host = |n: u64| n as f64 / hosts_n;
    let writes = per_host(total.writes) / renew_intervals;
    let checkpoints = per_host(total.writes - total.heartbeats) / renew_intervals;
    let rows = per_host(total.lease_rows_read) / acquire_intervals;
    let hb_rows = per_host(total.heartbeat_rows_read) / acquire_intervals;
    // Head rows: the change counter and the membership view, read together.
    let head_rows = per_host(total.head_rows_read) / acquire_intervals;
    let reads = per_host(total.reads) / acquire_intervals;
    // Every row read: heartbeat, head and lease rows together.
    let all_rows = rows + hb_rows + head_rows;
    // Per host per minute, the unit every cadence can be compared in.
    let ours_min = Anchor {
        writes: per_host(total.writes) / minutes,
        lease_rows: per_host(total.lease_rows_read) / minutes,
        heartbeat_rows: per_host(total.heartbeat_rows_read + total.head_rows_read) / minutes,
    };
    let same = Anchor::computed(
        leases,
        hosts_n,
        settings.renew_interval,
        settings.acquire_interval,
    );
    let kcl_default = Anchor::computed(
        leases,
        hosts_n,
        Duration::from_millis(10_000 / 3 - 25),
        Duration::from_millis((10_000 + 25) * 2),
    );
    let cosmos_default = Anchor::computed(
        leases,
        hosts_n,
        Duration::from_secs(17),
        Duration::from_secs(13),
    );
    println!(
        "{} leases, {} hosts ({} tables), balanced after {:.0} virtual s, then {} virtual minutes of steady state on an idle feed",
        args.leases,
        args.hosts,
        if args.own_tables { "own" } else { "shared" },
        m.balance_s,
        args.minutes
    );
    println!(
        "ours: renew {:?}, acquire {:?}, full list every {:?}",
        settings.renew_interval, settings.acquire_interval, settings.full_list_interval
    );
    println!();
    println!(
        "{:<42} {:>10} {:>12}",
        "per our interval (measured)", "per host", "fleet-wide"
    );
    for (what, v) in [
        ("writes per renew interval", writes),
        ("  of which not heartbeats", checkpoints),
        ("store reads per acquire interval", reads),
        ("lease rows read per acquire interval", rows),
        ("heartbeat rows read per acquire interval", hb_rows),
        ("head rows read per acquire interval", head_rows),
        ("rows read per acquire interval, in all", all_rows),
    ] {
        println!("{what:<42} {v:>10.2} {:>12.0}", v * hosts_n);
    }
    println!();
    println!(
        "{:<30} {:>14} {:>18} {:>18} {:>18}",
        "per host per minute", "ours", "pattern at ours", "KCL 2.x defaults", "Cosmos defaults"
    );
    println!(
        "{:<30} {:>14} {:>18} {:>18} {:>18}",
        "", "(measured)", "(computed)", "(computed)", "(computed)"
    );
    for (what, f) in [
        ("writes", (|a: &Anchor| a.writes) as fn(&Anchor) -> f64),
        ("lease rows read", |a: &Anchor| a.lease_rows),
        ("heartbeat and head rows read", |a: &Anchor| {
            a.heartbeat_rows
        }),
    ] {
        println!(
            "{:<30} {:>14.0} {:>18.0} {:>18.0} {:>18.0}",
            what,
            f(&ours_min),
            f(&same),
            f(&kcl_default),
            f(&cosmos_default)
        );
    }
    println!(
        "RESULT hosts={} leases={} writes_per_host_per_interval={writes:.3} checkpoints_per_host_per_interval={checkpoints:.3} lease_rows_read_per_host_per_interval={rows:.2} kcl_writes_per_host_per_interval={:.1} kcl_lease_rows_read_per_host_per_interval={:.0} heartbeat_rows_read_per_host_per_interval={hb_rows:.2} writes_per_host_min_ours={:.1} writes_per_host_min_kcl_default={:.0} writes_per_host_min_cosmos_default={:.0} lease_rows_read_per_host_min_ours={:.0} lease_rows_read_per_host_min_kcl_default={:.0} lease_rows_read_per_host_min_cosmos_default={:.0} heartbeat_rows_read_per_host_min_ours={:.0} rows_read_per_host_per_interval={all_rows:.2} rows_read_per_interval_fleet={:.0} writes_per_interval_fleet={:.0} head_rows_read_per_host_per_interval={head_rows:.2} balance_s={:.0} {}",
        args.hosts,
        args.leases,
        leases / hosts_n,
        leases,
        ours_min.writes,
        kcl_default.writes,
        cosmos_default.writes,
        ours_min.lease_rows,
        kcl_default.lease_rows,
        cosmos_default.lease_rows,
        ours_min.heartbeat_rows,
        all_rows * hosts_n,
        writes * hosts_n,
        m.balance_s,
        cost.fields()?,
    );
    Ok(())
}

/// Store work per host per minute.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    writes: f64,
    lease_rows: f64,
    heartbeat_rows: f64,
}

impl Anchor {
    /// The anchors' published pattern: each host renews its share of the leases every `renew`
    /// and scans the whole table every `scan`; no heartbeat rows.
    fn computed(leases: f64, hosts: f64, renew: Duration, scan: Duration) -> Self {
        Anchor {
            writes: leases / hosts * 60.0 / renew.as_secs_f64(),
            lease_rows: leases * 60.0 / scan.as_secs_f64(),
            heartbeat_rows: 0.0,
        }
    }
}
