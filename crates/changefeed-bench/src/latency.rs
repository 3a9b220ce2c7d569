//! `latency`: the time from a `PutRecord` to the handler seeing the record, on a Kinesis
//! endpoint (kinesis-mock), for our polling reader and our enhanced fan-out reader, in one run
//! and at the library's default settings (`poll_delay` 500 ms).
//!
//! Each side gets a fresh one-shard stream and one host on the in-memory lease store; a first
//! record is awaited so the reader is running, then `--records` records are put one at a
//! time, spaced by `--gap-ms` plus a varying part (so the puts do not keep one phase against
//! the poll or the server's push), and each record's latency is taken from just before its
//! `PutRecord` to the handler call that holds it. Prints p50 and p99 of each side.
//!
//! Real time is measured here with `std::time::Instant`: a benchmark is the one place that must
//! read the machine's clock rather than the library's injectable one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor};
use changefeed::source::FeedSource;
use changefeed_kinesis::{AwsOptions, KinesisFeed, Retrieval};
use tokio::sync::Notify;

/// Arguments of `changefeed-bench latency`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// kinesis-mock's (or another Kinesis endpoint's) URL.
    #[arg(
        long,
        env = "CHANGEFEED_TEST_KINESIS_URL",
        default_value = "http://127.0.0.1:4568"
    )]
    kinesis_url: String,
    /// Records timed per reader.
    #[arg(long, default_value_t = 100)]
    records: u64,
    /// Least time between two puts, in milliseconds (a varying 0..200 ms is added).
    #[arg(long, default_value_t = 150)]
    gap_ms: u64,
    /// A short run for CI: 15 records per reader.
    #[arg(long)]
    quick: bool,
    /// Also time the real Java KCL 2.5.8 (MultiLangDaemon and a Python record processor, by
    /// `kcl-real/run.sh --latency`; needs Java 17 and Python 3), polling and fan-out, on its
    /// own kinesis-mock and DynamoDB Local: adds `kcl_p50_ms`/`kcl_p99_ms` (the KCL's default
    /// retrieval, fan-out) and `kcl_polling_p50_ms`/`kcl_polling_p99_ms` to the RESULT line.
    #[arg(long)]
    kcl: bool,
}

/// Runs the real KCL's side of `kcl-real/run.sh --latency` and returns its RESULT fields.
fn kcl_side(records: u64) -> anyhow::Result<HashMap<String, String>> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kcl-real/run.sh");
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(&script)
        .args(["--latency", "--sides", "kcl", "--records"])
        .arg(records.to_string())
        .stderr(std::process::Stdio::inherit());
    if let Ok(me) = std::env::current_exe() {
        let cli = me.with_file_name("changefeed");
        if cli.exists() {
            cmd.env("CHANGEFEED_BIN", cli);
        }
    }
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    anyhow::ensure!(
        out.status.success(),
        "{} --latency exited with {}",
        script.display(),
        out.status
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or_else(|| anyhow::anyhow!("{} printed no RESULT line", script.display()))?;
    Ok(line
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

/// The put times of the records not yet seen, and the latencies of those seen.
#[derive(Default)]
struct Timings {
    sent: Mutex<HashMap<u64, Instant>>,
    latencies: Mutex<Vec<Duration>>,
    seen: Notify,
}

#[async_trait]
impl Handler for Timings {
    async fn handle(&self, _ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let now = Instant::now();
        for r in &batch.records {
            let Ok(bytes) = <[u8; 8]>::try_from(r.data.as_ref()) else {
                continue;
            };
            let n = u64::from_le_bytes(bytes);
            let sent = self
                .sent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&n);
            if let Some(at) = sent {
                self.latencies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(now - at);
            }
        }
        self.seen.notify_waiters();
        Ok(())
    }
}

impl Timings {
    /// Puts record `n` and notes when.
    async fn put(&self, feed: &KinesisFeed, n: u64) -> anyhow::Result<()> {
        self.sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(n, Instant::now());
        feed.put(&format!("k{n}"), n.to_le_bytes().to_vec(), None)
            .await
            .with_context(|| format!("PutRecord of record {n}"))?;
        Ok(())
    }

    /// Waits (at most `limit`) until every record put has been seen.
    async fn drained(&self, limit: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + limit;
        loop {
            let seen = self.seen.notified();
            if self
                .sent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            anyhow::ensure!(
                !left.is_zero(),
                "records put were not delivered within {limit:?}"
            );
            let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), seen).await;
        }
    }
}

/// p50 and p99 of one reader's latencies, in milliseconds.
fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    (at(0.50), at(0.99))
}

/// One reader's run: a fresh stream, one host, `records` timed puts.
async fn side(args: &Args, records: u64, retrieval: Retrieval) -> anyhow::Result<(f64, f64)> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let stream = format!("bench-latency-{}-{nanos}", std::process::id());
    let feed = KinesisFeed::connect(&AwsOptions::local(&args.kinesis_url), &stream)
        .await
        .with_retrieval(retrieval);
    feed.create_stream(1)
        .await
        .with_context(|| format!("creating a stream on {}", args.kinesis_url))?;
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
    let timings = Arc::new(Timings::default());
    let running = Processor::builder()
        .host("bench-host")
        .group("bench")
        .store(Arc::new(store))
        .source(Arc::new(feed.clone()))
        .shared_handler(timings.clone())
        .seed(1)
        .build()?
        .start();
    // A first record, untimed, so the reader is running before the clock starts.
    timings.put(&feed, u64::MAX).await?;
    timings.drained(Duration::from_secs(60)).await?;
    timings
        .latencies
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    for n in 0..records {
        timings.put(&feed, n).await?;
        let varying = (n * 53) % 200;
        tokio::time::sleep(Duration::from_millis(args.gap_ms + varying)).await;
    }
    timings.drained(Duration::from_secs(30)).await?;
    running.stop().await.context("stopping the processor")?;
    let latencies =
        std::mem::take(&mut *timings.latencies.lock().unwrap_or_else(|p| p.into_inner()));
    anyhow::ensure!(
        latencies.len() as u64 == records,
        "{} of {records} records timed",
        latencies.len()
    );
    if let Err(e) = feed.delete_stream().await {
        eprintln!("deleting stream {stream}: {e}");
    }
    Ok(percentiles(latencies))
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    let records = if args.quick { 15 } else { args.records };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let polling = side(&args, records, Retrieval::Polling).await?;
        let fanout = side(
            &args,
            records,
            Retrieval::FanOut {
                consumer_name: "bench-latency".into(),
            },
        )
        .await?;
        println!(
            "put-to-handler latency on {} ({records} records per reader, default settings)",
            args.kinesis_url
        );
        println!("{:<10} {:>8} {:>8}", "reader", "p50 ms", "p99 ms");
        println!("{:<10} {:>8.0} {:>8.0}", "polling", polling.0, polling.1);
        println!("{:<10} {:>8.0} {:>8.0}", "fan-out", fanout.0, fanout.1);
        let mut result = format!(
            "RESULT polling_p50_ms={:.0} polling_p99_ms={:.0} fanout_p50_ms={:.0} fanout_p99_ms={:.0}",
            polling.0, polling.1, fanout.0, fanout.1
        );
        if args.kcl {
            let kcl = kcl_side(records)?;
            let get = |k: &str| kcl.get(k).map_or("NA", String::as_str).to_string();
            result.push_str(&format!(
                " kcl_p50_ms={} kcl_p99_ms={} kcl_polling_p50_ms={} kcl_polling_p99_ms={}",
                get("kcl_fanout_p50_ms"),
                get("kcl_fanout_p99_ms"),
                get("kcl_polling_p50_ms"),
                get("kcl_polling_p99_ms"),
            ));
        }
        println!("{result}");
        Ok(())
    })
}
