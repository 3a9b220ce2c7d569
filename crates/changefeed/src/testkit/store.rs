//! The lease store conformance suite.

use std::sync::Arc;

use async_trait::async_trait;

use crate::lease::LeaseStore;
use crate::model::LeaseKey;

/// How a fixture should make a stored lease row unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corruption {
    /// The properties column no longer holds valid JSON.
    BadPropertiesJson,
    /// The state column holds a state that does not exist.
    UnknownState,
}

/// One fresh, empty lease store for the suite.
#[async_trait]
pub trait LeaseStoreFixture: Send + Sync {
    /// A new handle to this fixture's store. For a server or a file, each call opens a new
    /// connection, so racing handles really race through the backend.
    async fn connect(&self) -> Arc<dyn LeaseStore>;
    /// Makes the stored row of `key` unreadable in the way `how` says, by writing the backend
    /// directly (as a person editing the table by hand would).
    async fn corrupt(&self, key: &LeaseKey, how: Corruption);
}

/// Runs every lease store check, each on a fresh fixture from `factory`.
pub async fn lease_store_conformance<F, Fut>(factory: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Box<dyn LeaseStoreFixture>>,
{
    let _ = factory;
}
