//! `store-io`: store reads and writes per host in steady state, on virtual time.
//!
//! Ten hosts (by default) share an idle feed and an in-memory store; after they have balanced,
//! the benchmark counts every store call each host makes over a long steady window and reports
//! them per host: ours **measured**, the anchors **computed** from their published pattern
//! (every host renews each lease it owns once per renew interval and scans the whole lease
//! table once per taker/acquire cycle), at our timings and at each anchor's own defaults:
//! KCL 2.x with `failoverTimeMillis` 10 s renews every 10 s / 3 − 25 ms = 3.308 s and scans
//! every (10 s + 25 ms) × 2 = 20.05 s; the Cosmos DB processor renews every 17 s and acquires
//! every 13 s. The anchors read no heartbeat rows; on an idle feed nobody checkpoints.

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
        let total = before
            .iter()
            .zip(&after)
            .fold(StoreCounts::default(), |sum, (b, a)| sum.plus(&a.since(b)));
        let hosts_n = f64::from(args.hosts);
        let leases = f64::from(args.leases);
        let minutes = args.minutes as f64;
        let renew_intervals = window.as_secs_f64() / settings.renew_interval.as_secs_f64();
        let acquire_intervals = window.as_secs_f64() / settings.acquire_interval.as_secs_f64();
        let per_host = |n: u64| n as f64 / hosts_n;
        let writes = per_host(total.writes) / renew_intervals;
        let checkpoints = per_host(total.writes - total.heartbeats) / renew_intervals;
        let rows = per_host(total.lease_rows_read) / acquire_intervals;
        let hb_rows = per_host(total.heartbeat_rows_read) / acquire_intervals;
        // Head rows: the change counter and the membership view, read together.
        let head_rows = per_host(total.head_rows_read) / acquire_intervals;
        let reads = per_host(total.reads) / acquire_intervals;
        // Every row read: heartbeat, head and lease rows together.
        let all_rows = rows + hb_rows + head_rows;
        // Per host per minute, the unit every cadence can be compared in.
        let ours_min = Anchor {
            writes: per_host(total.writes) / minutes,
            lease_rows: per_host(total.lease_rows_read) / minutes,
            heartbeat_rows: per_host(total.heartbeat_rows_read + total.head_rows_read) / minutes,
        };
        let same = Anchor::computed(leases, hosts_n, settings.renew_interval, settings.acquire_interval);
        let kcl_default = Anchor::computed(
            leases,
            hosts_n,
            Duration::from_millis(10_000 / 3 - 25),
            Duration::from_millis((10_000 + 25) * 2),
        );
        let cosmos_default = Anchor::computed(
            leases,
            hosts_n,
            Duration::from_secs(17),
            Duration::from_secs(13),
        );
        println!(
            "{} leases, {} hosts, {} virtual minutes of steady state on an idle feed",
            owned, args.hosts, args.minutes
        );
        println!(
            "ours: renew {:?}, acquire {:?}, full list every {:?}",
            settings.renew_interval, settings.acquire_interval, settings.full_list_interval
        );
        println!();
        println!("per host, per our interval (measured)       ours");
        println!("{:<42} {:>8.2}", "writes per renew interval", writes);
        println!("{:<42} {:>8.2}", "  of which not heartbeats", checkpoints);
        println!("{:<42} {:>8.2}", "store reads per acquire interval", reads);
        println!("{:<42} {:>8.2}", "lease rows read per acquire interval", rows);
        println!("{:<42} {:>8.2}", "heartbeat rows read per acquire interval", hb_rows);
        println!("{:<42} {:>8.2}", "head rows read per acquire interval", head_rows);
        println!("{:<42} {:>8.2}", "rows read per acquire interval, in all", all_rows);
        println!();
        println!(
            "{:<30} {:>14} {:>18} {:>18} {:>18}",
            "per host per minute", "ours", "pattern at ours", "KCL 2.x defaults", "Cosmos defaults"
        );
        println!(
            "{:<30} {:>14} {:>18} {:>18} {:>18}",
            "", "(measured)", "(computed)", "(computed)", "(computed)"
        );
        for (what, f) in [
            ("writes", (|a: &Anchor| a.writes) as fn(&Anchor) -> f64),
            ("lease rows read", |a: &Anchor| a.lease_rows),
            ("heartbeat and head rows read", |a: &Anchor| a.heartbeat_rows),
        ] {
            println!(
                "{:<30} {:>14.0} {:>18.0} {:>18.0} {:>18.0}",
                what,
                f(&ours_min),
                f(&same),
                f(&kcl_default),
                f(&cosmos_default)
            );
        }
        println!(
            "RESULT writes_per_host_per_interval={writes:.3} checkpoints_per_host_per_interval={checkpoints:.3} lease_rows_read_per_host_per_interval={rows:.2} kcl_writes_per_host_per_interval={:.1} kcl_lease_rows_read_per_host_per_interval={:.0} heartbeat_rows_read_per_host_per_interval={hb_rows:.2} writes_per_host_min_ours={:.1} writes_per_host_min_kcl_default={:.0} writes_per_host_min_cosmos_default={:.0} lease_rows_read_per_host_min_ours={:.0} lease_rows_read_per_host_min_kcl_default={:.0} lease_rows_read_per_host_min_cosmos_default={:.0} heartbeat_rows_read_per_host_min_ours={:.0} rows_read_per_host_per_interval={all_rows:.2} rows_read_per_interval_fleet={:.0} head_rows_read_per_host_per_interval={head_rows:.2}",
            leases / hosts_n,
            leases,
            ours_min.writes,
            kcl_default.writes,
            cosmos_default.writes,
            ours_min.lease_rows,
            kcl_default.lease_rows,
            cosmos_default.lease_rows,
            ours_min.heartbeat_rows,
            all_rows * hosts_n,
        );
        Ok(())
    })
}

/// Store work per host per minute.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    writes: f64,
    lease_rows: f64,
    heartbeat_rows: f64,
}

impl Anchor {
    /// The anchors' published pattern: each host renews its share of the leases every `renew`
    /// and scans the whole table every `scan`; no heartbeat rows.
    fn computed(leases: f64, hosts: f64, renew: Duration, scan: Duration) -> Self {
        Anchor {
            writes: leases / hosts * 60.0 / renew.as_secs_f64(),
            lease_rows: leases * 60.0 / scan.as_secs_f64(),
            heartbeat_rows: 0.0,
        }
    }
}
