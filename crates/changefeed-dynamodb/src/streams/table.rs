//! A table's stream: finding it, and [`StreamTable`], the writes tools and tests make to a
//! table whose changes a [`super::DynamoStreamsFeed`] reads.

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, StreamSpecification, StreamViewType,
};
use aws_sdk_dynamodb::Client;
use changefeed::SourceError;

use crate::error::{is_retryable, DynamoError};
use crate::table::{until_active, TableWait};

fn table_error<E, R>(
    operation: &'static str,
    err: aws_sdk_dynamodb::error::SdkError<E, R>,
) -> SourceError
where
    E: aws_sdk_dynamodb::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let retryable = is_retryable(&err);
    SourceError::source(operation, None, retryable, DynamoError::from_sdk(err))
}

fn wait_error(table: &str, err: TableWait) -> SourceError {
    match err {
        TableWait::Describe(e) => table_error("describe_table", *e),
        TableWait::NeverActive => SourceError::source(
            "create_table",
            None,
            true,
            DynamoError::other(format!("table {table} did not become active")),
        ),
    }
}

/// The ARN of `table`'s current stream (`DescribeTable`'s `LatestStreamArn`).
///
/// # Errors
/// [`SourceError::Source`] naming the table when it cannot be described or has no stream
/// enabled.
pub(crate) async fn latest_stream_arn(client: &Client, table: &str) -> Result<String, SourceError> {
    let out = client
        .describe_table()
        .table_name(table)
        .send()
        .await
        .map_err(|e| table_error("describe_table", e))?;
    let description = out.table();
    let enabled = description
        .and_then(|t| t.stream_specification())
        .is_some_and(|s| s.stream_enabled());
    match description.and_then(|t| t.latest_stream_arn()) {
        Some(arn) if enabled => Ok(arn.to_string()),
        _ => Err(SourceError::source(
            "describe_table",
            None,
            false,
            DynamoError::other(format!(
                "table {table} has no stream enabled: set its StreamSpecification \
                 (StreamEnabled, StreamViewType NEW_AND_OLD_IMAGES) or name the stream with \
                 stream=ARN"
            )),
        )),
    }
}

/// A table with one string hash key `pk` and a stream of new and old images: what the
/// Streams tests, the benchmark and demos write to.
#[derive(Debug, Clone)]
pub struct StreamTable {
    client: Client,
    table: String,
}

impl StreamTable {
    /// The hash key attribute.
    pub const KEY: &'static str = "pk";

    /// `table` through `client`.
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self {
            client,
            table: table.into(),
        }
    }

    /// Connects with `options` to `table`.
    pub async fn connect(options: &crate::AwsOptions, table: impl Into<String>) -> Self {
        let config = options.load().await;
        Self::new(Client::new(&config), table)
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the table (if absent) with its stream (`NEW_AND_OLD_IMAGES`), waits until it
    /// is active, and returns the stream's ARN.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn create(&self) -> Result<String, SourceError> {
        let build = |e: aws_sdk_dynamodb::error::BuildError| {
            SourceError::source("create_table", None, false, e)
        };
        let created = self
            .client
            .create_table()
            .table_name(&self.table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(Self::KEY)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(build)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(Self::KEY)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build)?,
            )
            .stream_specification(
                StreamSpecification::builder()
                    .stream_enabled(true)
                    .stream_view_type(StreamViewType::NewAndOldImages)
                    .build()
                    .map_err(build)?,
            )
            .send()
            .await;
        if let Err(err) = created {
            let exists = err
                .as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception());
            if !exists {
                return Err(table_error("create_table", err));
            }
        }
        until_active(&self.client, &self.table)
            .await
            .map_err(|e| wait_error(&self.table, e))?;
        latest_stream_arn(&self.client, &self.table).await
    }

    /// Writes the item `pk` = `key` with the string attribute `data` (an insert, or a modify
    /// of the item there).
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn put(&self, key: &str, data: &str) -> Result<(), SourceError> {
        self.client
            .put_item()
            .table_name(&self.table)
            .item(Self::KEY, AttributeValue::S(key.to_string()))
            .item("data", AttributeValue::S(data.to_string()))
            .send()
            .await
            .map_err(|e| table_error("put_item", e))?;
        Ok(())
    }

    /// Deletes the item `pk` = `key` (a remove, if it was there).
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn delete(&self, key: &str) -> Result<(), SourceError> {
        self.client
            .delete_item()
            .table_name(&self.table)
            .key(Self::KEY, AttributeValue::S(key.to_string()))
            .send()
            .await
            .map_err(|e| table_error("delete_item", e))?;
        Ok(())
    }
}
