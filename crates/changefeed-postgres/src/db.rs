//! The shared PostgreSQL plumbing: connection options, the pool, TLS, timeouts, identifier
//! rules, and the versioned schema migrations.
//!
//! Both [`crate::PostgresLeaseStore`] and [`crate::PostgresOutbox`] hold a [`Db`]. What the
//! tables mean is left to those two modules; this one only connects and migrates.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio_postgres::config::{Host, SslMode};

use crate::error::PostgresError;

/// Idle time before the first keepalive probe, the time between probes, and how many go
/// unanswered before the kernel closes the connection: a silent peer is found in about 16 s.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_RETRIES: u32 = 3;

/// The default table prefix.
pub const DEFAULT_PREFIX: &str = "changefeed";
/// Longest accepted table prefix, in bytes: PostgreSQL identifiers are at most 63 bytes and
/// the longest suffix this crate appends is 20.
pub const MAX_PREFIX_LEN: usize = 40;

/// How to reach the database and how to behave there. Built with [`PgOptions::new`] and the
/// setters; checked when a store or outbox connects.
///
/// # TLS
///
/// `sslmode` in the URL is honoured: `disable` (plain TCP), `prefer` (TLS if the server
/// offers it) and `require` (TLS or fail). Without `sslmode`, a loopback host (`127.0.0.1`,
/// `::1`, `localhost`) or a Unix socket gets `disable` and any other host `prefer`.
/// Unlike libpq's `require`, the server certificate is **always verified** when TLS is used:
/// against the Mozilla roots (`webpki-roots`) by default, or the roots given with
/// [`PgOptions::tls_roots`] (for a private CA).
#[derive(Clone)]
pub struct PgOptions {
    url: String,
    prefix: String,
    statement_timeout: Duration,
    client_timeout: Duration,
    connect_timeout: Duration,
    pool_size: usize,
    tls_roots: Option<Arc<rustls::RootCertStore>>,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password: show only the prefix and timeouts.
        f.debug_struct("PgOptions")
            .field("prefix", &self.prefix)
            .field("statement_timeout", &self.statement_timeout)
            .field("client_timeout", &self.client_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_size", &self.pool_size)
            .finish_non_exhaustive()
    }
}

impl PgOptions {
    /// Options for `url` (`postgres://user[:password]@host[:port]/database[?sslmode=…]`),
    /// with prefix [`DEFAULT_PREFIX`], a 4 s `statement_timeout`, a 5 s client-side timeout,
    /// a 3 s connect timeout and a pool of 8 connections.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: DEFAULT_PREFIX.to_string(),
            statement_timeout: Duration::from_secs(4),
            client_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            pool_size: 8,
            tls_roots: None,
        }
    }

    /// The prefix of every table name: lowercase ASCII letters, digits and `_`, starting with
    /// a letter or `_`, at most [`MAX_PREFIX_LEN`] bytes. Tables are `{prefix}_leases` …
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The server-side `statement_timeout` set on every connection.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// How long one call (getting a connection plus its statements) may take on the client
    /// before it fails with a retryable error. Must be at least the statement timeout.
    pub fn client_timeout(mut self, timeout: Duration) -> Self {
        self.client_timeout = timeout;
        self
    }

    /// How long opening a connection (TCP, TLS and the start-up exchange) may take; a
    /// `connect_timeout` in the URL (whole seconds, as libpq takes it) wins over it.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The most connections the pool opens.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// The roots server certificates are verified against (default: the Mozilla roots).
    pub fn tls_roots(mut self, roots: rustls::RootCertStore) -> Self {
        self.tls_roots = Some(Arc::new(roots));
        self
    }

    /// The server-side statement timeout these options set.
    pub fn statement_timeout_value(&self) -> Duration {
        self.statement_timeout
    }

    /// The client-side timeout of one call these options set.
    pub fn client_timeout_value(&self) -> Duration {
        self.client_timeout
    }

    /// The table prefix.
    pub fn table_prefix(&self) -> &str {
        &self.prefix
    }
}

/// Checks `prefix` against the identifier rules of [`PgOptions::prefix`].
///
/// # Errors
/// [`PostgresError::Config`] naming the setting and the rule.
pub fn validate_prefix(prefix: &str) -> Result<(), PostgresError> {
    let bad = |reason: String| PostgresError::Config {
        setting: "prefix",
        reason: format!("{:?} {reason}", prefix.escape_debug().to_string()),
    };
    let mut chars = prefix.chars();
    match chars.next() {
        None => return Err(bad("must not be empty".into())),
        Some(c) if !(c.is_ascii_lowercase() || c == '_') => {
            return Err(bad("must start with a lowercase ASCII letter or '_'".into()))
        }
        _ => {}
    }
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(bad(format!("must be at most {MAX_PREFIX_LEN} bytes")));
    }
    if !prefix
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(bad(
            "may only hold lowercase ASCII letters, digits and '_'".into()
        ));
    }
    Ok(())
}

/// `"{prefix}_{suffix}"`, quoted. The prefix is validated, so quoting only keeps keywords safe.
pub(crate) fn table(prefix: &str, suffix: &str) -> String {
    format!("\"{prefix}_{suffix}\"")
}

/// A pool of connections plus the client-side timeout every call runs under.
#[derive(Clone)]
pub(crate) struct Db {
    pool: Pool,
    client_timeout: Duration,
    prefix: Arc<str>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("prefix", &self.prefix)
            .field("client_timeout", &self.client_timeout)
            .field("status", &self.pool.status())
            .finish()
    }
}

fn is_loopback(hosts: &[Host]) -> bool {
    hosts.iter().all(|h| match h {
        Host::Tcp(name) => {
            name == "localhost" || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
        }
        #[allow(unreachable_patterns)]
        _ => true, // Unix socket
    })
}

fn tls_config(
    roots: Option<Arc<rustls::RootCertStore>>,
) -> Result<rustls::ClientConfig, PostgresError> {
    let roots = match roots {
        Some(r) => (*r).clone(),
        None => rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        },
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PostgresError::Config {
            setting: "tls",
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl Db {
    /// Validates `options` and builds the pool. Connections open lazily; the first call (the
    /// migration) shows whether the server is reachable.
    pub(crate) fn new(options: &PgOptions) -> Result<Db, PostgresError> {
        validate_prefix(&options.prefix)?;
        if options.statement_timeout.is_zero() {
            return Err(PostgresError::Config {
                setting: "statement_timeout",
                reason: "must be above zero".into(),
            });
        }
        if options.client_timeout < options.statement_timeout {
            return Err(PostgresError::Config {
                setting: "client_timeout",
                reason: format!(
                    "client_timeout ({:?}) must be at least statement_timeout ({:?})",
                    options.client_timeout, options.statement_timeout
                ),
            });
        }
        if options.connect_timeout.is_zero() {
            return Err(PostgresError::Config {
                setting: "connect_timeout",
                reason: "must be above zero".into(),
            });
        }
        if options.pool_size == 0 {
            return Err(PostgresError::Config {
                setting: "pool_size",
                reason: "must be at least 1".into(),
            });
        }
        let mut config: tokio_postgres::Config =
            options
                .url
                .parse()
                .map_err(|e: tokio_postgres::Error| PostgresError::Config {
                    setting: "url",
                    reason: e.to_string(),
                })?;
        if !options.url.contains("sslmode=") && is_loopback(config.get_hosts()) {
            config.ssl_mode(SslMode::Disable);
        }
        let timeout_ms = options.statement_timeout.as_millis();
        let extra = format!("-c statement_timeout={timeout_ms}");
        let merged = match config.get_options() {
            Some(existing) if !existing.is_empty() => format!("{existing} {extra}"),
            _ => extra,
        };
        config.options(merged);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.connect_timeout.min(options.client_timeout));
        }
        // A peer gone without a word (a dead switch, a host powered off) is noticed by the
        // kernel: an idle connection by keepalive probes, one with unanswered bytes by the
        // user timeout. Both close the socket, so the pool never hands it out again. The URL's
        // own `keepalives_*` and `tcp_user_timeout` win.
        if !options.url.contains("keepalives_idle") {
            config.keepalives_idle(KEEPALIVE_IDLE);
        }
        if !options.url.contains("keepalives_interval") {
            config.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if !options.url.contains("keepalives_retries") {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(options.client_timeout * 2);
        }
        let tls =
            tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(options.tls_roots.clone())?);
        let manager = Manager::from_config(
            config,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(options.pool_size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(options.client_timeout))
            .create_timeout(Some(options.client_timeout))
            .build()
            .map_err(|e| PostgresError::Config {
                setting: "pool",
                reason: e.to_string(),
            })?;
        Ok(Db {
            pool,
            client_timeout: options.client_timeout,
            prefix: Arc::from(options.prefix.as_str()),
        })
    }

    /// The validated table prefix.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Runs `f` with a pooled connection, the whole call (waiting for a connection included)
    /// bounded by the client-side timeout: a hung server becomes a retryable
    /// [`PostgresError::Timeout`].
    ///
    /// A connection goes back to the pool only when `f` finished. One whose call timed out,
    /// or whose caller gave up on it (dropped this future), may still have a request on the
    /// wire that will never be answered: it is closed, and so is every idle connection of the
    /// pool, since a path that hung one probably hung the others opened before it. The next
    /// call opens a fresh connection, so a host whose path comes back is served at once
    /// instead of queueing behind dead connections.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        operation: &'static str,
        f: F,
    ) -> Result<T, PostgresError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = Result<T, PostgresError>>,
    {
        let lent = Arc::new(std::sync::Mutex::new(Unfinished {
            object: None,
            pool: self.pool.clone(),
        }));
        let work = async {
            let object = self.pool.get().await.map_err(pool_error)?;
            f(Conn {
                object: Some(object),
                back: Arc::clone(&lent),
            })
            .await
        };
        let result = tokio::time::timeout(self.client_timeout, work).await;
        match result {
            Ok(result) => {
                // Finished: the connection may serve again (the pool checks it is not closed).
                let object = lent.lock().unwrap_or_else(|p| p.into_inner()).object.take();
                drop(object);
                result
            }
            // `lent` holds the connection; dropping it closes the connection.
            Err(_) => Err(PostgresError::Timeout {
                operation,
                after: self.client_timeout,
            }),
        }
    }

    /// Brings the schema `component` up to `migrations.len()`: in one transaction holding an
    /// advisory lock on the prefix (so concurrent starters apply each migration once), reads
    /// the version, refuses a newer one, applies what is missing and records the new version.
    pub(crate) async fn migrate(
        &self,
        component: &'static str,
        migrations: &[String],
    ) -> Result<(), PostgresError> {
        let prefix = self.prefix.to_string();
        let versions = table(&prefix, "schema_versions");
        let supported = i32::try_from(migrations.len()).unwrap_or(i32::MAX);
        self.run("migrate", |mut client| async move {
            let tx = client.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('changefeed:' || $1, 0))",
                &[&prefix],
            )
            .await?;
            tx.batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {versions} (
                    component text PRIMARY KEY,
                    version integer NOT NULL
                )"
            ))
            .await?;
            let found: i32 = tx
                .query_opt(
                    &format!("SELECT version FROM {versions} WHERE component = $1"),
                    &[&component],
                )
                .await?
                .map(|r| r.try_get(0))
                .transpose()?
                .unwrap_or(0);
            if found > supported {
                return Err(PostgresError::SchemaTooNew {
                    prefix,
                    component,
                    found,
                    supported,
                });
            }
            if found == supported {
                return Ok(()); // dropping `tx` rolls back the read-only transaction
            }
            for migration in &migrations[usize::try_from(found.max(0)).unwrap_or(0)..] {
                tx.batch_execute(migration).await?;
            }
            tx.execute(
                &format!(
                    "INSERT INTO {versions} (component, version) VALUES ($1, $2)
                     ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version"
                ),
                &[&component, &supported],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }
}

/// A pooled connection lent to one call of [`Db::run`]; derefs to the pool's client. When
/// the call's future is dropped it hands the connection back to [`Db::run`], which returns it
/// to the pool only if the call finished.
pub(crate) struct Conn {
    object: Option<Object>,
    back: Arc<std::sync::Mutex<Unfinished>>,
}

impl std::ops::Deref for Conn {
    type Target = Object;

    fn deref(&self) -> &Object {
        self.object
            .as_ref()
            .expect("a lent connection is held until the call's future is dropped")
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Object {
        self.object
            .as_mut()
            .expect("a lent connection is held until the call's future is dropped")
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            self.back.lock().unwrap_or_else(|p| p.into_inner()).object = Some(object);
        }
    }
}

/// A connection whose call has not (yet) been seen to finish. Dropped while it still holds
/// the connection (a timeout, a caller that gave up), it closes it and every idle connection
/// of the pool rather than give them out again.
struct Unfinished {
    object: Option<Object>,
    pool: Pool,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            // Detached from the pool, the client is dropped and its connection task aborted,
            // which closes the socket.
            drop(Object::take(object));
            let closed = self.pool.retain(|_, _| false).removed.len();
            let status = self.pool.status();
            tracing::warn!(
                closed_idle = closed,
                open = status.size,
                waiting = status.waiting,
                "a PostgreSQL call did not finish; its connection and the pool's idle ones are closed"
            );
        }
    }
}

/// A pool error as ours. The pool's failure to open a connection wraps the driver's error in
/// `Error occurred while creating a new object: …` and also returns it as its cause, so the
/// driver's error is kept alone: the message then reads `error connecting to server: …` once.
fn pool_error(err: deadpool_postgres::PoolError) -> PostgresError {
    match err {
        deadpool_postgres::PoolError::Backend(e) => PostgresError::Postgres(e),
        other => PostgresError::Pool(other),
    }
}
