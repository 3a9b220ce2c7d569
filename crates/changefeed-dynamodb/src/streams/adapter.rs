//! A stream record in the shape the KCL's DynamoDB Streams Kinesis adapter gives a record
//! processor: the DynamoDB Streams `Record` as JSON, images in typed attribute values.
//!
//! The adapter writes each record's data with its Jackson mapper, so a processor written for
//! it (a MultiLangDaemon processor in Python, say) parses this:
//!
//! ```json
//! {"eventID":"…","eventName":"MODIFY","eventVersion":"1.1","eventSource":"aws:dynamodb",
//!  "awsRegion":"us-east-1","dynamodb":{"ApproximateCreationDateTime":1796550060000,
//!  "Keys":{"pk":{"S":"a"}},"NewImage":{"pk":{"S":"a"},"n":{"N":"2"}},
//!  "OldImage":{"pk":{"S":"a"},"n":{"N":"1"}},"SequenceNumber":"000000000000000000002",
//!  "SizeBytes":19,"StreamViewType":"NEW_AND_OLD_IMAGES"}}
//! ```
//!
//! Fields the stream leaves out are left out (the mapper writes no nulls);
//! `ApproximateCreationDateTime` is milliseconds since the epoch, as the mapper writes a date;
//! `B` and `BS` are base64 text; `userIdentity` (`principalId`, `type`) is there for a removal
//! by time to live.

use std::collections::HashMap;

use aws_sdk_dynamodbstreams::types::{AttributeValue, Record as StreamRecord};
use base64::Engine as _;
use serde_json::{Map, Value};

/// One attribute value as typed JSON: `{"S": "a"}`, `{"N": "2"}`, `{"B": "AQI="}`, the sets
/// as arrays of text, `{"M": {…}}`, `{"L": […]}`, `{"NULL": true}`, `{"BOOL": false}`.
///
/// # Errors
/// The reason, for a value of a type this build does not know.
pub(crate) fn attribute(value: &AttributeValue) -> Result<Value, String> {
    let b64 = |bytes: &[u8]| Value::from(base64::engine::general_purpose::STANDARD.encode(bytes));
    let texts = |items: &[String]| Value::from(items.to_vec());
    let (tag, typed) = match value {
        AttributeValue::S(s) => ("S", Value::from(s.as_str())),
        AttributeValue::N(n) => ("N", Value::from(n.as_str())),
        AttributeValue::B(b) => ("B", b64(b.as_ref())),
        AttributeValue::Ss(items) => ("SS", texts(items)),
        AttributeValue::Ns(items) => ("NS", texts(items)),
        AttributeValue::Bs(items) => ("BS", items.iter().map(|b| b64(b.as_ref())).collect()),
        AttributeValue::M(m) => ("M", item(m)?),
        AttributeValue::L(items) => (
            "L",
            Value::Array(items.iter().map(attribute).collect::<Result<_, _>>()?),
        ),
        AttributeValue::Null(b) => ("NULL", Value::from(*b)),
        AttributeValue::Bool(b) => ("BOOL", Value::from(*b)),
        other => {
            return Err(format!(
                "an attribute value of a type this build does not know: {other:?}"
            ))
        }
    };
    Ok(Value::Object(Map::from_iter([(tag.to_string(), typed)])))
}

/// An item (or its keys) as typed JSON: each attribute's name to its [`attribute`] value.
///
/// # Errors
/// As for [`attribute`], naming the attribute.
pub(crate) fn item(values: &HashMap<String, AttributeValue>) -> Result<Value, String> {
    let mut out = Map::new();
    for (name, value) in values {
        let typed = attribute(value).map_err(|e| format!("attribute {name}: {e}"))?;
        out.insert(name.clone(), typed);
    }
    Ok(Value::Object(out))
}

/// The record as the adapter's JSON document.
///
/// # Errors
/// The reason, when an image holds a value [`attribute`] cannot write.
pub(crate) fn document(r: &StreamRecord) -> Result<Value, String> {
    let mut doc = Map::new();
    let put = |doc: &mut Map<String, Value>, name: &str, value: Option<&str>| {
        if let Some(v) = value {
            doc.insert(name.to_string(), Value::from(v));
        }
    };
    put(&mut doc, "eventID", r.event_id());
    put(&mut doc, "eventName", r.event_name().map(|n| n.as_str()));
    put(&mut doc, "eventVersion", r.event_version());
    put(&mut doc, "eventSource", r.event_source());
    put(&mut doc, "awsRegion", r.aws_region());
    if let Some(change) = r.dynamodb() {
        let mut d = Map::new();
        if let Some(millis) = change
            .approximate_creation_date_time()
            .and_then(|t| t.to_millis().ok())
        {
            d.insert("ApproximateCreationDateTime".into(), Value::from(millis));
        }
        let images = [
            ("Keys", change.keys()),
            ("NewImage", change.new_image()),
            ("OldImage", change.old_image()),
        ];
        for (name, image) in images {
            if let Some(values) = image {
                d.insert(
                    name.into(),
                    item(values).map_err(|e| format!("{name}: {e}"))?,
                );
            }
        }
        put(&mut d, "SequenceNumber", change.sequence_number());
        if let Some(size) = change.size_bytes() {
            d.insert("SizeBytes".into(), Value::from(size));
        }
        put(
            &mut d,
            "StreamViewType",
            change.stream_view_type().map(|v| v.as_str()),
        );
        doc.insert("dynamodb".into(), Value::Object(d));
    }
    if let Some(identity) = r.user_identity() {
        let mut who = Map::new();
        put(&mut who, "principalId", identity.principal_id());
        put(&mut who, "type", identity.r#type());
        doc.insert("userIdentity".into(), Value::Object(who));
    }
    Ok(Value::Object(doc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodbstreams::primitives::{Blob, DateTime};
    use aws_sdk_dynamodbstreams::types::{
        Identity, OperationType, StreamRecord as Change, StreamViewType,
    };
    use serde_json::json;

    fn s(v: &str) -> AttributeValue {
        AttributeValue::S(v.to_string())
    }

    #[test]
    fn every_attribute_type_is_written_as_the_services_typed_json() {
        // The shape a processor written for the adapter reads, one case per type.
        let cases = [
            (s("a"), json!({"S": "a"})),
            (AttributeValue::N("-1.5E3".into()), json!({"N": "-1.5E3"})),
            (
                AttributeValue::B(Blob::new(vec![1, 2, 255])),
                json!({"B": "AQL/"}),
            ),
            (
                AttributeValue::Ss(vec!["x".into(), "y".into()]),
                json!({"SS": ["x", "y"]}),
            ),
            (
                AttributeValue::Ns(vec!["1".into(), "2.5".into()]),
                json!({"NS": ["1", "2.5"]}),
            ),
            (
                AttributeValue::Bs(vec![Blob::new(vec![0]), Blob::new(b"hi".to_vec())]),
                json!({"BS": ["AA==", "aGk="]}),
            ),
            (
                AttributeValue::M(HashMap::from([(
                    "k".to_string(),
                    AttributeValue::Bool(true),
                )])),
                json!({"M": {"k": {"BOOL": true}}}),
            ),
            (
                AttributeValue::L(vec![s("x"), AttributeValue::Null(true)]),
                json!({"L": [{"S": "x"}, {"NULL": true}]}),
            ),
            (AttributeValue::Null(true), json!({"NULL": true})),
            (AttributeValue::Bool(false), json!({"BOOL": false})),
            (AttributeValue::L(vec![]), json!({"L": []})),
            (AttributeValue::M(HashMap::new()), json!({"M": {}})),
        ];
        for (value, want) in cases {
            assert_eq!(attribute(&value).expect("writes"), want, "{value:?}");
        }
    }

    #[test]
    fn a_record_is_the_adapters_document_with_typed_images() {
        let keys = HashMap::from([("pk".to_string(), s("a"))]);
        let mut old = keys.clone();
        old.insert("n".into(), AttributeValue::N("1".into()));
        let mut new = keys.clone();
        new.insert("n".into(), AttributeValue::N("2".into()));
        let change = Change::builder()
            .set_keys(Some(keys))
            .set_new_image(Some(new))
            .set_old_image(Some(old))
            .sequence_number("000000000000000000002")
            .size_bytes(19)
            .stream_view_type(StreamViewType::NewAndOldImages)
            .approximate_creation_date_time(DateTime::from_secs(1_796_550_060))
            .build();
        let r = StreamRecord::builder()
            .event_id("e1")
            .event_name(OperationType::Modify)
            .event_version("1.1")
            .event_source("aws:dynamodb")
            .aws_region("us-east-1")
            .dynamodb(change)
            .user_identity(
                Identity::builder()
                    .principal_id("dynamodb.amazonaws.com")
                    .r#type("Service")
                    .build(),
            )
            .build();
        assert_eq!(
            document(&r).expect("writes"),
            json!({
                "eventID": "e1", "eventName": "MODIFY", "eventVersion": "1.1",
                "eventSource": "aws:dynamodb", "awsRegion": "us-east-1",
                "dynamodb": {
                    "ApproximateCreationDateTime": 1_796_550_060_000_i64,
                    "Keys": {"pk": {"S": "a"}},
                    "NewImage": {"pk": {"S": "a"}, "n": {"N": "2"}},
                    "OldImage": {"pk": {"S": "a"}, "n": {"N": "1"}},
                    "SequenceNumber": "000000000000000000002",
                    "SizeBytes": 19,
                    "StreamViewType": "NEW_AND_OLD_IMAGES"
                },
                "userIdentity": {"principalId": "dynamodb.amazonaws.com", "type": "Service"}
            })
        );
    }
}
