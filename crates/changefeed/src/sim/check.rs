//! The invariant checker: reads a run's delivery ledger and lease write history and reports
//! every broken rule of `DESIGN.md` ("Correctness rules").
//!
//! - **lost**: every record written is delivered at least once (rule 4).
//! - **order**: per partition, a record is delivered only after every earlier record of its
//!   partition (rule 4).
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
//!
//! "Before" and "after" are the order things happened in: virtual time, and at one instant the
//! order the single-threaded run made them in ([`Delivery::seq`]). A record counts as
//! delivered when the handler applied it, not when the call began: a call dropped halfway
//! delivered the records it applied.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::world::{Delivery, WriteRec};
use crate::model::PartitionId;

/// One broken rule, with what shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The rule: `lost`, `order`, `parents-first`, `continuation-backwards`, `duplicate`,
    /// `two-deliverers`, `overlap`.
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
}

#[derive(Default)]
struct PartState {
    /// Records of the partition delivered in order so far (a prefix).
    prefix: usize,
    /// Total records written to the partition.
    len: usize,
    /// Delivery sequence number at which the prefix became complete.
    complete_seq: Option<u64>,
    current: Option<u64>,
    current_host: String,
    current_since: std::time::Duration,
    retired: BTreeSet<u64>,
    started: bool,
}

#[derive(Default)]
struct EpochState {
    fresh_seen: bool,
    duplicates: usize,
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

    // Index of each record in its partition.
    let mut parts: BTreeMap<&PartitionId, PartState> = BTreeMap::new();
    let mut index: Vec<usize> = Vec::with_capacity(input.written.len());
    for p in input.written {
        let st = parts.entry(p).or_default();
        index.push(st.len);
        st.len += 1;
    }
    let mut order: Vec<&Delivery> = input.deliveries.iter().collect();
    order.sort_by_key(|d| d.seq);
    let mut epochs: BTreeMap<u64, EpochState> = BTreeMap::new();
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
                        .map(|p| (p.prefix, p.len))
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
        let ep = epochs.entry(d.epoch).or_default();
        if i < st.prefix {
            if ep.fresh_seen {
                report(
                    "duplicate",
                    format!(
                        "partition {}: {} delivered record {} again in the middle of its ownership (epoch {}) at {:?}",
                        d.partition, d.host, d.record, d.epoch, d.at
                    ),
                );
            }
            ep.duplicates += 1;
            if input.max_duplicates.is_some_and(|m| ep.duplicates == m + 1) {
                report(
                    "duplicate",
                    format!(
                        "partition {}: {} redelivered more than one batch ({} records) after taking over (epoch {}) at {:?}",
                        d.partition,
                        d.host,
                        ep.duplicates,
                        d.epoch,
                        d.at
                    ),
                );
            }
        } else if i == st.prefix {
            ep.fresh_seen = true;
            st.prefix += 1;
            if st.prefix == st.len {
                st.complete_seq = Some(d.seq);
            }
        } else {
            report(
                "order",
                format!(
                    "partition {}: {} delivered record {} (#{i}) at {:?} before #{} of the partition",
                    d.partition, d.host, d.record, d.at, st.prefix
                ),
            );
        }
    }
    for (p, st) in &parts {
        if st.prefix < st.len {
            let missing = input
                .written
                .iter()
                .enumerate()
                .filter(|(_, q)| q == p)
                .nth(st.prefix)
                .map(|(id, _)| id)
                .unwrap_or_default();
            report(
                "lost",
                format!(
                    "partition {p}: {} of {} records never delivered in order, first missing record {missing}",
                    st.len - st.prefix,
                    st.len
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
