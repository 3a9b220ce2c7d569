//! Taking over a .NET change feed processor's lease container on the local server: documents
//! written as the .NET processor writes them (v3 EPK leases with their `.info` and `.lock`
//! markers, v2 `PartitionId` leases), imported into our store.

use std::sync::Arc;
use std::time::Duration;

use changefeed::clock::{Clock, SystemClock, VirtualClock};
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position,
    Timestamp,
};
use changefeed::source::{FeedSource, LeasedPartition};
use changefeed_cosmos::import::{DotnetSchema, ImportOutcome};
use changefeed_cosmos::testkit::dotnet::{self, LeaseFields as Dotnet};
use changefeed_cosmos::testkit::RawContainer;
use changefeed_cosmos::{
    import_dotnet_leases, CosmosFeed, CosmosLeaseStore, DotnetLeaseContainer, ImportError,
    ImportOptions,
};
use serde_json::Value;

use crate::{fresh_options, fresh_store};

fn group() -> GroupName {
    GroupName::new("migrated").expect("valid")
}

fn key(partition: &str) -> LeaseKey {
    LeaseKey::new(group(), PartitionId::new(partition).expect("valid"))
}

/// A fresh .NET lease container (partitioned by `partition_key_path`) holding `docs`, and a
/// read-only handle on it.
async fn dotnet_container(partition_key_path: &str, docs: &[Value]) -> DotnetLeaseContainer {
    let options = fresh_options("dotnet-leases");
    let raw = RawContainer::create(&options, partition_key_path)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach the local Cosmos DB server at {} ({e}): start it with \
                 `eval \"$(bash .ci/cosmos-server.sh)\"`",
                crate::endpoint()
            )
        });
    for doc in docs {
        raw.create_document(doc)
            .await
            .expect("write a .NET document");
    }
    DotnetLeaseContainer::new(&options).expect("valid options")
}

/// The documents of `container`, by id, without what the server changes on every read.
async fn snapshot(container: &DotnetLeaseContainer) -> Vec<Value> {
    let mut docs = container
        .documents()
        .await
        .expect("read the .NET container");
    docs.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    docs
}

/// Where our lease of `partition` resumes.
async fn resume(target: &CosmosLeaseStore, partition: &str) -> Position {
    target
        .get(&key(partition))
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("no lease {partition}"))
        .resume_position()
}

fn now() -> Timestamp {
    SystemClock.wall()
}

/// Options whose clock reads `offset` from now.
fn at(offset: Duration) -> ImportOptions {
    let clock = VirtualClock::new(Timestamp(now().0 + offset.as_millis() as i64));
    ImportOptions::default().clock(Arc::new(clock))
}

const V3: &str = "ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=";
const V2: &str = "legacyacct.documents.azure.com_Ab0CAA==_Ab0CAJ9xQwE=";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v3_epk_leases_are_taken_over_at_their_continuations() {
    // A stopped .NET v3 fleet's leases become ours: same ranges, same continuations, no owner;
    // the .NET container is only read; a second run creates nothing.
    let long_ago = Timestamp(now().0 - 3_600_000);
    let docs = [
        dotnet::v3_epk_lease(
            V3,
            "0",
            ("", "7FFFFFFFFFFFFFFF"),
            &Dotnet {
                owner: Some("dotnet-host-1"),
                continuation: Some("\"42\""),
                renewed_at: Some(long_ago),
                properties: &[("strategy", "a")],
            },
        ),
        dotnet::v3_epk_lease(
            V3,
            "7FFFFFFFFFFFFFFF-BFFFFFFFFFFFFFFF",
            ("7FFFFFFFFFFFFFFF", "BFFFFFFFFFFFFFFF"),
            &Dotnet {
                continuation: Some("\"1077\""),
                renewed_at: Some(long_ago),
                ..Dotnet::default()
            },
        ),
        dotnet::v3_epk_lease(
            V3,
            "BFFFFFFFFFFFFFFF-FF",
            ("BFFFFFFFFFFFFFFF", "FF"),
            &Dotnet {
                renewed_at: Some(long_ago),
                ..Dotnet::default()
            },
        ),
        dotnet::v3_info(V3),
        dotnet::v3_lock(V3, 30),
    ];
    let container = dotnet_container("/id", &docs).await;
    let before = snapshot(&container).await;
    let target = fresh_store("import-target").await;

    let report = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect("import");
    assert_eq!(report.processor, V3);
    assert!(report.initialized, "the .info marker is seen");
    assert!(report.initialization_lock, "the .lock marker is seen");
    assert_eq!(report.count("created"), 3, "{report:?}");
    assert!(report
        .leases
        .iter()
        .all(|l| l.schema == DotnetSchema::V3Epk));

    let listing = target.list(&group()).await.expect("list");
    assert!(listing.malformed.is_empty(), "{:?}", listing.malformed);
    let found: Vec<(&str, Option<&str>, LeaseState, Option<&HostName>)> = listing
        .leases
        .iter()
        .map(|l| {
            (
                l.key.partition.as_str(),
                l.continuation.as_ref().map(Continuation::as_str),
                l.state,
                l.owner.as_ref(),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            ("0", Some("\"42\""), LeaseState::Available, None),
            (
                "7FFFFFFFFFFFFFFF-BFFFFFFFFFFFFFFF",
                Some("\"1077\""),
                LeaseState::Available,
                None
            ),
            ("BFFFFFFFFFFFFFFF-FF", None, LeaseState::Available, None),
        ]
    );
    let l0 = &listing.leases[0];
    assert_eq!(l0.start, Position::Beginning);
    assert_eq!(
        l0.properties.get("dotnet.id").map(String::as_str),
        Some(format!("{V3}..0").as_str())
    );
    assert_eq!(
        l0.properties.get("dotnet.feed_range").map(String::as_str),
        Some(r#"{"min":"","max":"7FFFFFFFFFFFFFFF"}"#)
    );
    assert_eq!(
        l0.properties
            .get("dotnet.property.strategy")
            .map(String::as_str),
        Some("a")
    );
    assert_eq!(
        listing.leases[2].resume_position(),
        Position::Beginning,
        "never checkpointed: from the beginning"
    );
    assert_eq!(
        snapshot(&container).await,
        before,
        "the .NET container is not written"
    );

    // Again: every lease is there already, at the same place; nothing is written.
    let again = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect("import again");
    assert!(
        again.leases.iter().all(|l| l.outcome
            == ImportOutcome::Existing {
                same_position: true
            }),
        "{again:?}"
    );
    let relisted = target.list(&group()).await.expect("list");
    assert_eq!(relisted.leases, listing.leases, "nothing rewritten");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_epk_leases_of_a_merged_range_open_in_the_feed_source() {
    // A .NET v3 fleet whose ranges merged holds EPK leases "{min}-{max}" (the old
    // ranges, now parts of one). Imported, they are the feed source's partitions in place of
    // the range they cover, and each opens there, read with its EPK bounds from its
    // continuation. (The local server's one range [, FF) plays the merged range; its change
    // feed is not Cosmos DB's, so only the requests and its 304 are checked.)
    let long_ago = Timestamp(now().0 - 3_600_000);
    let at = |continuation| Dotnet {
        continuation: Some(continuation),
        renewed_at: Some(long_ago),
        ..Dotnet::default()
    };
    let docs = [
        dotnet::v3_epk_lease(V3, "-80", ("", "80"), &at("\"42\"")),
        dotnet::v3_epk_lease(V3, "80-FF", ("80", "FF"), &at("\"57\"")),
        dotnet::v3_info(V3),
    ];
    let container = dotnet_container("/id", &docs).await;
    let target = fresh_store("import-target").await;
    let report = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect("import");
    assert_eq!(report.count("created"), 2, "{report:?}");
    let leases = target.list(&group()).await.expect("list").leases;

    let monitored = fresh_options("monitored");
    RawContainer::create(&monitored, "/tenant")
        .await
        .expect("the monitored container on the local server");
    let feed = CosmosFeed::connect(&monitored).await.expect("connect");
    let leased: Vec<LeasedPartition> = leases.iter().map(|l| LeasedPartition::of(l)).collect();
    let parts = feed.partitions_for(&leased).await.expect("partitions");
    let shape: Vec<(&str, usize, bool)> = parts
        .iter()
        .map(|p| (p.id.as_str(), p.parents.len(), p.closed))
        .collect();
    assert_eq!(
        shape,
        [("-80", 0, false), ("80-FF", 0, false)],
        "range 0 is read through the imported leases only"
    );
    let expected = [("", "80", "\"42\""), ("80", "FF", "\"57\"")];
    for (lease, (min, max, etag)) in leases.iter().zip(expected) {
        let from = lease.resume_position();
        let headers = feed
            .first_read_headers(&lease.key.partition, &from)
            .await
            .expect("placed")
            .expect("not ended");
        for wanted in [
            ("x-ms-documentdb-partitionkeyrangeid", "0"),
            ("x-ms-read-key-type", "EffectivePartitionKeyRange"),
            ("x-ms-start-epk", min),
            ("x-ms-end-epk", max),
            ("if-none-match", etag),
        ] {
            assert!(
                headers.iter().any(|(h, v)| (*h, v.as_str()) == wanted),
                "{wanted:?} in {headers:?}"
            );
        }
        let mut reader = feed
            .open(&lease.key.partition, &from)
            .await
            .expect("an imported EPK lease opens");
        let batch = reader.next_batch(10).await.expect("read");
        assert!(
            batch.records.is_empty() && !batch.end_of_partition,
            "the server's 304: caught up, still open"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_partition_leases_are_taken_over_and_a_dry_run_writes_nothing() {
    // The v2 library's PartitionId leases import the same way; a dry run only reports.
    let long_ago = Timestamp(now().0 - 600_000);
    let state = |continuation| Dotnet {
        continuation,
        renewed_at: Some(long_ago),
        ..Dotnet::default()
    };
    let docs = [
        dotnet::v2_lease(V2, "0", &state(Some("\"2468759\""))),
        dotnet::v2_lease(V2, "1", &state(Some("\"1357\""))),
        dotnet::v2_lease(V2, "2", &state(None)),
        dotnet::v2_info(V2),
    ];
    let container = dotnet_container("/id", &docs).await;
    let target = fresh_store("import-target").await;
    let options = ImportOptions::default().start(Position::Now);

    let dry = import_dotnet_leases(
        &container,
        &target,
        &group(),
        &options.clone().dry_run(true),
    )
    .await
    .expect("dry run");
    assert!(dry.dry_run);
    assert_eq!(dry.count("would-create"), 3, "{dry:?}");
    assert!(
        target.list(&group()).await.expect("list").leases.is_empty(),
        "a dry run writes nothing"
    );

    let report = import_dotnet_leases(&container, &target, &group(), &options)
        .await
        .expect("import");
    assert_eq!(report.count("created"), 3, "{report:?}");
    assert!(report.leases.iter().all(|l| l.schema == DotnetSchema::V2));
    assert_eq!(
        resume(&target, "0").await,
        Position::Continuation(Continuation::new("\"2468759\""))
    );
    assert_eq!(
        resume(&target, "1").await,
        Position::Continuation(Continuation::new("\"1357\""))
    );
    assert_eq!(
        resume(&target, "2").await,
        Position::Now,
        "no continuation: the start position"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_dotnet_leases_are_refused_and_nothing_is_written() {
    // Owned and renewed within the expiry, by `timestamp` (v3) or by `_ts` when there is none
    // (v2): a .NET host may still read them. Refused, naming them; after the expiry, imported.
    let fresh = now();
    let docs = [
        dotnet::v3_epk_lease(
            V3,
            "0",
            ("", "FF"),
            &Dotnet {
                owner: Some("dotnet-host-1"),
                continuation: Some("\"42\""),
                renewed_at: Some(fresh),
                ..Dotnet::default()
            },
        ),
        dotnet::v3_info(V3),
        // Another processor's lease, owned, timestamp null: the server's _ts (now) counts.
        dotnet::v2_lease(
            V2,
            "5",
            &Dotnet {
                owner: Some("dotnet-host-2"),
                continuation: Some("\"9\""),
                ..Dotnet::default()
            },
        ),
    ];
    let container = dotnet_container("/id", &docs).await;
    let target = fresh_store("import-target").await;

    for (prefix, id, owner) in [
        ("orders", format!("{V3}..0"), "dotnet-host-1"),
        ("legacy", format!("{V2}..5"), "dotnet-host-2"),
    ] {
        let err = import_dotnet_leases(
            &container,
            &target,
            &group(),
            &ImportOptions::default().processor(prefix),
        )
        .await
        .expect_err("live leases are refused");
        let ImportError::Live { leases, .. } = &err else {
            panic!("{err}");
        };
        assert_eq!(leases.len(), 1, "{err}");
        assert_eq!(
            (leases[0].id.as_str(), leases[0].owner.as_str()),
            (id.as_str(), owner)
        );
        let text = err.to_string();
        assert!(text.contains(&id) && text.contains(owner), "{text}");
        assert!(
            target.list(&group()).await.expect("list").leases.is_empty(),
            "nothing written"
        );
        // --dry-run is refused the same way.
        let dry = ImportOptions::default().processor(prefix).dry_run(true);
        let err = import_dotnet_leases(&container, &target, &group(), &dry)
            .await
            .expect_err("refused");
        assert!(matches!(err, ImportError::Live { .. }), "{err}");
    }

    // A minute and a bit later (by the importer's clock) both have expired.
    let later = at(Duration::from_secs(61)).processor("orders");
    let report = import_dotnet_leases(&container, &target, &group(), &later)
        .await
        .expect("expired leases are imported");
    assert_eq!(report.count("created"), 1);
    assert_eq!(
        report.leases[0].dotnet_owner.as_deref(),
        Some("dotnet-host-1")
    );
    assert_eq!(report.other_processors, [V2]);
    let lease = target.get(&key("0")).await.expect("get").expect("lease 0");
    assert_eq!((lease.state, lease.owner), (LeaseState::Available, None));
    assert_eq!(lease.continuation, Some(Continuation::new("\"42\"")));
    // The fleet's own LeaseExpirationInterval, when longer, refuses again.
    let longer = at(Duration::from_secs(61))
        .processor("legacy")
        .expiry(Duration::from_secs(300));
    assert!(matches!(
        import_dotnet_leases(&container, &target, &group(), &longer).await,
        Err(ImportError::Live { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_replaces_unowned_leases_and_never_owned_ones() {
    // Leases already in our store stay unless forced; forced, an unowned one moves to the .NET
    // continuation and one our host owns is left and reported.
    let long_ago = Timestamp(now().0 - 3_600_000);
    let state = |continuation| Dotnet {
        continuation: Some(continuation),
        renewed_at: Some(long_ago),
        ..Dotnet::default()
    };
    let docs = [
        dotnet::v3_pkrange_lease(V3, "0", &state("\"500\"")),
        dotnet::v3_pkrange_lease(V3, "1", &state("\"600\"")),
        dotnet::v3_info(V3),
    ];
    let container = dotnet_container("/id", &docs).await;
    let target = fresh_store("import-target").await;
    let mut stale = Lease::new(key("0"), Position::Beginning);
    stale.continuation = Some(Continuation::new("\"100\""));
    target.create(&stale).await.expect("create").expect("new");
    let created = target
        .create(&Lease::new(key("1"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    let mut owned = created.clone();
    owned.state = LeaseState::Owned;
    owned.owner = Some(HostName::new("rust-host").expect("valid"));
    let owned = target.replace(&owned, created.version).await.expect("own");

    let report = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect("import");
    assert_eq!(
        report
            .leases
            .iter()
            .map(|l| l.outcome.clone())
            .collect::<Vec<_>>(),
        [
            ImportOutcome::Existing {
                same_position: false
            },
            ImportOutcome::Existing {
                same_position: false
            }
        ]
    );
    assert_eq!(
        target
            .get(&key("0"))
            .await
            .expect("get")
            .map(|l| l.continuation),
        Some(Some(Continuation::new("\"100\""))),
        "left as it was"
    );

    let forced = ImportOptions::default().force(true);
    let report = import_dotnet_leases(&container, &target, &group(), &forced)
        .await
        .expect("forced import");
    assert_eq!(report.leases[0].outcome, ImportOutcome::Replaced);
    let ImportOutcome::Skipped { reason } = &report.leases[1].outcome else {
        panic!("{report:?}");
    };
    assert!(reason.contains("rust-host"), "{reason}");
    let l0 = target.get(&key("0")).await.expect("get").expect("lease 0");
    assert_eq!(l0.continuation, Some(Continuation::new("\"500\"")));
    assert_eq!(l0.state, LeaseState::Available);
    assert_eq!(
        target.get(&key("1")).await.expect("get"),
        Some(owned),
        "an owned lease is never replaced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_partitioned_by_partition_key_is_read_across_partitions() {
    // The v3 SDK also accepts a lease container partitioned by /partitionKey, where each lease
    // carries a GUID there: the importer reads every logical partition.
    let long_ago = Timestamp(now().0 - 3_600_000);
    let docs: Vec<Value> = ["0", "1", "2", "3"]
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let continuation = format!("\"{}\"", 100 + i);
            let mut doc = dotnet::v3_pkrange_lease(
                V3,
                token,
                &Dotnet {
                    continuation: Some(&continuation),
                    renewed_at: Some(long_ago),
                    ..Dotnet::default()
                },
            );
            doc["partitionKey"] = format!("6f1c0c6e-93a4-4b8e-9d2b-5d1f4a7e00{i:02}").into();
            doc
        })
        .collect();
    let container = dotnet_container("/partitionKey", &docs).await;
    let target = fresh_store("import-target").await;
    let report = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect("import");
    assert_eq!(report.count("created"), 4, "{report:?}");
    assert!(!report.initialized, "no .info among these");
    for (i, p) in ["0", "1", "2", "3"].iter().enumerate() {
        let lease = target.get(&key(p)).await.expect("get").expect("lease");
        assert_eq!(
            lease.continuation,
            Some(Continuation::new(format!("\"{}\"", 100 + i)))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_container_or_a_stray_document_imports_nothing() {
    // A container that is not there is named; one foreign document stops the import.
    let target = fresh_store("import-target").await;
    let missing = DotnetLeaseContainer::new(&fresh_options("no-such")).expect("valid options");
    let err = import_dotnet_leases(&missing, &target, &group(), &ImportOptions::default())
        .await
        .expect_err("no container");
    assert!(matches!(err, ImportError::NoContainer { .. }), "{err}");

    let long_ago = Timestamp(now().0 - 3_600_000);
    let docs = [
        dotnet::v3_epk_lease(
            V3,
            "0",
            ("", "FF"),
            &Dotnet {
                continuation: Some("\"42\""),
                renewed_at: Some(long_ago),
                ..Dotnet::default()
            },
        ),
        serde_json::json!({ "id": "orders-settings", "retries": 3 }),
    ];
    let container = dotnet_container("/id", &docs).await;
    let err = import_dotnet_leases(&container, &target, &group(), &ImportOptions::default())
        .await
        .expect_err("stray document");
    assert!(err.to_string().contains("orders-settings"), "{err}");
    assert!(target.list(&group()).await.expect("list").leases.is_empty());
}
