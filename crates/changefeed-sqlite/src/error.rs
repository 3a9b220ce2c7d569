//! The backend's own errors, carried as the `source` of the core's `LeaseError::Store` and
//! `SourceError::Source`, and the one place that decides which of them are retryable.

use changefeed::lease::BackendError;

use crate::db::is_busy;

/// What can go wrong inside the SQLite backend. Callers see it as the `source` of a
/// [`LeaseError::Store`](changefeed::LeaseError::Store) or
/// [`SourceError::Source`](changefeed::SourceError::Source); downcast to tell the cases apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// The database was written by a newer version of this crate; opening it could corrupt it.
    #[error(
        "database {path} has schema version {found}, newer than version {supported} that this \
         build of changefeed-sqlite knows; upgrade changefeed-sqlite to open it"
    )]
    SchemaTooNew {
        /// The database file.
        path: String,
        /// The version stored in the file.
        found: i64,
        /// The newest version this build knows.
        supported: i64,
    },
    /// The stored schema version is not a version at all (negative).
    #[error("database {path} has an invalid schema version {found}")]
    SchemaCorrupt {
        /// The database file.
        path: String,
        /// The version stored in the file.
        found: i64,
    },
    /// A stored row that is not a lease (heartbeat, partition, record) cannot be read.
    #[error("malformed {table} row {key}: {reason}")]
    MalformedRow {
        /// The table.
        table: &'static str,
        /// The row's key as stored.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `append` found no open partition covering the key's hash (the feed has no partitions
    /// yet: call `create_partitions` first).
    #[error("no open partition covers the hash of key {key:?}; were partitions created?")]
    NoOpenPartition {
        /// The record key.
        key: String,
    },
    /// A value could not be encoded as JSON for storage.
    #[error("cannot encode {what} as JSON: {source}")]
    Encode {
        /// Which field.
        what: &'static str,
        /// The encoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// SQLite failed. Shown as SQLite's own message only: the driver's error also returns
    /// the bare result code (`Error code 14: Unable to open the database file`) as its cause,
    /// which says the same again, so it is kept here (match on it) but not chained as a
    /// `source`.
    #[error("{0}")]
    Sqlite(rusqlite::Error),
    /// The blocking task running the call panicked or was cancelled at shutdown.
    #[error("the blocking task running the call failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl From<rusqlite::Error> for SqliteError {
    fn from(err: rusqlite::Error) -> Self {
        SqliteError::Sqlite(err)
    }
}

impl SqliteError {
    /// Whether trying again later may help: SQLite reported the database busy or locked
    /// (another connection held the write lock for longer than the busy timeout).
    pub fn is_retryable(&self) -> bool {
        match self {
            SqliteError::Sqlite(e) => is_busy(e),
            _ => false,
        }
    }
}

impl BackendError for SqliteError {
    fn is_retryable(&self) -> bool {
        // The inherent method above, the one place that decides.
        SqliteError::is_retryable(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::ffi;

    fn sqlite(code: std::os::raw::c_int) -> SqliteError {
        SqliteError::Sqlite(rusqlite::Error::SqliteFailure(ffi::Error::new(code), None))
    }

    #[test]
    fn busy_and_locked_are_retryable_and_nothing_else_is() {
        // One place decides retryability: a lock held by another connection may free up.
        assert!(sqlite(ffi::SQLITE_BUSY).is_retryable());
        assert!(sqlite(ffi::SQLITE_LOCKED).is_retryable());
        assert!(!sqlite(ffi::SQLITE_CORRUPT).is_retryable());
        assert!(!sqlite(ffi::SQLITE_READONLY).is_retryable());
        let err = sqlite(ffi::SQLITE_BUSY).into_lease("replace", Some("g/0".into()));
        assert!(err.is_retryable());
        assert!(err.to_string().contains("replace failed for g/0"), "{err}");
        let err = sqlite(ffi::SQLITE_BUSY).into_source("read", Some("3".into()));
        assert!(err.is_retryable());
        assert!(err.to_string().contains("partition 3"), "{err}");
    }

    #[test]
    fn a_sqlite_failure_reads_once() {
        // Errors read once: SQLite's message, without the bare result code restating it.
        let err = SqliteError::Sqlite(rusqlite::Error::SqliteFailure(
            ffi::Error::new(ffi::SQLITE_CANTOPEN),
            Some("unable to open database file".into()),
        ));
        assert_eq!(err.to_string(), "unable to open database file");
        assert!(std::error::Error::source(&err).is_none());
    }
}
