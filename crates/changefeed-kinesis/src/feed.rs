//! [`KinesisFeed`]: the feed source seam on one Kinesis data stream, read by polling
//! (`GetRecords`) or by enhanced fan-out (`SubscribeToShard`, see [`crate::FanOutReader`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::primitives::DateTime;
use aws_sdk_kinesis::types::{Shard, ShardIteratorType};
use aws_sdk_kinesis::Client;
use changefeed::error::BoxError;
use changefeed::model::{Continuation, KeyRange, Partition, PartitionId, Position};
use changefeed::source::{FeedSource, OldestUnread, PartitionReader};
use changefeed::SourceError;
use rand::rngs::SmallRng;
use std::collections::HashMap;

use crate::kpl::ExtendedSequenceNumber;
use crate::reader::KinesisReader;
use rand::{Rng, SeedableRng};

/// How a reader polls and retries.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// Throttled calls (`ProvisionedThroughputExceededException`, `LimitExceededException`)
    /// retried before `next_batch` gives up with a retryable error.
    pub max_retries: u32,
    /// First back-off after a throttled call; doubles each retry, full jitter.
    pub base_backoff: Duration,
    /// Longest back-off.
    pub max_backoff: Duration,
    /// Empty `GetRecords` answers followed while `MillisBehindLatest` says there is more (real
    /// Kinesis may answer empty on a sparse shard before reaching its records).
    pub empty_polls: u32,
    /// Seed of the RNG that jitters back-off.
    pub seed: u64,
    /// Deliver the user records of a KPL-aggregated record even when one of them has a hash key
    /// outside the shard's range (a producer with a stale shard map). `false` (the default)
    /// drops such an aggregated record whole, as the KCL 2.5.8 does ([`crate::kpl`]).
    pub deliver_outside_shard: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            max_retries: 8,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            empty_polls: 5,
            seed: 0,
            deliver_outside_shard: false,
        }
    }
}

/// How a [`KinesisFeed`] reads its shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Retrieval {
    /// `GetShardIterator` then `GetRecords`, following `NextShardIterator`: the shard's
    /// read throughput (2 MB/s, 5 calls/s) is shared with every other polling reader.
    #[default]
    Polling,
    /// Enhanced fan-out: the stream consumer `consumer_name` is registered (or reused) and
    /// each shard is read by `SubscribeToShard`, records pushed as they arrive, with 2 MB/s per
    /// shard of its own. The KCL's default retrieval.
    FanOut {
        /// The stream consumer's name (the KCL uses the application name).
        consumer_name: String,
    },
}

/// The feed source on one Kinesis data stream: partitions are shards, the continuation is a
/// record's sequence number.
///
/// - `partitions` pages through `ListShards` (`NextToken`); a shard's parents are its
///   `ParentShardId` and `AdjacentParentShardId`, its key range its `HashKeyRange`, and it is
///   closed when its `SequenceNumberRange` has an `EndingSequenceNumber`.
/// - Positions map to `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP` and `AFTER_SEQUENCE_NUMBER`.
///   The iterator is taken when the reader opens, so `Now` means "after what was there at
///   open".
/// - A reader follows `NextShardIterator`; an expired iterator is renewed after the last
///   sequence number read; throttling is retried with exponential back-off and full jitter;
///   a null next iterator (or `ChildShards` in the answer) is the end of the shard.
/// - Records the KPL aggregated are taken apart into their user records, as the KCL does
///   ([`crate::kpl`]): each has the Kinesis record's sequence number and its own sub-sequence
///   number, and the continuation `SEQ/SUB` ([`ExtendedSequenceNumber`]). Opening after such a
///   continuation reads `AT_SEQUENCE_NUMBER` `SEQ` and skips the user records up to `SUB`, as
///   the KCL resumes from a checkpoint at a sub-sequence number. A batch holds at most `max`
///   user records; the rest of an aggregated record waits for the next batch. An aggregated
///   record with a user record whose hash key lies outside the shard's range is dropped whole,
///   as by the KCL (unless [`ReadOptions::deliver_outside_shard`]); the shard's range comes
///   from `ListShards` (kept per shard: a shard's range never changes).
#[derive(Debug, Clone)]
pub struct KinesisFeed {
    pub(crate) client: Client,
    pub(crate) stream: String,
    pub(crate) options: ReadOptions,
    pub(crate) retrieval: Retrieval,
    /// The registered stream consumer's ARN, once known (fan-out only).
    pub(crate) consumer_arn: Arc<tokio::sync::OnceCell<String>>,
    /// The fan-out readers' subscriptions between calls.
    pub(crate) subscriptions: Arc<crate::fanout::Subscriptions>,
    rng: Arc<Mutex<SmallRng>>,
    /// The hash key range of each shard `ListShards` listed.
    ranges: Arc<Mutex<HashMap<PartitionId, KeyRange>>>,
}

/// Error codes for throttling and transient trouble, retried with back-off.
const THROTTLED: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "LimitExceededException",
    "KMSThrottlingException",
    "ThrottlingException",
];

pub(crate) fn code<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Option<&str> {
    err.as_service_error().and_then(|e| e.code())
}

pub(crate) fn is_throttled<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    code(err).is_some_and(|c| THROTTLED.contains(&c))
}

fn is_transient<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    match err {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            true
        }
        SdkError::ServiceError(_) => {
            is_throttled(err) || code(err).is_some_and(|c| c.contains("InternalFailure"))
        }
        _ => false,
    }
}

/// A Kinesis SDK error, summarised: the service's error code and message, or the chain of
/// causes in words (without the SDK's `Debug` dump of the request); the SDK error stays the
/// `source`.
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct KinesisError {
    context: String,
    #[source]
    source: Option<BoxError>,
}

impl KinesisError {
    pub(crate) fn new<E, R>(err: SdkError<E, R>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        let context = match err.as_service_error() {
            Some(e) => format!(
                "{}: {}",
                e.code().unwrap_or("service error"),
                e.message().unwrap_or("(no message)")
            ),
            None => changefeed_aws::summary(&err),
        };
        Self {
            context,
            source: Some(Box::new(err)),
        }
    }

    pub(crate) fn other(context: impl Into<String>) -> Self {
        Self {
            context: context.into(),
            source: None,
        }
    }
}

pub(crate) fn source_error<E, R>(
    operation: &'static str,
    partition: Option<&PartitionId>,
    err: SdkError<E, R>,
) -> SourceError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let retryable = is_transient(&err);
    SourceError::source(
        operation,
        partition.map(|p| p.to_string()),
        retryable,
        KinesisError::new(err),
    )
}

/// A shard's hash key range, if `ListShards` gave one that reads.
fn key_range(shard: &Shard) -> Option<KeyRange> {
    shard.hash_key_range().and_then(|r| {
        Some(KeyRange {
            start: r.starting_hash_key().parse().ok()?,
            end: r.ending_hash_key().parse().ok()?,
        })
    })
}

fn to_partition(shard: &Shard) -> Result<Partition, SourceError> {
    let id = PartitionId::new(shard.shard_id()).map_err(|e| SourceError::Corrupt {
        partition: shard.shard_id().to_string(),
        reason: e.to_string(),
    })?;
    let mut parents = Vec::new();
    for p in [shard.parent_shard_id(), shard.adjacent_parent_shard_id()]
        .into_iter()
        .flatten()
    {
        parents.push(PartitionId::new(p).map_err(|e| SourceError::Corrupt {
            partition: shard.shard_id().to_string(),
            reason: format!("parent: {e}"),
        })?);
    }
    let key_range = key_range(shard);
    let closed = shard
        .sequence_number_range()
        .and_then(|r| r.ending_sequence_number())
        .is_some();
    Ok(Partition {
        id,
        parents,
        closed,
        key_range,
    })
}

impl KinesisFeed {
    /// A source reading `stream` through `client`, with default [`ReadOptions`].
    pub fn new(client: Client, stream: impl Into<String>) -> Self {
        Self::with_options(client, stream, ReadOptions::default())
    }

    /// A source reading `stream` through `client`.
    pub fn with_options(client: Client, stream: impl Into<String>, options: ReadOptions) -> Self {
        let rng = SmallRng::seed_from_u64(options.seed);
        Self {
            client,
            stream: stream.into(),
            options,
            retrieval: Retrieval::Polling,
            consumer_arn: Arc::default(),
            subscriptions: Arc::default(),
            rng: Arc::new(Mutex::new(rng)),
            ranges: Arc::default(),
        }
    }

    /// Connects with `options` (endpoint, region, credentials; the rest from the standard AWS
    /// chain) to read `stream`, with default [`ReadOptions`].
    pub async fn connect(options: &crate::AwsOptions, stream: impl Into<String>) -> Self {
        Self::connect_with(options, stream, ReadOptions::default()).await
    }

    /// As [`KinesisFeed::connect`], reading as `read` says. The client's timeouts are
    /// [`Timeouts::KINESIS`](crate::Timeouts::KINESIS) less what `options` overrides: see the
    /// crate docs, "Timeouts and recovery".
    pub async fn connect_with(
        options: &crate::AwsOptions,
        stream: impl Into<String>,
        read: ReadOptions,
    ) -> Self {
        let config = options.load_with(crate::Timeouts::KINESIS).await;
        Self::with_options(Client::new(&config), stream, read)
    }

    /// This source, reading its shards as `retrieval` says (polling unless told).
    #[must_use]
    pub fn with_retrieval(mut self, retrieval: Retrieval) -> Self {
        self.retrieval = retrieval;
        self.consumer_arn = Arc::default();
        self
    }

    /// How this source reads its shards.
    pub fn retrieval(&self) -> &Retrieval {
        &self.retrieval
    }

    /// The stream name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Every shard as `ListShards` returns it, all pages.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn shards(&self) -> Result<Vec<Shard>, SourceError> {
        let mut shards = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut req = self.client.list_shards().max_results(1000);
            req = match token.take() {
                // With a NextToken, ListShards refuses the stream name.
                Some(t) => req.next_token(t),
                None => req.stream_name(&self.stream),
            };
            let out = self
                .call_with_backoff(|| req.clone().send(), "partitions", None)
                .await?;
            shards.extend(out.shards().iter().cloned());
            match out.next_token() {
                Some(t) if !t.is_empty() => token = Some(t.to_string()),
                _ => break,
            }
        }
        let mut ranges = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        for shard in &shards {
            if let (Ok(id), Some(range)) = (PartitionId::new(shard.shard_id()), key_range(shard)) {
                ranges.insert(id, range);
            }
        }
        Ok(shards)
    }

    /// The hash key range of `partition`: known from an earlier listing, else from
    /// `ListShards`; `None` when the shard is not listed (any more) or has no range.
    pub(crate) async fn range_of(
        &self,
        partition: &PartitionId,
    ) -> Result<Option<KeyRange>, SourceError> {
        let known = |feed: &Self| {
            feed.ranges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(partition)
                .copied()
        };
        if let Some(range) = known(self) {
            return Ok(Some(range));
        }
        self.shards().await?;
        Ok(known(self))
    }

    pub(crate) async fn backoff(&self, attempt: u32) {
        let cap = self
            .options
            .base_backoff
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.options.max_backoff);
        let ms = cap.as_millis().max(1) as u64;
        let wait = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            rng.gen_range(0..=ms)
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }

    /// Runs `call`, retrying throttling with jittered exponential back-off.
    pub(crate) async fn call_with_backoff<T, E, R, F, Fut>(
        &self,
        call: F,
        operation: &'static str,
        partition: Option<&PartitionId>,
    ) -> Result<T, SourceError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, SdkError<E, R>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        let mut attempt = 0;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(e) if is_throttled(&e) && attempt < self.options.max_retries => {
                    tracing::debug!(operation, error = %changefeed_aws::summary(&e), "throttled; backing off");
                    attempt += 1;
                    self.backoff(attempt).await;
                }
                Err(e) => return Err(source_error(operation, partition, e)),
            }
        }
    }

    pub(crate) async fn iterator(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Option<String>, SourceError> {
        let start = Start::of(partition, from)?;
        let req = self
            .client
            .get_shard_iterator()
            .stream_name(&self.stream)
            .shard_id(partition.as_str())
            .shard_iterator_type(start.kind)
            .set_starting_sequence_number(start.sequence_number)
            .set_timestamp(start.timestamp);
        let mut attempt = 0;
        loop {
            match req.clone().send().await {
                Ok(out) => return Ok(out.shard_iterator().map(str::to_string)),
                Err(e) if is_throttled(&e) && attempt < self.options.max_retries => {
                    attempt += 1;
                    self.backoff(attempt).await;
                }
                Err(e) => return Err(open_error(partition, from, e)),
            }
        }
    }
}

/// Where a read starts, as `GetShardIterator` and `SubscribeToShard` both take it.
pub(crate) struct Start {
    pub(crate) kind: ShardIteratorType,
    pub(crate) sequence_number: Option<String>,
    pub(crate) timestamp: Option<DateTime>,
}

impl Start {
    pub(crate) fn of(partition: &PartitionId, from: &Position) -> Result<Self, SourceError> {
        let (kind, sequence_number, timestamp) = match from {
            Position::Beginning => (ShardIteratorType::TrimHorizon, None, None),
            Position::Now => (ShardIteratorType::Latest, None, None),
            Position::AtTime(t) => (
                ShardIteratorType::AtTimestamp,
                None,
                Some(DateTime::from_millis(t.millis())),
            ),
            Position::Continuation(c) => match check_sequence_number(partition, c)? {
                ExtendedSequenceNumber {
                    sequence_number,
                    sub_sequence_number: None,
                } => (
                    ShardIteratorType::AfterSequenceNumber,
                    Some(sequence_number.to_string()),
                    None,
                ),
                // Part of an aggregated record is done: read it again, skipping that part.
                ExtendedSequenceNumber {
                    sequence_number, ..
                } => (
                    ShardIteratorType::AtSequenceNumber,
                    Some(sequence_number.to_string()),
                    None,
                ),
            },
        };
        Ok(Self {
            kind,
            sequence_number,
            timestamp,
        })
    }
}

/// The error of a refused start of a read at `from`: an invalid continuation and an unknown
/// shard are told apart from other trouble.
pub(crate) fn open_error<E, R>(
    partition: &PartitionId,
    from: &Position,
    e: SdkError<E, R>,
) -> SourceError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let message = e
        .as_service_error()
        .and_then(|s| s.message())
        .unwrap_or_default()
        .to_ascii_lowercase();
    // Kinesis refuses a sequence number of another shard, or one that is not
    // there, with InvalidArgumentException; kinesis-mock with
    // ResourceNotFoundException naming the sequence number.
    let bad_sequence = match code(&e) {
        Some("InvalidArgumentException") => !partition_unknown(&e),
        Some("ResourceNotFoundException") => message.contains("sequencenumber"),
        _ => false,
    };
    if let (Position::Continuation(c), true) = (from, bad_sequence) {
        return SourceError::InvalidContinuation {
            partition: partition.to_string(),
            continuation: c.to_string(),
            reason: e
                .as_service_error()
                .and_then(|s| s.message())
                .unwrap_or("refused by Kinesis")
                .to_string(),
        };
    }
    if partition_unknown(&e) {
        return SourceError::UnknownPartition {
            partition: partition.to_string(),
        };
    }
    source_error("open", Some(partition), e)
}

/// Whether Kinesis said the shard does not exist (`ResourceNotFoundException`, or an
/// `InvalidArgumentException` about the shard id itself).
fn partition_unknown<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    match code(err) {
        Some("ResourceNotFoundException") => {
            // The stream itself missing is not a missing partition.
            let msg = err
                .as_service_error()
                .and_then(|e| e.message())
                .unwrap_or_default()
                .to_ascii_lowercase();
            msg.contains("shard") || !msg.contains("stream")
        }
        Some("InvalidArgumentException") => {
            let msg = err
                .as_service_error()
                .and_then(|e| e.message())
                .unwrap_or_default()
                .to_ascii_lowercase();
            msg.contains("shardid") || msg.contains("shard id")
        }
        _ => false,
    }
}

/// A continuation of this source: a Kinesis sequence number (decimal, up to 128 digits),
/// optionally `/` and a sub-sequence number.
fn check_sequence_number<'a>(
    partition: &PartitionId,
    c: &'a Continuation,
) -> Result<ExtendedSequenceNumber<'a>, SourceError> {
    ExtendedSequenceNumber::parse(c.as_str()).ok_or_else(|| SourceError::InvalidContinuation {
        partition: partition.to_string(),
        continuation: c.as_str().to_string(),
        reason: "a Kinesis continuation is a sequence number (up to 128 decimal digits), \
                 optionally followed by / and a sub-sequence number"
            .to_string(),
    })
}

#[async_trait]
impl FeedSource for KinesisFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.shards().await?.iter().map(to_partition).collect()
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        if let Retrieval::FanOut { consumer_name } = &self.retrieval {
            return crate::fanout::open(self, consumer_name, partition, from).await;
        }
        let iterator = self.iterator(partition, from).await?;
        Ok(Box::new(KinesisReader::new(
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
        // Kinesis cannot count records; readers report MillisBehindLatest instead.
        Ok(None)
    }

    /// The `ApproximateArrivalTimestamp` of the first record after `after`: one
    /// `GetShardIterator` (`AFTER_SEQUENCE_NUMBER`, or `TRIM_HORIZON`) and one `GetRecords`
    /// with `Limit` 1 (more only while Kinesis answers empty pages behind the tip, as a reader
    /// does). Chosen over `MillisBehindLatest`, which costs the same two calls but measures the
    /// distance from the iterator to the tip of the shard (the age of the newest record, not of
    /// the oldest unread one) and is 0 for a closed shard whatever is left in it. Caught up when
    /// the page is empty and `MillisBehindLatest` is 0, or the shard ended.
    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let from = after
            .map(|c| Position::Continuation(c.clone()))
            .unwrap_or(Position::Beginning);
        let iterator = self.iterator(partition, &from).await?;
        let mut reader = KinesisReader::new(self.clone(), partition.clone(), from, iterator);
        let batch = reader.next_batch(1).await?;
        Ok(match batch.records.first() {
            Some(r) => match r.timestamp {
                Some(t) => OldestUnread::At(t),
                None => OldestUnread::Unknown,
            },
            None if batch.end_of_partition || reader.millis_behind_latest() == Some(0) => {
                OldestUnread::CaughtUp
            }
            None => OldestUnread::Unknown,
        })
    }
}
