//! The parts of the host state: the lease table
//! ([`LeaseTable`]: the listed rows, the partitions this host owns and was asked for, and
//! whether the workers must be told of a whole new listing) and the listing state
//! ([`Listing`]: counter, live hosts and time of the last list). The decisions over them are
//! in `decide.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use imbl::{OrdMap, OrdSet};

use crate::balance::{holder, Census};
use crate::clock::Instant;
use crate::lineage::{ready_under, ParentsRule};
use crate::model::{HostName, Lease, LeaseState, PartitionId};

use super::share::TableShare;

/// The leases this host has listed, by partition, and what they say of this host.
///
/// The contents ([`Rows`]: the rows, the [`Census`] of the eligible ones, the children index
/// and who owns or was asked for what) are a pure function of the rows, held in persistent
/// maps (`imbl`) behind one `Arc`: cloning them costs O(1), and changing a clone copies only
/// the paths it changes. Hosts of one process given the same [`TableShare`] hold equal
/// contents once between them: a host whose rows come to equal contents another host already
/// holds takes that host's in O(1) instead of building its own. That is what lets the
/// simulator run a thousand hosts' tables of 100,000 leases; a lone host gives nothing up.
#[derive(Debug, Clone)]
pub(crate) struct LeaseTable {
    me: HostName,
    parents: ParentsRule,
    rows: Arc<Rows>,
    share: Option<TableShare>,
    /// Set when the rows were replaced whole: every worker's row must be compared before the
    /// next hints (rows taken in one by one are compared as they come).
    hint_all: bool,
    /// Set when a listed lease became finished (its partition closed and was read to the
    /// end): its children may now need leases, so the leader syncs at once rather than at
    /// its next `sync_interval`. Cleared by [`LeaseTable::take_finished`].
    finished: bool,
}

/// What a lease table holds: a pure function of its rows and the parents rule.
#[derive(Debug, Clone, Default)]
pub(super) struct Rows {
    leases: OrdMap<PartitionId, Arc<Lease>>,
    /// The eligible leases (design rule 5), indexed for the balancer.
    census: Census,
    /// Per partition named as a parent: the listed leases naming it. Their eligibility
    /// follows its row, so they are counted again when it changes.
    children: OrdMap<PartitionId, Vec<PartitionId>>,
    /// Per host: the partitions it owns.
    owned: OrdMap<HostName, OrdSet<PartitionId>>,
    /// Per host: the partitions naming it as `next_owner`.
    named: OrdMap<HostName, OrdSet<PartitionId>>,
    /// The sum of the rows' fingerprints ([`row_print`]): equal rows, equal sums.
    pub(super) print: u128,
    /// The sum of the finished rows' fingerprints.
    finished: u128,
}

/// A row's fingerprint: 128 bits of two hashes of what the table derives from the row (its
/// key, state, owner, `next_owner` and parents). A table's fingerprint is the sum of its
/// rows', so two tables of equal fingerprints hold rows that agree on ownership and lineage
/// (but with a chance of about 2⁻¹²⁸ per pair), which is all a host decides by: their
/// versions and checkpoints may differ, as a cached row's may differ from the store's after
/// a checkpoint (no list of changes shows a checkpoint; every write is a compare-and-swap on
/// the store's version, and a take that finds only the checkpoint moved is retried).
pub(super) fn row_print(lease: &Lease) -> u128 {
    let mut h = DefaultHasher::new();
    lease.key.hash(&mut h);
    lease.state.hash(&mut h);
    lease.owner.hash(&mut h);
    lease.next_owner.hash(&mut h);
    lease.parents.hash(&mut h);
    let low = h.finish();
    0x5eed_u16.hash(&mut h);
    let high = h.finish();
    (u128::from(high) << 64) | u128::from(low)
}

impl Rows {
    fn get(&self, partition: &PartitionId) -> Option<&Lease> {
        self.leases.get(partition).map(|l| &**l)
    }

    fn eligible(&self, lease: &Lease, parents: ParentsRule) -> bool {
        ready_under(lease, |p| self.get(p), parents)
    }

    /// Puts `new` in place of `partition`'s row (none: removes it), keeping the census, the
    /// indexes and the fingerprint in step.
    fn put(&mut self, partition: &PartitionId, new: Option<Arc<Lease>>, parents: ParentsRule) {
        let old = self.leases.get(partition).cloned();
        // The leases naming this one as a parent: their eligibility may follow its change.
        let kids = self.kids_of(partition);
        for kid in &kids {
            self.uncount(kid, parents);
        }
        if let Some(old) = &old {
            self.uncount(old, parents);
            self.unlink(old);
            self.unmark(old);
            let print = row_print(old);
            self.print = self.print.wrapping_sub(print);
            if old.state == LeaseState::Finished {
                self.finished = self.finished.wrapping_sub(print);
            }
            self.leases.remove(partition);
        }
        if let Some(new) = new {
            let print = row_print(&new);
            self.print = self.print.wrapping_add(print);
            if new.state == LeaseState::Finished {
                self.finished = self.finished.wrapping_add(print);
            }
            self.leases.insert(partition.clone(), new.clone());
            self.link(&new);
            self.mark(&new);
            self.count(&new, parents);
        }
        for kid in &kids {
            self.count(kid, parents);
        }
    }

    /// The listed rows of the leases naming `partition` as a parent (not itself).
    fn kids_of(&self, partition: &PartitionId) -> Vec<Arc<Lease>> {
        let Some(kids) = self.children.get(partition) else {
            return Vec::new();
        };
        let mut kids: Vec<&PartitionId> = kids.iter().filter(|k| *k != partition).collect();
        kids.sort_unstable();
        kids.dedup();
        kids.into_iter()
            .filter_map(|k| self.leases.get(k).cloned())
            .collect()
    }

    /// Notes `row` as a child of each of its parents.
    fn link(&mut self, row: &Lease) {
        for parent in &row.parents {
            self.children
                .entry(parent.clone())
                .or_default()
                .push(row.key.partition.clone());
        }
    }

    /// Forgets `row` as a child of its parents.
    fn unlink(&mut self, row: &Lease) {
        for parent in &row.parents {
            if let Some(kids) = self.children.get_mut(parent) {
                if let Some(k) = kids.iter().position(|k| *k == row.key.partition) {
                    kids.swap_remove(k);
                }
                if kids.is_empty() {
                    self.children.remove(parent);
                }
            }
        }
    }

    /// Notes who owns `row` and whom it names as `next_owner`.
    fn mark(&mut self, row: &Lease) {
        let partition = &row.key.partition;
        if let Some(owner) = holder(row) {
            self.owned
                .entry(owner.clone())
                .or_default()
                .insert(partition.clone());
        }
        if let Some(asker) = &row.next_owner {
            self.named
                .entry(asker.clone())
                .or_default()
                .insert(partition.clone());
        }
    }

    /// Forgets what [`Rows::mark`] noted of `row`.
    fn unmark(&mut self, row: &Lease) {
        let partition = &row.key.partition;
        for (index, host) in [
            (&mut self.owned, holder(row)),
            (&mut self.named, row.next_owner.as_ref()),
        ] {
            let Some(host) = host else { continue };
            if let Some(set) = index.get_mut(host) {
                set.remove(partition);
                if set.is_empty() {
                    index.remove(host);
                }
            }
        }
    }

    /// Counts `row` in the census if it is eligible now.
    fn count(&mut self, row: &Arc<Lease>, parents: ParentsRule) {
        if self.eligible(row, parents) {
            self.census.insert(row.clone());
        }
    }

    /// Stops counting `row` (as it was counted: call before anything it depends on changes).
    fn uncount(&mut self, row: &Lease, parents: ParentsRule) {
        if self.eligible(row, parents) {
            self.census.remove(row);
        }
    }

    /// The contents of `leases` (each partition once), built in one pass per index.
    fn build(leases: Vec<Arc<Lease>>, parents: ParentsRule) -> Self {
        let mut rows = Rows {
            print: leases
                .iter()
                .fold(0u128, |sum, l| sum.wrapping_add(row_print(l))),
            finished: leases
                .iter()
                .filter(|l| l.state == LeaseState::Finished)
                .fold(0u128, |sum, l| sum.wrapping_add(row_print(l))),
            leases: leases
                .iter()
                .map(|l| (l.key.partition.clone(), l.clone()))
                .collect(),
            ..Rows::default()
        };
        for l in &leases {
            rows.link(l);
            rows.mark(l);
        }
        for l in &leases {
            rows.count(l, parents);
        }
        rows
    }
}

impl LeaseTable {
    pub(crate) fn new(me: HostName, parents: ParentsRule, share: Option<TableShare>) -> Self {
        Self {
            me,
            parents,
            rows: Arc::new(Rows::default()),
            share,
            hint_all: false,
            finished: false,
        }
    }

    /// Takes in a fresh listing whole.
    pub(crate) fn replace_all(&mut self, leases: Vec<impl Into<Arc<Lease>>>) {
        let leases: Vec<Arc<Lease>> = leases.into_iter().map(Into::into).collect();
        // Only finished rows are looked up in the old table: they are few.
        self.finished |= leases.iter().any(|l| {
            l.state == LeaseState::Finished
                && self
                    .get(&l.key.partition)
                    .is_none_or(|old| old.state != LeaseState::Finished)
        });
        self.hint_all = true;
        if let Some(share) = &self.share {
            let print = leases
                .iter()
                .fold(0u128, |sum, l| sum.wrapping_add(row_print(l)));
            if let Some(held) = share.find(self.parents, print) {
                if held.leases.len() == leases.len() {
                    self.rows = held;
                    return;
                }
            }
        }
        self.rows = Arc::new(Rows::build(leases, self.parents));
        if let Some(share) = &self.share {
            share.offer(self.parents, &self.rows);
        }
    }

    /// Takes in one row if it is newer than the cached one (or new). Returns the row if it
    /// was taken in, so its worker can be told.
    #[cfg(test)]
    pub(crate) fn remember(&mut self, lease: impl Into<Arc<Lease>>) -> Option<&Lease> {
        let lease: Arc<Lease> = lease.into();
        let partition = lease.key.partition.clone();
        if self.apply(&[], vec![lease]).is_empty() {
            return None;
        }
        self.rows.get(&partition)
    }

    /// Forgets a deleted lease.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, partition: &PartitionId) {
        self.apply(std::slice::from_ref(partition), Vec::new());
    }

    /// Takes in a list of changes: forgets the `deleted` leases, then takes in each of
    /// `leases` newer than the cached row (or new). Returns the partitions of the rows taken
    /// in, as given, in order, so their workers can be told.
    ///
    /// With a [`TableShare`], the fingerprint the changes lead to is worked out first: if a
    /// host of the share holds that table, with every row taken in here at least as new, it
    /// is taken whole (O(changes) lookups), and only otherwise are the changes applied here.
    pub(crate) fn apply(
        &mut self,
        deleted: &[PartitionId],
        leases: Vec<Arc<Lease>>,
    ) -> Vec<Arc<Lease>> {
        // The rows the changes leave, by partition (`None`: deleted), over the cached ones.
        let mut pending: BTreeMap<PartitionId, Option<Arc<Lease>>> = BTreeMap::new();
        let mut print = self.rows.print;
        let mut taken = Vec::new();
        for partition in deleted {
            let current = match pending.get(partition) {
                Some(row) => row.clone(),
                None => self.rows.leases.get(partition).cloned(),
            };
            if let Some(old) = current {
                print = print.wrapping_sub(row_print(&old));
                pending.insert(partition.clone(), None);
            }
        }
        for lease in leases {
            let partition = &lease.key.partition;
            let current = match pending.get(partition) {
                Some(row) => row.clone(),
                None => self.rows.leases.get(partition).cloned(),
            };
            if current
                .as_ref()
                .is_some_and(|old| old.version >= lease.version)
            {
                continue;
            }
            self.finished |= lease.state == LeaseState::Finished
                && current
                    .as_ref()
                    .is_none_or(|o| o.state != LeaseState::Finished);
            let old = current.as_deref().map_or(0, row_print);
            print = print.wrapping_sub(old).wrapping_add(row_print(&lease));
            taken.push(lease.clone());
            pending.insert(partition.clone(), Some(lease));
        }
        if pending.is_empty() {
            return taken;
        }
        // A held table is taken only if it holds each row taken in here at least as new:
        // equal fingerprints say the rows agree on ownership, not that their versions do, and
        // a row this host was given (a take's reply, a conflict's current row) must not be
        // replaced by an older one.
        if let Some(share) = &self.share {
            if let Some(held) = share.find(self.parents, print) {
                let as_new = taken.iter().all(|row| {
                    held.leases
                        .get(&row.key.partition)
                        .is_some_and(|h| h.version >= row.version)
                });
                if as_new {
                    self.rows = held;
                    return taken;
                }
            }
        }
        let rows = Arc::make_mut(&mut self.rows);
        for (partition, new) in pending {
            rows.put(&partition, new, self.parents);
        }
        if let Some(share) = &self.share {
            share.offer(self.parents, &self.rows);
        }
        taken
    }

    /// Notes this table as what a list of changes up to `counter` left (see
    /// [`LeaseTable::fast_forward`]).
    pub(crate) fn offer_table_at(&self, counter: u64) {
        if let Some(share) = &self.share {
            share.listed(self.parents, counter, &self.rows);
        }
    }

    /// Takes the table another host of the share was left with by a list of changes up to a
    /// counter above `counter`, the one this table is at (`None`: a table not trusted at any
    /// counter, which would be listed in full), and returns that counter; a list of changes
    /// since it then brings the table up to date as one since `counter`, or a full list, would
    /// (every change of hands moves the counter, and a table at a counter holds the leases'
    /// owners and requests as they stood at it). The table counts as replaced whole: workers
    /// are told of their rows. `None` without a share or a higher counter.
    pub(crate) fn fast_forward(&mut self, counter: Option<u64>) -> Option<u64> {
        let (at, rows) = self.share.as_ref()?.latest_after(self.parents, counter)?;
        // A lease that became finished may leave its children without leases: when the
        // finished leases differ, say so (the leader syncs; once too often is harmless).
        self.finished |= rows.finished != self.rows.finished;
        self.rows = rows;
        self.hint_all = true;
        Some(at)
    }

    /// Whether `self` and `other` hold one shared table.
    #[cfg(test)]
    pub(crate) fn shares_rows_with(&self, other: &LeaseTable) -> bool {
        Arc::ptr_eq(&self.rows, &other.rows)
    }

    /// The listed row of `partition`, shared.
    pub(crate) fn row(&self, partition: &PartitionId) -> Option<&Arc<Lease>> {
        self.rows.leases.get(partition)
    }

    /// The listed row of `partition`, if any.
    pub(crate) fn get(&self, partition: &PartitionId) -> Option<&Lease> {
        self.rows.get(partition)
    }

    /// Every listed row, sorted by partition.
    pub(crate) fn rows(&self) -> Vec<Arc<Lease>> {
        self.rows.leases.values().cloned().collect()
    }

    /// The eligible leases, indexed for the balancer.
    pub(crate) fn census(&self) -> &Census {
        &self.rows.census
    }

    /// The partitions listed with this host as `next_owner`.
    pub(crate) fn asked(&self) -> BTreeSet<PartitionId> {
        self.rows
            .named
            .get(&self.me)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Whether the table was replaced whole since the last call (then every worker's row must
    /// be compared); resets the flag.
    pub(crate) fn take_hint_all(&mut self) -> bool {
        std::mem::take(&mut self.hint_all)
    }

    /// Whether a listed lease became finished since the last call; resets the flag.
    pub(crate) fn take_finished(&mut self) -> bool {
        std::mem::take(&mut self.finished)
    }

    /// Whether any listed lease names `host` as its owner.
    pub(crate) fn owns_any(&self, host: &HostName) -> bool {
        self.rows.owned.contains_key(host)
    }

    /// The hosts the listed leases name as owners.
    pub(crate) fn owners(&self) -> BTreeSet<HostName> {
        self.rows.owned.keys().cloned().collect()
    }

    /// Whether `lease` may be read now (design rule 5, see [`ready_under`]).
    pub(crate) fn eligible(&self, lease: &Lease, parents: ParentsRule) -> bool {
        self.rows.eligible(lease, parents)
    }

    /// The leases this host owns by the table whose partitions `running` does not list: to
    /// resume (a restart under the same name, or a fence that was lowered).
    pub(crate) fn to_adopt(&self, running: impl Fn(&PartitionId) -> bool) -> Vec<Lease> {
        self.rows
            .owned
            .get(&self.me)
            .into_iter()
            .flatten()
            .filter(|p| !running(p))
            .filter_map(|p| self.get(p).cloned())
            .collect()
    }
}

/// What the host should read after a membership read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// The cached table is accurate: the counter has not moved and the live hosts are the
    /// same.
    Nothing,
    /// Only what changed since the last list (the store may answer with a full list).
    Changes,
    /// The safety net is due: the changes since the table's counter on a store that can say
    /// (however few), every lease on one that cannot.
    Full,
}

/// Whether two lists of live hosts are the same: at once when they are one shared list (the
/// view's, taken in again), element by element otherwise.
fn same_hosts(a: &Arc<[HostName]>, b: &Arc<[HostName]>) -> bool {
    Arc::ptr_eq(a, b) || a[..] == b[..]
}

/// When and at what change counter this host last listed the leases.
#[derive(Debug, Clone, Default)]
pub(crate) struct Listing {
    /// The change counter the cached table is at, if it is trusted.
    pub(crate) counter: Option<u64>,
    /// The live hosts when the table was last balanced on.
    live: Arc<[HostName]>,
    last_full: Option<Instant>,
}

impl Listing {
    /// What to read after a membership read at `now` showing `counter` and `live`.
    pub(crate) fn next_read(
        &self,
        counter: u64,
        live: &Arc<[HostName]>,
        now: Instant,
        full_every: Duration,
    ) -> Read {
        let full_due = self
            .last_full
            .is_none_or(|t| now.saturating_duration_since(t) >= full_every);
        if full_due {
            Read::Full
        } else if self.counter != Some(counter) || !same_hosts(live, &self.live) {
            Read::Changes
        } else {
            Read::Nothing
        }
    }

    /// A read chosen by [`Listing::next_read`] succeeded at `counter`, and `live` was judged
    /// from a membership read made after it.
    pub(crate) fn listed(
        &mut self,
        read: Read,
        counter: u64,
        live: &Arc<[HostName]>,
        now: Instant,
    ) {
        self.counter = Some(counter);
        self.live = Arc::clone(live);
        if read == Read::Full {
            self.last_full = Some(now);
        }
    }

    /// Whether `live` differs from the live hosts the table was last balanced on; if so, it is
    /// balanced on `live` from now.
    pub(crate) fn take_live_change(&mut self, live: &Arc<[HostName]>) -> bool {
        if same_hosts(live, &self.live) {
            return false;
        }
        self.live = Arc::clone(live);
        true
    }

    /// A list of changes took the trusted table to `counter` (an untrusted one stays so).
    pub(crate) fn advanced(&mut self, counter: u64) {
        if self.counter.is_some() {
            self.counter = Some(counter);
        }
    }

    /// The cached table can no longer be trusted at its counter (a failed read after a list,
    /// or this host's own writes): list again next cycle.
    pub(crate) fn invalidate(&mut self) {
        self.counter = None;
    }
}
