//! Processor settings and their validation.

use std::time::Duration;

use crate::balance::LeaseLimits;
use crate::lineage::MissingParents;
use crate::model::Position;

/// When the worker writes a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointMode {
    /// After every batch the handler accepted (the default).
    EveryBatch,
    /// After a batch the handler accepted, at most once per interval (fewer store writes on hot
    /// partitions; on stop or hand-off the pending position is always written).
    Interval(Duration),
    /// Only when the handler calls [`super::Context::checkpoint`].
    Manual,
}

/// Timing and batching settings of a processor. Built by [`super::ProcessorBuilder`], which
/// validates them with [`Settings::validate`].
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where a new lease without a checkpoint starts. Default [`Position::Beginning`].
    pub start_position: Position,
    /// How long a host's heartbeat must stay unchanged, on an observer's own clock, before the
    /// observer judges the host dead and takes its leases. Default 10 s.
    pub lease_expiry: Duration,
    /// How often a host writes its heartbeat. Default 3 s, as the KCL's lease renewal (a third
    /// of its 10 s failover time): one write per host per interval is most of an idle fleet's
    /// store bill. A try that fails is followed half an interval later.
    pub renew_interval: Duration,
    /// A host whose last successful heartbeat was sent `lease_expiry − safety_margin` ago stops
    /// its workers (fencing). Covers clock-rate drift and store latency. Default 2 s.
    pub safety_margin: Duration,
    /// How often a host reads membership and balances. Default 2 s.
    pub acquire_interval: Duration,
    /// A host checks its lease table at least this often, even when the change counter did
    /// not move: a safety net against a store that lost a counter bump. On a store that
    /// answers [`crate::lease::LeaseStore::list_changes`] the check reads the rows whose
    /// change stamp is past the table's counter (none in steady state); on one that cannot,
    /// it lists every lease. Default 5 min.
    pub full_list_interval: Duration,
    /// Most records per batch. Default 1000.
    pub max_batch_size: usize,
    /// Wait before reading an idle partition again. Default 500 ms.
    pub poll_delay: Duration,
    /// How long an asker waits for a hand-off before taking the lease (a steal). Default 10 s.
    ///
    /// The owner's workers deliver only while the host has confirmed, within
    /// `handoff_timeout − safety_margin`, that no request is pending (each acquire cycle does,
    /// or the worker reads its lease row), so a steal never overlaps a delivery of an owner
    /// that could not see the request. Must exceed `safety_margin + acquire_interval`.
    pub handoff_timeout: Duration,
    /// When checkpoints are written. Default [`CheckpointMode::EveryBatch`].
    pub checkpoint_mode: CheckpointMode,
    /// How many times a failing batch is retried before the lease is released. Default 5.
    ///
    /// The failures are counted in the lease's properties (`changefeed.failures`), so the host
    /// that takes the lease next waits out the backoff they earned instead of starting over.
    pub handler_max_retries: u32,
    /// Longest a handler call may run (optional). A call that runs longer is cancelled (its
    /// future dropped, [`super::Context::cancelled`] signalled) and counts as a failure,
    /// retried with backoff. Default none: a call runs until it ends, the fence rises or the
    /// stop deadline passes.
    pub handler_timeout: Option<Duration>,
    /// How long a graceful stop may take in all. The batch in flight may run for the first
    /// half; then it is cancelled, every lease is released at its last checkpoint and the
    /// heartbeat row is removed. Default 5 s; at most `lease_expiry`.
    pub shutdown_timeout: Duration,
    /// After this many failures of one batch (counted across hosts), hand it to the
    /// dead-letter sink and checkpoint past it (optional; needs
    /// [`super::ProcessorBuilder::dead_letter`]). Default none: a failing batch is never
    /// skipped.
    pub dead_letter_after: Option<u32>,
    /// First backoff after a source, store or handler error; doubles up to `max_backoff`.
    /// Default 100 ms.
    pub min_backoff: Duration,
    /// Longest backoff. Default 10 s.
    pub max_backoff: Duration,
    /// How often the leader lists the source's partitions and creates missing leases (KCL's
    /// shard sync). The leader also syncs once when it starts leading. Default 60 s.
    pub sync_interval: Duration,
    /// Whether the leader deletes finished leases once every child has started (design rule
    /// 5). Default on.
    pub cleanup: bool,
    /// How long a finished lease must have been deletable, on the leader's clock, before it
    /// is deleted. Default 5 min (KCL's completed-lease cleanup interval).
    pub cleanup_delay: Duration,
    /// How a parent the source no longer lists is read. Default
    /// [`MissingParents::Finished`] (trimmed by retention).
    pub missing_parents: MissingParents,
    /// The fewest eligible leases this host should hold (Cosmos's
    /// `MinPartitionCount`). Default 0: no minimum.
    ///
    /// When the leases do not cover every host's minimum, hosts fill up to it one after
    /// another (those holding most first) and the rest hold nothing, instead of every host
    /// holding a share below the minimum. Applies to the default strategy
    /// ([`EqualShare`](crate::balance::EqualShare), see its "Limits"). They are this host's
    /// own: it publishes them with its heartbeat, and every host plans every host with the
    /// limits that host publishes, so hosts of one group may differ.
    pub min_leases: usize,
    /// The most eligible leases this host may hold (Cosmos's
    /// `MaxPartitionCount`, KCL's `maxLeasesForWorker`). Default none.
    ///
    /// A host at its maximum takes no more, and what it cannot hold is spread over the others.
    /// A host above it hands the excess to hosts that ask, and releases what nobody asks for.
    /// When every host is at its maximum, the remaining leases stay free, and their
    /// partitions unread, until a host joins. At least 1 and at least `min_leases`; this
    /// host's own, published as `min_leases` is.
    pub max_leases: Option<usize>,
    /// An idle tick (optional): when a partition has had no records for this long, its handler
    /// is called with an empty batch, and again after each further such wait, for time-window
    /// flushes and liveness checks (Event Hubs' `MaximumWaitTime`). An idle call is delivered
    /// like a batch (fenced, retried when it fails, never dead-lettered) and moves no
    /// checkpoint. Measured from the last call, on the host's clock; the wait is at least
    /// `poll_delay`. Default none: the handler is only called with records.
    pub max_wait_time: Option<Duration>,
    /// Whether to publish the lag of each partition this host reads as well
    /// (`changefeed_partition_lag_records` and `changefeed_partition_lag_seconds`, labels
    /// `group` and `partition`), beside the group totals. Default off: one series per
    /// partition may be many.
    pub lag_per_partition: bool,
    /// How long this host may stay fenced or unregistered, without a break, before it says it
    /// is unhealthy ([`super::Health::unhealthy`], an error log, the gauge
    /// `changefeed_unhealthy_since_seconds`; `changefeed run`'s `/healthz` then answers 503):
    /// its recovery has failed, and a restart is the remedy left. A host cut off from its store
    /// fences itself and recovers by itself once the store answers again; one still fenced or
    /// unregistered after this long is not recovering. Default none: 3 × `lease_expiry`
    /// ([`Settings::unhealthy_after`]). At least `lease_expiry`.
    pub max_unhealthy: Option<Duration>,
    /// This host's capacity weight, published with its heartbeat for strategies that balance
    /// measured load: how much load it should carry relative to the others. Default none: the
    /// cores this process may use. Above 0 and finite.
    pub capacity: Option<f64>,
    /// Whether the heartbeat also publishes the load measured on each lease this host holds
    /// (records/s, bytes/s, handler busy time per second, moving averages over about 30 s),
    /// for strategies that balance measured load. Default off: the row then carries the
    /// capacity and limits only (a few bytes); with loads it grows by about 45 bytes per lease
    /// held, which DynamoDB bills by the KB ([`crate::model::HostReport`]).
    pub publish_load: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            start_position: Position::Beginning,
            lease_expiry: Duration::from_secs(10),
            renew_interval: Duration::from_secs(3),
            safety_margin: Duration::from_secs(2),
            acquire_interval: Duration::from_secs(2),
            full_list_interval: Duration::from_secs(300),
            max_batch_size: 1000,
            poll_delay: Duration::from_millis(500),
            handoff_timeout: Duration::from_secs(10),
            checkpoint_mode: CheckpointMode::EveryBatch,
            handler_max_retries: 5,
            handler_timeout: None,
            shutdown_timeout: Duration::from_secs(5),
            dead_letter_after: None,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            sync_interval: Duration::from_secs(60),
            cleanup: true,
            cleanup_delay: Duration::from_secs(300),
            missing_parents: MissingParents::Finished,
            min_leases: 0,
            max_leases: None,
            max_wait_time: None,
            lag_per_partition: false,
            max_unhealthy: None,
            capacity: None,
            publish_load: false,
        }
    }
}

/// A setting that breaks a rule, or a missing part. The message names the setting and the rule.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting breaks a rule.
    #[error("{setting}: {rule}")]
    Invalid {
        /// The setting's name, as the builder method is called.
        setting: &'static str,
        /// The rule, with the values involved.
        rule: String,
    },
    /// A required part was not given.
    #[error("{0} is required: call ProcessorBuilder::{0}")]
    Missing(&'static str),
}

/// Largest accepted `max_batch_size`.
pub const MAX_BATCH_LIMIT: usize = 1_000_000;

/// Longest accepted duration of any setting: 365 days. Longer ones would overflow the
/// monotonic clock's arithmetic and mean nothing in practice.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

impl Settings {
    /// Checks every rule, returning the first broken one.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting, for example
    /// `renew_interval: 15s must be below lease_expiry − safety_margin (8s)`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |setting, rule: String| Err(ConfigError::Invalid { setting, rule });
        let mut positive = vec![
            ("lease_expiry", self.lease_expiry),
            ("renew_interval", self.renew_interval),
            ("safety_margin", self.safety_margin),
            ("shutdown_timeout", self.shutdown_timeout),
            ("cleanup_delay", self.cleanup_delay),
            ("acquire_interval", self.acquire_interval),
            ("full_list_interval", self.full_list_interval),
            ("poll_delay", self.poll_delay),
            ("handoff_timeout", self.handoff_timeout),
            ("min_backoff", self.min_backoff),
            ("max_backoff", self.max_backoff),
            ("sync_interval", self.sync_interval),
        ];
        if let Some(d) = self.handler_timeout {
            positive.push(("handler_timeout", d));
        }
        if let Some(d) = self.max_wait_time {
            positive.push(("max_wait_time", d));
        }
        if let Some(d) = self.max_unhealthy {
            positive.push(("max_unhealthy", d));
        }
        if let CheckpointMode::Interval(d) = self.checkpoint_mode {
            positive.push(("checkpoint_mode", d));
        }
        for (setting, value) in positive {
            if value.is_zero() {
                return bad(setting, "must be greater than zero".into());
            }
            if value > MAX_DURATION {
                return bad(
                    setting,
                    format!("{value:?} is longer than the longest accepted duration, 365 days"),
                );
            }
        }
        // Sums below cannot overflow: every term is at most MAX_DURATION.
        if self.safety_margin >= self.lease_expiry {
            return bad(
                "safety_margin",
                format!(
                    "{:?} must be below lease_expiry ({:?})",
                    self.safety_margin, self.lease_expiry
                ),
            );
        }
        if let Some(c) = self.capacity.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return bad(
                "capacity",
                format!("{c} must be above 0 and finite: it weighs this host against the others"),
            );
        }
        let fence_after = self.lease_expiry - self.safety_margin;
        if self.renew_interval >= fence_after {
            return bad(
                "renew_interval",
                format!(
                    "{:?} must be below lease_expiry − safety_margin ({:?}), or the host fences itself between heartbeats",
                    self.renew_interval, fence_after
                ),
            );
        }
        if self.handoff_timeout <= self.safety_margin + self.acquire_interval {
            return bad(
                "handoff_timeout",
                format!(
                    "{:?} must exceed safety_margin + acquire_interval ({:?}): an owner confirms once per acquire cycle that it knows of every hand-off request",
                    self.handoff_timeout,
                    self.safety_margin + self.acquire_interval
                ),
            );
        }
        if self.sync_interval < self.acquire_interval {
            return bad(
                "sync_interval",
                format!(
                    "{:?} must be at least acquire_interval ({:?}): the sync runs in the acquire cycle",
                    self.sync_interval, self.acquire_interval
                ),
            );
        }
        if self.max_batch_size == 0 || self.max_batch_size > MAX_BATCH_LIMIT {
            return bad(
                "max_batch_size",
                format!(
                    "{} must be between 1 and {MAX_BATCH_LIMIT}",
                    self.max_batch_size
                ),
            );
        }
        if self.shutdown_timeout > self.lease_expiry {
            return bad(
                "shutdown_timeout",
                format!(
                    "{:?} must not exceed lease_expiry ({:?}): a stopping host would hold its leases longer than a dead one",
                    self.shutdown_timeout, self.lease_expiry
                ),
            );
        }
        if self.dead_letter_after == Some(0) {
            return bad(
                "dead_letter_after",
                "must be at least 1 (the number of failures before a batch is dead-lettered)"
                    .into(),
            );
        }
        if let Some(d) = self.max_unhealthy {
            if d < self.lease_expiry {
                return bad(
                    "max_unhealthy",
                    format!(
                        "{d:?} must be at least lease_expiry ({:?}): a store outage that short is one a host rides out by itself (it fences, then renews or registers again), so calling it unhealthy would only restart it for every brief outage",
                        self.lease_expiry
                    ),
                );
            }
        }
        self.lease_limits()?;
        if self.min_backoff > self.max_backoff {
            return bad(
                "min_backoff",
                format!(
                    "{:?} must not exceed max_backoff ({:?})",
                    self.min_backoff, self.max_backoff
                ),
            );
        }
        Ok(())
    }

    /// `min_leases` and `max_leases` as the default strategy's limits.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `max_leases` if it is 0, or `min_leases` if it exceeds
    /// `max_leases`.
    pub fn lease_limits(&self) -> Result<LeaseLimits, ConfigError> {
        LeaseLimits::new(self.min_leases, self.max_leases).map_err(|e| ConfigError::Invalid {
            setting: e.setting,
            rule: e.rule,
        })
    }

    /// How long after its last successful heartbeat was sent a host fences itself.
    pub fn fence_after(&self) -> Duration {
        self.lease_expiry.saturating_sub(self.safety_margin)
    }

    /// How long the processor waits for any one store or source call before giving it up as
    /// failed (a retryable error its caller handles as any other): `lease_expiry −
    /// safety_margin`. Not a setting of its own: no answer later than that is of use, since a
    /// host whose heartbeat had waited as long would have fenced itself and every read it made
    /// is stale. It keeps a client that can hang a call for ever (a connection to a vanished
    /// peer, with no timeout of its own) from stalling the host loop or a worker for ever. The
    /// heartbeat's renewals have a shorter bound, `min(safety_margin, renew_interval)`.
    pub fn call_timeout(&self) -> Duration {
        self.fence_after()
    }

    /// How long this host may stay fenced or unregistered before it is unhealthy:
    /// `max_unhealthy`, or 3 × `lease_expiry` when that is not set.
    pub fn unhealthy_after(&self) -> Duration {
        self.max_unhealthy
            .unwrap_or_else(|| self.lease_expiry.saturating_mul(3))
    }

    /// How long the batch in flight may still run once a graceful stop has begun: half the
    /// shutdown timeout, leaving the other half to release the leases and remove the heartbeat.
    pub fn stop_grace(&self) -> Duration {
        self.shutdown_timeout / 2
    }
}
