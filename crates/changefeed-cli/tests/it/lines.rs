//! `changefeed run --protocol lines`: one long-lived handler process per
//! partition, framed JSON lines. The example handler of `docs/operations.md` is taken from the
//! document itself and run, so the two cannot drift apart.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use changefeed::model::{Continuation, PartitionId};

use crate::support::{bin, process_alive, read, terminate, wait_exit, wait_for, Fixture, FAST};

/// The Python block under "Long-lived handlers" in docs/operations.md.
pub fn example_handler() -> String {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
    let text = std::fs::read_to_string(&doc).expect("docs/operations.md");
    let section = text
        .split_once("### Long-lived handlers (`--protocol lines`)")
        .expect("the section")
        .1;
    let block = section
        .split_once("```python\n")
        .expect("a python block")
        .1
        .split_once("```")
        .expect("closed")
        .0;
    assert!(
        block.lines().count() <= 20,
        "the documented example stays short:\n{block}"
    );
    block.to_string()
}

/// Two partitions with `n` records each, `p:i` as data.
fn feed(fx: &Fixture, n: usize) {
    fx.with_feed(async |feed| {
        feed.create_partitions(2).await.expect("partitions");
        for p in ["0", "1"] {
            let id = PartitionId::new(p).expect("id");
            for i in 0..n {
                feed.append_to(&id, "k", format!("{p}:{i}"))
                    .await
                    .expect("append");
            }
        }
    });
}

/// Starts `run --protocol lines` with `handler`, logging one line to `starts` per process.
fn start(fx: &Fixture, handler: &str, starts: &Path) -> std::process::Child {
    let command = format!(
        "echo \"$CHANGEFEED_PARTITION\" >> '{}'; exec {handler}",
        starts.display()
    );
    bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", &command, "--protocol", "lines", "--host", "h1"])
        .args(["--group", "g", "--max-batch-size", "4"])
        .args(FAST)
        .env("ORDERS_OUT", fx.path("out.txt"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(fx.path("stderr")).expect("stderr file"))
        .spawn()
        .expect("start run")
}

#[test]
fn lines_protocol_example_handler_reads_every_record() {
    let fx = Fixture::new();
    feed(&fx, 30);
    let script = fx.path("orders_handler.py");
    std::fs::write(&script, example_handler()).expect("write handler");
    let starts = fx.path("starts");
    let mut host = start(&fx, &format!("python3 '{}'", script.display()), &starts);
    let out = fx.path("out.txt");
    wait_for(Duration::from_secs(30), "all 60 records handled", || {
        (read(&out).lines().count() >= 60).then_some(())
    });
    // In order per partition, each once (no failure, no redelivery).
    let mut per: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in read(&out).lines() {
        let mut f = line.split(' ');
        let (p, _c, data) = (f.next(), f.next(), f.next());
        per.entry(p.expect("partition").into())
            .or_default()
            .push(data.expect("data").into());
    }
    for p in ["0", "1"] {
        let want: Vec<String> = (0..30).map(|i| format!("{p}:{i}")).collect();
        assert_eq!(per.get(p), Some(&want), "partition {p}");
    }
    // Every batch's ack moved the checkpoint to the batch's last record.
    for p in ["0", "1"] {
        wait_for(Duration::from_secs(10), "the last checkpoint", || {
            let lease = fx.lease("g", p)?;
            (lease.continuation == Some(Continuation::new(format!("{p}:30")))).then_some(())
        });
    }
    // One process per partition for 8 batches each.
    let mut started: Vec<String> = read(&starts).lines().map(str::to_string).collect();
    started.sort();
    assert_eq!(started, ["0", "1"], "one long-lived process per partition");
    terminate(&host);
    let status = wait_exit(&mut host, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
}

#[test]
fn lines_protocol_serves_checkpoint_requests_and_names_bad_replies() {
    // The first process of each partition asks for a checkpoint at the batch's second record,
    // then writes a line that is not a message: the batch fails with a named error, the
    // process is replaced, and the fresh one (marker file present) acknowledges normally.
    let fx = Fixture::new();
    feed(&fx, 6);
    let replies = fx.path("replies");
    let script = fx.path("handler.py");
    std::fs::write(
        &script,
        format!(
            r#"import json, os, sys
marker = "{dir}/started-" + os.environ["CHANGEFEED_PARTITION"]
first = not os.path.exists(marker)
open(marker, "a").close()
for line in sys.stdin:
    records = json.loads(line)["records"]
    if first:
        print(json.dumps({{"checkpoint": records[1]["continuation"]}}), flush=True)
        open("{replies}", "a").write(sys.stdin.readline())
        print(json.dumps({{"checkpoint": "9:9"}}), flush=True)
        open("{replies}", "a").write(sys.stdin.readline())
        print("nonsense", flush=True)
    else:
        print(json.dumps({{"ack": records[-1]["continuation"]}}), flush=True)
"#,
            dir = fx.dir.path().display(),
            replies = replies.display()
        ),
    )
    .expect("write handler");
    let starts = fx.path("starts");
    let mut host = start(&fx, &format!("python3 '{}'", script.display()), &starts);
    for p in ["0", "1"] {
        wait_for(Duration::from_secs(30), "the checkpoint at the end", || {
            let lease = fx.lease("g", p)?;
            (lease.continuation == Some(Continuation::new(format!("{p}:6")))).then_some(())
        });
    }
    terminate(&host);
    let status = wait_exit(&mut host, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
    let stderr = read(&fx.path("stderr"));
    assert!(
        stderr.contains(r#"sent a line that is not {"ack":C}"#) && stderr.contains("nonsense"),
        "the bad reply is named: {stderr}"
    );
    let replies: Vec<serde_json::Value> = read(&replies)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    for p in ["0", "1"] {
        assert!(
            replies.contains(&serde_json::json!({"checkpointed": format!("{p}:2")})),
            "granted at the record asked for: {replies:?}"
        );
        assert!(
            replies.contains(&serde_json::json!({"checkpointed": "9:9", "error": "\"9:9\" is not a record of the batch"})),
            "refused outside the batch: {replies:?}"
        );
    }
    let mut started: Vec<String> = read(&starts).lines().map(str::to_string).collect();
    started.sort();
    assert_eq!(
        started,
        ["0", "0", "1", "1"],
        "each partition's process replaced once"
    );
}

#[test]
fn lines_protocol_hung_process_is_cut_by_handler_timeout_and_by_the_stop() {
    // The fencing rules hold for long-lived processes: a process that never answers is cut
    // at handler_timeout (its whole group, grandchild included, killed; a fresh process gets
    // the batch), and a stop with one hung ends within shutdown_timeout, exit 0, nothing left.
    let fx = Fixture::new();
    feed(&fx, 3);
    let pids = fx.path("pids");
    let script = fx.path("hung.py");
    std::fs::write(
        &script,
        format!(
            r#"import os, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "300"])
open("{pids}", "a").write(f"{{os.getpid()}}\n{{grandchild.pid}}\n")
sys.stdin.readline()
time.sleep(300)
"#,
            pids = pids.display()
        ),
    )
    .expect("write handler");
    let mut host = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", &format!("python3 '{}'", script.display())])
        .args(["--protocol", "lines", "--host", "h1", "--group", "g"])
        .args(["--handler-timeout", "1s", "--shutdown-timeout", "2s"])
        .args(["--handler-max-retries", "100"])
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    let all = || -> Vec<i64> { read(&pids).lines().filter_map(|l| l.parse().ok()).collect() };
    // Two attempts per partition: the first processes were cut and are gone.
    let first = wait_for(Duration::from_secs(30), "second attempts", || {
        let p = all();
        (p.len() >= 8).then_some(p)
    });
    wait_for(Duration::from_secs(10), "the cut processes gone", || {
        first[..4].iter().all(|p| !process_alive(*p)).then_some(())
    });
    let stopping = std::time::Instant::now();
    terminate(&host);
    let status = wait_exit(&mut host, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(8),
        "the stop is bounded by shutdown_timeout and the kill grace: {:?}",
        stopping.elapsed()
    );
    let left: Vec<i64> = all().into_iter().filter(|p| process_alive(*p)).collect();
    assert!(left.is_empty(), "processes left: {left:?}");
    assert_eq!(fx.lease("g", "0").and_then(|l| l.owner), None, "released");
}

#[test]
fn a_move_hands_a_lines_lease_over_at_the_last_acknowledged_batch_even_between_interval_checkpoints(
) {
    // With --checkpoint interval:1h no checkpoint falls due while the test runs: the hand-off
    // itself writes the position of the last batch the process acknowledged, so the host
    // joining delivers nothing again.
    let fx = Fixture::new();
    feed(&fx, 30);
    let script = fx.path("orders_handler.py");
    std::fs::write(&script, example_handler()).expect("write handler");
    let host = |name: &str| {
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--handler", &format!("python3 '{}'", script.display())])
            .args(["--protocol", "lines", "--host", name, "--group", "g"])
            .args(["--max-batch-size", "4", "--checkpoint", "interval:1h"])
            .args(FAST)
            .env("ORDERS_OUT", fx.path("out.txt"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(fx.path(&format!("{name}.stderr"))).expect("stderr"))
            .spawn()
            .map(crate::support::KillOnDrop)
            .expect("start run")
    };
    let out = fx.path("out.txt");
    let handled = || -> Vec<String> {
        read(&out)
            .lines()
            .filter_map(|l| l.split(' ').nth(2).map(str::to_string))
            .collect()
    };
    let _h1 = host("h1");
    wait_for(Duration::from_secs(30), "h1 handled all 60 records", || {
        (handled().len() >= 60).then_some(())
    });
    let _h2 = host("h2");
    wait_for(Duration::from_secs(30), "h2 owns a partition", || {
        ["0", "1"]
            .iter()
            .any(|p| {
                fx.lease("g", p)
                    .and_then(|l| l.owner)
                    .is_some_and(|o| o.as_str() == "h2")
            })
            .then_some(())
    });
    fx.with_feed(async |feed| {
        for p in ["0", "1"] {
            let id = PartitionId::new(p).expect("id");
            for i in 30..40 {
                feed.append_to(&id, "k", format!("{p}:{i}"))
                    .await
                    .expect("append");
            }
        }
    });
    wait_for(Duration::from_secs(30), "all 80 records handled", || {
        (handled().len() >= 80).then_some(())
    });
    let mut seen = BTreeMap::new();
    for data in handled() {
        *seen.entry(data).or_insert(0) += 1;
    }
    let again: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        again.is_empty(),
        "delivered again after the move: {again:?}"
    );
    assert_eq!(seen.len(), 80, "every record once");
}
