//! `outbox`: PostgreSQL outbox throughput, against the in-memory feed in the same run.
//!
//! Appends `--records` records (each in its own transaction, from `--writers` concurrent
//! tasks, routed by key over `--partitions` partitions), then reads every partition from the
//! beginning in batches of `--batch`, one reader at a time, and reports records/s per
//! partition. The baseline is the same reads on a `MemoryFeed` holding the same records.
//! Wall time is read with `std::time::Instant`: measuring real elapsed time is the point.

use std::time::Instant;

use anyhow::{ensure, Context};
use changefeed::model::{PartitionId, Position};
use changefeed::source::{FeedSource, MemoryFeed};
use changefeed_postgres::{OutboxTable, PgOptions, PostgresOutbox};

/// Arguments of `changefeed-bench outbox`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The server: `postgres://USER@HOST:PORT/DB`. The benchmark creates tables prefixed
    /// `bench_outbox_<pid>` and drops nothing (the prefix is fresh each run).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    url: String,
    /// Records to append.
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Partitions of the outbox.
    #[arg(long, default_value_t = 4)]
    partitions: u32,
    /// Concurrent appending tasks.
    #[arg(long, default_value_t = 8)]
    writers: u64,
    /// Records per read.
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// A small run for a smoke test: 1,000 records.
    #[arg(long)]
    quick: bool,
}

/// Runs the benchmark on its own tokio runtime.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        args.records = 1000;
    }
    ensure!(args.records > 0, "--records must be at least 1");
    ensure!(args.partitions > 0, "--partitions must be at least 1");
    ensure!(args.writers > 0, "--writers must be at least 1");
    ensure!(args.batch > 0, "--batch must be at least 1");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: Args) -> anyhow::Result<()> {
    let prefix = format!("bench_outbox_{}", std::process::id());
    let table = OutboxTable::new(&prefix)?;
    let options = PgOptions::new(&args.url).pool_size(args.writers as usize);
    let outbox = PostgresOutbox::connect(options, table)
        .await
        .context("connecting to PostgreSQL")?;
    outbox.create_partitions(args.partitions).await?;
    let memory = MemoryFeed::new(args.partitions);

    // Append: `writers` tasks, each record its own transaction.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.writers {
        let outbox = outbox.clone();
        let n = args.records;
        let writers = args.writers;
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < n {
                let payload = format!("{{\"order\":{i},\"status\":\"created\"}}");
                outbox
                    .append_one(&format!("order-{i}"), payload.as_bytes())
                    .await?;
                i += writers;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await.context("append task")??;
    }
    let append_per_s = args.records as f64 / start.elapsed().as_secs_f64();
    for i in 0..args.records {
        let payload = format!("{{\"order\":{i},\"status\":\"created\"}}");
        memory.append(&format!("order-{i}"), payload.into_bytes());
    }

    let pg = read_all(&outbox, args.batch, args.records).await?;
    let mem = read_all(&memory, args.batch, args.records).await?;
    println!(
        "outbox: {} records over {} partitions, appended by {} writers (one transaction each), \
         read in batches of {}",
        args.records, args.partitions, args.writers, args.batch
    );
    println!("{:<12} {:>22}", "source", "read records/s/partition");
    println!("{:<12} {:>22.0}", "postgres", pg);
    println!("{:<12} {:>22.0}", "memory", mem);
    println!("append (postgres): {append_per_s:.0} records/s");
    println!(
        "RESULT postgres_read_rps_per_partition={pg:.0} memory_read_rps_per_partition={mem:.0} \
         postgres_append_rps={append_per_s:.0} read_ratio={:.1}",
        mem / pg
    );
    Ok(())
}

/// Reads every open partition from the beginning, one after another; returns the mean of the
/// per-partition records/s, after checking every record came back.
async fn read_all(source: &dyn FeedSource, batch: usize, expected: u64) -> anyhow::Result<f64> {
    let partitions: Vec<PartitionId> = source
        .partitions()
        .await?
        .into_iter()
        .filter(|p| !p.closed)
        .map(|p| p.id)
        .collect();
    let mut rates = Vec::new();
    let mut total = 0u64;
    for p in &partitions {
        let start = Instant::now();
        let mut reader = source.open(p, &Position::Beginning).await?;
        let mut n = 0u64;
        loop {
            let b = reader.next_batch(batch).await?;
            if b.records.is_empty() {
                break;
            }
            n += b.records.len() as u64;
        }
        let secs = start.elapsed().as_secs_f64();
        total += n;
        if n > 0 {
            rates.push(n as f64 / secs);
        }
    }
    ensure!(
        total == expected,
        "read {total} records, expected {expected} (is a long transaction holding back the \
         server's xmin?)"
    );
    Ok(rates.iter().sum::<f64>() / rates.len().max(1) as f64)
}
