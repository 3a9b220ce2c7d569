//! `changefeed plan`: what one host's balancer would do with a snapshot of the lease table.
//!
//! Reads a JSON snapshot (live hosts and leases, optionally lease limits), runs the default
//! strategy ([`changefeed::balance::EqualShare`]) for `--host`, and prints the plan and every
//! host's quota as pretty JSON. It touches no store: the snapshot is all it knows. A malformed
//! snapshot is reported with the path of the bad field (`leases[3].owner`) and exit code 2.
//!
//! Snapshot format:
//!
//! ```json
//! {"hosts": ["a", "b"],
//!  "leases": [{"partition": "0", "owner": "a"},
//!             {"partition": "1", "owner": null, "next_owner": "b"}],
//!  "min_leases": 1, "max_leases": 4,
//!  "host_limits": {"b": {"max_leases": 2}}}
//! ```
//!
//! Per lease, `partition` is required; `owner` and `next_owner` are a host name or null
//! (default null); `state` is `available`, `owned` or `finished` (default `owned` when there is
//! an owner, else `available`); `eligible` defaults to true unless finished;
//! `handoff_overdue` defaults to false; `properties` is an object of strings. A lease whose
//! owner is not in `hosts` belongs to a dead host. Unknown fields are ignored.
//!
//! `min_leases` and `max_leases` (a whole number or null, default none) are every host's lease
//! limits, as `changefeed run --min-leases/--max-leases` sets them on every host of a group;
//! the flags `--min-leases` and `--max-leases` override them. `host_limits` gives named hosts
//! limits of their own, each field defaulting to the fleet's. With any limit the output also
//! has `limits`: the fleet's limits, the hosts' own, and `left_free`, the eligible leases no
//! host may hold because every host's quota is its maximum.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context};
use changefeed::balance::{BalanceStrategy, EqualShare, LeaseLimits, LeaseView, Plan, Snapshot};
use changefeed::model::{GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position};
use serde::Serialize;
use serde_json::{Map, Value};

/// Arguments of `changefeed plan`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The snapshot: a JSON file with `hosts` and `leases`, and optionally the lease limits
    /// `min_leases`, `max_leases` and `host_limits` (`-` reads standard input).
    #[arg(long, value_name = "FILE")]
    snapshot: PathBuf,
    /// The host to plan for; must be one of the snapshot's `hosts`.
    #[arg(long, value_name = "NAME")]
    host: String,
    /// Every host's minimum number of leases, instead of the snapshot's `min_leases`.
    // (Negative numbers are read as values, so that `-1` is refused as one, naming the flag.)
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    min_leases: Option<usize>,
    /// Every host's maximum number of leases, instead of the snapshot's `max_leases`.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    max_leases: Option<usize>,
}

/// Exit code for bad input: an unreadable or malformed snapshot, or an unknown host.
const USAGE: u8 = 2;

/// Prints the plan for `--host`. Bad input is reported on standard error with exit code 2.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (snapshot, me, strategy) = match load(&args) {
        Ok(loaded) => loaded,
        Err(err) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(USAGE));
        }
    };
    let views: Vec<LeaseView<'_>> = snapshot
        .leases
        .iter()
        .map(|(lease, eligible, handoff_overdue)| LeaseView {
            lease,
            eligible: *eligible,
            handoff_overdue: *handoff_overdue,
        })
        .collect();
    let plan = strategy.plan(&Snapshot {
        me: &me,
        live_hosts: &snapshot.hosts,
        leases: &views,
    });
    let quota = strategy.quotas(&snapshot.hosts, &views);
    let limits = (!strategy.is_unlimited()).then(|| {
        let eligible = views.iter().filter(|v| v.eligible).count();
        let own = |h: &HostName| {
            let limits = strategy.limits_of(h);
            (limits != snapshot.limits.fleet).then(|| (h.clone(), LimitsOutput::from(limits)))
        };
        LimitsOutput {
            own: snapshot.hosts.iter().filter_map(own).collect(),
            left_free: Some(eligible.saturating_sub(quota.values().sum())),
            ..LimitsOutput::from(snapshot.limits.fleet)
        }
    });
    let output = Output {
        plan: &plan,
        quota,
        limits,
    };
    let text = serde_json::to_string_pretty(&output).context("encoding the plan")?;
    println!("{text}");
    Ok(ExitCode::SUCCESS)
}

#[derive(Serialize)]
struct Output<'a> {
    #[serde(flatten)]
    plan: &'a Plan,
    quota: BTreeMap<HostName, usize>,
    /// Only when some host has a limit, so that plain snapshots print what they always did.
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<LimitsOutput>,
}

/// The limits a plan was made with.
#[derive(Serialize)]
struct LimitsOutput {
    min_leases: usize,
    max_leases: Option<usize>,
    /// Live hosts whose limits differ from the fleet's.
    #[serde(rename = "hosts", skip_serializing_if = "BTreeMap::is_empty")]
    own: BTreeMap<HostName, LimitsOutput>,
    /// Eligible leases no host may hold (every quota is its host's maximum).
    #[serde(skip_serializing_if = "Option::is_none")]
    left_free: Option<usize>,
}

impl From<LeaseLimits> for LimitsOutput {
    fn from(limits: LeaseLimits) -> Self {
        Self {
            min_leases: limits.min_leases(),
            max_leases: limits.max_leases(),
            own: BTreeMap::new(),
            left_free: None,
        }
    }
}

/// A parsed snapshot: live hosts (sorted), leases with their eligible / overdue flags, and
/// the lease limits.
struct Parsed {
    hosts: Vec<HostName>,
    leases: Vec<(Lease, bool, bool)>,
    limits: Limits,
}

/// The snapshot's lease limits, checked, with the flags applied.
#[derive(Default)]
struct Limits {
    fleet: LeaseLimits,
    hosts: Vec<(HostName, LeaseLimits)>,
}

/// One set of limits as written: each field absent (`None`), or a value (`Some`, where a
/// `max_leases` of null is `Some(None)`: no maximum).
#[derive(Default, Clone, Copy)]
struct LimitsText {
    min: Option<usize>,
    max: Option<Option<usize>>,
}

impl LimitsText {
    /// These limits, each field not given taken from `base`; `path` names them in errors.
    fn over(self, base: LeaseLimits, path: &str) -> anyhow::Result<LeaseLimits> {
        let min = self.min.unwrap_or(base.min_leases());
        let max = self.max.unwrap_or(base.max_leases());
        LeaseLimits::new(min, max).map_err(|e| {
            let dot = if path.is_empty() { "" } else { "." };
            anyhow!("{path}{dot}{e}")
        })
    }
}

fn load(args: &Args) -> anyhow::Result<(Parsed, HostName, EqualShare)> {
    let shown = args.snapshot.display().to_string();
    let text = if shown == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the snapshot from stdin")?
    } else {
        std::fs::read_to_string(&args.snapshot)
            .with_context(|| format!("reading snapshot {shown}"))?
    };
    let json: Value =
        serde_json::from_str(&text).with_context(|| format!("snapshot {shown}: invalid JSON"))?;
    let flags = LimitsText {
        min: args.min_leases,
        max: args.max_leases.map(Some),
    };
    // Limits given as flags are checked on their own first, so that the error names the flag.
    if flags.min.is_some() || flags.max.is_some() {
        let min = flags.min.unwrap_or(0);
        let max = flags.max.flatten();
        LeaseLimits::new(min, max)
            .map_err(|e| anyhow!("--{}: {}", e.setting.replace('_', "-"), e.rule))?;
    }
    let parsed = parse(&json, flags).with_context(|| format!("snapshot {shown}"))?;
    let me = HostName::new(args.host.as_str()).map_err(|e| anyhow!("--host: {e}"))?;
    if parsed.hosts.binary_search(&me).is_err() {
        let mut known = String::new();
        for (i, h) in parsed.hosts.iter().enumerate() {
            let _ = write!(known, "{}{h}", if i == 0 { "" } else { ", " });
        }
        bail!("--host {me} is not one of the snapshot's hosts ({known})");
    }
    let strategy = parsed.limits.hosts.iter().fold(
        EqualShare::with_limits(parsed.limits.fleet),
        |strategy, (host, limits)| strategy.with_host_limits(host.clone(), *limits),
    );
    Ok((parsed, me, strategy))
}

fn parse(json: &Value, flags: LimitsText) -> anyhow::Result<Parsed> {
    let top = json.as_object().ok_or_else(|| {
        anyhow!(
            "expected an object with \"hosts\" and \"leases\", got {}",
            kind(json)
        )
    })?;
    let hosts = field(top, "", "hosts")?
        .as_array()
        .ok_or_else(|| anyhow!("hosts: expected an array of host names"))?;
    let mut live = BTreeSet::new();
    for (i, h) in hosts.iter().enumerate() {
        let path = format!("hosts[{i}]");
        let name = host_name(h, &path)?
            .ok_or_else(|| anyhow!("{path}: expected a host name, got null"))?;
        if !live.insert(name.clone()) {
            bail!("{path}: host {name} is listed twice");
        }
    }
    let leases = field(top, "", "leases")?
        .as_array()
        .ok_or_else(|| anyhow!("leases: expected an array of leases"))?;
    let group = GroupName::new("snapshot").context("group name")?;
    let mut seen = BTreeSet::new();
    let mut parsed = Vec::with_capacity(leases.len());
    for (i, l) in leases.iter().enumerate() {
        let path = format!("leases[{i}]");
        let lease = parse_lease(l, &path, &group)?;
        if !seen.insert(lease.0.key.partition.clone()) {
            bail!(
                "{path}.partition: partition {} is listed twice",
                lease.0.key.partition
            );
        }
        parsed.push(lease);
    }
    Ok(Parsed {
        hosts: live.into_iter().collect(),
        leases: parsed,
        limits: parse_limits(top, flags)?,
    })
}

/// The fleet's limits (`min_leases`, `max_leases`, overridden by `flags`) and the hosts' own
/// (`host_limits`).
fn parse_limits(top: &Map<String, Value>, flags: LimitsText) -> anyhow::Result<Limits> {
    let written = limits_text(top, "")?;
    let fleet = LimitsText {
        min: flags.min.or(written.min),
        max: flags.max.or(written.max),
    }
    .over(LeaseLimits::NONE, "")?;
    let mut hosts = Vec::new();
    match top.get("host_limits") {
        None | Some(Value::Null) => {}
        Some(Value::Object(own)) => {
            for (name, value) in own {
                let path = format!("host_limits.{name}");
                let host = HostName::new(name.as_str()).map_err(|e| anyhow!("{path}: {e}"))?;
                let obj = value.as_object().ok_or_else(|| {
                    anyhow!(
                        "{path}: expected an object with min_leases and/or max_leases, got {}",
                        kind(value)
                    )
                })?;
                hosts.push((host, limits_text(obj, &path)?.over(fleet, &path)?));
            }
        }
        Some(other) => bail!(
            "host_limits: expected an object of host names to limits, got {}",
            kind(other)
        ),
    }
    Ok(Limits { fleet, hosts })
}

/// The `min_leases` and `max_leases` fields of `obj`, as written.
fn limits_text(obj: &Map<String, Value>, path: &str) -> anyhow::Result<LimitsText> {
    let dot = if path.is_empty() { "" } else { "." };
    let count = |name: &str| -> anyhow::Result<Option<Option<usize>>> {
        match obj.get(name) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(None)),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(|n| Some(Some(n)))
                .ok_or_else(|| {
                    anyhow!(
                        "{path}{dot}{name}: expected a whole number or null, got {}",
                        match v {
                            Value::Number(n) => format!("{n}"),
                            other => kind(other).to_string(),
                        }
                    )
                }),
        }
    };
    Ok(LimitsText {
        min: count("min_leases")?.map(|n| n.unwrap_or(0)),
        max: count("max_leases")?,
    })
}

fn parse_lease(json: &Value, path: &str, group: &GroupName) -> anyhow::Result<(Lease, bool, bool)> {
    let obj = json
        .as_object()
        .ok_or_else(|| anyhow!("{path}: expected a lease object, got {}", kind(json)))?;
    let partition = match field(obj, path, "partition")? {
        Value::String(s) => {
            PartitionId::new(s.as_str()).map_err(|e| anyhow!("{path}.partition: {e}"))?
        }
        other => bail!("{path}.partition: expected a string, got {}", kind(other)),
    };
    let owner = match obj.get("owner") {
        Some(v) => host_name(v, &format!("{path}.owner"))?,
        None => None,
    };
    let next_owner = match obj.get("next_owner") {
        Some(v) => host_name(v, &format!("{path}.next_owner"))?,
        None => None,
    };
    let state = match obj.get("state") {
        None | Some(Value::Null) if owner.is_some() => LeaseState::Owned,
        None | Some(Value::Null) => LeaseState::Available,
        Some(Value::String(s)) => s.parse().map_err(|e| anyhow!("{path}.state: {e}"))?,
        Some(other) => bail!(
            "{path}.state: expected available, owned or finished, got {}",
            kind(other)
        ),
    };
    let eligible = flag(obj, path, "eligible", state != LeaseState::Finished)?;
    let handoff_overdue = flag(obj, path, "handoff_overdue", false)?;
    let mut properties = BTreeMap::new();
    match obj.get("properties") {
        None | Some(Value::Null) => {}
        Some(Value::Object(props)) => {
            for (k, v) in props {
                let v = v.as_str().ok_or_else(|| {
                    anyhow!("{path}.properties.{k}: expected a string, got {}", kind(v))
                })?;
                properties.insert(k.clone(), v.to_string());
            }
        }
        Some(other) => bail!(
            "{path}.properties: expected an object of strings, got {}",
            kind(other)
        ),
    }
    let mut lease = Lease::new(LeaseKey::new(group.clone(), partition), Position::Beginning);
    lease.state = state;
    lease.owner = owner;
    lease.next_owner = next_owner;
    lease.properties = properties;
    lease
        .validate()
        .map_err(|e| anyhow!("{path}: {e} (see its state, owner and next_owner)"))?;
    Ok((lease, eligible, handoff_overdue))
}

fn field<'v>(obj: &'v Map<String, Value>, path: &str, name: &str) -> anyhow::Result<&'v Value> {
    let dot = if path.is_empty() { "" } else { "." };
    obj.get(name)
        .ok_or_else(|| anyhow!("{path}{dot}{name}: missing"))
}

fn host_name(json: &Value, path: &str) -> anyhow::Result<Option<HostName>> {
    match json {
        Value::Null => Ok(None),
        Value::String(s) => HostName::new(s.as_str())
            .map(Some)
            .map_err(|e| anyhow!("{path}: {e}")),
        other => bail!("{path}: expected a host name or null, got {}", kind(other)),
    }
}

fn flag(obj: &Map<String, Value>, path: &str, name: &str, default: bool) -> anyhow::Result<bool> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => bail!("{path}.{name}: expected true or false, got {}", kind(other)),
    }
}

/// What kind of JSON value `v` is, for error messages.
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
