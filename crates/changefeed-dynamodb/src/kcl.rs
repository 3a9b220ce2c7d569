//! Importing a KCL 2.x lease table: the same leases, at the same checkpoints.
//!
//! KCL keeps one item per shard in its lease table: `leaseKey` (the shard id, or
//! `account:stream:creationEpoch:shardId` in multi-stream mode), `checkpoint` (a sequence
//! number, or `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP` or `SHARD_END`),
//! `checkpointSubSequenceNumber`, `ownerSwitchesSinceCheckpoint`, `parentShardIds` and more.
//! [`import_kcl`] scans it once (a one-off migration, so a scan is fine here) and creates one
//! of our leases per item, available, at the same continuation, so a consumer moved from Java
//! KCL to Rust neither reprocesses nor skips records.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, Lease, LeaseKey, LeaseState, PartitionId, Position,
};
use changefeed::LeaseError;

use crate::error::store_error;
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
/// `leaseKey`), same parents, starting after the KCL checkpoint. A checkpoint of
/// `TRIM_HORIZON`/`LATEST` becomes the start position `Beginning`/`Now`; `SHARD_END` becomes
/// a finished lease. A sub-sequence number other than 0 (a KPL-aggregated record in the middle
/// of its parent) is refused, naming the lease: this crate does not de-aggregate, and resuming
/// after the whole parent record would skip the rest of it.
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

fn kcl_lease(
    group: &GroupName,
    lease_key: &str,
    item: &HashMap<String, AttributeValue>,
) -> Result<Lease, String> {
    let partition = PartitionId::new(lease_key).map_err(|e| e.to_string())?;
    let parents = match item.get("parentShardIds") {
        Some(AttributeValue::Ss(ids)) => ids.clone(),
        Some(AttributeValue::L(ids)) => ids.iter().filter_map(|v| v.as_s().ok().cloned()).collect(),
        _ => Vec::new(),
    };
    let mut parents = parents
        .into_iter()
        .map(PartitionId::new)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
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
            if sub != "0" {
                return Err(format!(
                    "checkpoint {seq} has sub-sequence number {sub} (KPL aggregation), which this importer does not support"
                ));
            }
            lease.continuation = Some(Continuation::new(seq));
        }
        other => return Err(format!("unknown checkpoint {other:?}")),
    }
    let switches = text(item, "ownerSwitchesSinceCheckpoint").unwrap_or_else(|| "0".into());
    lease
        .properties
        .insert("kcl.ownerSwitchesSinceCheckpoint".into(), switches);
    Ok(lease)
}
