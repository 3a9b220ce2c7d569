//! The `lines` protocol (`changefeed run --protocol lines`): one long-lived handler process per owned partition,
//! framed JSON lines both ways (see `docs/operations.md`, "Long-lived handlers").
//!
//! The host writes one line per batch, `{"records":[…]}`, each record as the per-batch
//! protocol writes it ([`crate::batch::RecordLine`]). The process answers with lines of its own:
//!
//! - `{"ack":"C"}`: every record up to and including continuation `C` is done. When `C` is the
//!   batch's last record the batch is done (checkpointed as `--checkpoint` says); when it is an
//!   earlier one, the checkpoint is written at `C` and the batch counts as failed, so it is
//!   delivered again after the backoff (at least once).
//! - `{"checkpoint":"C"}`: write the checkpoint at `C` (a record of the batch) now. The host
//!   replies `{"checkpointed":"C"}`, or `{"checkpointed":"C","error":"…"}` if it could not
//!   (the lease is lost, the store failed, `C` is not in the batch).
//! - `{"error":"…"}`: nothing more of the batch is done: it is retried with backoff.
//!
//! Anything else is a named error that fails the batch; the process is then replaced, as is
//! one that exits or closes its stdout. Stdin closing is the process's signal to exit.
//!
//! With key concurrency ([`LinesHandler::key_concurrency`]) a partition runs up to N such
//! processes, and each batch line holds the records of one key. The host then owns the
//! checkpoint, which must not pass a record of another key not yet done: a `checkpoint`
//! request is answered with an error, and an ack short of the line's last record fails the
//! line without a checkpoint, so its records are delivered again.

use async_trait::async_trait;
use changefeed::model::{Batch, Continuation};
use changefeed::processor::{CloseReason, Context, Handler, HandlerError};
use serde::{Deserialize, Serialize};

use crate::batch::RecordLine;
use crate::child::{LongLived, Slots};
use crate::groups::{ProcessGroups, KILL_GRACE};

/// The long-lived JSON-lines handler.
#[derive(Debug)]
pub struct LinesHandler {
    command: String,
    group: String,
    groups: ProcessGroups,
    slots: Slots<LongLived>,
    /// Whether calls on one partition run side by side, one key each: then only the host
    /// moves the checkpoint.
    keyed: bool,
}

/// A batch as the process reads it.
#[derive(Serialize)]
struct BatchLine<'a> {
    records: Vec<RecordLine<'a>>,
}

/// A message from the process: exactly one of the fields.
#[derive(Deserialize, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
enum Reply {
    #[serde(rename = "ack")]
    Ack(String),
    #[serde(rename = "checkpoint")]
    Checkpoint(String),
    #[serde(rename = "error")]
    Error(String),
}

/// The host's answer to a checkpoint request.
#[derive(Serialize)]
struct Checkpointed<'a> {
    checkpointed: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Parses one line from the process, with an error that quotes it.
fn parse_reply(line: &str) -> Result<Reply, String> {
    // The externally tagged enum reads `{"ack":"…"}` and refuses other keys or several keys.
    serde_json::from_str::<Reply>(line).map_err(|e| {
        format!(
            "sent a line that is not {{\"ack\":C}}, {{\"checkpoint\":C}} or {{\"error\":TEXT}}: {e}: {}",
            quote(line)
        )
    })
}

/// At most 200 characters of `line`, escaped.
pub(crate) fn quote(line: &str) -> String {
    let short: String = line.chars().take(200).collect();
    format!("\"{}\"", short.escape_debug())
}

impl LinesHandler {
    /// Runs `command` with `sh -c`, one process per owned partition of `group`, in `groups`.
    #[must_use]
    pub fn new(command: String, group: String, groups: ProcessGroups) -> Self {
        LinesHandler {
            command,
            group,
            groups,
            slots: Slots::default(),
            keyed: false,
        }
    }

    /// Serves a processor with key concurrency above 1 (its `key_concurrency`): a partition
    /// gets a process per call running at once, and the processes' checkpoint requests are
    /// refused (see the module doc).
    #[must_use]
    pub fn key_concurrency(mut self, n: usize) -> Self {
        self.keyed = n > 1;
        self
    }

    fn start(&self, ctx: &Context) -> Result<LongLived, HandlerError> {
        let env = [
            ("CHANGEFEED_GROUP", self.group.clone()),
            ("CHANGEFEED_HOST", ctx.host().as_str().to_string()),
            ("CHANGEFEED_PARTITION", ctx.partition().as_str().to_string()),
            ("CHANGEFEED_FENCING_TOKEN", ctx.fencing_token().to_string()),
        ];
        LongLived::spawn(&self.groups, &self.command, ctx.partition(), &env)
    }

    /// One batch's exchange: the batch, then checkpoint requests until an ack or an error.
    async fn exchange(
        &self,
        ctx: &Context,
        child: &mut LongLived,
        batch: &Batch,
    ) -> Result<(), HandlerError> {
        let partition = ctx.partition();
        let line = serde_json::to_vec(&BatchLine {
            records: batch
                .records
                .iter()
                .map(|r| RecordLine::new(partition, r))
                .collect(),
        })?;
        child.send(&line).await?;
        let in_batch = |c: &str| batch.records.iter().any(|r| r.continuation.as_str() == c);
        loop {
            let line = child.recv().await?;
            match parse_reply(&line).map_err(|e| child.failed(&e))? {
                Reply::Ack(c) => {
                    let last = batch.records.last().map(|r| r.continuation.as_str());
                    if last == Some(c.as_str()) {
                        return Ok(());
                    }
                    if !in_batch(&c) {
                        return Err(child
                            .failed(&format!(
                                "acknowledged {}, not a record of the batch",
                                quote(&c)
                            ))
                            .into());
                    }
                    if !self.keyed {
                        ctx.checkpoint(Continuation::new(c.clone())).await?;
                    }
                    return Err(child
                        .failed(&format!(
                            "acknowledged the batch only up to {}; the rest is delivered again",
                            quote(&c)
                        ))
                        .into());
                }
                Reply::Checkpoint(c) => {
                    let error = if self.keyed {
                        Some(
                            "with key concurrency the host checkpoints, once every key's \
                             records before it are done: acknowledge the line instead"
                                .to_string(),
                        )
                    } else if in_batch(&c) {
                        ctx.checkpoint(Continuation::new(c.clone()))
                            .await
                            .err()
                            .map(|e| e.to_string())
                    } else {
                        Some(format!("{} is not a record of the batch", quote(&c)))
                    };
                    let reply = serde_json::to_vec(&Checkpointed {
                        checkpointed: &c,
                        error,
                    })?;
                    child.send(&reply).await?;
                }
                Reply::Error(why) => {
                    return Err(child.failed(&format!("failed the batch: {why}")).into())
                }
            }
        }
    }
}

#[async_trait]
impl Handler for LinesHandler {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        if batch.records.is_empty() {
            return Ok(());
        }
        let mut child = match self.slots.take(ctx.partition()) {
            Some(c) => c,
            None => self.start(ctx)?,
        };
        // On an error the process is dropped (its group killed): the next call starts afresh.
        self.exchange(ctx, &mut child, batch).await?;
        self.slots.put(ctx.partition(), child);
        Ok(())
    }

    async fn close(&self, ctx: &Context, _reason: CloseReason) {
        let children = self.slots.take_all(ctx.partition());
        futures::future::join_all(children.into_iter().map(|c| c.finish(KILL_GRACE))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_one_keyed_objects_and_anything_else_is_named() {
        assert_eq!(
            parse_reply(r#"{"ack":"3:4"}"#),
            Ok(Reply::Ack("3:4".into()))
        );
        assert_eq!(
            parse_reply(r#"{"checkpoint":"3:2"}"#),
            Ok(Reply::Checkpoint("3:2".into()))
        );
        assert_eq!(
            parse_reply(r#"{"error":"db down"}"#),
            Ok(Reply::Error("db down".into()))
        );
        for bad in [
            r#"{"ack":"1","error":"x"}"#,
            r#"{"done":"1"}"#,
            "ok",
            r#"{"ack":1}"#,
        ] {
            let err = parse_reply(bad).expect_err(bad);
            assert!(err.contains("is not {\"ack\":C}"), "{err}");
            assert!(err.contains(&bad.escape_debug().to_string()), "{err}");
        }
    }
}
