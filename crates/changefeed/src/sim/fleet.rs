//! [`SimFleet`]: many hosts running the real processor over one in-memory store and feed, on
//! the paused tokio clock, every host behind its own fault-injecting seams.
//!
//! The random scenario ([`super::run`]) and the rebalancing benchmark both drive it: start,
//! crash, stop, stall and cut off hosts, split and merge partitions, write records, and step
//! virtual time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

use super::seams::{Cut, HostCtl, SimClock, SimHandler, SimSource, SimStore, World, WriteOp};
use super::StrategyKind;
use crate::clock::VirtualClock;
use crate::lease::{CountingStore, LeaseStore, MemoryLeaseStore, StoreCounts, StoreStats};
use crate::model::{
    GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position, Timestamp,
};
use crate::processor::{Broken, Processor, ProcessorError, ProcessorHandle, Settings};
use crate::source::{FeedSource, MemoryFeed};

/// The wall time every simulated clock starts at (before its skew).
const WALL_ORIGIN: Timestamp = Timestamp(1_700_000_000_000);

enum Run {
    Up(ProcessorHandle, Option<JoinHandle<()>>),
    Stopping(JoinHandle<Result<(), ProcessorError>>),
    Down,
}

struct SimHost {
    ctl: Arc<HostCtl>,
    run: Run,
    starts: u64,
    skew_ms: i64,
    drift_ppm: i64,
    stats: Arc<StoreStats>,
    /// When a timed fault (stall, cut, latency) ends.
    heal_at: Vec<(Duration, &'static str)>,
}

/// How a [`SimFleet`] is built.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Seeds the fleet's own choices and every host's processor.
    pub seed: u64,
    /// Partitions at the start (a lease each).
    pub partitions: u32,
    /// Every host's settings.
    pub settings: Settings,
    /// The balancing strategy every host runs.
    pub strategy: StrategyKind,
    /// A deliberately broken processor variant.
    pub broken: Broken,
    /// Model the anchors' store costs: every host renews each lease it owns once per renew
    /// interval (one write per lease) and lists every lease every acquire cycle.
    pub anchor_costs: bool,
    /// What trace to keep.
    pub trace: super::TraceMode,
    /// Keep the delivery ledger and write history (needed by the checker and the timeline).
    pub history: bool,
}

/// A simulated fleet; see the module docs.
pub struct SimFleet {
    pub(crate) world: Arc<World>,
    /// The feed every host reads.
    pub feed: MemoryFeed,
    store: MemoryLeaseStore,
    group: GroupName,
    cfg: FleetConfig,
    hosts: BTreeMap<String, SimHost>,
    /// Partition of every record written, by record id.
    pub(crate) written: Vec<PartitionId>,
    /// The open partitions' key ranges, sorted: routes records without scanning the feed.
    routes: Vec<(u128, PartitionId)>,
    rng: SmallRng,
}

impl std::fmt::Debug for SimFleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimFleet")
            .field("hosts", &self.hosts.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl SimFleet {
    /// A fleet with no host yet and one lease per partition. Must run inside a paused tokio
    /// runtime.
    pub async fn new(cfg: FleetConfig) -> Self {
        let mut rng = SmallRng::seed_from_u64(cfg.seed);
        let world = Arc::new(World::new(
            SmallRng::seed_from_u64(rng.gen()),
            cfg.trace,
            cfg.history,
        ));
        let clock = Arc::new(VirtualClock::new(WALL_ORIGIN));
        let feed = MemoryFeed::with_clock(cfg.partitions, clock);
        let store = MemoryLeaseStore::new();
        let group = GroupName::new("sim").expect("a valid group name");
        let fleet = Self {
            world,
            feed,
            store,
            group,
            cfg,
            hosts: BTreeMap::new(),
            written: Vec::new(),
            routes: Vec::new(),
            rng,
        };
        let parts = fleet.feed.partitions().await.unwrap_or_default();
        for p in parts {
            fleet.create_lease(p.id, Vec::new()).await;
        }
        let mut fleet = fleet;
        fleet.reroute().await;
        fleet
    }

    async fn reroute(&mut self) {
        let mut routes: Vec<(u128, PartitionId)> = self
            .feed
            .partitions()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|p| !p.closed)
            .map(|p| (p.key_range.map_or(0, |r| r.start), p.id))
            .collect();
        routes.sort();
        self.routes = routes;
    }

    async fn create_lease(&self, partition: PartitionId, parents: Vec<PartitionId>) {
        let lease = Lease::new(
            LeaseKey::new(self.group.clone(), partition),
            Position::Beginning,
        )
        .with_parents(parents);
        // The driver writes past every fault; create-if-absent makes this idempotent.
        if let Ok(Some(stored)) = self.store.create(&lease).await {
            self.world.write(
                "driver",
                WriteOp::Create,
                &stored.key.partition,
                Some(&stored),
                None,
            );
        }
    }

    /// The fleet's own random generator (fault choices), seeded from the config.
    pub fn rng(&mut self) -> &mut SmallRng {
        &mut self.rng
    }

    /// Virtual time since the fleet was built.
    pub fn now(&self) -> Duration {
        self.world.now()
    }

    /// Sets a host's wall-clock skew and clock-rate drift, applied from its next start.
    pub fn set_clock(&mut self, name: &str, skew_ms: i64, drift_ppm: i64) {
        let host = self.host_entry(name);
        host.skew_ms = skew_ms;
        host.drift_ppm = drift_ppm;
    }

    fn host_entry(&mut self, name: &str) -> &mut SimHost {
        self.hosts
            .entry(name.to_string())
            .or_insert_with(|| SimHost {
                ctl: Arc::new(HostCtl::new(name)),
                run: Run::Down,
                starts: 0,
                skew_ms: 0,
                drift_ppm: 0,
                stats: Arc::new(StoreStats::default()),
                heal_at: Vec::new(),
            })
    }

    /// Starts (or restarts, under the same name) a host that is down. Returns false if it is
    /// already up or stopping.
    pub fn start(&mut self, name: &str) -> bool {
        let seed = self.rng.gen::<u64>();
        let world = self.world.clone();
        let store = self.store.clone();
        let store_raw = self.store.clone();
        let feed = self.feed.clone();
        let group = self.group.clone();
        let cfg = self.cfg.clone();
        let host = self.host_entry(name);
        if !matches!(host.run, Run::Down) {
            return false;
        }
        host.starts += 1;
        let ctl = host.ctl.clone();
        let sim_store = SimStore {
            inner: store,
            ctl: ctl.clone(),
            world: world.clone(),
        };
        let counted: Arc<dyn LeaseStore> =
            Arc::new(CountingStore::new(Arc::new(sim_store), host.stats.clone()));
        let clock = SimClock {
            inner: VirtualClock::new(WALL_ORIGIN)
                .with_skew(host.skew_ms)
                .with_drift(host.drift_ppm),
            ctl: ctl.clone(),
        };
        let processor = Processor::builder()
            .host(name)
            .group(group.as_str())
            .store(counted.clone())
            .source(Arc::new(SimSource {
                inner: feed,
                ctl: ctl.clone(),
                world: world.clone(),
            }))
            .handler(SimHandler {
                ctl: ctl.clone(),
                world: world.clone(),
                epochs: Default::default(),
            })
            .strategy(cfg.strategy.strategy())
            .clock(Arc::new(clock))
            .seed(seed)
            .settings(cfg.settings.clone())
            .broken(cfg.broken)
            .build();
        let processor = match processor {
            Ok(p) => p,
            Err(err) => {
                world.event("exit", name, format!("invalid settings: {err}"));
                return false;
            }
        };
        let renewer = cfg.anchor_costs.then(|| {
            tokio::spawn(renew_every_lease(
                counted,
                store_raw,
                group,
                HostName::new(name).expect("a started host has a valid name"),
                cfg.settings.renew_interval,
            ))
        });
        host.run = Run::Up(processor.start(), renewer);
        let detail = format!(
            "incarnation={} skew_ms={} drift_ppm={}",
            host.starts, host.skew_ms, host.drift_ppm
        );
        world.event("start", name, detail);
        true
    }

    /// Crashes a running host: every task dropped, nothing released. Returns false if it was
    /// not up.
    pub fn crash(&mut self, name: &str) -> bool {
        let Some(host) = self.hosts.get_mut(name) else {
            return false;
        };
        match std::mem::replace(&mut host.run, Run::Down) {
            Run::Up(handle, renewer) => {
                handle.kill();
                if let Some(r) = renewer {
                    r.abort();
                }
                self.world.event("crash", name, String::new());
                true
            }
            other => {
                host.run = other;
                false
            }
        }
    }

    /// Starts a graceful stop of a running host (it finishes in the background). Returns false
    /// if it was not up.
    pub fn stop(&mut self, name: &str) -> bool {
        let Some(host) = self.hosts.get_mut(name) else {
            return false;
        };
        match std::mem::replace(&mut host.run, Run::Down) {
            Run::Up(handle, renewer) => {
                if let Some(r) = renewer {
                    r.abort();
                }
                host.run = Run::Stopping(tokio::spawn(handle.stop()));
                self.world.event("stop", name, String::new());
                true
            }
            other => {
                host.run = other;
                false
            }
        }
    }

    /// Stalls a host for `d` (a GC pause): its store calls, source reads, handler calls and
    /// timers all wait, then it resumes believing it still owns its leases.
    pub fn pause(&mut self, name: &str, d: Duration) {
        let now = self.now();
        let host = self.host_entry(name);
        host.ctl.set_paused(true);
        host.heal_at.push((now + d, "pause"));
        self.world
            .event("pause", name, format!("for_ms={}", d.as_millis()));
    }

    /// Cuts a host off from the store for `d`.
    pub fn cut(&mut self, name: &str, cut: Cut, d: Duration) {
        let now = self.now();
        let host = self.host_entry(name);
        host.ctl.set_cut(cut);
        host.heal_at.push((now + d, "cut"));
        self.world
            .event("cut", name, format!("{cut:?} for_ms={}", d.as_millis()));
    }

    /// Delays each of a host's store calls by up to `max` for `d`.
    pub fn latency(&mut self, name: &str, max: Duration, d: Duration) {
        let now = self.now();
        let host = self.host_entry(name);
        host.ctl.set_latency(max.as_millis() as u64);
        host.heal_at.push((now + d, "latency"));
        self.world.event(
            "latency",
            name,
            format!("max_ms={} for_ms={}", max.as_millis(), d.as_millis()),
        );
    }

    /// Ends every stall, cut and latency spike now.
    pub fn heal_all(&mut self) {
        for host in self.hosts.values_mut() {
            host.heal_at.clear();
            host.ctl.set_paused(false);
            host.ctl.set_cut(Cut::None);
            host.ctl.set_latency(0);
        }
    }

    fn heal_due(&mut self) {
        let now = self.now();
        for host in self.hosts.values_mut() {
            let ctl = host.ctl.clone();
            host.heal_at.retain(|(at, what)| {
                if *at > now {
                    return true;
                }
                match *what {
                    "pause" => ctl.set_paused(false),
                    "cut" => ctl.set_cut(Cut::None),
                    _ => ctl.set_latency(0),
                }
                false
            });
        }
    }

    /// Notes hosts whose processor ended (stopped, or failed) as down.
    fn reap(&mut self) {
        let mut ended = Vec::new();
        for (name, host) in &mut self.hosts {
            let finished = match &host.run {
                Run::Up(h, _) => h.is_finished(),
                Run::Stopping(j) => j.is_finished(),
                Run::Down => false,
            };
            if finished {
                if let Run::Up(_, Some(r)) = &host.run {
                    r.abort();
                }
                host.run = Run::Down;
                ended.push(name.clone());
            }
        }
        for name in ended {
            self.world.event("stopped", &name, String::new());
        }
    }

    /// Splits an open partition and creates its children's leases. Returns the children.
    pub async fn split(&mut self, partition: &PartitionId) -> Option<(PartitionId, PartitionId)> {
        let (a, b) = self.feed.split(partition).ok()?;
        self.reroute().await;
        self.world
            .event("split", partition.as_str(), format!("into {a} {b}"));
        self.create_lease(a.clone(), vec![partition.clone()]).await;
        self.create_lease(b.clone(), vec![partition.clone()]).await;
        Some((a, b))
    }

    /// Merges two adjacent open partitions and creates the child's lease.
    pub async fn merge(&mut self, a: &PartitionId, b: &PartitionId) -> Option<PartitionId> {
        let c = self.feed.merge(a, b).ok()?;
        self.reroute().await;
        self.world
            .event("merge", a.as_str(), format!("with {b} into {c}"));
        self.create_lease(c.clone(), vec![a.clone(), b.clone()])
            .await;
        Some(c)
    }

    /// Appends `n` records with random keys out of `keys`; each record's payload is its id.
    pub fn write(&mut self, n: u64, keys: u32) {
        for _ in 0..n {
            let id = self.written.len() as u64;
            let key = format!("k{}", self.rng.gen_range(0..keys.max(1)));
            let hash = crate::source::key_hash(&key);
            let slot = self.routes.partition_point(|(start, _)| *start <= hash);
            let p = match slot.checked_sub(1).and_then(|i| self.routes.get(i)) {
                Some((_, p)) => {
                    let p = p.clone();
                    if self.feed.append_to(&p, &key, id.to_string()).is_err() {
                        continue;
                    }
                    p
                }
                None => self.feed.append(&key, id.to_string()).0,
            };
            self.written.push(p);
        }
    }

    /// Records written so far.
    pub fn written(&self) -> u64 {
        self.written.len() as u64
    }

    /// Distinct records delivered so far.
    pub fn delivered(&self) -> u64 {
        self.world.log().delivered_count
    }

    /// Advances virtual time by `d`, then ends due faults and notes ended hosts.
    pub async fn advance(&mut self, d: Duration) {
        tokio::time::sleep(d).await;
        self.heal_due();
        self.reap();
    }

    /// Names of hosts whose processor is running.
    pub fn up(&self) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|(_, h)| matches!(h.run, Run::Up(..)))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names of hosts that are down (crashed or stopped) and may be started again.
    pub fn down(&self) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|(_, h)| matches!(h.run, Run::Down))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Whether a handler call of `name` is in progress now.
    pub fn in_call(&self, name: &str) -> bool {
        self.hosts.get(name).is_some_and(|h| h.ctl.in_call())
    }

    /// Makes a share (0 to 1) of every host's handler calls from now on slow: each applies its
    /// records one by one over a length drawn from a few milliseconds to `max` (see
    /// [`super::Fault::SlowHandler`]). Other per-call fault rates are kept.
    pub fn slow_handler(&self, share: f64, max: Duration) {
        let mut rates = self.world.rates();
        rates.slow_handler = share;
        rates.slow_handler_max = max;
        self.world.set_rates(rates);
    }

    /// Checks every rule over what the fleet delivered and wrote so far (see [`super::check`]).
    /// `max_duplicates`: most duplicate records allowed per ownership epoch (`None`: not
    /// counted).
    pub async fn check(&self, max_duplicates: Option<usize>) -> Vec<super::Violation> {
        let partitions = self.feed.partitions().await.unwrap_or_default();
        let parents: BTreeMap<PartitionId, Vec<PartitionId>> =
            partitions.into_iter().map(|p| (p.id, p.parents)).collect();
        let log = self.world.log();
        super::check(&super::CheckInput {
            written: &self.written,
            deliveries: &log.deliveries,
            writes: &log.writes,
            parents: &parents,
            max_duplicates,
        })
    }

    /// Whether a host is stalled now.
    pub fn is_paused(&self, name: &str) -> bool {
        self.hosts.get(name).is_some_and(|h| h.ctl.is_paused())
    }

    /// For each of `names`: whether it is up, and whether it is stalled.
    pub fn states(&self, names: &[String]) -> Vec<(bool, bool)> {
        names
            .iter()
            .map(|name| {
                self.hosts.get(name).map_or((false, false), |h| {
                    (matches!(h.run, Run::Up(..)), h.ctl.is_paused())
                })
            })
            .collect()
    }

    /// The leases as stored (read without faults or counting).
    pub async fn leases(&self) -> Vec<Lease> {
        self.store
            .list(&self.group)
            .await
            .map(|l| l.leases)
            .unwrap_or_default()
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

    /// Whether every lease is owned by a running host and every running host owns within one
    /// of the others (the anchors' and our notion of balanced).
    pub async fn balanced(&self) -> bool {
        let up = self.up();
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

    /// Store calls of `name` so far, across its restarts.
    pub fn store_counts(&self, name: &str) -> StoreCounts {
        self.hosts
            .get(name)
            .map(|h| h.stats.snapshot())
            .unwrap_or_default()
    }

    /// Stops every running host gracefully and waits (in virtual time) until all have ended.
    pub async fn stop_all(&mut self) {
        for name in self.up() {
            self.stop(&name);
        }
        for _ in 0..600 {
            let busy = self.hosts.values().any(|h| !matches!(h.run, Run::Down));
            if !busy {
                return;
            }
            self.advance(Duration::from_millis(500)).await;
        }
    }
}

/// The anchors' renewal pattern, for cost comparison: every renew interval, one CAS write per
/// lease this host owns (the write bumps the lease's version, as a KCL renewal bumps its
/// counter and a Cosmos renewal its ETag).
async fn renew_every_lease(
    store: Arc<dyn LeaseStore>,
    raw: MemoryLeaseStore,
    group: GroupName,
    host: HostName,
    every: Duration,
) {
    // The renewer knows what it owns from its own memory in the anchors; here it reads the
    // table without counting (through the shared store behind the counters would double the
    // reads), so only its writes are counted.
    loop {
        tokio::time::sleep(every).await;
        let Ok(listing) = raw.list(&group).await else {
            continue;
        };
        for lease in listing.leases {
            if lease.is_owned_by(&host) {
                let _ = store.replace(&lease, lease.version).await;
            }
        }
    }
}
