//! A host's health for probes: [`Health`], read through a [`HealthProbe`] or
//! [`super::ProcessorHandle::health`].
//!
//! It owns nothing of the host's decisions: it reads the record the heartbeat task keeps (the
//! fence deadline, whether the fence is raised, since when the heartbeat row has been missing
//! from the store) on the processor's clock, by the same rule the workers obey, and adds
//! whether the processor is stopping. Readiness therefore says what the host's workers do: a
//! ready host may deliver, and one that is not has stopped delivering (or never started).
//! Health in the liveness sense ([`Health::unhealthy`]) says whether that has lasted too long:
//! a host fenced or unregistered for longer than `max_unhealthy` is not recovering by itself.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::heartbeat::{FenceDeadline, Trouble};
use crate::clock::{Clock, Instant};
use crate::model::Timestamp;

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
    /// Set once the host has been fenced or unregistered, without a break, for longer than
    /// `max_unhealthy` (see [`super::Settings::max_unhealthy`]): its recovery has failed, and
    /// restarting the process is the remedy left. `None` while it is healthy, which includes
    /// being briefly fenced or unregistered (a store outage it rides out by itself), and once
    /// a stop has begun or the processor has ended.
    pub unhealthy: Option<Unhealthy>,
}

impl Health {
    /// Whether the host is ready: registered, not fenced and not stopping.
    pub fn is_ready(&self) -> bool {
        self.registered && !self.fenced && !self.stopping
    }

    /// Whether the host is healthy: not fenced or unregistered for longer than
    /// `max_unhealthy` ([`Health::unhealthy`] says why not).
    pub fn is_healthy(&self) -> bool {
        self.unhealthy.is_none()
    }
}

/// Why, and since when, a host is unhealthy: it has been fenced or unregistered, without a
/// break, for longer than `max_unhealthy`.
///
/// Its [`Display`](std::fmt::Display) is one line for a liveness probe's answer and the log:
/// `unhealthy: fenced: no successful heartbeat since 2024-05-01T11:59:52.000Z; fenced or
/// unregistered for 38.1s, longer than max_unhealthy (30s)`, or `unhealthy: not registered
/// since 2024-05-01T12:00:05.000Z; …` when its heartbeat row is gone. Times are this host's
/// wall clock, in UTC.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Unhealthy {
    /// What keeps the host from working.
    pub reason: UnhealthyReason,
    /// When the host became fenced or unregistered (whichever was first), on its wall clock.
    pub since: Timestamp,
    /// How long ago that was: more than [`Unhealthy::max_unhealthy`].
    pub duration: Duration,
    /// The `max_unhealthy` setting it was judged by.
    pub max_unhealthy: Duration,
}

/// What keeps an [`Unhealthy`] host from working.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnhealthyReason {
    /// Fenced: no heartbeat has succeeded (returned in time) for `lease_expiry −
    /// safety_margin` and more; its workers deliver nothing. Usually the store cannot be
    /// reached, or answers too slowly.
    Fenced {
        /// When the last successful heartbeat was sent, on this host's wall clock.
        last_heartbeat: Timestamp,
    },
    /// The host's heartbeat row is gone from the store (a peer judged it dead and removed it,
    /// or an operator released it) and registering again has not succeeded since.
    NotRegistered {
        /// When the host found its row gone, on its wall clock.
        since: Timestamp,
    },
}

impl Unhealthy {
    /// Judges `trouble` seen at `now` (wall time `wall`): unhealthy once it has lasted longer
    /// than `max_unhealthy`. `fence_after` is `lease_expiry − safety_margin`.
    pub(crate) fn judge(
        trouble: &Trouble,
        now: Instant,
        wall: Timestamp,
        fence_after: Duration,
        max_unhealthy: Duration,
    ) -> Option<Self> {
        let since = trouble.since();
        let duration = now.saturating_duration_since(since);
        if duration <= max_unhealthy {
            return None;
        }
        // A moment on the monotonic clock, on the wall clock as it reads now.
        let wall_of = |at: Instant| {
            let ago = now.saturating_duration_since(at).as_millis();
            Timestamp(
                wall.0
                    .saturating_sub(i64::try_from(ago).unwrap_or(i64::MAX)),
            )
        };
        let reason = match (trouble.unregistered_at, trouble.fenced_at) {
            (Some(at), _) => UnhealthyReason::NotRegistered { since: wall_of(at) },
            (None, Some(deadline)) => UnhealthyReason::Fenced {
                last_heartbeat: wall_of(deadline.checked_sub(fence_after).unwrap_or(deadline)),
            },
            (None, None) => return None,
        };
        Some(Self {
            reason,
            since: wall_of(since),
            duration,
            max_unhealthy,
        })
    }
}

impl std::fmt::Display for Unhealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, at) = match &self.reason {
            UnhealthyReason::Fenced { last_heartbeat } => {
                ("fenced: no successful heartbeat since", *last_heartbeat)
            }
            UnhealthyReason::NotRegistered { since } => ("not registered since", *since),
        };
        write!(
            f,
            "unhealthy: {what} {}; fenced or unregistered for {:.1?}, longer than max_unhealthy ({:?})",
            utc(at),
            Duration::from_millis(self.duration.as_millis() as u64),
            self.max_unhealthy
        )
    }
}

/// `t` as an RFC 3339 UTC time with milliseconds, e.g. `2024-05-01T12:00:00.000Z`.
fn utc(t: Timestamp) -> String {
    let ms = t.0.rem_euclid(1000);
    let secs = t.0.div_euclid(1000);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days: days since 1970-01-01 to a proleptic Gregorian date.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
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
                unhealthy: None,
            };
        };
        let now = self.clock.now();
        let sent = fence.get().checked_sub(self.fence_after);
        // A stopping host has given up recovering on purpose: its state is no failure.
        let unhealthy = match (state.stopping, fence.trouble(now)) {
            (false, Some(trouble)) => Unhealthy::judge(
                &trouble,
                now,
                self.clock.wall(),
                self.fence_after,
                fence.max_unhealthy(),
            ),
            _ => None,
        };
        Health {
            registered: fence.is_registered() && !state.ended,
            heartbeat_age: sent.map(|at| now.saturating_duration_since(at)),
            fenced: fence.is_fenced(now),
            stopping: state.stopping,
            unhealthy,
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
            unhealthy: None,
        }
    }

    #[test]
    fn utc_times_are_rfc_3339_with_milliseconds() {
        for (ms, text) in [
            (0, "1970-01-01T00:00:00.000Z"),
            (1_500, "1970-01-01T00:00:01.500Z"),
            (951_782_400_000, "2000-02-29T00:00:00.000Z"),
            (1_714_564_800_123, "2024-05-01T12:00:00.123Z"),
            (-1, "1969-12-31T23:59:59.999Z"),
        ] {
            assert_eq!(utc(Timestamp(ms)), text);
        }
    }

    #[test]
    fn unhealthy_only_after_max_unhealthy_of_unbroken_trouble_and_says_why_since_when() {
        // The rule /healthz answers by: fenced or unregistered for longer than max_unhealthy.
        let t0 = crate::clock::SystemClock.now();
        let fence_after = Duration::from_secs(8);
        let max = Duration::from_secs(30);
        let fenced = Trouble::new(Some(t0), None).expect("fenced");
        let wall_at = |after: Duration| Timestamp(1_714_564_800_000 + after.as_millis() as i64);
        // At exactly max_unhealthy: not yet.
        let at = t0 + max;
        assert_eq!(
            Unhealthy::judge(&fenced, at, wall_at(max), fence_after, max),
            None
        );
        let later = max + Duration::from_millis(100);
        let u = Unhealthy::judge(&fenced, t0 + later, wall_at(later), fence_after, max)
            .expect("unhealthy past max_unhealthy");
        assert_eq!(u.since, wall_at(Duration::ZERO));
        assert_eq!(u.duration, later);
        assert_eq!(
            u.reason,
            UnhealthyReason::Fenced {
                last_heartbeat: Timestamp(1_714_564_800_000 - 8_000)
            }
        );
        assert_eq!(
            u.to_string(),
            "unhealthy: fenced: no successful heartbeat since 2024-05-01T11:59:52.000Z; fenced or unregistered for 30.1s, longer than max_unhealthy (30s)"
        );
        // Fenced first, then the row found removed: the spell began with the fence, the
        // reason is the missing row.
        let both = Trouble::new(Some(t0), Some(t0 + Duration::from_secs(5))).expect("both");
        let u = Unhealthy::judge(&both, t0 + later, wall_at(later), fence_after, max)
            .expect("unhealthy");
        assert_eq!(u.since, wall_at(Duration::ZERO));
        assert_eq!(
            u.to_string(),
            "unhealthy: not registered since 2024-05-01T12:00:05.000Z; fenced or unregistered for 30.1s, longer than max_unhealthy (30s)"
        );
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
