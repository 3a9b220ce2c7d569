//! `changefeed feed`: reshape a SQLite feed by hand (split, merge) and list its partitions,
//! so a person can watch a running fleet follow the lineage.
//!
//! `list` prints the partitions in the format `changefeed lineage --partitions` reads.
//! Unknown or closed partitions and partitions that are not adjacent are reported naming the
//! partition, with exit code 2.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use changefeed::error::SourceError;
use changefeed::model::PartitionId;
use changefeed::source::FeedSource;
use changefeed_sqlite::SqliteFeed;
use serde_json::{json, Value};

/// Exit code for bad input.
const USAGE: u8 = 2;

/// Arguments of `changefeed feed`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The SQLite database holding the feed.
    #[arg(long, value_name = "PATH", global = true, required = false)]
    db: Option<PathBuf>,
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
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
    /// Print every partition as JSON (id, parents, closed, range).
    List,
    /// Create N open partitions dividing the key space, if the feed has none.
    Create {
        /// How many partitions.
        n: u32,
    },
}

/// Runs a `feed` action against `--db`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Some(db) = args.db else {
        eprintln!("error: --db PATH is required");
        return Ok(ExitCode::from(USAGE));
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let feed = SqliteFeed::open(&db)
            .await
            .with_context(|| format!("opening feed {}", db.display()))?;
        let out = match act(&feed, args.action).await {
            Ok(out) => out,
            Err(Bad(err)) => {
                eprintln!("error: {err:#}");
                return Ok(ExitCode::from(USAGE));
            }
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        Ok(ExitCode::SUCCESS)
    })
}

/// A refused action (exit code 2).
struct Bad(anyhow::Error);

impl From<SourceError> for Bad {
    fn from(e: SourceError) -> Self {
        Bad(e.into())
    }
}

fn id(text: &str, what: &str) -> Result<PartitionId, Bad> {
    PartitionId::new(text).map_err(|e| Bad(anyhow::anyhow!("{what}: {e}")))
}

async fn act(feed: &SqliteFeed, action: Action) -> Result<Value, Bad> {
    Ok(match action {
        Action::Split { partition } => {
            let p = id(&partition, "PARTITION")?;
            let (l, r) = feed.split(&p).await?;
            json!({"split": p.as_str(), "children": [l.as_str(), r.as_str()]})
        }
        Action::Merge { a, b } => {
            let (a, b) = (id(&a, "A")?, id(&b, "B")?);
            let child = feed.merge(&a, &b).await?;
            json!({"merged": [a.as_str(), b.as_str()], "child": child.as_str()})
        }
        Action::Create { n } => {
            if n == 0 {
                return Err(Bad(anyhow::anyhow!("N: must be at least 1")));
            }
            json!({"created": feed.create_partitions(n).await?})
        }
        Action::List => {
            let partitions = feed.partitions().await?;
            Value::Array(
                partitions
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
            )
        }
    })
}
