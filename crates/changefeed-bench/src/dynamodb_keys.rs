//! `dynamodb-keys`: request units per second on each DynamoDB partition key of a real fleet.
//!
//! `--hosts` real processors (in-process, each with its own `DynamoLeaseStore` handle on a
//! client to DynamoDB Local) share `--leases` leases on an idle in-memory feed, with the
//! membership view on (the DynamoDB store keeps one). After they have balanced, an SDK
//! interceptor on every client counts, over a steady window, the request units of each call
//! by the partition key it touches: DynamoDB Local neither enforces nor reports per-partition
//! limits, so the figures are computed from counted requests. Each call's units are the ones
//! DynamoDB Local reports for it (`ReturnConsumedCapacity=TOTAL`, which the store asks on
//! every call; they follow DynamoDB's rules: 1 write unit per KB written, 1 read unit per 4 KB
//! read strongly consistently, transactions twice that), attributed to the call's partition
//! key; a transaction's units are split evenly over its items (each of the store's transaction
//! items is below 1 KB, so each costs 2); a write refused by its condition, which DynamoDB
//! charges but does not report, counts 1 unit (2 per item of a transaction).
//!
//! The per-key rates are extrapolated per host to 1,000 and 10,000 hosts (rate × N / hosts):
//! every key's traffic here comes from per-host calls (heartbeats spread over the shards, used
//! here from the first host as a fleet of that size would use them; head reads of the counter
//! item), so the linear figure bounds it. The counter item's reads
//! are head reads, which the fleet paces to the store's `head_reads_per_second` (the acquire
//! cycle stretches to `live hosts ÷ limit`, up to 0.45 × (`handoff_timeout −
//! safety_margin`)): they are extrapolated with the cycle each fleet size gets, computed by
//! that rule (`× cycle(hosts) ÷ cycle(N)`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use changefeed::lease::{LeaseStore, MembershipStore};
use changefeed::model::{Batch, GroupName, Lease, LeaseKey, Position};
use changefeed::processor::{Context, Handler, HandlerError, Processor, Settings};
use changefeed::source::{FeedSource, MemoryFeed};
use changefeed_dynamodb::sdk::config::interceptors::{
    BeforeSerializationInterceptorContextRef, FinalizerInterceptorContextRef,
};
use changefeed_dynamodb::sdk::config::{ConfigBag, Intercept, RuntimeComponents};
use changefeed_dynamodb::sdk::operation::delete_item::{DeleteItemInput, DeleteItemOutput};
use changefeed_dynamodb::sdk::operation::get_item::{GetItemInput, GetItemOutput};
use changefeed_dynamodb::sdk::operation::put_item::{PutItemInput, PutItemOutput};
use changefeed_dynamodb::sdk::operation::query::{QueryInput, QueryOutput};
use changefeed_dynamodb::sdk::operation::transact_write_items::{
    TransactWriteItemsInput, TransactWriteItemsOutput,
};
use changefeed_dynamodb::sdk::operation::update_item::{UpdateItemInput, UpdateItemOutput};
use changefeed_dynamodb::sdk::types::{AttributeValue, ConsumedCapacity};
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore, PK};

/// DynamoDB's per-partition limits: write and read units per second.
const WCU_LIMIT: f64 = 1_000.0;
const RCU_LIMIT: f64 = 3_000.0;

/// Arguments of `changefeed-bench dynamodb-keys`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Hosts (real processors in this process).
    #[arg(long, default_value_t = 50)]
    hosts: u32,
    /// Leases (partitions).
    #[arg(long, default_value_t = 500)]
    leases: u32,
    /// Seconds to let the fleet balance before measuring.
    #[arg(long, default_value_t = 60)]
    warmup: u64,
    /// Seconds of the steady window measured.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// DynamoDB endpoint (default: $CHANGEFEED_TEST_DYNAMODB_URL, else DynamoDB Local on
    /// 127.0.0.1:8000).
    #[arg(long)]
    endpoint: Option<String>,
    /// The stores' limit on the fleet's head reads per second (default: the DynamoDB store's,
    /// 2,400). A low one shows the pacing at this machine's fleet size.
    #[arg(long)]
    head_reads_per_second: Option<f64>,
    /// A small run for a smoke test: 5 hosts, 50 leases, 10 s to balance, 5 s measured.
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

/// Units counted per partition key while recording.
#[derive(Debug, Default)]
struct Tally {
    recording: AtomicBool,
    by_key: Mutex<BTreeMap<String, KeyUnits>>,
}

#[derive(Clone, Copy, Debug, Default)]
struct KeyUnits {
    read: f64,
    write: f64,
    calls: u64,
}

impl Tally {
    fn add(&self, keys: &[String], read: f64, write: f64) {
        if !self.recording.load(Ordering::Relaxed) || keys.is_empty() {
            return;
        }
        let share = keys.len() as f64;
        let mut by_key = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        for k in keys {
            let e = by_key.entry(k.clone()).or_default();
            e.read += read / share;
            e.write += write / share;
            e.calls += 1;
        }
    }
}

/// The partition keys a call touches, kept between serialization and the end of the call.
#[derive(Clone, Debug)]
struct Touched {
    keys: Vec<String>,
    write: bool,
}

impl aws_smithy_types::config_bag::Storable for Touched {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

#[derive(Debug)]
struct Counter(Arc<Tally>);

fn pk_of(item: Option<&std::collections::HashMap<String, AttributeValue>>) -> Option<String> {
    match item?.get(PK)? {
        AttributeValue::S(s) => Some(s.clone()),
        _ => None,
    }
}

fn touched(
    input: &aws_smithy_runtime_api::client::interceptors::context::Input,
) -> Option<Touched> {
    let one = |pk: Option<String>, write| {
        pk.map(|k| Touched {
            keys: vec![k],
            write,
        })
    };
    if let Some(i) = input.downcast_ref::<GetItemInput>() {
        return one(pk_of(i.key()), false);
    }
    if let Some(i) = input.downcast_ref::<QueryInput>() {
        let pk = i
            .expression_attribute_values()
            .and_then(|v| match v.get(":pk") {
                Some(AttributeValue::S(s)) => Some(s.clone()),
                _ => None,
            });
        return one(pk, false);
    }
    if let Some(i) = input.downcast_ref::<PutItemInput>() {
        return one(pk_of(i.item()), true);
    }
    if let Some(i) = input.downcast_ref::<UpdateItemInput>() {
        return one(pk_of(i.key()), true);
    }
    if let Some(i) = input.downcast_ref::<DeleteItemInput>() {
        return one(pk_of(i.key()), true);
    }
    let t = input.downcast_ref::<TransactWriteItemsInput>()?;
    let keys = t
        .transact_items()
        .iter()
        .filter_map(|item| {
            item.put()
                .and_then(|p| pk_of(Some(p.item())))
                .or_else(|| item.update().and_then(|u| pk_of(Some(u.key()))))
                .or_else(|| item.delete().and_then(|d| pk_of(Some(d.key()))))
                .or_else(|| item.condition_check().and_then(|c| pk_of(Some(c.key()))))
        })
        .collect();
    Some(Touched { keys, write: true })
}

fn units(c: Option<&ConsumedCapacity>) -> f64 {
    c.and_then(ConsumedCapacity::capacity_units).unwrap_or(0.0)
}

fn reported(output: &aws_smithy_runtime_api::client::interceptors::context::Output) -> Option<f64> {
    if let Some(o) = output.downcast_ref::<GetItemOutput>() {
        return Some(units(o.consumed_capacity()));
    }
    if let Some(o) = output.downcast_ref::<QueryOutput>() {
        return Some(units(o.consumed_capacity()));
    }
    if let Some(o) = output.downcast_ref::<PutItemOutput>() {
        return Some(units(o.consumed_capacity()));
    }
    if let Some(o) = output.downcast_ref::<UpdateItemOutput>() {
        return Some(units(o.consumed_capacity()));
    }
    if let Some(o) = output.downcast_ref::<DeleteItemOutput>() {
        return Some(units(o.consumed_capacity()));
    }
    let o = output.downcast_ref::<TransactWriteItemsOutput>()?;
    Some(o.consumed_capacity().iter().map(|c| units(Some(c))).sum())
}

impl Intercept for Counter {
    fn name(&self) -> &'static str {
        "PartitionKeyUnits"
    }

    fn read_before_serialization(
        &self,
        context: &BeforeSerializationInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        if let Some(t) = touched(context.input()) {
            cfg.interceptor_state().store_put(t);
        }
        Ok(())
    }

    fn read_after_execution(
        &self,
        context: &FinalizerInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let Some(t) = cfg.load::<Touched>().cloned() else {
            return Ok(());
        };
        match context.output_or_error() {
            Some(Ok(output)) => {
                let u = reported(output).unwrap_or(0.0);
                if t.write {
                    self.0.add(&t.keys, 0.0, u);
                } else {
                    self.0.add(&t.keys, u, 0.0);
                }
            }
            // A refused or failed write: DynamoDB charges it without saying so.
            Some(Err(_)) if t.write => {
                let per_item = if t.keys.len() > 1 { 2.0 } else { 1.0 };
                self.0.add(&t.keys, 0.0, per_item * t.keys.len() as f64);
            }
            _ => {}
        }
        Ok(())
    }
}

/// Runs the benchmark.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.hosts, args.leases, args.warmup, args.seconds) = (5, 50, 10, 5);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
    let config = AwsOptions::local(&endpoint).load().await;
    let tally = Arc::new(Tally::default());
    let counted = changefeed_dynamodb::sdk::config::Builder::from(&config)
        .interceptor(Counter(tally.clone()))
        .build();
    let client = changefeed_dynamodb::sdk::Client::from_conf(counted);
    let table = format!("bench-keys-{}-{}", std::process::id(), args.hosts);
    let setup = DynamoLeaseStore::new(client.clone(), &table);
    setup.ensure_table().await?;
    let settings = Settings::default();
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
    let mut hosts = Vec::new();
    for h in 0..args.hosts {
        // Sharded from the first host: the figures are extrapolated to fleets of 1,000 and
        // 10,000, which outgrow one heartbeat key long before, whatever size runs here.
        let mut store = DynamoLeaseStore::with_seed(client.clone(), &table, u64::from(h))
            .with_heartbeat_shards_at(1);
        if let Some(limit) = args.head_reads_per_second {
            store = store.with_head_reads_per_second(limit)?;
        }
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
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;
    tally.recording.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    tally.recording.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let head = setup.head(&group).await?;
    let view = head.as_ref().and_then(|h| h.view.as_ref());
    for h in hosts {
        let _ = h.stop().await;
    }
    let by_key = tally
        .by_key
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    println!(
        "dynamodb-keys: {} hosts, {} leases, renew every {:?}, acquire every {:?}, {elapsed:.0} s measured; view version {:?}, {} live",
        args.hosts,
        args.leases,
        settings.renew_interval,
        settings.acquire_interval,
        view.map(|v| v.version),
        view.map_or(0, |v| v.live.len()),
    );
    println!(
        "{:<24} {:>8} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "partition key",
        "calls/s",
        "WCU/s",
        "RCU/s",
        "WCU/s@1k",
        "RCU/s@1k",
        "WCU/s@10k",
        "RCU/s@10k"
    );
    let hosts = f64::from(args.hosts);
    let limit = args
        .head_reads_per_second
        .unwrap_or(changefeed_dynamodb::DEFAULT_HEAD_READS_PER_SECOND);
    // The acquire cycle a fleet of `n` hosts gets (the processor's pacing rule).
    let cycle = |n: f64| {
        let base = settings.acquire_interval.as_secs_f64();
        let cap = 0.45 * (settings.handoff_timeout - settings.safety_margin).as_secs_f64();
        base.max((n / limit).min(cap))
    };
    let counter_key = changefeed_dynamodb::heartbeat_pk(&group);
    // Per-key units at `n` hosts: linear in the hosts, the counter item's reads paced.
    let at = |key: &str, write: f64, read: f64, n: f64| {
        let pace = if key == counter_key {
            cycle(hosts) / cycle(n)
        } else {
            1.0
        };
        (write * n / hosts, read * n / hosts * pace)
    };
    let (mut max_w, mut max_r) = ((String::new(), 0.0f64), (String::new(), 0.0f64));
    let (mut max_w_at, mut max_r_at) = ([0.0f64; 2], [0.0f64; 2]);
    for (key, u) in &by_key {
        let (w, r) = (u.write / elapsed, u.read / elapsed);
        let (w1k, r1k) = at(key, w, r, 1_000.0);
        let (w10k, r10k) = at(key, w, r, 10_000.0);
        println!(
            "{key:<24} {:>8.1} {w:>10.2} {r:>10.2} {w1k:>12.0} {r1k:>12.0} {w10k:>12.0} {r10k:>12.0}",
            u.calls as f64 / elapsed,
        );
        if w > max_w.1 {
            max_w = (key.clone(), w);
        }
        if r > max_r.1 {
            max_r = (key.clone(), r);
        }
        max_w_at = [max_w_at[0].max(w1k), max_w_at[1].max(w10k)];
        max_r_at = [max_r_at[0].max(r1k), max_r_at[1].max(r10k)];
    }
    let over_10k = max_w_at[1] > WCU_LIMIT || max_r_at[1] > RCU_LIMIT;
    println!(
        "head reads paced to {limit} per second: acquire cycle {:.2} s at {hosts} hosts, {:.2} s at 1,000, {:.2} s at 10,000",
        cycle(hosts),
        cycle(1_000.0),
        cycle(10_000.0),
    );
    println!(
        "RESULT hosts={} max_key_wcu_per_s={:.2} max_key_rcu_per_s={:.2} hottest_write_key={} hottest_read_key={} max_key_wcu_per_s_at_1000={:.0} max_key_rcu_per_s_at_1000={:.0} max_key_wcu_per_s_at_10000={:.0} max_key_rcu_per_s_at_10000={:.0} over_limit_at_10000={over_10k} head_reads_per_second_limit={limit}",
        args.hosts,
        max_w.1,
        max_r.1,
        max_w.0,
        max_r.0,
        max_w_at[0],
        max_r_at[0],
        max_w_at[1],
        max_r_at[1],
    );
    Ok(())
}
