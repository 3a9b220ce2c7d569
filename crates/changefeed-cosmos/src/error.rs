//! [`CosmosError`]: what went wrong talking to Cosmos DB, and the one place that decides which
//! failures are worth retrying.

use changefeed::lease::BackendError;

/// A failed Cosmos DB request, or a setting or response this crate cannot use.
///
/// Every variant names the request (`VERB resource-link`) or the setting, so the message alone
/// says where to look. The transport's error stays the `source`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CosmosError {
    /// Cosmos DB answered with a status this crate does not treat as an outcome of the
    /// operation (a 409 on create or a 412 on a precondition is an outcome, never this).
    #[error("{request}: HTTP {status}{}: {message}", substatus.map(|s| format!(" (substatus {s})")).unwrap_or_default())]
    Status {
        /// `VERB resource-link`, e.g. `PUT dbs/db/colls/leases/docs/lease.0`.
        request: String,
        /// The HTTP status.
        status: u16,
        /// The `x-ms-substatus` header, if any.
        substatus: Option<u32>,
        /// The service's message, or the body as text.
        message: String,
    },
    /// The request got no answer: connection refused or lost, TLS failure …
    #[error("{request}: {source}")]
    Transport {
        /// `VERB resource-link`.
        request: String,
        /// The HTTP client's error.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The answer did not come within the request timeout.
    #[error("{request}: no answer within {timeout:?} (CosmosOptions::timeout)")]
    Timeout {
        /// `VERB resource-link`.
        request: String,
        /// The timeout.
        timeout: std::time::Duration,
    },
    /// An answer this crate cannot read (not JSON, a batch answer of the wrong length …).
    #[error("{request}: unexpected answer: {reason}")]
    Unexpected {
        /// `VERB resource-link`.
        request: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting that cannot work, named.
    #[error("setting {setting}: {reason}")]
    Setting {
        /// The setting (`endpoint`, `key`, `database` …).
        setting: &'static str,
        /// Why.
        reason: String,
    },
}

impl CosmosError {
    /// The HTTP status, if Cosmos DB answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            CosmosError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

impl BackendError for CosmosError {
    /// Transport failures, timeouts, throttling (429), request timeouts (408), retry-with (449)
    /// and server trouble (500, 502, 503, 504) may pass; everything else will not.
    fn is_retryable(&self) -> bool {
        match self {
            CosmosError::Transport { .. } | CosmosError::Timeout { .. } => true,
            CosmosError::Status { status, .. } => {
                matches!(status, 408 | 429 | 449 | 500 | 502 | 503 | 504)
            }
            CosmosError::Unexpected { .. } | CosmosError::Setting { .. } => false,
        }
    }
}
