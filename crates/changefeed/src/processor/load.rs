//! The host's load signal: what its workers measure on each lease they hold, and the
//! [`HostReport`] its heartbeat publishes from it.
//!
//! Each measure is a moving average with time constant [`TIME_CONSTANT`]: an amount that
//! arrives adds to a sum that decays as `exp(−age ÷ τ)`, and the rate is that sum ÷ τ. An idle
//! lease's rates decay to nothing without any event, and a reading costs no timer.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::clock::Instant;
use crate::model::{HostReport, LeaseLoad, PartitionId};

use super::Settings;

/// The time constant of every moving average: long enough that one slow batch does not make
/// a lease look hot, short enough that a hot spot shows within a few heartbeats.
pub const TIME_CONSTANT: Duration = Duration::from_secs(30);

/// An exponentially decaying sum of the amounts recorded.
#[derive(Debug, Clone, Copy)]
struct Decaying {
    sum: f64,
    at: Instant,
}

impl Decaying {
    fn new(at: Instant) -> Self {
        Decaying { sum: 0.0, at }
    }

    fn decayed(&self, now: Instant) -> f64 {
        let age = now.saturating_duration_since(self.at).as_secs_f64();
        self.sum * (-age / TIME_CONSTANT.as_secs_f64()).exp()
    }

    fn add(&mut self, amount: f64, now: Instant) {
        self.sum = self.decayed(now) + amount;
        self.at = now;
    }

    /// The rate per second at `now`.
    fn rate(&self, now: Instant) -> f64 {
        self.decayed(now) / TIME_CONSTANT.as_secs_f64()
    }
}

/// One lease's measures.
#[derive(Debug, Clone, Copy)]
struct Meter {
    records: Decaying,
    bytes: Decaying,
    busy: Decaying,
}

/// The host's load book: written by its workers, read by its heartbeat.
#[derive(Debug)]
pub(crate) struct LoadBook {
    capacity: f64,
    min_leases: Option<usize>,
    max_leases: Option<usize>,
    publish_load: bool,
    leases: Mutex<HashMap<PartitionId, Meter>>,
}

impl LoadBook {
    pub(crate) fn new(settings: &Settings) -> Self {
        LoadBook {
            capacity: settings.capacity.unwrap_or_else(default_capacity),
            min_leases: (settings.min_leases > 0).then_some(settings.min_leases),
            max_leases: settings.max_leases,
            publish_load: settings.publish_load,
            leases: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PartitionId, Meter>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handler call of `partition` that ran `busy` and ended at `now`, delivering `records`
    /// records of `bytes` bytes (0 and 0 for a call that failed: its time still counts).
    pub(crate) fn record(
        &self,
        partition: &PartitionId,
        records: usize,
        bytes: usize,
        busy: Duration,
        now: Instant,
    ) {
        let mut leases = self.lock();
        let meter = leases.entry(partition.clone()).or_insert(Meter {
            records: Decaying::new(now),
            bytes: Decaying::new(now),
            busy: Decaying::new(now),
        });
        meter.records.add(records as f64, now);
        meter.bytes.add(bytes as f64, now);
        meter.busy.add(busy.as_secs_f64(), now);
    }

    /// The worker of `partition` stopped: the host no longer carries its load.
    pub(crate) fn forget(&self, partition: &PartitionId) {
        self.lock().remove(partition);
    }

    /// What the heartbeat publishes at `now`: the capacity and limits always, each held
    /// lease's load when the host publishes loads.
    pub(crate) fn report(&self, now: Instant) -> HostReport {
        let mut report = HostReport::new(self.capacity);
        report.min_leases = self.min_leases;
        report.max_leases = self.max_leases;
        if self.publish_load {
            report.leases = self
                .lock()
                .iter()
                .map(|(p, m)| {
                    let load = LeaseLoad {
                        records_per_second: m.records.rate(now),
                        bytes_per_second: m.bytes.rate(now),
                        busy: m.busy.rate(now),
                    };
                    (p.clone(), load)
                })
                .collect();
        }
        report
    }
}

/// The cores this process may use, or 1 when that is unknown.
fn default_capacity() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str) -> PartitionId {
        PartitionId::new(id).expect("a valid partition id")
    }

    fn book(publish_load: bool) -> LoadBook {
        LoadBook::new(&Settings {
            capacity: Some(2.0),
            max_leases: Some(10),
            publish_load,
            ..Settings::default()
        })
    }

    #[test]
    fn a_steady_rate_is_measured_as_that_rate() {
        let t0 = Instant::now();
        let b = book(true);
        // 100 records of 10 bytes each second, each call busy 250 ms, for ten time constants.
        let secs = TIME_CONSTANT.as_secs() * 10;
        for s in 1..=secs {
            b.record(
                &p("a"),
                100,
                1000,
                Duration::from_millis(250),
                t0 + Duration::from_secs(s),
            );
        }
        let r = b.report(t0 + Duration::from_secs(secs));
        let load = r.leases[&p("a")];
        assert!((load.records_per_second - 100.0).abs() < 2.0, "{load:?}");
        assert!((load.bytes_per_second - 1000.0).abs() < 20.0, "{load:?}");
        assert!((load.busy - 0.25).abs() < 0.01, "{load:?}");
        assert_eq!(r.capacity, 2.0);
        assert_eq!(r.max_leases, Some(10));
        assert_eq!(r.min_leases, None);
    }

    #[test]
    fn an_idle_lease_decays_and_a_stopped_one_is_gone() {
        let t0 = Instant::now();
        let b = book(true);
        b.record(&p("a"), 1000, 0, Duration::from_secs(1), t0);
        b.record(&p("b"), 1000, 0, Duration::from_secs(1), t0);
        let later = t0 + TIME_CONSTANT * 5;
        let r = b.report(later);
        assert!(r.leases[&p("a")].records_per_second < 1000.0 / 30.0 * 0.01);
        b.forget(&p("b"));
        assert!(!b.report(later).leases.contains_key(&p("b")));
    }

    #[test]
    fn without_publishing_loads_the_report_holds_capacity_and_limits_only() {
        let t0 = Instant::now();
        let b = book(false);
        b.record(&p("a"), 10, 10, Duration::from_millis(5), t0);
        assert_eq!(b.report(t0).to_json(), r#"{"v":1,"c":2.0,"max":10}"#);
    }
}
