//! `throughput`: records per second through one host (in-memory store and feed, a no-op
//! handler), against raw reads of the same feed in the same run.
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
    /// Runs of each side; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

struct Counting {
    seen: AtomicU64,
    target: u64,
    done: Notify,
}

#[async_trait]
impl Handler for Counting {
    async fn handle(&self, _ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let n = self
            .seen
            .fetch_add(batch.records.len() as u64, Ordering::Relaxed)
            + batch.records.len() as u64;
        if n >= self.target {
            self.done.notify_one();
        }
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

async fn raw(feed: &MemoryFeed, args: &Args) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut total = 0u64;
    let mut readers = Vec::new();
    for p in feed.partitions().await? {
        readers.push(feed.open(&p.id, &Position::Beginning).await?);
    }
    // Round-robin over the partitions, as a host's workers interleave.
    loop {
        let mut progressed = false;
        for r in &mut readers {
            let b = r.next_batch(args.batch).await?;
            if !b.records.is_empty() {
                progressed = true;
                total += b.records.len() as u64;
            }
        }
        if !progressed {
            break;
        }
    }
    anyhow::ensure!(total == args.records, "raw read {total} records");
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

async fn processor(feed: &MemoryFeed, args: &Args) -> anyhow::Result<f64> {
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
    let handler = Arc::new(Counting {
        seen: AtomicU64::new(0),
        target: args.records,
        done: Notify::new(),
    });
    let started = Instant::now();
    let running = Processor::builder()
        .host("bench-host")
        .group("bench")
        .store(Arc::new(store))
        .source(Arc::new(feed.clone()))
        .shared_handler(handler.clone())
        .max_batch_size(args.batch)
        .seed(1)
        .build()?
        .start();
    handler.done.notified().await;
    let elapsed = started.elapsed();
    running.stop().await.context("stopping the processor")?;
    Ok(args.records as f64 / elapsed.as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let feed = feed(&args);
        let (mut raws, mut procs) = (Vec::new(), Vec::new());
        for run in 0..args.runs.max(1) {
            let r = raw(&feed, &args).await?;
            let p = processor(&feed, &args).await?;
            println!("run {run}: raw {r:>12.0} rec/s   processor {p:>12.0} rec/s");
            raws.push(r);
            procs.push(p);
        }
        let (raw_rps, processor_rps) = (median(raws), median(procs));
        let overhead_pct = (raw_rps - processor_rps) / raw_rps * 100.0;
        println!(
            "{} records over {} partitions, batches of {}; medians of {} runs",
            args.records, args.partitions, args.batch, args.runs
        );
        println!(
            "RESULT processor_rps={processor_rps:.0} raw_rps={raw_rps:.0} overhead_pct={overhead_pct:.1}"
        );
        Ok(())
    })
}
