//! Who is in a group: each host's heartbeat row, the rows read together, and the membership
//! view its leader keeps.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{GroupName, HostName, Timestamp, Version};

/// One live host's membership row: written by the host once per renew interval.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The group.
    pub group: GroupName,
    /// The host.
    pub host: HostName,
    /// Random per process start: tells a restart, or a second process with the same name,
    /// from the host that wrote the row before. Shared text: every host reads every row each
    /// cycle.
    pub incarnation: Arc<str>,
    /// Bumped by every write; observers judge liveness by watching it change (design rule 2).
    pub version: Version,
    /// The writer's own wall clock at the write. For display only; never compared across hosts.
    pub written_at: Timestamp,
    /// What the host published about itself with this renewal, if anything: a
    /// [`HostReport`](super::HostReport) as JSON, kept as text by the stores (they neither
    /// read nor check it) and parsed by its readers with
    /// [`HostReport::parse`](super::HostReport::parse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<Arc<str>>,
}

/// What a host reads every acquire cycle: the live membership and the group's change counter,
/// in one read whose size grows with the number of hosts, not of leases.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Membership {
    /// Every heartbeat row of the group, ordered by host name.
    pub hosts: Vec<Heartbeat>,
    /// Bumped by every write that creates, deletes, or changes who owns a lease of the group
    /// (not by checkpoints). If it has not moved since a host's last `list`, that list is still
    /// accurate as far as ownership goes.
    pub change_counter: u64,
}

/// The leader's judgment of the fleet, which the other hosts read instead of every heartbeat
/// (`docs/protocol.md`, "The membership view").
///
/// The leader reads every heartbeat, judges liveness on its own clock (rule 2), and writes
/// the view by compare-and-swap on [`MembershipView::version`] when its judgment changes, and
/// every few renewals otherwise, copying its own heartbeat version so that the others can
/// judge whether the leader lives from the view alone.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct MembershipView {
    /// Bumped by every write of the view; the compare-and-swap is on it.
    pub version: u64,
    /// The host that wrote it.
    pub leader: HostName,
    /// The leader's incarnation.
    pub leader_incarnation: Arc<str>,
    /// The leader's own heartbeat version when it wrote the view: observers judge the
    /// leader's liveness from it as from its heartbeat row (it was written after that row).
    pub leader_heartbeat: Version,
    /// The hosts judged live, each with the incarnation seen, sorted by name. A host takes and
    /// asks for leases only once a view lists it with its own incarnation.
    pub live: Vec<ViewHost>,
    /// The hosts judged dead that may still own leases, sorted: their leases are free. An
    /// owner in neither list is unknown, and its leases are left alone.
    pub dead: Vec<HostName>,
}

/// A live host in a [`MembershipView`].
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ViewHost {
    /// The host.
    pub host: HostName,
    /// Its incarnation when the leader judged it live.
    pub incarnation: Arc<str>,
    /// The host's own lease limits, as its heartbeat report published them: the leader copies
    /// them here so that hosts reading the view alone plan every host with its own limits.
    /// `None`: it publishes no limit (or no readable report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<HostLimits>,
}

/// A host's own `min_leases` and `max_leases`, as it publishes them (see
/// [`HostReport`](super::HostReport)).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct HostLimits {
    /// Its `min_leases`, if it sets one.
    #[serde(rename = "min", default, skip_serializing_if = "Option::is_none")]
    pub min_leases: Option<usize>,
    /// Its `max_leases`, if it sets one.
    #[serde(rename = "max", default, skip_serializing_if = "Option::is_none")]
    pub max_leases: Option<usize>,
}

impl HostLimits {
    /// These limits, or `None` when they limit nothing.
    pub fn some(self) -> Option<Self> {
        (self != Self::default()).then_some(self)
    }
}

impl ViewHost {
    /// `host` live with `incarnation`, publishing no limit.
    pub fn new(host: HostName, incarnation: Arc<str>) -> Self {
        ViewHost {
            host,
            incarnation,
            limits: None,
        }
    }
}

impl MembershipView {
    /// Whether the view lists `host` live with `incarnation`: the host may take leases.
    pub fn admits(&self, host: &HostName, incarnation: &str) -> bool {
        self.live
            .binary_search_by(|h| h.host.cmp(host))
            .is_ok_and(|i| &*self.live[i].incarnation == incarnation)
    }

    /// The live hosts' names, sorted.
    pub fn live_hosts(&self) -> Vec<HostName> {
        self.live.iter().map(|h| h.host.clone()).collect()
    }

    /// Whether the judgment (leader, live, dead) equals `other`'s, whatever the versions.
    pub fn same_judgment(&self, other: &MembershipView) -> bool {
        self.leader == other.leader
            && self.leader_incarnation == other.leader_incarnation
            && self.live == other.live
            && self.dead == other.dead
    }
}

/// What a host reads every acquire cycle from a store that keeps a membership view: one small
/// row with the group's change counter and the view, read together.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct GroupHead {
    /// The group's change counter (see [`Membership::change_counter`]).
    pub change_counter: u64,
    /// The membership view, if a leader has written one.
    pub view: Option<MembershipView>,
}
