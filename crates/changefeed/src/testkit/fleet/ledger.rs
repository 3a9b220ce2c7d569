//! [`LedgerKit`]: the fleet scenarios' hosts, each on the backend's store behind a [`Faulty`]
//! switch, delivering into one [`Ledger`]; and the ledger's checks.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    scenario_settings, Companion, FaultMode, Faulty, Fleet, HostKit, HostStart, StoreFactory,
    Timing, KEYS,
};
use crate::model::{Batch, GroupName, Lease, LeaseKey, PartitionId, Position};
use crate::processor::{
    CloseReason, ConfigError, Context, Handler, HandlerError, ProcessorBuilder,
};
use crate::source::{FeedSource, MemoryFeed};

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

/// The fleet scenarios' [`HostKit`]: each start of a host gets a fresh store handle behind a
/// [`Faulty`] switch (healthy), the fleet's feed, a handler recording into the [`Ledger`], and
/// processor seeds 2, 3, 4 … in the order processors are built. Invalid settings panic.
#[derive(Debug)]
pub struct LedgerKit {
    ledger: Arc<Ledger>,
    next_seed: u64,
}

impl LedgerKit {
    /// A kit with an empty ledger.
    pub fn new() -> Self {
        Self {
            ledger: Arc::default(),
            next_seed: 1,
        }
    }
}

impl Default for LedgerKit {
    fn default() -> Self {
        Self::new()
    }
}

impl HostKit for LedgerKit {
    /// The switch of the host's current start.
    type Host = Option<Faulty>;

    fn host(&mut self, _name: &str) -> Option<Faulty> {
        None
    }

    fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed
    }

    fn equip(
        &mut self,
        start: HostStart<'_>,
        host: &mut Option<Faulty>,
        builder: ProcessorBuilder,
    ) -> (ProcessorBuilder, Option<Companion>) {
        let faulty = Faulty::new((start.stores)());
        *host = Some(faulty.clone());
        let builder = builder
            .store(Arc::new(faulty))
            .source(Arc::new(start.feed.clone()))
            .handler(LedgerHandler {
                host: start.name.to_string(),
                ledger: self.ledger.clone(),
                origin: start.origin,
                timing: start.timing,
            })
            .clock(Arc::new(start.clock));
        (builder, None)
    }

    fn refused(&mut self, name: &str, err: &ConfigError) {
        panic!("host {name}: invalid settings: {err}");
    }
}

impl Fleet<LedgerKit> {
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
        Self::with_kit(
            LedgerKit::new(),
            stores,
            feed,
            group,
            scenario_settings(),
            timing,
        )
    }

    /// A fleet over `partitions` partitions with no lease created up front, on paused time: the
    /// leader's partition sync creates them, and follows splits and merges. Syncs every acquire
    /// interval and deletes finished leases 4 s after their children start.
    pub async fn with_sync(stores: StoreFactory, partitions: u32) -> Self {
        let feed = MemoryFeed::new(partitions);
        let mut settings = scenario_settings();
        settings.sync_interval = settings.acquire_interval;
        settings.cleanup_delay = Duration::from_secs(4);
        Self::with_kit(
            LedgerKit::new(),
            stores,
            feed,
            GroupName::new("fleet").expect("valid"),
            settings,
            Timing::Paused,
        )
    }

    /// Every delivery of every host.
    pub fn ledger(&self) -> &Ledger {
        &self.kit.ledger
    }

    /// Cuts `name` off from the store (or heals it) while it runs; its next start is healthy.
    pub fn set_store_mode(&self, name: &str, mode: FaultMode) {
        if let Some(faulty) = self
            .hosts
            .get(name)
            .filter(|h| h.is_up())
            .and_then(|h| h.kit.as_ref())
        {
            faulty.set(mode);
        }
    }

    /// Runs until every record written has been delivered, or `limit` of scenario time passes.
    /// Returns whether everything was delivered.
    pub async fn drain(&mut self, limit: Duration) -> bool {
        let step = self.timing.real(Duration::from_millis(250));
        let deadline = tokio::time::Instant::now() + self.timing.real(limit);
        loop {
            let delivered: BTreeSet<u64> = self
                .ledger()
                .deliveries()
                .iter()
                .map(|d| d.record)
                .collect();
            if delivered.len() as u64 == self.written() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(step).await;
        }
    }

    /// Checks the ledger: every record delivered, in order per partition. Returns the number
    /// of duplicate deliveries.
    pub fn check_ledger(&self) -> usize {
        let deliveries = self.ledger().deliveries();
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
        let missing: Vec<u64> = (0..self.written()).filter(|r| !seen.contains(r)).collect();
        assert!(
            missing.is_empty(),
            "{} records never delivered, first {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
        duplicates
    }

    /// Checks lineage order (design rule 5): for every key, records are first delivered in
    /// the order they were written, across every parent → child boundary; and no record of a
    /// child is delivered before the last delivery of any record of its parents.
    pub async fn check_lineage_order(&self) {
        let deliveries = self.ledger().deliveries();
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
}
