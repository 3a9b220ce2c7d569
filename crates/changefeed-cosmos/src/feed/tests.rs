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

use super::map::{self, Cursor, EpkRange, Placement, Target};
use super::*;
use changefeed::source::LeasedPartition;

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
        span: None,
    };
    assert_eq!(Cursor::parse("\"41\";skip=2;range=3"), Ok(inside.clone()));
    assert_eq!(
        Cursor::parse(inside.to_continuation().as_str()),
        Ok(inside.clone())
    );
    // A reader of a range read by id records the range's span (after the range, or its skip).
    let spanned = Cursor {
        etag: "\"42\"".into(),
        skip: 0,
        range: "1".into(),
        span: Some(("".into(), "80".into())),
    };
    assert_eq!(
        Cursor::parse("\"42\";range=1;span=-80"),
        Ok(spanned.clone())
    );
    assert_eq!(
        spanned.to_continuation().as_str(),
        "\"42\";range=1;span=-80"
    );
    let both = "\"41\";skip=2;range=3;span=05C1D9CD673398-FF";
    let parsed = Cursor::parse(both).expect("skip and span");
    assert_eq!((parsed.skip, parsed.range.as_str()), (2, "3"));
    assert_eq!(
        parsed.span_of("3"),
        Some(&("05C1D9CD673398".into(), "FF".into()))
    );
    assert_eq!(
        parsed.span_of("4"),
        None,
        "the span of the range that wrote it"
    );
    assert_eq!(parsed.to_continuation().as_str(), both);
    for bad in [
        "",
        "abc",
        "\"\"",
        "\"41\";skip=0;range=3",
        "\"41\";skip=x;range=3",
        "\"41\";skip=2",
        "\"41\";skip=2;range=",
        "0:17",
        "\"42\";span=-80",
        "\"42\";range=1",
        "\"42\";range=1;span=80-40",
        "\"42\";range=1;span=80",
        "\"42\";range=1;span=-8x",
        "\"42\";range=1;span=-80;skip=1",
        "\"42\";other=1",
    ] {
        let err = Cursor::parse(bad).expect_err(bad);
        assert!(
            ["ETag", "skip", "range", "span"]
                .iter()
                .any(|w| err.contains(w)),
            "{bad}: {err}"
        );
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
    let records =
        map::page_records(page_docs(), "0", None, "\"13\"", &start(), &paths).expect("records");
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
    let again = map::page_records(
        page_docs()[1..].to_vec(),
        "0",
        None,
        "\"13\"",
        &resumed,
        &paths,
    )
    .expect("records");
    assert_eq!(ids(&again), vec!["\"c\"", "\"d\""]);
    assert_eq!(again[0].continuation.as_str(), "\"11\"");
}

#[test]
fn page_records_of_a_range_whose_span_is_known_record_it_in_every_continuation() {
    // So that a merge, which takes the range out of the listing, cannot take its span too.
    let paths = vec!["/tenant".to_string()];
    let span = ("".to_string(), "80".to_string());
    let records = map::page_records(page_docs(), "1", Some(&span), "\"13\"", &start(), &paths)
        .expect("records");
    let conts: Vec<&str> = records.iter().map(|r| r.continuation.as_str()).collect();
    assert_eq!(
        conts,
        vec![
            "\"10\";range=1;span=-80",
            "\"10\";skip=1;range=1;span=-80",
            "\"11\";range=1;span=-80",
            "\"13\";range=1;span=-80"
        ]
    );
    // Resuming inside the transaction skips what was done, as without the span.
    let resumed = Cursor::parse(conts[1]).expect("cursor");
    let again = map::page_records(
        page_docs()[1..].to_vec(),
        "1",
        Some(&span),
        "\"13\"",
        &resumed,
        &paths,
    )
    .expect("records");
    assert_eq!(ids(&again), vec!["\"c\"", "\"d\""]);
}

#[test]
fn page_records_refuse_documents_without_lsn() {
    let docs = vec![json!({"id": "a", "_ts": 1})];
    let err = map::page_records(docs, "0", None, "\"1\"", &start(), &[]).expect_err("no _lsn");
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
        target: Some(Target {
            range_id: "0".into(),
            epk: None,
        }),
        span: None,
        restate: false,
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
        "0",
    )
    .expect("page");
    assert!(
        matches!(&page, Answered::Page { docs, etag: Some(e), session_lsn: Some(20) } if docs.len() == 4 && e == "\"13\"")
    );
    let caught_up = classify(answer(304, &[("etag", "\"13\"")], json!(null)), "0").expect("304");
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
        "0",
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
        "0",
    )
    .expect_err("410/1007");
    let err = source_error("read", &p0, completing);
    assert!(err.is_retryable(), "{err}");
    let throttled = classify(answer(429, &[], json!({"message": "busy"})), "0").expect_err("429");
    assert!(source_error("read", &p0, throttled).is_retryable());
    let missing =
        classify(answer(404, &[], json!({"message": "no container"})), "0").expect_err("404");
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
        span: None,
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

fn epk(id: &str) -> EpkRange {
    EpkRange::parse(id)
        .expect("an EPK id")
        .expect("a valid EPK id")
}

/// A listing of `(id, min, max, parents)`, as `GET …/pkranges` answers it.
fn listing(ranges: &[(&str, &str, &str, &[&str])]) -> Vec<map::PkRange> {
    let body = json!({"PartitionKeyRanges": ranges
        .iter()
        .map(|(id, min, max, parents)| json!({
            "id": id, "minInclusive": min, "maxExclusive": max, "parents": parents,
            "status": "online"
        }))
        .collect::<Vec<_>>()});
    map::parse_pkranges(&body).expect("listing")
}

/// Each partition as (id, parents, closed), in id order.
fn shape(parts: &[Partition]) -> Vec<(String, Vec<String>, bool)> {
    parts
        .iter()
        .map(|p| {
            (
                p.id.to_string(),
                p.parents.iter().map(ToString::to_string).collect(),
                p.closed,
            )
        })
        .collect()
}

fn row(id: &str, parents: &[&str], closed: bool) -> (String, Vec<String>, bool) {
    (
        id.to_string(),
        parents.iter().map(|p| p.to_string()).collect(),
        closed,
    )
}

fn lease(partition: &str, state: LeaseState, checkpoint: Option<&str>) -> Lease {
    let mut l = Lease::new(
        LeaseKey::new(GroupName::new("g").expect("group"), id(partition)),
        Position::Beginning,
    );
    l.state = state;
    l.continuation = checkpoint.map(Continuation::new);
    l
}

/// The leases the sync of a Cosmos DB source would create, as (partition, start).
fn planned(parts: &[Partition], leases: &[Lease], start: &Position) -> Vec<(String, Position)> {
    let plan = lineage::plan(
        &Input::new(parts, leases, start).with_child_start(ChildStart::ParentContinuation),
    );
    assert!(plan.errors.is_empty(), "{:?}", plan.errors);
    plan.create
        .iter()
        .map(|n| (n.partition.to_string(), n.start.clone()))
        .collect()
}

#[test]
fn epk_partition_ids_are_dotnet_lease_tokens() {
    // The .NET v3 processor names an EPK-range lease "{min}-{max}"; range ids are numbers.
    let half = epk("-80");
    assert_eq!((half.min.as_str(), half.max.as_str()), ("", "80"));
    assert_eq!(
        half.range,
        KeyRange {
            start: 0,
            end: HALF - 1
        }
    );
    for id in ["-80", "80-FF", "05C1D19581B37C-05C1E399CD7000"] {
        assert_eq!(epk(id).id(), id);
    }
    assert!(EpkRange::parse("0").is_none(), "a partition key range id");
    for bad in [
        "80-",
        "x-FF",
        "ab-FF",
        "80-40",
        "80-80",
        &format!("{}-FF", "0".repeat(33)),
    ] {
        let err = EpkRange::parse(bad).expect("has a -").expect_err(bad);
        assert!(err.contains(bad) && err.contains("{min}-{max}"), "{err}");
    }
}

#[test]
fn an_epk_lease_is_read_on_the_range_holding_it_with_its_bounds() {
    // The .NET SDK's three cases (RequestInvokerHandler): an EPK range that is a whole range
    // is read by its id; a part of one by its id plus x-ms-start-epk / x-ms-end-epk.
    let one = listing(&[("0", "", "FF", &[])]);
    let on_zero = map::place(&one, &epk("-80")).expect("placed");
    assert_eq!(
        on_zero,
        Placement::On(Target {
            range_id: "0".into(),
            epk: Some(("".into(), "80".into())),
        })
    );
    let Placement::On(target) = on_zero else {
        unreachable!("checked above")
    };
    let after = ReadFrom::After(Cursor::after("\"42\""));
    assert_eq!(
        read_headers(&target, Some(&after), 100),
        vec![
            ("a-im", "Incremental feed".to_string()),
            ("x-ms-documentdb-partitionkeyrangeid", "0".into()),
            ("x-ms-max-item-count", "100".into()),
            ("x-ms-read-key-type", "EffectivePartitionKeyRange".into()),
            ("x-ms-start-epk", "".into()),
            ("x-ms-end-epk", "80".into()),
            ("if-none-match", "\"42\"".into()),
        ]
    );
    // From now and from the beginning: the same bounds, the feed's own preconditions.
    let now = read_headers(&target, None, 1);
    assert!(now.contains(&("if-none-match", "*".into())));
    assert!(now.contains(&("x-ms-start-epk", "".into())));
    let beginning = read_headers(&target, Some(&ReadFrom::Beginning), 1);
    assert!(!beginning.iter().any(|(h, _)| *h == "if-none-match"));
    // Exactly a range: read by its id alone, as a partition key range lease is.
    let split = map::parse_pkranges(&split_listing()).expect("listing");
    let exact = map::place(&split, &epk("80-FF")).expect("placed");
    let Placement::On(exact) = exact else {
        panic!("one range: {exact:?}")
    };
    assert_eq!(
        read_headers(&exact, Some(&after), 1),
        vec![
            ("a-im", "Incremental feed".to_string()),
            ("x-ms-documentdb-partitionkeyrangeid", "2".into()),
            ("x-ms-max-item-count", "1".into()),
            ("if-none-match", "\"42\"".into()),
        ]
    );
    // The session token of the range read gives the estimator its LSN.
    let page = classify(
        answer(
            200,
            &[("etag", "\"13\""), ("x-ms-session-token", "2:-1#20")],
            json!({"Documents": [], "_count": 0}),
        ),
        &exact.range_id,
    )
    .expect("page");
    assert!(matches!(
        page,
        Answered::Page {
            session_lsn: Some(20),
            ..
        }
    ));
}

#[test]
fn an_epk_range_continues_across_a_gone_range_and_its_continuations_round_trip() {
    // A .NET EPK lease's continuation is the ETag of the range it is read on, as for a
    // range lease; inside a transaction the skip is counted in the EPK partition.
    let mut r = reader(ReadFrom::After(Cursor::after("\"9\"")));
    r.partition = id("-80");
    r.target = Some(Target {
        range_id: "0".into(),
        epk: Some(("".into(), "80".into())),
    });
    let batch = r
        .apply(
            Answered::Page {
                docs: page_docs(),
                etag: Some("\"13\"".into()),
                session_lsn: None,
            },
            2,
            0,
        )
        .expect("page");
    let inside = batch.continuation.expect("a continuation");
    assert_eq!(inside.as_str(), "\"10\";skip=1;range=-80");
    let cursor = Cursor::parse(inside.as_str()).expect("round trip");
    assert_eq!(cursor.to_continuation(), inside);
    assert_eq!(cursor.clone().in_range("-80").skip, 1);
    // A part of it after a split reads the transaction again (never a gap).
    assert_eq!(cursor.in_range("-40"), Cursor::after("\"10\""));
    // 410/1002 on the range read: not the end of an EPK range, which is placed again on the
    // next read (the .NET processor's "redirect" after a merge or a split at its edge).
    let drained = r.take(10);
    assert_eq!(drained.continuation, Some(Continuation::new("\"13\"")));
    let gone = r.apply(Answered::Gone, 2, 0).expect("410");
    assert!(!gone.end_of_partition && gone.records.is_empty());
    assert!(r.target.is_none() && !r.ended);
    assert_eq!(r.from, ReadFrom::After(Cursor::after("\"13\"")));
}

#[test]
fn a_split_under_an_epk_lease_ends_it_and_its_parts_continue_from_its_continuation() {
    // Range 3 [, FF) held the .NET EPK leases "-80" and "80-FF" (after a merge); then it
    // split at 40 into 4 and 5. "-80" now spans both: closed, its parts "-40" (all of 4) and
    // "40-80" (part of 5) are its children; "80-FF" lies in 5 and reads on there.
    let after_split = listing(&[("4", "", "40", &["3"]), ("5", "40", "FF", &["3"])]);
    assert_eq!(
        map::place(&after_split, &epk("-80")),
        Ok(Placement::Split(vec![epk("-40"), epk("40-80")]))
    );
    let leased = [epk("-80"), epk("80-FF")];
    let parts = map::partitions_for(&after_split, &BTreeMap::new(), &leased).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-40", &["-80"], false),
            row("-80", &[], true),
            row("40-80", &["-80"], false),
            row("80-FF", &[], false),
        ],
        "ranges 3, 4 and 5 are read through the EPK leases only"
    );
    assert_eq!(parts[0].key_range, map::epk_range("", "40"));
    // The reader of "-80" ended at "77"; its parts start there.
    let leases = [
        lease("-80", LeaseState::Finished, Some("\"77\"")),
        lease("80-FF", LeaseState::Owned, Some("\"80\"")),
    ];
    let at = Position::Continuation(Continuation::new("\"77\""));
    assert_eq!(
        planned(&parts, &leases, &Position::Now),
        vec![("-40".into(), at.clone()), ("40-80".into(), at)]
    );
    // Once they have leases, they are "-80"'s children until its lease is deleted, then roots.
    let all = [epk("-80"), epk("80-FF"), epk("-40"), epk("40-80")];
    let later = map::partitions_for(&after_split, &BTreeMap::new(), &all).expect("parts");
    assert_eq!(
        shape(&later),
        vec![
            row("-40", &["-80"], false),
            row("-80", &[], true),
            row("40-80", &["-80"], false),
            row("80-FF", &[], false),
        ]
    );
    let deleted = [epk("80-FF"), epk("-40"), epk("40-80")];
    let last = map::partitions_for(&after_split, &BTreeMap::new(), &deleted).expect("parts");
    assert_eq!(
        shape(&last),
        vec![
            row("-40", &[], false),
            row("40-80", &[], false),
            row("80-FF", &[], false),
        ]
    );
    // A second split, inside "40-80" (5 into 6 and 7 at 60): only that part ends.
    let again = listing(&[
        ("4", "", "40", &["3"]),
        ("6", "40", "60", &["3", "5"]),
        ("7", "60", "FF", &["3", "5"]),
    ]);
    let parts = map::partitions_for(&again, &BTreeMap::new(), &deleted).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-40", &[], false),
            row("40-60", &["40-80"], false),
            row("40-80", &[], true),
            row("60-80", &["40-80"], false),
            row("80-FF", &[], false),
        ]
    );
}

#[test]
fn imported_epk_leases_stand_in_for_the_merged_range_they_cover() {
    // A .NET fleet's leases after 1 and 2 merged into 3: "-80" and "80-FF" (the old ranges,
    // now EPK ranges of 3). Imported, they are the partitions; nothing is created for 3 or
    // its ancestors, whatever the start.
    let merged = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    let leased = [epk("-80"), epk("80-FF")];
    let parts = map::partitions_for(&merged, &BTreeMap::new(), &leased).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![row("-80", &[], false), row("80-FF", &[], false)]
    );
    let leases = [
        lease("-80", LeaseState::Available, Some("\"42\"")),
        lease("80-FF", LeaseState::Available, Some("\"57\"")),
    ];
    for start in [Position::Beginning, Position::Now] {
        assert_eq!(planned(&parts, &leases, &start), vec![], "{start:?}");
    }
    let Ok(Placement::On(target)) = map::place(&merged, &epk("80-FF")) else {
        panic!("80-FF lies in 3")
    };
    assert_eq!(target.range_id, "3");
    // A listing without EPK leases is the plain one.
    assert_eq!(
        map::partitions_for(&merged, &BTreeMap::new(), &[]),
        map::partitions(&merged, &BTreeMap::new())
    );
}

#[test]
fn a_merge_is_a_child_of_both_merged_ranges() {
    // 0 split into 1 and 2, 1 into 5 and 6, 2 into 7 and 8; then 6 and 7 merged into 9,
    // which names every ancestor (in no documented order). 9's parents are 6 and 7; the
    // chains of splits above them are read as before.
    let ranges = listing(&[
        ("5", "", "20", &["0", "1"]),
        ("9", "20", "60", &["0", "1", "6", "2", "7"]),
        ("8", "60", "FF", &["0", "2"]),
    ]);
    let parts = map::partitions(&ranges, &BTreeMap::new()).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("0", &[], true),
            row("1", &["0"], true),
            row("2", &["0"], true),
            row("5", &["1"], false),
            // The listing cannot tell which of 1 and 2 each merged range came from: both,
            // which waits for one range more and never skips.
            row("6", &["1", "2"], true),
            row("7", &["1", "2"], true),
            row("8", &["2"], false),
            row("9", &["6", "7"], false),
        ]
    );
    // Both merged ranges finished: the merge child starts at the beginning (two
    // continuations cannot be ordered by the core), not at either parent's continuation.
    let leases = [
        lease("5", LeaseState::Owned, Some("\"30\"")),
        lease("6", LeaseState::Finished, Some("\"44\"")),
        lease("7", LeaseState::Finished, Some("\"47\"")),
        lease("8", LeaseState::Owned, Some("\"31\"")),
    ];
    assert_eq!(
        planned(&parts, &leases, &Position::Now),
        vec![("9".into(), Position::Beginning)]
    );
    // While one merged range is still read, the child waits.
    let reading = [
        lease("6", LeaseState::Finished, Some("\"44\"")),
        lease("7", LeaseState::Owned, Some("\"45\"")),
        lease("5", LeaseState::Owned, None),
        lease("8", LeaseState::Owned, None),
    ];
    assert_eq!(planned(&parts, &reading, &Position::Now), vec![]);
    // Two halves merged back into one range: parent and halves are alike in the listing,
    // so the child waits for all three and starts at the beginning.
    let back = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    let parts = map::partitions(&back, &BTreeMap::new()).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("0", &[], true),
            row("1", &[], true),
            row("2", &[], true),
            row("3", &["0", "1", "2"], false),
        ]
    );
    let halves = [
        lease("1", LeaseState::Finished, Some("\"44\"")),
        lease("2", LeaseState::Finished, Some("\"47\"")),
    ];
    let first = planned(&parts, &halves, &Position::Now);
    assert_eq!(
        first,
        vec![("0".into(), Position::Beginning)],
        "0 ends at once (410)"
    );
    let mut done = halves.to_vec();
    done.push(lease("0", LeaseState::Finished, None));
    assert_eq!(
        planned(&parts, &done, &Position::Now),
        vec![("3".into(), Position::Beginning)]
    );
}

#[test]
fn a_merge_of_an_epk_read_range_with_another_reads_the_rest_as_a_merge_child() {
    // Our lease "4" reads range 4 [, 40); range 5 [40, FF) is read by the EPK leases
    // "40-80" and "80-FF". 4 and 5 merge into 6: "40-80" and "80-FF" read on in 6, and the
    // rest of 6, "-40", is a merge child (6's parents), from the beginning once they end.
    let merged = listing(&[("6", "", "FF", &["0", "4", "5"])]);
    let leased = [epk("40-80"), epk("80-FF")];
    let parts = map::partitions_for(&merged, &BTreeMap::new(), &leased).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-40", &["0", "4", "5"], false),
            row("0", &[], true),
            row("4", &[], true),
            row("40-80", &[], false),
            row("5", &[], true),
            row("80-FF", &[], false),
        ]
    );
    let leases = [
        lease("4", LeaseState::Finished, Some("\"21\"")),
        lease("40-80", LeaseState::Owned, Some("\"22\"")),
        lease("80-FF", LeaseState::Owned, Some("\"23\"")),
        lease("0", LeaseState::Finished, None),
        lease("5", LeaseState::Finished, None),
    ];
    assert_eq!(
        planned(&parts, &leases, &Position::Now),
        vec![("-40".into(), Position::Beginning)]
    );
}

/// The leases as [`FeedSource::partitions_for`] is told of them.
fn held(leases: &[Lease]) -> Vec<LeasedPartition> {
    leases.iter().map(LeasedPartition::of).collect()
}

/// 1's and 2's continuations as their readers write them: with each range's span.
const C1: &str = "\"42\";range=1;span=-80";
const C2: &str = "\"57\";range=2;span=80-FF";

fn at(c: &str) -> Position {
    Position::Continuation(Continuation::new(c))
}

#[test]
fn a_merge_of_ranges_read_by_id_goes_on_at_their_continuations_in_their_spans() {
    // Ranges 1 [, 80) and 2 [80, FF), read by id, merge into 3. Their readers recorded each
    // range's span in its continuations, so the leases alone say where they were: as the .NET
    // processor keeps each old lease at its continuation and reads its span of 3, each goes
    // on as the EPK range of its span ("-80", "80-FF"), its child from its final
    // continuation: nothing is read again, nothing skipped, and 3 itself is never opened.
    // No listing from before the merge is used (`seen` is empty: a process started after it).
    let after = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    let reading = [
        lease("1", LeaseState::Owned, Some(C1)),
        lease("2", LeaseState::Owned, Some(C2)),
    ];
    let merged = map::merged_away(&after, &held(&reading)).expect("spans recorded");
    assert_eq!(
        merged.iter().map(EpkRange::id).collect::<Vec<_>>(),
        vec!["1", "2"]
    );
    let parts = map::partitions_for(&after, &BTreeMap::new(), &merged).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-80", &["1"], false),
            row("1", &[], true),
            row("2", &[], true),
            row("80-FF", &["2"], false),
        ],
        "3 is read through the old ranges' spans only"
    );
    assert_eq!(parts[1].key_range, map::epk_range("", "80"));
    // While 1 and 2 are read (their readers end at the 410 of their next read), nothing
    // starts; each span starts at its own range's final continuation, whatever the start.
    assert_eq!(planned(&parts, &reading, &Position::Beginning), vec![]);
    let one_done = [
        lease("1", LeaseState::Finished, Some(C1)),
        lease("2", LeaseState::Owned, Some(C2)),
    ];
    assert_eq!(
        map::merged_away(&after, &held(&one_done)),
        Ok(merged.clone()),
        "the same whatever the leases' states"
    );
    assert_eq!(
        planned(&parts, &one_done, &Position::Beginning),
        vec![("-80".into(), at(C1))]
    );
    let both_done = [
        lease("1", LeaseState::Finished, Some(C1)),
        lease("2", LeaseState::Finished, Some(C2)),
    ];
    assert_eq!(
        planned(&parts, &both_done, &Position::Now),
        vec![("-80".into(), at(C1)), ("80-FF".into(), at(C2))]
    );
    // With their leases they stay 1's and 2's children until those are deleted; then they
    // are EPK leases like imported .NET ones, standing in for 3.
    let mut all = merged.clone();
    all.extend([epk("-80"), epk("80-FF")]);
    let later = map::partitions_for(&after, &BTreeMap::new(), &all).expect("parts");
    assert_eq!(shape(&later), shape(&parts));
    let children = [epk("-80"), epk("80-FF")];
    let last = map::partitions_for(&after, &BTreeMap::new(), &children).expect("parts");
    assert_eq!(
        shape(&last),
        vec![row("-80", &[], false), row("80-FF", &[], false)]
    );
    // "-80" is read on 3 with its bounds, from 1's continuation.
    let Ok(Placement::On(target)) = map::place(&after, &epk("-80")) else {
        panic!("-80 lies in 3")
    };
    let from = ReadFrom::After(map::start_cursor(
        Cursor::parse(C1).expect("continuation"),
        "-80",
    ));
    let headers = read_headers(&target, Some(&from), 10);
    assert!(headers.contains(&("x-ms-documentdb-partitionkeyrangeid", "3".into())));
    assert!(headers.contains(&("x-ms-start-epk", "".into())));
    assert!(headers.contains(&("x-ms-end-epk", "80".into())));
    assert!(headers.contains(&("if-none-match", "\"42\"".into())));
}

/// A reader of range 1 [, 80) read by id, opened from `from` while the listing had it.
fn reader_of_one(from: ReadFrom) -> CosmosReader {
    let mut r = reader(from);
    r.partition = id("1");
    r.target = Some(Target {
        range_id: "1".into(),
        epk: None,
    });
    r.record_span(Some(("".into(), "80".into())));
    r
}

fn docs_at(lsns: &[u64]) -> Vec<Value> {
    lsns.iter()
        .map(|l| json!({"id": format!("d{l}"), "tenant": "t", "_ts": 1700000000, "_lsn": l}))
        .collect()
}

#[test]
fn a_fresh_source_continues_a_merged_away_range_at_its_checkpoint_without_redelivery() {
    // The span goes with the lease, not the process. Range 1's reader records its
    // span in every continuation; after 1 and 2 merge into 3, a source that never listed 1
    // (a leader started after the merge: nothing `seen`) continues 1's span on 3 after the
    // last record delivered, and what it reads from there is only what came after.
    let mut r = reader_of_one(ReadFrom::After(Cursor::after("\"40\"")));
    let page = Answered::Page {
        docs: docs_at(&[41, 42]),
        etag: Some("\"42\"".into()),
        session_lsn: None,
    };
    let delivered = r.apply(page, 10, 0).expect("page");
    let conts: Vec<&str> = delivered
        .records
        .iter()
        .map(|x| x.continuation.as_str())
        .collect();
    assert_eq!(conts, ["\"41\";range=1;span=-80", C1]);
    // The merge: 410/1002 ends 1; the worker finished its lease at its last checkpoint.
    let end = r.apply(Answered::Gone, 10, 0).expect("410");
    assert!(end.end_of_partition && end.continuation.is_none());
    let checkpoint = delivered.continuation.expect("checkpointed");
    let leases = [
        lease("1", LeaseState::Finished, Some(checkpoint.as_str())),
        lease("2", LeaseState::Finished, Some(C2)),
    ];
    let after = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    let merged = map::merged_away(&after, &held(&leases)).expect("placed");
    let parts = map::partitions_for(&after, &BTreeMap::new(), &merged).expect("parts");
    let plan = planned(&parts, &leases, &Position::Beginning);
    assert_eq!(plan, vec![("-80".into(), at(C1)), ("80-FF".into(), at(C2))]);
    // "-80" opened there: read on 3 in 1's bounds after 42; the documents after 42 of its
    // keys come, and nothing 1 delivered.
    let mut child = reader(ReadFrom::After(map::start_cursor(
        Cursor::parse(C1).expect("continuation"),
        "-80",
    )));
    child.partition = id("-80");
    let Ok(Placement::On(target)) = map::place(&after, &epk("-80")) else {
        panic!("-80 lies in 3")
    };
    let headers = read_headers(&target, Some(&child.from), 10);
    for wanted in [
        ("x-ms-documentdb-partitionkeyrangeid", "3"),
        ("x-ms-start-epk", ""),
        ("x-ms-end-epk", "80"),
        ("if-none-match", "\"42\""),
    ] {
        assert!(
            headers.iter().any(|(h, v)| (*h, v.as_str()) == wanted),
            "{wanted:?} in {headers:?}"
        );
    }
    child.target = Some(target);
    let next = child
        .apply(
            Answered::Page {
                docs: docs_at(&[43]),
                etag: Some("\"43\"".into()),
                session_lsn: None,
            },
            10,
            0,
        )
        .expect("page");
    assert_eq!(ids(&next.records), vec!["\"d43\""]);
    assert_eq!(next.continuation, Some(Continuation::new("\"43\"")));
}

#[test]
fn a_reader_restates_its_place_with_its_span_once_when_nothing_comes() {
    // A lease checkpointed without the span (an earlier version, a .NET import, a child at
    // its parent's continuation) gets it at its reader's first read that has no records: the
    // place restated, which the worker checkpoints, so that a merge after that loses nothing.
    let mut r = reader_of_one(ReadFrom::After(Cursor::after("\"42\"")));
    let caught_up = || Answered::CaughtUp {
        etag: Some("\"45\"".into()),
        session_lsn: None,
    };
    let first = r.apply(caught_up(), 10, 0).expect("304");
    assert!(first.records.is_empty() && !first.end_of_partition);
    assert_eq!(
        first.continuation,
        Some(Continuation::new("\"45\";range=1;span=-80"))
    );
    let again = r.apply(caught_up(), 10, 0).expect("304");
    assert_eq!(again.continuation, None, "once");
    // A skip counted in this range is kept; one counted in the parent (a child starting at
    // its continuation) is dropped, as a read there would drop it.
    let inside = Cursor::parse("\"41\";skip=2;range=1").expect("continuation");
    let mut r = reader_of_one(ReadFrom::After(inside));
    let first = r.apply(caught_up(), 10, 2).expect("304");
    assert_eq!(
        first.continuation,
        Some(Continuation::new("\"41\";skip=2;range=1;span=-80"))
    );
    let mut r = reader_of_one(ReadFrom::After(Cursor::parse(C2).expect("parent's")));
    let first = r.apply(caught_up(), 10, 0).expect("304");
    assert_eq!(
        first.continuation,
        Some(Continuation::new("\"45\";range=1;span=-80"))
    );
    // At the end of the range (a merge or split before any read), the end carries it.
    let mut r = reader_of_one(ReadFrom::After(Cursor::after("\"42\"")));
    let end = r.apply(Answered::Gone, 10, 0).expect("410");
    assert!(end.end_of_partition);
    assert_eq!(end.continuation, Some(Continuation::new(C1)));
    // A position that records the span already, or none at all: nothing to restate.
    let mut r = reader_of_one(ReadFrom::After(Cursor::parse(C1).expect("own")));
    assert_eq!(r.apply(caught_up(), 10, 0).expect("304").continuation, None);
    let mut r = reader_of_one(ReadFrom::Beginning);
    assert_eq!(
        r.apply(Answered::Gone, 10, 0).expect("410").continuation,
        None
    );
    // A reader opened after the range went (no span listed) keeps the one its cursor records.
    let mut r = reader(ReadFrom::After(Cursor::parse(C1).expect("own")));
    r.partition = id("1");
    r.record_span(None);
    assert_eq!(r.span, Some(("".into(), "80".into())));
    assert!(!r.restate);
}

#[test]
fn a_span_continuing_a_merged_range_keeps_its_place_inside_a_transaction() {
    // 1 stopped inside a transaction (two of its documents done). Its span "-80" reads the
    // same keys, so the same documents of that transaction: it skips the same two. A piece
    // of the span (a split too), or a continuation that records no span, reads the
    // transaction again (at least once, never a gap).
    let inside = Cursor::parse("\"41\";skip=2;range=1;span=-80").expect("continuation");
    assert_eq!(
        map::start_cursor(inside.clone(), "-80"),
        inside,
        "the same span"
    );
    assert_eq!(
        map::start_cursor(inside.clone(), "-40"),
        Cursor::after("\"41\"")
    );
    assert_eq!(
        map::start_cursor(inside.clone(), "80-FF"),
        Cursor::after("\"41\"")
    );
    let unrecorded = Cursor::parse("\"41\";skip=2;range=1").expect("continuation");
    assert_eq!(
        map::start_cursor(unrecorded, "-80"),
        Cursor::after("\"41\"")
    );
    assert_eq!(map::start_cursor(inside.clone(), "1"), inside);
}

#[test]
fn only_a_merge_turns_a_range_read_by_id_into_its_span() {
    // A split leaves only ranges inside the parent's span: its children are the listed
    // ranges, as before. A range listed, or an EPK range, is not one.
    let split = listing(&[
        ("4", "", "40", &["0", "1"]),
        ("5", "40", "80", &["0", "1"]),
        ("2", "80", "FF", &["0"]),
    ]);
    let one = [lease("1", LeaseState::Finished, Some(C1))];
    assert_eq!(map::merged_away(&split, &held(&one)), Ok(vec![]));
    let merged = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    let listed = [
        lease("3", LeaseState::Owned, Some("\"9\"")),
        lease("-80", LeaseState::Owned, Some("\"9\"")),
    ];
    assert_eq!(
        map::merged_away(&merged, &held(&listed)),
        Ok(vec![]),
        "listed ids and EPK ranges are not merged-away ranges"
    );
    // 3 already has a lease (planned as a merge child before spans were recorded): it is
    // read as planned, and the old spans are not read a second time.
    let planned_before = [
        lease("1", LeaseState::Finished, Some(C1)),
        lease("2", LeaseState::Finished, Some(C2)),
        lease("3", LeaseState::Owned, None),
    ];
    assert_eq!(
        map::merged_away(&merged, &held(&planned_before)),
        Ok(vec![])
    );
    // One span recorded, the other range never read (no continuation: nothing of its keys
    // was delivered): 1 goes on in its span; the rest of 3 is a merge child from the
    // beginning, which reads 2's keys once.
    let half = [
        lease("1", LeaseState::Finished, Some(C1)),
        lease("2", LeaseState::Finished, None),
    ];
    let one = map::merged_away(&merged, &held(&half)).expect("placed");
    let parts = map::partitions_for(&merged, &BTreeMap::new(), &one).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-80", &["1"], false),
            row("0", &[], true),
            row("1", &[], true),
            row("2", &[], true),
            row("80-FF", &["0", "1", "2"], false),
        ]
    );
    let mut done = half.to_vec();
    done.push(lease("0", LeaseState::Finished, None));
    assert_eq!(
        planned(&parts, &done, &Position::Now),
        vec![
            ("-80".into(), at(C1)),
            ("80-FF".into(), Position::Beginning)
        ]
    );
    // A merge after a split of the merged range: 3 split again at 40 into 6 and 7; 1's span
    // is cut at 40, both pieces its children.
    let resplit = listing(&[
        ("6", "", "40", &["0", "1", "2", "3"]),
        ("7", "40", "FF", &["0", "1", "2", "3"]),
    ]);
    let both = map::merged_away(&resplit, &held(&planned_before[..2])).expect("placed");
    let parts = map::partitions_for(&resplit, &BTreeMap::new(), &both).expect("parts");
    assert_eq!(
        shape(&parts),
        vec![
            row("-40", &["1"], false),
            row("1", &[], true),
            row("2", &[], true),
            row("40-80", &["1"], false),
            row("80-FF", &["2"], false),
        ]
    );
}

#[test]
fn a_merged_range_whose_span_no_lease_records_is_refused_by_name_not_read_again() {
    // A leased range gone in a merge, read up to a continuation that records no span of its
    // own (an earlier version's checkpoint, or its parent's continuation it started at and
    // never read past): where it was cannot be known, and the merge child from the beginning
    // would deliver its keys again. The answer is an error naming it and saying how to go on,
    // and nothing is planned; never a silent read from the beginning.
    let merged = listing(&[("3", "", "FF", &["0", "1", "2"])]);
    for (checkpoint, start) in [
        (Some("\"42\""), Position::Beginning),
        (None, at("\"30\";range=0;span=-FF")),
        (Some("\"41\";skip=2;range=1"), Position::Beginning),
    ] {
        let mut one = lease("1", LeaseState::Finished, checkpoint);
        one.start = start.clone();
        let leases = [one, lease("2", LeaseState::Owned, Some(C2))];
        let err = map::merged_away(&merged, &held(&leases)).expect_err("span unknown");
        assert_eq!(err.partition, "1", "{checkpoint:?} {start:?}");
        for needle in [
            "merge 3",
            "records no span of 1",
            "beginning",
            "changefeed reset",
        ] {
            assert!(err.reason.contains(needle), "{needle}: {}", err.reason);
        }
        let etag = checkpoint.map_or("\"30\"", |c| &c[..4]);
        let skip = if checkpoint.is_some_and(|c| c.contains("skip")) {
            ";skip=2"
        } else {
            ""
        };
        let reset = format!("`{etag}{skip};range=1;span=MIN-MAX`");
        assert!(err.reason.contains(&reset), "{reset}: {}", err.reason);
    }
    // Reset to that, with the span, it goes on there.
    let fixed = [
        lease("1", LeaseState::Finished, Some("\"42\";range=1;span=-80")),
        lease("2", LeaseState::Owned, Some(C2)),
    ];
    assert_eq!(
        map::merged_away(&merged, &held(&fixed)).map(|m| m.len()),
        Ok(2)
    );
    // Never read (no continuation): nothing of its keys was delivered, so its part of 3 is a
    // merge child from the beginning (above); a lease row that cannot be read says nothing
    // and is left alone too.
    for position in [None, Some(Position::Beginning), Some(Position::Now)] {
        let leased = [
            LeasedPartition::at(id("2"), at(C2)),
            match position {
                Some(p) => LeasedPartition::at(id("1"), p),
                None => LeasedPartition::unreadable(id("1")),
            },
        ];
        assert_eq!(
            map::merged_away(&merged, &leased).map(|m| m.len()),
            Ok(1),
            "only 2 goes on in its span"
        );
    }
    // 3 already leased (planned before): kept to, no error.
    let kept = [
        lease("1", LeaseState::Finished, Some("\"42\"")),
        lease("3", LeaseState::Owned, None),
    ];
    assert_eq!(map::merged_away(&merged, &held(&kept)), Ok(vec![]));
    // A split needs no span: its children are listed, and start at its continuation.
    let split = listing(&[
        ("4", "", "40", &["0", "1"]),
        ("5", "40", "80", &["0", "1"]),
        ("2", "80", "FF", &["0"]),
    ]);
    let old = [
        lease("1", LeaseState::Finished, Some("\"42\"")),
        lease("2", LeaseState::Owned, Some("\"57\"")),
    ];
    assert_eq!(map::merged_away(&split, &held(&old)), Ok(vec![]));
    let parts = map::partitions_for(&split, &BTreeMap::new(), &[]).expect("parts");
    assert_eq!(
        planned(&parts, &old, &Position::Now),
        vec![("4".into(), at("\"42\"")), ("5".into(), at("\"42\""))]
    );
}
