//! `store`: lease store throughput, a real backend against the in-memory baseline in one run.
//!
//! Measures compare-and-swap `replace` per second (one writer, sequential, each write a
//! checkpoint that moves the continuation) and the time to `list` a group of N leases (median
//! of 5), on a SQLite file (or a PostgreSQL server, `--url postgres://…`) and on
//! `MemoryLeaseStore`. Wall time is read with
//! `std::time::Instant`: measuring real elapsed time is the point of a benchmark.

use changefeed::lease::HeartbeatRole;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
    Timestamp,
};
use changefeed_postgres::{PgOptions, PostgresLeaseStore};
use changefeed_sqlite::SqliteLeaseStore;

/// Arguments of `changefeed-bench store`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases in the group that `list` reads.
    #[arg(long, default_value_t = 10_000)]
    leases: usize,
    /// CAS `replace` calls to time, per store.
    #[arg(long, default_value_t = 20_000)]
    ops: u64,
    /// The store under test: `sqlite://PATH` (default: a file in a temporary directory) or
    /// `postgres://USER@HOST:PORT/DB` (tables prefixed `bench`). The benchmark writes only
    /// the groups `bench-replace` and `bench-list`.
    #[arg(long)]
    url: Option<String>,
    /// A small run for a smoke test: 1,000 leases, 500 calls.
    #[arg(long)]
    quick: bool,
}

/// What one store measured.
#[derive(Debug)]
struct Figures {
    replace_per_s: f64,
    list_ms: f64,
    changes_ms: f64,
    heartbeat_ms: f64,
}

/// Runs the benchmark on its own tokio runtime.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.leases, args.ops) = (1000, 500);
    }
    ensure!(args.ops > 0, "--ops must be at least 1");
    ensure!(args.leases > 0, "--leases must be at least 1");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: Args) -> anyhow::Result<()> {
    // Kept alive until the end so the temporary file outlives the store.
    let mut _tempdir = None;
    let (backend, label, store): (&str, String, Arc<dyn LeaseStore>) = match args.url.as_deref() {
        None => {
            let dir = tempfile::tempdir().context("creating a temporary directory")?;
            let path = dir.path().join("bench.db");
            _tempdir = Some(dir);
            let store = SqliteLeaseStore::open(&path)
                .await
                .with_context(|| format!("opening {}", path.display()))?;
            ("sqlite", "sqlite (temp file)".to_string(), Arc::new(store))
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let store = PostgresLeaseStore::connect_with(PgOptions::new(url).prefix("bench"))
                .await
                .context("connecting to PostgreSQL")?;
            ("postgres", "postgres".to_string(), Arc::new(store))
        }
        Some(url) => match url.strip_prefix("sqlite://") {
            Some(path) if !path.is_empty() => {
                let path = PathBuf::from(path);
                let store = SqliteLeaseStore::open(&path)
                    .await
                    .with_context(|| format!("opening {}", path.display()))?;
                (
                    "sqlite",
                    format!("sqlite ({})", path.display()),
                    Arc::new(store),
                )
            }
            _ => bail!("unsupported --url {url:?}: expected sqlite://PATH or postgres://…"),
        },
    };
    let memory: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());

    let sq = measure(store.as_ref(), &args).await.context(backend)?;
    let mem = measure(memory.as_ref(), &args).await.context("memory")?;

    println!(
        "store: {} CAS replaces (sequential checkpoints), list of {} leases (median of 5)",
        args.ops, args.leases
    );
    println!(
        "{:<40} {:>14} {:>12} {:>16} {:>14}",
        "store", "replace/s", "list ms", "10 changes ms", "heartbeat ms"
    );
    for (name, f) in [(label.as_str(), &sq), ("memory", &mem)] {
        println!(
            "{name:<40} {:>14.0} {:>12.2} {:>16.3} {:>14.3}",
            f.replace_per_s, f.list_ms, f.changes_ms, f.heartbeat_ms
        );
    }
    println!(
        "RESULT {backend}_replace_per_s={:.0} memory_replace_per_s={:.0} {backend}_list_ms={:.3} \
         memory_list_ms={:.3} replace_ratio={:.1} {backend}_heartbeat_ms={:.3} memory_heartbeat_ms={:.4} \
         {backend}_changes_ms={:.3} memory_changes_ms={:.4} {backend}_list_vs_changes={:.0}",
        sq.replace_per_s,
        mem.replace_per_s,
        sq.list_ms,
        mem.list_ms,
        mem.replace_per_s / sq.replace_per_s,
        sq.heartbeat_ms,
        mem.heartbeat_ms,
        sq.changes_ms,
        mem.changes_ms,
        sq.list_ms / sq.changes_ms,
    );
    Ok(())
}

async fn measure(store: &dyn LeaseStore, args: &Args) -> anyhow::Result<Figures> {
    Ok(Figures {
        replace_per_s: replace_per_s(store, args.ops).await?,
        list_ms: list_ms(store, args.leases).await?,
        changes_ms: changes_ms(store, args.leases).await?,
        heartbeat_ms: heartbeat_ms(store).await?,
    })
}

/// Median latency of a heartbeat renewal (the one write a host makes per renew interval), and
/// of the membership read it pairs with, over 200 sequential calls.
async fn heartbeat_ms(store: &dyn LeaseStore) -> anyhow::Result<f64> {
    let group = GroupName::new("bench-heartbeat")?;
    let host = HostName::new("bench-host")?;
    let mut row = match store
        .heartbeat(
            &group,
            &host,
            "bench",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
    {
        Ok(row) => row,
        Err(changefeed::LeaseError::HeartbeatConflict {
            current: Some(cur), ..
        }) => *cur,
        Err(e) => return Err(e.into()),
    };
    let mut times = Vec::with_capacity(200);
    for i in 0..200 {
        let start = Instant::now();
        row = store
            .heartbeat(
                &group,
                &host,
                "bench",
                Timestamp(i),
                Some(row.version),
                HeartbeatRole::Member,
                None,
            )
            .await?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(ms(times[times.len() / 2]))
}

/// Sequential checkpoint-style CAS writes on one owned lease.
async fn replace_per_s(store: &dyn LeaseStore, ops: u64) -> anyhow::Result<f64> {
    let key = LeaseKey::new(GroupName::new("bench-replace")?, PartitionId::new("0")?);
    let mut lease = Lease::new(key.clone(), Position::Beginning);
    lease.state = LeaseState::Owned;
    lease.owner = Some(HostName::new("bench")?);
    let mut lease = match store.create(&lease).await? {
        Some(created) => created,
        None => store.get(&key).await?.context("the bench lease vanished")?,
    };
    let checkpoint = |lease: &Lease, i: u64| {
        let mut next = lease.clone();
        next.continuation = Some(Continuation::new(format!("0:{i}")));
        next
    };
    // Warm up (prepared statements, page cache) before timing.
    for i in 0..ops.min(200) {
        lease = store.replace(&checkpoint(&lease, i), lease.version).await?;
    }
    let start = Instant::now();
    for i in 0..ops {
        lease = store.replace(&checkpoint(&lease, i), lease.version).await?;
    }
    Ok(ops as f64 / start.elapsed().as_secs_f64())
}

/// Median time of 5 `list` calls on a group of `n` leases.
async fn list_ms(store: &dyn LeaseStore, n: usize) -> anyhow::Result<f64> {
    let group = GroupName::new("bench-list")?;
    // A reused file may hold a previous run's group: start from exactly `n` leases.
    for lease in store.list(&group).await?.leases {
        store.delete(&lease.key, lease.version).await?;
    }
    let width = n.to_string().len();
    for i in 0..n {
        let key = LeaseKey::new(group.clone(), PartitionId::new(format!("{i:0width$}"))?);
        let mut lease = Lease::new(key, Position::Beginning);
        lease.continuation = Some(Continuation::new(format!("{i}:12345")));
        lease.properties.insert("zone".into(), "a".into());
        store.create(&lease).await?;
    }
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let start = Instant::now();
        let listing = store.list(&group).await?;
        times.push(start.elapsed());
        ensure!(
            listing.leases.len() == n && listing.malformed.is_empty(),
            "listed {} leases and {} malformed rows, expected {n}",
            listing.leases.len(),
            listing.malformed.len()
        );
    }
    times.sort();
    Ok(ms(times[times.len() / 2]))
}

/// Median time of 5 `list_changes` calls that each find 10 leases (or `n`, if fewer) changed
/// hands among the `n` that [`list_ms`] left in its group: what a host reads when the change
/// counter moved, where it used to list all `n`.
async fn changes_ms(store: &dyn LeaseStore, n: usize) -> anyhow::Result<f64> {
    let group = GroupName::new("bench-list")?;
    let mut times = Vec::with_capacity(5);
    for round in 0..5 {
        // A new owner each round, so every replace changes hands even when `n` is small.
        let owner = HostName::new(format!("bench-taker-{round}"))?;
        let since = store.membership(&group).await?.change_counter;
        for i in 0..10 {
            let key = LeaseKey::new(
                group.clone(),
                PartitionId::new(format!(
                    "{:0width$}",
                    (round * 10 + i) % n,
                    width = n.to_string().len()
                ))?,
            );
            let mut lease = store.get(&key).await?.context("a bench lease vanished")?;
            let expected = lease.version;
            lease.state = LeaseState::Owned;
            lease.owner = Some(owner.clone());
            lease.next_owner = None;
            store.replace(&lease, expected).await?;
        }
        let start = Instant::now();
        let changes = store.list_changes(&group, since).await?;
        times.push(start.elapsed());
        let changes = changes
            .with_context(|| format!("the store cannot list the changes since counter {since}"))?;
        ensure!(
            changes.leases.len() == 10.min(n),
            "listed {} changed leases, expected {}",
            changes.leases.len(),
            10.min(n)
        );
    }
    times.sort();
    Ok(ms(times[times.len() / 2]))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}
