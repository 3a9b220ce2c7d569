//! [`PostgresDeadLetters`]: a dead-letter table in the lease store's PostgreSQL database.
//!
//! It owns the table `{prefix}_dead_letters`, created on first connect (versioned as the
//! `dead_letters` component in `{prefix}_schema_versions`), and writes one row per batch the
//! processor gave up on (see
//! [`ProcessorBuilder::dead_letter`](changefeed::processor::ProcessorBuilder::dead_letter)).
//! When to give up, and moving the checkpoint past the batch once the row is written, are the
//! core's business; reading, replaying and deleting rows is the operator's
//! (`docs/backends.md`, "Dead-letter tables").

use async_trait::async_trait;
use changefeed::processor::{DeadLetter, DeadLetterSink, HandlerError};

use crate::db::{table, Db, PgOptions};
use crate::error::PostgresError;

/// The dead-letter table's migrations, in order, for tables with `prefix`. Never edit a
/// released entry; append a new one.
fn migrations(prefix: &str) -> Vec<String> {
    let letters = table(prefix, "dead_letters");
    let partition_idx = table(prefix, "dead_letters_grp");
    vec![format!(
        r#"
        CREATE TABLE {letters} (
            id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            grp                text COLLATE "C" NOT NULL,
            partition          text COLLATE "C" NOT NULL,
            host               text NOT NULL,
            after_continuation text,
            last_continuation  text,
            failures           integer NOT NULL,
            error              text NOT NULL,
            records            jsonb NOT NULL,
            created_at         timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX {partition_idx} ON {letters} (grp, partition, id);
        "#
    )]
}

/// The schema version of the dead-letter table this build creates and understands.
pub const DEAD_LETTER_SCHEMA_VERSION: i32 = 1;

/// A [`DeadLetterSink`] writing each dead letter as one row of `{prefix}_dead_letters`,
/// normally in the lease store's database and with its prefix.
///
/// Columns: `id` (increasing), `grp`, `partition`, `host` (the host that gave up),
/// `after_continuation` (the checkpoint the batch started after; NULL: the partition's start),
/// `last_continuation` (the batch's own continuation, where the checkpoint moves),
/// `failures`, `error` (the last error's text), `records` (`jsonb`: an array, one object per
/// record as `changefeed run` pipes them to its handler: `partition`, `key`, `data` or
/// `data_b64`, `continuation`, `timestamp`) and `created_at` (the server's `now()`).
///
/// A batch is written at least once: if the host loses its lease between writing the row and
/// checkpointing past it, the next owner may dead-letter the same records again.
#[derive(Debug, Clone)]
pub struct PostgresDeadLetters {
    db: Db,
    insert: String,
}

impl PostgresDeadLetters {
    /// Connects with default [`PgOptions`] for `url` and creates the table if absent.
    ///
    /// # Errors
    /// As for [`PostgresDeadLetters::connect_with`].
    pub async fn connect(url: &str) -> Result<Self, PostgresError> {
        Self::connect_with(PgOptions::new(url)).await
    }

    /// Connects with `options` (use the lease store's, so the table gets its prefix) and
    /// brings the dead-letter table up to date, creating it on first use.
    ///
    /// # Errors
    /// [`PostgresError::Config`] for a bad setting, a retryable error for an unreachable
    /// server, [`PostgresError::SchemaTooNew`] for a table written by a newer build.
    pub async fn connect_with(options: PgOptions) -> Result<Self, PostgresError> {
        let db = Db::new(&options)?;
        db.migrate("dead_letters", &migrations(db.prefix())).await?;
        let insert = format!(
            "INSERT INTO {} (grp, partition, host, after_continuation, last_continuation, \
             failures, error, records) VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb)",
            table(db.prefix(), "dead_letters")
        );
        Ok(Self { db, insert })
    }

    /// The table prefix.
    pub fn prefix(&self) -> &str {
        self.db.prefix()
    }
}

#[async_trait]
impl DeadLetterSink for PostgresDeadLetters {
    async fn dead_letter(&self, letter: &DeadLetter) -> Result<(), HandlerError> {
        let records = letter
            .records_json()
            .map_err(|source| PostgresError::Encode {
                what: "dead-letter records",
                source,
            })?;
        let group = letter.key.group.as_str();
        let partition = letter.key.partition.as_str();
        let host = letter.host.as_str();
        let after = letter.after.as_ref().map(|c| c.as_str());
        let last = letter.batch.continuation.as_ref().map(|c| c.as_str());
        let failures = i32::try_from(letter.failures).unwrap_or(i32::MAX);
        let error = letter.error.as_str();
        let sql = self.insert.as_str();
        let records = records.as_str();
        self.db
            .run("dead_letter", |client| async move {
                let stmt = client.prepare_cached(sql).await?;
                client
                    .execute(
                        &stmt,
                        &[
                            &group, &partition, &host, &after, &last, &failures, &error, &records,
                        ],
                    )
                    .await?;
                Ok(())
            })
            .await?;
        Ok(())
    }
}
