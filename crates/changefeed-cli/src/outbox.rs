//! `changefeed outbox`: create, fill by hand, list and reshape a PostgreSQL outbox feed.
//!
//! The outbox is named by the same `--source postgres-outbox://…?prefix=P` URL that `run`
//! reads (see [`crate::url`]). Applications append in their own transactions with
//! [`changefeed_postgres::append`]; `append` here writes test records, each in a transaction
//! of its own. Every action prints JSON. Exit codes: 0 ok; 1 the server failed; 2 bad input
//! (a bad URL, an unknown or closed partition, no partitions yet).

use std::process::ExitCode;

use anyhow::Context as _;
use changefeed::error::SourceError;
use changefeed::model::PartitionId;
use changefeed::source::FeedSource;
use changefeed_postgres::{PostgresError, PostgresOutbox};
use serde_json::{json, Value};

use crate::url::BackendUrl;
use crate::usage::UsageError;

/// Arguments of `changefeed outbox`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The outbox, e.g. postgres-outbox://USER@HOST/DB?prefix=P.
    #[arg(
        long,
        value_name = "URL",
        env = "CHANGEFEED_SOURCE",
        global = true,
        required = false
    )]
    source: Option<String>,
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Create the outbox tables and N partitions dividing the key space, if it has none.
    Create {
        /// How many partitions.
        #[arg(long, value_name = "N")]
        partitions: u32,
    },
    /// Append records, each in a transaction of its own, to the partition of their key.
    Append {
        /// The record's key (it decides the partition).
        #[arg(long, value_name = "KEY")]
        key: String,
        /// The record's data (UTF-8 text).
        #[arg(long, value_name = "TEXT")]
        data: String,
        /// Append this many records; with more than one, each record's data is TEXT-i.
        #[arg(long, value_name = "N", default_value_t = 1)]
        count: u32,
    },
    /// Print every partition as JSON (id, parents, closed, range).
    List,
    /// Replace every open partition by M new ones (a new generation).
    Repartition {
        /// How many partitions the new generation has.
        m: u32,
    },
    /// Close PARTITION and open two children dividing its key range.
    Split {
        /// The open partition to split.
        partition: String,
    },
    /// Close A and B (open, adjacent key ranges) and open one child covering both.
    Merge {
        /// One partition.
        a: String,
        /// The other, adjacent partition.
        b: String,
    },
}

/// Runs an `outbox` action against `--source`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let url = match args
        .source
        .as_deref()
        .ok_or_else(|| {
            UsageError("--source: required, e.g. postgres-outbox://USER@HOST/DB?prefix=P".into())
        })
        .and_then(|text| BackendUrl::source("--source", text))
    {
        Ok(BackendUrl::PostgresOutbox(pg)) => pg,
        Ok(_) => {
            return Ok(crate::usage::usage(&UsageError(
                "--source: outbox commands need a postgres-outbox:// URL".into(),
            )))
        }
        Err(err) => return Ok(crate::usage::usage(&err)),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let outbox = crate::url::open_outbox(&url).await?;
        match act(&outbox, args.action).await {
            Ok(out) => {
                println!("{}", serde_json::to_string_pretty(&out)?);
                Ok(ExitCode::SUCCESS)
            }
            Err(Failure::Bad(err)) => Ok(crate::usage::usage(&UsageError(err))),
            Err(Failure::Server(err)) => Err(err.into()),
        }
    })
}

/// Why an action failed: bad input (exit 2) or the server (exit 1).
enum Failure {
    Bad(String),
    Server(SourceError),
}

impl From<SourceError> for Failure {
    fn from(e: SourceError) -> Self {
        // The server's failures are exit 1; a wrong partition or an outbox without partitions
        // is the input's fault (exit 2).
        let no_partitions = matches!(
            &e,
            SourceError::Source { source, .. }
                if matches!(
                    source.downcast_ref::<PostgresError>(),
                    Some(PostgresError::NoOpenPartition { .. })
                )
        );
        match e {
            SourceError::Source { .. } if !no_partitions => Failure::Server(e),
            other => Failure::Bad(other.to_string()),
        }
    }
}

fn id(text: &str, what: &str) -> Result<PartitionId, Failure> {
    PartitionId::new(text).map_err(|e| Failure::Bad(format!("{what}: {e}")))
}

async fn act(outbox: &PostgresOutbox, action: Action) -> Result<Value, Failure> {
    Ok(match action {
        Action::Create { partitions } => {
            if partitions == 0 {
                return Err(Failure::Bad("--partitions: must be at least 1".into()));
            }
            let created = outbox.create_partitions(partitions).await?;
            let ids: Vec<String> = outbox
                .partitions()
                .await?
                .into_iter()
                .filter(|p| !p.closed)
                .map(|p| p.id.to_string())
                .collect();
            json!({"created": created, "open": ids})
        }
        Action::Append { key, data, count } => {
            let mut written = Vec::new();
            for i in 0..count {
                let data = if count == 1 {
                    data.clone()
                } else {
                    format!("{data}-{i}")
                };
                let a = outbox.append_one(&key, data.as_bytes()).await?;
                written.push(json!({
                    "key": key,
                    "partition": a.partition.as_str(),
                    "continuation": a.continuation().as_str(),
                }));
            }
            Value::Array(written)
        }
        Action::List => Value::Array(
            outbox
                .partitions()
                .await?
                .iter()
                .map(|p| {
                    let mut v = json!({
                        "id": p.id.as_str(),
                        "parents": p.parents.iter().map(PartitionId::as_str).collect::<Vec<_>>(),
                        "closed": p.closed,
                    });
                    if let Some(r) = p.key_range {
                        v["range"] = json!([r.start.to_string(), r.end.to_string()]);
                    }
                    v
                })
                .collect(),
        ),
        Action::Repartition { m } => {
            let ids = outbox.repartition(m).await?;
            json!({"open": ids.iter().map(PartitionId::as_str).collect::<Vec<_>>()})
        }
        Action::Split { partition } => {
            let p = id(&partition, "PARTITION")?;
            let (l, r) = outbox.split(&p).await?;
            json!({"split": p.as_str(), "children": [l.as_str(), r.as_str()]})
        }
        Action::Merge { a, b } => {
            let (a, b) = (id(&a, "A")?, id(&b, "B")?);
            let child = outbox.merge(&a, &b).await?;
            json!({"merged": [a.as_str(), b.as_str()], "child": child.as_str()})
        }
    })
}
