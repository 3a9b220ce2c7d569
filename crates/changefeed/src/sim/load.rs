//! The loads simulated hosts running [`LoadShare`] plan by: each lease's records applied per
//! second, as an exponential moving average on virtual time, and when each lease last changed
//! owner, both measured from the run's own deliveries and lease writes.
//!
//! The processor measures its leases' loads and publishes them with its heartbeat, but its
//! hosts do not yet read each other's reports to plan, so a host given `LoadShare` plans by
//! counts. The simulator stands in for that path: every host reads one meter
//! ([`MeasuredLoadShare`]), as if each owner had published its leases' rates the moment it
//! applied their records. What it leaves out is the delay and the loss of
//! publishing them; the rates themselves are what the run delivered.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::world::World;
use crate::balance::{BalanceStrategy, LoadInput, LoadShare, Plan, Snapshot};
use crate::model::{HostName, PartitionId};

/// The time constant of the measured rates: five acquire intervals of the simulator's
/// settings, long enough to smooth batches of up to 20 records at a few records a second.
const AVERAGE: Duration = Duration::from_secs(10);

/// Each lease's measured rate and last move; see the module doc.
#[derive(Debug, Default)]
pub(crate) struct LoadMeter {
    /// Per partition: the moving average (records/s) and when it was last updated.
    rates: BTreeMap<PartitionId, (f64, Duration)>,
    moved_at: BTreeMap<PartitionId, Duration>,
}

impl LoadMeter {
    /// `n` records of `partition` were applied at `at`.
    pub(crate) fn applied(&mut self, partition: &PartitionId, n: usize, at: Duration) {
        let (rate, since) = self.rates.entry(partition.clone()).or_insert((0.0, at));
        *rate = decayed(*rate, at.saturating_sub(*since)) + n as f64 / AVERAGE.as_secs_f64();
        *since = at;
    }

    /// `partition` changed owner at `at`.
    pub(crate) fn moved(&mut self, partition: &PartitionId, at: Duration) {
        self.moved_at.insert(partition.clone(), at);
    }

    /// Every measured rate at `now`, records/s.
    pub(crate) fn rates(&self, now: Duration) -> BTreeMap<PartitionId, f64> {
        self.rates
            .iter()
            .map(|(p, &(rate, since))| (p.clone(), decayed(rate, now.saturating_sub(since))))
            .collect()
    }
}

fn decayed(rate: f64, after: Duration) -> f64 {
    rate * (-after.as_secs_f64() / AVERAGE.as_secs_f64()).exp()
}

/// [`LoadShare`] at its defaults, given the run's [`LoadMeter`] at every plan (every host's
/// capacity 1).
#[derive(Debug)]
pub(crate) struct MeasuredLoadShare {
    pub(crate) world: Arc<World>,
    pub(crate) inner: LoadShare,
}

impl BalanceStrategy for MeasuredLoadShare {
    fn plan(&self, snapshot: &Snapshot<'_>) -> Plan {
        let now = self.world.now();
        let meter = self.world.meter();
        let rates = meter.rates(now);
        let capacity: BTreeMap<HostName, f64> = BTreeMap::new();
        let input = LoadInput {
            lease_load: &rates,
            capacity: &capacity,
            moved_at: &meter.moved_at,
            now,
        };
        self.inner.plan_with_load(snapshot, &input)
    }
}
