//! Stream operations for tools and tests: create, write, split, merge.

use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::StreamStatus;
use changefeed::model::{Continuation, KeyRange, Partition, PartitionId};
use changefeed::source::FeedSource;
use changefeed::SourceError;
use std::time::Duration;

use crate::feed::{code, source_error, KinesisError, KinesisFeed};

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
