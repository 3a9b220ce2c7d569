//! `throughput`: records per second through one host (in-memory store and feed, a handler
//! that only counts), against raw reads of the same feed in the same run, with the same
//! parallelism on both sides: the host runs one worker task per partition, and the raw side one
//! reader task per partition, each passing every batch to the same counting code; both on one
//! runtime of `--threads` worker threads (2 by default; 1 puts both on one thread).
//!
//! The two sides run in pairs, alternating which goes first, and the spread over the pairs is
//! reported (min, median, max), at `--batch` and over a sweep of batch sizes (10, 100, 1,000).
//! A last row times `changefeed run` (the CLI binary, a host whose handler is an external
//! command) with `cat >/dev/null` as the handler on a SQLite feed, against raw reads of the
//! same SQLite feed ([`cli_run`]).
//!
//! Real time is measured here with `std::time::Instant`: a benchmark is the one place that must
//! read the machine's clock rather than the library's injectable one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor};
use changefeed::source::{FeedSource, MemoryFeed};
use tokio::sync::Notify;

/// Arguments of `changefeed-bench throughput`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Records in the feed.
    #[arg(long, default_value_t = 2_000_000)]
    records: u64,
    /// Partitions of the feed.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// Records per batch.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Pairs of runs (raw and processor) per batch size; min, median and max are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Worker threads of the runtime both sides run on.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Records in the SQLite feed of the `changefeed run` row (0: skip the row).
    #[arg(long, default_value_t = 100_000)]
    run_records: u64,
    /// The `changefeed` binary for that row (default: `changefeed` beside this binary, built
    /// with `cargo build --release -p changefeed-cli` if missing).
    #[arg(long, env = "CHANGEFEED_BIN")]
    run_bin: Option<std::path::PathBuf>,
    /// A small run for a smoke test: 100,000 records, one pair per batch size, no
    /// `changefeed run` row.
    #[arg(long)]
    quick: bool,
}

mod cli_run;

/// The batch sizes swept.
const SWEEP: [usize; 3] = [10, 100, 1000];

/// What both sides do with a batch: count its records, and say when all have been seen.
struct Counting {
    seen: AtomicU64,
    target: u64,
    done: Notify,
}

impl Counting {
    fn new(target: u64) -> Self {
        Self {
            seen: AtomicU64::new(0),
            target,
            done: Notify::new(),
        }
    }

    fn count(&self, batch: &Batch) {
        let n = batch.records.len() as u64;
        if self.seen.fetch_add(n, Ordering::Relaxed) + n >= self.target {
            self.done.notify_one();
        }
    }
}

#[async_trait]
impl Handler for Counting {
    async fn handle(&self, _ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        self.count(batch);
        Ok(())
    }
}

fn feed(args: &Args) -> MemoryFeed {
    let feed = MemoryFeed::new(args.partitions);
    for i in 0..args.records {
        feed.append(&format!("key-{}", i % 1024), i.to_le_bytes().to_vec());
    }
    feed
}

/// Raw reads: one task per partition reading it to the end in batches of `batch`, each batch
/// counted as the processor's handler counts it.
async fn raw(feed: &dyn FeedSource, records: u64, batch: usize) -> anyhow::Result<f64> {
    let counting = Arc::new(Counting::new(records));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for p in feed.partitions().await? {
        let mut reader = feed.open(&p.id, &Position::Beginning).await?;
        let counting = counting.clone();
        tasks.spawn(async move {
            loop {
                let b = reader.next_batch(batch).await?;
                if b.records.is_empty() {
                    return anyhow::Ok(());
                }
                counting.count(&b);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("a raw reader task")??;
    }
    let elapsed = started.elapsed();
    let total = counting.seen.load(Ordering::Relaxed);
    anyhow::ensure!(total == records, "raw read {total} of {records} records");
    Ok(total as f64 / elapsed.as_secs_f64())
}

/// One host (one worker task per partition) from the beginning to the last record.
async fn processor(feed: &MemoryFeed, records: u64, batch: usize) -> anyhow::Result<f64> {
    let store = MemoryLeaseStore::new();
    let group = GroupName::new("bench")?;
    for p in feed.partitions().await? {
        store
            .create(&Lease::new(
                LeaseKey::new(group.clone(), p.id),
                Position::Beginning,
            ))
            .await?;
    }
    let handler = Arc::new(Counting::new(records));
    let started = Instant::now();
    let running = Processor::builder()
        .host("bench-host")
        .group("bench")
        .store(Arc::new(store))
        .source(Arc::new(feed.clone()))
        .shared_handler(handler.clone())
        .max_batch_size(batch)
        .seed(1)
        .build()?
        .start();
    handler.done.notified().await;
    let elapsed = started.elapsed();
    running.stop().await.context("stopping the processor")?;
    Ok(records as f64 / elapsed.as_secs_f64())
}

/// Min, median and max.
#[derive(Debug, Clone, Copy)]
struct Spread {
    min: f64,
    median: f64,
    max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        Self {
            min: v[0],
            median: v[v.len() / 2],
            max: v[v.len() - 1],
        }
    }
}

/// `runs` pairs at one batch size: raw, processor, and each pair's overhead in percent.
struct Pairs {
    raw: Spread,
    processor: Spread,
    overhead_pct: Spread,
}

async fn pairs(feed: &MemoryFeed, args: &Args, batch: usize) -> anyhow::Result<Pairs> {
    let (mut raws, mut procs, mut overheads) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..args.runs.max(1) {
        // Alternate which side goes first, so that a trend over the run (a neighbour's build
        // starting) does not fall on one side.
        let (r, p) = if run % 2 == 0 {
            let r = raw(feed, args.records, batch).await?;
            (r, processor(feed, args.records, batch).await?)
        } else {
            let p = processor(feed, args.records, batch).await?;
            (raw(feed, args.records, batch).await?, p)
        };
        let o = (r - p) / r * 100.0;
        println!(
            "batch {batch:>5} pair {run}: raw {r:>12.0} rec/s   processor {p:>12.0} rec/s   overhead {o:>6.1} %"
        );
        raws.push(r);
        procs.push(p);
        overheads.push(o);
    }
    Ok(Pairs {
        raw: Spread::of(raws),
        processor: Spread::of(procs),
        overhead_pct: Spread::of(overheads),
    })
}

fn spread_cell(s: &Spread, decimals: usize) -> String {
    format!(
        "{:.d$} / {:.d$} / {:.d$}",
        s.min,
        s.median,
        s.max,
        d = decimals
    )
}

/// Runs the benchmark.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.records, args.runs, args.run_records) = (100_000, 1, 0);
    }
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(args.threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let feed = feed(&args);
        let mut sizes: Vec<usize> = SWEEP.to_vec();
        if !sizes.contains(&args.batch) {
            sizes.push(args.batch);
        }
        let mut results = Vec::new();
        for &batch in &sizes {
            results.push((batch, pairs(&feed, &args, batch).await?));
        }
        let run_row = if args.run_records > 0 {
            Some(cli_run::measure(&args).await?)
        } else {
            None
        };
        println!();
        println!(
            "{} records over {} partitions, one task per partition on both sides, {} runtime thread(s), {} pairs (min / median / max)",
            args.records, args.partitions, args.threads, args.runs
        );
        println!(
            "{:<8} {:>40} {:>40} {:>24}",
            "batch", "raw rec/s", "processor rec/s", "overhead %"
        );
        let mut keys = String::new();
        for (batch, p) in &results {
            println!(
                "{batch:<8} {:>40} {:>40} {:>24}",
                spread_cell(&p.raw, 0),
                spread_cell(&p.processor, 0),
                spread_cell(&p.overhead_pct, 1)
            );
            if SWEEP.contains(batch) {
                keys.push_str(&format!(
                    " processor_rps_b{batch}={:.0} raw_rps_b{batch}={:.0} overhead_pct_b{batch}={:.1} overhead_pct_b{batch}_min={:.1} overhead_pct_b{batch}_max={:.1}",
                    p.processor.median,
                    p.raw.median,
                    p.overhead_pct.median,
                    p.overhead_pct.min,
                    p.overhead_pct.max
                ));
            }
        }
        if let Some(r) = &run_row {
            println!("{r}");
            keys.push_str(&r.keys());
        }
        let head = results
            .iter()
            .find(|(b, _)| *b == args.batch)
            .map(|(_, p)| p)
            .context("the --batch results")?;
        println!(
            "RESULT processor_rps={:.0} raw_rps={:.0} overhead_pct={:.1} overhead_pct_min={:.1} overhead_pct_max={:.1}{keys}",
            head.processor.median,
            head.raw.median,
            head.overhead_pct.median,
            head.overhead_pct.min,
            head.overhead_pct.max
        );
        Ok(())
    })
}
