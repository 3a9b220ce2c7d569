//! Error types, one per seam: the model, the lease store and the feed source.
//!
//! Each variant names what it is about (a lease key, a host, a partition, a setting) so the
//! message alone tells an operator where to look. Backend errors stay attached as a `source`.

use crate::model::{Heartbeat, Lease};

/// A boxed backend error, kept as the `source` of ours.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A value that breaks a rule of the model.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModelError {
    /// A name, key or position that breaks a rule.
    #[error("invalid {kind} \"{value}\": {rule}")]
    Invalid {
        /// What kind of value (`group name`, `partition id` …).
        kind: &'static str,
        /// The value, escaped for display.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// A lease whose fields contradict each other.
    #[error("lease {key}: {rule}")]
    InconsistentLease {
        /// The lease key.
        key: String,
        /// The rule it breaks.
        rule: &'static str,
    },
}

/// What can go wrong talking to a lease store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// A compare-and-swap lost: the row's version moved. Carries the row as it is now.
    #[error("lease {key}: version conflict (expected {expected}, found {})", current.version)]
    Conflict {
        /// The lease key.
        key: String,
        /// The version the writer expected.
        expected: crate::model::Version,
        /// The row as it is now.
        current: Box<Lease>,
    },
    /// A heartbeat compare-and-swap lost. Carries the row as it is now (`None`: it was
    /// removed).
    #[error("host {host} in group {group}: heartbeat conflict (another writer, or removed)")]
    HeartbeatConflict {
        /// The group.
        group: String,
        /// The host.
        host: String,
        /// The row as it is now, if any.
        current: Option<Box<Heartbeat>>,
    },
    /// A membership view compare-and-swap lost. Carries the view as it is now (`None`: there
    /// is none).
    #[error("group {group}: membership view conflict (expected version {expected})")]
    ViewConflict {
        /// The group.
        group: String,
        /// The version the writer expected (0: no view).
        expected: u64,
        /// The view as it is now, if any.
        current: Option<Box<crate::model::MembershipView>>,
    },
    /// The lease does not exist.
    #[error("lease {key}: not found")]
    NotFound {
        /// The lease key.
        key: String,
    },
    /// A stored row that cannot be read back as a lease (bad JSON, unknown state …).
    #[error("lease {key}: malformed row: {reason}")]
    Malformed {
        /// The row's key as stored.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A lease the caller tried to write breaks a model rule.
    #[error(transparent)]
    Invalid(#[from] ModelError),
    /// The store failed (I/O, server, timeout). `retryable` says whether trying again later
    /// can help.
    #[error("lease store {operation} failed{}: {source}", key.as_deref().map(|k| format!(" for {k}")).unwrap_or_default())]
    Store {
        /// The operation (`list`, `replace` …).
        operation: &'static str,
        /// The lease key or host it concerned, if any.
        key: Option<String>,
        /// Whether a retry may succeed.
        retryable: bool,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
}

impl LeaseError {
    /// Wraps a backend error for `operation` on `key`.
    pub fn store(
        operation: &'static str,
        key: Option<String>,
        retryable: bool,
        source: impl Into<BoxError>,
    ) -> Self {
        LeaseError::Store {
            operation,
            key,
            retryable,
            source: source.into(),
        }
    }

    /// The one place that decides whether an error is worth retrying later: store failures
    /// the backend marked retryable. Conflicts are not retried blindly: the caller re-reads.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            LeaseError::Store {
                retryable: true,
                ..
            }
        )
    }
}

/// What can go wrong reading a feed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The partition does not exist.
    #[error("partition {partition}: not found")]
    UnknownPartition {
        /// The partition id.
        partition: String,
    },
    /// A continuation the source does not recognise, or that does not belong to this
    /// partition.
    #[error("partition {partition}: invalid continuation \"{continuation}\": {reason}")]
    InvalidContinuation {
        /// The partition id.
        partition: String,
        /// The token.
        continuation: String,
        /// Why it was refused.
        reason: String,
    },
    /// The source's partition data breaks a rule (a cycle, an unknown parent …).
    #[error("partition {partition}: {reason}")]
    Corrupt {
        /// The partition id.
        partition: String,
        /// What is wrong.
        reason: String,
    },
    /// The source failed (I/O, server, throttling).
    #[error("feed source {operation} failed{}: {source}", partition.as_deref().map(|p| format!(" for partition {p}")).unwrap_or_default())]
    Source {
        /// The operation (`partitions`, `read` …).
        operation: &'static str,
        /// The partition, if any.
        partition: Option<String>,
        /// Whether a retry may succeed.
        retryable: bool,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
}

impl SourceError {
    /// Wraps a backend error for `operation` on `partition`.
    pub fn source(
        operation: &'static str,
        partition: Option<String>,
        retryable: bool,
        source: impl Into<BoxError>,
    ) -> Self {
        SourceError::Source {
            operation,
            partition,
            retryable,
            source: source.into(),
        }
    }

    /// Whether trying again later may help.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            SourceError::Source {
                retryable: true,
                ..
            }
        )
    }
}

/// An error and its causes on one line, each cause once, outermost first: `opening lease store
/// x.db: outer failed: inner broke: disk on fire`.
///
/// Many errors print their cause inside their own message and also return it as their
/// `source` (this crate's [`LeaseError::Store`] does, as do the drivers' wrappers), so printing
/// every link of the chain repeats each cause once per wrapper. A link whose text is already
/// part of what was printed adds nothing and is left out.
#[must_use]
pub fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    for link in std::iter::successors(Some(err), |e| e.source()) {
        let text = link.to_string();
        let text = text.trim();
        if text.is_empty() || out.contains(text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(text);
    }
    out
}
