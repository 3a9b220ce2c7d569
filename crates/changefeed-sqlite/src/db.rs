//! The shared SQLite plumbing: opening a connection, the schema and its migrations, and running
//! a closure on the connection off the async runtime.
//!
//! Both [`crate::SqliteLeaseStore`] and [`crate::SqliteFeed`] hold a [`Db`]: one connection
//! behind a mutex, used from `tokio::task::spawn_blocking` ([`Db::call`]), or on the calling
//! thread for a statement that need not wait ([`Db::try_now`]). What the tables mean is left to
//! those two modules; this one only creates them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, OptionalExtension, TransactionBehavior};
use tokio::task::JoinError;

use crate::error::SqliteError;

/// How long a connection waits for another writer's lock before giving up with `SQLITE_BUSY`.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The table holding the schema version (one row).
const VERSION_TABLE: &str = "changefeed_schema_version";

/// The migrations, in order: migration `i` (0-based) takes the schema from version `i` to
/// `i + 1`. Never edit a released entry; append a new one.
const MIGRATIONS: &[&str] = &[
    // 1: leases, heartbeats and change counters; the feed's partitions and records.
    r#"
    CREATE TABLE changefeed_leases (
        group_name   TEXT NOT NULL,
        partition    TEXT NOT NULL,
        state        TEXT NOT NULL,
        owner        TEXT,
        next_owner   TEXT,
        continuation TEXT,
        start        TEXT NOT NULL,
        parents      TEXT NOT NULL,
        properties   TEXT NOT NULL,
        version      INTEGER NOT NULL,
        PRIMARY KEY (group_name, partition)
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_heartbeats (
        group_name  TEXT NOT NULL,
        host        TEXT NOT NULL,
        incarnation TEXT NOT NULL,
        version     INTEGER NOT NULL,
        written_at  INTEGER NOT NULL,
        PRIMARY KEY (group_name, host)
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_groups (
        group_name     TEXT NOT NULL PRIMARY KEY,
        change_counter INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_partitions (
        id          TEXT NOT NULL PRIMARY KEY,
        parents     TEXT NOT NULL,
        closed      INTEGER NOT NULL,
        range_start TEXT NOT NULL,
        range_end   TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE changefeed_records (
        partition    TEXT NOT NULL,
        seq          INTEGER NOT NULL,
        key          TEXT NOT NULL,
        data         BLOB NOT NULL,
        timestamp_ms INTEGER NOT NULL,
        PRIMARY KEY (partition, seq)
    ) WITHOUT ROWID;
    "#,
    // 2: change stamps, so `list_changes` reads what changed hands since a counter value in
    // O(changes). Rows from before have no stamp (NULL), so each group answers only from its
    // counter as of this migration on (`changes_from`). See the store module for the meaning.
    r#"
    ALTER TABLE changefeed_leases ADD COLUMN changed_at INTEGER;
    CREATE INDEX changefeed_leases_changed_at ON changefeed_leases (group_name, changed_at);
    CREATE TABLE changefeed_deletions (
        group_name TEXT NOT NULL,
        partition  TEXT NOT NULL,
        deleted_at INTEGER NOT NULL,
        PRIMARY KEY (group_name, partition)
    ) WITHOUT ROWID;
    CREATE INDEX changefeed_deletions_deleted_at ON changefeed_deletions (group_name, deleted_at);
    ALTER TABLE changefeed_groups ADD COLUMN changes_from INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE changefeed_groups ADD COLUMN stamped_counter INTEGER NOT NULL DEFAULT 0;
    UPDATE changefeed_groups SET changes_from = change_counter, stamped_counter = change_counter;
    "#,
    // 3: the membership view, in the group's counter row so that one read gives both (see the
    // store module). `view` holds the live and dead hosts as JSON; the leader and its copied
    // heartbeat version are columns, so a leader's renewal updates them in place.
    r#"
    ALTER TABLE changefeed_groups ADD COLUMN view_version INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE changefeed_groups ADD COLUMN view TEXT;
    ALTER TABLE changefeed_groups ADD COLUMN view_leader TEXT;
    ALTER TABLE changefeed_groups ADD COLUMN view_leader_incarnation TEXT;
    ALTER TABLE changefeed_groups ADD COLUMN view_leader_heartbeat INTEGER NOT NULL DEFAULT 0;
    "#,
    // 4: what a host publishes with its heartbeat (its capacity, limits and loads, JSON),
    // written by each renewal. Rows from before have none.
    r#"
    ALTER TABLE changefeed_heartbeats ADD COLUMN report TEXT;
    "#,
];

/// The schema version this build creates and understands.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// One connection to the database file, shared by the clones of one handle.
#[derive(Debug, Clone)]
pub(crate) struct Db {
    conn: Arc<Mutex<Connection>>,
    path: Arc<PathBuf>,
}

impl Db {
    /// Opens (creating if needed) the database at `path` and brings its schema up to date.
    pub(crate) async fn open(path: &Path) -> Result<Db, SqliteError> {
        let path = path.to_path_buf();
        let conn = tokio::task::spawn_blocking({
            let path = path.clone();
            move || open_blocking(&path)
        })
        .await??;
        Ok(Db {
            conn: Arc::new(Mutex::new(conn)),
            path: Arc::new(path),
        })
    }

    /// The file this handle opened.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection right here, on the calling thread, if that costs no wait:
    /// `None` if the connection is in use by another call (then nothing ran). While `f` runs,
    /// SQLite does not wait for another connection's lock: a statement that would wait fails
    /// at once with `SQLITE_BUSY` instead ([`is_busy`]), having changed nothing, and the caller
    /// goes to [`Db::call`], which waits.
    ///
    /// For the statements so short that handing them to the blocking pool and back costs more
    /// than running them (a checkpoint's one-row `UPDATE`): the thread is held only for the
    /// statement's own work (and, once every thousand or so pages written, the automatic WAL
    /// checkpoint SQLite runs after a commit), never for another writer.
    pub(crate) fn try_now<T, E: From<rusqlite::Error>>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, E>,
    ) -> Option<Result<T, E>> {
        let mut guard = match self.conn.try_lock() {
            Ok(guard) => guard,
            // See `call` on a poisoned lock.
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if guard.busy_timeout(Duration::ZERO).is_err() {
            return None;
        }
        let result = f(&mut guard);
        // `sqlite3_busy_timeout` only fails for a handle that is not an open connection.
        if let Err(e) = guard.busy_timeout(BUSY_TIMEOUT) {
            return Some(result.and(Err(e.into())));
        }
        Some(result)
    }

    /// Runs `f` on the connection in the blocking thread pool, so the async runtime never
    /// waits on SQLite (a busy database may hold a call for up to [`BUSY_TIMEOUT`]).
    pub(crate) async fn call<T, E, F>(&self, f: F) -> Result<Result<T, E>, JoinError>
    where
        T: Send + 'static,
        E: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            // A panic while the lock was held dropped its rusqlite `Transaction`, which rolled
            // back, so the connection behind a poisoned lock is still usable.
            let mut guard = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            f(&mut guard)
        })
        .await
    }
}

/// Opens the connection: WAL journal (readers never block the writer, and several processes
/// can share the file), `synchronous = NORMAL` (durable across process crashes; a power loss
/// may lose the last commits, which only means re-delivery), a busy timeout, then migrations.
fn open_blocking(path: &Path) -> Result<Connection, SqliteError> {
    let mut conn = Connection::open(path).map_err(|e| without_path(e, path))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // Switching to WAL needs a moment of exclusive access; the busy timeout covers a race with
    // another process opening the same file.
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    migrate(&mut conn, path)?;
    Ok(conn)
}

/// `err` without the `: PATH` the driver appends to the message of a failed open: the caller
/// names the file already (`lease store open failed for PATH`), so it would read twice.
fn without_path(err: rusqlite::Error, path: &Path) -> rusqlite::Error {
    match err {
        rusqlite::Error::SqliteFailure(code, Some(msg)) => {
            let path = path.to_string_lossy();
            let msg = match msg.strip_suffix(&*path) {
                // Only the path (SQLite gave no handle): the result code says what failed.
                Some("") => None,
                Some(rest) if rest.ends_with(": ") => Some(rest[..rest.len() - 2].to_string()),
                _ => Some(msg),
            };
            rusqlite::Error::SqliteFailure(code, msg)
        }
        other => other,
    }
}

/// Applies the migrations the database lacks, all in one immediate transaction, so two
/// processes opening a fresh file at once cannot both apply them.
fn migrate(conn: &mut Connection, path: &Path) -> Result<(), SqliteError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version INTEGER NOT NULL)"
    ))?;
    let found: Option<i64> = tx
        .query_row(
            &format!("SELECT MAX(version) FROM {VERSION_TABLE}"),
            [],
            |r| r.get(0),
        )
        .optional()?
        .flatten();
    let found = found.unwrap_or(0);
    if found > SCHEMA_VERSION {
        return Err(SqliteError::SchemaTooNew {
            path: path.display().to_string(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    if found == SCHEMA_VERSION {
        return Ok(()); // dropping `tx` ends the read-only transaction
    }
    let first = usize::try_from(found).map_err(|_| SqliteError::SchemaCorrupt {
        path: path.display().to_string(),
        found,
    })?;
    for migration in &MIGRATIONS[first..] {
        tx.execute_batch(migration)?;
    }
    tx.execute(&format!("DELETE FROM {VERSION_TABLE}"), [])?;
    tx.execute(
        &format!("INSERT INTO {VERSION_TABLE} (version) VALUES (?1)"),
        [SCHEMA_VERSION],
    )?;
    tx.commit()?;
    Ok(())
}

/// Whether `err` is SQLite saying another connection holds the lock: worth retrying later.
pub(crate) fn is_busy(err: &rusqlite::Error) -> bool {
    matches!(
        err.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}
