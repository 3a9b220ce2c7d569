//! The lag estimator: how far each lease's checkpoint is behind its partition's end.
//!
//! Like the Cosmos DB change feed estimator, it reads the leases and asks the source how many
//! records remain after each checkpoint. It owns no state and writes nothing; the CLI's `lag`
//! and `status` commands and the processor's `changefeed_lag_records` gauge use it.

use crate::error::{LeaseError, SourceError};
use crate::lease::LeaseStore;
use crate::model::{Continuation, GroupName, HostName, Lease, LeaseState, PartitionId, Position};
use crate::source::FeedSource;

/// The estimate for one lease.
#[derive(Debug)]
pub struct LeaseLag {
    /// The partition.
    pub partition: PartitionId,
    /// Its owner, if any.
    pub owner: Option<HostName>,
    /// Its checkpoint, if any.
    pub checkpoint: Option<Continuation>,
    /// Records after the checkpoint: `Ok(None)` when the source cannot tell (or the lease
    /// starts at `Now` / a time and has no checkpoint yet), `Err` when asking failed.
    pub records: Result<Option<u64>, SourceError>,
}

/// The estimate for a whole group.
#[derive(Debug, Default)]
pub struct LagReport {
    /// One entry per readable lease, in partition order.
    pub leases: Vec<LeaseLag>,
    /// Lease rows that could not be read, each naming its key.
    pub malformed: Vec<LeaseError>,
}

impl LagReport {
    /// The sum of the known per-lease estimates.
    pub fn total(&self) -> u64 {
        self.leases
            .iter()
            .filter_map(|l| l.records.as_ref().ok().copied().flatten())
            .fold(0u64, u64::saturating_add)
    }

    /// How many leases have no estimate (unknown or failed).
    pub fn unknown(&self) -> usize {
        self.leases
            .iter()
            .filter(|l| !matches!(l.records, Ok(Some(_))))
            .count()
    }
}

/// Records after `lease`'s checkpoint. A finished lease has none. Without a checkpoint, a
/// lease starting at `Beginning` lags by the whole partition; one starting at `Now` or a time
/// has no estimate until its first checkpoint.
///
/// # Errors
/// What the source returned (an unknown partition, a continuation it does not recognise …).
pub async fn lease_lag(source: &dyn FeedSource, lease: &Lease) -> Result<Option<u64>, SourceError> {
    if lease.state == LeaseState::Finished {
        return Ok(Some(0));
    }
    lag_after(
        source,
        &lease.key.partition,
        lease.continuation.as_ref(),
        &lease.start,
    )
    .await
}

/// Records in `partition` after `checkpoint`, or after `start` when there is none.
///
/// # Errors
/// What the source returned.
pub async fn lag_after(
    source: &dyn FeedSource,
    partition: &PartitionId,
    checkpoint: Option<&Continuation>,
    start: &Position,
) -> Result<Option<u64>, SourceError> {
    match (checkpoint, start) {
        (Some(c), _) => source.remaining(partition, Some(c)).await,
        (None, Position::Continuation(c)) => source.remaining(partition, Some(c)).await,
        (None, Position::Beginning) => source.remaining(partition, None).await,
        (None, Position::Now | Position::AtTime(_)) => Ok(None),
    }
}

/// Estimates the lag of every lease of `group`.
///
/// # Errors
/// [`LeaseError`] if the leases cannot be listed; per-lease source errors are reported in
/// [`LeaseLag::records`] instead.
pub async fn estimate(
    store: &dyn LeaseStore,
    source: &dyn FeedSource,
    group: &GroupName,
) -> Result<LagReport, LeaseError> {
    let listing = store.list(group).await?;
    let mut report = LagReport {
        leases: Vec::with_capacity(listing.leases.len()),
        malformed: listing.malformed,
    };
    for lease in listing.leases {
        let records = lease_lag(source, &lease).await;
        report.leases.push(LeaseLag {
            partition: lease.key.partition,
            owner: lease.owner,
            checkpoint: lease.continuation,
            records,
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::MemoryLeaseStore;
    use crate::model::LeaseKey;
    use crate::source::MemoryFeed;

    #[tokio::test]
    async fn lag_counts_records_after_each_checkpoint() {
        // Design, "Observability": per lease, how far the checkpoint is behind the end.
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(2);
        let group = GroupName::new("g").expect("valid");
        let p0 = PartitionId::new("0").expect("valid");
        let p1 = PartitionId::new("1").expect("valid");
        let mut c = None;
        for i in 0..10 {
            let cont = feed.append_to(&p0, "k", format!("{i}")).expect("open");
            if i == 3 {
                c = Some(cont);
            }
            feed.append_to(&p1, "k", format!("{i}")).expect("open");
        }
        let mut l0 = Lease::new(LeaseKey::new(group.clone(), p0), Position::Beginning);
        l0.continuation = c;
        store.create(&l0).await.expect("create");
        store
            .create(&Lease::new(LeaseKey::new(group.clone(), p1), Position::Now))
            .await
            .expect("create");
        let report = estimate(&store, &feed, &group).await.expect("estimate");
        assert_eq!(report.leases[0].records.as_ref().ok(), Some(&Some(6)));
        assert_eq!(
            report.leases[1].records.as_ref().ok(),
            Some(&None),
            "Now: unknown"
        );
        assert_eq!(report.total(), 6);
        assert_eq!(report.unknown(), 1);
    }
}
