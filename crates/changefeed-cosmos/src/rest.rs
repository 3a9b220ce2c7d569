//! The Cosmos DB REST API, as much of it as the lease store uses: point reads and writes of
//! documents with `If-Match`, SQL queries with continuation paging, transactional batches, and
//! creating the database and container. Requests are signed with the account's master key.
//!
//! This module owns HTTP and authorization; what the documents hold is `doc`'s, and what the
//! operations mean is the store's.
//!
//! # Bounded waits
//!
//! Every wait is bounded ([`Timeouts`]; the crate docs, "Timeouts and recovery", give the
//! defaults): connecting (TCP) by `connect`, one attempt of a request (connecting, TLS, sending
//! and reading the whole answer) by `request`; a request that is safe to send again (a read, a
//! query, a `PUT` conditioned on an ETag) gets `attempts` attempts when one fails without an
//! answer (times out, or its connection fails).
//!
//! No connection outlives a request that failed or was cancelled. The HTTP client is
//! hyper-util's legacy client over HTTP/1.1. When an attempt times out (or its caller drops
//! it), its `Pooled` connection is dropped with the request in flight: in hyper-util 0.1.21
//! (`client/legacy/pool.rs`, `impl Drop for Pooled`) a connection goes back to the pool only if
//! it `is_open()`, which for HTTP/1 is hyper's `SendRequest::is_ready()`, true only while the
//! connection's dispatcher waits for a *new* request; with one in flight it is not, so the
//! connection is never handed out again, and hyper 1.12's dispatcher closes it once the
//! request's caller is gone (`proto/h1/dispatch.rs`, `poll_read_head`: "dispatch no longer
//! receiving messages"). A connection the server or a middlebox reset is dropped from the pool
//! when next checked out, and a request not yet written on such a reused connection is sent
//! again on a new one by hyper-util itself. What no client can see is an idle pooled
//! connection whose flow a NAT or load balancer forgot during a fault (its packets dropped for
//! ever): such connections are closed after `pool_idle` idle, and TCP keepalive (probes after
//! `keepalive` idle) finds them dead on a real network.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use changefeed::clock::Clock;
use hmac::{KeyInit, Mac};
use http::{HeaderMap, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use serde_json::Value;

use crate::error::CosmosError;

/// The REST API version sent as `x-ms-version` (transactional batches need 2018-12-31 or later).
pub const API_VERSION: &str = "2018-12-31";

/// Characters escaped in a URL path segment (database, container and document ids).
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'\\')
    .add(b'^')
    .add(b'|');

/// Requests and request units a handle has spent, as Cosmos DB reported them
/// (`x-ms-request-charge`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// HTTP requests sent (a batch is one).
    pub requests: u64,
    /// Request units charged.
    pub request_units: f64,
}

/// An answer from Cosmos DB.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// `VERB resource-link`, for error messages.
    pub request: String,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Result<Value, CosmosError> {
        serde_json::from_slice(&self.body).map_err(|e| CosmosError::Unexpected {
            request: self.request.clone(),
            reason: format!("the body is not JSON ({e}): {}", lossy(&self.body)),
        })
    }

    /// The answer as an error (for a status the caller does not handle).
    pub fn into_error(self) -> CosmosError {
        let substatus = self
            .headers
            .get("x-ms-substatus")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let message = serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| lossy(&self.body));
        CosmosError::Status {
            request: self.request,
            status: self.status,
            substatus,
            message,
        }
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

fn lossy(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut text = text.trim().to_string();
    if text.len() > 300 {
        let mut end = 300;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    if text.is_empty() {
        "(empty body)".into()
    } else {
        text
    }
}

/// One operation of a transactional batch.
#[derive(Debug, Clone)]
pub(crate) enum BatchOp {
    Create(Value),
    Replace {
        id: String,
        body: Value,
        if_match: String,
    },
    Delete {
        id: String,
        if_match: String,
    },
}

impl BatchOp {
    fn to_json(&self, partition_key: &str) -> Value {
        let mut op = serde_json::Map::new();
        // The partition key of each operation, as the header carries it (a JSON array).
        op.insert(
            "partitionKey".into(),
            Value::String(Value::Array(vec![Value::String(partition_key.into())]).to_string()),
        );
        match self {
            BatchOp::Create(body) => {
                op.insert("operationType".into(), "Create".into());
                op.insert("resourceBody".into(), body.clone());
            }
            BatchOp::Replace { id, body, if_match } => {
                op.insert("operationType".into(), "Replace".into());
                op.insert("id".into(), id.clone().into());
                op.insert("resourceBody".into(), body.clone());
                op.insert("ifMatch".into(), if_match.clone().into());
            }
            BatchOp::Delete { id, if_match } => {
                op.insert("operationType".into(), "Delete".into());
                op.insert("id".into(), id.clone().into());
                op.insert("ifMatch".into(), if_match.clone().into());
            }
        }
        Value::Object(op)
    }
}

/// The outcome of one batch operation.
#[derive(Debug, Clone)]
pub(crate) struct OpResult {
    pub status: u16,
    pub etag: Option<String>,
    pub body: Option<Value>,
}

/// How long the parts of a request may take; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// Opening a TCP connection.
    pub connect: Duration,
    /// One attempt of a request: connecting, TLS, sending and reading the whole answer.
    pub request: Duration,
    /// Attempts of a request that is safe to send again (at least 1).
    pub attempts: u32,
    /// How long an idle pooled connection is kept.
    pub pool_idle: Duration,
    /// Idle time of a connection before TCP keepalive probes it (then every `keepalive / 2`,
    /// three probes).
    pub keepalive: Duration,
}

/// A signed REST client of one container.
#[derive(Clone)]
pub(crate) struct Rest {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The endpoint without a trailing slash, e.g. `https://acct.documents.azure.com:443`.
    base: String,
    key: Arc<Vec<u8>>,
    clock: Arc<dyn Clock>,
    timeouts: Timeouts,
    pub database: String,
    pub container: String,
    usage: Arc<UsageCounter>,
}

impl std::fmt::Debug for Rest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Rest")
            .field("endpoint", &self.base)
            .field("database", &self.database)
            .field("container", &self.container)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct UsageCounter {
    requests: AtomicU64,
    /// Request units in thousandths.
    milli_units: AtomicU64,
}

/// Which resource a request is about, for the signature.
#[derive(Clone, Copy)]
pub(crate) enum Resource<'a> {
    /// The account's databases (`POST dbs`).
    Databases,
    /// The containers of the database (`POST dbs/{db}/colls`).
    Containers,
    /// The container itself (`GET dbs/{db}/colls/{coll}`: its partition key paths).
    Container,
    /// The container's partition key ranges (`GET …/pkranges`).
    PartitionKeyRanges,
    /// The documents of the container (create, query, batch, change feed).
    Documents,
    /// One document.
    Document(&'a str),
}

impl Rest {
    /// A client of `container` in `database` at `endpoint`, signing with `key` (base64).
    pub fn new(
        endpoint: &str,
        key: &str,
        database: &str,
        container: &str,
        timeouts: Timeouts,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, CosmosError> {
        let uri: http::Uri = endpoint.parse().map_err(|e| CosmosError::Setting {
            setting: "endpoint",
            reason: format!("{endpoint:?} is not a URL: {e}"),
        })?;
        let scheme = uri.scheme_str().unwrap_or_default();
        if !matches!(scheme, "http" | "https") || uri.host().is_none() {
            return Err(CosmosError::Setting {
                setting: "endpoint",
                reason: format!(
                    "{endpoint:?} must be http://HOST[:PORT] or https://HOST[:PORT] (the account \
                     endpoint, e.g. https://ACCOUNT.documents.azure.com:443/)"
                ),
            });
        }
        let key = base64::engine::general_purpose::STANDARD
            .decode(key.trim())
            .map_err(|e| CosmosError::Setting {
                setting: "key",
                reason: format!("the account key is not base64 ({e}); its value is not shown"),
            })?;
        for (setting, name) in [("database", database), ("container", container)] {
            if name.is_empty()
                || name.len() > 255
                || name
                    .chars()
                    .any(|c| matches!(c, '/' | '\\' | '?' | '#') || c.is_control())
                || name.ends_with(' ')
            {
                return Err(CosmosError::Setting {
                    setting,
                    reason: format!(
                        "{name:?} is not a Cosmos DB id (1 to 255 characters, none of / \\ ? # \
                         or control characters, no trailing space)"
                    ),
                });
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = match hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_native_roots(provider.clone())
        {
            Ok(builder) => builder,
            Err(e) if scheme == "http" => {
                // No system certificates, and none needed for a plain-HTTP endpoint.
                tracing::debug!(error = %e, "no native root certificates; plain HTTP only");
                let config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| CosmosError::Setting {
                        setting: "endpoint",
                        reason: format!("TLS set-up failed: {e}"),
                    })?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth();
                hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config)
            }
            Err(e) => {
                return Err(CosmosError::Setting {
                    setting: "endpoint",
                    reason: format!("cannot load the system's root certificates for https: {e}"),
                })
            }
        };
        // TCP: connect timeout, keepalive (so that a dead idle connection is found on a real
        // network), no Nagle delay. TLS is bounded by the request timeout around each attempt.
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(positive(timeouts.connect)));
        tcp.set_keepalive(Some(positive(timeouts.keepalive)));
        tcp.set_keepalive_interval(Some(positive(timeouts.keepalive / 2)));
        tcp.set_keepalive_retries(Some(3));
        let connector = builder.https_or_http().enable_http1().wrap_connector(tcp);
        // An idle connection is closed after `pool_idle`: checked at every checkout, and by the
        // pool's reaper, which needs the timer.
        let http = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(positive(timeouts.pool_idle))
            .build(connector);
        Ok(Self {
            http,
            base: endpoint.trim_end_matches('/').to_string(),
            key: Arc::new(key),
            clock,
            timeouts,
            database: database.to_string(),
            container: container.to_string(),
            usage: Arc::new(UsageCounter::default()),
        })
    }

    /// What this client (and its clones) has spent so far.
    pub fn usage(&self) -> Usage {
        Usage {
            requests: self.usage.requests.load(Ordering::Relaxed),
            request_units: self.usage.milli_units.load(Ordering::Relaxed) as f64 / 1000.0,
        }
    }

    /// The resource type, resource link (for the signature) and URL path of `resource`.
    fn locate(&self, resource: Resource<'_>) -> (&'static str, String, String) {
        let db = &self.database;
        let coll = &self.container;
        let enc = |s: &str| utf8_percent_encode(s, SEGMENT).to_string();
        match resource {
            Resource::Databases => ("dbs", String::new(), "/dbs".into()),
            Resource::Containers => (
                "colls",
                format!("dbs/{db}"),
                format!("/dbs/{}/colls", enc(db)),
            ),
            Resource::Container => (
                "colls",
                format!("dbs/{db}/colls/{coll}"),
                format!("/dbs/{}/colls/{}", enc(db), enc(coll)),
            ),
            Resource::PartitionKeyRanges => (
                "pkranges",
                format!("dbs/{db}/colls/{coll}"),
                format!("/dbs/{}/colls/{}/pkranges", enc(db), enc(coll)),
            ),
            Resource::Documents => (
                "docs",
                format!("dbs/{db}/colls/{coll}"),
                format!("/dbs/{}/colls/{}/docs", enc(db), enc(coll)),
            ),
            Resource::Document(id) => (
                "docs",
                format!("dbs/{db}/colls/{coll}/docs/{id}"),
                format!("/dbs/{}/colls/{}/docs/{}", enc(db), enc(coll), enc(id)),
            ),
        }
    }

    /// Sends one signed request and returns the answer, whatever its status. A request safe to
    /// send again (a read, a query, a `PUT` with `If-Match`) that got no answer (it timed out
    /// or its connection failed) is sent again, up to [`Timeouts::attempts`] in all; each
    /// attempt on a connection of its own choosing (a failed one is never reused).
    pub async fn send(
        &self,
        method: Method,
        resource: Resource<'_>,
        headers: &[(&'static str, String)],
        body: Option<Vec<u8>>,
    ) -> Result<Answer, CosmosError> {
        let repeatable = method == Method::GET
            || headers.iter().any(|(n, _)| *n == "x-ms-documentdb-isquery")
            || (method == Method::PUT && headers.iter().any(|(n, _)| *n == "if-match"));
        let attempts = if repeatable {
            self.timeouts.attempts.max(1)
        } else {
            1
        };
        let mut attempt = 1;
        loop {
            match self
                .send_once(method.clone(), resource, headers, body.clone())
                .await
            {
                Err(e @ (CosmosError::Timeout { .. } | CosmosError::Transport { .. }))
                    if attempt < attempts =>
                {
                    tracing::debug!(error = %e, attempt, "no answer; sending again");
                    attempt += 1;
                    // A short wait, so that a refused connection is not retried in a spin.
                    let ms = rand::random::<u64>() % 50 + 1;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                other => return other,
            }
        }
    }

    /// One attempt of [`Rest::send`], bounded by [`Timeouts::request`].
    async fn send_once(
        &self,
        method: Method,
        resource: Resource<'_>,
        headers: &[(&'static str, String)],
        body: Option<Vec<u8>>,
    ) -> Result<Answer, CosmosError> {
        let (resource_type, link, path) = self.locate(resource);
        let request_name = if link.is_empty() {
            format!("{method} {resource_type}")
        } else {
            format!("{method} {link}")
        };
        let date = httpdate::fmt_http_date(self.clock.wall_system_time());
        let authorization = authorization(&self.key, &method, resource_type, &link, &date);
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", authorization)
            .header("x-ms-date", &date)
            .header("x-ms-version", API_VERSION)
            .header("accept", "application/json");
        for (name, value) in headers {
            let value = HeaderValue::from_str(value).map_err(|e| CosmosError::Unexpected {
                request: request_name.clone(),
                reason: format!("header {name} cannot hold {value:?}: {e}"),
            })?;
            builder = builder.header(*name, value);
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| CosmosError::Unexpected {
                request: request_name.clone(),
                reason: format!("cannot build the request: {e}"),
            })?;
        self.usage.requests.fetch_add(1, Ordering::Relaxed);
        let exchange = async {
            let response =
                self.http
                    .request(request)
                    .await
                    .map_err(|source| CosmosError::Transport {
                        request: request_name.clone(),
                        source,
                    })?;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| CosmosError::Unexpected {
                    request: request_name.clone(),
                    reason: format!("the body could not be read: {e}"),
                })?
                .to_bytes();
            Ok::<_, CosmosError>((parts, body))
        };
        // Dropping `exchange` at the timeout drops its connection with the request in flight:
        // it never goes back to the pool (see the module docs).
        let (parts, body) = tokio::time::timeout(positive(self.timeouts.request), exchange)
            .await
            .map_err(|_| CosmosError::Timeout {
                request: request_name.clone(),
                timeout: self.timeouts.request,
            })??;
        if let Some(charge) = parts
            .headers
            .get("x-ms-request-charge")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<f64>().ok())
        {
            self.usage
                .milli_units
                .fetch_add((charge * 1000.0).round() as u64, Ordering::Relaxed);
        }
        Ok(Answer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            request: request_name,
        })
    }

    /// A header naming the logical partition `group`.
    fn partition_header(group: &str) -> (&'static str, String) {
        (
            "x-ms-documentdb-partitionkey",
            Value::Array(vec![Value::String(group.into())]).to_string(),
        )
    }

    /// Reads document `id` of partition `group`: `None` on 404.
    pub async fn read(
        &self,
        group: &str,
        id: &str,
    ) -> Result<Option<(Value, String)>, CosmosError> {
        // `x-ms-documentdb-query-enablecrosspartition` means nothing to a point read on Cosmos
        // DB; the local test server (@vercel/cosmosdb-server 1.0.1) needs it to answer 404 for
        // a missing document: without it, it compares the partition key header with the
        // document's fields before checking there is a document, and answers 500 ("Cannot
        // read properties of undefined").
        let answer = self
            .send(
                Method::GET,
                Resource::Document(id),
                &[
                    Self::partition_header(group),
                    ("x-ms-documentdb-query-enablecrosspartition", "True".into()),
                ],
                None,
            )
            .await?;
        match answer.status {
            200 => {
                let doc = answer.json()?;
                let etag = etag_of(&answer, &doc)?;
                Ok(Some((doc, etag)))
            }
            404 => Ok(None),
            _ => Err(answer.into_error()),
        }
    }

    /// Creates `doc` (POST): the answer as is (201, or 409 when the id is taken).
    pub async fn create(&self, group: &str, doc: &Value) -> Result<Answer, CosmosError> {
        self.send(
            Method::POST,
            Resource::Documents,
            &[
                Self::partition_header(group),
                ("content-type", "application/json".into()),
            ],
            Some(doc.to_string().into_bytes()),
        )
        .await
    }

    /// Replaces document `id` with `doc` if its ETag is `if_match` (PUT): the answer as is (200,
    /// 412 on another ETag, 404).
    pub async fn replace(
        &self,
        group: &str,
        id: &str,
        doc: &Value,
        if_match: &str,
    ) -> Result<Answer, CosmosError> {
        self.send(
            Method::PUT,
            Resource::Document(id),
            &[
                Self::partition_header(group),
                ("content-type", "application/json".into()),
                ("if-match", if_match.to_string()),
            ],
            Some(doc.to_string().into_bytes()),
        )
        .await
    }

    /// Deletes document `id`, if its ETag is `if_match` when given: the answer as is (204, 412,
    /// 404).
    pub async fn delete(
        &self,
        group: &str,
        id: &str,
        if_match: Option<&str>,
    ) -> Result<Answer, CosmosError> {
        let mut headers = vec![Self::partition_header(group)];
        if let Some(etag) = if_match {
            headers.push(("if-match", etag.to_string()));
        }
        self.send(Method::DELETE, Resource::Document(id), &headers, None)
            .await
    }

    /// One page of a query within partition `group`: the documents and the continuation token
    /// of the next page. `page_size`: `x-ms-max-item-count` (`-1`: as many as one page holds).
    pub async fn query_page(
        &self,
        group: &str,
        query: &str,
        parameters: &[(&str, Value)],
        page_size: i64,
        continuation: Option<&str>,
    ) -> Result<(Vec<Value>, Option<String>), CosmosError> {
        self.query_page_in(Some(group), query, parameters, page_size, continuation)
            .await
    }

    /// One page of a query within logical partition `partition`, or across every partition
    /// of the container when `None` (`x-ms-documentdb-query-enablecrosspartition`, which the
    /// gateway serves for queries without ORDER BY, aggregates or TOP; a page may then be
    /// empty and still have a next one).
    async fn query_page_in(
        &self,
        partition: Option<&str>,
        query: &str,
        parameters: &[(&str, Value)],
        page_size: i64,
        continuation: Option<&str>,
    ) -> Result<(Vec<Value>, Option<String>), CosmosError> {
        let body = serde_json::json!({
            "query": query,
            "parameters": parameters
                .iter()
                .map(|(name, value)| serde_json::json!({"name": name, "value": value}))
                .collect::<Vec<_>>(),
        });
        let mut headers = vec![
            ("content-type", "application/query+json".into()),
            ("x-ms-documentdb-isquery", "True".into()),
            ("x-ms-max-item-count", page_size.to_string()),
        ];
        match partition {
            Some(group) => headers.push(Self::partition_header(group)),
            None => headers.push(("x-ms-documentdb-query-enablecrosspartition", "True".into())),
        }
        if let Some(token) = continuation {
            headers.push(("x-ms-continuation", token.to_string()));
        }
        let answer = self
            .send(
                Method::POST,
                Resource::Documents,
                &headers,
                Some(body.to_string().into_bytes()),
            )
            .await?;
        if answer.status != 200 {
            return Err(answer.into_error());
        }
        let next = answer
            .header("x-ms-continuation")
            .filter(|t| !t.is_empty())
            .map(str::to_string);
        let mut json = answer.json()?;
        let docs = match json.get_mut("Documents").map(Value::take) {
            Some(Value::Array(docs)) => docs,
            _ => {
                return Err(CosmosError::Unexpected {
                    request: answer.request,
                    reason: "a query answer without a Documents array".into(),
                })
            }
        };
        Ok((docs, next))
    }

    /// Every page of a query within partition `group`.
    pub async fn query_all(
        &self,
        group: &str,
        query: &str,
        parameters: &[(&str, Value)],
        page_size: i64,
    ) -> Result<Vec<Value>, CosmosError> {
        self.every_page(Some(group), query, parameters, page_size)
            .await
    }

    /// Every page of a query across all logical partitions of the container.
    pub async fn query_all_partitions(
        &self,
        query: &str,
        parameters: &[(&str, Value)],
        page_size: i64,
    ) -> Result<Vec<Value>, CosmosError> {
        self.every_page(None, query, parameters, page_size).await
    }

    /// Every page of a query, following the continuation, within `group` or across all
    /// partitions.
    async fn every_page(
        &self,
        group: Option<&str>,
        query: &str,
        parameters: &[(&str, Value)],
        page_size: i64,
    ) -> Result<Vec<Value>, CosmosError> {
        let mut all = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let (docs, next) = self
                .query_page_in(group, query, parameters, page_size, continuation.as_deref())
                .await?;
            all.extend(docs);
            match next {
                Some(token) => continuation = Some(token),
                None => return Ok(all),
            }
        }
    }

    /// Runs `ops` as one atomic transactional batch in partition `group`: one result per
    /// operation, in order. When one fails, Cosmos DB applies none and answers 424 for the
    /// others; the failed one carries its own status (409, 412, 404 …).
    pub async fn batch(&self, group: &str, ops: &[BatchOp]) -> Result<Vec<OpResult>, CosmosError> {
        let body = Value::Array(ops.iter().map(|op| op.to_json(group)).collect());
        let answer = self
            .send(
                Method::POST,
                Resource::Documents,
                &[
                    Self::partition_header(group),
                    ("content-type", "application/json".into()),
                    ("x-ms-cosmos-is-batch-request", "True".into()),
                    ("x-ms-cosmos-batch-atomic", "True".into()),
                    ("x-ms-cosmos-batch-continue-on-error", "False".into()),
                ],
                Some(body.to_string().into_bytes()),
            )
            .await?;
        // A failed batch may come as 207 or as the failed operation's status, with the
        // per-operation results in the body either way; anything else is an error.
        let results = match answer.json() {
            Ok(Value::Array(results)) => results,
            _ if answer.status >= 400 => return Err(answer.into_error()),
            Ok(_) | Err(_) => {
                return Err(CosmosError::Unexpected {
                    request: answer.request.clone(),
                    reason: format!(
                        "a batch answer that is not an array: {}",
                        lossy(&answer.body)
                    ),
                })
            }
        };
        if results.len() != ops.len() {
            return Err(CosmosError::Unexpected {
                request: answer.request,
                reason: format!("{} results for {} operations", results.len(), ops.len()),
            });
        }
        results
            .into_iter()
            .map(|mut r| {
                let status = r
                    .get("statusCode")
                    .and_then(Value::as_u64)
                    .and_then(|s| u16::try_from(s).ok())
                    .ok_or_else(|| CosmosError::Unexpected {
                        request: answer.request.clone(),
                        reason: format!("a batch result without a statusCode: {r}"),
                    })?;
                let body = r.get_mut("resourceBody").map(Value::take);
                let etag = r
                    .get("eTag")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .or_else(|| {
                        body.as_ref()
                            .and_then(|b| b.get("_etag"))
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    });
                Ok(OpResult { status, etag, body })
            })
            .collect()
    }

    /// Creates the database and the container (partition key `partition_key_path`) unless
    /// they exist.
    pub async fn ensure_container(&self, partition_key_path: &str) -> Result<(), CosmosError> {
        let db = serde_json::json!({ "id": self.database });
        let answer = self
            .send(
                Method::POST,
                Resource::Databases,
                &[("content-type", "application/json".into())],
                Some(db.to_string().into_bytes()),
            )
            .await?;
        if !matches!(answer.status, 201 | 409) {
            return Err(answer.into_error());
        }
        let coll = serde_json::json!({
            "id": self.container,
            "partitionKey": { "paths": [partition_key_path], "kind": "Hash", "version": 2 },
        });
        let answer = self
            .send(
                Method::POST,
                Resource::Containers,
                &[("content-type", "application/json".into())],
                Some(coll.to_string().into_bytes()),
            )
            .await?;
        if !matches!(answer.status, 201 | 409) {
            return Err(answer.into_error());
        }
        Ok(())
    }
}

/// The ETag of a document answer: its `etag` header, or its `_etag` property.
pub(crate) fn etag_of(answer: &Answer, doc: &Value) -> Result<String, CosmosError> {
    answer
        .header("etag")
        .map(str::to_string)
        .or_else(|| doc.get("_etag").and_then(Value::as_str).map(str::to_string))
        .ok_or_else(|| CosmosError::Unexpected {
            request: answer.request.clone(),
            reason: "a document without an ETag".into(),
        })
}

/// The value of the `authorization` header for a master-key signed request, URL-encoded:
/// `type=master&ver=1.0&sig=` and the base64 HMAC-SHA256, under the decoded key, of the verb,
/// resource type, resource link and date, each lower-cased but the link, one per line, with an
/// empty line at the end.
pub(crate) fn authorization(
    key: &[u8],
    method: &Method,
    resource_type: &str,
    resource_link: &str,
    date: &str,
) -> String {
    let payload = format!(
        "{}\n{}\n{}\n{}\n\n",
        method.as_str().to_lowercase(),
        resource_type.to_lowercase(),
        resource_link,
        date.to_lowercase()
    );
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key)
        .expect("HMAC-SHA256 takes a key of any length");
    mac.update(payload.as_bytes());
    let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    let token = format!("type=master&ver=1.0&sig={signature}");
    percent_encoding::utf8_percent_encode(&token, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Wall time as the `Date` of a request.
trait WallTime {
    fn wall_system_time(&self) -> std::time::SystemTime;
}

impl WallTime for Arc<dyn Clock> {
    fn wall_system_time(&self) -> std::time::SystemTime {
        let ms = self.wall().millis();
        if ms >= 0 {
            std::time::UNIX_EPOCH + Duration::from_millis(ms as u64)
        } else {
            std::time::UNIX_EPOCH
        }
    }
}

/// A zero duration would time everything out at once: at least a millisecond.
fn positive(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

/// A lock that a panic elsewhere cannot poison for good: the data behind these locks is plain.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_the_documented_hmac_of_verb_type_link_and_date() {
        // The string to sign and its HMAC-SHA256 under the base64-decoded key, checked against
        // an independent computation (Python's hmac module, same inputs):
        //   hmac.new(base64.b64decode(KEY), b"get\ndocs\ndbs/db/colls/c/docs/lease.0\n
        //     mon, 01 jan 2024 00:00:00 gmt\n\n", hashlib.sha256).digest()
        let key = base64::engine::general_purpose::STANDARD
            .decode(crate::EMULATOR_KEY)
            .expect("the emulator key is base64");
        let header = authorization(
            &key,
            &Method::GET,
            "docs",
            "dbs/db/colls/c/docs/lease.0",
            "Mon, 01 Jan 2024 00:00:00 GMT",
        );
        let decoded = percent_encoding::percent_decode_str(&header)
            .decode_utf8()
            .expect("utf-8");
        assert!(decoded.starts_with("type=master&ver=1.0&sig="), "{decoded}");
        assert_eq!(decoded, format!("type=master&ver=1.0&sig={}", EXPECTED_SIG));
        assert!(
            !header.contains('='),
            "the header value is URL-encoded: {header}"
        );
    }

    /// HMAC-SHA256 of the payload above under the emulator key, base64 (from Python).
    const EXPECTED_SIG: &str = "I5dWNIzvDuJJkJhdVOfAgTMaHdx4Wa0+RALqFcYiGPA=";
}
