//! A DynamoDB Streams record as the core's [`Record`]: the change as one plain JSON document.
//!
//! The document holds what a handler of table changes needs, with the item images as plain
//! JSON (through `serde_dynamo`: `S` a string, `N` a number, `M` an object, `L` and the sets
//! arrays, `B` an array of bytes, `NULL` null):
//!
//! ```json
//! {"eventName":"MODIFY","eventId":"…","keys":{"pk":"a"},"newImage":{"pk":"a","n":2},
//!  "oldImage":{"pk":"a","n":1},"approximateCreationTime":1796550060000,
//!  "sequenceNumber":"000000000000000000002","sizeBytes":19}
//! ```
//!
//! `newImage` and `oldImage` are present as the stream's view type provides them. The record's
//! key is the item's key (the value of a single string or number key attribute, otherwise
//! the key attributes as JSON), so that changes of one item keep one key.
//!
//! In [`RecordShape::Adapter`] the data is the adapter's typed document instead
//! ([`super::adapter`]); the key, continuation and time are the same.

use std::collections::HashMap;

use aws_sdk_dynamodbstreams::types::{
    AttributeValue, Record as StreamRecord, StreamRecord as Change,
};
use changefeed::model::{Continuation, PartitionId, Record, Timestamp};
use changefeed::SourceError;
use serde_json::{Map, Value};

use super::{adapter, RecordShape};

/// `value` with every binary value (`B`, and each of a `BS`) as a list of its bytes, at any
/// depth: `serde_dynamo` cannot write bytes into a JSON value, and would refuse the whole
/// record (and so stop its shard) over one binary attribute.
fn bytes_as_lists(value: AttributeValue) -> AttributeValue {
    let bytes = |b: aws_sdk_dynamodbstreams::primitives::Blob| {
        AttributeValue::L(
            b.into_inner()
                .into_iter()
                .map(|byte| AttributeValue::N(byte.to_string()))
                .collect(),
        )
    };
    match value {
        AttributeValue::B(b) => bytes(b),
        AttributeValue::Bs(items) => AttributeValue::L(items.into_iter().map(bytes).collect()),
        AttributeValue::M(m) => {
            AttributeValue::M(m.into_iter().map(|(k, v)| (k, bytes_as_lists(v))).collect())
        }
        AttributeValue::L(items) => {
            AttributeValue::L(items.into_iter().map(bytes_as_lists).collect())
        }
        other => other,
    }
}

/// An item image (or its keys) as plain JSON.
fn image(
    partition: &PartitionId,
    item: &HashMap<String, AttributeValue>,
) -> Result<Value, SourceError> {
    let item: HashMap<String, AttributeValue> = item
        .iter()
        .map(|(k, v)| (k.clone(), bytes_as_lists(v.clone())))
        .collect();
    serde_dynamo::aws_sdk_dynamodbstreams_1::from_item(item).map_err(|e| SourceError::Corrupt {
        partition: partition.to_string(),
        reason: format!("a stream record's image cannot be read as JSON: {e}"),
    })
}

/// The record key of an item with `keys`: a lone string or number key attribute as it is,
/// otherwise the key attributes as JSON (object keys sorted, so one item has one key).
fn key_text(keys: &Value) -> String {
    match keys {
        Value::Object(m) if m.len() == 1 => match m.values().next() {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => keys.to_string(),
        },
        Value::Object(m) => {
            let sorted: std::collections::BTreeMap<&String, &Value> = m.iter().collect();
            serde_json::to_string(&sorted).unwrap_or_else(|_| keys.to_string())
        }
        _ => keys.to_string(),
    }
}

/// The core's record for one stream record of `partition`, its data in `shape`.
///
/// # Errors
/// [`SourceError::Corrupt`] naming the partition when the record lacks its sequence number
/// or its keys, or an image cannot be read.
pub(crate) fn to_record(
    partition: &PartitionId,
    r: &StreamRecord,
    shape: RecordShape,
) -> Result<Record, SourceError> {
    let corrupt = |reason: &str| SourceError::Corrupt {
        partition: partition.to_string(),
        reason: reason.to_string(),
    };
    let change = r
        .dynamodb()
        .ok_or_else(|| corrupt("a stream record without its change (dynamodb)"))?;
    let sequence = change
        .sequence_number()
        .ok_or_else(|| corrupt("a stream record without a SequenceNumber"))?;
    let keys = image(
        partition,
        change
            .keys()
            .ok_or_else(|| corrupt("a stream record without Keys"))?,
    )?;
    let timestamp = change
        .approximate_creation_date_time()
        .and_then(|t| t.to_millis().ok())
        .map(Timestamp);
    let key = key_text(&keys);
    let doc = match shape {
        RecordShape::Plain => plain(partition, r, change, keys, timestamp)?,
        RecordShape::Adapter => adapter::document(r).map_err(|e| {
            corrupt(&format!(
                "a stream record cannot be written in the adapter's shape: {e}"
            ))
        })?,
    };
    let data = serde_json::to_vec(&doc)
        .map_err(|e| corrupt(&format!("a stream record cannot be written as JSON: {e}")))?;
    Ok(Record {
        key,
        data: data.into(),
        continuation: Continuation::new(sequence),
        timestamp,
    })
}

/// The plain document of `r`, whose change is `change`, keys `keys` (plain JSON) and time
/// `timestamp`.
fn plain(
    partition: &PartitionId,
    r: &StreamRecord,
    change: &Change,
    keys: Value,
    timestamp: Option<Timestamp>,
) -> Result<Value, SourceError> {
    let mut doc = Map::new();
    if let Some(name) = r.event_name() {
        doc.insert("eventName".into(), Value::from(name.as_str()));
    }
    if let Some(id) = r.event_id() {
        doc.insert("eventId".into(), Value::from(id));
    }
    doc.insert("keys".into(), keys);
    if let Some(new) = change.new_image() {
        doc.insert("newImage".into(), image(partition, new)?);
    }
    if let Some(old) = change.old_image() {
        doc.insert("oldImage".into(), image(partition, old)?);
    }
    if let Some(t) = timestamp {
        doc.insert("approximateCreationTime".into(), Value::from(t.0));
    }
    if let Some(sequence) = change.sequence_number() {
        doc.insert("sequenceNumber".into(), Value::from(sequence));
    }
    if let Some(size) = change.size_bytes() {
        doc.insert("sizeBytes".into(), Value::from(size));
    }
    Ok(Value::Object(doc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodbstreams::primitives::DateTime;
    use aws_sdk_dynamodbstreams::types::OperationType;

    fn s(v: &str) -> AttributeValue {
        AttributeValue::S(v.to_string())
    }

    #[test]
    fn images_become_plain_json_and_the_item_key_the_record_key() {
        // Handlers get plain JSON, not DynamoDB's typed attribute values.
        let p = PartitionId::new("shardId-1").expect("valid");
        let keys = HashMap::from([("pk".to_string(), s("a"))]);
        let new = HashMap::from([
            ("pk".to_string(), s("a")),
            ("n".to_string(), AttributeValue::N("2".into())),
            (
                "tags".to_string(),
                AttributeValue::L(vec![s("x"), AttributeValue::Bool(true)]),
            ),
        ]);
        let change = Change::builder()
            .set_keys(Some(keys))
            .set_new_image(Some(new))
            .sequence_number("000000000000000000002")
            .approximate_creation_date_time(DateTime::from_secs(1_796_550_060))
            .build();
        let r = StreamRecord::builder()
            .event_name(OperationType::Modify)
            .dynamodb(change)
            .build();
        let rec = to_record(&p, &r, RecordShape::Plain).expect("converts");
        assert_eq!(rec.key, "a");
        assert_eq!(rec.continuation.as_str(), "000000000000000000002");
        assert_eq!(rec.timestamp, Some(Timestamp(1_796_550_060_000)));
        let doc: Value = serde_json::from_slice(&rec.data).expect("json");
        assert_eq!(doc["eventName"], "MODIFY");
        assert_eq!(doc["keys"], serde_json::json!({"pk": "a"}));
        assert_eq!(
            doc["newImage"],
            serde_json::json!({"pk": "a", "n": 2, "tags": ["x", true]})
        );
        assert!(doc.get("oldImage").is_none());
    }

    #[test]
    fn the_adapter_shape_changes_the_data_only() {
        // One item's changes keep one key and resume at the same continuation in both shapes.
        let p = PartitionId::new("shardId-1").expect("valid");
        let keys = HashMap::from([("pk".to_string(), s("a"))]);
        let r = StreamRecord::builder()
            .event_name(OperationType::Remove)
            .dynamodb(
                Change::builder()
                    .set_keys(Some(keys.clone()))
                    .set_old_image(Some(keys))
                    .sequence_number("000000000000000000003")
                    .build(),
            )
            .build();
        let plain = to_record(&p, &r, RecordShape::Plain).expect("plain");
        let typed = to_record(&p, &r, RecordShape::Adapter).expect("adapter");
        assert_eq!(
            (&typed.key, &typed.continuation),
            (&plain.key, &plain.continuation)
        );
        let doc: Value = serde_json::from_slice(&typed.data).expect("json");
        assert_eq!(doc["eventName"], "REMOVE");
        assert_eq!(
            doc["dynamodb"]["OldImage"],
            serde_json::json!({"pk": {"S": "a"}})
        );
        assert_eq!(doc["dynamodb"]["SequenceNumber"], "000000000000000000003");
    }

    #[test]
    fn binary_values_are_arrays_of_bytes_at_any_depth() {
        // One binary attribute must not make the record unreadable (and stop its shard).
        use aws_sdk_dynamodbstreams::primitives::Blob;
        let p = PartitionId::new("shardId-1").expect("valid");
        let item = HashMap::from([
            ("b".to_string(), AttributeValue::B(Blob::new(vec![1, 255]))),
            (
                "bs".to_string(),
                AttributeValue::Bs(vec![Blob::new(vec![0]), Blob::new(vec![7, 8])]),
            ),
            (
                "m".to_string(),
                AttributeValue::M(HashMap::from([(
                    "l".to_string(),
                    AttributeValue::L(vec![AttributeValue::B(Blob::new(vec![2]))]),
                )])),
            ),
        ]);
        assert_eq!(
            image(&p, &item).expect("plain JSON"),
            serde_json::json!({"b": [1, 255], "bs": [[0], [7, 8]], "m": {"l": [[2]]}})
        );
    }

    #[test]
    fn a_composite_key_is_its_attributes_as_json() {
        // Two items sharing a hash key but not a sort key must not share a record key.
        let keys: Value = serde_json::json!({"pk": "a", "sk": 1});
        assert_eq!(key_text(&keys), r#"{"pk":"a","sk":1}"#);
    }

    #[test]
    fn a_record_without_its_sequence_number_is_a_named_error() {
        let p = PartitionId::new("shardId-1").expect("valid");
        let r = StreamRecord::builder()
            .dynamodb(Change::builder().build())
            .build();
        let err = to_record(&p, &r, RecordShape::Plain).expect_err("no sequence number");
        assert!(err.to_string().contains("shardId-1"), "{err}");
        assert!(err.to_string().contains("SequenceNumber"), "{err}");
    }
}
