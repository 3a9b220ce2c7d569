//! The backend's own errors, carried as the `source` of the core's `LeaseError::Store` and
//! `SourceError::Source`, and the one place that decides which of them are retryable.

use std::time::Duration;

use changefeed::lease::BackendError;
use tokio_postgres::error::SqlState;

/// What can go wrong inside the PostgreSQL backend. Callers see it as the `source` of a
/// [`LeaseError::Store`](changefeed::LeaseError::Store) or
/// [`SourceError::Source`](changefeed::SourceError::Source); downcast to tell the cases apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresError {
    /// A setting breaks its rule (bad URL, bad table prefix, timeouts out of order …).
    #[error("invalid setting {setting}: {reason}")]
    Config {
        /// The setting (`url`, `prefix`, `statement_timeout` …).
        setting: &'static str,
        /// The rule it breaks.
        reason: String,
    },
    /// The database holds a schema written by a newer build of this crate.
    #[error(
        "tables with prefix {prefix:?} have {component} schema version {found}, newer than \
         version {supported} that this build of changefeed-postgres knows; upgrade it"
    )]
    SchemaTooNew {
        /// The table prefix.
        prefix: String,
        /// Which schema (`lease_store`, `outbox`).
        component: &'static str,
        /// The version stored in the database.
        found: i32,
        /// The newest version this build knows.
        supported: i32,
    },
    /// The call did not finish within the client-side timeout (a hung server or network).
    #[error("{operation} did not finish within {after:?}")]
    Timeout {
        /// The operation.
        operation: &'static str,
        /// The client-side timeout.
        after: Duration,
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
    /// The outbox has no open partition for the key (partitions were never created).
    #[error("no open outbox partition covers the hash of key {key:?}; were partitions created?")]
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
    /// No connection could be had from the pool.
    #[error("connection pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// PostgreSQL (or the connection to it) failed. The message carries the server's own
    /// (`db error: FATAL: role "x" does not exist`), so a log line that prints only this
    /// error's text still says what the server refused; the driver's error is the source.
    #[error("{}", postgres_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

/// The driver's message, with the server's error when there is one (the driver's own text
/// for it is only `db error`).
fn postgres_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{e}: {db}"),
        None => e.to_string(),
    }
}

/// Whether a PostgreSQL error may go away on a retry: the connection broke, the server is
/// shutting down or out of resources, a statement timed out, or a serialization failure or
/// deadlock aborted the transaction.
fn postgres_retryable(e: &tokio_postgres::Error) -> bool {
    let Some(code) = e.code() else {
        // No SQLSTATE: an I/O error, a closed connection, a failed TLS handshake … all
        // things a new connection may not have.
        return e.as_db_error().is_none();
    };
    let class = &code.code()[..2];
    matches!(class, "08" | "53" | "57" | "40")
        || code == &SqlState::LOCK_NOT_AVAILABLE
        || code == &SqlState::T_R_SERIALIZATION_FAILURE
}

impl PostgresError {
    /// Whether trying again later may help: connection failures, timeouts (client or
    /// `statement_timeout`), pool exhaustion, serialization failures and deadlocks.
    pub fn is_retryable(&self) -> bool {
        match self {
            PostgresError::Timeout { .. } => true,
            PostgresError::Postgres(e) => postgres_retryable(e),
            PostgresError::Pool(p) => match p {
                deadpool_postgres::PoolError::Timeout(_) => true,
                deadpool_postgres::PoolError::Backend(e) => postgres_retryable(e),
                _ => false,
            },
            _ => false,
        }
    }
}

impl BackendError for PostgresError {
    fn is_retryable(&self) -> bool {
        // The inherent method above, the one place that decides.
        PostgresError::is_retryable(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_retryable_and_config_errors_are_not() {
        // A hung server must become a retryable store error, never a stuck host.
        let t = PostgresError::Timeout {
            operation: "replace",
            after: Duration::from_secs(1),
        };
        assert!(t.is_retryable());
        let err = t.into_lease("replace", Some("g/0".into()));
        assert!(err.is_retryable());
        assert!(err.to_string().contains("replace failed for g/0"), "{err}");
        let c = PostgresError::Config {
            setting: "prefix",
            reason: "x".into(),
        };
        assert!(!c.is_retryable());
    }
}
