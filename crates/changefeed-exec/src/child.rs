//! Long-lived handler processes: one per owned partition, speaking JSON lines over their
//! stdin and stdout (`run --protocol lines` and `run --protocol kcl`).
//!
//! The per-batch rules of [`crate::batch`] hold for these processes too: each runs in a process
//! group of its own, registered in the host's [`ProcessGroups`], so a second signal or the
//! host's exit kills it; the [`GroupGuard`] that owns the group travels with the
//! [`LongLived`] value, so a call the library cuts short (fence, lease lost, timeout, stop
//! deadline) drops the process with the call's future and the whole group gets SIGTERM, then
//! SIGKILL after the kill grace. Nothing of a partition's process outlives its tenure.
//!
//! Between calls a partition's process waits in [`Slots`]; a call takes it out and puts it
//! back only when the exchange ended cleanly, so a process that died, spoke out of turn or was
//! cut short is never reused: the next call starts a fresh one (the library's retry backoff
//! sits in between, and after `handler_max_retries` failures the lease is released).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use changefeed::model::PartitionId;
use changefeed::processor::HandlerError;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::ChildStdout;

use crate::groups::{GroupGuard, ProcessGroups, Running};

/// A handler process that lives as long as this host owns its partition.
#[derive(Debug)]
pub(crate) struct LongLived {
    child: tokio::process::Child,
    guard: GroupGuard,
    stdout: Lines<BufReader<ChildStdout>>,
    /// The command, for error messages.
    command: String,
    partition: PartitionId,
}

impl LongLived {
    /// Starts `sh -c command` for `partition` in a process group of its own, stdin and stdout
    /// piped, stderr inherited.
    pub(crate) fn spawn(
        groups: &ProcessGroups,
        command: &str,
        partition: &PartitionId,
        env: &[(&str, String)],
    ) -> Result<Self, HandlerError> {
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(command)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let Running { mut child, guard } = groups.spawn(&mut cmd).map_err(|e| {
            format!("starting handler process `{command}` for partition {partition}: {e}")
        })?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| format!("handler process `{command}` has no stdout pipe"))?;
        Ok(LongLived {
            child,
            guard,
            stdout: BufReader::new(stdout).lines(),
            command: command.to_string(),
            partition: partition.clone(),
        })
    }

    /// Writes `line` and a newline to the process's stdin.
    pub(crate) async fn send(&mut self, line: &[u8]) -> Result<(), HandlerError> {
        let Some(stdin) = self.guard.stdin.as_mut() else {
            return Err(self.failed("has no stdin").into());
        };
        // One write per message: the line and its newline together.
        let mut framed = Vec::with_capacity(line.len() + 1);
        framed.extend_from_slice(line);
        framed.push(b'\n');
        let written = async {
            stdin.write_all(&framed).await?;
            stdin.flush().await
        }
        .await;
        match written {
            Ok(()) => Ok(()),
            Err(e) => Err(self.died(&format!("writing to it: {e}")).await.into()),
        }
    }

    /// Reads the process's next line that is not blank (the KCL's client libraries write a
    /// newline before each message).
    pub(crate) async fn recv(&mut self) -> Result<String, HandlerError> {
        loop {
            match self.stdout.next_line().await {
                Ok(Some(line)) if line.trim().is_empty() => continue,
                Ok(Some(line)) => return Ok(line),
                Ok(None) => return Err(self.died("closed its stdout").await.into()),
                Err(e) => return Err(self.died(&format!("reading from it: {e}")).await.into()),
            }
        }
    }

    /// Closes stdin (the process's signal to exit), waits up to `grace` for it to exit, then
    /// drops it: whatever is left of its group gets SIGTERM, then SIGKILL.
    pub(crate) async fn finish(mut self, grace: Duration) {
        self.guard.stdin = None;
        let _ = tokio::time::timeout(grace, self.child.wait()).await;
    }

    /// An error naming the process and partition.
    pub(crate) fn failed(&self, what: &str) -> String {
        format!(
            "handler process `{}` for partition {} {what}",
            self.command, self.partition
        )
    }

    /// The error for a process whose pipe broke: with its exit status if it has exited (or
    /// does within a moment, as a process that closed its pipes is about to).
    async fn died(&mut self, what: &str) -> String {
        match tokio::time::timeout(Duration::from_millis(500), self.child.wait()).await {
            Ok(Ok(status)) => self.failed(&format!("{what} ({status})")),
            _ => self.failed(what),
        }
    }
}

/// The processes of the partitions this host owns, waiting between calls. A call takes a
/// process out and puts it back when done. Calls on one partition overlap only with key
/// concurrency (the `lines` runner's), and then each call holds a process of its own, so a
/// partition has as many processes as calls ever ran on it at once.
#[derive(Debug)]
pub(crate) struct Slots<T>(Mutex<HashMap<PartitionId, Vec<T>>>);

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots(Mutex::new(HashMap::new()))
    }
}

impl<T> Slots<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PartitionId, Vec<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes one of `partition`'s waiting processes, if there is one.
    pub(crate) fn take(&self, partition: &PartitionId) -> Option<T> {
        let mut slots = self.lock();
        let waiting = slots.get_mut(partition)?;
        let one = waiting.pop();
        if waiting.is_empty() {
            slots.remove(partition);
        }
        one
    }

    /// Takes every waiting process of `partition`.
    pub(crate) fn take_all(&self, partition: &PartitionId) -> Vec<T> {
        self.lock().remove(partition).unwrap_or_default()
    }

    /// Puts a process of `partition` back after a clean exchange.
    pub(crate) fn put(&self, partition: &PartitionId, value: T) {
        self.lock()
            .entry(partition.clone())
            .or_default()
            .push(value);
    }
}
