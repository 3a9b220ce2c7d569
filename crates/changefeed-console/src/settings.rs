//! How the console reads the store and judges hosts.

use std::time::Duration;

/// How the console reads and judges.
#[derive(Debug, Clone)]
pub struct Settings {
    /// A full list (checkpoints and lag) at least this often.
    pub list_every: Duration,
    /// A heartbeat standing still this long: the host has fenced itself
    /// (`lease_expiry − safety_margin`).
    pub fence_after: Duration,
    /// A heartbeat standing still this long: its leases are free (`lease_expiry`).
    pub expire_after: Duration,
    /// A hand-off request pending this long may be stolen (`handoff_timeout`).
    pub handoff_timeout: Duration,
    /// How much history the timeline keeps.
    pub window: Duration,
    /// With a membership view, the heartbeat rows are read at least this often (and whenever
    /// the view's version moves), for the heartbeat ages shown.
    pub heartbeats_every: Duration,
}

impl Settings {
    /// Judging hosts by a fleet's own timing settings (`lease_expiry`, `safety_margin`,
    /// `handoff_timeout`), listing every 30 s, reading heartbeats every 20 s, five minutes of
    /// history.
    #[must_use]
    pub fn for_fleet(fleet: &changefeed::processor::Settings) -> Self {
        Self {
            list_every: Duration::from_secs(30),
            fence_after: fleet.lease_expiry.saturating_sub(fleet.safety_margin),
            expire_after: fleet.lease_expiry,
            handoff_timeout: fleet.handoff_timeout,
            window: Duration::from_secs(300),
            heartbeats_every: Duration::from_secs(20),
        }
    }
}

impl Default for Settings {
    /// [`Settings::for_fleet`] of a fleet at the library's default settings.
    fn default() -> Self {
        Self::for_fleet(&changefeed::processor::Settings::default())
    }
}

/// How a host's liveness is judged at a refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// From the membership view, which its leader keeps fresh.
    View,
    /// From the heartbeat rows, on the console's clock: the store keeps no view, or no leader
    /// keeps it fresh.
    Heartbeats,
}

impl Judged {
    /// The name the API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Judged::View => "view",
            Judged::Heartbeats => "heartbeats",
        }
    }
}
