//! How a fleet's time passes: paused tokio time, or real time sped up for a store on a server.

use std::time::Duration;

use crate::processor::{CheckpointMode, Settings};

/// How a scenario's time passes: the backend difference the fleet scenarios take as an
/// argument, as the conformance suites take fixture flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Paused tokio time: scenario time is tokio time, exactly, and every bound is asserted as
    /// written. The test must run on a paused runtime (`start_paused = true`).
    Paused,
    /// Real time, for a store on a real server: every duration of the scenario (the hosts'
    /// settings, its waits) is divided by `speedup`, and each tight bound it asserts is widened
    /// for store round trips and scheduling: `allowance` of real time is added to an upper
    /// bound ("owned again within …"), a quarter of it taken off a lower bound ("not taken
    /// before …"). Safety checks (no delivery after a takeover, no continuation moving back)
    /// are not widened.
    Real {
        /// How many times faster than scenario time the hosts run (at least 1).
        speedup: u32,
        /// Real time added to each tight upper bound (a quarter of it taken off a lower one).
        allowance: Duration,
    },
}

impl Timing {
    fn speedup(self) -> u32 {
        match self {
            Timing::Paused => 1,
            Timing::Real { speedup, .. } => speedup.max(1),
        }
    }

    /// `d` of scenario time as it passes on the tokio clock.
    pub fn real(self, d: Duration) -> Duration {
        d / self.speedup()
    }

    /// `d` of the tokio clock in scenario time.
    pub fn scenario(self, d: Duration) -> Duration {
        d * self.speedup()
    }

    /// The allowance in scenario time, added to upper bounds (zero on paused time).
    pub fn allowance(self) -> Duration {
        match self {
            Timing::Paused => Duration::ZERO,
            Timing::Real { allowance, .. } => self.scenario(allowance),
        }
    }

    /// How much earlier a lower bound is checked, in scenario time (zero on paused time): a
    /// quarter of the allowance. Only the check's own round trips and a late wake-up can carry
    /// it past the event it bounds, and the bound must stay close to what it checks.
    pub fn early(self) -> Duration {
        self.allowance() / 4
    }

    /// `settings`, written in scenario time, as the hosts run them: every duration divided by
    /// the speed-up (unchanged on paused time).
    pub fn settings(self, settings: &Settings) -> Settings {
        let d = |d: Duration| self.real(d);
        let mut s = settings.clone();
        s.lease_expiry = d(s.lease_expiry);
        s.renew_interval = d(s.renew_interval);
        s.safety_margin = d(s.safety_margin);
        s.acquire_interval = d(s.acquire_interval);
        s.full_list_interval = d(s.full_list_interval);
        s.poll_delay = d(s.poll_delay);
        s.handoff_timeout = d(s.handoff_timeout);
        if let CheckpointMode::Interval(i) = s.checkpoint_mode {
            s.checkpoint_mode = CheckpointMode::Interval(d(i));
        }
        s.handler_timeout = s.handler_timeout.map(d);
        s.shutdown_timeout = d(s.shutdown_timeout);
        s.min_backoff = d(s.min_backoff);
        s.max_backoff = d(s.max_backoff);
        s.sync_interval = d(s.sync_interval);
        s.cleanup_delay = d(s.cleanup_delay);
        s
    }
}
