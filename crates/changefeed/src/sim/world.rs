//! The shared [`World`] of a simulated run: its random generator for per-call faults, the
//! fault rates, and the log of every store write, delivery and fleet event (with the event
//! trace, hashed as it grows), which the checker and the timeline read.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;
use tokio::time::Instant;

use crate::model::{HostName, Lease, PartitionId};

/// How much of the event trace a run keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceMode {
    /// Nothing (fastest; for scale runs).
    Off,
    /// Only a 64-bit hash of the trace.
    Hash,
    /// The whole trace text and its hash.
    Full,
}

/// The event trace: one line per event, hashed as it grows.
#[derive(Debug)]
pub(crate) struct Trace {
    mode: TraceMode,
    text: String,
    line: String,
    hash: u64,
}

impl Trace {
    fn new(mode: TraceMode) -> Self {
        Self {
            mode,
            text: String::new(),
            line: String::new(),
            hash: 0xcbf2_9ce4_8422_2325,
        }
    }

    pub(crate) fn on(&self) -> bool {
        self.mode != TraceMode::Off
    }

    pub(crate) fn push(&mut self, at: Duration, args: std::fmt::Arguments<'_>) {
        if self.mode == TraceMode::Off {
            return;
        }
        self.line.clear();
        let _ = write!(self.line, "{:>10} ", at.as_millis());
        let _ = self.line.write_fmt(args);
        self.line.push('\n');
        for b in self.line.bytes() {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(0x0000_0100_0000_01B3);
        }
        if self.mode == TraceMode::Full {
            self.text.push_str(&self.line);
        }
    }

    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    pub(crate) fn take_text(&mut self) -> String {
        std::mem::take(&mut self.text)
    }
}

/// One record applied by a handler call (a delivery).
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The order in which things happened: records applied and handler calls begun draw their
    /// numbers from one counter, so it orders applications by virtual time, and ties by the
    /// order the single-threaded run made them in. Unique in the run.
    pub seq: u64,
    /// Virtual time the record was applied.
    pub at: Duration,
    /// The handler call that applied it: the `seq` number drawn when the call began (unique in
    /// the run; every record of one call shares it).
    pub call: u64,
    /// Virtual time the call began.
    pub call_at: Duration,
    /// The delivering host.
    pub host: String,
    /// The ownership epoch: one per worker start (handler `open`), unique in the run.
    pub epoch: u64,
    /// The partition.
    pub partition: PartitionId,
    /// The record id (its payload).
    pub record: u64,
}

/// What kind of store write a [`WriteRec`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOp {
    /// `create`.
    Create,
    /// `replace`.
    Replace,
    /// `delete`.
    Delete,
}

/// One successful lease write, as the store applied it.
#[derive(Debug, Clone)]
pub struct WriteRec {
    /// Virtual time.
    pub at: Duration,
    /// The writing host (`driver` for the simulator's own writes).
    pub host: String,
    /// The operation.
    pub op: WriteOp,
    /// The partition.
    pub partition: PartitionId,
    /// The row's state after the write (`None` for a delete).
    pub after: Option<Lease>,
    /// The owner before the write.
    pub owner_before: Option<HostName>,
    /// The `next_owner` before the write.
    pub next_owner_before: Option<HostName>,
}

/// A fleet-level event (fault, arrival, split …), for the trace and the timeline.
#[derive(Debug, Clone)]
pub struct Event {
    /// Virtual time.
    pub at: Duration,
    /// What happened: `start`, `crash`, `stop`, `stopped`, `pause`, `cut`, `latency`, `split`,
    /// `merge`, `exit`.
    pub kind: &'static str,
    /// The host or partition concerned.
    pub subject: String,
    /// Details.
    pub detail: String,
}

/// When a host's path to the store turned healthy or unhealthy: healthy while the host is up
/// (started, not crashed or stopping), not stalled, not cut off and without a latency spike.
/// The liveness rule ([`super::check::liveness`]) reads these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthMark {
    /// Virtual time.
    pub at: Duration,
    /// The host.
    pub host: String,
    /// Whether its path is healthy from now on.
    pub healthy: bool,
}

/// A heartbeat the store applied (a renewal, a registration, a leader's renewal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatRec {
    /// Virtual time it was applied.
    pub at: Duration,
    /// The host.
    pub host: String,
}

/// Fault probabilities applied per call while faults are on.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Rates {
    pub store_error: f64,
    pub lost_reply: f64,
    pub conflict: f64,
    pub source_error: f64,
    pub handler_error: f64,
    /// Probability that a handler call is slow (applies its records one by one over a while).
    pub slow_handler: f64,
    /// The longest a slow call lasts (stalls not counted).
    pub slow_handler_max: Duration,
}

/// Conditions every host's store calls meet, set by a benchmark rather than drawn by the seed
/// (the random scenario leaves them off, so its runs do not change).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StoreConditions {
    /// Every store call takes from `latency.0` to `latency.1` (uniform), on top of any latency
    /// fault; zero: none.
    pub latency: (Duration, Duration),
    /// Ownership writes go through one shared change-counter item, as in the DynamoDB store: a
    /// write that reaches the item while another holds it fails with a transaction conflict
    /// and is retried after a back-off.
    pub counter: bool,
}

/// The shared change-counter item of [`StoreConditions::counter`].
#[derive(Debug, Default)]
pub(crate) struct CounterItem {
    /// Until when the last ownership write holds the item.
    pub busy_until: Duration,
    /// Transaction conflicts so far.
    pub conflicts: u64,
}

/// Everything the run logs.
#[derive(Debug)]
pub(crate) struct Log {
    pub trace: Trace,
    pub deliveries: Vec<Delivery>,
    pub writes: Vec<WriteRec>,
    pub events: Vec<Event>,
    pub next_seq: u64,
    pub next_epoch: u64,
    pub delivered: Vec<bool>,
    pub delivered_count: u64,
    pub keep_history: bool,
    /// When the first record of each partition was appended (for [`super::children`]).
    pub first_append: BTreeMap<PartitionId, Duration>,
    /// Every change of a host's path health (kept with the history).
    pub health: Vec<HealthMark>,
    /// Every heartbeat the store applied (kept with the history).
    pub heartbeats: Vec<HeartbeatRec>,
}

/// State shared by every seam of every host.
#[derive(Debug)]
pub(crate) struct World {
    pub origin: Instant,
    rng: Mutex<SmallRng>,
    log: Mutex<Log>,
    rates: Mutex<Rates>,
    conditions: Mutex<StoreConditions>,
    counter: Mutex<CounterItem>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Single-threaded runtime; a panic elsewhere already fails the run.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl World {
    pub(crate) fn new(rng: SmallRng, trace: TraceMode, keep_history: bool) -> Self {
        Self {
            origin: Instant::now(),
            rng: Mutex::new(rng),
            log: Mutex::new(Log {
                trace: Trace::new(trace),
                deliveries: Vec::new(),
                writes: Vec::new(),
                events: Vec::new(),
                next_seq: 0,
                next_epoch: 0,
                delivered: Vec::new(),
                delivered_count: 0,
                keep_history,
                first_append: BTreeMap::new(),
                health: Vec::new(),
                heartbeats: Vec::new(),
            }),
            rates: Mutex::new(Rates::default()),
            conditions: Mutex::new(StoreConditions::default()),
            counter: Mutex::new(CounterItem::default()),
        }
    }

    pub(crate) fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }

    pub(crate) fn log(&self) -> MutexGuard<'_, Log> {
        lock(&self.log)
    }

    pub(crate) fn set_rates(&self, rates: Rates) {
        *lock(&self.rates) = rates;
    }

    pub(crate) fn rates(&self) -> Rates {
        *lock(&self.rates)
    }

    pub(crate) fn set_conditions(&self, conditions: StoreConditions) {
        *lock(&self.conditions) = conditions;
    }

    pub(crate) fn conditions(&self) -> StoreConditions {
        *lock(&self.conditions)
    }

    pub(crate) fn counter(&self) -> MutexGuard<'_, CounterItem> {
        lock(&self.counter)
    }

    /// A duration drawn uniformly from `min` to `max` (whole milliseconds).
    pub(crate) fn between(&self, (min, max): (Duration, Duration)) -> Duration {
        let (lo, hi) = (min.as_millis() as u64, max.as_millis() as u64);
        Duration::from_millis(lock(&self.rng).gen_range(lo..=hi.max(lo)))
    }

    /// True with probability `p`; draws nothing when `p` is zero, so runs without a fault do
    /// not depend on how often it is asked.
    pub(crate) fn roll(&self, p: f64) -> bool {
        p > 0.0 && lock(&self.rng).gen_bool(p.min(1.0))
    }

    pub(crate) fn below(&self, max: u64) -> u64 {
        lock(&self.rng).gen_range(0..=max)
    }

    /// How long a slow handler call lasts: log-uniform-ish from [`SLOW_CALL_MIN`] to `max`
    /// (an octave chosen uniformly, then a length uniformly within it), so most calls are
    /// short and a few last several fence windows. Integer arithmetic only, so a seed runs the
    /// same on every platform.
    pub(crate) fn call_length(&self, max: Duration) -> Duration {
        let min_ms = SLOW_CALL_MIN.as_millis() as u64;
        let max_ms = (max.as_millis() as u64).max(min_ms);
        let octaves = (max_ms / min_ms).ilog2();
        let mut rng = lock(&self.rng);
        let lo = min_ms << rng.gen_range(0..=octaves);
        let hi = lo.saturating_mul(2).min(max_ms).max(lo);
        Duration::from_millis(rng.gen_range(lo..=hi))
    }

    /// The next number of the run's order of applications and call starts.
    pub(crate) fn next_seq(&self) -> u64 {
        let mut log = self.log();
        log.next_seq += 1;
        log.next_seq
    }

    pub(crate) fn event(&self, kind: &'static str, subject: &str, detail: String) {
        let at = self.now();
        let mut log = self.log();
        log.trace
            .push(at, format_args!("event {kind} {subject} {detail}"));
        log.events.push(Event {
            at,
            kind,
            subject: subject.to_string(),
            detail,
        });
    }

    /// `host`'s path health changed to `healthy` now.
    pub(crate) fn health(&self, host: &str, healthy: bool) {
        let at = self.now();
        let mut log = self.log();
        if log.keep_history {
            log.health.push(HealthMark {
                at,
                host: host.to_string(),
                healthy,
            });
        }
    }

    /// The store applied a heartbeat of `host` now.
    pub(crate) fn heartbeat(&self, host: &str) {
        let at = self.now();
        let mut log = self.log();
        log.trace.push(at, format_args!("heartbeat {host}"));
        if log.keep_history {
            log.heartbeats.push(HeartbeatRec {
                at,
                host: host.to_string(),
            });
        }
    }

    /// A record was appended to `partition` now.
    pub(crate) fn appended(&self, partition: &PartitionId) {
        let at = self.now();
        let mut log = self.log();
        if !log.first_append.contains_key(partition) {
            log.first_append.insert(partition.clone(), at);
        }
    }

    pub(crate) fn write(
        &self,
        host: &str,
        op: WriteOp,
        partition: &PartitionId,
        after: Option<&Lease>,
        before: Option<&Lease>,
    ) {
        let at = self.now();
        let mut log = self.log();
        if log.trace.on() {
            match after {
                Some(l) => log.trace.push(
                    at,
                    format_args!(
                        "write {host} {op:?} {partition} {} {} owner={:?} next={:?} cont={:?}",
                        l.version,
                        l.state,
                        l.owner.as_ref().map(|o| o.as_str()),
                        l.next_owner.as_ref().map(|o| o.as_str()),
                        l.continuation.as_ref().map(|c| c.as_str())
                    ),
                ),
                None => log
                    .trace
                    .push(at, format_args!("write {host} {op:?} {partition}")),
            }
        }
        if log.keep_history {
            log.writes.push(WriteRec {
                at,
                host: host.to_string(),
                op,
                partition: partition.clone(),
                after: after.cloned(),
                owner_before: before.and_then(|b| b.owner.clone()),
                next_owner_before: before.and_then(|b| b.next_owner.clone()),
            });
        }
    }
}

/// The writer name of the simulator's own lease writes.
pub(crate) const DRIVER: &str = "driver";

/// The shortest slow handler call.
const SLOW_CALL_MIN: Duration = Duration::from_millis(5);
