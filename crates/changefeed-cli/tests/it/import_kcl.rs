//! `changefeed import-kcl` against DynamoDB Local: a KCL-shaped table in, our leases out.

use changefeed::lease::{LeaseStore, MembershipStore};
use changefeed::model::{Continuation, GroupName, LeaseState, Position};
use changefeed_dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore};

use crate::support::{bin, rt, text};

/// The DynamoDB Local endpoint, or a panic saying how to start it.
fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with \
             `eval \"$(bash .ci/aws-services.sh)\"` (or `bash .ci/run`)"
        )
    })
}

fn fresh_table(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

pub(crate) async fn connect(table: &str) -> DynamoLeaseStore {
    DynamoLeaseStore::connect(&AwsOptions::local(endpoint()), table)
        .await
        .unwrap_or_else(|e| panic!("cannot reach DynamoDB Local at {}: {e}", endpoint()))
}

/// Writes a KCL 2.x lease table: (leaseKey, checkpoint, sub-sequence, parents).
pub(crate) async fn write_kcl_table(
    store: &DynamoLeaseStore,
    table: &str,
    rows: &[(&str, &str, u64, &[&str])],
) {
    let client = store.client();
    client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("leaseKey")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("valid"),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("leaseKey")
                .key_type(KeyType::Hash)
                .build()
                .expect("valid"),
        )
        .send()
        .await
        .expect("create the KCL table");
    for (key, checkpoint, sub, parents) in rows {
        let mut req = client
            .put_item()
            .table_name(table)
            .item("leaseKey", AttributeValue::S(key.to_string()))
            .item("checkpoint", AttributeValue::S(checkpoint.to_string()))
            .item(
                "checkpointSubSequenceNumber",
                AttributeValue::N(sub.to_string()),
            )
            .item("leaseCounter", AttributeValue::N("42".into()))
            .item("leaseOwner", AttributeValue::S("java-worker-1".into()))
            .item(
                "ownerSwitchesSinceCheckpoint",
                AttributeValue::N("3".into()),
            );
        if !parents.is_empty() {
            req = req.item(
                "parentShardIds",
                AttributeValue::Ss(parents.iter().map(|p| p.to_string()).collect()),
            );
        }
        req.send().await.expect("write a KCL lease");
    }
}

const SEQ: &str = "49590338271490256608559692538361571095921575989136588898";

#[test]
fn import_kcl_creates_our_leases_at_the_kcl_checkpoints() {
    // A consumer moved from Java KCL resumes exactly where KCL stopped, via the CLI.
    let ours = fresh_table("cli-kcl-ours");
    let kcl = fresh_table("cli-kcl-app");
    let rows: &[(&str, &str, u64, &[&str])] = &[
        ("shardId-000000000000", "SHARD_END", 0, &[]),
        ("shardId-000000000001", SEQ, 0, &[]),
        (
            "shardId-000000000002",
            "TRIM_HORIZON",
            0,
            &["shardId-000000000000"],
        ),
        ("shardId-000000000003", "LATEST", 0, &[]),
    ];
    rt().block_on(async {
        let store = connect(&ours).await;
        write_kcl_table(&store, &kcl, rows).await;
    });
    let store_url = format!("dynamodb://{ours}?endpoint={}", endpoint());
    let import = || {
        bin()
            .args(["import-kcl", "--table", &kcl, "--store", &store_url])
            .args(["--group", "migrated", "--region", "us-east-1", "--json"])
            .args(["--failover-time", "1s"])
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .output()
            .expect("run changefeed import-kcl")
    };
    let out = import();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("watching the counters of 4 owned KCL lease(s)"),
        "the KCL's owners were watched before importing: {stderr}"
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(
        report["created"].as_array().map(Vec::len),
        Some(4),
        "{stdout}"
    );
    assert_eq!(
        report["skipped"].as_array().map(Vec::len),
        Some(0),
        "{stdout}"
    );

    let group = GroupName::new("migrated").expect("valid");
    let leases = rt().block_on(async { connect(&ours).await.list(&group).await.expect("list") });
    let by = |id: &str| {
        leases
            .leases
            .iter()
            .find(|l| l.key.partition.as_str() == id)
            .unwrap_or_else(|| panic!("{id} imported: {leases:?}"))
    };
    assert_eq!(by("shardId-000000000000").state, LeaseState::Finished);
    let l1 = by("shardId-000000000001");
    assert_eq!(
        l1.continuation,
        Some(Continuation::new(format!("{SEQ}/0"))),
        "at SEQ, skipping its user record 0 (the whole record unless KPL-aggregated)"
    );
    assert_eq!(
        l1.state,
        LeaseState::Available,
        "nobody owns an imported lease"
    );
    let l2 = by("shardId-000000000002");
    assert_eq!(l2.start, Position::Beginning);
    assert_eq!(l2.parents.len(), 1, "parents are kept for lineage");
    assert_eq!(by("shardId-000000000003").start, Position::Now);

    // Again: nothing new, still exit 0.
    let out = import();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(
        report["created"].as_array().map(Vec::len),
        Some(0),
        "{stdout}"
    );
    assert_eq!(
        report["existing"].as_array().map(Vec::len),
        Some(4),
        "{stdout}"
    );
}

#[test]
fn import_kcl_exits_1_naming_skipped_leases_and_2_on_bad_usage() {
    // An AT_TIMESTAMP checkpoint cannot be imported (the KCL does not store the time): the
    // rest is (a checkpoint inside a KPL aggregate at its sub-sequence number), and the exit
    // says so.
    let ours = fresh_table("cli-kcl-ours2");
    let kcl = fresh_table("cli-kcl-app2");
    let rows: &[(&str, &str, u64, &[&str])] = &[
        ("shardId-000000000001", SEQ, 0, &[]),
        ("shardId-000000000004", SEQ, 7, &[]),
        ("shardId-000000000005", "AT_TIMESTAMP", 0, &[]),
    ];
    rt().block_on(async {
        let store = connect(&ours).await;
        write_kcl_table(&store, &kcl, rows).await;
    });
    let out = bin()
        .args([
            "import-kcl",
            "--table",
            &kcl,
            "--store",
            &format!("dynamodb://{ours}"),
        ])
        .args(["--endpoint", &endpoint(), "--region", "us-east-1"])
        .args(["--failover-time", "1s"])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .expect("run changefeed import-kcl");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("shardId-000000000005") && stdout.contains("AT_TIMESTAMP"),
        "{stdout}"
    );
    assert!(stdout.contains("2 created"), "{stdout}");
    let group = GroupName::new("default").expect("valid");
    let leases = rt().block_on(async { connect(&ours).await.list(&group).await.expect("list") });
    let l4 = leases
        .leases
        .iter()
        .find(|l| l.key.partition.as_str() == "shardId-000000000004")
        .unwrap_or_else(|| panic!("the sub-sequence checkpoint imported: {leases:?}"));
    assert_eq!(
        l4.continuation,
        Some(Continuation::new(format!("{SEQ}/7"))),
        "right after user record 7 of the aggregate at SEQ"
    );

    let out = bin()
        .args(["import-kcl", "--table", &kcl, "--store", "sqlite://x.db"])
        .output()
        .expect("run changefeed import-kcl");
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--store"), "{stderr}");
}

#[test]
fn import_kcl_refuses_while_a_kcl_worker_renews_its_leases_naming_each() {
    // Two fleets on one stream would both deliver: while a KCL worker still renews a lease
    // (its leaseCounter moves within the failover time, as the KCL judges liveness), nothing
    // is imported and the lease and its owner are named.
    let ours = fresh_table("cli-kcl-ours3");
    let kcl = fresh_table("cli-kcl-app3");
    let rows: &[(&str, &str, u64, &[&str])] = &[
        ("shardId-000000000001", SEQ, 0, &[]),
        ("shardId-000000000002", SEQ, 0, &[]),
    ];
    rt().block_on(async {
        let store = connect(&ours).await;
        write_kcl_table(&store, &kcl, rows).await;
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let renewer = {
        let (stop, kcl, ours) = (stop.clone(), kcl.clone(), ours.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let store = connect(&ours).await;
                // A live KCL worker: renews shardId-1 every 100 ms (its renewals are a third
                // of the failover time by default).
                let mut renewals = tokio::time::interval(std::time::Duration::from_millis(100));
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    renewals.tick().await;
                    store
                        .client()
                        .update_item()
                        .table_name(&kcl)
                        .key("leaseKey", AttributeValue::S("shardId-000000000001".into()))
                        .update_expression("ADD leaseCounter :one")
                        .expression_attribute_values(":one", AttributeValue::N("1".into()))
                        .send()
                        .await
                        .expect("renew");
                }
            });
        })
    };
    let out = bin()
        .args(["import-kcl", "--table", &kcl, "--store"])
        .arg(format!("dynamodb://{ours}?endpoint={}", endpoint()))
        .args(["--region", "us-east-1", "--failover-time", "1s"])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .expect("run changefeed import-kcl");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    renewer.join().expect("renewer");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("shardId-000000000001: held by java-worker-1 (leaseCounter ")
            && stderr.contains(" within 1s)"),
        "the live lease and its owner named: {stderr}"
    );
    assert!(
        !stderr.contains("shardId-000000000002:"),
        "a lease nobody renews is not live: {stderr}"
    );
    assert!(stderr.contains("Nothing was imported"), "{stderr}");
    let group = GroupName::new("default").expect("valid");
    let leases = rt().block_on(async { connect(&ours).await.list(&group).await.expect("list") });
    assert!(leases.leases.is_empty(), "nothing written: {leases:?}");
}

#[test]
fn run_pointed_at_a_kcl_lease_table_says_what_it_is_and_how_to_import_it() {
    // A KCL user who gives `run` the application's own lease table is told at once (exit 78,
    // no retries) that it is the KCL's, and the import-kcl line to run instead.
    let kcl = fresh_table("cli-kcl-own");
    rt().block_on(async {
        let store = connect(&fresh_table("cli-kcl-any")).await;
        write_kcl_table(&store, &kcl, &[("shardId-000000000001", SEQ, 0, &[])]).await;
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let feed = format!("sqlite://{}", dir.path().join("feed.db").display());
    let out = bin()
        .args(["run", "--store"])
        .arg(format!(
            "dynamodb://{kcl}?endpoint={}&region=us-east-1",
            endpoint()
        ))
        .args(["--source", &feed, "--group", "app", "--handler", "cat"])
        .args(["--start-timeout", "30s"])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .expect("run changefeed run");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(78), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("table {kcl} is a KCL application's lease table"))
            && stderr.contains(&format!(
                "changefeed import-kcl --table {kcl} --store dynamodb://{kcl}-changefeed"
            )),
        "{stderr}"
    );
}

#[test]
fn export_kcl_refuses_while_a_changefeed_host_runs_naming_it() {
    // The way back must not hand the KCL leases our hosts still deliver: while a host of the
    // group renews its heartbeat, nothing is written to the KCL table and the host is named.
    let ours = fresh_table("cli-kcl-back");
    let kcl = fresh_table("cli-kcl-back-app");
    rt().block_on(async {
        let store = connect(&ours).await;
        write_kcl_table(&store, &kcl, &[("0", SEQ, 0, &[])]).await;
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let feed = format!("sqlite://{}", dir.path().join("feed.db").display());
    crate::support::run_ok(&["feed", "--db", &feed["sqlite://".len()..], "create", "1"]);
    let store_url = format!("dynamodb://{ours}?endpoint={}&region=us-east-1", endpoint());
    let mut host = crate::support::KillOnDrop(
        bin()
            .args(["run", "--store", &store_url, "--source", &feed])
            .args(["--group", "app", "--handler", "cat", "--host", "h-back"])
            .args(crate::support::FAST)
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start run"),
    );
    let group = GroupName::new("app").expect("valid");
    crate::support::wait_for(
        std::time::Duration::from_secs(30),
        "the host registered",
        || {
            let hosts = rt().block_on(async {
                connect(&ours)
                    .await
                    .membership(&group)
                    .await
                    .expect("membership")
            });
            (!hosts.hosts.is_empty()).then_some(())
        },
    );
    let out = bin()
        .args(["export-kcl", "--table", &kcl, "--store", &store_url])
        .args(["--group", "app", "--expiry", "2s"])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .expect("run changefeed export-kcl");
    crate::support::terminate(&host.0);
    crate::support::wait_exit(&mut host.0, std::time::Duration::from_secs(15));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("host(s) h-back of group app still renew their heartbeats")
            && stderr.contains("Nothing was written"),
        "{stderr}"
    );
    let checkpoint = rt().block_on(async {
        connect(&ours)
            .await
            .client()
            .get_item()
            .table_name(&kcl)
            .key("leaseKey", AttributeValue::S("0".into()))
            .send()
            .await
            .expect("get")
            .item()
            .and_then(|i| i.get("checkpoint").cloned())
    });
    assert_eq!(
        checkpoint,
        Some(AttributeValue::S(SEQ.into())),
        "the KCL table untouched"
    );
}
