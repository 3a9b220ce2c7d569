//! A record processor written for the KCL's DynamoDB Streams Kinesis adapter
//! (`adapter_processor.py`, on the real `amazon_kclpy`) reads a DynamoDB Local table's stream
//! under `changefeed run`: first started from the adapter's KCL properties file (the stream ARN
//! as `streamName`), then restarted with `--protocol kcl` and `--source`, neither naming a
//! record shape.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use base64::Engine as _;
use changefeed_dynamodb::{AwsOptions, StreamTable};
use serde_json::{json, Value};

use super::{checkpoints_answered, endpoint, kclpy_python, ledger, rand_suffix, seq};
use crate::support::KillOnDrop;
use crate::support::{bin, json as stdout_json, read, rt, run_ok, terminate, wait_exit, wait_for};

/// Change `i` as a byte of the item's binary attributes.
fn byte(i: usize) -> u8 {
    u8::try_from(i).expect("fewer than 256 changes")
}

/// The item `key` holds after change `i`: one attribute of each kind a processor reads.
fn item(key: &str, i: usize) -> HashMap<String, AttributeValue> {
    let n = AttributeValue::N(i.to_string());
    HashMap::from([
        ("pk".to_string(), AttributeValue::S(key.to_string())),
        ("n".to_string(), n.clone()),
        ("flag".to_string(), AttributeValue::Bool(i % 2 == 0)),
        (
            "tags".to_string(),
            AttributeValue::Ss(vec![format!("t{i}")]),
        ),
        ("nums".to_string(), AttributeValue::Ns(vec![i.to_string()])),
        (
            "blob".to_string(),
            AttributeValue::B(Blob::new(vec![byte(i), 255])),
        ),
        (
            "blobs".to_string(),
            AttributeValue::Bs(vec![Blob::new(vec![byte(i)])]),
        ),
        (
            "nested".to_string(),
            AttributeValue::M(HashMap::from([("i".to_string(), n)])),
        ),
        (
            "list".to_string(),
            AttributeValue::L(vec![
                AttributeValue::S("x".into()),
                AttributeValue::Null(true),
            ]),
        ),
    ])
}

/// [`item`] as the adapter's typed JSON, written here by hand from the service's documented
/// shape.
fn typed(key: &str, i: usize) -> Value {
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    json!({
        "pk": {"S": key},
        "n": {"N": i.to_string()},
        "flag": {"BOOL": i % 2 == 0},
        "tags": {"SS": [format!("t{i}")]},
        "nums": {"NS": [i.to_string()]},
        "blob": {"B": b64(&[byte(i), 255])},
        "blobs": {"BS": [b64(&[byte(i)])]},
        "nested": {"M": {"i": {"N": i.to_string()}}},
        "list": {"L": [{"S": "x"}, {"NULL": true}]},
    })
}

/// Each item's changes as `[eventName, NewImage, OldImage]` (null where absent).
type Changes = BTreeMap<String, Vec<Value>>;

/// Writes changes `ops` over three items (puts, and a delete of an item there at every fifth),
/// noting each in `want` as the processor must read it; `now` holds each item's last change.
fn write(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
    ops: std::ops::Range<usize>,
    now: &mut BTreeMap<String, usize>,
    want: &mut Changes,
) {
    rt().block_on(async {
        for i in ops {
            let key = format!("item-{}", i % 3);
            let old = now
                .get(&key)
                .map(|&j| typed(&key, j))
                .unwrap_or(Value::Null);
            let change = if now.contains_key(&key) && i % 5 == 3 {
                client
                    .delete_item()
                    .table_name(table)
                    .key("pk", AttributeValue::S(key.clone()))
                    .send()
                    .await
                    .expect("delete");
                now.remove(&key);
                json!(["REMOVE", null, old])
            } else {
                client
                    .put_item()
                    .table_name(table)
                    .set_item(Some(item(&key, i)))
                    .send()
                    .await
                    .expect("put");
                let name = if now.insert(key.clone(), i).is_some() {
                    "MODIFY"
                } else {
                    "INSERT"
                };
                json!([name, typed(&key, i), old])
            };
            want.entry(key).or_default().push(change);
        }
    });
}

/// The changes the processor read in `entries`, per item in the order read, after checking each
/// record's own fields: its keys, sequence number, source and view type.
fn read_changes(entries: &[Value]) -> Changes {
    let mut got = Changes::new();
    for e in entries.iter().filter(|e| e["ev"] == "rec") {
        let key = e["key"].as_str().expect("partition key");
        let c = &e["change"];
        let d = &c["dynamodb"];
        assert_eq!(d["Keys"], json!({"pk": {"S": key}}), "{e}");
        assert_eq!(d["SequenceNumber"], e["seq"], "{e}");
        assert_eq!(c["eventSource"], "aws:dynamodb", "{e}");
        assert_eq!(d["StreamViewType"], "NEW_AND_OLD_IMAGES", "{e}");
        assert!(d["ApproximateCreationDateTime"].is_i64(), "{e}");
        assert!(d["SizeBytes"].is_u64(), "{e}");
        got.entry(key.to_string()).or_default().push(json!([
            c["eventName"],
            d["NewImage"],
            d["OldImage"]
        ]));
    }
    got
}

/// How many records `entries` holds.
fn records(entries: &[Value]) -> usize {
    entries.iter().filter(|e| e["ev"] == "rec").count()
}

/// The sequence number of the last checkpoint granted in `entries`.
fn last_checkpoint(entries: &[Value]) -> Value {
    let granted: Vec<&Value> = entries
        .iter()
        .filter(|e| e["ev"] == "ckpt")
        .map(|e| &e["seq"])
        .collect();
    assert!(
        !entries.iter().any(|e| e["ev"] == "ckpt_error"),
        "every checkpoint was granted: {entries:?}"
    );
    (*granted.last().expect("a checkpoint granted")).clone()
}

/// Waits until the ledger past `from` holds `count` records and a granted checkpoint at the
/// last of them, the host alive all along.
fn wait_records(host: &mut KillOnDrop, path: &Path, stderr: &Path, from: usize, count: usize) {
    wait_for(
        Duration::from_secs(90),
        "every change read and checkpointed",
        || {
            assert!(
                host.0.try_wait().expect("try_wait").is_none(),
                "run exited: {}",
                read(stderr)
            );
            let entries = &ledger(path)[from..];
            let last = |ev: &str| {
                entries
                    .iter()
                    .rev()
                    .find(|e| e["ev"] == ev)
                    .map(|e| &e["seq"])
            };
            (records(entries) >= count && last("rec").is_some() && last("rec") == last("ckpt"))
                .then_some(())
        },
    );
}

#[test]
fn an_adapter_record_processor_reads_typed_changes_and_resumes_after_its_checkpoints() {
    let python = kclpy_python();
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let app = format!("kcladapter-{}-{}", std::process::id(), rand_suffix());
    let table = format!("{app}-items");
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let processor = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/adapter_processor.py");
    let handler = format!("'{python}' '{}'", processor.display());
    let (client, arn) = rt().block_on(async {
        let options = AwsOptions::local(dynamodb.clone());
        let arn = StreamTable::connect(&options, &table)
            .await
            .create()
            .await
            .expect("create the table with its stream");
        (aws_sdk_dynamodb::Client::new(&options.load().await), arn)
    });
    let source = format!("dynamodb-streams://{table}?endpoint={dynamodb}&region=us-east-1");
    let store = format!("dynamodb://{app}?endpoint={dynamodb}&region=us-east-1");
    let properties = dir.path().join("app.properties");
    std::fs::write(
        &properties,
        format!(
            "executableName = {handler}\nstreamName = {arn}\napplicationName = {app}\n\
             processingLanguage = python/3\ninitialPositionInStream = TRIM_HORIZON\n\
             regionName = us-east-1\nkinesisEndpoint = {dynamodb}\n\
             dynamoDBEndpoint = {dynamodb}\n"
        ),
    )
    .expect("write properties");
    let start = |args: &[&str], host: &str| {
        let stderr = dir.path().join(format!("{host}.stderr"));
        let child = bin()
            .arg("run")
            .args(args)
            .args(["--host", host])
            .args(["--acquire-interval", "200ms", "--poll-delay", "50ms"])
            .env("KCL_TEST_LEDGER", &ledger_path)
            .env("AWS_REGION", "us-east-1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start changefeed run");
        (KillOnDrop(child), stderr)
    };
    let stop = |host: &mut KillOnDrop| {
        checkpoints_answered(&ledger_path);
        terminate(&host.0);
        let status = wait_exit(&mut host.0, Duration::from_secs(30));
        assert!(status.success(), "stopped gracefully: {status}");
    };

    // The properties file of an adapter application, the table's stream ARN as streamName.
    let mut now = BTreeMap::new();
    let mut want = Changes::new();
    write(&client, &table, 0..15, &mut now, &mut want);
    let props = properties.to_str().expect("utf-8 path");
    let (mut a, a_err) = start(&["--properties", props], "a");
    wait_records(&mut a, &ledger_path, &a_err, 0, 15);
    stop(&mut a);
    let first = ledger(&ledger_path);
    assert_eq!(
        read_changes(&first),
        want,
        "every change, typed, each item's in order"
    );
    let checkpoint = last_checkpoint(&first);

    // Restarted with --protocol kcl: it resumes after the checkpoint, nothing read twice.
    let mut later = Changes::new();
    write(&client, &table, 15..24, &mut now, &mut later);
    let group = ["--store", &store, "--group", &app];
    let (mut b, b_err) = start(
        &[
            &group[..],
            &[
                "--source",
                &source,
                "--protocol",
                "kcl",
                "--handler",
                &handler,
            ],
        ]
        .concat(),
        "b",
    );
    wait_records(&mut b, &ledger_path, &b_err, first.len(), 9);
    stop(&mut b);
    let second = &ledger(&ledger_path)[first.len()..];
    let init = second
        .iter()
        .find(|e| e["ev"] == "init")
        .expect("the processor initialized");
    assert_eq!(init["seq"], checkpoint, "resumed at the checkpoint: {init}");
    let first_read = second.iter().find(|e| e["ev"] == "rec").expect("a record");
    assert!(seq(&first_read["seq"]) > seq(&checkpoint), "{first_read}");
    assert_eq!(
        read_changes(second),
        later,
        "only the later changes, typed, in order"
    );

    // The stored checkpoint is the last one the processor asked for.
    let status = stdout_json(&run_ok(&[
        "status", "--store", &store, "--group", &app, "--json",
    ]));
    let leases = status["leases"].as_array().expect("leases");
    assert_eq!(leases.len(), 1, "DynamoDB Local's one shard: {status}");
    assert_eq!(
        leases[0]["continuation"],
        last_checkpoint(second),
        "{status}"
    );
}
