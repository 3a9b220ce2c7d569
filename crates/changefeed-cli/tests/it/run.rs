//! `changefeed run`: a real host process with a shell handler against a temporary SQLite file.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use changefeed::model::{Continuation, LeaseState, PartitionId};
use serde_json::Value;

use crate::support::{bin, terminate, text, wait_exit, wait_for, Fixture, FAST};

/// Writes `n` text records and one binary record to partition 0 of a one-partition feed.
fn feed_with_records(fx: &Fixture, n: usize) {
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for i in 0..n {
            feed.append_to(&p, "k", format!("record {i}"))
                .await
                .expect("append");
        }
        feed.append_to(&p, "bin", vec![0xffu8, 0x00])
            .await
            .expect("append");
    });
}

#[test]
fn checkpoint_moves_only_after_the_handler_command_exits_zero() {
    // The handler contract: non-zero exit = retried, never skipped, never checkpointed.
    let fx = Fixture::new();
    feed_with_records(&fx, 3);
    let input = fx.path("input.jsonl");
    let marker = fx.path("ok");
    let attempts = fx.path("attempts");
    let handler = format!(
        "cat > '{}'; echo x >> '{}'; test -f '{}'",
        input.display(),
        attempts.display(),
        marker.display()
    );
    let mut child = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", &handler, "--host", "h1", "--group", "g"])
        .args(["--handler-max-retries", "1000"])
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    // Two failed attempts, and the lease is owned but not checkpointed.
    wait_for(Duration::from_secs(15), "two failed attempts", || {
        (crate::support::read(&attempts).lines().count() >= 2).then_some(())
    });
    let lease = fx.lease("g", "0").expect("lease created by discovery");
    assert_eq!(lease.state, LeaseState::Owned);
    assert_eq!(
        lease.continuation, None,
        "a failed batch must not be checkpointed"
    );
    // The batch arrived as JSON lines: text as `data`, binary as `data_b64`.
    let lines: Vec<Value> = crate::support::read(&input)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0]["partition"], "0");
    assert_eq!(lines[0]["key"], "k");
    assert_eq!(lines[0]["data"], "record 0");
    assert_eq!(lines[0]["continuation"], "0:1");
    assert!(lines[0]["timestamp"].is_i64());
    assert_eq!(lines[3]["data_b64"], "/wA=");
    assert!(lines[3].get("data").is_none());
    // Success: the same batch is retried and then checkpointed.
    std::fs::write(&marker, "").expect("marker");
    wait_for(Duration::from_secs(20), "the checkpoint to move", || {
        let lease = fx.lease("g", "0")?;
        (lease.continuation == Some(Continuation::new("0:4"))).then_some(())
    });
    terminate(&child);
    let status = wait_exit(&mut child, Duration::from_secs(15));
    assert!(status.success(), "graceful stop exits 0: {status}");
    let lease = fx.lease("g", "0").expect("lease");
    assert_eq!(lease.owner, None, "a graceful stop releases the lease");
    assert_eq!(lease.continuation, Some(Continuation::new("0:4")));
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

#[test]
fn metrics_addr_serves_the_documented_metrics() {
    // docs/metrics.md lists every metric a host exports; the scrape uses those names.
    let fx = Fixture::new();
    feed_with_records(&fx, 5);
    let port = free_port();
    let mut child = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args([
            "--handler",
            "cat > /dev/null",
            "--host",
            "h1",
            "--group",
            "g",
        ])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    let body = wait_for(Duration::from_secs(20), "a scrape with batches", || {
        scrape(port).filter(|b| b.contains("changefeed_batches_total"))
    });
    terminate(&child);
    let status = wait_exit(&mut child, Duration::from_secs(15));
    assert!(status.success(), "{status}");
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/metrics.md"
    ))
    .expect("docs/metrics.md");
    for name in [
        "changefeed_batches_total",
        "changefeed_records_total",
        "changefeed_leases_owned",
    ] {
        assert!(
            body.contains(name),
            "{name} missing from the scrape:\n{body}"
        );
    }
    for line in body.lines().filter(|l| l.starts_with("changefeed_")) {
        let name = line
            .split(['{', ' '])
            .next()
            .expect("a name")
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        assert!(
            docs.contains(&format!("`{name}`")),
            "{name} is not in docs/metrics.md"
        );
    }
    assert!(body.contains("group=\"g\""), "{body}");
}

#[test]
fn bad_setting_values_exit_2_naming_the_setting() {
    // DESIGN "Bad input": configuration errors name the setting; usage errors exit 2.
    let fx = Fixture::new();
    let base = [
        "run",
        "--store",
        &fx.url(),
        "--source",
        &fx.url(),
        "--handler",
        "cat",
    ];
    let out = bin()
        .args(base)
        .args(["--lease-expiry", "soon"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("lease_expiry"), "{:?}", text(&out));
    // From the environment, checked against the library's rule.
    let out = bin()
        .args(base)
        .env("CHANGEFEED_RENEW_INTERVAL", "20s")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("renew_interval"), "{:?}", text(&out));
    // From a config file: an unknown key is named.
    let cfg = fx.path("cfg.toml");
    std::fs::write(&cfg, "lease_expiri = \"5s\"\n").expect("write");
    let out = bin()
        .args(base)
        .arg("--config")
        .arg(&cfg)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("lease_expiri"), "{:?}", text(&out));
    // A store URL with an unknown scheme.
    let out = bin()
        .args([
            "run",
            "--store",
            "redis://x",
            "--source",
            &fx.url(),
            "--handler",
            "cat",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("store"), "{:?}", text(&out));
}

#[test]
fn a_batch_failing_dead_letter_after_times_goes_to_the_dead_letter_command_and_is_skipped() {
    // Opt-in dead letters: after N failures the batch is piped to the dead-letter
    // command as one JSON object; once it exits 0 the checkpoint moves past the batch.
    let fx = Fixture::new();
    feed_with_records(&fx, 2);
    let letters = fx.path("letters.json");
    let envs = fx.path("env");
    let mut child = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args([
            "--handler",
            "cat > /dev/null; exit 3",
            "--host",
            "h1",
            "--group",
            "g",
        ])
        .args(["--handler-max-retries", "1000", "--dead-letter-after", "2"])
        .arg("--dead-letter-command")
        .arg(format!(
            "cat >> '{}'; echo \"$CHANGEFEED_PARTITION $CHANGEFEED_RECORDS\" >> '{}'",
            letters.display(),
            envs.display()
        ))
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    wait_for(
        Duration::from_secs(20),
        "the checkpoint past the batch",
        || {
            let lease = fx.lease("g", "0")?;
            (lease.continuation == Some(Continuation::new("0:3"))).then_some(())
        },
    );
    terminate(&child);
    let status = wait_exit(&mut child, Duration::from_secs(15));
    assert!(status.success(), "{status}");
    let stored = crate::support::read(&letters);
    let letter: Value =
        serde_json::from_str(stored.lines().next().expect("one letter")).expect("a JSON object");
    assert_eq!(letter["group"], "g");
    assert_eq!(letter["partition"], "0");
    assert_eq!(letter["host"], "h1");
    assert_eq!(letter["failures"], 2);
    assert_eq!(letter["after"], Value::Null);
    assert!(
        letter["error"]
            .as_str()
            .is_some_and(|e| e.contains("exit status: 3")),
        "{letter}"
    );
    let records = letter["records"].as_array().expect("records");
    assert_eq!(records.len(), 3, "{letter}");
    assert_eq!(records[0]["data"], "record 0");
    assert_eq!(records[0]["continuation"], "0:1");
    assert_eq!(records[2]["data_b64"], "/wA=");
    assert_eq!(crate::support::read(&envs).trim(), "0 3");
    // Without the command, the count is a usage error naming the flag.
    let out = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--handler", "cat", "--dead-letter-after", "3"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("--dead-letter-after"),
        "{:?}",
        text(&out)
    );
}
