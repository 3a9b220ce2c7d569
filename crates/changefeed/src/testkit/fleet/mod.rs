//! The fleet scenarios every backend runs, on the fleet harness ([`Fleet`], re-exported from
//! `changefeed::fleet`): several processors on one lease store and one in-memory feed,
//! started, crashed, stopped and restarted by name, checked against what they delivered.
//!
//! [`LedgerKit`] (the default kit of [`Fleet`] here) gives each host the backend's store behind
//! a [`Faulty`] switch and a handler that records every delivery in a [`Ledger`]. The fleet
//! scenarios (the `scenario_*` functions) drive it; each takes a [`StoreFactory`] and a
//! [`Timing`], the one backend difference they admit.
//!
//! A scenario is written in scenario time: the settings of [`scenario_settings`] (10 s expiry,
//! 2 s cycles), its waits and the bounds it asserts. The [`Timing`] argument says how that time
//! passes: [`Timing::Paused`] on paused tokio time (`#[tokio::test(start_paused = true)]`), or
//! [`Timing::Real`] for a store on a real server.

mod faulty;
mod ledger;
mod scenarios;

pub use crate::fleet::{Companion, HostKit, HostStart, StoreFactory, Timing, KEYS, WALL_ORIGIN};
pub use faulty::{FaultMode, Faulty};
pub use ledger::{Delivery, Ledger, LedgerKit};
pub use scenarios::{
    assert_balanced, scenario_cut_off_host_fences_before_takeover,
    scenario_duplicate_host_refused_restart_takes_back, scenario_graceful_stop_and_resume,
    scenario_killed_host_leases_taken_in_one_cycle,
    scenario_newcomer_after_crash_moves_only_its_share,
    scenario_owner_blind_to_request_stops_before_steal, scenario_rebalance_on_arrivals,
    scenario_settings, watch_moves,
};

/// The fleet harness; with no kit named, the scenarios' [`LedgerKit`].
pub type Fleet<K = LedgerKit> = crate::fleet::Fleet<K>;
