//! Whether a lease may be read now (design rule 5, "parents first"), and the rule the
//! processor reads children by.

use crate::model::{Lease, LeaseState, PartitionId};

/// Whether a child waits for its parents (design rule 5). The processor always waits; a
/// build with feature `sim-broken` adds `Ignore` for the simulator's deliberately broken
/// variant, to show its checker catches a child read too early.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) enum ParentsRule {
    /// A child is read only once every listed parent is finished.
    #[default]
    Wait,
    /// Parents are not waited for (broken on purpose).
    #[cfg(feature = "sim-broken")]
    Ignore,
}

/// Whether `lease` may be read now: it is not finished, and every parent `listed` knows of is
/// finished (a parent no longer listed was deleted after its children started, or never had a
/// lease: it counts as finished). Design rule 5, "parents first".
pub fn ready_to_read<'a>(
    lease: &Lease,
    listed: impl Fn(&PartitionId) -> Option<&'a Lease>,
) -> bool {
    ready_under(lease, listed, ParentsRule::Wait)
}

/// [`ready_to_read`] under `parents`: with [`ParentsRule::Wait`] the same.
pub(crate) fn ready_under<'a>(
    lease: &Lease,
    listed: impl Fn(&PartitionId) -> Option<&'a Lease>,
    parents: ParentsRule,
) -> bool {
    let wait = match parents {
        ParentsRule::Wait => true,
        #[cfg(feature = "sim-broken")]
        ParentsRule::Ignore => false,
    };
    lease.state != LeaseState::Finished
        && (!wait
            || lease
                .parents
                .iter()
                .all(|p| listed(p).is_none_or(|parent| parent.state == LeaseState::Finished)))
}
