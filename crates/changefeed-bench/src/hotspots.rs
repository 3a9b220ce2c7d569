//! `hotspots`: placement by measured load against counts, on a pure workload model.
//!
//! The model (`hotspots/model.rs`) steps a fleet every acquire interval (2 s) for an hour on
//! four workloads (uniform rates; Zipf; a hot spot that appears, moves and fades; a diurnal
//! swing in opposite phase on two halves of the partitions), with loads measured as a moving
//! average of the rates (time constant `--average-s`) with ±10 % noise. On the same workloads it runs [`EqualShare`]
//! (counts), [`LoadShare`] (given the measured loads) and a model of KCL 3.x's assignment (a
//! leader every 20 s, rebalancing every third run the workers 10 % over the mean, moving 60 %
//! of the excess), by throughput and by CPU (utilisation). Hand-offs complete within a step.
//! It reports per placement the p99 over time of the busiest host's utilisation over the
//! mean, hand-offs per hour, repeat moves (within 5 minutes) and, on the hot-spot workload,
//! how long after the hot spot appears or moves the busiest host is within 1.25 of the mean.
//!
//! What it leaves out: store and hand-off latency, a handler's real cost curve (utilisation is
//! records/s ÷ capacity), lag, and KCL 3.x's own CPU measurement and its lease-level
//! throughput limits; the KCL 3.x figures are our model's, not KCL's.
//!
//! [`EqualShare`]: changefeed::balance::EqualShare
//! [`LoadShare`]: changefeed::balance::LoadShare

mod model;

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::ensure;

use model::{Outcome, Placer, Shape, Workload};

/// Arguments of `changefeed-bench hotspots`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Partitions (leases).
    #[arg(long, default_value_t = 256)]
    partitions: usize,
    /// Hosts.
    #[arg(long, default_value_t = 8)]
    hosts: usize,
    /// Simulated minutes.
    #[arg(long, default_value_t = 60)]
    minutes: u64,
    /// The seed of the noise and of the partitions' order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The time constant of the measured loads' moving average, in seconds.
    #[arg(long, default_value_t = 6)]
    average_s: u64,
    /// A short run for CI: 64 partitions, 40 minutes.
    #[arg(long)]
    quick: bool,
}

const PLACERS: [(&str, Placer); 4] = [
    ("equal", Placer::Equal),
    ("load", Placer::Load),
    ("kcl3", Placer::Kcl3 { cpu: false }),
    ("kcl3cpu", Placer::Kcl3 { cpu: true }),
];

/// The p99 of `v` (nearest rank); 0 when empty.
fn p99(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n => s[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1],
    }
}

/// Runs the benchmark (pure computation: no runtime, no store).
pub fn run(args: Args) -> anyhow::Result<()> {
    let (partitions, minutes) = if args.quick {
        (64, 40)
    } else {
        (args.partitions, args.minutes)
    };
    ensure!(args.hosts > 0, "--hosts must be at least 1");
    ensure!(partitions > 0, "--partitions must be at least 1");
    ensure!(
        minutes >= 30,
        "--minutes must be at least 30 (the hot spot appears at 10)"
    );
    let shape = Shape {
        partitions,
        hosts: args.hosts,
        duration: Duration::from_secs(minutes * 60),
        step: Duration::from_secs(2),
        warmup: Duration::from_secs(120),
        average: Duration::from_secs(args.average_s.max(1)),
        seed: args.seed,
    };
    let hours = (shape.duration - shape.warmup).as_secs_f64() / 3600.0;
    let equal_capacity = vec![1.0; args.hosts];
    // A quarter of the hosts (at least one) twice as big.
    let mixed: Vec<f64> = (0..args.hosts)
        .map(|h| if h < args.hosts.div_ceil(4) { 2.0 } else { 1.0 })
        .collect();
    println!(
        "hotspots: {partitions} partitions, {} hosts, {minutes} min, steps of 2 s, loads averaged \
         over {} s, seed {}",
        args.hosts, args.average_s, args.seed
    );
    println!(
        "{:<9} {:<8} {:>18} {:>11} {:>13} {:>12}",
        "workload", "placer", "max/mean p99", "moves/hour", "repeat moves", "converge s"
    );
    let mut result = String::from("RESULT");
    let mut headline: Vec<(String, f64)> = Vec::new();
    let mut by: std::collections::BTreeMap<(String, &str), Outcome> = Default::default();
    let runs = Workload::ALL
        .iter()
        .map(|&w| (w, w.name().to_string(), &equal_capacity))
        .chain(std::iter::once((
            Workload::Zipf,
            "zipf_mixed".to_string(),
            &mixed,
        )));
    for (w, name, capacity) in runs {
        for (placer_name, placer) in PLACERS {
            let out = model::run(w, placer, &shape, capacity);
            let ratio = p99(&out.max_over_mean);
            let per_hour = out.moves as f64 / hours;
            let converge = out.converge_s.iter().copied().fold(0.0, f64::max);
            println!(
                "{name:<9} {placer_name:<8} {ratio:>18.3} {per_hour:>11.1} {:>13} {:>12}",
                out.repeat_moves,
                if w == Workload::HotSpot {
                    format!("{converge:.0}")
                } else {
                    "-".into()
                }
            );
            write!(
                result,
                " load_max_over_mean_p99_{placer_name}_{name}={ratio:.3}"
            )?;
            write!(result, " moves_per_hour_{placer_name}_{name}={per_hour:.1}")?;
            write!(
                result,
                " repeat_moves_{placer_name}_{name}={}",
                out.repeat_moves
            )?;
            if w == Workload::HotSpot && capacity == &equal_capacity {
                write!(result, " converge_s_{placer_name}_{name}={converge:.0}")?;
            }
            by.insert((name.clone(), placer_name), out);
        }
    }
    // The headline keys: the worse of the Zipf and moving hot-spot workloads.
    for placer in ["equal", "load", "kcl3"] {
        let worst = ["zipf", "hotspot"]
            .iter()
            .map(|w| p99(&by[&((*w).to_string(), placer)].max_over_mean))
            .fold(0.0, f64::max);
        headline.push((format!("load_max_over_mean_p99_{placer}"), worst));
    }
    for placer in ["load", "kcl3"] {
        let worst = ["zipf", "hotspot"]
            .iter()
            .map(|w| by[&((*w).to_string(), placer)].moves as f64 / hours)
            .fold(0.0, f64::max);
        headline.push((format!("moves_per_hour_{placer}"), worst));
    }
    for placer in ["load", "kcl3"] {
        let hot = &by[&("hotspot".to_string(), placer)];
        headline.push((
            format!("converge_s_{placer}"),
            hot.converge_s.iter().copied().fold(0.0, f64::max),
        ));
    }
    let mut line = String::from("RESULT");
    for (k, v) in &headline {
        if k.starts_with("load_max") {
            write!(line, " {k}={v:.3}")?;
        } else {
            write!(line, " {k}={v:.1}")?;
        }
    }
    println!("{}{}", line, &result["RESULT".len()..]);
    Ok(())
}
