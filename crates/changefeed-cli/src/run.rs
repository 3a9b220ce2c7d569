//! `changefeed run`: one host of a fleet, with an external command as the handler.
//!
//! Like KCL's multi-language daemon: each batch is piped to a fresh `sh -c CMD` as JSON lines,
//! one object per record:
//!
//! ```json
//! {"partition":"3","key":"order-17","data":"created","continuation":"3:42","timestamp":1700000000000}
//! ```
//!
//! `data` is the payload as a string when it is valid UTF-8; otherwise the object has
//! `data_b64` (standard base64, with padding) instead. `timestamp` is milliseconds since the
//! epoch by the source's clock, or null. The command also gets `CHANGEFEED_GROUP`,
//! `CHANGEFEED_HOST` and `CHANGEFEED_PARTITION` in its environment. Exit status 0 means the
//! batch is done and may be checkpointed; any other status (or death by a signal) means nothing
//! of it is done: the library retries it with backoff and never skips it.
//!
//! This module owns the process shell around the library's [`Processor`]: configuration,
//! telemetry and the signals (SIGINT/SIGTERM stop gracefully: a second one exits at once).
//! Lease creation, lineage and cleanup are the library's (its leader's partition sync). Exit
//! codes: 0 after a graceful stop, 1 on an operational error, 2 on a usage error.

use std::process::{ExitCode, Stdio};
use std::sync::Arc;

use anyhow::Context as _;
use async_trait::async_trait;
use base64::Engine as _;
use changefeed::model::{Batch, PartitionId};
use changefeed::processor::{Context, Handler, HandlerError, Processor};
use serde::Serialize;
use tokio::io::AsyncWriteExt as _;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{RunArgs, RunConfig, UsageError, USAGE_EXIT};
use crate::url::BackendUrl;

/// Handler names that select a built-in handler instead of a command.
const INTERNAL_PREFIX: &str = "internal:";

/// Runs one host until SIGINT/SIGTERM (exit 0) or a fatal error (exit 1).
pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let config = match args.resolve() {
        Ok(c) => c,
        Err(err) => return Ok(usage(&err)),
    };
    crate::metrics::init_logging(config.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run_host(config))
}

/// Prints a usage error and returns exit code 2.
pub(crate) fn usage(err: &UsageError) -> ExitCode {
    eprintln!("error: {err}");
    ExitCode::from(USAGE_EXIT)
}

async fn run_host(config: RunConfig) -> anyhow::Result<ExitCode> {
    if let Some(addr) = config.metrics_addr {
        crate::metrics::serve(addr)?;
    }
    let store = config.store.open_store().await?;
    let source = config.source.open_source().await?;
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
        None => Arc::new(CommandHandler {
            command: config.handler.clone(),
            group: config.group.clone(),
        }),
    };
    let processor = match Processor::builder()
        .host(config.host.clone())
        .group(config.group.clone())
        .store(store.clone())
        .source(source.clone())
        .shared_handler(handler)
        .settings(config.settings.clone())
        .build()
    {
        Ok(p) => p,
        Err(err) => return Ok(usage(&UsageError(err.to_string()))),
    };
    let cancel = CancellationToken::new();
    tokio::spawn(stop_on_signal(cancel.clone()));
    info!(host = %config.host, group = %config.group, "starting");
    let outcome = processor.run(cancel.clone()).await;
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

/// Cancels `cancel` on the first SIGINT or SIGTERM; exits the process at once on a second.
async fn stop_on_signal(cancel: CancellationToken) {
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
    cancel.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    warn!("second signal: exiting without releasing leases");
    std::process::exit(1);
}

/// One record as a JSON line on the handler's stdin.
#[derive(Serialize)]
struct RecordLine<'a> {
    partition: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_b64: Option<String>,
    continuation: &'a str,
    timestamp: Option<i64>,
}

/// Encodes a batch as JSON lines, as the handler command reads it.
pub fn encode_batch(partition: &PartitionId, batch: &Batch) -> Vec<u8> {
    let mut out = Vec::new();
    for r in &batch.records {
        let text = std::str::from_utf8(&r.data).ok();
        let line = RecordLine {
            partition: partition.as_str(),
            key: &r.key,
            data: text,
            data_b64: match text {
                Some(_) => None,
                None => Some(base64::engine::general_purpose::STANDARD.encode(&r.data)),
            },
            continuation: r.continuation.as_str(),
            timestamp: r.timestamp.map(|t| t.millis()),
        };
        // Serialising plain strings and numbers into a Vec cannot fail.
        if serde_json::to_writer(&mut out, &line).is_ok() {
            out.push(b'\n');
        }
    }
    out
}

/// The external-command handler: `sh -c CMD` per batch, the batch on its stdin.
#[derive(Debug)]
struct CommandHandler {
    command: String,
    group: String,
}

#[async_trait]
impl Handler for CommandHandler {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        if batch.records.is_empty() {
            return Ok(());
        }
        let input = encode_batch(ctx.partition(), batch);
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .env("CHANGEFEED_GROUP", &self.group)
            .env("CHANGEFEED_HOST", ctx.host().as_str())
            .env("CHANGEFEED_PARTITION", ctx.partition().as_str())
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            // A batch abandoned on stop or lease loss must not leave its command running.
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting handler command `{}`: {e}", self.command))?;
        if let Some(mut stdin) = child.stdin.take() {
            match stdin.write_all(&input).await {
                // A command may exit without reading all of its input; its status decides.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(format!("writing the batch to the handler command: {e}").into())
                }
                _ => {}
            }
            drop(stdin);
        }
        let status = child
            .wait()
            .await
            .map_err(|e| format!("waiting for the handler command: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "handler command `{}` {status} for {} records of partition {}",
                self.command,
                batch.records.len(),
                ctx.partition()
            )
            .into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use changefeed::model::{Continuation, Record, Timestamp};

    #[test]
    fn records_are_json_lines_with_text_or_base64_data() {
        // The handler protocol: one object per record; data as text when UTF-8, else data_b64.
        let p = PartitionId::new("3").expect("valid");
        let batch = Batch {
            records: vec![
                Record {
                    key: "k".into(),
                    data: Bytes::from_static(b"hello"),
                    continuation: Continuation::new("3:1"),
                    timestamp: Some(Timestamp(5)),
                },
                Record {
                    key: "k".into(),
                    data: Bytes::from_static(&[0xff, 0x00]),
                    continuation: Continuation::new("3:2"),
                    timestamp: None,
                },
            ],
            continuation: Some(Continuation::new("3:2")),
            end_of_partition: false,
        };
        let text = String::from_utf8(encode_batch(&p, &batch)).expect("utf-8");
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(
            lines[0],
            serde_json::json!({"partition":"3","key":"k","data":"hello","continuation":"3:1","timestamp":5})
        );
        assert_eq!(
            lines[1],
            serde_json::json!({"partition":"3","key":"k","data_b64":"/wA=","continuation":"3:2","timestamp":null})
        );
    }
}
