//! `report`: the figures table the README quotes, produced by a command rather than copied by
//! hand. It runs the `--quick` form of each benchmark that needs no server (this same
//! executable, one subcommand at a time), or reads the `RESULT` lines of fuller runs from a
//! file, and prints one row per headline figure: ours, what it is set against, and whether it
//! is measured, computed from a published pattern, or from the simulator. It ends with its own
//! `RESULT` line: each figure under `<subcommand>_<key>`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use changefeed_bench::result::{parse, parse_last};

/// Arguments of `changefeed-bench report`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Read the figures from this file instead of running the quick benchmarks: lines
    /// `SUBCOMMAND: RESULT key=value …` (other lines are ignored), as
    /// `changefeed-bench SUBCOMMAND … | sed -n 's/^RESULT/SUBCOMMAND: RESULT/p'` writes them.
    #[arg(long)]
    results: Option<PathBuf>,
    /// Only these subcommands (repeat the flag; default: every one in the table).
    #[arg(long = "bench")]
    benches: Vec<String>,
}

/// What a figure is set against: another key of the same line, or a goal in words.
#[derive(Clone, Copy)]
enum Against {
    Key(&'static str, &'static str),
    Goal(&'static str),
}

/// One row of the table.
struct Row {
    bench: &'static str,
    figure: &'static str,
    key: &'static str,
    against: Against,
    how: &'static str,
}

/// The benchmarks run by default: `--quick`, no server, no other binary.
const RUN_BY_DEFAULT: [&str; 7] = [
    "store-io",
    "rebalance",
    "balance",
    "store",
    "throughput",
    "hotspots",
    "key-parallel",
];

const ROWS: &[Row] = &[
    Row {
        bench: "store-io",
        figure: "store writes / host / 3 s renew interval, idle",
        key: "writes_per_host_per_interval",
        against: Against::Key("KCL 2.x pattern", "kcl_writes_per_host_per_interval"),
        how: "measured; KCL computed",
    },
    Row {
        bench: "store-io",
        figure: "rows read / host / interval, idle",
        key: "rows_read_per_host_per_interval",
        against: Against::Key(
            "KCL 2.x pattern (lease rows)",
            "kcl_lease_rows_read_per_host_per_interval",
        ),
        how: "measured; KCL computed",
    },
    Row {
        bench: "rebalance",
        figure: "acquire cycles until balanced, 10 -> 11 hosts",
        key: "cycles_ours",
        against: Against::Key("KCL 2.x model", "cycles_kcl"),
        how: "simulator",
    },
    Row {
        bench: "rebalance",
        figure: "failover after a crash, s",
        key: "failover_s_ours",
        against: Against::Key("KCL 2.x model", "failover_s_kcl"),
        how: "simulator",
    },
    Row {
        bench: "balance",
        figure: "one host's plan, ms (worst scenario)",
        key: "balance_ms",
        against: Against::Key("one O(leases) pass", "baseline_ms"),
        how: "measured",
    },
    Row {
        bench: "store",
        figure: "SQLite checkpoint CAS / s",
        key: "sqlite_replace_per_s",
        against: Against::Key("in-memory store", "memory_replace_per_s"),
        how: "measured",
    },
    Row {
        bench: "throughput",
        figure: "records / s through one host",
        key: "processor_rps",
        against: Against::Key("raw feed reads", "raw_rps"),
        how: "measured",
    },
    Row {
        bench: "hotspots",
        figure: "p99 max/mean host load, by measured load",
        key: "load_max_over_mean_p99_load",
        against: Against::Key("KCL 3.x model", "load_max_over_mean_p99_kcl3"),
        how: "simulator (workload model)",
    },
    Row {
        bench: "key-parallel",
        figure: "records / s of one hot partition, 16 calls by key",
        key: "rps_n16",
        against: Against::Key("one call at a time", "rps_n1"),
        how: "measured",
    },
    Row {
        bench: "run-throughput",
        figure: "CPU / record: per-batch ÷ long-lived, batch 10",
        key: "long_lived_cpu_ratio_b10",
        against: Against::Goal("goal ≥ 10"),
        how: "measured",
    },
    Row {
        bench: "run-throughput",
        figure: "CPU / record: per-batch ÷ KCL protocol, batch 10",
        key: "kcl_cpu_ratio_b10",
        against: Against::Goal("goal ≥ 10"),
        how: "measured",
    },
    Row {
        bench: "dynamodb-cost",
        figure: "DynamoDB write units / min, idle fleet",
        key: "wcu_per_min_ours",
        against: Against::Key("KCL 2.x pattern", "wcu_per_min_kcl"),
        how: "measured (DynamoDB Local)",
    },
    Row {
        bench: "dynamodb-keys",
        figure: "hottest key's write units / s at 10,000 hosts",
        key: "max_key_wcu_per_s_at_10000",
        against: Against::Goal("DynamoDB's limit 1,000"),
        how: "computed from measured",
    },
    Row {
        bench: "outbox",
        figure: "PostgreSQL outbox records / s / partition",
        key: "postgres_read_rps_per_partition",
        against: Against::Key("in-memory feed", "memory_read_rps_per_partition"),
        how: "measured",
    },
];

/// Runs the report.
pub fn run(args: Args) -> anyhow::Result<()> {
    for b in &args.benches {
        if !ROWS.iter().any(|r| r.bench == b) {
            bail!("--bench {b}: not a benchmark of the table");
        }
    }
    let wanted = |b: &str| args.benches.is_empty() || args.benches.iter().any(|w| w == b);
    let (results, source) = match &args.results {
        Some(path) => (read(path)?, format!("--results {}", path.display())),
        None => {
            let mut results = BTreeMap::new();
            for bench in RUN_BY_DEFAULT.iter().copied().filter(|b| wanted(b)) {
                eprintln!("report: changefeed-bench {bench} --quick");
                results.insert(bench.to_string(), run_quick(bench)?);
            }
            (results, "the --quick forms".to_string())
        }
    };
    println!("Figures from {source}:");
    println!();
    println!("| benchmark | figure | ours | against | theirs | how |");
    println!("|---|---|---:|---|---:|---|");
    let mut line = String::from("RESULT");
    for row in ROWS.iter().filter(|r| wanted(r.bench)) {
        let Some(fields) = results.get(row.bench) else {
            continue;
        };
        let ours = fields
            .get(row.key)
            .with_context(|| format!("{}: no `{}` in its RESULT line", row.bench, row.key))?;
        let (against, theirs) = match row.against {
            Against::Key(label, key) => (
                label,
                fields
                    .get(key)
                    .with_context(|| format!("{}: no `{key}` in its RESULT line", row.bench))?
                    .as_str(),
            ),
            Against::Goal(goal) => (goal, "—"),
        };
        println!(
            "| `{}` | {} | {ours} | {against} | {theirs} | {} |",
            row.bench, row.figure, row.how
        );
        line.push_str(&format!(
            " {}_{}={ours}",
            row.bench.replace('-', "_"),
            row.key
        ));
    }
    println!();
    println!("{line}");
    Ok(())
}

/// The `RESULT` fields of `changefeed-bench BENCH --quick`, run from this executable.
fn run_quick(bench: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let exe = std::env::current_exe().context("locating changefeed-bench")?;
    let out = Command::new(exe)
        .args([bench, "--quick"])
        .output()
        .with_context(|| format!("running changefeed-bench {bench} --quick"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "changefeed-bench {bench} --quick failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_last(&stdout).map_err(|e| anyhow::anyhow!("changefeed-bench {bench} --quick: {e}"))
}

/// The `SUBCOMMAND: RESULT …` lines of a file, by subcommand (the last line of each wins).
fn read(path: &PathBuf) -> anyhow::Result<BTreeMap<String, BTreeMap<String, String>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut results = BTreeMap::new();
    for (n, l) in text.lines().enumerate() {
        let Some((bench, rest)) = l.split_once(": RESULT ") else {
            continue;
        };
        let fields = parse(&format!("RESULT {rest}"))
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1))?;
        results.insert(bench.trim().to_string(), fields);
    }
    if results.is_empty() {
        bail!(
            "{}: no `SUBCOMMAND: RESULT …` line (see --results)",
            path.display()
        );
    }
    Ok(results)
}
