//! `changefeed console`: a live web page of one group: its hosts, its lease table with lag,
//! an ownership timeline of the last minutes and a feed of events.
//!
//! The console reads only the store (and the source, for lag): no agent runs on the hosts, so
//! it watches any fleet. One task refreshes a [`watch::Watch`] every `--refresh` and renders
//! the API's documents ([`api::Rendered`]); the HTTP server ([`crate::http::serve`]) answers
//! every request from the last rendering, so any number of open pages cost the store nothing
//! more. The page (`page.html`) is one self-contained document whose small script polls the
//! API; nothing is fetched from elsewhere.
//!
//! What it costs the store per refresh, from a store that keeps a membership view: the head
//! row (the change counter and the view); a `list_changes` when the counter moved (a row per
//! lease that changed hands); every heartbeat row only when the view's version moved, every
//! `--heartbeats-every`, or while no fresh view is kept; a full list every `--list-every`
//! (for checkpoints and lag, which do not move the counter). A host that does not lead reads
//! the same way each acquire cycle (`docs/operations.md` has the measured figures). From a
//! store without a view, every heartbeat each refresh instead of the head.

mod api;
mod events;
mod timeline;
mod watch;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::{LeaseStore, StoreCounts};
use changefeed::model::GroupName;
use changefeed::source::FeedSource;
use http_body_util::Full;
use hyper::{Method, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::{parse_duration, UsageError};
use crate::http::{body_as, only_get, text};
pub use watch::{Settings, Watch};

/// The page, served at `/`.
const PAGE: &str = include_str!("page.html");

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
        .await?;
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

/// What the last refresh rendered, and what the console's reads have cost the store.
#[derive(Debug, Default)]
struct Published {
    rendered: api::Rendered,
    refreshes: u64,
    cost: StoreCounts,
}

/// A running console: its refresh task and its server, until the token given to
/// [`Console::start`] is cancelled.
#[derive(Debug)]
pub struct Console {
    /// The address it serves.
    pub addr: SocketAddr,
    /// The group it watches.
    pub group: GroupName,
    published: Arc<Mutex<Arc<Published>>>,
}

impl Console {
    /// Reads the group once (failing if the store cannot be read), binds `listen`, and then
    /// refreshes every `refresh` and serves the page and the API until `cancel`.
    ///
    /// # Errors
    /// If the first read fails or `listen` cannot be bound (both named in the error).
    pub async fn start(
        store: Arc<dyn LeaseStore>,
        source: Option<Arc<dyn FeedSource>>,
        group: GroupName,
        settings: Settings,
        refresh: Duration,
        listen: SocketAddr,
        cancel: CancellationToken,
    ) -> anyhow::Result<Self> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let mut watch = Watch::new(store, source, group.clone(), settings, clock.clone());
        watch
            .refresh()
            .await
            .with_context(|| format!("reading group {group}"))?;
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("--listen: serving the console on {listen}"))?;
        let addr = listener.local_addr().context("reading the bound address")?;
        let published = Arc::new(Mutex::new(Arc::new(publish(&watch))));
        tokio::spawn(refresh_loop(
            watch,
            refresh,
            clock,
            published.clone(),
            cancel.clone(),
        ));
        let from = published.clone();
        let answer = move |method: &Method, path: &str| {
            let current = from.lock().unwrap_or_else(|p| p.into_inner()).clone();
            answer(&current, method, path)
        };
        tokio::spawn(crate::http::serve(listener, cancel, answer));
        Ok(Self {
            addr,
            group,
            published,
        })
    }

    /// The console of `changefeed demo --console`: the demo's SQLite file as store and source,
    /// hosts judged by the demo's timing settings (`lease_expiry` 3s, `safety_margin` 1s,
    /// `handoff_timeout` 3s), refreshed every second (the hosts' acquire interval), lag and
    /// heartbeat ages every 5 s, and the whole run in the timeline.
    ///
    /// # Errors
    /// As for [`Console::start`], and if the file cannot be opened.
    pub async fn start_demo(
        db: &std::path::Path,
        group: &GroupName,
        addr: SocketAddr,
        duration: Duration,
        stop: CancellationToken,
    ) -> anyhow::Result<Self> {
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
        Self::start(
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

    /// One line on what the console's reads cost the store so far, per refresh.
    pub fn cost_line(&self) -> String {
        let p = self
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        cost_line(p.refreshes, &p.cost)
    }
}

fn cost_line(refreshes: u64, c: &StoreCounts) -> String {
    let n = refreshes.max(1) as f64;
    format!(
        "console store cost: {refreshes} refreshes, {} reads ({:.2}/refresh), {} head rows ({:.2}/refresh), {} lease rows ({:.2}/refresh), {} heartbeat rows ({:.2}/refresh), {} full lists",
        c.reads,
        c.reads as f64 / n,
        c.head_rows_read,
        c.head_rows_read as f64 / n,
        c.lease_rows_read,
        c.lease_rows_read as f64 / n,
        c.heartbeat_rows_read,
        c.heartbeat_rows_read as f64 / n,
        c.lists
    )
}

fn publish(watch: &Watch) -> Published {
    Published {
        rendered: api::Rendered::of(watch),
        refreshes: watch.refreshes,
        cost: watch.cost(),
    }
}

async fn refresh_loop(
    mut watch: Watch,
    every: Duration,
    clock: Arc<dyn Clock>,
    published: Arc<Mutex<Arc<Published>>>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = clock.sleep(every) => {}
        }
        if let Err(err) = watch.refresh().await {
            warn!(error = %crate::error_text(&err), "console refresh failed; showing the last read");
        }
        let next = Arc::new(publish(&watch));
        *published.lock().unwrap_or_else(|p| p.into_inner()) = next;
    }
}

const JSON: &str = "application/json";

fn answer(p: &Published, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if let Some(refused) = only_get(method) {
        return refused;
    }
    let (body, content_type) = match path {
        "/" | "/index.html" => (PAGE.to_string(), "text/html; charset=utf-8"),
        "/api/hosts" => (p.rendered.hosts.clone(), JSON),
        "/api/leases" => (p.rendered.leases.clone(), JSON),
        "/api/events" => (p.rendered.events.clone(), JSON),
        "/api/stats" => (p.rendered.stats.clone(), JSON),
        "/api/timeline.svg" => (p.rendered.timeline.clone(), "image/svg+xml"),
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "not found: the console serves /, /api/hosts, /api/leases, /api/events, /api/stats and /api/timeline.svg\n".into(),
            )
        }
    };
    let mut response = body_as(StatusCode::OK, body, content_type);
    response.headers_mut().insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-store"),
    );
    response
}

#[cfg(test)]
mod tests;
