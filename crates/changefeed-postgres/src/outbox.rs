//! [`PostgresOutbox`]: a transactional outbox as a partitioned feed source.
//!
//! An application writes change records into the outbox table **inside its own
//! transactions** with [`append`], so a record exists exactly when the business change it
//! describes committed. Each record's key is hashed with [`key_hash`] to the open partition
//! whose key range holds it; the source reads each partition in order.
//!
//! # Why transaction ids and the snapshot's `xmin`
//!
//! The classic outbox reader remembers the highest sequence number it read and asks for
//! `seq > last`. Under concurrent writers that loses records: T1 takes sequence 1, T2 takes
//! sequence 2 and commits, the reader reads 2, then T1 commits and its record 1 sits below
//! the reader's position for ever. Sequences (and commit timestamps without
//! `track_commit_timestamp`) are handed out before commit, so no column of the row alone
//! tells the reader that nothing below it can still appear.
//!
//! Every row here also stores its writer's transaction id (`pg_current_xact_id()`, 64-bit,
//! so it never wraps). The reader orders a partition by `(xid, seq)` and reads only rows
//! whose `xid` is below `pg_snapshot_xmin(pg_current_snapshot())`, the oldest transaction
//! still running when its statement started. Every transaction below that `xmin` has
//! finished (committed or rolled back), and every transaction that has not yet taken an id
//! will get one above it, so **the set of rows below `xmin` never changes again**: once the
//! reader has passed `(xid, seq)`, no row can appear before it. A late-committing writer
//! holds `xmin` down until it finishes, so its rows are delayed, never skipped. The
//! continuation is `partition@xid:seq`.
//!
//! The price: `xmin` is cluster-wide, so any long transaction on the server (in any
//! database) delays delivery — not correctness — until it ends. Keep transactions short, as
//! PostgreSQL's vacuum wants anyway. The order is transaction-id order (the order in which
//! writers took their first lock or write), which is commit order for writers that serialise
//! on the same rows **when the outbox write, or a lock on the entity, is the first write of
//! the transaction**: make it so where per-key order between conflicting transactions
//! matters. Within one transaction, records keep their insert order.
//!
//! A closed partition (see below) needs no `xmin` guard: every writer that could write to it
//! finished before it was closed, so all its rows are final and readable.
//!
//! # Generations and re-partitioning
//!
//! The table `{prefix}_outbox_meta` holds one row with the current generation. [`append`]
//! takes it `FOR SHARE`, then (in a second statement, so under READ COMMITTED it sees the
//! latest partitions) inserts into the open partition for the key. Re-shaping the partitions
//! ([`PostgresOutbox::repartition`], [`PostgresOutbox::split`], [`PostgresOutbox::merge`])
//! takes the same row `FOR UPDATE`, which waits until every writer of the old shape has
//! committed or rolled back and holds off new ones; it then bumps the generation, closes the
//! old partitions and opens their children, each listing the old partitions whose key ranges
//! overlap its own as parents, and commits. From then on every writer uses the new
//! partitions. So a closed partition receives no more records (it is listed `closed` at
//! once); its reader returns `end_of_partition` after its last row, and the processor starts
//! a child only after all its parents are finished (design rule 5), which keeps per-key
//! order across the change. A writer in a REPEATABLE READ or SERIALIZABLE transaction whose
//! snapshot predates a re-partition gets a serialization failure from [`append`] and retries,
//! as it would for any concurrent update.
//!
//! Partition ids are `{generation}.{index}`; the first generation's are `1.0`, `1.1`, …

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::BackendError;
use changefeed::model::{
    Batch, Continuation, KeyRange, Partition, PartitionId, Position, Record, Timestamp,
};
use changefeed::source::{
    key_hash, merge_ranges, split_key_space, split_range, FeedSource, OldestUnread, PartitionReader,
};
use changefeed::SourceError;
use tokio_postgres::Row;

use crate::db::{table, validate_prefix, Db, PgOptions};
use crate::error::PostgresError;

/// The schema version of the outbox tables this build creates and understands.
pub const OUTBOX_SCHEMA_VERSION: i32 = 1;

fn migrations(prefix: &str) -> Vec<String> {
    let meta = table(prefix, "outbox_meta");
    let parts = table(prefix, "outbox_partitions");
    let outbox = table(prefix, "outbox");
    let idx = table(prefix, "outbox_read_idx");
    vec![format!(
        r#"
        CREATE TABLE {meta} (
            id         integer PRIMARY KEY CHECK (id = 1),
            generation bigint NOT NULL
        );
        CREATE TABLE {parts} (
            id          text COLLATE "C" PRIMARY KEY,
            generation  bigint NOT NULL,
            idx         integer NOT NULL,
            parents     text NOT NULL,
            range_start numeric(39, 0) NOT NULL,
            range_end   numeric(39, 0) NOT NULL,
            closed_by   bigint
        );
        CREATE TABLE {outbox} (
            seq        bigserial PRIMARY KEY,
            xid        bigint NOT NULL DEFAULT (pg_current_xact_id()::text::bigint),
            partition  text COLLATE "C" NOT NULL,
            key        text NOT NULL,
            data       bytea NOT NULL,
            created_ms bigint NOT NULL
        );
        CREATE INDEX {idx} ON {outbox} (partition, xid, seq);
        "#
    )]
}

/// The outbox tables of one prefix, and the clock that stamps records: what [`append`]
/// needs, without a connection of its own.
#[derive(Clone)]
pub struct OutboxTable {
    prefix: String,
    clock: Arc<dyn Clock>,
    lock_meta: String,
    insert_routed: String,
    insert_direct: String,
}

impl std::fmt::Debug for OutboxTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxTable")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl OutboxTable {
    /// The outbox tables `{prefix}_outbox`, `{prefix}_outbox_partitions` and
    /// `{prefix}_outbox_meta`, stamping records with the system clock.
    ///
    /// # Errors
    /// [`PostgresError::Config`] if `prefix` breaks the identifier rules of
    /// [`PgOptions::prefix`].
    pub fn new(prefix: &str) -> Result<Self, PostgresError> {
        validate_prefix(prefix)?;
        let meta = table(prefix, "outbox_meta");
        let parts = table(prefix, "outbox_partitions");
        let outbox = table(prefix, "outbox");
        Ok(Self {
            prefix: prefix.to_string(),
            clock: Arc::new(SystemClock),
            lock_meta: format!("SELECT generation FROM {meta} WHERE id = 1 FOR SHARE"),
            insert_routed: format!(
                "INSERT INTO {outbox} (partition, key, data, created_ms)
                 SELECT id, $2, $3, $4 FROM {parts}
                 WHERE closed_by IS NULL AND $1::text::numeric BETWEEN range_start AND range_end
                 ORDER BY range_start LIMIT 1
                 RETURNING partition, xid, seq"
            ),
            insert_direct: format!(
                "INSERT INTO {outbox} (partition, key, data, created_ms)
                 SELECT id, $2, $3, $4 FROM {parts} WHERE closed_by IS NULL AND id = $1
                 RETURNING partition, xid, seq"
            ),
        })
    }

    /// Stamps records with `clock`'s wall time instead (for tests of `AtTime`).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The table prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// Where [`append`] put a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// The partition.
    pub partition: PartitionId,
    /// The writer's transaction id.
    pub xid: i64,
    /// The record's sequence number.
    pub seq: i64,
}

impl Appended {
    /// The continuation that stands for this record.
    pub fn continuation(&self) -> Continuation {
        continuation(&self.partition, self.xid, self.seq)
    }
}

fn appended(row: &Row) -> Result<Appended, PostgresError> {
    let partition: String = row.try_get(0)?;
    Ok(Appended {
        partition: PartitionId::new(partition.clone()).map_err(|e| {
            PostgresError::MalformedRow {
                table: "outbox_partitions",
                key: partition,
                reason: e.to_string(),
            }
        })?,
        xid: row.try_get(1)?,
        seq: row.try_get(2)?,
    })
}

/// Appends a record with `key` and `data` to the outbox **in the caller's transaction**: it
/// becomes visible to readers exactly when `tx` commits, and disappears if `tx` rolls back.
/// The record goes to the open partition whose key range holds [`key_hash`]`(key)`.
///
/// Two statements: the current generation row is taken `FOR SHARE` (so a concurrent
/// re-partition waits for this transaction), then the record is inserted. Call it early in
/// the transaction where per-key order between conflicting transactions matters (see the
/// [module docs](self)).
///
/// # Errors
/// [`PostgresError::NoOpenPartition`] if the outbox has no partitions yet;
/// [`PostgresError::Postgres`] from the server (a serialization failure, retryable, if a
/// REPEATABLE READ transaction raced a re-partition).
pub async fn append(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &OutboxTable,
    key: &str,
    data: &[u8],
) -> Result<Appended, PostgresError> {
    let no_partition = || PostgresError::NoOpenPartition {
        key: key.to_string(),
    };
    tx.query_opt(&outbox.lock_meta, &[])
        .await?
        .ok_or_else(no_partition)?;
    let hash = key_hash(key).to_string();
    let now = outbox.clock.wall().millis();
    let row = tx
        .query_opt(&outbox.insert_routed, &[&hash, &key, &data, &now])
        .await?
        .ok_or_else(no_partition)?;
    appended(&row)
}

/// Appends a record to `partition` directly, whatever its key's hash, in the caller's
/// transaction. For tests and tools; applications use [`append`], which keeps every key in
/// one partition.
///
/// # Errors
/// [`PostgresError::NoOpenPartition`] if `partition` does not exist or is closed;
/// [`PostgresError::Postgres`].
pub async fn append_to(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &OutboxTable,
    partition: &PartitionId,
    key: &str,
    data: &[u8],
) -> Result<Appended, PostgresError> {
    let no_partition = || PostgresError::NoOpenPartition {
        key: key.to_string(),
    };
    tx.query_opt(&outbox.lock_meta, &[])
        .await?
        .ok_or_else(no_partition)?;
    let now = outbox.clock.wall().millis();
    let row = tx
        .query_opt(
            &outbox.insert_direct,
            &[&partition.as_str(), &key, &data, &now],
        )
        .await?
        .ok_or_else(no_partition)?;
    appended(&row)
}

fn continuation(partition: &PartitionId, xid: i64, seq: i64) -> Continuation {
    Continuation::new(format!("{partition}@{xid}:{seq}"))
}

/// The statements of the source, with the table names filled in once.
#[derive(Debug)]
struct Sql {
    partitions: String,
    partition: String,
    read: String,
    ended: String,
    last: String,
    at_time: String,
    remaining: String,
    oldest_unread: String,
    lock_meta: String,
    open_partitions: String,
    close: String,
    insert_partition: String,
    create_meta: String,
}

impl Sql {
    fn new(prefix: &str) -> Self {
        let meta = table(prefix, "outbox_meta");
        let parts = table(prefix, "outbox_partitions");
        let outbox = table(prefix, "outbox");
        let xmin = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint";
        let xmax = "pg_snapshot_xmax(pg_current_snapshot())::text::bigint";
        let cols = "id, parents, closed_by IS NOT NULL, range_start::text, range_end::text";
        Sql {
            partitions: format!("SELECT {cols} FROM {parts} ORDER BY generation, idx"),
            partition: format!("SELECT closed_by IS NOT NULL, {xmax} FROM {parts} WHERE id = $1"),
            read: format!(
                "SELECT xid, seq, key, data, created_ms FROM {outbox}
                 WHERE partition = $1 AND (xid, seq) > ($2, $3)
                   AND (xid < {xmin}
                        OR EXISTS (SELECT 1 FROM {parts} WHERE id = $1 AND closed_by IS NOT NULL))
                 ORDER BY xid, seq LIMIT $4"
            ),
            ended: format!(
                "SELECT closed_by IS NOT NULL AND NOT EXISTS (
                    SELECT 1 FROM {outbox} WHERE partition = $1 AND (xid, seq) > ($2, $3))
                 FROM {parts} WHERE id = $1"
            ),
            last: format!(
                "SELECT xid, seq FROM {outbox} WHERE partition = $1
                 ORDER BY xid DESC, seq DESC LIMIT 1"
            ),
            at_time: format!(
                "SELECT xid, seq FROM {outbox} WHERE partition = $1 AND created_ms >= $2
                 ORDER BY xid, seq LIMIT 1"
            ),
            remaining: format!(
                "SELECT count(*) FROM {outbox} WHERE partition = $1 AND (xid, seq) > ($2, $3)"
            ),
            oldest_unread: format!(
                "SELECT created_ms FROM {outbox} WHERE partition = $1 AND (xid, seq) > ($2, $3)
                 ORDER BY xid, seq LIMIT 1"
            ),
            lock_meta: format!("SELECT generation FROM {meta} WHERE id = 1 FOR UPDATE"),
            open_partitions: format!(
                "SELECT {cols} FROM {parts} WHERE closed_by IS NULL ORDER BY range_start"
            ),
            close: format!(
                "UPDATE {parts} SET closed_by = $2 WHERE id = ANY($1) AND closed_by IS NULL"
            ),
            insert_partition: format!(
                "INSERT INTO {parts} (id, generation, idx, parents, range_start, range_end)
                 VALUES ($1, $2, $3, $4, $5::text::numeric, $6::text::numeric)"
            ),
            create_meta: format!(
                "INSERT INTO {meta} (id, generation) VALUES (1, 1) ON CONFLICT DO NOTHING
                 RETURNING generation"
            ),
        }
    }
}

/// A [`FeedSource`] over a transactional outbox table in PostgreSQL. See the
/// [module docs](self) for how it never skips a late-committing writer.
///
/// [`Clone`] shares the connection pool.
#[derive(Debug, Clone)]
pub struct PostgresOutbox {
    db: Db,
    table: OutboxTable,
    sql: Arc<Sql>,
}

/// One partition as stored.
fn parse_partition(row: &Row) -> Result<Partition, PostgresError> {
    let id: String = row.try_get(0)?;
    let bad = |reason: String| PostgresError::MalformedRow {
        table: "outbox_partitions",
        key: id.clone(),
        reason,
    };
    let parents: String = row.try_get(1)?;
    let parents: Vec<PartitionId> =
        serde_json::from_str(&parents).map_err(|e| bad(format!("parents: {e}")))?;
    let closed: bool = row.try_get(2)?;
    let start: String = row.try_get(3)?;
    let end: String = row.try_get(4)?;
    let range = KeyRange {
        start: start
            .parse()
            .map_err(|e| bad(format!("range_start: {e}")))?,
        end: end.parse().map_err(|e| bad(format!("range_end: {e}")))?,
    };
    Ok(Partition {
        id: PartitionId::new(id.clone()).map_err(|e| bad(e.to_string()))?,
        parents,
        closed,
        key_range: Some(range),
    })
}

/// What a re-shaping does: which open partitions to close, and the children to open (key
/// range and parents), computed from the open partitions under the generation lock.
type Reshape = Box<
    dyn FnOnce(
            &[Partition],
        )
            -> Result<(Vec<PartitionId>, Vec<(KeyRange, Vec<PartitionId>)>), SourceError>
        + Send,
>;

impl PostgresOutbox {
    /// Connects with `options` (its prefix is ignored: `table` names the tables) and brings
    /// the outbox tables up to date.
    ///
    /// # Errors
    /// [`SourceError::Source`] (operation `connect`) for a bad setting, an unreachable server
    /// (retryable), or tables written by a newer build ([`PostgresError::SchemaTooNew`]).
    pub async fn connect(options: PgOptions, table: OutboxTable) -> Result<Self, SourceError> {
        let fail = |e: PostgresError| e.into_source("connect", None);
        let options = options.prefix(table.prefix().to_string());
        let db = Db::new(&options).map_err(fail)?;
        db.migrate("outbox", &migrations(table.prefix()))
            .await
            .map_err(fail)?;
        let sql = Arc::new(Sql::new(table.prefix()));
        Ok(Self { db, table, sql })
    }

    /// The outbox tables this source reads.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Creates the first generation of `n` partitions (ids `1.0` … covering the key space in
    /// order) if the outbox has none. Returns whether this call created them.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn create_partitions(&self, n: u32) -> Result<bool, SourceError> {
        let sql = self.sql.clone();
        self.db
            .run("create_partitions", |mut client| async move {
                let tx = client.transaction().await?;
                if tx.query_opt(&sql.create_meta, &[]).await?.is_none() {
                    return Ok(false);
                }
                for (i, range) in split_key_space(n).into_iter().enumerate() {
                    let id = format!("1.{i}");
                    let idx = i32::try_from(i).unwrap_or(i32::MAX);
                    tx.execute(
                        &sql.insert_partition,
                        &[
                            &id,
                            &1i64,
                            &idx,
                            &"[]",
                            &range.start.to_string(),
                            &range.end.to_string(),
                        ],
                    )
                    .await?;
                }
                tx.commit().await?;
                Ok(true)
            })
            .await
            .map_err(|e| e.into_source("create_partitions", None))
    }

    /// Appends one record in a transaction of its own (see [`append`] for appending inside an
    /// application's transaction).
    ///
    /// # Errors
    /// As for [`append`], as a [`SourceError::Source`].
    pub async fn append_one(&self, key: &str, data: &[u8]) -> Result<Appended, SourceError> {
        let table = &self.table;
        self.db
            .run("append", |mut client| async move {
                let tx = client.transaction().await?;
                let a = append(&tx, table, key, data).await?;
                tx.commit().await?;
                Ok(a)
            })
            .await
            .map_err(|e| e.into_source("append", None))
    }

    /// Replaces every open partition by `m` new ones dividing the key space equally (a new
    /// generation). Each new partition lists as parents the old ones whose key ranges overlap
    /// its own; the old ones are closed. Waits for in-flight writers of the old generation.
    /// Returns the new partitions' ids.
    ///
    /// # Errors
    /// [`SourceError::Corrupt`] if the outbox has no partitions, or `m` is 0;
    /// [`SourceError::Source`].
    pub async fn repartition(&self, m: u32) -> Result<Vec<PartitionId>, SourceError> {
        if m == 0 {
            return Err(SourceError::Corrupt {
                partition: "*".into(),
                reason: "cannot repartition into 0 partitions".into(),
            });
        }
        self.reshape(Box::new(move |open| {
            let close: Vec<PartitionId> = open.iter().map(|p| p.id.clone()).collect();
            let children = split_key_space(m)
                .into_iter()
                .map(|r| {
                    let parents = open
                        .iter()
                        .filter(|p| {
                            p.key_range
                                .is_some_and(|pr| pr.start <= r.end && r.start <= pr.end)
                        })
                        .map(|p| p.id.clone())
                        .collect();
                    (r, parents)
                })
                .collect();
            Ok((close, children))
        }))
        .await
    }

    /// Closes `partition` and opens two children dividing its key range (a re-partition of
    /// that one partition; the others stay open). Returns the children.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Corrupt`] if it is closed or covers
    /// one hash; [`SourceError::Source`].
    pub async fn split(
        &self,
        partition: &PartitionId,
    ) -> Result<(PartitionId, PartitionId), SourceError> {
        let target = partition.clone();
        let ids = self
            .reshape(Box::new(move |open| {
                let (lower, upper) = split_range(&target, open_range(open, &target)?)?;
                Ok((
                    vec![target.clone()],
                    vec![(lower, vec![target.clone()]), (upper, vec![target.clone()])],
                ))
            }))
            .await?;
        match <[PartitionId; 2]>::try_from(ids) {
            Ok([a, b]) => Ok((a, b)),
            Err(_) => Err(SourceError::Corrupt {
                partition: partition.to_string(),
                reason: "split did not open two children".into(),
            }),
        }
    }

    /// Closes `a` and `b` (open, with adjacent key ranges) and opens one child covering both.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Corrupt`] naming the partition that
    /// is closed or not adjacent; [`SourceError::Source`].
    pub async fn merge(
        &self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Result<PartitionId, SourceError> {
        let (a2, b2) = (a.clone(), b.clone());
        let ids = self
            .reshape(Box::new(move |open| {
                let ra = open_range(open, &a2)?;
                let rb = open_range(open, &b2)?;
                let range = merge_ranges(&a2, ra, &b2, rb)?;
                Ok((
                    vec![a2.clone(), b2.clone()],
                    vec![(range, vec![a2.clone(), b2.clone()])],
                ))
            }))
            .await?;
        ids.into_iter().next().ok_or_else(|| SourceError::Corrupt {
            partition: a.to_string(),
            reason: "merge did not open a child".into(),
        })
    }

    /// The one re-shaping transaction: lock the generation row `FOR UPDATE` (waiting out every
    /// writer of the current shape), compute the change from the open partitions, bump the
    /// generation, close and open partitions, commit.
    async fn reshape(&self, plan: Reshape) -> Result<Vec<PartitionId>, SourceError> {
        enum Fail {
            Plan(SourceError),
            Db(PostgresError),
        }
        impl From<tokio_postgres::Error> for Fail {
            fn from(e: tokio_postgres::Error) -> Self {
                Fail::Db(e.into())
            }
        }
        impl From<PostgresError> for Fail {
            fn from(e: PostgresError) -> Self {
                Fail::Db(e)
            }
        }
        let sql = self.sql.clone();
        let work = |mut client: crate::db::Conn| async move {
            let inner = async {
                let tx = client.transaction().await?;
                let Some(row) = tx.query_opt(&sql.lock_meta, &[]).await? else {
                    return Err(Fail::Plan(SourceError::Corrupt {
                        partition: "*".into(),
                        reason: "the outbox has no partitions; call create_partitions first".into(),
                    }));
                };
                let generation: i64 = row.try_get(0)?;
                let next = generation + 1;
                let open = tx
                    .query(&sql.open_partitions, &[])
                    .await?
                    .iter()
                    .map(parse_partition)
                    .collect::<Result<Vec<_>, _>>()?;
                let (close, children) = plan(&open).map_err(Fail::Plan)?;
                tx.execute(
                    &format!(
                        "UPDATE {} SET generation = $1 WHERE id = 1",
                        table(self.db.prefix(), "outbox_meta")
                    ),
                    &[&next],
                )
                .await?;
                let close: Vec<String> = close.iter().map(|p| p.to_string()).collect();
                tx.execute(&sql.close, &[&close, &next]).await?;
                let mut ids = Vec::with_capacity(children.len());
                for (i, (range, parents)) in children.into_iter().enumerate() {
                    let id = format!("{next}.{i}");
                    let idx = i32::try_from(i).unwrap_or(i32::MAX);
                    let parents = serde_json::to_string(&parents).map_err(|source| {
                        PostgresError::Encode {
                            what: "parents",
                            source,
                        }
                    })?;
                    tx.execute(
                        &sql.insert_partition,
                        &[
                            &id,
                            &next,
                            &idx,
                            &parents,
                            &range.start.to_string(),
                            &range.end.to_string(),
                        ],
                    )
                    .await?;
                    ids.push(PartitionId::new(id).map_err(|e| {
                        Fail::Plan(SourceError::Corrupt {
                            partition: "*".into(),
                            reason: e.to_string(),
                        })
                    })?);
                }
                tx.commit().await?;
                Ok(ids)
            };
            // Carry plan errors through `Db::run` untouched.
            Ok::<_, PostgresError>(inner.await)
        };
        match self.db.run("repartition", work).await {
            Ok(Ok(ids)) => Ok(ids),
            Ok(Err(Fail::Plan(e))) => Err(e),
            Ok(Err(Fail::Db(e))) | Err(e) => Err(e.into_source("repartition", None)),
        }
    }

    async fn query(
        &self,
        operation: &'static str,
        partition: &PartitionId,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, SourceError> {
        self.db
            .run(operation, |client| async move {
                let stmt = client.prepare_cached(sql).await?;
                Ok(client.query(&stmt, params).await?)
            })
            .await
            .map_err(|e| e.into_source(operation, Some(partition.to_string())))
    }

    /// The cursor `(xid, seq)` a position stands for (reading returns rows after it), after
    /// checking the partition exists and the continuation is one of ours for it.
    async fn cursor(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<(i64, i64), SourceError> {
        let p = partition.as_str();
        let rows = self
            .query("open", partition, &self.sql.partition, &[&p])
            .await?;
        let Some(row) = rows.first() else {
            return Err(SourceError::UnknownPartition {
                partition: partition.to_string(),
            });
        };
        let xmax: i64 = row
            .try_get(1)
            .map_err(|e| PostgresError::from(e).into_source("open", Some(partition.to_string())))?;
        let at = |rows: Vec<Row>, inclusive: bool| -> Result<Option<(i64, i64)>, SourceError> {
            rows.first()
                .map(|r| {
                    let xid: i64 = r.try_get(0)?;
                    let seq: i64 = r.try_get(1)?;
                    Ok((xid, if inclusive { seq - 1 } else { seq }))
                })
                .transpose()
                .map_err(|e: tokio_postgres::Error| {
                    PostgresError::from(e).into_source("open", Some(partition.to_string()))
                })
        };
        match from {
            Position::Beginning => Ok((0, 0)),
            Position::Now => {
                let rows = self.query("open", partition, &self.sql.last, &[&p]).await?;
                Ok(at(rows, false)?.unwrap_or((0, 0)))
            }
            Position::AtTime(t) => {
                let ms = t.millis();
                let rows = self
                    .query("open", partition, &self.sql.at_time, &[&p, &ms])
                    .await?;
                match at(rows, true)? {
                    Some(c) => Ok(c),
                    None => {
                        let rows = self.query("open", partition, &self.sql.last, &[&p]).await?;
                        Ok(at(rows, false)?.unwrap_or((0, 0)))
                    }
                }
            }
            Position::Continuation(c) => parse_continuation(partition, c, xmax),
        }
    }
}

fn open_range(open: &[Partition], id: &PartitionId) -> Result<KeyRange, SourceError> {
    open.iter()
        .find(|p| &p.id == id)
        .and_then(|p| p.key_range)
        .ok_or_else(|| SourceError::Corrupt {
            partition: id.to_string(),
            reason: "is not an open partition".into(),
        })
}

/// Reads `partition@xid:seq` back, refusing another partition's token, garbage, and a
/// transaction id the server has not handed out yet (`xmax`).
fn parse_continuation(
    partition: &PartitionId,
    c: &Continuation,
    xmax: i64,
) -> Result<(i64, i64), SourceError> {
    let bad = |reason: &str| SourceError::InvalidContinuation {
        partition: partition.to_string(),
        continuation: c.to_string(),
        reason: reason.to_string(),
    };
    let (owner, rest) = c
        .as_str()
        .rsplit_once('@')
        .ok_or_else(|| bad("expected PARTITION@XID:SEQ"))?;
    if owner != partition.as_str() {
        return Err(bad(&format!("it belongs to partition {owner}")));
    }
    let (xid, seq) = rest
        .split_once(':')
        .ok_or_else(|| bad("expected PARTITION@XID:SEQ"))?;
    let xid: i64 = xid
        .parse()
        .map_err(|_| bad("XID is not a transaction id"))?;
    let seq: i64 = seq
        .parse()
        .map_err(|_| bad("SEQ is not a sequence number"))?;
    if xid < 0 || seq < 0 {
        return Err(bad("XID and SEQ must not be negative"));
    }
    if xid >= xmax {
        return Err(bad("XID is a transaction the server has not started yet"));
    }
    Ok((xid, seq))
}

#[async_trait]
impl FeedSource for PostgresOutbox {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        let sql = self.sql.clone();
        self.db
            .run("partitions", |client| async move {
                let stmt = client.prepare_cached(&sql.partitions).await?;
                client
                    .query(&stmt, &[])
                    .await?
                    .iter()
                    .map(parse_partition)
                    .collect()
            })
            .await
            .map_err(|e| e.into_source("partitions", None))
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let (xid, seq) = self.cursor(partition, from).await?;
        Ok(Box::new(OutboxReader {
            source: self.clone(),
            partition: partition.clone(),
            xid,
            seq,
            ended: false,
        }))
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        let from = after
            .map(|c| Position::Continuation(c.clone()))
            .unwrap_or(Position::Beginning);
        let (xid, seq) = self.cursor(partition, &from).await?;
        let p = partition.as_str();
        let rows = self
            .query(
                "remaining",
                partition,
                &self.sql.remaining,
                &[&p, &xid, &seq],
            )
            .await?;
        let n: i64 = rows
            .first()
            .map(|r| r.try_get(0))
            .transpose()
            .map_err(|e| {
                PostgresError::from(e).into_source("remaining", Some(partition.to_string()))
            })?
            .unwrap_or(0);
        Ok(Some(u64::try_from(n).unwrap_or(0)))
    }

    /// The `created_ms` of the first committed record after `after`, in read order (one row
    /// by the `(partition, xid, seq)` index): the writer's clock when it appended the record.
    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let from = after
            .map(|c| Position::Continuation(c.clone()))
            .unwrap_or(Position::Beginning);
        let (xid, seq) = self.cursor(partition, &from).await?;
        let p = partition.as_str();
        let rows = self
            .query(
                "oldest_unread",
                partition,
                &self.sql.oldest_unread,
                &[&p, &xid, &seq],
            )
            .await?;
        let first: Option<i64> = rows
            .first()
            .map(|r| r.try_get(0))
            .transpose()
            .map_err(|e| {
                PostgresError::from(e).into_source("oldest_unread", Some(partition.to_string()))
            })?;
        Ok(match first {
            Some(ms) => OldestUnread::At(Timestamp(ms)),
            None => OldestUnread::CaughtUp,
        })
    }
}

/// Reads one outbox partition forward from a cursor `(xid, seq)`.
#[derive(Debug)]
struct OutboxReader {
    source: PostgresOutbox,
    partition: PartitionId,
    xid: i64,
    seq: i64,
    ended: bool,
}

#[async_trait]
impl PartitionReader for OutboxReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        if self.ended {
            return Ok(Batch {
                end_of_partition: true,
                ..Batch::default()
            });
        }
        let limit = i64::try_from(max.max(1)).unwrap_or(i64::MAX);
        let p = self.partition.as_str();
        let rows = self
            .source
            .query(
                "read",
                &self.partition,
                &self.source.sql.read,
                &[&p, &self.xid, &self.seq, &limit],
            )
            .await?;
        let to_err = |e: tokio_postgres::Error| {
            PostgresError::from(e).into_source("read", Some(self.partition.to_string()))
        };
        let mut records = Vec::with_capacity(rows.len());
        let (mut xid, mut seq) = (self.xid, self.seq);
        for row in &rows {
            xid = row.try_get(0).map_err(to_err)?;
            seq = row.try_get(1).map_err(to_err)?;
            let data: Vec<u8> = row.try_get(3).map_err(to_err)?;
            records.push(Record {
                key: row.try_get(2).map_err(to_err)?,
                data: Bytes::from(data),
                continuation: continuation(&self.partition, xid, seq),
                timestamp: Some(Timestamp(row.try_get(4).map_err(to_err)?)),
            });
        }
        let mut end = false;
        if records.len() < max {
            let ended = self
                .source
                .query(
                    "read",
                    &self.partition,
                    &self.source.sql.ended,
                    &[&p, &xid, &seq],
                )
                .await?;
            end = ended
                .first()
                .map(|r| r.try_get::<_, Option<bool>>(0))
                .transpose()
                .map_err(to_err)?
                .flatten()
                .unwrap_or(false);
        }
        // Only move once everything above succeeded, so a failed call retries from here.
        self.xid = xid;
        self.seq = seq;
        self.ended = end;
        Ok(Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            records,
            end_of_partition: end,
        })
    }
}
