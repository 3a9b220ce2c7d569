//! What no local server produces in a test's time, served on loopback to the real SDK client
//! (`replay`): a checkpoint trimmed by the 24-hour retention, an iterator expired after 15
//! minutes, and throttling of `DescribeStream`.

use changefeed::model::{Continuation, PartitionId, Position};
use changefeed::source::FeedSource;
use changefeed::SourceError;
use changefeed_dynamodb::{AwsOptions, DynamoStreamsFeed, StreamRef, StreamsOptions};
use serde_json::json;

use crate::replay::{error, serve};

const ARN: &str =
    "arn:aws:dynamodb:us-east-1:123456789012:table/orders/stream/2023-11-14T22:13:20.000";
const SHARD: &str = "shardId-00000001700000000000-aaaaaaaa";

fn seq(n: u64) -> String {
    format!("{:021}", 100_000_000_000_000_000_000u128 + u128::from(n))
}

/// A `GetRecords` answer holding the inserts of `item-N` for each `n`, then `next`.
fn records(ns: &[u64], next: Option<&str>) -> (u16, String) {
    let records: Vec<_> = ns
        .iter()
        .map(|n| {
            json!({
                "eventID": format!("e{n}"),
                "eventName": "INSERT",
                "dynamodb": {
                    "ApproximateCreationDateTime": 1_700_000_000 + n,
                    "Keys": {"pk": {"S": format!("item-{n}")}},
                    "NewImage": {"pk": {"S": format!("item-{n}")}, "data": {"S": format!("v{n}")}},
                    "SequenceNumber": seq(*n),
                    "SizeBytes": 20,
                    "StreamViewType": "NEW_AND_OLD_IMAGES"
                }
            })
        })
        .collect();
    let mut body = json!({ "Records": records });
    if let Some(next) = next {
        body["NextShardIterator"] = json!(next);
    }
    (200, body.to_string())
}

async fn feed(endpoint: String) -> DynamoStreamsFeed {
    DynamoStreamsFeed::connect(
        &AwsOptions::local(endpoint),
        &StreamRef::Arn(ARN.to_string()),
        StreamsOptions::default(),
    )
    .await
    .expect("connect")
}

fn shard() -> PartitionId {
    PartitionId::new(SHARD).expect("valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_older_than_the_retention_is_reported_as_lost_never_skipped() {
    // A trimmed checkpoint is refused by name (shard, sequence number, retention), and the
    // source never falls back to the trim horizon on its own (DESIGN.md rule 4).
    let (endpoint, seen) = serve(|_, _, _| {
        error(
            "TrimmedDataAccessException",
            "the requested data is past the trim horizon",
        )
    })
    .await;
    let feed = feed(endpoint).await;
    let at = Continuation::new(seq(7));
    match feed
        .open(&shard(), &Position::Continuation(at.clone()))
        .await
    {
        Err(e @ SourceError::InvalidContinuation { .. }) => {
            let text = e.to_string();
            assert!(text.contains(SHARD) && text.contains(at.as_str()), "{text}");
            assert!(text.contains("lost to retention"), "{text}");
        }
        other => panic!("reported as lost to retention, got {other:?}"),
    }
    let seen = seen.lock().expect("log").clone();
    assert!(
        seen.iter().all(|(_, body)| !body.contains("TRIM_HORIZON")),
        "no fallback to the horizon: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_iterator_is_renewed_after_the_last_record_read() {
    // Nothing skipped or repeated across an expired iterator (15 minutes idle in a handler).
    let (endpoint, seen) = serve(|op, body, _| match op {
        "GetShardIterator" if body.contains("AFTER_SEQUENCE_NUMBER") => {
            (200, json!({"ShardIterator": "it-3"}).to_string())
        }
        "GetShardIterator" => (200, json!({"ShardIterator": "it-1"}).to_string()),
        "GetRecords" if body.contains("\"it-1\"") => records(&[1, 2], Some("it-2")),
        "GetRecords" if body.contains("\"it-2\"") => {
            error("ExpiredIteratorException", "Iterator expired")
        }
        "GetRecords" if body.contains("\"it-3\"") => records(&[3], Some("it-4")),
        "GetRecords" => records(&[], Some("it-4")),
        other => panic!("unexpected operation {other}"),
    })
    .await;
    let feed = feed(endpoint).await;
    let mut reader = feed
        .open(&shard(), &Position::Beginning)
        .await
        .expect("open");
    let first = reader.next_batch(10).await.expect("read");
    assert_eq!(first.continuation, Some(Continuation::new(seq(2))));
    let second = reader.next_batch(10).await.expect("read across the expiry");
    let got: Vec<_> = second
        .records
        .iter()
        .map(|r| r.continuation.as_str().to_string())
        .collect();
    assert_eq!(got, [seq(3)], "exactly the record after the last one read");
    let renewal = seen
        .lock()
        .expect("log")
        .iter()
        .find(|(op, body)| op == "GetShardIterator" && body.contains("AFTER_SEQUENCE_NUMBER"))
        .cloned()
        .expect("a renewed iterator");
    assert!(
        renewal.1.contains(&seq(2)),
        "after the last record read: {renewal:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_trimmed_under_a_reader_is_reported_after_its_last_record() {
    // A reader that fell behind the retention stops with the loss named, at its last record.
    let (endpoint, _) = serve(|op, body, _| match op {
        "GetShardIterator" => (200, json!({"ShardIterator": "it-1"}).to_string()),
        "GetRecords" if body.contains("\"it-1\"") => records(&[1], Some("it-2")),
        _ => error("TrimmedDataAccessException", "trimmed"),
    })
    .await;
    let feed = feed(endpoint).await;
    let mut reader = feed
        .open(&shard(), &Position::Beginning)
        .await
        .expect("open");
    reader.next_batch(10).await.expect("read");
    match reader.next_batch(10).await {
        Err(e @ SourceError::InvalidContinuation { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&seq(1)) && text.contains("lost to retention"),
                "{text}"
            );
        }
        other => panic!("reported as lost to retention, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_listing_is_tried_again() {
    // DescribeStream's 10 calls a second are shared by every reader of the stream: a
    // LimitExceededException is retried, not reported.
    let page = include_str!("testdata/describe_stream_rollover_2.json");
    let (endpoint, seen) = serve(move |_, _, n| {
        if n == 0 {
            error("LimitExceededException", "Rate exceeded for stream")
        } else {
            (200, page.to_string())
        }
    })
    .await;
    let ps = feed(endpoint)
        .await
        .partitions()
        .await
        .expect("listed after a retry");
    assert_eq!(ps.len(), 2);
    assert_eq!(
        seen.lock().expect("log").len(),
        2,
        "one refused call, one retry"
    );
}
