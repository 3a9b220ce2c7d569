//! A small service that embeds a changefeed host with the capabilities the `changefeed` binary
//! is made of: each batch piped to a shell command (`changefeed-exec`), `/healthz`, `/readyz`
//! and `/metrics` (`changefeed-http`), and the group's web console (`changefeed-console`).
//!
//! ```text
//! cargo run -p changefeed-examples --example embedded -- orders.db 'cat >> orders.jsonl'
//! ```
//!
//! Feed it with `changefeed feed --db orders.db append …`; stop it with Ctrl-C.

#[path = "embedded/service.rs"]
mod service;

use std::path::PathBuf;

use metrics_exporter_prometheus::PrometheusBuilder;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let db = args.next().map_or_else(
        || std::env::temp_dir().join("changefeed-embedded.db"),
        PathBuf::from,
    );
    let command = args.next().unwrap_or_else(|| "cat".into());
    // The service's own recorder: the library installs none.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    changefeed::processor::describe_metrics();
    let stop = CancellationToken::new();
    let (started, addresses) = tokio::sync::oneshot::channel();
    let service = tokio::spawn({
        let stop = stop.clone();
        async move {
            service::run(
                &db,
                &command,
                metrics,
                "127.0.0.1:9100".parse()?,
                "127.0.0.1:7070".parse()?,
                started,
                stop,
            )
            .await
        }
    });
    if let Ok(at) = addresses.await {
        println!(
            "health and metrics at http://{}/, console at http://{}/",
            at.http, at.console
        );
    }
    tokio::select! {
        _ = tokio::signal::ctrl_c() => stop.cancel(),
        _ = stop.cancelled() => {}
    }
    service.await?
}
