//! The CLI with its leases in Cosmos DB (`cosmos://`), against the local server `.ci/run`
//! starts (`.ci/cosmos-server.sh`): a host runs, the operator commands read and change its
//! leases there.

use std::process::Stdio;
use std::time::Duration;

use changefeed::model::PartitionId;
use serde_json::Value;

use crate::support::{
    bin, killed_host_keeps_its_leases_until_release, owned_by, read, run_ok, status, terminate,
    text, wait_exit, wait_for, Fixture, FAST,
};

/// The local server's endpoint, or a panic saying how to start it.
fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_COSMOS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_COSMOS_URL is not set: start the local Cosmos DB server with \
             `eval \"$(bash .ci/cosmos-server.sh)\"` (or run `bash .ci/run`)"
        )
    })
}

/// A `cosmos://` store URL on a container no other test uses.
fn store_url() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "cosmos://local/changefeed-cli/leases-{}-{nanos}?endpoint={}",
        std::process::id(),
        endpoint()
    )
}

#[test]
fn run_and_the_operator_commands_keep_leases_in_cosmos_db() {
    let store = store_url();
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(3).await.expect("partitions");
        for p in 0..3 {
            let p = PartitionId::new(p.to_string()).expect("id");
            for i in 0..4 {
                feed.append_to(&p, &format!("k{p}"), format!("v-{i}"))
                    .await
                    .expect("append");
            }
        }
    });
    let delivered = fx.path("delivered.jsonl");
    let mut host = bin()
        .args(["run", "--store", &store, "--source", &fx.url()])
        .args(["--group", "g", "--host", "h1"])
        .arg("--handler")
        .arg(format!("cat >> '{}'", delivered.display()))
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start run");
    wait_for(Duration::from_secs(30), "all 12 records delivered", || {
        (read(&delivered).lines().count() >= 12).then_some(())
    });
    let lines: Vec<Value> = read(&delivered)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for p in 0..3 {
        let data: Vec<&str> = lines
            .iter()
            .filter(|l| l["key"] == format!("k{p}"))
            .filter_map(|l| l["data"].as_str())
            .collect();
        assert_eq!(data, ["v-0", "v-1", "v-2", "v-3"], "partition {p} in order");
    }
    wait_for(Duration::from_secs(15), "h1 to own all 3 leases", || {
        (owned_by(&status(&store), "h1") == 3).then_some(())
    });
    let hosts = run_ok(&["hosts", "--store", &store, "--group", "g"]);
    assert!(text(&hosts).0.contains("h1"), "{:?}", text(&hosts));
    wait_for(Duration::from_secs(15), "lag 0 after checkpoints", || {
        let out = run_ok(&[
            "lag",
            "--store",
            &store,
            "--source",
            &fx.url(),
            "--group",
            "g",
        ]);
        text(&out).0.contains("total 0").then_some(())
    });
    // A graceful stop releases the leases and keeps their checkpoints.
    terminate(&host);
    assert!(
        wait_exit(&mut host, Duration::from_secs(20)).success(),
        "graceful stop exits 0"
    );
    let s = status(&store);
    assert_eq!(owned_by(&s, "h1"), 0, "{s}");
    // reset moves a released lease's checkpoint back to the beginning.
    run_ok(&[
        "reset",
        "--store",
        &store,
        "--group",
        "g",
        "--partition",
        "0",
        "--to",
        "beginning",
    ]);
    let s = status(&store);
    let zero = s["leases"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["partition"] == "0"))
        .unwrap_or_else(|| panic!("lease 0 in {s}"));
    assert!(
        zero["continuation"].is_null(),
        "reset to the beginning clears the checkpoint: {zero}"
    );
    // A killed host keeps its leases until release frees them.
    killed_host_keeps_its_leases_until_release(&store, &fx.url(), 3);
}

#[test]
fn a_cosmos_account_without_a_key_is_a_usage_error_naming_the_variable() {
    let out = bin()
        .args(["status", "--store", "cosmos://myaccount/app/leases"])
        .env_remove("CHANGEFEED_COSMOS_KEY")
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("set CHANGEFEED_COSMOS_KEY"),
        "{:?}",
        text(&out)
    );
    let out = bin()
        .args(["run", "--store", "cosmos://myaccount/app/leases"])
        .args([
            "--source",
            "cosmos://myaccount/app/feed",
            "--handler",
            "cat",
        ])
        .env_remove("CHANGEFEED_COSMOS_KEY")
        .output()
        .expect("run");
    // A cosmos:// source needs the key as much as the store.
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("set CHANGEFEED_COSMOS_KEY"),
        "{:?}",
        text(&out)
    );
}
