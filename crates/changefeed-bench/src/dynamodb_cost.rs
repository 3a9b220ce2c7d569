//! `dynamodb-cost`: DynamoDB capacity per minute of a fleet, ours against KCL's pattern.
//!
//! Ours: `--hosts` real processors share `--leases` leases on a DynamoDB table (DynamoDB Local
//! by default) and an in-memory feed. After they have balanced, the capacity units DynamoDB
//! reports (`ReturnConsumedCapacity`) are summed over a steady window on an idle feed
//! (liveness and balancing only), then over a second window with records flowing (checkpoints
//! added).
//!
//! KCL: its published pattern, driven against a KCL-shaped lease table on the same server in
//! the same run: each worker renews each lease it owns with one conditional `UpdateItem`
//! every failover/3 (3.33 s at the default 10 s failover), and scans the whole table once per
//! taker cycle (every 20 s). One full renewal round and one scan per worker are issued for
//! real, their reported capacity measured and scaled by the cadence. With records flowing,
//! the KCL side also issues, for real, as many checkpoint `UpdateItem`s as ours made.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor, ProcessorHandle, Settings};
use changefeed::source::{FeedSource, MemoryFeed};
use changefeed_dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ReturnConsumedCapacity, ScalarAttributeType,
};
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore};

/// On-demand prices, us-east-1, USD per million request units (since November 2024).
const USD_PER_MILLION_WRITES: f64 = 0.625;
const USD_PER_MILLION_READS: f64 = 0.125;
const MINUTES_PER_MONTH: f64 = 30.0 * 24.0 * 60.0;

/// Arguments of `changefeed-bench dynamodb-cost`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases (partitions).
    #[arg(long, default_value_t = 1000)]
    leases: u32,
    /// Hosts.
    #[arg(long, default_value_t = 10)]
    hosts: u32,
    /// Seconds of each steady window measured (idle, then flowing).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Records per second appended to the feed during the flowing window.
    #[arg(long, default_value_t = 50)]
    records_per_sec: u32,
    /// DynamoDB endpoint (default: $CHANGEFEED_TEST_DYNAMODB_URL, else DynamoDB Local on
    /// 127.0.0.1:8000).
    #[arg(long)]
    endpoint: Option<String>,
    /// A small run for a smoke test: 3 hosts, 30 leases, 3 s windows.
    #[arg(long)]
    quick: bool,
}

#[derive(Debug)]
struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(&self, _ctx: &Context, _batch: &Batch) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Units {
    read: f64,
    write: f64,
}

fn capacity(stores: &[DynamoLeaseStore]) -> Units {
    stores.iter().fold(Units::default(), |u, s| {
        let c = s.capacity();
        Units {
            read: u.read + c.read_units,
            write: u.write + c.write_units,
        }
    })
}

fn non_heartbeat_writes(hosts: &[ProcessorHandle]) -> u64 {
    hosts
        .iter()
        .map(|h| {
            let c = h.store_stats().snapshot();
            c.writes - c.heartbeats
        })
        .sum()
}

fn monthly(units_per_min: f64, usd_per_million: f64) -> f64 {
    units_per_min * MINUTES_PER_MONTH / 1e6 * usd_per_million
}

/// Runs the benchmark.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.hosts, args.leases, args.seconds) = (3, 30, 3);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    rt.block_on(run_async(args))
}

async fn run_async(args: Args) -> anyhow::Result<()> {
    let endpoint = args
        .endpoint
        .clone()
        .or_else(|| std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8000".into());
    let options = AwsOptions::local(&endpoint);
    let config = options.load().await;
    let client = changefeed_dynamodb::sdk::Client::new(&config);
    let stamp = std::process::id();
    let table = format!("bench-cost-{stamp}-{}", args.leases);
    let setup = DynamoLeaseStore::new(client.clone(), &table);
    setup.ensure_table().await?;

    // --- ours -------------------------------------------------------------------------------
    let failover = Duration::from_secs(10);
    let settings = Settings {
        lease_expiry: failover,
        // Equal timings with KCL: liveness written every failover/3.
        renew_interval: failover / 3,
        ..Settings::default()
    };
    let feed = MemoryFeed::new(args.leases);
    let group = GroupName::new("bench")?;
    for p in feed.partitions().await? {
        setup
            .create(&Lease::new(
                LeaseKey::new(group.clone(), p.id),
                Position::Beginning,
            ))
            .await?;
    }
    let mut stores = Vec::new();
    let mut hosts = Vec::new();
    for h in 0..args.hosts {
        let store = DynamoLeaseStore::new(client.clone(), &table);
        stores.push(store.clone());
        hosts.push(
            Processor::builder()
                .host(format!("host-{h:03}"))
                .group("bench")
                .store(Arc::new(store))
                .source(Arc::new(feed.clone()))
                .handler(Noop)
                .settings(settings.clone())
                .seed(u64::from(h))
                .build()?
                .start(),
        );
    }
    let quota = args.leases.div_ceil(args.hosts) as usize;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let listing = setup.list(&group).await?;
        let mut per: BTreeMap<String, usize> = BTreeMap::new();
        for l in &listing.leases {
            if let Some(o) = &l.owner {
                *per.entry(o.to_string()).or_default() += 1;
            }
        }
        let owned: usize = per.values().sum();
        if owned == args.leases as usize
            && per.len() == args.hosts as usize
            && per.values().all(|n| *n <= quota)
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "fleet did not balance in 300 s: {owned} owned, {per:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Let the last hand-offs settle before measuring.
    tokio::time::sleep(settings.lease_expiry).await;
    let window = Duration::from_secs(args.seconds);
    let minutes = window.as_secs_f64() / 60.0;

    let before = capacity(&stores);
    tokio::time::sleep(window).await;
    let after = capacity(&stores);
    let ours_idle = Units {
        read: (after.read - before.read) / minutes,
        write: (after.write - before.write) / minutes,
    };

    let running = Arc::new(AtomicBool::new(true));
    let writer = {
        let feed = feed.clone();
        let running = running.clone();
        let per_tick = (args.records_per_sec / 10).max(1);
        tokio::spawn(async move {
            let mut i = 0u64;
            while running.load(Ordering::Relaxed) {
                for _ in 0..per_tick {
                    feed.append(&format!("key-{i}"), format!("record-{i}"));
                    i += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            i
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = capacity(&stores);
    let cp_before = non_heartbeat_writes(&hosts);
    tokio::time::sleep(window).await;
    let after = capacity(&stores);
    let checkpoints = non_heartbeat_writes(&hosts) - cp_before;
    running.store(false, Ordering::Relaxed);
    let appended = writer.await?;
    let ours_flowing = Units {
        read: (after.read - before.read) / minutes,
        write: (after.write - before.write) / minutes,
    };
    for h in hosts {
        h.stop().await?;
    }

    // --- KCL's pattern, on a KCL-shaped table on the same server ----------------------------
    let kcl_table = format!("bench-kcl-{stamp}-{}", args.leases);
    client
        .create_table()
        .table_name(&kcl_table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("leaseKey")
                .attribute_type(ScalarAttributeType::S)
                .build()?,
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("leaseKey")
                .key_type(KeyType::Hash)
                .build()?,
        )
        .send()
        .await?;
    let s = |v: String| AttributeValue::S(v);
    let n = |v: u64| AttributeValue::N(v.to_string());
    let shard = |i: u32| format!("shardId-{i:012}");
    let worker = |i: u32| {
        format!(
            "worker-{:03}-0f3c2a9e-5d1b-4c7e-9a8b-1c2d3e4f5a6b",
            i % args.hosts
        )
    };
    for i in 0..args.leases {
        client
            .put_item()
            .table_name(&kcl_table)
            .item("leaseKey", s(shard(i)))
            .item("leaseOwner", s(worker(i)))
            .item("leaseCounter", n(1))
            .item(
                "checkpoint",
                s("49590338271490256608559692538361571095921575989136588898".into()),
            )
            .item("checkpointSubSequenceNumber", n(0))
            .item("ownerSwitchesSinceCheckpoint", n(0))
            .item("startingHashKey", s("0".into()))
            .item(
                "endingHashKey",
                s("340282366920938463463374607431768211455".into()),
            )
            .send()
            .await?;
    }
    // One renewal round: every lease renewed by its owner (KCL's DynamoDBLeaseRefresher.renewLease:
    // conditional on leaseCounter and leaseOwner, increments leaseCounter).
    let mut renew_wcu = 0.0;
    for i in 0..args.leases {
        let out = client
            .update_item()
            .table_name(&kcl_table)
            .key("leaseKey", s(shard(i)))
            .update_expression("SET leaseCounter = leaseCounter + :one")
            .condition_expression("leaseCounter = :c AND leaseOwner = :o")
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":c", n(1))
            .expression_attribute_values(":o", s(worker(i)))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await?;
        renew_wcu += out
            .consumed_capacity()
            .and_then(|c| c.capacity_units())
            .unwrap_or(0.0);
    }
    // One taker cycle: every worker scans the whole table (KCL's listLeases).
    let mut scan_rcu = 0.0;
    for _ in 0..args.hosts {
        let mut start = None;
        loop {
            let out = client
                .scan()
                .table_name(&kcl_table)
                .set_exclusive_start_key(start.take())
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await?;
            scan_rcu += out
                .consumed_capacity()
                .and_then(|c| c.capacity_units())
                .unwrap_or(0.0);
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
    }
    // Checkpoints: as many as ours made in the flowing window, each KCL's conditional update.
    let mut checkpoint_wcu = 0.0;
    for c in 0..checkpoints {
        let i = (c % u64::from(args.leases)) as u32;
        let out = client
            .update_item()
            .table_name(&kcl_table)
            .key("leaseKey", s(shard(i)))
            .update_expression(
                "SET checkpoint = :cp, checkpointSubSequenceNumber = :z, ownerSwitchesSinceCheckpoint = :z, leaseCounter = leaseCounter + :one",
            )
            .condition_expression("leaseOwner = :o")
            .expression_attribute_values(":cp", s(format!("4959033827149025660855969253836157109592157598913{c:07}")))
            .expression_attribute_values(":z", n(0))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":o", s(worker(i)))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await?;
        checkpoint_wcu += out
            .consumed_capacity()
            .and_then(|c| c.capacity_units())
            .unwrap_or(0.0);
    }
    let renewals_per_min = 60.0 / (failover.as_secs_f64() / 3.0);
    let taker_cycles_per_min = 60.0 / 20.0;
    let kcl_idle = Units {
        write: renew_wcu * renewals_per_min,
        read: scan_rcu * taker_cycles_per_min,
    };
    let kcl_flowing = Units {
        write: kcl_idle.write + checkpoint_wcu / minutes,
        read: kcl_idle.read,
    };
    let write_ratio = kcl_idle.write / ours_idle.write.max(f64::EPSILON);
    let write_ratio_flowing = kcl_flowing.write / ours_flowing.write.max(f64::EPSILON);

    println!(
        "{} leases, {} hosts, DynamoDB at {endpoint}; {}s windows; failover {:?}, our renew {:?}, acquire {:?}",
        args.leases, args.hosts, args.seconds, failover, settings.renew_interval, settings.acquire_interval
    );
    println!(
        "flowing: {appended} records appended, {checkpoints} checkpoints by ours in the window"
    );
    println!(
        "{:<22} {:>12} {:>12} {:>14}",
        "units per minute", "WCU", "RCU", "USD per month"
    );
    for (name, u) in [
        ("ours, idle", ours_idle),
        ("KCL, idle", kcl_idle),
        ("ours, flowing", ours_flowing),
        ("KCL, flowing", kcl_flowing),
    ] {
        println!(
            "{:<22} {:>12.1} {:>12.1} {:>14.2}",
            name,
            u.write,
            u.read,
            monthly(u.write, USD_PER_MILLION_WRITES) + monthly(u.read, USD_PER_MILLION_READS)
        );
    }
    println!(
        "RESULT wcu_per_min_ours={:.1} rcu_per_min_ours={:.1} wcu_per_min_kcl={:.1} rcu_per_min_kcl={:.1} write_ratio={:.1} flowing_wcu_per_min_ours={:.1} flowing_wcu_per_min_kcl={:.1} flowing_write_ratio={:.2} usd_month_ours={:.2} usd_month_kcl={:.2}",
        ours_idle.write,
        ours_idle.read,
        kcl_idle.write,
        kcl_idle.read,
        write_ratio,
        ours_flowing.write,
        kcl_flowing.write,
        write_ratio_flowing,
        monthly(ours_idle.write, USD_PER_MILLION_WRITES) + monthly(ours_idle.read, USD_PER_MILLION_READS),
        monthly(kcl_idle.write, USD_PER_MILLION_WRITES) + monthly(kcl_idle.read, USD_PER_MILLION_READS),
    );
    Ok(())
}
