//! [`SqliteLeaseStore`]: the lease store seam on a SQLite file.
//!
//! It owns the tables `changefeed_leases`, `changefeed_heartbeats`, `changefeed_groups` (the
//! per-group change counter) and `changefeed_deletions`. Every write is one `BEGIN IMMEDIATE`
//! transaction that reads the row, checks the expected version and writes, so compare-and-swap
//! holds across every connection and process sharing the file. What the leases mean is the
//! core's business.
//!
//! # Listing changes
//!
//! [`LeaseStore::list_changes`] reads what changed hands after a counter value in O(changes),
//! from stamps written in the same transaction as the counter bump (schema version 2):
//!
//! - `changefeed_leases.changed_at`: the counter value at which the row was created or last
//!   changed state, owner or next_owner (a checkpoint keeps it). Indexed by
//!   `(group_name, changed_at)`; the read finds `changed_at > since` through that index and
//!   sorts the few rows by partition. NULL on rows from before the migration.
//! - `changefeed_deletions (group_name, partition, deleted_at)`: the counter value of the
//!   latest deletion of each key, indexed by `(group_name, deleted_at)`. A key deleted and
//!   created again after `since` is listed both as deleted and with its new row, so a reader
//!   that applies the deletions first ends up with the new row.
//! - `changefeed_groups.changes_from`: the oldest `since` the group can answer; `None` below it
//!   (and above the counter). It starts at the counter as of the migration (older rows carry no
//!   stamp) and rises when deletions are forgotten.
//! - `changefeed_groups.stamped_counter`: the counter as of the last stamped write. A writer
//!   that moves the counter without stamping (a process of the previous version still running
//!   on a migrated file, a hand edit) leaves it behind: the group then answers `None` until this
//!   store's next write, which raises `changes_from` to the counter that write found.
//!
//! Deletion records are bounded by a counter horizon, [`CHANGE_HORIZON`] (16,384 moves, as
//! the core's in-memory store): each delete forgets the deletions more than that many counter
//! moves older than itself, in the same transaction, and raises `changes_from` to the newest it
//! forgot. Every deletion moves the counter, so the table holds at most [`CHANGE_HORIZON`]
//! rows per group (at most one per key), and a host less than that far behind is answered.
//! Lease rows need no pruning: each holds only its latest stamp.
//!
//! The counter row and the rows listed are read in one read transaction, one snapshot: every
//! change up to the counter returned is included, none after it.
//!
//! # The membership view
//!
//! The view lives in the group's counter row (schema version 3), so [`MembershipStore::head`] is one
//! read of one row: `view_version` (the CAS), `view` (the view as JSON), and `view_leader`,
//! `view_leader_incarnation` and `view_leader_heartbeat`, which [`LeaseStore::lead_heartbeat`]
//! updates in the heartbeat's own transaction when the leader and incarnation match.

mod members;

use changefeed::lease::HeartbeatRole;
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::row::{SQL_COLUMNS, SQL_COLUMN_NAMES, SQL_TEXT_COLUMNS};
use changefeed::lease::{BackendError, Changes, LeaseRow, LeaseStore, Listing};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    PartitionId, Timestamp, Version,
};
use changefeed::LeaseError;
use rusqlite::types::{ToSql, ValueRef};
use rusqlite::{
    params, Connection, OptionalExtension, Row, Rows, Transaction, TransactionBehavior,
};

use crate::db::{is_busy, Db};
use crate::error::SqliteError;

/// A [`LeaseStore`] in a SQLite database file.
///
/// Each handle holds one connection; [`Clone`] shares it, while [`SqliteLeaseStore::open`]
/// called again (in this process or another) opens another one. Every call is one short
/// transaction and runs on tokio's blocking pool, so the async runtime is never blocked, even
/// while another writer holds the file's lock (calls wait up to 5 s for it, then fail with a
/// retryable [`LeaseError::Store`]). The exception is a checkpoint's single-row `UPDATE`
/// ([`LeaseStore::replace`] moving only the continuation): it runs on the calling thread when
/// the connection is free, and goes to the blocking pool to wait if another writer holds the
/// lock, since the trip there and back costs more than the statement.
///
/// It answers [`LeaseStore::list_changes`] from change stamps, in one read transaction that
/// costs O(changes): `Some` for any `since` from the group's oldest answerable counter value
/// up to its current counter, `None` otherwise. The oldest answerable value is the counter as
/// of the migration to schema version 2 (rows from before carry no stamp), raised when a
/// deletion more than [`CHANGE_HORIZON`] counter moves old is forgotten, or when a writer that
/// does not stamp (a process of the previous version, a hand edit) moved the counter.
#[derive(Debug, Clone)]
pub struct SqliteLeaseStore {
    db: Db,
}

/// A failure inside a blocking call: already a lease error, or a backend error still to be
/// tagged with the operation and key.
enum Fail {
    Lease(LeaseError),
    Backend(SqliteError),
}

impl From<LeaseError> for Fail {
    fn from(e: LeaseError) -> Self {
        Fail::Lease(e)
    }
}

impl From<rusqlite::Error> for Fail {
    fn from(e: rusqlite::Error) -> Self {
        Fail::Backend(SqliteError::Sqlite(e))
    }
}

impl From<SqliteError> for Fail {
    fn from(e: SqliteError) -> Self {
        Fail::Backend(e)
    }
}

/// How many change-counter moves back a group's deletions are remembered for
/// [`LeaseStore::list_changes`]: a host further behind than that when a deletion is forgotten
/// gets `None` and lists in full. The same bound as the core's in-memory store; it keeps at
/// most this many rows per group in `changefeed_deletions` (about a megabyte).
pub const CHANGE_HORIZON: u64 = 16_384;

/// [`CHANGE_HORIZON`] as SQLite's integer.
const HORIZON_SQL: i64 = CHANGE_HORIZON as i64;

impl SqliteLeaseStore {
    /// Opens the database at `path`, creating the file and the schema if needed.
    ///
    /// # Errors
    /// [`LeaseError::Store`] (operation `open`) if the file cannot be opened, or holds a
    /// schema newer than this build knows ([`SqliteError::SchemaTooNew`] as its source).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, LeaseError> {
        let path = path.as_ref();
        let db = Db::open(path)
            .await
            .map_err(|e| e.into_lease("open", Some(path.display().to_string())))?;
        Ok(Self { db })
    }

    /// The database file this handle opened.
    pub fn path(&self) -> &Path {
        self.db.path()
    }

    /// The version of the lease row under `key` as stored, whether or not the rest of it can
    /// be read; `None` if there is no row. For repairing a malformed row (`changefeed reset
    /// --force`): [`LeaseStore::delete`] removes it at this version.
    ///
    /// # Errors
    /// [`LeaseError::Malformed`] if not even the version can be read; [`LeaseError::Store`].
    pub async fn row_version(&self, key: &LeaseKey) -> Result<Option<Version>, LeaseError> {
        let key = key.clone();
        self.run("get", key.to_string(), move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT version FROM changefeed_leases WHERE group_name = ?1 AND partition = ?2",
            )?;
            let mut rows = stmt.query(params![key.group.as_str(), key.partition.as_str()])?;
            match rows.next()? {
                None => Ok(None),
                Some(row) => version_column(row, 0).map(Some).map_err(|reason| {
                    Fail::Lease(LeaseError::Malformed {
                        key: key.to_string(),
                        reason,
                    })
                }),
            }
        })
        .await
    }

    /// A heartbeat write; with `lead`, also the copy of its version into the view this host
    /// leads, in the same transaction.
    #[allow(clippy::too_many_arguments)]
    async fn write_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        lead: bool,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let (group, host, incarnation) = (group.clone(), host.clone(), incarnation.to_string());
        let report: Option<Arc<str>> = report.map(Into::into);
        self.run("heartbeat", format!("{group}/{host}"), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let current = read_heartbeat(&tx, &group, &host)?;
            let version = match (&current, expected) {
                (None, None) => Version::FIRST,
                (Some(row), Some(v)) if row.version == v => v.next(),
                _ => {
                    return Err(LeaseError::HeartbeatConflict {
                        group: group.to_string(),
                        host: host.to_string(),
                        current: current.map(Box::new),
                    }
                    .into())
                }
            };
            tx.prepare_cached(
                "INSERT INTO changefeed_heartbeats
                 (group_name, host, incarnation, version, written_at, report)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (group_name, host) DO UPDATE SET incarnation = excluded.incarnation,
                 version = excluded.version, written_at = excluded.written_at,
                 report = excluded.report",
            )?
            .execute(params![
                group.as_str(),
                host.as_str(),
                incarnation,
                to_sql_version(version)?,
                written_at.millis(),
                report.as_deref(),
            ])?;
            if lead {
                tx.prepare_cached(
                    "UPDATE changefeed_groups SET view_leader_heartbeat = ?1
                     WHERE group_name = ?2 AND view_leader = ?3 AND view_leader_incarnation = ?4",
                )?
                .execute(params![
                    to_sql_version(version)?,
                    group.as_str(),
                    host.as_str(),
                    incarnation
                ])?;
            }
            tx.commit()?;
            Ok(Heartbeat {
                group,
                host,
                incarnation: incarnation.into(),
                version,
                written_at,
                report,
            })
        })
        .await
    }

    async fn run<T, F>(&self, operation: &'static str, key: String, f: F) -> Result<T, LeaseError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, Fail> + Send + 'static,
    {
        match self.db.call(f).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(Fail::Lease(e))) => Err(e),
            Ok(Err(Fail::Backend(e))) => Err(e.into_lease(operation, Some(key))),
            Err(join) => Err(SqliteError::Task(join).into_lease(operation, Some(key))),
        }
    }
}

/// The parameters of a lease write: `?1` the group, `?2`…`?9` the text columns of
/// [`SQL_COLUMNS`] (`text`, from [`LeaseRow::sql_text`]), then `more`.
fn lease_params<'a>(
    group: &'a dyn ToSql,
    text: &'a [Option<Cow<'a, str>>],
    more: &[&'a dyn ToSql],
) -> Vec<&'a dyn ToSql> {
    let mut params: Vec<&dyn ToSql> = Vec::with_capacity(1 + text.len() + more.len());
    params.push(group);
    params.extend(text.iter().map(|t| t as &dyn ToSql));
    params.extend_from_slice(more);
    params
}

fn to_sql_version(v: Version) -> Result<i64, Fail> {
    i64::try_from(v.0).map_err(|_| {
        Fail::Lease(LeaseError::store(
            "write",
            None,
            false,
            format!("version {v} does not fit SQLite's INTEGER"),
        ))
    })
}

/// Writes `lease` as a checkpoint of the row at version `expected`: one `UPDATE` of the
/// continuation and version, matching only if every other column is as `row` writes it. The
/// stored columns it compares are then exactly the valid text it would write, and a
/// continuation is any text, so the row it overwrites was well formed. Returns whether it
/// wrote (`false`: the row is not that, or is absent; nothing changed).
fn checkpoint_in_place(
    conn: &Connection,
    lease: &Lease,
    row: &LeaseRow,
    expected: Version,
) -> Result<bool, Fail> {
    let new_version = to_sql_version(expected.next())?;
    let expected_sql = to_sql_version(expected)?;
    let written = conn
        .prepare_cached(
            "UPDATE changefeed_leases SET continuation = ?6, version = ?10
             WHERE group_name = ?1 AND partition = ?2 AND version = ?11
             AND state = ?3 AND owner IS ?4 AND next_owner IS ?5 AND start = ?7
             AND parents = ?8 AND properties = ?9",
        )?
        .execute(&*lease_params(
            &lease.key.group.as_str(),
            &row.sql_text(),
            &[&new_version, &expected_sql],
        ))?;
    Ok(written == 1)
}

/// Moves `group`'s change counter on by one and returns the new value, the stamp of the write
/// that moved it. Also keeps `stamped_counter` at the counter: if they differed, a writer that
/// does not stamp (an older build, a hand edit) moved the counter, so what changed up to here
/// cannot be told and the group answers `list_changes` only from here on (`changes_from`).
///
/// `DO UPDATE SET` expressions read the row as it was, so all three see the old counter.
fn bump_counter(tx: &Transaction<'_>, group: &str) -> rusqlite::Result<i64> {
    tx.prepare_cached(
        "INSERT INTO changefeed_groups (group_name, change_counter, changes_from, stamped_counter)
         VALUES (?1, 1, 0, 1)
         ON CONFLICT (group_name) DO UPDATE SET
           changes_from = CASE WHEN stamped_counter = change_counter THEN changes_from
                               ELSE change_counter END,
           change_counter = change_counter + 1,
           stamped_counter = change_counter + 1
         RETURNING change_counter",
    )?
    .query_row([group], |r| r.get(0))
}

/// Remembers that `group`/`partition` was deleted by the write stamped `at`, and forgets the
/// deletions more than [`CHANGE_HORIZON`] counter moves old, raising the group's
/// `changes_from` past them: a `since` older than a forgotten deletion cannot be answered.
///
/// Each call forgets what fell behind since the previous one, so the table holds at most
/// [`CHANGE_HORIZON`] rows per group (every deletion moves the counter), and each call costs
/// O(log n) plus the rows it forgets.
fn record_deletion(
    tx: &Transaction<'_>,
    group: &str,
    partition: &str,
    at: i64,
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO changefeed_deletions (group_name, partition, deleted_at) VALUES (?1, ?2, ?3)
         ON CONFLICT (group_name, partition) DO UPDATE SET deleted_at = excluded.deleted_at",
    )?
    .execute(params![group, partition, at])?;
    let horizon = at.saturating_sub(HORIZON_SQL);
    if horizon <= 0 {
        return Ok(());
    }
    let newest_forgotten: Option<i64> = tx
        .prepare_cached(
            "SELECT deleted_at FROM changefeed_deletions
             INDEXED BY changefeed_deletions_deleted_at
             WHERE group_name = ?1 AND deleted_at <= ?2 ORDER BY deleted_at DESC LIMIT 1",
        )?
        .query_row(params![group, horizon], |r| r.get(0))
        .optional()?;
    if let Some(forgotten) = newest_forgotten {
        tx.prepare_cached(
            "DELETE FROM changefeed_deletions WHERE group_name = ?1 AND deleted_at <= ?2",
        )?
        .execute(params![group, forgotten])?;
        tx.prepare_cached(
            "UPDATE changefeed_groups SET changes_from = MAX(changes_from, ?2)
             WHERE group_name = ?1",
        )?
        .execute(params![group, forgotten])?;
    }
    Ok(())
}

/// A group's change counter and how far back `list_changes` can answer from.
#[derive(Default)]
struct CounterRow {
    change_counter: i64,
    changes_from: i64,
    stamped_counter: i64,
}

impl CounterRow {
    fn read(conn: &Connection, group: &GroupName) -> rusqlite::Result<Self> {
        Ok(conn
            .prepare_cached(
                "SELECT change_counter, changes_from, stamped_counter FROM changefeed_groups
                 WHERE group_name = ?1",
            )?
            .query_row([group.as_str()], |r| {
                Ok(CounterRow {
                    change_counter: r.get(0)?,
                    changes_from: r.get(1)?,
                    stamped_counter: r.get(2)?,
                })
            })
            .optional()?
            .unwrap_or_default())
    }

    /// The counter as the core sees it (a negative value, only from a hand edit, reads as 0).
    fn counter(&self) -> u64 {
        u64::try_from(self.change_counter).unwrap_or(0)
    }

    /// Whether every change after `since` is stamped and remembered, so they can be listed.
    fn answers(&self, since: u64) -> bool {
        let (Ok(counter), Ok(from)) = (
            u64::try_from(self.change_counter),
            u64::try_from(self.changes_from),
        ) else {
            return false;
        };
        self.stamped_counter == self.change_counter && from <= since && since <= counter
    }
}

/// The group's head row: its change counter and membership view. A view that cannot be read
/// back (a hand edit) is an error naming the group, not a missing view: a missing view would
/// let the hosts elect a leader that overwrites it, which is what an operator fixing the row
/// wants anyway, but silently.
fn read_head(conn: &Connection, group: &GroupName) -> Result<GroupHead, Fail> {
    let row = conn
        .prepare_cached(
            "SELECT change_counter, view_version, view, view_leader_heartbeat
             FROM changefeed_groups WHERE group_name = ?1",
        )?
        .query_row([group.as_str()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })
        .optional()?;
    let Some((counter, version, json, leader_heartbeat)) = row else {
        return Ok(GroupHead::default());
    };
    let change_counter = u64::try_from(counter).unwrap_or(0);
    let view = match (version, json) {
        (0, _) | (_, None) => None,
        (version, Some(json)) => {
            let unreadable = |why: String| {
                Fail::Lease(LeaseError::store(
                    "head",
                    Some(group.to_string()),
                    false,
                    format!("the membership view of group {group} cannot be read: {why}"),
                ))
            };
            let mut view: MembershipView =
                serde_json::from_str(&json).map_err(|e| unreadable(e.to_string()))?;
            view.version = u64::try_from(version).map_err(|e| unreadable(e.to_string()))?;
            view.leader_heartbeat =
                Version(u64::try_from(leader_heartbeat).map_err(|e| unreadable(e.to_string()))?);
            Some(view)
        }
    };
    Ok(GroupHead {
        change_counter,
        view,
    })
}

/// Text of column `i`, or why it is not text.
fn text<'r>(row: &'r Row<'_>, i: usize, name: &str) -> Result<&'r str, String> {
    match row.get_ref(i).map_err(|e| format!("{name}: {e}"))? {
        ValueRef::Text(bytes) => {
            std::str::from_utf8(bytes).map_err(|_| format!("{name} is not valid UTF-8"))
        }
        ValueRef::Null => Err(format!("{name} is NULL")),
        other => Err(format!("{name} is not text ({:?})", other.data_type())),
    }
}

fn opt_text<'r>(row: &'r Row<'_>, i: usize, name: &str) -> Result<Option<&'r str>, String> {
    match row.get_ref(i).map_err(|e| format!("{name}: {e}"))? {
        ValueRef::Null => Ok(None),
        _ => text(row, i, name).map(Some),
    }
}

fn version_column(row: &Row<'_>, i: usize) -> Result<Version, String> {
    match row.get_ref(i).map_err(|e| format!("version: {e}"))? {
        ValueRef::Integer(v) if v >= 1 => Ok(Version(v as u64)),
        other => Err(format!(
            "version must be a positive integer, found {other:?}"
        )),
    }
}

/// The partition column as stored, for naming a row that cannot be parsed.
fn raw_text(row: &Row<'_>, i: usize) -> String {
    match row.get_ref(i) {
        Ok(ValueRef::Text(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("<{e}>"),
    }
}

/// Reads a lease row (columns in [`SQL_COLUMNS`] order), or a [`LeaseError::Malformed`]
/// naming its key and what is wrong.
fn parse_lease(group: &GroupName, row: &Row<'_>) -> Result<Lease, LeaseError> {
    parse_lease_fields(group, row).map_err(|reason| LeaseError::Malformed {
        key: format!("{group}/{}", raw_text(row, 0)),
        reason,
    })
}

fn parse_lease_fields(group: &GroupName, row: &Row<'_>) -> Result<Lease, String> {
    let mut text = [None; SQL_TEXT_COLUMNS];
    for (i, value) in text.iter_mut().enumerate() {
        *value = opt_text(row, i, SQL_COLUMN_NAMES[i])?;
    }
    let version = version_column(row, SQL_TEXT_COLUMNS)?;
    LeaseRow::from_sql_text(text, version.0)?.decode(group)
}

/// Reads every row of `rows` (columns in [`SQL_COLUMNS`] order) into `leases`, or into
/// `malformed` when it cannot be read: one bad row never hides the others.
fn read_lease_rows(
    group: &GroupName,
    mut rows: Rows<'_>,
    leases: &mut Vec<Arc<Lease>>,
    malformed: &mut Vec<LeaseError>,
) -> rusqlite::Result<()> {
    while let Some(row) = rows.next()? {
        match parse_lease(group, row) {
            Ok(lease) => leases.push(Arc::new(lease)),
            Err(e) => malformed.push(e),
        }
    }
    Ok(())
}

/// What is stored under a key: nothing, a lease, or a row that cannot be read (with its raw
/// version, if that much is readable).
enum Stored {
    Absent,
    Lease(Lease),
    Malformed(LeaseError, Option<Version>),
}

fn read_lease(conn: &Connection, key: &LeaseKey) -> rusqlite::Result<Stored> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {SQL_COLUMNS} FROM changefeed_leases WHERE group_name = ?1 AND partition = ?2"
    ))?;
    let mut rows = stmt.query(params![key.group.as_str(), key.partition.as_str()])?;
    Ok(match rows.next()? {
        None => Stored::Absent,
        Some(row) => match parse_lease(&key.group, row) {
            Ok(lease) => Stored::Lease(lease),
            Err(e) => Stored::Malformed(e, version_column(row, SQL_TEXT_COLUMNS).ok()),
        },
    })
}

fn read_heartbeat(
    conn: &Connection,
    group: &GroupName,
    host: &HostName,
) -> Result<Option<Heartbeat>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT host, incarnation, version, written_at, report FROM changefeed_heartbeats
         WHERE group_name = ?1 AND host = ?2",
    )?;
    let mut rows = stmt.query(params![group.as_str(), host.as_str()])?;
    match rows.next()? {
        None => Ok(None),
        Some(row) => Ok(Some(parse_heartbeat(group, row)?)),
    }
}

fn parse_heartbeat(group: &GroupName, row: &Row<'_>) -> Result<Heartbeat, SqliteError> {
    let parse = || -> Result<Heartbeat, String> {
        let host = HostName::new(text(row, 0, "host")?).map_err(|e| e.to_string())?;
        let incarnation = text(row, 1, "incarnation")?.to_string();
        let version = version_column(row, 2)?;
        let written_at = match row.get_ref(3).map_err(|e| e.to_string())? {
            ValueRef::Integer(ms) => Timestamp(ms),
            other => return Err(format!("written_at is not an integer: {other:?}")),
        };
        // Advisory: a report that cannot be read leaves the row without one, never unreadable.
        let report = match row.get_ref(4) {
            Ok(ValueRef::Text(t)) => std::str::from_utf8(t).ok().map(Into::into),
            _ => None,
        };
        Ok(Heartbeat {
            group: group.clone(),
            host,
            incarnation: incarnation.into(),
            version,
            written_at,
            report,
        })
    };
    parse().map_err(|reason| SqliteError::MalformedRow {
        table: "changefeed_heartbeats",
        key: format!("{group}/{}", raw_text(row, 0)),
        reason,
    })
}

fn conflict(key: &LeaseKey, expected: Version, current: Lease) -> LeaseError {
    LeaseError::Conflict {
        key: key.to_string(),
        expected,
        current: Box::new(current),
    }
}

fn not_found(key: &LeaseKey) -> LeaseError {
    LeaseError::NotFound {
        key: key.to_string(),
    }
}

#[async_trait]
impl LeaseStore for SqliteLeaseStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let group = group.clone();
        self.run("list", group.to_string(), move |conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {SQL_COLUMNS} FROM changefeed_leases WHERE group_name = ?1
                 ORDER BY partition"
            ))?;
            let mut listing = Listing::default();
            read_lease_rows(
                &group,
                stmt.query([group.as_str()])?,
                &mut listing.leases,
                &mut listing.malformed,
            )?;
            Ok(listing)
        })
        .await
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        let key = key.clone();
        self.run("get", key.to_string(), move |conn| {
            match read_lease(conn, &key)? {
                Stored::Absent => Ok(None),
                Stored::Lease(lease) => Ok(Some(lease)),
                Stored::Malformed(e, _) => Err(e.into()),
            }
        })
        .await
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        let mut stored = lease.clone();
        stored.version = Version::FIRST;
        self.run("create", lease.key.to_string(), move |conn| {
            let key = &stored.key;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let inserted = tx
                .prepare_cached(&format!(
                    "INSERT INTO changefeed_leases (group_name, {SQL_COLUMNS})
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 1)
                     ON CONFLICT (group_name, partition) DO NOTHING"
                ))?
                .execute(&*lease_params(&key.group.as_str(), &row.sql_text(), &[]))?;
            if inserted == 0 {
                return Ok(None); // dropping `tx` rolls back nothing
            }
            let at = bump_counter(&tx, key.group.as_str())?;
            tx.prepare_cached(
                "UPDATE changefeed_leases SET changed_at = ?3 WHERE group_name = ?1 AND partition = ?2",
            )?
            .execute(params![key.group.as_str(), key.partition.as_str(), at])?;
            tx.commit()?;
            Ok(Some(stored))
        })
        .await
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        // A checkpoint (every column but the continuation as written, at the expected version)
        // is one statement in its own transaction: no counter to move, and no read first. It
        // runs on this thread when the connection is free and no other writer holds the file
        // (`Db::try_now`), sparing a trip to the blocking pool and back per checkpoint.
        // Anything else (a conflict, a missing or malformed row, a change of hands or of
        // properties, a busy file) takes the transaction below, on the blocking pool, which
        // reads the row and says why.
        let attempt = self
            .db
            .try_now(|conn| checkpoint_in_place(conn, lease, &row, expected));
        let tried = matches!(attempt, Some(Ok(false)));
        match attempt {
            Some(Ok(true)) => {
                let mut stored = lease.clone();
                stored.version = expected.next();
                return Ok(stored);
            }
            Some(Err(Fail::Backend(SqliteError::Sqlite(e)))) if is_busy(&e) => {}
            Some(Err(Fail::Backend(e))) => {
                return Err(e.into_lease("replace", Some(lease.key.to_string())))
            }
            Some(Err(Fail::Lease(e))) => return Err(e),
            Some(Ok(false)) | None => {}
        }
        let lease = lease.clone();
        self.run("replace", lease.key.to_string(), move |conn| {
            // Unless it found the row otherwise above, the checkpoint may be possible now.
            if !tried && checkpoint_in_place(conn, &lease, &row, expected)? {
                let mut stored = lease;
                stored.version = expected.next();
                return Ok(stored);
            }
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let current = match read_lease(&tx, &lease.key)? {
                Stored::Absent => return Err(not_found(&lease.key).into()),
                Stored::Malformed(e, _) => return Err(e.into()),
                Stored::Lease(current) => current,
            };
            if current.version != expected {
                return Err(conflict(&lease.key, expected, current).into());
            }
            let mut stored = lease;
            stored.version = expected.next();
            // A change of hands is stamped with the counter value it moved to; a checkpoint
            // keeps the row's stamp.
            let changed_at = if current.ownership_differs(&stored) {
                Some(bump_counter(&tx, stored.key.group.as_str())?)
            } else {
                None
            };
            let version = to_sql_version(stored.version)?;
            tx.prepare_cached(
                "UPDATE changefeed_leases SET state = ?3, owner = ?4, next_owner = ?5,
                 continuation = ?6, start = ?7, parents = ?8, properties = ?9, version = ?10,
                 changed_at = COALESCE(?11, changed_at)
                 WHERE group_name = ?1 AND partition = ?2",
            )?
            .execute(&*lease_params(
                &stored.key.group.as_str(),
                &row.sql_text(),
                &[&version, &changed_at],
            ))?;
            tx.commit()?;
            Ok(stored)
        })
        .await
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        let key = key.clone();
        self.run("delete", key.to_string(), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            match read_lease(&tx, &key)? {
                Stored::Absent => return Err(not_found(&key).into()),
                Stored::Lease(current) if current.version != expected => {
                    return Err(conflict(&key, expected, current).into())
                }
                Stored::Lease(_) => {}
                // A malformed row can be deleted at its version, so an operator can clear it.
                Stored::Malformed(_, Some(version)) if version == expected => {}
                Stored::Malformed(e, _) => return Err(e.into()),
            }
            tx.prepare_cached(
                "DELETE FROM changefeed_leases WHERE group_name = ?1 AND partition = ?2",
            )?
            .execute(params![key.group.as_str(), key.partition.as_str()])?;
            let at = bump_counter(&tx, key.group.as_str())?;
            record_deletion(&tx, key.group.as_str(), key.partition.as_str(), at)?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        let group = group.clone();
        self.run("list_changes", group.to_string(), move |conn| {
            // One read transaction: the counter and the rows are one snapshot, so every change
            // up to the counter returned is in them, and none after it.
            let tx = conn.transaction()?;
            let counter = CounterRow::read(&tx, &group)?;
            if !counter.answers(since) {
                return Ok(None);
            }
            // `since` is at most the counter, an i64.
            let Ok(since) = i64::try_from(since) else {
                return Ok(None);
            };
            let mut changes = Changes {
                counter: counter.counter(),
                ..Changes::default()
            };
            {
                // INDEXED BY: the read must grow with the changes, never scan the group's
                // leases (which the planner might pick to save the sort).
                let mut stmt = tx.prepare_cached(&format!(
                    "SELECT {SQL_COLUMNS} FROM changefeed_leases
                     INDEXED BY changefeed_leases_changed_at
                     WHERE group_name = ?1 AND changed_at > ?2 ORDER BY partition"
                ))?;
                read_lease_rows(
                    &group,
                    stmt.query(params![group.as_str(), since])?,
                    &mut changes.leases,
                    &mut changes.malformed,
                )?;
                let mut stmt = tx.prepare_cached(
                    "SELECT partition FROM changefeed_deletions
                     INDEXED BY changefeed_deletions_deleted_at
                     WHERE group_name = ?1 AND deleted_at > ?2 ORDER BY partition",
                )?;
                let mut rows = stmt.query(params![group.as_str(), since])?;
                while let Some(row) = rows.next()? {
                    let partition = text(row, 0, "partition")
                        .and_then(|p| PartitionId::new(p).map_err(|e| e.to_string()));
                    match partition {
                        Ok(p) => changes.deleted.push(LeaseKey::new(group.clone(), p)),
                        Err(reason) => changes.malformed.push(LeaseError::Malformed {
                            key: format!("{group}/{}", raw_text(row, 0)),
                            reason: format!("deletion record: {reason}"),
                        }),
                    }
                }
            }
            tx.commit()?;
            Ok(Some(changes))
        })
        .await
    }
}
