//! `changefeed run --source dynamodb-streams://TABLE`: a fleet of real host processes on a
//! DynamoDB lease store reads a table's changes from DynamoDB Local's stream while items are
//! written, updated and deleted, and the host reading them is killed.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed_dynamodb::{AwsOptions, StreamTable};
use serde_json::Value;

use crate::support::{bin, read, rt, wait_for, Fixture, KillOnDrop, FAST};

/// The DynamoDB Local endpoint, or a panic saying how to start it.
fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with `bash .ci/run` \
             (or `eval \"$(bash .ci/aws-services.sh)\"`)"
        )
    })
}

/// One change as the writer made it: (event name, the item's new data or None on removal).
type Change = (&'static str, Option<String>);

/// Writes `ops` changes over `keys` items (inserts, updates and deletes in a fixed pattern),
/// returning each key's changes in the order written.
async fn write_load(
    table: &StreamTable,
    keys: usize,
    ops: std::ops::Range<usize>,
    exists: &mut BTreeSet<String>,
    want: &mut BTreeMap<String, Vec<Change>>,
) {
    for i in ops {
        let key = format!("item-{}", i % keys);
        let change = if exists.contains(&key) && i % 7 == 3 {
            table.delete(&key).await.expect("delete");
            exists.remove(&key);
            ("REMOVE", None)
        } else {
            let data = format!("v{i}");
            table.put(&key, &data).await.expect("put");
            let name = if exists.insert(key.clone()) {
                "INSERT"
            } else {
                "MODIFY"
            };
            (name, Some(data))
        };
        want.entry(key).or_default().push(change);
    }
}

/// The JSON lines a handler wrote: (host, line), in the order each host wrote them.
fn delivered(files: &[(String, std::path::PathBuf)]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (host, path) in files {
        for line in read(path).lines() {
            let v: Value = serde_json::from_str(line).expect("a JSON line");
            out.push((host.clone(), v));
        }
    }
    out
}

/// A sequence number as a sortable key: DynamoDB's are decimal numbers of varying length.
fn seq_order(s: &str) -> (usize, String) {
    let digits = s.trim_start_matches('0');
    (digits.len(), digits.to_string())
}

/// The hosts owning group `g`'s leases in `store`.
fn owners(store: &str) -> Vec<String> {
    crate::support::status(store)["leases"]
        .as_array()
        .map(|ls| {
            ls.iter()
                .filter_map(|l| l["owner"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_fleet_reads_every_table_change_in_order_while_its_reader_is_killed() {
    // DESIGN rules 1 and 4 on DynamoDB Streams: every change delivered, each item's changes
    // in order, duplicates only after the killed owner's lease is taken and at most one batch
    // of them (a joining host's hand-off adds none).
    let endpoint = endpoint();
    let fx = Fixture::new();
    let unique = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default()
    );
    let table_name = format!("streams-fleet-{unique}");
    let table = rt().block_on(async {
        let table = StreamTable::connect(&AwsOptions::local(endpoint.clone()), &table_name).await;
        table
            .create()
            .await
            .expect("create the table with its stream");
        table
    });
    let store = format!("dynamodb://leases-{unique}?endpoint={endpoint}&region=us-east-1");
    let source = format!("dynamodb-streams://{table_name}?endpoint={endpoint}&region=us-east-1");
    let batch = 10usize;
    let mut files = Vec::new();
    let mut hosts = BTreeMap::new();
    let start = |name: &str, out: &std::path::Path| {
        let handler = format!("cat >> '{}'", out.display());
        KillOnDrop(
            bin()
                .args([
                    "run", "--store", &store, "--source", &source, "--group", "g",
                ])
                .args(["--host", name, "--handler", &handler])
                .args(["--max-batch-size", &batch.to_string()])
                .args(FAST)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start run"),
        )
    };
    for name in ["h1", "h2", "h3"] {
        let out = fx.path(&format!("{name}.jsonl"));
        hosts.insert(name.to_string(), start(name, &out));
        files.push((name.to_string(), out));
    }
    // Items are written, updated and deleted before and after the kill below: the writer
    // stops halfway until the owner is dead, so the kill falls in the middle of the load.
    let killed_flag = Arc::new(AtomicBool::new(false));
    let writer = {
        let table = table.clone();
        let killed_flag = killed_flag.clone();
        std::thread::spawn(move || {
            let (mut exists, mut want) = (BTreeSet::new(), BTreeMap::new());
            rt().block_on(async {
                for step in 0..30 {
                    if step == 15 {
                        wait_for(Duration::from_secs(60), "the shard's owner killed", || {
                            killed_flag.load(Ordering::SeqCst).then_some(())
                        });
                    }
                    let ops = step * 10..(step + 1) * 10;
                    write_load(&table, 12, ops, &mut exists, &mut want).await;
                }
            });
            want
        })
    };
    // The host reading the stream's shard is killed mid-load, with no release.
    let owner = wait_for(Duration::from_secs(30), "a host to read the shard", || {
        let owners = owners(&store);
        let got = delivered(&files).len();
        (got >= 30).then(|| owners.first().cloned()).flatten()
    });
    let mut killed = hosts.remove(&owner).expect("a host of ours");
    killed.0.kill().expect("SIGKILL");
    killed.0.wait().expect("reap");
    killed_flag.store(true, Ordering::SeqCst);
    let killed_after = delivered(&files).len();
    // A host joins while the load goes on; it sorts first, so the balance may hand the shard
    // to it (a hand-off, which delivers nothing twice).
    let joined = fx.path("h0.jsonl");
    hosts.insert("h0".to_string(), start("h0", &joined));
    files.push(("h0".to_string(), joined));
    let want = writer.join().expect("the writer");
    let total: usize = want.values().map(Vec::len).sum();
    let lines = wait_for(Duration::from_secs(60), "every change delivered", || {
        let lines = delivered(&files);
        let unique: BTreeSet<String> = lines
            .iter()
            .map(|(_, l)| l["continuation"].as_str().unwrap_or_default().to_string())
            .collect();
        (unique.len() >= total).then_some(lines)
    });
    let new_owner = owners(&store);
    assert!(
        new_owner.iter().all(|o| o != &owner),
        "another host took the shard over: {new_owner:?}"
    );

    // Each host delivered each item's changes in order (sequence numbers only grow).
    let mut last: BTreeMap<(String, String), (usize, String)> = BTreeMap::new();
    let mut got: BTreeMap<String, BTreeMap<(usize, String), Change>> = BTreeMap::new();
    for (host, line) in &lines {
        let seq = seq_order(line["continuation"].as_str().expect("continuation"));
        let key = line["key"].as_str().expect("key").to_string();
        let doc: Value =
            serde_json::from_str(line["data"].as_str().expect("JSON text")).expect("a change");
        if let Some(before) = last.insert((host.clone(), key.clone()), seq.clone()) {
            assert!(
                before < seq,
                "{host} delivered {key} out of order: {before:?} then {seq:?}"
            );
        }
        let name = match doc["eventName"].as_str() {
            Some("INSERT") => "INSERT",
            Some("MODIFY") => "MODIFY",
            Some("REMOVE") => "REMOVE",
            other => panic!("an event name: {other:?}"),
        };
        let data = doc["newImage"]["data"].as_str().map(str::to_string);
        got.entry(key).or_default().insert(seq, (name, data));
    }
    // Every change arrived, and in sequence order they are the writer's order.
    let got: BTreeMap<String, Vec<Change>> = got
        .into_iter()
        .map(|(k, by_seq)| (k, by_seq.into_values().collect()))
        .collect();
    assert_eq!(
        got, want,
        "every change of every item, in the order written"
    );
    // Duplicates come only from the one ownership change, at most one batch.
    let duplicates = lines.len() - total;
    eprintln!(
        "changes={total} delivered={} duplicates={duplicates} killed={owner} after={killed_after}",
        lines.len()
    );
    assert!(
        killed_after < total,
        "the reader was killed while changes were still to come ({killed_after} of {total})"
    );
    assert!(
        duplicates <= batch,
        "{duplicates} duplicates after one ownership change by expiry (batch {batch})"
    );
    for (name, mut host) in hosts {
        crate::support::terminate(&host.0);
        let status = crate::support::wait_exit(&mut host.0, Duration::from_secs(20));
        assert!(status.success(), "{name} stops gracefully: {status}");
    }
}

#[test]
fn an_adapters_checkpoints_are_imported_and_read_on_from() {
    // A DynamoDB Streams Kinesis Adapter application's lease table has the KCL's schema with
    // stream shard ids and sequence numbers: import-kcl takes its checkpoints, and `run` reads
    // on from exactly the record after each.
    let endpoint = endpoint();
    let fx = Fixture::new();
    let unique = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default()
    );
    let table_name = format!("streams-adapter-{unique}");
    let kcl_table = format!("adapter-app-{unique}");
    let options = AwsOptions::local(endpoint.clone());
    let (shard, checkpoint) = rt().block_on(async {
        let table = StreamTable::connect(&options, &table_name).await;
        let arn = table
            .create()
            .await
            .expect("create the table with its stream");
        for i in 0..4 {
            table.put("item", &format!("v{i}")).await.expect("put");
        }
        let feed = changefeed_dynamodb::DynamoStreamsFeed::connect(
            &options,
            &changefeed_dynamodb::StreamRef::Arn(arn),
            changefeed_dynamodb::StreamsOptions::default(),
        )
        .await
        .expect("the stream");
        use changefeed::source::FeedSource as _;
        let shard = feed.partitions().await.expect("shards")[0].id.clone();
        let mut reader = feed
            .open(&shard, &changefeed::model::Position::Beginning)
            .await
            .expect("open");
        let batch = reader.next_batch(10).await.expect("read");
        assert_eq!(batch.records.len(), 4);
        // The adapter checkpointed the second change.
        (shard, batch.records[1].continuation.as_str().to_string())
    });
    // The adapter's lease table, as the KCL writes it (leaseKey, checkpoint, counter, owner).
    rt().block_on(async {
        let ours = crate::import_kcl::connect(&format!("leases-{unique}")).await;
        let rows: &[(&str, &str, u64, &[&str])] = &[(shard.as_str(), checkpoint.as_str(), 0, &[])];
        crate::import_kcl::write_kcl_table(&ours, &kcl_table, rows).await;
    });
    let store = format!("dynamodb://leases-{unique}?endpoint={endpoint}&region=us-east-1");
    let out = bin()
        .args(["import-kcl", "--table", &kcl_table, "--store", &store])
        .args(["--group", "g", "--failover-time", "1s", "--json"])
        .output()
        .expect("run import-kcl");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{:?}",
        crate::support::text(&out)
    );
    let source = format!("dynamodb-streams://{table_name}?endpoint={endpoint}&region=us-east-1");
    let file = fx.path("out.jsonl");
    let mut host = KillOnDrop(
        bin()
            .args([
                "run", "--store", &store, "--source", &source, "--group", "g",
            ])
            .args([
                "--host",
                "h1",
                "--handler",
                &format!("cat >> '{}'", file.display()),
            ])
            .args(FAST)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start run"),
    );
    let got = wait_for(Duration::from_secs(30), "the rest delivered", || {
        let lines = delivered(&[("h1".to_string(), file.clone())]);
        (lines.len() >= 2).then_some(lines)
    });
    let data: Vec<String> = got
        .iter()
        .map(|(_, l)| {
            let doc: Value =
                serde_json::from_str(l["data"].as_str().expect("text")).expect("a change");
            doc["newImage"]["data"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(
        data,
        ["v2", "v3"],
        "exactly the changes after the checkpoint"
    );
    crate::support::terminate(&host.0);
    let status = crate::support::wait_exit(&mut host.0, Duration::from_secs(20));
    assert!(status.success(), "{status}");
}
