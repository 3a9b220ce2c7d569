//! The per-batch protocol (`changefeed run`'s default), like the KCL's multi-language daemon:
//! each batch is piped to a fresh `sh -c CMD` as JSON lines,
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
//! [`GroupGuard`]: the whole group gets SIGTERM at once and SIGKILL [`KILL_GRACE`] (2 s) later if
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

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use changefeed::model::{Batch, PartitionId, Record};
use changefeed::processor::{Context, DeadLetter, DeadLetterSink, Handler, HandlerError};
use serde::Serialize;
use tokio::io::AsyncWriteExt as _;
use tokio_util::sync::CancellationToken;

#[cfg(doc)]
use crate::groups::{GroupGuard, KILL_GRACE};
use crate::groups::{ProcessGroups, Running};

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
#[derive(Debug, Serialize)]
pub struct RecordLine<'a> {
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
    /// `r` of `partition`, as a handler reads it.
    #[must_use]
    pub fn new(partition: &'a PartitionId, r: &'a Record) -> Self {
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
pub struct CommandHandler {
    command: String,
    group: String,
    groups: ProcessGroups,
}

impl CommandHandler {
    /// Runs `command` with `sh -c` per batch, for group `group`, its processes in `groups`.
    #[must_use]
    pub fn new(command: String, group: String, groups: ProcessGroups) -> Self {
        Self {
            command,
            group,
            groups,
        }
    }
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
pub struct CommandDeadLetters {
    command: String,
    groups: ProcessGroups,
    /// The host's stop: once cancelled, a letter still being written gets `grace` more.
    stop: CancellationToken,
    grace: Duration,
    /// `handler_timeout`, which bounds a dead-letter command too.
    timeout: Option<Duration>,
}

impl CommandDeadLetters {
    /// Runs `command` with `sh -c` per letter, its processes in `groups`; a letter still being
    /// written `grace` after `stop` is cancelled, or running longer than `timeout`, fails.
    #[must_use]
    pub fn new(
        command: String,
        groups: ProcessGroups,
        stop: CancellationToken,
        grace: Duration,
        timeout: Option<Duration>,
    ) -> Self {
        Self {
            command,
            groups,
            stop,
            grace,
            timeout,
        }
    }
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
#[path = "batch_tests.rs"]
mod tests;
