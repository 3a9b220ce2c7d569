//! Operator commands against a lease store: `status`, `hosts`, `lag`, `reset` and `release`.
//!
//! Each opens the store (and, where needed, the source) from its URL ([`crate::url`]), reads
//! or writes by compare-and-swap, and prints a table (or JSON with `--json`). A malformed lease
//! row never hides the others: it is shown as an error line naming its key. Heartbeat ages are
//! computed from the writer's own wall clock and are for display only: liveness is judged by a
//! heartbeat's version moving, never by comparing clocks (design rule 2).
//!
//! Exit codes: 0 ok; 1 operational error (store failure, a refused or conflicting write);
//! 2 usage error (bad URL, name or value).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context as _};
use changefeed::admin::{self, ResetError, Watched};
use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, Heartbeat, HostLimits, HostName, HostReport, Lease, LeaseKey,
    LeaseState, PartitionId, Position, Timestamp,
};
use changefeed::source::{FeedSource, LeasedPartition};
use changefeed::{LeaseError, SourceError};
use serde::Serialize;
use serde_json::json;

use crate::url::BackendUrl;
use crate::usage::{parse_duration, UsageError};

/// The store and group every operator command names.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The lease store: sqlite://PATH, postgres://USER@HOST/DB[?prefix=P],
    /// dynamodb://TABLE[?endpoint=URL&region=R] or cosmos://ACCOUNT/DATABASE/CONTAINER.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_STORE")]
    pub(crate) store: String,
    /// The group.
    #[arg(
        long,
        value_name = "NAME",
        env = "CHANGEFEED_GROUP",
        default_value = "default"
    )]
    pub(crate) group: String,
}

/// Arguments of `changefeed status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    target: Target,
    /// The feed source, to show each lease's lag (records after its checkpoint).
    #[arg(long, value_name = "URL", env = "CHANGEFEED_SOURCE")]
    source: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `changefeed hosts`.
#[derive(Debug, clap::Args)]
pub struct HostsArgs {
    #[command(flatten)]
    target: Target,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `changefeed lag`.
#[derive(Debug, clap::Args)]
pub struct LagArgs {
    #[command(flatten)]
    target: Target,
    /// The feed source, e.g. sqlite://feed.db or postgres-outbox://USER@HOST/DB?prefix=P.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_SOURCE")]
    source: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `changefeed reset`.
#[derive(Debug, clap::Args)]
pub struct ResetArgs {
    #[command(flatten)]
    target: Target,
    /// The partition whose checkpoint moves.
    #[arg(long, value_name = "ID")]
    partition: String,
    /// Where it moves: beginning, now, at:MILLIS, or a continuation (as `status` shows it;
    /// needs --source).
    #[arg(long, value_name = "POSITION")]
    to: String,
    /// Reset even while a host owns the lease: also clears the owner, so the worker stops
    /// and a host takes the lease again from the new position. Also replaces a row that
    /// cannot be read (needs --source).
    #[arg(long)]
    force: bool,
    /// The feed source: checks a continuation by opening a reader at it, and gives a
    /// rewritten malformed row its partition's parents and key range.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_SOURCE")]
    source: Option<String>,
}

/// Arguments of `changefeed release`.
#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    target: Target,
    /// The (dead) host whose leases are released and whose heartbeat row is removed.
    #[arg(long, value_name = "NAME")]
    host: String,
    /// How long to watch the host's heartbeat first; if it moves, the host is alive and the
    /// command refuses (unless --force).
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    wait: String,
    /// Release even if the heartbeat moves (the live host will stop: its row is gone).
    #[arg(long)]
    force: bool,
}

/// Runs an async operator command on a small runtime, mapping a [`UsageError`] to exit 2 and
/// any other error to exit 1.
pub(crate) fn block_on<F>(f: F) -> anyhow::Result<ExitCode>
where
    F: std::future::Future<Output = anyhow::Result<ExitCode>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    match runtime.block_on(f) {
        Ok(code) => Ok(code),
        Err(err) => match err.downcast_ref::<UsageError>() {
            Some(usage) => Ok(crate::usage::usage(usage)),
            None => {
                eprintln!("error: {}", crate::error_text(&err));
                Ok(ExitCode::from(1))
            }
        },
    }
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(msg.into()))
}

impl Target {
    /// The group named, checked (a usage error names `--group`).
    pub(crate) fn group_name(&self) -> Result<GroupName, UsageError> {
        GroupName::new(self.group.as_str()).map_err(|e| UsageError(format!("--group: {e}")))
    }

    /// The store named, parsed (a usage error names `--store`).
    pub(crate) fn store_url(&self) -> Result<BackendUrl, UsageError> {
        BackendUrl::store("--store", &self.store)
    }

    /// Opens the store and checks the group name (a usage error names the flag).
    pub(crate) async fn open(&self) -> anyhow::Result<(Arc<dyn LeaseStore>, GroupName)> {
        let group = self.group_name()?;
        let store = self.store_url()?.open_store().await?;
        Ok((store, group))
    }
}

/// Opens the source `--source` names.
pub(crate) async fn open_source(url: &str) -> anyhow::Result<Arc<dyn FeedSource>> {
    BackendUrl::source("--source", url)?.open_source().await
}

/// Milliseconds from `then` to `now`, by the writer's and this machine's wall clocks.
fn age_ms(now: Timestamp, then: Timestamp) -> i64 {
    now.millis().saturating_sub(then.millis())
}

fn show_age(ms: i64) -> String {
    if ms < 0 {
        format!("in {:.1}s (clock ahead)", -ms as f64 / 1000.0)
    } else {
        format!("{:.1}s ago", ms as f64 / 1000.0)
    }
}

/// Lag of one lease: records after its checkpoint, where the source can tell (the library's
/// estimator, [`changefeed::lag::lease_lag`]).
async fn lease_lag(source: &dyn FeedSource, lease: &Lease) -> Result<Option<u64>, String> {
    changefeed::lag::lease_lag(source, lease)
        .await
        .map_err(|e| e.to_string())
}

/// Prints rows as a left-aligned table with a header.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let _ = write!(text, "{cell:<w$}");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

fn opt(s: Option<impl ToString>) -> String {
    s.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

/// `changefeed status`: the lease table.
pub fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    block_on(async move {
        let (store, group) = args.target.open().await?;
        let source = match &args.source {
            Some(url) => Some(open_source(url).await?),
            None => None,
        };
        let listing = store.list(&group).await.context("listing leases")?;
        let membership = store
            .membership(&group)
            .await
            .context("reading heartbeats")?;
        let hosts: BTreeMap<&HostName, &Heartbeat> =
            membership.hosts.iter().map(|h| (&h.host, h)).collect();
        let now = SystemClock.wall();
        let mut rows = Vec::new();
        let mut json_leases = Vec::new();
        for lease in &listing.leases {
            let lag = match &source {
                Some(s) => Some(lease_lag(s.as_ref(), lease).await),
                None => None,
            };
            // Lag in time: one more small read of the source per lease (one row, or one
            // GetRecords), only with --source.
            let age = match &source {
                Some(s) => Some(
                    changefeed::lag::lease_age_ms(s.as_ref(), lease, now)
                        .await
                        .map_err(|e| e.to_string()),
                ),
                None => None,
            };
            let heartbeat = lease.owner.as_ref().map(|o| hosts.get(o).copied());
            let hb_text = match heartbeat {
                None => "-".to_string(),
                Some(None) => "no heartbeat (dead)".to_string(),
                Some(Some(h)) => show_age(age_ms(now, h.written_at)),
            };
            let lag_text = match &lag {
                None => "-".to_string(),
                Some(Ok(Some(n))) => n.to_string(),
                Some(Ok(None)) => "?".to_string(),
                Some(Err(e)) => format!("error: {e}"),
            };
            let state = match &lease.next_owner {
                Some(n) => format!("{} (hand-off to {n})", lease.state),
                None => lease.state.to_string(),
            };
            rows.push(vec![
                lease.key.partition.to_string(),
                opt(lease.owner.as_ref()),
                state,
                match &lease.continuation {
                    Some(c) => c.to_string(),
                    None => format!("({})", lease.start),
                },
                lag_text,
                match &age {
                    None | Some(Err(_)) => "-".to_string(),
                    Some(Ok(ms)) => show_seconds(*ms),
                },
                hb_text,
            ]);
            json_leases.push(json!({
                "partition": lease.key.partition.as_str(),
                "owner": lease.owner.as_ref().map(HostName::as_str),
                "next_owner": lease.next_owner.as_ref().map(HostName::as_str),
                "state": lease.state.as_str(),
                "continuation": lease.continuation.as_ref().map(Continuation::as_str),
                "start": lease.start.to_string(),
                "parents": lease.parents,
                "version": lease.version.0,
                "lag": match &lag { Some(Ok(n)) => json!(n), _ => json!(null) },
                "lag_error": match &lag { Some(Err(e)) => json!(e), _ => json!(null) },
                "lag_seconds": match &age {
                    Some(Ok(Some(ms))) => json!(*ms as f64 / 1000.0),
                    _ => json!(null),
                },
                "owner_heartbeat_age_ms": match heartbeat {
                    Some(Some(h)) => json!(age_ms(now, h.written_at)),
                    _ => json!(null),
                },
                "owner_has_heartbeat": heartbeat.map(|h| h.is_some()),
            }));
        }
        if args.json {
            let errors: Vec<_> = listing
                .malformed
                .iter()
                .map(|e| json!({"key": malformed_key(e), "error": e.to_string()}))
                .collect();
            let out = json!({"group": group.as_str(), "leases": json_leases, "errors": errors});
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print!(
                "{}",
                table(
                    &[
                        "PARTITION",
                        "OWNER",
                        "STATE",
                        "CHECKPOINT",
                        "LAG",
                        "SECONDS",
                        "OWNER HEARTBEAT"
                    ],
                    &rows
                )
            );
            for bad in &listing.malformed {
                println!("error: {bad}");
            }
            if listing.leases.is_empty() && listing.malformed.is_empty() {
                println!("(no leases in group {group})");
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn malformed_key(err: &LeaseError) -> Option<&str> {
    match err {
        LeaseError::Malformed { key, .. } => Some(key),
        _ => None,
    }
}

/// The partition part of a malformed row's key (`group/partition`), as stored.
fn malformed_partition(err: &LeaseError, group: &GroupName) -> String {
    let key = malformed_key(err).unwrap_or("?");
    key.strip_prefix(group.as_str())
        .and_then(|k| k.strip_prefix('/'))
        .unwrap_or(key)
        .to_string()
}

/// A host's published lease limits for display: `2..8`, `min 2`, `max 8`.
fn show_limits(limits: HostLimits) -> String {
    match (limits.min_leases, limits.max_leases) {
        (Some(min), Some(max)) => format!("{min}..{max}"),
        (Some(min), None) => format!("min {min}"),
        (None, Some(max)) => format!("max {max}"),
        (None, None) => "-".into(),
    }
}

/// `changefeed hosts`: the heartbeat rows, how many leases each host owns, and what each
/// publishes about itself (capacity, lease limits, and with `--json` its leases' loads).
pub fn hosts(args: HostsArgs) -> anyhow::Result<ExitCode> {
    block_on(async move {
        let (store, group) = args.target.open().await?;
        let membership = store
            .membership(&group)
            .await
            .context("reading heartbeats")?;
        let listing = store.list(&group).await.context("listing leases")?;
        let mut counts: BTreeMap<&HostName, usize> = BTreeMap::new();
        for lease in &listing.leases {
            if let (LeaseState::Owned, Some(o)) = (lease.state, &lease.owner) {
                *counts.entry(o).or_default() += 1;
            }
        }
        let now = SystemClock.wall();
        let mut rows = Vec::new();
        let mut json_hosts = Vec::new();
        for h in &membership.hosts {
            let n = counts.remove(&h.host).unwrap_or(0);
            let age = age_ms(now, h.written_at);
            // What the host publishes about itself; an unreadable report shows as none.
            let report = h.report.as_deref().and_then(|t| HostReport::parse(t).ok());
            let limits = report.as_ref().and_then(HostReport::limits);
            rows.push(vec![
                h.host.to_string(),
                n.to_string(),
                show_age(age),
                h.version.to_string(),
                h.incarnation.to_string(),
                opt(report.as_ref().map(|r| r.capacity)),
                limits.map_or_else(|| "-".into(), show_limits),
            ]);
            let load: BTreeMap<&str, serde_json::Value> = report
                .iter()
                .flat_map(|r| &r.leases)
                .map(|(p, l)| {
                    let load = json!({
                        "records_per_second": l.records_per_second,
                        "bytes_per_second": l.bytes_per_second,
                        "busy": l.busy,
                    });
                    (p.as_str(), load)
                })
                .collect();
            json_hosts.push(json!({
                "host": h.host.as_str(), "leases": n, "heartbeat_age_ms": age,
                "heartbeat_version": h.version.0, "incarnation": h.incarnation,
                "capacity": report.as_ref().map(|r| r.capacity),
                "min_leases": limits.and_then(|l| l.min_leases),
                "max_leases": limits.and_then(|l| l.max_leases),
                "load": load,
            }));
        }
        // Owners without a heartbeat row: dead hosts whose leases nobody has taken yet.
        for (host, n) in counts {
            rows.push(vec![
                host.to_string(),
                n.to_string(),
                "no heartbeat (dead)".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
            json_hosts.push(json!({
                "host": host.as_str(), "leases": n, "heartbeat_age_ms": null,
                "heartbeat_version": null, "incarnation": null, "capacity": null,
                "min_leases": null, "max_leases": null, "load": {},
            }));
        }
        if args.json {
            let out = json!({
                "group": group.as_str(),
                "change_counter": membership.change_counter,
                "hosts": json_hosts,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print!(
                "{}",
                table(
                    &[
                        "HOST",
                        "LEASES",
                        "HEARTBEAT WRITTEN",
                        "VERSION",
                        "INCARNATION",
                        "CAPACITY",
                        "LIMITS"
                    ],
                    &rows
                )
            );
            if rows.is_empty() {
                println!("(no hosts in group {group})");
            }
        }
        for bad in &listing.malformed {
            eprintln!("warning: {bad}");
        }
        Ok(ExitCode::SUCCESS)
    })
}

#[derive(Serialize)]
struct LagRow {
    partition: String,
    owner: Option<String>,
    /// False for a partition the source lists that has no lease yet.
    leased: bool,
    checkpoint: Option<String>,
    lag: Option<u64>,
    /// Lag in time: how old the first unread record is, in seconds (0 when caught up).
    seconds: Option<f64>,
    error: Option<String>,
}

/// Milliseconds as seconds with one decimal, for display.
fn show_seconds(ms: Option<u64>) -> String {
    match ms {
        Some(ms) => format!("{:.1}", ms as f64 / 1000.0),
        None => "?".into(),
    }
}

/// `changefeed lag`: records after each lease's checkpoint and how old the first of them is,
/// per partition (partitions without a lease included) and in total.
pub fn lag(args: LagArgs) -> anyhow::Result<ExitCode> {
    block_on(async move {
        let (store, group) = args.target.open().await?;
        let source = open_source(&args.source).await?;
        let now = SystemClock.wall();
        let report = changefeed::lag::estimate_at(store.as_ref(), source.as_ref(), &group, now)
            .await
            .context("listing leases")?;
        let total = report.total();
        let max_ms = report.max_age_ms();
        let mut unknown = report.unknown();
        let mut out = Vec::new();
        for l in &report.leases {
            let error = match (&l.records, &l.age_ms) {
                (Err(e), _) | (Ok(_), Err(e)) => Some(e.to_string()),
                _ => None,
            };
            out.push(LagRow {
                partition: l.partition.to_string(),
                owner: l.owner.as_ref().map(ToString::to_string),
                leased: l.leased,
                checkpoint: l.checkpoint.as_ref().map(ToString::to_string),
                lag: l.records.as_ref().ok().copied().flatten(),
                seconds: l
                    .age_ms
                    .as_ref()
                    .ok()
                    .copied()
                    .flatten()
                    .map(|ms| ms as f64 / 1000.0),
                error,
            });
        }
        // A row that cannot be read still stands for a partition whose lag nobody knows: it
        // counts as unknown, so the total is never silently missing a partition.
        for bad in &report.malformed {
            unknown += 1;
            out.push(LagRow {
                partition: malformed_partition(bad, &group),
                owner: None,
                leased: true,
                checkpoint: None,
                lag: None,
                seconds: None,
                error: Some(bad.to_string()),
            });
        }
        let mut errors: Vec<String> = report.malformed.iter().map(ToString::to_string).collect();
        if let Some(e) = &report.partitions_error {
            errors.push(format!("partitions without a lease are not counted: {e}"));
        }
        if args.json {
            let j = json!({"group": group.as_str(), "partitions": out, "total": total,
                           "max_seconds": max_ms.map(|ms| ms as f64 / 1000.0),
                           "unknown": unknown, "errors": errors});
            println!("{}", serde_json::to_string_pretty(&j)?);
        } else {
            let rows: Vec<Vec<String>> = out
                .iter()
                .map(|r| {
                    vec![
                        r.partition.clone(),
                        match (&r.owner, r.leased) {
                            (_, false) => "(no lease)".into(),
                            (o, true) => opt(o.as_ref()),
                        },
                        match (&r.checkpoint, r.leased) {
                            (Some(c), _) => c.clone(),
                            (None, false) => "(beginning)".into(),
                            (None, true) => "-".into(),
                        },
                        match (&r.lag, &r.error) {
                            (_, Some(e)) => format!("error: {e}"),
                            (Some(n), None) => n.to_string(),
                            (None, None) => "?".into(),
                        },
                        match (&r.seconds, &r.error) {
                            (_, Some(_)) => "-".into(),
                            (s, None) => show_seconds(s.map(|s| (s * 1000.0).round() as u64)),
                        },
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &["PARTITION", "OWNER", "CHECKPOINT", "LAG", "SECONDS"],
                    &rows
                )
            );
            for e in report.partitions_error.iter() {
                eprintln!("warning: partitions without a lease are not counted: {e}");
            }
            let note = if unknown > 0 {
                format!(" ({unknown} partitions unknown)")
            } else {
                String::new()
            };
            println!("total {total}, max {}s{note}", show_seconds(max_ms));
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Where `reset --to` moves a lease.
fn parse_target(text: &str) -> Result<(Option<Continuation>, Position), UsageError> {
    match text {
        "beginning" => Ok((None, Position::Beginning)),
        "now" => Ok((None, Position::Now)),
        t if t.starts_with("at:") => {
            let p: Position = t.parse().map_err(|e| UsageError(format!("--to: {e}")))?;
            Ok((None, p))
        }
        t => {
            let token = t.strip_prefix("after:").unwrap_or(t);
            if token.is_empty() || token.trim() != token {
                return Err(UsageError(format!(
                    "--to: \"{}\" must be beginning, now, at:MILLIS or a continuation",
                    t.escape_debug()
                )));
            }
            Ok((Some(Continuation::new(token)), Position::Beginning))
        }
    }
}

/// `changefeed reset`: moves one lease's checkpoint, by compare-and-swap.
pub fn reset(args: ResetArgs) -> anyhow::Result<ExitCode> {
    block_on(async move {
        // Everything that can be judged without the store first: a usage error writes nothing.
        let store_url = BackendUrl::store("--store", &args.target.store)?;
        let group = GroupName::new(args.target.group.as_str())
            .map_err(|e| usage(format!("--group: {e}")))?;
        let partition = PartitionId::new(args.partition.as_str())
            .map_err(|e| usage(format!("--partition: {e}")))?;
        let (continuation, start) = parse_target(&args.to)?;
        if continuation.is_some() && args.source.is_none() {
            // Only the source knows what its continuations look like: one written unchecked
            // could stop the partition for good when a host opens it.
            return Err(usage(format!(
                "--to: \"{}\" is a continuation, which only the source can check: pass --source (or set CHANGEFEED_SOURCE), or move to beginning, now or at:MILLIS",
                args.to.escape_debug()
            )));
        }
        let source = match &args.source {
            Some(url) => Some(open_source(url).await?),
            None => None,
        };
        if let (Some(source), Some(c)) = (&source, &continuation) {
            check_continuation(source.as_ref(), &partition, c).await?;
        }
        let store = store_url.open_store().await?;
        let key = LeaseKey::new(group, partition.clone());
        let (lease, stored) =
            match admin::reset_lease(store.as_ref(), &key, continuation.clone(), start.clone(), args.force).await {
                Ok(done) => done,
                Err(ResetError::Malformed { reason, .. }) => {
                    let target = Rewrite {
                        store: store.as_ref(),
                        store_url: &store_url,
                        source: source.as_deref(),
                        key: &key,
                        continuation,
                        start,
                    };
                    return rewrite_malformed(target, &reason, args.force).await;
                }
                Err(ResetError::Owned { owner, .. }) => bail!(
                    "lease {key} is owned by {owner}; stop that host first, or pass --force to clear the owner too (its worker stops and the lease is taken again from the new position)"
                ),
                Err(ResetError::Store(e @ LeaseError::Conflict { .. })) => bail!(
                    "{e}: the lease changed while resetting it; check `status` and run again"
                ),
                Err(other) => return Err(other.into()),
            };
        println!(
            "lease {key}: checkpoint {} -> {} (start {}), state {}{} ({})",
            opt(lease.continuation.as_ref()),
            opt(stored.continuation.as_ref()),
            stored.start,
            stored.state,
            match &lease.owner {
                Some(o) if args.force => format!(", owner {o} cleared"),
                _ => String::new(),
            },
            stored.version
        );
        Ok(ExitCode::SUCCESS)
    })
}

/// Checks `continuation` by opening a reader of `partition` at it: a token the source refuses
/// (or a partition it does not have) is a usage error; the source failing is not.
async fn check_continuation(
    source: &dyn FeedSource,
    partition: &PartitionId,
    continuation: &Continuation,
) -> anyhow::Result<()> {
    match source
        .open(partition, &Position::Continuation(continuation.clone()))
        .await
    {
        Ok(_) => Ok(()),
        Err(e @ SourceError::Source { .. }) => {
            Err(anyhow::Error::new(e).context("checking --to against the source"))
        }
        Err(refused) => Err(usage(format!("--to: {refused}"))),
    }
}

/// Where a malformed lease row is rewritten to.
struct Rewrite<'a> {
    store: &'a dyn LeaseStore,
    store_url: &'a BackendUrl,
    source: Option<&'a dyn FeedSource>,
    key: &'a LeaseKey,
    continuation: Option<Continuation>,
    start: Position,
}

/// `reset` of a row that cannot be read: with `--force`, replaces it by a new lease at the
/// position asked for, with the partition's parents and key range as the source lists them
/// (what the leader's partition sync would have written). The old row is deleted at its
/// version, so a row that changes meanwhile is not lost unseen, then the new one created.
async fn rewrite_malformed(to: Rewrite<'_>, reason: &str, force: bool) -> anyhow::Result<ExitCode> {
    let key = to.key;
    if !force {
        bail!(
            "lease {key}: malformed row: {reason}; pass --force to replace it with a new lease at the position given (parents and key range from --source)"
        );
    }
    let Some(source) = to.source else {
        return Err(usage(format!(
            "--source: needed to rewrite the malformed row of lease {key}: the new lease takes the partition's parents and key range from the source"
        )));
    };
    // Named, so that a partition only a lease names (a Cosmos DB EPK range) is listed too;
    // the row cannot be read, so its position is unknown.
    let partitions = source
        .partitions_for(&[LeasedPartition::unreadable(key.partition.clone())])
        .await
        .context("listing the source's partitions")?;
    let Some(partition) = partitions.into_iter().find(|p| p.id == key.partition) else {
        bail!(
            "lease {key}: malformed row, and the source has no partition {}: nothing to rewrite it as; delete the row by hand",
            key.partition
        );
    };
    let mut lease = Lease::new(key.clone(), to.start).with_parents(partition.parents);
    lease.continuation = to.continuation;
    if let Some(range) = partition.key_range {
        lease.properties.insert(
            changefeed::lineage::RANGE_PROPERTY.to_string(),
            changefeed::lineage::range_property(range),
        );
    }
    let Some(version) = to.store_url.row_version(key).await? else {
        bail!("lease {key}: not found (deleted while resetting)");
    };
    to.store.delete(key, version).await.map_err(|e| match e {
        LeaseError::Conflict { .. } | LeaseError::Malformed { .. } => {
            anyhow!("{e}: the row changed while resetting it; check `status` and run again")
        }
        other => anyhow::Error::new(other),
    })?;
    let Some(stored) = to.store.create(&lease).await? else {
        bail!(
            "lease {key}: the malformed row was deleted, but a host created the lease again before the reset could (the leader's partition sync); check `status` and reset it again"
        );
    };
    println!(
        "lease {key}: malformed row ({reason}) replaced: checkpoint {} (start {}), state {}, parents [{}] ({})",
        opt(stored.continuation.as_ref()),
        stored.start,
        stored.state,
        stored
            .parents
            .iter()
            .map(PartitionId::as_str)
            .collect::<Vec<_>>()
            .join(", "),
        stored.version
    );
    Ok(ExitCode::SUCCESS)
}

/// `changefeed release`: frees a dead host's leases now and removes its heartbeat row.
pub fn release(args: ReleaseArgs) -> anyhow::Result<ExitCode> {
    block_on(async move {
        let (store, group) = args.target.open().await?;
        let host = HostName::new(args.host.as_str()).map_err(|e| usage(format!("--host: {e}")))?;
        let wait = parse_duration("--wait", &args.wait)?;
        let watched =
            admin::watch_heartbeat(store.as_ref(), &group, &host, wait, &SystemClock).await?;
        match &watched {
            Watched::Moved { from, to } => {
                let now = to
                    .as_ref()
                    .map_or("removed".to_string(), |h| h.version.to_string());
                if !args.force {
                    bail!(
                        "host {host} is alive: its heartbeat moved from {} to {now} within {}; stop it first, or pass --force",
                        from.version,
                        humantime::format_duration(wait)
                    );
                }
                eprintln!(
                    "warning: host {host} is alive (heartbeat {} -> {now}); releasing anyway (--force): it will stop when it sees its row gone",
                    from.version
                );
            }
            Watched::Unchecked(_) => {
                eprintln!("warning: --wait 0s: not checking whether host {host} is alive")
            }
            Watched::NoRow | Watched::StoodStill(_) => {}
        }
        let report = admin::release_host(store.as_ref(), &group, &host, watched.last())
            .await
            .context("listing leases")?;
        for lease in &report.released {
            println!(
                "released {} (checkpoint {})",
                lease.key,
                opt(lease.continuation.as_ref())
            );
        }
        for key in &report.cleared {
            println!("cleared hand-off request of {host} on {key}");
        }
        let mut failed = report.failed.len();
        for err in &report.failed {
            eprintln!("error: {err}");
        }
        for bad in &report.malformed {
            eprintln!("warning: {bad}");
        }
        match &report.heartbeat {
            Some(Ok(())) => println!("removed heartbeat row of {host}"),
            Some(Err(err)) => {
                failed += 1;
                eprintln!("error: {err}");
            }
            None => println!("host {host} has no heartbeat row"),
        }
        let released = report.released.len();
        println!("{released} leases released");
        Ok(if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    })
}
