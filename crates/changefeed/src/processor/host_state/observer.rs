//! What one reader of a group knows of its members, and how it judges them: [`GroupObserver`].

use std::time::Duration;

use super::liveness::Liveness;
use super::view::Members;
use crate::clock::Instant;
use crate::model::{HostName, Membership, MembershipView};

/// What one reader of a group knows of its members, on the reader's own clock: the
/// membership view last read (and when it last moved) and each host's heartbeat (and since
/// when it has stood still). The hosts judge the fleet by it, and so do the console and the
/// operator commands, so none of them can judge a host differently from the others.
///
/// Pure: every reading and every judgment takes the time as an argument.
#[derive(Debug, Clone, Default)]
pub struct GroupObserver {
    pub(crate) members: Members,
    pub(crate) liveness: Liveness,
}

impl GroupObserver {
    /// Takes in the view of a head read that returned at `now`. Returns whether it is newer
    /// than the one known (by its version, or by its copy of the leader's heartbeat). The
    /// leader's heartbeat copied into the view counts as a sighting of its row, so a reader
    /// that has to judge the leader itself (the view went stale) can do so at once.
    pub fn observe_view(&mut self, view: Option<&MembershipView>, now: Instant) -> bool {
        let before = self.moved_marker();
        self.members.observe(view, now);
        if let Some(view) = view {
            self.liveness.observe_copy(
                &view.leader,
                &view.leader_incarnation,
                view.leader_heartbeat,
                now,
            );
        }
        self.moved_marker() != before
    }

    fn moved_marker(&self) -> Option<(u64, crate::model::Version)> {
        self.members.view().map(|v| (v.version, v.leader_heartbeat))
    }

    /// Takes in a read of every heartbeat that returned at `now`.
    pub fn observe_heartbeats(&mut self, membership: &Membership, now: Instant) {
        self.liveness.observe(membership, now);
    }

    /// The view last read, if any.
    pub fn view(&self) -> Option<&MembershipView> {
        self.members.view()
    }

    /// Whether the view decides who is live at `now`: there is one, it moved within
    /// `expiry` (its leader keeps it), and it lists its leader live. Otherwise each reader
    /// judges from the heartbeats.
    pub fn by_view(&self, now: Instant, expiry: Duration) -> bool {
        !self.members.leaderless(now, expiry)
    }

    /// The hosts whose heartbeat moved less than `expiry` before `at`, sorted by name.
    pub fn live_by_heartbeats(&self, at: Instant, expiry: Duration) -> Vec<HostName> {
        self.liveness.live(at, expiry)
    }

    /// Since when `host`'s heartbeat has stood still, if it was ever seen.
    pub fn standing_since(&self, host: &HostName) -> Option<Instant> {
        self.liveness.changed_at(host)
    }

    /// Whether the view judges `host` dead (its leases are free).
    pub fn dead_by_view(&self, host: &HostName) -> bool {
        self.members.is_dead(host)
    }
}
