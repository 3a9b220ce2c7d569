//! Telemetry of the `changefeed` process: the log subscriber and the Prometheus exporter.
//!
//! The library only emits through the `tracing` and `metrics` facades; this module is where the
//! binary installs what receives them. Logs go to standard error, filtered by `RUST_LOG`
//! (default `info`), as text or JSON lines. Metrics are recorded for Prometheus when `--http`
//! or `--metrics-addr` is given, and served at `http://ADDR/metrics` by `changefeed_http`;
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
    changefeed::processor::describe_metrics();
    Ok(handle)
}
