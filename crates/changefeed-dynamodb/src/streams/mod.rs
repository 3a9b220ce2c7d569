//! DynamoDB Streams as a feed source: a table's changes, shards as partitions, with lineage.
//!
//! [`DynamoStreamsFeed`] implements the core's [`FeedSource`] on one table's stream (found
//! from the table, or named by its ARN). This module owns the mapping of stream shards,
//! iterators and sequence numbers to the core's partitions, positions and continuations, and
//! of stream records to JSON, plain ([`record`]) or as the KCL's adapter writes them
//! ([`adapter`]); leases, balancing and lineage stay in the core, which starts a child shard
//! only after its parent is finished.

mod adapter;
mod reader;
mod record;
mod table;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodbstreams::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodbstreams::types::{Shard, ShardIteratorType};
use aws_sdk_dynamodbstreams::Client;
use changefeed::model::{Continuation, Partition, PartitionId, Position, Timestamp};
use changefeed::source::{FeedSource, OldestUnread, PartitionReader};
use changefeed::SourceError;
use tokio::sync::Mutex;
use tokio::time::{Interval, MissedTickBehavior};

use crate::error::DynamoError;

pub use reader::DynamoStreamsReader;
pub use table::StreamTable;

/// How the source lists shards and reads them.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StreamsOptions {
    /// The least time between two `DescribeStream` calls of one source (pages included):
    /// DynamoDB Streams allows 10 a second per stream, shared by everyone reading it. Default
    /// 250 ms, so the partition sync of a leader, a `status` and a `lag` fit together.
    pub describe_interval: Duration,
    /// The shape of each record's data. Default [`RecordShape::Plain`].
    pub record: RecordShape,
}

impl StreamsOptions {
    /// These options with `describe_interval` between two `DescribeStream` calls.
    pub fn with_describe_interval(mut self, interval: Duration) -> Self {
        self.describe_interval = interval;
        self
    }

    /// These options with records in `shape`.
    pub fn with_record(mut self, shape: RecordShape) -> Self {
        self.record = shape;
        self
    }
}

impl Default for StreamsOptions {
    fn default() -> Self {
        Self {
            describe_interval: Duration::from_millis(250),
            record: RecordShape::Plain,
        }
    }
}

/// The shape of a record's data: the same change, for two kinds of handler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecordShape {
    /// One plain JSON document (`eventName`, `keys`, `newImage`, `oldImage` …, the images as
    /// plain JSON): for handlers written for changefeed.
    #[default]
    Plain,
    /// The DynamoDB Streams `Record` JSON with typed images (`{"dynamodb": {"NewImage":
    /// {"pk": {"S": "a"}}}}`), as the KCL's DynamoDB Streams Kinesis adapter gives it to a
    /// record processor: for processors written for the adapter.
    Adapter,
}

impl RecordShape {
    /// The shape named `name` (`plain` or `adapter`); `None` for another name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "plain" => Some(Self::Plain),
            "adapter" => Some(Self::Adapter),
            _ => None,
        }
    }

    /// The shape's name, as [`RecordShape::parse`] reads it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Adapter => "adapter",
        }
    }
}

/// Which stream to read: the latest stream of a table, or one stream by its ARN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamRef {
    /// The table's current stream (`DescribeTable`'s `LatestStreamArn`).
    Table(String),
    /// A stream ARN (`arn:aws:dynamodb:…:table/T/stream/LABEL`).
    Arn(String),
}

/// The feed source on one DynamoDB stream: partitions are shards, the continuation is a
/// record's sequence number.
///
/// - `partitions` pages through `DescribeStream` (`ExclusiveStartShardId`), paced to
///   [`StreamsOptions::describe_interval`]; a shard's parent is its `ParentShardId` (which may
///   name a shard trimmed from the listing: the core's lineage counts it as finished), and it
///   is closed when its `SequenceNumberRange` has an `EndingSequenceNumber`. Shards have no
///   key range.
/// - Positions map to `TRIM_HORIZON`, `LATEST` and `AFTER_SEQUENCE_NUMBER` (a continuation
///   `SEQ/SUB`, a KCL checkpoint as `import-kcl` copies it from an adapter's lease table,
///   reads after `SEQ`). DynamoDB Streams
///   has no `AT_TIMESTAMP`: `AtTime(t)` reads from `TRIM_HORIZON` and leaves out records whose
///   `ApproximateCreationDateTime` is before `t` (a second on AWS, a minute on DynamoDB
///   Local).
/// - A reader follows `NextShardIterator`; an expired iterator (15 minutes) is renewed after
///   the last sequence number read; a null next iterator is the end of the shard.
/// - A continuation older than the stream's retention (24 hours), refused with
///   `TrimmedDataAccessException`, is an [`SourceError::InvalidContinuation`] saying the data
///   after it was lost to retention: the lease keeps its checkpoint and is given back, never
///   moved past the gap silently (`changefeed reset` moves it, by the operator's choice).
#[derive(Debug, Clone)]
pub struct DynamoStreamsFeed {
    client: Client,
    stream_arn: String,
    /// Paces `DescribeStream`; made at the first call (an interval needs the runtime).
    describe: Arc<Mutex<Option<Interval>>>,
    options: StreamsOptions,
}

/// Whether an error is worth trying again later: the lease store's rule, and the Streams
/// API's own throttling (`LimitExceededException`) and server trouble.
fn is_retryable<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    crate::error::is_retryable(err)
        || matches!(
            err.as_service_error().and_then(|e| e.code()),
            Some("LimitExceededException" | "InternalFailure")
        )
}

fn code<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Option<&str> {
    err.as_service_error().and_then(|e| e.code())
}

fn message<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> String {
    err.as_service_error()
        .and_then(|e| e.message())
        .unwrap_or_default()
        .to_string()
}

fn source_error<E, R>(
    operation: &'static str,
    partition: Option<&PartitionId>,
    err: SdkError<E, R>,
) -> SourceError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let retryable = is_retryable(&err);
    SourceError::source(
        operation,
        partition.map(|p| p.to_string()),
        retryable,
        DynamoError::from_sdk(err),
    )
}

/// The error for data after a continuation that the stream no longer holds.
fn lost_to_retention(partition: &PartitionId, after: &str, detail: &str) -> SourceError {
    SourceError::InvalidContinuation {
        partition: partition.to_string(),
        continuation: after.to_string(),
        reason: format!(
            "the records after it were lost to retention (DynamoDB Streams keeps 24 hours; \
             TrimmedDataAccessException: {detail}); move the checkpoint with `changefeed reset` \
             to accept the loss"
        ),
    }
}

/// A shard as the core's partition.
///
/// # Errors
/// [`SourceError::Corrupt`] for a shard without an id or with an id the core refuses.
pub(crate) fn to_partition(shard: &Shard) -> Result<Partition, SourceError> {
    let raw = shard.shard_id().unwrap_or_default();
    let id = PartitionId::new(raw).map_err(|e| SourceError::Corrupt {
        partition: raw.to_string(),
        reason: e.to_string(),
    })?;
    let parents = match shard.parent_shard_id() {
        Some(p) => vec![PartitionId::new(p).map_err(|e| SourceError::Corrupt {
            partition: raw.to_string(),
            reason: format!("parent: {e}"),
        })?],
        None => Vec::new(),
    };
    let closed = shard
        .sequence_number_range()
        .and_then(|r| r.ending_sequence_number())
        .is_some();
    Ok(Partition {
        id,
        parents,
        closed,
        key_range: None,
    })
}

/// Whether `s` reads as a DynamoDB Streams sequence number (21 to 40 decimal digits).
fn is_sequence_number(s: &str) -> bool {
    (21..=40).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())
}

/// The sequence number a continuation reads after: the continuation itself, or `SEQ` of
/// `SEQ/SUB`, the KCL's checkpoint with its sub-sequence number as `import-kcl` writes it (a
/// stream record is never aggregated, so any part of it done means all of it is).
fn sequence_of(c: &str) -> Option<&str> {
    let (seq, sub) = c.split_once('/').unwrap_or((c, "0"));
    let sub_ok = !sub.is_empty() && sub.len() <= 20 && sub.bytes().all(|b| b.is_ascii_digit());
    (is_sequence_number(seq) && sub_ok).then_some(seq)
}

/// Whether `s` can be a shard id (28 to 65 characters, as the API requires).
fn is_shard_id(s: &str) -> bool {
    (28..=65).contains(&s.len())
}

impl DynamoStreamsFeed {
    /// A source reading the stream `stream_arn` through `client`.
    pub fn new(client: Client, stream_arn: impl Into<String>, options: StreamsOptions) -> Self {
        Self {
            client,
            stream_arn: stream_arn.into(),
            describe: Arc::default(),
            options,
        }
    }

    /// Connects with `options` (endpoint, region, credentials; the rest from the standard AWS
    /// chain) to read `stream`, finding a table's stream with `DescribeTable`. The clients'
    /// timeouts are [`Timeouts::KINESIS`](crate::Timeouts::KINESIS) (a `GetRecords` answer
    /// holds up to 1 MB) less what `options` overrides.
    ///
    /// # Errors
    /// [`SourceError::Source`] when the table cannot be described or has no stream enabled.
    pub async fn connect(
        options: &crate::AwsOptions,
        stream: &StreamRef,
        read: StreamsOptions,
    ) -> Result<Self, SourceError> {
        let config = options.load_with(crate::Timeouts::KINESIS).await;
        let arn = match stream {
            StreamRef::Arn(arn) => arn.clone(),
            StreamRef::Table(table) => {
                let ddb = aws_sdk_dynamodb::Client::new(&config);
                table::latest_stream_arn(&ddb, table).await?
            }
        };
        Ok(Self::new(Client::new(&config), arn, read))
    }

    /// The stream's ARN.
    pub fn stream_arn(&self) -> &str {
        &self.stream_arn
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Every shard as `DescribeStream` lists it, all pages, paced.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn shards(&self) -> Result<Vec<Shard>, SourceError> {
        let mut shards = Vec::new();
        let mut after: Option<String> = None;
        let mut pace = self.describe.lock().await;
        loop {
            let interval = pace.get_or_insert_with(|| {
                let mut i = tokio::time::interval(self.options.describe_interval.max(
                    // A zero period would panic; a millisecond is no pacing at all.
                    Duration::from_millis(1),
                ));
                i.set_missed_tick_behavior(MissedTickBehavior::Delay);
                i
            });
            interval.tick().await;
            let out = self
                .client
                .describe_stream()
                .stream_arn(&self.stream_arn)
                .limit(100)
                .set_exclusive_start_shard_id(after.take())
                .send()
                .await
                .map_err(|e| source_error("partitions", None, e))?;
            let Some(description) = out.stream_description() else {
                break;
            };
            shards.extend(description.shards().iter().cloned());
            match description.last_evaluated_shard_id() {
                Some(last) if !last.is_empty() => after = Some(last.to_string()),
                _ => break,
            }
        }
        Ok(shards)
    }

    /// A shard iterator on `partition` at `from`; `None` when the shard has nothing more.
    pub(crate) async fn iterator(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Option<String>, SourceError> {
        if !is_shard_id(partition.as_str()) {
            return Err(SourceError::UnknownPartition {
                partition: partition.to_string(),
            });
        }
        let req = self
            .client
            .get_shard_iterator()
            .stream_arn(&self.stream_arn)
            .shard_id(partition.as_str());
        let req = match from {
            Position::Beginning | Position::AtTime(_) => {
                req.shard_iterator_type(ShardIteratorType::TrimHorizon)
            }
            Position::Now => req.shard_iterator_type(ShardIteratorType::Latest),
            Position::Continuation(c) => {
                let Some(seq) = sequence_of(c.as_str()) else {
                    return Err(SourceError::InvalidContinuation {
                        partition: partition.to_string(),
                        continuation: c.to_string(),
                        reason: "a DynamoDB Streams continuation is a sequence number \
                                 (21 to 40 decimal digits), optionally followed by / and a \
                                 sub-sequence number"
                            .to_string(),
                    });
                };
                req.shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                    .sequence_number(seq)
            }
        };
        let err = match req.send().await {
            Ok(out) => return Ok(out.shard_iterator().map(str::to_string)),
            Err(e) => e,
        };
        let text = message(&err);
        if code(&err) == Some("ResourceNotFoundException")
            && text.to_ascii_lowercase().contains("shard")
        {
            return Err(SourceError::UnknownPartition {
                partition: partition.to_string(),
            });
        }
        let Position::Continuation(c) = from else {
            return Err(source_error("open", Some(partition), err));
        };
        match code(&err) {
            Some("TrimmedDataAccessException") => {
                Err(lost_to_retention(partition, c.as_str(), &text))
            }
            // Throttled or busy: the sequence number is not in question.
            Some(service) if service != "InternalFailure" && is_retryable(&err) => {
                Err(source_error("open", Some(partition), err))
            }
            Some(service) => {
                // The server refused the sequence number (DynamoDB Local answers one past the
                // shard with InternalFailure, even after retries): if it serves the shard from
                // its start, the sequence number is what it refused.
                let service = service.to_string();
                self.client
                    .get_shard_iterator()
                    .stream_arn(&self.stream_arn)
                    .shard_id(partition.as_str())
                    .shard_iterator_type(ShardIteratorType::TrimHorizon)
                    .send()
                    .await
                    .map_err(|e| source_error("open", Some(partition), e))?;
                Err(SourceError::InvalidContinuation {
                    partition: partition.to_string(),
                    continuation: c.to_string(),
                    reason: format!(
                        "not a sequence number of this shard: the server refused it ({service}: \
                         {text}) and serves the shard from its start"
                    ),
                })
            }
            None => Err(source_error("open", Some(partition), err)),
        }
    }
}

#[async_trait]
impl FeedSource for DynamoStreamsFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.shards().await?.iter().map(to_partition).collect()
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let iterator = self.iterator(partition, from).await?;
        Ok(Box::new(DynamoStreamsReader::new(
            self.clone(),
            partition.clone(),
            from.clone(),
            iterator,
        )))
    }

    async fn remaining(
        &self,
        _partition: &PartitionId,
        _after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        // A stream cannot count its records; lag is told in time (oldest_unread).
        Ok(None)
    }

    /// The `ApproximateCreationDateTime` of the first record after `after`: one
    /// `GetShardIterator` and one `GetRecords` with `Limit` 1. DynamoDB Streams has no
    /// `MillisBehindLatest`, so an empty answer (or the end of a closed shard) is taken as
    /// caught up.
    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let from = after
            .map(|c| Position::Continuation(c.clone()))
            .unwrap_or(Position::Beginning);
        let iterator = self.iterator(partition, &from).await?;
        let mut reader = DynamoStreamsReader::new(self.clone(), partition.clone(), from, iterator);
        let batch = reader.next_batch(1).await?;
        Ok(match batch.records.first() {
            Some(r) => r.timestamp.map_or(OldestUnread::Unknown, OldestUnread::At),
            None => OldestUnread::CaughtUp,
        })
    }
}

/// The time `AtTime` starts at, for the reader's filter.
pub(crate) fn not_before(from: &Position) -> Option<Timestamp> {
    match from {
        Position::AtTime(t) => Some(*t),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
