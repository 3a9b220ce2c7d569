//! Keeping this host alive, judging whether others are, and fencing.
//!
//! Liveness is per host (design, "The lease store seam"): each host writes one heartbeat row per
//! renew interval. An observer judges a host dead when it has seen the same heartbeat version
//! for `lease_expiry` on its *own* monotonic clock (rule 2), so no two clocks are ever compared.
//! A host whose last successful heartbeat was *sent* `lease_expiry − safety_margin` ago fences
//! itself: its workers stop before any observer can judge it dead (rule 3).

use crate::lease::HeartbeatRole;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

mod fence;

use fence::FenceWriter;
pub(crate) use fence::{FenceDeadline, Trouble};

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
    report: &str,
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
                .heartbeat(
                    group,
                    host,
                    incarnation,
                    clock.wall(),
                    expected,
                    HeartbeatRole::Member,
                    Some(report),
                )
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
    loads: Arc<super::load::LoadBook>,
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
    // A try that did not count (failed, timed out, landed too late) is followed half an
    // interval later: at the default cadence (3 s, as the KCL's) a host then has four tries,
    // not two, before its fence, while a healthy host still writes once per interval.
    let mut retry_soon = false;
    loop {
        let deadline = last_ok_sent + fence_after;
        let wait = if renew_now {
            Duration::ZERO
        } else {
            let interval = if retry_soon {
                renew_interval / 2
            } else {
                renew_interval
            };
            (last_try + interval).saturating_duration_since(clock.now())
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
        let role = if link.leads(sent) {
            HeartbeatRole::Leader
        } else {
            HeartbeatRole::Member
        };
        // The host's capacity, limits and (when it publishes them) loads ride the renewal.
        let published = loads.report(sent).to_json();
        let write = store.heartbeat(
            &row.group,
            &row.host,
            &row.incarnation,
            clock.wall(),
            Some(row.version),
            role,
            Some(&published),
        );
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
                let published = loads.report(clock.now()).to_json();
                // Bounded like a renewal: a hung store must not hold the loop (and with it the
                // fence and health reports). A registration that lands after the bound is
                // adopted by the next renewal's conflict, as its incarnation is ours.
                let register = store.heartbeat(
                    &row.group,
                    &row.host,
                    &token,
                    clock.wall(),
                    None,
                    HeartbeatRole::Member,
                    Some(&published),
                );
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
        retry_soon = last_ok_sent != sent;
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
