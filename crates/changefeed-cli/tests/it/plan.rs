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

/// Runs `changefeed plan` on `snapshot` for `host` with `extra` flags.
fn plan_with(snapshot: &Value, host: &str, extra: &[&str]) -> (Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("snapshot.json");
    std::fs::write(&path, snapshot.to_string()).expect("write snapshot");
    let out = Command::new(env!("CARGO_BIN_EXE_changefeed"))
        .arg("plan")
        .arg("--snapshot")
        .arg(&path)
        .args(["--host", host])
        .args(extra)
        .output()
        .expect("run changefeed");
    (out, dir)
}

/// Ten free leases for hosts a and b, with the given top-level fields added.
fn ten_free(extra: Value) -> Value {
    let leases: Vec<Value> = (0..10)
        .map(|i| json!({"partition": i.to_string()}))
        .collect();
    let mut snapshot = json!({"hosts": ["a", "b"], "leases": leases});
    for (k, v) in extra.as_object().expect("an object") {
        snapshot[k] = v.clone();
    }
    snapshot
}

#[test]
fn plan_with_a_maximum_takes_up_to_it_and_reports_the_leases_left_free() {
    // Hosts at their maximum take no more; leases nobody may hold stay free, and
    // the plan says how many.
    let (out, _dir) = plan_with(&ten_free(json!({"max_leases": 3})), "a", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(
        plan,
        json!({
            "take": ["0", "1", "2"],
            "request_handoff": [],
            "steal": [],
            "release": [],
            "quota": {"a": 3, "b": 3},
            "limits": {"min_leases": 0, "max_leases": 3, "left_free": 4},
        })
    );
    // The flag wins over the snapshot.
    let (out, _dir) = plan_with(
        &ten_free(json!({"max_leases": 3})),
        "b",
        &["--max-leases", "4"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(plan["take"], json!(["4", "5", "6", "7"]));
    assert_eq!(plan["limits"]["left_free"], json!(2));
}

#[test]
fn plan_with_a_hosts_own_minimum_gives_it_more_than_its_equal_share() {
    // A host under its minimum is served first and the others' shares shrink; a
    // host's own limits are listed with the fleet's.
    let snapshot = ten_free(json!({"host_limits": {"b": {"min_leases": 7}}}));
    let (out, _dir) = plan_with(&snapshot, "b", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(plan["take"].as_array().map(Vec::len), Some(7));
    assert_eq!(plan["quota"], json!({"a": 3, "b": 7}));
    assert_eq!(
        plan["limits"],
        json!({
            "min_leases": 0,
            "max_leases": null,
            "hosts": {"b": {"min_leases": 7, "max_leases": null}},
            "left_free": 0,
        })
    );
    // With the fleet's --min-leases 3 (b keeps its own 7) the minimums use every lease.
    let (out, _dir) = plan_with(&snapshot, "a", &["--min-leases", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(plan["quota"], json!({"a": 3, "b": 7}));
}

#[test]
fn bad_limits_in_flags_or_snapshot_name_the_flag_or_field_and_exit_2() {
    // DESIGN "Bad input": limits that break a rule are usage errors naming where they came
    // from, and nothing is printed on stdout.
    let plain = ten_free(json!({}));
    let cases: Vec<(Value, Vec<&str>, &str)> = vec![
        (
            plain.clone(),
            vec!["--max-leases", "0"],
            "error: --max-leases: must be at least 1",
        ),
        (
            plain.clone(),
            vec!["--min-leases", "5", "--max-leases", "2"],
            "error: --min-leases: 5 must not exceed max_leases (2)",
        ),
        (plain.clone(), vec!["--max-leases", "many"], "--max-leases"),
        (plain.clone(), vec!["--min-leases", "-1"], "--min-leases"),
        (
            ten_free(json!({"max_leases": -1})),
            vec![],
            "max_leases: expected a whole number or null, got -1",
        ),
        (
            ten_free(json!({"min_leases": "two"})),
            vec![],
            "min_leases: expected a whole number or null, got a string",
        ),
        (
            ten_free(json!({"max_leases": 3, "host_limits": {"b": {"min_leases": 5}}})),
            vec![],
            "host_limits.b.min_leases: 5 must not exceed max_leases (3)",
        ),
        (
            ten_free(json!({"max_leases": 2})),
            vec!["--min-leases", "3"],
            "min_leases: 3 must not exceed max_leases (2)",
        ),
        (
            ten_free(json!({"host_limits": {"b": 4}})),
            vec![],
            "host_limits.b: expected an object",
        ),
    ];
    for (snapshot, flags, expected) in cases {
        let (out, _dir) = plan_with(&snapshot, "a", &flags);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(expected),
            "{flags:?}: {}",
            stderr(&out)
        );
        assert!(out.stdout.is_empty(), "{flags:?}");
    }
}
