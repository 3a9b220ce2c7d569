//! The deterministic fleet simulator (feature `sim`): many hosts running the real processor
//! over the in-memory store and feed on virtual time, with faults chosen by one seed, and an
//! invariant checker over what they delivered and wrote.
//!
//! One seed gives one exact run: every random choice (faults, keys, each host's processor seed)
//! comes from a generator seeded with it; each run gets a fresh current-thread tokio runtime
//! with its clock paused, so tasks run in a fixed order and time only moves when every task
//! waits. [`run`] returns the event trace (or its hash) and the [`Violation`]s found; a failing
//! seed is reproduced by running its [`SimConfig`] again (the `changefeed simulate` command
//! prints the command line that does).
//!
//! The simulator owns the seams' fault injection ([`Fault`]), the scenario and the checker
//! ([`fn@check`]); it records each run's writes and events ([`SimOutcome`]) and leaves drawing
//! them (`changefeed simulate --svg`) to the CLI. Its hosts are the fleet harness's
//! ([`SimFleet`]) with fault-injecting seams. The processor under test is the real one, except
//! that a build with feature `sim-broken` may switch on one deliberately broken variant
//! (`Broken`) to show the checker catches it.
//!
//! ```
//! use changefeed::sim::{run, Faults, SimConfig};
//! let mut cfg = SimConfig::new(7);
//! cfg.faults = Faults::all();
//! let outcome = run(&cfg).expect("the simulation runs");
//! assert!(outcome.violations.is_empty(), "seed 7: {:?}", outcome.violations);
//! ```

pub mod check;
pub mod children;
mod fleet;
mod pool;
mod seams;
mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::Rng;

pub use check::{check, liveness, CheckInput, LivenessInput, LivenessWindows, Violation};
pub use fleet::{FleetConfig, SimFleet, SimHost, SimKit};
pub use pool::{PoolConfig, PoolCounts};
pub use seams::Cut;
pub use world::{Delivery, Event, HealthMark, HeartbeatRec, TraceMode, WriteOp, WriteRec};

use crate::balance::{BalanceStrategy, CosmosLike, EqualShare, Kcl3Like, KclLike, LoadShare};
use crate::model::{Partition, PartitionId};
#[cfg(feature = "sim-broken")]
pub use crate::processor::Broken;
use crate::processor::{CheckpointMode, Settings};
use crate::source::FeedSource;

/// A kind of fault the simulator can inject. Each is chosen by the seed at its own rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A host dies: tasks dropped, nothing released.
    Crash,
    /// A host stops gracefully (releases its leases).
    Stop,
    /// A crashed or stopped host comes back under the same name.
    Restart,
    /// A host stalls (GC pause): its seams and timers wait, then it resumes.
    Pause,
    /// A host's store calls fail or hang for a while; half the hangs black-hole its whole
    /// network and leave its client's connections dead when they end ([`Cut::Forget`]).
    CutOff,
    /// A host's store calls are slow for a while.
    Latency,
    /// A compare-and-swap fails with the real current row though nothing changed.
    Conflict,
    /// Store calls fail transiently, some after the write was applied (reply lost).
    StoreError,
    /// Source reads fail transiently.
    SourceError,
    /// Host wall clocks are off by up to ±10 minutes.
    Skew,
    /// Host clocks run fast or slow, within the safety margin.
    Drift,
    /// Partitions split.
    Split,
    /// Adjacent partitions merge.
    Merge,
    /// The handler fails batches (they are retried).
    HandlerError,
    /// Some handler calls are slow: they apply their records one by one over a few
    /// milliseconds to several fence windows, so stalls, cut-offs and lease moves land inside
    /// them.
    SlowHandler,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 15] = [
        Fault::Crash,
        Fault::Stop,
        Fault::Restart,
        Fault::Pause,
        Fault::CutOff,
        Fault::Latency,
        Fault::Conflict,
        Fault::StoreError,
        Fault::SourceError,
        Fault::Skew,
        Fault::Drift,
        Fault::Split,
        Fault::Merge,
        Fault::HandlerError,
        Fault::SlowHandler,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Crash => "crash",
            Fault::Stop => "stop",
            Fault::Restart => "restart",
            Fault::Pause => "pause",
            Fault::CutOff => "cutoff",
            Fault::Latency => "latency",
            Fault::Conflict => "conflict",
            Fault::StoreError => "store-error",
            Fault::SourceError => "source-error",
            Fault::Skew => "skew",
            Fault::Drift => "drift",
            Fault::Split => "split",
            Fault::Merge => "merge",
            Fault::HandlerError => "handler-error",
            Fault::SlowHandler => "slow-handler",
        }
    }
}

/// A set of faults and a rate multiplier.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// The faults switched on.
    pub set: BTreeSet<Fault>,
    /// Multiplies every fault's base rate (1.0 by default).
    pub rate: f64,
}

impl Faults {
    /// No fault.
    pub fn none() -> Self {
        Self {
            set: BTreeSet::new(),
            rate: 1.0,
        }
    }

    /// Every fault.
    pub fn all() -> Self {
        Self {
            set: Fault::ALL.into_iter().collect(),
            rate: 1.0,
        }
    }

    /// Whether `f` is on.
    pub fn has(&self, f: Fault) -> bool {
        self.set.contains(&f)
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.set.len() == Fault::ALL.len() {
            return f.write_str("all");
        }
        if self.set.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.set.iter().map(|x| x.name()).collect();
        f.write_str(&names.join(","))
    }
}

impl FromStr for Faults {
    type Err = String;

    /// `all`, `none`, or a comma-separated list of fault names.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => return Ok(Self::all()),
            "none" | "" => return Ok(Self::none()),
            _ => {}
        }
        let mut set = BTreeSet::new();
        for name in s.split(',').map(str::trim) {
            let f = Fault::ALL
                .into_iter()
                .find(|f| f.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
                    format!(
                        "unknown fault {name:?}; expected all, none or some of {}",
                        known.join(",")
                    )
                })?;
            set.insert(f);
        }
        Ok(Self { set, rate: 1.0 })
    }
}

/// Which balancing strategy the simulated hosts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StrategyKind {
    /// [`EqualShare`], ours (`ours` on the command line).
    EqualShare,
    /// [`KclLike`].
    Kcl,
    /// [`CosmosLike`].
    Cosmos,
    /// [`Kcl3Like`], KCL 3.x's leader-driven assignment (`kcl3` on the command line).
    Kcl3,
    /// [`LoadShare`] (`load` on the command line). In a [`SimFleet`] its hosts plan by the
    /// records each lease delivered per second in the run (a moving average), as a stand-in
    /// for loads the processor does not yet publish; elsewhere, by counts.
    Load,
    /// [`KclLike`] stealing at most this many leases per cycle (`usize::MAX`: no cap), for the
    /// benchmark's sweep of `maxLeasesToStealAtOneTime`. Not accepted on the command line;
    /// [`StrategyKind::Kcl`] is the default cap of 1.
    KclSteal(usize),
}

impl StrategyKind {
    /// The strategy.
    pub fn strategy(self) -> Arc<dyn BalanceStrategy> {
        match self {
            StrategyKind::EqualShare => Arc::new(EqualShare::default()),
            StrategyKind::Kcl => Arc::new(KclLike::default()),
            StrategyKind::Cosmos => Arc::new(CosmosLike),
            StrategyKind::Kcl3 => Arc::new(Kcl3Like),
            StrategyKind::Load => Arc::new(LoadShare::default()),
            StrategyKind::KclSteal(cap) => Arc::new(KclLike {
                max_leases_to_steal: cap,
            }),
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::EqualShare => "ours",
            StrategyKind::Kcl => "kcl",
            StrategyKind::Cosmos => "cosmos",
            StrategyKind::Kcl3 => "kcl3",
            StrategyKind::Load => "load",
            StrategyKind::KclSteal(_) => "kcl-steal",
        }
    }
}

impl FromStr for StrategyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ours" | "equal" | "equal-share" => Ok(Self::EqualShare),
            "load" => Ok(Self::Load),
            "kcl" => Ok(Self::Kcl),
            "cosmos" => Ok(Self::Cosmos),
            "kcl3" => Ok(Self::Kcl3),
            other => Err(format!(
                "unknown strategy {other:?}; expected ours (or equal), load, kcl, kcl3 or cosmos"
            )),
        }
    }
}

/// Parses a broken variant's command-line name.
///
/// # Errors
/// A message naming the accepted values.
#[cfg(feature = "sim-broken")]
pub fn parse_broken(s: &str) -> Result<Broken, String> {
    match s {
        "none" => Ok(Broken::None),
        "no-fencing" => Ok(Broken::NoFencing),
        "checkpoint-without-cas" => Ok(Broken::CheckpointWithoutCas),
        "child-before-parent" => Ok(Broken::ChildBeforeParent),
        "no-handler-fence" => Ok(Broken::NoHandlerFence),
        "no-admission" => Ok(Broken::NoAdmission),
        "no-timeouts" => Ok(Broken::NoTimeouts),
        other => Err(format!(
            "unknown broken variant {other:?}; expected no-fencing, checkpoint-without-cas, child-before-parent, no-handler-fence, no-admission or no-timeouts"
        )),
    }
}

/// A broken variant's command-line name.
#[cfg(feature = "sim-broken")]
pub fn broken_name(b: Broken) -> &'static str {
    match b {
        Broken::None => "none",
        Broken::NoFencing => "no-fencing",
        Broken::CheckpointWithoutCas => "checkpoint-without-cas",
        Broken::ChildBeforeParent => "child-before-parent",
        Broken::NoHandlerFence => "no-handler-fence",
        Broken::NoAdmission => "no-admission",
        Broken::NoTimeouts => "no-timeouts",
    }
}

/// One simulation run's parameters.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The seed: one seed, one run.
    pub seed: u64,
    /// Hosts at the start.
    pub hosts: usize,
    /// Partitions at the start.
    pub partitions: u32,
    /// Virtual time with faults and writes, before the final drain.
    pub duration: Duration,
    /// The faults.
    pub faults: Faults,
    /// The balancing strategy.
    pub strategy: StrategyKind,
    /// How many handler calls each lease's batch may be split into, one key per call
    /// ([`crate::processor::ProcessorBuilder::key_concurrency`]); 1: the whole batch in one
    /// call. Above 1 the checker checks order per key.
    pub key_concurrency: usize,
    /// A deliberately broken processor variant.
    #[cfg(feature = "sim-broken")]
    pub broken: Broken,
    /// Records written per virtual second.
    pub records_per_sec: u64,
    /// What trace to keep.
    pub trace: TraceMode,
    /// How long the drain after the faults may take (virtual) before undelivered records count
    /// as lost.
    pub drain_limit: Duration,
    /// Every host's settings; [`SimConfig::new`] uses short intervals. With faults on, the
    /// checkpoint mode is chosen by the seed.
    pub settings: Settings,
    /// With `Some(n)`, the timed host faults (crash, stop, pause, cut-off, latency) strike a
    /// fleet of more than `n` hosts as often in all as they strike `n` hosts at their
    /// per-host rates: each host's rate is scaled by `n / hosts`. `None`: per host.
    pub timed_fault_hosts: Option<usize>,
    /// Whether the hosts share their lease tables (one `TableShare` inside the processor): a host
    /// then starts each list of changes from the most recent table any host listed, so a
    /// fleet applies each change about once instead of once per host. The hosts' decisions
    /// are those of hosts listing on their own, but they read fewer rows, so store costs are
    /// not measured with it.
    pub share_tables: bool,
}

impl SimConfig {
    /// A small fleet (4 hosts, 8 partitions, 3 virtual minutes) with no faults.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            hosts: 4,
            partitions: 8,
            duration: Duration::from_secs(180),
            faults: Faults::none(),
            strategy: StrategyKind::EqualShare,
            key_concurrency: 1,
            #[cfg(feature = "sim-broken")]
            broken: Broken::None,
            records_per_sec: 20,
            trace: TraceMode::Hash,
            drain_limit: Duration::from_secs(600),
            settings: sim_settings(),
            timed_fault_hosts: None,
            share_tables: false,
        }
    }
}

/// The timing settings of simulated hosts: 10 s expiry, 2 s renew and acquire, 2 s margin,
/// batches of 20.
pub fn sim_settings() -> Settings {
    Settings {
        lease_expiry: Duration::from_secs(10),
        renew_interval: Duration::from_secs(2),
        safety_margin: Duration::from_secs(2),
        acquire_interval: Duration::from_secs(2),
        full_list_interval: Duration::from_secs(60),
        poll_delay: Duration::from_millis(500),
        handoff_timeout: Duration::from_secs(10),
        max_batch_size: 20,
        min_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(5),
        ..Settings::default()
    }
}

/// What a run produced.
#[derive(Debug)]
pub struct SimOutcome {
    /// The seed.
    pub seed: u64,
    /// Hash of the event trace (FNV-1a over its bytes).
    pub trace_hash: u64,
    /// The event trace, when [`TraceMode::Full`].
    pub trace: String,
    /// Broken rules.
    pub violations: Vec<Violation>,
    /// Records written.
    pub written: u64,
    /// Distinct records delivered.
    pub delivered: u64,
    /// Deliveries in all (duplicates included).
    pub deliveries: u64,
    /// Fleet events (faults, starts, splits).
    pub events: Vec<Event>,
    /// Every lease write.
    pub writes: Vec<WriteRec>,
    /// Every partition at the end, with its parents.
    pub partitions: Vec<Partition>,
    /// Virtual time the run took, drain included.
    pub virtual_time: Duration,
    /// How long each child partition read in the run waited after its parents ended (see
    /// [`children::child_waits`]).
    pub child_waits: Vec<Duration>,
    /// The longest stretch the liveness rule judged of each kind (a healthy host without a
    /// heartbeat, then without a lease it should hold), if any: how close the run came to
    /// its windows ([`SimOutcome::liveness_windows`]).
    pub longest_gaps: Vec<check::Gap>,
    /// The liveness rule's windows in this run.
    pub liveness_windows: LivenessWindows,
}

/// Why a run could not be carried out (not a violation: the simulator itself failed).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The tokio runtime could not be built.
    #[error("could not build the simulation runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// Runs one seed on a fresh paused current-thread runtime; see the module docs.
///
/// # Errors
/// [`SimError`] if the runtime cannot be built.
pub fn run(cfg: &SimConfig) -> Result<SimOutcome, SimError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    Ok(rt.block_on(scenario(cfg.clone())))
}

/// Base rates, per virtual minute per host, for the timed faults; per call for the others.
mod rate {
    pub const CRASH: f64 = 0.15;
    pub const STOP: f64 = 0.10;
    pub const PAUSE: f64 = 0.15;
    pub const CUT: f64 = 0.15;
    pub const LATENCY: f64 = 0.2;
    /// Per fleet per virtual minute.
    pub const SPLIT: f64 = 0.8;
    pub const MERGE: f64 = 0.5;
    pub const STORE_ERROR: f64 = 0.01;
    pub const LOST_REPLY: f64 = 0.003;
    pub const CONFLICT: f64 = 0.01;
    pub const SOURCE_ERROR: f64 = 0.01;
    pub const HANDLER_ERROR: f64 = 0.02;
    /// Per handler call: the share of calls that are slow.
    pub const SLOW_HANDLER: f64 = 0.05;
    /// The longest slow call, in fence windows (`lease_expiry − safety_margin`).
    pub const SLOW_HANDLER_WINDOWS: u32 = 3;
}

async fn scenario(mut cfg: SimConfig) -> SimOutcome {
    let faults = cfg.faults.clone();
    let on = |f: Fault| faults.has(f);
    let scale = faults.rate;
    // The seed's checkpoint cadence: a draw from 0 to 9 of a generator of its own (so it
    // takes nothing from the fleet's); with faults on, 0, 1 and 2 checkpoint every 3, 8 or
    // 13 s instead of after every batch.
    let checkpoint_draw = {
        use rand::SeedableRng;
        rand::rngs::SmallRng::seed_from_u64(cfg.seed ^ 0x5151_5151).gen_range(0u32..10)
    };
    if !faults.set.is_empty() && checkpoint_draw < 3 {
        cfg.settings.checkpoint_mode =
            CheckpointMode::Interval(Duration::from_secs(3 + u64::from(checkpoint_draw) * 5));
    }
    // The seed's store: with faults on, 3 seeds in 10 (a draw of a generator of its own) play
    // a store that limits the fleet's head reads, at a rate that stretches every cycle to 1.5
    // acquire intervals once all hosts are live (`docs/protocol.md`, "Pacing the head").
    let pacing_draw = {
        use rand::SeedableRng;
        rand::rngs::SmallRng::seed_from_u64(cfg.seed ^ 0x7A7A_7A7A).gen_range(0u32..10)
    };
    let head_reads_per_second = (!faults.set.is_empty() && pacing_draw < 3)
        .then(|| cfg.hosts.max(1) as f64 / (1.5 * cfg.settings.acquire_interval.as_secs_f64()));
    // The seed's client, in front of every host's store and feed (`pool.rs`): the correct one,
    // with a per-call timeout of its own from 3 to 10 s or, 3 seeds in 10, none (then only the
    // processor's bounds end a call on a dead connection); the broken one with `no-timeouts`.
    let client = {
        use rand::SeedableRng;
        let mut draw = rand::rngs::SmallRng::seed_from_u64(cfg.seed ^ 0x3C3C_3C3C);
        let call_timeout = (draw.gen_range(0u32..10) >= 3)
            .then(|| Duration::from_millis(draw.gen_range(3_000..=10_000)));
        PoolConfig::correct(call_timeout)
    };
    #[cfg(feature = "sim-broken")]
    let client = if cfg.broken == Broken::NoTimeouts {
        PoolConfig::no_timeouts()
    } else {
        client
    };
    let max_duplicates = match cfg.settings.checkpoint_mode {
        CheckpointMode::EveryBatch => Some(cfg.settings.max_batch_size),
        _ => None,
    };
    let mut fleet = SimFleet::simulated(FleetConfig {
        seed: cfg.seed,
        partitions: cfg.partitions,
        settings: cfg.settings.clone(),
        strategy: cfg.strategy,
        anchor_costs: false,
        trace: cfg.trace,
        history: true,
        head_reads_per_second,
        share_tables: cfg.share_tables,
        pool: Some(client),
    })
    .await;
    #[cfg(feature = "sim-broken")]
    fleet.set_broken(cfg.broken);
    fleet.set_key_concurrency(cfg.key_concurrency);
    fleet.kit.world.set_rates(world::Rates {
        store_error: if on(Fault::StoreError) {
            rate::STORE_ERROR * scale
        } else {
            0.0
        },
        lost_reply: if on(Fault::StoreError) {
            rate::LOST_REPLY * scale
        } else {
            0.0
        },
        conflict: if on(Fault::Conflict) {
            rate::CONFLICT * scale
        } else {
            0.0
        },
        source_error: if on(Fault::SourceError) {
            rate::SOURCE_ERROR * scale
        } else {
            0.0
        },
        handler_error: if on(Fault::HandlerError) {
            rate::HANDLER_ERROR * scale
        } else {
            0.0
        },
        slow_handler: if on(Fault::SlowHandler) {
            rate::SLOW_HANDLER * scale
        } else {
            0.0
        },
        slow_handler_max: cfg
            .settings
            .lease_expiry
            .saturating_sub(cfg.settings.safety_margin)
            * rate::SLOW_HANDLER_WINDOWS,
    });
    let names: Vec<String> = (0..cfg.hosts).map(|i| format!("h{i:02}")).collect();
    let margin = cfg.settings.safety_margin.as_secs_f64() / cfg.settings.lease_expiry.as_secs_f64();
    for name in &names {
        let skew = if on(Fault::Skew) {
            fleet.rng().gen_range(-600_000i64..=600_000)
        } else {
            0
        };
        // Drift within the margin: a quarter of it each way, so two hosts drifting apart
        // still stay inside it.
        let max_ppm = (margin / 4.0 * 1e6) as i64;
        let drift = if on(Fault::Drift) {
            fleet.rng().gen_range(-max_ppm..=max_ppm)
        } else {
            0
        };
        fleet.set_clock(name, skew, drift);
        fleet.start(name);
    }

    let step = Duration::from_millis(500);
    let per_step = |r: f64| r * scale * step.as_secs_f64() / 60.0;
    let host_scale = cfg
        .timed_fault_hosts
        .map_or(1.0, |n| (n as f64 / cfg.hosts.max(1) as f64).min(1.0));
    let per_host_step = |r: f64| per_step(r) * host_scale;
    let keys = (cfg.partitions * 2).max(64);
    let mut restart_at: BTreeMap<String, Duration> = BTreeMap::new();
    let max_partitions = cfg.partitions as usize * 4;
    let mut writes_carry = 0.0f64;
    while fleet.now() < cfg.duration {
        writes_carry += cfg.records_per_sec as f64 * step.as_secs_f64();
        let n = writes_carry as u64;
        writes_carry -= n as f64;
        fleet.write_random_keys(n, keys);
        let now = fleet.now();
        let states = fleet.states(&names);
        for (name, &(up, paused)) in names.iter().zip(&states) {
            if up && on(Fault::Crash) && fleet.rng().gen_bool(per_host_step(rate::CRASH)) {
                fleet.crash(name);
            } else if up && on(Fault::Stop) && fleet.rng().gen_bool(per_host_step(rate::STOP)) {
                fleet.begin_stop(name);
            } else if up
                && on(Fault::Pause)
                && !paused
                && fleet.rng().gen_bool(per_host_step(rate::PAUSE))
            {
                let ms = fleet.rng().gen_range(1_000..=30_000);
                fleet.pause(name, Duration::from_millis(ms));
            } else if up && on(Fault::CutOff) && fleet.rng().gen_bool(per_host_step(rate::CUT)) {
                let mode = if fleet.rng().gen_bool(0.5) {
                    Cut::Fail
                } else if fleet.rng().gen_bool(0.5) {
                    Cut::Hang
                } else {
                    Cut::Forget
                };
                let ms = fleet.rng().gen_range(2_000..=40_000);
                fleet.cut(name, mode, Duration::from_millis(ms));
            } else if up && on(Fault::Latency) && fleet.rng().gen_bool(per_host_step(rate::LATENCY))
            {
                let max = fleet.rng().gen_range(50..=3_000);
                let ms = fleet.rng().gen_range(2_000..=30_000);
                fleet.latency(name, Duration::from_millis(max), Duration::from_millis(ms));
            }
        }
        // Restarts of hosts that went down.
        for name in fleet.down() {
            if !on(Fault::Restart) {
                continue;
            }
            match restart_at.get(&name) {
                None => {
                    let after = Duration::from_millis(fleet.rng().gen_range(1_000..=60_000));
                    restart_at.insert(name, now + after);
                }
                Some(at) if *at <= now => {
                    restart_at.remove(&name);
                    fleet.start(&name);
                }
                Some(_) => {}
            }
        }
        // Never leave the fleet empty for long: without restarts, bring one host back.
        if fleet.running().is_empty() && !on(Fault::Restart) {
            if let Some(name) = fleet.down().first().cloned() {
                fleet.start(&name);
            }
        }
        // Splits and merges (the partition list is read only when one is due).
        let split = on(Fault::Split) && fleet.rng().gen_bool(per_step(rate::SPLIT));
        let merge = on(Fault::Merge) && fleet.rng().gen_bool(per_step(rate::MERGE));
        let all: Vec<Partition> = if split || merge {
            fleet.feed.partitions().await.unwrap_or_default()
        } else {
            Vec::new()
        };
        let total = all.len();
        let open: Vec<Partition> = all.into_iter().filter(|p| !p.closed).collect();
        // Half the splits and merges leave the children's leases to the processor (the
        // leader's sync, which the run times: `child_waits`); the other half create them at
        // once, as a second creator would, so children can exist before their parents end.
        if split && total + 2 <= max_partitions {
            if let Some(p) = open.choose(fleet.rng()).map(|p| p.id.clone()) {
                if fleet.rng().gen_bool(0.5) {
                    fleet.split_with_leases(&p).await;
                } else {
                    fleet.split_rerouted(&p).await;
                }
            }
        }
        if merge && total < max_partitions && open.len() > 1 {
            let mut ranges: Vec<(u128, u128, PartitionId)> = open
                .iter()
                .filter_map(|p| p.key_range.map(|r| (r.start, r.end, p.id.clone())))
                .collect();
            ranges.sort();
            let pairs: Vec<(PartitionId, PartitionId)> = ranges
                .windows(2)
                .filter(|w| w[0].1.checked_add(1) == Some(w[1].0))
                .map(|w| (w[0].2.clone(), w[1].2.clone()))
                .collect();
            if let Some((a, b)) = pairs.choose(fleet.rng()).cloned() {
                if fleet.rng().gen_bool(0.5) {
                    fleet.merge_with_leases(&a, &b).await;
                } else {
                    fleet.merge_rerouted(&a, &b).await;
                }
            }
        }
        fleet.advance(step).await;
    }

    // Drain: heal everything, bring every host back, stop writing, wait for delivery.
    fleet.kit.world.set_rates(world::Rates::default());
    fleet.heal_all();
    fleet.kit.world.event("drain", "fleet", String::new());
    let drain_start = fleet.now();
    loop {
        for name in fleet.down() {
            fleet.start(&name);
        }
        if fleet.delivered() >= fleet.written() || fleet.now() >= drain_start + cfg.drain_limit {
            break;
        }
        fleet.advance(Duration::from_secs(1)).await;
    }
    fleet.stop_all().await;

    let violations = fleet.check(max_duplicates).await;
    let liveness_windows = fleet.liveness_windows();
    let mut longest_gaps: Vec<check::Gap> = Vec::new();
    for gap in fleet.liveness_gaps() {
        match longest_gaps.iter_mut().find(|g| g.what == gap.what) {
            Some(g) if g.len() >= gap.len() => {}
            Some(g) => *g = gap,
            None => longest_gaps.push(gap),
        }
    }
    let partitions = fleet.feed.partitions().await.unwrap_or_default();
    let virtual_time = fleet.now();
    let mut log = fleet.kit.world.log();
    let child_waits =
        children::child_waits(&partitions, &log.writes, &log.deliveries, &log.first_append);
    SimOutcome {
        seed: cfg.seed,
        trace_hash: log.trace.hash(),
        trace: log.trace.take_text(),
        violations,
        written: fleet.written(),
        delivered: log.delivered_count,
        deliveries: log.deliveries.len() as u64,
        events: std::mem::take(&mut log.events),
        writes: std::mem::take(&mut log.writes),
        partitions,
        virtual_time,
        child_waits,
        longest_gaps,
        liveness_windows,
    }
}
