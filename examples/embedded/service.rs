//! The service of `examples/embedded.rs`, a function so that its test can run it in-process.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use changefeed::model::GroupName;
use changefeed::processor::{Processor, Settings};
use changefeed_console::Console;
use changefeed_exec::batch::CommandHandler;
use changefeed_exec::groups::{ProcessGroups, KILL_GRACE};
use changefeed_http::Endpoints;
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

/// Where a running service can be reached.
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    /// `/healthz`, `/readyz` and `/metrics`.
    pub http: SocketAddr,
    /// The console's page and API.
    pub console: SocketAddr,
}

/// Runs one host of group `orders` over the SQLite file `db` (its leases and its feed), each
/// batch piped to `sh -c command` as JSON lines, until `stop`; serves its health and metrics on
/// `http` and the group's console on `console` (port 0: any free port), and tells `started`
/// where once both are bound.
pub async fn run(
    db: &Path,
    command: &str,
    metrics: PrometheusHandle,
    http: SocketAddr,
    console: SocketAddr,
    started: tokio::sync::oneshot::Sender<Addresses>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let group = GroupName::new("orders")?;
    let store = Arc::new(SqliteLeaseStore::open(db).await?);
    let source = Arc::new(SqliteFeed::open(db).await?);
    let settings = Settings::default();

    let endpoints = Endpoints::new(metrics);
    let http = endpoints.serve(&[http], stop.clone()).await?;
    let console = Console::start(
        store.clone(),
        Some(source.clone()),
        group.clone(),
        changefeed_console::Settings::for_fleet(&settings),
        std::time::Duration::from_secs(1),
        console,
        stop.clone(),
    )
    .await?;

    let groups = ProcessGroups::default();
    let handler = CommandHandler::new(command.into(), group.to_string(), groups.clone());
    let processor = Processor::builder()
        .host("embedded-1")
        .group(group)
        .store(store)
        .source(source)
        .shared_handler(Arc::new(handler))
        .settings(settings)
        .build()?;
    endpoints.ready_from(processor.health_probe());
    let _ = started.send(Addresses {
        http: http.first().copied().unwrap_or(console.addr),
        console: console.addr,
    });
    let outcome = processor.run(stop).await;
    // Every call has ended: give what the commands left running the kill grace, then SIGKILL.
    groups
        .finish(tokio::time::Instant::now() + KILL_GRACE)
        .await;
    Ok(outcome?)
}
