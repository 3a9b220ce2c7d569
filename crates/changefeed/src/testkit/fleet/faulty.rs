//! [`Faulty`]: a lease store wrapper a test can cut off from the store.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::error::LeaseError;
use crate::lease::{LeaseStore, StoreOp};

/// A store wrapper a test can cut off: calls then fail or hang. Clones share one switch.
#[derive(Debug, Clone)]
pub struct Faulty {
    inner: Arc<dyn LeaseStore>,
    mode: Arc<Mutex<FaultMode>>,
}

/// How a [`Faulty`] store behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultMode {
    /// Calls go through.
    #[default]
    Healthy,
    /// Calls fail with a retryable error.
    Fail,
    /// Calls never complete.
    Hang,
    /// Heartbeats go through; every other call fails (a partial outage: the host stays live
    /// but can neither read nor write its leases).
    LeasesFail,
}

impl Faulty {
    /// Wraps `inner`, healthy.
    pub fn new(inner: Arc<dyn LeaseStore>) -> Self {
        Self {
            inner,
            mode: Arc::new(Mutex::new(FaultMode::Healthy)),
        }
    }

    /// Switches the behaviour of every handle to this store.
    pub fn set(&self, mode: FaultMode) {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
    }

    /// How this store behaves now.
    pub fn mode(&self) -> FaultMode {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn gate(&self, op: StoreOp) -> Result<(), LeaseError> {
        match self.mode() {
            FaultMode::Healthy => Ok(()),
            FaultMode::LeasesFail if matches!(op, StoreOp::Heartbeat) => Ok(()),
            FaultMode::Fail | FaultMode::LeasesFail => Err(LeaseError::store(
                op.as_str(),
                None,
                true,
                "cut off from the store (test)",
            )),
            FaultMode::Hang => std::future::pending().await,
        }
    }
}

#[async_trait]
impl crate::lease::ForwardingStore for Faulty {
    fn inner(&self) -> &dyn LeaseStore {
        &*self.inner
    }

    async fn before(&self, op: StoreOp) -> Result<(), LeaseError> {
        self.gate(op).await
    }
}
