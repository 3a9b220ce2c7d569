//! Waiting for a table to become active: shared by the lease store, which creates its table,
//! and the Streams source's [`crate::StreamTable`].

use std::time::Duration;

use aws_sdk_dynamodb::types::TableStatus;
use aws_sdk_dynamodb::Client;

/// Why [`until_active`] gave up.
#[derive(Debug)]
pub(crate) enum TableWait {
    /// `DescribeTable` failed.
    Describe(
        Box<
            aws_sdk_dynamodb::error::SdkError<
                aws_sdk_dynamodb::operation::describe_table::DescribeTableError,
            >,
        >,
    ),
    /// The table was not active within a minute.
    NeverActive,
}

/// Polls `DescribeTable` (every 100 ms, up to a minute) until `table` is active; returns its
/// description.
pub(crate) async fn until_active(
    client: &Client,
    table: &str,
) -> Result<aws_sdk_dynamodb::types::TableDescription, TableWait> {
    for _ in 0..600 {
        let described = client
            .describe_table()
            .table_name(table)
            .send()
            .await
            .map_err(|e| TableWait::Describe(Box::new(e)))?;
        if let Some(t) = described.table() {
            if t.table_status() == Some(&TableStatus::Active) {
                return Ok(t.clone());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(TableWait::NeverActive)
}
