//! `rebalance`: how fast a fleet rebalances, and what it costs in store calls, for our
//! strategy against KCL-like and Cosmos-like ones, all in one run with the same timings.
//!
//! Every fleet is the real processor on the simulator (`changefeed::sim`): 1000 leases (by
//! default), an idle in-memory feed, virtual time, renew and acquire every 2 s, lease expiry
//! 10 s. The three columns differ only in what the anchors do differently:
//!
//! - the balancing decision: `EqualShare` (ours), `KclLike` (bulk takes of expired leases,
//!   at most one steal per cycle, from the most-loaded host), `CosmosLike` (the same with
//!   Cosmos's target rule);
//! - their store costs: for KCL and Cosmos every host also renews each lease it owns once per
//!   renew interval (one CAS write per lease, which contends with checkpoints as theirs do) and
//!   lists the whole lease table every acquire cycle.
//!
//! Liveness is judged the same way for all three (a host's leases expire `lease_expiry` after
//! its heartbeat stops changing, on the observer's clock), which is what KCL's per-lease
//! counter rule with `failover_time = lease_expiry` amounts to when a host dies; a steal by
//! the anchors is a hand-off request here (the only safe way to move a live host's lease in
//! this protocol), one lease per cycle as theirs.

use std::collections::BTreeMap;
use std::time::Duration;

use changefeed::model::PartitionId;
use changefeed::processor::Settings;
use changefeed::sim::{FleetConfig, SimFleet, StrategyKind, TraceMode};

/// Arguments of `changefeed-bench rebalance`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases (partitions).
    #[arg(long, default_value_t = 1000)]
    leases: u32,
    /// Virtual minutes of steady state over which store calls are counted.
    #[arg(long, default_value_t = 5)]
    minutes: u64,
}

fn settings(anchor: bool) -> Settings {
    let acquire = Duration::from_secs(2);
    Settings {
        lease_expiry: Duration::from_secs(10),
        renew_interval: Duration::from_secs(2),
        safety_margin: Duration::from_secs(2),
        acquire_interval: acquire,
        // The anchors scan the whole lease table every cycle.
        full_list_interval: if anchor {
            acquire
        } else {
            Duration::from_secs(300)
        },
        poll_delay: Duration::from_secs(5),
        handoff_timeout: Duration::from_secs(10),
        ..Settings::default()
    }
}

fn block<F: std::future::Future>(f: F) -> anyhow::Result<F::Output> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?
        .block_on(f))
}

async fn fleet(strategy: StrategyKind, leases: u32) -> SimFleet {
    let anchor = strategy != StrategyKind::EqualShare;
    SimFleet::simulated(FleetConfig {
        seed: 1,
        partitions: leases,
        settings: settings(anchor),
        strategy,
        anchor_costs: anchor,
        trace: TraceMode::Off,
        history: false,
    })
    .await
}

fn name(i: usize) -> String {
    format!("host-{i:03}")
}

/// Steps until balanced (or `limit`), counting lease moves. Returns (seconds, moves, done).
async fn until_balanced(fleet: &mut SimFleet, limit: Duration) -> (f64, usize, bool) {
    let step = Duration::from_millis(250);
    let t0 = fleet.now();
    let mut last: BTreeMap<PartitionId, String> = fleet
        .owners()
        .await
        .into_iter()
        .filter_map(|(p, o)| o.map(|o| (p, o)))
        .collect();
    let mut moves = 0;
    loop {
        fleet.advance(step).await;
        for (p, o) in fleet.owners().await {
            if let Some(o) = o {
                if last.get(&p).is_some_and(|prev| *prev != o) {
                    moves += 1;
                }
                last.insert(p, o);
            }
        }
        let elapsed = fleet.now() - t0;
        if fleet.balanced().await {
            return (elapsed.as_secs_f64(), moves, true);
        }
        if elapsed >= limit {
            return (elapsed.as_secs_f64(), moves, false);
        }
    }
}

struct Change {
    secs: f64,
    cycles: u64,
    moves: usize,
    done: bool,
}

async fn change(strategy: StrategyKind, leases: u32, from: usize, to: usize) -> Change {
    let mut fleet = fleet(strategy, leases).await;
    for i in 0..from {
        fleet.start(&name(i));
    }
    let limit = Duration::from_secs(1800);
    until_balanced(&mut fleet, limit).await;
    fleet.advance(Duration::from_secs(5)).await;
    if to > from {
        for i in from..to {
            fleet.start(&name(i));
        }
    } else {
        for i in to..from {
            fleet.begin_stop(&name(i));
        }
    }
    let (secs, moves, done) = until_balanced(&mut fleet, limit).await;
    fleet.stop_all().await;
    let acquire = settings(false).acquire_interval.as_secs_f64();
    Change {
        secs,
        cycles: (secs / acquire).ceil() as u64,
        moves,
        done,
    }
}

/// Seconds from a crash until every lease of the crashed host is owned by a running host.
async fn failover(strategy: StrategyKind, leases: u32) -> f64 {
    let mut fleet = fleet(strategy, leases).await;
    for i in 0..10 {
        fleet.start(&name(i));
    }
    until_balanced(&mut fleet, Duration::from_secs(1800)).await;
    fleet.advance(Duration::from_secs(5)).await;
    let victim = name(0);
    fleet.crash(&victim);
    let t0 = fleet.now();
    loop {
        fleet.advance(Duration::from_millis(100)).await;
        let (counts, free) = fleet.ownership().await;
        if free == 0 && !counts.contains_key(&victim) {
            break;
        }
        if fleet.now() - t0 > Duration::from_secs(600) {
            break;
        }
    }
    let secs = (fleet.now() - t0).as_secs_f64();
    fleet.stop_all().await;
    secs
}

struct Io {
    writes: f64,
    reads: f64,
    rows: f64,
}

/// Store calls per host per minute in steady state, 10 hosts.
async fn io(strategy: StrategyKind, leases: u32, minutes: u64) -> Io {
    let mut fleet = fleet(strategy, leases).await;
    let hosts: Vec<String> = (0..10).map(name).collect();
    for h in &hosts {
        fleet.start(h);
    }
    until_balanced(&mut fleet, Duration::from_secs(1800)).await;
    fleet.advance(Duration::from_secs(30)).await;
    let before: Vec<_> = hosts.iter().map(|h| fleet.store_counts(h)).collect();
    fleet.advance(Duration::from_secs(minutes * 60)).await;
    let after: Vec<_> = hosts.iter().map(|h| fleet.store_counts(h)).collect();
    fleet.stop_all().await;
    let per = |f: &dyn Fn(&changefeed::lease::StoreCounts) -> u64| {
        let total: u64 = after.iter().zip(&before).map(|(a, b)| f(a) - f(b)).sum();
        total as f64 / hosts.len() as f64 / minutes as f64
    };
    Io {
        writes: per(&|c| c.writes),
        reads: per(&|c| c.reads),
        rows: per(&|c| c.lease_rows_read),
    }
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let strategies = [
        StrategyKind::EqualShare,
        StrategyKind::Kcl,
        StrategyKind::Cosmos,
    ];
    let changes = [(1usize, 2usize), (10, 11), (10, 20), (20, 10)];
    println!(
        "{} leases, idle feed, renew and acquire every 2 s, lease expiry 10 s, virtual time",
        args.leases
    );
    println!(
        "{:<28} {:>22} {:>22} {:>22}",
        "", "ours", "KCL-like", "Cosmos-like"
    );
    let mut cycles: BTreeMap<(usize, usize, &str), u64> = BTreeMap::new();
    for (from, to) in changes {
        let mut cells = Vec::new();
        for s in strategies {
            let c = block(change(s, args.leases, from, to))?;
            cycles.insert((from, to, s.name()), c.cycles);
            cells.push(format!(
                "{}{} cyc {:.0} s {} mv",
                if c.done { "" } else { ">" },
                c.cycles,
                c.secs,
                c.moves
            ));
        }
        println!(
            "{:<28} {:>22} {:>22} {:>22}",
            format!("hosts {from} -> {to}"),
            cells[0],
            cells[1],
            cells[2]
        );
    }
    let mut fail = Vec::new();
    for s in strategies {
        fail.push(block(failover(s, args.leases))?);
    }
    println!(
        "{:<28} {:>22.1} {:>22.1} {:>22.1}",
        "failover after a crash (s)", fail[0], fail[1], fail[2]
    );
    let mut ios = Vec::new();
    for s in strategies {
        ios.push(block(io(s, args.leases, args.minutes))?);
    }
    let small = block(io(StrategyKind::EqualShare, args.leases / 10, args.minutes))?;
    println!(
        "{:<28} {:>22.0} {:>22.0} {:>22.0}",
        "writes / host / min", ios[0].writes, ios[1].writes, ios[2].writes
    );
    println!(
        "{:<28} {:>22.0} {:>22.0} {:>22.0}",
        "reads / host / min", ios[0].reads, ios[1].reads, ios[2].reads
    );
    println!(
        "{:<28} {:>22.0} {:>22.0} {:>22.0}",
        "lease rows read / host / min", ios[0].rows, ios[1].rows, ios[2].rows
    );
    println!(
        "ours with {} leases: writes / host / min {:.0}, reads {:.0}, lease rows read {:.0}",
        args.leases / 10,
        small.writes,
        small.reads,
        small.rows
    );
    println!("wall time {:.1} s", started.elapsed().as_secs_f64());
    let ours = cycles[&(10, 11, "ours")].max(1);
    let kcl = cycles[&(10, 11, "kcl")];
    let cosmos = cycles[&(10, 11, "cosmos")];
    println!(
        "RESULT cycles_ours={ours} cycles_kcl={kcl} cycles_cosmos={cosmos} ratio_vs_kcl={:.1} failover_s_ours={:.1} failover_s_kcl={:.1} writes_per_host_min_ours={:.0} writes_per_host_min_kcl={:.0}",
        kcl as f64 / ours as f64,
        fail[0],
        fail[1],
        ios[0].writes,
        ios[1].writes
    );
    Ok(())
}
