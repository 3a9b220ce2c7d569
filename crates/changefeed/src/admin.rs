//! Operator actions on a group's rows, by the protocol's rules: freeing a dead host's leases
//! ([`release_host`], after [`watch_heartbeat`] says it is dead) and moving one lease's
//! checkpoint ([`reset_lease`]). Every write is a compare-and-swap on the version read, so an
//! action that races a host loses cleanly; time comes from the injected [`Clock`].
//!
//! ```
//! use changefeed::admin;
//! use changefeed::clock::SystemClock;
//! use changefeed::lease::{LeaseStore, MemoryLeaseStore};
//! use changefeed::model::{GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryLeaseStore::new();
//! let group = GroupName::new("orders")?;
//! let gone = HostName::new("host-7")?;
//! let key = LeaseKey::new(group.clone(), PartitionId::new("0")?);
//! let mut lease = store
//!     .create(&Lease::new(key, Position::Beginning))
//!     .await?
//!     .ok_or("the lease exists already")?;
//! lease.state = LeaseState::Owned;
//! lease.owner = Some(gone.clone());
//! store.replace(&lease, lease.version).await?;
//!
//! // The host has no heartbeat row: nothing to watch, its leases are freed at once.
//! let watched = admin::watch_heartbeat(&store, &group, &gone, std::time::Duration::ZERO, &SystemClock).await?;
//! let report = admin::release_host(&store, &group, &gone, watched.last()).await?;
//! assert_eq!(report.released.len(), 1);
//! assert!(store.list(&group).await?.leases[0].owner.is_none());
//! # Ok(()) }
//! ```

use std::time::Duration;

use crate::clock::Clock;
use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{
    Continuation, GroupName, Heartbeat, HostName, Lease, LeaseKey, LeaseState, Membership, Position,
};
use crate::processor::GroupObserver;

/// What watching a host's heartbeat showed ([`watch_heartbeat`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched {
    /// The host has no heartbeat row.
    NoRow,
    /// Not watched (a zero wait): the row as first read.
    Unchecked(Heartbeat),
    /// The row stood still for the whole wait: the host is dead.
    StoodStill(Heartbeat),
    /// The row moved (or was removed) within the wait: the host is alive.
    Moved {
        /// The row at the start of the wait.
        from: Heartbeat,
        /// The row at its end, if it is still there.
        to: Option<Heartbeat>,
    },
}

impl Watched {
    /// The host's row as last read, if it has one.
    pub fn last(&self) -> Option<&Heartbeat> {
        match self {
            Watched::NoRow => None,
            Watched::Unchecked(row) | Watched::StoodStill(row) => Some(row),
            Watched::Moved { to, .. } => to.as_ref(),
        }
    }
}

/// Reads `host`'s heartbeat row, and again after `wait` on `clock`: a row that moved means
/// the host lives. The reads are judged by the [`GroupObserver`] the hosts judge each other
/// by, with `wait` as the expiry, so an operator cannot call dead a host the fleet sees alive.
///
/// # Errors
/// The store's.
pub async fn watch_heartbeat(
    store: &dyn LeaseStore,
    group: &GroupName,
    host: &HostName,
    wait: Duration,
    clock: &dyn Clock,
) -> Result<Watched, LeaseError> {
    let find = |read: &Membership| read.hosts.iter().find(|h| &h.host == host).cloned();
    let read = store.membership(group).await?;
    let Some(first) = find(&read) else {
        return Ok(Watched::NoRow);
    };
    if wait.is_zero() {
        return Ok(Watched::Unchecked(first));
    }
    let mut observer = GroupObserver::default();
    observer.observe_heartbeats(&read, clock.now());
    clock.sleep(wait).await;
    let read = store.membership(group).await?;
    let now = clock.now();
    observer.observe_heartbeats(&read, now);
    let live = observer.live_by_heartbeats(now, wait).contains(host);
    Ok(match find(&read) {
        Some(row) if !live => Watched::StoodStill(row),
        to => Watched::Moved { from: first, to },
    })
}

/// What [`release_host`] did.
#[derive(Debug, Default)]
pub struct Released {
    /// The leases the host owned, as they were before they were freed (their checkpoints).
    pub released: Vec<Lease>,
    /// The leases on which the host's hand-off request was cleared.
    pub cleared: Vec<LeaseKey>,
    /// Writes that failed (a row that changed meanwhile, or the store's error).
    pub failed: Vec<LeaseError>,
    /// Rows the store could not read, left as they are.
    pub malformed: Vec<LeaseError>,
    /// Whether the heartbeat row was removed: `None` when there was none to remove.
    pub heartbeat: Option<Result<(), LeaseError>>,
}

/// Frees every lease `host` owns (available, its checkpoint kept), clears its hand-off
/// requests, and removes its heartbeat `row` (at its version and incarnation), each by
/// compare-and-swap. The caller decides first that the host is dead ([`watch_heartbeat`]):
/// a live host whose row is removed stops its workers when it sees the row gone.
///
/// # Errors
/// The store's, when the leases cannot be listed; failed writes are in [`Released::failed`].
pub async fn release_host(
    store: &dyn LeaseStore,
    group: &GroupName,
    host: &HostName,
    row: Option<&Heartbeat>,
) -> Result<Released, LeaseError> {
    let listing = store.list(group).await?;
    let mut out = Released {
        malformed: listing.malformed,
        ..Released::default()
    };
    for lease in &listing.leases {
        let owned = lease.owner.as_ref() == Some(host);
        let asked = lease.next_owner.as_ref() == Some(host);
        if !owned && !asked {
            continue;
        }
        let mut next = Lease::clone(lease);
        next.next_owner = None;
        if owned {
            next.state = LeaseState::Available;
            next.owner = None;
        }
        match store.replace(&next, lease.version).await {
            Ok(_) if owned => out.released.push(Lease::clone(lease)),
            Ok(_) => out.cleared.push(lease.key.clone()),
            Err(err) => out.failed.push(err),
        }
    }
    if let Some(row) = row {
        out.heartbeat = Some(
            store
                .remove_heartbeat(group, host, &row.incarnation, row.version)
                .await,
        );
    }
    Ok(out)
}

/// Why [`reset_lease`] wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// No such lease.
    #[error("lease {0}: not found")]
    NotFound(LeaseKey),
    /// A host owns it and the reset was not forced.
    #[error("lease {key} is owned by {owner}")]
    Owned {
        /// The lease.
        key: LeaseKey,
        /// Its owner, as the row names it.
        owner: String,
    },
    /// The row cannot be read (see [`LeaseError::Malformed`]).
    #[error("lease {key}: malformed row: {reason}")]
    Malformed {
        /// The lease.
        key: LeaseKey,
        /// What is wrong with the row.
        reason: String,
    },
    /// The store refused or failed the write; a conflict means the lease changed meanwhile.
    #[error(transparent)]
    Store(#[from] LeaseError),
}

/// Moves `key`'s checkpoint to `continuation` (and its start position to `start`), by
/// compare-and-swap on the version read. An owned lease is refused unless `force`, which
/// clears the owner too (its worker stops and a host takes the lease again from the new
/// position); a finished lease becomes available again. Returns the row before and after.
///
/// # Errors
/// [`ResetError`].
pub async fn reset_lease(
    store: &dyn LeaseStore,
    key: &LeaseKey,
    continuation: Option<Continuation>,
    start: Position,
    force: bool,
) -> Result<(Lease, Lease), ResetError> {
    let lease = match store.get(key).await {
        Ok(Some(lease)) => lease,
        Ok(None) => return Err(ResetError::NotFound(key.clone())),
        Err(LeaseError::Malformed { reason, .. }) => {
            return Err(ResetError::Malformed {
                key: key.clone(),
                reason,
            })
        }
        Err(other) => return Err(other.into()),
    };
    if lease.state == LeaseState::Owned && !force {
        return Err(ResetError::Owned {
            key: key.clone(),
            owner: lease
                .owner
                .as_ref()
                .map_or_else(|| "-".to_string(), HostName::to_string),
        });
    }
    let mut next = lease.clone();
    next.continuation = continuation;
    next.start = start;
    if next.state != LeaseState::Available {
        // Forced, or a finished lease read again: nobody owns it until a host takes it.
        next.state = LeaseState::Available;
        next.owner = None;
        next.next_owner = None;
    }
    let stored = store.replace(&next, lease.version).await?;
    Ok((lease, stored))
}

#[cfg(test)]
mod tests;
