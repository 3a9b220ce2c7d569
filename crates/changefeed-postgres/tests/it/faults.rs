//! Faults below the client, injected at the socket with a proxy between the store and the
//! server: a black hole (nothing answered, nothing closed), flows that stay dead after the path
//! is back, resets, refusals and a slow server. The store must fail such calls within its
//! timeouts and serve again as soon as the path is back: a connection whose call hung or was
//! given up on is never handed out again.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::time::Duration;

use changefeed::model::{GroupName, HostName, Timestamp};
use changefeed::testkit::net::FaultProxy;
use changefeed_postgres::{PgOptions, PostgresLeaseStore};
use tokio::time::Instant;

use crate::common::url;

/// `url()` through `proxy`, and the proxy itself (forwarding to the server).
async fn proxied() -> (FaultProxy, String) {
    let url = url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h.to_string()),
        None => (String::new(), authority.to_string()),
    };
    let upstream = if hostport.contains(':') {
        hostport
    } else {
        format!("{hostport}:5432")
    };
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let via = format!("{scheme}://{user}127.0.0.1:{}{tail}", proxy.port());
    (proxy, via)
}

fn prefix(tag: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 10_000_000_000;
    format!("{tag}{ms}p{}", std::process::id())
}

struct Fixture {
    proxy: FaultProxy,
    store: PostgresLeaseStore,
    group: GroupName,
    host: HostName,
}

const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

async fn fixture(tag: &str) -> Fixture {
    let (proxy, via) = proxied().await;
    let store = PostgresLeaseStore::connect_with(
        PgOptions::new(via)
            .prefix(prefix(tag))
            .statement_timeout(Duration::from_millis(1500))
            .client_timeout(CLIENT_TIMEOUT)
            .pool_size(4),
    )
    .await
    .unwrap();
    Fixture {
        proxy,
        store,
        group: GroupName::new("g").unwrap(),
        host: HostName::new("h").unwrap(),
    }
}

impl Fixture {
    /// One heartbeat write, given up on after `within` as the processor's heartbeat does.
    async fn beat(&self, within: Duration) -> Option<bool> {
        let call = self.store.heartbeat(
            &self.group,
            &self.host,
            "i",
            Timestamp(0),
            None,
            HeartbeatRole::Member,
            None,
        );
        tokio::time::timeout(within, call)
            .await
            .ok()
            .map(|r| r.is_ok())
    }

    /// Fills the pool: `n` calls at once, all answered.
    async fn warm(&self, n: usize) {
        let calls = (0..n).map(|_| self.store.membership(&self.group));
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
    }

    /// Calls until one succeeds (each given up on after `within`); how long that took.
    async fn until_served(&self, within: Duration, limit: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if self.beat(within).await == Some(true) {
                return started.elapsed();
            }
            assert!(started.elapsed() < limit, "not served within {limit:?}");
        }
    }
}

// A call into a black hole fails within the client timeout instead of hanging.
#[tokio::test]
async fn a_call_into_a_black_hole_fails_within_the_client_timeout() {
    let f = fixture("fbh").await;
    f.warm(2).await;
    f.proxy.black_hole();
    let started = Instant::now();
    let r = f.store.membership(&f.group).await;
    let took = started.elapsed();
    let err = r.expect_err("no answer through a black hole");
    assert!(err.is_retryable(), "{err}");
    assert!(
        took < CLIENT_TIMEOUT + Duration::from_millis(500),
        "took {took:?}"
    );
}

// Connections that lived through a black hole stay dead after it; calls given up on by their
// caller must not leave them in the pool, or every later call hangs on one (the host stalls
// for ever with its path healthy).
#[tokio::test]
async fn after_a_black_hole_whose_flows_stay_dead_the_next_call_is_served() {
    let f = fixture("ffg").await;
    f.warm(4).await;
    f.proxy.black_hole();
    // Callers give up after 300 ms, well inside the client timeout, as a heartbeat does.
    for _ in 0..8 {
        assert_eq!(f.beat(Duration::from_millis(300)).await, None);
    }
    f.proxy.pass_forgetting_held();
    let took = f
        .until_served(Duration::from_millis(300), Duration::from_secs(3))
        .await;
    assert!(took < Duration::from_secs(1), "served again after {took:?}");
}

// A server restart as the client sees it: every connection reset, new ones refused a moment.
#[tokio::test]
async fn after_every_connection_is_reset_the_next_call_is_served() {
    let f = fixture("frs").await;
    f.warm(4).await;
    f.proxy.refuse();
    f.proxy.reset_all();
    assert_eq!(f.beat(Duration::from_millis(500)).await, Some(false));
    f.proxy.pass();
    let took = f
        .until_served(Duration::from_millis(500), Duration::from_secs(3))
        .await;
    assert!(took < Duration::from_secs(1), "served again after {took:?}");
}

// A server slower than the client timeout: calls fail in time, and are served once it is not.
#[tokio::test]
async fn a_slow_server_fails_calls_in_time_and_serves_once_fast_again() {
    let f = fixture("fsl").await;
    f.warm(2).await;
    f.proxy.delay(CLIENT_TIMEOUT * 2);
    let started = Instant::now();
    let err = f.store.membership(&f.group).await.expect_err("too slow");
    assert!(err.is_retryable(), "{err}");
    assert!(started.elapsed() < CLIENT_TIMEOUT + Duration::from_millis(500));
    f.proxy.pass();
    let took = f
        .until_served(Duration::from_millis(500), Duration::from_secs(3))
        .await;
    assert!(took < Duration::from_secs(1), "served again after {took:?}");
}

// As a host uses the store: workers' calls run to the client timeout while the heartbeat
// gives up on its calls early; once the path is back (old flows dead), calls are served.
#[tokio::test]
async fn concurrent_callers_through_a_black_hole_are_served_once_it_ends() {
    let f = fixture("fcc").await;
    f.warm(4).await;
    f.proxy.black_hole();
    let store = std::sync::Arc::new(f.store.clone());
    let mut long = Vec::new();
    for _ in 0..8 {
        let store = std::sync::Arc::clone(&store);
        let group = f.group.clone();
        long.push(tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(8);
            while Instant::now() < until {
                let _ = store.membership(&group).await;
            }
        }));
    }
    for _ in 0..10 {
        assert_eq!(f.beat(Duration::from_millis(300)).await, None);
    }
    f.proxy.pass_forgetting_held();
    // Callers on connections opened into the black hole hold their pool slots until the
    // client timeout at most; after that every call gets a fresh connection.
    let took = f
        .until_served(Duration::from_millis(300), Duration::from_secs(10))
        .await;
    assert!(
        took < CLIENT_TIMEOUT + Duration::from_secs(1),
        "served again after {took:?}"
    );
    for t in long {
        t.await.unwrap();
    }
}
