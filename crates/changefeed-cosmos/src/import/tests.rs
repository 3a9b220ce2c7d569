//! The .NET documents as the .NET serializer writes them (property order and all, as Cosmos DB
//! returns them with its `_` fields), read; the plan made of them.

use super::*;

/// The lease prefix of a processor built with `.WithLeaseContainer(…)` and lease prefix
/// `orders`, on account `acct`, monitored database rid `Vn0AAA==`, container rid
/// `Vn0AAI+L4xY=`.
const PREFIX: &str = "ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=";

/// A v3 EPK lease (`DocumentServiceLeaseCoreEpk`): id, version, _etag, LeaseToken, FeedRange,
/// Owner, ContinuationToken, properties, timestamp, then Cosmos DB's fields.
const V3_EPK: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..0","version":1,"_etag":"\"0000d10c-0000-0100-0000-663889d90000\"","LeaseToken":"0","FeedRange":{"Range":{"min":"","max":"FF"}},"Owner":"dotnet-host-1","ContinuationToken":"\"42\"","properties":{"strategy":"a"},"timestamp":"2024-05-06T07:08:09.1234567Z","_rid":"Vn0AAJ2T3GQBAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQBAAAAAAAAAA==/","_attachments":"attachments/","_ts":1714979289}"#;

/// A v3 EPK lease of a range split off: LeaseToken `{min}-{max}`, released (Owner null).
const V3_EPK_SPLIT: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..05C1D9CD673398-05C1E9CD673398","version":1,"_etag":"\"0000d20c-0000-0100-0000-663889da0000\"","LeaseToken":"05C1D9CD673398-05C1E9CD673398","FeedRange":{"Range":{"min":"05C1D9CD673398","max":"05C1E9CD673398"}},"Owner":null,"ContinuationToken":"\"1077\"","properties":{},"timestamp":"2024-05-06T07:08:10Z","_rid":"Vn0AAJ2T3GQCAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQCAAAAAAAAAA==/","_attachments":"attachments/","_ts":1714979290}"#;

/// A v3 partition-key-range lease (`DocumentServiceLeaseCore`, version 0) with the FeedRange
/// the SDK adds when it acquires an old lease, never checkpointed.
const V3_PKRANGE: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..1","version":0,"_etag":"\"0000d30c-0000-0100-0000-663889db0000\"","LeaseToken":"1","FeedRange":{"Range":{"min":"7FFFFFFFFFFFFFFF","max":"FF"}},"Owner":null,"ContinuationToken":null,"properties":{},"timestamp":"2024-05-06T07:08:11.5Z","_rid":"Vn0AAJ2T3GQDAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQDAAAAAAAAAA==/","_attachments":"attachments/","_ts":1714979291}"#;

/// An older v3 `DocumentServiceLeaseCore` (no version property) of a lease that came from the
/// v2 library: LeaseToken and, kept for going back, PartitionId.
const V3_FROM_V2: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..2","_etag":"\"0000d40c-0000-0100-0000-663889dc0000\"","LeaseToken":"2","PartitionId":"2","Owner":"","ContinuationToken":"\"7\"","properties":{},"timestamp":"2024-05-06T07:08:12.25Z","_rid":"Vn0AAJ2T3GQEAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQEAAAAAAAAAA==/","_attachments":"attachments/","_ts":1714979292}"#;

/// A v2 library lease (`DocumentServiceLease`): id, gremlincompatid, _etag, PartitionId, Owner,
/// ContinuationToken, properties, timestamp (null: the processor then uses `_ts`).
const V2: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..3","gremlincompatid":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..3","_etag":"\"0000d50c-0000-0100-0000-663889dd0000\"","PartitionId":"3","Owner":"dotnet-host-2","ContinuationToken":"\"2468759\"","properties":{},"timestamp":null,"_rid":"Vn0AAJ2T3GQFAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQFAAAAAAAAAA==/","_attachments":"attachments/","_ts":1714979293}"#;

/// The v3 `.info` marker (`new { id = markerDocId }`).
const V3_INFO: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=.info","_rid":"Vn0AAJ2T3GQGAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQGAAAAAAAAAA==/","_etag":"\"0000d60c-0000-0100-0000-663889de0000\"","_attachments":"attachments/","_ts":1714979294}"#;

/// The v3 `.lock` marker (`LockDocument`: id, ttl).
const V3_LOCK: &str = r#"{"id":"ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=.lock","ttl":30,"_rid":"Vn0AAJ2T3GQHAAAAAAAAAA==","_self":"dbs/Vn0AAA==/colls/Vn0AAJ2T3GQ=/docs/Vn0AAJ2T3GQHAAAAAAAAAA==/","_etag":"\"0000d70c-0000-0100-0000-663889df0000\"","_attachments":"attachments/","_ts":1714979295}"#;

/// The v2 `.info` marker (a `Document` with gremlincompatid).
const V2_INFO: &str = r#"{"id":"legacyacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=.info","gremlincompatid":"legacyacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=.info","_rid":"Vn0AAJ2T3GQIAAAAAAAAAA==","_ts":1714979296}"#;

/// 2024-05-06T07:08:09.123Z, `V3_EPK`'s timestamp.
const RENEWED: Timestamp = Timestamp(1_714_979_289_123);

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("test JSON")
}

fn lease(text: &str) -> DotnetLease {
    match parse_dotnet_document(&json(text)) {
        Ok(DotnetDocument::Lease(lease)) => lease,
        other => panic!("a lease: {other:?}"),
    }
}

fn group() -> GroupName {
    GroupName::new("orders").expect("valid")
}

fn docs(texts: &[&str]) -> Vec<Value> {
    texts.iter().map(|t| json(t)).collect()
}

#[test]
fn v3_epk_lease_is_read_field_for_field() {
    // LeaseToken, FeedRange, Owner, ContinuationToken, timestamp and properties as written.
    let l = lease(V3_EPK);
    assert_eq!(l.schema, DotnetSchema::V3Epk);
    assert_eq!(l.processor, PREFIX);
    assert_eq!(l.token, "0");
    assert_eq!(
        l.feed_range,
        Some(FeedRange {
            min: String::new(),
            max: "FF".into()
        })
    );
    assert_eq!(l.owner.as_deref(), Some("dotnet-host-1"));
    assert_eq!(l.continuation.as_deref(), Some("\"42\""));
    assert_eq!(l.renewed_at, RENEWED, "timestamp, to the millisecond");
    assert_eq!(l.properties.get("strategy").map(String::as_str), Some("a"));

    let split = lease(V3_EPK_SPLIT);
    assert_eq!(split.token, "05C1D9CD673398-05C1E9CD673398");
    assert_eq!(split.processor, PREFIX);
    assert_eq!(split.owner, None, "a released lease has a null Owner");
}

#[test]
fn v3_partition_key_range_leases_are_read_with_or_without_version() {
    // version 0 or no version, LeaseToken: the v3 SDK's partition-key-range lease.
    let l = lease(V3_PKRANGE);
    assert_eq!(l.schema, DotnetSchema::V3PartitionKeyRange);
    assert_eq!(l.token, "1");
    assert_eq!(l.continuation, None, "never checkpointed");
    assert_eq!(l.renewed_at, Timestamp(1_714_979_291_500));
    let migrated = lease(V3_FROM_V2);
    assert_eq!(migrated.schema, DotnetSchema::V3PartitionKeyRange);
    assert_eq!(migrated.token, "2");
    assert_eq!(migrated.owner, None, "an empty Owner is no owner");
    assert_eq!(migrated.continuation.as_deref(), Some("\"7\""));
}

#[test]
fn v2_lease_is_read_and_falls_back_to_ts_without_timestamp() {
    // The v2 library's PartitionId lease; timestamp null means `_ts`, as in the .NET code.
    let l = lease(V2);
    assert_eq!(l.schema, DotnetSchema::V2);
    assert_eq!(l.token, "3");
    assert_eq!(l.owner.as_deref(), Some("dotnet-host-2"));
    assert_eq!(l.continuation.as_deref(), Some("\"2468759\""));
    assert_eq!(l.renewed_at, Timestamp(1_714_979_293_000));
}

#[test]
fn info_and_lock_markers_are_recognised() {
    // `{prefix}.info` and `{prefix}.lock` of both libraries are markers, not leases.
    assert_eq!(
        parse_dotnet_document(&json(V3_INFO)),
        Ok(DotnetDocument::Initialized {
            processor: PREFIX.into()
        })
    );
    assert_eq!(
        parse_dotnet_document(&json(V3_LOCK)),
        Ok(DotnetDocument::InitializationLock {
            processor: PREFIX.into()
        })
    );
    assert_eq!(
        parse_dotnet_document(&json(V2_INFO)),
        Ok(DotnetDocument::Initialized {
            processor: "legacyacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=".into()
        })
    );
}

#[test]
fn unrecognised_documents_are_named_with_why() {
    // Anything else is a problem naming the document: never guessed at, never skipped quietly.
    let cases: &[(&str, &str)] = &[
        (
            r#"{"id":"orders-config","enabled":true}"#,
            "neither a lease",
        ),
        (r#"{"id":"p..0","version":2,"LeaseToken":"0"}"#, "version 2"),
        (r#"{"id":"p..0","version":1}"#, "without a LeaseToken"),
        (r#"{"id":"p..0","LeaseToken":"9"}"#, "does not end with"),
        (
            r#"{"id":"p..0","LeaseToken":"0","PartitionId":"1"}"#,
            "disagree",
        ),
        (
            r#"{"id":"p..0","version":1,"LeaseToken":"0","Mode":"Full-Fidelity Feed"}"#,
            "all-versions-and-deletes",
        ),
        (
            r#"{"id":"p..0","version":1,"LeaseToken":"0","Mode":"Sideways"}"#,
            "Mode \"Sideways\"",
        ),
        (
            r#"{"id":"p..0","version":1,"LeaseToken":"0","FeedRange":{"PKRangeId":"0"}}"#,
            "not an EPK range",
        ),
        (
            r#"{"id":"p..0","LeaseToken":"0","Owner":7}"#,
            "Owner is not a string",
        ),
        (
            r#"{"id":"p..0","LeaseToken":"0","timestamp":"last tuesday"}"#,
            "not an ISO 8601 time",
        ),
        (
            r#"{"id":"p..0","LeaseToken":"0","properties":{"a":1}}"#,
            "properties.a",
        ),
        (r#"{"LeaseToken":"0"}"#, "without an id"),
    ];
    for (text, why) in cases {
        let problem = parse_dotnet_document(&json(text)).expect_err(text);
        assert!(problem.reason.contains(why), "{text}: {problem}");
        if !why.contains("without an id") {
            assert_ne!(problem.id, "?", "{text}: the id is named");
        }
    }
    // A lease of the latest-version mode, named either way, is a lease.
    for mode in ["Incremental Feed", "LatestVersion", "IncrementalFeed"] {
        let text = format!(r#"{{"id":"p..0","version":1,"LeaseToken":"0","Mode":"{mode}"}}"#);
        assert!(
            matches!(
                parse_dotnet_document(&json(&text)),
                Ok(DotnetDocument::Lease(_))
            ),
            "{mode}"
        );
    }
}

#[test]
fn dotnet_times_are_read_as_newtonsoft_writes_them() {
    // Seven fraction digits or none, Z, an offset, or an unspecified kind (read as UTC).
    let at = |t| parse_dotnet_time(t);
    assert_eq!(at("2024-05-06T07:08:09.1234567Z"), Some(RENEWED));
    assert_eq!(
        at("2024-05-06T07:08:09Z"),
        Some(Timestamp(1_714_979_289_000))
    );
    assert_eq!(at("2024-05-06T07:08:09.1234567"), Some(RENEWED));
    assert_eq!(at("2024-05-06T09:08:09.1234567+02:00"), Some(RENEWED));
    assert_eq!(at("2024-05-06T06:08:09.1234567-0100"), Some(RENEWED));
    assert_eq!(at("2000-02-29T00:00:00Z"), Some(Timestamp(951_782_400_000)));
    assert_eq!(at("1969-12-31T23:59:59.5Z"), Some(Timestamp(-500)));
    for bad in [
        "2024-13-01T00:00:00Z",
        "2023-02-29T00:00:00Z",
        "2024-05-06T24:00:00Z",
        "2024-05-06T07:08:09.Z",
        "2024-05-06T07:08:09+25:00",
        "2024-05-06",
        "2024-05-06T07:08:09 UTC",
        "２０２４-05-06T07:08:09Z",
    ] {
        assert_eq!(at(bad), None, "{bad}");
    }
    for t in [0, RENEWED.0, -1, 951_782_400_000, 4_102_444_800_999] {
        let text = format_dotnet_time(Timestamp(t));
        assert_eq!(parse_dotnet_time(&text), Some(Timestamp(t)), "{text}");
    }
}

#[test]
fn plan_maps_each_lease_to_an_available_one_at_its_continuation() {
    // Ours: partition = LeaseToken/PartitionId, continuation as is, no owner, .NET facts in
    // properties; markers noted, not imported.
    let now = Timestamp(RENEWED.0 + 3_600_000);
    let plan = plan_import(
        &docs(&[
            V3_EPK,
            V3_EPK_SPLIT,
            V3_PKRANGE,
            V3_FROM_V2,
            V3_INFO,
            V3_LOCK,
        ]),
        &group(),
        now,
        &ImportOptions::default(),
    )
    .expect("plan");
    assert_eq!(plan.processor, PREFIX);
    assert!(plan.initialized && plan.initialization_lock);
    let partitions: Vec<&str> = plan
        .leases
        .iter()
        .map(|p| p.lease.key.partition.as_str())
        .collect();
    assert_eq!(partitions, ["0", "05C1D9CD673398-05C1E9CD673398", "1", "2"]);
    for p in &plan.leases {
        assert_eq!(p.lease.state, LeaseState::Available);
        assert_eq!(p.lease.owner, None);
        assert_eq!(p.lease.key.group, group());
        assert_eq!(
            p.lease.properties.get("dotnet.id"),
            Some(&p.dotnet.id),
            "the .NET id is kept"
        );
        assert!(p.lease.validate().is_ok());
    }
    let l0 = &plan.leases[0].lease;
    assert_eq!(l0.continuation, Some(Continuation::new("\"42\"")));
    assert_eq!(
        l0.resume_position(),
        Position::Continuation(Continuation::new("\"42\""))
    );
    assert_eq!(
        l0.properties.get("dotnet.feed_range").map(String::as_str),
        Some(r#"{"min":"","max":"FF"}"#)
    );
    assert_eq!(
        l0.properties.get("dotnet.schema").map(String::as_str),
        Some("v3-epk")
    );
    assert_eq!(
        l0.properties
            .get("dotnet.property.strategy")
            .map(String::as_str),
        Some("a")
    );
    let l1 = &plan.leases[2].lease;
    assert_eq!(l1.continuation, None);
    assert_eq!(
        l1.resume_position(),
        Position::Beginning,
        "the default start"
    );
}

#[test]
fn a_lease_without_continuation_starts_where_the_options_say() {
    // --start-position now: the one lease never checkpointed starts now; the others keep theirs.
    let now = Timestamp(RENEWED.0 + 3_600_000);
    let plan = plan_import(
        &docs(&[V3_PKRANGE, V3_FROM_V2]),
        &group(),
        now,
        &ImportOptions::default().start(Position::Now),
    )
    .expect("plan");
    assert_eq!(plan.leases[0].lease.resume_position(), Position::Now);
    assert_eq!(
        plan.leases[1].lease.resume_position(),
        Position::Continuation(Continuation::new("\"7\""))
    );
    assert!(!plan.initialized, "no .info among these");
}

#[test]
fn owned_fresh_leases_are_refused_naming_ids_and_owners() {
    // Owner set and timestamp within the expiry (or ahead of our clock): a .NET host may still
    // read it, so nothing is planned.
    let v2_renewed = Timestamp(1_714_979_293_000);
    // 59.9 s after the EPK lease's timestamp (and 56 s after the v2 lease's `_ts`): both
    // owned leases are within 60 s.
    let now = Timestamp(RENEWED.0 + 59_900);
    let err = plan_import(
        &docs(&[V3_EPK, V2, V3_PKRANGE]),
        &group(),
        now,
        &ImportOptions::default(),
    )
    .expect_err("refused");
    let ImportError::Live { leases, expiry, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(*expiry, DEFAULT_DOTNET_LEASE_EXPIRY);
    let named: Vec<(&str, &str)> = leases
        .iter()
        .map(|l| (l.token.as_str(), l.owner.as_str()))
        .collect();
    assert_eq!(named, [("0", "dotnet-host-1"), ("3", "dotnet-host-2")]);
    let text = err.to_string();
    for needle in [
        "ordersacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY=..0",
        "dotnet-host-1",
        "..3",
        "dotnet-host-2",
        "Nothing was written",
    ] {
        assert!(text.contains(needle), "{needle} in {text}");
    }
    assert!(
        !text.contains("..1\""),
        "the unowned lease is not named: {text}"
    );

    // Past the expiry of both: imported, owners dropped.
    let later = Timestamp(v2_renewed.0 + 60_001);
    let plan = plan_import(
        &docs(&[V3_EPK, V2]),
        &group(),
        later,
        &ImportOptions::default(),
    )
    .expect("expired leases are imported");
    assert!(plan.leases.iter().all(|p| p.lease.owner.is_none()));
    assert_eq!(
        plan.leases[1].dotnet.owner.as_deref(),
        Some("dotnet-host-2")
    );

    // A longer expiry (the fleet's LeaseExpirationInterval) refuses again.
    let err = plan_import(
        &docs(&[V3_EPK, V2]),
        &group(),
        later,
        &ImportOptions::default().expiry(Duration::from_secs(120)),
    )
    .expect_err("refused");
    assert!(
        matches!(err, ImportError::Live { ref leases, .. } if leases.len() == 2),
        "{err}"
    );

    // A timestamp ahead of our clock is live, whatever the expiry.
    let err = plan_import(
        &docs(&[V3_EPK]),
        &group(),
        Timestamp(RENEWED.0 - 5_000),
        &ImportOptions::default().expiry(Duration::ZERO),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("in the future"), "{err}");
}

#[test]
fn an_unrecognised_document_stops_the_whole_import() {
    // One document of unknown shape: nothing planned, the document named.
    let now = Timestamp(RENEWED.0 + 3_600_000);
    let err = plan_import(
        &docs(&[V3_EPK_SPLIT, r#"{"id":"stray","x":1}"#, V3_INFO]),
        &group(),
        now,
        &ImportOptions::default(),
    )
    .expect_err("refused");
    let ImportError::Unrecognised { documents } = &err else {
        panic!("{err}");
    };
    assert_eq!(documents.len(), 1);
    assert_eq!(documents[0].id, "stray");
    assert!(err.to_string().contains("\"stray\""), "{err}");
}

#[test]
fn several_processors_need_a_prefix_to_choose_one() {
    // Two processors in one container: refused until a prefix names one; the other is left.
    let other = V3_EPK.replace("ordersacct", "billingacct");
    let now = Timestamp(RENEWED.0 + 3_600_000);
    let all = docs(&[V3_EPK_SPLIT, &other, V3_INFO]);
    let err = plan_import(&all, &group(), now, &ImportOptions::default()).expect_err("which?");
    assert!(
        matches!(err, ImportError::SeveralProcessors { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("billingacct") && err.to_string().contains("ordersacct"),
        "{err}"
    );
    let plan = plan_import(
        &all,
        &group(),
        now,
        &ImportOptions::default().processor("orders"),
    )
    .expect("chosen by the start of its prefix");
    assert_eq!(plan.processor, PREFIX);
    assert_eq!(plan.leases.len(), 1);
    assert!(plan.initialized);
    assert_eq!(
        plan.other_processors,
        ["billingacct.documents.azure.com_Vn0AAA==_Vn0AAI+L4xY="]
    );
    let err = plan_import(
        &all,
        &group(),
        now,
        &ImportOptions::default().processor("shipping"),
    )
    .expect_err("unknown");
    assert!(matches!(err, ImportError::UnknownProcessor { .. }), "{err}");
    let err = plan_import(&docs(&[V3_INFO]), &group(), now, &ImportOptions::default())
        .expect_err("no leases");
    assert!(matches!(err, ImportError::NoLeases), "{err}");
}
