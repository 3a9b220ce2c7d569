//! The console's JSON API, rendered from a [`Watch`] after each refresh:
//!
//! - `/api/hosts`: every host with a heartbeat row, listed in the membership view, or owning
//!   a lease: name, status (from the view while a leader keeps it fresh: `live`, `dead`,
//!   `unknown`; otherwise from the heartbeats: `live`, `fenced`, `expired`, `no heartbeat`),
//!   leader, heartbeat age as of the last heartbeat read (and how old that read is), leases
//!   owned;
//! - `/api/leases`: every lease (and every partition without one yet): owner, state,
//!   checkpoint, lag in records and in seconds, hand-off requested;
//! - `/api/events`: the events derived from successive reads, oldest first;
//! - `/api/stats`: what the console's own reads have cost the store;
//! - `/api/timeline.svg`: the ownership timeline.
//!
//! Heartbeat ages are the writer's wall clock against the console's at the heartbeat read, for
//! display only. Liveness is the view's judgment while it is fresh (each a rule-2 judgment of
//! its leader); otherwise whether a host is fenced or expired is judged, as a host judges, by
//! how long the console has seen its heartbeat stand still on its own clock (design rule 2).

use std::collections::{BTreeMap, BTreeSet};

use changefeed::model::{Continuation, HostName, PartitionId};
use serde_json::{json, Value};

use super::watch::{Judged, Watch};

/// Every document the API serves, rendered at one refresh.
#[derive(Debug, Default)]
pub struct Rendered {
    pub hosts: String,
    pub leases: String,
    pub events: String,
    pub stats: String,
    pub timeline: String,
}

impl Rendered {
    /// Renders every document from `watch`.
    pub fn of(watch: &Watch) -> Self {
        let now = watch.wall_ms();
        let title = format!("group {}: ownership over the last minutes", watch.group);
        Self {
            hosts: hosts(watch, now).to_string(),
            leases: leases(watch, now).to_string(),
            events: events(watch, now).to_string(),
            stats: stats(watch).to_string(),
            timeline: watch.timeline.svg(now, &title, &|h| watch.colour(h)),
        }
    }
}

/// `/api/hosts`.
pub fn hosts(watch: &Watch, now: i64) -> Value {
    let mut owned: BTreeMap<&HostName, usize> = BTreeMap::new();
    for lease in watch.leases.values() {
        if let Some(owner) = &lease.owner {
            *owned.entry(owner).or_default() += 1;
        }
    }
    let judged = watch.judged(watch.now());
    let view = watch.view();
    // Every host with a row, listed in the view, or owning a lease.
    let mut names: BTreeSet<&HostName> = watch.hosts.keys().collect();
    names.extend(owned.keys().copied());
    if let Some(v) = view {
        names.extend(v.live.iter().map(|h| &h.host));
        names.extend(&v.dead);
    }
    let read_at = watch.heartbeats_read_at();
    let out: Vec<Value> = names
        .into_iter()
        .map(|name| {
            let row = watch.hosts.get(name);
            let live = view.and_then(|v| v.live.iter().find(|h| h.host == *name));
            let in_view = view.map(|v| {
                if live.is_some() {
                    "live"
                } else if v.dead.contains(name) {
                    "dead"
                } else {
                    "unknown"
                }
            });
            let status = match (judged, in_view, row) {
                (Judged::View, Some(listed), _) => listed,
                (_, _, Some(r)) if r.expired => "expired",
                (_, _, Some(r)) if r.fenced => "fenced",
                (_, _, Some(_)) => "live",
                (_, _, None) => "no heartbeat",
            };
            let (fenced, expired) = match (judged, row) {
                (Judged::View, _) => (status == "dead", status == "dead"),
                (Judged::Heartbeats, Some(r)) => (r.fenced, r.expired),
                (Judged::Heartbeats, None) => (true, true),
            };
            let incarnation = live
                .map(|h| &*h.incarnation)
                .or(row.map(|r| &*r.heartbeat.incarnation));
            json!({
                "name": name.as_str(),
                "status": status,
                "leader": view.is_some_and(|v| v.leader == *name && live.is_some()),
                "in_view": in_view,
                "fenced": fenced,
                "expired": expired,
                "heartbeat_age_ms": row.map(|r| watch.heartbeats_at_ms.saturating_sub(r.heartbeat.written_at.millis())),
                "unchanged_ms": row.and(read_at).and_then(|at| watch.unchanged_for(name, at)).map(|d| d.as_millis() as u64),
                "heartbeat_version": row.map(|r| r.heartbeat.version.0),
                "incarnation": incarnation,
                "leases_owned": owned.get(name).copied().unwrap_or(0),
                "colour": watch.colour(name),
            })
        })
        .collect();
    json!({
        "group": watch.group.as_str(),
        "now_ms": now,
        "judged_by": judged.as_str(),
        "view": view.map(|v| json!({
            "version": v.version,
            "leader": v.leader.as_str(),
            "live": v.live.len(),
            "dead": v.dead.len(),
        })),
        "heartbeats_as_of_ms": watch.heartbeats_at_ms,
        "heartbeats_read_age_ms": now.saturating_sub(watch.heartbeats_at_ms),
        "hosts": out,
        "error": watch.error,
    })
}

/// `/api/leases`.
pub fn leases(watch: &Watch, now: i64) -> Value {
    let lag = |p: &PartitionId| watch.lag.get(p).cloned().unwrap_or_default();
    let mut rows: Vec<(&PartitionId, Value)> = watch
        .leases
        .values()
        .map(|l| {
            let lag = lag(&l.key.partition);
            let row = json!({
                "partition": l.key.partition.as_str(),
                "leased": true,
                "owner": l.owner.as_ref().map(HostName::as_str),
                "owner_colour": l.owner.as_ref().map(|o| watch.colour(o)),
                "state": l.state.as_str(),
                "next_owner": l.next_owner.as_ref().map(HostName::as_str),
                "handoff_requested": l.next_owner.is_some(),
                "checkpoint": l.continuation.as_ref().map(Continuation::as_str),
                "start": l.start.to_string(),
                "parents": l.parents,
                "version": l.version.0,
                "lag_records": lag.records,
                "lag_seconds": lag.age_ms.map(|ms| ms as f64 / 1000.0),
                "lag_error": lag.error,
            });
            (&l.key.partition, row)
        })
        .collect();
    for p in &watch.unleased {
        let lag = lag(p);
        rows.push((
            p,
            json!({
                "partition": p.as_str(),
                "leased": false,
                "owner": null,
                "owner_colour": null,
                "state": "no lease yet",
                "next_owner": null,
                "handoff_requested": false,
                "checkpoint": null,
                "start": null,
                "parents": [],
                "version": null,
                "lag_records": lag.records,
                "lag_seconds": lag.age_ms.map(|ms| ms as f64 / 1000.0),
                "lag_error": lag.error,
            }),
        ));
    }
    rows.sort_by_key(|(p, _)| (p.as_str().parse::<u64>().unwrap_or(u64::MAX), *p));
    let total: u64 = rows
        .iter()
        .filter_map(|(_, r)| r["lag_records"].as_u64())
        .sum();
    json!({
        "group": watch.group.as_str(),
        "now_ms": now,
        "checkpoints_as_of_ms": watch.listed_at_ms,
        "lag_total": total,
        "leases": rows.into_iter().map(|(_, r)| r).collect::<Vec<_>>(),
        "errors": watch.malformed,
        "error": watch.error,
    })
}

/// `/api/events`, oldest first.
pub fn events(watch: &Watch, now: i64) -> Value {
    let events: Vec<Value> = watch
        .events
        .iter()
        .map(|e| {
            json!({
                "at_ms": e.at_ms,
                "kind": e.change.kind,
                "partition": e.change.partition.as_ref().map(PartitionId::as_str),
                "host": e.change.host.as_ref().map(HostName::as_str),
                "text": e.change.text,
            })
        })
        .collect();
    json!({"group": watch.group.as_str(), "now_ms": now, "events": events})
}

/// `/api/stats`: the console's store calls and rows since it started, and per refresh.
pub fn stats(watch: &Watch) -> Value {
    let c = watch.cost();
    let n = watch.refreshes.max(1) as f64;
    json!({
        "refreshes": watch.refreshes,
        "reads": c.reads,
        "writes": c.writes,
        "lists": c.lists,
        "lease_rows_read": c.lease_rows_read,
        "heartbeat_rows_read": c.heartbeat_rows_read,
        "head_rows_read": c.head_rows_read,
        "heartbeat_reads": watch.heartbeat_reads,
        "rows_read": c.lease_rows_read + c.heartbeat_rows_read + c.head_rows_read,
        "per_refresh": {
            "reads": c.reads as f64 / n,
            "lease_rows_read": c.lease_rows_read as f64 / n,
            "heartbeat_rows_read": c.heartbeat_rows_read as f64 / n,
            "head_rows_read": c.head_rows_read as f64 / n,
            "rows_read": (c.lease_rows_read + c.heartbeat_rows_read + c.head_rows_read) as f64 / n,
        },
    })
}
