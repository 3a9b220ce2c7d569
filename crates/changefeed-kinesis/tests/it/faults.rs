//! Socket faults between the Kinesis source and kinesis-mock ([`FaultProxy`]): every call ends
//! within the client's stated timeouts (`Timeouts::KINESIS`, the crate docs' "Timeouts and
//! recovery") with a retryable error instead of hanging, and the source reads again as soon as
//! the path is back, never on a connection the fault left dead.

use std::time::{Duration, Instant};

use changefeed::model::{PartitionId, Position};
use changefeed::source::FeedSource;
use changefeed::testkit::net::FaultProxy;
use changefeed::SourceError;
use changefeed_kinesis::{AwsOptions, KinesisFeed, Timeouts};

use crate::{endpoint, fresh_feed};

const T: Timeouts = Timeouts::KINESIS;

/// Scheduling slack on a loaded 2-core machine, on top of every stated bound.
const SLACK: Duration = Duration::from_millis(750);

/// A fresh stream of one shard with `records` records, and a source on it reached through a
/// new fault proxy.
async fn proxied_feed(prefix: &str, records: usize) -> (FaultProxy, KinesisFeed, PartitionId) {
    let direct = fresh_feed(prefix, 1).await;
    let mut shard = None;
    for i in 0..records {
        let (s, _) = direct
            .put("k", format!("r{i}").into_bytes(), None)
            .await
            .expect("put");
        shard = Some(s);
    }
    let upstream = endpoint()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let proxy = FaultProxy::start(upstream).await.expect("fault proxy");
    let feed = KinesisFeed::connect(
        &AwsOptions::local(format!("http://{}", proxy.addr())),
        direct.stream(),
    )
    .await;
    let shard = match shard {
        Some(s) => s,
        None => direct.partitions().await.expect("shards")[0].id.clone(),
    };
    (proxy, feed, shard)
}

/// One listing of the shards, timed.
async fn timed_partitions(feed: &KinesisFeed) -> (Result<(), SourceError>, Duration) {
    let started = Instant::now();
    let result = feed.partitions().await.map(|_| ());
    (result, started.elapsed())
}

fn assert_retryable_failure(result: Result<(), SourceError>, elapsed: Duration, within: Duration) {
    let err = result.expect_err("no answer through the fault");
    assert!(err.is_retryable(), "a fault is retryable: {err}");
    assert!(
        elapsed <= within + SLACK,
        "the call failed after {elapsed:?}, past the stated {within:?}: {err}"
    );
}

#[tokio::test]
async fn a_read_into_a_black_hole_fails_retryably_within_the_operation_timeout_and_resumes_after() {
    let (proxy, feed, shard) = proxied_feed("bh", 6).await;
    let mut reader = feed
        .open(&shard, &Position::Beginning)
        .await
        .expect("open through the passing proxy");
    let first = reader.next_batch(3).await.expect("a batch");
    assert_eq!(first.records.len(), 3);
    proxy.black_hole();
    let started = Instant::now();
    let result = reader.next_batch(3).await.map(|_| ());
    let elapsed = started.elapsed();
    eprintln!("black hole: GetRecords failed after {elapsed:?}");
    assert!(elapsed >= T.request, "{elapsed:?}");
    assert_retryable_failure(result, elapsed, T.operation());
    proxy.pass();
    let started = Instant::now();
    let next = reader.next_batch(3).await.expect("the path is back");
    assert!(
        started.elapsed() <= T.connect + T.request + SLACK,
        "{:?}",
        started.elapsed()
    );
    let data: Vec<Vec<u8>> = next.records.iter().map(|r| r.data.to_vec()).collect();
    assert_eq!(
        data,
        [b"r3".to_vec(), b"r4".to_vec(), b"r5".to_vec()],
        "the reader goes on where it was"
    );
}

#[tokio::test]
async fn after_a_black_hole_that_forgot_every_flow_the_next_call_succeeds_on_a_new_connection_at_once(
) {
    let (proxy, feed, _) = proxied_feed("forget", 0).await;
    let calls = (0..3).map(|_| feed.partitions());
    for r in futures::future::join_all(calls).await {
        r.expect("a listing through the passing proxy");
    }
    proxy.black_hole();
    let (result, elapsed) = timed_partitions(&feed).await;
    assert_retryable_failure(result, elapsed, T.operation());
    assert!(elapsed > T.pool_idle, "the fault outlasts pool_idle");
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_partitions(&feed).await;
    eprintln!("forgotten flows: the first call after the fault took {elapsed:?}");
    result.expect("the path is back");
    assert!(
        elapsed < T.request,
        "answered on a first attempt (no dead connection tried): {elapsed:?}"
    );
}

#[tokio::test]
async fn a_call_on_a_connection_a_short_fault_left_dead_is_sent_again_on_a_new_one() {
    let (proxy, feed, _) = proxied_feed("short", 0).await;
    timed_partitions(&feed).await.0.expect("warm");
    proxy.black_hole();
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_partitions(&feed).await;
    eprintln!("a dead pooled connection: the call took {elapsed:?}");
    result.expect("answered on another connection");
    assert!(
        elapsed >= T.request,
        "the first attempt went to the dead connection: {elapsed:?}"
    );
    assert!(
        elapsed <= T.request + T.max_backoff + T.connect + SLACK,
        "{elapsed:?}"
    );
    let (result, elapsed) = timed_partitions(&feed).await;
    result.expect("answered");
    assert!(elapsed < T.request, "{elapsed:?}");
}

#[tokio::test]
async fn after_every_connection_is_reset_the_call_in_flight_is_sent_again_and_answered() {
    let (proxy, feed, _) = proxied_feed("reset", 0).await;
    timed_partitions(&feed).await.0.expect("warm");
    proxy.black_hole();
    let in_flight = {
        let feed = feed.clone();
        tokio::spawn(async move { timed_partitions(&feed).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let healed = Instant::now();
    proxy.reset_all();
    proxy.pass();
    let (result, _) = in_flight.await.expect("the call's task");
    let after = healed.elapsed();
    eprintln!("reset: the call in flight was answered {after:?} after the reset");
    result.expect("sent again after the reset and answered");
    assert!(
        after <= T.max_backoff + T.connect + T.request + SLACK,
        "{after:?}"
    );
    proxy.reset_all();
    let (result, elapsed) = timed_partitions(&feed).await;
    result.expect("answered on a new connection");
    assert!(elapsed < T.request, "{elapsed:?}");
}

#[tokio::test]
async fn answers_slower_than_the_request_timeout_fail_retryably_and_pass_again_after() {
    let (proxy, feed, _) = proxied_feed("slow", 0).await;
    timed_partitions(&feed).await.0.expect("warm");
    proxy.delay(T.request + Duration::from_millis(500));
    let (result, elapsed) = timed_partitions(&feed).await;
    eprintln!("delay: the call failed after {elapsed:?}");
    assert_retryable_failure(result, elapsed, T.operation());
    proxy.pass();
    let (result, elapsed) = timed_partitions(&feed).await;
    result.expect("answered once the path is fast again");
    assert!(elapsed <= T.connect + T.request + SLACK, "{elapsed:?}");
}
