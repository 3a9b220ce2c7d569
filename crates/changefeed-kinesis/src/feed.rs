//! [`KinesisFeed`]: the feed source seam on one Kinesis data stream, read by polling.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::primitives::{Blob, DateTime};
use aws_sdk_kinesis::types::{Shard, ShardIteratorType, StreamStatus};
use aws_sdk_kinesis::Client;
use changefeed::error::BoxError;
use changefeed::model::{
    Batch, Continuation, KeyRange, Partition, PartitionId, Position, Record, Timestamp,
};
use changefeed::source::{FeedSource, OldestUnread, PartitionReader};
use changefeed::SourceError;
use rand::rngs::SmallRng;
use std::collections::{HashMap, VecDeque};

use crate::kpl::{self, ExtendedSequenceNumber};
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
    client: Client,
    stream: String,
    options: ReadOptions,
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

fn code<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Option<&str> {
    err.as_service_error().and_then(|e| e.code())
}

fn is_throttled<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
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
    fn new<E, R>(err: SdkError<E, R>) -> Self
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

    fn other(context: impl Into<String>) -> Self {
        Self {
            context: context.into(),
            source: None,
        }
    }
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
    async fn range_of(&self, partition: &PartitionId) -> Result<Option<KeyRange>, SourceError> {
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

    async fn backoff(&self, attempt: u32) {
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
    async fn call_with_backoff<T, E, R, F, Fut>(
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

    async fn iterator(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Option<String>, SourceError> {
        let mut req = self
            .client
            .get_shard_iterator()
            .stream_name(&self.stream)
            .shard_id(partition.as_str());
        req = match from {
            Position::Beginning => req.shard_iterator_type(ShardIteratorType::TrimHorizon),
            Position::Now => req.shard_iterator_type(ShardIteratorType::Latest),
            Position::AtTime(t) => req
                .shard_iterator_type(ShardIteratorType::AtTimestamp)
                .timestamp(DateTime::from_millis(t.millis())),
            Position::Continuation(c) => match check_sequence_number(partition, c)? {
                ExtendedSequenceNumber {
                    sequence_number,
                    sub_sequence_number: None,
                } => req
                    .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                    .starting_sequence_number(sequence_number),
                // Part of an aggregated record is done: read it again, skipping that part.
                ExtendedSequenceNumber {
                    sequence_number, ..
                } => req
                    .shard_iterator_type(ShardIteratorType::AtSequenceNumber)
                    .starting_sequence_number(sequence_number),
            },
        };
        let mut attempt = 0;
        loop {
            match req.clone().send().await {
                Ok(out) => return Ok(out.shard_iterator().map(str::to_string)),
                Err(e) if is_throttled(&e) && attempt < self.options.max_retries => {
                    attempt += 1;
                    self.backoff(attempt).await;
                }
                Err(e) => {
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
                        return Err(SourceError::InvalidContinuation {
                            partition: partition.to_string(),
                            continuation: c.to_string(),
                            reason: e
                                .as_service_error()
                                .and_then(|s| s.message())
                                .unwrap_or("refused by Kinesis")
                                .to_string(),
                        });
                    }
                    if partition_unknown(&e) {
                        return Err(SourceError::UnknownPartition {
                            partition: partition.to_string(),
                        });
                    }
                    return Err(source_error("open", Some(partition), e));
                }
            }
        }
    }
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
            None if batch.end_of_partition || reader.millis_behind_latest == Some(0) => {
                OldestUnread::CaughtUp
            }
            None => OldestUnread::Unknown,
        })
    }
}

/// Reads one shard forward by `GetRecords`.
#[derive(Debug)]
pub struct KinesisReader {
    feed: KinesisFeed,
    partition: PartitionId,
    start: Position,
    /// The sequence number of the last Kinesis record read (all its user records are in
    /// `pending` or delivered): where a renewed iterator starts after.
    last: Option<Continuation>,
    iterator: Option<String>,
    ended: bool,
    millis_behind_latest: Option<i64>,
    /// User records read and not yet returned (the rest of an aggregated record beyond `max`).
    pending: VecDeque<Record>,
    /// Opened after part of an aggregated record: its sequence number and the last
    /// sub-sequence number done, skipped when that record is read.
    skip: Option<(String, u64)>,
    /// The shard's hash key range, once looked up (at the first record that may be an
    /// aggregated one, unless `deliver_outside_shard`); `Some(None)` when it is unknown.
    range: Option<Option<KeyRange>>,
}

impl KinesisReader {
    fn new(
        feed: KinesisFeed,
        partition: PartitionId,
        start: Position,
        iterator: Option<String>,
    ) -> Self {
        let skip = match &start {
            Position::Continuation(c) => ExtendedSequenceNumber::parse(c.as_str())
                .and_then(|e| Some((e.sequence_number.to_string(), e.sub_sequence_number?))),
            _ => None,
        };
        KinesisReader {
            feed,
            partition,
            start,
            last: None,
            ended: iterator.is_none(),
            iterator,
            millis_behind_latest: None,
            pending: VecDeque::new(),
            skip,
            range: None,
        }
    }

    /// Queues the user records of one Kinesis record (itself, unless the KPL aggregated it),
    /// leaving out those a sub-sequence continuation says are done.
    fn queue(&mut self, r: &aws_sdk_kinesis::types::Record) {
        let timestamp = r
            .approximate_arrival_timestamp()
            .and_then(|t| t.to_millis().ok().map(Timestamp));
        let seq = r.sequence_number();
        // The skip applies to the first record read, which is the one it names.
        let done = match self.skip.take() {
            Some((s, sub)) if s == seq => Some(sub),
            _ => None,
        };
        let data = bytes::Bytes::copy_from_slice(r.data().as_ref());
        let Some(users) = kpl::deaggregate(&data) else {
            if done.is_none() {
                self.pending.push_back(Record {
                    key: r.partition_key().unwrap_or_default().to_string(),
                    data,
                    continuation: Continuation::new(seq),
                    timestamp,
                });
            }
            return;
        };
        if let Some(range) = self.range.flatten() {
            if let Some(user) = kpl::outside(&users, range) {
                metrics::counter!("changefeed_kinesis_user_records_dropped_total")
                    .increment(users.len() as u64);
                tracing::warn!(
                    shard = %self.partition,
                    sequence_number = seq,
                    user_records = users.len(),
                    partition_key = %user.key,
                    hash_key = ?user.hash_key,
                    shard_hash_keys = %format_args!("{}..={}", range.start, range.end),
                    "a KPL-aggregated record holds a user record whose hash key is outside the \
                     shard: dropped whole, as the KCL does (a producer with a stale shard map)"
                );
                return;
            }
        }
        for (sub, user) in (0u64..).zip(users) {
            if done.is_some_and(|d| sub <= d) {
                continue;
            }
            let at = ExtendedSequenceNumber {
                sequence_number: seq,
                sub_sequence_number: Some(sub),
            };
            self.pending.push_back(Record {
                key: user.key,
                data: user.data,
                continuation: at.continuation(),
                timestamp,
            });
        }
    }

    /// Up to `max` queued user records as a batch; the end of the shard once the reader ended
    /// and nothing is queued.
    fn take(&mut self, max: usize) -> Batch {
        let n = self.pending.len().min(max.max(1));
        let records: Vec<Record> = self.pending.drain(..n).collect();
        Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            records,
            end_of_partition: self.ended && self.pending.is_empty(),
        }
    }

    /// How far behind the tip of the shard the last `GetRecords` answer was, in milliseconds
    /// (Kinesis's `MillisBehindLatest`): the lag of this reader.
    pub fn millis_behind_latest(&self) -> Option<i64> {
        self.millis_behind_latest
    }

    async fn renew(&mut self) -> Result<(), SourceError> {
        let from = match &self.last {
            Some(c) => Position::Continuation(c.clone()),
            None => self.start.clone(),
        };
        self.iterator = self.feed.iterator(&self.partition, &from).await?;
        if self.iterator.is_none() {
            self.ended = true;
        }
        Ok(())
    }
}

#[async_trait]
impl PartitionReader for KinesisReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        let mut throttled = 0;
        let mut empty = 0;
        let mut renewed = false;
        loop {
            if self.ended || !self.pending.is_empty() {
                return Ok(self.take(max));
            }
            let Some(iterator) = self.iterator.clone() else {
                self.renew().await?;
                continue;
            };
            let limit = max.clamp(1, 10_000) as i32;
            let result = self
                .feed
                .client
                .get_records()
                .shard_iterator(iterator)
                .limit(limit)
                .send()
                .await;
            let out = match result {
                Ok(out) => out,
                Err(e) if code(&e) == Some("ExpiredIteratorException") && !renewed => {
                    // Renew once from the last continuation: nothing is skipped or repeated.
                    renewed = true;
                    self.iterator = None;
                    continue;
                }
                Err(e) if is_throttled(&e) && throttled < self.feed.options.max_retries => {
                    throttled += 1;
                    self.feed.backoff(throttled).await;
                    continue;
                }
                Err(e) => return Err(source_error("read", Some(&self.partition), e)),
            };
            if self.range.is_none()
                && !self.feed.options.deliver_outside_shard
                && out
                    .records()
                    .iter()
                    .any(|r| kpl::maybe_aggregated(r.data().as_ref()))
            {
                // Before anything of this answer is kept: on an error the same iterator reads
                // it again.
                let range = self.feed.range_of(&self.partition).await?;
                if range.is_none() {
                    tracing::warn!(
                        shard = %self.partition,
                        "the shard's hash key range is unknown (not listed by ListShards): \
                         KPL user records outside it are delivered"
                    );
                }
                self.range = Some(range);
            }
            self.millis_behind_latest = out.millis_behind_latest();
            if let Some(ms) = out.millis_behind_latest() {
                metrics::gauge!("changefeed_kinesis_millis_behind_latest").set(ms as f64);
            }
            for r in out.records() {
                self.queue(r);
            }
            if let Some(r) = out.records().last() {
                self.last = Some(Continuation::new(r.sequence_number()));
            }
            self.iterator = out.next_shard_iterator().map(str::to_string);
            let end = self.iterator.is_none() || !out.child_shards().is_empty();
            if end {
                self.ended = true;
                self.iterator = None;
            }
            let behind = out.millis_behind_latest().unwrap_or(0) > 0;
            if self.pending.is_empty() && !end && behind && empty < self.feed.options.empty_polls {
                empty += 1;
                continue;
            }
            return Ok(self.take(max));
        }
    }
}

/// Stream operations for tools and tests: create, write, split, merge.
impl KinesisFeed {
    /// Creates the stream with `shards` shards (if absent) and waits until it is active.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn create_stream(&self, shards: i32) -> Result<(), SourceError> {
        let created = self
            .client
            .create_stream()
            .stream_name(&self.stream)
            .shard_count(shards)
            .send()
            .await;
        if let Err(e) = created {
            if code(&e) != Some("ResourceInUseException") {
                return Err(source_error("create_stream", None, e));
            }
        }
        self.wait_active().await
    }

    /// Deletes the stream.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn delete_stream(&self) -> Result<(), SourceError> {
        self.client
            .delete_stream()
            .stream_name(&self.stream)
            .enforce_consumer_deletion(true)
            .send()
            .await
            .map_err(|e| source_error("delete_stream", None, e))?;
        Ok(())
    }

    /// Waits (polling `DescribeStreamSummary`, up to a minute) until the stream is active.
    ///
    /// # Errors
    /// [`SourceError::Source`] if it never becomes active.
    pub async fn wait_active(&self) -> Result<(), SourceError> {
        for _ in 0..600 {
            let out = self
                .call_with_backoff(
                    || {
                        self.client
                            .describe_stream_summary()
                            .stream_name(&self.stream)
                            .send()
                    },
                    "describe_stream_summary",
                    None,
                )
                .await?;
            let status = out
                .stream_description_summary()
                .map(|d| d.stream_status().clone());
            if status == Some(StreamStatus::Active) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(SourceError::source(
            "wait_active",
            None,
            true,
            KinesisError::other(format!("stream {} did not become active", self.stream)),
        ))
    }

    /// Writes one record with partition key `key`, routed by Kinesis (or to the shard owning
    /// `explicit_hash_key`); returns its shard and sequence number.
    ///
    /// # Errors
    /// [`SourceError::Source`].
    pub async fn put(
        &self,
        key: &str,
        data: impl Into<Vec<u8>>,
        explicit_hash_key: Option<u128>,
    ) -> Result<(PartitionId, Continuation), SourceError> {
        let data = Blob::new(data.into());
        let out = self
            .call_with_backoff(
                || {
                    self.client
                        .put_record()
                        .stream_name(&self.stream)
                        .partition_key(key)
                        .set_explicit_hash_key(explicit_hash_key.map(|h| h.to_string()))
                        .data(data.clone())
                        .send()
                },
                "put_record",
                None,
            )
            .await?;
        let shard = PartitionId::new(out.shard_id()).map_err(|e| SourceError::Corrupt {
            partition: out.shard_id().to_string(),
            reason: e.to_string(),
        })?;
        Ok((shard, Continuation::new(out.sequence_number())))
    }

    async fn partition(&self, id: &PartitionId) -> Result<Partition, SourceError> {
        self.partitions()
            .await?
            .into_iter()
            .find(|p| &p.id == id)
            .ok_or_else(|| SourceError::UnknownPartition {
                partition: id.to_string(),
            })
    }

    /// Splits `shard` at the middle of its hash-key range (`SplitShard`), waits until the
    /// stream is active, and returns the two children, lower range first.
    ///
    /// # Errors
    /// [`SourceError::UnknownPartition`]; [`SourceError::Source`].
    pub async fn split(
        &self,
        shard: &PartitionId,
    ) -> Result<(PartitionId, PartitionId), SourceError> {
        let p = self.partition(shard).await?;
        let range = p.key_range.unwrap_or(KeyRange::FULL);
        let middle = range.start + (range.end - range.start) / 2 + 1;
        self.call_with_backoff(
            || {
                self.client
                    .split_shard()
                    .stream_name(&self.stream)
                    .shard_to_split(shard.as_str())
                    .new_starting_hash_key(middle.to_string())
                    .send()
            },
            "split_shard",
            Some(shard),
        )
        .await?;
        self.wait_active().await?;
        let mut children: Vec<Partition> = self
            .partitions()
            .await?
            .into_iter()
            .filter(|c| c.parents.first() == Some(shard) && c.parents.len() == 1)
            .collect();
        children.sort_by_key(|c| c.key_range.map(|r| r.start));
        match children.as_slice() {
            [a, b] => Ok((a.id.clone(), b.id.clone())),
            _ => Err(SourceError::Corrupt {
                partition: shard.to_string(),
                reason: format!("split produced {} children", children.len()),
            }),
        }
    }

    /// Merges the adjacent shards `a` and `b` (`MergeShards`), waits until the stream is
    /// active, and returns the child.
    ///
    /// # Errors
    /// [`SourceError::Source`] (for instance if they are not adjacent).
    pub async fn merge(
        &self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Result<PartitionId, SourceError> {
        self.call_with_backoff(
            || {
                self.client
                    .merge_shards()
                    .stream_name(&self.stream)
                    .shard_to_merge(a.as_str())
                    .adjacent_shard_to_merge(b.as_str())
                    .send()
            },
            "merge_shards",
            Some(a),
        )
        .await?;
        self.wait_active().await?;
        self.partitions()
            .await?
            .into_iter()
            .find(|c| c.parents.contains(a) && c.parents.contains(b))
            .map(|c| c.id)
            .ok_or_else(|| SourceError::Corrupt {
                partition: a.to_string(),
                reason: format!("no child of the merge of {a} and {b} is listed"),
            })
    }
}
