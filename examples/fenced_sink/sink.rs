//! A PostgreSQL sink that refuses the late writes of a deposed owner, by fencing token.
//!
//! Shared by `examples/fenced_sink.rs` (the runnable example) and `tests/fenced_sink.rs` (the
//! test that freezes an owner mid-write and shows its late write refused).
//!
//! Two tables, `{name}_fences` (partition → the highest fencing token that wrote it) and
//! `{name}_values` (key → value, with the token and continuation of the record that wrote
//! it). Each batch is one transaction:
//!
//! 1. **The guard.** Raise the partition's fence to the writer's token, unless it is already
//!    higher:
//!    `INSERT … ON CONFLICT (partition) DO UPDATE SET token = EXCLUDED.token
//!    WHERE stored.token <= EXCLUDED.token`. No row affected means a later owner of the
//!    partition has written: roll back, nothing of the batch is applied.
//! 2. **The records.** Upsert each one. The fence row stays locked until commit, so no later
//!    owner's transaction can slip in between the check and the writes.
//!
//! Why the token is kept per partition and not per key: [`Context::fencing_token`] is the
//! lease's version, which only grows within one partition's lease. A child partition after a
//! split or merge starts its lease again from a low version, so comparing a key's stored
//! token across partitions would refuse the child's legitimate writes.
//!
//! [`Context::fencing_token`]: changefeed::processor::Context::fencing_token

use changefeed::model::Batch;
use changefeed::processor::HandlerError;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};

/// What became of one batch's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The guard let the batch through: this many records were upserted.
    Applied(usize),
    /// A later owner of the partition has written (a higher token): none of this many
    /// records was.
    Refused(usize),
}

/// One connection and the two table names. A batch holds the connection for its transaction.
#[derive(Debug)]
pub struct FencedSink {
    client: Mutex<Client>,
    fences: String,
    values: String,
}

impl FencedSink {
    /// Connects to `url`; the tables are `{name}_fences` and `{name}_values`.
    pub async fn connect(url: &str, name: &str) -> Result<Self, tokio_postgres::Error> {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
        tokio::spawn(connection); // drives the socket; ends when the client is dropped
        Ok(Self {
            client: Mutex::new(client),
            fences: format!("{name}_fences"),
            values: format!("{name}_values"),
        })
    }

    /// Creates both tables if absent.
    pub async fn create_tables(&self) -> Result<(), tokio_postgres::Error> {
        let (fences, values) = (&self.fences, &self.values);
        self.client
            .lock()
            .await
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {fences} (
                     partition text PRIMARY KEY,
                     token     bigint NOT NULL
                 );
                 CREATE TABLE IF NOT EXISTS {values} (
                     key          text PRIMARY KEY,
                     value        text NOT NULL,
                     token        bigint NOT NULL,
                     continuation text NOT NULL
                 );"
            ))
            .await
    }

    /// Writes `batch` of `partition` with the writer's fencing `token`
    /// ([`changefeed::processor::Context::fencing_token`]), all or nothing.
    pub async fn write(
        &self,
        partition: &str,
        token: u64,
        batch: &Batch,
    ) -> Result<Written, HandlerError> {
        let token = i64::try_from(token)?; // PostgreSQL's bigint; lease versions fit
        let mut client = self.client.lock().await;
        let tx = client.transaction().await?;
        // 1. The guard: raise the fence to our token unless a later owner raised it higher.
        let raised = tx
            .execute(
                &format!(
                    "INSERT INTO {} AS stored (partition, token) VALUES ($1, $2)
                     ON CONFLICT (partition) DO UPDATE SET token = EXCLUDED.token
                     WHERE stored.token <= EXCLUDED.token",
                    self.fences
                ),
                &[&partition, &token],
            )
            .await?;
        if raised == 0 {
            tx.rollback().await?;
            return Ok(Written::Refused(batch.records.len()));
        }
        // 2. The records, under the fence row's lock until commit.
        let upsert = tx
            .prepare(&format!(
                "INSERT INTO {} (key, value, token, continuation) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (key) DO UPDATE
                 SET value = EXCLUDED.value, token = EXCLUDED.token,
                     continuation = EXCLUDED.continuation",
                self.values
            ))
            .await?;
        for r in &batch.records {
            let value: &str = &String::from_utf8_lossy(&r.data);
            tx.execute(&upsert, &[&r.key, &value, &token, &r.continuation.as_str()])
                .await?;
        }
        tx.commit().await?;
        Ok(Written::Applied(batch.records.len()))
    }

    /// Every stored value as `(key, value, token)`, by key.
    pub async fn values(&self) -> Result<Vec<(String, String, i64)>, tokio_postgres::Error> {
        let sql = format!("SELECT key, value, token FROM {} ORDER BY key", self.values);
        let rows = self.client.lock().await.query(&sql, &[]).await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }
}
