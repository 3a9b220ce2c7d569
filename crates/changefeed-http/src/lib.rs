//! A changefeed host's HTTP endpoints, for Prometheus and an orchestrator's probes:
//!
//! - `GET /metrics`: every metric of the recorder handle it is given, in Prometheus's text
//!   format (the library's are listed in `docs/metrics.md`);
//! - `GET /healthz`: `200 ok` while the process is alive and the host healthy; `503` once the
//!   host has stayed fenced or unregistered for longer than `max_unhealthy` (its recovery has
//!   failed: [`changefeed::processor::Health::unhealthy`]), the body one line saying why and
//!   since when, e.g. `unhealthy: fenced: no successful heartbeat since
//!   2024-05-01T11:59:52.000Z; fenced or unregistered for 38.1s, longer than max_unhealthy
//!   (30s)`. A liveness probe: restart the process on it;
//! - `GET /readyz`: `200` while the host is ready (registered, heartbeat fresh, not fenced,
//!   not stopping: [`changefeed::processor::Health::is_ready`]), `503` otherwise; the body is
//!   one line saying which, e.g. `not ready: fenced: last successful heartbeat 4.1s ago`.
//!
//! What readiness and health mean is the library's ([`changefeed::processor::Health`]); this
//! crate owns the listeners, the connections and the recorder's upkeep, and installs nothing
//! global: the service installs its own recorder and hands over its handle. Until the
//! processor exists (its store still being opened, say) `/readyz` answers `503 not ready:
//! starting` and `/healthz` `200 ok`. Each connection is HTTP/1.1 (hyper), with a 10 s limit on
//! reading a request's headers.
//!
//! A service with an HTTP server of its own mounts [`Endpoints::answer`] under its routes
//! instead of calling [`Endpoints::serve`].
//!
//! ```no_run
//! # async fn example(processor: changefeed::processor::Processor) -> Result<(), Box<dyn std::error::Error>> {
//! use metrics_exporter_prometheus::PrometheusBuilder;
//! use tokio_util::sync::CancellationToken;
//!
//! let recorder = PrometheusBuilder::new().install_recorder()?;
//! changefeed::processor::describe_metrics();
//! let stop = CancellationToken::new();
//! let endpoints = changefeed_http::Endpoints::new(recorder);
//! endpoints.serve(&["127.0.0.1:9100".parse()?], stop.clone()).await?;
//! endpoints.ready_from(processor.health_probe());
//! processor.run(stop).await?;
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use changefeed::processor::HealthProbe;
use http_body_util::Full;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// How often the Prometheus recorder's histograms are drained (its own default).
const UPKEEP: Duration = Duration::from_secs(5);

/// Longest a client may take to send a request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The Prometheus text format's content type.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What every connection answers from.
#[derive(Debug)]
struct State {
    metrics: PrometheusHandle,
    /// Set once the processor is built.
    probe: OnceLock<HealthProbe>,
}

/// An address that could not be served.
#[derive(Debug, thiserror::Error)]
#[error("serving HTTP on {addr}: {source}")]
pub struct BindError {
    /// The address.
    pub addr: SocketAddr,
    /// Why binding it failed.
    #[source]
    pub source: std::io::Error,
}

/// `/metrics`, `/healthz` and `/readyz` of one host: tell them the processor's health with
/// [`Endpoints::ready_from`]; serve them with [`Endpoints::serve`] or mount
/// [`Endpoints::answer`] in a server of your own. Clones share the same state.
#[derive(Debug, Clone)]
pub struct Endpoints {
    state: Arc<State>,
}

impl Endpoints {
    /// Endpoints rendering `/metrics` from `metrics`, the handle of a Prometheus recorder the
    /// caller installed (or built).
    #[must_use]
    pub fn new(metrics: PrometheusHandle) -> Self {
        Self {
            state: Arc::new(State {
                metrics,
                probe: OnceLock::new(),
            }),
        }
    }

    /// Binds every address in `addrs` and serves the endpoints on each, and runs the
    /// recorder's upkeep (draining its histograms every 5 s), until `cancel` is cancelled.
    /// Returns the bound addresses (port 0 binds any free port) once every address is bound;
    /// must be called inside a tokio runtime.
    ///
    /// # Errors
    /// If an address cannot be bound (named in the error); then nothing is served.
    pub async fn serve(
        &self,
        addrs: &[SocketAddr],
        cancel: CancellationToken,
    ) -> Result<Vec<SocketAddr>, BindError> {
        let mut listeners = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let listener = TcpListener::bind(addr).await.map_err(|source| BindError {
                addr: *addr,
                source,
            })?;
            listeners.push(listener);
        }
        let mut bound = Vec::with_capacity(listeners.len());
        for listener in listeners {
            if let Ok(addr) = listener.local_addr() {
                info!(%addr, "serving /metrics, /healthz and /readyz");
                bound.push(addr);
            }
            let endpoints = self.clone();
            let answer = move |method: &Method, path: &str| endpoints.answer(method, path);
            tokio::spawn(serve(listener, cancel.clone(), answer));
        }
        let metrics = self.state.metrics.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(UPKEEP) => metrics.run_upkeep(),
                }
            }
        });
        Ok(bound)
    }

    /// From now on `/readyz` and `/healthz` answer from `probe`.
    pub fn ready_from(&self, probe: HealthProbe) {
        // Set once, right after the processor is built; a second call would change nothing.
        let _ = self.state.probe.set(probe);
    }

    /// The response to `method path`: `405` for methods other than `GET` and `HEAD`, `404`
    /// for paths other than the three.
    #[must_use]
    pub fn answer(&self, method: &Method, path: &str) -> Response<Full<Bytes>> {
        answer(&self.state, method, path)
    }
}

/// Accepts connections on `listener` until `cancel`, each served on a task of its own and
/// answered by `answer(method, path)` (a web console serves its pages through this too).
pub async fn serve<F>(listener: TcpListener, cancel: CancellationToken, answer: F)
where
    F: Fn(&Method, &str) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    loop {
        let stream = tokio::select! {
            _ = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    warn!(error = %err, "accepting an HTTP connection failed");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            },
        };
        let answer = answer.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let response = answer(req.method(), req.uri().path());
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = cancel.cancelled() => {}
                result = connection => {
                    if let Err(err) = result {
                        debug!(error = %err, "HTTP connection ended with an error");
                    }
                }
            }
        });
    }
}

/// `405` for anything but `GET` and `HEAD` (the only methods served), `None` for those.
pub fn only_get(method: &Method) -> Option<Response<Full<Bytes>>> {
    if method == Method::GET || method == Method::HEAD {
        return None;
    }
    let mut response = text(
        StatusCode::METHOD_NOT_ALLOWED,
        "only GET and HEAD are served\n".into(),
    );
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    Some(response)
}

/// The response to `method path` from `state`.
fn answer(state: &State, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if let Some(refused) = only_get(method) {
        return refused;
    }
    match path {
        "/metrics" => {
            let mut response = Response::new(Full::new(Bytes::from(state.metrics.render())));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(PROMETHEUS_TEXT));
            response
        }
        "/healthz" => match state.probe.get().and_then(|p| p.health().unhealthy) {
            Some(unhealthy) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{unhealthy}\n")),
            None => text(StatusCode::OK, "ok\n".into()),
        },
        "/readyz" => {
            let (ready, line) = match state.probe.get().map(HealthProbe::health) {
                Some(health) => (health.is_ready(), health.to_string()),
                None => (false, "not ready: starting".to_string()),
            };
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            text(status, format!("{line}\n"))
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: the endpoints are /metrics, /healthz and /readyz\n".into(),
        ),
    }
}

/// A plain-text response.
pub fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    body_as(status, body, "text/plain; charset=utf-8")
}

/// A response of `content_type`.
pub fn body_as(
    status: StatusCode,
    body: String,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;
    use metrics_exporter_prometheus::PrometheusBuilder;

    fn state() -> State {
        State {
            metrics: PrometheusBuilder::new().build_recorder().handle(),
            probe: OnceLock::new(),
        }
    }

    /// A response's body as text.
    async fn body(response: Response<Full<Bytes>>) -> String {
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("a full body cannot fail")
            .to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    #[tokio::test]
    async fn endpoints_answer_by_path_and_method() {
        // The routes: a live process is healthy; it is not ready before the processor exists;
        // other paths are 404 and other methods 405.
        let state = state();
        let healthz = answer(&state, &Method::GET, "/healthz");
        assert_eq!(healthz.status(), StatusCode::OK);
        assert_eq!(body(healthz).await, "ok\n");
        let readyz = answer(&state, &Method::GET, "/readyz");
        assert_eq!(readyz.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body(readyz).await, "not ready: starting\n");
        let metrics = answer(&state, &Method::GET, "/metrics");
        assert_eq!(metrics.status(), StatusCode::OK);
        assert_eq!(
            metrics.headers().get(CONTENT_TYPE),
            Some(&HeaderValue::from_static(PROMETHEUS_TEXT))
        );
        assert_eq!(
            answer(&state, &Method::GET, "/").status(),
            StatusCode::NOT_FOUND
        );
        let post = answer(&state, &Method::POST, "/readyz");
        assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            post.headers().get(ALLOW),
            Some(&HeaderValue::from_static("GET, HEAD"))
        );
    }
}

/// The README's example, compiled as a doctest so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
