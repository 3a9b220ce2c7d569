//! Fleet scenarios: several processors on one store and one in-memory feed, checked against a
//! delivery ledger. Every backend runs every scenario with its own store.
//!
//! A scenario is written in scenario time: the settings of [`scenario_settings`] (10 s expiry,
//! 2 s cycles), its waits and the bounds it asserts. The [`Timing`] argument says how that time
//! passes. [`Timing::Paused`] runs it on paused tokio time
//! (`#[tokio::test(start_paused = true)]`), where a minute costs nothing: the in-memory store,
//! and SQLite, whose blocking calls hold the paused clock until they return. A store on a real
//! server cannot run there (while a call waits on a socket the runtime is idle, so paused time
//! jumps ahead and every timer fires at once), so it runs on [`Timing::Real`]: real time, every
//! duration divided by a speed-up, each asserted bound widened by an allowance for round trips.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, VirtualClock};
use crate::error::LeaseError;
use crate::lease::{LeaseStore, StoreOp};
use crate::model::{
    Batch, GroupName, Lease, LeaseKey, LeaseState, PartitionId, Position, Timestamp,
};
use crate::processor::{
    CloseReason, Context, Handler, HandlerError, Processor, ProcessorError, ProcessorHandle,
    Settings,
};
use crate::source::{FeedSource, MemoryFeed};

/// How many distinct keys [`Fleet::write`] spreads records over: record `n` has key
/// `key-{n % KEYS}`.
pub const KEYS: u64 = 97;

/// Makes a fresh store handle; called once per host (a new connection for a real backend).
pub type StoreFactory = Arc<dyn Fn() -> Arc<dyn LeaseStore> + Send + Sync>;

/// How a scenario's time passes: the backend difference the fleet scenarios take as an
/// argument, as the conformance suites take fixture flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Paused tokio time: scenario time is tokio time, exactly, and every bound is asserted as
    /// written. The test must run on a paused runtime (`start_paused = true`).
    Paused,
    /// Real time, for a store on a real server: every duration of the scenario (the hosts'
    /// settings, its waits) is divided by `speedup`, and each tight bound it asserts is widened
    /// for store round trips and scheduling: `allowance` of real time is added to an upper
    /// bound ("owned again within …"), a quarter of it taken off a lower bound ("not taken
    /// before …"). Safety checks (no delivery after a takeover, no continuation moving back)
    /// are not widened.
    Real {
        /// How many times faster than scenario time the hosts run (at least 1).
        speedup: u32,
        /// Real time added to each tight upper bound (a quarter of it taken off a lower one).
        allowance: Duration,
    },
}

impl Timing {
    fn speedup(self) -> u32 {
        match self {
            Timing::Paused => 1,
            Timing::Real { speedup, .. } => speedup.max(1),
        }
    }

    /// `d` of scenario time as it passes on the tokio clock.
    pub fn real(self, d: Duration) -> Duration {
        d / self.speedup()
    }

    /// `d` of the tokio clock in scenario time.
    pub fn scenario(self, d: Duration) -> Duration {
        d * self.speedup()
    }

    /// The allowance in scenario time, added to upper bounds (zero on paused time).
    pub fn allowance(self) -> Duration {
        match self {
            Timing::Paused => Duration::ZERO,
            Timing::Real { allowance, .. } => self.scenario(allowance),
        }
    }

    /// How much earlier a lower bound is checked, in scenario time (zero on paused time): a
    /// quarter of the allowance. Only the check's own round trips and a late wake-up can carry
    /// it past the event it bounds, and the bound must stay close to what it checks.
    pub fn early(self) -> Duration {
        self.allowance() / 4
    }

    /// `settings`, written in scenario time, as the hosts run them: every duration divided by
    /// the speed-up (unchanged on paused time).
    pub fn settings(self, settings: &Settings) -> Settings {
        let d = |d: Duration| self.real(d);
        let mut s = settings.clone();
        s.lease_expiry = d(s.lease_expiry);
        s.renew_interval = d(s.renew_interval);
        s.safety_margin = d(s.safety_margin);
        s.acquire_interval = d(s.acquire_interval);
        s.full_list_interval = d(s.full_list_interval);
        s.poll_delay = d(s.poll_delay);
        s.handoff_timeout = d(s.handoff_timeout);
        if let crate::processor::CheckpointMode::Interval(i) = s.checkpoint_mode {
            s.checkpoint_mode = crate::processor::CheckpointMode::Interval(d(i));
        }
        s.handler_timeout = s.handler_timeout.map(d);
        s.shutdown_timeout = d(s.shutdown_timeout);
        s.min_backoff = d(s.min_backoff);
        s.max_backoff = d(s.max_backoff);
        s.sync_interval = d(s.sync_interval);
        s.cleanup_delay = d(s.cleanup_delay);
        s
    }
}

/// One delivery of one record.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Who delivered it.
    pub host: String,
    /// The partition.
    pub partition: PartitionId,
    /// The record's payload (a unique sequence number).
    pub record: u64,
    /// Scenario time since the fleet started.
    pub at: Duration,
}

/// Records every delivery of every host.
#[derive(Debug, Default)]
pub struct Ledger {
    deliveries: Mutex<Vec<Delivery>>,
}

impl Ledger {
    /// Every delivery so far.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.deliveries.lock().expect("ledger lock").clone()
    }
}

#[derive(Debug)]
struct LedgerHandler {
    host: String,
    ledger: Arc<Ledger>,
    origin: tokio::time::Instant,
    timing: Timing,
}

#[async_trait]
impl Handler for LedgerHandler {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let at = self
            .timing
            .scenario(tokio::time::Instant::now() - self.origin);
        let mut d = self.ledger.deliveries.lock().expect("ledger lock");
        for r in &batch.records {
            let record = std::str::from_utf8(&r.data)?.parse()?;
            d.push(Delivery {
                host: self.host.clone(),
                partition: ctx.partition().clone(),
                record,
                at,
            });
        }
        Ok(())
    }

    async fn close(&self, _ctx: &Context, _reason: CloseReason) {}
}

/// A store wrapper a test can cut off: calls then fail or hang.
#[derive(Debug, Clone)]
pub struct Faulty {
    inner: Arc<dyn LeaseStore>,
    mode: Arc<AtomicU8>,
}

/// How a [`Faulty`] store behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// Calls go through.
    Healthy = 0,
    /// Calls fail with a retryable error.
    Fail = 1,
    /// Calls never complete.
    Hang = 2,
    /// Heartbeats go through; every other call fails (a partial outage: the host stays live
    /// but can neither read nor write its leases).
    LeasesFail = 3,
}

impl Faulty {
    /// Wraps `inner`, healthy.
    pub fn new(inner: Arc<dyn LeaseStore>) -> Self {
        Self {
            inner,
            mode: Arc::new(AtomicU8::new(0)),
        }
    }

    /// Switches the behaviour of every handle to this store.
    pub fn set(&self, mode: FaultMode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    async fn gate(&self, op: &'static str) -> Result<(), LeaseError> {
        match self.mode.load(Ordering::SeqCst) {
            0 => Ok(()),
            3 if op == "heartbeat" => Ok(()),
            1 | 3 => Err(LeaseError::store(
                op,
                None,
                true,
                "cut off from the store (test)",
            )),
            _ => std::future::pending().await,
        }
    }
}

#[async_trait]
impl crate::lease::ForwardingStore for Faulty {
    fn inner(&self) -> &dyn LeaseStore {
        &*self.inner
    }

    async fn before(&self, op: StoreOp) -> Result<(), LeaseError> {
        self.gate(op.as_str()).await
    }
}

/// A fleet of processors on one store and one in-memory feed.
pub struct Fleet {
    stores: StoreFactory,
    /// The feed every host reads.
    pub feed: MemoryFeed,
    /// Every delivery.
    pub ledger: Arc<Ledger>,
    /// The group.
    pub group: GroupName,
    /// Settings every host gets, in scenario time ([`Timing::settings`] gives what the hosts
    /// run).
    pub settings: Settings,
    /// How scenario time passes.
    pub timing: Timing,
    hosts: BTreeMap<String, (ProcessorHandle, Faulty)>,
    origin: tokio::time::Instant,
    written: u64,
    next_seed: u64,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("hosts", &self.hosts.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// The settings scenarios use: 10 s expiry, 2 s renew and acquire, 2 s margin.
pub fn scenario_settings() -> Settings {
    Settings {
        lease_expiry: Duration::from_secs(10),
        renew_interval: Duration::from_secs(2),
        safety_margin: Duration::from_secs(2),
        acquire_interval: Duration::from_secs(2),
        poll_delay: Duration::from_millis(200),
        handoff_timeout: Duration::from_secs(10),
        max_batch_size: 50,
        ..Settings::default()
    }
}

impl Fleet {
    /// A fleet over `partitions` partitions, with a lease created for each, on paused time.
    pub async fn new(stores: StoreFactory, partitions: u32) -> Self {
        Self::timed(stores, partitions, Timing::Paused).await
    }

    /// A fleet over `partitions` partitions, with a lease created for each, whose time passes
    /// as `timing` says.
    pub async fn timed(stores: StoreFactory, partitions: u32, timing: Timing) -> Self {
        let feed = MemoryFeed::new(partitions);
        let group = GroupName::new("fleet").expect("valid");
        let store = stores();
        for p in feed.partitions().await.expect("partitions") {
            store
                .create(&Lease::new(
                    LeaseKey::new(group.clone(), p.id),
                    Position::Beginning,
                ))
                .await
                .expect("create lease");
        }
        Self {
            stores,
            feed,
            ledger: Arc::new(Ledger::default()),
            group,
            settings: scenario_settings(),
            timing,
            hosts: BTreeMap::new(),
            origin: tokio::time::Instant::now(),
            written: 0,
            next_seed: 1,
        }
    }

    /// A fleet over `partitions` partitions with no lease created up front, on paused time: the
    /// leader's partition sync creates them, and follows splits and merges. Syncs every acquire
    /// interval and deletes finished leases 4 s after their children start.
    pub async fn with_sync(stores: StoreFactory, partitions: u32) -> Self {
        let feed = MemoryFeed::new(partitions);
        let mut settings = scenario_settings();
        settings.sync_interval = settings.acquire_interval;
        settings.cleanup_delay = Duration::from_secs(4);
        Self {
            stores,
            feed,
            ledger: Arc::new(Ledger::default()),
            group: GroupName::new("fleet").expect("valid"),
            settings,
            timing: Timing::Paused,
            hosts: BTreeMap::new(),
            origin: tokio::time::Instant::now(),
            written: 0,
            next_seed: 1,
        }
    }

    /// Splits the open partition `partition` of the feed. Returns the two children.
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
    pub async fn open_partitions(&self) -> Vec<crate::model::Partition> {
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

    /// Checks lineage order (design rule 5): for every key, records are first delivered in
    /// the order they were written, across every parent → child boundary; and no record of a
    /// child is delivered before the last delivery of any record of its parents.
    pub async fn check_lineage_order(&self) {
        let deliveries = self.ledger.deliveries();
        let mut seen: BTreeSet<u64> = BTreeSet::new();
        let mut last_of_key: HashMap<u64, u64> = HashMap::new();
        let mut first_at: HashMap<&PartitionId, usize> = HashMap::new();
        let mut last_at: HashMap<&PartitionId, usize> = HashMap::new();
        for (i, d) in deliveries.iter().enumerate() {
            first_at.entry(&d.partition).or_insert(i);
            last_at.insert(&d.partition, i);
            if !seen.insert(d.record) {
                continue;
            }
            let key = d.record % KEYS;
            if let Some(prev) = last_of_key.insert(key, d.record) {
                assert!(
                    prev < d.record,
                    "key-{key}: record {} (partition {}) first delivered after record {prev}",
                    d.record,
                    d.partition
                );
            }
        }
        for p in self.feed.partitions().await.expect("memory feed lists") {
            let Some(first) = first_at.get(&p.id) else {
                continue;
            };
            for parent in &p.parents {
                if let Some(last) = last_at.get(parent) {
                    assert!(
                        last < first,
                        "child {} delivered (delivery #{first}) before the last delivery of parent {parent} (#{last})",
                        p.id
                    );
                }
            }
        }
    }

    /// Builds (but does not start) a processor named `name`, its clock skewed by `skew_ms`.
    pub fn processor(&mut self, name: &str, skew_ms: i64) -> (Processor, Faulty) {
        let faulty = Faulty::new((self.stores)());
        let clock: Arc<dyn Clock> =
            Arc::new(VirtualClock::new(Timestamp(1_700_000_000_000)).with_skew(skew_ms));
        self.next_seed += 1;
        let p = Processor::builder()
            .host(name)
            .group(self.group.as_str())
            .store(Arc::new(faulty.clone()))
            .source(Arc::new(self.feed.clone()))
            .handler(LedgerHandler {
                host: name.to_string(),
                ledger: self.ledger.clone(),
                origin: self.origin,
                timing: self.timing,
            })
            .clock(clock)
            .seed(self.next_seed)
            .settings(self.timing.settings(&self.settings))
            .build()
            .expect("valid settings");
        (p, faulty)
    }

    /// Starts a host.
    pub fn start(&mut self, name: &str) {
        self.start_skewed(name, 0);
    }

    /// Starts a host whose wall clock is off by `skew_ms`.
    pub fn start_skewed(&mut self, name: &str, skew_ms: i64) {
        let (p, faulty) = self.processor(name, skew_ms);
        self.hosts.insert(name.to_string(), (p.start(), faulty));
    }

    /// Crashes a host: its tasks are dropped, nothing is released.
    pub fn kill(&mut self, name: &str) {
        if let Some((h, _)) = self.hosts.remove(name) {
            h.kill();
        }
    }

    /// Stops a host gracefully.
    pub async fn stop(&mut self, name: &str) -> Result<(), ProcessorError> {
        match self.hosts.remove(name) {
            Some((h, _)) => h.stop().await,
            None => Ok(()),
        }
    }

    /// Cuts `name` off from the store (or heals it).
    pub fn set_store_mode(&self, name: &str, mode: FaultMode) {
        if let Some((_, f)) = self.hosts.get(name) {
            f.set(mode);
        }
    }

    /// Host names running.
    pub fn running(&self) -> Vec<String> {
        self.hosts.keys().cloned().collect()
    }

    /// Appends `n` records spread over keys; returns their numbers.
    pub fn write(&mut self, n: u64) {
        for _ in 0..n {
            let seq = self.written;
            self.written += 1;
            self.feed
                .append(&format!("key-{}", seq % KEYS), seq.to_string());
        }
    }

    /// Scenario time since the fleet was made.
    pub fn elapsed(&self) -> Duration {
        self.timing.scenario(self.origin.elapsed())
    }

    /// Lets `d` of scenario time pass, writing `per_sec` records each second of it, a quarter
    /// of a second's worth at a time.
    pub async fn run_for(&mut self, d: Duration, per_sec: u64) {
        let step = Duration::from_millis(250);
        let start = tokio::time::Instant::now();
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

    /// Runs until every record written has been delivered, or `limit` of scenario time passes.
    /// Returns whether everything was delivered.
    pub async fn drain(&mut self, limit: Duration) -> bool {
        let step = self.timing.real(Duration::from_millis(250));
        let deadline = tokio::time::Instant::now() + self.timing.real(limit);
        loop {
            let delivered: BTreeSet<u64> =
                self.ledger.deliveries().iter().map(|d| d.record).collect();
            if delivered.len() as u64 == self.written {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(step).await;
        }
    }

    /// The leases as stored.
    pub async fn leases(&self) -> Vec<Lease> {
        (self.stores)()
            .list(&self.group)
            .await
            .expect("list")
            .leases
    }

    /// Owner per partition, as stored.
    pub async fn owners(&self) -> BTreeMap<PartitionId, Option<String>> {
        self.leases()
            .await
            .into_iter()
            .map(|l| (l.key.partition, l.owner.map(|o| o.to_string())))
            .collect()
    }

    /// Checks the ledger: every record delivered, in order per partition. Returns the number
    /// of duplicate deliveries.
    pub fn check_ledger(&self) -> usize {
        let deliveries = self.ledger.deliveries();
        let mut seen: BTreeSet<u64> = BTreeSet::new();
        let mut duplicates = 0;
        let mut last: HashMap<PartitionId, u64> = HashMap::new();
        for d in &deliveries {
            if !seen.insert(d.record) {
                duplicates += 1;
                continue;
            }
            if let Some(prev) = last.insert(d.partition.clone(), d.record) {
                assert!(
                    prev < d.record,
                    "partition {}: record {} delivered after {} (out of order)",
                    d.partition,
                    d.record,
                    prev
                );
            }
        }
        let missing: Vec<u64> = (0..self.written).filter(|r| !seen.contains(r)).collect();
        assert!(
            missing.is_empty(),
            "{} records never delivered, first {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
        duplicates
    }
}

/// Asserts every running host owns within one of its equal share.
pub fn assert_balanced(owners: &BTreeMap<PartitionId, Option<String>>, hosts: &[String]) {
    let n = owners.len();
    let mut counts: BTreeMap<&str, usize> = hosts.iter().map(|h| (h.as_str(), 0)).collect();
    for owner in owners.values() {
        let owner = owner.as_deref().unwrap_or("<nobody>");
        *counts.entry(owner).or_default() += 1;
    }
    assert!(
        !counts.contains_key("<nobody>"),
        "every lease is owned: {counts:?}"
    );
    let (lo, hi) = (n / hosts.len(), n.div_ceil(hosts.len()));
    for (h, c) in &counts {
        assert!(
            (lo..=hi).contains(c),
            "host {h} owns {c} leases; its share is {lo}..={hi}: {counts:?}"
        );
    }
}

/// Watches owners every 250 ms of scenario time for `d`, returning how many times each lease
/// changed owner.
pub async fn watch_moves(
    fleet: &mut Fleet,
    d: Duration,
    per_sec: u64,
) -> BTreeMap<PartitionId, usize> {
    let mut moves: BTreeMap<PartitionId, usize> = BTreeMap::new();
    let mut prev = fleet.owners().await;
    let step = Duration::from_millis(250);
    let end = fleet.elapsed() + d;
    while fleet.elapsed() < end {
        fleet.run_for(step, per_sec).await;
        let now = fleet.owners().await;
        for (p, o) in &now {
            if o.is_some() && prev.get(p).is_some_and(|po| po.is_some() && po != o) {
                *moves.entry(p.clone()).or_default() += 1;
            }
        }
        prev = now;
    }
    moves
}

/// Scenario: 1 host, then 2, then 11, over 200 leases. Within two acquire intervals of each
/// arrival every host is within one of its share, each lease moved at most once, and the
/// ledger shows no duplicate and no gap (design, "Balancing": hand-off is zero-gap,
/// zero-duplicate).
pub async fn scenario_rebalance_on_arrivals(stores: StoreFactory, timing: Timing) {
    let mut fleet = Fleet::timed(stores, 200, timing).await;
    let slack = timing.allowance();
    let window = fleet.settings.acquire_interval * 2;
    fleet.start("host-00");
    fleet.run_for(window + slack, 100).await;
    assert_balanced(&fleet.owners().await, &fleet.running());
    for arrivals in [vec![1], (2..11).collect::<Vec<_>>()] {
        for i in arrivals {
            fleet.start(&format!("host-{i:02}"));
        }
        // A new host asks for hand-offs once it has been registered for one renew interval
        // (so hosts starting together see each other); from then on, two acquire intervals.
        let arrival = fleet.settings.renew_interval + window + Duration::from_millis(250) + slack;
        let moves = watch_moves(&mut fleet, arrival, 100).await;
        assert_balanced(&fleet.owners().await, &fleet.running());
        if let Some((p, n)) = moves.iter().find(|(_, n)| **n > 1) {
            panic!("lease {p} moved {n} times in one rebalance");
        }
        // Settled: nothing moves any more.
        let settle = fleet.settings.acquire_interval * 3;
        let later = watch_moves(&mut fleet, settle, 100).await;
        assert!(
            later.is_empty(),
            "leases keep moving after balance: {later:?}"
        );
    }
    assert!(
        fleet.drain(Duration::from_secs(30) + slack).await,
        "everything delivered"
    );
    let dups = fleet.check_ledger();
    assert_eq!(dups, 0, "hand-offs deliver no duplicates");
    for h in fleet.running() {
        fleet.stop(&h).await.expect("graceful stop");
    }
}

/// Scenario: a host is killed (no release); every lease it owned is owned again within
/// `lease_expiry + acquire_interval`, taken in one cycle, and nothing is lost. The hosts'
/// wall clocks are off by `skews` (ms): rule 2, no clock agreement is needed.
pub async fn scenario_killed_host_leases_taken_in_one_cycle(
    stores: StoreFactory,
    skews: [i64; 3],
    timing: Timing,
) {
    let mut fleet = Fleet::timed(stores, 60, timing).await;
    let slack = timing.allowance();
    for (i, skew) in skews.iter().enumerate() {
        fleet.start_skewed(&format!("h{i}"), *skew);
    }
    fleet.run_for(Duration::from_secs(10), 200).await;
    assert_balanced(&fleet.owners().await, &fleet.running());
    let victims: Vec<PartitionId> = fleet
        .owners()
        .await
        .into_iter()
        .filter(|(_, o)| o.as_deref() == Some("h0"))
        .map(|(p, _)| p)
        .collect();
    assert!(!victims.is_empty());
    fleet.kill("h0");
    // The bound is inclusive: the cycle that takes them may run at the deadline instant itself.
    let deadline = fleet.settings.lease_expiry
        + fleet.settings.acquire_interval
        + Duration::from_millis(50)
        + slack;
    // Just before the earliest possible expiry nobody has taken them (no premature take).
    let quiet = (fleet.settings.lease_expiry - fleet.settings.acquire_interval)
        .saturating_sub(timing.early());
    fleet.run_for(quiet, 200).await;
    let owners = fleet.owners().await;
    assert!(
        victims.iter().all(|p| owners[p].as_deref() == Some("h0")),
        "a dead host's leases are not taken before lease_expiry"
    );
    fleet.run_for(deadline - quiet, 200).await;
    let owners = fleet.owners().await;
    for p in &victims {
        let o = owners[p].as_deref();
        assert!(
            o.is_some() && o != Some("h0"),
            "lease {p} of the killed host is owned again within lease_expiry + acquire_interval (owner {o:?})"
        );
    }
    assert_balanced(&owners, &fleet.running());
    assert!(fleet.drain(Duration::from_secs(30) + slack).await);
    fleet.check_ledger();
    for h in fleet.running() {
        fleet.stop(&h).await.expect("stop");
    }
}

/// Scenario: a host cut off from the store (its calls fail or hang, as `mode` says) stops
/// delivering before another host takes its leases (rule 3), and no continuation ever moves
/// backwards (rule 4).
///
/// Hosts checkpoint at most every 30 s, so a worker keeps delivering between store writes:
/// only fencing stops it (with a checkpoint per batch, the failing checkpoint would).
pub async fn scenario_cut_off_host_fences_before_takeover(
    stores: StoreFactory,
    mode: FaultMode,
    timing: Timing,
) {
    let mut fleet = Fleet::timed(stores, 30, timing).await;
    let slack = timing.allowance();
    fleet.settings.checkpoint_mode =
        crate::processor::CheckpointMode::Interval(Duration::from_secs(30));
    for i in 0..3 {
        fleet.start(&format!("h{i}"));
    }
    fleet.run_for(Duration::from_secs(10), 200).await;
    let cut_at = fleet.elapsed();
    fleet.set_store_mode("h0", mode);
    let mut continuations: BTreeMap<PartitionId, u64> = BTreeMap::new();
    let end = cut_at + Duration::from_secs(30);
    while fleet.elapsed() < end {
        fleet.run_for(Duration::from_millis(250), 200).await;
        for l in fleet.leases().await {
            if let Some(c) = &l.continuation {
                let off: u64 = c
                    .as_str()
                    .rsplit_once(':')
                    .and_then(|(_, o)| o.parse().ok())
                    .expect("memory feed continuation");
                let prev = continuations.insert(l.key.partition.clone(), off);
                assert!(
                    prev.is_none_or(|p| p <= off),
                    "continuation of {} moved backwards",
                    l.key.partition
                );
            }
        }
    }
    let deliveries = fleet.ledger.deliveries();
    let h0_partitions: BTreeSet<PartitionId> = deliveries
        .iter()
        .filter(|d| d.host == "h0" && d.at >= cut_at.saturating_sub(Duration::from_secs(1)))
        .map(|d| d.partition.clone())
        .collect();
    for p in &h0_partitions {
        let last_h0 = deliveries
            .iter()
            .filter(|d| &d.partition == p && d.host == "h0")
            .map(|d| d.at)
            .max()
            .expect("delivered");
        let first_other = deliveries
            .iter()
            .filter(|d| &d.partition == p && d.host != "h0" && d.at > cut_at)
            .map(|d| d.at)
            .min();
        let first_other = first_other.unwrap_or_else(|| panic!("partition {p} taken over"));
        assert!(
            last_h0 < first_other,
            "partition {p}: cut-off host delivered at {last_h0:?}, after another host started at {first_other:?}"
        );
    }
    assert!(
        !h0_partitions.is_empty(),
        "h0 was delivering before the cut"
    );
    let owners = fleet.owners().await;
    assert!(owners.values().all(|o| o.as_deref() != Some("h0")));
    fleet.set_store_mode("h0", FaultMode::Healthy);
    assert!(fleet.drain(Duration::from_secs(30) + slack).await);
    fleet.check_ledger();
    fleet.kill("h0");
    for h in fleet.running() {
        fleet.stop(&h).await.expect("stop");
    }
}

/// Scenario: an owner that cannot see a hand-off request (its lease reads and writes fail
/// while its heartbeat still succeeds, so it is never fenced) stops delivering before the
/// asker steals the lease (rule 1): its workers deliver only within `handoff_timeout −
/// safety_margin` of confirming that no request is pending.
///
/// Checkpoints are written at most every 30 s, so only that rule stops the owner.
pub async fn scenario_owner_blind_to_request_stops_before_steal(
    stores: StoreFactory,
    timing: Timing,
) {
    let mut fleet = Fleet::timed(stores, 4, timing).await;
    let slack = timing.allowance();
    fleet.settings.checkpoint_mode =
        crate::processor::CheckpointMode::Interval(Duration::from_secs(30));
    fleet.start("a");
    fleet.run_for(Duration::from_secs(6), 40).await;
    let owners = fleet.owners().await;
    assert!(
        owners.values().all(|o| o.as_deref() == Some("a")),
        "a owns every lease: {owners:?}"
    );
    fleet.set_store_mode("a", FaultMode::LeasesFail);
    fleet.start("b");
    fleet.run_for(Duration::from_secs(40), 40).await;
    let owners = fleet.owners().await;
    let stolen: Vec<PartitionId> = owners
        .iter()
        .filter(|(_, o)| o.as_deref() == Some("b"))
        .map(|(p, _)| p.clone())
        .collect();
    assert_eq!(
        stolen.len(),
        2,
        "b stole its share of the unhonoured requests: {owners:?}"
    );
    let deliveries = fleet.ledger.deliveries();
    for p in &stolen {
        let last_a = deliveries
            .iter()
            .filter(|d| &d.partition == p && d.host == "a")
            .map(|d| d.at)
            .max()
            .expect("a delivered before");
        let first_b = deliveries
            .iter()
            .filter(|d| &d.partition == p && d.host == "b")
            .map(|d| d.at)
            .min()
            .unwrap_or_else(|| panic!("b delivers {p}"));
        assert!(
            last_a < first_b,
            "partition {p}: a delivered at {last_a:?}, after b started at {first_b:?}"
        );
    }
    fleet.set_store_mode("a", FaultMode::Healthy);
    assert!(fleet.drain(Duration::from_secs(60) + slack).await);
    fleet.check_ledger();
    for h in fleet.running() {
        fleet.stop(&h).await.expect("stop");
    }
}

/// Scenario: graceful stop releases every lease with its continuation; a restart resumes
/// exactly after the last checkpoint (rule 6): no duplicate, no gap.
pub async fn scenario_graceful_stop_and_resume(stores: StoreFactory, timing: Timing) {
    let mut fleet = Fleet::timed(stores, 8, timing).await;
    let slack = timing.allowance();
    fleet.start("a");
    fleet.start("b");
    fleet.run_for(Duration::from_secs(10), 100).await;
    assert!(fleet.drain(Duration::from_secs(10) + slack).await);
    fleet.stop("a").await.expect("stop a");
    fleet.stop("b").await.expect("stop b");
    let leases = fleet.leases().await;
    for l in &leases {
        assert_eq!(l.state, LeaseState::Available, "lease {} released", l.key);
        assert_eq!(l.owner, None);
        let records = fleet.feed.len(&l.key.partition).expect("partition");
        assert_eq!(
            l.continuation.is_some(),
            records > 0,
            "lease {} keeps its continuation",
            l.key
        );
    }
    let m = (fleet.stores)()
        .membership(&fleet.group)
        .await
        .expect("membership");
    assert!(m.hosts.is_empty(), "heartbeats removed on graceful stop");
    fleet.write(200);
    fleet.start("a");
    fleet.run_for(Duration::from_secs(6), 0).await;
    assert!(fleet.drain(Duration::from_secs(20) + slack).await);
    assert_eq!(fleet.check_ledger(), 0, "resume delivers no duplicate");
    fleet.stop("a").await.expect("stop");
}

/// Scenario: a second live process with a host name in use is refused; after a crash, a
/// restart under the same name takes the name and its leases back.
pub async fn scenario_duplicate_host_refused_restart_takes_back(
    stores: StoreFactory,
    timing: Timing,
) {
    let mut fleet = Fleet::timed(stores, 6, timing).await;
    let slack = timing.allowance();
    fleet.start("a");
    fleet.run_for(Duration::from_secs(4), 10).await;
    let (twin, _) = fleet.processor("a", 0);
    let cancel = CancellationToken::new();
    let result = tokio::time::timeout(timing.real(Duration::from_secs(60)), twin.run(cancel)).await;
    match result {
        Ok(Err(ProcessorError::DuplicateHost { host, .. })) => assert_eq!(host, "a"),
        other => panic!("a second process named a must be refused, got {other:?}"),
    }
    // The first one was not disturbed.
    fleet.run_for(Duration::from_secs(4), 10).await;
    let owners = fleet.owners().await;
    assert!(owners.values().all(|o| o.as_deref() == Some("a")));
    fleet.kill("a");
    fleet.start("a");
    fleet
        .run_for(
            fleet.settings.lease_expiry + fleet.settings.acquire_interval * 2 + slack,
            10,
        )
        .await;
    assert!(fleet
        .owners()
        .await
        .values()
        .all(|o| o.as_deref() == Some("a")));
    assert!(fleet.drain(Duration::from_secs(20) + slack).await);
    fleet.check_ledger();
    fleet.stop("a").await.expect("stop");
}

/// Scenario: a host joins after another crashed (its heartbeat row is still there, owning
/// nothing): exactly the newcomer's share moves, each lease once. The crashed host's row must
/// not count as a live host owed a share.
pub async fn scenario_newcomer_after_crash_moves_only_its_share(
    stores: StoreFactory,
    timing: Timing,
) {
    let mut fleet = Fleet::timed(stores, 60, timing).await;
    let slack = timing.allowance();
    for i in 0..3 {
        fleet.start(&format!("h{i}"));
    }
    fleet.run_for(Duration::from_secs(10), 100).await;
    fleet.kill("h0");
    // Its leases are taken within lease_expiry + acquire_interval; its row is removed by the
    // leader at a cycle after that.
    let takeover = fleet.settings.lease_expiry + fleet.settings.acquire_interval * 3 + slack;
    fleet.run_for(takeover, 100).await;
    let m = (fleet.stores)()
        .membership(&fleet.group)
        .await
        .expect("membership");
    assert!(
        m.hosts.iter().all(|h| h.host.as_str() != "h0"),
        "the dead host's row is removed once it owns nothing"
    );
    let before = fleet.owners().await;
    assert_balanced(&before, &fleet.running());
    fleet.start("h3");
    let settle = fleet.settings.renew_interval + fleet.settings.acquire_interval * 4 + slack;
    let moves = watch_moves(&mut fleet, settle, 100).await;
    let after = fleet.owners().await;
    assert_balanced(&after, &fleet.running());
    let moved: usize = moves.values().sum();
    let to_newcomer = after
        .values()
        .filter(|o| o.as_deref() == Some("h3"))
        .count();
    assert_eq!(
        moved, to_newcomer,
        "only the newcomer's share moves ({to_newcomer}), got {moved} moves: {moves:?}"
    );
    assert!(fleet.drain(Duration::from_secs(30) + slack).await);
    fleet.check_ledger();
    for h in fleet.running() {
        fleet.stop(&h).await.expect("stop");
    }
}
