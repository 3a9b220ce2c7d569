//! One fleet harness: several processors on one lease store and one in-memory feed, started,
//! crashed, stopped and restarted by name (features `testkit` and `sim`; a program never
//! builds one).
//!
//! [`Fleet`] owns what every use of a fleet shares: the hosts and their lives (up, stopping,
//! down; restarts under the same name with a new incarnation; clock skew and drift), the feed
//! and the records written to it, the lease table as stored, and how time passes
//! ([`Timing`]). What a host's processor is built from is a [`HostKit`]'s business:
//!
//! - The test kit's `LedgerKit` (feature `testkit`, `changefeed::testkit::fleet`) gives each
//!   host the backend's store behind a fault switch and a handler that records every
//!   delivery; the fleet scenarios every backend runs drive it.
//! - The simulator's kit (`changefeed::sim::SimKit`, feature `sim`) puts every host behind
//!   fault-injecting seams over the in-memory store and logs every write and delivery for its
//!   invariant checker; `sim::SimFleet` is this type with that kit, its fault and checking
//!   methods layered on top.
//!
//! The harness is its own module, not the test kit's, so that the simulator (which
//! `changefeed simulate` runs) builds on it without compiling the conformance suites, the
//! scenarios or the network fault proxy.
//!
//! [`Timing::Paused`] runs a fleet on paused tokio time, where a minute costs nothing: the
//! in-memory store, and SQLite, whose blocking calls hold the paused clock until they return.
//! A store on a real server cannot run there (while a call waits on a socket the runtime is
//! idle, so paused time jumps ahead and every timer fires at once), so it runs on
//! [`Timing::Real`]: real time, every duration divided by a speed-up, each asserted bound
//! widened by an allowance for round trips.

mod timing;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::clock::VirtualClock;
use crate::lease::LeaseStore;
use crate::model::{GroupName, Lease, LeaseState, Partition, PartitionId, Timestamp};
use crate::processor::{
    ConfigError, Processor, ProcessorBuilder, ProcessorError, ProcessorHandle, Settings,
};
use crate::source::{FeedSource, MemoryFeed};

pub use timing::Timing;

/// How many distinct keys [`Fleet::write`] spreads records over: record `n` has key
/// `key-{n % KEYS}`.
pub const KEYS: u64 = 97;

/// The wall time every host's clock starts at (before its skew).
pub const WALL_ORIGIN: Timestamp = Timestamp(1_700_000_000_000);

/// Makes a fresh store handle; called once per host start (a new connection for a real
/// backend) and for each read of the lease table.
pub type StoreFactory = Arc<dyn Fn() -> Arc<dyn LeaseStore> + Send + Sync>;

/// A task a [`HostKit`] runs beside a host's processor while it is up (not yet spawned).
pub type Companion = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What a [`Fleet`] plugs into each host it starts: the parts that differ between the fleet
/// scenarios (the test kit's `LedgerKit`) and the simulator.
pub trait HostKit {
    /// What the fleet keeps of a host across its restarts (its fault switches, its counters).
    type Host;

    /// The state of a host the fleet meets for the first time.
    fn host(&mut self, name: &str) -> Self::Host;

    /// The seed of the next processor built (asked once per build, before anything else).
    fn seed(&mut self) -> u64;

    /// Gives `builder` (host, group, seed and settings already set) its store, source, handler
    /// and clock, the clock built on `start.clock`; and returns the task to run beside the
    /// processor while it is up, if any.
    fn equip(
        &mut self,
        start: HostStart<'_>,
        host: &mut Self::Host,
        builder: ProcessorBuilder,
    ) -> (ProcessorBuilder, Option<Companion>);

    /// A processor for `name` could not be built from the fleet's settings.
    fn refused(&mut self, name: &str, err: &ConfigError);

    /// Notes a fleet event: `start`, `crash`, `stop` or `stopped` of `host`. Does nothing by
    /// default.
    fn event(&self, kind: &'static str, host: &str, detail: String) {
        let _ = (kind, host, detail);
    }
}

/// What a [`HostKit`] is given to equip one start of a host.
pub struct HostStart<'a> {
    /// The host's name.
    pub name: &'a str,
    /// The fleet's group.
    pub group: &'a GroupName,
    /// The fleet's store factory.
    pub stores: &'a StoreFactory,
    /// The fleet's feed.
    pub feed: &'a MemoryFeed,
    /// The settings the host runs (in tokio time: [`Timing::settings`] of the fleet's).
    pub settings: &'a Settings,
    /// How the fleet's time passes.
    pub timing: Timing,
    /// When the fleet was made (tokio time).
    pub origin: Instant,
    /// The host's clock: virtual time from [`WALL_ORIGIN`], with the host's skew and drift.
    pub clock: VirtualClock,
}

impl std::fmt::Debug for HostStart<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStart")
            .field("name", &self.name)
            .field("group", &self.group)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

/// Whether a host's processor runs.
enum Run {
    /// Running, with the kit's companion task.
    Up(ProcessorHandle, Option<JoinHandle<()>>),
    /// Stopping gracefully in the background.
    Stopping(JoinHandle<Result<(), ProcessorError>>),
    /// Crashed, stopped, or never started.
    Down,
}

/// One host of a fleet, kept across its restarts.
pub(crate) struct Host<H> {
    /// The kit's part.
    pub(crate) kit: H,
    run: Run,
    starts: u64,
    skew_ms: i64,
    drift_ppm: i64,
}

impl<H> Host<H> {
    pub(crate) fn is_up(&self) -> bool {
        matches!(self.run, Run::Up(..))
    }
}

/// A fleet of processors on one store and one in-memory feed; see the module docs.
pub struct Fleet<K: HostKit> {
    /// What each host is built from.
    pub(crate) kit: K,
    stores: StoreFactory,
    /// The feed every host reads.
    pub feed: MemoryFeed,
    /// The group.
    pub group: GroupName,
    /// Settings every host gets at its next start, in scenario time ([`Timing::settings`]
    /// gives what the hosts run).
    pub settings: Settings,
    /// How scenario time passes.
    pub timing: Timing,
    pub(crate) hosts: BTreeMap<String, Host<K::Host>>,
    origin: Instant,
    /// The partition of every record written, by record id (a record's payload is its id).
    pub(crate) written: Vec<PartitionId>,
    /// The key of every record written, by record id.
    pub(crate) written_keys: Vec<String>,
}

impl<K: HostKit> std::fmt::Debug for Fleet<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("hosts", &self.hosts.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<K: HostKit> Fleet<K> {
    /// A fleet with no host yet over `feed`, creating no lease; its time starts now.
    pub fn with_kit(
        kit: K,
        stores: StoreFactory,
        feed: MemoryFeed,
        group: GroupName,
        settings: Settings,
        timing: Timing,
    ) -> Self {
        Self {
            kit,
            stores,
            feed,
            group,
            settings,
            timing,
            hosts: BTreeMap::new(),
            origin: Instant::now(),
            written: Vec::new(),
            written_keys: Vec::new(),
        }
    }

    /// A fresh handle to the fleet's store.
    pub fn store(&self) -> Arc<dyn LeaseStore> {
        (self.stores)()
    }

    /// Sets a host's wall-clock skew and clock-rate drift, applied from its next start.
    pub fn set_clock(&mut self, name: &str, skew_ms: i64, drift_ppm: i64) {
        let host = Self::entry(&mut self.hosts, &mut self.kit, name);
        host.skew_ms = skew_ms;
        host.drift_ppm = drift_ppm;
    }

    /// The host named `name`, met now if it is new.
    fn entry<'a>(
        hosts: &'a mut BTreeMap<String, Host<K::Host>>,
        kit: &mut K,
        name: &str,
    ) -> &'a mut Host<K::Host> {
        hosts.entry(name.to_string()).or_insert_with(|| Host {
            kit: kit.host(name),
            run: Run::Down,
            starts: 0,
            skew_ms: 0,
            drift_ppm: 0,
        })
    }

    /// Starts (or restarts, under the same name and with a new incarnation) a host that is
    /// down. Returns false if it is already up or stopping, or its processor could not be
    /// built (the kit was told).
    pub fn start(&mut self, name: &str) -> bool {
        let seed = self.kit.seed();
        let settings = self.timing.settings(&self.settings);
        let kit = &mut self.kit;
        let host = Self::entry(&mut self.hosts, kit, name);
        if !matches!(host.run, Run::Down) {
            return false;
        }
        host.starts += 1;
        let start = HostStart {
            name,
            group: &self.group,
            stores: &self.stores,
            feed: &self.feed,
            settings: &settings,
            timing: self.timing,
            origin: self.origin,
            clock: VirtualClock::new(WALL_ORIGIN)
                .with_skew(host.skew_ms)
                .with_drift(host.drift_ppm),
        };
        let builder = Processor::builder()
            .host(name)
            .group(self.group.as_str())
            .seed(seed)
            .settings(settings.clone());
        let (builder, companion) = kit.equip(start, &mut host.kit, builder);
        let processor = match builder.build() {
            Ok(p) => p,
            Err(err) => {
                kit.refused(name, &err);
                return false;
            }
        };
        let companion = companion.map(tokio::spawn);
        host.run = Run::Up(processor.start(), companion);
        let detail = format!(
            "incarnation={} skew_ms={} drift_ppm={}",
            host.starts, host.skew_ms, host.drift_ppm
        );
        kit.event("start", name, detail);
        true
    }

    /// Starts a host whose wall clock is off by `skew_ms` (see [`Fleet::start`]).
    pub fn start_skewed(&mut self, name: &str, skew_ms: i64) -> bool {
        self.set_clock(name, skew_ms, 0);
        self.start(name)
    }

    /// Builds (but neither starts nor tracks) a processor named `name`, with the clock of the
    /// host of that name and state of its own: a second process claiming a name in use.
    ///
    /// # Errors
    /// [`ConfigError`] if the fleet's settings are invalid.
    pub fn processor(&mut self, name: &str) -> Result<Processor, ConfigError> {
        let seed = self.kit.seed();
        let settings = self.timing.settings(&self.settings);
        let (skew_ms, drift_ppm) = self
            .hosts
            .get(name)
            .map_or((0, 0), |h| (h.skew_ms, h.drift_ppm));
        let mut own = self.kit.host(name);
        let start = HostStart {
            name,
            group: &self.group,
            stores: &self.stores,
            feed: &self.feed,
            settings: &settings,
            timing: self.timing,
            origin: self.origin,
            clock: VirtualClock::new(WALL_ORIGIN)
                .with_skew(skew_ms)
                .with_drift(drift_ppm),
        };
        let builder = Processor::builder()
            .host(name)
            .group(self.group.as_str())
            .seed(seed)
            .settings(settings.clone());
        let (builder, _) = self.kit.equip(start, &mut own, builder);
        builder.build()
    }

    /// Crashes a running host: every task dropped, nothing released, as a crash would. Returns
    /// false if it was not up.
    pub fn crash(&mut self, name: &str) -> bool {
        let Some(host) = self.hosts.get_mut(name) else {
            return false;
        };
        match std::mem::replace(&mut host.run, Run::Down) {
            Run::Up(handle, companion) => {
                handle.crash();
                if let Some(c) = companion {
                    c.abort();
                }
                self.kit.event("crash", name, String::new());
                true
            }
            other => {
                host.run = other;
                false
            }
        }
    }

    /// Stops a host gracefully and waits until it has (a host stopping in the background is
    /// waited for too).
    ///
    /// # Errors
    /// What the processor failed with, if it had already stopped on an error.
    pub async fn stop(&mut self, name: &str) -> Result<(), ProcessorError> {
        let Some(host) = self.hosts.get_mut(name) else {
            return Ok(());
        };
        match std::mem::replace(&mut host.run, Run::Down) {
            Run::Up(handle, companion) => {
                if let Some(c) = companion {
                    c.abort();
                }
                self.kit.event("stop", name, String::new());
                handle.stop().await
            }
            Run::Stopping(task) => match task.await {
                Ok(r) => r,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Ok(()),
            },
            Run::Down => Ok(()),
        }
    }

    /// Starts a graceful stop of a running host, which finishes in the background (see
    /// [`Fleet::reap`]). Returns false if it was not up.
    pub fn begin_stop(&mut self, name: &str) -> bool {
        let Some(host) = self.hosts.get_mut(name) else {
            return false;
        };
        match std::mem::replace(&mut host.run, Run::Down) {
            Run::Up(handle, companion) => {
                if let Some(c) = companion {
                    c.abort();
                }
                host.run = Run::Stopping(tokio::spawn(handle.stop()));
                self.kit.event("stop", name, String::new());
                true
            }
            other => {
                host.run = other;
                false
            }
        }
    }

    /// Notes hosts whose processor ended (a background stop finished, or it failed) as down.
    pub fn reap(&mut self) {
        let mut ended = Vec::new();
        for (name, host) in &mut self.hosts {
            let finished = match &host.run {
                Run::Up(h, _) => h.is_finished(),
                Run::Stopping(j) => j.is_finished(),
                Run::Down => false,
            };
            if finished {
                if let Run::Up(_, Some(c)) = &host.run {
                    c.abort();
                }
                host.run = Run::Down;
                ended.push(name.clone());
            }
        }
        for name in ended {
            self.kit.event("stopped", &name, String::new());
        }
    }

    /// Names of the hosts whose processor is running.
    pub fn running(&self) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|(_, h)| h.is_up())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names of the hosts that are down (crashed or stopped) and may be started again.
    pub fn down(&self) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|(_, h)| matches!(h.run, Run::Down))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Whether every host is down.
    pub fn all_down(&self) -> bool {
        self.hosts.values().all(|h| matches!(h.run, Run::Down))
    }

    /// Appends `n` records spread over [`KEYS`] keys; each record's payload is its id.
    pub fn write(&mut self, n: u64) {
        for _ in 0..n {
            let id = self.written();
            let key = format!("key-{}", id % KEYS);
            let (p, _) = self.feed.append(&key, id.to_string());
            self.written.push(p);
            self.written_keys.push(key);
        }
    }

    /// Records written so far.
    pub fn written(&self) -> u64 {
        self.written.len() as u64
    }

    /// Scenario time since the fleet was made.
    pub fn elapsed(&self) -> Duration {
        self.timing.scenario(self.origin.elapsed())
    }

    /// Lets `d` of scenario time pass, writing `per_sec` records each second of it, a quarter
    /// of a second's worth at a time.
    pub async fn run_for(&mut self, d: Duration, per_sec: u64) {
        let step = Duration::from_millis(250);
        let start = Instant::now();
        let mut done = Duration::ZERO;
        while done < d {
            let s = step.min(d - done);
            self.write(per_sec * s.as_millis() as u64 / 1000);
            done += s;
            // Until a deadline rather than for a step, so time spent reading the store between
            // steps does not stretch the run on real time.
            tokio::time::sleep_until(start + self.timing.real(done)).await;
        }
    }

    /// Splits the open partition `partition` of the feed. Returns the two children (their
    /// leases are the partition sync's business).
    ///
    /// # Errors
    /// As [`MemoryFeed::split`].
    pub fn split(
        &self,
        partition: &PartitionId,
    ) -> Result<(PartitionId, PartitionId), crate::error::SourceError> {
        self.feed.split(partition)
    }

    /// Merges the open, adjacent partitions `a` and `b`. Returns the child.
    ///
    /// # Errors
    /// As [`MemoryFeed::merge`].
    pub fn merge(
        &self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Result<PartitionId, crate::error::SourceError> {
        self.feed.merge(a, b)
    }

    /// The open partitions, ordered by key range.
    pub async fn open_partitions(&self) -> Vec<Partition> {
        let mut open: Vec<_> = self
            .feed
            .partitions()
            .await
            .expect("memory feed lists")
            .into_iter()
            .filter(|p| !p.closed)
            .collect();
        open.sort_by_key(|p| p.key_range.map(|r| r.start));
        open
    }

    /// The leases as stored.
    pub async fn leases(&self) -> Vec<Lease> {
        (self.stores)()
            .list(&self.group)
            .await
            .expect("list")
            .leases
            .into_iter()
            .map(Arc::unwrap_or_clone)
            .collect()
    }

    /// Owner per partition, as stored.
    pub async fn owners(&self) -> BTreeMap<PartitionId, Option<String>> {
        self.leases()
            .await
            .into_iter()
            .map(|l| (l.key.partition, l.owner.map(|o| o.to_string())))
            .collect()
    }

    /// Eligible (not finished) leases per owner, and how many have no owner.
    pub async fn ownership(&self) -> (BTreeMap<String, usize>, usize) {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut free = 0;
        for l in self.leases().await {
            match (l.state, &l.owner) {
                (LeaseState::Owned, Some(o)) => *counts.entry(o.to_string()).or_default() += 1,
                (LeaseState::Finished, _) => {}
                _ => free += 1,
            }
        }
        (counts, free)
    }

    /// Whether every eligible lease is owned by a running host and every running host owns
    /// within one of the others (the anchors' and our notion of balanced).
    pub async fn balanced(&self) -> bool {
        let up = self.running();
        let (counts, free) = self.ownership().await;
        if free > 0 || up.is_empty() || counts.keys().any(|h| !up.contains(h)) {
            return false;
        }
        let per: Vec<usize> = up
            .iter()
            .map(|h| counts.get(h).copied().unwrap_or(0))
            .collect();
        let (lo, hi) = (
            per.iter().min().copied().unwrap_or(0),
            per.iter().max().copied().unwrap_or(0),
        );
        hi - lo <= 1
    }
}
