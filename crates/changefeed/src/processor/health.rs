//! A host's health for probes: [`Health`], read through a [`HealthProbe`] or
//! [`super::ProcessorHandle::health`].
//!
//! It owns nothing of the host's decisions: it reads the record the heartbeat task keeps (the
//! fence deadline, whether the fence is raised, whether the heartbeat row is in the store) on
//! the processor's clock, by the same rule the workers obey, and adds whether the processor is
//! stopping. Readiness therefore says what the host's workers do: a ready host may deliver, and
//! one that is not has stopped delivering (or never started).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::heartbeat::FenceDeadline;
use crate::clock::Clock;

/// A processor host's health at one moment, as an orchestrator's probes ask for it.
///
/// The host is [ready](Health::is_ready) while it is registered (its heartbeat row is written),
/// not fenced and not stopping. *Fenced* includes a stale heartbeat: a host fences itself once
/// its last successful heartbeat was sent `lease_expiry − safety_margin` ago (see
/// [`super::Settings::safety_margin`]), so "heartbeat fresh" and "not fenced" are one rule, the
/// one its workers stop by. Readiness comes back by itself: when a heartbeat succeeds again
/// (the host registers afresh if its row was removed while it was cut off), the fence is
/// lowered and the host is ready again.
///
/// Its [`Display`](std::fmt::Display) is one short line for a probe's answer:
/// `ready: heartbeat 0.4s ago`, `not ready: fenced: last successful heartbeat 4.1s ago`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// Whether this host's heartbeat row is in the store, as far as the host knows: false
    /// before the first heartbeat is written (while registering, which waits out a previous
    /// incarnation's row of the same name), after the host found its row removed until it has
    /// written a new one, and once the processor has ended.
    pub registered: bool,
    /// How long ago the last heartbeat that counted (the registration, or a renewal that
    /// returned in time) was sent; `None` before the host registered.
    pub heartbeat_age: Option<Duration>,
    /// Whether the host is fenced now: its last successful heartbeat is older than
    /// `lease_expiry − safety_margin`, or its heartbeat task has raised the fence. Its workers
    /// deliver nothing while it is. False before the host registered (there is nothing to fence
    /// yet).
    pub fenced: bool,
    /// Whether the processor is stopping (a graceful stop has begun) or has ended.
    pub stopping: bool,
}

impl Health {
    /// Whether the host is ready: registered, not fenced and not stopping.
    pub fn is_ready(&self) -> bool {
        self.registered && !self.fenced && !self.stopping
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let age = self
            .heartbeat_age
            .map(|a| Duration::from_millis(a.as_millis() as u64));
        match (self.is_ready(), age) {
            (true, Some(age)) => write!(f, "ready: heartbeat {age:.1?} ago"),
            (true, None) => write!(f, "ready"),
            _ if self.stopping => write!(f, "not ready: stopping"),
            (false, None) => write!(f, "not ready: not registered yet"),
            _ if !self.registered => {
                write!(f, "not ready: heartbeat row removed; registering again")
            }
            (false, Some(age)) => {
                write!(
                    f,
                    "not ready: fenced: last successful heartbeat {age:.1?} ago"
                )
            }
        }
    }
}

/// Reads a processor host's [`Health`]; cheap to clone and to call, from any thread.
///
/// From [`super::Processor::health_probe`] (before [`super::Processor::run`], for a program that
/// runs the processor itself) or [`super::ProcessorHandle::health_probe`].
#[derive(Debug, Clone)]
pub struct HealthProbe(pub(crate) Arc<HealthCell>);

impl HealthProbe {
    /// The host's health now, on the processor's clock.
    pub fn health(&self) -> Health {
        self.0.read()
    }
}

/// What the processor's tasks write for [`HealthProbe`]: the host's fence record once it has
/// registered, and whether it is stopping or has ended.
#[derive(Debug)]
pub(crate) struct HealthCell {
    clock: Arc<dyn Clock>,
    /// `lease_expiry − safety_margin`: the fence deadline is the last counted heartbeat's
    /// sending plus this.
    fence_after: Duration,
    state: Mutex<CellState>,
}

#[derive(Debug, Default)]
struct CellState {
    fence: Option<FenceDeadline>,
    stopping: bool,
    ended: bool,
}

impl HealthCell {
    pub(crate) fn new(clock: Arc<dyn Clock>, fence_after: Duration) -> Self {
        Self {
            clock,
            fence_after,
            state: Mutex::new(CellState::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CellState> {
        // The lock only guards plain values; a poisoned lock still holds valid ones.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host registered; `fence` is the record its heartbeat task keeps from now on.
    pub(crate) fn registered(&self, fence: FenceDeadline) {
        self.lock().fence = Some(fence);
    }

    /// A graceful stop has begun.
    pub(crate) fn stopping(&self) {
        self.lock().stopping = true;
    }

    /// The processor has ended (or its future was dropped).
    pub(crate) fn ended(&self) {
        let mut state = self.lock();
        state.stopping = true;
        state.ended = true;
    }

    fn read(&self) -> Health {
        let state = self.lock();
        let Some(fence) = &state.fence else {
            return Health {
                registered: false,
                heartbeat_age: None,
                fenced: false,
                stopping: state.stopping,
            };
        };
        let now = self.clock.now();
        let sent = fence.get().checked_sub(self.fence_after);
        Health {
            registered: fence.is_registered() && !state.ended,
            heartbeat_age: sent.map(|at| now.saturating_duration_since(at)),
            fenced: fence.is_fenced(now),
            stopping: state.stopping,
        }
    }
}

/// Marks the processor ended when dropped: when its future completes, fails or is dropped.
#[derive(Debug)]
pub(crate) struct EndGuard(pub(crate) Arc<HealthCell>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.0.ended();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(registered: bool, age: Option<u64>, fenced: bool, stopping: bool) -> Health {
        Health {
            registered,
            heartbeat_age: age.map(Duration::from_millis),
            fenced,
            stopping,
        }
    }

    #[test]
    fn ready_only_when_registered_unfenced_and_running_and_says_why_not() {
        // The readiness rule, and the one-line reason a probe answers with.
        let cases = [
            (
                health(true, Some(400), false, false),
                true,
                "ready: heartbeat 400.0ms ago",
            ),
            (
                health(false, None, false, false),
                false,
                "not ready: not registered yet",
            ),
            (
                health(true, Some(4_120), true, false),
                false,
                "not ready: fenced: last successful heartbeat 4.1s ago",
            ),
            (
                health(false, Some(9_000), true, false),
                false,
                "not ready: heartbeat row removed; registering again",
            ),
            (
                health(true, Some(100), false, true),
                false,
                "not ready: stopping",
            ),
        ];
        for (h, ready, text) in cases {
            assert_eq!(h.is_ready(), ready, "{h:?}");
            assert_eq!(h.to_string(), text, "{h:?}");
        }
    }
}
