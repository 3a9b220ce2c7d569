//! The lag estimator: how far each lease's checkpoint is behind its partition's end, in
//! records and in time.
//!
//! Like the Cosmos DB change feed estimator, it reads the leases and asks the source how many
//! records remain after each checkpoint ([`FeedSource::remaining`]) and when the first of them
//! was written ([`FeedSource::oldest_unread`]). Partitions the source lists that have no lease
//! yet (children of a split before the leader's sync, partitions never leased) are counted too,
//! from where their lease would start. It owns no state and writes nothing; the CLI's `lag` and
//! `status` commands and the processor's `changefeed_lag_records` and `changefeed_lag_seconds`
//! gauges use it.

use std::collections::{BTreeMap, BTreeSet};

use crate::clock::{Clock, SystemClock};
use crate::error::{LeaseError, SourceError};
use crate::lease::LeaseStore;
use crate::lineage::{self, ChildStart};
use crate::model::{
    Continuation, GroupName, HostName, Lease, LeaseState, Partition, PartitionId, Position,
    Timestamp,
};
use crate::source::{FeedSource, LeasedPartition, OldestUnread};

/// The estimate for one lease, or for a partition that has no lease yet.
#[derive(Debug)]
pub struct LeaseLag {
    /// The partition.
    pub partition: PartitionId,
    /// Its owner, if any.
    pub owner: Option<HostName>,
    /// Its checkpoint, if any.
    pub checkpoint: Option<Continuation>,
    /// False for a partition the source lists that has no lease yet: it is counted from where
    /// its lease would start (the beginning, for a child and for a partition never leased;
    /// the parent's checkpoint for a child of one leased parent on a source whose children
    /// continue from their parent, see [`unleased`]).
    pub leased: bool,
    /// Records after the checkpoint: `Ok(None)` when the source cannot tell (or the lease
    /// starts at `Now` / a time and has no checkpoint yet), `Err` when asking failed.
    pub records: Result<Option<u64>, SourceError>,
    /// Lag in time, in milliseconds: how old the first record after the checkpoint is (0 when
    /// nothing is unread); `Ok(None)` when the source cannot tell, `Err` when asking failed.
    pub age_ms: Result<Option<u64>, SourceError>,
}

/// The estimate for a whole group.
#[derive(Debug, Default)]
pub struct LagReport {
    /// One entry per readable lease and per partition without a lease, in partition order.
    pub leases: Vec<LeaseLag>,
    /// Lease rows that could not be read, each naming its key.
    pub malformed: Vec<LeaseError>,
    /// Set when the source's partition list could not be read: partitions without a lease
    /// are then missing from `leases`.
    pub partitions_error: Option<SourceError>,
}

impl LagReport {
    /// The sum of the known per-lease estimates.
    pub fn total(&self) -> u64 {
        self.leases
            .iter()
            .filter_map(|l| l.records.as_ref().ok().copied().flatten())
            .fold(0u64, u64::saturating_add)
    }

    /// How many leases have no estimate (unknown or failed).
    pub fn unknown(&self) -> usize {
        self.leases
            .iter()
            .filter(|l| !matches!(l.records, Ok(Some(_))))
            .count()
    }

    /// The largest known lag in time, in milliseconds (`None` when no entry knows it).
    pub fn max_age_ms(&self) -> Option<u64> {
        self.leases
            .iter()
            .filter_map(|l| l.age_ms.as_ref().ok().copied().flatten())
            .max()
    }
}

/// Records after `lease`'s checkpoint. A finished lease has none. Without a checkpoint, a
/// lease starting at `Beginning` lags by the whole partition; one starting at `Now` or a time
/// has no estimate until its first checkpoint.
///
/// # Errors
/// What the source returned (an unknown partition, a continuation it does not recognise …).
pub async fn lease_lag(source: &dyn FeedSource, lease: &Lease) -> Result<Option<u64>, SourceError> {
    if lease.state == LeaseState::Finished {
        return Ok(Some(0));
    }
    lag_after(
        source,
        &lease.key.partition,
        lease.continuation.as_ref(),
        &lease.start,
    )
    .await
}

/// Lag in time of `lease` at wall time `now`, in milliseconds: how old the first record after
/// its checkpoint is (0 when nothing is unread, and for a finished lease). `Ok(None)` when the
/// source cannot tell, or the lease starts at `Now` / a time and has no checkpoint yet.
///
/// # Errors
/// What the source returned.
pub async fn lease_age_ms(
    source: &dyn FeedSource,
    lease: &Lease,
    now: Timestamp,
) -> Result<Option<u64>, SourceError> {
    if lease.state == LeaseState::Finished {
        return Ok(Some(0));
    }
    age_after(
        source,
        &lease.key.partition,
        lease.continuation.as_ref(),
        &lease.start,
        now,
    )
    .await
}

/// Records in `partition` after `checkpoint`, or after `start` when there is none.
///
/// # Errors
/// What the source returned.
pub async fn lag_after(
    source: &dyn FeedSource,
    partition: &PartitionId,
    checkpoint: Option<&Continuation>,
    start: &Position,
) -> Result<Option<u64>, SourceError> {
    match (checkpoint, start) {
        (Some(c), _) => source.remaining(partition, Some(c)).await,
        (None, Position::Continuation(c)) => source.remaining(partition, Some(c)).await,
        (None, Position::Beginning) => source.remaining(partition, None).await,
        (None, Position::Now | Position::AtTime(_)) => Ok(None),
    }
}

/// What the source knows of the first record of `partition` after `checkpoint` (or at
/// `start` when there is none): unknown for a `Now` or `AtTime` start without a checkpoint.
///
/// # Errors
/// What the source returned.
pub async fn oldest_after(
    source: &dyn FeedSource,
    partition: &PartitionId,
    checkpoint: Option<&Continuation>,
    start: &Position,
) -> Result<OldestUnread, SourceError> {
    match (checkpoint, start) {
        (Some(c), _) | (None, Position::Continuation(c)) => {
            source.oldest_unread(partition, Some(c)).await
        }
        (None, Position::Beginning) => source.oldest_unread(partition, None).await,
        (None, Position::Now | Position::AtTime(_)) => Ok(OldestUnread::Unknown),
    }
}

/// Lag in time of a reader of `partition` after `checkpoint` (or at `start` when there is
/// none) at wall time `now`, in milliseconds.
///
/// # Errors
/// What the source returned.
pub async fn age_after(
    source: &dyn FeedSource,
    partition: &PartitionId,
    checkpoint: Option<&Continuation>,
    start: &Position,
    now: Timestamp,
) -> Result<Option<u64>, SourceError> {
    Ok(oldest_after(source, partition, checkpoint, start)
        .await?
        .age_ms(now))
}

/// Estimates the lag of every lease of `group`, and of every partition without a lease, at
/// the system clock's wall time. See [`estimate_at`].
///
/// # Errors
/// As for [`estimate_at`].
pub async fn estimate(
    store: &dyn LeaseStore,
    source: &dyn FeedSource,
    group: &GroupName,
) -> Result<LagReport, LeaseError> {
    estimate_at(store, source, group, SystemClock.wall()).await
}

/// Estimates the lag of every lease of `group` at wall time `now`, and of every partition the
/// source lists that has no lease yet and would get one (the lineage rules' plan with the
/// group starting at the beginning: a child starts at its beginning, or at its one parent's
/// checkpoint where the source's children continue from their parent; a partition never
/// leased is counted whole, since the group's configured start is not known here). A closed partition
/// whose lease was deleted after it finished gets none and is not counted.
///
/// # Errors
/// [`LeaseError`] if the leases cannot be listed; per-lease source errors are reported in
/// [`LeaseLag::records`] and [`LeaseLag::age_ms`], and a failed partition list in
/// [`LagReport::partitions_error`].
pub async fn estimate_at(
    store: &dyn LeaseStore,
    source: &dyn FeedSource,
    group: &GroupName,
    now: Timestamp,
) -> Result<LagReport, LeaseError> {
    let listing = store.list(group).await?;
    let mut report = LagReport {
        leases: Vec::with_capacity(listing.leases.len()),
        malformed: listing.malformed,
        partitions_error: None,
    };
    for lease in &listing.leases {
        let records = lease_lag(source, lease).await;
        let age_ms = lease_age_ms(source, lease, now).await;
        report.leases.push(LeaseLag {
            partition: lease.key.partition.clone(),
            owner: lease.owner.clone(),
            checkpoint: lease.continuation.clone(),
            leased: true,
            records,
            age_ms,
        });
    }
    // A row that cannot be read is still a lease: its partition is not counted as unleased.
    let prefix = format!("{}/", group.as_str());
    let unreadable: BTreeSet<PartitionId> = report
        .malformed
        .iter()
        .filter_map(|e| match e {
            LeaseError::Malformed { key, .. } => key
                .strip_prefix(&prefix)
                .and_then(|p| PartitionId::new(p).ok()),
            _ => None,
        })
        .collect();
    match unleased(source, &listing.leases, &unreadable).await {
        Ok(missing) => {
            for (partition, start) in missing {
                let records = lag_after(source, &partition, None, &start).await;
                let age_ms = age_after(source, &partition, None, &start, now).await;
                report.leases.push(LeaseLag {
                    partition,
                    owner: None,
                    checkpoint: None,
                    leased: false,
                    records,
                    age_ms,
                });
            }
        }
        Err(err) => report.partitions_error = Some(err),
    }
    report.leases.sort_by(|a, b| a.partition.cmp(&b.partition));
    Ok(report)
}

/// The partitions `source` lists for the group holding `leases` (and rows `unreadable`,
/// which count as leased) that have no lease and that the fleet has not gone past (no
/// descendant of theirs has a lease: a closed partition whose lease was deleted after it
/// finished has leased children), each with where its lease would start: the beginning, or,
/// for a child of one leased parent on a source whose children continue from their parent
/// ([`ChildStart::ParentContinuation`], Cosmos DB), the parent's checkpoint (what the
/// parent has not delivered of the child's keys is all the child will read, as
/// [`lineage::inherited_start`] starts it). A child waiting for its parents counts too,
/// though the lineage rules create its lease only once they are finished: its records are
/// unread all the same.
///
/// # Errors
/// [`SourceError`] if the partitions cannot be listed.
pub async fn unleased<L: std::borrow::Borrow<Lease> + Sync>(
    source: &dyn FeedSource,
    leases: &[L],
    unreadable: &BTreeSet<PartitionId>,
) -> Result<Vec<(PartitionId, Position)>, SourceError> {
    let by_id: BTreeMap<&PartitionId, &Lease> = leases
        .iter()
        .map(|l| {
            let l = l.borrow();
            (&l.key.partition, l)
        })
        .collect();
    let leased: BTreeSet<&PartitionId> = by_id.keys().copied().chain(unreadable).collect();
    let held: Vec<LeasedPartition> = leased
        .iter()
        .map(|p| match by_id.get(p) {
            Some(lease) => LeasedPartition::of(lease),
            None => LeasedPartition::unreadable((*p).clone()),
        })
        .collect();
    let partitions = source.partitions_for(&held).await?;
    let mut children: BTreeMap<&PartitionId, Vec<&PartitionId>> = BTreeMap::new();
    for p in &partitions {
        for parent in &p.parents {
            children.entry(parent).or_default().push(&p.id);
        }
    }
    // Whether any descendant of `id` has a lease (a walk bounded by the partition count, so a
    // corrupt cycle cannot loop).
    let has_leased_descendant = |id: &PartitionId| {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&PartitionId> = children.get(id).cloned().unwrap_or_default();
        while let Some(c) = todo.pop() {
            if !seen.insert(c) {
                continue;
            }
            if leased.contains(c) {
                return true;
            }
            todo.extend(children.get(c).cloned().unwrap_or_default());
        }
        false
    };
    let continuing = source.child_start() == ChildStart::ParentContinuation;
    let start_of = |p: &Partition| match (continuing, p.parents.as_slice()) {
        (true, [parent]) => by_id
            .get(parent)
            .and_then(|l| lineage::inherited_start(l))
            .unwrap_or(Position::Beginning),
        _ => lineage::child_start(&Position::Beginning),
    };
    Ok(partitions
        .iter()
        .filter(|p| !leased.contains(&p.id) && !has_leased_descendant(&p.id))
        .map(|p| (p.id.clone(), start_of(p)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::MemoryLeaseStore;
    use crate::model::LeaseKey;
    use crate::source::MemoryFeed;
    use std::sync::Arc;

    #[tokio::test]
    async fn lag_counts_records_after_each_checkpoint() {
        // Design, "Observability": per lease, how far the checkpoint is behind the end.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(2);
        let group = GroupName::new("g").expect("valid");
        let p0 = PartitionId::new("0").expect("valid");
        let p1 = PartitionId::new("1").expect("valid");
        let mut c = None;
        for i in 0..10 {
            let cont = feed.append_to(&p0, "k", format!("{i}")).expect("open");
            if i == 3 {
                c = Some(cont);
            }
            feed.append_to(&p1, "k", format!("{i}")).expect("open");
        }
        let mut l0 = Lease::new(LeaseKey::new(group.clone(), p0), Position::Beginning);
        l0.continuation = c;
        store.create(&l0).await.expect("create");
        store
            .create(&Lease::new(LeaseKey::new(group.clone(), p1), Position::Now))
            .await
            .expect("create");
        let report = estimate(&store, &feed, &group).await.expect("estimate");
        assert_eq!(report.leases[0].records.as_ref().ok(), Some(&Some(6)));
        assert_eq!(
            report.leases[1].records.as_ref().ok(),
            Some(&None),
            "Now: unknown"
        );
        assert_eq!(report.total(), 6);
        assert_eq!(report.unknown(), 1);
    }

    /// A clock whose wall time the test sets (the feed stamps records with it).
    #[derive(Debug)]
    struct Wall(std::sync::atomic::AtomicI64);

    impl Clock for Wall {
        fn now(&self) -> tokio::time::Instant {
            tokio::time::Instant::now()
        }
        fn wall(&self) -> Timestamp {
            Timestamp(self.0.load(std::sync::atomic::Ordering::SeqCst))
        }
        fn sleep(&self, duration: std::time::Duration) -> crate::clock::Sleep {
            SystemClock.sleep(duration)
        }
    }

    #[tokio::test]
    async fn children_of_a_split_without_leases_are_counted_from_their_beginning() {
        // `lag` counts the unread records of a split's children; it must not print `total 0`
        // while they hold some.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let group = GroupName::new("g").expect("valid");
        let p0 = PartitionId::new("0").expect("valid");
        let mut parent = Lease::new(
            LeaseKey::new(group.clone(), p0.clone()),
            Position::Beginning,
        );
        parent.continuation = Some(feed.append_to(&p0, "k", "x").expect("open"));
        store.create(&parent).await.expect("create");
        let (a, b) = feed.split(&p0).expect("split");
        for i in 0..5 {
            feed.append_to(&a, "k", format!("{i}")).expect("open");
        }
        for i in 0..7 {
            feed.append_to(&b, "k", format!("{i}")).expect("open");
        }
        let report = estimate(&store, &feed, &group).await.expect("estimate");
        assert_eq!(report.total(), 12, "both children are counted whole");
        let rows: Vec<_> = report
            .leases
            .iter()
            .map(|l| {
                (
                    l.partition.clone(),
                    l.leased,
                    l.records.as_ref().ok().copied().flatten(),
                )
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                (p0.clone(), true, Some(0)),
                (a.clone(), false, Some(5)),
                (b.clone(), false, Some(7))
            ]
        );
    }

    #[tokio::test]
    async fn children_continuing_from_their_parent_are_counted_from_its_checkpoint() {
        // On a source whose children continue from their parent (Cosmos DB), a
        // child without a lease will start at its parent's checkpoint (lineage rule 4), so
        // its lag counts from there, not from its beginning; a merge child still from its
        // beginning.
        let feed = crate::source::Behaving::continuing(MemoryFeed::new(3));
        let group = GroupName::new("g").expect("valid");
        let id = |s: &str| PartitionId::new(s).expect("valid");
        let (a, b) = feed.feed.split(&id("0")).expect("split");
        let merged = feed.feed.merge(&id("1"), &id("2")).expect("merge");
        let at = Continuation::new("0:7");
        let mut parent = Lease::new(LeaseKey::new(group.clone(), id("0")), Position::Beginning);
        parent.state = LeaseState::Finished;
        parent.continuation = Some(at.clone());
        let ones = [&id("1"), &id("2")].map(|p| {
            let mut l = Lease::new(LeaseKey::new(group.clone(), p.clone()), Position::Now);
            l.state = LeaseState::Finished;
            l.continuation = Some(Continuation::new(format!("{p}:3")));
            l
        });
        let leases = [parent.clone(), ones[0].clone(), ones[1].clone()];
        let starts = unleased(&feed, &leases, &BTreeSet::new())
            .await
            .expect("listed");
        // The source is told each lease's position (FeedSource::partitions_for).
        assert_eq!(
            *feed.asked.lock().expect("lock"),
            leases.each_ref().map(LeasedPartition::of)
        );
        assert_eq!(
            starts,
            vec![
                (a.clone(), Position::Continuation(at.clone())),
                (b.clone(), Position::Continuation(at)),
                (merged.clone(), Position::Beginning),
            ]
        );
        // A source whose children hold only what came after the split: from the beginning.
        let plain = unleased(&feed.feed, &leases, &BTreeSet::new())
            .await
            .expect("listed");
        assert!(
            plain.iter().all(|(_, s)| *s == Position::Beginning),
            "{plain:?}"
        );
    }

    #[tokio::test]
    async fn a_finished_parent_whose_lease_was_deleted_is_not_counted_again() {
        // Cleanup deletes a finished parent's lease once its children started: the fleet is
        // past it, so its records are not lag.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let group = GroupName::new("g").expect("valid");
        let p0 = PartitionId::new("0").expect("valid");
        for i in 0..9 {
            feed.append_to(&p0, "k", format!("{i}")).expect("open");
        }
        let (a, b) = feed.split(&p0).expect("split");
        for child in [&a, &b] {
            let mut lease = Lease::new(
                LeaseKey::new(group.clone(), child.clone()),
                Position::Beginning,
            );
            lease.parents = vec![p0.clone()];
            store.create(&lease).await.expect("create");
        }
        feed.append_to(&a, "k", "new").expect("open");
        let report = estimate(&store, &feed, &group).await.expect("estimate");
        assert_eq!(report.total(), 1, "only the child's record is unread");
        assert!(report.leases.iter().all(|l| l.leased), "{report:?}");
    }

    #[tokio::test]
    async fn lag_in_time_is_the_age_of_the_first_unread_record() {
        // Per lease, how old the oldest unprocessed record is; 0 when caught up.
        let clock = Arc::new(Wall(std::sync::atomic::AtomicI64::new(1_000_000)));
        let feed = MemoryFeed::with_clock(2, clock.clone());
        let store = MemoryLeaseStore::new();
        let group = GroupName::new("g").expect("valid");
        let p0 = PartitionId::new("0").expect("valid");
        let p1 = PartitionId::new("1").expect("valid");
        let first = feed.append_to(&p0, "k", "a").expect("open");
        clock
            .0
            .store(1_030_000, std::sync::atomic::Ordering::SeqCst);
        feed.append_to(&p0, "k", "b").expect("open");
        let caught_up = feed.append_to(&p1, "k", "c").expect("open");
        let mut l0 = Lease::new(
            LeaseKey::new(group.clone(), p0.clone()),
            Position::Beginning,
        );
        l0.continuation = Some(first);
        store.create(&l0).await.expect("create");
        let mut l1 = Lease::new(
            LeaseKey::new(group.clone(), p1.clone()),
            Position::Beginning,
        );
        l1.continuation = Some(caught_up);
        store.create(&l1).await.expect("create");
        let report = estimate_at(&store, &feed, &group, Timestamp(1_045_000))
            .await
            .expect("estimate");
        let ages: Vec<_> = report
            .leases
            .iter()
            .map(|l| l.age_ms.as_ref().ok().copied().flatten())
            .collect();
        assert_eq!(
            ages,
            vec![Some(15_000), Some(0)],
            "record b is 15 s old; p1 is caught up"
        );
        assert_eq!(report.max_age_ms(), Some(15_000));
        assert_eq!(
            lease_age_ms(
                &feed,
                &Lease::new(LeaseKey::new(group, p0), Position::Now),
                Timestamp(0)
            )
            .await
            .expect("asked"),
            None,
            "a Now lease without a checkpoint has no estimate"
        );
    }
}
