//! The vocabulary every layer shares: partitions, positions, continuations, leases and hosts.
//!
//! These are plain data types with validation at construction. They do no I/O; the lease store
//! ([`crate::lease`]) and the feed source ([`crate::source`]) move them around.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, SourceError};

mod membership;
mod report;
pub use membership::{GroupHead, Heartbeat, HostLimits, Membership, MembershipView, ViewHost};
pub use report::{HostReport, LeaseLoad, ReportError, REPORT_VERSION};

/// Longest accepted group name, in bytes.
pub const MAX_GROUP_LEN: usize = 128;
/// Longest accepted partition id, in bytes.
pub const MAX_PARTITION_ID_LEN: usize = 256;
/// Longest accepted host name, in bytes.
pub const MAX_HOST_NAME_LEN: usize = 128;
/// The separator between a lease key's group and its partition id. Group names never contain it.
pub const KEY_SEPARATOR: char = '/';

fn check_text(kind: &'static str, value: &str, max: usize) -> Result<(), ModelError> {
    let rule = if value.is_empty() {
        Some("must not be empty".to_string())
    } else if value.len() > max {
        Some(format!("must be at most {max} bytes, got {}", value.len()))
    } else if value.chars().any(|c| c.is_control()) {
        Some("must be printable (no control characters)".to_string())
    } else if value.trim() != value {
        Some("must not start or end with whitespace".to_string())
    } else {
        None
    };
    match rule {
        Some(rule) => Err(ModelError::Invalid {
            kind,
            value: value.escape_debug().to_string(),
            rule,
        }),
        None => Ok(()),
    }
}

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:expr $(, extra = $extra:expr)?) => {
        $(#[$doc])*
        #[derive(Clone, Eq, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Arc<str>);

        impl std::hash::Hash for $name {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                self.0.hash(state);
            }
        }

        // Clones share their text, so most comparisons of equal names are of one allocation:
        // those skip comparing bytes. Names of one fleet mostly differ in their last
        // character ("host-07", "host-08"): that is compared before the rest.
        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
                Arc::ptr_eq(&self.0, &other.0)
                    || (a.len() == b.len() && a.last() == b.last() && a == b)
            }
        }

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $name {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                if Arc::ptr_eq(&self.0, &other.0) {
                    std::cmp::Ordering::Equal
                } else {
                    self.0.cmp(&other.0)
                }
            }
        }

        impl $name {
            /// Whether `self` and `other` share one allocation (then they are equal; equal
            /// names need not share one).
            #[allow(dead_code)]
            pub(crate) fn same_allocation(&self, other: &Self) -> bool {
                Arc::ptr_eq(&self.0, &other.0)
            }

            /// Validates and wraps `value`.
            ///
            /// # Errors
            /// [`ModelError::Invalid`] naming the rule `value` breaks.
            pub fn new(value: impl Into<String>) -> Result<Self, ModelError> {
                let value = value.into();
                check_text($kind, &value, $max)?;
                $( ($extra)(&value)?; )?
                Ok(Self(Arc::from(value)))
            }

            /// The text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = ModelError;
            fn from_str(s: &str) -> Result<Self, ModelError> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ModelError;
            fn try_from(s: String) -> Result<Self, ModelError> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0.to_string()
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

text_id!(
    /// The id of one partition of a feed (a Kinesis shard id, a partition number …).
    ///
    /// Non-empty, at most [`MAX_PARTITION_ID_LEN`] bytes, printable, no surrounding whitespace.
    PartitionId,
    "partition id",
    MAX_PARTITION_ID_LEN
);

text_id!(
    /// The name of a group: the hosts sharing one feed. Every lease and heartbeat of a group
    /// carries it, so several groups can share one store.
    ///
    /// Non-empty, at most [`MAX_GROUP_LEN`] bytes, printable, and without [`KEY_SEPARATOR`], so
    /// `group/partition` splits one way only.
    GroupName,
    "group name",
    MAX_GROUP_LEN,
    extra = |v: &str| {
        if v.contains(KEY_SEPARATOR) {
            Err(ModelError::Invalid {
                kind: "group name",
                value: v.escape_debug().to_string(),
                rule: format!("must not contain '{KEY_SEPARATOR}'"),
            })
        } else {
            Ok(())
        }
    }
);

text_id!(
    /// The unique name of one host (processor instance) in a group.
    HostName,
    "host name",
    MAX_HOST_NAME_LEN
);

/// The key of a lease: its group and its partition. Shown as `group/partition`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LeaseKey {
    /// The group the lease belongs to.
    pub group: GroupName,
    /// The partition the lease binds.
    pub partition: PartitionId,
}

impl LeaseKey {
    /// The key of `partition` in `group`.
    pub fn new(group: GroupName, partition: PartitionId) -> Self {
        Self { group, partition }
    }

    /// Parses `group/partition`. The group is everything before the first separator.
    ///
    /// # Errors
    /// [`ModelError::Invalid`] when a part is missing or breaks its rule.
    pub fn parse(text: &str) -> Result<Self, ModelError> {
        let (group, partition) =
            text.split_once(KEY_SEPARATOR)
                .ok_or_else(|| ModelError::Invalid {
                    kind: "lease key",
                    value: text.escape_debug().to_string(),
                    rule: format!("must be GROUP{KEY_SEPARATOR}PARTITION"),
                })?;
        Ok(Self::new(
            GroupName::new(group)?,
            PartitionId::new(partition)?,
        ))
    }
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{KEY_SEPARATOR}{}", self.group, self.partition)
    }
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseKey({self})")
    }
}

/// A row version: a counter the store bumps on every write of the row (KCL's `leaseCounter`,
/// an ETag in Cosmos DB). Compare-and-swap writes name the version they expect.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Debug, Default,
)]
#[serde(transparent)]
pub struct Version(pub u64);

impl Version {
    /// The version a row gets when it is first written.
    pub const FIRST: Version = Version(1);

    /// The version after this one.
    pub fn next(self) -> Version {
        Version(self.0 + 1)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Wall-clock time in milliseconds since the Unix epoch, as a host's own clock reads it.
///
/// Only used for positions (`AtTime`) and for display. Nothing in the lease protocol compares
/// wall times of different hosts (design rule 2).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Debug, Default,
)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// Milliseconds since the Unix epoch.
    pub fn millis(self) -> i64 {
        self.0
    }
}

/// A token from the source meaning "everything up to here is done". Opaque to the core: only
/// the source that issued it can order or interpret it.
///
/// Cheap to clone: the token is shared, not copied.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub struct Continuation(Arc<str>);

impl Continuation {
    /// Wraps a source's token.
    pub fn new(token: impl Into<String>) -> Self {
        Self(Arc::from(token.into()))
    }

    /// The token.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for Continuation {
    fn from(token: String) -> Self {
        Self::new(token)
    }
}

impl From<Continuation> for String {
    fn from(c: Continuation) -> String {
        c.0.to_string()
    }
}

impl fmt::Display for Continuation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Continuation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Continuation({:?})", self.0)
    }
}

/// The `PARTITION:N` continuation of the in-memory and SQLite feeds: the partition id, a colon,
/// and the number of the last record done (an offset, a sequence number), so `3:42` means
/// "partition 3 up to record 42". One format and one parser for every feed that issues it; what
/// differs is only how messages name the number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NumberedContinuation {
    /// The number in the expected form, upper case: `OFFSET` in `expected PARTITION:OFFSET`.
    pub placeholder: &'static str,
    /// The number as messages name it: `offset`, `sequence number`.
    pub noun: &'static str,
}

impl NumberedContinuation {
    /// The token for "record `n` of `partition` and everything before it is done".
    pub fn format(partition: &PartitionId, n: u64) -> Continuation {
        Continuation::new(format!("{partition}:{n}"))
    }

    /// The number of any `PARTITION:N` token, without checking whose it is or how far it
    /// reaches; `None` if it has no number. For checks that follow a checkpoint's progress.
    pub fn number(c: &Continuation) -> Option<u64> {
        c.as_str().rsplit_once(':')?.1.parse().ok()
    }

    /// Reads the number back from `c`, a token of `partition` whose last record is `last`.
    ///
    /// # Errors
    /// [`SourceError::InvalidContinuation`] naming the partition and the token when it is not
    /// `PARTITION:N`, belongs to another partition, has no number, or is past `last`.
    pub fn parse(
        &self,
        partition: &PartitionId,
        c: &Continuation,
        last: u64,
    ) -> Result<u64, SourceError> {
        let bad = |reason: String| SourceError::InvalidContinuation {
            partition: partition.to_string(),
            continuation: c.to_string(),
            reason,
        };
        let (p, n) = c
            .as_str()
            .rsplit_once(':')
            .ok_or_else(|| bad(format!("expected PARTITION:{}", self.placeholder)))?;
        if p != partition.as_str() {
            return Err(bad("belongs to another partition".into()));
        }
        let n: u64 = n
            .parse()
            .map_err(|_| bad(format!("{} is not a number", self.noun)))?;
        if n > last {
            return Err(bad("is past the end of the partition".into()));
        }
        Ok(n)
    }
}

/// Where reading a partition starts.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum Position {
    /// The oldest record the source still has (Kinesis `TRIM_HORIZON`).
    Beginning,
    /// After the newest record at the moment the reader opens (Kinesis `LATEST`).
    Now,
    /// The first record written at or after this wall time.
    AtTime(Timestamp),
    /// Just after the record this continuation stands for.
    Continuation(Continuation),
}

impl fmt::Display for Position {
    /// `beginning`, `now`, `at:<millis>` or `after:<token>`; [`Position::from_str`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Beginning => f.write_str("beginning"),
            Position::Now => f.write_str("now"),
            Position::AtTime(t) => write!(f, "at:{}", t.0),
            Position::Continuation(c) => write!(f, "after:{}", c.0),
        }
    }
}

impl FromStr for Position {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, ModelError> {
        let bad = |rule: &str| ModelError::Invalid {
            kind: "position",
            value: s.escape_debug().to_string(),
            rule: rule.to_string(),
        };
        match s {
            "beginning" => Ok(Position::Beginning),
            "now" => Ok(Position::Now),
            _ => {
                if let Some(ms) = s.strip_prefix("at:") {
                    let ms = ms
                        .parse::<i64>()
                        .map_err(|_| bad("at: must be followed by milliseconds since the epoch"))?;
                    Ok(Position::AtTime(Timestamp(ms)))
                } else if let Some(token) = s.strip_prefix("after:") {
                    if token.is_empty() {
                        return Err(bad("after: must be followed by a continuation"));
                    }
                    Ok(Position::Continuation(Continuation::new(token)))
                } else {
                    Err(bad(
                        "must be beginning, now, at:MILLIS or after:CONTINUATION",
                    ))
                }
            }
        }
    }
}

impl Serialize for Position {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Position {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A range of the key-hash space a partition covers, inclusive at both ends.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct KeyRange {
    /// First hash in the range.
    pub start: u128,
    /// Last hash in the range (inclusive).
    pub end: u128,
}

impl KeyRange {
    /// The whole hash space.
    pub const FULL: KeyRange = KeyRange {
        start: 0,
        end: u128::MAX,
    };

    /// Whether `hash` falls in this range.
    pub fn contains(&self, hash: u128) -> bool {
        self.start <= hash && hash <= self.end
    }

    /// The two halves a split of this range opens, lower first; `None` for a single hash.
    pub fn split(self) -> Option<(KeyRange, KeyRange)> {
        if self.start == self.end {
            return None;
        }
        let mid = self.start + (self.end - self.start) / 2;
        Some((
            KeyRange {
                start: self.start,
                end: mid,
            },
            KeyRange {
                start: mid + 1,
                end: self.end,
            },
        ))
    }

    /// The range covering this one and `other` when they are adjacent (in either order);
    /// `None` otherwise.
    pub fn merge(self, other: KeyRange) -> Option<KeyRange> {
        let (lo, hi) = if self.start < other.start {
            (self, other)
        } else {
            (other, self)
        };
        (lo.end.checked_add(1) == Some(hi.start)).then_some(KeyRange {
            start: lo.start,
            end: hi.end,
        })
    }
}

/// One partition of a feed, as the source lists it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Partition {
    /// Its id.
    pub id: PartitionId,
    /// The partitions it was split or merged from; empty for an original partition.
    #[serde(default)]
    pub parents: Vec<PartitionId>,
    /// Whether it is closed: no more records will arrive (KCL's SHARD_END).
    #[serde(default)]
    pub closed: bool,
    /// The key-hash range it covers, where the source has one.
    #[serde(default, rename = "range", skip_serializing_if = "Option::is_none")]
    pub key_range: Option<KeyRange>,
}

/// One change record.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Record {
    /// The key the writer gave it (the partition key); records of one key stay in order.
    pub key: String,
    /// The payload.
    pub data: Bytes,
    /// The continuation that stands for "this record and everything before it is done".
    pub continuation: Continuation,
    /// When the source accepted it, by the source's clock, where it knows.
    pub timestamp: Option<Timestamp>,
}

/// What one read of a partition returns.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Batch {
    /// The records, in partition order. May be empty (idle partition, or end reached).
    pub records: Vec<Record>,
    /// The continuation after the last record of the batch; on an empty batch `None` (the
    /// reader's position did not move), or the reader's place restated without records (see
    /// [`crate::source::PartitionReader::next_batch`]), which is checkpointed all the same.
    pub continuation: Option<Continuation>,
    /// True when the partition is closed and this batch holds its last records: nothing more
    /// will ever be read from it.
    pub end_of_partition: bool,
}

/// The lifecycle state of a lease.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// No owner; any host may take it.
    Available,
    /// A host owns it and reads its partition.
    Owned,
    /// Its partition is closed and fully checkpointed; kept until its children have started.
    Finished,
}

impl LeaseState {
    /// `available`, `owned` or `finished`.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Available => "available",
            LeaseState::Owned => "owned",
            LeaseState::Finished => "finished",
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LeaseState {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "available" => Ok(LeaseState::Available),
            "owned" => Ok(LeaseState::Owned),
            "finished" => Ok(LeaseState::Finished),
            other => Err(ModelError::Invalid {
                kind: "lease state",
                value: other.escape_debug().to_string(),
                rule: "must be available, owned or finished".into(),
            }),
        }
    }
}

/// The record in the lease store that binds a partition to at most one owner and carries how
/// far its partition has been read.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Lease {
    /// Group and partition.
    pub key: LeaseKey,
    /// Lifecycle state; see [`Lease::validate`] for how it agrees with `owner`.
    pub state: LeaseState,
    /// The host that owns it, when `state` is [`LeaseState::Owned`].
    pub owner: Option<HostName>,
    /// A host that asked for this lease by hand-off; the owner passes it over at its next
    /// checkpoint.
    pub next_owner: Option<HostName>,
    /// How far the partition has been read; `None` until the first checkpoint.
    pub continuation: Option<Continuation>,
    /// Where reading starts while there is no continuation.
    pub start: Position,
    /// The partitions this one was split or merged from.
    pub parents: Vec<PartitionId>,
    /// Free-form properties for custom balancing strategies and operators.
    pub properties: BTreeMap<String, String>,
    /// The row version; the store sets it on every write.
    pub version: Version,
}

impl Lease {
    /// A new available lease for `key`, starting at `start`, not yet stored.
    pub fn new(key: LeaseKey, start: Position) -> Self {
        Self {
            key,
            state: LeaseState::Available,
            owner: None,
            next_owner: None,
            continuation: None,
            start,
            parents: Vec::new(),
            properties: BTreeMap::new(),
            version: Version::default(),
        }
    }

    /// Sets the parents.
    pub fn with_parents(mut self, parents: Vec<PartitionId>) -> Self {
        self.parents = parents;
        self
    }

    /// Where a reader of this lease's partition must start: after the continuation, or at
    /// `start` while there is none.
    pub fn resume_position(&self) -> Position {
        match &self.continuation {
            Some(c) => Position::Continuation(c.clone()),
            None => self.start.clone(),
        }
    }

    /// Whether `host` owns it.
    pub fn is_owned_by(&self, host: &HostName) -> bool {
        self.state == LeaseState::Owned && self.owner.as_ref() == Some(host)
    }

    /// Checks the lease is self-consistent: `owned` exactly when there is an owner, and a
    /// `next_owner` only on an owned lease.
    ///
    /// # Errors
    /// [`ModelError::InconsistentLease`] naming the key and the rule.
    pub fn validate(&self) -> Result<(), ModelError> {
        let rule = match (self.state, &self.owner, &self.next_owner) {
            (LeaseState::Owned, None, _) => Some("an owned lease must have an owner"),
            (LeaseState::Available | LeaseState::Finished, Some(_), _) => {
                Some("only an owned lease may have an owner")
            }
            (LeaseState::Available | LeaseState::Finished, _, Some(_)) => {
                Some("only an owned lease may have a next_owner")
            }
            _ => None,
        };
        match rule {
            Some(rule) => Err(ModelError::InconsistentLease {
                key: self.key.to_string(),
                rule,
            }),
            None => Ok(()),
        }
    }

    /// Who owns this lease: its state, owner and next owner.
    #[must_use]
    pub fn ownership(&self) -> Ownership {
        Ownership {
            state: self.state,
            owner: self.owner.clone(),
            next_owner: self.next_owner.clone(),
        }
    }

    /// Whether `other` differs from this lease in who owns it (owner, next owner or state).
    /// Stores bump the group's change counter exactly for such writes.
    pub fn ownership_differs(&self, other: &Lease) -> bool {
        self.state != other.state
            || self.owner != other.owner
            || self.next_owner != other.next_owner
    }
}

/// The part of a lease that says who owns it. A write that changes it moves the group's change
/// counter ([`Lease::ownership_differs`]); stores that condition a write on it compare this.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// The lease's state.
    pub state: LeaseState,
    /// Its owner.
    pub owner: Option<HostName>,
    /// The host a hand-off was asked for.
    pub next_owner: Option<HostName>,
}

#[cfg(test)]
mod tests;
