use super::*;
use bytes::Bytes;
use changefeed::model::{Continuation, Record, Timestamp};

#[test]
fn records_are_json_lines_with_text_or_base64_data() {
    // The handler protocol: one object per record; data as text when UTF-8, else data_b64.
    let p = PartitionId::new("3").expect("valid");
    let batch = Batch {
        records: vec![
            Record {
                key: "k".into(),
                data: Bytes::from_static(b"hello"),
                continuation: Continuation::new("3:1"),
                timestamp: Some(Timestamp(5)),
            },
            Record {
                key: "k".into(),
                data: Bytes::from_static(&[0xff, 0x00]),
                continuation: Continuation::new("3:2"),
                timestamp: None,
            },
        ],
        continuation: Some(Continuation::new("3:2")),
        end_of_partition: false,
    };
    let text = String::from_utf8(encode_batch(&p, &batch)).expect("utf-8");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(
        lines[0],
        serde_json::json!({"partition":"3","key":"k","data":"hello","continuation":"3:1","timestamp":5})
    );
    assert_eq!(
        lines[1],
        serde_json::json!({"partition":"3","key":"k","data_b64":"/wA=","continuation":"3:2","timestamp":null})
    );
}
