//! `store-io`: store reads and writes per host in steady state, on virtual time.
//!
//! Ten hosts (by default) share an idle feed and an in-memory store; after they have balanced,
//! the benchmark counts every store call each host makes over a long steady window and reports
//! them per host per interval. The baseline is the anchors' published pattern at the same
//! timings: KCL and the Cosmos processor renew every owned lease once per renew interval and
//! scan the whole lease table once per acquire cycle on every host.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MemoryLeaseStore, StoreCounts};
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor, Settings};
use changefeed::source::{FeedSource, MemoryFeed};

/// Arguments of `changefeed-bench store-io`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases (partitions).
    #[arg(long, default_value_t = 1000)]
    leases: u32,
    /// Hosts.
    #[arg(long, default_value_t = 10)]
    hosts: u32,
    /// Virtual minutes of steady state measured.
    #[arg(long, default_value_t = 30)]
    minutes: u64,
}

#[derive(Debug)]
struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(&self, _ctx: &Context, _batch: &Batch) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn sum(counts: &[StoreCounts]) -> StoreCounts {
    counts
        .iter()
        .fold(StoreCounts::default(), |a, c| StoreCounts {
            reads: a.reads + c.reads,
            writes: a.writes + c.writes,
            lease_rows_read: a.lease_rows_read + c.lease_rows_read,
            lists: a.lists + c.lists,
            heartbeats: a.heartbeats + c.heartbeats,
        })
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    rt.block_on(async {
        let settings = Settings::default();
        let feed = MemoryFeed::new(args.leases);
        let store = MemoryLeaseStore::new();
        let group = GroupName::new("bench")?;
        for p in feed.partitions().await? {
            store
                .create(&Lease::new(LeaseKey::new(group.clone(), p.id), Position::Beginning))
                .await?;
        }
        let mut hosts = Vec::new();
        for h in 0..args.hosts {
            hosts.push(
                Processor::builder()
                    .host(format!("host-{h:03}"))
                    .group("bench")
                    .store(Arc::new(store.clone()))
                    .source(Arc::new(feed.clone()))
                    .handler(Noop)
                    .settings(settings.clone())
                    .seed(u64::from(h))
                    .build()?
                    .start(),
            );
        }
        // Let the fleet balance.
        tokio::time::sleep(Duration::from_secs(90)).await;
        let before: Vec<StoreCounts> = hosts.iter().map(|h| h.store_stats().snapshot()).collect();
        let window = Duration::from_secs(args.minutes * 60);
        tokio::time::sleep(window).await;
        let after: Vec<StoreCounts> = hosts.iter().map(|h| h.store_stats().snapshot()).collect();
        let owned = {
            let l = store.list(&group).await?;
            let owners: std::collections::BTreeSet<_> =
                l.leases.iter().filter_map(|l| l.owner.clone()).collect();
            anyhow::ensure!(owners.len() == args.hosts as usize, "fleet did not balance");
            l.leases.len()
        };
        for h in hosts {
            h.stop().await?;
        }
        let delta: Vec<StoreCounts> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| StoreCounts {
                reads: a.reads - b.reads,
                writes: a.writes - b.writes,
                lease_rows_read: a.lease_rows_read - b.lease_rows_read,
                lists: a.lists - b.lists,
                heartbeats: a.heartbeats - b.heartbeats,
            })
            .collect();
        let total = sum(&delta);
        let hosts_n = f64::from(args.hosts);
        let renew_intervals = window.as_secs_f64() / settings.renew_interval.as_secs_f64();
        let acquire_intervals = window.as_secs_f64() / settings.acquire_interval.as_secs_f64();
        let writes = total.writes as f64 / hosts_n / renew_intervals;
        let checkpoints = (total.writes - total.heartbeats) as f64 / hosts_n / renew_intervals;
        let rows = total.lease_rows_read as f64 / hosts_n / acquire_intervals;
        let reads = total.reads as f64 / hosts_n / acquire_intervals;
        // The anchors at the same timings: one renewal per owned lease per renew interval, one
        // full scan of the lease table per acquire cycle.
        let kcl_writes = f64::from(args.leases) / hosts_n;
        let kcl_rows = f64::from(args.leases);
        println!(
            "{} leases, {} hosts, {} virtual minutes of steady state on an idle feed",
            owned, args.hosts, args.minutes
        );
        println!(
            "renew {:?}, acquire {:?}, full list every {:?}",
            settings.renew_interval, settings.acquire_interval, settings.full_list_interval
        );
        println!("{:<40} {:>12} {:>12}", "per host", "ours", "KCL/Cosmos");
        println!("{:<40} {:>12.2} {:>12.1}", "writes per renew interval", writes, kcl_writes);
        println!("{:<40} {:>12.2} {:>12}", "  of which checkpoints", checkpoints, "-");
        println!("{:<40} {:>12.2} {:>12.1}", "store reads per acquire interval", reads, 1.0);
        println!("{:<40} {:>12.2} {:>12.1}", "lease rows read per acquire interval", rows, kcl_rows);
        println!(
            "{:<40} {:>12.0} {:>12.0}",
            "lease rows read per host per minute",
            total.lease_rows_read as f64 / hosts_n / args.minutes as f64,
            kcl_rows * 60.0 / settings.acquire_interval.as_secs_f64()
        );
        println!(
            "RESULT writes_per_host_per_interval={writes:.3} checkpoints_per_host_per_interval={checkpoints:.3} lease_rows_read_per_host_per_interval={rows:.2} kcl_writes_per_host_per_interval={kcl_writes:.1} kcl_lease_rows_read_per_host_per_interval={kcl_rows:.0}"
        );
        Ok(())
    })
}
