//! [`SqliteLeaseStore`]: the lease store seam on a SQLite file.
//!
//! It owns the tables `changefeed_leases`, `changefeed_heartbeats` and `changefeed_groups` (the
//! per-group change counter). Every write is one `BEGIN IMMEDIATE` transaction that reads the
//! row, checks the expected version and writes, so compare-and-swap holds across every
//! connection and process sharing the file. What the leases mean is the core's business.

use std::collections::BTreeMap;
use std::path::Path;

use async_trait::async_trait;
use changefeed::lease::{LeaseStore, Listing};
use changefeed::model::{
    Continuation, GroupName, Heartbeat, HostName, Lease, LeaseKey, LeaseState, Membership,
    PartitionId, Position, Timestamp, Version,
};
use changefeed::LeaseError;
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, OptionalExtension, Row, Transaction, TransactionBehavior};

use crate::db::Db;
use crate::error::SqliteError;

/// A [`LeaseStore`] in a SQLite database file.
///
/// Each handle holds one connection; [`Clone`] shares it, while [`SqliteLeaseStore::open`]
/// called again (in this process or another) opens another one. Every call runs on tokio's
/// blocking pool and is one short transaction, so the async runtime is never blocked, even
/// while another writer holds the file's lock (calls wait up to 5 s for it, then fail with a
/// retryable [`LeaseError::Store`]).
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

const LEASE_COLUMNS: &str =
    "partition, state, owner, next_owner, continuation, start, parents, properties, version";

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

/// A lease's columns, encoded for writing.
struct Encoded {
    group: String,
    partition: String,
    state: &'static str,
    owner: Option<String>,
    next_owner: Option<String>,
    continuation: Option<String>,
    start: String,
    parents: String,
    properties: String,
}

impl Encoded {
    fn new(lease: &Lease) -> Result<Self, LeaseError> {
        lease.validate()?;
        let key = || Some(lease.key.to_string());
        let parents = serde_json::to_string(&lease.parents).map_err(|source| {
            SqliteError::Encode {
                what: "parents",
                source,
            }
            .into_lease("encode", key())
        })?;
        let properties = serde_json::to_string(&lease.properties).map_err(|source| {
            SqliteError::Encode {
                what: "properties",
                source,
            }
            .into_lease("encode", key())
        })?;
        Ok(Self {
            group: lease.key.group.to_string(),
            partition: lease.key.partition.to_string(),
            state: lease.state.as_str(),
            owner: lease.owner.as_ref().map(|h| h.to_string()),
            next_owner: lease.next_owner.as_ref().map(|h| h.to_string()),
            continuation: lease.continuation.as_ref().map(|c| c.to_string()),
            start: lease.start.to_string(),
            parents,
            properties,
        })
    }
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

fn bump_counter(tx: &Transaction<'_>, group: &str) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO changefeed_groups (group_name, change_counter) VALUES (?1, 1)
         ON CONFLICT (group_name) DO UPDATE SET change_counter = change_counter + 1",
    )?
    .execute([group])?;
    Ok(())
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

/// Reads a lease row (columns in [`LEASE_COLUMNS`] order), or a [`LeaseError::Malformed`]
/// naming its key and what is wrong.
fn parse_lease(group: &GroupName, row: &Row<'_>) -> Result<Lease, LeaseError> {
    parse_lease_fields(group, row).map_err(|reason| LeaseError::Malformed {
        key: format!("{group}/{}", raw_text(row, 0)),
        reason,
    })
}

fn parse_lease_fields(group: &GroupName, row: &Row<'_>) -> Result<Lease, String> {
    let partition = PartitionId::new(text(row, 0, "partition")?).map_err(|e| e.to_string())?;
    let state: LeaseState = text(row, 1, "state")?
        .parse()
        .map_err(|e: changefeed::error::ModelError| e.to_string())?;
    let host = |i, name| -> Result<Option<HostName>, String> {
        opt_text(row, i, name)?
            .map(|h| HostName::new(h).map_err(|e| format!("{name}: {e}")))
            .transpose()
    };
    let owner = host(2, "owner")?;
    let next_owner = host(3, "next_owner")?;
    let continuation = opt_text(row, 4, "continuation")?.map(Continuation::new);
    let start: Position = text(row, 5, "start")?
        .parse()
        .map_err(|e: changefeed::error::ModelError| format!("start: {e}"))?;
    let parents: Vec<PartitionId> = serde_json::from_str(text(row, 6, "parents")?)
        .map_err(|e| format!("parents is not a JSON array of partition ids: {e}"))?;
    let properties: BTreeMap<String, String> = serde_json::from_str(text(row, 7, "properties")?)
        .map_err(|e| format!("properties is not a JSON object of strings: {e}"))?;
    let version = version_column(row, 8)?;
    let lease = Lease {
        key: LeaseKey::new(group.clone(), partition),
        state,
        owner,
        next_owner,
        continuation,
        start,
        parents,
        properties,
        version,
    };
    lease.validate().map_err(|e| e.to_string())?;
    Ok(lease)
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
        "SELECT {LEASE_COLUMNS} FROM changefeed_leases WHERE group_name = ?1 AND partition = ?2"
    ))?;
    let mut rows = stmt.query(params![key.group.as_str(), key.partition.as_str()])?;
    Ok(match rows.next()? {
        None => Stored::Absent,
        Some(row) => match parse_lease(&key.group, row) {
            Ok(lease) => Stored::Lease(lease),
            Err(e) => Stored::Malformed(e, version_column(row, 8).ok()),
        },
    })
}

fn read_heartbeat(
    conn: &Connection,
    group: &GroupName,
    host: &HostName,
) -> Result<Option<Heartbeat>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT host, incarnation, version, written_at FROM changefeed_heartbeats
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
        Ok(Heartbeat {
            group: group.clone(),
            host,
            incarnation: incarnation.into(),
            version,
            written_at,
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
                "SELECT {LEASE_COLUMNS} FROM changefeed_leases WHERE group_name = ?1
                 ORDER BY partition"
            ))?;
            let mut rows = stmt.query([group.as_str()])?;
            let mut listing = Listing::default();
            while let Some(row) = rows.next()? {
                match parse_lease(&group, row) {
                    Ok(lease) => listing.leases.push(lease),
                    Err(e) => listing.malformed.push(e),
                }
            }
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
        let encoded = Encoded::new(lease)?;
        let mut stored = lease.clone();
        stored.version = Version::FIRST;
        self.run("create", lease.key.to_string(), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let inserted = tx
                .prepare_cached(&format!(
                    "INSERT INTO changefeed_leases (group_name, {LEASE_COLUMNS})
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 1)
                     ON CONFLICT (group_name, partition) DO NOTHING"
                ))?
                .execute(params![
                    encoded.group,
                    encoded.partition,
                    encoded.state,
                    encoded.owner,
                    encoded.next_owner,
                    encoded.continuation,
                    encoded.start,
                    encoded.parents,
                    encoded.properties,
                ])?;
            if inserted == 0 {
                return Ok(None); // dropping `tx` rolls back nothing
            }
            bump_counter(&tx, &encoded.group)?;
            tx.commit()?;
            Ok(Some(stored))
        })
        .await
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        let encoded = Encoded::new(lease)?;
        let lease = lease.clone();
        self.run("replace", lease.key.to_string(), move |conn| {
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
            tx.prepare_cached(
                "UPDATE changefeed_leases SET state = ?3, owner = ?4, next_owner = ?5,
                 continuation = ?6, start = ?7, parents = ?8, properties = ?9, version = ?10
                 WHERE group_name = ?1 AND partition = ?2",
            )?
            .execute(params![
                encoded.group,
                encoded.partition,
                encoded.state,
                encoded.owner,
                encoded.next_owner,
                encoded.continuation,
                encoded.start,
                encoded.parents,
                encoded.properties,
                to_sql_version(stored.version)?,
            ])?;
            if current.ownership_differs(&stored) {
                bump_counter(&tx, &encoded.group)?;
            }
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
            bump_counter(&tx, key.group.as_str())?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
    ) -> Result<Heartbeat, LeaseError> {
        let (group, host, incarnation) = (group.clone(), host.clone(), incarnation.to_string());
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
                 (group_name, host, incarnation, version, written_at) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (group_name, host) DO UPDATE SET incarnation = excluded.incarnation,
                 version = excluded.version, written_at = excluded.written_at",
            )?
            .execute(params![
                group.as_str(),
                host.as_str(),
                incarnation,
                to_sql_version(version)?,
                written_at.millis(),
            ])?;
            tx.commit()?;
            Ok(Heartbeat {
                group,
                host,
                incarnation: incarnation.into(),
                version,
                written_at,
            })
        })
        .await
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let (group, host) = (group.clone(), host.clone());
        self.run("remove_heartbeat", format!("{group}/{host}"), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            match read_heartbeat(&tx, &group, &host)? {
                None => return Ok(()),
                Some(row) if row.version == expected => {}
                Some(row) => {
                    return Err(LeaseError::HeartbeatConflict {
                        group: group.to_string(),
                        host: host.to_string(),
                        current: Some(Box::new(row)),
                    }
                    .into())
                }
            }
            tx.prepare_cached(
                "DELETE FROM changefeed_heartbeats WHERE group_name = ?1 AND host = ?2",
            )?
            .execute(params![group.as_str(), host.as_str()])?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let group = group.clone();
        self.run("membership", group.to_string(), move |conn| {
            // One read transaction: the heartbeats and the counter are one snapshot.
            let tx = conn.transaction()?;
            let mut hosts = Vec::new();
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT host, incarnation, version, written_at FROM changefeed_heartbeats
                     WHERE group_name = ?1 ORDER BY host",
                )?;
                let mut rows = stmt.query([group.as_str()])?;
                while let Some(row) = rows.next()? {
                    hosts.push(parse_heartbeat(&group, row)?);
                }
            }
            let counter: Option<i64> = tx
                .prepare_cached(
                    "SELECT change_counter FROM changefeed_groups WHERE group_name = ?1",
                )?
                .query_row([group.as_str()], |r| r.get(0))
                .optional()?;
            tx.commit()?;
            Ok(Membership {
                hosts,
                change_counter: counter.unwrap_or(0).max(0) as u64,
            })
        })
        .await
    }
}
