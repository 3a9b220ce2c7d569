//! Reading a shard by polling `GetRecords`, and the unpacking of Kinesis records into the
//! core's records that every reader of this crate shares (KPL de-aggregation, the sub-sequence
//! skip after a continuation inside an aggregated record, the shard's hash key range check).

use std::collections::VecDeque;

use async_trait::async_trait;
use changefeed::model::{Batch, Continuation, KeyRange, PartitionId, Position, Record, Timestamp};
use changefeed::source::PartitionReader;
use changefeed::SourceError;

use crate::feed::{code, is_throttled, source_error, KinesisFeed};
use crate::kpl::{self, ExtendedSequenceNumber};

/// The user records of the Kinesis records a reader received and has not yet returned.
#[derive(Debug)]
pub(crate) struct Unpacker {
    partition: PartitionId,
    /// User records read and not yet returned (the rest of an aggregated record beyond `max`).
    pending: VecDeque<Record>,
    /// Opened after part of an aggregated record: its sequence number and the last
    /// sub-sequence number done, skipped when that record is read.
    skip: Option<(String, u64)>,
    /// The shard's hash key range, once looked up (at the first record that may be an
    /// aggregated one, unless `deliver_outside_shard`); `Some(None)` when it is unknown.
    range: Option<Option<KeyRange>>,
}

impl Unpacker {
    pub(crate) fn new(partition: PartitionId, start: &Position) -> Self {
        let skip = match start {
            Position::Continuation(c) => ExtendedSequenceNumber::parse(c.as_str())
                .and_then(|e| Some((e.sequence_number.to_string(), e.sub_sequence_number?))),
            _ => None,
        };
        Self {
            partition,
            pending: VecDeque::new(),
            skip,
            range: None,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Looks up the shard's hash key range once `records` hold one that may be a KPL
    /// aggregate. Called before anything of `records` is kept: on an error the caller reads
    /// them again.
    pub(crate) async fn prepare(
        &mut self,
        feed: &KinesisFeed,
        records: &[aws_sdk_kinesis::types::Record],
    ) -> Result<(), SourceError> {
        if self.range.is_some()
            || feed.options.deliver_outside_shard
            || !records
                .iter()
                .any(|r| kpl::maybe_aggregated(r.data().as_ref()))
        {
            return Ok(());
        }
        let range = feed.range_of(&self.partition).await?;
        if range.is_none() {
            tracing::warn!(
                shard = %self.partition,
                "the shard's hash key range is unknown (not listed by ListShards): \
                 KPL user records outside it are delivered"
            );
        }
        self.range = Some(range);
        Ok(())
    }

    /// Queues the user records of one Kinesis record (itself, unless the KPL aggregated it),
    /// leaving out those a sub-sequence continuation says are done.
    pub(crate) fn queue(&mut self, r: &aws_sdk_kinesis::types::Record) {
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

    /// Up to `max` queued user records as a batch; the end of the shard once the reader
    /// `ended` and nothing is queued.
    pub(crate) fn take(&mut self, max: usize, ended: bool) -> Batch {
        let n = self.pending.len().min(max.max(1));
        let records: Vec<Record> = self.pending.drain(..n).collect();
        Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            records,
            end_of_partition: ended && self.pending.is_empty(),
        }
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
    unpacker: Unpacker,
}

impl KinesisReader {
    pub(crate) fn new(
        feed: KinesisFeed,
        partition: PartitionId,
        start: Position,
        iterator: Option<String>,
    ) -> Self {
        KinesisReader {
            unpacker: Unpacker::new(partition.clone(), &start),
            feed,
            partition,
            start,
            last: None,
            ended: iterator.is_none(),
            iterator,
            millis_behind_latest: None,
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
            if self.ended || !self.unpacker.is_empty() {
                return Ok(self.unpacker.take(max, self.ended));
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
            self.unpacker.prepare(&self.feed, out.records()).await?;
            self.millis_behind_latest = out.millis_behind_latest();
            if let Some(ms) = out.millis_behind_latest() {
                metrics::gauge!("changefeed_kinesis_millis_behind_latest").set(ms as f64);
            }
            for r in out.records() {
                self.unpacker.queue(r);
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
            if self.unpacker.is_empty() && !end && behind && empty < self.feed.options.empty_polls {
                empty += 1;
                continue;
            }
            return Ok(self.unpacker.take(max, self.ended));
        }
    }
}
