//! `changefeed run --protocol kcl`: a drop-in for the KCL MultiLangDaemon. Record processors
//! written for `amazon_kclpy` (or the Node, Ruby … clients of the same protocol) run unchanged,
//! started from the application's own properties file (`changefeed run --properties FILE`).
//!
//! One long-lived child per owned lease, as the Java daemon runs them, speaking the messages of
//! [`protocol`] over its stdin and stdout:
//!
//! 1. when the lease is taken: `initialize` with the shard id and the lease's checkpoint (or
//!    `TRIM_HORIZON` / `LATEST` for a lease without one), answered by a `status`;
//! 2. per batch: `processRecords`; while handling it the child may send `checkpoint` requests
//!    (at a sequence number of a record delivered, or null for the last record delivered),
//!    each answered with a `checkpoint` message, with `error` naming the failure
//!    (`ShutdownException` when the lease is lost, `IllegalArgumentException` for a sequence
//!    number not delivered, `KinesisClientLibDependencyException` when the store failed);
//!    the `status` reply ends the batch. The lease's checkpoint moves only where the child asks
//!    (the library's manual checkpoint mode);
//! 3. at the shard's end: `shardEnded`; the child must checkpoint (else the last batch is
//!    delivered again to a fresh child, as the KCL retries), then the lease is finished and the
//!    children's leases continue from the parent's end;
//! 4. when a stop begins, or another host asks for the lease (a planned move: balancing, a
//!    host joining): `shutdownRequested`, after the batch in flight or at once for an idle
//!    child (the library's [`Handler::stopping`]), so the child may checkpoint while the lease
//!    is still held; on a move its checkpoint passes the lease over, and the new owner's child
//!    starts right after it (KCL 3.x's graceful lease hand-off, bounded by the time the asker
//!    waits before it may take the lease: `handoff_timeout − safety_margin`). Then stdin is
//!    closed and the child has [`KILL_GRACE`] to exit;
//! 5. when the lease goes any other way (lost, failed, a move or a stop that could not wait
//!    for the child): `leaseLost`, then stdin is closed likewise.
//!
//! A child that exits, writes an unknown or malformed message, or answers out of turn fails
//! the batch; it is killed (its whole process group) and the batch is retried with the
//! library's backoff by a fresh child (which is sent `initialize` again at the checkpoint);
//! after `handler_max_retries` failures the lease is released. A line that is not a protocol
//! message (not JSON, no `action`, an `action` no message has: a logger or a library printing
//! to stdout) is skipped, as the Java daemon does: the first of each child is logged, every
//! one is counted in `changefeed_kcl_stdout_lines_skipped_total`.

mod protocol;

use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{Batch, Continuation, Position};
use changefeed::processor::{CloseReason, Context, Handler, HandlerError};
use changefeed::LeaseError;
use changefeed_kinesis::ExtendedSequenceNumber;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use protocol::{FromChild, Line, RecordJson, ToChild};

use crate::child::{LongLived, Slots};
use crate::groups::{ProcessGroups, KILL_GRACE};

/// The KCL protocol handler: one session (a child and what it was told) per owned lease.
#[derive(Debug)]
pub struct KclHandler {
    command: String,
    group: String,
    groups: ProcessGroups,
    store: Arc<dyn LeaseStore>,
    /// The host's stop: once cancelled, a batch is followed by `shutdownRequested`.
    stop: CancellationToken,
    slots: Slots<Session>,
}

/// A lease's child and what it was told.
#[derive(Debug)]
struct Session {
    child: LongLived,
    /// The last record delivered: where a checkpoint without a sequence number goes.
    delivered: Option<Continuation>,
    /// The last checkpoint written at the child's request (or the lease's at `initialize`).
    checkpointed: Option<Continuation>,
    /// Whether a user record of a KPL-aggregated record was delivered (see [`target`]).
    aggregated: bool,
    shard_ended: bool,
    shutdown_requested: bool,
    /// Whether a line that is not a message was skipped yet (only the first is logged).
    skipped: bool,
}

/// What a checkpoint request made of.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// Write the checkpoint here.
    At(Continuation),
    /// Nothing was delivered yet, or the shard ended (the library finishes the lease): no
    /// write, and the answer is success.
    Nothing,
}

/// A checkpoint request's place: the sequence number and the sub-sequence number the child
/// named (`None`: not given), or `None` for "the last record delivered".
type Requested<'a> = Option<(&'a str, Option<u64>)>;

/// Which continuation a checkpoint request names, or the name of the exception to answer with.
/// A request without a sub-sequence number means sub-sequence 0, as in the KCL
/// (`checkpoint(sequenceNumber)` is `checkpoint(sequenceNumber, 0)`). The place must be one the
/// child was given: a record of the current batch (its own continuation, `SEQ/SUB` for a user
/// record of a KPL-aggregated record), or (Kinesis positions, which are ordered) one between
/// the last checkpoint and the last record delivered. There the continuation is `SEQ/SUB` when
/// the child named a sub-sequence number or this session delivered aggregated records (`SEQ/0`
/// resumes at `SEQ` without skipping the rest of an aggregated record), else plain `SEQ`.
fn target(
    requested: Requested<'_>,
    batch: Option<&Batch>,
    delivered: Option<&Continuation>,
    checkpointed: Option<&Continuation>,
    aggregated: bool,
) -> Result<Target, &'static str> {
    let Some((seq, sub)) = requested else {
        return Ok(delivered.cloned().map_or(Target::Nothing, Target::At));
    };
    let named = |c: &&Continuation| protocol::position(c.as_str()) == (seq, sub.unwrap_or(0));
    let given = batch
        .and_then(|b| b.records.iter().map(|r| &r.continuation).find(named))
        .or(delivered.filter(named));
    if let Some(c) = given {
        return Ok(Target::At(c.clone()));
    }
    let asked = ExtendedSequenceNumber {
        sequence_number: seq,
        sub_sequence_number: sub.filter(|s| *s > 0).or(aggregated.then_some(0)),
    };
    fn key(c: &Continuation) -> Option<(usize, &str, u64)> {
        ExtendedSequenceNumber::parse(c.as_str()).map(|e| e.order_key())
    }
    let plain = ExtendedSequenceNumber::parse(seq).is_some_and(|e| e.sub_sequence_number.is_none());
    let below = delivered
        .and_then(key)
        .is_some_and(|high| asked.order_key() <= high);
    let above = checkpointed.is_none_or(|low| key(low).is_none_or(|low| asked.order_key() >= low));
    if plain && below && above {
        Ok(Target::At(asked.continuation()))
    } else {
        Err("IllegalArgumentException")
    }
}

/// The exception name a failed checkpoint write is reported as.
fn exception(err: &LeaseError) -> &'static str {
    match err {
        LeaseError::Conflict { .. } => "ShutdownException",
        _ => "KinesisClientLibDependencyException",
    }
}

impl KclHandler {
    /// Runs `command` with `sh -c`, one child per owned lease of `group`, in `groups`;
    /// checkpoints go to `store`; once `stop` is cancelled, children are sent
    /// `shutdownRequested`.
    #[must_use]
    pub fn new(
        command: String,
        group: String,
        groups: ProcessGroups,
        store: Arc<dyn LeaseStore>,
        stop: CancellationToken,
    ) -> Self {
        KclHandler {
            command,
            group,
            groups,
            store,
            stop,
            slots: Slots::default(),
        }
    }

    /// Starts a child for the lease and sends it `initialize` at the lease's checkpoint.
    async fn start(&self, ctx: &Context) -> Result<Session, HandlerError> {
        let lease = self.store.get(ctx.lease_key()).await?;
        let checkpointed = lease.as_ref().and_then(|l| l.continuation.clone());
        let start = match (&checkpointed, lease.as_ref().map(|l| &l.start)) {
            (Some(c), _) | (None, Some(Position::Continuation(c))) => c.as_str().to_string(),
            (None, Some(Position::Now)) => "LATEST".into(),
            (None, Some(Position::AtTime(_))) => "AT_TIMESTAMP".into(),
            (None, _) => "TRIM_HORIZON".into(),
        };
        let (sequence_number, sub_sequence_number) = protocol::position(&start);
        let env = [
            ("CHANGEFEED_GROUP", self.group.clone()),
            ("CHANGEFEED_HOST", ctx.host().as_str().to_string()),
            ("CHANGEFEED_PARTITION", ctx.partition().as_str().to_string()),
            ("CHANGEFEED_FENCING_TOKEN", ctx.fencing_token().to_string()),
        ];
        let child = LongLived::spawn(&self.groups, &self.command, ctx.partition(), &env)?;
        let mut session = Session {
            child,
            delivered: None,
            checkpointed,
            aggregated: false,
            shard_ended: false,
            shutdown_requested: false,
            skipped: false,
        };
        let init = ToChild::Initialize {
            shard_id: ctx.partition().as_str(),
            sequence_number,
            sub_sequence_number,
        };
        self.converse(ctx, &mut session, &init, "initialize", None)
            .await?;
        Ok(session)
    }

    /// Sends `message` and serves the child's checkpoint requests until its `status` for
    /// `action`. Returns how many checkpoints the child asked for.
    async fn converse(
        &self,
        ctx: &Context,
        session: &mut Session,
        message: &ToChild<'_>,
        action: &str,
        batch: Option<&Batch>,
    ) -> Result<u32, HandlerError> {
        session.child.send(&protocol::encode(message)?).await?;
        let mut checkpoints = 0;
        loop {
            let line = session.child.recv().await?;
            match protocol::decode(&line).map_err(|e| session.child.failed(&e))? {
                Line::Other => {
                    metrics::counter!("changefeed_kcl_stdout_lines_skipped_total", "group" => self.group.clone()).increment(1);
                    if !session.skipped {
                        session.skipped = true;
                        info!(partition = %ctx.partition(), line = %line, "skipping a line on the record processor's stdout that is not a protocol message (the later ones are only counted, in changefeed_kcl_stdout_lines_skipped_total)");
                    }
                }
                Line::Message(FromChild::Status { response_for }) if response_for == action => {
                    return Ok(checkpoints);
                }
                Line::Message(FromChild::Status { response_for }) => {
                    return Err(session
                        .child
                        .failed(&format!(
                            "answered \"{}\" while \"{action}\" was outstanding",
                            response_for.escape_debug()
                        ))
                        .into());
                }
                Line::Message(FromChild::Checkpoint {
                    sequence_number,
                    sub_sequence_number,
                }) => {
                    checkpoints += 1;
                    let requested = sequence_number.as_deref().map(|s| (s, sub_sequence_number));
                    let error = self
                        .checkpoint(ctx, session, action, requested, batch)
                        .await;
                    let reply = ToChild::Checkpoint {
                        sequence_number: sequence_number.as_deref(),
                        sub_sequence_number: sub_sequence_number.or(Some(0)),
                        error,
                    };
                    session.child.send(&protocol::encode(&reply)?).await?;
                }
            }
        }
    }

    /// Serves one checkpoint request; returns the exception name if it failed.
    async fn checkpoint(
        &self,
        ctx: &Context,
        session: &mut Session,
        action: &str,
        requested: Requested<'_>,
        batch: Option<&Batch>,
    ) -> Option<&'static str> {
        match action {
            "shardEnded" if session.shard_ended => return None,
            "initialize" | "leaseLost" => return Some("ShutdownException"),
            _ => {}
        }
        let target = match target(
            requested,
            batch,
            session.delivered.as_ref(),
            session.checkpointed.as_ref(),
            session.aggregated,
        ) {
            Ok(t) => t,
            Err(name) => {
                warn!(partition = %ctx.partition(), requested = ?requested, "checkpoint at a sequence number not delivered");
                return Some(name);
            }
        };
        let Target::At(c) = target else {
            return None;
        };
        match ctx.checkpoint(c.clone()).await {
            Ok(()) => {
                session.checkpointed = Some(c);
                None
            }
            Err(err) => {
                warn!(partition = %ctx.partition(), error = %err, "checkpoint failed");
                Some(exception(&err))
            }
        }
    }

    /// One batch: `processRecords`, then `shardEnded` at the partition's end and
    /// `shutdownRequested` once a stop began.
    async fn deliver(
        &self,
        ctx: &Context,
        session: &mut Session,
        batch: &Batch,
    ) -> Result<(), HandlerError> {
        if !batch.records.is_empty() {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            let behind = batch
                .records
                .last()
                .and_then(|r| r.timestamp)
                .map_or(0, |t| (now - t.millis()).max(0));
            let message = ToChild::ProcessRecords {
                records: batch.records.iter().map(RecordJson::new).collect(),
                millis_behind_latest: behind,
            };
            session.delivered = batch.continuation.clone().or(session.delivered.take());
            session.aggregated |= batch.records.iter().any(|r| {
                ExtendedSequenceNumber::parse(r.continuation.as_str())
                    .is_some_and(|e| e.sub_sequence_number.is_some())
            });
            self.converse(ctx, session, &message, "processRecords", Some(batch))
                .await?;
        }
        if batch.end_of_partition {
            self.shard_end(ctx, session).await?;
        } else if self.stop.is_cancelled() && !session.shutdown_requested {
            session.shutdown_requested = true;
            self.converse(
                ctx,
                session,
                &ToChild::ShutdownRequested,
                "shutdownRequested",
                None,
            )
            .await?;
        }
        Ok(())
    }

    /// `shardEnded`: the child must checkpoint; the library then finishes the lease.
    async fn shard_end(&self, ctx: &Context, session: &mut Session) -> Result<(), HandlerError> {
        session.shard_ended = true;
        let asked = self
            .converse(ctx, session, &ToChild::ShardEnded, "shardEnded", None)
            .await?;
        if asked == 0 {
            return Err(session
                .child
                .failed("did not checkpoint at shardEnded (the shard's end must be checkpointed)")
                .into());
        }
        Ok(())
    }
}

#[async_trait]
impl Handler for KclHandler {
    async fn open(&self, ctx: &Context) -> Result<(), HandlerError> {
        let session = self.start(ctx).await?;
        self.slots.put(ctx.partition(), session);
        Ok(())
    }

    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let mut session = match self.slots.take(ctx.partition()) {
            Some(s) => s,
            None => self.start(ctx).await?,
        };
        // On an error the session is dropped (its process group killed): the next call
        // starts a fresh child at the checkpoint.
        self.deliver(ctx, &mut session, batch).await?;
        self.slots.put(ctx.partition(), session);
        Ok(())
    }

    async fn stopping(&self, ctx: &Context) -> Result<(), HandlerError> {
        let Some(mut session) = self.slots.take(ctx.partition()) else {
            return Ok(());
        };
        if session.shutdown_requested || session.shard_ended {
            self.slots.put(ctx.partition(), session);
            return Ok(());
        }
        session.shutdown_requested = true;
        self.converse(
            ctx,
            &mut session,
            &ToChild::ShutdownRequested,
            "shutdownRequested",
            None,
        )
        .await?;
        self.slots.put(ctx.partition(), session);
        Ok(())
    }

    async fn close(&self, ctx: &Context, reason: CloseReason) {
        let Some(mut session) = self.slots.take(ctx.partition()) else {
            return;
        };
        let said = tokio::time::timeout(KILL_GRACE, async {
            match reason {
                // The end came in a batch without records, which the handler is not called for:
                // the lease is finished at the last record the child returned from; the child
                // still gets `shardEnded` and its checkpoint is acknowledged.
                CloseReason::PartitionEnded if !session.shard_ended => {
                    self.shard_end(ctx, &mut session).await
                }
                CloseReason::PartitionEnded => Ok(()),
                // The child finished at `shutdownRequested` and the lease left in good order
                // (released at a stop, or passed on at the child's checkpoint): not lost.
                CloseReason::Shutdown | CloseReason::HandedOff if session.shutdown_requested => {
                    Ok(())
                }
                _ => self
                    .converse(ctx, &mut session, &ToChild::LeaseLost, "leaseLost", None)
                    .await
                    .map(|_| ()),
            }
        })
        .await
        .unwrap_or_else(|_| Err("no status within the grace".into()));
        if let Err(err) = said {
            warn!(partition = %ctx.partition(), reason = ?reason, error = %err, "the child's last exchange failed");
        }
        session.child.finish(KILL_GRACE).await;
    }
}

#[cfg(test)]
mod tests;
