//! `changefeed run`: one host of a fleet, with an external command as the handler.
//!
//! Each batch goes to the handler command by one of `changefeed_exec`'s protocols
//! (`--protocol batch|lines|kcl`: [`changefeed_exec::batch`], [`changefeed_exec::lines`],
//! [`changefeed_exec::kcl`]), each command in a process group of its own
//! ([`changefeed_exec::groups`]).
//!
//! With `--http ADDR` the host serves `/metrics`, `/healthz` and `/readyz` ([`changefeed_http`]);
//! `/readyz` is 503 while the host is not ready (not registered yet, fenced, stopping), and
//! `/healthz` once it has stayed fenced or unregistered for longer than `max_unhealthy`.
//!
//! At start the store and the source are opened within `start_timeout` ([`crate::start`]):
//! faults that may pass (a name that does not resolve, a refused connection, a timeout) are
//! retried with backoff until then, and the host exits with 75 if they outlast it; faults that
//! will not pass (authentication refused, an unknown database, a newer schema) exit at once
//! with 78.
//!
//! This module owns the process shell around the library's [`Processor`]: configuration,
//! telemetry, the handler processes and the signals. The first SIGINT/SIGTERM stops
//! gracefully within `shutdown_timeout` (the library's bound; the host then waits for the
//! process groups it signalled, up to the same deadline, and SIGKILLs what is left); a second
//! one SIGKILLs every handler process group at once and exits with 1 without releasing.
//! Lease creation, lineage and cleanup are the library's (its leader's partition sync). Exit
//! codes: 0 after a graceful stop, 1 on an operational error or a second signal, 2 on a usage
//! error, 75 when the store or source stayed unreachable for `start_timeout`, 78 when one of
//! them refused the host at start.
//!
//! In the KCL protocol a `dynamodb-streams://` source without `record=` hands records in the
//! shape of the KCL's DynamoDB Streams adapter (`record=adapter`); otherwise `plain`.

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use anyhow::Context as _;
use changefeed::balance::LoadShare;
use changefeed::processor::{Handler, Processor};
use changefeed_dynamodb::RecordShape;
use changefeed_exec::batch::{CommandDeadLetters, CommandHandler};
use changefeed_exec::groups::{ProcessGroups, KILL_GRACE};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Protocol, RunArgs, RunConfig, Strategy};
use crate::url::BackendUrl;
use crate::usage::{usage, UsageError};

/// Handler names that select a built-in handler instead of a command.
const INTERNAL_PREFIX: &str = "internal:";

/// Runs one host until SIGINT/SIGTERM (exit 0) or a fatal error (exit 1).
pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let config = match args.resolve() {
        Ok(c) => c,
        Err(err) => return Ok(usage(&err)),
    };
    crate::metrics::init_logging(config.log_format);
    config.property_notes.log();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run_host(config))
}

async fn run_host(config: RunConfig) -> anyhow::Result<ExitCode> {
    // Served from before the store is opened (`/readyz` says "starting" until the processor
    // exists) until the process exits.
    let http_stop = CancellationToken::new();
    let endpoints = if config.http_addrs.is_empty() {
        None
    } else {
        let endpoints = changefeed_http::Endpoints::new(crate::metrics::install()?);
        endpoints
            .serve(&config.http_addrs, http_stop.clone())
            .await?;
        Some(endpoints)
    };
    let _stop_http = http_stop.drop_guard();
    let window = crate::start::Window::new(config.start_timeout);
    let store = match crate::start::open("lease store", &config.store.redacted(), window, || {
        config.store.open_store()
    })
    .await
    {
        Ok(store) => store,
        Err(err) => return Ok(err.exit()),
    };
    let source_url = source_url(&config);
    let source = match crate::start::open("feed source", &source_url.redacted(), window, || {
        source_url.open_source_with(&config.kinesis)
    })
    .await
    {
        Ok(source) => source,
        Err(err) => return Ok(err.exit()),
    };
    let groups = ProcessGroups::default();
    let cancel = CancellationToken::new();
    let handler: Arc<dyn Handler> = match config.handler.strip_prefix(INTERNAL_PREFIX) {
        Some("ledger") => match &config.source {
            BackendUrl::Sqlite(path) => {
                Arc::new(crate::demo::LedgerHandler::open(path, &config.host).await?)
            }
            _ => {
                return Ok(usage(&UsageError(format!(
                    "handler: {INTERNAL_PREFIX}ledger is the SQLite demo's handler and needs a sqlite:// source"
                ))))
            }
        },
        Some(other) => {
            return Ok(usage(&UsageError(format!(
                "handler: unknown built-in handler \"{INTERNAL_PREFIX}{}\" (known: {INTERNAL_PREFIX}ledger)",
                other.escape_debug()
            ))))
        }
        None => match config.protocol {
            Protocol::Batch => Arc::new(CommandHandler::new(
                config.handler.clone(),
                config.group.clone(),
                groups.clone(),
            )),
            Protocol::Lines => Arc::new(
                changefeed_exec::lines::LinesHandler::new(
                    config.handler.clone(),
                    config.group.clone(),
                    groups.clone(),
                )
                .key_concurrency(config.key_concurrency),
            ),
            Protocol::Kcl => Arc::new(changefeed_exec::kcl::KclHandler::new(
                config.handler.clone(),
                config.group.clone(),
                groups.clone(),
                store.clone(),
                cancel.clone(),
            )),
        },
    };
    let mut builder = Processor::builder()
        .host(config.host.clone())
        .group(config.group.clone())
        .store(store.clone())
        .source(source.clone())
        .shared_handler(handler)
        .key_concurrency(config.key_concurrency)
        .settings(config.settings.clone());
    if config.strategy == Strategy::Load {
        builder = builder.strategy(Arc::new(LoadShare::default()));
    }
    if let (Some(after), Some(command)) = (
        config.settings.dead_letter_after,
        config.dead_letter_command.clone(),
    ) {
        builder = builder.dead_letter(
            Arc::new(CommandDeadLetters::new(
                command,
                groups.clone(),
                cancel.clone(),
                config.settings.stop_grace(),
                config.settings.handler_timeout,
            )),
            after,
        );
    }
    let processor = match builder.build() {
        Ok(p) => p,
        Err(err) => return Ok(usage(&UsageError(err.to_string()))),
    };
    if let Some(endpoints) = &endpoints {
        endpoints.ready_from(processor.health_probe());
    }
    let stop_requested = Arc::new(OnceLock::new());
    tokio::spawn(stop_on_signal(
        cancel.clone(),
        groups.clone(),
        stop_requested.clone(),
    ));
    info!(host = %config.host, group = %config.group, "starting");
    let outcome = processor.run(cancel.clone()).await;
    // Every call has ended or been dropped by now; wait for the process groups signalled on the
    // way, up to the stop's own deadline, and kill what is left.
    let deadline = match stop_requested.get() {
        Some(at) => (*at + config.settings.shutdown_timeout).max(Instant::now()),
        None => Instant::now() + KILL_GRACE,
    };
    groups.finish(deadline).await;
    match outcome {
        Ok(()) => {
            info!("stopped gracefully");
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            tracing::error!(error = %err, "host stopped on an error");
            eprintln!("error: {err}");
            Ok(ExitCode::from(1))
        }
    }
}

/// The source to open: as configured, except that a DynamoDB Streams source without its own
/// `record=` gives the KCL protocol the adapter's typed records, the shape a record processor
/// written for the KCL's DynamoDB Streams adapter parses, so that it runs unchanged.
fn source_url(config: &RunConfig) -> BackendUrl {
    let mut url = config.source.clone();
    if let (Protocol::Kcl, BackendUrl::DynamodbStreams(aws)) = (&config.protocol, &mut url) {
        let shape = *aws.record.get_or_insert(RecordShape::Adapter);
        info!(
            record = shape.as_str(),
            "DynamoDB Streams records in the KCL protocol"
        );
    }
    url
}

/// Cancels `cancel` on the first SIGINT or SIGTERM (noting when in `requested`); on a second,
/// SIGKILLs every handler process group and exits the process at once with 1.
async fn stop_on_signal(
    cancel: CancellationToken,
    groups: ProcessGroups,
    requested: Arc<OnceLock<Instant>>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot listen for signals; stop with SIGKILL");
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping gracefully"),
        _ = int.recv() => info!("SIGINT: stopping gracefully"),
    }
    let _ = requested.set(Instant::now());
    cancel.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    warn!("second signal: killing the handler commands and exiting without releasing leases");
    groups.kill_all_and_exit(1);
}
