//! The leader's partition sync and the lag of partitions nobody owns, run from the host's
//! cycle.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::time::Instant;
use tracing::{debug, warn};

use crate::lag;
use crate::model::{Continuation, Lease, LeaseState, PartitionId, Position};
use crate::processor::callbacks::ErrorOrigin;
use crate::processor::host_state::Answer;
use crate::processor::{sync, worker};
use crate::source::OldestUnread;

use super::Host;

/// At most this many partitions no host reads are asked about per estimate.
const UNOWNED_LAG_MAX: usize = 64;

/// The older of two answers about a first unread record: a known time beats caught-up, and
/// caught-up beats unknown.
fn older(a: OldestUnread, b: OldestUnread) -> OldestUnread {
    match (a, b) {
        (OldestUnread::At(x), OldestUnread::At(y)) => OldestUnread::At(x.min(y)),
        (OldestUnread::At(x), _) | (_, OldestUnread::At(x)) => OldestUnread::At(x),
        (OldestUnread::CaughtUp, _) | (_, OldestUnread::CaughtUp) => OldestUnread::CaughtUp,
        _ => OldestUnread::Unknown,
    }
}

impl Host {
    /// Runs the leader's partition sync over `rows` (listed at `counter`); failures are
    /// logged and reported.
    pub(super) async fn sync(
        &mut self,
        rows: &[Arc<Lease>],
        counter: Option<u64>,
        now: Instant,
    ) -> Answer {
        let report = self
            .syncer
            .run(
                self.processor.store.as_ref(),
                self.processor.source.as_ref(),
                &self.processor.group,
                &self.processor.settings,
                rows,
                now,
                counter,
            )
            .await;
        match report {
            Ok(report) => {
                if report.changed() {
                    debug!(?report, "partition sync changed the lease table");
                }
                Answer::Synced {
                    ok: true,
                    changed: report.changed(),
                }
            }
            Err(err) => {
                warn!(error = %err, "partition sync failed; retrying at the next interval");
                let origin = match err {
                    sync::SyncError::Source(_) => ErrorOrigin::Source,
                    sync::SyncError::Store(_) => ErrorOrigin::Store,
                };
                self.processor
                    .callbacks
                    .error(origin, None, || format!("partition sync failed: {err}"));
                Answer::Synced {
                    ok: false,
                    changed: false,
                }
            }
        }
    }

    /// The lag of the partitions no host reads (leases without an owner, such as children
    /// waiting for their parents, and partitions the source lists that have no lease yet),
    /// added to this host's lag gauges so the fleet's sum counts them once. At most
    /// [`UNOWNED_LAG_MAX`] partitions are asked about (one or two small source reads each); a
    /// failed read is left out.
    pub(super) async fn estimate_unowned(&mut self, rows: Vec<Arc<Lease>>) {
        let mut todo: Vec<(PartitionId, Option<Continuation>, Position)> = rows
            .iter()
            .filter(|l| l.owner.is_none() && l.state != LeaseState::Finished)
            .map(|l| {
                (
                    l.key.partition.clone(),
                    l.continuation.clone(),
                    l.start.clone(),
                )
            })
            .collect();
        let source = self.processor.source.clone();
        let estimate = async {
            match lag::unleased(source.as_ref(), &rows, &BTreeSet::new()).await {
                Ok(more) => todo.extend(more.into_iter().map(|(p, start)| (p, None, start))),
                Err(err) => debug!(error = %err, "listing partitions for the lag estimate failed"),
            }
            let mut records: Option<u64> = None;
            let mut oldest = OldestUnread::Unknown;
            for (partition, checkpoint, start) in todo.iter().take(UNOWNED_LAG_MAX) {
                match lag::lag_after(source.as_ref(), partition, checkpoint.as_ref(), start).await {
                    Ok(Some(n)) => records = Some(records.unwrap_or(0).saturating_add(n)),
                    Ok(None) => {}
                    Err(err) => debug!(%partition, error = %err, "lag estimate failed"),
                }
                match lag::oldest_after(source.as_ref(), partition, checkpoint.as_ref(), start)
                    .await
                {
                    Ok(found) => oldest = older(oldest, found),
                    Err(err) => debug!(%partition, error = %err, "lag in time estimate failed"),
                }
            }
            (!todo.is_empty()).then_some(worker::PartitionLag { records, oldest })
        };
        // Observation only: a source that answers slowly (each read bounded by the call
        // timeout) must not hold the cycle for one bound per partition. The estimate keeps its
        // last value until the next refresh.
        let estimate = tokio::select! {
            biased;
            estimate = estimate => estimate,
            _ = self.processor.clock.sleep(self.processor.settings.call_timeout()) => {
                debug!("the lag estimate of unowned partitions took longer than the call timeout; left as it was");
                return;
            }
        };
        self.lag
            .set_unowned(&self.group_label, estimate, self.processor.clock.wall());
    }

    pub(super) fn publish_gauges(&self) {
        metrics::gauge!("changefeed_leases_owned", "group" => self.group_label.clone())
            .set(self.state.running() as f64);
        metrics::gauge!("changefeed_malformed_leases", "group" => self.group_label.clone())
            .set(self.state.malformed_rows() as f64);
        self.lag
            .publish_seconds(&self.group_label, self.processor.clock.wall());
    }
}
