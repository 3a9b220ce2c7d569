//! Partition lineage: which leases to create when a feed splits and merges, and which
//! finished leases may go. Pure rules: no I/O, no clock, no async.
//!
//! This module owns the decisions of KCL's lease lifecycle (DISCOVERY → CREATION → PROCESSING
//! → SHARD_END → DELETION, see `reference/kcl-lease-lifecycle.md`): given the source's
//! partition list, the existing leases and the configured start position, [`plan`] returns the
//! leases to create and where each starts; [`deletable`] returns the finished leases whose
//! children have all started; [`covers_key_space`] tells the sync task when listing the
//! partitions can be skipped. Listing partitions, writing leases and timing belong to the
//! processor's sync task; marking a lease finished belongs to its worker.
//!
//! # The rules
//!
//! Partitions form a graph through their parents. A partition is **settled** when its lease is
//! finished, or when it has no lease but one of its descendants has (the fleet is already past
//! it: processed and cleaned up, or skipped by the start position). The **leaves** are the
//! partitions without an open parent that are open or have no children.
//!
//! | # | a partition without a lease … | gets a lease starting at |
//! |---|---|---|
//! | 1 | that is a root (no listed parent) reached from a leaf, when the start is `Beginning` or `AtTime` | the start position |
//! | 2 | that is a parent of a partition the fleet will reach, when no lease exists or will exist on its own ancestry (`Now` only: the gap next to a leased sibling) | `Beginning` (`AtTime(t)` for an `AtTime` start) |
//! | 3 | that is an open leaf the fleet will not reach otherwise (`Now`) | `Now` |
//! | 4 | whose parents are all closed and settled (every parent finished: the child is ready) | `Beginning` (`AtTime(t)` for an `AtTime` start); the parent's final continuation under [`ChildStart::ParentContinuation`] (tests `child_of_one_parent_continues_from_its_final_continuation`, `merge_child_starts_at_the_beginning_even_when_continuing`) |
//!
//! Where a rule-4 child starts depends on the source ([`ChildStart`], from
//! [`crate::source::FeedSource::child_start`]). With [`ChildStart::Beginning`] (the default:
//! Kinesis, the in-memory and SQLite feeds, where a child holds only what was written after
//! the split) it starts as the table says. With [`ChildStart::ParentContinuation`] (Cosmos DB,
//! where a child key range also holds every change of its keys from before the split, so
//! reading it from its beginning would deliver the parent's records again) a child of **one**
//! parent starts where that parent's finished lease ended ([`inherited_start`]): at its last
//! continuation, or at the parent's own start when it never checkpointed and did not start at
//! `Now`; otherwise as the table says. A child of **several** parents (a merge) starts as the
//! table says: the core cannot order two opaque continuations, and the earlier of two
//! positions is the only start that loses nothing, so it falls back to the beginning (or
//! `AtTime(t)`), which delivers the parents' records again (at least once, never a gap). This
//! is what the .NET change feed processor does on a split (the child leases take the parent's
//! continuation token).
//!
//! Nothing else is created: not a settled partition, not a child while a parent is still
//! being read, never a child at `Now`. The walk from the leaves stops at partitions that have
//! a lease, as KCL's `HierarchicalShardSyncer` does, so one pass creates one level.
//!
//! `AtTime(t)` follows KCL: with leases already present it walks back like `Beginning` and
//! starts every lease it creates at `AtTime(t)`; a reader finds nothing at or after `t` in a
//! partition that closed before `t`, so such a lease finishes at once and its children
//! follow. With an **empty** lease table, where [`Input::closed_at`] knows that a closed
//! partition closed before `t`, that partition is skipped and its children are needed
//! instead (KCL lists shards with an `AT_TIMESTAMP` filter only to seed an empty table).
//!
//! A parent the listing lacks was trimmed by retention and counts as finished
//! ([`MissingParents::Finished`], KCL's behaviour), or is corrupt data
//! ([`MissingParents::Error`]). A partition that names itself, sits on a cycle, names an
//! unknown parent under [`MissingParents::Error`], or is listed twice is reported as a
//! [`LineageError`] naming it; no lease is created for it or any of its descendants, and the
//! rest of the plan stands.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{KeyRange, Lease, LeaseState, Partition, PartitionId, Position, Timestamp};

mod ready;

pub use ready::ready_to_read;
pub(crate) use ready::{ready_under, ParentsRule};

#[cfg(test)]
mod tests;

/// The lease property holding a lease's key range, as `START..=END` in decimal. The sync task
/// writes it when it creates a lease for a partition with a range; [`covers_key_space`] reads
/// it.
pub const RANGE_PROPERTY: &str = "changefeed.range";

/// How to read a parent id the partition list does not contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingParents {
    /// The parent was trimmed by retention: nothing of it can be read any more, so it counts
    /// as finished (KCL's behaviour). The default.
    #[default]
    Finished,
    /// The source never trims, so a missing parent is corrupt data: the child is reported and
    /// gets no lease.
    Error,
}

/// Partition data the rules refuse. Each names the partition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LineageError {
    /// The same id is listed more than once.
    #[error("partition {partition}: listed more than once")]
    Duplicate {
        /// The partition id.
        partition: PartitionId,
    },
    /// A partition names itself as a parent.
    #[error("partition {partition}: names itself as a parent")]
    SelfParent {
        /// The partition id.
        partition: PartitionId,
    },
    /// A partition names a parent the list does not contain (under [`MissingParents::Error`]).
    #[error("partition {partition}: names unknown parent {parent}")]
    UnknownParent {
        /// The partition id.
        partition: PartitionId,
        /// The parent it names.
        parent: PartitionId,
    },
    /// Parents form a cycle.
    #[error("partition {partition}: its parents form a cycle ({})", cycle_text(.cycle))]
    Cycle {
        /// The smallest id on the cycle.
        partition: PartitionId,
        /// The cycle, each partition a parent of the one before.
        cycle: Vec<PartitionId>,
    },
    /// A partition descends from one reported above, so its place in the lineage is unknown.
    #[error("partition {partition}: descends from corrupt partition {from}")]
    Descends {
        /// The partition id.
        partition: PartitionId,
        /// The corrupt ancestor.
        from: PartitionId,
    },
}

impl LineageError {
    /// The partition the error is about.
    pub fn partition(&self) -> &PartitionId {
        match self {
            LineageError::Duplicate { partition }
            | LineageError::SelfParent { partition }
            | LineageError::UnknownParent { partition, .. }
            | LineageError::Cycle { partition, .. }
            | LineageError::Descends { partition, .. } => partition,
        }
    }
}

fn cycle_text(cycle: &[PartitionId]) -> String {
    let mut text: Vec<&str> = cycle.iter().map(PartitionId::as_str).collect();
    if let Some(first) = cycle.first() {
        text.push(first.as_str());
    }
    text.join(" → ")
}

/// Where a child of finished parents (rule 4) starts: a property of the source
/// ([`crate::source::FeedSource::child_start`]). See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChildStart {
    /// At the beginning of the child (or the group's `AtTime(t)`): the child holds only what
    /// was written to it after the split or merge. The default.
    #[default]
    Beginning,
    /// A child of one parent continues from that parent's final continuation (a Cosmos DB
    /// partition key range, which also holds its keys' changes from before the split).
    ParentContinuation,
}

/// Where a child continuing from its one finished parent `parent` starts under
/// [`ChildStart::ParentContinuation`]: after the parent's last checkpoint; with none, at the
/// parent's own start unless that was `Now` (a position of the moment the parent's reader
/// opened, long gone: `None`, the caller falls back to the beginning, which loses nothing).
pub fn inherited_start(parent: &Lease) -> Option<Position> {
    match parent.resume_position() {
        Position::Now => None,
        position => Some(position),
    }
}

/// What the rules look at: one snapshot of the source and the lease table.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    /// Every partition the source lists, open and closed.
    pub partitions: &'a [Partition],
    /// Every lease of the group.
    pub leases: &'a [Lease],
    /// The configured start position of the group.
    pub start: &'a Position,
    /// When closed partitions closed, where the source knows (used only for an `AtTime` start
    /// with an empty lease table; see the module docs).
    pub closed_at: BTreeMap<PartitionId, Timestamp>,
    /// How to read a parent the list lacks.
    pub missing_parents: MissingParents,
    /// Where a child of finished parents starts (rule 4).
    pub child_start: ChildStart,
}

impl<'a> Input<'a> {
    /// A snapshot with no close times and the default [`MissingParents::Finished`].
    pub fn new(partitions: &'a [Partition], leases: &'a [Lease], start: &'a Position) -> Self {
        Self {
            partitions,
            leases,
            start,
            closed_at: BTreeMap::new(),
            missing_parents: MissingParents::default(),
            child_start: ChildStart::default(),
        }
    }

    /// Sets the close times.
    pub fn with_closed_at(mut self, closed_at: BTreeMap<PartitionId, Timestamp>) -> Self {
        self.closed_at = closed_at;
        self
    }

    /// Sets how missing parents are read.
    pub fn with_missing_parents(mut self, missing_parents: MissingParents) -> Self {
        self.missing_parents = missing_parents;
        self
    }

    /// Sets where a child of finished parents starts.
    pub fn with_child_start(mut self, child_start: ChildStart) -> Self {
        self.child_start = child_start;
        self
    }
}

/// One lease to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    /// Its partition.
    pub partition: PartitionId,
    /// The partition's parents as the source lists them (the processor keeps the lease
    /// ineligible until every parent lease is finished or gone).
    pub parents: Vec<PartitionId>,
    /// Where reading starts.
    pub start: Position,
    /// The partition's key range, if the source gave one.
    pub key_range: Option<KeyRange>,
}

/// What [`plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Leases to create, ordered by partition id.
    pub create: Vec<NewLease>,
    /// Partitions refused as corrupt, each with what is wrong. None of them, and none of their
    /// descendants, is in `create`.
    pub errors: Vec<LineageError>,
}

/// Where a child's lease starts: the beginning of its partition (or `AtTime(t)` when the group
/// starts at `t`: the child's records before `t` are before the start), never `Now`.
pub fn child_start(start: &Position) -> Position {
    match start {
        Position::AtTime(t) => Position::AtTime(*t),
        _ => Position::Beginning,
    }
}

/// The leases to create so that the group reaches its start position without a gap, and
/// reads every child only after its parents. See the module docs for the rules.
pub fn plan(input: &Input<'_>) -> Plan {
    let graph = Graph::build(input);
    let mut errors = graph.errors.clone();
    errors.sort_by(|a, b| a.partition().cmp(b.partition()));
    let g = &graph;
    let n = g.parts.len();
    let leased: Vec<Option<&Lease>> = g
        .parts
        .iter()
        .map(|p| g.leases.get(&p.id).copied())
        .collect();
    let any_lease = !input.leases.is_empty();
    let pruned: Vec<bool> = g
        .parts
        .iter()
        .map(|p| match input.start {
            Position::AtTime(t) if !any_lease && p.closed => {
                input.closed_at.get(&p.id).is_some_and(|c| c < t)
            }
            _ => false,
        })
        .collect();
    // Effective parents: listed, sound, and not skipped by an `AtTime` seed.
    let parents: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            g.parents[i]
                .iter()
                .copied()
                .filter(|p| !pruned[*p])
                .collect()
        })
        .collect();
    // Whether a proper descendant has a lease (children before parents: reverse topo order).
    let mut below = vec![false; n];
    for &i in g.order.iter().rev() {
        below[i] = g.children[i]
            .iter()
            .any(|c| leased[*c].is_some() || below[*c]);
    }
    let settled = |i: usize| match leased[i] {
        Some(l) => l.state == LeaseState::Finished,
        None => below[i],
    };
    let from_start = !matches!(input.start, Position::Now);
    // Whether the fleet will reach the partition through a lease that exists or that rule 1
    // creates (KCL's "is a descendant"); parents before children.
    let mut reached = vec![false; n];
    for &i in &g.order {
        reached[i] = !pruned[i]
            && (leased[i].is_some()
                || below[i]
                || if parents[i].is_empty() {
                    from_start
                } else {
                    parents[i].iter().any(|p| reached[*p])
                });
    }
    let mut create: BTreeMap<usize, Position> = BTreeMap::new();
    // Walk up from the leaves, stopping at leased or settled partitions.
    let mut visited = vec![false; n];
    let mut stack: Vec<usize> = (0..n)
        .filter(|&i| {
            let p = g.parts[i];
            !pruned[i]
                && !parents[i].iter().any(|q| !g.parts[*q].closed)
                && (!p.closed || g.children[i].is_empty())
        })
        .collect();
    let leaves: Vec<usize> = stack.clone();
    while let Some(i) = stack.pop() {
        if visited[i] || pruned[i] || leased[i].is_some() || below[i] {
            continue;
        }
        visited[i] = true;
        if parents[i].is_empty() {
            if from_start {
                create.entry(i).or_insert_with(|| input.start.clone()); // rule 1
            }
            continue;
        }
        if reached[i] {
            for &p in &parents[i] {
                if leased[p].is_none() && !reached[p] {
                    create.entry(p).or_insert_with(|| child_start(input.start));
                    // rule 2
                }
            }
        }
        stack.extend(parents[i].iter().copied());
    }
    for i in leaves {
        let p = g.parts[i];
        if !reached[i] && leased[i].is_none() && !below[i] && !pruned[i] && !p.closed {
            create.entry(i).or_insert_with(|| input.start.clone()); // rule 3
        }
    }
    for i in 0..n {
        let ready =
            !parents[i].is_empty() && parents[i].iter().all(|p| g.parts[*p].closed && settled(*p));
        if ready && leased[i].is_none() && !below[i] && !pruned[i] {
            let inherited = match (input.child_start, parents[i].as_slice()) {
                (ChildStart::ParentContinuation, [p]) if g.parts[i].parents.len() == 1 => {
                    leased[*p].and_then(inherited_start)
                }
                _ => None,
            };
            create
                .entry(i)
                .or_insert_with(|| inherited.unwrap_or_else(|| child_start(input.start)));
            // rule 4
        }
    }
    let mut create: Vec<NewLease> = create
        .into_iter()
        .map(|(i, start)| {
            let p = g.parts[i];
            NewLease {
                partition: p.id.clone(),
                parents: p.parents.clone(),
                start,
                key_range: p.key_range,
            }
        })
        .collect();
    create.sort_by(|a, b| a.partition.cmp(&b.partition));
    Plan { create, errors }
}

/// The sound part of the partition graph, indexed, with a topological order.
struct Graph<'a> {
    /// Sound partitions.
    parts: Vec<&'a Partition>,
    /// Listed, sound parents of each.
    parents: Vec<Vec<usize>>,
    /// Sound children of each.
    children: Vec<Vec<usize>>,
    /// Parents before children.
    order: Vec<usize>,
    leases: BTreeMap<&'a PartitionId, &'a Lease>,
    errors: Vec<LineageError>,
}

impl<'a> Graph<'a> {
    fn build(input: &Input<'a>) -> Self {
        let mut errors = Vec::new();
        let mut bad: BTreeMap<&'a PartitionId, Option<&'a PartitionId>> = BTreeMap::new();
        let mut by_id: BTreeMap<&'a PartitionId, &'a Partition> = BTreeMap::new();
        for p in input.partitions {
            if by_id.insert(&p.id, p).is_some() && !bad.contains_key(&p.id) {
                errors.push(LineageError::Duplicate {
                    partition: p.id.clone(),
                });
                bad.insert(&p.id, None);
            }
        }
        for p in by_id.values() {
            if bad.contains_key(&p.id) {
                continue;
            }
            if p.parents.contains(&p.id) {
                errors.push(LineageError::SelfParent {
                    partition: p.id.clone(),
                });
                bad.insert(&p.id, None);
            } else if input.missing_parents == MissingParents::Error {
                if let Some(parent) = p.parents.iter().find(|q| !by_id.contains_key(q)) {
                    errors.push(LineageError::UnknownParent {
                        partition: p.id.clone(),
                        parent: parent.clone(),
                    });
                    bad.insert(&p.id, None);
                }
            }
        }
        // Kahn's algorithm over the listed parent edges; what remains sits on or below a cycle.
        let ids: Vec<&'a PartitionId> = by_id.keys().copied().collect();
        let index: BTreeMap<&PartitionId, usize> =
            ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let all = ids.len();
        let mut edges_up: Vec<Vec<usize>> = vec![Vec::new(); all];
        let mut edges_down: Vec<Vec<usize>> = vec![Vec::new(); all];
        for (i, id) in ids.iter().enumerate() {
            let mut seen = BTreeSet::new();
            for q in &by_id[id].parents {
                if let Some(&j) = index.get(q) {
                    if j != i && seen.insert(j) {
                        edges_up[i].push(j);
                        edges_down[j].push(i);
                    }
                }
            }
        }
        let mut indegree: Vec<usize> = edges_up.iter().map(Vec::len).collect();
        let mut queue: Vec<usize> = (0..all).filter(|i| indegree[*i] == 0).collect();
        queue.reverse();
        let mut topo = Vec::with_capacity(all);
        while let Some(i) = queue.pop() {
            topo.push(i);
            for &c in &edges_down[i] {
                indegree[c] -= 1;
                if indegree[c] == 0 {
                    queue.push(c);
                }
            }
        }
        let mut in_topo = vec![false; all];
        for &i in &topo {
            in_topo[i] = true;
        }
        let mut on_cycle = vec![false; all];
        for start in 0..all {
            if in_topo[start] || on_cycle[start] {
                continue;
            }
            // Walk up through unsorted parents until a partition repeats: that is a cycle.
            let mut path: Vec<usize> = Vec::new();
            let mut pos: BTreeMap<usize, usize> = BTreeMap::new();
            let mut at = start;
            loop {
                if let Some(&k) = pos.get(&at) {
                    let cycle: Vec<usize> = path[k..].to_vec();
                    if cycle.iter().all(|c| !on_cycle[*c]) {
                        for &c in &cycle {
                            on_cycle[c] = true;
                            bad.entry(ids[c]).or_insert(None);
                        }
                        let lowest = cycle.iter().copied().min().unwrap_or(at);
                        let turn = cycle.iter().position(|c| *c == lowest).unwrap_or(0);
                        let mut ordered = cycle[turn..].to_vec();
                        ordered.extend_from_slice(&cycle[..turn]);
                        errors.push(LineageError::Cycle {
                            partition: ids[lowest].clone(),
                            cycle: ordered.iter().map(|c| ids[*c].clone()).collect(),
                        });
                    }
                    break;
                }
                if on_cycle[at] {
                    break;
                }
                pos.insert(at, path.len());
                path.push(at);
                match edges_up[at].iter().find(|p| !in_topo[**p]) {
                    Some(&p) => at = p,
                    None => break,
                }
            }
        }
        // Everything below a bad partition is refused too, naming the bad ancestor.
        let mut blame: Vec<Option<usize>> = vec![None; all];
        for i in 0..all {
            if bad.contains_key(ids[i]) {
                blame[i] = Some(i);
            }
        }
        let mut stack: Vec<usize> = (0..all).filter(|i| blame[*i].is_some()).collect();
        while let Some(i) = stack.pop() {
            for &c in &edges_down[i] {
                if blame[c].is_none() {
                    blame[c] = blame[i];
                    stack.push(c);
                }
            }
        }
        for i in 0..all {
            if let Some(from) = blame[i] {
                if from != i && !bad.contains_key(ids[i]) {
                    errors.push(LineageError::Descends {
                        partition: ids[i].clone(),
                        from: ids[from].clone(),
                    });
                }
            }
        }
        // The sound graph, renumbered.
        let sound: Vec<usize> = topo
            .iter()
            .copied()
            .filter(|i| blame[*i].is_none())
            .collect();
        let mut renumber = vec![usize::MAX; all];
        for (k, &i) in sound.iter().enumerate() {
            renumber[i] = k;
        }
        let parts: Vec<&'a Partition> = sound.iter().map(|i| by_id[ids[*i]]).collect();
        let parents: Vec<Vec<usize>> = sound
            .iter()
            .map(|i| edges_up[*i].iter().map(|p| renumber[*p]).collect())
            .collect();
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); sound.len()];
        for (k, ps) in parents.iter().enumerate() {
            for &p in ps {
                children[p].push(k);
            }
        }
        let leases = input.leases.iter().map(|l| (&l.key.partition, l)).collect();
        Graph {
            order: (0..parts.len()).collect(),
            parts,
            parents,
            children,
            leases,
            errors,
        }
    }
}

/// Whether a lease has started processing: it has a checkpoint past its initial position, or
/// it is finished.
pub fn has_started(lease: &Lease) -> bool {
    lease.continuation.is_some() || lease.state == LeaseState::Finished
}

/// The finished leases that may be deleted now (design rule 5): every child partition has a
/// lease that has started ([`has_started`]), and no parent still has a lease (oldest first,
/// so a chain is never cut in the middle). A finished lease whose partition the source no
/// longer lists (trimmed) may go too: nothing can recreate it. A finished partition with no
/// children stays until it is trimmed, as a tombstone, so that it is not created again.
pub fn deletable(partitions: &[Partition], leases: &[Lease]) -> Vec<PartitionId> {
    let by_id: BTreeMap<&PartitionId, &Lease> =
        leases.iter().map(|l| (&l.key.partition, l)).collect();
    let listed: BTreeMap<&PartitionId, &Partition> =
        partitions.iter().map(|p| (&p.id, p)).collect();
    let mut children: BTreeMap<&PartitionId, Vec<&PartitionId>> = BTreeMap::new();
    for p in partitions {
        for q in &p.parents {
            children.entry(q).or_default().push(&p.id);
        }
    }
    leases
        .iter()
        .filter(|l| l.state == LeaseState::Finished)
        .filter(|l| {
            let id = &l.key.partition;
            let listed_parents = listed.get(id).map(|p| p.parents.as_slice()).unwrap_or(&[]);
            let parent_leased = l
                .parents
                .iter()
                .chain(listed_parents)
                .any(|q| q != id && by_id.contains_key(q));
            if parent_leased {
                return false;
            }
            if !listed.contains_key(id) {
                return true;
            }
            match children.get(id) {
                None => false,
                Some(kids) => kids
                    .iter()
                    .all(|c| *c != id && by_id.get(c).is_some_and(|cl| has_started(cl))),
            }
        })
        .map(|l| l.key.partition.clone())
        .collect()
}

/// The key range a lease's [`RANGE_PROPERTY`] holds, if it holds a valid one.
pub fn lease_range(lease: &Lease) -> Option<KeyRange> {
    let text = lease.properties.get(RANGE_PROPERTY)?;
    let (start, end) = text.split_once("..=")?;
    let range = KeyRange {
        start: start.parse().ok()?,
        end: end.parse().ok()?,
    };
    (range.start <= range.end).then_some(range)
}

/// The text of `range` for [`RANGE_PROPERTY`].
pub fn range_property(range: KeyRange) -> String {
    format!("{}..={}", range.start, range.end)
}

/// Whether listing the partitions can be skipped (KCL's "avoid a shard sync"): there is at
/// least one lease, none is finished, and their key ranges ([`RANGE_PROPERTY`]) together cover
/// the whole key space. Until a lease finishes no partition can have closed under a reader,
/// so no child can be due; a lease without a range makes the answer `false`.
pub fn covers_key_space<L: std::borrow::Borrow<Lease>>(leases: &[L]) -> bool {
    if leases.is_empty()
        || leases
            .iter()
            .any(|l| l.borrow().state == LeaseState::Finished)
    {
        return false;
    }
    let mut ranges = Vec::with_capacity(leases.len());
    for l in leases {
        match lease_range(l.borrow()) {
            Some(r) => ranges.push(r),
            None => return false,
        }
    }
    ranges.sort();
    // The first hash not yet covered; `None` once the end of the space is covered.
    let mut next: Option<u128> = Some(0);
    for r in ranges {
        match next {
            None => break,
            Some(n) if r.start > n => return false,
            Some(n) if r.end >= n => next = r.end.checked_add(1),
            Some(_) => {}
        }
    }
    next.is_none()
}
