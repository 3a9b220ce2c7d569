//! `changefeed import-cosmos` against the local Cosmos DB server (`.ci/cosmos-server.sh`): a
//! .NET change feed processor's lease container, written as the .NET processor writes it, in;
//! our leases out.

use changefeed::clock::{Clock, SystemClock};
use changefeed::model::Timestamp;
use changefeed_cosmos::testkit::dotnet::{self, LeaseFields as Dotnet};
use changefeed_cosmos::testkit::RawContainer;
use changefeed_cosmos::CosmosOptions;
use serde_json::{json, Value};

use crate::support::{bin, rt, text, Fixture};

/// The local server's endpoint, or a panic saying how to start it.
fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_COSMOS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_COSMOS_URL is not set: start the local Cosmos DB server with \
             `eval \"$(bash .ci/cosmos-server.sh)\"` (or run `bash .ci/run`)"
        )
    })
}

/// A container name no other test uses.
fn fresh(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// Writes `docs` into a fresh container partitioned by `/id` (as the .NET processor requires)
/// and returns its `cosmos://` URL.
fn dotnet_container(docs: &[Value]) -> String {
    let container = fresh("dotnet-leases");
    let options = CosmosOptions::new(endpoint(), "changefeed-cli", &container);
    rt().block_on(async {
        let raw = RawContainer::create(&options, "/id")
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot reach the local Cosmos DB server at {} ({e}): start it with \
                     `eval \"$(bash .ci/cosmos-server.sh)\"`",
                    endpoint()
                )
            });
        for doc in docs {
            raw.create_document(doc)
                .await
                .expect("write a .NET document");
        }
    });
    format!(
        "cosmos://local/changefeed-cli/{container}?endpoint={}",
        endpoint()
    )
}

const PREFIX: &str = "ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=";

fn now() -> Timestamp {
    SystemClock.wall()
}

/// The group's leases as `status --json` shows them.
fn status(store: &str) -> Vec<Value> {
    let out = bin()
        .args(["status", "--store", store, "--group", "migrated", "--json"])
        .output()
        .expect("run status");
    assert!(out.status.success(), "{:?}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON status");
    v["leases"].as_array().cloned().unwrap_or_default()
}

#[test]
fn import_cosmos_creates_our_leases_at_the_dotnet_continuations() {
    // A stopped .NET v3 fleet's EPK leases (with .info and .lock) become ours, available, at
    // their continuations; --dry-run writes nothing first; a second run creates nothing.
    let long_ago = Timestamp(now().0 - 3_600_000);
    let lease = |token: &str, range, owner, continuation| {
        dotnet::v3_epk_lease(
            PREFIX,
            token,
            range,
            &Dotnet {
                owner,
                continuation,
                renewed_at: Some(long_ago),
                ..Dotnet::default()
            },
        )
    };
    let container = dotnet_container(&[
        lease(
            "0",
            ("", "7FFFFFFFFFFFFFFF"),
            Some("dotnet-host-1"),
            Some("\"42\""),
        ),
        lease(
            "7FFFFFFFFFFFFFFF-FF",
            ("7FFFFFFFFFFFFFFF", "FF"),
            None,
            None,
        ),
        dotnet::v3_info(PREFIX),
        dotnet::v3_lock(PREFIX, 30),
    ]);
    let fx = Fixture::new();
    let store = fx.url();
    let import = |extra: &[&str]| {
        bin()
            .args(["import-cosmos", "--lease-container", &container])
            .args(["--store", &store, "--group", "migrated"])
            .args(extra)
            .output()
            .expect("run changefeed import-cosmos")
    };

    let out = import(&["--dry-run"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("would-create"), "{stdout}");
    assert!(
        stdout.contains("RESULT created=2 existing=0 replaced=0 skipped=0 dry_run=true"),
        "{stdout}"
    );
    assert!(stderr.contains(".lock is present"), "{stderr}");
    assert!(status(&store).is_empty(), "a dry run writes nothing");

    let out = import(&["--json"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(report["processor"], PREFIX);
    assert_eq!(report["initialized"], true);
    let results: Vec<(&str, &str)> = report["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .map(|l| {
            (
                l["partition"].as_str().unwrap_or_default(),
                l["result"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        results,
        [("0", "created"), ("7FFFFFFFFFFFFFFF-FF", "created")]
    );
    assert_eq!(report["leases"][0]["dotnet_owner"], "dotnet-host-1");

    let leases = status(&store);
    let seen: Vec<Value> = leases
        .iter()
        .map(|l| {
            json!([
                l["partition"],
                l["state"],
                l["owner"],
                l["start"],
                l["continuation"]
            ])
        })
        .collect();
    assert_eq!(
        seen,
        [
            json!(["0", "available", null, "beginning", "\"42\""]),
            json!(["7FFFFFFFFFFFFFFF-FF", "available", null, "beginning", null]),
        ]
    );

    // Again, as a table: both already there at the .NET continuation.
    let out = import(&[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("already at the .NET continuation"),
        "{stdout}"
    );
    assert!(
        stdout.contains("RESULT created=0 existing=2 replaced=0 skipped=0 dry_run=false"),
        "{stdout}"
    );
}

#[test]
fn import_cosmos_refuses_live_dotnet_leases_and_writes_nothing() {
    // An owned lease renewed just now (v3 timestamp) or with only the server's _ts (v2): exit 1,
    // the error names the leases and owners, and our store stays empty.
    let container = dotnet_container(&[
        dotnet::v3_epk_lease(
            PREFIX,
            "0",
            ("", "FF"),
            &Dotnet {
                owner: Some("dotnet-host-1"),
                continuation: Some("\"42\""),
                renewed_at: Some(now()),
                ..Dotnet::default()
            },
        ),
        dotnet::v3_info(PREFIX),
    ]);
    let fx = Fixture::new();
    let store = fx.url();
    let out = bin()
        .args(["import-cosmos", "--lease-container", &container])
        .args(["--store", &store, "--group", "migrated"])
        .output()
        .expect("run changefeed import-cosmos");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    for needle in [
        "refusing to import",
        &format!("{PREFIX}..0"),
        "dotnet-host-1",
        "Nothing was written",
    ] {
        assert!(stderr.contains(needle), "{needle} in {stderr}");
    }
    assert!(status(&store).is_empty(), "nothing written");

    let v2 = dotnet_container(&[dotnet::v2_lease(
        PREFIX,
        "3",
        &Dotnet {
            owner: Some("dotnet-host-2"),
            continuation: Some("\"9\""),
            ..Dotnet::default()
        },
    )]);
    let out = bin()
        .args(["import-cosmos", "--lease-container", &v2])
        .args(["--store", &store, "--group", "migrated", "--dry-run"])
        .output()
        .expect("run changefeed import-cosmos");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("dotnet-host-2"), "{stderr}");
    assert!(status(&store).is_empty(), "nothing written");
}

#[test]
fn import_cosmos_exits_2_on_bad_usage() {
    // Flags that cannot work are named before anything is read.
    let fx = Fixture::new();
    let store = fx.url();
    let cosmos = format!("cosmos://local/db/leases?endpoint={}", endpoint());
    let cases: &[(&[&str], &str)] = &[
        (
            &["--lease-container", "sqlite://x.db", "--store", &store],
            "--lease-container",
        ),
        (
            &[
                "--lease-container",
                &cosmos,
                "--store",
                &store,
                "--start-position",
                "after:42",
            ],
            "--start-position",
        ),
        (
            &[
                "--lease-container",
                &cosmos,
                "--store",
                &store,
                "--expiry",
                "soon",
            ],
            "--expiry",
        ),
        (
            &["--lease-container", &cosmos, "--store", &cosmos],
            "a container of their own",
        ),
    ];
    for (args, needle) in cases {
        let out = bin()
            .arg("import-cosmos")
            .args(*args)
            .output()
            .expect("run changefeed import-cosmos");
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{needle} in {stderr}");
    }
}
