//! The CLI against PostgreSQL: `outbox create/append`, `run` on a `postgres://` store and a
//! `postgres-outbox://` source, and the operator commands on the same store.
//!
//! The server is `CHANGEFEED_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`, started by `.ci/run`). An unreachable server
//! fails the test with how to start it; it never skips.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::support::{
    bin, json, killed_host_keeps_its_leases_until_release, owned_by, read, run_ok, status,
    terminate, text, wait_exit, wait_for, Fixture, FAST,
};

/// The server under test.
pub fn pg_url() -> String {
    std::env::var("CHANGEFEED_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// `pg_url()` with a new scheme and our `prefix` parameter added.
pub fn cli_url(scheme: &str, prefix: &str) -> String {
    let url = pg_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let sep = if rest.contains('?') { '&' } else { '?' };
    format!("{scheme}://{rest}{sep}prefix={prefix}")
}

/// The lease store URL for `prefix`.
pub fn store_url(prefix: &str) -> String {
    cli_url("postgres", prefix)
}

/// The outbox source URL for `prefix`.
pub fn source_url(prefix: &str) -> String {
    cli_url("postgres-outbox", prefix)
}

/// A plain connection; fails loudly, saying how to start the server, when it is unreachable.
pub async fn raw_client() -> tokio_postgres::Client {
    let url = pg_url();
    match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(async move {
                let _ = connection.await;
            });
            client
        }
        Err(e) => panic!(
            "cannot reach PostgreSQL at {url}: {e}\n\
             Start it with `bash .ci/run` (it installs and starts PostgreSQL), or by hand:\n  \
             pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
             and make sure database `test` exists with trust auth on 127.0.0.1, or point \
             CHANGEFEED_TEST_POSTGRES_URL at another server."
        ),
    }
}

/// A table prefix unique to this test and run: `{tag}{millis}p{pid}`.
pub fn unique_prefix(tag: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
        % 10_000_000_000;
    format!("{tag}{ms}p{}", std::process::id())
}

/// Drops every table whose name starts with `{prefix}_`.
pub async fn drop_tables(prefix: &str) {
    let client = raw_client().await;
    let rows = client
        .query(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() \
             AND tablename LIKE $1",
            &[&format!("{prefix}\\_%")],
        )
        .await
        .expect("list tables");
    for row in rows {
        let name: String = row.get(0);
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS \"{name}\" CASCADE"))
            .await
            .expect("drop table");
    }
}

#[test]
fn run_reads_a_postgres_outbox_with_leases_in_postgres_and_operators_see_them() {
    // The CLI item: every command works against PostgreSQL, store and source.
    let prefix = unique_prefix("cli");
    let (store, source) = (store_url(&prefix), source_url(&prefix));
    crate::support::rt().block_on(raw_client());
    let out = run_ok(&["outbox", "--source", &source, "create", "--partitions", "3"]);
    assert_eq!(json(&out)["open"], serde_json::json!(["1.0", "1.1", "1.2"]));
    let again = run_ok(&["outbox", "--source", &source, "create", "--partitions", "3"]);
    assert_eq!(json(&again)["created"], false, "create is if-missing");
    for key in ["a", "b", "c", "d"] {
        let out = run_ok(&[
            "outbox", "--source", &source, "append", "--key", key, "--data", "v", "--count", "3",
        ]);
        assert_eq!(json(&out).as_array().map(Vec::len), Some(3));
    }
    let fx = Fixture::new();
    let delivered = fx.path("delivered.jsonl");
    let mut host = bin()
        .args(["run", "--store", &store, "--source", &source])
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
    for key in ["a", "b", "c", "d"] {
        let data: Vec<&str> = lines
            .iter()
            .filter(|l| l["key"] == key)
            .filter_map(|l| l["data"].as_str())
            .collect();
        assert_eq!(data, ["v-0", "v-1", "v-2"], "key {key} in order");
    }
    // status, hosts and lag read the same store (and the outbox for lag).
    let s = wait_for(Duration::from_secs(15), "h1 to own all 3 leases", || {
        let s = status(&store);
        (owned_by(&s, "h1") == 3).then_some(s)
    });
    assert_eq!(s["leases"].as_array().map(Vec::len), Some(3), "{s}");
    let hosts = run_ok(&["hosts", "--store", &store, "--group", "g"]);
    assert!(text(&hosts).0.contains("h1"), "{:?}", text(&hosts));
    wait_for(Duration::from_secs(15), "lag 0 after checkpoints", || {
        let out = run_ok(&[
            "lag", "--store", &store, "--source", &source, "--group", "g",
        ]);
        text(&out).0.contains("total 0").then_some(())
    });
    // A graceful stop releases the leases and keeps their checkpoints.
    terminate(&host);
    let status_code = wait_exit(&mut host, Duration::from_secs(20));
    assert!(status_code.success(), "graceful stop exits 0");
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
        "1.0",
        "--to",
        "beginning",
    ]);
    // A killed host keeps its leases until release frees them.
    killed_host_keeps_its_leases_until_release(&store, &source, 3);
    crate::support::rt().block_on(drop_tables(&prefix));
}

#[test]
fn postgres_urls_in_the_wrong_role_are_usage_errors() {
    // DESIGN "Bad input": exit 2 naming the setting, before anything connects.
    let prefix = unique_prefix("cliu");
    let out = bin()
        .args(["run", "--store", &source_url(&prefix)])
        .args(["--source", &source_url(&prefix), "--handler", "cat"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("store: postgres-outbox://"),
        "{:?}",
        text(&out)
    );
    let out = bin()
        .args(["status", "--store", &cli_url("postgres", "Bad-Prefix")])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("prefix"), "{:?}", text(&out));
    let out = bin()
        .args(["outbox", "--source", &store_url(&prefix), "list"])
        .output()
        .expect("outbox");
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
}

#[test]
fn reset_force_rewrites_a_malformed_postgres_row() {
    // An operator can repair an unreadable lease row on PostgreSQL as on SQLite: the store
    // reads the row's version alone, and `reset --force` replaces the row at that version.
    let prefix = unique_prefix("clim");
    let (store, source) = (store_url(&prefix), source_url(&prefix));
    let rt = crate::support::rt();
    let client = rt.block_on(raw_client());
    run_ok(&["outbox", "--source", &source, "create", "--partitions", "2"]);
    // A short run creates the leases (its partition sync), then stops.
    let mut host = bin()
        .args(["run", "--store", &store, "--source", &source])
        .args([
            "--group",
            "g",
            "--host",
            "h1",
            "--handler",
            "cat >/dev/null",
        ])
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    wait_for(Duration::from_secs(30), "the two leases", || {
        let s = status(&store);
        (s["leases"].as_array().map(Vec::len) == Some(2)).then_some(())
    });
    terminate(&host);
    assert!(wait_exit(&mut host, Duration::from_secs(20)).success());
    rt.block_on(client.execute(
        &format!("UPDATE {prefix}_leases SET state = 'sideways' WHERE partition = '1.0'"),
        &[],
    ))
    .expect("corrupt the row");
    let reset = |extra: &[&str]| {
        bin()
            .args(["reset", "--store", &store, "--group", "g"])
            .args(["--partition", "1.0", "--to", "beginning"])
            .args(extra)
            .output()
            .expect("run reset")
    };
    let out = reset(&["--source", &source]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("malformed row") && text(&out).1.contains("--force"),
        "{:?}",
        text(&out)
    );
    let out = reset(&["--force", "--source", &source]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(text(&out).0.contains("replaced"), "{:?}", text(&out));
    let s = status(&store);
    let lease = s["leases"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["partition"] == "1.0"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(lease["state"], "available", "readable again: {s}");
    rt.block_on(drop_tables(&prefix));
}
