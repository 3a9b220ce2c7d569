//! A host joining a running fleet in KCL mode: the lease it takes moves by a graceful
//! hand-off, so nothing the first host's record processor delivered is delivered again.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use changefeed::model::PartitionId;
use serde_json::Value;

use super::{kclpy_python, ledger};
use crate::support::{read, terminate, wait_exit, wait_for, Fixture, KillOnDrop};

/// Record indices the test processor never checkpoints at by itself (it checkpoints at
/// multiples of 3): every checkpoint comes from `shutdownRequested` or a shard's end.
fn indices(range: std::ops::Range<usize>) -> Vec<usize> {
    range.filter(|i| i % 3 != 0).collect()
}

fn append(fx: &Fixture, indices: &[usize]) {
    fx.with_feed(async |feed| {
        for i in indices {
            let p = PartitionId::new((i % 2).to_string()).expect("id");
            feed.append_to(&p, &format!("key-{i}"), format!("r-{i}"))
                .await
                .expect("append");
        }
    });
}

fn host(fx: &Fixture, name: &str, ledger: &Path) -> KillOnDrop {
    super::sqlite_kcl_host(crate::support::bin(), fx, name, ledger)
}

/// How many times each record was delivered, by data.
fn deliveries(entries: &[Value]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for e in entries.iter().filter(|e| e["ev"] == "rec") {
        *counts
            .entry(e["data"].as_str().unwrap_or_default().to_string())
            .or_insert(0) += 1;
    }
    counts
}

#[test]
fn a_host_joining_takes_its_lease_by_a_graceful_hand_off_with_nothing_delivered_again() {
    // KCL 3.x's graceful lease hand-off: when h2 joins, h1's record processor for the lease
    // that moves gets shutdownRequested (not leaseLost) and checkpoints where it is; h2's
    // processor starts right after it. The processor checkpoints at nothing else, so without
    // the hand-off every record of that shard would be delivered again.
    let fx = Fixture::new();
    fx.with_feed(async |feed| feed.create_partitions(2).await.expect("partitions"));
    let first = indices(1..60);
    append(&fx, &first);
    let ledger_path = fx.path("ledger.jsonl");
    let mut h1 = host(&fx, "h1", &ledger_path);
    wait_for(Duration::from_secs(60), "h1 delivered every record", || {
        assert!(
            h1.0.try_wait().expect("try_wait").is_none(),
            "h1 exited: {}",
            read(&fx.path("h1.stderr"))
        );
        (deliveries(&ledger(&ledger_path)).len() == first.len()).then_some(())
    });
    let mut h2 = host(&fx, "h2", &ledger_path);
    wait_for(Duration::from_secs(60), "h2 started a processor", || {
        ledger(&ledger_path)
            .iter()
            .any(|e| e["ev"] == "init" && e["host"] == "h2")
            .then_some(())
    });
    let later = indices(60..120);
    append(&fx, &later);
    wait_for(Duration::from_secs(60), "every record delivered", || {
        (deliveries(&ledger(&ledger_path)).len() == first.len() + later.len()).then_some(())
    });
    let entries = ledger(&ledger_path);
    let again: Vec<(String, usize)> = deliveries(&entries)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(again.is_empty(), "records delivered again: {again:?}");
    let h1_said = |ev: &str| {
        entries
            .iter()
            .filter(|e| e["host"] == "h1" && e["ev"] == ev)
            .count()
    };
    assert_eq!(
        h1_said("shutdown_requested"),
        1,
        "h1's processor asked to finish: {entries:?}"
    );
    assert_eq!(
        h1_said("lost"),
        0,
        "no leaseLost for a planned move: {entries:?}"
    );
    assert!(
        entries
            .iter()
            .any(|e| e["ev"] == "rec" && e["host"] == "h2"),
        "h2 delivers its shard's new records"
    );
    for h in [&mut h2, &mut h1] {
        terminate(&h.0);
        let status = wait_exit(&mut h.0, Duration::from_secs(15));
        assert!(status.success(), "graceful stop: {status}");
    }
}

#[test]
fn on_kinesis_a_host_joining_a_properties_file_fleet_delivers_nothing_again() {
    // The same, as a KCL application runs: the properties file (sample keys, local endpoints),
    // a kinesis-mock stream of two shards, the leases in DynamoDB Local; polling.
    joining_a_properties_file_fleet("retrievalMode = POLLING\n");
}

#[test]
fn on_kinesis_with_fan_out_a_host_joining_a_properties_file_fleet_delivers_nothing_again() {
    // As the KCL reads by default: enhanced fan-out, each host subscribing to its shards.
    joining_a_properties_file_fleet("retrievalMode = FANOUT\n");
}

fn joining_a_properties_file_fleet(retrieval: &str) {
    let python = kclpy_python();
    let kinesis = super::endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = super::endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let app = format!("kclhandoff-{}-{}", std::process::id(), super::rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let properties = super::write_properties(
        dir.path(),
        &python,
        &app,
        &kinesis,
        &dynamodb,
        &format!("AWSCredentialsProvider = DefaultCredentialsProvider\n{retrieval}"),
    );
    let feed = super::stream(&kinesis, &app);
    let put = |range: std::ops::Range<usize>| -> Vec<usize> {
        let chosen = indices(range);
        crate::support::rt().block_on(async {
            for i in &chosen {
                feed.put(&format!("key-{i}"), format!("r-{i}").into_bytes(), None)
                    .await
                    .expect("put");
            }
        });
        chosen
    };
    let first = put(0..40);
    let _a = super::start_host(&properties, &ledger_path, "a", &[]);
    wait_for(
        Duration::from_secs(60),
        "host a delivered every record",
        || (deliveries(&ledger(&ledger_path)).len() == first.len()).then_some(()),
    );
    let _b = super::start_host(&properties, &ledger_path, "b", &[]);
    wait_for(
        Duration::from_secs(60),
        "host b started a processor",
        || {
            ledger(&ledger_path)
                .iter()
                .any(|e| e["ev"] == "init" && e["host"] == "b")
                .then_some(())
        },
    );
    let later = put(40..80);
    wait_for(Duration::from_secs(60), "every record delivered", || {
        (deliveries(&ledger(&ledger_path)).len() == first.len() + later.len()).then_some(())
    });
    let entries = ledger(&ledger_path);
    let again: Vec<(String, usize)> = deliveries(&entries)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(again.is_empty(), "records delivered again: {again:?}");
    let said = |host: &str, ev: &str| {
        entries
            .iter()
            .filter(|e| e["host"] == host && e["ev"] == ev)
            .count()
    };
    assert_eq!(said("a", "shutdown_requested"), 1, "{entries:?}");
    assert_eq!(said("a", "lost"), 0, "no leaseLost for a planned move");
    // Fan-out reads through one consumer named after the application; polling registers none.
    let consumers = super::stream_consumers(&feed, &app);
    let want = if retrieval.contains("FANOUT") {
        vec![app.clone()]
    } else {
        Vec::new()
    };
    assert_eq!(consumers, want);
    crate::support::rt()
        .block_on(feed.delete_stream())
        .expect("delete stream");
}
