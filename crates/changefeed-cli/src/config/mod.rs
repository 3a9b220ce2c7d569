//! Configuration of `changefeed run`: flags, `CHANGEFEED_*` environment variables and an
//! optional TOML file, merged and validated into the library's [`Settings`].
//!
//! Precedence is flags > environment > file > defaults. Clap reads the flag or, failing that,
//! its environment variable; the file fills what both left unset; the library's defaults fill
//! the rest. Every value is parsed here with an error naming the setting (by its file key, which
//! is also the library's name for it), and the assembled [`Settings`] go through the library's
//! own [`Settings::validate`], whose [`changefeed::processor::ConfigError`] already names the
//! setting and the rule. Any such error is a [`UsageError`] (exit code 2).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use changefeed::model::Position;
use changefeed::processor::{CheckpointMode, ConfigError, Settings};
use changefeed_kinesis::ReadOptions;

use crate::url::BackendUrl;

mod strategy;
pub(crate) use crate::usage::{parse_duration, UsageError};
pub use strategy::Strategy;

/// How logs are written to standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = UsageError;
    fn from_str(s: &str) -> Result<Self, UsageError> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(UsageError(format!(
                "log_format: \"{}\" must be text or json",
                other.escape_debug()
            ))),
        }
    }
}

/// Arguments of `changefeed run`. Every setting is also read from `CHANGEFEED_<NAME>` and from
/// the `--config` file (key = the setting's snake_case name).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunArgs {
    /// A TOML file of settings (keys as below in snake_case, e.g. `lease_expiry = "10s"`).
    #[arg(long, value_name = "FILE", env = "CHANGEFEED_CONFIG")]
    pub config: Option<PathBuf>,
    /// The lease store, e.g. sqlite://leases.db or postgres://USER@HOST/DB?prefix=P.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_STORE")]
    pub store: Option<String>,
    /// The feed source, e.g. sqlite://feed.db or postgres-outbox://USER@HOST/DB?prefix=P.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_SOURCE")]
    pub source: Option<String>,
    /// The handler command, run with `sh -c` once per batch; the batch arrives on its stdin as
    /// JSON lines. Exit 0 = done (checkpoint); anything else = retried with backoff.
    #[arg(long, value_name = "CMD", env = "CHANGEFEED_HANDLER")]
    pub handler: Option<String>,
    /// This host's name, unique in the group. Default: the machine's hostname and the pid.
    #[arg(long, value_name = "NAME", env = "CHANGEFEED_HOST")]
    pub host: Option<String>,
    /// The group: the hosts sharing this feed. Default `default`.
    #[arg(long, value_name = "NAME", env = "CHANGEFEED_GROUP")]
    pub group: Option<String>,
    /// Where new leases start: beginning, now, at:MILLIS. Default beginning.
    #[arg(long, value_name = "POSITION", env = "CHANGEFEED_START_POSITION")]
    pub start_position: Option<String>,
    /// How long a silent host's heartbeat takes to expire. Default 10s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_LEASE_EXPIRY")]
    pub lease_expiry: Option<String>,
    /// How often this host writes its heartbeat. Default 2s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_RENEW_INTERVAL")]
    pub renew_interval: Option<String>,
    /// Fencing margin below lease_expiry. Default 2s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_SAFETY_MARGIN")]
    pub safety_margin: Option<String>,
    /// How often this host balances. Default 2s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_ACQUIRE_INTERVAL")]
    pub acquire_interval: Option<String>,
    /// How long to wait for a hand-off before taking the lease. Default 10s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_HANDOFF_TIMEOUT")]
    pub handoff_timeout: Option<String>,
    /// Most records per batch. Default 1000.
    #[arg(long, value_name = "N", env = "CHANGEFEED_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<String>,
    /// Wait before reading an idle partition again. Default 500ms.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_POLL_DELAY")]
    pub poll_delay: Option<String>,
    /// How often the leader lists partitions and creates missing leases. Default 60s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_SYNC_INTERVAL")]
    pub sync_interval: Option<String>,
    /// How long a finished lease waits, once all its children started, before deletion.
    /// Default 5m.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_CLEANUP_DELAY")]
    pub cleanup_delay: Option<String>,
    /// Failures of one batch before the lease is released for another host. Default 5.
    #[arg(long, value_name = "N", env = "CHANGEFEED_HANDLER_MAX_RETRIES")]
    pub handler_max_retries: Option<String>,
    /// Longest a handler command may run; then its process group is killed and the batch
    /// counts as failed. Default none.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_HANDLER_TIMEOUT")]
    pub handler_timeout: Option<String>,
    /// How long a graceful stop may take in all; the batch in flight gets half of it, then its
    /// command is killed. At most lease_expiry. Default 5s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout: Option<String>,
    /// How long this host may stay fenced or unregistered (cut off from its store) before it
    /// reports itself unhealthy: /healthz answers 503, an error is logged. At least
    /// lease_expiry. Default 3 × lease_expiry.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_MAX_UNHEALTHY")]
    pub max_unhealthy: Option<String>,
    /// How long to keep retrying, at start, a store or source that cannot be reached (does not
    /// resolve, refuses connections, times out) before exiting with 75; 0 = do not retry.
    /// A store or source that refuses us (authentication, unknown database …) exits with 78 at
    /// once. Default 60s.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_START_TIMEOUT")]
    pub start_timeout: Option<String>,
    /// Failures of one batch (across hosts) before it goes to --dead-letter-command and the
    /// partition moves past it. Default none: a failing batch is never skipped.
    #[arg(long, value_name = "N", env = "CHANGEFEED_DEAD_LETTER_AFTER")]
    pub dead_letter_after: Option<String>,
    /// The command that stores a dead letter, run with `sh -c`; the letter arrives on its stdin
    /// as one JSON object. Exit 0 = stored. Needs --dead-letter-after.
    #[arg(long, value_name = "CMD", env = "CHANGEFEED_DEAD_LETTER_COMMAND")]
    pub dead_letter_command: Option<String>,
    /// Handler commands run at once per partition, each with one key's records of the batch
    /// in order; the batch is checkpointed once every key is done. Needs --protocol batch.
    /// Default 1 (the whole batch in one command).
    #[arg(long, value_name = "N", env = "CHANGEFEED_KEY_CONCURRENCY")]
    pub key_concurrency: Option<String>,
    /// When to checkpoint: every-batch or interval:DURATION. Default every-batch.
    #[arg(long, value_name = "MODE", env = "CHANGEFEED_CHECKPOINT")]
    pub checkpoint: Option<String>,
    /// The fewest leases each host should hold; when there are too few for every host's
    /// minimum, hosts fill up to it one after another. Give every host of the group the same
    /// value. Default 0 (none).
    #[arg(long, value_name = "N", env = "CHANGEFEED_MIN_LEASES")]
    pub min_leases: Option<String>,
    /// The most leases each host may hold; leases beyond every host's maximum stay unread.
    /// Give every host of the group the same value. Default none.
    #[arg(long, value_name = "N", env = "CHANGEFEED_MAX_LEASES")]
    pub max_leases: Option<String>,
    /// This host's capacity weight, published with its heartbeat for balancing by measured
    /// load: how much load it takes relative to the others. Default its available cores.
    #[arg(long, value_name = "WEIGHT", env = "CHANGEFEED_CAPACITY")]
    pub capacity: Option<String>,
    /// Also publish each held partition's measured load (records/s, bytes/s, handler busy
    /// time) with the heartbeat: true or false. Default false (about 45 bytes per partition
    /// in the heartbeat row).
    #[arg(long, value_name = "BOOL", env = "CHANGEFEED_PUBLISH_LOAD", num_args = 0..=1, default_missing_value = "true")]
    pub publish_load: Option<String>,
    /// How the group's hosts balance: equal (the same number of leases per host, within
    /// min/max leases) or load (measured load against each host's capacity; publishes loads).
    /// Give every host of the group the same. Default equal.
    #[arg(long, value_name = "equal|load", env = "CHANGEFEED_STRATEGY")]
    pub strategy: Option<String>,
    /// The idle tick: when a partition has had no records for this long, run the handler
    /// command with an empty batch (empty stdin), for time-window flushes. Default none.
    #[arg(long, value_name = "DURATION", env = "CHANGEFEED_MAX_WAIT_TIME")]
    pub max_wait_time: Option<String>,
    /// Also publish each partition's lag (changefeed_partition_lag_records and
    /// changefeed_partition_lag_seconds, labels group and partition): true or false. Default
    /// false.
    #[arg(long, value_name = "BOOL", env = "CHANGEFEED_LAG_PER_PARTITION", num_args = 0..=1, default_missing_value = "true")]
    pub lag_per_partition: Option<String>,
    /// Serve HTTP at ADDR, e.g. 127.0.0.1:9898: Prometheus metrics at /metrics, /healthz (200
    /// while the host is healthy; 503 with the reason once it has been fenced or unregistered
    /// for longer than max_unhealthy) and /readyz (200 when registered, heartbeat fresh and not
    /// fenced; 503 with the reason otherwise).
    #[arg(long, value_name = "ADDR", env = "CHANGEFEED_HTTP")]
    pub http: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (the same endpoints as --http, which it
    /// predates).
    #[arg(long, value_name = "ADDR", env = "CHANGEFEED_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Log format on stderr: text or json (filter with RUST_LOG; default info).
    #[arg(long, value_name = "FORMAT", env = "CHANGEFEED_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// How the handler runs: batch (a fresh `sh -c` per batch, the default), lines (one
    /// long-lived process per partition, framed JSON lines) or kcl (one long-lived child per
    /// lease speaking the KCL MultiLangDaemon protocol). See docs/operations.md.
    #[arg(long, value_name = "PROTOCOL", env = "CHANGEFEED_PROTOCOL")]
    pub protocol: Option<String>,
    /// Kinesis source only: deliver the user records of a KPL-aggregated record even when one
    /// of them has a hash key outside its shard (a producer with a stale shard map), instead of
    /// dropping the aggregated record whole as the KCL does: true or false. Default false.
    #[arg(long, value_name = "BOOL", env = "CHANGEFEED_KINESIS_DELIVER_OUTSIDE_SHARD", num_args = 0..=1, default_missing_value = "true")]
    pub kinesis_deliver_outside_shard: Option<String>,
    /// Kinesis source only: how it reads, polling (GetRecords) or fanout (enhanced fan-out,
    /// SubscribeToShard, through a stream consumer named after the group; fanout:NAME names
    /// it). Wins over the source URL's retrieval= and a properties file's retrievalMode.
    /// Default: the URL's, else polling.
    #[arg(long, value_name = "MODE", env = "CHANGEFEED_KINESIS_RETRIEVAL")]
    pub kinesis_retrieval: Option<String>,
    /// A KCL MultiLangDaemon properties file (executableName, streamName, applicationName,
    /// initialPositionInStream, endpoints, regionName …) to take the handler, source, store and
    /// group from; implies --protocol kcl. Flags and variables win over it.
    #[arg(long, value_name = "FILE", env = "CHANGEFEED_PROPERTIES")]
    pub properties: Option<PathBuf>,
}

/// How `run` talks to the handler command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// A fresh `sh -c CMD` per batch, the batch on its stdin ([`changefeed_exec::batch`]).
    #[default]
    Batch,
    /// One long-lived process per partition, framed JSON lines ([`changefeed_exec::lines`]).
    Lines,
    /// One long-lived child per lease, the KCL MultiLangDaemon protocol ([`changefeed_exec::kcl`]).
    Kcl,
}

/// The file keys, in the order of [`RunArgs`].
const KEYS: &[&str] = &[
    "store",
    "source",
    "handler",
    "host",
    "group",
    "start_position",
    "lease_expiry",
    "renew_interval",
    "safety_margin",
    "acquire_interval",
    "handoff_timeout",
    "max_batch_size",
    "poll_delay",
    "sync_interval",
    "cleanup_delay",
    "handler_max_retries",
    "handler_timeout",
    "shutdown_timeout",
    "max_unhealthy",
    "start_timeout",
    "dead_letter_after",
    "dead_letter_command",
    "key_concurrency",
    "checkpoint",
    "min_leases",
    "max_leases",
    "capacity",
    "publish_load",
    "strategy",
    "max_wait_time",
    "lag_per_partition",
    "http",
    "metrics_addr",
    "log_format",
    "protocol",
    "kinesis_deliver_outside_shard",
    "kinesis_retrieval",
];

/// A fully resolved and validated `run` configuration.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The lease store.
    pub store: BackendUrl,
    /// The feed source.
    pub source: BackendUrl,
    /// The handler command (or `internal:NAME`).
    pub handler: String,
    /// This host's name.
    pub host: String,
    /// The group.
    pub group: String,
    /// The library settings, validated.
    pub settings: Settings,
    /// Where to serve the HTTP endpoints (`--http`, then `--metrics-addr`), without repeats.
    pub http_addrs: Vec<SocketAddr>,
    /// The log format.
    pub log_format: LogFormat,
    /// The dead-letter command, set exactly when `settings.dead_letter_after` is.
    pub dead_letter_command: Option<String>,
    /// How the handler command is run.
    pub protocol: Protocol,
    /// Handler calls at once per partition, split by key (`key_concurrency`); 1 by default.
    pub key_concurrency: usize,
    /// How the hosts balance (`strategy`).
    pub strategy: Strategy,
    /// How a Kinesis source reads (`kinesis_deliver_outside_shard`); the defaults otherwise.
    pub kinesis: ReadOptions,
    /// How long transient faults opening the store and the source are retried at start
    /// (`start_timeout`); zero: not at all.
    pub start_timeout: Duration,
    /// What the KCL properties file held that is not used, logged at start.
    pub(crate) property_notes: crate::properties::Notes,
}

/// The default `start_timeout`.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(60);

impl RunArgs {
    fn field(&mut self, key: &str) -> Option<&mut Option<String>> {
        Some(match key {
            "store" => &mut self.store,
            "source" => &mut self.source,
            "handler" => &mut self.handler,
            "host" => &mut self.host,
            "group" => &mut self.group,
            "start_position" => &mut self.start_position,
            "lease_expiry" => &mut self.lease_expiry,
            "renew_interval" => &mut self.renew_interval,
            "safety_margin" => &mut self.safety_margin,
            "acquire_interval" => &mut self.acquire_interval,
            "handoff_timeout" => &mut self.handoff_timeout,
            "max_batch_size" => &mut self.max_batch_size,
            "poll_delay" => &mut self.poll_delay,
            "sync_interval" => &mut self.sync_interval,
            "cleanup_delay" => &mut self.cleanup_delay,
            "handler_max_retries" => &mut self.handler_max_retries,
            "handler_timeout" => &mut self.handler_timeout,
            "shutdown_timeout" => &mut self.shutdown_timeout,
            "max_unhealthy" => &mut self.max_unhealthy,
            "start_timeout" => &mut self.start_timeout,
            "dead_letter_after" => &mut self.dead_letter_after,
            "dead_letter_command" => &mut self.dead_letter_command,
            "key_concurrency" => &mut self.key_concurrency,
            "checkpoint" => &mut self.checkpoint,
            "min_leases" => &mut self.min_leases,
            "max_leases" => &mut self.max_leases,
            "capacity" => &mut self.capacity,
            "publish_load" => &mut self.publish_load,
            "strategy" => &mut self.strategy,
            "max_wait_time" => &mut self.max_wait_time,
            "lag_per_partition" => &mut self.lag_per_partition,
            "http" => &mut self.http,
            "metrics_addr" => &mut self.metrics_addr,
            "log_format" => &mut self.log_format,
            "protocol" => &mut self.protocol,
            "kinesis_deliver_outside_shard" => &mut self.kinesis_deliver_outside_shard,
            "kinesis_retrieval" => &mut self.kinesis_retrieval,
            _ => return None,
        })
    }

    /// Fills the settings flags and environment left unset from the TOML text `file`.
    ///
    /// # Errors
    /// [`UsageError`] for invalid TOML, an unknown key, or a value that is not a string,
    /// integer or boolean.
    pub fn merge_file(&mut self, name: &str, file: &str) -> Result<(), UsageError> {
        let table: BTreeMap<String, toml::Value> =
            toml::from_str(file).map_err(|e| UsageError(format!("config file {name}: {e}")))?;
        for (key, value) in table {
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(UsageError(format!(
                        "config file {name}: {key}: expected a string or a number, got {}",
                        other.type_str()
                    )))
                }
            };
            let Some(slot) = self.field(&key) else {
                return Err(UsageError(format!(
                    "config file {name}: unknown setting \"{}\" (known: {})",
                    key.escape_debug(),
                    KEYS.join(", ")
                )));
            };
            if slot.is_none() {
                *slot = Some(text);
            }
        }
        Ok(())
    }

    /// Fills the settings that flags and the environment left unset from a KCL properties
    /// file, and returns what to report of the keys it did not use.
    pub(crate) fn fill_from(
        &mut self,
        file: crate::properties::Properties,
    ) -> crate::properties::Notes {
        fn fill(slot: &mut Option<String>, value: Option<String>) {
            if slot.is_none() {
                *slot = value;
            }
        }
        self.source = Some(file.source(self.source.take()));
        self.store = Some(file.store(self.store.take()));
        fill(&mut self.handler, Some(file.handler));
        fill(&mut self.group, Some(file.application));
        fill(&mut self.start_position, file.start_position);
        fill(&mut self.poll_delay, file.poll_delay);
        fill(&mut self.lease_expiry, file.lease_expiry);
        fill(&mut self.sync_interval, file.sync_interval);
        fill(&mut self.max_batch_size, file.max_batch_size);
        fill(&mut self.host, file.host);
        file.notes
    }

    /// Reads the `--config` file (if any), then parses and validates every setting.
    ///
    /// # Errors
    /// [`UsageError`] naming the first bad setting.
    pub fn resolve(mut self) -> Result<RunConfig, UsageError> {
        let mut property_notes = crate::properties::Notes::default();
        if let Some(path) = self.properties.clone() {
            let name = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| UsageError(format!("properties file {name}: {e}")))?;
            property_notes = self.fill_from(crate::properties::read(&name, &text)?);
        }
        if let Some(path) = self.config.clone() {
            let name = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| UsageError(format!("config file {name}: {e}")))?;
            self.merge_file(&name, &text)?;
        }
        let protocol = self.protocol_setting()?;
        let required = |v: Option<String>, key: &str, flag: &str| {
            v.ok_or_else(|| {
                UsageError(format!(
                    "{key} is required: pass --{flag}, set CHANGEFEED_{}, or set {key} in --config",
                    key.to_uppercase()
                ))
            })
        };
        let store = BackendUrl::store("store", &required(self.store, "store", "store")?)?;
        let mut source = BackendUrl::source("source", &required(self.source, "source", "source")?)?;
        let handler = required(self.handler, "handler", "handler")?;
        if handler.trim().is_empty() {
            return Err(UsageError("handler: must not be empty".into()));
        }
        let mut settings = Settings::default();
        if let Some(v) = &self.start_position {
            settings.start_position = parse_position(v)?;
        }
        for (key, value, slot) in [
            (
                "lease_expiry",
                &self.lease_expiry,
                &mut settings.lease_expiry,
            ),
            (
                "renew_interval",
                &self.renew_interval,
                &mut settings.renew_interval,
            ),
            (
                "safety_margin",
                &self.safety_margin,
                &mut settings.safety_margin,
            ),
            (
                "acquire_interval",
                &self.acquire_interval,
                &mut settings.acquire_interval,
            ),
            (
                "handoff_timeout",
                &self.handoff_timeout,
                &mut settings.handoff_timeout,
            ),
            ("poll_delay", &self.poll_delay, &mut settings.poll_delay),
            (
                "sync_interval",
                &self.sync_interval,
                &mut settings.sync_interval,
            ),
            (
                "cleanup_delay",
                &self.cleanup_delay,
                &mut settings.cleanup_delay,
            ),
            (
                "shutdown_timeout",
                &self.shutdown_timeout,
                &mut settings.shutdown_timeout,
            ),
        ] {
            if let Some(v) = value {
                *slot = parse_duration(key, v)?;
            }
        }
        if let Some(v) = &self.max_batch_size {
            settings.max_batch_size = parse_number("max_batch_size", v)?;
        }
        if let Some(v) = &self.handler_max_retries {
            settings.handler_max_retries = parse_number("handler_max_retries", v)?;
        }
        if let Some(v) = &self.checkpoint {
            settings.checkpoint_mode = parse_checkpoint(v)?;
        }
        if protocol == Protocol::Kcl {
            if self.checkpoint.is_some() {
                return Err(UsageError(
                    "checkpoint: the kcl protocol checkpoints where the record processor asks; leave checkpoint unset".into(),
                ));
            }
            settings.checkpoint_mode = CheckpointMode::Manual;
        }
        if let Some(v) = &self.min_leases {
            settings.min_leases = parse_number("min_leases", v)?;
        }
        if let Some(v) = &self.max_leases {
            settings.max_leases = Some(parse_number("max_leases", v)?);
        }
        if let Some(v) = &self.capacity {
            let weight = v.trim().parse::<f64>().map_err(|_| {
                UsageError(format!(
                    "capacity: {v:?} is not a number (a weight, e.g. 2 or 0.5)"
                ))
            })?;
            settings.capacity = Some(weight);
        }
        if let Some(v) = &self.publish_load {
            settings.publish_load = parse_bool("publish_load", v)?;
        }
        if let Some(v) = &self.handler_timeout {
            settings.handler_timeout = Some(parse_duration("handler_timeout", v)?);
        }
        if let Some(v) = &self.max_wait_time {
            settings.max_wait_time = Some(parse_duration("max_wait_time", v)?);
        }
        if let Some(v) = &self.max_unhealthy {
            settings.max_unhealthy = Some(parse_duration("max_unhealthy", v)?);
        }
        // Not a library setting: zero is allowed (fail at once).
        let start_timeout = match &self.start_timeout {
            Some(v) => parse_duration("start_timeout", v)?,
            None => DEFAULT_START_TIMEOUT,
        };
        if let Some(v) = &self.lag_per_partition {
            settings.lag_per_partition = parse_bool("lag_per_partition", v)?;
        }
        if let Some(v) = &self.dead_letter_after {
            settings.dead_letter_after = Some(parse_number("dead_letter_after", v)?);
        }
        let strategy = strategy::resolve(self.strategy.as_deref(), &mut settings)?;
        let key_concurrency = match &self.key_concurrency {
            Some(v) => parse_number("key_concurrency", v)?,
            None => 1,
        };
        if key_concurrency > 1 && protocol == Protocol::Kcl {
            return Err(UsageError(format!(
                "key_concurrency: {key_concurrency} needs --protocol batch or lines: a KCL \
                 record processor serves its whole shard in order"
            )));
        }
        let dead_letter_command = self.dead_letter_command.clone();
        match (&settings.dead_letter_after, &dead_letter_command) {
            (Some(_), None) => {
                return Err(UsageError(
                    "dead_letter_after: --dead-letter-after needs --dead-letter-command (CHANGEFEED_DEAD_LETTER_COMMAND, dead_letter_command in --config), the command that stores a dead letter".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(UsageError(
                    "dead_letter_command: --dead-letter-command needs --dead-letter-after N (CHANGEFEED_DEAD_LETTER_AFTER, dead_letter_after in --config), the failures before a batch is dead-lettered".into(),
                ))
            }
            (Some(_), Some(c)) if c.trim().is_empty() => {
                return Err(UsageError("dead_letter_command: must not be empty".into()))
            }
            _ => {}
        }
        // A short lease expiry given alone would leave the default margin above it: scale the
        // margin down with it, as the operator evidently wants fast failover.
        if self.safety_margin.is_none() && settings.safety_margin >= settings.lease_expiry {
            settings.safety_margin = settings.lease_expiry / 5;
        }
        // An explicit shutdown_timeout is checked as given; only the default follows below.
        if self.shutdown_timeout.is_some() && settings.shutdown_timeout > settings.lease_expiry {
            return Err(UsageError(format!(
                "shutdown_timeout: {:?} must not exceed lease_expiry ({:?}): a stopping host would hold its leases longer than a dead one",
                settings.shutdown_timeout, settings.lease_expiry
            )));
        }
        // Likewise the default graceful stop: it may not outlast a short lease.
        settings.shutdown_timeout = settings.shutdown_timeout.min(settings.lease_expiry);
        settings.validate().map_err(|e| match e {
            // The library's name for it; the flag and file key are `checkpoint`.
            ConfigError::Invalid {
                setting: "checkpoint_mode",
                rule,
            } => UsageError(format!("checkpoint: {rule}")),
            other => UsageError(other.to_string()),
        })?;
        let mut http_addrs: Vec<SocketAddr> = Vec::new();
        for (key, value) in [("http", &self.http), ("metrics_addr", &self.metrics_addr)] {
            let Some(v) = value.as_deref() else {
                continue;
            };
            let addr = v.parse::<SocketAddr>().map_err(|e| {
                UsageError(format!(
                    "{key}: \"{}\" is not HOST:PORT, e.g. 127.0.0.1:9898 ({e})",
                    v.escape_debug()
                ))
            })?;
            if !http_addrs.contains(&addr) {
                http_addrs.push(addr);
            }
        }
        let log_format = self
            .log_format
            .as_deref()
            .map(str::parse)
            .transpose()?
            .unwrap_or_default();
        let mut kinesis = ReadOptions::default();
        if let Some(v) = &self.kinesis_deliver_outside_shard {
            kinesis.deliver_outside_shard = parse_bool("kinesis_deliver_outside_shard", v)?;
            if kinesis.deliver_outside_shard && !matches!(source, BackendUrl::Kinesis(_)) {
                return Err(UsageError(
                    "kinesis_deliver_outside_shard: only a kinesis:// source reads KPL-aggregated records; the source is not one".into(),
                ));
            }
        }
        let group = self.group.unwrap_or_else(|| "default".into());
        if let Some(v) = &self.kinesis_retrieval {
            let BackendUrl::Kinesis(aws) = &mut source else {
                return Err(UsageError(
                    "kinesis_retrieval: only a kinesis:// source reads by polling or fan-out; the source is not one".into(),
                ));
            };
            aws.retrieval = kinesis_retrieval(v, &group)?;
        }
        let host = match self.host {
            Some(h) => h,
            None => default_host(),
        };
        Ok(RunConfig {
            property_notes,
            store,
            source,
            handler,
            host,
            group,
            settings,
            http_addrs,
            log_format,
            dead_letter_command,
            protocol,
            key_concurrency,
            strategy,
            kinesis,
            start_timeout,
        })
    }

    /// The `protocol` setting: given, or kcl with a properties file, or batch.
    fn protocol_setting(&self) -> Result<Protocol, UsageError> {
        let protocol = match self.protocol.as_deref().map(str::trim) {
            None if self.properties.is_some() => Protocol::Kcl,
            None | Some("batch") => Protocol::Batch,
            Some("lines") => Protocol::Lines,
            Some("kcl") => Protocol::Kcl,
            Some(other) => {
                return Err(UsageError(format!(
                    "protocol: \"{}\" must be batch, lines or kcl",
                    other.escape_debug()
                )))
            }
        };
        if self.properties.is_some() && protocol != Protocol::Kcl {
            return Err(UsageError(
                "properties: a KCL properties file runs the kcl protocol; drop --protocol or pass --protocol kcl".into(),
            ));
        }
        Ok(protocol)
    }
}

/// The machine's hostname and this process's id: unique per process on a machine.
fn default_host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("{name}-{}", std::process::id())
}

fn parse_number<T: std::str::FromStr>(setting: &str, value: &str) -> Result<T, UsageError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse().map_err(|e| {
        UsageError(format!(
            "{setting}: \"{}\" is not a whole number ({e})",
            value.escape_debug()
        ))
    })
}

fn parse_bool(setting: &str, value: &str) -> Result<bool, UsageError> {
    match value.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(UsageError(format!(
            "{setting}: \"{}\" is not true or false",
            other.escape_debug()
        ))),
    }
}

fn parse_position(value: &str) -> Result<Position, UsageError> {
    let pos: Position = value
        .parse()
        .map_err(|e| UsageError(format!("start_position: {e}")))?;
    match pos {
        Position::Continuation(_) => Err(UsageError(
            "start_position: must be beginning, now or at:MILLIS (a continuation belongs to one partition; use `changefeed reset`)".into(),
        )),
        p => Ok(p),
    }
}

fn parse_checkpoint(value: &str) -> Result<CheckpointMode, UsageError> {
    match value.trim() {
        "every-batch" => Ok(CheckpointMode::EveryBatch),
        "manual" => Err(UsageError(
            "checkpoint: manual is not available to an external handler command; use every-batch or interval:DURATION".into(),
        )),
        v => match v.strip_prefix("interval:") {
            Some(d) => Ok(CheckpointMode::Interval(parse_duration("checkpoint", d)?)),
            None => Err(UsageError(format!(
                "checkpoint: \"{}\" must be every-batch or interval:DURATION",
                v.escape_debug()
            ))),
        },
    }
}

#[cfg(test)]
mod tests;

/// The `kinesis_retrieval` setting: polling, fanout (a consumer named after `group`) or
/// fanout:NAME.
fn kinesis_retrieval(v: &str, group: &str) -> Result<changefeed_kinesis::Retrieval, UsageError> {
    let fanout = |name: &str| {
        if crate::url::consumer_name_ok(name) {
            Ok(changefeed_kinesis::Retrieval::FanOut {
                consumer_name: name.to_string(),
            })
        } else {
            Err(UsageError(format!(
                "kinesis_retrieval: the consumer name \"{}\" must be 1 to 128 characters of A-Z, a-z, 0-9, '_', '-' and '.'{}",
                name.escape_debug(),
                if name == group { " (it is the group's name: give one with fanout:NAME)" } else { "" }
            )))
        }
    };
    match v.split_once(':') {
        None if v == "polling" => Ok(changefeed_kinesis::Retrieval::Polling),
        None if v == "fanout" => fanout(group),
        Some(("fanout", name)) => fanout(name),
        _ => Err(UsageError(format!(
            "kinesis_retrieval: \"{}\" must be polling, fanout or fanout:CONSUMER",
            v.escape_debug()
        ))),
    }
}
