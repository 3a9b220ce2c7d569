//! Enhanced fan-out: reading a shard by `SubscribeToShard`, records pushed to a registered
//! stream consumer.
//!
//! The consumer is registered once per [`KinesisFeed`] (`RegisterStreamConsumer`; one that
//! exists is reused) and used once `DescribeStreamConsumer` says it is `ACTIVE`. A reader holds
//! one subscription at a time. Kinesis ends a subscription after 5 minutes, and a subscription
//! may fail (a connection reset, a throttled call): the reader then subscribes again after the
//! last record it received (`AFTER_SEQUENCE_NUMBER`), or at the event's
//! `ContinuationSequenceNumber` when it has received none, so nothing is skipped or repeated.
//! A second subscription on the same shard and consumer (a lease that moved while the old
//! owner's subscription still runs) is refused with `ResourceInUseException`: it is retried
//! with back-off until the old one ends. Within one process the newest reader of a shard
//! takes the subscription over: readers keep their subscription in [`Subscriptions`] between
//! calls, and opening a reader drops an older reader's subscription of that shard, as Kinesis
//! itself lets a new subscription replace the old one. The shard ends at an event that names `ChildShards`
//! (or that has no continuation); the core then starts the children, as with polling.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::operation::subscribe_to_shard::SubscribeToShardOutput;
use aws_sdk_kinesis::types::{ConsumerStatus, StartingPosition, SubscribeToShardEventStream};
use changefeed::model::{Batch, Continuation, PartitionId, Position};
use changefeed::source::{FeedSource, PartitionReader};
use changefeed::SourceError;

use crate::feed::{code, is_throttled, open_error, source_error, KinesisError, KinesisFeed, Start};
use crate::reader::{KinesisReader, Unpacker};

/// How long a reader waits for an event with records before it returns an empty batch, so the
/// worker stays responsive to its lease. Longer than kinesis-mock's one second between events:
/// an empty event may have waited in the connection since before the call, so only a wait
/// that spans a fresh event says there is nothing to read (Kinesis pushes records at once).
const EVENT_WAIT: Duration = Duration::from_secs(2);

/// How long without any event a subscription is taken for dead (a connection that hangs with
/// no reset): it is dropped and made again.
const SILENCE: Duration = Duration::from_secs(30);

/// How long the consumer may take to become `ACTIVE` (seconds of real Kinesis, less on
/// kinesis-mock), polled every 500 ms.
const ACTIVE_POLLS: u32 = 240;

/// Every how many empty events at the tip a reader asks whether its shard is closed (see
/// `FanOutReader::check_closed`), counting from the first.
const CLOSED_CHECK: u32 = 10;

/// The subscriptions of a [`KinesisFeed`]'s fan-out readers while they are not reading, by
/// shard, with the reader that owns each: the newest reader of a shard.
#[derive(Default)]
pub(crate) struct Subscriptions {
    next_id: AtomicU64,
    held: Mutex<HashMap<PartitionId, Held>>,
}

struct Held {
    owner: u64,
    subscription: Option<SubscribeToShardOutput>,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions").finish_non_exhaustive()
    }
}

impl Subscriptions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PartitionId, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes reader `id` the owner of `shard`'s subscription; an older reader's is dropped.
    fn claim(&self, shard: &PartitionId, id: u64) {
        let old = self.lock().insert(
            shard.clone(),
            Held {
                owner: id,
                subscription: None,
            },
        );
        drop(old);
    }

    /// The subscription reader `id` left, `Err` when another reader took the shard over (then
    /// `id` owns it again and subscribes anew).
    fn take(&self, shard: &PartitionId, id: u64) -> Result<Option<SubscribeToShardOutput>, ()> {
        let mut held = self.lock();
        match held.get_mut(shard) {
            Some(h) if h.owner == id => Ok(h.subscription.take()),
            _ => {
                let old = held.insert(
                    shard.clone(),
                    Held {
                        owner: id,
                        subscription: None,
                    },
                );
                drop(held);
                drop(old);
                Err(())
            }
        }
    }

    /// Keeps reader `id`'s subscription until its next call, unless another reader took over.
    fn put(&self, shard: &PartitionId, id: u64, subscription: Option<SubscribeToShardOutput>) {
        let mut held = self.lock();
        if let Some(h) = held.get_mut(shard) {
            if h.owner == id {
                h.subscription = subscription;
            }
        }
    }

    /// Reader `id` is gone: its subscription ends.
    fn release(&self, shard: &PartitionId, id: u64) {
        let mut held = self.lock();
        if held.get(shard).is_some_and(|h| h.owner == id) {
            let old = held.remove(shard);
            drop(held);
            drop(old);
        }
    }
}

/// Opens a fan-out reader of `partition` from `from`: subscribes at once, so `Now` means
/// "after what was there at open", as for polling.
pub(crate) async fn open(
    feed: &KinesisFeed,
    consumer_name: &str,
    partition: &PartitionId,
    from: &Position,
) -> Result<Box<dyn PartitionReader>, SourceError> {
    // kinesis-mock's SubscribeToShard takes an unknown shard or sequence number and then sends
    // nothing: GetShardIterator refuses them by name, so they are told at open, as for polling
    // (one call per open).
    feed.iterator(partition, from).await?;
    let consumer_arn = consumer(feed, consumer_name).await?;
    let id = feed.subscriptions.next_id.fetch_add(1, Ordering::Relaxed);
    feed.subscriptions.claim(partition, id);
    let mut reader = FanOutReader {
        id,
        unpacker: Unpacker::new(partition.clone(), from),
        feed: feed.clone(),
        consumer_arn,
        partition: partition.clone(),
        start: from.clone(),
        resume: None,
        subscription: None,
        silent: 0,
        failures: 0,
        live: false,
        last_record: None,
        quiet: 0,
        drain: None,
        ended: false,
        millis_behind_latest: None,
    };
    reader.subscribe().await?;
    Ok(Box::new(reader))
}

/// The ARN of the stream consumer `name`, registered if absent, once it is `ACTIVE`.
async fn consumer(feed: &KinesisFeed, name: &str) -> Result<String, SourceError> {
    feed.consumer_arn
        .get_or_try_init(|| register(feed, name))
        .await
        .cloned()
}

async fn register(feed: &KinesisFeed, name: &str) -> Result<String, SourceError> {
    let summary = feed
        .call_with_backoff(
            || {
                feed.client
                    .describe_stream_summary()
                    .stream_name(feed.stream())
                    .send()
            },
            "register_consumer",
            None,
        )
        .await?;
    let stream_arn = summary
        .stream_description_summary()
        .map(|d| d.stream_arn().to_string())
        .ok_or_else(|| {
            SourceError::source(
                "register_consumer",
                None,
                true,
                KinesisError::other("DescribeStreamSummary gave no stream description"),
            )
        })?;
    let registered = feed
        .client
        .register_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name(name)
        .send()
        .await;
    if let Err(e) = registered {
        // ResourceInUseException: the consumer exists (another host, an earlier run): reuse it.
        if code(&e) != Some("ResourceInUseException") {
            return Err(source_error("register_consumer", None, e));
        }
    }
    for _ in 0..ACTIVE_POLLS {
        let out = feed
            .call_with_backoff(
                || {
                    feed.client
                        .describe_stream_consumer()
                        .stream_arn(&stream_arn)
                        .consumer_name(name)
                        .send()
                },
                "register_consumer",
                None,
            )
            .await?;
        if let Some(d) = out.consumer_description() {
            if d.consumer_status() == &ConsumerStatus::Active {
                tracing::info!(
                    consumer = name,
                    consumer_arn = d.consumer_arn(),
                    stream = feed.stream(),
                    "enhanced fan-out consumer active"
                );
                return Ok(d.consumer_arn().to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(SourceError::source(
        "register_consumer",
        None,
        true,
        KinesisError::other(format!(
            "the stream consumer {name} of stream {} did not become ACTIVE",
            feed.stream()
        )),
    ))
}

/// Reads one shard by enhanced fan-out.
pub struct FanOutReader {
    /// This reader among the feed's [`Subscriptions`].
    id: u64,
    feed: KinesisFeed,
    consumer_arn: String,
    partition: PartitionId,
    start: Position,
    /// Where a new subscription starts after: the last record received, else the last event's
    /// continuation sequence number.
    resume: Option<Continuation>,
    subscription: Option<SubscribeToShardOutput>,
    /// Calls in a row that waited [`EVENT_WAIT`] without any event.
    silent: u32,
    /// Subscriptions in a row that ended with an error before any event.
    failures: u32,
    /// Whether the current subscription has sent an event.
    live: bool,
    /// The last record received.
    last_record: Option<Continuation>,
    /// Empty events in a row at the tip of the shard.
    quiet: u32,
    /// The polling reader of the rest of a closed shard.
    drain: Option<KinesisReader>,
    ended: bool,
    millis_behind_latest: Option<i64>,
    unpacker: Unpacker,
}

impl std::fmt::Debug for FanOutReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FanOutReader")
            .field("consumer_arn", &self.consumer_arn)
            .field("partition", &self.partition)
            .field("resume", &self.resume)
            .field("subscribed", &self.subscription.is_some())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl FanOutReader {
    /// Subscribes from where the reader is, retrying a subscription refused because another
    /// one on this shard and consumer still runs, and throttling.
    /// Where the next subscription starts.
    fn from(&self) -> Position {
        match &self.resume {
            Some(c) => Position::Continuation(c.clone()),
            None => self.start.clone(),
        }
    }

    async fn subscribe(&mut self) -> Result<(), SourceError> {
        let from = self.from();
        let start = Start::of(&self.partition, &from)?;
        let position = StartingPosition::builder()
            .r#type(start.kind)
            .set_sequence_number(start.sequence_number)
            .set_timestamp(start.timestamp)
            .build()
            .map_err(|e| {
                SourceError::source(
                    "subscribe",
                    Some(self.partition.to_string()),
                    false,
                    KinesisError::other(format!("starting position: {e}")),
                )
            })?;
        let mut attempt = 0;
        loop {
            let result = self
                .feed
                .client
                .subscribe_to_shard()
                .consumer_arn(&self.consumer_arn)
                .shard_id(self.partition.as_str())
                .starting_position(position.clone())
                .send()
                .await;
            match result {
                Ok(out) => {
                    self.live = false;
                    self.subscription = Some(out);
                    return Ok(());
                }
                Err(e)
                    if (code(&e) == Some("ResourceInUseException") || is_throttled(&e))
                        && attempt < self.feed.options.max_retries =>
                {
                    tracing::debug!(shard = %self.partition, error = %changefeed_aws::summary(&e), "subscription refused; retrying");
                    attempt += 1;
                    self.feed.backoff(attempt).await;
                }
                Err(e) if code(&e) == Some("ResourceInUseException") => {
                    // Still held by another subscription: the worker tries again.
                    return Err(retryable("subscribe", &self.partition, e));
                }
                Err(e) => return Err(open_error(&self.partition, &from, e)),
            }
        }
    }

    /// How far behind the tip of the shard the last event was, in milliseconds.
    pub fn millis_behind_latest(&self) -> Option<i64> {
        self.millis_behind_latest
    }

    /// Takes in one event: its records, where to resume, and whether the shard ended.
    async fn receive(
        &mut self,
        event: aws_sdk_kinesis::types::SubscribeToShardEvent,
    ) -> Result<(), SourceError> {
        self.unpacker.prepare(&self.feed, event.records()).await?;
        for r in event.records() {
            self.unpacker.queue(r);
        }
        self.millis_behind_latest = Some(event.millis_behind_latest());
        metrics::gauge!("changefeed_kinesis_millis_behind_latest")
            .set(event.millis_behind_latest() as f64);
        let continuation = event.continuation_sequence_number();
        if let Some(r) = event.records().last() {
            self.last_record = Some(Continuation::new(r.sequence_number()));
            self.resume = self.last_record.clone();
            self.quiet = 0;
        } else if !continuation.is_empty() {
            self.resume = Some(Continuation::new(continuation));
        }
        if !event.child_shards().is_empty() || continuation.is_empty() {
            self.ended = true;
            self.subscription = None;
            return Ok(());
        }
        if event.records().is_empty() && event.millis_behind_latest() == 0 {
            self.quiet += 1;
            if self.quiet % CLOSED_CHECK == 1 {
                self.check_closed().await?;
            }
        }
        Ok(())
    }

    /// Whether the shard is closed by `ListShards`; if it is, the rest of it is read by
    /// polling, which ends at the end of the shard. A subscription names the children at the
    /// end of a shard, but kinesis-mock keeps sending empty events on a closed shard (and
    /// none of its records): the shard's end must not hang on that.
    async fn check_closed(&mut self) -> Result<(), SourceError> {
        let closed = self
            .feed
            .partitions()
            .await?
            .into_iter()
            .any(|p| p.id == self.partition && p.closed);
        if closed {
            let from = match &self.last_record {
                Some(c) => Position::Continuation(c.clone()),
                None => self.start.clone(),
            };
            tracing::debug!(shard = %self.partition, "the shard is closed: reading the rest of it by polling");
            let iterator = self.feed.iterator(&self.partition, &from).await?;
            self.subscription = None;
            self.drain = Some(KinesisReader::new(
                self.feed.clone(),
                self.partition.clone(),
                from,
                iterator,
            ));
        }
        Ok(())
    }
}

/// An error of a subscription, retryable whatever its kind: the reader subscribes again
/// from where it is.
fn retryable<E, R>(
    operation: &'static str,
    partition: &PartitionId,
    e: aws_sdk_kinesis::error::SdkError<E, R>,
) -> SourceError
where
    E: aws_sdk_kinesis::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    SourceError::source(
        operation,
        Some(partition.to_string()),
        true,
        KinesisError::new(e),
    )
}

impl Drop for FanOutReader {
    fn drop(&mut self) {
        self.feed.subscriptions.release(&self.partition, self.id);
    }
}

#[async_trait]
impl PartitionReader for FanOutReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        match self.feed.subscriptions.take(&self.partition, self.id) {
            Ok(Some(subscription)) => self.subscription = Some(subscription),
            Ok(None) => {}
            Err(()) => self.subscription = None,
        }
        let batch = self.read(max).await;
        self.feed
            .subscriptions
            .put(&self.partition, self.id, self.subscription.take());
        batch
    }
}

impl FanOutReader {
    async fn read(&mut self, max: usize) -> Result<Batch, SourceError> {
        let deadline = tokio::time::sleep(EVENT_WAIT);
        tokio::pin!(deadline);
        loop {
            if let (Some(drain), true) = (self.drain.as_mut(), self.unpacker.is_empty()) {
                return drain.next_batch(max).await;
            }
            if self.ended || !self.unpacker.is_empty() {
                return Ok(self.unpacker.take(max, self.ended));
            }
            let Some(subscription) = self.subscription.as_mut() else {
                self.subscribe().await?;
                continue;
            };
            // Until a subscription's first event the reader does not know whether there is
            // more to read: it waits for it (bounded by SILENCE, and by the back-off of a
            // subscription refused while the last one ends) rather than answer empty.
            let next = if self.live {
                tokio::select! {
                    _ = &mut deadline => None,
                    r = subscription.event_stream.recv() => Some(r),
                }
            } else {
                tokio::time::timeout(SILENCE, subscription.event_stream.recv())
                    .await
                    .ok()
            };
            let Some(next) = next else {
                // Before the first event the wait was SILENCE itself.
                self.silent = if self.live { self.silent + 1 } else { u32::MAX };
                if self.silent.saturating_mul(EVENT_WAIT.as_millis() as u32)
                    >= SILENCE.as_millis() as u32
                {
                    tracing::warn!(shard = %self.partition, "no event on the subscription for {SILENCE:?}: subscribing again");
                    self.subscription = None;
                    self.silent = 0;
                }
                return Ok(self.unpacker.take(max, false));
            };
            self.silent = 0;
            let event = match next {
                Ok(Some(SubscribeToShardEventStream::SubscribeToShardEvent(event))) => event,
                Ok(Some(_)) => continue,
                Ok(None) => {
                    // Kinesis ended the subscription (every 5 minutes): subscribe again.
                    self.subscription = None;
                    continue;
                }
                Err(e) => {
                    self.subscription = None;
                    let again = match e.as_service_error() {
                        // A subscription still open (this reader's last, or the last owner's
                        // after the lease moved) or trouble on the service's side: subscribe
                        // again from the last record received, after a back-off.
                        Some(s) => {
                            s.is_resource_in_use_exception()
                                || s.is_internal_failure_exception()
                                || s.is_kms_throttling_exception()
                        }
                        // The connection broke.
                        None => true,
                    };
                    if !again {
                        return Err(open_error(&self.partition, &self.from(), e));
                    }
                    if self.failures >= self.feed.options.max_retries {
                        self.failures = 0;
                        return Err(retryable("read", &self.partition, e));
                    }
                    tracing::debug!(shard = %self.partition, error = %changefeed_aws::summary(&e), "subscription ended with an error; subscribing again");
                    self.failures += 1;
                    self.feed.backoff(self.failures).await;
                    continue;
                }
            };
            self.failures = 0;
            self.live = true;
            self.receive(event).await?;
        }
    }
}
