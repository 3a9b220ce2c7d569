//! Several named streams as one feed: KCL's multi-stream mode, for any [`FeedSource`].
//!
//! A [`MultiFeed`] lets one fleet and one lease table consume several streams. Each stream's
//! partition `p` is listed as `"{stream}:{p}"` (parents likewise), so lease keys carry the
//! stream; `open` and `remaining` go to the stream the id names, with the stream's own id.
//! Continuations are per partition and opaque, so they pass through unchanged.
//!
//! Streams can be added and removed at runtime. The partition sync discovers a new stream's
//! partitions at its next run and creates their leases. A removed stream's partitions are no
//! longer listed, and [`FeedSource::retired`] answers `true` for them: the sync deletes their
//! leases (after `cleanup_delay`, by compare-and-swap), and a worker still reading one stops
//! at its next write (the lease is gone: lost).
//!
//! Key ranges are not listed: every stream covers the whole key space on its own, so one
//! stream's leases would otherwise let the sync skip listing and never see a new stream.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;

use super::{FeedSource, LeasedPartition, PartitionReader};
use crate::error::{ModelError, SourceError};
use crate::lineage::ChildStart;
use crate::model::{Continuation, Partition, PartitionId, Position};

/// What separates the stream name from the stream's own partition id.
pub const STREAM_SEPARATOR: char = ':';

/// Several named feed sources as one, with partitions `"{stream}:{partition}"`.
#[derive(Clone, Default)]
pub struct MultiFeed {
    streams: Arc<RwLock<BTreeMap<String, Arc<dyn FeedSource>>>>,
}

impl std::fmt::Debug for MultiFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiFeed")
            .field("streams", &self.stream_names())
            .finish()
    }
}

fn invalid_name(name: &str, rule: &str) -> ModelError {
    ModelError::Invalid {
        kind: "stream name",
        value: name.escape_debug().to_string(),
        rule: rule.to_string(),
    }
}

impl MultiFeed {
    /// An empty feed; add streams with [`MultiFeed::add_stream`].
    pub fn new() -> Self {
        Self::default()
    }

    fn snapshot(&self) -> Vec<(String, Arc<dyn FeedSource>)> {
        self.streams
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(n, s)| (n.clone(), Arc::clone(s)))
            .collect()
    }

    /// Adds (or replaces) the stream `name`. Its partitions are listed from now on.
    ///
    /// # Errors
    /// [`ModelError::Invalid`] if `name` is empty, contains `':'` or control characters, or
    /// starts or ends with whitespace.
    pub fn add_stream(&self, name: &str, source: Arc<dyn FeedSource>) -> Result<(), ModelError> {
        if name.is_empty() {
            return Err(invalid_name(name, "must not be empty"));
        }
        if name.contains(STREAM_SEPARATOR) {
            return Err(invalid_name(name, "must not contain ':'"));
        }
        if name.chars().any(char::is_control) || name.trim() != name {
            return Err(invalid_name(
                name,
                "must be printable, without leading or trailing whitespace",
            ));
        }
        self.streams
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), source);
        Ok(())
    }

    /// Removes the stream `name`; returns whether it was there. Its partitions are no longer
    /// listed and count as [retired](FeedSource::retired).
    pub fn remove_stream(&self, name: &str) -> bool {
        self.streams
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
            .is_some()
    }

    /// The streams, by name.
    pub fn stream_names(&self) -> Vec<String> {
        self.streams
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// The id of `stream`'s partition `partition` in this feed: `"{stream}:{partition}"`.
    ///
    /// # Errors
    /// [`ModelError::Invalid`] if the result is too long for a partition id.
    pub fn partition_id(stream: &str, partition: &PartitionId) -> Result<PartitionId, ModelError> {
        PartitionId::new(format!("{stream}{STREAM_SEPARATOR}{partition}"))
    }

    /// Splits `"{stream}:{partition}"` into the stream name and the stream's partition id.
    pub fn split_id(id: &PartitionId) -> Option<(&str, PartitionId)> {
        let (stream, inner) = id.as_str().split_once(STREAM_SEPARATOR)?;
        Some((stream, PartitionId::new(inner).ok()?))
    }

    /// The stream and inner id `partition` names, or `UnknownPartition`.
    fn route(
        &self,
        partition: &PartitionId,
    ) -> Result<(Arc<dyn FeedSource>, PartitionId), SourceError> {
        let unknown = || SourceError::UnknownPartition {
            partition: partition.to_string(),
        };
        let (stream, inner) = Self::split_id(partition).ok_or_else(unknown)?;
        let source = self
            .streams
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(stream)
            .cloned()
            .ok_or_else(unknown)?;
        Ok((source, inner))
    }
}

#[async_trait]
impl FeedSource for MultiFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.partitions_for(&[]).await
    }

    /// Each stream's [`FeedSource::partitions_for`] with the leased partitions of that stream
    /// (their ids without the stream's prefix; continuations pass as they are).
    async fn partitions_for(
        &self,
        leased: &[LeasedPartition],
    ) -> Result<Vec<Partition>, SourceError> {
        let mut out = Vec::new();
        for (name, source) in self.snapshot() {
            let own: Vec<LeasedPartition> = leased
                .iter()
                .filter_map(|l| {
                    let (stream, inner) = Self::split_id(&l.partition)?;
                    (stream == name).then(|| LeasedPartition {
                        partition: inner,
                        position: l.position.clone(),
                    })
                })
                .collect();
            for p in source.partitions_for(&own).await? {
                let corrupt = |e: ModelError| SourceError::Corrupt {
                    partition: format!("{name}{STREAM_SEPARATOR}{}", p.id),
                    reason: e.to_string(),
                };
                let id = Self::partition_id(&name, &p.id).map_err(corrupt)?;
                let parents = p
                    .parents
                    .iter()
                    .map(|parent| Self::partition_id(&name, parent))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(corrupt)?;
                out.push(Partition {
                    id,
                    parents,
                    closed: p.closed,
                    // See the module docs: ranges would let the sync skip listing.
                    key_range: None,
                });
            }
        }
        Ok(out)
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        let (source, inner) = self.route(partition)?;
        source.open(&inner, from).await
    }

    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        let (source, inner) = self.route(partition)?;
        source.remaining(&inner, after).await
    }

    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<crate::source::OldestUnread, SourceError> {
        let (source, inner) = self.route(partition)?;
        source.oldest_unread(&inner, after).await
    }

    /// The streams' own rule: [`ChildStart::ParentContinuation`] when any stream's source
    /// has it (a child and its parent are always of one stream, and continuations pass
    /// through unchanged). Streams of mixed kinds would need a rule per partition; feeds of
    /// one kind are what this type is for.
    fn child_start(&self) -> ChildStart {
        if self
            .snapshot()
            .iter()
            .any(|(_, s)| s.child_start() == ChildStart::ParentContinuation)
        {
            ChildStart::ParentContinuation
        } else {
            ChildStart::Beginning
        }
    }

    fn retired(&self, partition: &PartitionId) -> bool {
        match partition.as_str().split_once(STREAM_SEPARATOR) {
            Some((stream, _)) => !self
                .streams
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(stream),
            // Not a multi-stream id: not ours to retire.
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MemoryFeed;

    fn id(s: &str) -> PartitionId {
        PartitionId::new(s).expect("valid")
    }

    #[tokio::test]
    async fn partitions_carry_the_stream_and_route_back_to_it() {
        // Lease keys carry the stream; reads go to the stream's own partition.
        let multi = MultiFeed::new();
        let a = MemoryFeed::new(2);
        let b = MemoryFeed::new(1);
        multi.add_stream("a", Arc::new(a.clone())).expect("valid");
        multi.add_stream("b", Arc::new(b.clone())).expect("valid");
        let (pa, _) = a.append("k", "from-a");
        let (l, r) = b.split(&id("0")).expect("split");
        let listed = multi.partitions().await.expect("list");
        let ids: Vec<String> = listed.iter().map(|p| p.id.to_string()).collect();
        assert_eq!(ids.len(), 5, "{ids:?}");
        assert!(ids.contains(&format!("a:{pa}")));
        let child = listed
            .iter()
            .find(|p| p.id.as_str() == format!("b:{l}"))
            .expect("child listed");
        assert_eq!(child.parents, vec![id("b:0")]);
        assert!(listed.iter().all(|p| p.key_range.is_none()));
        assert!(listed.iter().any(|p| p.id.as_str() == format!("b:{r}")));
        let mut reader = multi
            .open(&id(&format!("a:{pa}")), &Position::Beginning)
            .await
            .expect("open");
        let batch = reader.next_batch(10).await.expect("read");
        assert_eq!(batch.records.len(), 1);
        let c = batch.continuation.expect("continuation");
        assert_eq!(
            multi
                .remaining(&id(&format!("a:{pa}")), Some(&c))
                .await
                .expect("remaining"),
            Some(0)
        );
        assert!(matches!(
            multi.open(&id("c:0"), &Position::Beginning).await,
            Err(SourceError::UnknownPartition { .. })
        ));
    }

    #[tokio::test]
    async fn leased_ids_reach_their_own_stream_without_its_prefix() {
        // FeedSource::partitions_for: each stream is asked with its own leased partitions
        // only, their positions as the leases hold them.
        let multi = MultiFeed::new();
        let mut streams = Vec::new();
        for name in ["a", "b"] {
            let naming = Arc::new(crate::source::Behaving {
                feed: MemoryFeed::new(1),
                continuing: false,
                naming: true,
                asked: Default::default(),
            });
            multi.add_stream(name, naming.clone()).expect("valid");
            streams.push(naming);
        }
        let at = Position::Continuation(Continuation::new("\"42\""));
        let leased = [
            LeasedPartition::at(id("a:-80"), at.clone()),
            LeasedPartition::unreadable(id("b:80-FF")),
            LeasedPartition::at(id("c:x"), Position::Beginning),
            LeasedPartition::at(id("plain"), Position::Beginning),
        ];
        let mut ids: Vec<String> = multi
            .partitions_for(&leased)
            .await
            .expect("list")
            .iter()
            .map(|p| p.id.to_string())
            .collect();
        ids.sort();
        assert_eq!(ids, ["a:-80", "a:0", "b:0", "b:80-FF"]);
        let asked = |i: usize| streams[i].asked.lock().expect("lock").clone();
        assert_eq!(asked(0), [LeasedPartition::at(id("-80"), at)]);
        assert_eq!(asked(1), [LeasedPartition::unreadable(id("80-FF"))]);
        assert_eq!(multi.partitions().await.expect("list").len(), 2);
    }

    #[test]
    fn names_are_checked_and_removed_streams_are_retired() {
        let multi = MultiFeed::new();
        assert!(multi
            .add_stream("a:b", Arc::new(MemoryFeed::new(1)))
            .is_err());
        assert!(multi.add_stream("", Arc::new(MemoryFeed::new(1))).is_err());
        multi
            .add_stream("a", Arc::new(MemoryFeed::new(1)))
            .expect("valid");
        assert!(!multi.retired(&id("a:0")));
        assert!(multi.retired(&id("gone:0")));
        assert!(!multi.retired(&id("plain")), "not a multi-stream id");
        assert!(multi.remove_stream("a"));
        assert!(multi.retired(&id("a:0")));
        assert!(!multi.remove_stream("a"));
    }
}
