//! A live web page of one changefeed group: its hosts, its lease table with lag, an ownership
//! timeline of the last minutes and a feed of events. `changefeed console` serves it; a Rust
//! service can serve it beside its own endpoints with [`Console::start`].
//!
//! The console reads only the store (and the source, for lag): no agent runs on the hosts, so
//! it watches any fleet. One task refreshes a [`Watch`] every `refresh` and renders the API's
//! documents; the HTTP server ([`changefeed_http::serve`]) answers every request from the last
//! rendering, so any number of open pages cost the store nothing more. The page is one
//! self-contained document whose small script polls the API (`/api/hosts`, `/api/leases`,
//! `/api/events`, `/api/stats`, `/api/timeline.svg`); nothing is fetched from elsewhere.
//!
//! What it costs the store per refresh, from a store that keeps a membership view: the head
//! row (the change counter and the view); a `list_changes` when the counter moved (a row per
//! lease that changed hands); every heartbeat row only when the view's version moved, every
//! `heartbeats_every`, or while no fresh view is kept; a full list every `list_every` (for
//! checkpoints and lag, which do not move the counter). From a store without a view, every
//! heartbeat each refresh instead of the head.
//!
//! ```no_run
//! # async fn example(store: std::sync::Arc<dyn changefeed::lease::LeaseStore>) -> anyhow::Result<()> {
//! use std::time::Duration;
//! use changefeed::model::GroupName;
//! use changefeed_console::{Console, Settings};
//!
//! let stop = tokio_util::sync::CancellationToken::new();
//! let console = Console::start(
//!     store,
//!     None, // no source: no lag column
//!     GroupName::new("orders")?,
//!     Settings::default(),
//!     Duration::from_secs(2),
//!     "127.0.0.1:7070".parse()?,
//!     stop.clone(),
//! )
//! .await?;
//! println!("console at http://{}/", console.addr);
//! # Ok(()) }
//! ```

mod api;
pub mod draw;
mod events;
mod settings;
mod timeline;
mod watch;

use std::net::SocketAddr;
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

use changefeed_http::{body_as, only_get, text};
pub use settings::Settings;
pub use watch::Watch;

/// The page, served at `/`.
const PAGE: &str = include_str!("page.html");

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
            .with_context(|| format!("serving the console on {listen}"))?;
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
        tokio::spawn(changefeed_http::serve(listener, cancel, answer));
        Ok(Self {
            addr,
            group,
            published,
        })
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

/// One line on what `refreshes` refreshes cost the store.
pub fn cost_line(refreshes: u64, c: &StoreCounts) -> String {
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
            warn!(error = %changefeed::error::one_line(err.as_ref()), "console refresh failed; showing the last read");
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

/// The README's example, compiled as a doctest so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
