//! Building, starting and stopping a processor: [`ProcessorBuilder`] and [`Processor`]; the
//! [`ProcessorHandle`] is in `handle.rs`. The host loop they run is in [`super::host`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;
use tracing::{info, Instrument};

use super::bounded::{BoundedSource, BoundedStore};
use super::callbacks::{Callbacks, ErrorNotice};
use super::config::{CheckpointMode, ConfigError, Settings};
use super::handle::ProcessorHandle;
use super::handler::{DeadLetterSink, Handler};
use super::health::{EndGuard, HealthCell, HealthProbe};
use super::heartbeat::{self, ProcessorError};
use super::hooks;
#[cfg(feature = "sim-broken")]
use super::hooks::Broken;
use super::host::Host;
use super::host_state::TableShare;
use crate::balance::{BalanceStrategy, EqualShare};
use crate::clock::{Clock, SystemClock};
use crate::lease::{CountingStore, LeaseStore};
use crate::model::{GroupName, HostName, PartitionId, Position};
use crate::source::FeedSource;

/// Builds a [`Processor`]; every setting is validated by [`ProcessorBuilder::build`].
#[derive(Default)]
pub struct ProcessorBuilder {
    host: Option<String>,
    group: Option<String>,
    store: Option<Arc<dyn LeaseStore>>,
    source: Option<Arc<dyn FeedSource>>,
    handler: Option<Arc<dyn Handler>>,
    key_concurrency: Option<usize>,
    dead_letter: Option<Arc<dyn DeadLetterSink>>,
    strategy: Option<Arc<dyn BalanceStrategy>>,
    clock: Option<Arc<dyn Clock>>,
    seed: Option<u64>,
    settings: Settings,
    hooks: hooks::Hooks,
    callbacks: Callbacks,
    share: Option<TableShare>,
}

impl std::fmt::Debug for ProcessorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessorBuilder")
            .field("host", &self.host)
            .field("group", &self.group)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

macro_rules! setting {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.settings.$name = value;
            self
        }
    };
}

impl ProcessorBuilder {
    /// This host's name, unique in the group (required).
    pub fn host(mut self, name: impl Into<String>) -> Self {
        self.host = Some(name.into());
        self
    }

    /// The group: the hosts sharing this feed (required).
    pub fn group(mut self, name: impl Into<String>) -> Self {
        self.group = Some(name.into());
        self
    }

    /// The lease store (required).
    pub fn store(mut self, store: Arc<dyn LeaseStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// The feed source (required).
    pub fn source(mut self, source: Arc<dyn FeedSource>) -> Self {
        self.source = Some(source);
        self
    }

    /// The handler (required).
    pub fn handler(mut self, handler: impl Handler) -> Self {
        self.handler = Some(Arc::new(handler));
        self
    }

    /// Runs each batch in up to `n` concurrent handler calls, one per record key, each key's
    /// records in order; the batch is done when every key is (see [`super::KeyParallel`]).
    /// Default 1: one call per batch. 0 is refused by [`ProcessorBuilder::build`].
    pub fn key_concurrency(mut self, n: usize) -> Self {
        self.key_concurrency = Some(n);
        self
    }

    /// The handler, already shared.
    pub fn shared_handler(mut self, handler: Arc<dyn Handler>) -> Self {
        self.handler = Some(handler);
        self
    }

    /// Hands a batch that failed `after` times (counted across hosts) to `sink` and moves the
    /// checkpoint past it. Without this, a failing batch is retried forever, never skipped.
    pub fn dead_letter(mut self, sink: Arc<dyn DeadLetterSink>, after: u32) -> Self {
        self.dead_letter = Some(sink);
        self.settings.dead_letter_after = Some(after);
        self
    }

    /// The balancing strategy. Default [`EqualShare`], with each host within the
    /// [`min_leases`](Self::min_leases) and [`max_leases`](Self::max_leases) it publishes.
    /// Those two settings configure the default strategy only: giving them together with a
    /// strategy is refused by [`build`](Self::build) (construct it with
    /// [`EqualShare::with_limits`] instead, the same on every host).
    pub fn strategy(mut self, strategy: Arc<dyn BalanceStrategy>) -> Self {
        self.strategy = Some(strategy);
        self
    }

    /// The clock. Default [`SystemClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Seeds every random choice (incarnation id, backoff jitter). Default: derived from the
    /// clock's wall time and the process id.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Shares the lease tables this host lists with the other hosts of this process given
    /// the same [`TableShare`]: hosts whose tables come to hold equal rows hold them once.
    /// Only the simulator runs many hosts of one group in one process (a host alone in its
    /// process gains nothing from it), so this is the simulator's, not the public API. A share
    /// serves one group: [`build`] refuses a host of another. Default: none.
    ///
    /// [`build`]: ProcessorBuilder::build
    #[cfg(feature = "sim")]
    pub(crate) fn share_tables(mut self, share: TableShare) -> Self {
        self.share = Some(share);
        self
    }

    /// Runs a deliberately broken variant (feature `sim-broken` only), so the simulator can
    /// show its checker catches it.
    #[cfg(feature = "sim-broken")]
    pub fn broken(mut self, broken: Broken) -> Self {
        self.hooks.broken = broken;
        self
    }

    /// Replaces all timing settings at once.
    pub fn settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    setting!(
        /// Where a new lease without a checkpoint starts.
        start_position: crate::model::Position
    );
    setting!(
        /// See [`Settings::lease_expiry`].
        lease_expiry: Duration
    );
    setting!(
        /// See [`Settings::renew_interval`].
        renew_interval: Duration
    );
    setting!(
        /// See [`Settings::safety_margin`].
        safety_margin: Duration
    );
    setting!(
        /// See [`Settings::acquire_interval`].
        acquire_interval: Duration
    );
    setting!(
        /// See [`Settings::full_list_interval`].
        full_list_interval: Duration
    );
    setting!(
        /// See [`Settings::max_batch_size`].
        max_batch_size: usize
    );
    setting!(
        /// See [`Settings::poll_delay`].
        poll_delay: Duration
    );
    setting!(
        /// See [`Settings::handoff_timeout`].
        handoff_timeout: Duration
    );
    setting!(
        /// See [`Settings::checkpoint_mode`].
        checkpoint_mode: CheckpointMode
    );
    setting!(
        /// See [`Settings::handler_max_retries`].
        handler_max_retries: u32
    );
    setting!(
        /// See [`Settings::handler_timeout`].
        handler_timeout: Option<Duration>
    );
    setting!(
        /// See [`Settings::shutdown_timeout`].
        shutdown_timeout: Duration
    );
    setting!(
        /// See [`Settings::sync_interval`].
        sync_interval: Duration
    );
    setting!(
        /// See [`Settings::cleanup`].
        cleanup: bool
    );
    setting!(
        /// See [`Settings::cleanup_delay`].
        cleanup_delay: Duration
    );
    setting!(
        /// See [`Settings::missing_parents`].
        missing_parents: crate::lineage::MissingParents
    );
    setting!(
        /// See [`Settings::min_leases`]: this host's own, published with its heartbeat.
        min_leases: usize
    );
    setting!(
        /// See [`Settings::max_leases`]: this host's own, published with its heartbeat.
        max_leases: Option<usize>
    );
    setting!(
        /// See [`Settings::capacity`]: this host's weight, published with its heartbeat.
        capacity: Option<f64>
    );
    setting!(
        /// See [`Settings::publish_load`]: publish each held lease's measured load with the
        /// heartbeat.
        publish_load: bool
    );
    setting!(
        /// See [`Settings::max_wait_time`]: the idle tick.
        max_wait_time: Option<Duration>
    );
    setting!(
        /// See [`Settings::lag_per_partition`].
        lag_per_partition: bool
    );
    setting!(
        /// See [`Settings::max_unhealthy`]: how long this host may stay fenced or unregistered
        /// before [`ProcessorHandle::health`] says it is unhealthy. `None`: 3 × `lease_expiry`.
        max_unhealthy: Option<Duration>
    );

    /// Calls `f` with the partition each time this host starts reading a lease it acquired
    /// (Cosmos DB's `WithLeaseAcquireNotification`). Every call is followed, once that worker
    /// stops, by one of [`on_lease_released`](Self::on_lease_released)'s. See
    /// [`callbacks`](super::callbacks) for how notifications are called.
    pub fn on_lease_acquired(mut self, f: impl Fn(&PartitionId) + Send + Sync + 'static) -> Self {
        self.callbacks.acquired = Some(Arc::new(f));
        self
    }

    /// Calls `f` with the partition and the reason each time this host stops reading a lease
    /// (Cosmos DB's `WithLeaseReleaseNotification`): handed off, lost, finished, released after
    /// failures, or released at shutdown.
    pub fn on_lease_released(
        mut self,
        f: impl Fn(&PartitionId, super::CloseReason) + Send + Sync + 'static,
    ) -> Self {
        self.callbacks.released = Some(Arc::new(f));
        self
    }

    /// Calls `f` with every failure the processor meets and retries (Cosmos DB's
    /// `WithErrorNotification`): [`ErrorNotice::is_user_error`] tells the handler's failures
    /// from the store's and the source's.
    pub fn on_error(mut self, f: impl Fn(&ErrorNotice) + Send + Sync + 'static) -> Self {
        self.callbacks.error = Some(Arc::new(f));
        self
    }

    /// Chooses where each partition the group starts on begins (Event Hubs' partition
    /// initialising handler): `f` gets the partition and the group's
    /// [`start_position`](Self::start_position) and returns the position its lease starts at.
    ///
    /// It is asked once per partition, by the host that creates the partition's lease, for the
    /// leases that would start at the group's start position: the partitions without a parent
    /// (with `Position::Now`, every open partition the fleet starts on). A lease with a
    /// checkpoint resumes from it, and a child of a split or merge always starts where its
    /// parents ended, so that nothing between them is lost. Give every host of a group the same
    /// function, as the same start position.
    pub fn start_position_for(
        mut self,
        f: impl Fn(&PartitionId, &Position) -> Position + Send + Sync + 'static,
    ) -> Self {
        self.callbacks.start = Some(Arc::new(f));
        self
    }

    /// Validates everything and builds the processor.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first setting that breaks a rule or the missing part.
    pub fn build(self) -> Result<Processor, ConfigError> {
        let host = HostName::new(self.host.ok_or(ConfigError::Missing("host"))?).map_err(|e| {
            ConfigError::Invalid {
                setting: "host",
                rule: e.to_string(),
            }
        })?;
        let group =
            GroupName::new(self.group.ok_or(ConfigError::Missing("group"))?).map_err(|e| {
                ConfigError::Invalid {
                    setting: "group",
                    rule: e.to_string(),
                }
            })?;
        if let Some(share) = &self.share {
            share.bind(&group).map_err(|other| ConfigError::Invalid {
                setting: "share_tables",
                rule: format!(
                    "the share serves the hosts of group {other}; a host of group {group} \
                     needs a share of its own"
                ),
            })?;
        }
        let store = self.store.ok_or(ConfigError::Missing("store"))?;
        let source = self.source.ok_or(ConfigError::Missing("source"))?;
        let handler = self.handler.ok_or(ConfigError::Missing("handler"))?;
        self.settings.validate()?;
        let handler = super::keyed::wrap(handler, self.key_concurrency, &self.settings)?;
        let limits = self.settings.lease_limits()?;
        if self.strategy.is_some() && !limits.is_none() {
            return Err(ConfigError::Invalid {
                setting: if limits.max_leases().is_some() {
                    "max_leases"
                } else {
                    "min_leases"
                },
                rule: "configures the default strategy, but ProcessorBuilder::strategy gave \
                       another: give the limits to that strategy (EqualShare::with_limits)"
                    .into(),
            });
        }
        if self.settings.dead_letter_after.is_some() && self.dead_letter.is_none() {
            return Err(ConfigError::Invalid {
                setting: "dead_letter_after",
                rule: "needs a dead-letter sink: call ProcessorBuilder::dead_letter".into(),
            });
        }
        let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock));
        static STARTS: AtomicU64 = AtomicU64::new(0);
        let seed = self.seed.unwrap_or_else(|| {
            (clock.wall().0 as u64)
                ^ (u64::from(std::process::id()) << 32)
                ^ STARTS
                    .fetch_add(1, Ordering::Relaxed)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        });
        let stats = Arc::new(crate::lease::StoreStats::default());
        let health = Arc::new(HealthCell::new(clock.clone(), self.settings.fence_after()));
        // Every store and source call is bounded, so that a client that hangs a call for ever
        // cannot stall the host (see `bounded.rs`).
        let (store, source): (Arc<dyn LeaseStore>, Arc<dyn FeedSource>) =
            if self.hooks.no_timeouts() {
                (store, source)
            } else {
                let limit = self.settings.call_timeout();
                (
                    Arc::new(BoundedStore::new(store, clock.clone(), limit)),
                    Arc::new(BoundedSource::new(source, clock.clone(), limit)),
                )
            };
        Ok(Processor {
            host,
            group,
            store: Arc::new(CountingStore::new(store, stats.clone())),
            stats,
            source,
            handler,
            dead_letter: self.dead_letter,
            strategy: self
                .strategy
                // This host's own limits reach every host, itself included, through its
                // heartbeat report (`HostState::planning_strategy`).
                .unwrap_or_else(|| Arc::new(EqualShare::default())),
            clock,
            rng: SmallRng::seed_from_u64(seed),
            settings: Arc::new(self.settings),
            hooks: self.hooks,
            callbacks: Arc::new(self.callbacks),
            health,
            share: self.share,
        })
    }
}

/// One host of a fleet. Run it with [`Processor::run`] or [`Processor::start`].
pub struct Processor {
    pub(super) host: HostName,
    pub(super) group: GroupName,
    pub(super) store: Arc<dyn LeaseStore>,
    pub(super) stats: Arc<crate::lease::StoreStats>,
    pub(super) source: Arc<dyn FeedSource>,
    pub(super) handler: Arc<dyn Handler>,
    pub(super) dead_letter: Option<Arc<dyn DeadLetterSink>>,
    pub(super) strategy: Arc<dyn BalanceStrategy>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) rng: SmallRng,
    pub(super) settings: Arc<Settings>,
    pub(super) hooks: hooks::Hooks,
    /// The program's notifications and start-position choice.
    pub(super) callbacks: Arc<Callbacks>,
    /// What [`HealthProbe`] reads; the host and its heartbeat task write it.
    pub(super) health: Arc<HealthCell>,
    /// The lease tables shared with other hosts of this process, if any.
    pub(super) share: Option<TableShare>,
}

impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("host", &self.host)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Processor {
    /// A builder with default settings.
    pub fn builder() -> ProcessorBuilder {
        ProcessorBuilder::default()
    }

    /// This host's name.
    pub fn host(&self) -> &HostName {
        &self.host
    }

    /// Reads this host's [`Health`] once it runs: for a program that runs the processor with
    /// [`Processor::run`] and serves probes itself. [`ProcessorHandle::health`] gives the same.
    pub fn health_probe(&self) -> HealthProbe {
        HealthProbe(self.health.clone())
    }

    /// Spawns the processor on the current tokio runtime.
    pub fn start(self) -> ProcessorHandle {
        let cancel = CancellationToken::new();
        let stats = self.stats.clone();
        let health = self.health_probe();
        let task = tokio::spawn(self.run(cancel.clone()));
        ProcessorHandle {
            cancel,
            task,
            stats,
            health,
        }
    }

    /// Runs until `cancel` is cancelled (then stops gracefully) or a fatal error. Dropping the
    /// future drops every task of the processor with it.
    ///
    /// # Errors
    /// [`ProcessorError::DuplicateHost`] if another live process has this host name;
    /// [`ProcessorError::Superseded`] if the heartbeat row was taken over while running;
    /// [`ProcessorError::Store`] if registration failed.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), ProcessorError> {
        let span = tracing::info_span!("host", host = %self.host, group = %self.group);
        // However the run ends (stopped, failed, or its future dropped), its health says so.
        let _ended = EndGuard(self.health.clone());
        async move {
            let incarnation = format!("{:016x}", self.rng.gen::<u64>());
            // The first row already carries the host's capacity and limits, so that no host
            // plans this one without them.
            let report = super::load::LoadBook::new(&self.settings)
                .report(self.clock.now())
                .to_json();
            let Some(row) = heartbeat::register(
                self.store.as_ref(),
                self.clock.as_ref(),
                &self.group,
                &self.host,
                &incarnation,
                self.settings.lease_expiry,
                self.settings.renew_interval,
                &report,
                &cancel,
            )
            .await?
            else {
                return Ok(());
            };
            info!(%incarnation, "host registered");
            Host::new(self).run(cancel, row).await
        }
        .instrument(span)
        .await
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::lease::MemoryLeaseStore;
    use crate::processor::handler_fn;
    use crate::source::MemoryFeed;

    /// A table share serves one group: a host of another group is refused, naming the group
    /// the share serves, since a host fast-forwards to the newest table of its share.
    #[test]
    fn a_table_share_serves_one_group_and_refuses_a_host_of_another_by_name() {
        let share = TableShare::new();
        let store = MemoryLeaseStore::new();
        let feed = MemoryFeed::new(1);
        let host = |group: &str| {
            Processor::builder()
                .host("a")
                .group(group)
                .store(Arc::new(store.clone()))
                .source(Arc::new(feed.clone()))
                .handler(handler_fn(|_, _| async { Ok(()) }))
                .share_tables(share.clone())
                .build()
        };
        assert!(
            host("g").is_ok(),
            "the first host binds the share to its group"
        );
        assert!(host("g").is_ok(), "another host of the group shares it");
        let err = host("other").expect_err("a host of another group is refused");
        assert!(
            matches!(&err, ConfigError::Invalid { setting: "share_tables", rule } if rule.contains("group g")),
            "{err}"
        );
    }
}
