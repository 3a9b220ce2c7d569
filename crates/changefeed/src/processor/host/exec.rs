//! Carrying out what the state asks: store calls answered, effects applied, workers started.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tracing::{debug, info, warn, Instrument};

use super::{Host, WorkerSlot};
use crate::error::LeaseError;
use crate::model::Lease;
use crate::processor::callbacks::ErrorOrigin;
use crate::processor::host_state::{Answer, Call, Effect, HeadRead, Why};
use crate::processor::worker;

impl Host {
    /// Makes `call` and answers it. Failures are logged and reported here; the state only
    /// learns that the call failed.
    pub(super) async fn execute(&mut self, call: Call) -> Answer {
        match call {
            Call::ReadHead => Answer::Head(self.roll().await),
            Call::Membership => Answer::Membership(self.membership().await),
            Call::ListChanges { since, after_sync } => {
                let read = self
                    .processor
                    .store
                    .list_changes(&self.processor.group, since)
                    .await;
                match &read {
                    Ok(Some(changes)) => self.warn_malformed(&changes.malformed),
                    Ok(None) => {}
                    Err(err) => self.list_failed(err, after_sync),
                }
                Answer::Changes(read)
            }
            Call::ListAll { after_sync } => {
                let listing = self.processor.store.list(&self.processor.group).await;
                match &listing {
                    // After the sync, the rows it wrote are what matters; unreadable rows are
                    // reported at the cycle's own lists.
                    Ok(listing) if !after_sync => self.warn_malformed(&listing.malformed),
                    Ok(_) => {}
                    Err(err) => self.list_failed(err, after_sync),
                }
                Answer::Listed(listing)
            }
            Call::WriteView {
                view,
                expected,
                changed,
            } => {
                let written = self
                    .processor
                    .store
                    .write_view(&self.processor.group, &view, expected)
                    .await;
                match &written {
                    Ok(stored) if changed => info!(
                        version = stored.version,
                        live = stored.live.len(),
                        dead = stored.dead.len(),
                        "wrote the membership view"
                    ),
                    Ok(stored) => debug!(version = stored.version, "renewed the membership view"),
                    Err(LeaseError::ViewConflict { .. }) => {
                        debug!("another host wrote the membership view first")
                    }
                    Err(err) => {
                        warn!(error = %err, "writing the membership view failed");
                        self.processor
                            .callbacks
                            .error(ErrorOrigin::Store, None, || {
                                format!("writing the membership view failed: {err}")
                            });
                    }
                }
                Answer::ViewWritten(written)
            }
            Call::Sync { rows, counter, now } => self.sync(&rows, counter, now).await,
            Call::EstimateUnowned { rows } => {
                self.estimate_unowned(rows).await;
                Answer::Done
            }
            Call::RemoveHeartbeat(hb) => {
                match self
                    .processor
                    .store
                    .remove_heartbeat(&hb.group, &hb.host, &hb.incarnation, hb.version)
                    .await
                {
                    Ok(()) => info!(host = %hb.host, "removed the heartbeat row of a dead host"),
                    Err(err) => {
                        debug!(host = %hb.host, error = %err, "dead host's row not removed")
                    }
                }
                Answer::Done
            }
            Call::Write {
                next,
                expected,
                why,
            } => {
                let written = self.processor.store.replace(&next, expected).await;
                self.report_write(&next, &why, &written);
                Answer::Written(written)
            }
        }
    }

    /// Logs and counts a lease write's outcome.
    fn report_write(&self, next: &Lease, why: &Why, written: &Result<Lease, LeaseError>) {
        let group = self.group_label.clone();
        match (why, written) {
            (Why::Resume, Ok(stored)) => {
                info!(lease = %stored.key, "resuming a lease this host owns")
            }
            (Why::Resume, Err(err)) => {
                debug!(lease = %next.key, error = %err, "could not resume lease")
            }
            (Why::Take { kind, previous }, Ok(stored)) => {
                info!(lease = %stored.key, ?previous, %kind, "took lease");
                metrics::counter!(kind.metric(), "group" => group).increment(1);
            }
            (Why::Take { kind, .. }, Err(err)) => {
                debug!(lease = %next.key, error = %err, %kind, "could not take lease")
            }
            (Why::Request { from }, Ok(stored)) => {
                info!(lease = %stored.key, %from, "asked for hand-off");
                metrics::counter!("changefeed_handoffs_requested_total", "group" => group)
                    .increment(1);
            }
            (Why::Request { .. }, Err(err)) => {
                debug!(lease = %next.key, error = %err, "hand-off request not written")
            }
        }
    }

    fn warn_malformed(&self, malformed: &[LeaseError]) {
        // Repeated at every list while the rows stay unreadable: an operator fixes them with
        // `changefeed reset --force`.
        for bad in malformed {
            warn!(error = %bad, "unreadable lease row skipped; fix it with `changefeed reset --force`");
        }
    }

    fn list_failed(&self, err: &LeaseError, after_sync: bool) {
        if after_sync {
            warn!(error = %err, "listing leases after the sync failed");
            return;
        }
        warn!(error = %err, "listing leases failed");
        self.processor
            .callbacks
            .error(ErrorOrigin::Store, None, || {
                format!("listing leases failed: {err}")
            });
    }

    /// Reads the head row, or every heartbeat if the store keeps no view; a failure is logged
    /// and reported.
    async fn roll(&self) -> Option<HeadRead> {
        match self.processor.store.head(&self.processor.group).await {
            Ok(Some(head)) => Some(HeadRead::Head(head)),
            Ok(None) => self.membership().await.map(HeadRead::Heartbeats),
            Err(err) => {
                warn!(error = %err, "reading the group's head row failed");
                self.processor
                    .callbacks
                    .error(ErrorOrigin::Store, None, || {
                        format!("reading the group's head row failed: {err}")
                    });
                None
            }
        }
    }

    /// Reads the group's membership; a failure is logged and reported.
    async fn membership(&self) -> Option<crate::model::Membership> {
        match self.processor.store.membership(&self.processor.group).await {
            Ok(m) => Some(m),
            Err(err) => {
                warn!(error = %err, "reading membership failed");
                self.processor
                    .callbacks
                    .error(ErrorOrigin::Store, None, || {
                        format!("reading membership failed: {err}")
                    });
                None
            }
        }
    }

    /// Carries out one effect.
    pub(super) fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::Hint(row) => {
                if let Some(slot) = self.workers.get(&row.key.partition) {
                    slot.hint.send_replace(Some(row));
                }
            }
            Effect::Stop(partition) => {
                if let Some(slot) = self.workers.get(&partition) {
                    info!(%partition, "lease deleted; stopping its worker");
                    slot.cancel.cancel();
                }
            }
            Effect::Release(partition) => {
                if let Some(slot) = self.workers.get(&partition) {
                    info!(%partition, "releasing lease by plan");
                    slot.cancel.cancel();
                }
            }
            Effect::StartWorker(lease) => self.start_worker(lease),
            Effect::Confirm(sent) => self.stamp.confirm(sent),
            Effect::LeadUntil(until) => self.heartbeat_link.lead_until(until),
            Effect::SyncReset => self.syncer.reset(),
            Effect::UnownedLagCleared => {
                self.lag
                    .set_unowned(&self.group_label, None, self.processor.clock.wall());
            }
            Effect::Gauges => self.publish_gauges(),
        }
    }

    fn start_worker(&mut self, lease: Lease) {
        let partition = lease.key.partition.clone();
        if self.workers.contains_key(&partition) {
            return;
        }
        let cancel = self.worker_cancel.child_token();
        // The first hint is the lease itself, so a pending hand-off request is honoured at once.
        let (hint_tx, mut hint_rx) = watch::channel(None);
        if lease.next_owner.is_some() {
            hint_tx.send_replace(Some(lease.clone()));
        } else {
            hint_rx.mark_unchanged();
        }
        let seed = self.processor.rng.gen::<u64>();
        self.workers.insert(
            partition,
            WorkerSlot {
                cancel: cancel.clone(),
                hint: hint_tx,
            },
        );
        let args = worker::WorkerArgs {
            lease,
            store: self.processor.store.clone(),
            source: self.processor.source.clone(),
            handler: self.processor.handler.clone(),
            host: self.processor.host.clone(),
            settings: self.processor.settings.clone(),
            clock: self.processor.clock.clone(),
            cancel,
            fenced: self.fenced_tx.subscribe(),
            fence_deadline: self.fence_deadline.clone(),
            view: self.stamp.clone(),
            hint: hint_rx,
            exits: self.exits_tx.clone(),
            rng: SmallRng::seed_from_u64(seed),
            group_label: self.group_label.clone(),
            hooks: self.processor.hooks,
            lag: self.lag.clone(),
            loads: self.loads.clone(),
            dead_letter: self.processor.dead_letter.clone(),
            callbacks: self.processor.callbacks.clone(),
        };
        self.worker_tasks.spawn(worker::run(args).in_current_span());
    }
}
