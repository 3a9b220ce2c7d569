//! Importing a KCL 2.x lease table: the same leases, at the same checkpoints.
//!
//! KCL keeps one item per shard in its lease table: `leaseKey` (the shard id, or
//! `account:stream:creationEpoch:shardId` in multi-stream mode), `checkpoint` (a sequence
//! number, or `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP` or `SHARD_END`),
//! `checkpointSubSequenceNumber`, `ownerSwitchesSinceCheckpoint`, `parentShardIds` and more.
//! [`import_kcl`] scans it once (a one-off migration, so a scan is fine here) and creates one
//! of our leases per item, available, at the same continuation, so a consumer moved from Java
//! KCL to Rust neither reprocesses nor skips records.

use std::collections::{BTreeMap, HashMap};

use aws_sdk_dynamodb::types::AttributeValue;
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, Lease, LeaseKey, LeaseState, PartitionId, Position,
};
use changefeed::source::MultiFeed;
use changefeed::LeaseError;

use crate::error::store_error;
use crate::store::{PK, SK};
use crate::DynamoError;
use crate::DynamoLeaseStore;

/// What [`import_kcl`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// Leases created.
    pub created: Vec<LeaseKey>,
    /// Leases that already existed in our store (left untouched).
    pub existing: Vec<LeaseKey>,
    /// KCL items skipped, each with why.
    pub skipped: Vec<(String, String)>,
}

fn text(item: &HashMap<String, AttributeValue>, attr: &str) -> Option<String> {
    match item.get(attr) {
        Some(AttributeValue::S(s)) => Some(s.clone()),
        Some(AttributeValue::N(n)) => Some(n.clone()),
        _ => None,
    }
}

/// Reads every item of the KCL 2.x lease table `kcl_table` through `store`'s client and
/// creates, in `group` of `store`, one lease per KCL lease: same partition id (the KCL
/// `leaseKey`; in multi-stream mode, `account:stream:creationEpoch:shardId` becomes
/// [`MultiFeed`]'s `stream:shardId`, the identifier kept in the property
/// `kcl.streamIdentifier`), same parents (converted alike), starting after the KCL checkpoint. A checkpoint of
/// `TRIM_HORIZON`/`LATEST` becomes the start position `Beginning`/`Now`; `SHARD_END` becomes
/// a finished lease. A checkpoint at a sequence number becomes the continuation that resumes
/// right after it, `SEQ/SUB` (see `checkpoint_continuation`).
///
/// # Errors
/// [`LeaseError::Store`] if a table cannot be read or written.
pub async fn import_kcl(
    store: &DynamoLeaseStore,
    kcl_table: &str,
    group: &GroupName,
) -> Result<ImportReport, LeaseError> {
    let mut report = ImportReport::default();
    let mut start = None;
    loop {
        let out = store
            .client()
            .scan()
            .table_name(kcl_table)
            .consistent_read(true)
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .map_err(|e| store_error("import_kcl", Some(kcl_table.to_string()), e))?;
        for item in out.items() {
            let Some(lease_key) = text(item, "leaseKey") else {
                report
                    .skipped
                    .push(("?".into(), "item has no leaseKey".into()));
                continue;
            };
            match kcl_lease(group, &lease_key, item) {
                Ok(lease) => match store.create(&lease).await? {
                    Some(_) => report.created.push(lease.key),
                    None => report.existing.push(lease.key),
                },
                Err(why) => report.skipped.push((lease_key, why)),
            }
        }
        match out.last_evaluated_key() {
            Some(k) if !k.is_empty() => start = Some(k.clone()),
            _ => break,
        }
    }
    Ok(report)
}

/// Who holds one KCL lease, as its table shows it at one read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KclHolder {
    /// `leaseOwner`: the worker holding it (`None`: nobody).
    pub owner: Option<String>,
    /// `leaseCounter`: moved by every renewal and every take.
    pub counter: u64,
}

/// Reads who holds each lease of the KCL lease table `kcl_table`, by `leaseKey`. A KCL worker
/// renews each lease it holds by moving its `leaseCounter`; whether one still does is told by
/// two reads a failover time apart ([`live_kcl_leases`]).
///
/// # Errors
/// [`LeaseError::Store`] if the table cannot be read.
pub async fn kcl_holders(
    store: &DynamoLeaseStore,
    kcl_table: &str,
) -> Result<BTreeMap<String, KclHolder>, LeaseError> {
    let mut holders = BTreeMap::new();
    let mut start = None;
    loop {
        let out = store
            .client()
            .scan()
            .table_name(kcl_table)
            .consistent_read(true)
            .projection_expression("leaseKey, leaseOwner, leaseCounter")
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .map_err(|e| store_error("kcl_holders", Some(kcl_table.to_string()), e))?;
        for item in out.items() {
            let Some(key) = text(item, "leaseKey") else {
                continue;
            };
            let holder = KclHolder {
                owner: text(item, "leaseOwner").filter(|o| !o.is_empty()),
                counter: text(item, "leaseCounter")
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0),
            };
            holders.insert(key, holder);
        }
        match out.last_evaluated_key() {
            Some(k) if !k.is_empty() => start = Some(k.clone()),
            _ => break,
        }
    }
    Ok(holders)
}

/// The leases a KCL worker held between two reads of [`kcl_holders`]: owned at the second, and
/// renewed or taken in between (the counter or the owner moved, or the lease is new), as the
/// KCL itself tells a live holder from a dead one. Each with its counter at the first read.
#[must_use]
pub fn live_kcl_leases(
    before: &BTreeMap<String, KclHolder>,
    after: &BTreeMap<String, KclHolder>,
) -> Vec<(String, KclHolder, Option<u64>)> {
    after
        .iter()
        .filter(|(_, now)| now.owner.is_some())
        .filter_map(|(key, now)| {
            let then = before.get(key);
            let moved = then.is_none_or(|t| t.counter != now.counter || t.owner != now.owner);
            moved.then(|| (key.clone(), now.clone(), then.map(|t| t.counter)))
        })
        .collect()
}

/// Refuses a table keyed otherwise than ours (every call on it would fail), naming what it
/// is when it is a KCL application's own lease table, and what to do instead.
pub(crate) fn check_key_schema(
    name: &str,
    table: &aws_sdk_dynamodb::types::TableDescription,
) -> Result<(), LeaseError> {
    let hash = table
        .key_schema()
        .iter()
        .find(|k| k.key_type() == &aws_sdk_dynamodb::types::KeyType::Hash)
        .map(|k| k.attribute_name());
    let refuse = |why: String| {
        Err(LeaseError::store(
            "describe_table",
            Some(name.to_string()),
            false,
            DynamoError::other(why),
        ))
    };
    match hash {
        None | Some(PK) => Ok(()),
        Some("leaseKey") => refuse(format!(
            "table {t} is a KCL application's lease table (keyed by leaseKey), not a changefeed lease table: \
             changefeed keeps its leases in a table of its own. Stop the KCL application, copy its checkpoints with \
             `changefeed import-kcl --table {t} --store dynamodb://{t}-changefeed --group {t}`, \
             then run with --store dynamodb://{t}-changefeed",
            t = name
        )),
        Some(other) => refuse(format!(
            "table {} is keyed by {other}, not a changefeed lease table (keyed by {PK} and {SK}): name a table of its own",
            name
        )),
    }
}

/// What [`export_kcl`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// KCL leases whose checkpoint was set to ours.
    pub updated: Vec<String>,
    /// KCL leases created for partitions the KCL table did not have (children of a split
    /// since the import, say).
    pub created: Vec<String>,
    /// Our leases not exported, each with why.
    pub skipped: Vec<(String, String)>,
}

/// The KCL checkpoint of one of our leases: `(checkpoint, checkpointSubSequenceNumber)`, or
/// why it has none the KCL can read. The inverse of the import: `SEQ/SUB` (after user record
/// `SUB` of the record at `SEQ`) and a plain `SEQ` (after the record at `SEQ`, as the KCL's
/// sub-sequence 0 of a record that is not KPL-aggregated) become the KCL's `(SEQ, SUB)`; a
/// lease with no checkpoint yet, its start; a finished one, `SHARD_END`.
fn kcl_checkpoint(lease: &Lease) -> Result<(String, u64), String> {
    if lease.state == LeaseState::Finished {
        return Ok(("SHARD_END".into(), 0));
    }
    let Some(c) = &lease.continuation else {
        return match lease.start {
            Position::Beginning => Ok(("TRIM_HORIZON".into(), 0)),
            Position::Now => Ok(("LATEST".into(), 0)),
            _ => Err(format!(
                "no checkpoint yet and starts at {:?}: the KCL keeps no such start in a lease; create it by hand",
                lease.start
            )),
        };
    };
    let (seq, sub) = match c.as_str().split_once('/') {
        Some((seq, sub)) => (
            seq,
            sub.parse::<u64>()
                .map_err(|_| format!("checkpoint {c} is not a Kinesis position"))?,
        ),
        None => (c.as_str(), 0),
    };
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("checkpoint {c} is not a Kinesis sequence number"));
    }
    Ok((seq.to_string(), sub))
}

/// The KCL `leaseKey` of one of our leases: its partition id, or in multi-stream mode the
/// stream identifier the import kept (`kcl.streamIdentifier`) and the shard id.
fn kcl_lease_key(lease: &Lease) -> Result<String, String> {
    let partition = lease.key.partition.as_str();
    match lease.properties.get("kcl.streamIdentifier") {
        Some(identifier) => {
            let shard = partition.rsplit_once(':').map_or(partition, |(_, s)| s);
            Ok(format!("{identifier}:{shard}"))
        }
        None if partition.contains(':') => Err(
            "a multi-stream partition without the KCL stream identifier (kcl.streamIdentifier) an import keeps".into(),
        ),
        None => Ok(partition.to_string()),
    }
}

/// Writes the checkpoints of `group`'s leases in `store` into the KCL lease table `kcl_table`,
/// so that the KCL application, started again, resumes where changefeed stopped: each KCL
/// lease gets our checkpoint, loses its owner and has its `leaseCounter` moved (a worker that
/// still cached it takes it afresh); a partition the KCL table lacks gets a lease of its own,
/// with its parents. Our hosts must have stopped first (the caller checks).
///
/// # Errors
/// [`LeaseError::Store`] if a table cannot be read or written.
pub async fn export_kcl(
    store: &DynamoLeaseStore,
    kcl_table: &str,
    group: &GroupName,
) -> Result<ExportReport, LeaseError> {
    let mut report = ExportReport::default();
    let listing = store.list(group).await?;
    let existing = kcl_holders(store, kcl_table).await?;
    let client = store.client();
    for lease in &listing.leases {
        let partition = lease.key.partition.to_string();
        let (key, (checkpoint, sub)) =
            match kcl_lease_key(lease).and_then(|k| Ok((k, kcl_checkpoint(lease)?))) {
                Ok(found) => found,
                Err(why) => {
                    report.skipped.push((partition, why));
                    continue;
                }
            };
        if existing.contains_key(&key) {
            client
                .update_item()
                .table_name(kcl_table)
                .key("leaseKey", AttributeValue::S(key.clone()))
                .update_expression(
                    "SET checkpoint = :c, checkpointSubSequenceNumber = :s, ownerSwitchesSinceCheckpoint = :zero \
                     REMOVE leaseOwner, pendingCheckpoint, pendingCheckpointSubSequenceNumber \
                     ADD leaseCounter :one",
                )
                .expression_attribute_values(":c", AttributeValue::S(checkpoint))
                .expression_attribute_values(":s", AttributeValue::N(sub.to_string()))
                .expression_attribute_values(":zero", AttributeValue::N("0".into()))
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .send()
                .await
                .map_err(|e| store_error("export_kcl", Some(key.clone()), e))?;
            report.updated.push(key);
        } else {
            let mut put = client
                .put_item()
                .table_name(kcl_table)
                .item("leaseKey", AttributeValue::S(key.clone()))
                .item("checkpoint", AttributeValue::S(checkpoint))
                .item(
                    "checkpointSubSequenceNumber",
                    AttributeValue::N(sub.to_string()),
                )
                .item("leaseCounter", AttributeValue::N("0".into()))
                .item(
                    "ownerSwitchesSinceCheckpoint",
                    AttributeValue::N("0".into()),
                )
                .condition_expression("attribute_not_exists(leaseKey)");
            let parents: Vec<String> = lease
                .parents
                .iter()
                .map(|p| {
                    p.as_str()
                        .rsplit_once(':')
                        .map_or(p.as_str(), |(_, s)| s)
                        .to_string()
                })
                .collect();
            if !parents.is_empty() {
                put = put.item("parentShardIds", AttributeValue::Ss(parents));
            }
            put.send()
                .await
                .map_err(|e| store_error("export_kcl", Some(key.clone()), e))?;
            report.created.push(key);
        }
    }
    Ok(report)
}

/// A KCL multi-stream lease key, `account:stream:creationEpoch:shardId`, split into the stream
/// identifier (`account:stream:creationEpoch`), the stream name and the shard id; `None` for a
/// single-stream key (a shard id).
fn multi_stream_key(lease_key: &str) -> Option<(&str, &str, &str)> {
    let (identifier, shard) = lease_key.rsplit_once(':')?;
    let mut parts = identifier.split(':');
    let (account, stream, epoch) = (parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (parts.next().is_none() && digits(account) && digits(epoch) && !stream.is_empty())
        .then_some((identifier, stream, shard))
}

/// Our partition id for the KCL shard `shard`: the shard id itself, or in multi-stream mode
/// `MultiFeed`'s `"{stream}:{shard}"` (so a [`changefeed::source::MultiFeed`] of the same
/// streams reads the imported leases). A parent named by its full multi-stream key is
/// converted the same way.
fn partition_for(stream: Option<&str>, shard: &str) -> Result<PartitionId, String> {
    let id = match (multi_stream_key(shard), stream) {
        (Some((_, stream, shard)), _) => {
            PartitionId::new(shard).and_then(|p| MultiFeed::partition_id(stream, &p))
        }
        (None, Some(stream)) => {
            PartitionId::new(shard).and_then(|p| MultiFeed::partition_id(stream, &p))
        }
        (None, None) => PartitionId::new(shard),
    };
    id.map_err(|e| e.to_string())
}

/// The continuation of the Kinesis source for the KCL checkpoint `seq` with
/// `checkpointSubSequenceNumber` `sub`: `SEQ/SUB`, which reads `AT_SEQUENCE_NUMBER` `SEQ` and
/// skips the user records up to `SUB` of the record there (all of it when it was not
/// aggregated), as the KCL resumes from that checkpoint (it reads `AT_SEQUENCE_NUMBER` and
/// drops every user record at or before `(SEQ, SUB)`). So nothing at or before the checkpoint
/// is delivered again and nothing after it is lost, whether the record at `SEQ` is a KPL
/// aggregate or not, which the lease row does not say: sub-sequence 0 is also where the KCL
/// checkpoints the first user record of an aggregate, and a plain `SEQ` (after the whole
/// record) would lose the rest of it.
///
/// # Errors
/// A message naming the sub-sequence number when it is not a whole number.
fn checkpoint_continuation(seq: &str, sub: &str) -> Result<Continuation, String> {
    let sub: u64 = sub.parse().map_err(|_| {
        format!("checkpoint {seq} has checkpointSubSequenceNumber {sub:?}, not a whole number")
    })?;
    Ok(Continuation::new(format!("{seq}/{sub}")))
}

fn kcl_lease(
    group: &GroupName,
    lease_key: &str,
    item: &HashMap<String, AttributeValue>,
) -> Result<Lease, String> {
    let multi = multi_stream_key(lease_key);
    let stream = multi.map(|(_, stream, _)| stream);
    let partition = partition_for(stream, lease_key)?;
    let parents = match item.get("parentShardIds") {
        Some(AttributeValue::Ss(ids)) => ids.clone(),
        Some(AttributeValue::L(ids)) => ids.iter().filter_map(|v| v.as_s().ok().cloned()).collect(),
        _ => Vec::new(),
    };
    let mut parents = parents
        .iter()
        .map(|p| partition_for(stream, p))
        .collect::<Result<Vec<_>, _>>()?;
    parents.sort();
    let sub = text(item, "checkpointSubSequenceNumber").unwrap_or_else(|| "0".into());
    let checkpoint = text(item, "checkpoint").ok_or("item has no checkpoint")?;
    let mut lease = Lease::new(LeaseKey::new(group.clone(), partition), Position::Beginning)
        .with_parents(parents);
    match checkpoint.as_str() {
        "TRIM_HORIZON" => lease.start = Position::Beginning,
        "LATEST" => lease.start = Position::Now,
        "SHARD_END" => lease.state = LeaseState::Finished,
        "AT_TIMESTAMP" => {
            return Err("checkpoint AT_TIMESTAMP: KCL does not store the timestamp in the lease; create this lease with an explicit start".into())
        }
        seq if !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()) => {
            lease.continuation = Some(checkpoint_continuation(seq, &sub)?);
        }
        other => return Err(format!("unknown checkpoint {other:?}")),
    }
    let switches = text(item, "ownerSwitchesSinceCheckpoint").unwrap_or_else(|| "0".into());
    lease
        .properties
        .insert("kcl.ownerSwitchesSinceCheckpoint".into(), switches);
    if let Some((identifier, _, _)) = multi {
        lease
            .properties
            .insert("kcl.streamIdentifier".into(), identifier.into());
    }
    Ok(lease)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_resumes_after_its_user_record() {
        let c = |seq, sub| checkpoint_continuation(seq, sub).map(|c| c.as_str().to_string());
        assert_eq!(c("4960", "3"), Ok("4960/3".to_string()));
        // Sub-sequence 0: the record itself when it was not aggregated, the first user record
        // of an aggregate (the rest of which is still to come) when it was.
        assert_eq!(c("4960", "0"), Ok("4960/0".to_string()));
        let err = c("4960", "-1").expect_err("not a whole number");
        assert!(err.contains("checkpointSubSequenceNumber"), "{err}");
    }

    #[test]
    fn our_checkpoints_become_the_kcl_checkpoints_the_import_reads_back() {
        // The way back is the import's inverse: each export, read by the import, gives the
        // same lease position again; what the KCL cannot hold is refused with why.
        let group = GroupName::new("g").expect("group");
        let lease = |p: &str| {
            Lease::new(
                LeaseKey::new(group.clone(), PartitionId::new(p).expect("id")),
                Position::Beginning,
            )
        };
        let seq = "49590338271490256608559692538361571095921575989136588898";
        let mut at = lease("shardId-1");
        at.continuation = Some(Continuation::new(format!("{seq}/7")));
        assert_eq!(kcl_checkpoint(&at), Ok((seq.to_string(), 7)));
        at.continuation = Some(Continuation::new(seq));
        assert_eq!(kcl_checkpoint(&at), Ok((seq.to_string(), 0)));
        let mut now = lease("shardId-2");
        now.start = Position::Now;
        assert_eq!(kcl_checkpoint(&now), Ok(("LATEST".into(), 0)));
        assert_eq!(
            kcl_checkpoint(&lease("shardId-3")),
            Ok(("TRIM_HORIZON".into(), 0))
        );
        let mut done = lease("shardId-4");
        done.state = LeaseState::Finished;
        assert_eq!(kcl_checkpoint(&done), Ok(("SHARD_END".into(), 0)));
        let mut odd = lease("shardId-5");
        odd.continuation = Some(Continuation::new("0:42"));
        assert!(kcl_checkpoint(&odd).is_err_and(|e| e.contains("0:42")));
        // Round trip through the import's reading of a KCL item.
        for (checkpoint, sub) in [(seq.to_string(), 7), ("TRIM_HORIZON".into(), 0)] {
            let item: HashMap<String, AttributeValue> = [
                (
                    "leaseKey".to_string(),
                    AttributeValue::S("shardId-1".into()),
                ),
                (
                    "checkpoint".to_string(),
                    AttributeValue::S(checkpoint.clone()),
                ),
                (
                    "checkpointSubSequenceNumber".to_string(),
                    AttributeValue::N(sub.to_string()),
                ),
            ]
            .into();
            let back = kcl_lease(&group, "shardId-1", &item).expect("imported");
            assert_eq!(kcl_checkpoint(&back), Ok((checkpoint, sub)));
        }
        // Multi-stream: the identifier the import kept names the KCL lease.
        let mut multi = lease("orders:shardId-9");
        multi.properties.insert(
            "kcl.streamIdentifier".into(),
            "123456789012:orders:1700000000".into(),
        );
        assert_eq!(
            kcl_lease_key(&multi),
            Ok("123456789012:orders:1700000000:shardId-9".into())
        );
        assert!(kcl_lease_key(&lease("orders:shardId-9")).is_err());
        assert_eq!(kcl_lease_key(&lease("shardId-1")), Ok("shardId-1".into()));
    }

    #[test]
    fn a_kcl_lease_is_live_when_its_counter_or_owner_moved_between_reads() {
        let holder = |owner: Option<&str>, counter| KclHolder {
            owner: owner.map(str::to_string),
            counter,
        };
        let before: BTreeMap<String, KclHolder> = [
            ("renewed".into(), holder(Some("w1"), 4)),
            ("dead".into(), holder(Some("w2"), 9)),
            ("taken".into(), holder(Some("w2"), 3)),
            ("released".into(), holder(Some("w1"), 1)),
        ]
        .into();
        let after: BTreeMap<String, KclHolder> = [
            ("renewed".into(), holder(Some("w1"), 5)),
            ("dead".into(), holder(Some("w2"), 9)),
            ("taken".into(), holder(Some("w1"), 3)),
            ("released".into(), holder(None, 2)),
            ("new".into(), holder(Some("w1"), 1)),
        ]
        .into();
        let live: Vec<String> = live_kcl_leases(&before, &after)
            .into_iter()
            .map(|(k, _, _)| k)
            .collect();
        assert_eq!(live, ["new", "renewed", "taken"]);
    }
}
