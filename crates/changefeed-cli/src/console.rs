//! `changefeed console`: serves the web page of one group ([`changefeed_console`]) until
//! SIGINT or SIGTERM, judging hosts by the fleet's timing settings given as flags.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use std::sync::Arc;

use changefeed::model::GroupName;
use changefeed::source::FeedSource;
use changefeed_console::{Console, Settings};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::usage::{parse_duration, UsageError};

/// Arguments of `changefeed console`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    target: crate::ops::Target,
    /// The feed source, to show each lease's lag in records and in seconds.
    #[arg(long, value_name = "URL", env = "CHANGEFEED_SOURCE")]
    source: Option<String>,
    /// Where to serve the page (port 0: any free port; the address is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// How often the store is read.
    #[arg(long, value_name = "DURATION", default_value = "2s")]
    refresh: String,
    /// How often the whole lease table is read, for checkpoints and lag.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    list_every: String,
    /// With a membership view, how often every heartbeat row is read for the heartbeat ages
    /// shown (they are read too whenever the view's version moves, and every refresh while no
    /// leader keeps the view fresh).
    #[arg(long, value_name = "DURATION", default_value = "20s")]
    heartbeats_every: String,
    /// The fleet's lease expiry: a host whose heartbeat stands still this long is expired.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    lease_expiry: String,
    /// The fleet's safety margin: a host whose heartbeat stands still for lease_expiry minus
    /// this has fenced itself.
    #[arg(long, value_name = "DURATION", default_value = "2s")]
    safety_margin: String,
    /// The fleet's hand-off timeout: an owner change after a request pending this long is a
    /// steal.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    handoff_timeout: String,
    /// How much history the timeline shows.
    #[arg(long, value_name = "DURATION", default_value = "5m")]
    window: String,
}

impl Args {
    fn settings(&self) -> Result<(Settings, Duration), UsageError> {
        let refresh = parse_duration("--refresh", &self.refresh)?;
        let lease_expiry = parse_duration("--lease-expiry", &self.lease_expiry)?;
        let safety_margin = parse_duration("--safety-margin", &self.safety_margin)?;
        if refresh.is_zero() {
            return Err(UsageError("--refresh: must be more than 0".into()));
        }
        if safety_margin >= lease_expiry {
            return Err(UsageError(format!(
                "--safety-margin ({}) must be below --lease-expiry ({})",
                self.safety_margin, self.lease_expiry
            )));
        }
        let settings = Settings {
            list_every: parse_duration("--list-every", &self.list_every)?,
            heartbeats_every: parse_duration("--heartbeats-every", &self.heartbeats_every)?,
            fence_after: lease_expiry - safety_margin,
            expire_after: lease_expiry,
            handoff_timeout: parse_duration("--handoff-timeout", &self.handoff_timeout)?,
            window: parse_duration("--window", &self.window)?.max(Duration::from_secs(10)),
        };
        Ok((settings, refresh))
    }
}

/// `changefeed console`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    crate::ops::block_on(async move {
        let (settings, refresh) = args.settings().map_err(anyhow::Error::new)?;
        let (store, group) = args.target.open().await?;
        let source = match &args.source {
            Some(url) => Some(crate::ops::open_source(url).await?),
            None => None,
        };
        let cancel = CancellationToken::new();
        let console = Console::start(
            store,
            source,
            group,
            settings,
            refresh,
            args.listen,
            cancel.clone(),
        )
        .await
        .context("--listen")?;
        println!(
            "serving the console of group {} at http://{}/",
            console.group, console.addr
        );
        stop_on_signal().await;
        cancel.cancel();
        Ok(ExitCode::SUCCESS)
    })
}

/// Waits for SIGTERM or SIGINT.
async fn stop_on_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            warn!("cannot listen for SIGTERM; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The console of `changefeed demo --console`: the demo's SQLite file as store and source,
/// hosts judged by the demo's timing settings (`lease_expiry` 3s, `safety_margin` 1s,
/// `handoff_timeout` 3s), refreshed every second (the hosts' acquire interval), lag and
/// heartbeat ages every 5 s, and the whole run in the timeline.
///
/// # Errors
/// As for [`Console::start`], and if the file cannot be opened.
pub(crate) async fn start_demo(
    db: &std::path::Path,
    group: &GroupName,
    addr: SocketAddr,
    duration: Duration,
    stop: CancellationToken,
) -> anyhow::Result<Console> {
    let settings = Settings {
        list_every: Duration::from_secs(5),
        heartbeats_every: Duration::from_secs(5),
        fence_after: Duration::from_secs(2),
        expire_after: Duration::from_secs(3),
        handoff_timeout: Duration::from_secs(3),
        window: (duration + Duration::from_secs(30)).max(Duration::from_secs(60)),
    };
    let store = changefeed_sqlite::SqliteLeaseStore::open(db).await?;
    let source = changefeed_sqlite::SqliteFeed::open(db).await?;
    let refresh = Duration::from_secs(1);
    let source: Arc<dyn FeedSource> = Arc::new(source);
    Console::start(
        Arc::new(store),
        Some(source),
        group.clone(),
        settings,
        refresh,
        addr,
        stop,
    )
    .await
}
