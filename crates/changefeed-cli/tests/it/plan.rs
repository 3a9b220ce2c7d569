//! `changefeed plan`: runs the built binary on snapshot files and checks its JSON and errors.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

fn plan(snapshot: &str, host: &str) -> (Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("snapshot.json");
    std::fs::write(&path, snapshot).expect("write snapshot");
    (run(&path, host), dir)
}

fn run(path: &Path, host: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_changefeed"))
        .arg("plan")
        .arg("--snapshot")
        .arg(path)
        .args(["--host", host])
        .output()
        .expect("run changefeed")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn plan_prints_takes_handoffs_and_quotas() {
    // DESIGN "Balancing": c takes the dead host's lease and asks the over-quota host for one.
    let snapshot = json!({
        "hosts": ["a", "b", "c"],
        "leases": [
            {"partition": "0", "owner": "a"},
            {"partition": "1", "owner": "a"},
            {"partition": "2", "owner": "a"},
            {"partition": "3", "owner": "a"},
            {"partition": "4", "owner": "b"},
            {"partition": "5", "owner": "b"},
            {"partition": "6", "owner": "dead"},
            {"partition": "7", "owner": null, "state": "finished"},
        ]
    });
    let (out, _dir) = plan(&snapshot.to_string(), "c");
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(
        plan,
        json!({
            "take": ["6"],
            "request_handoff": [{"partition": "0", "from": "a"}],
            "steal": [],
            "release": [],
            "quota": {"a": 3, "b": 2, "c": 2},
        })
    );
}

#[test]
fn overdue_handoff_is_shown_as_a_steal() {
    // A hand-off to --host that the shell judged overdue is stolen.
    let snapshot = json!({
        "hosts": ["a", "b"],
        "leases": [
            {"partition": "0", "owner": "a"},
            {"partition": "1", "owner": "a", "next_owner": "b", "handoff_overdue": true},
        ]
    });
    let (out, _dir) = plan(&snapshot.to_string(), "b");
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(plan["steal"], json!(["1"]));
    assert_eq!(plan["take"], json!([]));
}

#[test]
fn malformed_snapshot_names_the_field_and_exits_2() {
    // DESIGN "Bad input": the error names what is wrong; usage errors exit with 2.
    let cases = [
        (
            r#"{"hosts": ["a"], "leases": [{"partition": "0", "owner": 7}]}"#,
            "leases[0].owner",
        ),
        (
            r#"{"hosts": ["a"], "leases": [{"owner": "a"}]}"#,
            "leases[0].partition: missing",
        ),
        (
            r#"{"hosts": ["a"], "leases": [{"partition": "0", "state": "gone"}]}"#,
            "leases[0].state",
        ),
        (
            r#"{"hosts": ["a"], "leases": [{"partition": "0", "eligible": "yes"}]}"#,
            "leases[0].eligible",
        ),
        (r#"{"leases": []}"#, "hosts: missing"),
        (r#"{"hosts": ["a", ""], "leases": []}"#, "hosts[1]"),
        (
            r#"{"hosts": ["a"], "leases": [{"partition": "0"}, {"partition": "0"}]}"#,
            "listed twice",
        ),
        (
            r#"{"hosts": ["a"], "leases": [{"partition": "0", "owner": "a", "state": "available"}]}"#,
            "leases[0]",
        ),
        (r#"{"hosts": ["a"], "leases": ["#, "invalid JSON"),
    ];
    for (snapshot, expected) in cases {
        let (out, _dir) = plan(snapshot, "a");
        assert_eq!(out.status.code(), Some(2), "{snapshot}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(expected),
            "{snapshot}: {}",
            stderr(&out)
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn unknown_host_and_missing_file_exit_2() {
    // --host must be one of the snapshot's hosts; an unreadable file is a usage error too.
    let (out, dir) = plan(r#"{"hosts": ["a", "b"], "leases": []}"#, "zed");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--host zed"), "{}", stderr(&out));
    assert!(stderr(&out).contains("(a, b)"), "{}", stderr(&out));
    let out = run(&dir.path().join("missing.json"), "a");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
}
