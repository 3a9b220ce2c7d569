//! The pure half of the feed source: Cosmos DB's answers mapped to the core's model, with no
//! I/O, so every rule here is tested on documented response bodies and headers
//! (`feed/tests.rs`).
//!
//! - Partition key ranges (`GET …/pkranges`: `id`, `minInclusive`, `maxExclusive`, `parents`)
//!   become partitions; ranges a split or merge removed from the listing come back as closed
//!   partitions, rebuilt from their descendants' `parents`.
//! - EPK sub-ranges (.NET v3 lease tokens `"{min}-{max}"`, [`EpkRange`]) are placed in the
//!   range holding them ([`place`]) and listed, for the leases a group holds, in place of
//!   what they cover ([`partitions_for`]).
//! - Effective partition key (EPK) ranges become [`KeyRange`]s of the 128-bit key space.
//! - Change feed pages become records with per-record continuations ([`Cursor`]), which
//!   record the span of a range read by id, so that the leases alone say where a range a
//!   merge took away was ([`merged_away`]).
//! - Session tokens give the LSN the .NET estimator counts from.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use changefeed::model::{
    Continuation, KeyRange, Partition, PartitionId, Position, Record, Timestamp,
};
use changefeed::source::LeasedPartition;
use serde_json::Value;

/// One partition key range as `GET …/pkranges` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PkRange {
    pub id: String,
    pub min: String,
    pub max: String,
    /// Every ancestor, oldest first (Cosmos DB lists the whole lineage: a range split twice
    /// names its grandparent, then its parent).
    pub parents: Vec<String>,
}

/// The id of a range, a string on Cosmos DB (`"0"`), a number on the local test server.
fn id_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The ranges of a `GET …/pkranges` body (`{"PartitionKeyRanges": [...], "_count": n}`).
pub(crate) fn parse_pkranges(body: &Value) -> Result<Vec<PkRange>, String> {
    let ranges = body
        .get("PartitionKeyRanges")
        .and_then(Value::as_array)
        .ok_or("no PartitionKeyRanges array")?;
    ranges
        .iter()
        .map(|r| {
            let id = r
                .get("id")
                .and_then(id_text)
                .ok_or(format!("a range without an id: {r}"))?;
            let text = |field: &str| {
                r.get(field)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or(format!("range {id}: no {field}"))
            };
            let parents = match r.get("parents") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(ps)) => ps
                    .iter()
                    .map(|p| {
                        id_text(p).ok_or(format!("range {id}: a parent that is not an id: {p}"))
                    })
                    .collect::<Result<_, _>>()?,
                Some(other) => return Err(format!("range {id}: parents is not an array: {other}")),
            };
            Ok(PkRange {
                min: text("minInclusive")?,
                max: text("maxExclusive")?,
                id,
                parents,
            })
        })
        .collect()
}

/// The largest EPK, `FF`: the exclusive end of the last range.
const EPK_MAX: &str = "FF";

/// An EPK (upper-case hex, most significant first) as a point of the 128-bit key space: the
/// first 32 hex digits, padded with zeros. `None` when it is not hex or longer than 128 bits
/// (hierarchical partition keys): the range is then left without a key range.
fn epk_point(epk: &str) -> Option<u128> {
    if epk.len() > 32 || !epk.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let padded = format!("{epk:0<32}");
    u128::from_str_radix(&padded, 16).ok()
}

/// The key range of the EPK range `[min, max)`: `""` is 0 and `FF` the end of the space, as
/// Kinesis hash key ranges cover it (inclusive ends).
pub(crate) fn epk_range(min: &str, max: &str) -> Option<KeyRange> {
    let start = epk_point(min)?;
    let end = if max == EPK_MAX {
        u128::MAX
    } else {
        epk_point(max)?.checked_sub(1)?
    };
    (start <= end).then_some(KeyRange { start, end })
}

fn partition_id(id: &str) -> Result<PartitionId, String> {
    PartitionId::new(id).map_err(|e| format!("partition key range {id:?}: {e}"))
}

/// For each id some listed range names as a parent, the listed ranges naming it (its
/// descendants in the listing).
fn descendants(listed: &[PkRange]) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut desc: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for r in listed {
        for p in &r.parents {
            desc.entry(p.as_str()).or_default().insert(r.id.as_str());
        }
    }
    desc
}

/// The members of `ids` that are not known ancestors of another member: the direct parents,
/// when `ids` are the ancestors a range names.
///
/// `parents` lists every ancestor, but its order is documented only for splits (oldest
/// first); after a merge a range names both merged ranges and their ancestors. So ancestry is
/// read from the listing alone, the same on every host: `g` is known to be an ancestor of `h`
/// when every listed range descending from `h` descends from `g` too and some other listed
/// range descends from `g` only (a split leaves at least two children, so along a chain of
/// splits each ancestor has strictly more descendants). That recovers every chain of splits
/// exactly and both sides of a merge whose parents came from different splits. Where the
/// listing cannot tell (two ranges merged back into the range they split from: the parent and
/// both halves have the same descendants), all of them are kept: a child waits for, and
/// starts as a merge of, a few more ancestors than it has, which reads again and never skips.
fn direct<'a>(ids: &[&'a str], desc: &BTreeMap<&str, BTreeSet<&str>>) -> Vec<&'a str> {
    let empty = BTreeSet::new();
    let of = |id: &str| desc.get(id).unwrap_or(&empty);
    let mut out: Vec<&'a str> = ids
        .iter()
        .copied()
        .filter(|g| {
            !ids.iter()
                .any(|h| h != g && of(g).len() > of(h).len() && of(h).is_subset(of(g)))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The partitions of a listing: every listed range open, its parents the direct ones among
/// its `parents` ([`direct`]); and every ancestor the listing no longer has (a split replaces
/// the parent by its children, a merge both merged ranges by one) closed, its parents its
/// direct known ancestors, its key range the one `seen` remembers from an earlier listing,
/// or else the union of its descendants' ranges when they are contiguous.
pub(crate) fn partitions(
    listed: &[PkRange],
    seen: &BTreeMap<String, KeyRange>,
) -> Result<Vec<Partition>, String> {
    let listed_ids: BTreeSet<&str> = listed.iter().map(|r| r.id.as_str()).collect();
    let desc = descendants(listed);
    let ids = |names: &[&str]| -> Result<Vec<PartitionId>, String> {
        names.iter().map(|p| partition_id(p)).collect()
    };
    let mut out = Vec::with_capacity(listed.len());
    let mut gone: BTreeMap<&str, (Vec<KeyRange>, bool)> = BTreeMap::new();
    for r in listed {
        let range = epk_range(&r.min, &r.max);
        let named: Vec<&str> = r.parents.iter().map(String::as_str).collect();
        out.push(Partition {
            id: partition_id(&r.id)?,
            parents: ids(&direct(&named, &desc))?,
            closed: false,
            key_range: range,
        });
        for ancestor in &r.parents {
            if listed_ids.contains(ancestor.as_str()) {
                continue;
            }
            let entry = gone.entry(ancestor).or_insert((Vec::new(), true));
            match range {
                Some(range) => entry.0.push(range),
                None => entry.1 = false,
            }
        }
    }
    for (id, (mut ranges, all_known)) in gone {
        let key_range = seen.get(id).copied().or_else(|| {
            ranges.sort();
            let contiguous = all_known
                && ranges
                    .windows(2)
                    .all(|w| w[0].end.checked_add(1) == Some(w[1].start) || w[0] == w[1]);
            match (contiguous, ranges.first(), ranges.last()) {
                (true, Some(first), Some(last)) => Some(KeyRange {
                    start: first.start,
                    end: last.end,
                }),
                _ => None,
            }
        });
        // Its ancestors are named by each of its descendants: candidates from one of them.
        let mine = &desc[id];
        let named: &[String] = mine
            .first()
            .and_then(|d| listed.iter().find(|r| r.id == *d))
            .map_or(&[], |r| &r.parents);
        let older: Vec<&str> = named
            .iter()
            .map(String::as_str)
            .filter(|g| {
                *g != id
                    && desc
                        .get(g)
                        .is_some_and(|d| d.len() > mine.len() && mine.is_subset(d))
            })
            .collect();
        out.push(Partition {
            id: partition_id(id)?,
            parents: ids(&direct(&older, &desc))?,
            closed: true,
            key_range,
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// The separator of an EPK range's lease token, `"{min}-{max}"`.
const EPK_SEPARATOR: char = '-';

/// An effective partition key sub-range `[min, max)` of the container, as a partition: the
/// .NET v3 processor's lease token `"{min}-{max}"` (`"-80"`, `"80-FF"`), which it gives a
/// lease when the range is not one whole partition key range (after a merge, and after a
/// split under such a lease). Partition key range ids are numbers, so the two never clash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EpkRange {
    pub min: String,
    pub max: String,
    pub range: KeyRange,
    /// The partition id when it is not `"{min}-{max}"`: a partition key range read by its id
    /// that a merge took away, standing for its span ([`merged_away`]).
    pub name: Option<String>,
}

impl EpkRange {
    /// The EPK range `id` names; `None` for a partition key range id (no `-`).
    ///
    /// # Errors
    /// Why an id with a `-` is not an EPK range (not hex, longer than 128 bits, empty or
    /// reversed).
    pub fn parse(id: &str) -> Option<Result<Self, String>> {
        let (min, max) = id.split_once(EPK_SEPARATOR)?;
        Some(Self::new(min, max).ok_or_else(|| {
            format!(
                "{id:?} is neither a partition key range id nor an effective partition key \
                 range \"{{min}}-{{max}}\" (upper-case hex, at most 32 digits, min below max)"
            )
        }))
    }

    fn new(min: &str, max: &str) -> Option<Self> {
        let upper = |s: &str| !s.bytes().any(|b| b.is_ascii_lowercase());
        if max.is_empty() || !upper(min) || !upper(max) {
            return None;
        }
        Some(Self {
            range: epk_range(min, max)?,
            min: min.to_string(),
            max: max.to_string(),
            name: None,
        })
    }

    /// The partition id: `"{min}-{max}"` (the .NET lease token), or the range id it stands
    /// for.
    pub fn id(&self) -> String {
        match &self.name {
            Some(name) => name.clone(),
            None => format!("{}{EPK_SEPARATOR}{}", self.min, self.max),
        }
    }

    fn partition(&self, parents: Vec<PartitionId>, closed: bool) -> Result<Partition, String> {
        Ok(Partition {
            id: partition_id(&self.id())?,
            parents,
            closed,
            key_range: Some(self.range),
        })
    }
}

/// Where a read of an EPK range goes: the partition key range holding it, and the EPK
/// bounds to send (`None` when the range is that whole partition key range).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub range_id: String,
    pub epk: Option<(String, String)>,
}

/// Where an EPK range is in a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Inside one partition key range: readable there.
    On(Target),
    /// Across several (a split under it): its parts in each, in key order. A reader of it
    /// has ended; the parts continue.
    Split(Vec<EpkRange>),
}

fn overlaps(a: KeyRange, b: KeyRange) -> bool {
    a.start <= b.end && b.start <= a.end
}

/// The listed ranges overlapping `epk`, in key order, each with its key range.
///
/// # Errors
/// A listed range without a 128-bit EPK range (hierarchical partition keys: EPK ranges are
/// not mapped there), or no range at all (a listing that does not cover the key space).
fn overlapping<'a>(
    listed: &'a [PkRange],
    epk: &EpkRange,
) -> Result<Vec<(&'a PkRange, KeyRange)>, String> {
    let mut found = Vec::new();
    for r in listed {
        let range = epk_range(&r.min, &r.max).ok_or_else(|| {
            format!(
                "partition key range {} [{:?}, {:?}) has no 128-bit effective partition key \
                 range, so EPK range {} cannot be placed",
                r.id,
                r.min,
                r.max,
                epk.id()
            )
        })?;
        if overlaps(range, epk.range) {
            found.push((r, range));
        }
    }
    found.sort_by_key(|(_, range)| range.start);
    if found.is_empty() {
        return Err(format!(
            "no partition key range holds EPK range {}",
            epk.id()
        ));
    }
    Ok(found)
}

/// Where `epk` is in `listed` (the .NET SDK's three cases: one whole range, read by its id;
/// a part of one, read by its id with `x-ms-start-epk` / `x-ms-end-epk`; several, a split).
///
/// # Errors
/// As [`overlapping`].
pub(crate) fn place(listed: &[PkRange], epk: &EpkRange) -> Result<Placement, String> {
    let found = overlapping(listed, epk)?;
    if let [(r, range)] = found[..] {
        let epk_bounds = (range != epk.range).then(|| (epk.min.clone(), epk.max.clone()));
        return Ok(Placement::On(Target {
            range_id: r.id.clone(),
            epk: epk_bounds,
        }));
    }
    Ok(Placement::Split(cut(epk, &found)))
}

/// `epk` cut at the boundaries of the ranges `found` overlapping it (in key order).
fn cut(epk: &EpkRange, found: &[(&PkRange, KeyRange)]) -> Vec<EpkRange> {
    found
        .iter()
        .map(|(r, range)| {
            let (min, start) = if range.start > epk.range.start {
                (r.min.clone(), range.start)
            } else {
                (epk.min.clone(), epk.range.start)
            };
            let (max, end) = if range.end < epk.range.end {
                (r.max.clone(), range.end)
            } else {
                (epk.max.clone(), epk.range.end)
            };
            EpkRange {
                min,
                max,
                range: KeyRange { start, end },
                name: None,
            }
        })
        .collect()
}

/// The parts of `outer` that none of `inner` covers (the `inner` ranges disjoint, possibly
/// reaching past `outer`), in key order.
fn gaps(outer: &EpkRange, inner: &[&EpkRange]) -> Vec<EpkRange> {
    let mut inner: Vec<&EpkRange> = inner
        .iter()
        .copied()
        .filter(|e| overlaps(e.range, outer.range))
        .collect();
    inner.sort_by_key(|e| e.range.start);
    let mut out = Vec::new();
    // Where the next gap would start (`None`: past the end of the key space).
    let (mut min, mut start) = (outer.min.clone(), Some(outer.range.start));
    for e in inner {
        if let Some(s) = start.filter(|s| *s < e.range.start) {
            out.push(EpkRange {
                min: min.clone(),
                max: e.min.clone(),
                range: KeyRange {
                    start: s,
                    end: e.range.start - 1,
                },
                name: None,
            });
        }
        let after = e.range.end.checked_add(1);
        if start.is_some_and(|s| after.is_none_or(|a| a > s)) {
            (min, start) = (e.max.clone(), after);
        }
    }
    if let Some(s) = start.filter(|s| *s <= outer.range.end) {
        out.push(EpkRange {
            min,
            max: outer.max.clone(),
            range: KeyRange {
                start: s,
                end: outer.range.end,
            },
            name: None,
        });
    }
    out
}

/// The partitions for a group holding leases on the EPK ranges `leased` (and on any
/// partition key ranges): [`partitions`], with the EPK ranges in place of what they cover.
///
/// - A leased EPK range is a partition; its parent the smallest other leased one holding it
///   (the one it was split from, until that lease is deleted). It is **open** while it lies
///   in one partition key range (after a split at its edge or a merge around it, the .NET
///   processor's "redirect": the same partition, read on the range now holding it), and
///   **closed** once it spans several or has leased parts: its children are then its leased
///   parts, and the rest of it cut at the partition key range boundaries (`"{min}-{max}"`
///   each, open), which start at its final continuation (one parent), as the .NET processor
///   splits an EPK lease.
/// - A partition key range wholly covered by those EPK ranges is left out (with ancestors
///   only it names): it is read through them. One they cover in part (a merge of a range
///   read by EPK ranges with one that is not) is left out too, and its uncovered parts are
///   open EPK partitions whose parents are the range's own (a merge: from the beginning).
/// - Without EPK leases this is [`partitions`].
///
/// # Errors
/// As [`partitions`] and [`place`].
pub(crate) fn partitions_for(
    listed: &[PkRange],
    seen: &BTreeMap<String, KeyRange>,
    leased: &[EpkRange],
) -> Result<Vec<Partition>, String> {
    if leased.is_empty() {
        return partitions(listed, seen);
    }
    let mut leased: Vec<&EpkRange> = leased.iter().collect();
    // By start, the larger first, a range read by id before an EPK range of its span.
    leased.sort_by(|a, b| {
        (a.range.start, b.range.end, a.name.is_none()).cmp(&(
            b.range.start,
            a.range.end,
            b.name.is_none(),
        ))
    });
    leased.dedup_by(|a, b| a.range == b.range && a.name == b.name);
    // The smallest other leased range holding each one; a merged-away range read by id
    // holds the EPK range of its own span (its child).
    let parent_of = |e: &EpkRange| {
        leased
            .iter()
            .filter(|o| o.range != e.range || (o.name.is_some() && e.name.is_none()))
            .filter(|o| o.range.start <= e.range.start && e.range.end <= o.range.end)
            .min_by_key(|o| (o.range.end - o.range.start, o.name.is_none()))
            .copied()
    };
    let mut out = Vec::new();
    for e in &leased {
        let parent: Vec<PartitionId> = parent_of(e)
            .map(|p| partition_id(&p.id()))
            .transpose()?
            .into_iter()
            .collect();
        let parts: Vec<&EpkRange> = leased
            .iter()
            .copied()
            .filter(|c| parent_of(c).is_some_and(|p| std::ptr::eq(p, *e)))
            .collect();
        let rest: Vec<EpkRange> = match place(listed, e)? {
            // A merged-away range read by id ended at its 410: its span goes on in its parts.
            Placement::On(_) if parts.is_empty() && e.name.is_none() => Vec::new(),
            _ => gaps(e, &parts),
        };
        let closed = e.name.is_some() || !parts.is_empty() || !rest.is_empty();
        out.push(e.partition(parent, closed)?);
        let me = vec![partition_id(&e.id())?];
        for gap in &rest {
            for piece in cut(gap, &overlapping(listed, gap)?) {
                out.push(piece.partition(me.clone(), false)?);
            }
        }
    }
    // What the leased EPK ranges cover: the outermost ones (disjoint in a lease set the
    // .NET processor or this one left).
    let roots: Vec<&EpkRange> = leased
        .iter()
        .copied()
        .filter(|e| parent_of(e).is_none())
        .collect();
    let mut physical: Vec<PkRange> = Vec::new();
    let mut partly: BTreeMap<&str, Vec<EpkRange>> = BTreeMap::new();
    for r in listed {
        let Some(range) = epk_range(&r.min, &r.max) else {
            physical.push(r.clone());
            continue;
        };
        if !roots.iter().any(|e| overlaps(e.range, range)) {
            physical.push(r.clone());
            continue;
        }
        let whole = EpkRange {
            min: r.min.clone(),
            max: r.max.clone(),
            range,
            name: None,
        };
        let rest = gaps(&whole, &roots);
        if !rest.is_empty() {
            physical.push(r.clone());
            partly.insert(r.id.as_str(), rest);
        }
    }
    let named: BTreeSet<&str> = leased.iter().filter_map(|e| e.name.as_deref()).collect();
    for p in partitions(&physical, seen)? {
        if named.contains(p.id.as_str()) {
            continue;
        }
        match partly.get(p.id.as_str()) {
            None => out.push(p),
            Some(rest) => {
                for part in rest {
                    out.push(part.partition(p.parents.clone(), false)?);
                }
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// The continuation a reader of a leased partition starts after, when it has one (its
/// checkpoint, or the start it inherited from a parent: records of its keys up to there
/// were delivered); `None` for a lease at the beginning, now or a time, or a row that cannot
/// be read.
fn continuation_of(leased: &LeasedPartition) -> Option<&str> {
    match &leased.position {
        Some(Position::Continuation(c)) => Some(c.as_str()),
        _ => None,
    }
}

/// A leased range a merge took away whose span nothing records: its id and why it cannot
/// be placed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unplaced {
    pub partition: String,
    pub reason: String,
}

/// The partitions among `leased` that a merge took away, each as the EPK range of its span
/// named by its id: a partition key range id, not listed any more, its span recorded in its
/// lease's continuation ([`Cursor`]), and some listed range overlapping that span reaching
/// beyond it (a split leaves only ranges inside it: those are its children as listed), none
/// of them leased (a merged range that has a lease is read as the merge child it was
/// planned as). [`partitions_for`] lists each closed, its children the pieces of its span
/// cut at the listed ranges (`"{min}-{max}"` EPK partitions), which start at its final
/// continuation as a split's children do: the .NET processor's merge, where the lease keeps
/// its continuation and reads its span of the merged range. The answer depends only on the
/// listing and the leases, so every host plans alike.
///
/// A range leased without a continuation (never read, nor started at a parent's) needs no
/// span: nothing of its keys was delivered, and the part of the merged range it held is a
/// merge child read from the beginning, which is right.
///
/// # Errors
/// [`Unplaced`] for a leased range with a continuation that records no span of its own (a
/// checkpoint of an earlier version, or a start inherited from its parent, never read since)
/// which is the parent of a merge (a listed or gone range with several parents) that has no
/// lease: planning that merge child would read the range's keys again from the beginning.
pub(crate) fn merged_away(
    listed: &[PkRange],
    leased: &[LeasedPartition],
) -> Result<Vec<EpkRange>, Unplaced> {
    let listed_ids: BTreeSet<&str> = listed.iter().map(|r| r.id.as_str()).collect();
    let leased_ids: BTreeSet<&str> = leased.iter().map(|l| l.partition.as_str()).collect();
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for held in leased {
        let id = held.partition.as_str();
        if listed_ids.contains(id) || EpkRange::parse(id).is_some() {
            continue;
        }
        let continuation = continuation_of(held);
        let recorded = continuation
            .and_then(|c| Cursor::parse(c).ok())
            .and_then(|c| c.span_of(id).and_then(|(min, max)| EpkRange::new(min, max)));
        let Some(mut span) = recorded else {
            if let Some(c) = continuation {
                unknown.push((id, c));
            }
            continue;
        };
        let over: Vec<(&PkRange, KeyRange)> = listed
            .iter()
            .filter_map(|r| epk_range(&r.min, &r.max).map(|range| (r, range)))
            .filter(|(_, range)| overlaps(*range, span.range))
            .collect();
        let beyond = over
            .iter()
            .any(|(_, range)| range.start < span.range.start || range.end > span.range.end);
        // A merged range that already has a lease (planned as a merge child before the span
        // was recorded) is read as such: its span is not read a second time.
        let merged_leased = over.iter().any(|(r, _)| leased_ids.contains(r.id.as_str()));
        if beyond && !merged_leased {
            span.name = Some(id.to_string());
            out.push(span);
        }
    }
    if unknown.is_empty() {
        return Ok(out);
    }
    let plain = partitions(listed, &BTreeMap::new()).map_err(|reason| Unplaced {
        partition: "(partition key ranges)".into(),
        reason,
    })?;
    for (id, continuation) in unknown {
        let merge = plain.iter().find(|p| {
            p.parents.len() > 1
                && p.parents.iter().any(|q| q.as_str() == id)
                && !leased_ids.contains(p.id.as_str())
        });
        if let Some(merge) = merge {
            let parents: Vec<&str> = merge.parents.iter().map(PartitionId::as_str).collect();
            let placeholder = ("MIN".to_string(), "MAX".to_string());
            let go_on = Cursor::parse(continuation).map_or_else(
                |_| String::new(),
                |c| {
                    format!(
                        "to `{}` (MIN-MAX the range's effective partition key bounds) to go \
                         on there, or ",
                        c.written_by(id, &placeholder).to_continuation()
                    )
                },
            );
            return Err(Unplaced {
                partition: id.to_string(),
                reason: format!(
                    "partition key range {id} is gone, a parent of the merge {} (of {}), and \
                     its lease's continuation {continuation} records no span of {id} (written \
                     before continuations recorded spans, or inherited from its parent and not \
                     read since): its keys would be read again from the beginning, so nothing \
                     is planned. Reset the lease (`changefeed reset`) {go_on}to `beginning` \
                     to read them again",
                    merge.id,
                    parents.join(", ")
                ),
            });
        }
    }
    Ok(out)
}

/// The EPK bounds `(min, max)` of a partition key range: `[min, max)`.
pub(crate) type Span = (String, String);

/// Where a reader stands: after the change feed ETag `etag` (`"42"`, the LSN the next read
/// starts after), with the first `skip` documents of the next LSN already done; and, from a
/// reader of a range read by id that knew it, that range's EPK span.
///
/// A change feed page ends on an ETag, but documents written by one transaction (a
/// transactional batch, a stored procedure) share one `_lsn`, and a reader may stop inside
/// such a group: the continuation of a document followed by one of the same LSN is
/// `"LSN-1";skip=K;range=ID` (after the LSN before, the first K of the group done in range
/// ID), so that resuming there neither skips the rest of the group nor repeats its start.
/// Every other document's continuation is its own `"LSN"`, and a page's last document's is
/// the page's ETag. The skip holds only in the range that counted it: a child range starting
/// at its parent's continuation ([`Cursor::in_range`]) holds only some of the group's
/// documents, so there the whole group is read again (at least once, never a gap).
///
/// A reader of a partition key range read by id that knows the range's EPK span (it listed
/// the range when it opened) writes it into every continuation: `"42";range=ID;span=MIN-MAX`
/// (`"41";skip=2;range=ID;span=MIN-MAX` inside a transaction). A merge takes the range out of
/// the listing, and with it the only other record of where the range was; the span in the
/// lease's checkpoint lets any process continue the range in its span ([`merged_away`]).
/// Cursors without a span (`"42"`, as .NET leases and earlier versions hold them) are read as
/// before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub etag: String,
    pub skip: u32,
    /// The partition whose reader wrote it, where it says more than the ETag (a skip, a
    /// span); empty otherwise.
    pub range: String,
    /// The EPK span of partition key range `range`, as its reader knew it.
    pub span: Option<Span>,
}

const SKIP: &str = ";skip=";
const RANGE: &str = ";range=";
const SPAN: &str = ";span=";

impl Cursor {
    /// The cursor a continuation stands for.
    ///
    /// # Errors
    /// Why the text is not a continuation of this source.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (etag, rest) = text.split_at(text.find(';').unwrap_or(text.len()));
        let (rest, span) = match rest.split_once(SPAN) {
            Some((before, span)) => {
                let parsed = span
                    .split_once(EPK_SEPARATOR)
                    .and_then(|(min, max)| EpkRange::new(min, max))
                    .ok_or(format!(
                        "{SPAN}{span} is not an effective partition key range MIN-MAX \
                         (upper-case hex, min below max)"
                    ))?;
                (before, Some((parsed.min, parsed.max)))
            }
            None => (rest, None),
        };
        let (rest, range) = match rest.split_once(RANGE) {
            Some((before, range)) if !range.is_empty() => (before, range.to_string()),
            Some((_, _)) => return Err(format!("{RANGE} names no range: {text}")),
            None => (rest, String::new()),
        };
        let skip = match rest.strip_prefix(SKIP) {
            Some(skip) => skip
                .parse::<u32>()
                .ok()
                .filter(|k| *k > 0)
                .ok_or(format!("{SKIP}{skip} is not a positive count"))?,
            None if rest.is_empty() => 0,
            None => {
                return Err(format!(
                    "{rest:?} is neither {SKIP}N, {RANGE}ID nor {SPAN}MIN-MAX"
                ))
            }
        };
        if range.is_empty() && (skip > 0 || span.is_some()) {
            let what = if skip > 0 { SKIP } else { SPAN };
            return Err(format!("{what} needs the {RANGE}ID it was counted in"));
        }
        if !range.is_empty() && skip == 0 && span.is_none() {
            return Err(format!(
                "{RANGE}{range} with neither {SKIP}N nor {SPAN}MIN-MAX"
            ));
        }
        let digits = etag
            .strip_prefix('"')
            .and_then(|e| e.strip_suffix('"'))
            .unwrap_or(etag);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 20 {
            return Err(
                "a Cosmos DB change feed continuation is the ETag of a change feed page, a \
                 quoted LSN such as \"42\" (optionally followed by ;skip=N;range=ID and \
                 ;span=MIN-MAX)"
                    .into(),
            );
        }
        Ok(Self {
            etag: etag.to_string(),
            skip,
            range,
            span,
        })
    }

    /// After `etag` with nothing done beyond it.
    pub fn after(etag: impl Into<String>) -> Self {
        Self {
            etag: etag.into(),
            skip: 0,
            range: String::new(),
            span: None,
        }
    }

    /// This cursor for a reader of range `range`: its skip dropped when counted in another
    /// range (a child starting at its parent's continuation).
    pub fn in_range(self, range: &str) -> Self {
        if self.skip > 0 && self.range != range {
            Self::after(self.etag)
        } else {
            self
        }
    }

    /// This place as the reader of range `range`, whose span is `span`, writes it: its skip
    /// kept where `range` counted it, the span recorded.
    pub fn written_by(self, range: &str, span: &Span) -> Self {
        let skip = if self.range == range { self.skip } else { 0 };
        Self {
            etag: self.etag,
            skip,
            range: range.to_string(),
            span: Some(span.clone()),
        }
    }

    /// The span of range `range` this cursor records, if its reader wrote one.
    pub fn span_of(&self, range: &str) -> Option<&Span> {
        self.span.as_ref().filter(|_| self.range == range)
    }

    /// The continuation text.
    pub fn to_continuation(&self) -> Continuation {
        let mut text = self.etag.clone();
        if self.skip > 0 {
            text.push_str(&format!("{SKIP}{}", self.skip));
        }
        if self.skip > 0 || self.span.is_some() {
            text.push_str(&format!("{RANGE}{}", self.range));
        }
        if let Some((min, max)) = &self.span {
            text.push_str(&format!("{SPAN}{min}{EPK_SEPARATOR}{max}"));
        }
        Continuation::new(text)
    }
}

/// Where a reader of `partition` starts from `cursor`: [`Cursor::in_range`], except that a
/// skip counted in a range read by id holds in the EPK range of that range's whole span (a
/// merged-away range's child, [`merged_away`]): it reads exactly the same keys, so the same
/// documents of the transaction, and nothing of it is read twice. The span is the one the
/// cursor records (none: the skip is dropped, and the transaction read again).
pub(crate) fn start_cursor(cursor: Cursor, partition: &str) -> Cursor {
    let same_span = EpkRange::parse(partition)
        .and_then(Result::ok)
        .zip(cursor.span.as_ref())
        .is_some_and(|(e, (min, max))| e.min == *min && e.max == *max);
    if same_span {
        cursor
    } else {
        cursor.in_range(partition)
    }
}

/// The LSN of a change feed document (`_lsn`, a number; a string in some answers).
fn lsn_of(doc: &Value) -> Option<u64> {
    match doc.get("_lsn")? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// The partition key of `doc` under the container's key paths (`/tenant`, `/a/b`): the value
/// as text for one path (a string as is, anything else as JSON), a JSON array of the values
/// for hierarchical keys; empty where the document has none.
pub(crate) fn partition_key(doc: &Value, paths: &[String]) -> String {
    let value = |path: &str| doc.pointer(path).cloned().unwrap_or(Value::Null);
    match paths {
        [] => String::new(),
        [one] => match value(one) {
            Value::String(s) => s,
            Value::Null => String::new(),
            other => other.to_string(),
        },
        many => Value::Array(many.iter().map(|p| value(p)).collect()).to_string(),
    }
}

/// The records of one change feed page of range `range` read from `from`, each with its
/// continuation (see [`Cursor`]; with `span`, the range's span, when known): `from.skip`
/// documents of the first LSN are dropped first (they were done).
///
/// # Errors
/// A document without a numeric `_lsn`, or LSNs going backwards.
pub(crate) fn page_records(
    docs: Vec<Value>,
    range: &str,
    span: Option<&Span>,
    page_etag: &str,
    from: &Cursor,
    key_paths: &[String],
) -> Result<Vec<Record>, String> {
    let lsns: Vec<u64> = docs
        .iter()
        .map(|d| {
            lsn_of(d).ok_or_else(|| {
                format!(
                    "a change feed document without a numeric _lsn: id {}",
                    d.get("id").unwrap_or(&Value::Null)
                )
            })
        })
        .collect::<Result<_, _>>()?;
    if lsns.windows(2).any(|w| w[1] < w[0]) {
        return Err(format!("change feed documents out of LSN order: {lsns:?}"));
    }
    let first = lsns.first().copied();
    let done = lsns
        .iter()
        .take(from.skip as usize)
        .take_while(|l| Some(**l) == first)
        .count();
    let n = docs.len();
    let mut records = Vec::with_capacity(n - done);
    let mut in_group = 0u32;
    for (i, doc) in docs.into_iter().enumerate() {
        let lsn = lsns[i];
        in_group = if i > 0 && lsns[i - 1] == lsn {
            in_group + 1
        } else {
            1
        };
        if i < done {
            continue;
        }
        let cursor = if i + 1 == n {
            Cursor::after(page_etag)
        } else if lsns[i + 1] != lsn {
            Cursor::after(format!("\"{lsn}\""))
        } else {
            Cursor {
                etag: format!("\"{}\"", lsn.saturating_sub(1)),
                skip: in_group,
                range: range.to_string(),
                span: None,
            }
        };
        let cursor = match span {
            Some(span) => cursor.written_by(range, span),
            None => cursor,
        };
        let timestamp = doc
            .get("_ts")
            .and_then(Value::as_i64)
            .map(|s| Timestamp(s.saturating_mul(1000)));
        let key = partition_key(&doc, key_paths);
        let data = Bytes::from(serde_json::to_vec(&doc).map_err(|e| e.to_string())?);
        records.push(Record {
            key,
            data,
            continuation: cursor.to_continuation(),
            timestamp,
        });
    }
    Ok(records)
}

/// The LSN a session token ends at, as the .NET estimator reads it: after the range id and
/// `:`, the second `#` segment (`0:1#1234#3=1200` → 1234), or the whole rest in the old form
/// (`0:1234`). Of a compound token (`0:…,1:…`) the part of range `range` (or the first).
pub(crate) fn session_lsn(token: &str, range: &str) -> Option<u64> {
    let part = token
        .split(',')
        .find(|t| t.split_once(':').is_some_and(|(id, _)| id == range))
        .or_else(|| token.split(',').next())?;
    let rest = part.split_once(':').map_or(part, |(_, rest)| rest);
    let segments: Vec<&str> = rest.split('#').collect();
    let lsn = if segments.len() < 2 {
        segments[0]
    } else {
        segments[1]
    };
    lsn.trim().parse().ok()
}

/// The .NET estimator's remaining work of a range: the session LSN minus the LSN before the
/// first unread document (0 when nothing is unread). It counts LSNs, not documents: deletes
/// and other writes of the physical partition move it too, so it is an estimate.
pub(crate) fn estimate(session_lsn: u64, first_unread_lsn: Option<u64>) -> u64 {
    match first_unread_lsn {
        Some(first) => session_lsn.saturating_sub(first.saturating_sub(1)),
        None => 0,
    }
}

/// The LSN of the first document of a page, for [`estimate`].
pub(crate) fn first_lsn(docs: &[Value]) -> Option<u64> {
    docs.first().and_then(lsn_of)
}

/// The `If-Modified-Since` value for a start at `t` (ms): an HTTP date, which has whole
/// seconds, one second before the second `t` falls in, so that no change at or after `t` is
/// missed whether Cosmos DB compares exclusively or not (a reader may see up to two seconds
/// of changes before `t`).
pub(crate) fn if_modified_since(t: Timestamp) -> String {
    let secs = t.millis().div_euclid(1000).saturating_sub(1).max(0);
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs as u64);
    httpdate::fmt_http_date(when)
}
