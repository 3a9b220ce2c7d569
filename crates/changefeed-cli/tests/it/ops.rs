//! Operator commands against a temporary SQLite store: status, reset, release.

use changefeed::lease::LeaseStore;
use changefeed::lease::{HeartbeatRole, MembershipStore};
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseState, PartitionId, Position, Timestamp,
};
use serde_json::Value;

use crate::support::{bin, key, text, Fixture};

/// Creates leases `0..n` in group `g`; partition 0 owned by `h1` with a checkpoint.
fn leases(fx: &Fixture, n: usize) {
    fx.with_store(async |s| {
        for i in 0..n {
            let lease = Lease::new(key("g", &i.to_string()), Position::Beginning);
            s.create(&lease).await.expect("create");
        }
        let mut l = s.get(&key("g", "0")).await.expect("get").expect("lease");
        let v = l.version;
        l.state = LeaseState::Owned;
        l.owner = Some(HostName::new("h1").expect("host"));
        l.continuation = Some(Continuation::new("0:5"));
        s.replace(&l, v).await.expect("take");
    });
}

#[test]
fn status_shows_a_malformed_row_as_an_error_line_and_the_rest_normally() {
    // DESIGN "Bad input": a malformed row is reported with its key; the others still show.
    let fx = Fixture::new();
    leases(&fx, 3);
    let conn = rusqlite::Connection::open(&fx.db).expect("open");
    conn.execute(
        "UPDATE changefeed_leases SET state = 'bogus' WHERE partition = '1'",
        [],
    )
    .expect("corrupt");
    drop(conn);
    let out = bin()
        .args(["status", "--store", &fx.url(), "--group", "g"])
        .output()
        .expect("status");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("error: lease g/1: malformed row"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with("error")).collect();
    assert!(rows[0].starts_with("PARTITION"), "{stdout}");
    assert!(
        rows[1].starts_with("0 ") && rows[1].contains("h1") && rows[1].contains("0:5"),
        "{stdout}"
    );
    assert!(rows[1].contains("no heartbeat"), "{stdout}");
    assert!(
        rows[2].starts_with("2 ") && rows[2].contains("available"),
        "{stdout}"
    );
    let out = bin()
        .args(["status", "--store", &fx.url(), "--group", "g", "--json"])
        .output()
        .expect("status");
    let j: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(j["leases"].as_array().map(Vec::len), Some(2));
    assert_eq!(j["errors"][0]["key"], "g/1");
}

/// A feed of `n` partitions in the fixture's file, partition 0 holding five records.
fn feed(fx: &Fixture, n: u32) {
    fx.with_feed(async |feed| {
        feed.create_partitions(n).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for i in 0..5 {
            feed.append_to(&p, "k", format!("r{i}"))
                .await
                .expect("append");
        }
    });
}

/// Makes the lease row of `partition` in group `g` unreadable.
fn corrupt(fx: &Fixture, partition: &str) {
    let conn = rusqlite::Connection::open(&fx.db).expect("open");
    conn.execute(
        "UPDATE changefeed_leases SET state = 'bogus' WHERE group_name = 'g' AND partition = ?1",
        [partition],
    )
    .expect("corrupt");
}

#[test]
fn reset_refuses_an_owned_lease_unless_forced_and_then_clears_the_owner() {
    // Moving an owned lease's checkpoint under its worker would be overwritten: refuse.
    let fx = Fixture::new();
    leases(&fx, 1);
    feed(&fx, 1);
    let before = fx.lease("g", "0").expect("lease");
    let reset = |extra: &[&str]| {
        bin()
            .args([
                "reset",
                "--store",
                &fx.url(),
                "--group",
                "g",
                "--partition",
                "0",
            ])
            .args(["--to", "0:2", "--source", &fx.url()])
            .args(extra)
            .output()
            .expect("reset")
    };
    let out = reset(&[]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert!(text(&out).1.contains("owned by h1"), "{:?}", text(&out));
    assert_eq!(fx.lease("g", "0"), Some(before.clone()), "nothing written");
    let out = reset(&["--force"]);
    assert!(out.status.success(), "{:?}", text(&out));
    let after = fx.lease("g", "0").expect("lease");
    assert_eq!(after.continuation, Some(Continuation::new("0:2")));
    assert_eq!((after.state, after.owner), (LeaseState::Available, None));
    assert_eq!(after.version, before.version.next(), "one CAS write");
    // A bad partition id is a usage error.
    let out = bin()
        .args([
            "reset",
            "--store",
            &fx.url(),
            "--group",
            "g",
            "--partition",
            " x",
            "--to",
            "now",
        ])
        .output()
        .expect("reset");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
}

#[test]
fn release_frees_a_dead_hosts_leases_and_removes_its_heartbeat() {
    // An operator can hand a dead host's leases back without waiting for expiry.
    let fx = Fixture::new();
    leases(&fx, 2);
    let group = GroupName::new("g").expect("group");
    let h1 = HostName::new("h1").expect("host");
    fx.with_store(async |s| {
        s.heartbeat(
            &group,
            &h1,
            "inc",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("heartbeat");
    });
    let out = bin()
        .args([
            "release",
            "--store",
            &fx.url(),
            "--group",
            "g",
            "--host",
            "h1",
            "--wait",
            "300ms",
        ])
        .output()
        .expect("release");
    assert!(out.status.success(), "{:?}", text(&out));
    let lease = fx.lease("g", "0").expect("lease");
    assert_eq!((lease.state, lease.owner), (LeaseState::Available, None));
    assert_eq!(
        lease.continuation,
        Some(Continuation::new("0:5")),
        "checkpoint kept"
    );
    let hosts = fx.with_store(async |s| s.membership(&group).await.expect("membership").hosts);
    assert!(hosts.is_empty(), "{hosts:?}");
}

/// `changefeed reset` on the fixture's store, group `g`, partition `partition`.
fn reset(fx: &Fixture, partition: &str, extra: &[&str]) -> std::process::Output {
    bin()
        .args(["reset", "--store", &fx.url(), "--group", "g"])
        .args(["--partition", partition])
        .args(extra)
        .output()
        .expect("reset")
}

#[test]
fn reset_to_a_continuation_needs_the_source_to_check_it() {
    // A continuation written unchecked could stop the partition for good.
    let fx = Fixture::new();
    leases(&fx, 2);
    feed(&fx, 2);
    let before = fx.lease("g", "1").expect("lease");
    let out = reset(&fx, "1", &["--to", "1:3"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("--source"), "{:?}", text(&out));
    // Refused by the source: another partition's token, and one past the end.
    for to in ["0:3", "1:3"] {
        let out = reset(&fx, "1", &["--to", to, "--source", &fx.url()]);
        assert_eq!(out.status.code(), Some(2), "{to}: {:?}", text(&out));
        assert!(
            text(&out).1.starts_with(&format!(
                "error: --to: partition 1: invalid continuation \"{to}\""
            )),
            "{to}: {:?}",
            text(&out)
        );
    }
    assert_eq!(fx.lease("g", "1"), Some(before), "nothing written");
    // Positions that need no source still do without one.
    let out = reset(&fx, "1", &["--to", "now"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(fx.lease("g", "1").expect("lease").start, Position::Now);
}

#[test]
fn lag_counts_a_malformed_row_as_unknown() {
    // An unreadable row is a partition whose lag nobody knows, not a missing one.
    let fx = Fixture::new();
    leases(&fx, 3);
    feed(&fx, 3);
    fx.with_feed(async |feed| {
        let p = PartitionId::new("1").expect("id");
        for i in 0..4 {
            feed.append_to(&p, "k", format!("r{i}"))
                .await
                .expect("append");
        }
    });
    corrupt(&fx, "2");
    let lag = |json: bool| {
        let mut c = bin();
        c.args([
            "lag",
            "--store",
            &fx.url(),
            "--source",
            &fx.url(),
            "--group",
            "g",
        ]);
        if json {
            c.arg("--json");
        }
        c.output().expect("lag")
    };
    let out = lag(false);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("2 "))
        .unwrap_or_else(|| panic!("a row for partition 2: {stdout}"));
    assert!(row.contains("error: lease g/2: malformed row"), "{stdout}");
    let total = stdout.lines().last().unwrap_or_default();
    assert!(
        total.starts_with("total 4, max ") && total.ends_with("s (1 partitions unknown)"),
        "{stdout}"
    );
    let j: Value = serde_json::from_slice(&lag(true).stdout).expect("json");
    assert_eq!(j["unknown"], 1, "{j}");
    assert_eq!(j["total"], 4, "{j}");
    assert_eq!(j["partitions"][2]["partition"], "2", "{j}");
    assert!(j["partitions"][2]["lag"].is_null(), "{j}");
}

#[test]
fn reset_force_rewrites_a_malformed_row_with_the_sources_lineage() {
    // An operator can repair an unreadable row; without --force it is refused.
    let fx = Fixture::new();
    leases(&fx, 2);
    feed(&fx, 2);
    corrupt(&fx, "0");
    let out = reset(&fx, "0", &["--to", "0:2", "--source", &fx.url()]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert!(
        text(&out)
            .1
            .starts_with("error: lease g/0: malformed row: ")
            && text(&out).1.contains("--force"),
        "{:?}",
        text(&out)
    );
    let out = reset(&fx, "0", &["--to", "beginning", "--force"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "needs the source: {:?}",
        text(&out)
    );
    assert!(
        text(&out).1.starts_with("error: --source: "),
        "{:?}",
        text(&out)
    );
    let out = reset(&fx, "0", &["--to", "0:2", "--force", "--source", &fx.url()]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(text(&out).0.contains("malformed row"), "{:?}", text(&out));
    let lease = fx.lease("g", "0").expect("readable again");
    assert_eq!(lease.continuation, Some(Continuation::new("0:2")));
    assert_eq!(
        (lease.state, lease.owner.clone()),
        (LeaseState::Available, None)
    );
    assert!(lease.parents.is_empty(), "an original partition");
    assert!(
        lease
            .properties
            .contains_key(changefeed::lineage::RANGE_PROPERTY),
        "the key range comes from the source: {lease:?}"
    );
    // The other lease is untouched.
    assert_eq!(
        fx.lease("g", "1").expect("lease").version,
        changefeed::model::Version::FIRST
    );
}

#[test]
fn lag_counts_the_children_of_a_split_that_have_no_lease_yet() {
    // `lag` counts the unread records of a split's children; it must not print `total 0`
    // while they hold some.
    // The children count from their beginning, shown as "(no lease)", with their records' age.
    use changefeed::clock::{Clock, SystemClock, VirtualClock};
    use changefeed_sqlite::SqliteFeed;
    use std::sync::Arc;
    let fx = Fixture::new();
    let hour_ago = Timestamp(SystemClock.wall().0 - 3_600_000);
    let (a, b) = fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p0 = PartitionId::new("0").expect("id");
        for i in 0..3 {
            feed.append_to(&p0, "k", format!("r{i}"))
                .await
                .expect("append");
        }
        let (a, b) = feed.split(&p0).await.expect("split");
        // Records stamped an hour ago by the writer's clock (the time the lag is measured by).
        let old = SqliteFeed::open_with_clock(&fx.db, Arc::new(VirtualClock::new(hour_ago)))
            .await
            .expect("open feed");
        for (child, n) in [(&a, 4), (&b, 6)] {
            for i in 0..n {
                old.append_to(child, "k", format!("c{i}"))
                    .await
                    .expect("append");
            }
        }
        (a, b)
    });
    fx.with_store(async |s| {
        // The parent's lease is caught up; the children have none yet.
        let mut l = Lease::new(key("g", "0"), Position::Beginning);
        l.continuation = Some(Continuation::new("0:3"));
        s.create(&l).await.expect("create");
    });
    let lag = |json: bool| {
        let mut c = bin();
        c.args([
            "lag",
            "--store",
            &fx.url(),
            "--source",
            &fx.url(),
            "--group",
            "g",
        ]);
        if json {
            c.arg("--json");
        }
        c.output().expect("lag")
    };
    let out = lag(false);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for (child, n) in [(&a, 4), (&b, 6)] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{child} ")))
            .unwrap_or_else(|| panic!("a row for child {child}: {stdout}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[1..4], ["(no", "lease)", "(beginning)"], "{stdout}");
        assert_eq!(cells[4], n.to_string(), "{stdout}");
        let secs: f64 = cells[5].parse().expect("seconds");
        assert!((3600.0..4200.0).contains(&secs), "an hour old: {stdout}");
    }
    let total = stdout.lines().last().unwrap_or_default();
    assert!(total.starts_with("total 10, max 36"), "{stdout}");
    let j: Value = serde_json::from_slice(&lag(true).stdout).expect("json");
    assert_eq!(j["total"], 10, "{j}");
    assert_eq!(j["unknown"], 0, "{j}");
    let max = j["max_seconds"].as_f64().expect("max_seconds");
    assert!((3600.0..4200.0).contains(&max), "{j}");
    let parent = &j["partitions"][0];
    assert_eq!(
        (
            &parent["partition"],
            &parent["leased"],
            &parent["lag"],
            &parent["seconds"]
        ),
        (
            &Value::from("0"),
            &Value::from(true),
            &Value::from(0),
            &Value::from(0.0)
        ),
        "the caught-up parent: {j}"
    );
    let unleased: Vec<(&str, u64)> = j["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .filter(|p| p["leased"] == false)
        .map(|p| {
            (
                p["partition"].as_str().unwrap_or(""),
                p["lag"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(unleased, [(a.as_str(), 4), (b.as_str(), 6)], "{j}");
}

#[test]
fn hosts_shows_what_each_host_publishes_capacity_limits_and_loads() {
    // What balancing goes by is visible: each host's capacity and own lease limits, and with
    // --json the loads it publishes; a host with an unreadable report shows none.
    let fx = Fixture::new();
    let group = GroupName::new("g").expect("group");
    let report = r#"{"v":1,"c":2.0,"max":3,"l":{"0":{"r":12.5,"b":400.0,"u":0.25}}}"#;
    fx.with_store(async |s| {
        for (host, report) in [("h1", Some(report)), ("h2", Some("not json")), ("h3", None)] {
            s.heartbeat(
                &group,
                &HostName::new(host).expect("host"),
                "inc",
                Timestamp(0),
                None,
                HeartbeatRole::Member,
                report,
            )
            .await
            .expect("heartbeat");
        }
    });
    let run = |json: bool| {
        let mut cmd = bin();
        cmd.args(["hosts", "--store", &fx.url(), "--group", "g"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("hosts");
        assert!(out.status.success(), "{:?}", text(&out));
        text(&out).0
    };
    let table = run(false);
    let cells: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        cells[0][cells[0].len() - 2..],
        ["CAPACITY", "LIMITS"],
        "{table}"
    );
    assert_eq!(
        (cells[1][0], &cells[1][cells[1].len() - 3..]),
        ("h1", &["2", "max", "3"][..]),
        "{table}"
    );
    assert_eq!(
        (cells[2][0], &cells[2][cells[2].len() - 2..]),
        ("h2", &["-", "-"][..]),
        "{table}"
    );
    let v: Value = serde_json::from_str(&run(true)).expect("JSON");
    let h1 = &v["hosts"][0];
    assert_eq!(
        (h1["capacity"].as_f64(), h1["max_leases"].as_u64()),
        (Some(2.0), Some(3))
    );
    assert!(h1["min_leases"].is_null(), "{h1}");
    assert_eq!(h1["load"]["0"]["records_per_second"].as_f64(), Some(12.5));
    assert_eq!(h1["load"]["0"]["busy"].as_f64(), Some(0.25));
    let h3 = &v["hosts"][2];
    assert!(
        h3["capacity"].is_null() && h3["load"] == serde_json::json!({}),
        "{h3}"
    );
}
