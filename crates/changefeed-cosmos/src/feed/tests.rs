//! The mapping of Cosmos DB's documented answers, without a server: the partition key range
//! listing (with the `parents` of a split), EPK ranges, change feed pages and their ETags,
//! 304, the 410/1002 of a split, continuations, session tokens and the `If-Modified-Since`
//! of a start time. Shapes from the REST API reference ("Change Feed", "Get Partition Key
//! Ranges") and the .NET SDK (ChangeFeedEstimatorIterator, the change feed processor's split
//! handling).

use std::collections::BTreeMap;

use bytes::Bytes;
use changefeed::lineage::{self, ChildStart, Input};
use changefeed::model::{
    Continuation, GroupName, KeyRange, Lease, LeaseKey, LeaseState, Partition, PartitionId,
    Position, Timestamp,
};
use http::{HeaderMap, HeaderValue};
use serde_json::{json, Value};

use super::map::{self, Cursor};
use super::*;

fn id(s: &str) -> PartitionId {
    PartitionId::new(s).expect("valid id")
}

/// A listing after range 0 (the whole key space) split into 1 and 2 at EPK `80`, as Cosmos DB
/// answers `GET dbs/db/colls/c/pkranges`.
fn split_listing() -> Value {
    json!({
        "_rid": "PaYSAPH7qAo=",
        "PartitionKeyRanges": [
            {"_rid": "PaYSAPH7qAoCAAAAAAAAUA==", "id": "1", "_etag": "\"00004b00-0000-0000-0000-5f6e4c1a0000\"",
             "minInclusive": "", "maxExclusive": "80", "ridPrefix": 1, "throughputFraction": 0.5,
             "status": "online", "parents": ["0"], "_ts": 1601064986, "lsn": 15},
            {"_rid": "PaYSAPH7qAoDAAAAAAAAUA==", "id": "2", "_etag": "\"00004c00-0000-0000-0000-5f6e4c1a0000\"",
             "minInclusive": "80", "maxExclusive": "FF", "ridPrefix": 2, "throughputFraction": 0.5,
             "status": "online", "parents": ["0"], "_ts": 1601064986, "lsn": 16}
        ],
        "_count": 2
    })
}

const HALF: u128 = 0x80 << 120;

#[test]
fn epk_ranges_map_onto_the_key_space() {
    let whole = map::epk_range("", "FF").expect("range");
    assert_eq!(
        whole,
        KeyRange {
            start: 0,
            end: u128::MAX
        }
    );
    assert_eq!(
        map::epk_range("", "80"),
        Some(KeyRange {
            start: 0,
            end: HALF - 1
        })
    );
    assert_eq!(
        map::epk_range("80", "FF"),
        Some(KeyRange {
            start: HALF,
            end: u128::MAX
        })
    );
    // Long EPKs are padded on the right, as hex fractions of the space.
    assert_eq!(
        map::epk_range("05C1D19581B37C", "05C1E399CD7000"),
        Some(KeyRange {
            start: 0x05C1_D195_81B3_7C00_0000_0000_0000_0000,
            end: 0x05C1_E399_CD70_0000_0000_0000_0000_0000 - 1,
        })
    );
    // Hierarchical keys (more than 128 bits) and garbage get no key range.
    assert_eq!(map::epk_range(&"0".repeat(40), "FF"), None);
    assert_eq!(map::epk_range("xyz", "FF"), None);
}

#[test]
fn a_split_lists_the_children_open_and_the_parent_closed_with_its_range() {
    let ranges = map::parse_pkranges(&split_listing()).expect("listing");
    assert_eq!(ranges.len(), 2);
    assert_eq!(ranges[0].parents, vec!["0".to_string()]);
    let parts = map::partitions(&ranges, &BTreeMap::new()).expect("partitions");
    assert_eq!(
        parts,
        vec![
            Partition {
                id: id("0"),
                parents: vec![],
                closed: true,
                // Rebuilt from the children's ranges.
                key_range: Some(KeyRange {
                    start: 0,
                    end: u128::MAX
                }),
            },
            Partition {
                id: id("1"),
                parents: vec![id("0")],
                closed: false,
                key_range: Some(KeyRange {
                    start: 0,
                    end: HALF - 1
                }),
            },
            Partition {
                id: id("2"),
                parents: vec![id("0")],
                closed: false,
                key_range: Some(KeyRange {
                    start: HALF,
                    end: u128::MAX
                }),
            },
        ]
    );
}

#[test]
fn a_second_split_chains_the_ancestors_oldest_first() {
    // 0 split into 1 and 2; then 1 into 3 and 4: Cosmos DB lists 3 and 4 with parents
    // ["0", "1"]. Range 1's key range is remembered from an earlier listing.
    let listing = json!({"PartitionKeyRanges": [
        {"id": "3", "minInclusive": "", "maxExclusive": "40", "parents": ["0", "1"]},
        {"id": "4", "minInclusive": "40", "maxExclusive": "80", "parents": ["0", "1"]},
        {"id": "2", "minInclusive": "80", "maxExclusive": "FF", "parents": ["0"]}
    ]});
    let ranges = map::parse_pkranges(&listing).expect("listing");
    let seen = BTreeMap::from([(
        "1".to_string(),
        KeyRange {
            start: 0,
            end: HALF - 1,
        },
    )]);
    let parts = map::partitions(&ranges, &seen).expect("partitions");
    let summary: Vec<(String, Vec<String>, bool)> = parts
        .iter()
        .map(|p| {
            (
                p.id.to_string(),
                p.parents.iter().map(ToString::to_string).collect(),
                p.closed,
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("0".into(), vec![], true),
            ("1".into(), vec!["0".into()], true),
            ("2".into(), vec!["0".into()], false),
            ("3".into(), vec!["1".into()], false),
            ("4".into(), vec!["1".into()], false),
        ]
    );
    assert_eq!(
        parts[0].key_range,
        Some(KeyRange {
            start: 0,
            end: u128::MAX
        })
    );
    assert_eq!(
        parts[1].key_range,
        Some(KeyRange {
            start: 0,
            end: HALF - 1
        })
    );
    // The lineage rules accept the graph as sound.
    let plan = lineage::plan(&Input::new(&parts, &[], &Position::Beginning));
    assert!(plan.errors.is_empty(), "{:?}", plan.errors);
}

#[test]
fn listing_accepts_numeric_ids_and_refuses_broken_ranges() {
    // The local test server answers `"id": 0`; Cosmos DB `"id": "0"`.
    let ranges = map::parse_pkranges(&json!({"PartitionKeyRanges": [
        {"id": 0, "minInclusive": "", "maxExclusive": "FF", "parents": []}
    ]}))
    .expect("listing");
    assert_eq!(ranges[0].id, "0");
    let err =
        map::parse_pkranges(&json!({"PartitionKeyRanges": [{"id": "0"}]})).expect_err("no bounds");
    assert!(err.contains("range 0: no minInclusive"), "{err}");
    let err = map::parse_pkranges(&json!({"Documents": []})).expect_err("no ranges");
    assert!(err.contains("PartitionKeyRanges"), "{err}");
}

#[test]
fn continuations_are_change_feed_etags() {
    assert_eq!(Cursor::parse("\"42\""), Ok(Cursor::after("\"42\"")));
    // As the .NET processor's leases hold them (imported as is) and unquoted.
    assert_eq!(Cursor::parse("42").map(|c| c.skip), Ok(0));
    let inside = Cursor {
        etag: "\"41\"".into(),
        skip: 2,
        range: "3".into(),
    };
    assert_eq!(Cursor::parse("\"41\";skip=2;range=3"), Ok(inside.clone()));
    assert_eq!(
        Cursor::parse(inside.to_continuation().as_str()),
        Ok(inside.clone())
    );
    for bad in [
        "",
        "abc",
        "\"\"",
        "\"41\";skip=0;range=3",
        "\"41\";skip=x;range=3",
        "\"41\";skip=2",
        "\"41\";skip=2;range=",
        "0:17",
    ] {
        let err = Cursor::parse(bad).expect_err(bad);
        assert!(err.contains("ETag") || err.contains("skip"), "{bad}: {err}");
    }
    // The skip holds in its own range; a child range starting at its parent's continuation
    // reads the whole transaction again, since it holds only some of its documents.
    assert_eq!(inside.clone().in_range("3"), inside);
    assert_eq!(inside.in_range("5"), Cursor::after("\"41\""));
}

/// Documents of a change feed page as Cosmos DB returns them: the item and its system
/// properties (`_lsn`, `_ts`). Documents 11 and 12 were written by one transactional batch.
fn page_docs() -> Vec<Value> {
    vec![
        json!({"id": "a", "tenant": "t1", "v": 1, "_rid": "x", "_etag": "\"e1\"", "_ts": 1700000000, "_lsn": 10}),
        json!({"id": "b", "tenant": "t2", "v": 2, "_rid": "y", "_etag": "\"e2\"", "_ts": 1700000001, "_lsn": 11}),
        json!({"id": "c", "tenant": "t2", "v": 3, "_rid": "z", "_etag": "\"e3\"", "_ts": 1700000001, "_lsn": 11}),
        json!({"id": "d", "tenant": 7, "v": 4, "_rid": "w", "_etag": "\"e4\"", "_ts": 1700000002, "_lsn": 12}),
    ]
}

/// The `id` of each record's document, as JSON text.
fn ids(records: &[changefeed::model::Record]) -> Vec<String> {
    records
        .iter()
        .map(|x| serde_json::from_slice::<Value>(&x.data).expect("json")["id"].to_string())
        .collect()
}

fn start() -> Cursor {
    Cursor::after("")
}

#[test]
fn page_records_carry_keys_times_and_resumable_continuations() {
    let paths = vec!["/tenant".to_string()];
    let records = map::page_records(page_docs(), "0", "\"13\"", &start(), &paths).expect("records");
    let conts: Vec<&str> = records.iter().map(|r| r.continuation.as_str()).collect();
    // After a: its LSN. After b, one of the two documents of LSN 11: before 11, one done.
    // After c: LSN 11. After d, the last of the page: the page's ETag.
    assert_eq!(
        conts,
        vec!["\"10\"", "\"10\";skip=1;range=0", "\"11\"", "\"13\""]
    );
    let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, vec!["t1", "t2", "t2", "7"]);
    assert_eq!(records[0].timestamp, Some(Timestamp(1_700_000_000_000)));
    let doc: Value = serde_json::from_slice(&records[3].data).expect("json");
    assert_eq!(doc["id"], "d");
    // Resuming after b reads from LSN 10 on and drops the one document of LSN 11 done.
    let resumed = Cursor::parse(conts[1]).expect("cursor");
    let again = map::page_records(page_docs()[1..].to_vec(), "0", "\"13\"", &resumed, &paths)
        .expect("records");
    assert_eq!(ids(&again), vec!["\"c\"", "\"d\""]);
    assert_eq!(again[0].continuation.as_str(), "\"11\"");
}

#[test]
fn page_records_refuse_documents_without_lsn() {
    let docs = vec![json!({"id": "a", "_ts": 1})];
    let err = map::page_records(docs, "0", "\"1\"", &start(), &[]).expect_err("no _lsn");
    assert!(err.contains("_lsn") && err.contains("\"a\""), "{err}");
}

#[test]
fn partition_keys_follow_the_container_paths() {
    let doc = json!({"a": {"b": "x"}, "t": "y", "n": 3});
    assert_eq!(map::partition_key(&doc, &["/a/b".into()]), "x");
    assert_eq!(map::partition_key(&doc, &["/missing".into()]), "");
    assert_eq!(
        map::partition_key(&doc, &["/t".into(), "/n".into()]),
        "[\"y\",3]"
    );
}

#[test]
fn session_tokens_give_the_estimators_lsn() {
    // {range}:{version}#{global LSN}#{region}={LSN}, and the old {range}:{LSN}.
    assert_eq!(map::session_lsn("0:1#1234#3=1200", "0"), Some(1234));
    assert_eq!(map::session_lsn("0:1234", "0"), Some(1234));
    assert_eq!(map::session_lsn("1:-1#77,2:-1#99", "2"), Some(99));
    assert_eq!(map::session_lsn("garbage", "0"), None);
    // Remaining: session LSN minus the LSN before the first unread document.
    assert_eq!(map::estimate(1234, Some(1200)), 35);
    assert_eq!(map::estimate(1234, None), 0);
    assert_eq!(map::estimate(5, Some(9)), 0);
}

#[test]
fn at_time_is_an_http_date_a_second_early() {
    // 2023-11-14T22:13:20.500Z: the second before the one it falls in.
    assert_eq!(
        map::if_modified_since(Timestamp(1_700_000_000_500)),
        "Tue, 14 Nov 2023 22:13:19 GMT"
    );
    assert_eq!(
        map::if_modified_since(Timestamp(0)),
        "Thu, 01 Jan 1970 00:00:00 GMT"
    );
}

fn answer(status: u16, headers: &[(&'static str, &str)], body: Value) -> Answer {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.insert(*name, HeaderValue::from_str(value).expect("header"));
    }
    Answer {
        status,
        headers: map,
        body: Bytes::from(body.to_string()),
        request: "GET dbs/db/colls/c".into(),
    }
}

/// A reader of range 0 that has not read yet; its client is never used (no I/O here).
fn reader(from: ReadFrom) -> CosmosReader {
    let rest = crate::CosmosOptions::new("http://127.0.0.1:9", "db", "c")
        .rest()
        .expect("client");
    CosmosReader {
        feed: CosmosFeed {
            rest,
            key_paths: Arc::new(vec!["/tenant".into()]),
            seen: Arc::default(),
        },
        partition: id("0"),
        from,
        first: true,
        buffer: VecDeque::new(),
        ended: false,
    }
}

#[test]
fn answers_are_pages_caught_up_gone_or_errors() {
    let p0 = id("0");
    let page = classify(
        answer(
            200,
            &[("etag", "\"13\""), ("x-ms-session-token", "0:-1#20")],
            json!({"_rid": "r", "Documents": page_docs(), "_count": 4}),
        ),
        &p0,
    )
    .expect("page");
    assert!(
        matches!(&page, Answered::Page { docs, etag: Some(e), session_lsn: Some(20) } if docs.len() == 4 && e == "\"13\"")
    );
    let caught_up = classify(answer(304, &[("etag", "\"13\"")], json!(null)), &p0).expect("304");
    assert!(matches!(
        caught_up,
        Answered::CaughtUp { etag: Some(_), .. }
    ));
    let gone = classify(
        answer(
            410,
            &[("x-ms-substatus", "1002")],
            json!({"code": "Gone", "message": "PartitionKeyRangeGone"}),
        ),
        &p0,
    )
    .expect("410/1002");
    assert!(matches!(gone, Answered::Gone));
    // A split still completing is a retryable error, not the end.
    let completing = classify(
        answer(
            410,
            &[("x-ms-substatus", "1007")],
            json!({"message": "completing split"}),
        ),
        &p0,
    )
    .expect_err("410/1007");
    let err = source_error("read", &p0, completing);
    assert!(err.is_retryable(), "{err}");
    let throttled = classify(answer(429, &[], json!({"message": "busy"})), &p0).expect_err("429");
    assert!(source_error("read", &p0, throttled).is_retryable());
    let missing =
        classify(answer(404, &[], json!({"message": "no container"})), &p0).expect_err("404");
    assert!(!source_error("read", &p0, missing).is_retryable());
}

#[test]
fn a_split_ends_the_parent_at_its_last_continuation_and_the_children_start_there() {
    let mut r = reader(ReadFrom::Beginning);
    // A page of four documents, read two at a time.
    let page = Answered::Page {
        docs: page_docs(),
        etag: Some("\"13\"".into()),
        session_lsn: Some(13),
    };
    let first = r.apply(page, 2, 0).expect("page");
    assert_eq!(first.records.len(), 2);
    assert_eq!(
        first.continuation,
        Some(Continuation::new("\"10\";skip=1;range=0"))
    );
    assert_eq!(r.from, ReadFrom::After(Cursor::after("\"13\"")));
    // The rest of the page comes from the buffer, before any other read.
    let rest = r.take(10);
    assert_eq!(rest.continuation, Some(Continuation::new("\"13\"")));
    // Caught up: nothing, the position stays a continuation of the range.
    let idle = r
        .apply(
            Answered::CaughtUp {
                etag: Some("\"15\"".into()),
                session_lsn: Some(15),
            },
            2,
            0,
        )
        .expect("304");
    assert!(idle.records.is_empty() && idle.continuation.is_none() && !idle.end_of_partition);
    assert_eq!(r.from, ReadFrom::After(Cursor::after("\"15\"")));
    // The split: 410/1002 ends the partition, and for good.
    let end = r.apply(Answered::Gone, 2, 0).expect("410");
    assert!(end.end_of_partition && end.records.is_empty());
    assert!(r.ended);
    // The listing now has the parent closed and its children; with the parent's lease
    // finished at its last checkpoint, the children continue from it (the .NET rule).
    let ranges = map::parse_pkranges(&split_listing()).expect("listing");
    let parts = map::partitions(&ranges, &BTreeMap::new()).expect("partitions");
    let mut parent = Lease::new(
        LeaseKey::new(GroupName::new("g").expect("group"), id("0")),
        Position::Beginning,
    );
    parent.state = LeaseState::Finished;
    parent.continuation = rest.continuation.clone();
    let feed = r.feed.clone();
    let plan = lineage::plan(
        &Input::new(&parts, std::slice::from_ref(&parent), &Position::Now)
            .with_child_start(feed.child_start()),
    );
    assert_eq!(feed.child_start(), ChildStart::ParentContinuation);
    let created: Vec<(String, Position)> = plan
        .create
        .iter()
        .map(|n| (n.partition.to_string(), n.start.clone()))
        .collect();
    let at = Position::Continuation(Continuation::new("\"13\""));
    assert_eq!(created, vec![("1".into(), at.clone()), ("2".into(), at)]);
}

#[test]
fn a_continuation_inside_a_transaction_skips_what_was_done() {
    let mut r = reader(ReadFrom::After(Cursor {
        etag: "\"10\"".into(),
        skip: 1,
        range: "0".into(),
    }));
    // Reading from LSN 10 on gives both documents of LSN 11 again; the first was done.
    let batch = r
        .apply(
            Answered::Page {
                docs: page_docs()[1..].to_vec(),
                etag: Some("\"13\"".into()),
                session_lsn: None,
            },
            5,
            1,
        )
        .expect("page");
    assert_eq!(ids(&batch.records), vec!["\"c\"", "\"d\""]);
}
