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
//! `CHANGEFEED_HOST`, `CHANGEFEED_PARTITION`, `CHANGEFEED_RECORDS` (how many records the batch
//! has, so that a command can tell a batch cut short) and `CHANGEFEED_FENCING_TOKEN` (the
//! lease's fencing token: the same for this host's whole tenure, greater for every later
//! owner) in its environment. Exit status 0 means the batch is done and may be checkpointed;
//! any other status (or death by a signal) means nothing of it is done: the library retries it
//! with backoff and never skips it.
//!
//! Each command runs in a process group of its own. When the library abandons a call (the host
//! was fenced, the lease lost, `handler_timeout` or the stop's grace passed), the call's future
//! is dropped, and with it the write of the batch into the command's stdin and the
//! `GroupGuard`: the whole group gets SIGTERM at once and SIGKILL `KILL_GRACE` (2 s) later if
//! anything of it is still there. The guard signals the group *before* closing the pipe, so a
//! command cut short dies before it could read an end of input after a partial batch. When a
//! command exits by itself, whatever it left running in its group (a backgrounded grandchild)
//! is signalled the same way. A command that moves its children into other process groups or
//! sessions (`setsid`) takes them out of the host's reach.
//!
//! With `--dead-letter-after N --dead-letter-command CMD`, a batch that failed N times (across
//! hosts) is piped to `sh -c CMD` as one JSON object, the records in an array, each as the
//! handler gets it:
//!
//! ```json
//! {"group":"orders","partition":"3","host":"h1","failures":5,"error":"handler command `…` exit status: 1 …",
//!  "after":"3:40","records":[{"partition":"3","key":"order-17","data":"created","continuation":"3:41","timestamp":1700000000000}]}
//! ```
//!
//! (`after` is the checkpoint the batch follows, or null at the partition's start.) Exit status
//! 0 means the letter is stored and the checkpoint moves past the batch; anything else keeps
//! the batch, which is retried. The dead-letter command runs in a group of its own too, and is
//! cut short (as a failure) by `handler_timeout` or once a stop has waited half of
//! `shutdown_timeout`.
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

use std::collections::HashMap;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use base64::Engine as _;
use changefeed::model::{Batch, PartitionId, Record};
use changefeed::processor::{
    Context, DeadLetter, DeadLetterSink, Handler, HandlerError, Processor,
};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::io::AsyncWriteExt as _;
use tokio::process::ChildStdin;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Protocol, RunArgs, RunConfig, UsageError, USAGE_EXIT};
use crate::url::BackendUrl;

/// Handler names that select a built-in handler instead of a command.
const INTERNAL_PREFIX: &str = "internal:";

/// How long a handler's process group has between SIGTERM and SIGKILL.
pub(crate) const KILL_GRACE: Duration = Duration::from_secs(2);

/// How often a signalled process group is checked for having gone.
const REAP_POLL: Duration = Duration::from_millis(50);

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

/// Prints a usage error and returns exit code 2.
pub(crate) fn usage(err: &UsageError) -> ExitCode {
    eprintln!("error: {err}");
    ExitCode::from(USAGE_EXIT)
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
    let source = match crate::start::open("feed source", &config.source.redacted(), window, || {
        config.source.open_source_with(&config.kinesis)
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
            Protocol::Batch => Arc::new(CommandHandler {
                command: config.handler.clone(),
                group: config.group.clone(),
                groups: groups.clone(),
            }),
            Protocol::Lines => Arc::new(crate::lines::LinesHandler::new(
                config.handler.clone(),
                config.group.clone(),
                groups.clone(),
            )),
            Protocol::Kcl => Arc::new(crate::kcl::KclHandler::new(
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
        .settings(config.settings.clone());
    if let (Some(after), Some(command)) = (
        config.settings.dead_letter_after,
        config.dead_letter_command.clone(),
    ) {
        builder = builder.dead_letter(
            Arc::new(CommandDeadLetters {
                command,
                groups: groups.clone(),
                stop: cancel.clone(),
                grace: config.settings.stop_grace(),
                timeout: config.settings.handler_timeout,
            }),
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

/// The process groups of the commands this host started that may still have processes: shared
/// by the handlers (which add and signal them) and the signal task (which kills them all).
///
/// Each entry carries a generation, so that a group id the kernel reuses for a new command is
/// never signalled on behalf of the old one.
#[derive(Debug, Clone, Default)]
pub(crate) struct ProcessGroups(Arc<Mutex<GroupTable>>);

#[derive(Debug, Default)]
struct GroupTable {
    /// Process group id → generation of the entry.
    live: HashMap<i32, u64>,
    next: u64,
    /// Set once the process is exiting: nothing more may be started.
    closed: bool,
}

impl ProcessGroups {
    fn lock(&self) -> MutexGuard<'_, GroupTable> {
        // A panic elsewhere while holding the lock leaves the table usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `command` as the leader of a new process group and registers the group, holding
    /// the lock across the start so that an exiting host cannot miss it.
    pub(crate) fn spawn(&self, command: &mut tokio::process::Command) -> std::io::Result<Running> {
        let mut table = self.lock();
        if table.closed {
            return Err(std::io::Error::other("the host is exiting"));
        }
        let mut child = command.process_group(0).kill_on_drop(false).spawn()?;
        let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
            return Err(std::io::Error::other("the command has no process id"));
        };
        table.next += 1;
        let generation = table.next;
        table.live.insert(pid, generation);
        let stdin = child.stdin.take();
        Ok(Running {
            child,
            guard: GroupGuard {
                pgid: pid,
                generation,
                groups: self.clone(),
                stdin,
            },
        })
    }

    /// As [`ProcessGroups::spawn`], on the blocking pool: starting a process holds the calling
    /// thread until the child has executed the command (`posix_spawn` waits for the `exec`),
    /// so a host starting a command per batch would otherwise hold a runtime worker for that
    /// long, and its partitions would take turns starting their commands. Dropped before the
    /// start ends, the command is still registered and its group signalled at once (the
    /// [`GroupGuard`] in the dropped result).
    pub(crate) async fn spawn_off_runtime(
        &self,
        mut command: tokio::process::Command,
    ) -> std::io::Result<Running> {
        let groups = self.clone();
        tokio::task::spawn_blocking(move || groups.spawn(&mut command))
            .await
            .map_err(std::io::Error::other)?
    }

    fn is_current(&self, pgid: i32, generation: u64) -> bool {
        self.lock().live.get(&pgid) == Some(&generation)
    }

    fn remove(&self, pgid: i32, generation: u64) {
        let mut table = self.lock();
        if table.live.get(&pgid) == Some(&generation) {
            table.live.remove(&pgid);
        }
    }

    /// Waits until every registered group is gone or `deadline` passes, then SIGKILLs the rest.
    async fn finish(&self, deadline: Instant) {
        for pgid in self.lock().live.keys() {
            let _ = killpg(Pid::from_raw(*pgid), Signal::SIGTERM);
        }
        loop {
            let left: Vec<i32> = self.lock().live.keys().copied().collect();
            let alive = left.iter().filter(|g| group_alive(**g)).count();
            if alive == 0 {
                return;
            }
            if Instant::now() >= deadline {
                warn!(
                    groups = alive,
                    "handler commands still running at exit; killing them"
                );
                let mut table = self.lock();
                table.closed = true;
                for pgid in table.live.keys() {
                    let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
                }
                return;
            }
            tokio::time::sleep(REAP_POLL).await;
        }
    }

    /// SIGKILLs every registered group and exits with `code`, holding the lock so that no
    /// command starts in between.
    fn kill_all_and_exit(&self, code: i32) -> ! {
        let mut table = self.lock();
        table.closed = true;
        for pgid in table.live.keys() {
            let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
        }
        std::process::exit(code);
    }
}

/// Whether process group `pgid` still has a process that is not a zombie. A group whose last
/// members are zombies (children orphaned to an init that does not reap them) counts as gone.
fn group_alive(pgid: i32) -> bool {
    if killpg(Pid::from_raw(pgid), None).is_err() {
        return false;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        // No procfs: the kernel's word is all there is.
        return true;
    };
    entries.flatten().any(|e| {
        let Ok(text) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        // `pid (comm) state ppid pgrp …`; comm may contain spaces and parentheses.
        let Some((_, rest)) = text.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        pgrp == Some(pgid) && state != Some("Z")
    })
}

/// A command just started: its child handle and the guard of its process group.
pub(crate) struct Running {
    pub(crate) child: tokio::process::Child,
    pub(crate) guard: GroupGuard,
}

/// Owns a command's process group and the write end of its stdin. Dropped (the call ended, or
/// its future was dropped), it sends the group SIGTERM, then SIGKILL after [`KILL_GRACE`] from
/// a thread if anything of it is still there; the stdin pipe stays open until then, so a
/// command cut short never reads an end of input after a partial batch.
pub(crate) struct GroupGuard {
    pgid: i32,
    generation: u64,
    groups: ProcessGroups,
    pub(crate) stdin: Option<ChildStdin>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let (pgid, generation) = (self.pgid, self.generation);
        if !self.groups.is_current(pgid, generation)
            || killpg(Pid::from_raw(pgid), Signal::SIGTERM).is_err()
        {
            // The group is gone (ESRCH): nothing of the command is left.
            self.groups.remove(pgid, generation);
            return;
        }
        let stdin = self.stdin.take();
        let groups = self.groups.clone();
        let reaper = move || {
            let _open_until_gone = stdin;
            let polls = KILL_GRACE.as_millis() / REAP_POLL.as_millis();
            for _ in 0..polls {
                if !groups.is_current(pgid, generation) || !group_alive(pgid) {
                    groups.remove(pgid, generation);
                    return;
                }
                std::thread::sleep(REAP_POLL);
            }
            if groups.is_current(pgid, generation) {
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                groups.remove(pgid, generation);
            }
        };
        if std::thread::Builder::new()
            .name("changefeed-reap".into())
            .spawn(reaper)
            .is_err()
        {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            self.groups.remove(pgid, generation);
        }
    }
}

/// Runs `sh -c command` in a process group of its own with `input` on its stdin and `env` in
/// its environment, and returns its exit status. Dropping the future kills the group (see
/// [`GroupGuard`]); nothing of it outlives the call.
async fn run_command(
    groups: &ProcessGroups,
    command: &str,
    env: &[(&str, String)],
    input: &[u8],
) -> Result<ExitStatus, HandlerError> {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    let Running {
        mut child,
        mut guard,
    } = groups
        .spawn_off_runtime(cmd)
        .await
        .map_err(|e| format!("starting command `{command}`: {e}"))?;
    if let Some(stdin) = guard.stdin.as_mut() {
        match stdin.write_all(input).await {
            // A command may exit without reading all of its input; its status decides.
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                return Err(format!("writing to command `{command}`: {e}").into())
            }
            _ => {}
        }
    }
    // The whole input is written: close the pipe, so the command reads its end.
    guard.stdin = None;
    let status = child
        .wait()
        .await
        .map_err(|e| format!("waiting for command `{command}`: {e}"))?;
    // `guard` drops here: whatever the command left running in its group is stopped.
    drop(guard);
    Ok(status)
}

/// One record as a JSON line on the handler's stdin.
#[derive(Serialize)]
pub(crate) struct RecordLine<'a> {
    partition: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_b64: Option<String>,
    continuation: &'a str,
    timestamp: Option<i64>,
}

impl<'a> RecordLine<'a> {
    pub(crate) fn new(partition: &'a PartitionId, r: &'a Record) -> Self {
        let text = std::str::from_utf8(&r.data).ok();
        RecordLine {
            partition: partition.as_str(),
            key: &r.key,
            data: text,
            data_b64: match text {
                Some(_) => None,
                None => Some(base64::engine::general_purpose::STANDARD.encode(&r.data)),
            },
            continuation: r.continuation.as_str(),
            timestamp: r.timestamp.map(|t| t.millis()),
        }
    }
}

/// Encodes a batch as JSON lines, as the handler command reads it.
pub fn encode_batch(partition: &PartitionId, batch: &Batch) -> Vec<u8> {
    let mut out = Vec::new();
    for r in &batch.records {
        // Serialising plain strings and numbers into a Vec cannot fail.
        if serde_json::to_writer(&mut out, &RecordLine::new(partition, r)).is_ok() {
            out.push(b'\n');
        }
    }
    out
}

/// A dead letter as the dead-letter command reads it: one JSON object.
#[derive(Serialize)]
struct LetterJson<'a> {
    group: &'a str,
    partition: &'a str,
    host: &'a str,
    failures: u32,
    error: &'a str,
    after: Option<&'a str>,
    records: Vec<RecordLine<'a>>,
}

/// Encodes a dead letter as one JSON object, its records as the handler gets them.
fn encode_letter(letter: &DeadLetter) -> Result<Vec<u8>, serde_json::Error> {
    let partition = &letter.key.partition;
    let mut out = serde_json::to_vec(&LetterJson {
        group: letter.key.group.as_str(),
        partition: partition.as_str(),
        host: letter.host.as_str(),
        failures: letter.failures,
        error: &letter.error,
        after: letter.after.as_ref().map(|c| c.as_str()),
        records: letter
            .batch
            .records
            .iter()
            .map(|r| RecordLine::new(partition, r))
            .collect(),
    })?;
    out.push(b'\n');
    Ok(out)
}

/// The external-command handler: `sh -c CMD` per batch, the batch on its stdin.
#[derive(Debug)]
struct CommandHandler {
    command: String,
    group: String,
    groups: ProcessGroups,
}

#[async_trait]
impl Handler for CommandHandler {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        if batch.records.is_empty() {
            return Ok(());
        }
        let input = encode_batch(ctx.partition(), batch);
        let env = [
            ("CHANGEFEED_GROUP", self.group.clone()),
            ("CHANGEFEED_HOST", ctx.host().as_str().to_string()),
            ("CHANGEFEED_PARTITION", ctx.partition().as_str().to_string()),
            ("CHANGEFEED_RECORDS", batch.records.len().to_string()),
            ("CHANGEFEED_FENCING_TOKEN", ctx.fencing_token().to_string()),
        ];
        let status = run_command(&self.groups, &self.command, &env, &input).await?;
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

/// The dead-letter sink of `--dead-letter-command`: `sh -c CMD` per letter, the letter on its
/// stdin as one JSON object; exit status 0 = stored.
#[derive(Debug)]
struct CommandDeadLetters {
    command: String,
    groups: ProcessGroups,
    /// The host's stop: once cancelled, a letter still being written gets `grace` more.
    stop: CancellationToken,
    grace: Duration,
    /// `handler_timeout`, which bounds a dead-letter command too.
    timeout: Option<Duration>,
}

#[async_trait]
impl DeadLetterSink for CommandDeadLetters {
    async fn dead_letter(&self, letter: &DeadLetter) -> Result<(), HandlerError> {
        let input = encode_letter(letter).map_err(|e| format!("encoding the dead letter: {e}"))?;
        let env = [
            ("CHANGEFEED_GROUP", letter.key.group.as_str().to_string()),
            ("CHANGEFEED_HOST", letter.host.as_str().to_string()),
            (
                "CHANGEFEED_PARTITION",
                letter.key.partition.as_str().to_string(),
            ),
            ("CHANGEFEED_RECORDS", letter.batch.records.len().to_string()),
        ];
        let run = run_command(&self.groups, &self.command, &env, &input);
        let stopped = async {
            self.stop.cancelled().await;
            tokio::time::sleep(self.grace).await;
        };
        let timed_out = async {
            match self.timeout {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        let status = tokio::select! {
            r = run => r?,
            () = stopped => return Err(format!("dead-letter command `{}` cut short by the stop", self.command).into()),
            () = timed_out => return Err(format!("dead-letter command `{}` ran longer than handler_timeout", self.command).into()),
        };
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "dead-letter command `{}` {status} for {} records of partition {}",
                self.command,
                letter.batch.records.len(),
                letter.key.partition
            )
            .into())
        }
    }
}

#[cfg(test)]
mod tests;
