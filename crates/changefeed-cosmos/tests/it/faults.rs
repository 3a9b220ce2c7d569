//! Socket faults between the lease store and the local Cosmos DB server ([`FaultProxy`]):
//! every request ends within the client's stated timeouts (the crate docs' "Timeouts and
//! recovery") with a retryable error instead of hanging, and the store talks again as soon as
//! the path is back, never on a connection the fault left dead.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::time::{Duration, Instant};

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, HostName, Timestamp};
use changefeed::testkit::net::FaultProxy;
use changefeed::LeaseError;
use changefeed_cosmos::{
    CosmosLeaseStore, CosmosOptions, DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT,
    POOL_IDLE_TIMEOUT, REQUEST_ATTEMPTS,
};

use crate::{connect, endpoint, fresh_container};

const REQUEST: Duration = DEFAULT_REQUEST_TIMEOUT;
const CONNECT: Duration = DEFAULT_CONNECT_TIMEOUT;

/// The longest a read (a query, sent again once when an attempt gets no answer) may take:
/// every attempt, and the short wait between them.
fn read_bound() -> Duration {
    REQUEST * REQUEST_ATTEMPTS + Duration::from_millis(50)
}

/// Scheduling slack on a loaded 2-core machine, on top of every stated bound.
const SLACK: Duration = Duration::from_millis(750);

/// A store on a fresh container of the local server, reached through a new fault proxy.
async fn proxied_store(prefix: &str) -> (FaultProxy, CosmosLeaseStore) {
    let upstream = endpoint()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let proxy = FaultProxy::start(upstream).await.expect("fault proxy");
    let options = CosmosOptions::new(
        format!("http://{}", proxy.addr()),
        "changefeed-test",
        fresh_container(prefix),
    );
    (proxy, connect(&options).await)
}

fn group() -> GroupName {
    GroupName::new("g").expect("group")
}

/// One read of the store (a query), timed.
async fn timed_list(store: &CosmosLeaseStore) -> (Result<(), LeaseError>, Duration) {
    let started = Instant::now();
    let result = store.list(&group()).await.map(|_| ());
    (result, started.elapsed())
}

/// `n` reads at once, so that the pool holds up to `n` idle connections afterwards.
async fn warm(store: &CosmosLeaseStore, n: usize) {
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
        "the request failed after {elapsed:?}, past the stated {within:?}: {err}"
    );
}

#[tokio::test]
async fn a_request_into_a_black_hole_fails_retryably_within_the_request_timeout() {
    let (proxy, store) = proxied_store("bh").await;
    warm(&store, 3).await;
    let host = HostName::new("h1").expect("host");
    let hb = store
        .heartbeat(
            &group(),
            &host,
            "i1",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("a heartbeat through the passing proxy");
    proxy.black_hole();
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("black hole: a read failed after {elapsed:?}");
    assert!(elapsed >= REQUEST, "{elapsed:?}");
    assert_retryable_failure(result, elapsed, read_bound());
    // A heartbeat (a PUT with If-Match, sent again once) too.
    let started = Instant::now();
    let result = store
        .heartbeat(
            &group(),
            &host,
            "i1",
            Timestamp(2),
            Some(hb.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .map(|_| ());
    let elapsed = started.elapsed();
    eprintln!("black hole: a heartbeat failed after {elapsed:?}");
    assert_retryable_failure(result, elapsed, read_bound());
    proxy.pass();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("the path is back");
    assert!(elapsed <= CONNECT + REQUEST + SLACK, "{elapsed:?}");
}

#[tokio::test]
async fn after_a_black_hole_that_forgot_every_flow_the_next_request_succeeds_on_a_new_connection_at_once(
) {
    // The fault outlasts the pool's idle timeout: every pooled connection (dead for ever behind
    // the proxy) has expired, so the first request after the path is back opens a new
    // connection and is answered on its first attempt.
    let (proxy, store) = proxied_store("forget").await;
    warm(&store, 4).await;
    let fault = Instant::now();
    proxy.black_hole();
    let (result, elapsed) = timed_list(&store).await;
    assert_retryable_failure(result, elapsed, read_bound());
    tokio::time::sleep(
        (POOL_IDLE_TIMEOUT + Duration::from_millis(200)).saturating_sub(fault.elapsed()),
    )
    .await;
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("forgotten flows: the first request after the fault took {elapsed:?}");
    result.expect("the path is back");
    assert!(
        elapsed < REQUEST,
        "answered on a first attempt (no dead connection tried): {elapsed:?}"
    );
}

#[tokio::test]
async fn a_request_after_a_short_fault_that_forgot_every_flow_is_answered_within_the_read_bound() {
    // A fault shorter than the pool's idle timeout, after which the path forgets the old
    // flows. A pooled connection would look open but be dead: the request's first attempt on
    // it would time out after `request` and the second, on a new connection, be answered. (The
    // local server answers `connection: close` to every request, so its connections are never
    // pooled, and the first attempt is answered: the bound holds either way.)
    let (proxy, store) = proxied_store("short").await;
    warm(&store, 1).await;
    proxy.black_hole();
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.pass_forgetting_held();
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("after a short fault that forgot every flow: the read took {elapsed:?}");
    result.expect("answered");
    assert!(elapsed <= read_bound() + SLACK, "{elapsed:?}");
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered");
    assert!(
        elapsed < REQUEST,
        "no dead connection is pooled: {elapsed:?}"
    );
}

#[tokio::test]
async fn after_every_connection_is_reset_the_store_answers_on_new_connections() {
    // A server restart as the client sees it, during a black hole: the read in flight fails
    // at once (retryable) or is sent again and answered; the next one is answered at once.
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
    let (result, _) = in_flight.await.expect("the read's task");
    let after = healed.elapsed();
    eprintln!("reset: the read in flight ended {after:?} after the reset: {result:?}");
    if let Err(err) = &result {
        assert!(err.is_retryable(), "{err}");
    }
    assert!(after <= CONNECT + REQUEST + SLACK, "{after:?}");
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered");
    assert!(elapsed < REQUEST, "{elapsed:?}");
    proxy.reset_all();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered on a new connection");
    assert!(elapsed < REQUEST, "{elapsed:?}");
}

#[tokio::test]
async fn answers_slower_than_the_request_timeout_fail_retryably_and_pass_again_after() {
    let (proxy, store) = proxied_store("slow").await;
    warm(&store, 2).await;
    proxy.delay(REQUEST + Duration::from_millis(500));
    let (result, elapsed) = timed_list(&store).await;
    eprintln!("delay: the read failed after {elapsed:?}");
    assert_retryable_failure(result, elapsed, read_bound());
    proxy.pass();
    let (result, elapsed) = timed_list(&store).await;
    result.expect("answered once the path is fast again");
    assert!(elapsed <= CONNECT + REQUEST + SLACK, "{elapsed:?}");
}
