//! `changefeed feed`: fill a SQLite feed by hand (append), reshape it (split, merge) and list
//! its partitions, so a person can try `changefeed run` on records of their own and watch a
//! running fleet follow the lineage.
//!
//! `append` takes one record from `--key` and `--data` (`--count N` of them), or JSON lines on
//! stdin, one record each: `{"key":"k","data":"text"}`. `data` may also be any other JSON value
//! (stored as its compact JSON text), or given as `data_b64` (standard base64) for bytes that
//! are not text. The whole input is checked before anything is written: a bad line is an error
//! naming its line number, and nothing is appended. Each record is appended in a transaction of
//! its own to the open partition covering its key's hash.
//!
//! `list` prints the partitions in the format `changefeed lineage --partitions` reads.
//! Unknown or closed partitions, partitions that are not adjacent, a bad input line and a feed
//! without partitions are reported naming the partition, line or flag, with exit code 2.

use std::io::{IsTerminal as _, Read as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use base64::Engine as _;
use bytes::Bytes;
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
    /// Append records: one from --key and --data (--count of them), or JSON lines on stdin
    /// such as {"key":"k","data":"text"}, each to the open partition covering its key.
    Append(AppendArgs),
    #[command(flatten)]
    Other(Other),
}

/// The actions other than `append`, which need nothing but the feed.
#[derive(Debug, clap::Subcommand)]
enum Other {
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

/// Arguments of `changefeed feed append`.
#[derive(Debug, clap::Args)]
struct AppendArgs {
    /// The record's key (it decides the partition). Without --key and --data, records are read
    /// from stdin as JSON lines.
    #[arg(long, value_name = "KEY", requires = "data")]
    key: Option<String>,
    /// The record's data (UTF-8 text).
    #[arg(long, value_name = "TEXT", requires = "key")]
    data: Option<String>,
    /// Append this many records; with more than one, each record's data is TEXT-i.
    #[arg(long, value_name = "N", requires = "key",
          value_parser = clap::value_parser!(u32).range(1..))]
    count: Option<u32>,
}

/// One record to append.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NewRecord {
    key: String,
    data: Bytes,
}

/// Runs a `feed` action against `--db`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Some(db) = args.db else {
        eprintln!("error: --db PATH is required");
        return Ok(ExitCode::from(USAGE));
    };
    // Records to append are read and checked before the database is opened: bad input
    // writes nothing.
    let job = match args.action {
        Action::Append(append) => match records(&append) {
            Ok(records) => Job::Append(records),
            Err(err) => {
                eprintln!("error: {err}");
                return Ok(ExitCode::from(USAGE));
            }
        },
        Action::Other(other) => Job::Other(other),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let feed = SqliteFeed::open(&db)
            .await
            .with_context(|| format!("opening feed {}", db.display()))?;
        let result = match job {
            Job::Append(records) => append(&feed, &db, records).await?,
            Job::Other(other) => act(&feed, other).await,
        };
        let out = match result {
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

/// What to do once the feed is open.
enum Job {
    /// Append these records (read and checked already).
    Append(Vec<NewRecord>),
    Other(Other),
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

/// The records `append` was given: from the flags, or from stdin's JSON lines.
fn records(args: &AppendArgs) -> Result<Vec<NewRecord>, String> {
    if let (Some(key), Some(data)) = (&args.key, &args.data) {
        let count = args.count.unwrap_or(1);
        return Ok((0..count)
            .map(|i| NewRecord {
                key: key.clone(),
                data: Bytes::from(if count == 1 {
                    data.clone()
                } else {
                    format!("{data}-{i}")
                }),
            })
            .collect());
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(
            "give --key KEY --data TEXT, or pipe JSON lines on stdin such as {\"key\":\"k\",\"data\":\"text\"}"
                .into(),
        );
    }
    let mut input = Vec::new();
    stdin
        .lock()
        .read_to_end(&mut input)
        .map_err(|e| format!("reading stdin: {e}"))?;
    parse_lines(&input)
}

/// One stdin line as written: `data` or `data_b64`, not both.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    key: String,
    data: Option<Value>,
    data_b64: Option<String>,
}

/// Parses JSON lines (blank lines skipped) into records; an error names the line (1-based).
fn parse_lines(input: &[u8]) -> Result<Vec<NewRecord>, String> {
    let mut out = Vec::new();
    for (i, raw) in input.split(|b| *b == b'\n').enumerate() {
        let n = i + 1;
        let text = std::str::from_utf8(raw).map_err(|_| format!("stdin line {n}: not UTF-8"))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(text).map_err(|e| {
            // serde_json places the error in the one line it was given; say which line.
            let msg = e.to_string();
            let at = format!(" at line {} column {}", e.line(), e.column());
            let msg = msg.strip_suffix(&at).unwrap_or(&msg);
            format!(
                "stdin line {n}, column {}: {msg}; a line looks like {{\"key\":\"k\",\"data\":\"text\"}}",
                e.column()
            )
        })?;
        let data = match (line.data, line.data_b64) {
            (Some(Value::String(text)), None) => Bytes::from(text),
            (Some(Value::Null), None) | (None, None) => {
                return Err(format!(
                    "stdin line {n}: no \"data\" (or \"data_b64\" for bytes that are not text)"
                ))
            }
            (Some(other), None) => Bytes::from(other.to_string()),
            (None, Some(b64)) => Bytes::from(
                base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map_err(|e| format!("stdin line {n}: data_b64: not standard base64 ({e})"))?,
            ),
            (Some(_), Some(_)) => {
                return Err(format!(
                    "stdin line {n}: \"data\" and \"data_b64\" both given; give one"
                ))
            }
        };
        out.push(NewRecord {
            key: line.key,
            data,
        });
    }
    if out.is_empty() {
        return Err(
            "stdin: no records; give JSON lines such as {\"key\":\"k\",\"data\":\"text\"}, or --key and --data"
                .into(),
        );
    }
    Ok(out)
}

/// Appends `records` in order, each in a transaction of its own. A feed without open
/// partitions is refused before anything is written.
async fn append(
    feed: &SqliteFeed,
    db: &Path,
    records: Vec<NewRecord>,
) -> anyhow::Result<Result<Value, Bad>> {
    let open = feed
        .partitions()
        .await
        .with_context(|| format!("listing the partitions of {}", db.display()))?
        .iter()
        .filter(|p| !p.closed)
        .count();
    if open == 0 {
        return Ok(Err(Bad(anyhow::anyhow!(
            "the feed in {db} has no open partitions: create some first with `changefeed feed --db {db} create N`",
            db = db.display()
        ))));
    }
    let mut written = Vec::with_capacity(records.len());
    for (i, record) in records.into_iter().enumerate() {
        let (partition, continuation) = feed
            .append(&record.key, record.data)
            .await
            .with_context(|| format!("appending record {} to {}", i + 1, db.display()))?;
        written.push(json!({
            "key": record.key,
            "partition": partition.as_str(),
            "continuation": continuation.as_str(),
        }));
    }
    Ok(Ok(Value::Array(written)))
}

async fn act(feed: &SqliteFeed, action: Other) -> Result<Value, Bad> {
    Ok(match action {
        Other::Split { partition } => {
            let p = id(&partition, "PARTITION")?;
            let (l, r) = feed.split(&p).await?;
            json!({"split": p.as_str(), "children": [l.as_str(), r.as_str()]})
        }
        Other::Merge { a, b } => {
            let (a, b) = (id(&a, "A")?, id(&b, "B")?);
            let child = feed.merge(&a, &b).await?;
            json!({"merged": [a.as_str(), b.as_str()], "child": child.as_str()})
        }
        Other::Create { n } => {
            if n == 0 {
                return Err(Bad(anyhow::anyhow!("N: must be at least 1")));
            }
            json!({"created": feed.create_partitions(n).await?})
        }
        Other::List => {
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
