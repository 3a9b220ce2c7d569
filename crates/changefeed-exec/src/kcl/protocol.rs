//! The KCL MultiLangDaemon's messages, as JSON lines, in both directions. Pure: no I/O.
//!
//! To the child (each one line): `initialize`, `processRecords` (records with `"action":
//! "record"`, base64 `data`, `partitionKey`, `sequenceNumber`, `subSequenceNumber`,
//! `approximateArrivalTimestamp` in epoch milliseconds; and `millisBehindLatest`), `checkpoint`
//! (the answer to the child's request, with `error` naming the exception when it failed),
//! `leaseLost`, `shardEnded`, `shutdownRequested`. From the child: `checkpoint` requests
//! (`sequenceNumber` null means "at the last record delivered") and `status` replies naming the
//! message they answer (`responseFor`). The field names and `action` values are those of the
//! Java daemon's `software.amazon.kinesis.multilang.messages` and of `amazon_kclpy`'s
//! `messages.py`, which decodes every object (records included) by its `action`.

use base64::Engine as _;
use changefeed::model::Record;
use changefeed_kinesis::ExtendedSequenceNumber;
use serde::{Deserialize, Serialize};

/// A message the daemon writes to the child.
#[derive(Serialize, Debug)]
#[serde(tag = "action", rename_all = "camelCase")]
pub(crate) enum ToChild<'a> {
    #[serde(rename_all = "camelCase")]
    Initialize {
        shard_id: &'a str,
        /// The lease's checkpoint, or `TRIM_HORIZON` / `LATEST` / `AT_TIMESTAMP` for a lease
        /// that has none yet (the KCL's sentinel values).
        sequence_number: &'a str,
        sub_sequence_number: u64,
    },
    #[serde(rename_all = "camelCase")]
    ProcessRecords {
        records: Vec<RecordJson<'a>>,
        millis_behind_latest: i64,
    },
    #[serde(rename_all = "camelCase")]
    Checkpoint {
        sequence_number: Option<&'a str>,
        sub_sequence_number: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
    },
    LeaseLost,
    ShardEnded,
    ShutdownRequested,
}

/// One record of `processRecords`, as the Java daemon's `JsonFriendlyRecord` writes it.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RecordJson<'a> {
    action: &'static str,
    data: String,
    partition_key: &'a str,
    sequence_number: &'a str,
    sub_sequence_number: u64,
    approximate_arrival_timestamp: i64,
}

/// The sequence and sub-sequence numbers the child sees for a continuation: a Kinesis user
/// record's own (`SEQ/SUB` for a user record of a KPL-aggregated record, [`changefeed_kinesis::ExtendedSequenceNumber`]),
/// or the continuation itself and 0 for any other source.
pub(crate) fn position(continuation: &str) -> (&str, u64) {
    ExtendedSequenceNumber::parse(continuation)
        .map_or((continuation, 0), |e| (e.sequence_number, e.sub()))
}

impl<'a> RecordJson<'a> {
    pub(crate) fn new(r: &'a Record) -> Self {
        let (sequence_number, sub_sequence_number) = position(r.continuation.as_str());
        RecordJson {
            action: "record",
            data: base64::engine::general_purpose::STANDARD.encode(&r.data),
            partition_key: &r.key,
            sequence_number,
            sub_sequence_number,
            // A source without arrival times: the epoch, as a number (the clients need one).
            approximate_arrival_timestamp: r.timestamp.map_or(0, |t| t.millis()),
        }
    }
}

/// A message the child writes to the daemon.
#[derive(Deserialize, Debug, PartialEq, Eq)]
#[serde(tag = "action", rename_all = "camelCase")]
pub(crate) enum FromChild {
    /// Checkpoint at `sequence_number`, or at the last record delivered when it is null.
    #[serde(rename_all = "camelCase")]
    Checkpoint {
        #[serde(default)]
        sequence_number: Option<String>,
        #[serde(default)]
        sub_sequence_number: Option<u64>,
    },
    /// The child finished handling the message named `response_for`.
    #[serde(rename_all = "camelCase")]
    Status { response_for: String },
}

/// What one line from the child is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Line {
    Message(FromChild),
    /// Not a protocol message: not JSON, JSON without an `action`, or an `action` the
    /// protocol does not define (a logger or a library printing to stdout). The Java daemon
    /// skips such a line ("Skipping unexpected line on STDOUT") and so do we.
    Other,
}

/// The `action`s of the messages the daemon sends: a child that sends one broke the
/// protocol, whereas an `action` no message has is some other program's output.
const TO_CHILD: [&str; 7] = [
    "initialize",
    "processRecords",
    "record",
    "shutdown",
    "shutdownRequested",
    "leaseLost",
    "shardEnded",
];

/// Encodes a message as one line (without the newline).
pub(crate) fn encode(message: &ToChild<'_>) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(message)
}

/// Decodes one line from the child. A line with a `checkpoint` or `status` action must be
/// that message whole; a line with the action of a message only the daemon sends is an error
/// too; anything else is [`Line::Other`]. The error names what is wrong with the line.
pub(crate) fn decode(line: &str) -> Result<Line, String> {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
        return Ok(Line::Other);
    };
    let Some(serde_json::Value::String(action)) = value.get("action") else {
        return Ok(Line::Other);
    };
    match action.as_str() {
        "checkpoint" | "status" => {}
        a if TO_CHILD.contains(&a) => {
            return Err(format!(
                "sent \"{a}\", a message only the daemon sends (a child sends checkpoint or status): {}",
                crate::lines::quote(line)
            ))
        }
        _ => return Ok(Line::Other),
    }
    serde_json::from_value(value)
        .map(Line::Message)
        .map_err(|e| {
            format!(
                "sent a malformed message ({e}): {}",
                crate::lines::quote(line)
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use changefeed::model::{Continuation, Timestamp};
    use serde_json::json;

    fn value(m: &ToChild<'_>) -> serde_json::Value {
        serde_json::from_slice(&encode(m).expect("encodes")).expect("json")
    }

    #[test]
    fn messages_to_the_child_have_the_java_daemons_fields() {
        assert_eq!(
            value(&ToChild::Initialize {
                shard_id: "shardId-000000000001",
                sequence_number: "TRIM_HORIZON",
                sub_sequence_number: 0
            }),
            json!({"action":"initialize","shardId":"shardId-000000000001","sequenceNumber":"TRIM_HORIZON","subSequenceNumber":0})
        );
        let r = Record {
            key: "pk".into(),
            data: Bytes::from_static(b"hi"),
            continuation: Continuation::new("4960"),
            timestamp: Some(Timestamp(1_700_000_000_000)),
        };
        assert_eq!(
            value(&ToChild::ProcessRecords {
                records: vec![RecordJson::new(&r)],
                millis_behind_latest: 5
            }),
            json!({"action":"processRecords","millisBehindLatest":5,"records":[
                {"action":"record","data":"aGk=","partitionKey":"pk","sequenceNumber":"4960",
                 "subSequenceNumber":0,"approximateArrivalTimestamp":1_700_000_000_000_i64}]})
        );
        assert_eq!(
            value(&ToChild::Checkpoint {
                sequence_number: Some("4960"),
                sub_sequence_number: Some(0),
                error: Some("ShutdownException")
            }),
            json!({"action":"checkpoint","sequenceNumber":"4960","subSequenceNumber":0,"error":"ShutdownException"})
        );
        assert_eq!(value(&ToChild::LeaseLost), json!({"action":"leaseLost"}));
        assert_eq!(value(&ToChild::ShardEnded), json!({"action":"shardEnded"}));
        assert_eq!(
            value(&ToChild::ShutdownRequested),
            json!({"action":"shutdownRequested"})
        );
    }

    #[test]
    fn a_user_record_of_an_aggregated_record_has_its_sub_sequence_number() {
        let r = Record {
            key: "pk".into(),
            data: Bytes::from_static(b"hi"),
            continuation: Continuation::new("4960/2"),
            timestamp: None,
        };
        let v = value(&ToChild::ProcessRecords {
            records: vec![RecordJson::new(&r)],
            millis_behind_latest: 0,
        });
        assert_eq!(v["records"][0]["sequenceNumber"], "4960");
        assert_eq!(v["records"][0]["subSequenceNumber"], 2);
        // Another source's continuation is passed on whole.
        assert_eq!(position("0:17"), ("0:17", 0));
    }

    #[test]
    fn child_messages_decode_and_bad_ones_are_named() {
        assert_eq!(
            decode(
                r#"{"action": "checkpoint", "sequenceNumber": null, "subSequenceNumber": null}"#
            ),
            Ok(Line::Message(FromChild::Checkpoint {
                sequence_number: None,
                sub_sequence_number: None
            }))
        );
        assert_eq!(
            decode(r#"{"action":"checkpoint","sequenceNumber":"49","subSequenceNumber":0}"#),
            Ok(Line::Message(FromChild::Checkpoint {
                sequence_number: Some("49".into()),
                sub_sequence_number: Some(0)
            }))
        );
        assert_eq!(
            decode(r#"{"action": "status", "responseFor": "processRecords"}"#),
            Ok(Line::Message(FromChild::Status {
                response_for: "processRecords".into()
            }))
        );
        let missing = decode(r#"{"action":"status"}"#).expect_err("no responseFor");
        assert!(
            missing.contains("malformed") && missing.contains("responseFor"),
            "{missing}"
        );
        let bad_type = decode(r#"{"action":"checkpoint","sequenceNumber":5}"#)
            .expect_err("a number for a string");
        assert!(
            bad_type.contains("malformed") && bad_type.contains("expected a string"),
            "{bad_type}"
        );
        let wrong_way = decode(r#"{"action":"processRecords","records":[]}"#)
            .expect_err("the daemon's message");
        assert!(
            wrong_way.contains(r#"sent "processRecords", a message only the daemon sends"#),
            "{wrong_way}"
        );
    }

    #[test]
    fn lines_that_are_not_protocol_messages_are_other_output() {
        // What the Java daemon skips as "unexpected line on STDOUT": a structured logger's
        // JSON, plain text, JSON that is not an object, an action no message has, and a line
        // that is not JSON at all (even one that starts like an object).
        for line in [
            r#"{"level":"info","msg":"starting record processor"}"#,
            "debug output",
            "[1, 2]",
            "42",
            r#"{"action":"log","msg":"x"}"#,
            r#"{"action":7}"#,
            r#"{"action":"status", "#,
            "{not json",
        ] {
            assert_eq!(decode(line), Ok(Line::Other), "{line}");
        }
    }
}
