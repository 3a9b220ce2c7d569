//! [`DynamoStreamsReader`]: one stream shard read forward by `GetRecords`.

use async_trait::async_trait;
use changefeed::model::{Batch, Continuation, PartitionId, Position, Timestamp};
use changefeed::source::PartitionReader;
use changefeed::SourceError;

use super::DynamoStreamsFeed;
use super::{code, lost_to_retention, message, not_before, record, source_error};

/// Reads one shard forward by `GetRecords`, following `NextShardIterator`.
#[derive(Debug)]
pub struct DynamoStreamsReader {
    feed: DynamoStreamsFeed,
    partition: PartitionId,
    start: Position,
    /// Records created before this are left out (`AtTime`).
    not_before: Option<Timestamp>,
    /// The sequence number of the last record read: where a renewed iterator starts after.
    last: Option<Continuation>,
    iterator: Option<String>,
    ended: bool,
}

impl DynamoStreamsReader {
    pub(crate) fn new(
        feed: DynamoStreamsFeed,
        partition: PartitionId,
        start: Position,
        iterator: Option<String>,
    ) -> Self {
        Self {
            feed,
            partition,
            not_before: not_before(&start),
            start,
            last: None,
            ended: iterator.is_none(),
            iterator,
        }
    }

    /// A fresh iterator after the last record read (or at the start): an iterator expires
    /// 15 minutes after it was issued.
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
impl PartitionReader for DynamoStreamsReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        let mut renewed = false;
        loop {
            if self.ended {
                return Ok(Batch {
                    records: Vec::new(),
                    continuation: None,
                    end_of_partition: true,
                });
            }
            let Some(iterator) = self.iterator.clone() else {
                self.renew().await?;
                continue;
            };
            let result = self
                .feed
                .client
                .get_records()
                .shard_iterator(iterator)
                .limit(max.clamp(1, 1000) as i32)
                .send()
                .await;
            let out = match result {
                Ok(out) => out,
                Err(e) if code(&e) == Some("ExpiredIteratorException") && !renewed => {
                    // Renewed once from the last record read: nothing skipped or repeated.
                    renewed = true;
                    self.iterator = None;
                    continue;
                }
                Err(e) if code(&e) == Some("TrimmedDataAccessException") => {
                    let after = self
                        .last
                        .as_ref()
                        .map(|c| c.as_str().to_string())
                        .unwrap_or_else(|| format!("{:?}", self.start));
                    return Err(lost_to_retention(&self.partition, &after, &message(&e)));
                }
                Err(e) => return Err(source_error("read", Some(&self.partition), e)),
            };
            // Converted before anything is kept: on an error the same iterator reads it again.
            let mut records = Vec::with_capacity(out.records().len());
            for r in out.records() {
                records.push(record::to_record(
                    &self.partition,
                    r,
                    self.feed.options.record,
                )?);
            }
            if let Some(last) = records.last() {
                self.last = Some(last.continuation.clone());
            }
            self.iterator = out.next_shard_iterator().map(str::to_string);
            self.ended = self.iterator.is_none();
            if let Some(t) = self.not_before {
                let read = records.len();
                records.retain(|r| r.timestamp.is_none_or(|at| at >= t));
                if !records.is_empty() {
                    // From the first record at or after `t` on, everything is delivered.
                    self.not_before = None;
                } else if read > 0 && !self.ended {
                    // Only records before `t` so far: read on rather than answer empty.
                    continue;
                }
            }
            let continuation = records.last().map(|r| r.continuation.clone());
            return Ok(Batch {
                records,
                continuation,
                end_of_partition: self.ended,
            });
        }
    }
}
