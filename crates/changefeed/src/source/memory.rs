//! An in-memory [`FeedSource`] with append, split and merge: for tests and the simulator.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use bytes::Bytes;

use super::{key_hash, split_key_space, FeedSource, OldestUnread, PartitionReader};
use crate::clock::{Clock, SystemClock};
use crate::error::SourceError;
use crate::model::{
    Batch, Continuation, KeyRange, NumberedContinuation, Partition, PartitionId, Position, Record,
    Timestamp,
};

#[derive(Debug)]
struct Log {
    meta: Partition,
    /// (key, data, timestamp), in order. A record's offset is its index + 1: the continuation
    /// `"{partition}:{offset}"` means "the first `offset` records are done".
    records: Vec<(Arc<str>, Bytes, Timestamp)>,
}

#[derive(Debug, Default)]
struct State {
    logs: BTreeMap<PartitionId, Log>,
    next_id: u64,
}

/// An in-memory partitioned feed. Cloning gives another handle to the same feed.
///
/// Partitions are numbered `0`, `1`, … in creation order and divide the key-hash space between
/// them; [`MemoryFeed::append`] routes a record to the open partition whose range holds its
/// key's hash. [`MemoryFeed::split`] and [`MemoryFeed::merge`] close partitions and open
/// children, as Kinesis resharding does.
#[derive(Debug, Clone)]
pub struct MemoryFeed {
    state: Arc<Mutex<State>>,
    clock: Arc<dyn Clock>,
}

impl MemoryFeed {
    /// A feed with `partitions` open partitions covering the key space, stamping records with
    /// the system clock.
    pub fn new(partitions: u32) -> Self {
        Self::with_clock(partitions, Arc::new(SystemClock))
    }

    /// As [`MemoryFeed::new`], stamping records with `clock`'s wall time.
    pub fn with_clock(partitions: u32, clock: Arc<dyn Clock>) -> Self {
        let mut state = State::default();
        for range in split_key_space(partitions) {
            let id = state.fresh_id();
            state.logs.insert(
                id.clone(),
                Log {
                    meta: Partition {
                        id,
                        parents: Vec::new(),
                        closed: false,
                        key_range: Some(range),
                    },
                    records: Vec::new(),
                },
            );
        }
        Self {
            state: Arc::new(Mutex::new(state)),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a few map/vector operations that cannot panic half-way.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Appends a record with `key`, routed to the open partition covering the key's hash.
    /// Returns the partition and the record's continuation.
    pub fn append(&self, key: &str, data: impl Into<Bytes>) -> (PartitionId, Continuation) {
        let hash = key_hash(key);
        let now = self.clock.wall();
        let mut state = self.lock();
        let log = state
            .logs
            .values_mut()
            .find(|l| !l.meta.closed && l.meta.key_range.is_some_and(|r| r.contains(hash)))
            .expect("open partitions always cover the whole key space");
        log.records.push((Arc::from(key), data.into(), now));
        let c = continuation(&log.meta.id, log.records.len());
        (log.meta.id.clone(), c)
    }

    /// Appends a record to `partition` directly, whatever its key.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`], or [`SourceError::Corrupt`] if it is closed.
    pub fn append_to(
        &self,
        partition: &PartitionId,
        key: &str,
        data: impl Into<Bytes>,
    ) -> Result<Continuation, SourceError> {
        let now = self.clock.wall();
        let mut state = self.lock();
        let log = state.log_mut(partition)?;
        if log.meta.closed {
            return Err(SourceError::Corrupt {
                partition: partition.to_string(),
                reason: "is closed; cannot append".into(),
            });
        }
        log.records.push((Arc::from(key), data.into(), now));
        Ok(continuation(partition, log.records.len()))
    }

    /// Closes `partition` and opens two children dividing its key range. Returns their ids.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`], or [`SourceError::Corrupt`] if it is closed or its
    /// range is a single hash.
    pub fn split(
        &self,
        partition: &PartitionId,
    ) -> Result<(PartitionId, PartitionId), SourceError> {
        let mut state = self.lock();
        let log = state.log_mut(partition)?;
        let (lower, upper) = super::split_range(partition, open_range(log)?)?;
        log.meta.closed = true;
        let left = state.open_child(vec![partition.clone()], lower);
        let right = state.open_child(vec![partition.clone()], upper);
        Ok((left, right))
    }

    /// Closes `a` and `b`, which must be open with adjacent key ranges, and opens one child
    /// covering both. Returns its id.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`], or [`SourceError::Corrupt`] naming the partition that
    /// is closed or not adjacent.
    pub fn merge(&self, a: &PartitionId, b: &PartitionId) -> Result<PartitionId, SourceError> {
        let mut state = self.lock();
        let ra = open_range(state.log_mut(a)?)?;
        let rb = open_range(state.log_mut(b)?)?;
        let range = super::merge_ranges(a, ra, b, rb)?;
        state.log_mut(a)?.meta.closed = true;
        state.log_mut(b)?.meta.closed = true;
        Ok(state.open_child(vec![a.clone(), b.clone()], range))
    }

    /// Total records appended to `partition`.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`].
    pub fn len(&self, partition: &PartitionId) -> Result<usize, SourceError> {
        Ok(self.lock().log_mut(partition)?.records.len())
    }
}

fn open_range(log: &Log) -> Result<KeyRange, SourceError> {
    if log.meta.closed {
        return Err(SourceError::Corrupt {
            partition: log.meta.id.to_string(),
            reason: "is closed".into(),
        });
    }
    Ok(log.meta.key_range.unwrap_or(KeyRange::FULL))
}

impl State {
    fn fresh_id(&mut self) -> PartitionId {
        let id = PartitionId::new(self.next_id.to_string()).expect("a number is a valid id");
        self.next_id += 1;
        id
    }

    fn open_child(&mut self, parents: Vec<PartitionId>, range: KeyRange) -> PartitionId {
        let id = self.fresh_id();
        self.logs.insert(
            id.clone(),
            Log {
                meta: Partition {
                    id: id.clone(),
                    parents,
                    closed: false,
                    key_range: Some(range),
                },
                records: Vec::new(),
            },
        );
        id
    }

    fn log_mut(&mut self, partition: &PartitionId) -> Result<&mut Log, SourceError> {
        self.logs
            .get_mut(partition)
            .ok_or_else(|| SourceError::UnknownPartition {
                partition: partition.to_string(),
            })
    }
}

/// The feed's tokens: `PARTITION:OFFSET`, the offset counting the records done.
const TOKENS: NumberedContinuation = NumberedContinuation {
    placeholder: "OFFSET",
    noun: "offset",
};

fn continuation(partition: &PartitionId, offset: usize) -> Continuation {
    NumberedContinuation::format(partition, offset as u64)
}

/// Reads back an offset from a continuation of `partition` holding `len` records.
fn parse_offset(
    partition: &PartitionId,
    c: &Continuation,
    len: usize,
) -> Result<usize, SourceError> {
    // At most `len`, so it fits a usize.
    TOKENS
        .parse(partition, c, len as u64)
        .map(|offset| offset as usize)
}

#[async_trait]
impl FeedSource for MemoryFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        Ok(self.lock().logs.values().map(|l| l.meta.clone()).collect())
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let mut state = self.lock();
        let log = state.log_mut(partition)?;
        let offset = match from {
            Position::Beginning => 0,
            Position::Now => log.records.len(),
            Position::AtTime(t) => log.records.partition_point(|(_, _, ts)| ts < t),
            Position::Continuation(c) => parse_offset(partition, c, log.records.len())?,
        };
        Ok(Box::new(MemoryReader {
            feed: self.clone(),
            partition: partition.clone(),
            offset,
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        let mut state = self.lock();
        let log = state.log_mut(partition)?;
        let len = log.records.len();
        let offset = match after {
            None => 0,
            Some(c) => parse_offset(partition, c, len)?,
        };
        Ok(Some((len - offset) as u64))
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let mut state = self.lock();
        let log = state.log_mut(partition)?;
        let len = log.records.len();
        let offset = match after {
            None => 0,
            Some(c) => parse_offset(partition, c, len)?,
        };
        Ok(match log.records.get(offset) {
            Some((_, _, ts)) => OldestUnread::At(*ts),
            None => OldestUnread::CaughtUp,
        })
    }
}

#[derive(Debug)]
struct MemoryReader {
    feed: MemoryFeed,
    partition: PartitionId,
    offset: usize,
}

#[async_trait]
impl PartitionReader for MemoryReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        let mut state = self.feed.lock();
        let log = state.log_mut(&self.partition)?;
        let end = log.records.len().min(self.offset + max.max(1));
        let records: Vec<Record> = log.records[self.offset..end]
            .iter()
            .enumerate()
            .map(|(i, (key, data, ts))| Record {
                key: key.to_string(),
                data: data.clone(),
                continuation: continuation(&self.partition, self.offset + i + 1),
                timestamp: Some(*ts),
            })
            .collect();
        let end_of_partition = log.meta.closed && end == log.records.len();
        self.offset = end;
        Ok(Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            records,
            end_of_partition,
        })
    }
}

/// A memory feed behaving as other sources do, for the core's tests: its children continue
/// from their parent's continuation when `continuing` (Cosmos DB's
/// [`crate::lineage::ChildStart::ParentContinuation`]), and it lists every leased id it is
/// given when `naming` (a source whose leases can name partitions its own listing lacks).
/// `asked` keeps what the last [`FeedSource::partitions_for`] was given.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Behaving {
    pub feed: MemoryFeed,
    pub continuing: bool,
    pub naming: bool,
    pub asked: std::sync::Mutex<Vec<super::LeasedPartition>>,
}

#[cfg(test)]
impl Behaving {
    /// `feed` whose children continue from their parent.
    pub fn continuing(feed: MemoryFeed) -> Self {
        Self {
            feed,
            continuing: true,
            naming: false,
            asked: Default::default(),
        }
    }
}

#[cfg(test)]
#[async_trait]
impl FeedSource for Behaving {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.feed.partitions().await
    }
    async fn partitions_for(
        &self,
        leased: &[super::LeasedPartition],
    ) -> Result<Vec<Partition>, SourceError> {
        *self
            .asked
            .lock()
            .expect("not poisoned: only this call writes it") = leased.to_vec();
        let mut all = self.feed.partitions().await?;
        if self.naming {
            all.extend(leased.iter().map(|l| Partition {
                id: l.partition.clone(),
                parents: Vec::new(),
                closed: false,
                key_range: None,
            }));
        }
        Ok(all)
    }
    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        self.feed.open(partition, from).await
    }
    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        self.feed.remaining(partition, after).await
    }
    fn child_start(&self) -> crate::lineage::ChildStart {
        if self.continuing {
            crate::lineage::ChildStart::ParentContinuation
        } else {
            crate::lineage::ChildStart::Beginning
        }
    }
}
