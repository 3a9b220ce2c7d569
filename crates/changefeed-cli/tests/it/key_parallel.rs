//! `changefeed run --key-concurrency 4`: a real host process whose handler calls run four at
//! a time, one key each, killed mid-flight and replaced by another host: per-batch commands,
//! and long-lived `lines` processes (four per partition).

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use changefeed::model::{Continuation, PartitionId};
use serde_json::Value;

use crate::support::{bin, read, wait_for, Fixture, KillOnDrop, FAST};

const KEYS: usize = 8;
const PER_KEY: usize = 25;
const BATCH: usize = 40;

/// A host of group `g` running `handler` over `protocol` with four key-parallel calls.
fn host(fx: &Fixture, name: &str, protocol: &str, handler: &str) -> KillOnDrop {
    let batch = BATCH.to_string();
    KillOnDrop(
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--handler", handler, "--host", name, "--group", "g"])
            .args(["--protocol", protocol])
            .args(["--key-concurrency", "4", "--max-batch-size", &batch])
            .args(FAST)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start run"),
    )
}

/// Rule 4 of DESIGN.md with key-parallel calls: a host killed while calls are in flight loses
/// nothing, each key's records arrive in order, and what is delivered twice is within the
/// batch in flight (the checkpoint stands before the oldest record not done).
#[test]
fn killed_key_parallel_host_loses_nothing_and_keeps_each_keys_order() {
    // Each call takes a while, then appends its records (one write per line).
    killed_host_loses_nothing(Protocol::Batch);
}

/// The same with long-lived `lines` processes, each answering a line of one key's records.
#[test]
fn killed_key_parallel_lines_host_loses_nothing_and_keeps_each_keys_order() {
    killed_host_loses_nothing(Protocol::Lines);
}

#[derive(Clone, Copy)]
enum Protocol {
    Batch,
    Lines,
}

/// The lines handler: per line, a while, then its records appended, then the ack.
const LINES_HANDLER: &str = r#"
import json, sys, time
out = open(sys.argv[1], "a")
for line in sys.stdin:
    records = json.loads(line)["records"]
    time.sleep(0.2)
    out.write("".join(json.dumps(r) + "\n" for r in records))
    out.flush()
    print(json.dumps({"ack": records[-1]["continuation"]}), flush=True)
"#;

fn killed_host_loses_nothing(protocol: Protocol) {
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for seq in 0..PER_KEY {
            for k in 0..KEYS {
                feed.append_to(&p, &format!("k{k}"), seq.to_string())
                    .await
                    .expect("append");
            }
        }
    });
    let delivered = fx.path("delivered.jsonl");
    let (name, handler) = match protocol {
        Protocol::Batch => (
            "batch",
            format!(
                "input=$(cat); sleep 0.2; printf '%s\\n' \"$input\" >> '{}'",
                delivered.display()
            ),
        ),
        Protocol::Lines => {
            let script = fx.path("keyed_lines.py");
            std::fs::write(&script, LINES_HANDLER).expect("write the lines handler");
            (
                "lines",
                format!("python3 '{}' '{}'", script.display(), delivered.display()),
            )
        }
    };
    let mut first = host(&fx, "h1", name, &handler);
    wait_for(
        Duration::from_secs(30),
        "a batch and a half delivered",
        || (read(&delivered).lines().count() >= BATCH + BATCH / 2).then_some(()),
    );
    first.0.kill().expect("SIGKILL the first host");
    first.0.wait().expect("reap the first host");
    let _second = host(&fx, "h2", name, &handler);
    let last = Continuation::new(format!("0:{}", KEYS * PER_KEY));
    wait_for(
        Duration::from_secs(60),
        "the checkpoint at the last record",
        || (fx.lease("g", "0")?.continuation == Some(last.clone())).then_some(()),
    );

    let mut per_key: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut total = 0;
    for line in read(&delivered).lines().filter(|l| !l.is_empty()) {
        let record: Value = serde_json::from_str(line).expect("a JSON line");
        let key = record["key"].as_str().expect("key").to_string();
        let seq = record["data"].as_str().expect("data").parse().expect("seq");
        per_key.entry(key).or_default().push(seq);
        total += 1;
    }
    assert_eq!(per_key.len(), KEYS, "{per_key:?}");
    for (key, got) in &per_key {
        // In order, nothing lost: the first delivery of each record comes in sequence.
        let mut firsts = got.clone();
        firsts.dedup_by(|b, a| b <= a);
        assert_eq!(firsts, (0..PER_KEY).collect::<Vec<_>>(), "{key}: {got:?}");
    }
    let repeated = total - KEYS * PER_KEY;
    assert!(
        repeated <= BATCH,
        "{repeated} records delivered twice, more than the batch in flight ({BATCH})"
    );
}
