//! `--strategy`: how the hosts of a group balance their leases.

use changefeed::processor::Settings;

use super::UsageError;

/// The balancing strategy `run` builds its processor with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Equal lease counts (`EqualShare`), within `min_leases` and `max_leases`.
    #[default]
    Equal,
    /// Measured load against each host's capacity (`LoadShare`): every host publishes its
    /// leases' loads with its heartbeat and reads the others' each cycle.
    Load,
}

/// Reads `--strategy` and adjusts `settings` to it: `load` publishes the loads it balances,
/// and refuses the lease limits, which only `equal` applies.
pub(super) fn resolve(
    value: Option<&str>,
    settings: &mut Settings,
) -> Result<Strategy, UsageError> {
    let strategy = match value.map(str::trim) {
        None | Some("equal") => Strategy::Equal,
        Some("load") => Strategy::Load,
        Some(other) => {
            return Err(UsageError(format!(
                "strategy: {other:?} is not a strategy: equal (the same number of leases per host) or load (measured load against each host's capacity)"
            )))
        }
    };
    if strategy == Strategy::Load {
        if settings.min_leases > 0 || settings.max_leases.is_some() {
            return Err(UsageError(
                "strategy: load balances measured load and applies no lease limits; drop min_leases and max_leases, or use --strategy equal".into(),
            ));
        }
        settings.publish_load = true;
    }
    Ok(strategy)
}
