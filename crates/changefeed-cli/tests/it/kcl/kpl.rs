//! Records the Kinesis Producer Library aggregated, read by `changefeed run --properties FILE`
//! with the real `amazon_kclpy`: user records with their sub-sequence numbers, a checkpoint
//! inside an aggregate, and the user records outside the shard that the KCL drops.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use changefeed_kinesis::{AwsOptions, KinesisFeed};
use serde_json::Value;

use super::{
    checkpoints_answered, endpoint, kclpy_python, ledger, put, rand_suffix, seq, start_host,
    stream, write_properties,
};
use crate::support::{bin, json, rt, run_ok, wait_for, KillOnDrop, FAST};

/// Puts, in order, one Kinesis record per group of user records: for a group `(a, b)` with
/// `a < b` the KPL-aggregated record of `r-a`..=`r-b` made by the official aggregator
/// (`aggregate.py`, PyPI `aws_kinesis_agg`), for `(a, a)` the plain record `r-a`.
fn put_aggregated(python: &str, feed: &KinesisFeed, groups: &[(usize, usize)]) {
    for &(first, last) in groups {
        if first == last {
            put(feed, first..first + 1);
        } else {
            put_from_aggregator(python, feed, &[format!("{first}-{last}")]);
        }
    }
}

/// Runs `aggregate.py` with `args` and puts the aggregated records it prints, in order.
pub(super) fn put_from_aggregator(python: &str, feed: &KinesisFeed, args: &[String]) {
    use base64::Engine as _;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/aggregate.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(args)
        .output()
        .expect("run aggregate.py");
    assert!(
        out.status.success(),
        "aggregate.py failed (the PyPI package aws_kinesis_agg is needed in the amazon_kclpy \
         venv; `bash .ci/run` installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line: Value = serde_json::from_str(line).expect("aggregate.py's JSON line");
        let data = base64::engine::general_purpose::STANDARD
            .decode(line["data"].as_str().expect("data"))
            .expect("base64");
        let ehk = line["ehk"]
            .as_str()
            .map(|h| h.parse::<u128>().expect("explicit hash key"));
        rt().block_on(feed.put(line["pk"].as_str().expect("pk"), data, ehk))
            .expect("put the aggregated record");
    }
}

/// The user records a host delivered, in order: (data, sequence number, sub-sequence number).
fn records_of(entries: &[Value], host: &str) -> Vec<(String, String, u64)> {
    entries
        .iter()
        .filter(|e| e["ev"] == "rec" && e["host"] == host)
        .map(|e| {
            (
                e["data"].as_str().expect("data").to_string(),
                e["seq"].as_str().expect("seq").to_string(),
                e["sub"].as_u64().expect("sub"),
            )
        })
        .collect()
}

#[test]
fn kpl_aggregated_records_arrive_as_user_records_and_resume_after_a_sub_sequence_checkpoint() {
    // Records aggregated by the official KPL-compatible aggregator reach an amazon_kclpy
    // processor as their user records: each once, in order, sharing the Kinesis record's
    // sequence number with sub-sequence numbers 0..n-1, in batches of at most maxRecords that
    // split aggregated records. A checkpoint at a sub-sequence number is stored there, and a
    // host started after a SIGKILL resumes right after it, as the KCL does.
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let unique = format!("kclagg-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let feed = rt().block_on(async {
        let feed = KinesisFeed::connect(&AwsOptions::local(kinesis.clone()), &unique).await;
        feed.create_stream(1).await.expect("create stream");
        feed
    });
    let groups = [(0, 4), (5, 5), (6, 10), (11, 14)];
    put_aggregated(&python, &feed, &groups);
    let properties = write_properties(
        dir.path(),
        &python,
        &unique,
        &kinesis,
        &dynamodb,
        "AWSCredentialsProvider = DefaultCredentialsProvider\nmaxRecords = 4\n",
    );
    let mut a = start_host(&properties, &ledger_path, "a", &[]);
    let upto = |n: usize, host: &'static str| {
        let path = ledger_path.clone();
        move || (records_of(&ledger(&path), host).len() >= n).then_some(())
    };
    wait_for(
        Duration::from_secs(60),
        "host a to deliver 15 user records",
        upto(15, "a"),
    );
    checkpoints_answered(&ledger_path);
    let got = records_of(&ledger(&ledger_path), "a");
    let data: Vec<&str> = got.iter().map(|(d, _, _)| d.as_str()).collect();
    let want: Vec<String> = (0..15).map(|i| format!("r-{i}")).collect();
    assert_eq!(data, want, "every user record once, in order");
    let mut sequence_of_group = Vec::new();
    for &(first, last) in &groups {
        let seqs: BTreeSet<&str> = got[first..=last]
            .iter()
            .map(|(_, s, _)| s.as_str())
            .collect();
        assert_eq!(
            seqs.len(),
            1,
            "one Kinesis record per group: {:?}",
            &got[first..=last]
        );
        let subs: Vec<u64> = got[first..=last].iter().map(|(_, _, sub)| *sub).collect();
        let want_subs: Vec<u64> = (0..=(last - first) as u64).collect();
        assert_eq!(
            subs, want_subs,
            "sub-sequence numbers of r-{first}..r-{last}"
        );
        sequence_of_group.push(got[first].1.clone());
    }
    assert!(
        sequence_of_group
            .windows(2)
            .all(|w| seq(&serde_json::json!(w[0])) < seq(&serde_json::json!(w[1]))),
        "the Kinesis records in order: {sequence_of_group:?}"
    );

    // The last checkpoint asked for is r-12, sub-sequence 1 of the last aggregated record:
    // stored there, and the next host resumes with r-13.
    let last_seq = sequence_of_group[3].clone();
    let last_ckpt = ledger(&ledger_path)
        .into_iter()
        .rev()
        .find(|e| e["ev"] == "ckpt")
        .expect("a checkpoint");
    assert_eq!(
        (&last_ckpt["seq"], &last_ckpt["sub"]),
        (&serde_json::json!(last_seq), &serde_json::json!(1))
    );
    a.0.kill().expect("SIGKILL host a");
    let _ = a.0.wait();
    let store = format!("dynamodb://{unique}?endpoint={dynamodb}&region=us-east-1");
    let table = json(&run_ok(&[
        "status", "--store", &store, "--group", &unique, "--json",
    ]));
    assert_eq!(
        table["leases"][0]["continuation"],
        serde_json::json!(format!("{last_seq}/1")),
        "the checkpoint is stored at the sub-sequence number: {table}"
    );
    put_aggregated(&python, &feed, &[(15, 17)]);
    let b = start_host(&properties, &ledger_path, "b", &[]);
    wait_for(
        Duration::from_secs(60),
        "host b to deliver the rest",
        upto(5, "b"),
    );
    let entries = ledger(&ledger_path);
    let init = entries
        .iter()
        .find(|e| e["ev"] == "init" && e["host"] == "b")
        .expect("host b initialized the shard");
    assert_eq!(
        (&init["seq"], &init["sub"]),
        (&serde_json::json!(last_seq), &serde_json::json!(1)),
        "{init}"
    );
    let got_b = records_of(&entries, "b");
    let data_b: Vec<&str> = got_b.iter().map(|(d, _, _)| d.as_str()).collect();
    assert_eq!(
        data_b,
        ["r-13", "r-14", "r-15", "r-16", "r-17"],
        "host b resumes right after the sub-sequence checkpoint"
    );
    assert_eq!(
        (got_b[0].1.as_str(), got_b[0].2),
        (last_seq.as_str(), 2),
        "r-13 keeps its place in the aggregated record"
    );
    drop(b);
    rt().block_on(feed.delete_stream()).expect("delete stream");
}

#[test]
fn the_deliver_outside_shard_flag_keeps_the_aggregates_the_kcl_drops() {
    // `--kinesis-deliver-outside-shard` reaches the Kinesis source of `changefeed run`: of a
    // KPL-aggregated record holding a user record whose explicit hash key lies in the other
    // shard (made by awslabs' `aws_kinesis_agg`), a host without the flag delivers nothing, as
    // the KCL drops it whole; a host with it delivers every user record, in order.
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let unique = format!("kploutside-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let feed = stream(&kinesis, &unique);
    let shards = rt().block_on(feed.shards()).expect("shards");
    let range = |i: usize| {
        let r = shards[i].hash_key_range().expect("hash key range");
        (
            r.starting_hash_key().to_string(),
            r.ending_hash_key().to_string(),
        )
    };
    let (inside, outside) = if range(0).0 == "0" { (0, 1) } else { (1, 0) };
    let user = |n: usize, out: bool| {
        let (lo, hi) = range(if out { outside } else { inside });
        serde_json::json!([n, "ehk", lo, hi])
    };
    // A: r-0, r-1; B: r-2, r-3 (hash key in the other shard), r-4; C: r-5.
    let groups = serde_json::json!([
        [user(0, false), user(1, false)],
        [user(2, false), user(3, true), user(4, false)],
        [user(5, false)],
    ]);
    put_from_aggregator(&python, &feed, &["--hash".into(), groups.to_string()]);
    let source = format!("kinesis://{unique}?endpoint={kinesis}&region=us-east-1");
    let out = |group: &str| dir.path().join(format!("{group}.jsonl"));
    let host = |group: &str, extra: &[&str]| {
        KillOnDrop(
            bin()
                .args(["run", "--store"])
                .arg(format!(
                    "sqlite://{}",
                    dir.path().join(format!("{group}.db")).display()
                ))
                .args(["--source", &source, "--group", group, "--host", "h"])
                .arg("--handler")
                .arg(format!("cat >> '{}'", out(group).display()))
                .args(FAST)
                .args(extra)
                .env("AWS_REGION", "us-east-1")
                .stdin(Stdio::null())
                .spawn()
                .expect("start changefeed run"),
        )
    };
    let delivered = |group: &str| -> Vec<String> {
        std::fs::read_to_string(out(group))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("a record line");
                v["data"].as_str().expect("data").to_string()
            })
            .collect()
    };
    let dropping = host("dropping", &[]);
    let keeping = host("keeping", &["--kinesis-deliver-outside-shard"]);
    wait_for(
        Duration::from_secs(60),
        "both hosts to deliver r-5, which follows the aggregate B",
        || {
            ["dropping", "keeping"]
                .iter()
                .all(|g| delivered(g).iter().any(|d| d == "r-5"))
                .then_some(())
        },
    );
    assert_eq!(
        delivered("dropping"),
        ["r-0", "r-1", "r-5"],
        "B dropped whole, as the KCL"
    );
    assert_eq!(
        delivered("keeping"),
        ["r-0", "r-1", "r-2", "r-3", "r-4", "r-5"],
        "every user record with the flag"
    );
    drop((dropping, keeping));
    rt().block_on(feed.delete_stream()).expect("delete stream");
}
