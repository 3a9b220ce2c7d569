//! `changefeed feed append`: records of one's own into a SQLite feed, from flags or JSON lines
//! on stdin, read back by `changefeed run`; bad input names the flag or the line and writes
//! nothing.

use std::io::Write as _;
use std::process::{Output, Stdio};
use std::time::Duration;

use changefeed::model::PartitionId;
use serde_json::Value;

use crate::support::{bin, read, terminate, text, wait_exit, wait_for, Fixture, FAST};

/// `changefeed feed --db DB ARGS…` with `stdin` on its standard input.
fn feed(fx: &Fixture, args: &[&str], stdin: &str) -> Output {
    let mut child = bin()
        .arg("feed")
        .arg("--db")
        .arg(&fx.db)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start feed");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("feed")
}

/// Records in each partition of the feed, by partition id.
fn lengths(fx: &Fixture) -> Vec<(String, u64)> {
    fx.with_feed(async |feed| {
        let mut out = Vec::new();
        for p in ["0", "1"] {
            let id = PartitionId::new(p).expect("id");
            if let Ok(n) = feed.len(&id).await {
                out.push((p.to_string(), n));
            }
        }
        out
    })
}

#[test]
fn records_appended_from_flags_and_stdin_are_delivered_by_run() {
    // A newcomer fills a SQLite feed without code and `run` hands the
    // records to the handler as written, text, JSON values and bytes alike.
    let fx = Fixture::new();
    let out = feed(&fx, &["create", "2"], "");
    assert!(out.status.success(), "{:?}", text(&out));
    let out = feed(
        &fx,
        &[
            "append", "--key", "order-1", "--data", "created", "--count", "3",
        ],
        "",
    );
    assert!(out.status.success(), "{:?}", text(&out));
    let appended: Vec<Value> = serde_json::from_slice(&out.stdout).expect("a JSON array");
    assert_eq!(appended.len(), 3, "{appended:?}");
    let partition = appended[0]["partition"].as_str().expect("partition");
    let continuations: Vec<&str> = appended
        .iter()
        .map(|a| a["continuation"].as_str().expect("continuation"))
        .collect();
    assert_eq!(
        continuations,
        [1, 2, 3].map(|i| format!("{partition}:{i}")),
        "one key, one partition, in order: {appended:?}"
    );
    let lines = concat!(
        "{\"key\":\"order-2\",\"data\":\"paid\"}\n",
        "\n",
        "{\"key\":\"order-3\",\"data\":{\"total\":12}}\n",
        "{\"key\":\"order-4\",\"data_b64\":\"/wA=\"}\n",
    );
    let out = feed(&fx, &["append"], lines);
    assert!(out.status.success(), "{:?}", text(&out));
    let appended: Vec<Value> = serde_json::from_slice(&out.stdout).expect("a JSON array");
    let keys: Vec<&str> = appended
        .iter()
        .map(|a| a["key"].as_str().expect("key"))
        .collect();
    assert_eq!(keys, ["order-2", "order-3", "order-4"]);
    let total: u64 = lengths(&fx).iter().map(|(_, n)| n).sum();
    assert_eq!(total, 6);

    let delivered = fx.path("delivered.jsonl");
    let mut child = bin()
        .args(["run", "--store", &fx.url(), "--source", &fx.url()])
        .args(["--host", "h1", "--group", "g"])
        .arg("--handler")
        .arg(format!("cat >> '{}'", delivered.display()))
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    let records: Vec<Value> = wait_for(Duration::from_secs(20), "6 records delivered", || {
        let lines: Vec<Value> = read(&delivered)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        (lines.len() >= 6).then_some(lines)
    });
    terminate(&child);
    let status = wait_exit(&mut child, Duration::from_secs(15));
    assert!(status.success(), "{status}");
    let data = |key: &str| -> Vec<Value> {
        records
            .iter()
            .filter(|r| r["key"] == key)
            .map(|r| r.get("data").or(r.get("data_b64")).cloned().expect("data"))
            .collect()
    };
    assert_eq!(data("order-1"), ["created-0", "created-1", "created-2"]);
    assert_eq!(data("order-2"), ["paid"]);
    assert_eq!(data("order-3"), ["{\"total\":12}"]);
    assert_eq!(data("order-4"), ["/wA="], "bytes come back as data_b64");
    assert_eq!(records.len(), 6, "{records:?}");
}

#[test]
fn bad_append_input_names_the_flag_or_the_line_and_writes_nothing() {
    // DESIGN "Bad input": exit 2, the message names the flag or the stdin line; a bad line
    // anywhere leaves the feed as it was.
    let fx = Fixture::new();
    let out = feed(&fx, &["append", "--key", "k", "--data", "x"], "");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("no open partitions")
            && text(&out).1.contains("feed --db")
            && text(&out).1.contains("create N"),
        "says how to create partitions: {:?}",
        text(&out)
    );
    let out = feed(&fx, &["create", "2"], "");
    assert!(out.status.success(), "{:?}", text(&out));

    let cases: [(&[&str], &str, &str); 6] = [
        (&["append", "--key", "k"], "", "--data"),
        (
            &["append", "--key", "k", "--data", "x", "--count", "0"],
            "",
            "--count",
        ),
        (
            &["append"],
            "{\"key\":\"a\",\"data\":\"ok\"}\n{\"key\":\"b\",\"dat\":\"typo\"}\n",
            "stdin line 2",
        ),
        (
            &["append"],
            "{\"key\":\"a\",\"data\":\"ok\"}\n\n{\"key\":\"c\"}\n",
            "stdin line 3: no \"data\"",
        ),
        (
            &["append"],
            "{\"key\":\"a\",\"data\":\"ok\"}\nnot json\n",
            "stdin line 2",
        ),
        (&["append"], "", "stdin: no records"),
    ];
    for (args, stdin, named) in cases {
        let out = feed(&fx, args, stdin);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:?}", text(&out));
        assert!(
            text(&out).1.contains(named),
            "{args:?} {stdin:?}: the error names {named}: {:?}",
            text(&out)
        );
        assert!(
            text(&out).0.is_empty(),
            "nothing reported written: {:?}",
            text(&out)
        );
    }
    let total: u64 = lengths(&fx).iter().map(|(_, n)| n).sum();
    assert_eq!(total, 0, "nothing was appended: {:?}", lengths(&fx));
}
