//! Keeping this host alive, judging whether others are, and fencing.
//!
//! Liveness is per host (design, "The lease store seam"): each host writes one heartbeat row per
//! renew interval. An observer judges a host dead when it has seen the same heartbeat version
//! for `lease_expiry` on its *own* monotonic clock (rule 2), so no two clocks are ever compared.
//! A host whose last successful heartbeat was *sent* `lease_expiry − safety_margin` ago fences
//! itself: its workers stop before any observer can judge it dead (rule 3).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

mod liveness;

pub use liveness::Liveness;

use super::callbacks::{Callbacks, ErrorOrigin};
use super::health::Unhealthy;
use crate::clock::Clock;
use crate::error::LeaseError;
use crate::lease::LeaseStore;
use crate::model::{GroupName, Heartbeat, HostName};

/// Why the processor could not run or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessorError {
    /// Another live process uses this host name.
    #[error("host name {host} is already in use in group {group} by a live process (incarnation {incarnation}); refusing to start a second one")]
    DuplicateHost {
        /// The group.
        group: String,
        /// The host name.
        host: String,
        /// The other process's incarnation id.
        incarnation: String,
    },
    /// This host's heartbeat row was taken over or removed by someone else while it ran.
    #[error("host {host} in group {group}: heartbeat row was replaced or removed by another writer; stopped")]
    Superseded {
        /// The group.
        group: String,
        /// The host name.
        host: String,
    },
    /// The store failed while registering the host.
    #[error(transparent)]
    Store(#[from] LeaseError),
}

/// Registers this host's heartbeat row. If a row with this name exists, watches it for
/// `lease_expiry`: if it moves, another live process holds the name and we refuse; if it stays
/// still, the previous incarnation is dead and we take the row over.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn register(
    store: &dyn LeaseStore,
    clock: &dyn Clock,
    group: &GroupName,
    host: &HostName,
    incarnation: &str,
    lease_expiry: Duration,
    renew_interval: Duration,
    cancel: &CancellationToken,
) -> Result<Option<Heartbeat>, ProcessorError> {
    let mut watching: Option<(Heartbeat, Instant)> = None;
    loop {
        let expected = watching.as_ref().map(|(hb, _)| hb.version);
        let stale_enough = watching.as_ref().is_some_and(|(_, since)| {
            clock.now().saturating_duration_since(*since) >= lease_expiry
        });
        if expected.is_none() || stale_enough {
            match store
                .heartbeat(group, host, incarnation, clock.wall(), expected)
                .await
            {
                Ok(hb) => {
                    if expected.is_some() {
                        info!(%host, "took over the heartbeat of a dead previous incarnation");
                    }
                    return Ok(Some(hb));
                }
                Err(LeaseError::HeartbeatConflict {
                    current: Some(cur), ..
                }) => {
                    let moved = watching
                        .as_ref()
                        .is_some_and(|(hb, _)| hb.version != cur.version);
                    if moved {
                        return Err(ProcessorError::DuplicateHost {
                            group: group.to_string(),
                            host: host.to_string(),
                            incarnation: cur.incarnation.to_string(),
                        });
                    }
                    if watching.is_none() {
                        info!(%host, incarnation = %cur.incarnation, "a heartbeat row with this host name exists; watching it before taking over");
                        watching = Some((*cur, clock.now()));
                    }
                }
                Err(LeaseError::HeartbeatConflict { current: None, .. }) => {
                    watching = None;
                    continue;
                }
                Err(err) => return Err(err.into()),
            }
        } else if let Some((hb, _)) = &watching {
            // Poll the row at the renew cadence to see whether it moves.
            let m = store.membership(group).await?;
            match m.hosts.iter().find(|h| &h.host == host) {
                None => {
                    watching = None;
                    continue;
                }
                Some(cur) if cur.version != hb.version => {
                    return Err(ProcessorError::DuplicateHost {
                        group: group.to_string(),
                        host: host.to_string(),
                        incarnation: cur.incarnation.to_string(),
                    });
                }
                Some(_) => {}
            }
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Ok(None),
            _ = clock.sleep(renew_interval.min(lease_expiry / 4).max(Duration::from_millis(1))) => {}
        }
    }
}

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
    fn renewed(&self, sent: Instant, at: Instant) {
        let mut state = self.lock();
        if sent >= state.at {
            state.lapses += 1;
        }
        state.at = at;
    }

    fn set(&self, at: Instant) {
        self.lock().at = at;
    }

    fn set_raised(&self, raised: bool) {
        self.lock().raised = raised;
    }

    /// The heartbeat row was found missing at `now` (kept if it already was).
    fn set_unregistered(&self, now: Instant) {
        let mut state = self.lock();
        state.unregistered_at.get_or_insert(now);
    }

    fn set_registered(&self) {
        self.lock().unregistered_at = None;
    }
}

/// The heartbeat task's side of the fence: the record, and the watch that wakes the tasks
/// waiting for it. A raise is recorded before it rings and a lowering rings before it is
/// recorded, so a task the watch shows fenced reads the record fenced too.
struct FenceWriter {
    record: FenceDeadline,
    doorbell: watch::Sender<bool>,
}

impl FenceWriter {
    fn is_raised(&self) -> bool {
        self.record.lock().raised
    }

    fn raise(&self) {
        self.record.set_raised(true);
        self.doorbell.send_replace(true);
    }

    fn lower(&self) {
        self.doorbell.send_replace(false);
        self.record.set_raised(false);
    }
}

/// When this host last made sure its workers know of every hand-off request: the time a
/// membership read was *sent* whose change counter the host had listed and hinted to its
/// workers. A request written after that read bumped the counter, so the next cycle lists it.
///
/// An asker steals an unhonoured request `handoff_timeout` after its request write
/// *returned*, so a worker that delivers only within `handoff_timeout − safety_margin` of a
/// confirmation (this stamp, or its own successful lease write or read) cannot deliver after
/// a steal it was not told of: a host cut off from the store stops delivering before the
/// asker may steal (design rule 1).
#[derive(Debug, Clone)]
pub(crate) struct ViewStamp(Arc<std::sync::Mutex<Instant>>);

impl ViewStamp {
    pub(crate) fn new(at: Instant) -> Self {
        Self(Arc::new(std::sync::Mutex::new(at)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Instant> {
        // The lock only guards a plain copy; a poisoned lock still holds a valid one.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn get(&self) -> Instant {
        *self.lock()
    }

    /// Records a confirmation made by a read sent at `sent`; never moves backwards.
    pub(crate) fn confirm(&self, sent: Instant) {
        let mut at = self.lock();
        if sent > *at {
            *at = sent;
        }
    }
}

/// What the host loop and the heartbeat task share about the membership view: this host's
/// current incarnation (the heartbeat task registers again under a new one if its row was
/// removed, and a view must list the new one before the host takes again), and until when the
/// heartbeat task renews as the view's leader ([`LeaseStore::lead_heartbeat`], which copies
/// the renewal into the view). The host loop extends that after each cycle in which it kept
/// the view up to date, so a leader that can renew its heartbeat but not keep the view (its
/// other store calls fail) stops looking alive to the fleet within `lease_expiry −
/// safety_margin`, and the fleet elects another.
#[derive(Debug, Clone)]
pub(crate) struct ViewLink(Arc<std::sync::Mutex<LinkState>>);

#[derive(Debug)]
struct LinkState {
    incarnation: Arc<str>,
    lead_until: Option<Instant>,
}

impl ViewLink {
    pub(crate) fn new(incarnation: Arc<str>) -> Self {
        Self(Arc::new(std::sync::Mutex::new(LinkState {
            incarnation,
            lead_until: None,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkState> {
        // The lock only guards plain values; a poisoned lock still holds valid ones.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This host's current incarnation.
    pub(crate) fn incarnation(&self) -> Arc<str> {
        Arc::clone(&self.lock().incarnation)
    }

    fn set_incarnation(&self, incarnation: Arc<str>) {
        self.lock().incarnation = incarnation;
    }

    /// Renew as the view's leader until `until` (`None`: not at all).
    pub(crate) fn lead_until(&self, until: Option<Instant>) {
        self.lock().lead_until = until;
    }

    fn leads(&self, now: Instant) -> bool {
        self.lock().lead_until.is_some_and(|until| now < until)
    }
}

/// Says once, in the log and the gauge `changefeed_unhealthy_since_seconds`, when this host
/// turns unhealthy (in [`Trouble`] for longer than `max_unhealthy` without a break), and once
/// when it is healthy again. The heartbeat task checks after every attempt, so it says so
/// within about a renew interval; [`super::HealthProbe`] reads the same record exactly when
/// asked.
struct HealthReport {
    fence_after: Duration,
    /// The gauge's `group` label.
    group: String,
    /// When the trouble reported as unhealthy began, while it lasts.
    reported: Option<Instant>,
}

impl HealthReport {
    fn new(group: &GroupName, fence_after: Duration) -> Self {
        let report = Self {
            fence_after,
            group: group.to_string(),
            reported: None,
        };
        // Healthy to begin with; the series is there from the start, for alerts on its value.
        report.gauge(0.0);
        report
    }

    fn gauge(&self, value: f64) {
        metrics::gauge!("changefeed_unhealthy_since_seconds", "group" => self.group.clone())
            .set(value);
    }

    fn check(&mut self, record: &FenceDeadline, clock: &dyn Clock, host: &HostName) {
        let now = clock.now();
        let trouble = record.trouble(now);
        if let Some(since) = self.reported {
            if trouble.is_some_and(|t| t.since() == since) {
                return;
            }
            // The spell reported is over (another may have begun since).
            info!(%host, unhealthy_for = ?now.saturating_duration_since(since), "healthy again: a heartbeat succeeded");
            self.reported = None;
            self.gauge(0.0);
        }
        let Some(trouble) = trouble else { return };
        let judged = Unhealthy::judge(
            &trouble,
            now,
            clock.wall(),
            self.fence_after,
            record.max_unhealthy(),
        );
        if let Some(unhealthy) = judged {
            error!(%host, "{unhealthy}; it stays so until a heartbeat succeeds (a restart may be needed)");
            self.gauge(unhealthy.since.millis() as f64 / 1000.0);
            self.reported = Some(trouble.since());
        }
    }
}

impl Drop for HealthReport {
    fn drop(&mut self) {
        // The heartbeat task has ended (a stop, or the row taken over): nothing recovers any
        // more, and the host's health no longer says unhealthy.
        if self.reported.is_some() {
            self.gauge(0.0);
        }
    }
}

/// Heartbeat loop: renews the row every `renew_interval`, and raises the fence when the last
/// successful renewal was sent `fence_after` ago. Lowers it again when a renewal succeeds.
/// Returns an error if the row was taken over or removed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    store: Arc<dyn LeaseStore>,
    clock: Arc<dyn Clock>,
    mut row: Heartbeat,
    renew_interval: Duration,
    fence_after: Duration,
    fenced: watch::Sender<bool>,
    cancel: CancellationToken,
    write_timeout: Duration,
    deadline_shared: FenceDeadline,
    callbacks: Arc<Callbacks>,
    link: ViewLink,
) -> Result<Heartbeat, ProcessorError> {
    let fence = FenceWriter {
        record: deadline_shared,
        doorbell: fenced,
    };
    let mut last_ok_sent = clock.now();
    fence.record.set(last_ok_sent + fence_after);
    let base_incarnation = row.incarnation.clone();
    let mut report = HealthReport::new(&row.group, fence_after);
    let mut rejoins = 0u32;
    let mut lapses_seen = 0u32;
    // Every incarnation this process writes starts with the one it registered with.
    let ours = |incarnation: &str| {
        incarnation == &*base_incarnation
            || incarnation
                .strip_prefix(&*base_incarnation)
                .is_some_and(|rest| rest.starts_with('.'))
    };
    // Tries start `renew_interval` apart, counted from when the last one was sent: a try that
    // hung until the write timeout must not add a whole interval before the next one, or a
    // host cut off from its store would try only every `renew_interval + write_timeout` and
    // come back that much later once the store answers again.
    let mut last_try = last_ok_sent;
    // After a lapse the new incarnation is written at once rather than a renew interval
    // later: the host takes nothing until a view lists it, and no view can before its row
    // carries it.
    let mut renew_now = false;
    loop {
        let deadline = last_ok_sent + fence_after;
        let wait = if renew_now {
            Duration::ZERO
        } else {
            (last_try + renew_interval).saturating_duration_since(clock.now())
        };
        let fence_in = deadline.saturating_duration_since(clock.now());
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Ok(row),
            _ = clock.sleep(fence_in), if !fence.is_raised() => {
                warn!(host = %row.host, "no successful heartbeat for lease_expiry − safety_margin; fencing: workers stop");
                metrics::counter!("changefeed_fenced_total").increment(1);
                fence.raise();
                continue;
            }
            _ = clock.sleep(wait) => {}
        }
        let sent = clock.now();
        last_try = sent;
        renew_now = false;
        let write = if link.leads(sent) {
            store.lead_heartbeat(
                &row.group,
                &row.host,
                &row.incarnation,
                clock.wall(),
                Some(row.version),
            )
        } else {
            store.heartbeat(
                &row.group,
                &row.host,
                &row.incarnation,
                clock.wall(),
                Some(row.version),
            )
        };
        // A hung store must not hold the loop past the fence deadline, which must still fire.
        // Once the fence is raised that deadline has passed, and the renewal gets the whole
        // write timeout: cut to nothing, it could never succeed on a store that takes more
        // than an instant to answer (a new connection after a network fault), and the host
        // would stay fenced for ever with its store reachable again.
        let limit = if fence.is_raised() {
            write_timeout
        } else {
            let fence_in = (last_ok_sent + fence_after).saturating_duration_since(clock.now());
            write_timeout.min(fence_in.max(Duration::from_millis(1)))
        };
        let result = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Ok(row),
            r = write => Some(r),
            _ = clock.sleep(limit) => None,
        };
        match result {
            Some(Ok(hb)) if clock.now().saturating_duration_since(sent) > write_timeout => {
                // Only a renewal that returned within `write_timeout` of being sent moves the
                // deadline: a later one (a write held by a stall) may have reached the store
                // after observers judged this host dead by its previous version and took its
                // leases. Adopt the version; the next renewal counts
                // (`tests::late_renewal_does_not_extend_the_fence`).
                warn!(host = %row.host, "heartbeat landed too late to count; not extending the fence");
                row = hb;
            }
            Some(Ok(hb)) => {
                row = hb;
                last_ok_sent = sent;
                if sent >= fence.record.get() {
                    // A lapse: this host may have been judged dead, and a membership view may
                    // still say so. It goes on under a new incarnation, written by its next
                    // renewal, and takes nothing until a view lists that one live (see
                    // `docs/protocol.md`, "The membership view"). Set before the deadline
                    // moves, so the host loop never plans on the old one after the lapse.
                    lapses_seen += 1;
                    let token: Arc<str> = format!("{base_incarnation}.l{lapses_seen}").into();
                    link.set_incarnation(Arc::clone(&token));
                    row.incarnation = token;
                    renew_now = true;
                }
                fence.record.renewed(sent, sent + fence_after);
                if fence.is_raised() {
                    info!(host = %row.host, "heartbeat succeeded again; fence lowered");
                    fence.lower();
                }
            }
            Some(Err(LeaseError::HeartbeatConflict {
                current: Some(cur), ..
            })) if ours(&cur.incarnation) => {
                // An earlier write that timed out on our side did land: adopt its version. It is
                // not counted as a success, since when it was sent is unknown. The incarnation
                // to write stays ours as of now (a lapse may have changed it since).
                row.version = cur.version;
                row.written_at = cur.written_at;
            }
            Some(Err(LeaseError::HeartbeatConflict { current: None, .. })) => {
                // The row was removed: this host was judged dead (its leases are taken) or an
                // operator released it. It is fenced by now; register afresh and carry on.
                // Observers see a host live while its (version, incarnation) changes, and the
                // new row starts again at version 1: it carries a new incarnation, or one back
                // at a version an observer saw before would look unchanged and its host dead
                // while alive (`tests::reregistered_row_is_seen_to_change`).
                fence.record.set_unregistered(clock.now());
                rejoins += 1;
                let token = format!("{base_incarnation}.r{rejoins}");
                // Bounded like a renewal: a hung store must not hold the loop (and with it the
                // fence and health reports). A registration that lands after the bound is
                // adopted by the next renewal's conflict, as its incarnation is ours.
                let register = store.heartbeat(&row.group, &row.host, &token, clock.wall(), None);
                let registered = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Ok(row),
                    r = register => Some(r),
                    _ = clock.sleep(write_timeout) => None,
                };
                match registered.unwrap_or_else(|| {
                    Err(LeaseError::store(
                        "heartbeat",
                        Some(format!("{}/{}", row.group, row.host)),
                        true,
                        format!("registering again took longer than {write_timeout:?}"),
                    ))
                }) {
                    Ok(hb) => {
                        warn!(host = %row.host, "heartbeat row had been removed; registered again");
                        link.set_incarnation(Arc::clone(&hb.incarnation));
                        row = hb;
                        last_ok_sent = sent;
                        fence.record.renewed(sent, sent + fence_after);
                        fence.record.set_registered();
                        if fence.is_raised() {
                            fence.lower();
                        }
                    }
                    Err(err) => warn!(host = %row.host, error = %err, "re-registering failed"),
                }
            }
            Some(Err(LeaseError::HeartbeatConflict { current, .. })) => {
                error!(host = %row.host, current = ?current.map(|c| c.incarnation), "heartbeat row taken over or removed; stopping");
                fence.record.set_unregistered(clock.now());
                fence.raise();
                return Err(ProcessorError::Superseded {
                    group: row.group.to_string(),
                    host: row.host.to_string(),
                });
            }
            Some(Err(err)) => {
                warn!(host = %row.host, error = %err, "heartbeat failed");
                callbacks.error(ErrorOrigin::Store, None, || {
                    format!("heartbeat failed: {err}")
                });
            }
            None => {
                warn!(host = %row.host, "heartbeat timed out");
                callbacks.error(ErrorOrigin::Store, None, || {
                    format!("heartbeat timed out after {write_timeout:?}")
                });
            }
        }
        if clock.now() >= last_ok_sent + fence_after && !fence.is_raised() {
            warn!(host = %row.host, "no successful heartbeat for lease_expiry − safety_margin; fencing: workers stop");
            metrics::counter!("changefeed_fenced_total").increment(1);
            fence.raise();
        }
        report.check(&fence.record, clock.as_ref(), &row.host);
    }
}

#[cfg(test)]
mod tests;
