//! The leader's periodic task: partition discovery, lease creation and cleanup (KCL's shard
//! sync and lease cleanup).
//!
//! The host loop runs [`Syncer::run`] on the leader (the first live host by name) every
//! [`Settings::sync_interval`]. It lists the source's partitions, asks the pure
//! [`crate::lineage`] rules what to create and what may go, and applies that through the store:
//! creation is create-if-absent, so two hosts that both believe they lead create every lease
//! once; deletion is compare-and-swap on the version seen. The listing is skipped while the
//! leases cover the whole key range and none is finished ([`lineage::covers_key_space`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::callbacks::Callbacks;
use super::config::Settings;
use crate::error::{LeaseError, SourceError};
use crate::lease::LeaseStore;
use crate::lineage::{self, Input};
use crate::model::{GroupName, Lease, LeaseKey, Partition, PartitionId, Position};
use crate::source::{FeedSource, LeasedPartition};

/// What one sync did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct SyncReport {
    /// The partition listing was skipped (the leases cover the key space, none finished).
    pub skipped: bool,
    /// Leases this call created (a racing leader may have created others).
    pub created: Vec<PartitionId>,
    /// Finished leases this call deleted.
    pub deleted: Vec<PartitionId>,
    /// Partitions refused as corrupt.
    pub refused: usize,
}

impl SyncReport {
    /// Whether the lease table changed.
    pub fn changed(&self) -> bool {
        !self.created.is_empty() || !self.deleted.is_empty()
    }
}

/// Why a sync stopped early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SyncError {
    #[error("listing partitions failed: {0}")]
    Source(#[from] SourceError),
    #[error(transparent)]
    Store(#[from] LeaseError),
}

/// The sync task's memory between runs, on this host's clock.
#[derive(Debug, Default)]
pub(crate) struct Syncer {
    /// Since when each finished lease has been deletable.
    deletable_since: BTreeMap<PartitionId, Instant>,
    /// Since when each lease has been [retired](FeedSource::retired) (its stream removed).
    retired_since: BTreeMap<PartitionId, Instant>,
    /// The last creation plan, with the lease change counter and the partitions it was made
    /// from: the plan reads only which leases exist and their state (both move the counter)
    /// and the partitions, so while neither changed it is the same.
    last_plan: Option<(u64, Vec<Partition>, lineage::Plan)>,
    /// The program's choice of where a partition the group starts on begins.
    callbacks: Arc<Callbacks>,
}

/// Whether `new` starts at the group's start position `start` because the group starts on its
/// partition (lineage rules 1 and 3), as opposed to a child of closed parents (rule 4) or a
/// parent closing a gap next to a leased sibling (rule 2), which must start at their beginning
/// (or the group's `AtTime`) so that nothing between them and their parents is lost. Rule 1's
/// roots have no parents; rule 3 exists only for a `Now` start, and rules 2 and 4 never start
/// at `Now`.
fn starts_the_group(new: &lineage::NewLease, start: &Position) -> bool {
    new.start == *start && (new.parents.is_empty() || *start == Position::Now)
}

impl Syncer {
    /// A syncer asking `callbacks` where the partitions the group starts on begin.
    pub fn new(callbacks: Arc<Callbacks>) -> Self {
        Self {
            deletable_since: BTreeMap::new(),
            retired_since: BTreeMap::new(),
            last_plan: None,
            callbacks,
        }
    }

    /// Forgets the cleanup timers and the last plan (this host stopped leading): the next
    /// time it leads, it times cleanup delays afresh.
    pub fn reset(&mut self) {
        self.deletable_since.clear();
        self.retired_since.clear();
        self.last_plan = None;
    }

    /// One sync against `leases` (the group's current lease list, as of the change counter
    /// `counter` when known).
    ///
    /// # Errors
    /// [`SyncError`] if the source cannot be listed or a store call fails; what was written
    /// before stays written (every write is idempotent or conditional).
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &mut self,
        store: &dyn LeaseStore,
        source: &dyn FeedSource,
        group: &GroupName,
        settings: &Settings,
        leases: &[Arc<Lease>],
        now: Instant,
        counter: Option<u64>,
    ) -> Result<SyncReport, SyncError> {
        let mut report = SyncReport::default();
        if lineage::covers_key_space(leases)
            && !leases.iter().any(|l| source.retired(&l.key.partition))
        {
            // Nothing can be due: no lease finished, so no partition closed under a reader.
            self.deletable_since.clear();
            report.skipped = true;
            return Ok(report);
        }
        let leased: Vec<LeasedPartition> = leases.iter().map(|l| LeasedPartition::of(l)).collect();
        let partitions = source.partitions_for(&leased).await?;
        // The lineage rules read plain rows; a sync that gets this far is the leader's
        // occasional work, so a copy of the table for it is cheap.
        let leases: Vec<Lease> = leases.iter().map(|l| Lease::clone(l)).collect();
        let leases = leases.as_slice();
        let plan = match (&self.last_plan, counter) {
            (Some((at, listed, plan)), Some(c)) if *at == c && *listed == partitions => {
                plan.clone()
            }
            _ => {
                let plan = lineage::plan(
                    &Input::new(&partitions, leases, &settings.start_position)
                        .with_missing_parents(settings.missing_parents)
                        .with_child_start(source.child_start()),
                );
                self.last_plan = counter.map(|c| (c, partitions.clone(), plan.clone()));
                plan
            }
        };
        for err in &plan.errors {
            warn!(partition = %err.partition(), error = %err, "corrupt partition data; no lease for it");
        }
        report.refused = plan.errors.len();
        metrics::gauge!("changefeed_corrupt_partitions", "group" => group.to_string())
            .set(plan.errors.len() as f64);
        for new in plan.create {
            let start = if starts_the_group(&new, &settings.start_position) {
                self.callbacks.start_position(&new.partition, &new.start)
            } else {
                new.start
            };
            let mut lease = Lease::new(LeaseKey::new(group.clone(), new.partition.clone()), start)
                .with_parents(new.parents);
            if let Some(range) = new.key_range {
                lease.properties.insert(
                    lineage::RANGE_PROPERTY.to_string(),
                    lineage::range_property(range),
                );
            }
            if store.create(&lease).await?.is_some() {
                info!(lease = %lease.key, start = %lease.start, parents = ?lease.parents, "created lease");
                metrics::counter!("changefeed_leases_created_total", "group" => group.to_string())
                    .increment(1);
                report.created.push(new.partition);
            } else {
                debug!(lease = %lease.key, "lease already created by another host");
            }
        }
        if !settings.cleanup {
            return Ok(report);
        }
        let deletable = lineage::deletable(&partitions, leases);
        self.deletable_since.retain(|p, _| deletable.contains(p));
        for partition in deletable {
            let since = *self.deletable_since.entry(partition.clone()).or_insert(now);
            if now.saturating_duration_since(since) < settings.cleanup_delay {
                continue;
            }
            let Some(lease) = leases.iter().find(|l| l.key.partition == partition) else {
                continue;
            };
            match store.delete(&lease.key, lease.version).await {
                Ok(()) => {
                    info!(lease = %lease.key, "deleted finished lease; every child has started");
                    metrics::counter!("changefeed_leases_deleted_total", "group" => group.to_string())
                        .increment(1);
                    self.deletable_since.remove(&partition);
                    report.deleted.push(partition);
                }
                Err(LeaseError::Conflict { .. } | LeaseError::NotFound { .. }) => {
                    debug!(lease = %lease.key, "finished lease changed or went; next sync decides");
                }
                Err(err) => return Err(err.into()),
            }
        }
        self.retire(store, source, group, settings, leases, now, &mut report)
            .await?;
        Ok(report)
    }

    /// Deletes, by compare-and-swap at the version listed, the leases whose partition the
    /// source calls [retired](FeedSource::retired) (a stream removed from a multi-stream feed)
    /// once they have been retired for `cleanup_delay`, owned or not: an owner's next write
    /// finds the lease gone and its worker stops (lease lost). A partition that is merely no
    /// longer listed is not retired; lineage decides about those.
    #[allow(clippy::too_many_arguments)]
    async fn retire(
        &mut self,
        store: &dyn LeaseStore,
        source: &dyn FeedSource,
        group: &GroupName,
        settings: &Settings,
        leases: &[Lease],
        now: Instant,
        report: &mut SyncReport,
    ) -> Result<(), SyncError> {
        let retired: Vec<&Lease> = leases
            .iter()
            .filter(|l| source.retired(&l.key.partition))
            .collect();
        self.retired_since
            .retain(|p, _| retired.iter().any(|l| &l.key.partition == p));
        for lease in retired {
            let partition = &lease.key.partition;
            if report.deleted.contains(partition) {
                continue;
            }
            let since = *self.retired_since.entry(partition.clone()).or_insert(now);
            if now.saturating_duration_since(since) < settings.cleanup_delay {
                continue;
            }
            // The listing may be older than the owner's last checkpoint; the partition is
            // retired whatever the row says, so a conflict retries at the current version.
            let mut version = lease.version;
            for _ in 0..3 {
                match store.delete(&lease.key, version).await {
                    Ok(()) => {
                        info!(lease = %lease.key, owner = ?lease.owner, "deleted lease of a retired stream");
                        metrics::counter!("changefeed_leases_deleted_total", "group" => group.to_string())
                            .increment(1);
                        self.retired_since.remove(partition);
                        report.deleted.push(partition.clone());
                        break;
                    }
                    Err(LeaseError::Conflict { current, .. }) => version = current.version,
                    Err(LeaseError::NotFound { .. }) => break,
                    Err(err) => return Err(err.into()),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::lease::MemoryLeaseStore;
    use crate::model::{LeaseState, Position};
    use crate::source::MemoryFeed;

    fn group() -> GroupName {
        GroupName::new("g").expect("valid")
    }

    async fn listed(store: &MemoryLeaseStore) -> Vec<Lease> {
        let listing = store.list(&group()).await.expect("list");
        listing
            .leases
            .into_iter()
            .map(Arc::unwrap_or_clone)
            .collect()
    }

    /// One sync of the test group now, which must succeed.
    async fn sync(
        s: &mut Syncer,
        store: &MemoryLeaseStore,
        source: &dyn FeedSource,
        settings: &Settings,
        leases: &[Lease],
        counter: Option<u64>,
    ) -> SyncReport {
        let leases: Vec<Arc<Lease>> = leases.iter().cloned().map(Arc::new).collect();
        s.run(
            store,
            source,
            &group(),
            settings,
            &leases,
            Instant::now(),
            counter,
        )
        .await
        .expect("sync")
    }

    /// Splits partition "0" of `feed` and finishes its lease (the only one in `store`), as
    /// its reader would at the end of the parent. Returns the parent and the two children.
    async fn split_and_finish(
        feed: &MemoryFeed,
        store: &MemoryLeaseStore,
    ) -> (PartitionId, PartitionId, PartitionId) {
        let p0 = PartitionId::new("0").expect("valid");
        let (l, r) = feed.split(&p0).expect("split");
        let mut parent = listed(store).await.remove(0);
        parent.state = LeaseState::Finished;
        store
            .replace(&parent, parent.version)
            .await
            .expect("finish");
        (p0, l, r)
    }

    /// One sync now on the store's current leases, which must succeed.
    async fn sync_listed(
        s: &mut Syncer,
        store: &MemoryLeaseStore,
        source: &dyn FeedSource,
        settings: &Settings,
    ) -> SyncReport {
        let leases = listed(store).await;
        sync(s, store, source, settings, &leases, None).await
    }

    #[tokio::test(start_paused = true)]
    async fn two_concurrent_syncs_create_each_lease_exactly_once() {
        // DESIGN "Partition lineage": two leaders are harmless, creation is create-if-absent.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(8);
        let settings = Settings::default();
        let (mut a, mut b) = (Syncer::default(), Syncer::default());
        let now = Instant::now();
        let g = group();
        let (ra, rb) = tokio::join!(
            a.run(&store, &feed, &g, &settings, &[], now, None),
            b.run(&store, &feed, &g, &settings, &[], now, None),
        );
        let (ra, rb) = (ra.expect("sync a"), rb.expect("sync b"));
        let mut created: Vec<PartitionId> = ra.created.into_iter().chain(rb.created).collect();
        created.sort();
        let leases = listed(&store).await;
        assert_eq!(leases.len(), 8);
        let ids: Vec<PartitionId> = leases.iter().map(|l| l.key.partition.clone()).collect();
        assert_eq!(created, ids, "each lease created by exactly one of the two");
        assert!(leases.iter().all(|l| lineage::lease_range(l).is_some()));
    }

    #[tokio::test(start_paused = true)]
    async fn listing_is_skipped_while_leases_cover_the_key_space() {
        // KCL's "avoid a shard sync": full coverage and nothing finished means nothing is due.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(4);
        let settings = Settings::default();
        let mut s = Syncer::default();
        let first = sync(&mut s, &store, &feed, &settings, &[], None).await;
        assert_eq!(first.created.len(), 4);
        let leases = listed(&store).await;
        let again = sync(&mut s, &store, &feed, &settings, &leases, None).await;
        assert!(again.skipped);
    }

    #[tokio::test(start_paused = true)]
    async fn a_changed_partition_list_is_planned_afresh_at_the_same_counter() {
        // The creation plan is reused only while both the counter and the partitions stand.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let settings = Settings::default();
        let mut s = Syncer::default();
        let first = sync(&mut s, &store, &feed, &settings, &[], Some(1)).await;
        assert_eq!(first.created.len(), 1);
        let (_, l, r) = split_and_finish(&feed, &store).await;
        let leases = listed(&store).await;
        let second = sync(&mut s, &store, &feed, &settings, &leases, Some(1)).await;
        assert_eq!(second.created, vec![l, r]);
    }

    #[tokio::test(start_paused = true)]
    async fn children_start_at_the_parents_continuation_when_the_source_says_so() {
        // The sync passes the source's child start to the lineage rules.
        let store = MemoryLeaseStore::new();
        let feed = crate::source::Behaving::continuing(MemoryFeed::new(1));
        let settings = Settings::default();
        let mut s = Syncer::default();
        sync(&mut s, &store, &feed, &settings, &[], None).await;
        let mut parent = listed(&store).await.remove(0);
        let last = crate::model::Continuation::new("0:41");
        parent.continuation = Some(last.clone());
        store
            .replace(&parent, parent.version)
            .await
            .expect("checkpoint");
        let (p0, l, r) = split_and_finish(&feed.feed, &store).await;
        let report = sync_listed(&mut s, &store, &feed, &settings).await;
        assert_eq!(report.created, vec![l, r]);
        // The source was told each lease's position (FeedSource::partitions_for).
        assert_eq!(
            *feed.asked.lock().expect("lock"),
            [LeasedPartition::at(
                p0,
                Position::Continuation(last.clone())
            )]
        );
        let children: Vec<Position> = listed(&store)
            .await
            .into_iter()
            .filter(|x| !x.parents.is_empty())
            .map(|x| x.start)
            .collect();
        assert_eq!(children, vec![Position::Continuation(last); 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn finished_parent_is_deleted_after_the_delay_once_its_children_started() {
        // Rule 5: deletion waits for every child to start, then for cleanup_delay.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let settings = Settings {
            cleanup_delay: Duration::from_secs(30),
            ..Settings::default()
        };
        let mut s = Syncer::default();
        sync(&mut s, &store, &feed, &settings, &[], None).await;
        let (p0, l, r) = split_and_finish(&feed, &store).await;
        let report = sync_listed(&mut s, &store, &feed, &settings).await;
        assert_eq!(report.created, vec![l.clone(), r.clone()]);
        let leases = listed(&store).await;
        assert!(leases
            .iter()
            .filter(|x| x.key.partition != p0)
            .all(|x| x.parents == vec![p0.clone()] && x.start == Position::Beginning));
        // Children exist but have not started: the parent stays.
        tokio::time::advance(Duration::from_secs(60)).await;
        let report = sync(&mut s, &store, &feed, &settings, &leases, None).await;
        assert!(report.deleted.is_empty());
        for child in [&l, &r] {
            let mut c = leases
                .iter()
                .find(|x| &x.key.partition == child)
                .cloned()
                .expect("child lease");
            c.continuation = Some(crate::model::Continuation::new(format!("{child}:0")));
            store.replace(&c, c.version).await.expect("checkpoint");
        }
        let report = sync_listed(&mut s, &store, &feed, &settings).await;
        assert!(report.deleted.is_empty(), "the delay starts now");
        tokio::time::advance(Duration::from_secs(31)).await;
        let report = sync_listed(&mut s, &store, &feed, &settings).await;
        assert_eq!(report.deleted, vec![p0.clone()]);
    }

    #[tokio::test(start_paused = true)]
    async fn leases_of_a_removed_stream_are_retired_but_unlisted_ones_kept() {
        // Multi-stream: a removed stream's leases go (after the delay, even if owned); a lease
        // whose partition is merely no longer listed is not the same thing and stays.
        use std::sync::Arc;
        let store = MemoryLeaseStore::new();
        let multi = crate::source::MultiFeed::new();
        multi
            .add_stream("a", Arc::new(MemoryFeed::new(1)))
            .expect("valid");
        multi
            .add_stream("b", Arc::new(MemoryFeed::new(2)))
            .expect("valid");
        let settings = Settings {
            cleanup_delay: Duration::from_secs(10),
            ..Settings::default()
        };
        let mut s = Syncer::default();
        let report = sync(&mut s, &store, &multi, &settings, &[], None).await;
        assert_eq!(report.created.len(), 3);
        let trimmed = Lease::new(
            LeaseKey::new(group(), PartitionId::new("a:trimmed").expect("valid")),
            Position::Beginning,
        );
        store.create(&trimmed).await.expect("create");
        let mut owned = listed(&store)
            .await
            .into_iter()
            .find(|l| l.key.partition.as_str() == "b:0")
            .expect("b:0");
        owned.owner = Some(crate::model::HostName::new("h").expect("valid"));
        owned.state = LeaseState::Owned;
        store.replace(&owned, owned.version).await.expect("own");
        assert!(multi.remove_stream("b"));
        let report = sync_listed(&mut s, &store, &multi, &settings).await;
        assert!(report.deleted.is_empty(), "the delay starts now");
        tokio::time::advance(Duration::from_secs(11)).await;
        let report = sync_listed(&mut s, &store, &multi, &settings).await;
        assert_eq!(report.deleted.len(), 2, "{report:?}");
        let left: Vec<String> = listed(&store)
            .await
            .iter()
            .map(|l| l.key.partition.to_string())
            .collect();
        assert_eq!(left, vec!["a:0".to_string(), "a:trimmed".to_string()]);
    }

    #[tokio::test(start_paused = true)]
    async fn cleanup_off_keeps_finished_leases() {
        // Cleanup is configurable: off means finished leases stay.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let settings = Settings {
            cleanup: false,
            cleanup_delay: Duration::ZERO,
            ..Settings::default()
        };
        let mut s = Syncer::default();
        sync(&mut s, &store, &feed, &settings, &[], None).await;
        let (p0, _, _) = split_and_finish(&feed, &store).await;
        for _ in 0..2 {
            let leases = listed(&store).await;
            let mut started: Vec<Lease> = leases.clone();
            for c in started.iter_mut().filter(|x| x.key.partition != p0) {
                c.continuation = Some(crate::model::Continuation::new("x:0"));
            }
            let report = sync(&mut s, &store, &feed, &settings, &started, None).await;
            assert!(report.deleted.is_empty());
        }
        assert_eq!(listed(&store).await.len(), 3);
    }
}
