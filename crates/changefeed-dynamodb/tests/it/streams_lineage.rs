//! The Streams source's lineage on DynamoDB Streams listings of a shard rollover, which
//! DynamoDB Local does not produce in a test's time (its shards roll over after hours): the
//! `DescribeStream` answers in `testdata/` are served on loopback to the real SDK client, so
//! paging, parents, closed shards and a trimmed parent are read exactly as from AWS.

use changefeed::lineage::{plan, Input};
use changefeed::model::{PartitionId, Position};
use changefeed::source::FeedSource;
use changefeed_dynamodb::{AwsOptions, DynamoStreamsFeed, StreamRef, StreamsOptions};

use crate::replay::{serve, Seen};

const PAGE_1: &str = include_str!("testdata/describe_stream_rollover_1.json");
const PAGE_2: &str = include_str!("testdata/describe_stream_rollover_2.json");
const ARN: &str =
    "arn:aws:dynamodb:us-east-1:123456789012:table/orders/stream/2023-11-14T22:13:20.000";

/// Serves the recorded `DescribeStream` pages on loopback: the second page to a request
/// that continues after the first page's last shard. Returns the endpoint and the requests
/// seen.
async fn replay() -> (String, Seen) {
    serve(|_, body, _| {
        let page = if body.contains("ExclusiveStartShardId") {
            PAGE_2
        } else {
            PAGE_1
        };
        (200, page.to_string())
    })
    .await
}

fn id(s: &str) -> PartitionId {
    PartitionId::new(s).expect("valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollover_lists_closed_parents_and_children_across_pages() {
    // Lineage comes from ParentShardId, closed shards from EndingSequenceNumber, and every
    // page of DescribeStream is read (DESIGN.md, "Partition lineage").
    let (endpoint, seen) = replay().await;
    let feed = DynamoStreamsFeed::connect(
        &AwsOptions::local(endpoint),
        &StreamRef::Arn(ARN.to_string()),
        StreamsOptions::default(),
    )
    .await
    .expect("connect");
    let ps = feed.partitions().await.expect("partitions");
    let got: Vec<_> = ps
        .iter()
        .map(|p| (p.id.as_str().to_string(), p.parents.clone(), p.closed))
        .collect();
    let (trimmed, p0, c1, c2, s1) = (
        id("shardId-00000001699985600000-99999999"),
        id("shardId-00000001700000000000-aaaaaaaa"),
        id("shardId-00000001700014400000-bbbbbbbb"),
        id("shardId-00000001700028800000-cccccccc"),
        id("shardId-00000001700014400000-dddddddd"),
    );
    assert_eq!(
        got,
        vec![
            (p0.to_string(), vec![trimmed.clone()], true),
            (c1.to_string(), vec![p0.clone()], true),
            (c2.to_string(), vec![c1.clone()], false),
            (s1.to_string(), vec![p0.clone()], false),
        ]
    );
    let bodies: Vec<String> = seen
        .lock()
        .expect("log")
        .iter()
        .map(|(_, b)| b.clone())
        .collect();
    assert_eq!(bodies.len(), 2, "two pages, two calls");
    assert!(
        bodies[1].contains(c1.as_str()),
        "the second page starts after the first page's last shard: {}",
        bodies[1]
    );

    // From the beginning, the oldest shard still listed starts (its trimmed parent counts as
    // finished); its children wait for it. From now, the open leaves start.
    let beginning = plan(&Input::new(&ps, &[], &Position::Beginning));
    let created: Vec<_> = beginning
        .create
        .iter()
        .map(|l| (l.partition.clone(), l.start.clone()))
        .collect();
    assert_eq!(created, vec![(p0.clone(), Position::Beginning)]);
    assert!(beginning.errors.is_empty(), "{:?}", beginning.errors);
    let now = plan(&Input::new(&ps, &[], &Position::Now));
    let mut created: Vec<_> = now.create.iter().map(|l| l.partition.clone()).collect();
    created.sort();
    let mut leaves = vec![c2, s1];
    leaves.sort();
    assert_eq!(created, leaves);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_stream_is_paced_within_its_limit() {
    // DescribeStream allows 10 calls a second per stream: one source never calls it faster
    // than its describe_interval, pages included.
    let (endpoint, seen) = replay().await;
    let options =
        StreamsOptions::default().with_describe_interval(std::time::Duration::from_millis(200));
    let feed = DynamoStreamsFeed::connect(
        &AwsOptions::local(endpoint),
        &StreamRef::Arn(ARN.to_string()),
        options,
    )
    .await
    .expect("connect");
    let started = std::time::Instant::now();
    for _ in 0..3 {
        feed.partitions().await.expect("partitions");
    }
    let calls = seen.lock().expect("log").len();
    assert_eq!(calls, 6);
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(200 * (calls as u64 - 1)),
        "{calls} calls in {:?}",
        started.elapsed()
    );
}
