//! Acting on a plan: claiming this host's own leases again, balancing, taking leases and
//! starting their workers.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, Instrument};

use crate::error::LeaseError;
use crate::model::{HostName, Lease};
use crate::processor::host_state::TakeKind;
use crate::processor::worker;

use super::{Host, Roll, WorkerSlot};

impl Host {
    /// Leases the store says are ours but no worker runs (a restart under the same name, or a
    /// fence that was lowered): claim them by CAS and start workers.
    pub(super) async fn adopt_own_leases(&mut self) {
        for lease in self.state.to_adopt() {
            match self.p.store.replace(&lease, lease.version).await {
                Ok(stored) => {
                    info!(lease = %stored.key, "resuming a lease this host owns");
                    self.start_worker(stored);
                }
                Err(LeaseError::Conflict { current, .. })
                    if current.is_owned_by(&self.p.host) && !current.ownership_differs(&lease) =>
                {
                    // Only its checkpoint moved since it was listed (our own, or the cached
                    // row is older than the one listed): resume it at the current version.
                    match self.p.store.replace(&current, current.version).await {
                        Ok(stored) => {
                            info!(lease = %stored.key, "resuming a lease this host owns");
                            self.start_worker(stored);
                        }
                        Err(err) => {
                            debug!(lease = %lease.key, error = %err, "could not resume lease");
                            if let LeaseError::Conflict { current, .. } = err {
                                self.state.keep_and_replan(*current);
                                self.flush();
                            } else {
                                self.state.write_failed();
                            }
                        }
                    }
                }
                Err(LeaseError::Conflict { current, .. }) => {
                    // It changed hands since it was listed: plan again with the current row.
                    debug!(lease = %lease.key, "could not resume lease: it changed");
                    self.state.keep_and_replan(*current);
                    self.flush();
                }
                Err(err) => {
                    debug!(lease = %lease.key, error = %err, "could not resume lease");
                    self.state.write_failed();
                }
            }
        }
    }

    /// Carries out the plan: takes and steals, hand-off requests, releases.
    pub(super) async fn balance(&mut self, now: Instant) {
        // Hand-off requests are timed on this host's own clock from when it first sees them.
        let seen = self.p.clock.now();
        let actions = self.state.actions(now, seen, self.p.strategy.as_ref());
        if actions.takes.is_empty() && actions.requests.is_empty() && actions.releases.is_empty() {
            return;
        }
        debug!(?actions, "balance plan");
        let mut retry: Vec<Lease> = Vec::new();
        for (lease, kind) in &actions.takes {
            match self.take(lease, *kind).await {
                Ok(()) => {}
                Err(LeaseError::Conflict { current, .. }) => {
                    // The cached row is older than the store's. If only its checkpoint moved
                    // (the owner wrote one before it died, after we listed), take it at the
                    // current version once a fresh membership read still shows that owner
                    // dead; otherwise plan again next cycle with the current row.
                    debug!(lease = %lease.key, %kind, "could not take lease: it changed");
                    retry.extend(self.state.take_conflict(lease, *current, *kind));
                    self.flush();
                }
                Err(err) => {
                    debug!(lease = %lease.key, error = %err, %kind, "could not take lease");
                    self.state.write_failed();
                }
            }
        }
        if !retry.is_empty() {
            self.retry_takes(retry).await;
        }
        for req in &actions.requests {
            // A conflict that only reflects a checkpoint of the owner is retried against the
            // current row, as long as the request still makes sense.
            let mut current: Option<Lease> = None;
            for _attempt in 0..3 {
                let Some((lease, next)) = self.state.request_row(req, current.as_ref()) else {
                    break;
                };
                match self.p.store.replace(&next, lease.version).await {
                    Ok(_) => {
                        info!(lease = %lease.key, from = %req.from, "asked for hand-off");
                        metrics::counter!("changefeed_handoffs_requested_total", "group" => self.group_label.clone()).increment(1);
                        // Timed from when the write returned: it landed by then, so the
                        // owner's workers stop delivering within handoff_timeout −
                        // safety_margin of it unless told (see `heartbeat::ViewStamp`).
                        self.state
                            .requested(req.partition.clone(), self.p.clock.now());
                        break;
                    }
                    Err(LeaseError::Conflict { current: c, .. }) => current = Some(*c),
                    Err(err) => {
                        debug!(lease = %lease.key, error = %err, "hand-off request not written");
                        self.state.write_failed();
                        break;
                    }
                }
            }
        }
        for partition in &actions.releases {
            if let Some(slot) = self.workers.get(partition) {
                info!(%partition, "releasing lease by plan");
                slot.cancel.cancel();
            }
        }
    }

    /// Takes again, at their current version, leases whose take conflicted only because their
    /// checkpoint had moved. The owner must still be judged dead by a membership read made
    /// after the conflict: a host that came back registers before it writes a lease, so an
    /// owner that re-adopted its lease shows a new heartbeat here and keeps it.
    pub(super) async fn retry_takes(&mut self, rows: Vec<Lease>) {
        let sent = self.p.clock.now();
        let Some(roll) = self.roll().await else {
            for row in rows {
                self.state.keep_and_replan(row);
            }
            self.flush();
            return;
        };
        let now = self.p.clock.now();
        let by_view = match &roll {
            Roll::Heartbeats(_) => None,
            Roll::Head(head) => self.state.live_after_conflict_head(head, now, &rows),
        };
        let live: Vec<HostName> = match (by_view, roll) {
            (Some(live), _) => live,
            (None, Roll::Heartbeats(membership)) => {
                self.state.live_after_conflict(&membership, sent, now)
            }
            (None, Roll::Head(_)) => {
                // Electing a leader: judge from a heartbeat read made after the conflict.
                let sent = self.p.clock.now();
                let Some(membership) = self.membership().await else {
                    for row in rows {
                        self.state.keep_and_replan(row);
                    }
                    self.flush();
                    return;
                };
                self.state
                    .live_after_conflict(&membership, sent, self.p.clock.now())
            }
        };
        for row in rows {
            if !self.state.retry_take(&row, &live) {
                self.flush();
                continue;
            }
            match self.take(&row, TakeKind::Take).await {
                Ok(()) => {}
                Err(LeaseError::Conflict { current, .. }) => self.state.keep_and_replan(*current),
                Err(err) => {
                    debug!(lease = %row.key, error = %err, "could not take lease");
                    self.state.keep_and_replan(row);
                }
            }
            self.flush();
        }
    }

    /// Takes `row` for this host by CAS at its version (`kind`: a take of a free or expired
    /// lease, or a steal of an unhonoured hand-off), then caches the new row and starts its
    /// worker. The caller decides what a failure means.
    pub(super) async fn take(&mut self, row: &Lease, kind: TakeKind) -> Result<(), LeaseError> {
        let next = self.state.taken_row(row);
        let stored = self.p.store.replace(&next, row.version).await?;
        info!(lease = %stored.key, previous = ?row.owner, %kind, "took lease");
        metrics::counter!(kind.metric(), "group" => self.group_label.clone()).increment(1);
        self.state.took(stored.clone());
        self.flush();
        self.start_worker(stored);
        Ok(())
    }

    pub(super) fn start_worker(&mut self, lease: Lease) {
        let partition = lease.key.partition.clone();
        if self.workers.contains_key(&partition) {
            return;
        }
        let cancel = self.worker_cancel.child_token();
        // The first hint is the lease itself, so a pending hand-off request is honoured at once.
        let (hint_tx, hint_rx) = watch::channel(None);
        if lease.next_owner.is_some() {
            hint_tx.send_replace(Some(lease.clone()));
        }
        let mut hint_rx = hint_rx;
        if lease.next_owner.is_none() {
            hint_rx.mark_unchanged();
        }
        let seed = self.p.rng.gen::<u64>();
        self.state.worker_started(&lease);
        self.workers.insert(
            partition,
            WorkerSlot {
                cancel: cancel.clone(),
                hint: hint_tx,
            },
        );
        let args = worker::WorkerArgs {
            lease,
            store: self.p.store.clone(),
            source: self.p.source.clone(),
            handler: self.p.handler.clone(),
            host: self.p.host.clone(),
            settings: self.p.settings.clone(),
            clock: self.p.clock.clone(),
            cancel,
            fenced: self.fenced_tx.subscribe(),
            fence_deadline: self.fence_deadline.clone(),
            view: self.view.clone(),
            hint: hint_rx,
            exits: self.exits_tx.clone(),
            rng: SmallRng::seed_from_u64(seed),
            group_label: self.group_label.clone(),
            hooks: self.p.hooks,
            lag: self.lag.clone(),
            dead_letter: self.p.dead_letter.clone(),
            callbacks: self.p.callbacks.clone(),
        };
        self.worker_tasks.spawn(worker::run(args).in_current_span());
    }
}
