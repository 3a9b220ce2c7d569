//! What the lease store conformance suite asks of a backend: a fresh store, a way to corrupt
//! a row, and the flags for what differs between backends.

use std::sync::Arc;

use async_trait::async_trait;

use crate::lease::LeaseStore;
use crate::model::{GroupName, LeaseKey};

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
    /// Whether the store answers [`LeaseStore::list_changes`] (`Some`). A store that says so
    /// fails the suite when it answers `None`; one that does not (the default) passes the
    /// checks of what the answer holds vacuously, and its hosts list in full on every move.
    ///
    /// The checks of the answer count counter values: each write that changes hands moves the
    /// counter by exactly one, as every shipped store counts.
    fn answers_changes(&self) -> bool {
        false
    }
    /// How many counter moves back the store keeps the deletions `list_changes` reports
    /// (SQLite's `CHANGE_HORIZON`, PostgreSQL's `changes_kept`, the in-memory store's log):
    /// after more deletions than that in a row, exactly the last that many are answered, and a
    /// `since` before them is `None`. `None` (the default): the store keeps no such bound, and
    /// the check of it is skipped. The check writes twice the horizon: a fixture may give its
    /// store a short one.
    fn changes_horizon(&self) -> Option<u64> {
        None
    }
    /// How many deletion records the store holds for `group`, counted in the backend directly
    /// (as a person reading the table would), so the suite can check they stay within the
    /// horizon. `None` (the default): the fixture does not count them.
    async fn deletion_records(&self, _group: &GroupName) -> Option<u64> {
        None
    }
    /// Whether the store keeps a membership view ([`MembershipStore::head`] answers `Some`). A
    /// store that says so fails the suite when `head` answers `None`; one that does not (the
    /// default) passes the view checks vacuously, and its hosts read every heartbeat.
    fn keeps_view(&self) -> bool {
        false
    }
    /// How many leases the check of listing at scale creates and lists. Default 10,000. A
    /// server that slows down with the size of a table (moto, a few calls a second at
    /// thousands of items) lists fewer, still more than one page.
    fn leases_at_scale(&self) -> usize {
        10_000
    }
}
