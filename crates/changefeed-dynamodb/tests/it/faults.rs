//! Socket faults between the lease store and DynamoDB Local ([`FaultProxy`]): every call ends
//! within the client's stated timeouts (`Timeouts::DYNAMODB`, the crate docs' "Timeouts and
//! recovery") with a retryable error instead of hanging, and the store talks again as soon as
//! the path is back, never on a connection the fault left dead.

use std::time::{Duration, Instant};

use changefeed::lease::LeaseStore;
use changefeed::model::GroupName;
use changefeed::testkit::net::FaultProxy;
use changefeed::LeaseError;
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore, Timeouts};

use crate::{endpoint, fresh_table};

const T: Timeouts = Timeouts::DYNAMODB;

/// Scheduling slack on a loaded 2-core machine, on top of every stated bound.
const SLACK: Duration = Duration::from_millis(750);

/// A store on a fresh table of DynamoDB Local, reached through a new fault proxy.
async fn proxied_store(prefix: &str) -> (FaultProxy, DynamoLeaseStore) {
    let upstream = endpoint()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let proxy = FaultProxy::start(upstream).await.expect("fault proxy");
    let options = AwsOptions::local(format!("http://{}", proxy.addr()));
    let store = DynamoLeaseStore::connect(&options, fresh_table(prefix))
        .await
        .unwrap_or_else(|e| panic!("cannot reach DynamoDB Local at {}: {e}", endpoint()));
    (proxy, store)
}

fn group() -> GroupName {
    GroupName::new("g").expect("group")
}

/// One read of the store, timed.
async fn timed_list(store: &DynamoLeaseStore) -> (Result<(), LeaseError>, Duration) {
    let started = Instant::now();
    let result = store.list(&group()).await.map(|_| ());
    (result, started.elapsed())
}

/// `n` reads at once, so that the pool holds up to `n` idle connections afterwards.
async fn warm(store: &DynamoLeaseStore, n: usize) {
    let g = group();
    let reads = (0..n).map(|_| store.list(&g));
    for r in futures::future::join_all(reads).await {
        r.expect("a read through the passing proxy");
    }
}

fn assert_retryable_failure(result: Result<(), LeaseError>, elapsed: Duration, within: Duration) {
    let err = result.expect_err("no answer through the fault");
    assert!(err.is_retryable(), "a fault is retryable: {err}");
    assert!(
        elapsed <= within + SLACK,
        "the call failed after {elapsed:?}, past the stated {within:?}: {err}"
    );
}

#[tokio::test]
async fn a_call_into_a_black_hole_fails_retryably_within_the_operation_timeout() {
    let (proxy, store) = proxied_store("bh").await;
    warm(&store, 3).await;
    proxy.black_hole();
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("black hole: the call failed after {elapsed:?}");
    assert!(
        elapsed >= T.request,
        "it waited for an answer at least one attempt: {elapsed:?}"
    );
    assert_retryable_failure(result, elapsed, T.operation());
    // The held bytes go through once the path is back: the store answers again.
    proxy.pass();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("the path is back");
    assert!(elapsed <= T.connect + T.request + SLACK, "{elapsed:?}");
}

#[tokio::test]
async fn after_a_black_hole_that_forgot_every_flow_the_next_call_succeeds_on_a_new_connection_at_once(
) {
    // The fault outlasts `pool_idle`: every pooled connection (dead for ever behind the proxy)
    // has expired, so the first call after the path is back opens a new connection and gets
    // its answer within connect + request, on its first attempt.
    let (proxy, store) = proxied_store("forget").await;
    warm(&store, 4).await;
    let fault = Instant::now();
    proxy.black_hole();
    let (result, elapsed) = timed_list(&store).await;
    assert_retryable_failure(result, elapsed, T.operation());
    tokio::time::sleep((T.pool_idle + Duration::from_millis(200)).saturating_sub(fault.elapsed()))
        .await;
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("forgotten flows: the first call after the fault took {elapsed:?}");
    result.expect("the path is back");
    assert!(
        elapsed < T.request,
        "answered on a first attempt (no dead connection tried): {elapsed:?}"
    );
}

#[tokio::test]
async fn a_call_on_a_connection_a_short_fault_left_dead_is_sent_again_on_a_new_one() {
    // A fault shorter than `pool_idle`, after which the path forgets the old flows: the pooled
    // connection looks open but is dead. The call's first attempt on it times out after
    // `request`, and the next attempt, on a new connection, is answered.
    let (proxy, store) = proxied_store("short").await;
    warm(&store, 1).await;
    proxy.black_hole();
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_list(&store).await;
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
    // The dead connection was not pooled again: the next call is answered at once.
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered");
    assert!(elapsed < T.request, "{elapsed:?}");
}

#[tokio::test]
async fn after_every_connection_is_reset_the_call_in_flight_is_sent_again_and_answered() {
    // A server restart as the client sees it, during a black hole: the call in flight gets a
    // reset, the SDK sends it again on a new connection, and it is answered once the path is
    // back; the call after it needs no retry.
    let (proxy, store) = proxied_store("reset").await;
    warm(&store, 3).await;
    proxy.black_hole();
    let in_flight = {
        let store = store.clone();
        tokio::spawn(async move { timed_list(&store).await })
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
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered");
    assert!(elapsed < T.request, "{elapsed:?}");
    // And a reset with the path passing: the pooled connections are dropped, not reused.
    proxy.reset_all();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered on a new connection");
    assert!(elapsed < T.request, "{elapsed:?}");
}

#[tokio::test]
async fn answers_slower_than_the_request_timeout_fail_retryably_and_pass_again_after() {
    let (proxy, store) = proxied_store("slow").await;
    warm(&store, 2).await;
    proxy.delay(T.request + Duration::from_millis(500));
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("delay: the call failed after {elapsed:?}");
    assert_retryable_failure(result, elapsed, T.operation());
    proxy.pass();
    let started = Instant::now();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered once the path is fast again");
    assert!(
        started.elapsed() <= T.connect + T.request + SLACK,
        "{elapsed:?}"
    );
}
