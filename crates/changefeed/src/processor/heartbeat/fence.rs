//! The host's fence record: whether its workers may still deliver and write, the lapses, and
//! since when its heartbeat row has been missing; written by the heartbeat task only.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// This host's fence: the one record of whether its workers may still deliver and write.
///
/// The host is fenced from `lease_expiry − safety_margin` after its last successful heartbeat
/// was sent (the *deadline*), and while the heartbeat task holds the fence *raised* (its timer
/// saw the deadline pass, or its row was taken over) until a renewal lowers it. Only the
/// heartbeat task ([`run`]) writes the record; workers and the host loop read it themselves
/// on their own reading of the clock, so a host that wakes from a long stall (a GC pause, a
/// suspended VM) is fenced at once, whichever of its tasks runs first. The `fenced` watch the
/// heartbeat task sends alongside only wakes tasks that wait; it decides nothing.
///
/// It also counts *lapses*: renewals sent after the deadline had already passed. Other hosts
/// may have taken this host's leases during a lapse, so a worker started before one must stop
/// even though the deadline has moved forward again (after a stall, the heartbeat task may
/// renew before a worker gets to look at the clock): see [`FenceDeadline::fenced_since`].
///
/// It also notes since when the host's heartbeat row has been missing from the store, as far
/// as the heartbeat task knows, and how long the host may stay fenced or unregistered before
/// it is unhealthy (`max_unhealthy`); only the host's health reads those
/// ([`super::HealthProbe`], [`HealthReport`]), and they decide nothing.
#[derive(Debug, Clone)]
pub(crate) struct FenceDeadline(Arc<std::sync::Mutex<FenceState>>);

/// What keeps a host from working at one moment: fenced, unregistered, or both, and since
/// when. A host in trouble for longer than `max_unhealthy` without a break is unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trouble {
    /// The host is fenced, since its fence deadline (the last counted heartbeat's sending plus
    /// `lease_expiry − safety_margin`).
    pub(crate) fenced_at: Option<Instant>,
    /// The host's heartbeat row is not in the store, since it found it removed or taken over.
    pub(crate) unregistered_at: Option<Instant>,
    /// When this spell of trouble began: the earlier of the two.
    since: Instant,
}

impl Trouble {
    /// The trouble of a host fenced since `fenced_at` and unregistered since
    /// `unregistered_at`; `None` if it is neither.
    pub(crate) fn new(
        fenced_at: Option<Instant>,
        unregistered_at: Option<Instant>,
    ) -> Option<Self> {
        let since = match (fenced_at, unregistered_at) {
            (Some(f), Some(u)) => f.min(u),
            (Some(t), None) | (None, Some(t)) => t,
            (None, None) => return None,
        };
        Some(Self {
            fenced_at,
            unregistered_at,
            since,
        })
    }

    /// When this spell of trouble began: the earlier of the two. Both end together (a
    /// renewal cannot succeed without the row, and registering again lowers the fence), so
    /// the spell is unbroken from then on.
    pub(crate) fn since(&self) -> Instant {
        self.since
    }
}

#[derive(Debug, Clone, Copy)]
struct FenceState {
    /// The deadline.
    at: Instant,
    /// Renewals sent at or after the deadline they moved.
    lapses: u64,
    /// Raised by the heartbeat task, until a renewal lowers it.
    raised: bool,
    /// Since when the heartbeat row has not been in the store (from finding it removed or
    /// taken over until registering again); `None` while it is.
    unregistered_at: Option<Instant>,
    /// How long the host may be in [`Trouble`] without a break before it is unhealthy.
    max_unhealthy: Duration,
}

impl FenceDeadline {
    /// A record whose deadline is `at`, for a host that is unhealthy after `max_unhealthy` of
    /// trouble ([`super::Settings::unhealthy_after`]).
    pub(crate) fn new(at: Instant, max_unhealthy: Duration) -> Self {
        Self(Arc::new(std::sync::Mutex::new(FenceState {
            at,
            lapses: 0,
            raised: false,
            unregistered_at: None,
            max_unhealthy,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FenceState> {
        // The lock only guards plain copies; a poisoned lock still holds valid ones.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The deadline: fenced from then on unless a renewal moves it.
    pub(crate) fn get(&self) -> Instant {
        self.lock().at
    }

    /// How many lapses there have been.
    pub(crate) fn lapses(&self) -> u64 {
        self.lock().lapses
    }

    /// Whether this host is fenced at `now`: the fence is raised or its deadline has passed.
    pub(crate) fn is_fenced(&self, now: Instant) -> bool {
        let state = self.lock();
        state.raised || now >= state.at
    }

    /// Whether a task that began when there had been `lapses` lapses (read with
    /// [`FenceDeadline::lapses`]) must stop at `now`: the fence is raised, its deadline has
    /// passed, or the host has lapsed since.
    pub(crate) fn fenced_since(&self, now: Instant, lapses: u64) -> bool {
        let state = self.lock();
        state.raised || now >= state.at || state.lapses != lapses
    }

    /// Whether the heartbeat row is in the store, as far as the heartbeat task knows.
    pub(crate) fn is_registered(&self) -> bool {
        self.lock().unregistered_at.is_none()
    }

    /// How long the host may be in [`Trouble`] without a break before it is unhealthy.
    pub(crate) fn max_unhealthy(&self) -> Duration {
        self.lock().max_unhealthy
    }

    /// What keeps the host from working at `now`, if anything: fenced (its deadline has
    /// passed) or unregistered.
    pub(crate) fn trouble(&self, now: Instant) -> Option<Trouble> {
        let state = self.lock();
        // The fence is raised only once its deadline has passed, or when the row was taken
        // over, which marks the host unregistered too.
        Trouble::new((now >= state.at).then_some(state.at), state.unregistered_at)
    }

    /// A renewal sent at `sent` succeeded: the deadline moves to `at`, and if `sent` was past
    /// the old deadline, that was a lapse.
    pub(super) fn renewed(&self, sent: Instant, at: Instant) {
        let mut state = self.lock();
        if sent >= state.at {
            state.lapses += 1;
        }
        state.at = at;
    }

    pub(super) fn set(&self, at: Instant) {
        self.lock().at = at;
    }

    pub(super) fn set_raised(&self, raised: bool) {
        self.lock().raised = raised;
    }

    /// The heartbeat row was found missing at `now` (kept if it already was).
    pub(super) fn set_unregistered(&self, now: Instant) {
        let mut state = self.lock();
        state.unregistered_at.get_or_insert(now);
    }

    pub(super) fn set_registered(&self) {
        self.lock().unregistered_at = None;
    }
}

/// The heartbeat task's side of the fence: the record, and the watch that wakes the tasks
/// waiting for it. A raise is recorded before it rings and a lowering rings before it is
/// recorded, so a task the watch shows fenced reads the record fenced too.
pub(super) struct FenceWriter {
    pub(super) record: FenceDeadline,
    pub(super) doorbell: watch::Sender<bool>,
}

impl FenceWriter {
    pub(super) fn is_raised(&self) -> bool {
        self.record.lock().raised
    }

    pub(super) fn raise(&self) {
        self.record.set_raised(true);
        self.doorbell.send_replace(true);
    }

    pub(super) fn lower(&self) {
        self.doorbell.send_replace(false);
        self.record.set_raised(false);
    }
}
