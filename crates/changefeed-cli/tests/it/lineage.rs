//! `changefeed lineage` and `changefeed feed`: the built binary on JSON files and a SQLite feed.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

fn changefeed(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_changefeed"))
        .args(args)
        .output()
        .expect("run changefeed")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn write(dir: &Path, name: &str, v: &Value) -> String {
    let path = dir.join(name);
    std::fs::write(&path, v.to_string()).expect("write file");
    path.display().to_string()
}

/// The worked example of DESIGN "Partition lineage", with close times: 0–3 closed at 102,
/// 5, 6 and 7 at 205 (milliseconds since the epoch).
fn worked_example() -> Value {
    json!([
        {"id": "0", "parents": [], "closed": true, "closed_at": 102},
        {"id": "1", "parents": [], "closed": true, "closed_at": 102},
        {"id": "2", "parents": [], "closed": true, "closed_at": 102},
        {"id": "3", "parents": [], "closed": true, "closed_at": 102},
        {"id": "4", "parents": []},
        {"id": "5", "parents": [], "closed": true, "closed_at": 205},
        {"id": "6", "parents": ["0", "1"], "closed": true, "closed_at": 205},
        {"id": "7", "parents": ["2", "3"], "closed": true, "closed_at": 205},
        {"id": "8", "parents": ["6", "7"]},
        {"id": "9", "parents": ["5"]},
        {"id": "10", "parents": ["5"]},
    ])
}

fn lineage(partitions: &Value, leases: &Value, position: &str) -> Output {
    lineage_with(partitions, leases, position, &[])
}

fn lineage_with(partitions: &Value, leases: &Value, position: &str, more: &[&str]) -> Output {
    let dir = tempfile::tempdir().expect("temporary directory");
    let p = write(dir.path(), "P.json", partitions);
    let l = write(dir.path(), "L.json", leases);
    let mut args = vec![
        "lineage",
        "--partitions",
        &p,
        "--leases",
        &l,
        "--position",
        position,
    ];
    args.extend_from_slice(more);
    changefeed(&args)
}

fn plan_of(out: &Output) -> Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[test]
fn worked_example_prints_the_leases_for_each_start_position() {
    // DESIGN "Partition lineage": with (4, 5, 7), Now → (6); Beginning → (0, 1);
    // AtTime(200) → (0, 1).
    let leases = json!([
        {"partition": "4", "state": "owned"},
        {"partition": "5", "state": "owned", "checkpoint": "5:10"},
        {"partition": "7", "state": "available"},
    ]);
    let now = plan_of(&lineage(&worked_example(), &leases, "now"));
    assert_eq!(
        now,
        json!({"create": [{"partition": "6", "start": "beginning"}]})
    );
    let beginning = plan_of(&lineage(&worked_example(), &leases, "beginning"));
    assert_eq!(
        beginning,
        json!({"create": [
            {"partition": "0", "start": "beginning"},
            {"partition": "1", "start": "beginning"},
        ]})
    );
    for position in ["at:1970-01-01T00:00:00.200Z", "at:200"] {
        let at = plan_of(&lineage(&worked_example(), &leases, position));
        assert_eq!(
            at,
            json!({"create": [
                {"partition": "0", "start": "at:1970-01-01T00:00:00.200Z"},
                {"partition": "1", "start": "at:1970-01-01T00:00:00.200Z"},
            ]})
        );
    }
}

#[test]
fn child_start_parent_continuation_plans_as_a_cosmos_source_does() {
    // docs/lineage.md "Children that continue from their parent": a split child of one
    // finished parent starts at the parent's last checkpoint; a merge child at the beginning;
    // without the flag every child starts at its beginning.
    let partitions = json!([
        {"id": "0", "closed": true},
        {"id": "1", "parents": ["0"]},
        {"id": "2", "parents": ["0"], "closed": true},
        {"id": "3", "closed": true},
        {"id": "4", "parents": ["2", "3"]},
    ]);
    let leases = json!([
        {"partition": "0", "state": "finished", "checkpoint": "\"42\""},
        {"partition": "2", "state": "finished", "checkpoint": "\"57\""},
        {"partition": "3", "state": "finished", "checkpoint": "\"61\""},
    ]);
    let cosmos = plan_of(&lineage_with(
        &partitions,
        &leases,
        "now",
        &["--child-start", "parent-continuation"],
    ));
    assert_eq!(
        cosmos,
        json!({"create": [
            {"partition": "1", "start": "after:\"42\""},
            {"partition": "4", "start": "beginning"},
        ]})
    );
    let others = plan_of(&lineage(&partitions, &leases, "now"));
    assert_eq!(
        others,
        json!({"create": [
            {"partition": "1", "start": "beginning"},
            {"partition": "4", "start": "beginning"},
        ]})
    );
    let bad = lineage_with(&partitions, &leases, "now", &["--child-start", "parent"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("--child-start"), "{}", stderr(&bad));
}

#[test]
fn at_time_on_an_empty_table_starts_at_the_partitions_open_at_that_time() {
    // A partition closed before t is not needed; its children are (KCL's AT_TIMESTAMP seed).
    let at = plan_of(&lineage(&worked_example(), &json!([]), "at:200"));
    let ids: Vec<&str> = at["create"]
        .as_array()
        .expect("array")
        .iter()
        .map(|c| c["partition"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["4", "5", "6", "7"]);
}

#[test]
fn corrupt_partitions_and_bad_input_name_the_partition_or_field_and_exit_2() {
    // DESIGN "Bad input": the error names what is wrong; usage errors exit with 2.
    let cases: Vec<(Value, Value, &str, &str)> = vec![
        (
            json!([{"id": "a", "parents": ["b"]}, {"id": "b", "parents": ["a"]}]),
            json!([]),
            "beginning",
            "partition a: its parents form a cycle",
        ),
        (
            json!([{"id": "s", "parents": ["s"]}]),
            json!([]),
            "now",
            "partition s: names itself as a parent",
        ),
        (
            json!([{"id": "0", "parents": 3}]),
            json!([]),
            "now",
            "[0] (partition 0).parents: expected an array of ids, got a number",
        ),
        (
            json!([{"parents": []}]),
            json!([]),
            "now",
            "[0].id: missing",
        ),
        (
            json!([{"id": "0", "range": [5, 1]}]),
            json!([]),
            "now",
            "[0] (partition 0).range: start 5 is after end 1",
        ),
        (
            json!([{"id": "0"}]),
            json!([{"partition": "0", "state": "gone"}]),
            "now",
            "[0] (partition 0).state: invalid lease state",
        ),
        (
            json!([{"id": "0"}]),
            json!([{"partition": "0"}]),
            "now",
            "[0] (partition 0).state: missing",
        ),
        (
            json!([{"id": "0"}]),
            json!([]),
            "yesterday",
            "--position: \"yesterday\": expected beginning, now or at:RFC3339",
        ),
        (
            json!({"id": "0"}),
            json!([]),
            "now",
            "expected an array of partitions, got an object",
        ),
    ];
    for (partitions, leases, position, expected) in cases {
        let out = lineage(&partitions, &leases, position);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{partitions} {leases}: {}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(expected),
            "expected {expected:?} in {:?}",
            stderr(&out)
        );
        assert!(out.stdout.is_empty(), "no plan printed on bad input");
    }
}

#[test]
fn unknown_parent_is_refused_only_when_asked_to_treat_it_as_corrupt() {
    // A missing parent is trimmed (finished) by default; --missing-parents error refuses it.
    let dir = tempfile::tempdir().expect("temporary directory");
    let p = write(
        dir.path(),
        "P.json",
        &json!([{"id": "c", "parents": ["ghost"]}]),
    );
    let l = write(dir.path(), "L.json", &json!([]));
    let base = [
        "lineage",
        "--partitions",
        &p,
        "--leases",
        &l,
        "--position",
        "now",
    ];
    let out = changefeed(&base);
    assert_eq!(
        plan_of(&out),
        json!({"create": [{"partition": "c", "start": "now"}]})
    );
    let mut strict = base.to_vec();
    strict.extend(["--missing-parents", "error"]);
    let out = changefeed(&strict);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("partition c: names unknown parent ghost"));
}

#[test]
fn feed_split_and_merge_reshape_a_sqlite_feed_that_lineage_then_reads() {
    // Sources: split and merge through the CLI, listed in the format lineage reads.
    let dir = tempfile::tempdir().expect("temporary directory");
    let db = dir.path().join("feed.db").display().to_string();
    let out = changefeed(&["feed", "--db", &db, "create", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = changefeed(&["feed", "split", "0", "--db", &db]);
    assert!(out.status.success(), "{}", stderr(&out));
    let split: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(split, json!({"split": "0", "children": ["2", "3"]}));
    let out = changefeed(&["feed", "--db", &db, "merge", "3", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let merged: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(merged, json!({"merged": ["3", "1"], "child": "4"}));
    // Refusals name the partition and exit 2.
    for (args, expected) in [
        (vec!["split", "0"], "partition 0"),
        (vec!["split", "99"], "partition 99: not found"),
        (vec!["merge", "0", "2"], "partition 0: is closed"),
    ] {
        let mut full = vec!["feed", "--db", db.as_str()];
        full.extend(args);
        let out = changefeed(&full);
        assert_eq!(out.status.code(), Some(2), "{full:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{}", stderr(&out));
    }
    let out = changefeed(&["feed", "--db", &db, "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let partitions: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(partitions.as_array().expect("array").len(), 5);
    // Partitions 0 and 3, 1 finished; 2 and 4 are ready (their parents are finished).
    let p = write(dir.path(), "P.json", &partitions);
    let l = write(
        dir.path(),
        "L.json",
        &json!([
            {"partition": "0", "state": "finished", "checkpoint": "0:5"},
            {"partition": "1", "state": "finished"},
            {"partition": "2", "state": "owned"},
            {"partition": "3", "state": "finished"},
        ]),
    );
    let out = changefeed(&[
        "lineage",
        "--partitions",
        &p,
        "--leases",
        &l,
        "--position",
        "now",
    ]);
    assert_eq!(
        plan_of(&out),
        json!({"create": [{"partition": "4", "start": "beginning"}]})
    );
}
