//! `changefeed lineage`: which leases the partition sync would create, from JSON files.
//!
//! Reads the source's partitions and the existing leases, runs the pure rules of
//! [`changefeed::lineage::plan`] for `--position`, and prints `{"create": [{"partition": "6",
//! "start": "beginning"}]}`. It touches no store and no source. Bad input, and partition data
//! the rules refuse (a cycle, a self-parent, an unknown parent under `--missing-parents
//! error`), are reported naming the partition or field, with exit code 2.
//!
//! `--partitions` file: `[{"id": "0", "parents": [], "closed": true}, …]`; `parents`
//! defaults to `[]`, `closed` to false; optional `"range": [start, end]` (numbers or decimal
//! strings) and `"closed_at"` (RFC 3339 text or milliseconds since the epoch; used for an
//! `at:` position when there are no leases).
//!
//! `--leases` file: `[{"partition": "4", "state": "owned"}, …]`; `state` is `available`,
//! `owned` or `finished`; optional `"checkpoint"` (a continuation).
//!
//! `--child-start parent-continuation` plans as the sync does for a source whose children
//! continue from their parent (Cosmos DB): a child of one finished parent starts at
//! `after:<the parent's checkpoint>` (its own start, `beginning` in this file format, when it
//! has none); a merge child at the beginning.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use changefeed::lineage::{self, ChildStart, Input, MissingParents};
use changefeed::model::{
    Continuation, GroupName, HostName, KeyRange, Lease, LeaseKey, LeaseState, Partition,
    PartitionId, Position, Timestamp,
};
use serde_json::{json, Map, Value};

/// Exit code for bad input.
const USAGE: u8 = 2;

/// How `--missing-parents` reads a parent the partition list lacks.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Missing {
    /// Trimmed by retention: counts as finished (KCL's behaviour).
    Finished,
    /// Corrupt data: the child is refused.
    Error,
}

/// How `--child-start` starts a child of finished parents (lineage rule 4).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Children {
    /// At the child's beginning: it holds only what was written after the split (Kinesis,
    /// the in-memory and SQLite feeds).
    Beginning,
    /// A child of one parent at the parent's last checkpoint: it also holds its keys' changes
    /// from before the split (Cosmos DB, `FeedSource::child_start`).
    ParentContinuation,
}

/// Arguments of `changefeed lineage`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The source's partitions: a JSON array (`-` reads standard input).
    #[arg(long, value_name = "P.json")]
    partitions: PathBuf,
    /// The existing leases: a JSON array.
    #[arg(long, value_name = "L.json")]
    leases: PathBuf,
    /// The group's start position: `beginning`, `now`, or `at:RFC3339` (or `at:MILLIS`).
    #[arg(long, value_name = "POSITION")]
    position: String,
    /// How to read a parent the partition list lacks.
    #[arg(long, value_enum, default_value = "finished")]
    missing_parents: Missing,
    /// Where a child of finished parents starts: `parent-continuation` is how a Cosmos DB
    /// source's sync plans (`cosmos://` sources), `beginning` every other source's.
    #[arg(long, value_enum, default_value = "beginning")]
    child_start: Children,
}

/// Prints the leases the rules would create. Bad input exits with code 2.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match plan(&args) {
        Ok(out) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&out).context("encoding the plan")?
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            Ok(ExitCode::from(USAGE))
        }
    }
}

fn plan(args: &Args) -> anyhow::Result<Value> {
    let start = parse_position(&args.position).context("--position")?;
    let (partitions, closed_at) = parse_partitions(&read_json(&args.partitions, "partitions")?)
        .with_context(|| format!("--partitions {}", args.partitions.display()))?;
    let leases = parse_leases(&read_json(&args.leases, "leases")?)
        .with_context(|| format!("--leases {}", args.leases.display()))?;
    let missing = match args.missing_parents {
        Missing::Finished => MissingParents::Finished,
        Missing::Error => MissingParents::Error,
    };
    let child_start = match args.child_start {
        Children::Beginning => ChildStart::Beginning,
        Children::ParentContinuation => ChildStart::ParentContinuation,
    };
    let plan = lineage::plan(
        &Input::new(&partitions, &leases, &start)
            .with_closed_at(closed_at)
            .with_missing_parents(missing)
            .with_child_start(child_start),
    );
    if !plan.errors.is_empty() {
        let text: Vec<String> = plan.errors.iter().map(ToString::to_string).collect();
        bail!("--partitions: {}", text.join("; "));
    }
    let create: Vec<Value> = plan
        .create
        .iter()
        .map(|n| json!({"partition": n.partition.as_str(), "start": show_position(&n.start)}))
        .collect();
    Ok(json!({ "create": create }))
}

fn read_json(path: &Path, what: &str) -> anyhow::Result<Value> {
    let shown = path.display().to_string();
    let text = if shown == "-" {
        std::io::read_to_string(std::io::stdin()).with_context(|| format!("reading {what}"))?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {what} file {shown}"))?
    };
    serde_json::from_str(&text).with_context(|| format!("{what} file {shown}: invalid JSON"))
}

/// `beginning`, `now`, `at:RFC3339` or `at:MILLIS`.
fn parse_position(text: &str) -> anyhow::Result<Position> {
    match text {
        "beginning" => Ok(Position::Beginning),
        "now" => Ok(Position::Now),
        _ => match text.strip_prefix("at:") {
            Some(t) => Ok(Position::AtTime(parse_time(t)?)),
            None => bail!("\"{text}\": expected beginning, now or at:RFC3339"),
        },
    }
}

fn parse_time(text: &str) -> anyhow::Result<Timestamp> {
    if let Ok(ms) = text.parse::<i64>() {
        return Ok(Timestamp(ms));
    }
    let t = humantime::parse_rfc3339_weak(text)
        .map_err(|e| anyhow!("\"{text}\": expected an RFC 3339 time or milliseconds: {e}"))?;
    let ms = t
        .duration_since(UNIX_EPOCH)
        .map_err(|_| anyhow!("\"{text}\": before 1970"))?
        .as_millis();
    Ok(Timestamp(i64::try_from(ms).map_err(|_| {
        anyhow!("\"{text}\": too far in the future")
    })?))
}

fn show_position(p: &Position) -> String {
    match p {
        Position::AtTime(t) if t.0 >= 0 => {
            let at = UNIX_EPOCH + Duration::from_millis(t.0.unsigned_abs());
            format!("at:{}", humantime::format_rfc3339_millis(at))
        }
        other => other.to_string(),
    }
}

type Parsed = (Vec<Partition>, BTreeMap<PartitionId, Timestamp>);

fn parse_partitions(json: &Value) -> anyhow::Result<Parsed> {
    let items = json
        .as_array()
        .ok_or_else(|| anyhow!("expected an array of partitions, got {}", kind(json)))?;
    let mut partitions = Vec::with_capacity(items.len());
    let mut closed_at = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        let path = format!("[{i}]");
        let obj = item
            .as_object()
            .ok_or_else(|| anyhow!("{path}: expected a partition object, got {}", kind(item)))?;
        let id = partition_id(
            obj.get("id").ok_or_else(|| anyhow!("{path}.id: missing"))?,
            &format!("{path}.id"),
        )?;
        if !seen.insert(id.clone()) {
            bail!("{path}.id: partition {id} is listed twice");
        }
        let path = format!("{path} (partition {id})");
        let parents = match obj.get("parents") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ps)) => ps
                .iter()
                .enumerate()
                .map(|(k, p)| partition_id(p, &format!("{path}.parents[{k}]")))
                .collect::<anyhow::Result<_>>()?,
            Some(other) => bail!(
                "{path}.parents: expected an array of ids, got {}",
                kind(other)
            ),
        };
        let closed = match obj.get("closed") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => bail!("{path}.closed: expected true or false, got {}", kind(other)),
        };
        let key_range = match obj.get("range") {
            None | Some(Value::Null) => None,
            Some(Value::Array(r)) if r.len() == 2 => {
                let start = bound(&r[0], &format!("{path}.range[0]"))?;
                let end = bound(&r[1], &format!("{path}.range[1]"))?;
                if start > end {
                    bail!("{path}.range: start {start} is after end {end}");
                }
                Some(KeyRange { start, end })
            }
            Some(other) => bail!("{path}.range: expected [start, end], got {}", kind(other)),
        };
        match obj.get("closed_at") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) => {
                let ms = n
                    .as_i64()
                    .ok_or_else(|| anyhow!("{path}.closed_at: expected whole milliseconds"))?;
                closed_at.insert(id.clone(), Timestamp(ms));
            }
            Some(Value::String(s)) => {
                let t = parse_time(s).with_context(|| format!("{path}.closed_at"))?;
                closed_at.insert(id.clone(), t);
            }
            Some(other) => bail!(
                "{path}.closed_at: expected an RFC 3339 time or milliseconds, got {}",
                kind(other)
            ),
        }
        partitions.push(Partition {
            id,
            parents,
            closed,
            key_range,
        });
    }
    Ok((partitions, closed_at))
}

fn parse_leases(json: &Value) -> anyhow::Result<Vec<Lease>> {
    let items = json
        .as_array()
        .ok_or_else(|| anyhow!("expected an array of leases, got {}", kind(json)))?;
    let group = GroupName::new("lineage").context("group name")?;
    let owner = HostName::new("owner").context("host name")?;
    let mut seen = BTreeSet::new();
    let mut leases = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let path = format!("[{i}]");
        let obj: &Map<String, Value> = item
            .as_object()
            .ok_or_else(|| anyhow!("{path}: expected a lease object, got {}", kind(item)))?;
        let partition = partition_id(
            obj.get("partition")
                .ok_or_else(|| anyhow!("{path}.partition: missing"))?,
            &format!("{path}.partition"),
        )?;
        if !seen.insert(partition.clone()) {
            bail!("{path}.partition: partition {partition} has two leases");
        }
        let path = format!("{path} (partition {partition})");
        let state: LeaseState = match obj.get("state") {
            Some(Value::String(s)) => s.parse().map_err(|e| anyhow!("{path}.state: {e}"))?,
            None => bail!("{path}.state: missing (available, owned or finished)"),
            Some(other) => bail!(
                "{path}.state: expected available, owned or finished, got {}",
                kind(other)
            ),
        };
        let mut lease = Lease::new(LeaseKey::new(group.clone(), partition), Position::Beginning);
        lease.state = state;
        if state == LeaseState::Owned {
            lease.owner = Some(owner.clone());
        }
        lease.continuation = match obj.get("checkpoint") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() => Some(Continuation::new(s.as_str())),
            Some(other) => bail!(
                "{path}.checkpoint: expected a non-empty string, got {}",
                kind(other)
            ),
        };
        leases.push(lease);
    }
    Ok(leases)
}

fn partition_id(v: &Value, path: &str) -> anyhow::Result<PartitionId> {
    match v {
        Value::String(s) => PartitionId::new(s.as_str()).map_err(|e| anyhow!("{path}: {e}")),
        other => bail!(
            "{path}: expected a partition id string, got {}",
            kind(other)
        ),
    }
}

fn bound(v: &Value, path: &str) -> anyhow::Result<u128> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .map(u128::from)
            .ok_or_else(|| anyhow!("{path}: expected a non-negative whole number")),
        Value::String(s) => s
            .parse()
            .map_err(|e| anyhow!("{path}: expected a decimal u128: {e}")),
        other => bail!("{path}: expected a number, got {}", kind(other)),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
