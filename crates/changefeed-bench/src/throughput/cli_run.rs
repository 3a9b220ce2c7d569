//! The `changefeed run` row of `throughput`: records per second through the CLI binary with
//! `cat >/dev/null` as the handler (one `sh -c` process per batch, the batch written to its
//! standard input as JSON lines), on a SQLite feed with the SQLite lease store in the same
//! file, against raw reads of the same SQLite feed (one task per partition) in the same run.
//!
//! The host's start-up (process start, registration, first acquire) is left out: the clock
//! starts when the first checkpoint appears and stops when every partition's checkpoint is at
//! its last record, both seen by polling the lease table every 20 ms.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use changefeed::lag::estimate;
use changefeed::lease::LeaseStore;
use changefeed::model::GroupName;
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use super::{raw, Args};

/// What the row measured.
pub(super) struct RunRow {
    batch: usize,
    records: u64,
    run_rps: f64,
    raw_rps: f64,
}

impl RunRow {
    /// The `RESULT` keys of the row (each starting with a space).
    pub(super) fn keys(&self) -> String {
        format!(
            " run_cat_rps={:.0} sqlite_raw_rps={:.0} run_cat_vs_raw_pct={:.1}",
            self.run_rps,
            self.raw_rps,
            self.run_rps / self.raw_rps * 100.0
        )
    }
}

impl fmt::Display for RunRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "changefeed run --handler 'cat >/dev/null', SQLite feed and store, {} records, batches of {}: {:.0} rec/s; raw SQLite reads {:.0} rec/s ({:.1} %)",
            self.records,
            self.batch,
            self.run_rps,
            self.raw_rps,
            self.run_rps / self.raw_rps * 100.0
        )
    }
}

/// A child process killed when dropped, so an error leaves no host behind.
struct Host(Child);

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `changefeed` binary: `--run-bin`, else beside this binary, built if missing.
fn binary(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(bin) = &args.run_bin {
        if !bin.is_file() {
            bail!("--run-bin {}: no such file", bin.display());
        }
        return Ok(bin.clone());
    }
    let exe = std::env::current_exe().context("locating changefeed-bench")?;
    let bin = exe.with_file_name("changefeed");
    if !bin.is_file() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        println!(
            "throughput: building {} for the changefeed run row",
            bin.display()
        );
        let status = Command::new("cargo")
            .args(["build", "--release", "-p", "changefeed-cli"])
            .current_dir(&workspace)
            .status()
            .context("running cargo build --release -p changefeed-cli")?;
        if !status.success() || !bin.is_file() {
            bail!(
                "no changefeed binary at {} (cargo build --release -p changefeed-cli, or pass --run-bin / CHANGEFEED_BIN)",
                bin.display()
            );
        }
    }
    Ok(bin)
}

/// Builds the SQLite feed, reads it raw, then runs `changefeed run` over it.
pub(super) async fn measure(args: &Args) -> anyhow::Result<RunRow> {
    let bin = binary(args)?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("run.db");
    let feed = SqliteFeed::open(&db).await?;
    feed.create_partitions(args.partitions).await?;
    for i in 0..args.run_records {
        feed.append(&format!("key-{}", i % 1024), format!("record {i}"))
            .await?;
    }
    let raw_rps = raw(&feed, args.run_records, args.batch).await?;
    let run_rps = run_cat(&bin, &db, &feed, args).await?;
    Ok(RunRow {
        batch: args.batch,
        records: args.run_records,
        run_rps,
        raw_rps,
    })
}

async fn run_cat(bin: &Path, db: &Path, feed: &SqliteFeed, args: &Args) -> anyhow::Result<f64> {
    let url = format!("sqlite://{}", db.display());
    let group = GroupName::new("bench")?;
    let store: Arc<dyn LeaseStore> = Arc::new(SqliteLeaseStore::open(db).await?);
    let mut host = Host(
        Command::new(bin)
            .args(["run", "--store", &url, "--source", &url, "--group", "bench"])
            .args(["--host", "bench-host", "--handler", "cat >/dev/null"])
            .args(["--max-batch-size", &args.batch.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?,
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut first: Option<Instant> = None;
    loop {
        if let Some(status) = host.0.try_wait()? {
            bail!("changefeed run exited early with {status}");
        }
        if Instant::now() > deadline {
            bail!(
                "changefeed run did not read {} records within 600 s",
                args.run_records
            );
        }
        let listing = store.list(&group).await?;
        if first.is_none() && listing.leases.iter().any(|l| l.continuation.is_some()) {
            first = Some(Instant::now());
        }
        if listing.leases.len() == args.partitions as usize {
            let lag = estimate(store.as_ref(), feed, &group).await?;
            if lag.leases.iter().all(|l| matches!(l.records, Ok(Some(0)))) {
                let started = first.context("no checkpoint seen before the end")?;
                return Ok(args.run_records as f64 / started.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
