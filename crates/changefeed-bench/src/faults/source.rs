//! The feed a fault fleet reads, and the writer that appends to it while the fault plays: a
//! PostgreSQL outbox, or a Kinesis stream (kinesis-mock, or another endpoint).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use changefeed::source::FeedSource as _;
use changefeed_kinesis::KinesisFeed;
use changefeed_postgres::{append, OutboxTable};

use super::{ledger, Setup};

/// The feed a fleet reads.
#[derive(Debug, Clone)]
pub enum SourceBackend {
    /// A PostgreSQL outbox, on the PostgreSQL server the fleet is given.
    Outbox,
    /// A Kinesis stream, on kinesis-mock (or another Kinesis endpoint) at this
    /// `http://host:port`, its shards the partitions.
    Kinesis(String),
}

impl SourceBackend {
    /// The name on the command line (`--source`) and in RESULT lines.
    pub fn name(&self) -> &'static str {
        match self {
            SourceBackend::Outbox => "postgres",
            SourceBackend::Kinesis(_) => "kinesis",
        }
    }
}

/// Records between two appends (both sources): a steady trickle, so that every partition has
/// something to deliver soon after any fault ends.
const EVERY: Duration = Duration::from_millis(40);

/// Records for each partition's keys: three keys a partition.
const KEYS_PER_PARTITION: usize = 3;

/// The writer of a fleet's source, connected and with its keys chosen.
pub(super) enum Writer {
    Outbox {
        client: tokio_postgres::Client,
        table: OutboxTable,
        keys: Vec<String>,
    },
    /// Each key with the hash key that routes it to its shard, so that every shard gets
    /// records (Kinesis would route partition keys by their MD5 hash otherwise).
    Kinesis {
        feed: KinesisFeed,
        keys: Vec<(String, u128)>,
    },
}

impl Writer {
    /// Creates the feed (the outbox's partitions; the Kinesis stream was created by `setup`)
    /// and connects its writer.
    pub(super) async fn prepare(setup: &Setup) -> anyhow::Result<Writer> {
        match &setup.source {
            SourceBackend::Outbox => {
                let (client, connection) =
                    tokio_postgres::connect(&setup.pg_url, tokio_postgres::NoTls)
                        .await
                        .context("connect to the outbox's PostgreSQL")?;
                tokio::spawn(connection);
                let table = OutboxTable::new(&setup.prefix).context("outbox table")?;
                let out = std::process::Command::new(&setup.changefeed)
                    .args(["outbox", "--source"])
                    .arg(setup.source_url.replace("{addr}", &setup.source_upstream))
                    .args(["create", "--partitions"])
                    .arg(setup.partitions.to_string())
                    .output()
                    .context("changefeed outbox create")?;
                if !out.status.success() {
                    bail!(
                        "changefeed outbox create: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                Ok(Writer::Outbox {
                    client,
                    table,
                    keys: ledger::keys(setup.partitions, KEYS_PER_PARTITION),
                })
            }
            SourceBackend::Kinesis(endpoint) => {
                let feed = kinesis_feed(endpoint, &setup.prefix).await;
                let mut shards = feed
                    .partitions()
                    .await
                    .context("list the stream's shards")?;
                shards.sort_by_key(|p| p.key_range.map(|r| r.start));
                let mut keys = Vec::new();
                for (i, shard) in shards.iter().enumerate() {
                    let range = shard
                        .key_range
                        .with_context(|| format!("shard {} has no hash-key range", shard.id))?;
                    for j in 0..KEYS_PER_PARTITION {
                        let hash = range.start.saturating_add(j as u128).min(range.end);
                        keys.push((format!("s{i}k{j}"), hash));
                    }
                }
                Ok(Writer::Kinesis { feed, keys })
            }
        }
    }

    /// Appends one record at a time, round-robin over the keys, until `stop`; returns how
    /// many each key got (numbered from 0, the record's data).
    pub(super) async fn run(self, stop: Arc<AtomicBool>) -> anyhow::Result<BTreeMap<String, i64>> {
        let mut next: BTreeMap<String, i64> = BTreeMap::new();
        let mut i = 0usize;
        match self {
            Writer::Outbox {
                mut client,
                table,
                keys,
            } => {
                for k in &keys {
                    next.insert(k.clone(), 0);
                }
                while !stop.load(Ordering::SeqCst) {
                    let key = &keys[i % keys.len()];
                    let seq = next[key];
                    let tx = client.transaction().await?;
                    append(&tx, &table, key, seq.to_string().as_bytes()).await?;
                    tx.commit().await?;
                    next.insert(key.clone(), seq + 1);
                    i += 1;
                    tokio::time::sleep(EVERY).await;
                }
            }
            Writer::Kinesis { feed, keys } => {
                for (k, _) in &keys {
                    next.insert(k.clone(), 0);
                }
                while !stop.load(Ordering::SeqCst) {
                    let (key, hash) = &keys[i % keys.len()];
                    let seq = next[key];
                    feed.put(key, seq.to_string().into_bytes(), Some(*hash))
                        .await
                        .with_context(|| format!("put {key}#{seq}"))?;
                    next.insert(key.clone(), seq + 1);
                    i += 1;
                    tokio::time::sleep(EVERY).await;
                }
            }
        }
        Ok(next)
    }
}

/// The stream `stream` on the Kinesis endpoint `endpoint`, reached directly (not through a
/// proxy); local endpoints take any credentials.
pub(super) async fn kinesis_feed(endpoint: &str, stream: &str) -> KinesisFeed {
    KinesisFeed::connect(&changefeed_kinesis::AwsOptions::local(endpoint), stream).await
}
