//! [`CosmosFeed`]: the feed source seam on one Cosmos DB container's change feed, over the
//! documented REST API (the same signed client as the lease store; see the crate README for
//! why REST and not `azure_data_cosmos`).
//!
//! - **Partitions** are the container's partition key ranges (`GET …/pkranges`), their key
//!   ranges the EPK ranges mapped onto the 128-bit key space. A split replaces a range by its
//!   children in that listing; the children's `parents` name it, and it is listed here as
//!   closed, so the core's lineage finishes it before the children are read. A merge lists
//!   one range naming both merged ones: a child of two parents ([`map::partitions`] reads
//!   which named ancestors are direct parents from the listing alone).
//! - **EPK ranges** are partitions too: a .NET v3 lease token `"{min}-{max}"` (the .NET
//!   processor's lease after a merge, or after a split under such a lease) names a part of a
//!   range. [`FeedSource::partitions_for`] lists the leased ones in place of the ranges they
//!   cover; a reader places one in the range holding it (a fresh listing) and reads that
//!   range with `x-ms-start-epk` / `x-ms-end-epk`; a 410/1002 there places it again (the
//!   .NET processor's redirect); spanning several ranges it ends, and its parts cut at the
//!   range boundaries are its children, from its continuation.
//! - **A merge of ranges read by id** ends each old range at its 410 as a split does; its
//!   child is the EPK range of its span, from its final continuation, read on the merged
//!   range (`map::merged_away`). The listing after a merge no longer says where the old
//!   ranges were, so the span goes with the lease: a reader of a range read by id records
//!   the range's span (from the listing it opened on) in every continuation,
//!   `"42";range=ID;span=MIN-MAX`, and restates its place with it once when the position it
//!   opened at lacks it (`map::Cursor`). A leased range gone in a merge whose continuation
//!   records no span is refused by name rather than read again from the beginning; one never
//!   read (no continuation) is read in the merge child, from the beginning.
//! - **Reading** is the incremental change feed of one range (`GET …/docs` with `A-IM:
//!   Incremental feed` and `x-ms-documentdb-partitionkeyrangeid`): `Beginning` sends no
//!   precondition, `Now` `If-None-Match: *` (once, when the reader opens, so `Now` is the
//!   moment of opening), `AtTime` `If-Modified-Since`, a continuation `If-None-Match` with
//!   its ETag. Each page's `etag` is where the next read starts; 304 is "caught up".
//! - **A split** answers the parent's read with 410, substatus 1002 (partition key range
//!   gone): the reader returns the end of the partition at its last continuation, and the
//!   children (listed by then) start there: [`FeedSource::child_start`] is
//!   [`ChildStart::ParentContinuation`], as the .NET processor starts child leases at the
//!   parent's continuation token (a child range also holds its keys' changes from before the
//!   split, so reading it from its beginning would deliver them again). 410 with substatus
//!   1007 or 1008 (a split or migration still completing) is retryable.
//! - **Lag**: [`FeedSource::remaining`] is the .NET estimator's figure (session LSN minus the
//!   LSN before the first unread document: LSNs, not documents), and
//!   [`FeedSource::oldest_unread`] the `_ts` of the first unread document.

mod map;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use changefeed::lease::BackendError;
use changefeed::lineage::ChildStart;
use changefeed::model::{Batch, Continuation, KeyRange, Partition, PartitionId, Position, Record};
use changefeed::source::{FeedSource, LeasedPartition, OldestUnread, PartitionReader};
use changefeed::SourceError;
use http::Method;
use serde_json::Value;

use crate::error::CosmosError;
use crate::rest::{lock, Answer, Resource, Rest};
use crate::store::CosmosOptions;
use map::{Cursor, EpkRange, PkRange, Placement, Span, Target};

/// Substatus of a 410 for a partition key range that split or merged away.
const RANGE_GONE: u32 = 1002;

/// The feed source on one Cosmos DB container: partitions are partition key ranges, the
/// continuation is a change feed ETag (`"42"`). See the module docs.
#[derive(Clone)]
pub struct CosmosFeed {
    rest: Rest,
    /// The container's partition key paths (`/tenant`), for each record's key.
    key_paths: Arc<Vec<String>>,
    /// The key range of every partition key range listed so far, for the closed ancestors of
    /// later listings.
    seen: Arc<Mutex<BTreeMap<String, KeyRange>>>,
}

impl std::fmt::Debug for CosmosFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosFeed")
            .field("rest", &self.rest)
            .field("key_paths", &self.key_paths)
            .finish_non_exhaustive()
    }
}

/// Where a read starts, before the first page has given an ETag.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ReadFrom {
    Beginning,
    Since(String),
    After(Cursor),
}

/// One answer of the change feed of a range.
#[derive(Debug)]
enum Answered {
    /// 200: documents (possibly none) and the ETag after them.
    Page {
        docs: Vec<Value>,
        etag: Option<String>,
        session_lsn: Option<u64>,
    },
    /// 304: nothing after the position; the ETag of the range's current end, if sent.
    CaughtUp {
        etag: Option<String>,
        session_lsn: Option<u64>,
    },
    /// 410/1002: the range split or merged away.
    Gone,
}

/// An answer of range `partition`'s change feed this source cannot use: final.
fn unexpected(operation: &'static str, partition: &PartitionId, reason: String) -> SourceError {
    let err = CosmosError::Unexpected {
        request: format!("GET change feed of range {partition}"),
        reason,
    };
    SourceError::source(operation, Some(partition.to_string()), false, err)
}

/// Where a reader "after `after`" starts: the continuation, or the beginning.
fn after_or_beginning(after: Option<&Continuation>) -> Position {
    after
        .map(|c| Position::Continuation(c.clone()))
        .unwrap_or(Position::Beginning)
}

/// The batch of a partition that will never have more.
fn end_of_partition() -> Batch {
    Batch {
        records: Vec::new(),
        continuation: None,
        end_of_partition: true,
    }
}

fn source_error(operation: &'static str, partition: &PartitionId, err: CosmosError) -> SourceError {
    let retryable = err.is_retryable()
        || matches!(err, CosmosError::Status { status: 410, substatus, .. } if substatus != Some(RANGE_GONE));
    SourceError::source(operation, Some(partition.to_string()), retryable, err)
}

impl CosmosFeed {
    /// A source on the container `options` name, whose partition key paths it reads (one
    /// request; the container must exist: it is the application's, never created here).
    ///
    /// # Errors
    /// [`CosmosError::Setting`] for a bad endpoint, key or name, or a container that is not
    /// there; [`CosmosError`] when Cosmos DB cannot be reached.
    pub async fn connect(options: &CosmosOptions) -> Result<Self, CosmosError> {
        let rest = options.rest()?;
        let answer = rest
            .send(Method::GET, Resource::Container, &[], None)
            .await?;
        if answer.status == 404 {
            return Err(CosmosError::Setting {
                setting: "container",
                reason: format!(
                    "container {:?} of database {:?} does not exist (the feed source reads an \
                     existing container's change feed)",
                    rest.container, rest.database
                ),
            });
        }
        if answer.status != 200 {
            return Err(answer.into_error());
        }
        let body = answer.json()?;
        let key_paths = body
            .pointer("/partitionKey/paths")
            .and_then(Value::as_array)
            .map(|paths| {
                paths
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            rest,
            key_paths: Arc::new(key_paths),
            seen: Arc::new(Mutex::new(BTreeMap::new())),
        })
    }

    /// The container's partition key paths.
    pub fn key_paths(&self) -> &[String] {
        &self.key_paths
    }

    /// Every partition key range the container lists now (all pages).
    async fn ranges(&self) -> Result<Vec<PkRange>, CosmosError> {
        let mut all = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let mut headers = Vec::new();
            if let Some(c) = continuation.take() {
                headers.push(("x-ms-continuation", c));
            }
            let answer = self
                .rest
                .send(Method::GET, Resource::PartitionKeyRanges, &headers, None)
                .await?;
            if answer.status != 200 {
                return Err(answer.into_error());
            }
            let body = answer.json()?;
            all.extend(
                map::parse_pkranges(&body).map_err(|reason| CosmosError::Unexpected {
                    request: answer.request.clone(),
                    reason,
                })?,
            );
            match answer.header("x-ms-continuation").filter(|c| !c.is_empty()) {
                Some(next) => continuation = Some(next.to_string()),
                None => return Ok(all),
            }
        }
    }

    /// The ranges listed now, and the key range of every range listed so far (this listing
    /// included), for the closed ancestors of this one.
    async fn listing(&self) -> Result<(Vec<PkRange>, BTreeMap<String, KeyRange>), SourceError> {
        let ranges = self.ranges().await.map_err(|e| {
            let retryable = e.is_retryable();
            SourceError::source("partitions", None, retryable, e)
        })?;
        let mut seen = lock(&self.seen);
        for r in &ranges {
            if let Some(range) = map::epk_range(&r.min, &r.max) {
                seen.insert(r.id.clone(), range);
            }
        }
        let seen = seen.clone();
        Ok((ranges, seen))
    }

    /// One change feed read at `target` from `from` (`None`: `If-None-Match: *`, from now),
    /// at most `max` documents.
    async fn read(
        &self,
        target: &Target,
        from: Option<&ReadFrom>,
        max: usize,
    ) -> Result<Answered, CosmosError> {
        let headers = read_headers(target, from, max);
        let answer = self
            .rest
            .send(Method::GET, Resource::Documents, &headers, None)
            .await?;
        classify(answer, &target.range_id)
    }

    /// Where `partition` is read now: a partition key range by its id; an EPK range (a .NET
    /// v3 lease token `"{min}-{max}"`) in the range holding it, found in a fresh listing, or
    /// `None` when it spans several (a split under it: it has ended).
    async fn target(&self, partition: &PartitionId) -> Result<Option<Target>, SourceError> {
        let Some(epk) = epk_of(partition)? else {
            return Ok(Some(Target {
                range_id: partition.to_string(),
                epk: None,
            }));
        };
        let ranges = self
            .ranges()
            .await
            .map_err(|e| source_error("open", partition, e))?;
        match map::place(&ranges, &epk).map_err(|reason| SourceError::Corrupt {
            partition: partition.to_string(),
            reason,
        })? {
            Placement::On(target) => Ok(Some(target)),
            Placement::Split(_) => Ok(None),
        }
    }

    /// A reader of `partition` at `from`, without checking the partition is listed.
    async fn reader(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<CosmosReader, SourceError> {
        let target = self.target(partition).await?;
        let mut reader = CosmosReader {
            feed: self.clone(),
            partition: partition.clone(),
            ended: target.is_none(),
            target,
            span: None,
            restate: false,
            from: ReadFrom::Beginning,
            first: true,
            buffer: VecDeque::new(),
        };
        match from {
            Position::Beginning => {}
            Position::AtTime(t) => reader.from = ReadFrom::Since(map::if_modified_since(*t)),
            Position::Continuation(c) => {
                let cursor = Cursor::parse(c.as_str()).map_err(|reason| {
                    SourceError::InvalidContinuation {
                        partition: partition.to_string(),
                        continuation: c.to_string(),
                        reason,
                    }
                })?;
                reader.from = ReadFrom::After(map::start_cursor(cursor, partition.as_str()));
            }
            Position::Now => {
                // Fix "now" at opening: the range's current ETag.
                let Some(target) = &reader.target else {
                    return Ok(reader);
                };
                match self
                    .read(target, None, 1)
                    .await
                    .map_err(|e| source_error("open", partition, e))?
                {
                    Answered::Gone => reader.ended = true,
                    Answered::CaughtUp { etag, .. } | Answered::Page { etag, .. } => {
                        let etag = etag.ok_or_else(|| {
                            unexpected(
                                "open",
                                partition,
                                "an answer to If-None-Match: * without an etag".into(),
                            )
                        })?;
                        reader.from = ReadFrom::After(Cursor::after(etag));
                    }
                }
            }
        }
        Ok(reader)
    }
}

#[cfg(feature = "testkit")]
impl CosmosFeed {
    /// The headers of the first change feed read of a reader of `partition` at `from`, as
    /// `open` would build it (listing the ranges to place an EPK range; a read only for
    /// `Now`); `None` when the partition has ended (an EPK range spanning several ranges).
    /// For the import tests: no server here has a real change feed, so what is checked there
    /// is that an imported .NET lease opens and what it would ask Cosmos DB.
    ///
    /// # Errors
    /// As [`FeedSource::open`].
    pub async fn first_read_headers(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Option<Vec<(&'static str, String)>>, SourceError> {
        let reader = self.reader(partition, from).await?;
        Ok(reader
            .target
            .as_ref()
            .map(|t| read_headers(t, Some(&reader.from), 1)))
    }
}

/// The EPK range `partition` names, `None` for a partition key range id.
fn epk_of(partition: &PartitionId) -> Result<Option<EpkRange>, SourceError> {
    EpkRange::parse(partition.as_str())
        .transpose()
        .map_err(|reason| SourceError::Corrupt {
            partition: partition.to_string(),
            reason,
        })
}

/// The headers of one incremental change feed read at `target` from `from` (`None`:
/// `If-None-Match: *`, from now), at most `max` documents. An EPK sub-range of a partition
/// key range is read on that range with `x-ms-read-key-type: EffectivePartitionKeyRange`
/// and its bounds in `x-ms-start-epk` / `x-ms-end-epk`, as the .NET SDK reads an EPK-range
/// lease; the continuation is the range's ETag either way.
fn read_headers(
    target: &Target,
    from: Option<&ReadFrom>,
    max: usize,
) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("a-im", "Incremental feed".to_string()),
        (
            "x-ms-documentdb-partitionkeyrangeid",
            target.range_id.clone(),
        ),
        ("x-ms-max-item-count", max.clamp(1, 10_000).to_string()),
    ];
    if let Some((min, max)) = &target.epk {
        headers.push(("x-ms-read-key-type", "EffectivePartitionKeyRange".into()));
        headers.push(("x-ms-start-epk", min.clone()));
        headers.push(("x-ms-end-epk", max.clone()));
    }
    match from {
        None => headers.push(("if-none-match", "*".into())),
        Some(ReadFrom::Beginning) => {}
        Some(ReadFrom::Since(date)) => headers.push(("if-modified-since", date.clone())),
        Some(ReadFrom::After(cursor)) => headers.push(("if-none-match", cursor.etag.clone())),
    }
    headers
}

/// What a change feed answer of partition key range `range_id` means: 200 a page, 304 caught
/// up, 410 with substatus 1002 the range gone; anything else an error.
fn classify(answer: Answer, range_id: &str) -> Result<Answered, CosmosError> {
    let etag = answer.header("etag").map(str::to_string);
    let session_lsn = answer
        .header("x-ms-session-token")
        .and_then(|t| map::session_lsn(t, range_id));
    match answer.status {
        200 => Ok(Answered::Page {
            docs: documents(&answer)?,
            etag,
            session_lsn,
        }),
        304 => Ok(Answered::CaughtUp { etag, session_lsn }),
        410 if substatus(&answer) == Some(RANGE_GONE) => Ok(Answered::Gone),
        _ => Err(answer.into_error()),
    }
}

fn substatus(answer: &Answer) -> Option<u32> {
    answer.header("x-ms-substatus").and_then(|s| s.parse().ok())
}

fn documents(answer: &Answer) -> Result<Vec<Value>, CosmosError> {
    match answer.json()?.get_mut("Documents").map(Value::take) {
        Some(Value::Array(docs)) => Ok(docs),
        _ => Err(CosmosError::Unexpected {
            request: answer.request.clone(),
            reason: "a change feed answer without a Documents array".into(),
        }),
    }
}

#[async_trait]
impl FeedSource for CosmosFeed {
    async fn partitions(&self) -> Result<Vec<Partition>, SourceError> {
        self.partitions_for(&[]).await
    }

    /// The partition key ranges, with the EPK ranges among `leased` (.NET v3 lease tokens
    /// `"{min}-{max}"`), and the spans of the leased ranges a merge took away, whose
    /// continuations record them (`map::merged_away`), in place of what they cover
    /// (`map::partitions_for`). A leased id that is neither is left to `open` to refuse.
    async fn partitions_for(
        &self,
        leased: &[LeasedPartition],
    ) -> Result<Vec<Partition>, SourceError> {
        let (ranges, seen) = self.listing().await?;
        let mut epks: Vec<EpkRange> = leased
            .iter()
            .filter_map(|l| EpkRange::parse(l.partition.as_str()).and_then(Result::ok))
            .collect();
        epks.extend(
            map::merged_away(&ranges, leased).map_err(|e| SourceError::Corrupt {
                partition: e.partition,
                reason: e.reason,
            })?,
        );
        map::partitions_for(&ranges, &seen, &epks).map_err(|reason| SourceError::Corrupt {
            partition: "(partition key ranges)".into(),
            reason,
        })
    }

    async fn open(
        &self,
        partition: &PartitionId,
        from: &Position,
    ) -> Result<Box<dyn PartitionReader>, SourceError> {
        // A range id the container never had answers like one that split away (410/1002):
        // only a listed range, or an ancestor of one, is a partition. An EPK range is one
        // wherever it lies in the key space ([`CosmosFeed::target`] places it).
        let mut span = None;
        if epk_of(partition)?.is_none() {
            let (ranges, seen) = self.listing().await?;
            let parts = map::partitions(&ranges, &seen).map_err(|reason| SourceError::Corrupt {
                partition: "(partition key ranges)".into(),
                reason,
            })?;
            if !parts.iter().any(|p| &p.id == partition) {
                return Err(SourceError::UnknownPartition {
                    partition: partition.to_string(),
                });
            }
            span = ranges
                .iter()
                .find(|r| r.id == partition.as_str())
                .map(|r| (r.min.clone(), r.max.clone()));
        }
        let mut reader = self.reader(partition, from).await?;
        reader.record_span(span);
        Ok(Box::new(reader))
    }

    /// The .NET estimator's remaining work: one read of at most one document after `after`;
    /// the LSN of the session token minus the LSN before that document, 0 when there is none
    /// (or the range is gone). LSNs, not documents: an estimate. `None` without a session
    /// token.
    async fn remaining(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<Option<u64>, SourceError> {
        let reader = self.reader(partition, &after_or_beginning(after)).await?;
        let Some(target) = &reader.target else {
            return Ok(Some(0));
        };
        let skip = match &reader.from {
            ReadFrom::After(c) => c.skip as usize,
            _ => 0,
        };
        let answer = self
            .read(target, Some(&reader.from), 1 + skip)
            .await
            .map_err(|e| source_error("remaining", partition, e))?;
        Ok(match answer {
            Answered::Gone => Some(0),
            Answered::CaughtUp { session_lsn, .. } => session_lsn.map(|s| map::estimate(s, None)),
            Answered::Page {
                docs, session_lsn, ..
            } => {
                session_lsn.map(|s| map::estimate(s, map::first_lsn(&docs[skip.min(docs.len())..])))
            }
        })
    }

    /// The `_ts` (seconds) of the first document after `after`: one read of one document.
    async fn oldest_unread(
        &self,
        partition: &PartitionId,
        after: Option<&Continuation>,
    ) -> Result<OldestUnread, SourceError> {
        let mut reader = self.reader(partition, &after_or_beginning(after)).await?;
        let batch = reader.next_batch(1).await?;
        Ok(match batch.records.first() {
            Some(Record {
                timestamp: Some(t), ..
            }) => OldestUnread::At(*t),
            Some(_) => OldestUnread::Unknown,
            None => OldestUnread::CaughtUp,
        })
    }

    fn child_start(&self) -> ChildStart {
        ChildStart::ParentContinuation
    }
}

/// Reads one partition key range's change feed forward, or one EPK range's.
#[derive(Debug)]
pub struct CosmosReader {
    feed: CosmosFeed,
    partition: PartitionId,
    /// Where reads go; `None` once an EPK range spans several partition key ranges, or after
    /// its range went (410/1002) until it is placed again.
    target: Option<Target>,
    /// The EPK span of the partition key range read by id, where known: written into every
    /// continuation ([`Cursor`]), so that a merge cannot take it away.
    span: Option<Span>,
    /// Whether the next read that returns no records restates the reader's place with the
    /// span (the position it was opened at does not record it).
    restate: bool,
    /// Where the next read starts.
    from: ReadFrom,
    /// Whether no page has been read yet (a refused continuation is then the caller's).
    first: bool,
    /// Records of the last page not yet returned (a page may hold more than asked for: the
    /// documents of one transaction come together).
    buffer: VecDeque<Record>,
    ended: bool,
}

impl CosmosReader {
    /// Records `span` (the listing's, when the range is listed) as the span of the range this
    /// reader reads by id; without it, the one its starting cursor records, if any. Where the
    /// starting position does not record it, the first read without records restates the
    /// place with it, so that the lease's checkpoint has it before a merge can happen.
    fn record_span(&mut self, span: Option<Span>) {
        let from = match &self.from {
            ReadFrom::After(c) => Some(c),
            _ => None,
        };
        let own = from.and_then(|c| c.span_of(self.partition.as_str()));
        self.span = span.or_else(|| own.cloned());
        self.restate = self.span.is_some() && from.is_some() && own != self.span.as_ref();
    }

    /// The batch of an answer without records: with the reader's place restated, once, where
    /// [`CosmosReader::record_span`] asked for it.
    fn without_records(&mut self, mut batch: Batch) -> Batch {
        if !self.restate {
            return batch;
        }
        if let (ReadFrom::After(c), Some(span)) = (&self.from, &self.span) {
            let place = c.clone().written_by(self.partition.as_str(), span);
            batch.continuation = Some(place.to_continuation());
            self.restate = false;
        }
        batch
    }

    fn take(&mut self, max: usize) -> Batch {
        let n = max.max(1).min(self.buffer.len());
        let records: Vec<Record> = self.buffer.drain(..n).collect();
        Batch {
            continuation: records.last().map(|r| r.continuation.clone()),
            records,
            end_of_partition: false,
        }
    }
}

#[async_trait]
impl PartitionReader for CosmosReader {
    async fn next_batch(&mut self, max: usize) -> Result<Batch, SourceError> {
        if !self.buffer.is_empty() {
            return Ok(self.take(max));
        }
        if self.target.is_none() && !self.ended {
            // An EPK range whose range went: placed again on a fresh listing.
            self.target = self.feed.target(&self.partition).await?;
            self.ended = self.target.is_none();
        }
        let (Some(target), false) = (&self.target, self.ended) else {
            return Ok(end_of_partition());
        };
        let skip = match &self.from {
            ReadFrom::After(c) => c.skip,
            _ => 0,
        };
        let answer = match self
            .feed
            .read(target, Some(&self.from), max.saturating_add(skip as usize))
            .await
        {
            Ok(answer) => answer,
            Err(CosmosError::Status {
                status: 400,
                message,
                ..
            }) if self.first => {
                if let ReadFrom::After(cursor) = &self.from {
                    return Err(SourceError::InvalidContinuation {
                        partition: self.partition.to_string(),
                        continuation: cursor.to_continuation().to_string(),
                        reason: format!("refused by Cosmos DB: {message}"),
                    });
                }
                return Err(unexpected("read", &self.partition, message));
            }
            Err(e) => return Err(source_error("read", &self.partition, e)),
        };
        self.first = false;
        self.apply(answer, max, skip)
    }
}

impl CosmosReader {
    /// Moves the reader on by one answer read from where it stood, skipping `skip` (no I/O).
    fn apply(&mut self, answer: Answered, max: usize, skip: u32) -> Result<Batch, SourceError> {
        match answer {
            Answered::Gone if EpkRange::parse(self.partition.as_str()).is_some() => {
                // An EPK range outlives the range it was read on: the next read places it
                // again (the same partition on the range now holding it, or its end when it
                // spans several), at the same continuation.
                self.target = None;
                Ok(Batch::default())
            }
            Answered::Gone => {
                self.ended = true;
                Ok(self.without_records(end_of_partition()))
            }
            Answered::CaughtUp { etag, .. } => {
                // The range's end may have moved past writes the feed does not show (deletes).
                if let (Some(etag), 0) = (etag, skip) {
                    if Cursor::parse(&etag).is_ok() {
                        self.from = ReadFrom::After(Cursor::after(etag));
                    }
                }
                Ok(self.without_records(Batch::default()))
            }
            Answered::Page { docs, etag, .. } => {
                let Some(etag) = etag else {
                    return Err(unexpected(
                        "read",
                        &self.partition,
                        "a change feed page without an etag".into(),
                    ));
                };
                let cursor = match &self.from {
                    ReadFrom::After(c) => c.clone(),
                    _ => Cursor::after(String::new()),
                };
                let records = map::page_records(
                    docs,
                    self.partition.as_str(),
                    self.span.as_ref(),
                    &etag,
                    &cursor,
                    &self.feed.key_paths,
                )
                .map_err(|reason| SourceError::Corrupt {
                    partition: self.partition.to_string(),
                    reason,
                })?;
                self.from = ReadFrom::After(Cursor::after(etag));
                self.buffer.extend(records);
                let batch = self.take(max);
                if batch.records.is_empty() {
                    return Ok(self.without_records(batch));
                }
                // Its records' continuations record the span.
                self.restate = false;
                Ok(batch)
            }
        }
    }
}
