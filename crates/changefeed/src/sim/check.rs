//! The invariant checker: reads a run's delivery ledger and lease write history and reports
//! every broken rule of `DESIGN.md` ("Correctness rules").
//!
//! - **lost**: every record written is delivered at least once (rule 4).
//! - **order**: per partition, a record is delivered only after every earlier record of its
//!   partition (rule 4); with key concurrency ([`CheckInput::keys`]), per key of a partition:
//!   after every earlier record of its partition with the same key, since keys of one batch
//!   are handled at once. Every other rule is unchanged, except that a key's redelivered
//!   records may follow another key's new ones within an epoch.
//! - **parents-first**: no record of a child is delivered before every record of each parent
//!   (rule 5).
//! - **continuation-backwards**: no write moves a lease's continuation backwards (rule 4).
//! - **duplicate**: a record is delivered again only at the start of a new ownership epoch
//!   (a worker start), and at most one batch of them per epoch (rule 4).
//! - **two-deliverers**: once a newer epoch has applied a record of a partition, no older epoch
//!   applies one again (rules 1 and 3: the old owner is fenced before anyone may take over).
//! - **overlap**: a handler call is in progress from when it begins until it applies its last
//!   record; no record of a partition is applied while a call of another epoch on that
//!   partition is in progress (rules 1 and 3: a call that outlives its owner's fence is
//!   dropped before it applies anything more).
//! - **liveness** ([`liveness`], over the hosts' path health, heartbeats and lease writes): a
//!   host that is up and whose path to the store has been healthy for a while heartbeats, and
//!   holds a lease where the fleet has one for every host (rule 2's other side: a live host
//!   does its share).
//!
//! "Before" and "after" are the order things happened in: virtual time, and at one instant the
//! order the single-threaded run made them in ([`Delivery::seq`]). A record counts as
//! delivered when the handler applied it, not when the call began: a call dropped halfway
//! delivered the records it applied.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use super::pool::PoolConfig;
use super::world::{Delivery, HealthMark, HeartbeatRec, WriteRec};
use crate::model::{LeaseState, PartitionId};
use crate::processor::Settings;

/// One broken rule, with what shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The rule: `lost`, `order`, `parents-first`, `continuation-backwards`, `duplicate`,
    /// `two-deliverers`, `overlap`, `liveness`.
    pub rule: &'static str,
    /// What happened, naming partitions, records, hosts and times.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.rule, self.detail)
    }
}

/// What the checker reads.
#[derive(Debug)]
pub struct CheckInput<'a> {
    /// The partition of every record written, by record id.
    pub written: &'a [PartitionId],
    /// Every record applied.
    pub deliveries: &'a [Delivery],
    /// Every successful lease write.
    pub writes: &'a [WriteRec],
    /// Each partition's parents.
    pub parents: &'a BTreeMap<PartitionId, Vec<PartitionId>>,
    /// Most duplicate records allowed per epoch (one batch), or `None` when checkpoints are
    /// not written after every batch (then only their place is checked).
    pub max_duplicates: Option<usize>,
    /// The key of every record written, by record id, when a partition's records are handled
    /// several keys at once (key concurrency): order is then checked per key. `None`: per
    /// partition.
    pub keys: Option<&'a [String]>,
}

#[derive(Default)]
struct PartState {
    /// Records of the partition delivered in order so far (the sum of its streams' prefixes).
    in_order: usize,
    /// Total records written to the partition.
    len: usize,
    /// Delivery sequence number at which every record of the partition was delivered in
    /// order.
    complete_seq: Option<u64>,
    current: Option<u64>,
    current_host: String,
    current_since: std::time::Duration,
    retired: BTreeSet<u64>,
    started: bool,
}

/// What order is checked in: a partition, or one key of it (see [`CheckInput::keys`]).
type Stream<'a> = (&'a PartitionId, Option<&'a str>);

#[derive(Default)]
struct StreamState {
    /// Records of the stream delivered in order so far (a prefix).
    prefix: usize,
    /// Total records written to the stream.
    len: usize,
}

/// Checks every rule; returns the violations found (at most a few per rule).
pub fn check(input: &CheckInput<'_>) -> Vec<Violation> {
    const PER_RULE: usize = 3;
    let mut out: Vec<Violation> = Vec::new();
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut report = |rule: &'static str, detail: String| {
        let n = counts.entry(rule).or_default();
        *n += 1;
        if *n <= PER_RULE {
            out.push(Violation { rule, detail });
        }
    };
    let stream_of = |record: usize| -> Stream<'_> {
        (
            &input.written[record],
            input.keys.and_then(|k| k.get(record)).map(String::as_str),
        )
    };
    let name = |(p, key): Stream<'_>| match key {
        Some(k) => format!("partition {p} key {k}"),
        None => format!("partition {p}"),
    };

    // Index of each record in its stream.
    let mut parts: BTreeMap<&PartitionId, PartState> = BTreeMap::new();
    let mut streams: BTreeMap<Stream<'_>, StreamState> = BTreeMap::new();
    let mut index: Vec<usize> = Vec::with_capacity(input.written.len());
    for (r, p) in input.written.iter().enumerate() {
        parts.entry(p).or_default().len += 1;
        let st = streams.entry(stream_of(r)).or_default();
        index.push(st.len);
        st.len += 1;
    }
    let mut order: Vec<&Delivery> = input.deliveries.iter().collect();
    order.sort_by_key(|d| d.seq);
    // Per epoch, duplicates so far; per epoch and stream, whether a new record was seen.
    let mut duplicates: BTreeMap<u64, usize> = BTreeMap::new();
    let mut fresh_seen: BTreeSet<(u64, Stream<'_>)> = BTreeSet::new();
    for d in order {
        let Some(&i) = usize::try_from(d.record).ok().and_then(|r| index.get(r)) else {
            report("order", format!("record {} was never written", d.record));
            continue;
        };
        if input.written[d.record as usize] != d.partition {
            report(
                "order",
                format!(
                    "record {} delivered from partition {}",
                    d.record, d.partition
                ),
            );
            continue;
        }
        let stream = stream_of(d.record as usize);
        // Parents first: checked at the partition's first delivery.
        let first = parts.get(&d.partition).is_none_or(|s| !s.started);
        if first {
            for parent in input.parents.get(&d.partition).into_iter().flatten() {
                let done = match parts.get(parent) {
                    None => Some(0),
                    Some(ps) if ps.len == 0 => Some(0),
                    Some(ps) => ps.complete_seq,
                };
                if done.is_none_or(|s| s >= d.seq) {
                    let (have, len) = parts
                        .get(parent)
                        .map(|p| (p.in_order, p.len))
                        .unwrap_or((0, 0));
                    report(
                        "parents-first",
                        format!(
                            "partition {} read by {} at {:?} before parent {parent} was finished ({have} of {len} records delivered)",
                            d.partition, d.host, d.at
                        ),
                    );
                }
            }
        }
        let st = parts.entry(&d.partition).or_default();
        st.started = true;
        // One deliverer at a time.
        if st.current != Some(d.epoch) {
            if st.retired.contains(&d.epoch) {
                report(
                    "two-deliverers",
                    format!(
                        "partition {}: {} delivered record {} at {:?}, after {} had started delivering it at {:?}",
                        d.partition, d.host, d.record, d.at, st.current_host, st.current_since
                    ),
                );
            } else {
                if let Some(c) = st.current {
                    st.retired.insert(c);
                }
                st.current = Some(d.epoch);
                st.current_host = d.host.clone();
                st.current_since = d.at;
            }
        }
        let ss = streams.entry(stream).or_default();
        if i < ss.prefix {
            if fresh_seen.contains(&(d.epoch, stream)) {
                report(
                    "duplicate",
                    format!(
                        "{}: {} delivered record {} again in the middle of its ownership (epoch {}) at {:?}",
                        name(stream), d.host, d.record, d.epoch, d.at
                    ),
                );
            }
            let dups = duplicates.entry(d.epoch).or_default();
            *dups += 1;
            if input.max_duplicates.is_some_and(|m| *dups == m + 1) {
                report(
                    "duplicate",
                    format!(
                        "partition {}: {} redelivered more than one batch ({} records) after taking over (epoch {}) at {:?}",
                        d.partition,
                        d.host,
                        *dups,
                        d.epoch,
                        d.at
                    ),
                );
            }
        } else if i == ss.prefix {
            fresh_seen.insert((d.epoch, stream));
            ss.prefix += 1;
            st.in_order += 1;
            if st.in_order == st.len {
                st.complete_seq = Some(d.seq);
            }
        } else {
            let of = if stream.1.is_some() {
                "key"
            } else {
                "partition"
            };
            report(
                "order",
                format!(
                    "{}: {} delivered record {} (#{i}) at {:?} before #{} of the {of}",
                    name(stream),
                    d.host,
                    d.record,
                    d.at,
                    ss.prefix
                ),
            );
        }
    }
    for (&stream, ss) in &streams {
        if ss.prefix < ss.len {
            let missing = (0..input.written.len())
                .filter(|&r| stream_of(r) == stream)
                .nth(ss.prefix)
                .unwrap_or_default();
            report(
                "lost",
                format!(
                    "{}: {} of {} records never delivered in order, first missing record {missing}",
                    name(stream),
                    ss.len - ss.prefix,
                    ss.len
                ),
            );
        }
    }

    overlapping_calls(input.deliveries, &mut report);

    // Continuations never move backwards.
    let mut last: BTreeMap<&PartitionId, u64> = BTreeMap::new();
    for w in input.writes {
        let Some(after) = &w.after else { continue };
        let Some(off) = after
            .continuation
            .as_ref()
            .and_then(|c| c.as_str().rsplit_once(':'))
            .and_then(|(_, o)| o.parse::<u64>().ok())
        else {
            continue;
        };
        if let Some(prev) = last.insert(&w.partition, off) {
            if off < prev {
                report(
                    "continuation-backwards",
                    format!(
                        "partition {}: {} moved the continuation from {prev} back to {off} at {:?}",
                        w.partition, w.host, w.at
                    ),
                );
            }
        }
    }
    out
}

/// A handler call, as seen from the records it applied.
struct Call<'a> {
    /// When it began, in run order.
    start: u64,
    /// When it applied its last record, in run order.
    last: u64,
    first_at: std::time::Duration,
    last_at: std::time::Duration,
    d: &'a Delivery,
    records: (u64, u64),
}

/// The `overlap` rule: per partition, calls sorted by start; each must begin after every
/// call of another epoch applied its last record.
fn overlapping_calls(deliveries: &[Delivery], report: &mut impl FnMut(&'static str, String)) {
    let mut calls: BTreeMap<(&PartitionId, u64), Call<'_>> = BTreeMap::new();
    for d in deliveries {
        let c = calls.entry((&d.partition, d.call)).or_insert(Call {
            start: d.call,
            last: d.seq,
            first_at: d.at,
            last_at: d.at,
            d,
            records: (d.record, d.record),
        });
        if d.seq >= c.last {
            c.last = d.seq;
            c.last_at = d.at;
            c.records.1 = d.record;
        }
        if d.seq < c.d.seq {
            c.first_at = d.at;
            c.records.0 = d.record;
            c.d = d;
        }
    }
    // The keys sort by partition, then start: one sweep per partition, keeping the call that
    // ended last and the one that ended last among the other epochs.
    let mut partition: Option<&PartitionId> = None;
    let mut latest: Option<&Call<'_>> = None;
    let mut other: Option<&Call<'_>> = None;
    // Each call that outlived another's start is reported once, against the first such call.
    let mut reported: BTreeSet<u64> = BTreeSet::new();
    for ((p, _), c) in &calls {
        if partition != Some(*p) {
            partition = Some(*p);
            latest = None;
            other = None;
            reported.clear();
        }
        let earlier = match latest {
            Some(l) if l.d.epoch != c.d.epoch => Some(l),
            _ => other,
        };
        if let Some(e) = earlier.filter(|e| e.last > c.start && reported.insert(e.start)) {
            report(
                "overlap",
                format!(
                    "partition {p}: {} (epoch {}) applied record {} at {:?}, in a call begun at {:?} (records {}..={} from {:?}), after {} (epoch {}) had begun a call at {:?} (records {}..={} applied from {:?} to {:?})",
                    e.d.host,
                    e.d.epoch,
                    e.records.1,
                    e.last_at,
                    e.d.call_at,
                    e.records.0,
                    e.records.1,
                    e.first_at,
                    c.d.host,
                    c.d.epoch,
                    c.d.call_at,
                    c.records.0,
                    c.records.1,
                    c.first_at,
                    c.last_at,
                ),
            );
        }
        // Keep the two calls of distinct epochs that ended last.
        match latest {
            Some(l) if l.last >= c.last => {
                if l.d.epoch != c.d.epoch && other.is_none_or(|o| o.last < c.last) {
                    other = Some(c);
                }
            }
            Some(l) => {
                if l.d.epoch != c.d.epoch {
                    other = Some(l);
                }
                latest = Some(c);
            }
            None => latest = Some(c),
        }
    }
}

/// The liveness rule's windows: how long a host that is up and whose path to the store is
/// healthy may go without a heartbeat reaching the store, and, while the fleet has a lease for
/// every host, without holding one. See [`LivenessWindows::of`] for how they follow from the
/// settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LivenessWindows {
    /// Longest stretch without a heartbeat.
    pub heartbeat: Duration,
    /// Longest stretch without a lease while the fleet has at least as many eligible leases
    /// as hosts (so the equal share gives every live host one); `None`: not checked (a
    /// strategy that may leave a host without a lease, such as KCL's target of
    /// `ceil(leases / hosts)`).
    pub lease: Option<Duration>,
}

impl LivenessWindows {
    /// The windows for hosts running `settings` behind `pool` (their client; `None`: none):
    ///
    /// - **heartbeat**: `recover + R + A`, where `recover` is the longer of `E + 2R` (a host
    ///   that restarts under the name of a crashed one watches its old row for `E`, polling
    ///   every `R`, before it registers) and `C + P × (R + W)` (after a forget cut, each of the
    ///   pool's `P` dead connections may cost a renewal, every `R`, its bound `W`, while a call
    ///   of the host loop holds another for up to `C`);
    /// - **lease**: `heartbeat + E + P × C + H + 3A`: once it renews, a host that lapsed waits
    ///   for a membership view to list its new incarnation (a leader that went quiet is
    ///   replaced within `E`); its cycles may meet the dead connections of its feed's pool one
    ///   after another (the leader's partition sync and lag estimate read the feed); then it
    ///   asks for its share, and steals a request not honoured within `H`, each a cycle or so
    ///   apart;
    ///
    /// with `R` = `renew_interval`, `W` = `min(safety_margin, renew_interval)` (a renewal's
    /// bound), `C` = the shorter of [`Settings::call_timeout`] and the client's own per-call
    /// timeout (the longest a call on a dead connection hangs), `P` = the pool's size (0
    /// without one), `E` = `lease_expiry`, `H` = `handoff_timeout`, and `A` = 1.5 ×
    /// `acquire_interval` (a cycle stretched by a store that paces head reads). With the
    /// simulator's settings and a pool of 4 whose client has no timeout of its own: 29 s and
    /// 90 s (with one of 3 s: 24 s and 65 s; without a pool: 19 s and 48 s).
    pub fn of(settings: &Settings, pool: Option<&PoolConfig>, lease: bool) -> Self {
        let r = settings.renew_interval;
        let w = settings.safety_margin.min(settings.renew_interval);
        let e = settings.lease_expiry;
        let a = settings.acquire_interval.mul_f64(1.5);
        let (c, p) = match pool {
            Some(pool) => (
                pool.call_timeout
                    .map_or(settings.call_timeout(), |t| t.min(settings.call_timeout())),
                u32::try_from(pool.size).unwrap_or(u32::MAX),
            ),
            None => (Duration::ZERO, 0),
        };
        let recover = (e + r * 2).max(c + (r + w) * p);
        let heartbeat = recover + r + a;
        Self {
            heartbeat,
            lease: lease.then(|| heartbeat + e + c * p + settings.handoff_timeout + a * 3),
        }
    }
}

/// What the liveness rule reads.
#[derive(Debug)]
pub struct LivenessInput<'a> {
    /// Every change of a host's path health, in time order.
    pub health: &'a [HealthMark],
    /// Every heartbeat the store applied, in time order.
    pub heartbeats: &'a [HeartbeatRec],
    /// Every lease write the store applied, in time order.
    pub writes: &'a [WriteRec],
    /// The hosts of the fleet, up or not.
    pub hosts: usize,
    /// The windows.
    pub windows: LivenessWindows,
    /// When the run ended.
    pub end: Duration,
}

/// A stretch in which a host that should have heartbeat (or held a lease) did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The host.
    pub host: String,
    /// `heartbeat` or `lease`.
    pub what: &'static str,
    /// Since when the host had been up with a healthy path.
    pub healthy_since: Duration,
    /// Where the stretch began.
    pub from: Duration,
    /// Where it ended (a heartbeat, a lease taken, the path failing, or the end of the run).
    pub to: Duration,
    /// Whether it ran to the end of the run.
    pub to_end: bool,
}

impl Gap {
    /// How long it lasted.
    pub fn len(&self) -> Duration {
        self.to.saturating_sub(self.from)
    }

    /// Whether it lasted no time.
    pub fn is_empty(&self) -> bool {
        self.to <= self.from
    }
}

/// The **liveness** rule: a host that is up and whose path to the store has been healthy (no
/// stall, cut or latency spike; see [`HealthMark`]) must get a heartbeat to the store within
/// [`LivenessWindows::heartbeat`], and again within as long after each; and while the fleet
/// has at least as many eligible leases (not finished, parents finished) as it has hosts, it
/// must not go without a lease for longer than [`LivenessWindows::lease`]. Each violation
/// names the host, since when its path was healthy, and the stretch.
pub fn liveness(input: &LivenessInput<'_>) -> Vec<Violation> {
    const PER_RULE: usize = 3;
    let w = input.windows;
    let mut out = Vec::new();
    for gap in liveness_gaps(input) {
        let window = match gap.what {
            "heartbeat" => w.heartbeat,
            _ => match w.lease {
                Some(d) => d,
                None => continue,
            },
        };
        if gap.len() <= window {
            continue;
        }
        if out.len() == PER_RULE {
            break;
        }
        let until = if gap.to_end {
            " (the end of the run)".to_string()
        } else {
            String::new()
        };
        let detail = match gap.what {
            "heartbeat" => format!(
                "host {}: up and its path to the store healthy since {:?}, no heartbeat reached the store from {:?} to {:?}{until} ({:?}; at most {:?} allowed)",
                gap.host, gap.healthy_since, gap.from, gap.to, gap.len(), window
            ),
            _ => format!(
                "host {}: up and its path to the store healthy since {:?}, held no lease from {:?} to {:?}{until} while the fleet had a lease for each of its {} hosts ({:?}; at most {:?} allowed)",
                gap.host, gap.healthy_since, gap.from, gap.to, input.hosts, gap.len(), window
            ),
        };
        out.push(Violation {
            rule: "liveness",
            detail,
        });
    }
    out
}

/// Every stretch the liveness rule judges (see [`liveness`]), however short: for each host,
/// the stretches of healthy path between heartbeats, and the stretches of healthy path without
/// a lease while the fleet had a lease for every host, in host order, then time order.
pub fn liveness_gaps(input: &LivenessInput<'_>) -> Vec<Gap> {
    // What each host's timeline is made of.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Change {
        Health(bool),
        Share(bool),
        Owns(bool),
        Heartbeat,
    }
    let (share, owns) = ownership_timelines(input.writes, input.hosts);
    let mut timelines: BTreeMap<&str, Vec<(Duration, Change)>> = BTreeMap::new();
    for m in input.health {
        timelines
            .entry(&m.host)
            .or_default()
            .push((m.at, Change::Health(m.healthy)));
    }
    let hosts: Vec<&str> = timelines.keys().copied().collect();
    for hb in input.heartbeats {
        if let Some(t) = timelines.get_mut(hb.host.as_str()) {
            t.push((hb.at, Change::Heartbeat));
        }
    }
    for host in &hosts {
        let t = timelines.get_mut(host).expect("listed above");
        t.extend(share.iter().map(|&(at, on)| (at, Change::Share(on))));
        if let Some(o) = owns.get(*host) {
            t.extend(o.iter().map(|&(at, on)| (at, Change::Owns(on))));
        }
        // Stable: marks of one instant keep the order they were logged in (a host started
        // and crashed at once is down).
        t.sort_by_key(|&(at, c)| {
            let rank = match c {
                Change::Health(_) => 0,
                Change::Share(_) => 1,
                Change::Owns(_) => 2,
                Change::Heartbeat => 3,
            };
            (at, rank)
        });
    }
    let mut gaps = Vec::new();
    for (host, timeline) in timelines {
        let (mut healthy, mut shared, mut owning) = (false, false, false);
        let mut healthy_since = Duration::ZERO;
        let mut last_beat = Duration::ZERO;
        // Since when the host has gone without a lease it should hold.
        let mut wanting: Option<Duration> = None;
        let gap = |what, healthy_since, from, to, to_end| Gap {
            host: host.to_string(),
            what,
            healthy_since,
            from,
            to,
            to_end,
        };
        for (i, &(at, change)) in timeline.iter().enumerate() {
            match change {
                Change::Health(on) if on != healthy => {
                    healthy = on;
                    if on {
                        healthy_since = at;
                        last_beat = at;
                    } else {
                        gaps.push(gap("heartbeat", healthy_since, last_beat, at, false));
                    }
                }
                Change::Heartbeat if healthy => {
                    gaps.push(gap("heartbeat", healthy_since, last_beat, at, false));
                    last_beat = at;
                }
                Change::Share(on) => shared = on,
                Change::Owns(on) => owning = on,
                _ => {}
            }
            if timeline.get(i + 1).is_some_and(|&(next, _)| next == at) {
                continue;
            }
            let want = healthy && shared && !owning;
            match (wanting, want) {
                (None, true) => wanting = Some(at),
                (Some(from), false) => {
                    gaps.push(gap("lease", healthy_since, from, at, false));
                    wanting = None;
                }
                _ => {}
            }
        }
        if healthy {
            gaps.push(gap("heartbeat", healthy_since, last_beat, input.end, true));
        }
        if let Some(from) = wanting {
            gaps.push(gap("lease", healthy_since, from, input.end, true));
        }
    }
    gaps.retain(|g| !g.is_empty());
    gaps
}

/// From the lease writes: when the fleet had at least `hosts` eligible leases (not finished,
/// every parent finished or deleted) and when it stopped having them; and when each host came
/// to own a lease and to own none.
#[allow(clippy::type_complexity)]
fn ownership_timelines(
    writes: &[WriteRec],
    hosts: usize,
) -> (
    Vec<(Duration, bool)>,
    BTreeMap<String, Vec<(Duration, bool)>>,
) {
    struct Row {
        state: LeaseState,
        owner: Option<String>,
        parents: Vec<PartitionId>,
    }
    let mut rows: BTreeMap<PartitionId, Row> = BTreeMap::new();
    let mut deleted: BTreeSet<PartitionId> = BTreeSet::new();
    let mut children: BTreeMap<PartitionId, BTreeSet<PartitionId>> = BTreeMap::new();
    let mut eligible: BTreeSet<PartitionId> = BTreeSet::new();
    let mut owned: BTreeMap<String, usize> = BTreeMap::new();
    let mut share = Vec::new();
    let mut owns: BTreeMap<String, Vec<(Duration, bool)>> = BTreeMap::new();
    let mut shared = false;
    let is_eligible =
        |p: &PartitionId, rows: &BTreeMap<PartitionId, Row>, deleted: &BTreeSet<PartitionId>| {
            rows.get(p).is_some_and(|r| {
                r.state != LeaseState::Finished
                    && r.parents.iter().all(|q| {
                        deleted.contains(q)
                            || rows
                                .get(q)
                                .is_some_and(|parent| parent.state == LeaseState::Finished)
                    })
            })
        };
    for w in writes {
        let p = &w.partition;
        if let Some(old) = rows.get(p) {
            if let (LeaseState::Owned, Some(owner)) = (old.state, &old.owner) {
                let n = owned.entry(owner.clone()).or_default();
                *n -= 1;
                if *n == 0 {
                    owns.entry(owner.clone()).or_default().push((w.at, false));
                }
            }
        }
        match &w.after {
            Some(l) => {
                let owner = l.owner.as_ref().map(|o| o.as_str().to_string());
                if let (LeaseState::Owned, Some(owner)) = (l.state, &owner) {
                    let n = owned.entry(owner.clone()).or_default();
                    *n += 1;
                    if *n == 1 {
                        owns.entry(owner.clone()).or_default().push((w.at, true));
                    }
                }
                for q in &l.parents {
                    children.entry(q.clone()).or_default().insert(p.clone());
                }
                deleted.remove(p);
                rows.insert(
                    p.clone(),
                    Row {
                        state: l.state,
                        owner,
                        parents: l.parents.clone(),
                    },
                );
            }
            None => {
                rows.remove(p);
                deleted.insert(p.clone());
            }
        }
        let affected = std::iter::once(p).chain(children.get(p).into_iter().flatten());
        for q in affected {
            if is_eligible(q, &rows, &deleted) {
                eligible.insert(q.clone());
            } else {
                eligible.remove(q);
            }
        }
        let now = eligible.len() >= hosts.max(1);
        if now != shared {
            shared = now;
            share.push((w.at, now));
        }
    }
    (share, owns)
}

#[cfg(test)]
mod liveness_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::model::{GroupName, Lease, LeaseKey, Position};
    use crate::sim::world::WriteOp;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn mark(at: u64, host: &str, healthy: bool) -> HealthMark {
        HealthMark {
            at: s(at),
            host: host.into(),
            healthy,
        }
    }

    /// Heartbeats of `host` every 2 s from `from` to `to`.
    fn beats(host: &str, from: u64, to: u64) -> Vec<HeartbeatRec> {
        (from..=to)
            .step_by(2)
            .map(|at| HeartbeatRec {
                at: s(at),
                host: host.into(),
            })
            .collect()
    }

    fn write(
        at: u64,
        p: &str,
        state: LeaseState,
        owner: Option<&str>,
        parents: &[&str],
    ) -> WriteRec {
        let id = |x: &str| PartitionId::new(x).unwrap();
        let mut lease = Lease::new(
            LeaseKey::new(GroupName::new("g").unwrap(), id(p)),
            Position::Beginning,
        )
        .with_parents(parents.iter().map(|x| id(x)).collect());
        lease.state = state;
        lease.owner = owner.map(|o| crate::model::HostName::new(o).unwrap());
        WriteRec {
            at: s(at),
            host: "driver".into(),
            op: WriteOp::Replace,
            partition: id(p),
            after: Some(lease),
            owner_before: None,
            next_owner_before: None,
        }
    }

    fn windows(heartbeat: u64, lease: Option<u64>) -> LivenessWindows {
        LivenessWindows {
            heartbeat: s(heartbeat),
            lease: lease.map(s),
        }
    }

    fn rule(
        health: &[HealthMark],
        heartbeats: &[HeartbeatRec],
        writes: &[WriteRec],
        hosts: usize,
        windows: LivenessWindows,
        end: u64,
    ) -> Vec<String> {
        liveness(&LivenessInput {
            health,
            heartbeats,
            writes,
            hosts,
            windows,
            end: s(end),
        })
        .into_iter()
        .map(|v| {
            assert_eq!(v.rule, "liveness");
            v.detail
        })
        .collect()
    }

    #[test]
    fn liveness_names_a_healthy_host_that_stops_heartbeating_and_since_when() {
        let health = [mark(10, "h1", true)];
        let found = rule(&health, &beats("h1", 12, 14), &[], 1, windows(20, None), 60);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("host h1: up and its path to the store healthy since 10s, no heartbeat reached the store from 14s to 60s (the end of the run)"),
            "{}",
            found[0]
        );
        // Within the window, nothing.
        assert!(rule(&health, &beats("h1", 12, 44), &[], 1, windows(20, None), 60).is_empty());
    }

    #[test]
    fn liveness_does_not_count_time_the_path_was_unhealthy() {
        // Cut off from 10 s to 50 s: no heartbeat is owed then; one is owed within the window
        // of the path healing.
        let health = [
            mark(0, "h1", true),
            mark(10, "h1", false),
            mark(50, "h1", true),
        ];
        let mut hb = beats("h1", 0, 10);
        hb.extend(beats("h1", 64, 100));
        assert!(rule(&health, &hb, &[], 1, windows(20, None), 100).is_empty());
        let hb: Vec<HeartbeatRec> = beats("h1", 0, 10)
            .into_iter()
            .chain(beats("h1", 74, 100))
            .collect();
        let found = rule(&health, &hb, &[], 1, windows(20, None), 100);
        assert!(
            found[0].contains("healthy since 50s, no heartbeat reached the store from 50s to 74s"),
            "{found:?}"
        );
    }

    #[test]
    fn liveness_keeps_the_order_marks_of_one_instant_were_logged_in() {
        // Started and crashed at the same instant: down, owing nothing (a host once seemed up
        // from then on, its crash sorted before its start).
        let health = [mark(0, "h1", true), mark(0, "h1", false)];
        assert!(rule(&health, &[], &[], 1, windows(20, Some(40)), 100).is_empty());
    }

    #[test]
    fn liveness_names_a_healthy_host_without_a_lease_while_the_fleet_has_one_for_each_host() {
        let health = [mark(0, "h0", true), mark(0, "h1", true)];
        let mut hb = beats("h0", 0, 100);
        hb.extend(beats("h1", 0, 100));
        let writes = [
            write(0, "a", LeaseState::Owned, Some("h0"), &[]),
            write(0, "b", LeaseState::Owned, Some("h0"), &[]),
        ];
        let found = rule(&health, &hb, &writes, 2, windows(20, Some(40)), 100);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("host h1: up and its path to the store healthy since 0ns, held no lease from 0ns to 100s (the end of the run) while the fleet had a lease for each of its 2 hosts"),
            "{}",
            found[0]
        );
        // Handed one at 30 s: fine.
        let mut moved = writes.to_vec();
        moved.push(write(30, "b", LeaseState::Owned, Some("h1"), &[]));
        assert!(rule(&health, &hb, &moved, 2, windows(20, Some(40)), 100).is_empty());
        // A strategy that may leave a host without a lease is not judged on it.
        assert!(rule(&health, &hb, &writes, 2, windows(20, None), 100).is_empty());
    }

    #[test]
    fn liveness_owes_no_lease_while_the_eligible_leases_are_fewer_than_the_hosts() {
        let health = [mark(0, "h0", true), mark(0, "h1", true)];
        let mut hb = beats("h0", 0, 100);
        hb.extend(beats("h1", 0, 100));
        // "c" is a child of "a", which is not finished: one eligible lease for two hosts.
        let writes = [
            write(0, "a", LeaseState::Owned, Some("h0"), &[]),
            write(0, "c", LeaseState::Available, None, &["a"]),
        ];
        assert!(rule(&health, &hb, &writes, 2, windows(20, Some(40)), 100).is_empty());
        // Once "a" is finished and a second partition opens, there is one for each from 50 s.
        let mut more = writes.to_vec();
        more.push(write(50, "a", LeaseState::Finished, None, &[]));
        more.push(write(50, "d", LeaseState::Owned, Some("h0"), &[]));
        more.push(write(50, "c", LeaseState::Owned, Some("h0"), &["a"]));
        let found = rule(&health, &hb, &more, 2, windows(20, Some(40)), 100);
        assert!(
            found[0].contains("held no lease from 50s to 100s"),
            "{found:?}"
        );
    }

    #[test]
    fn liveness_windows_follow_the_settings_and_the_client() {
        let settings = crate::sim::sim_settings();
        let of = |pool: Option<PoolConfig>| LivenessWindows::of(&settings, pool.as_ref(), true);
        assert_eq!(of(Some(PoolConfig::correct(None))), windows(29, Some(90)));
        assert_eq!(
            of(Some(PoolConfig::correct(Some(s(3))))),
            windows(24, Some(65))
        );
        assert_eq!(of(None), windows(19, Some(48)));
        assert_eq!(
            LivenessWindows::of(&settings, None, false),
            windows(19, None)
        );
    }
}
