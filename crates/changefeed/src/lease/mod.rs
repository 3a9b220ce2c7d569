//! The lease store seam: where leases and host heartbeats live.
//!
//! Two small traits: [`LeaseStore`] for the lease rows (list, create-if-absent,
//! compare-and-swap, delete) and its supertrait [`MembershipStore`] for the heartbeat row per
//! host and the membership view. Acquiring, renewing, checkpointing, handing off and releasing
//! are built on top of them by the processor, so a backend only has to get these few
//! operations atomic. [`MemoryLeaseStore`] is the in-memory implementation for tests and the simulator.
//!
//! The trait is object-safe (`Arc<dyn LeaseStore>`): a host picks its store at run time from a
//! URL, and the processor, CLI and simulator hold one type whatever the backend. The cost is
//! one boxed future per call, which is noise next to a store round trip.

mod backend;
mod counting;
mod forward;
mod memory;
pub mod row;

pub use backend::BackendError;
pub use counting::{CountingStore, StoreCounts, StoreStats};
pub use forward::{ForwardingStore, StoreOp};
pub use memory::MemoryLeaseStore;
pub use row::LeaseRow;

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::LeaseError;
use crate::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView, Version,
};

/// The result of [`LeaseStore::list`]: the readable leases, and every row that could not be
/// read, each as an error naming its key. One bad row never hides the others.
///
/// Rows come behind an `Arc`, here and in [`Changes`], so that they can be shared: a store
/// that keeps its rows in memory ([`MemoryLeaseStore`]) hands out its own, and every host of
/// one process (the simulator's thousand) holds one pointer per row instead of a copy. A
/// backend that decodes rows wraps each one (`Arc::new`, or `.into()`).
#[derive(Debug, Default)]
pub struct Listing {
    /// The leases, ordered by partition id.
    pub leases: Vec<Arc<Lease>>,
    /// One [`LeaseError::Malformed`] per unreadable row.
    pub malformed: Vec<LeaseError>,
}

/// The result of [`LeaseStore::list_changes`]: what changed hands since a change-counter
/// value.
#[derive(Debug, Default)]
pub struct Changes {
    /// The group's change counter as of this read: every change up to it is included.
    pub counter: u64,
    /// The current row of every lease created, or whose state, owner or next_owner changed,
    /// after the value asked about; ordered by partition id.
    pub leases: Vec<Arc<Lease>>,
    /// The keys of the leases deleted after it, ordered by partition id. A lease deleted and
    /// created again is in both lists (its new row restarts its versions): apply the
    /// deletions first.
    pub deleted: Vec<LeaseKey>,
    /// One [`LeaseError::Malformed`] per such row that cannot be read.
    pub malformed: Vec<LeaseError>,
}

/// In which role a host renews its heartbeat ([`MembershipStore::heartbeat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatRole {
    /// A plain member of the group.
    Member,
    /// The leader of the membership view: a store that keeps a view copies the new version
    /// into it.
    Leader,
}

/// A shared store of leases and host heartbeats, partitioned by group: the lease rows here,
/// the hosts' heartbeats and the membership view in its [`MembershipStore`] part.
///
/// # Contract
///
/// - Every successful write of a row sets its version to one more than before (a created row
///   gets [`Version::FIRST`]), and returns the row as stored.
/// - Writes are atomic per row, and conditional: `create` only if absent, `replace` and
///   `delete` only at the expected version. Nothing is ever overwritten blindly.
/// - Every write that creates or deletes a lease, or changes its `state`, `owner` or
///   `next_owner`, bumps the group's change counter in the same atomic step; a write that only
///   moves the continuation or properties does not.
/// - Groups are isolated: nothing done in one group is visible in another.
///
/// # Cancel safety
///
/// Dropping a returned future may or may not have applied the write (as with any remote
/// call). Because every write is conditional on a version, the caller recovers by re-reading.
#[async_trait]
pub trait LeaseStore: MembershipStore {
    /// All leases of `group`, ordered by partition id.
    ///
    /// # Errors
    /// [`LeaseError::Store`] if the store cannot be read. Unreadable rows do not fail the call:
    /// they are returned in [`Listing::malformed`].
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError>;

    /// The lease with `key`, or `None`.
    ///
    /// # Errors
    /// [`LeaseError::Malformed`] if its row cannot be read; [`LeaseError::Store`] on failure.
    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError>;

    /// Stores `lease` if no lease has its key. Returns `Some(stored)` (version
    /// [`Version::FIRST`]) if this call created it, `None` if it already existed. Racing
    /// creators: exactly one gets `Some`.
    ///
    /// # Errors
    /// [`LeaseError::Invalid`] if `lease` fails [`Lease::validate`]; [`LeaseError::Store`].
    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError>;

    /// Writes `lease` if the stored row is at `expected`; returns the row as stored (version
    /// `expected + 1`). `lease.version` is ignored.
    ///
    /// # Errors
    /// [`LeaseError::Conflict`] with the current row if the version moved;
    /// [`LeaseError::NotFound`] if there is no row; [`LeaseError::Invalid`];
    /// [`LeaseError::Store`].
    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError>;

    /// Deletes the lease if it is at `expected`.
    ///
    /// # Errors
    /// [`LeaseError::Conflict`] with the current row if the version moved;
    /// [`LeaseError::NotFound`]; [`LeaseError::Store`].
    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError>;

    /// What changed hands in `group` after its change counter was `since`: a read that grows
    /// with the changes, not with the number of leases. `None` when the store cannot tell (it
    /// does not track changes, or no longer remembers that far back); the caller then lists.
    /// Rows whose only change was a checkpoint are not included.
    ///
    /// The default returns `None`.
    ///
    /// # Errors
    /// [`LeaseError::Store`].
    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        let _ = (group, since);
        Ok(None)
    }
}

/// The membership part of a [`LeaseStore`]: each host's heartbeat row, and the group's
/// membership view where the store keeps one (`docs/protocol.md`, "The membership view").
/// The same contract holds: versioned, conditional, atomic writes per row, groups isolated.
#[async_trait]
pub trait MembershipStore: Send + Sync + std::fmt::Debug {
    /// Writes `host`'s heartbeat row in `group`: creates it when `expected` is `None` and no
    /// row exists, otherwise replaces it if it is at `expected`. `written_at` is stored for
    /// display. `report` is what the host publishes about itself
    /// ([`HostReport`](crate::model::HostReport) as JSON): stored as it is, replacing the
    /// row's last one (`None` leaves the row without one), and read back by
    /// [`MembershipStore::membership`]. Returns the row as stored.
    ///
    /// Written as the membership view's leader ([`HeartbeatRole::Leader`]), a store that keeps
    /// a view ([`MembershipStore::head`]) also copies the new version into the view's
    /// [`MembershipView::leader_heartbeat`] when the view names this host and incarnation as
    /// its leader: the others judge from the view alone that the leader lives and keeps it.
    /// The copy is made in the same atomic step or once the row's write has landed, never
    /// before: it may lag the row, which observers allow for, but never lead it. A store
    /// without a view writes the heartbeat only, whatever the role.
    ///
    /// # Errors
    /// [`LeaseError::HeartbeatConflict`] with the current row if it exists when `expected` is
    /// `None`, or is not at `expected`, or was removed; [`LeaseError::Store`].
    // A heartbeat's fields are its arguments; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: crate::model::Timestamp,
        expected: Option<Version>,
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError>;

    /// Removes `host`'s heartbeat row if it is at `expected` and was written by `incarnation`
    /// (a host leaving gracefully, or a leader or operator clearing a dead one). Removing a row
    /// that is already gone succeeds.
    ///
    /// The incarnation is part of the condition because a host that registers again starts a
    /// new row at version 1: a removal sent on a stale view (a request held by a stall or a
    /// slow network) must not delete the live row that reached the same version again.
    ///
    /// # Errors
    /// [`LeaseError::HeartbeatConflict`] if the row is at another version or incarnation;
    /// [`LeaseError::Store`].
    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError>;

    /// Every heartbeat of `group` and its change counter, in one read of O(hosts) rows.
    ///
    /// # Errors
    /// [`LeaseError::Store`].
    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError>;

    /// The group's change counter and membership view, in one read of one small row: what a
    /// host that is not the leader reads every cycle instead of every heartbeat
    /// (`docs/protocol.md`, "The membership view"). `None` when the store keeps no view; its
    /// hosts read [`MembershipStore::membership`] instead. A group never written to reads as a
    /// counter of 0 and no view.
    ///
    /// The counter and the view must be read atomically (one row, or one snapshot): a host
    /// relies on a view read with a counter being at least as new as every view written
    /// before the counter reached that value.
    ///
    /// The default returns `None`.
    ///
    /// # Errors
    /// [`LeaseError::Store`].
    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        let _ = group;
        Ok(None)
    }

    /// The most [`MembershipStore::head`] reads per second a whole fleet should make of one group,
    /// for a store whose head is one item under a per-key limit (DynamoDB: about 3,000 read
    /// units per second on one partition key). Hosts then stretch their acquire cycle to
    /// `live hosts ÷ this` when that is longer, up to a bound the hand-off protocol allows
    /// (`docs/protocol.md`, "Pacing the head"). `None` (the default): no limit.
    fn head_reads_per_second(&self) -> Option<f64> {
        None
    }

    /// Writes `view` as the group's membership view if the stored one is at `expected` (0: no
    /// view yet); returns it as stored, at version `expected + 1` (`view.version` is ignored).
    /// The change counter does not move.
    ///
    /// The default refuses: a store that answers [`MembershipStore::head`] must implement it.
    ///
    /// # Errors
    /// [`LeaseError::ViewConflict`] with the current view if the version moved;
    /// [`LeaseError::Store`].
    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let _ = (view, expected);
        Err(LeaseError::store(
            "write_view",
            Some(group.to_string()),
            false,
            "this lease store keeps no membership view",
        ))
    }
}
