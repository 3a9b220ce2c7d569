//! [`SqliteFeed`]: a partitioned, append-only feed in a SQLite file, with split and merge.
//!
//! It owns the tables `changefeed_partitions` (id, parents, closed, key-hash range) and
//! `changefeed_records` (partition, sequence number, key, data, timestamp) and mirrors the core's
//! in-memory `MemoryFeed`: records route by key hash to the open partition covering it, and
//! splits and merges close partitions and open children atomically. It serves as the embedded
//! default source (an outbox on one machine) and as a real-file test source.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::BackendError;
use changefeed::model::{
    Batch, Continuation, KeyRange, NumberedContinuation, Partition, PartitionId, Position, Record,
    Timestamp,
};
use changefeed::source::{
    key_hash, merge_ranges, split_key_space, split_range, FeedSource, OldestUnread, PartitionReader,
};
use changefeed::SourceError;
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};

use crate::db::Db;
use crate::error::SqliteError;

/// A [`FeedSource`] stored in a SQLite database file, which it can share with a
/// [`crate::SqliteLeaseStore`].
///
/// Partitions are numbered `0`, `1`, … in creation order and divide the 128-bit key-hash space
/// between them. Within a partition, records are numbered `1, 2, …` by a sequence assigned in
/// the appending transaction, so sequence order is commit order, with no gaps. A continuation
/// is `PARTITION:SEQ`: "the records up to `SEQ` are done".
///
/// Each handle holds one connection ([`Clone`] shares it; readers opened from a handle share
/// it too); every call runs on tokio's blocking pool. A reader asked for small batches reads
/// up to 1,000 records ahead in one transaction and serves the next batches from them, each
/// batch still the next records the file holds when it is asked for.
#[derive(Debug, Clone)]
pub struct SqliteFeed {
    db: Db,
    clock: Arc<dyn Clock>,
}

/// A failure inside a blocking call: already a source error, or a backend error still to be
/// tagged with the operation and partition.
enum Fail {
    Source(SourceError),
    Backend(SqliteError),
}

impl From<SourceError> for Fail {
    fn from(e: SourceError) -> Self {
        Fail::Source(e)
    }
}

impl From<rusqlite::Error> for Fail {
    fn from(e: rusqlite::Error) -> Self {
        Fail::Backend(SqliteError::Sqlite(e))
    }
}

async fn run<T, F>(
    db: &Db,
    operation: &'static str,
    partition: Option<String>,
    f: F,
) -> Result<T, SourceError>
where
    T: Send + 'static,
    F: FnOnce(&mut Connection) -> Result<T, Fail> + Send + 'static,
{
    match db.call(f).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(Fail::Source(e))) => Err(e),
        Ok(Err(Fail::Backend(e))) => Err(e.into_source(operation, partition)),
        Err(join) => Err(SqliteError::Task(join).into_source(operation, partition)),
    }
}

impl SqliteFeed {
    /// Opens the feed in the database at `path` (creating file and schema if needed), stamping
    /// records with the system clock. A new database has no partitions: call
    /// [`SqliteFeed::create_partitions`].
    ///
    /// # Errors
    /// [`SourceError::Source`] (operation `open`) if the file cannot be opened or holds a
    /// schema newer than this build knows.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SourceError> {
        Self::open_with_clock(path, Arc::new(SystemClock)).await
    }

    /// As [`SqliteFeed::open`], stamping records with `clock`'s wall time.
    ///
    /// # Errors
    /// As for [`SqliteFeed::open`].
    pub async fn open_with_clock(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, SourceError> {
        let db = Db::open(path.as_ref())
            .await
            .map_err(|e| e.into_source("open", None))?;
        Ok(Self { db, clock })
    }

    /// Creates `n` open partitions `0` … `n-1` dividing the key space evenly, if the feed has
    /// no partitions yet. Returns whether it created them (`false`: partitions already exist,
    /// and nothing changed).
    ///
    /// # Errors
    /// [`SourceError::Source`] if the database fails.
    pub async fn create_partitions(&self, n: u32) -> Result<bool, SourceError> {
        run(&self.db, "create_partitions", None, move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let existing: i64 =
                tx.query_row("SELECT COUNT(*) FROM changefeed_partitions", [], |r| {
                    r.get(0)
                })?;
            if existing > 0 {
                return Ok(false);
            }
            for (i, range) in split_key_space(n).into_iter().enumerate() {
                insert_partition(&tx, &i.to_string(), &[], range)?;
            }
            tx.commit()?;
            Ok(true)
        })
        .await
    }

    /// Appends a record with `key`, routed to the open partition covering the key's hash
    /// ([`key_hash`]). Returns the partition and the record's continuation.
    ///
    /// # Errors
    /// [`SourceError::Source`] if no open partition covers the hash (none were created) or the
    /// database fails.
    pub async fn append(
        &self,
        key: &str,
        data: impl Into<Bytes>,
    ) -> Result<(PartitionId, Continuation), SourceError> {
        let (key, data, now) = (key.to_string(), data.into(), self.clock.wall());
        let hash = key_hash(&key);
        run(&self.db, "append", None, move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let open = {
                let mut stmt = tx.prepare_cached(&format!(
                    "SELECT {PARTITION_COLUMNS} FROM changefeed_partitions WHERE closed = 0
                     ORDER BY id"
                ))?;
                let mut rows = stmt.query([])?;
                let mut found = None;
                while let Some(row) = rows.next()? {
                    let p = parse_partition(row)?;
                    if p.key_range.unwrap_or(KeyRange::FULL).contains(hash) {
                        found = Some(p.id);
                        break;
                    }
                }
                found
            };
            let Some(partition) = open else {
                return Err(Fail::Backend(SqliteError::NoOpenPartition { key }));
            };
            let c = insert_record(&tx, &partition, &key, &data, now)?;
            tx.commit()?;
            Ok((partition, c))
        })
        .await
    }

    /// Appends a record to `partition` directly, whatever its key.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Corrupt`] if it is closed;
    /// [`SourceError::Source`].
    pub async fn append_to(
        &self,
        partition: &PartitionId,
        key: &str,
        data: impl Into<Bytes>,
    ) -> Result<Continuation, SourceError> {
        let (partition, key, data, now) = (
            partition.clone(),
            key.to_string(),
            data.into(),
            self.clock.wall(),
        );
        run(
            &self.db,
            "append",
            Some(partition.to_string()),
            move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let p = require_partition(&tx, &partition)?;
                if p.closed {
                    return Err(SourceError::Corrupt {
                        partition: partition.to_string(),
                        reason: "is closed; cannot append".into(),
                    }
                    .into());
                }
                let c = insert_record(&tx, &partition, &key, &data, now)?;
                tx.commit()?;
                Ok(c)
            },
        )
        .await
    }

    /// Closes `partition` and opens two children dividing its key range, in one transaction.
    /// Returns their ids.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Corrupt`] if it is closed or its
    /// range is a single hash; [`SourceError::Source`].
    pub async fn split(
        &self,
        partition: &PartitionId,
    ) -> Result<(PartitionId, PartitionId), SourceError> {
        let partition = partition.clone();
        run(
            &self.db,
            "split",
            Some(partition.to_string()),
            move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let range = open_range(&require_partition(&tx, &partition)?)?;
                let (lower, upper) = split_range(&partition, range)?;
                close_partition(&tx, &partition)?;
                let first = next_id(&tx)?;
                let left = numbered_id(first)?;
                let right = numbered_id(first + 1)?;
                let parents = std::slice::from_ref(&partition);
                insert_partition(&tx, left.as_str(), parents, lower)?;
                insert_partition(&tx, right.as_str(), parents, upper)?;
                tx.commit()?;
                Ok((left, right))
            },
        )
        .await
    }

    /// Closes `a` and `b`, which must be open with adjacent key ranges, and opens one child
    /// covering both, in one transaction. Returns its id.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Corrupt`] naming the partition that
    /// is closed or not adjacent; [`SourceError::Source`].
    pub async fn merge(
        &self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Result<PartitionId, SourceError> {
        let (a, b) = (a.clone(), b.clone());
        run(&self.db, "merge", Some(a.to_string()), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let ra = open_range(&require_partition(&tx, &a)?)?;
            let rb = open_range(&require_partition(&tx, &b)?)?;
            let range = merge_ranges(&a, ra, &b, rb)?;
            close_partition(&tx, &a)?;
            close_partition(&tx, &b)?;
            let child = numbered_id(next_id(&tx)?)?;
            insert_partition(&tx, child.as_str(), &[a, b], range)?;
            tx.commit()?;
            Ok(child)
        })
        .await
    }

    /// Total records appended to `partition`.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Source`].
    pub async fn len(&self, partition: &PartitionId) -> Result<u64, SourceError> {
        let partition = partition.clone();
        run(&self.db, "len", Some(partition.to_string()), move |conn| {
            let tx = conn.transaction()?;
            require_partition(&tx, &partition)?;
            max_seq(&tx, &partition)
        })
        .await
    }
}

const PARTITION_COLUMNS: &str = "id, parents, closed, range_start, range_end";

fn corrupt(partition: &str, reason: impl Into<String>) -> Fail {
    Fail::Source(SourceError::Corrupt {
        partition: partition.to_string(),
        reason: reason.into(),
    })
}

fn raw_text(row: &Row<'_>, i: usize) -> String {
    match row.get_ref(i) {
        Ok(ValueRef::Text(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("<{e}>"),
    }
}

fn text<'r>(row: &'r Row<'_>, i: usize, name: &str) -> Result<&'r str, String> {
    match row.get_ref(i).map_err(|e| format!("{name}: {e}"))? {
        ValueRef::Text(bytes) => {
            std::str::from_utf8(bytes).map_err(|_| format!("{name} is not valid UTF-8"))
        }
        other => Err(format!("{name} is not text ({:?})", other.data_type())),
    }
}

/// Reads a partition row (columns in [`PARTITION_COLUMNS`] order).
fn parse_partition(row: &Row<'_>) -> Result<Partition, Fail> {
    let parse = || -> Result<Partition, String> {
        let id = PartitionId::new(text(row, 0, "id")?).map_err(|e| e.to_string())?;
        let parents: Vec<PartitionId> = serde_json::from_str(text(row, 1, "parents")?)
            .map_err(|e| format!("parents is not a JSON array of partition ids: {e}"))?;
        let closed = match row.get_ref(2).map_err(|e| e.to_string())? {
            ValueRef::Integer(0) => false,
            ValueRef::Integer(1) => true,
            other => return Err(format!("closed must be 0 or 1, found {other:?}")),
        };
        let bound = |i, name| -> Result<u128, String> {
            text(row, i, name)?
                .parse::<u128>()
                .map_err(|e| format!("{name} is not a decimal u128: {e}"))
        };
        let (start, end) = (bound(3, "range_start")?, bound(4, "range_end")?);
        if start > end {
            return Err(format!("key range {start}..={end} is empty"));
        }
        Ok(Partition {
            id,
            parents,
            closed,
            key_range: Some(KeyRange { start, end }),
        })
    };
    parse().map_err(|reason| corrupt(&raw_text(row, 0), reason))
}

fn load_partition(conn: &Connection, id: &PartitionId) -> Result<Option<Partition>, Fail> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {PARTITION_COLUMNS} FROM changefeed_partitions WHERE id = ?1"
    ))?;
    let mut rows = stmt.query([id.as_str()])?;
    match rows.next()? {
        None => Ok(None),
        Some(row) => parse_partition(row).map(Some),
    }
}

fn require_partition(conn: &Connection, id: &PartitionId) -> Result<Partition, Fail> {
    load_partition(conn, id)?.ok_or_else(|| {
        Fail::Source(SourceError::UnknownPartition {
            partition: id.to_string(),
        })
    })
}

fn open_range(p: &Partition) -> Result<KeyRange, Fail> {
    if p.closed {
        return Err(corrupt(p.id.as_str(), "is closed"));
    }
    Ok(p.key_range.unwrap_or(KeyRange::FULL))
}

fn close_partition(conn: &Connection, id: &PartitionId) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE changefeed_partitions SET closed = 1 WHERE id = ?1")?
        .execute([id.as_str()])?;
    Ok(())
}

fn insert_partition(
    conn: &Connection,
    id: &str,
    parents: &[PartitionId],
    range: KeyRange,
) -> Result<(), Fail> {
    let parents = serde_json::to_string(parents).map_err(|source| {
        Fail::Backend(SqliteError::Encode {
            what: "parents",
            source,
        })
    })?;
    conn.prepare_cached(
        "INSERT INTO changefeed_partitions (id, parents, closed, range_start, range_end)
         VALUES (?1, ?2, 0, ?3, ?4)",
    )?
    .execute(params![
        id,
        parents,
        range.start.to_string(),
        range.end.to_string()
    ])?;
    Ok(())
}

/// The id the next new partition gets: one more than the largest numeric id (`0` if none).
fn next_id(conn: &Connection) -> Result<u64, Fail> {
    let mut stmt = conn.prepare_cached("SELECT id FROM changefeed_partitions")?;
    let mut rows = stmt.query([])?;
    let mut next = 0u64;
    while let Some(row) = rows.next()? {
        if let Ok(ValueRef::Text(bytes)) = row.get_ref(0) {
            if let Some(n) = std::str::from_utf8(bytes)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
            {
                next = next.max(n.saturating_add(1));
            }
        }
    }
    Ok(next)
}

fn numbered_id(n: u64) -> Result<PartitionId, Fail> {
    PartitionId::new(n.to_string()).map_err(|e| corrupt(&n.to_string(), e.to_string()))
}

/// The sequence number of the last record of `partition` (0 when it has none).
fn max_seq(conn: &Connection, partition: &PartitionId) -> Result<u64, Fail> {
    let max: i64 = conn
        .prepare_cached(
            "SELECT COALESCE(MAX(seq), 0) FROM changefeed_records WHERE partition = ?1",
        )?
        .query_row([partition.as_str()], |r| r.get(0))?;
    u64::try_from(max).map_err(|_| corrupt(partition.as_str(), format!("negative sequence {max}")))
}

fn insert_record(
    conn: &Connection,
    partition: &PartitionId,
    key: &str,
    data: &[u8],
    now: Timestamp,
) -> Result<Continuation, Fail> {
    let seq = max_seq(conn, partition)? + 1;
    let seq_sql = i64::try_from(seq)
        .map_err(|_| corrupt(partition.as_str(), "sequence numbers exhausted"))?;
    conn.prepare_cached(
        "INSERT INTO changefeed_records (partition, seq, key, data, timestamp_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        partition.as_str(),
        seq_sql,
        key,
        data,
        now.millis()
    ])?;
    Ok(continuation(partition, seq))
}

/// The feed's tokens: `PARTITION:SEQUENCE`, the sequence number of the last record done.
const TOKENS: NumberedContinuation = NumberedContinuation {
    placeholder: "SEQUENCE",
    noun: "sequence number",
};

fn continuation(partition: &PartitionId, seq: u64) -> Continuation {
    NumberedContinuation::format(partition, seq)
}

/// Reads back the sequence number of a continuation of `partition`, whose last record is
/// `max`. Refuses a token of another partition, one that is not ours, or one past the end.
fn parse_seq(partition: &PartitionId, c: &Continuation, max: u64) -> Result<u64, SourceError> {
    TOKENS.parse(partition, c, max)
}

#[async_trait]
impl FeedSource for SqliteFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        run(&self.db, "partitions", None, |conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {PARTITION_COLUMNS} FROM changefeed_partitions ORDER BY id"
            ))?;
            let mut rows = stmt.query([])?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                out.push(parse_partition(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let (id, from) = (partition.clone(), from.clone());
        let after = run(&self.db, "open", Some(id.to_string()), move |conn| {
            let tx = conn.transaction()?;
            require_partition(&tx, &id)?;
            let max = max_seq(&tx, &id)?;
            let after = match &from {
                Position::Beginning => 0,
                Position::Now => max,
                Position::AtTime(t) => {
                    let first: Option<i64> = tx
                        .prepare_cached(
                            "SELECT seq FROM changefeed_records
                             WHERE partition = ?1 AND timestamp_ms >= ?2 ORDER BY seq LIMIT 1",
                        )?
                        .query_row(params![id.as_str(), t.millis()], |r| r.get(0))
                        .optional()?;
                    match first {
                        Some(seq) => u64::try_from(seq.saturating_sub(1)).unwrap_or(0),
                        None => max,
                    }
                }
                Position::Continuation(c) => parse_seq(&id, c, max)?,
            };
            Ok(after)
        })
        .await?;
        Ok(Box::new(SqliteReader {
            db: self.db.clone(),
            partition: partition.clone(),
            after,
            ahead: VecDeque::new(),
            ends: false,
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        let (id, after) = (partition.clone(), after.cloned());
        run(&self.db, "remaining", Some(id.to_string()), move |conn| {
            let tx = conn.transaction()?;
            require_partition(&tx, &id)?;
            let max = max_seq(&tx, &id)?;
            let done = match &after {
                None => 0,
                Some(c) => parse_seq(&id, c, max)?,
            };
            // Sequence numbers are contiguous from 1, so the count after `done` is a subtraction.
            Ok(Some(max - done))
        })
        .await
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let (id, after) = (partition.clone(), after.cloned());
        run(
            &self.db,
            "oldest_unread",
            Some(id.to_string()),
            move |conn| {
                let tx = conn.transaction()?;
                require_partition(&tx, &id)?;
                let max = max_seq(&tx, &id)?;
                let done = match &after {
                    None => 0,
                    Some(c) => parse_seq(&id, c, max)?,
                };
                // The record's own timestamp (the writer's clock when it was appended).
                let first: Option<i64> = tx
                    .prepare_cached(
                        "SELECT timestamp_ms FROM changefeed_records
                     WHERE partition = ?1 AND seq > ?2 ORDER BY seq LIMIT 1",
                    )?
                    .query_row(
                        params![id.as_str(), i64::try_from(done).unwrap_or(i64::MAX)],
                        |r| r.get(0),
                    )
                    .optional()?;
                Ok(match first {
                    Some(ms) => OldestUnread::At(Timestamp(ms)),
                    None => OldestUnread::CaughtUp,
                })
            },
        )
        .await
    }
}

/// Records a reader reads from the file in one go when the batches asked for are smaller, so
/// that small batches do not each cost a transaction: the next batches are served from what
/// was read. At most this many, and no more than [`READ_AHEAD_BYTES`] beyond the batch asked
/// for.
const READ_AHEAD_RECORDS: usize = 1_000;

/// The most bytes of keys and payloads a reader reads beyond the batch asked for (see
/// [`READ_AHEAD_RECORDS`]).
const READ_AHEAD_BYTES: usize = 256 * 1024;

/// Reads one partition of a [`SqliteFeed`] forward, by sequence number.
///
/// A batch of `max` records is the next `max` records after the last one returned, as the
/// file holds them when the batch is asked for: records are never changed or removed once
/// appended, so the reader reads ahead (up to [`READ_AHEAD_RECORDS`] in one transaction) and
/// serves the next batches from what it read, reading the file again once fewer than a
/// batch are left.
#[derive(Debug)]
struct SqliteReader {
    db: Db,
    partition: PartitionId,
    /// The sequence number of the last record read from the file (0: none yet).
    after: u64,
    /// Records read but not yet returned, in order; the last is record `after`.
    ahead: VecDeque<Record>,
    /// Whether the read that found record `after` saw the partition closed with `after` its
    /// last record: nothing will follow what is read.
    ends: bool,
}

/// What one read of a partition found: the records after the last one read, and whether
/// they end the closed partition.
struct ReadAhead {
    records: Vec<Record>,
    last: u64,
    ends: bool,
}

impl SqliteReader {
    /// Reads the records after `after`: at least `at_least` when there are that many, then on
    /// up to `at_most` while they fit in [`READ_AHEAD_BYTES`], in one read transaction (the
    /// rows, the closed flag and the last sequence agree). Changes nothing of the reader, so a
    /// failed read leaves it at the same place.
    async fn read(&self, at_least: usize, at_most: usize) -> Result<ReadAhead, SourceError> {
        let (id, after) = (self.partition.clone(), self.after);
        let limit = i64::try_from(at_most.max(1)).unwrap_or(i64::MAX);
        run(&self.db, "read", Some(id.to_string()), move |conn| {
            let tx = conn.transaction()?;
            let closed = require_partition(&tx, &id)?.closed;
            let end = max_seq(&tx, &id)?;
            let mut records = Vec::new();
            let mut last = after;
            let mut bytes = 0usize;
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT seq, key, data, timestamp_ms FROM changefeed_records
                     WHERE partition = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
                )?;
                let after_sql = i64::try_from(after).unwrap_or(i64::MAX);
                let mut rows = stmt.query(params![id.as_str(), after_sql, limit])?;
                while let Some(row) = rows.next()? {
                    let (seq, record) = parse_record(&id, row)?;
                    last = seq;
                    bytes = bytes.saturating_add(record.key.len() + record.data.len());
                    records.push(record);
                    if records.len() >= at_least && bytes >= READ_AHEAD_BYTES {
                        break;
                    }
                }
            }
            tx.commit()?;
            Ok(ReadAhead {
                records,
                last,
                ends: closed && last >= end,
            })
        })
        .await
    }
}

#[async_trait]
impl PartitionReader for SqliteReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        let max = max.max(1);
        if self.ahead.len() < max && !self.ends {
            let wanted = max - self.ahead.len();
            let room = READ_AHEAD_RECORDS.saturating_sub(self.ahead.len());
            let read = self.read(wanted, wanted.max(room)).await?;
            self.ahead.extend(read.records);
            self.after = read.last;
            self.ends = read.ends;
        }
        let records: Vec<Record> = self.ahead.drain(..max.min(self.ahead.len())).collect();
        Ok(Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            end_of_partition: self.ends && self.ahead.is_empty(),
            records,
        })
    }
}

fn parse_record(partition: &PartitionId, row: &Row<'_>) -> Result<(u64, Record), Fail> {
    let parse = || -> Result<(u64, Record), String> {
        let seq = match row.get_ref(0).map_err(|e| e.to_string())? {
            ValueRef::Integer(s) if s >= 1 => s as u64,
            other => return Err(format!("seq must be a positive integer, found {other:?}")),
        };
        let key = text(row, 1, "key")?.to_string();
        let data = match row.get_ref(2).map_err(|e| e.to_string())? {
            ValueRef::Blob(b) | ValueRef::Text(b) => Bytes::copy_from_slice(b),
            other => return Err(format!("data is not a blob ({:?})", other.data_type())),
        };
        let timestamp = match row.get_ref(3).map_err(|e| e.to_string())? {
            ValueRef::Integer(ms) => Timestamp(ms),
            other => return Err(format!("timestamp_ms is not an integer: {other:?}")),
        };
        Ok((
            seq,
            Record {
                key,
                data,
                continuation: continuation(partition, seq),
                timestamp: Some(timestamp),
            },
        ))
    };
    parse().map_err(|reason| corrupt(partition.as_str(), format!("malformed record: {reason}")))
}
