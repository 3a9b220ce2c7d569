//! What the host's machine asks of its shell, and what the shell answers: the vocabulary of
//! [`HostState::ready`] and [`HostState::advance`].
//!
//! A cycle is a sequence of [`Call`]s, each a store or source request the shell makes and
//! answers with an [`Answer`]; between calls, the machine asks for [`Effect`]s, which need no
//! answer (telling a worker, starting one, a metric). The order of both is the safety
//! argument, and it is decided here, not in the shell.
//!
//! [`HostState::ready`]: super::HostState::ready
//! [`HostState::advance`]: super::HostState::advance

use std::sync::Arc;

use crate::clock::Instant;
use crate::error::LeaseError;
use crate::lease::{Changes, Listing};
use crate::model::{
    GroupHead, Heartbeat, HostName, Lease, Membership, MembershipView, PartitionId, Version,
};

use super::TakeKind;

/// The shell's reading of the time and of its fence when it hands the machine control.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    pub at: Instant,
    /// Whether the fence is raised or its deadline has passed at `at`.
    pub fenced: bool,
    /// How many lapses the fence has counted (renewals sent after the deadline had passed).
    pub lapses: u64,
}

/// What a cycle reads first: the head row (the change counter and the membership view) from a
/// store that keeps a view, every heartbeat from one that does not.
#[derive(Debug, Clone)]
pub(crate) enum HeadRead {
    Head(GroupHead),
    Heartbeats(Membership),
}

impl HeadRead {
    pub(crate) fn change_counter(&self) -> u64 {
        match self {
            HeadRead::Head(h) => h.change_counter,
            HeadRead::Heartbeats(m) => m.change_counter,
        }
    }
}

/// Why a lease row is written, for the shell's log and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    /// Claiming again a lease the table says is ours but no worker runs.
    Resume,
    /// Taking a lease (`kind`) from `previous`, its owner as listed.
    Take {
        kind: TakeKind,
        previous: Option<HostName>,
    },
    /// Asking `from` to hand the lease over.
    Request { from: HostName },
}

/// One request to the store or the source; the shell answers each with an [`Answer`].
#[derive(Debug, Clone)]
pub(crate) enum Call {
    /// The head row, or every heartbeat when the store keeps no view ([`Answer::Head`]).
    ReadHead,
    /// Every heartbeat ([`Answer::Membership`]).
    Membership,
    /// The rows that changed hands since `since` ([`Answer::Changes`]); `after_sync`: to see
    /// what the leader's partition sync wrote.
    ListChanges { since: u64, after_sync: bool },
    /// Every lease ([`Answer::Listed`]).
    ListAll { after_sync: bool },
    /// The membership view, by CAS on `expected` ([`Answer::ViewWritten`]); `changed`: it
    /// judges differently from the view last read (a renewal otherwise).
    WriteView {
        view: MembershipView,
        expected: u64,
        changed: bool,
    },
    /// The leader's partition sync over `rows`, listed at `counter` ([`Answer::Synced`]).
    Sync {
        rows: Vec<Arc<Lease>>,
        counter: Option<u64>,
        now: Instant,
    },
    /// The lag of the partitions no host reads ([`Answer::Done`]).
    EstimateUnowned { rows: Vec<Arc<Lease>> },
    /// A dead host's heartbeat row, by CAS on its version ([`Answer::Done`]).
    RemoveHeartbeat(Heartbeat),
    /// A lease row, by CAS on `expected` ([`Answer::Written`]).
    Write {
        next: Lease,
        expected: Version,
        why: Why,
    },
}

/// The outcome of a [`Call`]. Failures the shell has already reported (logged and passed to
/// the error callback) come back as `None`.
#[derive(Debug)]
pub(crate) enum Answer {
    Head(Option<HeadRead>),
    Membership(Option<Membership>),
    Changes(Result<Option<Changes>, LeaseError>),
    Listed(Result<Listing, LeaseError>),
    ViewWritten(Result<MembershipView, LeaseError>),
    /// Whether the sync succeeded, and whether it changed the lease table.
    Synced {
        ok: bool,
        changed: bool,
    },
    Written(Result<Lease, LeaseError>),
    /// A call whose outcome decides nothing.
    Done,
}

/// What the shell carries out between calls, in order, without answering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Tell a running worker of a newer row of its lease (a hand-off request, a new owner).
    Hint(Lease),
    /// Stop a worker: its lease was deleted.
    Stop(PartitionId),
    /// Stop a worker: the plan gives its lease up.
    Release(PartitionId),
    /// Start a worker on a lease this host now owns.
    StartWorker(Lease),
    /// The workers know of every hand-off request written before the cycle's first read,
    /// sent at this instant (see `heartbeat::ViewStamp`).
    Confirm(Instant),
    /// Renew the heartbeat as the view's leader until then (`None`: as a plain member).
    LeadUntil(Option<Instant>),
    /// This host no longer leads: forget the partition sync's plan and cleanup timers.
    SyncReset,
    /// This host no longer leads: the lag of unowned partitions is another host's to report.
    UnownedLagCleared,
    /// Publish the gauges: leases owned, malformed rows, lag.
    Gauges,
}

/// What the shell must do now: the effects, in order, then at most one call to answer with
/// [`HostState::advance`](super::HostState::advance). No call: the cycle is over.
#[derive(Debug, Default)]
pub(crate) struct Ready {
    pub effects: Vec<Effect>,
    pub call: Option<Call>,
}
