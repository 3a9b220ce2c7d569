//! The one place that decides which DynamoDB failures are worth retrying.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use changefeed::LeaseError;

/// Error codes DynamoDB uses for throttling and transient server trouble.
const RETRYABLE_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionInProgressException",
    "TransactionConflictException",
];

/// Whether an SDK error is transient: the request never got a definite answer (dispatch
/// failure, timeout, unreadable response) or the service said it was throttled or busy.
pub(crate) fn is_retryable<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    match err {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            true
        }
        SdkError::ServiceError(e) => e
            .err()
            .code()
            .is_some_and(|code| RETRYABLE_CODES.contains(&code)),
        _ => false,
    }
}

/// Wraps an SDK error as a [`LeaseError::Store`] for `operation` on `key`.
pub(crate) fn store_error<E, R>(
    operation: &'static str,
    key: Option<String>,
    err: SdkError<E, R>,
) -> LeaseError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let retryable = is_retryable(&err);
    LeaseError::store(operation, key, retryable, DynamoError::from_sdk(err))
}

/// A DynamoDB SDK error, summarised: the service's error code and message, or the chain of
/// causes in words (the SDK's own `Display` says only "service error" or "dispatch failure",
/// and its `DisplayErrorContext` appends a `Debug` dump of the whole request). The SDK error
/// stays the `source`, for callers that downcast.
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct DynamoError {
    context: String,
    #[source]
    source: Option<changefeed::error::BoxError>,
}

impl DynamoError {
    /// The service's code and message; otherwise the chain of causes in words.
    pub(crate) fn from_sdk<E, R>(err: SdkError<E, R>) -> Self
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

    /// An error that is not from the SDK (a table that never became active …).
    pub(crate) fn other(context: impl Into<String>) -> Self {
        Self {
            context: context.into(),
            source: None,
        }
    }
}
