//! `key-parallel`: records/s of one hot partition whose handler costs 5 ms a record, with the
//! batch in one call (`key_concurrency` 1, the baseline) against 4 and 16 calls at once, one
//! per key, in the same run.
//!
//! One host, an in-memory feed of one partition and an in-memory lease store: the figure is
//! the handler's concurrency, not a backend's speed. The handler's cost is a timer (work that
//! waits on I/O, as a call to another service does), so the slots overlap even on a small
//! machine. Every run checks that each key's records arrived in order and none was lost or
//! repeated. Records/s is measured from the first handler call to the last record's end; wall
//! time is read with `std::time::Instant`, measuring real elapsed time being the point. CPU
//! time per record (user + system of the whole process) is reported beside it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use changefeed::lease::MemoryLeaseStore;
use changefeed::processor::{handler_fn, Processor, Settings};
use changefeed::source::MemoryFeed;
use nix::sys::resource::UsageWho;

use crate::usage::cpu_seconds;

/// Arguments of `changefeed-bench key-parallel`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Records in the partition (each run reads them all).
    #[arg(long, default_value_t = 2_000)]
    records: u64,
    /// Distinct record keys, spread round-robin over the records.
    #[arg(long, default_value_t = 256)]
    keys: u64,
    /// The handler's cost per record, in milliseconds.
    #[arg(long, default_value_t = 5)]
    cost_ms: u64,
    /// Records per batch.
    #[arg(long, default_value_t = 500)]
    batch: usize,
    /// A short run for CI: 400 records.
    #[arg(long)]
    quick: bool,
}

/// What one run at a given key concurrency measured.
#[derive(Debug)]
struct Run {
    rps: f64,
    cpu_us_per_record: f64,
}

/// What the handler records: each key's sequence numbers in delivery order, and the span
/// from the first call's start to the last call's end.
#[derive(Debug, Default)]
struct Seen {
    per_key: HashMap<String, Vec<u64>>,
    delivered: u64,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// Runs the benchmark on its own tokio runtime.
pub fn run(args: Args) -> anyhow::Result<()> {
    let records = if args.quick { 400 } else { args.records };
    ensure!(records > 0, "--records must be at least 1");
    ensure!(args.keys > 0, "--keys must be at least 1");
    ensure!(args.batch > 0, "--batch must be at least 1");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let cost = Duration::from_millis(args.cost_ms);
    let mut runs = Vec::new();
    for n in [1, 4, 16] {
        let run = runtime.block_on(one(n, records, args.keys, args.batch, cost))?;
        runs.push((n, run));
    }
    println!(
        "key-parallel: one partition, {records} records over {} keys, batches of {}, \
         handler {} ms a record",
        args.keys, args.batch, args.cost_ms
    );
    println!("{:>4} {:>12} {:>18}", "N", "records/s", "cpu µs/record");
    for (n, r) in &runs {
        println!("{n:>4} {:>12.0} {:>18.1}", r.rps, r.cpu_us_per_record);
    }
    let rps = |i: usize| runs[i].1.rps;
    println!(
        "RESULT rps_n1={:.0} rps_n4={:.0} rps_n16={:.0} ratio={:.1} \
         cpu_us_per_record_n16={:.1} order_checked=true lost=0",
        rps(0),
        rps(1),
        rps(2),
        rps(2) / rps(0),
        runs[2].1.cpu_us_per_record
    );
    Ok(())
}

/// One host with `key_concurrency(n)` reads `records` records; checks every key's order.
async fn one(
    n: usize,
    records: u64,
    keys: u64,
    batch: usize,
    cost: Duration,
) -> anyhow::Result<Run> {
    let feed = MemoryFeed::new(1);
    for i in 0..records {
        feed.append(&format!("key-{}", i % keys), (i / keys).to_string());
    }
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        handler_fn(move |_ctx, b| {
            let seen = seen.clone();
            async move {
                let started = Instant::now();
                for _ in &b.records {
                    tokio::time::sleep(cost).await;
                }
                let mut s = seen
                    .lock()
                    .map_err(|_| "the record of deliveries is poisoned")?;
                s.first = Some(s.first.map_or(started, |f| f.min(started)));
                s.last = Some(Instant::now());
                for r in &b.records {
                    let seq: u64 = std::str::from_utf8(&r.data)?.parse()?;
                    s.per_key.entry(r.key.clone()).or_default().push(seq);
                    s.delivered += 1;
                }
                Ok(())
            }
        })
    };
    let running = Processor::builder()
        .host("bench")
        .group("hot")
        .settings(Settings {
            max_batch_size: batch,
            poll_delay: Duration::from_millis(10),
            acquire_interval: Duration::from_millis(100),
            ..Settings::default()
        })
        .store(Arc::new(MemoryLeaseStore::new()))
        .source(Arc::new(feed))
        .handler(handler)
        .key_concurrency(n)
        .build()?
        .start();
    let cpu_before = cpu_seconds(UsageWho::RUSAGE_SELF)?;
    // Generous: the baseline at 5 ms a record, with room for a loaded machine.
    let limit = cost
        .saturating_mul(u32::try_from(records).unwrap_or(u32::MAX))
        .saturating_mul(3)
        .saturating_add(Duration::from_secs(30));
    let deadline = Instant::now() + limit;
    loop {
        let delivered = seen
            .lock()
            .map_err(|_| anyhow::anyhow!("the record of deliveries is poisoned"))?
            .delivered;
        if delivered >= records {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "N={n}: {delivered} of {records} records after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cpu = cpu_seconds(UsageWho::RUSAGE_SELF)? - cpu_before;
    running.stop().await?;
    let s = seen
        .lock()
        .map_err(|_| anyhow::anyhow!("the record of deliveries is poisoned"))?;
    ensure!(
        s.delivered == records,
        "N={n}: {} deliveries of {records} records",
        s.delivered
    );
    for (key, got) in &s.per_key {
        let want: Vec<u64> = (0..got.len() as u64).collect();
        ensure!(
            got == &want,
            "N={n}: {key} out of order, lost or repeated: {got:?}"
        );
    }
    let expected_keys = keys.min(records) as usize;
    ensure!(
        s.per_key.len() == expected_keys,
        "N={n}: {} keys of {expected_keys}",
        s.per_key.len()
    );
    let (Some(first), Some(last)) = (s.first, s.last) else {
        anyhow::bail!("N={n}: the handler was never called");
    };
    let secs = last.duration_since(first).as_secs_f64().max(1e-9);
    Ok(Run {
        rps: records as f64 / secs,
        cpu_us_per_record: cpu * 1e6 / records as f64,
    })
}
