//! The service of `examples/embedded.rs`, run in-process on a real SQLite file: its command
//! gets every record, its endpoints and console answer over real HTTP, and it stops when told.

// A failed unwrap in a test is a failed test with its cause: that is what we want here.
#![allow(clippy::unwrap_used)]

#[path = "../embedded/service.rs"]
mod service;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use changefeed_sqlite::SqliteFeed;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long anything here may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(30);

/// `GET path` on `addr`: the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// Waits until `done` answers `Some`, trying again every 50 ms, for at most [`DEADLINE`].
async fn until<T, F, Fut>(what: &str, mut done: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = done().await {
            return value;
        }
        assert!(Instant::now() < deadline, "waited {DEADLINE:?} for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_host_pipes_every_record_to_its_command_and_serves_health_metrics_and_console()
{
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("orders.db");
    let out = dir.path().join("out.jsonl");
    let feed = SqliteFeed::open(&db).await.unwrap();
    feed.create_partitions(4).await.unwrap();
    let mut written = BTreeSet::new();
    for i in 0..40 {
        let data = format!("order {i}");
        feed.append(&format!("customer-{}", i % 7), data.clone())
            .await
            .unwrap();
        written.insert(data);
    }
    let metrics = PrometheusBuilder::new().install_recorder().unwrap();
    changefeed::processor::describe_metrics();
    let stop = CancellationToken::new();
    let (started, addresses) = tokio::sync::oneshot::channel();
    let any_port: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let command = format!("cat >> '{}'", out.display());
    let service = tokio::spawn({
        let stop = stop.clone();
        async move { service::run(&db, &command, metrics, any_port, any_port, started, stop).await }
    });
    let at = tokio::time::timeout(DEADLINE, addresses)
        .await
        .expect("the service binds its addresses")
        .expect("the service started");

    // Every record reaches the command, once.
    let delivered = until("every record in the command's output", || async {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["data"].as_str().unwrap().to_string()
            })
            .collect();
        (lines.len() >= written.len()).then_some(lines)
    })
    .await;
    assert_eq!(delivered.len(), written.len(), "no record twice");
    assert_eq!(delivered.into_iter().collect::<BTreeSet<_>>(), written);

    // The endpoints answer from the running processor.
    until("/readyz to say ready", || async {
        (get(at.http, "/readyz").await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(get(at.http, "/healthz").await, (200, "ok\n".into()));
    let (status, scrape) = get(at.http, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        scrape.contains("changefeed_records_total"),
        "the library's metrics in the scrape:\n{scrape}"
    );

    // The console sees this host own every lease.
    until(
        "the console to show the host owning all four leases",
        || async {
            let (status, body) = get(at.console, "/api/leases").await;
            assert_eq!(status, 200);
            (body.matches("\"embedded-1\"").count() >= 4).then_some(())
        },
    )
    .await;

    stop.cancel();
    tokio::time::timeout(DEADLINE, service)
        .await
        .expect("the service stops when told")
        .unwrap()
        .expect("a graceful stop");
}
