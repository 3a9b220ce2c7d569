//! [`BackendError`]: how a backend's own error becomes the `source` of the core's errors.
//!
//! Each backend keeps one error enum of its own, and one method on it decides which of its
//! failures a retry may cure. This trait does the rest once for every backend: wrap the error,
//! with that decision, as a [`LeaseError::Store`] or a [`SourceError::Source`].

use crate::error::{LeaseError, SourceError};

/// A backend's own error, which knows whether trying again later may help.
///
/// Implement [`BackendError::is_retryable`]; the conversions come with it.
pub trait BackendError: std::error::Error + Send + Sync + Sized + 'static {
    /// Whether trying again later may help (a busy lock, a timeout, a lost connection). The
    /// one place a backend decides it.
    fn is_retryable(&self) -> bool;

    /// As a lease store error for `operation` on `key`, retryable as
    /// [`BackendError::is_retryable`] says.
    fn into_lease(self, operation: &'static str, key: Option<String>) -> LeaseError {
        let retryable = self.is_retryable();
        LeaseError::store(operation, key, retryable, self)
    }

    /// As a feed source error for `operation` on `partition`, retryable as
    /// [`BackendError::is_retryable`] says.
    fn into_source(self, operation: &'static str, partition: Option<String>) -> SourceError {
        let retryable = self.is_retryable();
        SourceError::source(operation, partition, retryable, self)
    }
}
