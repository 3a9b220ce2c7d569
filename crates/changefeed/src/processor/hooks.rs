//! Deliberately broken variants of the processor, for the simulator to prove its checker
//! catches them (feature `sim` only; without it [`Hooks`] is empty and every check is `false`).

/// A deliberate bug the simulator can switch on, to show its invariant checker catches it.
#[cfg(feature = "sim")]
#[doc(hidden)]
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
}

/// The broken variant a processor runs with; zero-sized and inert without feature `sim`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hooks {
    #[cfg(feature = "sim")]
    pub(crate) broken: Broken,
}

impl Hooks {
    /// Workers ignore the fence.
    pub(crate) fn no_fencing(self) -> bool {
        #[cfg(feature = "sim")]
        {
            self.broken == Broken::NoFencing
        }
        #[cfg(not(feature = "sim"))]
        {
            false
        }
    }

    /// Checkpoints overwrite on conflict.
    pub(crate) fn checkpoint_without_cas(self) -> bool {
        #[cfg(feature = "sim")]
        {
            self.broken == Broken::CheckpointWithoutCas
        }
        #[cfg(not(feature = "sim"))]
        {
            false
        }
    }

    /// The handler call runs to its end whatever the fence says.
    pub(crate) fn no_handler_fence(self) -> bool {
        #[cfg(feature = "sim")]
        {
            self.broken == Broken::NoHandlerFence
        }
        #[cfg(not(feature = "sim"))]
        {
            false
        }
    }

    /// Children do not wait for their parents.
    pub(crate) fn child_before_parent(self) -> bool {
        #[cfg(feature = "sim")]
        {
            self.broken == Broken::ChildBeforeParent
        }
        #[cfg(not(feature = "sim"))]
        {
            false
        }
    }
}
