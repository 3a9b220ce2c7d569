//! Telemetry of the `changefeed` process: the log subscriber and the Prometheus exporter.
//!
//! The library only emits through the `tracing` and `metrics` facades; this module is where the
//! binary installs what receives them. Logs go to standard error, filtered by `RUST_LOG`
//! (default `info`), as text or JSON lines. Metrics are recorded for Prometheus when `--http`
//! or `--metrics-addr` is given, and served at `http://ADDR/metrics` by [`crate::http`];
//! `docs/metrics.md` lists them.

use std::io::IsTerminal as _;

use anyhow::Context as _;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global log subscriber (once per process; later calls do nothing).
pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // `try_init` fails only if a subscriber is already installed, which is fine.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Installs the Prometheus recorder as the process's metrics recorder and returns the handle
/// that renders a scrape (its upkeep is the caller's: [`PrometheusHandle::run_upkeep`] every
/// few seconds).
///
/// # Errors
/// If a recorder is already installed.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    describe();
    Ok(handle)
}

/// Registers the help text of the library's metrics (see `docs/metrics.md`); each shows up in
/// the scrape from its first event.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "changefeed_batches_total",
        "Batches the handler accepted, by group."
    );
    describe_counter!(
        "changefeed_records_total",
        "Records in batches the handler accepted, by group."
    );
    describe_counter!(
        "changefeed_handler_errors_total",
        "Handler calls that failed (the batch is retried), by group."
    );
    describe_counter!(
        "changefeed_source_errors_total",
        "Feed source reads or opens that failed, by group."
    );
    describe_counter!(
        "changefeed_leases_taken_total",
        "Free or expired leases this host took, by group."
    );
    describe_counter!(
        "changefeed_leases_stolen_total",
        "Leases this host took from a live owner after an unhonoured hand-off, by group."
    );
    describe_counter!(
        "changefeed_leases_lost_total",
        "Leases this host's workers found owned by someone else, by group."
    );
    describe_counter!(
        "changefeed_handoffs_requested_total",
        "Hand-off requests this host wrote, by group."
    );
    describe_counter!(
        "changefeed_handoffs_given_total",
        "Leases this host handed to the host that asked, by group."
    );
    describe_counter!(
        "changefeed_fenced_total",
        "Times this host fenced itself because its heartbeat stopped succeeding."
    );
    describe_counter!(
        "changefeed_store_reads_total",
        "Lease store reads, by operation."
    );
    describe_counter!(
        "changefeed_store_lease_rows_read_total",
        "Lease rows returned by store reads, by operation."
    );
    describe_counter!(
        "changefeed_store_heartbeat_rows_read_total",
        "Heartbeat rows returned by membership reads."
    );
    describe_counter!(
        "changefeed_store_writes_total",
        "Lease store writes, by operation."
    );
    describe_gauge!(
        "changefeed_leases_owned",
        "Leases this host owns now, by group."
    );
    describe_gauge!(
        "changefeed_malformed_leases",
        "Unreadable lease rows in the last listing, by group."
    );
    describe_gauge!(
        "changefeed_unhealthy_since_seconds",
        "When this host's unbroken spell of being fenced or unregistered began (Unix seconds), once it has lasted longer than max_unhealthy; 0 while healthy."
    );
    describe_histogram!(
        "changefeed_checkpoint_seconds",
        Unit::Seconds,
        "Time to write one checkpoint."
    );
}
