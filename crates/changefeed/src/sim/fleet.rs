//! [`SimFleet`]: the fleet harness's [`Fleet`] with the simulator's [`SimKit`]: every host
//! runs the real processor behind its own fault-injecting seams over one in-memory store and
//! feed, on the paused tokio clock, and the shared [`World`] logs every write and delivery.
//!
//! The fleet itself (hosts started, crashed, stopped and restarted by name, clock skew and
//! drift, the lease table) is the harness's; this module layers on what only the simulator
//! does: stalls, cut-offs and latency spikes that heal on their own, splits and merges (whose
//! children's leases the processor creates), records with random keys, the anchors' renewal costs, per-host
//! store counts, and the invariant check. The random scenario ([`super::run`]) and the
//! rebalancing benchmark both drive it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::check::LivenessWindows;
use super::pool::{Net, Pool, PoolConfig, PoolCounts};
use super::seams::{Cut, HostCtl, SimClock, SimHandler, SimSource, SimStore};
use super::world::{World, WriteOp, DRIVER};
use super::StrategyKind;
use crate::balance::{BalanceStrategy, LoadShare};
use crate::clock::VirtualClock;
use crate::fleet::{Companion, Fleet, HostKit, HostStart, StoreFactory, Timing, WALL_ORIGIN};
use crate::lease::{CountingStore, LeaseStore, MemoryLeaseStore, StoreCounts, StoreStats};
use crate::model::{GroupName, HostName, Lease, LeaseKey, PartitionId, Position};
#[cfg(feature = "sim-broken")]
use crate::processor::Broken;
use crate::processor::{ConfigError, ProcessorBuilder, Settings, TableShare};
use crate::source::{FeedSource, MemoryFeed};

/// A fleet of simulated hosts; see the module docs.
pub type SimFleet = Fleet<SimKit>;

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
    /// Model the anchors' store costs: every host renews each lease it owns once per renew
    /// interval (one write per lease) and lists every lease every acquire cycle.
    pub anchor_costs: bool,
    /// What trace to keep.
    pub trace: super::TraceMode,
    /// Keep the delivery ledger and write history (needed by the checker and the timeline).
    pub history: bool,
    /// The store's limit on the fleet's head reads per second (see
    /// [`MembershipStore::head_reads_per_second`]): hosts pace their cycles to it. `None`: no limit.
    pub head_reads_per_second: Option<f64>,
    /// Whether the hosts share their lease tables (see [`super::SimConfig::share_tables`]).
    pub share_tables: bool,
    /// Each host's client: a pool of connections to its store and one to its feed, made anew
    /// at each start (see [`PoolConfig`]). `None`: calls reach the store and the feed
    /// directly, and a [`Cut::Forget`] is a [`Cut::Hang`] that reaches the feed too.
    pub pool: Option<PoolConfig>,
}

/// The simulator's [`HostKit`]: each host behind fault-injecting seams, whose switches it
/// keeps across restarts ([`SimHost`]); all hosts share one log of writes and deliveries, one
/// memory store and one random generator, which draws every processor seed and every fault.
#[derive(Debug)]
pub struct SimKit {
    pub(crate) world: Arc<World>,
    store: MemoryLeaseStore,
    rng: SmallRng,
    /// The open partitions' key ranges, sorted: routes records without scanning the feed.
    routes: Vec<(u128, PartitionId)>,
    strategy: StrategyKind,
    anchor_costs: bool,
    /// The lease tables the hosts share, if they do (see [`super::SimConfig::share_tables`]).
    tables: Option<TableShare>,
    /// Each host's client (see [`FleetConfig::pool`]).
    pool: Option<PoolConfig>,
    /// Every host's switches, by name, for the fleet's events.
    ctls: BTreeMap<String, Arc<HostCtl>>,
    /// Every host's key concurrency (1: none).
    key_concurrency: usize,
    #[cfg(feature = "sim-broken")]
    broken: Broken,
}

/// What a [`SimFleet`] keeps of a host across its restarts.
#[derive(Debug)]
pub struct SimHost {
    ctl: Arc<HostCtl>,
    stats: Arc<StoreStats>,
    /// The store and feed pools of its current (or last) start.
    pools: Option<(Arc<Pool>, Arc<Pool>)>,
    /// When each timed fault (stall, cut, latency) ends.
    heal_at: Vec<(Duration, Heal)>,
}

/// A timed fault that ends by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heal {
    Pause,
    Cut,
    Latency,
}

impl HostKit for SimKit {
    type Host = SimHost;

    fn host(&mut self, name: &str) -> SimHost {
        let ctl = Arc::new(HostCtl::new(name, self.world.clone()));
        // A second process claiming a name in use (`Fleet::processor`) gets switches of its
        // own; the fleet's events are about the first.
        self.ctls
            .entry(name.to_string())
            .or_insert_with(|| ctl.clone());
        SimHost {
            ctl,
            stats: Arc::new(StoreStats::default()),
            pools: None,
            heal_at: Vec::new(),
        }
    }

    fn seed(&mut self) -> u64 {
        self.rng.gen()
    }

    fn equip(
        &mut self,
        start: HostStart<'_>,
        host: &mut SimHost,
        builder: ProcessorBuilder,
    ) -> (ProcessorBuilder, Option<Companion>) {
        let ctl = host.ctl.clone();
        // Planning by load runs the processor's own path: each host measures its leases,
        // publishes them with its heartbeat and reads the others'. Every capacity is 1, as
        // the cores of the machine running the simulator must not change a run.
        let by_load = self.strategy == StrategyKind::Load;
        let strategy: Arc<dyn BalanceStrategy> = match self.strategy {
            StrategyKind::Load => Arc::new(LoadShare::default()),
            other => other.strategy(),
        };
        // A new process: new pools.
        host.pools = self.pool.map(|cfg| {
            (
                Arc::new(Pool::new(cfg, Net::Store, ctl.clone())),
                Arc::new(Pool::new(cfg, Net::Source, ctl.clone())),
            )
        });
        let sim_store = SimStore {
            inner: self.store.clone(),
            ctl: ctl.clone(),
            world: self.world.clone(),
            pool: host.pools.as_ref().map(|(store, _)| store.clone()),
        };
        let counted: Arc<dyn LeaseStore> =
            Arc::new(CountingStore::new(Arc::new(sim_store), host.stats.clone()));
        let clock = SimClock {
            inner: start.clock,
            ctl: ctl.clone(),
        };
        let builder = builder
            .store(counted.clone())
            .source(Arc::new(SimSource {
                inner: start.feed.clone(),
                ctl: ctl.clone(),
                world: self.world.clone(),
                pool: host.pools.as_ref().map(|(_, source)| source.clone()),
            }))
            .handler(SimHandler {
                ctl,
                world: self.world.clone(),
                epochs: Default::default(),
            })
            .strategy(strategy)
            .publish_load(by_load)
            .capacity(Some(1.0))
            .clock(Arc::new(clock));
        let builder = if self.key_concurrency > 1 {
            builder.key_concurrency(self.key_concurrency)
        } else {
            builder
        };
        let builder = match &self.tables {
            Some(tables) => builder.share_tables(tables.clone()),
            None => builder,
        };
        #[cfg(feature = "sim-broken")]
        let builder = builder.broken(self.broken);
        let renewer = self.anchor_costs.then(|| {
            Box::pin(renew_every_lease(
                counted,
                self.store.clone(),
                start.group.clone(),
                HostName::new(start.name).expect("a started host has a valid name"),
                start.settings.renew_interval,
            )) as Companion
        });
        (builder, renewer)
    }

    fn refused(&mut self, name: &str, err: &ConfigError) {
        self.world
            .event("exit", name, format!("invalid settings: {err}"));
    }

    fn event(&self, kind: &'static str, host: &str, detail: String) {
        self.world.event(kind, host, detail);
        if let Some(ctl) = self.ctls.get(host) {
            match kind {
                "start" => ctl.set_up(true),
                "crash" | "stop" | "stopped" => ctl.set_up(false),
                _ => {}
            }
        }
    }
}

impl Fleet<SimKit> {
    /// A fleet with no host yet and one lease per partition. Must run inside a paused tokio
    /// runtime.
    pub async fn simulated(cfg: FleetConfig) -> Self {
        let mut rng = SmallRng::seed_from_u64(cfg.seed);
        let world = Arc::new(World::new(
            SmallRng::seed_from_u64(rng.gen()),
            cfg.trace,
            cfg.history,
        ));
        let clock = Arc::new(VirtualClock::new(WALL_ORIGIN));
        let feed = MemoryFeed::with_clock(cfg.partitions, clock);
        let store = match cfg.head_reads_per_second {
            Some(limit) => MemoryLeaseStore::new().with_head_reads_per_second(limit),
            None => MemoryLeaseStore::new(),
        };
        let shared = store.clone();
        let stores: StoreFactory =
            Arc::new(move || Arc::new(shared.clone()) as Arc<dyn LeaseStore>);
        let kit = SimKit {
            world,
            store,
            rng,
            routes: Vec::new(),
            strategy: cfg.strategy,
            anchor_costs: cfg.anchor_costs,
            tables: cfg.share_tables.then(TableShare::new),
            pool: cfg.pool,
            ctls: BTreeMap::new(),
            key_concurrency: 1,
            #[cfg(feature = "sim-broken")]
            broken: Broken::None,
        };
        let group = GroupName::new("sim").expect("a valid group name");
        let mut fleet = Self::with_kit(kit, stores, feed, group, cfg.settings, Timing::Paused);
        let parts = fleet.feed.partitions().await.unwrap_or_default();
        for p in parts {
            fleet.create_lease(p.id, Vec::new()).await;
        }
        fleet.reroute().await;
        fleet
    }

    /// Runs every host started from now on as the deliberately broken variant `broken`.
    #[cfg(feature = "sim-broken")]
    pub fn set_broken(&mut self, broken: Broken) {
        self.kit.broken = broken;
    }

    /// Runs every host started from now on with `n` handler calls at once per lease, one key
    /// per call (1: none), and checks order per key when above 1.
    pub fn set_key_concurrency(&mut self, n: usize) {
        self.kit.key_concurrency = n;
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
        self.kit.routes = routes;
    }

    async fn create_lease(&self, partition: PartitionId, parents: Vec<PartitionId>) {
        let lease = Lease::new(
            LeaseKey::new(self.group.clone(), partition),
            Position::Beginning,
        )
        .with_parents(parents);
        // The driver writes past every fault; create-if-absent makes this idempotent.
        if let Ok(Some(stored)) = self.kit.store.create(&lease).await {
            self.kit.world.write(
                DRIVER,
                WriteOp::Create,
                &stored.key.partition,
                Some(&stored),
                None,
            );
        }
    }

    /// The fleet's own random generator (fault choices), seeded from the config.
    pub fn rng(&mut self) -> &mut SmallRng {
        &mut self.kit.rng
    }

    /// Virtual time since the fleet was built.
    pub fn now(&self) -> Duration {
        self.kit.world.now()
    }

    fn host_kit(&mut self, name: &str) -> &mut SimHost {
        self.set_clock_if_new(name);
        &mut self.hosts.get_mut(name).expect("the host was just met").kit
    }

    /// Meets `name` (with no skew or drift) if the fleet has not yet.
    fn set_clock_if_new(&mut self, name: &str) {
        if !self.hosts.contains_key(name) {
            self.set_clock(name, 0, 0);
        }
    }

    /// Stalls a host for `d` (a GC pause): its store calls, source reads, handler calls and
    /// timers all wait, then it resumes believing it still owns its leases.
    pub fn pause(&mut self, name: &str, d: Duration) {
        let now = self.now();
        let host = self.host_kit(name);
        host.ctl.set_paused(true);
        host.heal_at.push((now + d, Heal::Pause));
        self.kit
            .world
            .event("pause", name, format!("for_ms={}", d.as_millis()));
    }

    /// Cuts a host off from the store for `d`.
    pub fn cut(&mut self, name: &str, cut: Cut, d: Duration) {
        let now = self.now();
        let host = self.host_kit(name);
        host.ctl.set_cut(cut);
        host.heal_at.push((now + d, Heal::Cut));
        self.kit
            .world
            .event("cut", name, format!("{cut:?} for_ms={}", d.as_millis()));
    }

    /// Delays each of a host's store calls by up to `max` for `d`.
    pub fn latency(&mut self, name: &str, max: Duration, d: Duration) {
        let now = self.now();
        let host = self.host_kit(name);
        host.ctl.set_latency(max.as_millis() as u64);
        host.heal_at.push((now + d, Heal::Latency));
        self.kit.world.event(
            "latency",
            name,
            format!("max_ms={} for_ms={}", max.as_millis(), d.as_millis()),
        );
    }

    /// Ends every stall, cut and latency spike now.
    pub fn heal_all(&mut self) {
        for host in self.hosts.values_mut() {
            let host = &mut host.kit;
            host.heal_at.clear();
            host.ctl.set_paused(false);
            host.ctl.set_cut(Cut::None);
            host.ctl.set_latency(0);
        }
    }

    fn heal_due(&mut self) {
        let now = self.now();
        for host in self.hosts.values_mut() {
            let host = &mut host.kit;
            let ctl = host.ctl.clone();
            host.heal_at.retain(|(at, what)| {
                if *at > now {
                    return true;
                }
                match what {
                    Heal::Pause => ctl.set_paused(false),
                    Heal::Cut => ctl.set_cut(Cut::None),
                    Heal::Latency => ctl.set_latency(0),
                }
                false
            });
        }
    }

    /// Splits an open partition and routes new records by the new key ranges. Returns the
    /// children. Their leases are the processor's to
    /// create (the leader's partition sync, run as soon as it sees the parent finished), so
    /// a run measures how long children wait for them.
    pub async fn split_rerouted(
        &mut self,
        partition: &PartitionId,
    ) -> Option<(PartitionId, PartitionId)> {
        let (a, b) = self.feed.split(partition).ok()?;
        self.reroute().await;
        self.kit
            .world
            .event("split", partition.as_str(), format!("into {a} {b}"));
        Some((a, b))
    }

    /// Merges two adjacent open partitions. Returns the child, whose lease is the
    /// processor's to create (see [`SimFleet::split_rerouted`]).
    pub async fn merge_rerouted(
        &mut self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Option<PartitionId> {
        let c = self.feed.merge(a, b).ok()?;
        self.reroute().await;
        self.kit
            .world
            .event("merge", a.as_str(), format!("with {b} into {c}"));
        Some(c)
    }

    /// Splits an open partition and creates its children's leases at once, parents named (as
    /// a second creator racing the leader would), if the partition has a lease; otherwise the
    /// leader creates them all, following lineage. Returns the children.
    pub async fn split_with_leases(
        &mut self,
        partition: &PartitionId,
    ) -> Option<(PartitionId, PartitionId)> {
        let leased = self.has_lease(partition).await;
        let (a, b) = self.split_rerouted(partition).await?;
        if leased {
            self.create_lease(a.clone(), vec![partition.clone()]).await;
            self.create_lease(b.clone(), vec![partition.clone()]).await;
        }
        Some((a, b))
    }

    /// Merges two adjacent open partitions and creates the child's lease at once if both have
    /// a lease (see [`SimFleet::split_with_leases`]).
    pub async fn merge_with_leases(
        &mut self,
        a: &PartitionId,
        b: &PartitionId,
    ) -> Option<PartitionId> {
        let leased = self.has_lease(a).await && self.has_lease(b).await;
        let c = self.merge_rerouted(a, b).await?;
        if leased {
            self.create_lease(c.clone(), vec![a.clone(), b.clone()])
                .await;
        }
        Some(c)
    }

    async fn has_lease(&self, partition: &PartitionId) -> bool {
        let key = LeaseKey::new(self.group.clone(), partition.clone());
        matches!(self.kit.store.get(&key).await, Ok(Some(_)))
    }

    /// Appends `n` records with random keys out of `keys`; each record's payload is its id.
    pub fn write_random_keys(&mut self, n: u64, keys: u32) {
        for _ in 0..n {
            let id = self.written();
            let key = format!("k{}", self.kit.rng.gen_range(0..keys.max(1)));
            let hash = crate::source::key_hash(&key);
            let routes = &self.kit.routes;
            let slot = routes.partition_point(|(start, _)| *start <= hash);
            let p = match slot.checked_sub(1).and_then(|i| routes.get(i)) {
                Some((_, p)) => {
                    let p = p.clone();
                    if self.feed.append_to(&p, &key, id.to_string()).is_err() {
                        continue;
                    }
                    p
                }
                None => self.feed.append(&key, id.to_string()).0,
            };
            self.kit.world.appended(&p);
            self.written.push(p);
            self.written_keys.push(key);
        }
    }

    /// Distinct records delivered so far.
    pub fn delivered(&self) -> u64 {
        self.kit.world.log().delivered_count
    }

    /// Advances virtual time by `d`, then ends due faults and notes ended hosts.
    pub async fn advance(&mut self, d: Duration) {
        tokio::time::sleep(d).await;
        self.heal_due();
        self.reap();
    }

    /// Whether a handler call of `name` is in progress now.
    pub fn in_call(&self, name: &str) -> bool {
        self.hosts.get(name).is_some_and(|h| h.kit.ctl.in_call())
    }

    /// Makes a share (0 to 1) of every host's handler calls from now on slow: each applies its
    /// records one by one over a length drawn from a few milliseconds to `max` (see
    /// [`super::Fault::SlowHandler`]). Other per-call fault rates are kept.
    pub fn slow_handler(&self, share: f64, max: Duration) {
        let mut rates = self.kit.world.rates();
        rates.slow_handler = share;
        rates.slow_handler_max = max;
        self.kit.world.set_rates(rates);
    }

    /// From now on every store call of every host takes from `latency.0` to `latency.1`
    /// (uniform; zero: none), and with `counter` every ownership write (create, delete, a
    /// replace that changes the owner, state or next owner) goes through one shared
    /// change-counter item as in the DynamoDB store, conflicting with the writes that overlap
    /// it. For benchmarks: the random scenario never sets them.
    pub fn store_conditions(&self, latency: (Duration, Duration), counter: bool) {
        self.kit
            .world
            .set_conditions(super::world::StoreConditions { latency, counter });
    }

    /// Transaction conflicts on the shared change counter so far (see
    /// [`Self::store_conditions`]).
    pub fn counter_conflicts(&self) -> u64 {
        self.kit.world.counter().conflicts
    }

    /// Checks every rule over what the fleet delivered and wrote so far (see [`fn@super::check`]).
    /// `max_duplicates`: most duplicate records allowed per ownership epoch (`None`: not
    /// counted).
    pub async fn check(&self, max_duplicates: Option<usize>) -> Vec<super::Violation> {
        let partitions = self.feed.partitions().await.unwrap_or_default();
        let parents: BTreeMap<PartitionId, Vec<PartitionId>> =
            partitions.into_iter().map(|p| (p.id, p.parents)).collect();
        let log = self.kit.world.log();
        let mut violations = super::check(&super::CheckInput {
            written: &self.written,
            deliveries: &log.deliveries,
            writes: &log.writes,
            parents: &parents,
            max_duplicates,
            keys: (self.kit.key_concurrency > 1).then_some(&self.written_keys[..]),
        });
        violations.extend(super::check::liveness(&super::check::LivenessInput {
            health: &log.health,
            heartbeats: &log.heartbeats,
            writes: &log.writes,
            hosts: self.hosts.len(),
            windows: self.liveness_windows(),
            end: self.now(),
        }));
        violations
    }

    /// The liveness rule's windows for this fleet's settings, client and strategy (the lease
    /// part only with the equal share, which gives every live host a lease when there are
    /// enough).
    pub fn liveness_windows(&self) -> LivenessWindows {
        LivenessWindows::of(
            &self.settings,
            self.kit.pool.as_ref(),
            self.kit.strategy == StrategyKind::EqualShare,
        )
    }

    /// Every stretch the liveness rule judged so far (see [`super::check::liveness_gaps`]).
    pub fn liveness_gaps(&self) -> Vec<super::check::Gap> {
        let log = self.kit.world.log();
        super::check::liveness_gaps(&super::check::LivenessInput {
            health: &log.health,
            heartbeats: &log.heartbeats,
            writes: &log.writes,
            hosts: self.hosts.len(),
            windows: self.liveness_windows(),
            end: self.now(),
        })
    }

    /// What the pools of `name`'s current (or last) start have done (`None`: the fleet's
    /// hosts have no pools): its store's, then its feed's.
    pub fn pool_counts(&self, name: &str) -> Option<(PoolCounts, PoolCounts)> {
        let (store, source) = self.hosts.get(name)?.kit.pools.as_ref()?;
        Some((store.counts(), source.counts()))
    }

    /// Whether a host is stalled now.
    pub fn is_paused(&self, name: &str) -> bool {
        self.hosts.get(name).is_some_and(|h| h.kit.ctl.is_paused())
    }

    /// For each of `names`: whether it is up, and whether it is stalled.
    pub fn states(&self, names: &[String]) -> Vec<(bool, bool)> {
        names
            .iter()
            .map(|name| {
                self.hosts
                    .get(name)
                    .map_or((false, false), |h| (h.is_up(), h.kit.ctl.is_paused()))
            })
            .collect()
    }

    /// Store calls of `name` so far, across its restarts.
    pub fn store_counts(&self, name: &str) -> StoreCounts {
        self.hosts
            .get(name)
            .map(|h| h.kit.stats.snapshot())
            .unwrap_or_default()
    }

    /// Stops every running host gracefully and waits (in virtual time) until all have ended.
    pub async fn stop_all(&mut self) {
        for name in self.running() {
            self.begin_stop(&name);
        }
        for _ in 0..600 {
            if self.all_down() {
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
