//! How long a child partition waits after its parents end: from the later of its last
//! parent's finish (the write that marks its lease finished) and the first record appended to
//! it, to the first record of it a handler applies. Only children whose lease a host created
//! count (not the simulator's driver): the wait is the time the leader takes to notice the
//! finish and sync, plus the time a host takes to take the new lease and read it.

use std::collections::BTreeMap;
use std::time::Duration;

use super::world::{Delivery, WriteOp, WriteRec, DRIVER};
use crate::model::{LeaseState, Partition, PartitionId};

/// The wait of every child partition whose lease a host created and that was read in the run
/// (see the module docs), in partition order. A child no record of which was applied is left
/// out.
pub fn child_waits(
    partitions: &[Partition],
    writes: &[WriteRec],
    deliveries: &[Delivery],
    first_append: &BTreeMap<PartitionId, Duration>,
) -> Vec<Duration> {
    let mut finished: BTreeMap<&PartitionId, Duration> = BTreeMap::new();
    for w in writes {
        if w.after
            .as_ref()
            .is_some_and(|l| l.state == LeaseState::Finished)
        {
            finished.entry(&w.partition).or_insert(w.at);
        }
    }
    let created_by_host: std::collections::BTreeSet<&PartitionId> = writes
        .iter()
        .filter(|w| w.op == WriteOp::Create && w.host != DRIVER)
        .map(|w| &w.partition)
        .collect();
    let mut first_delivery: BTreeMap<&PartitionId, Duration> = BTreeMap::new();
    for d in deliveries {
        let at = first_delivery.entry(&d.partition).or_insert(d.at);
        *at = (*at).min(d.at);
    }
    partitions
        .iter()
        .filter(|p| !p.parents.is_empty() && created_by_host.contains(&p.id))
        .filter_map(|p| {
            let parents_end = p
                .parents
                .iter()
                .map(|parent| finished.get(parent).copied())
                .try_fold(Duration::ZERO, |end, at| at.map(|at| end.max(at)))?;
            let readable = parents_end.max(*first_append.get(&p.id)?);
            let first = *first_delivery.get(&p.id)?;
            Some(first.saturating_sub(readable))
        })
        .collect()
}

/// The `q`-quantile (0 to 1) of `waits`, by the nearest rank; zero when empty.
pub fn quantile(waits: &[Duration], q: f64) -> Duration {
    let mut sorted = waits.to_vec();
    sorted.sort_unstable();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::model::{GroupName, Lease, LeaseKey, Position};

    fn p(id: &str) -> PartitionId {
        PartitionId::new(id).unwrap()
    }

    fn part(id: &str, parents: &[&str]) -> Partition {
        Partition {
            id: p(id),
            parents: parents.iter().map(|x| p(x)).collect(),
            closed: false,
            key_range: None,
        }
    }

    fn finish(id: &str, secs: u64) -> WriteRec {
        write(id, secs, "h", WriteOp::Replace, LeaseState::Finished)
    }

    fn create(id: &str, host: &str) -> WriteRec {
        write(id, 0, host, WriteOp::Create, LeaseState::Available)
    }

    fn write(id: &str, secs: u64, host: &str, op: WriteOp, state: LeaseState) -> WriteRec {
        let mut lease = Lease::new(
            LeaseKey::new(GroupName::new("g").unwrap(), p(id)),
            Position::Beginning,
        );
        lease.state = state;
        WriteRec {
            at: Duration::from_secs(secs),
            host: host.into(),
            op,
            partition: p(id),
            after: Some(lease),
            owner_before: None,
            next_owner_before: None,
        }
    }

    fn delivery(id: &str, secs: u64) -> Delivery {
        Delivery {
            seq: secs,
            at: Duration::from_secs(secs),
            call: secs,
            call_at: Duration::from_secs(secs),
            host: "h".into(),
            epoch: 1,
            partition: p(id),
            record: secs,
        }
    }

    #[test]
    fn a_child_waits_from_its_last_parents_end_or_its_first_record() {
        let partitions = [
            part("0", &[]),
            part("1", &[]),
            part("2", &["0", "1"]),
            part("3", &["0"]),
            part("4", &["0"]),
            part("5", &["0"]),
        ];
        let writes = [
            create("2", "h"),
            create("3", "h"),
            create("4", "h"),
            create("5", DRIVER),
            finish("0", 10),
            finish("1", 14),
            finish("0", 30),
        ];
        let deliveries = [
            delivery("2", 20),
            delivery("2", 18),
            delivery("3", 40),
            delivery("5", 12),
            delivery("0", 1),
        ];
        let appended: BTreeMap<PartitionId, Duration> = [
            (p("2"), Duration::from_secs(5)),
            (p("3"), Duration::from_secs(25)),
        ]
        .into_iter()
        .collect();
        // "2": parents end at 14 (the first finish of each), first delivery at 18. "3": its
        // first record came at 25, after its parent's end. "4": never read. "5": its lease
        // was the simulator's.
        assert_eq!(
            child_waits(&partitions, &writes, &deliveries, &appended),
            [Duration::from_secs(4), Duration::from_secs(15)]
        );
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let waits: Vec<Duration> = [4, 1, 3, 2].map(Duration::from_secs).to_vec();
        assert_eq!(quantile(&waits, 0.5), Duration::from_secs(2));
        assert_eq!(quantile(&waits, 1.0), Duration::from_secs(4));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
