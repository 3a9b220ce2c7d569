//! [`SqliteDeadLetters`]: a dead-letter table in the lease store's SQLite file.
//!
//! It owns the table `changefeed_dead_letters`, created on open if absent, and writes one row
//! per batch the processor gave up on (see
//! [`ProcessorBuilder::dead_letter`](changefeed::processor::ProcessorBuilder::dead_letter)).
//! When to give up, and moving the checkpoint past the batch once the row is written, are the
//! core's business; reading, replaying and deleting rows is the operator's
//! (`docs/backends.md`, "Dead-letter tables").

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::clock::{Clock, SystemClock};
use changefeed::processor::{DeadLetter, DeadLetterSink, HandlerError};
use rusqlite::params;

use crate::db::Db;
use crate::error::SqliteError;

/// The dead-letter table's schema; `IF NOT EXISTS`, so opening an existing file keeps its
/// rows. Not part of the versioned lease schema: the table is only created where dead letters
/// are used.
const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS changefeed_dead_letters (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    group_name         TEXT NOT NULL,
    partition          TEXT NOT NULL,
    host               TEXT NOT NULL,
    after_continuation TEXT,
    last_continuation  TEXT,
    failures           INTEGER NOT NULL,
    error              TEXT NOT NULL,
    records            TEXT NOT NULL,
    created_at         INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS changefeed_dead_letters_partition
    ON changefeed_dead_letters (group_name, partition, id);
"#;

/// A [`DeadLetterSink`] writing each dead letter as one row of `changefeed_dead_letters` in a
/// SQLite file, normally the lease store's.
///
/// Columns: `id` (increasing, never reused), `group_name`, `partition`, `host` (the host that
/// gave up), `after_continuation` (the checkpoint the batch started after; NULL: the
/// partition's start), `last_continuation` (the batch's own continuation, where the checkpoint
/// moves), `failures`, `error` (the last error's text), `records` (a JSON array, one object per
/// record as `changefeed run` pipes them to its handler: `partition`, `key`, `data` or
/// `data_b64`, `continuation`, `timestamp`) and `created_at` (milliseconds since the epoch, by
/// the handle's clock).
///
/// A batch is written at least once: if the host loses its lease between writing the row and
/// checkpointing past it, the next owner may dead-letter the same records again.
#[derive(Debug, Clone)]
pub struct SqliteDeadLetters {
    db: Db,
    clock: Arc<dyn Clock>,
}

impl SqliteDeadLetters {
    /// Opens the database at `path` (creating the file and the lease schema if needed) and
    /// creates the dead-letter table if absent. Stamps rows with the system clock.
    ///
    /// # Errors
    /// [`SqliteError`] if the file cannot be opened or holds a schema newer than this build
    /// knows.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        Self::open_with_clock(path, Arc::new(SystemClock)).await
    }

    /// As [`SqliteDeadLetters::open`], stamping `created_at` with `clock`'s wall time.
    ///
    /// # Errors
    /// As for [`SqliteDeadLetters::open`].
    pub async fn open_with_clock(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, SqliteError> {
        let db = Db::open(path.as_ref()).await?;
        db.call(|conn| conn.execute_batch(SCHEMA)).await??;
        Ok(Self { db, clock })
    }

    /// The database file this handle opened.
    pub fn path(&self) -> &Path {
        self.db.path()
    }
}

#[async_trait]
impl DeadLetterSink for SqliteDeadLetters {
    async fn dead_letter(&self, letter: &DeadLetter) -> Result<(), HandlerError> {
        let records = letter
            .records_json()
            .map_err(|source| SqliteError::Encode {
                what: "dead-letter records",
                source,
            })?;
        let group = letter.key.group.to_string();
        let partition = letter.key.partition.to_string();
        let host = letter.host.to_string();
        let after = letter.after.as_ref().map(|c| c.as_str().to_string());
        let last = letter
            .batch
            .continuation
            .as_ref()
            .map(|c| c.as_str().to_string());
        let failures = i64::from(letter.failures);
        let error = letter.error.clone();
        let created_at = self.clock.wall().millis();
        self.db
            .call(move |conn| {
                conn.execute(
                    "INSERT INTO changefeed_dead_letters (group_name, partition, host, \
                     after_continuation, last_continuation, failures, error, records, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                    params![
                        group, partition, host, after, last, failures, error, records, created_at
                    ],
                )
            })
            .await
            .map_err(SqliteError::Task)?
            .map_err(SqliteError::Sqlite)?;
        Ok(())
    }
}
