//! Deliberately broken variants of the processor, for the simulator to prove its checker
//! catches them (feature `sim-broken` only: without it [`Hooks`] is zero-sized and every check
//! is a constant `false` the compiler removes, so no broken path is in a default build).

use crate::lineage::ParentsRule;

/// A deliberate bug the simulator can switch on, to show its invariant checker catches it.
#[cfg(feature = "sim-broken")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Broken {
    /// The real processor.
    #[default]
    None,
    /// Workers ignore the fence: a host cut off from the store keeps delivering.
    NoFencing,
    /// A checkpoint that loses its compare-and-swap overwrites the row anyway.
    CheckpointWithoutCas,
    /// Children are read without waiting for their parents to finish.
    ChildBeforeParent,
    /// The handler call is not raced against the fence: a host that stalls during a call
    /// finishes the call after another host has taken the lease (the bug the fence over the
    /// batch in flight fixes).
    NoHandlerFence,
    /// Hosts take and adopt leases before a membership view lists them live: a host that
    /// comes back under a name the view judged dead resumes its leases while the others still
    /// take them as a dead host's (the bug the admission rule fixes).
    NoAdmission,
    /// No store or source call is bounded ([`Settings::call_timeout`] is not applied), and
    /// the simulator's client has no per-call timeout of its own and returns a connection
    /// whose call was cancelled to its pool: after a network fault that leaves the pool's
    /// connections dead (a forgotten flow), every call hangs for ever and the host, up and
    /// connected, does nothing (the production bug the bounds and the client's fix address).
    ///
    /// [`Settings::call_timeout`]: super::Settings::call_timeout
    NoTimeouts,
}

/// The broken variant a processor runs with; zero-sized and inert without feature
/// `sim-broken`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hooks {
    #[cfg(feature = "sim-broken")]
    pub(crate) broken: Broken,
}

/// `Hooks::$name` is true when `$variant` is switched on; always false without feature
/// `sim-broken`.
macro_rules! check {
    ($(#[$doc:meta])* $name:ident => $variant:ident) => {
        $(#[$doc])*
        pub(crate) fn $name(self) -> bool {
            #[cfg(feature = "sim-broken")]
            {
                self.broken == Broken::$variant
            }
            #[cfg(not(feature = "sim-broken"))]
            {
                false
            }
        }
    };
}

impl Hooks {
    check!(
        /// Workers ignore the fence.
        no_fencing => NoFencing
    );
    check!(
        /// Checkpoints overwrite on conflict.
        checkpoint_without_cas => CheckpointWithoutCas
    );
    check!(
        /// The handler call runs to its end whatever the fence says.
        no_handler_fence => NoHandlerFence
    );
    check!(
        /// Hosts take before a membership view admits them.
        no_admission => NoAdmission
    );
    check!(
        /// Store and source calls are not bounded.
        no_timeouts => NoTimeouts
    );

    /// Whether children wait for their parents: always, unless `ChildBeforeParent` is on.
    pub(crate) fn parents_rule(self) -> ParentsRule {
        #[cfg(feature = "sim-broken")]
        if self.broken == Broken::ChildBeforeParent {
            return ParentsRule::Ignore;
        }
        ParentsRule::Wait
    }
}
