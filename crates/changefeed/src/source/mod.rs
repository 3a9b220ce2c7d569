//! The feed source seam: listing partitions and reading them in order.
//!
//! A [`FeedSource`] lists the partitions of a feed with their lineage and opens a
//! [`PartitionReader`] on one of them at a [`Position`]. The source alone understands its
//! continuations; the core only stores them and hands them back. [`MemoryFeed`] is the
//! in-memory implementation (with split and merge) for tests and the simulator; [`MultiFeed`]
//! consumes several named streams as one feed (KCL's multi-stream mode).

mod memory;
mod multi;

#[cfg(test)]
pub(crate) use memory::Behaving;
pub use memory::MemoryFeed;
pub use multi::{MultiFeed, STREAM_SEPARATOR};

use async_trait::async_trait;

use crate::error::SourceError;
use crate::lineage::ChildStart;
use crate::model::{Batch, Continuation, Lease, Partition, PartitionId, Position, Timestamp};

/// A partition the group holds a lease on, as [`FeedSource::partitions_for`] is told of it:
/// the partition and where a reader of it starts now, so that a source whose continuations
/// carry what its listing may no longer say (Cosmos DB: the key span of a range a merge took
/// away) can read it there.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct LeasedPartition {
    /// The partition the lease names.
    pub partition: PartitionId,
    /// Where its reader starts ([`Lease::resume_position`]: after the checkpoint, or the
    /// lease's start while it has none); `None` for a lease row that cannot be read.
    pub position: Option<Position>,
}

impl LeasedPartition {
    /// The partition of `lease`, at its resume position.
    pub fn of(lease: &Lease) -> Self {
        Self {
            partition: lease.key.partition.clone(),
            position: Some(lease.resume_position()),
        }
    }

    /// `partition`, leased and read from `position`.
    pub fn at(partition: PartitionId, position: Position) -> Self {
        Self {
            partition,
            position: Some(position),
        }
    }

    /// `partition`, whose lease row cannot be read (its position unknown).
    pub fn unreadable(partition: PartitionId) -> Self {
        Self {
            partition,
            position: None,
        }
    }
}

/// What [`FeedSource::oldest_unread`] knows of the first record after a position.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum OldestUnread {
    /// The source cannot tell (the default).
    Unknown,
    /// Nothing is after the position now: caught up, lag in time 0.
    CaughtUp,
    /// The first record after the position was accepted at this time, by the source's clock
    /// (the same time as its [`crate::model::Record::timestamp`]).
    At(Timestamp),
}

impl OldestUnread {
    /// How far behind `now` the first unread record is, in milliseconds (0 when caught up,
    /// and never negative: a source clock ahead of `now` counts as 0); `None` when unknown.
    pub fn age_ms(self, now: Timestamp) -> Option<u64> {
        match self {
            OldestUnread::Unknown => None,
            OldestUnread::CaughtUp => Some(0),
            OldestUnread::At(t) => Some(u64::try_from(now.0.saturating_sub(t.0)).unwrap_or(0)),
        }
    }
}

/// A partitioned, ordered feed of change records.
///
/// # Contract
///
/// - Within a partition, records are returned in one fixed order, and a reader opened at
///   `Position::Continuation(c)` returns exactly the records after the one `c` stands for.
/// - A partition listed as closed receives no more records; its reader eventually returns a
///   batch with `end_of_partition` set, and its children (partitions naming it as a parent)
///   are listed no later than that.
///
/// # Cancel safety
///
/// Every method only reads; dropping a future loses nothing.
#[async_trait]
pub trait FeedSource: Send + Sync + std::fmt::Debug {
    /// Every partition the source knows, open and closed, with their parents.
    ///
    /// # Errors
    /// [`SourceError::Source`] if the source cannot be read.
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError>;

    /// The partitions as the group holding the leases `leased` sees them: what
    /// [`FeedSource::partitions`] lists, for a source whose every partition is in its own
    /// listing (the default). A source where a lease can name a partition the feed does not
    /// list, a part of one of its partitions (a Cosmos DB lease on an effective partition key
    /// sub-range, taken over from the .NET processor, or the span of a range a merge took
    /// away, which only the lease's continuation still records), lists those too, with their
    /// lineage, and leaves out what they stand in for, so that the lineage rules neither read
    /// a key twice nor skip one. The partition sync and the lag estimator call this with the
    /// group's leases; the answer must depend only on the feed and `leased` (partitions and
    /// positions), so that every host plans alike.
    ///
    /// # Errors
    /// As for [`FeedSource::partitions`]; [`SourceError::Corrupt`] naming a leased partition
    /// that cannot be placed without reading a key twice (the sync then plans nothing).
    async fn partitions_for(
        &self,
        leased: &[LeasedPartition],
    ) -> Result<Vec<Partition>, SourceError> {
        let _ = leased;
        self.partitions().await
    }

    /// A reader of `partition` starting at `from`.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::InvalidContinuation`] if `from` holds
    /// a continuation this source did not issue for this partition; [`SourceError::Source`].
    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError>;

    /// How many records remain after `after` (`None`: from the beginning), where the source can
    /// tell; `Ok(None)` when it cannot. Used for lag.
    ///
    /// # Errors
    /// As for [`FeedSource::open`].
    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError>;

    /// When the first record after `after` (`None`: from the beginning) was accepted, where
    /// the source can tell: the lag in time of a reader at `after` is now minus that time.
    /// [`OldestUnread::CaughtUp`] when nothing is after `after`. Default:
    /// [`OldestUnread::Unknown`]. Costs about one small read (one row, or one `GetRecords`).
    ///
    /// # Errors
    /// As for [`FeedSource::open`].
    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let _ = (partition, after);
        Ok(OldestUnread::Unknown)
    }

    /// Where the lease of a child of finished parents starts (lineage rule 4):
    /// [`ChildStart::Beginning`] (the default) when a child holds only what was written to it
    /// after the split, [`ChildStart::ParentContinuation`] when it also holds its keys'
    /// records from before (Cosmos DB), so that a child of one parent must continue from the
    /// parent's final continuation (which this source must then accept for the child).
    fn child_start(&self) -> ChildStart {
        ChildStart::Beginning
    }

    /// Whether `partition` belongs to a part of the feed that is gone for good (a stream
    /// removed from a [`MultiFeed`]), so its lease should be deleted rather than kept. The
    /// partition sync (with `cleanup` on) deletes such leases after `cleanup_delay`, owned or
    /// not; a partition that is merely no longer listed (trimmed by retention) is not
    /// retired. Default: never.
    fn retired(&self, partition: &PartitionId) -> bool {
        let _ = partition;
        false
    }
}

/// Reads one partition forward.
#[async_trait]
pub trait PartitionReader: Send + std::fmt::Debug {
    /// The next records, at most `max` of them (`max` ≥ 1). An empty batch means nothing new
    /// yet, or, with `end_of_partition`, nothing ever again. An empty batch may carry a
    /// continuation: the reader's place restated (no record after the last one returned is
    /// passed), which the worker checkpoints as it would a batch's, without calling the
    /// handler (Cosmos DB restates a position with its range's span, so that the span
    /// outlives a merge).
    ///
    /// # Errors
    /// [`SourceError::Source`] on failure; the reader stays at the same place, so calling again
    /// retries.
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError>;
}

/// The stable hash of a record key into the 128-bit key space partitions divide: FNV-1a over
/// the bytes, then two splitmix64 finalizer rounds for the two halves, so that short keys
/// spread over the whole space. Sources that route records by key use it, so routing is the
/// same in every process and every run.
pub fn key_hash(key: &str) -> u128 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    (u128::from(mix(h)) << 64) | u128::from(mix(h ^ 0x5851_F42D_4C95_7F2D))
}

/// The halves a split of `partition`, covering `range`, opens ([`KeyRange::split`]); a
/// [`SourceError::Corrupt`] naming it when the range is a single hash.
///
/// [`KeyRange::split`]: crate::model::KeyRange::split
pub fn split_range(
    partition: &PartitionId,
    range: crate::model::KeyRange,
) -> Result<(crate::model::KeyRange, crate::model::KeyRange), SourceError> {
    range.split().ok_or_else(|| SourceError::Corrupt {
        partition: partition.to_string(),
        reason: "covers one hash; cannot split".into(),
    })
}

/// The range of the child a merge of `a` (covering `ra`) and `b` (covering `rb`) opens; a
/// [`SourceError::Corrupt`] naming `b` when they are not adjacent.
pub fn merge_ranges(
    a: &PartitionId,
    ra: crate::model::KeyRange,
    b: &PartitionId,
    rb: crate::model::KeyRange,
) -> Result<crate::model::KeyRange, SourceError> {
    ra.merge(rb).ok_or_else(|| SourceError::Corrupt {
        partition: b.to_string(),
        reason: format!("is not adjacent to partition {a}; cannot merge"),
    })
}

/// Splits the key space into `n` equal, contiguous ranges, in order (`n` ≥ 1).
pub fn split_key_space(n: u32) -> Vec<crate::model::KeyRange> {
    let n = u128::from(n.max(1));
    let width = u128::MAX / n;
    (0..n)
        .map(|i| crate::model::KeyRange {
            start: i * width,
            end: if i + 1 == n {
                u128::MAX
            } else {
                (i + 1) * width - 1
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_spread_over_every_range() {
        // Routing by key must use the whole key space, or some partitions never get records.
        let ranges = split_key_space(8);
        let mut counts = [0usize; 8];
        for i in 0..800 {
            let h = key_hash(&format!("key-{i}"));
            let slot = ranges.iter().position(|r| r.contains(h)).expect("covered");
            counts[slot] += 1;
        }
        assert!(counts.iter().all(|c| *c > 50), "{counts:?}");
    }

    #[test]
    fn key_space_ranges_are_contiguous_and_complete() {
        for n in [1, 2, 3, 7, 8] {
            let r = split_key_space(n);
            assert_eq!(r.len(), n as usize);
            assert_eq!(r[0].start, 0);
            assert_eq!(r[r.len() - 1].end, u128::MAX);
            for w in r.windows(2) {
                assert_eq!(w[0].end + 1, w[1].start);
            }
        }
    }
}
