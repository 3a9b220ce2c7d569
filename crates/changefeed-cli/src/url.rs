//! Store and source URLs: the one place that turns `--store URL` / `--source URL` into a backend.
//!
//! Each command takes URLs and gets back trait objects (`Arc<dyn LeaseStore>`,
//! `Arc<dyn FeedSource>`), so adding a backend means adding a scheme here and nothing
//! elsewhere. Built in:
//!
//! - `sqlite://PATH` (store and source): `sqlite:///abs/file.db` or `sqlite://relative/file.db`
//!   (the path is everything after `sqlite://`).
//! - `postgres://…` or `postgresql://…` (store): a [`PostgresLeaseStore`], e.g.
//!   `postgres://user:pw@db:5432/app?prefix=orders&sslmode=require`.
//! - `dynamodb://TABLE[?endpoint=URL&region=R]` (store): a [`DynamoLeaseStore`] on one table
//!   (created if absent); credentials, and region and endpoint unless given, from the standard
//!   AWS configuration chain.
//! - `kinesis://STREAM[?endpoint=URL&region=R]` (source): a [`KinesisFeed`] on one stream;
//!   `kinesis://S1,S2,…` reads several streams with one lease table (a [`MultiFeed`], KCL's
//!   multi-stream mode), partitions named `STREAM:SHARD`.
//! - `dynamodb-streams://TABLE[?endpoint=URL&region=R&stream=ARN&record=plain|adapter]`
//!   (source): a [`DynamoStreamsFeed`] on the table's latest stream (or the stream `ARN`), each
//!   record a JSON document of the change, plain or as the KCL's adapter writes it.
//! - `cosmos://ACCOUNT/DATABASE/CONTAINER[?endpoint=URL]` (store and source): as a store, a
//!   [`CosmosLeaseStore`] on one container (database and container created if absent); as a
//!   source, a [`CosmosFeed`] on an existing container's change feed; of the account
//!   `https://ACCOUNT.documents.azure.com:443/`, or of the server at `?endpoint=` (the emulator
//!   or a local server). The account key comes from the environment variable
//!   `CHANGEFEED_COSMOS_KEY`, never from the URL, and is never printed; with `?endpoint=` and no
//!   key, the emulator's published key is used.
//! - `postgres-outbox://…` (source): a [`PostgresOutbox`] over the tables `{prefix}_outbox…`,
//!   e.g. `postgres-outbox://user:pw@db:5432/app?prefix=orders`.
//!
//! `dynamodb://`, `dynamodb-streams://`, `kinesis://` and `cosmos://` also take `connect_timeout=` (opening a
//! connection) and `request_timeout=` (one attempt of one request), as durations such as `2s`
//! or `500ms`; their defaults are each backend's (docs/operations.md, "Timeouts and
//! recovery").
//!
//! The PostgreSQL URLs are libpq URLs plus parameters of ours, removed before connecting:
//! `prefix` (the table prefix, default `changefeed`), `pool_size` (most connections, default
//! 8), `request_timeout` (how long one call may take on the client, default 5 s) and
//! `statement_timeout` (the server's limit per statement, default 4 s), the two durations as
//! `5s` or `1500ms`. Every other parameter (`sslmode`, `connect_timeout` in whole seconds,
//! `keepalives_idle`, `tcp_user_timeout`, `application_name` …) goes to the driver. A URL's
//! password never appears in `Debug` output or error messages.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use changefeed::lease::LeaseStore;
use changefeed::model::{LeaseKey, Version};
use changefeed::source::{FeedSource, MultiFeed};
use changefeed_cosmos::{CosmosFeed, CosmosLeaseStore, CosmosOptions};
use changefeed_dynamodb::{DynamoLeaseStore, DynamoStreamsFeed, StreamRef, StreamsOptions};
use changefeed_kinesis::{KinesisFeed, ReadOptions};
use changefeed_postgres::{OutboxTable, PgOptions, PostgresLeaseStore, PostgresOutbox};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use crate::usage::UsageError;

mod aws;

use aws::check_endpoint;
pub use aws::{consumer_name_ok, AwsUrl};

/// Schemes this build understands, for error messages.
const SUPPORTED: &str =
    "sqlite://PATH, postgres://USER@HOST/DB[?prefix=P] (store), postgres-outbox://USER@HOST/DB[?prefix=P] (source), dynamodb://TABLE[?endpoint=URL&region=R] (store), cosmos://ACCOUNT/DATABASE/CONTAINER[?endpoint=URL] (store and source), kinesis://STREAM[,STREAM…][?endpoint=URL&region=R] (source), dynamodb-streams://TABLE[?endpoint=URL&region=R&stream=ARN&record=plain|adapter] (source)";

/// The longest `connect_timeout=` or `request_timeout=` accepted.
const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

/// Parses the value of a `connect_timeout=` or `request_timeout=` parameter: a duration above
/// zero and at most an hour. Returns the rule broken.
fn parse_timeout(value: &str) -> Result<std::time::Duration, String> {
    let rule = "must be a duration above zero and at most 1h, such as 2s or 500ms";
    match humantime::parse_duration(value) {
        Ok(d) if !d.is_zero() && d <= MAX_TIMEOUT => Ok(d),
        Ok(_) => Err(rule.to_string()),
        Err(e) => Err(format!("{rule} ({e})")),
    }
}

/// A PostgreSQL connection URL with our own parameters taken out.
#[derive(Clone, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL handed to the driver: `postgres://…` without `prefix` and `pool_size`.
    conn: String,
    /// The table prefix.
    prefix: String,
    /// The pool size, if given.
    pool_size: Option<usize>,
    /// `request_timeout`, if given.
    request_timeout: Option<std::time::Duration>,
    /// `statement_timeout`, if given.
    statement_timeout: Option<std::time::Duration>,
}

impl std::fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgUrl")
            .field("conn", &redact(&self.conn))
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size)
            .field("request_timeout", &self.request_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .finish()
    }
}

/// `text` with the password of its `user:password@` part, and the value of a `password=`
/// query parameter (libpq takes one there too), replaced by `***`.
pub fn redact(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some(("password", _)) => "password=***".to_string(),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", pairs.join("&"))
        }
        None => tail.to_string(),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => format!("{scheme}://{authority}{tail}"),
        },
        None => format!("{scheme}://{authority}{tail}"),
    }
}

impl PgUrl {
    /// Parses the part after `scheme://`, taking out `prefix` and `pool_size`.
    fn parse(setting: &str, scheme: &str, rest: &str) -> Result<Self, UsageError> {
        let bad = |rule: String| UsageError(format!("{setting}: {rule}"));
        let (base, query) = match rest.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (rest, None),
        };
        let mut prefix = changefeed_postgres::DEFAULT_PREFIX.to_string();
        let mut pool_size = None;
        let mut request_timeout = None;
        let mut statement_timeout = None;
        let mut kept = Vec::new();
        let duration = |name: &str, value: &str| {
            humantime::parse_duration(value)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    bad(format!(
                        "{scheme}:// parameter {name}: \"{}\" must be a duration above zero, e.g. 5s or 1500ms",
                        value.escape_debug()
                    ))
                })
        };
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            if pair.is_empty() {
                continue;
            }
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "prefix" => {
                    changefeed_postgres::validate_prefix(value)
                        .map_err(|e| bad(format!("{scheme}:// parameter {e}")))?;
                    prefix = value.to_string();
                }
                "pool_size" => {
                    let n: usize = value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(format!(
                            "{scheme}:// parameter pool_size: \"{}\" must be a whole number above 0",
                            value.escape_debug()
                        ))
                    })?;
                    pool_size = Some(n);
                }
                "request_timeout" => request_timeout = Some(duration(key, value)?),
                "statement_timeout" => statement_timeout = Some(duration(key, value)?),
                _ => kept.push(pair),
            }
        }
        let mut conn = format!("postgres://{base}");
        if !kept.is_empty() {
            conn.push('?');
            conn.push_str(&kept.join("&"));
        }
        // Let the driver judge the rest now, so a bad URL is a usage error naming the flag and,
        // through the driver's cause, the part that is wrong.
        let config = conn.parse::<tokio_postgres::Config>().map_err(|e| {
            bad(format!(
                "{}: {}",
                redact(&conn).escape_debug(),
                changefeed::error::one_line(&e)
            ))
        })?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            return Err(bad(format!(
                "{scheme}:// needs a host, e.g. {scheme}://USER@HOST/DB (or ?host=/run/postgresql for a socket); got \"{}\"",
                redact(&format!("{scheme}://{rest}")).escape_debug()
            )));
        }
        if let (Some(request), Some(statement)) = (request_timeout, statement_timeout) {
            if request < statement {
                return Err(bad(format!(
                    "{scheme}:// parameter request_timeout ({request:?}) must be at least statement_timeout ({statement:?})"
                )));
            }
        }
        Ok(Self {
            conn,
            prefix,
            pool_size,
            request_timeout,
            statement_timeout,
        })
    }

    /// The driver's options: the connection URL, the prefix, the pool size and the timeouts.
    /// A request timeout given alone below the default statement timeout lowers that too.
    pub fn options(&self) -> PgOptions {
        let mut options = PgOptions::new(self.conn.clone()).prefix(self.prefix.clone());
        if let Some(n) = self.pool_size {
            options = options.pool_size(n);
        }
        let default_statement = options.statement_timeout_value();
        let default_client = options.client_timeout_value();
        let statement = self
            .statement_timeout
            .or_else(|| self.request_timeout.filter(|r| *r < default_statement));
        if let Some(d) = statement {
            options = options.statement_timeout(d);
        }
        if let Some(d) = self.request_timeout {
            options = options.client_timeout(d);
        } else if let Some(d) = self.statement_timeout {
            options = options.client_timeout(d.max(default_client));
        }
        options
    }
}

/// A parsed store or source URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// A SQLite database file (store and source).
    Sqlite(PathBuf),
    /// A PostgreSQL lease store (`postgres://`, `postgresql://`).
    Postgres(PgUrl),
    /// A PostgreSQL outbox feed source (`postgres-outbox://`).
    PostgresOutbox(PgUrl),
    /// A DynamoDB lease store (`dynamodb://TABLE`).
    Dynamodb(AwsUrl),
    /// A Kinesis stream feed source (`kinesis://STREAM`).
    Kinesis(AwsUrl),
    /// A DynamoDB table's stream as a feed source (`dynamodb-streams://TABLE`).
    DynamodbStreams(AwsUrl),
    /// A Cosmos DB lease store or feed source (`cosmos://ACCOUNT/DATABASE/CONTAINER`).
    Cosmos(CosmosUrl),
}

/// The environment variable holding the Cosmos DB account key for `cosmos://` URLs.
pub const COSMOS_KEY_VAR: &str = "CHANGEFEED_COSMOS_KEY";

/// A `cosmos://ACCOUNT/DATABASE/CONTAINER[?endpoint=URL]` URL. It holds no key: that is read
/// from [`COSMOS_KEY_VAR`] when the store is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CosmosUrl {
    /// The account name (the first label of `ACCOUNT.documents.azure.com`).
    pub account: String,
    /// The database.
    pub database: String,
    /// The container.
    pub container: String,
    /// `?endpoint=URL`: a server other than the account's (the emulator, a local server).
    pub endpoint: Option<String>,
    /// `?connect_timeout=`: opening a connection.
    pub connect_timeout: Option<std::time::Duration>,
    /// `?request_timeout=`: one attempt of one request.
    pub request_timeout: Option<std::time::Duration>,
}

impl CosmosUrl {
    fn parse(setting: &str, rest: &str) -> Result<Self, UsageError> {
        let bad = |rule: String| UsageError(format!("{setting}: {rule}"));
        const SHAPE: &str =
            "cosmos:// needs ACCOUNT/DATABASE/CONTAINER, e.g. cosmos://myaccount/app/leases";
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut endpoint = None;
        let mut connect_timeout = None;
        let mut request_timeout = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("endpoint", v)) if !v.is_empty() => {
                    check_endpoint(v).map_err(|rule| {
                        bad(format!(
                            "cosmos:// parameter endpoint: \"{}\" {rule}",
                            v.escape_debug()
                        ))
                    })?;
                    endpoint = Some(v.to_string());
                }
                Some((name @ ("connect_timeout" | "request_timeout"), v)) => {
                    let d = parse_timeout(v).map_err(|rule| {
                        bad(format!(
                            "cosmos:// parameter {name}: \"{}\" {rule}",
                            v.escape_debug()
                        ))
                    })?;
                    if name == "connect_timeout" {
                        connect_timeout = Some(d);
                    } else {
                        request_timeout = Some(d);
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "cosmos:// accepts only ?endpoint=URL, ?connect_timeout=DURATION and ?request_timeout=DURATION (the key comes from {COSMOS_KEY_VAR}), got \"{}\"",
                        pair.escape_debug()
                    )))
                }
            }
        }
        let parts: Vec<&str> = path.split('/').collect();
        let [account, database, container] = parts[..] else {
            return Err(bad(SHAPE.into()));
        };
        // Azure's rule for account names: 3 to 44 lowercase letters, digits and hyphens.
        let account_ok = (3..=44).contains(&account.len())
            && account
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !account_ok {
            return Err(bad(format!(
                "cosmos:// account \"{}\" must be 3 to 44 characters of a-z, 0-9 and '-'",
                account.escape_debug()
            )));
        }
        // Cosmos DB refuses these in resource ids; a URL could not carry them either.
        for (what, name) in [("database", database), ("container", container)] {
            let ok = (1..=255).contains(&name.len())
                && !name.contains(['\\', '#', '?', ' '])
                && !name.ends_with('.');
            if !ok {
                return Err(bad(format!(
                    "cosmos:// {what} \"{}\" must be 1 to 255 characters without '\\', '#', '?', spaces or a trailing '.'; {SHAPE}",
                    name.escape_debug()
                )));
            }
        }
        Ok(CosmosUrl {
            account: account.to_string(),
            database: database.to_string(),
            container: container.to_string(),
            endpoint,
            connect_timeout,
            request_timeout,
        })
    }

    /// The account endpoint: `?endpoint=`, or the account's public one.
    pub fn endpoint(&self) -> String {
        self.endpoint
            .clone()
            .unwrap_or_else(|| format!("https://{}.documents.azure.com:443/", self.account))
    }

    /// The store's options, with the key from `key` (the value of [`COSMOS_KEY_VAR`]).
    ///
    /// # Errors
    /// A [`UsageError`] when no key is given for an account (only a server named by
    /// `?endpoint=` may go without: it gets the emulator's published key).
    pub fn options(&self, key: Option<String>) -> Result<CosmosOptions, UsageError> {
        let mut options = CosmosOptions::new(self.endpoint(), &self.database, &self.container);
        if let Some(d) = self.connect_timeout {
            options = options.connect_timeout(d);
        }
        if let Some(d) = self.request_timeout {
            options = options.timeout(d);
        }
        match (key.filter(|k| !k.is_empty()), &self.endpoint) {
            (Some(key), _) => Ok(options.key(key)),
            (None, Some(_)) => Ok(options),
            (None, None) => Err(UsageError(format!(
                "cosmos://{}: set {COSMOS_KEY_VAR} to the account's key (it is never taken from the URL or printed)",
                self.account
            ))),
        }
    }

    /// The feed source on this container's change feed (the container must exist).
    async fn open_feed(&self) -> anyhow::Result<CosmosFeed> {
        let options = self.options(std::env::var(COSMOS_KEY_VAR).ok())?;
        CosmosFeed::connect(&options).await.with_context(|| {
            format!(
                "opening the change feed of Cosmos DB container {}/{} at {}",
                self.database,
                self.container,
                self.endpoint()
            )
        })
    }

    async fn open(&self) -> anyhow::Result<CosmosLeaseStore> {
        let options = self.options(std::env::var(COSMOS_KEY_VAR).ok())?;
        CosmosLeaseStore::connect(&options).await.with_context(|| {
            format!(
                "opening Cosmos DB lease container {}/{} at {}",
                self.database,
                self.container,
                self.endpoint()
            )
        })
    }
}

impl BackendUrl {
    /// Parses `text`; `setting` names the flag for the error message (`--store`).
    ///
    /// # Errors
    /// A [`UsageError`] naming the setting when the scheme is unknown, the path is empty, or
    /// a PostgreSQL URL or its `prefix`/`pool_size` is invalid.
    pub fn parse(setting: &str, text: &str) -> Result<Self, UsageError> {
        let bad = |rule: String| UsageError(format!("{setting}: {rule}"));
        let Some((scheme, rest)) = text.split_once("://") else {
            return Err(bad(format!(
                "\"{}\" is not a URL; expected {SUPPORTED}",
                redact(text).escape_debug()
            )));
        };
        match scheme {
            "sqlite" => {
                if rest.is_empty() {
                    return Err(bad(
                        "sqlite:// needs a file path, e.g. sqlite://feed.db".into()
                    ));
                }
                Ok(BackendUrl::Sqlite(PathBuf::from(rest)))
            }
            "postgres" | "postgresql" => {
                Ok(BackendUrl::Postgres(PgUrl::parse(setting, scheme, rest)?))
            }
            "postgres-outbox" => Ok(BackendUrl::PostgresOutbox(PgUrl::parse(
                setting, scheme, rest,
            )?)),
            "dynamodb" => Ok(BackendUrl::Dynamodb(AwsUrl::parse(setting, scheme, rest)?)),
            "kinesis" => Ok(BackendUrl::Kinesis(AwsUrl::parse(setting, scheme, rest)?)),
            "dynamodb-streams" => Ok(BackendUrl::DynamodbStreams(AwsUrl::parse(
                setting, scheme, rest,
            )?)),
            "cosmos" => Ok(BackendUrl::Cosmos(CosmosUrl::parse(setting, rest)?)),
            other => Err(bad(format!(
                "unknown scheme \"{}\"; supported: {SUPPORTED}",
                other.escape_debug()
            ))),
        }
    }

    /// Parses a lease store URL: as [`BackendUrl::parse`], refusing a source-only scheme.
    ///
    /// # Errors
    /// A [`UsageError`] naming the setting.
    pub fn store(setting: &str, text: &str) -> Result<Self, UsageError> {
        let url = Self::parse(setting, text)?;
        if let BackendUrl::Kinesis(_) | BackendUrl::DynamodbStreams(_) = url {
            let scheme = match url {
                BackendUrl::Kinesis(_) => "kinesis",
                _ => "dynamodb-streams",
            };
            return Err(UsageError(format!(
                "{setting}: {scheme}:// is a feed source; the AWS lease store is dynamodb://TABLE"
            )));
        }
        if let BackendUrl::PostgresOutbox(_) = url {
            return Err(UsageError(format!(
                "{setting}: postgres-outbox:// is a feed source; the PostgreSQL lease store is postgres://USER@HOST/DB[?prefix=P]"
            )));
        }
        Ok(url)
    }

    /// Parses a feed source URL: as [`BackendUrl::parse`], refusing a store-only scheme.
    ///
    /// # Errors
    /// A [`UsageError`] naming the setting.
    pub fn source(setting: &str, text: &str) -> Result<Self, UsageError> {
        let url = Self::parse(setting, text)?;
        if let BackendUrl::Dynamodb(_) = url {
            return Err(UsageError(format!(
                "{setting}: dynamodb:// is a lease store; the AWS feed sources are kinesis://STREAM and dynamodb-streams://TABLE"
            )));
        }
        if let BackendUrl::Postgres(_) = url {
            return Err(UsageError(format!(
                "{setting}: postgres:// is a lease store; the PostgreSQL feed source is the outbox, postgres-outbox://USER@HOST/DB[?prefix=P]"
            )));
        }
        Ok(url)
    }

    /// The URL as it may be printed: without a password (see [`redact`]) and without the
    /// parameters of ours that a PostgreSQL URL had (`prefix`, `pool_size`).
    pub fn redacted(&self) -> String {
        match self {
            BackendUrl::Sqlite(path) => format!("sqlite://{}", path.display()),
            BackendUrl::Postgres(pg) => redact(&pg.conn),
            BackendUrl::PostgresOutbox(pg) => {
                let url = redact(&pg.conn);
                match url.strip_prefix("postgres://") {
                    Some(rest) => format!("postgres-outbox://{rest}"),
                    None => url,
                }
            }
            BackendUrl::Dynamodb(aws)
            | BackendUrl::Kinesis(aws)
            | BackendUrl::DynamodbStreams(aws) => {
                let scheme = match self {
                    BackendUrl::Dynamodb(_) => "dynamodb",
                    BackendUrl::Kinesis(_) => "kinesis",
                    _ => "dynamodb-streams",
                };
                match &aws.endpoint {
                    Some(endpoint) => format!("{scheme}://{}?endpoint={endpoint}", aws.name),
                    None => format!("{scheme}://{}", aws.name),
                }
            }
            BackendUrl::Cosmos(c) => format!(
                "cosmos://{}/{}/{} at {}",
                c.account,
                c.database,
                c.container,
                c.endpoint()
            ),
        }
    }

    /// Opens the lease store this URL names.
    ///
    /// # Errors
    /// The backend's error when it cannot be opened; a [`UsageError`] for a source-only URL.
    pub async fn open_store(&self) -> anyhow::Result<Arc<dyn LeaseStore>> {
        match self {
            BackendUrl::Sqlite(path) => {
                // The store's error names the file (`lease store open failed for PATH: …`).
                Ok(Arc::new(SqliteLeaseStore::open(path).await?))
            }
            BackendUrl::Postgres(pg) => {
                let store = PostgresLeaseStore::connect_with(pg.options())
                    .await
                    .with_context(|| format!("opening lease store {}", redact(&pg.conn)))?;
                Ok(Arc::new(store))
            }
            BackendUrl::PostgresOutbox(_) => Err(anyhow::Error::new(UsageError(
                "postgres-outbox:// is a feed source, not a lease store".into(),
            ))),
            BackendUrl::Dynamodb(aws) => {
                let store = DynamoLeaseStore::connect(&aws.options(), &aws.name)
                    .await
                    .with_context(|| format!("opening DynamoDB lease table {}", aws.name))?;
                Ok(Arc::new(store))
            }
            BackendUrl::Kinesis(_) => Err(anyhow::Error::new(UsageError(
                "kinesis:// is a feed source, not a lease store".into(),
            ))),
            BackendUrl::DynamodbStreams(_) => Err(anyhow::Error::new(UsageError(
                "dynamodb-streams:// is a feed source, not a lease store".into(),
            ))),
            BackendUrl::Cosmos(cosmos) => Ok(Arc::new(cosmos.open().await?)),
        }
    }

    /// The version of the lease row under `key` as this store holds it, whether or not the
    /// rest of the row can be read (for rewriting a malformed row); `None` if there is no row.
    ///
    /// # Errors
    /// The backend's error; an error saying so for a store that cannot tell (PostgreSQL, until
    /// its malformed-row errors carry the version).
    pub async fn row_version(&self, key: &LeaseKey) -> anyhow::Result<Option<Version>> {
        match self {
            BackendUrl::Sqlite(path) => Ok(SqliteLeaseStore::open(path)
                .await?
                .row_version(key)
                .await?),
            BackendUrl::Dynamodb(aws) => Ok(DynamoLeaseStore::connect(&aws.options(), &aws.name)
                .await?
                .row_version(key)
                .await?),
            BackendUrl::Cosmos(cosmos) => Ok(cosmos.open().await?.row_version(key).await?),
            BackendUrl::Postgres(pg) => Ok(PostgresLeaseStore::connect_with(pg.options())
                .await
                .with_context(|| format!("opening lease store {}", redact(&pg.conn)))?
                .row_version(key)
                .await?),
            _ => Err(anyhow::anyhow!(
                "lease {key}: this store cannot read the version of a row it cannot parse, so the row cannot be rewritten; correct or delete it by hand"
            )),
        }
    }

    /// Opens the feed source this URL names.
    ///
    /// # Errors
    /// The backend's error when it cannot be opened; a [`UsageError`] for a store-only URL.
    pub async fn open_source(&self) -> anyhow::Result<Arc<dyn FeedSource>> {
        self.open_source_with(&ReadOptions::default()).await
    }

    /// As [`BackendUrl::open_source`], a Kinesis source reading as `kinesis` says (the other
    /// sources have no such options).
    ///
    /// # Errors
    /// As for [`BackendUrl::open_source`].
    pub async fn open_source_with(
        &self,
        kinesis: &ReadOptions,
    ) -> anyhow::Result<Arc<dyn FeedSource>> {
        match self {
            BackendUrl::Sqlite(path) => {
                let feed = SqliteFeed::open(path)
                    .await
                    .with_context(|| format!("opening feed {}", path.display()))?;
                Ok(Arc::new(feed))
            }
            BackendUrl::PostgresOutbox(pg) => Ok(Arc::new(open_outbox(pg).await?)),
            BackendUrl::Kinesis(aws) => {
                let options = aws.options();
                let names: Vec<&str> = aws.name.split(',').collect();
                if names.len() == 1 {
                    let feed = KinesisFeed::connect_with(&options, &aws.name, kinesis.clone());
                    return Ok(Arc::new(feed.await.with_retrieval(aws.retrieval.clone())));
                }
                let multi = MultiFeed::new();
                for name in names {
                    let feed = KinesisFeed::connect_with(&options, name, kinesis.clone())
                        .await
                        .with_retrieval(aws.retrieval.clone());
                    multi.add_stream(name, Arc::new(feed)).map_err(|e| {
                        anyhow::Error::new(UsageError(format!("--source: kinesis://: {e}")))
                    })?;
                }
                Ok(Arc::new(multi))
            }
            BackendUrl::DynamodbStreams(aws) => {
                let stream = match &aws.stream {
                    Some(arn) => StreamRef::Arn(arn.clone()),
                    None => StreamRef::Table(aws.name.clone()),
                };
                let read = StreamsOptions::default().with_record(aws.record.unwrap_or_default());
                let feed = DynamoStreamsFeed::connect(&aws.options(), &stream, read)
                    .await
                    .with_context(|| format!("opening the stream of table {}", aws.name))?;
                Ok(Arc::new(feed))
            }
            BackendUrl::Dynamodb(_) => Err(anyhow::Error::new(UsageError(
                "dynamodb:// is a lease store; the AWS feed sources are kinesis://STREAM and dynamodb-streams://TABLE".into(),
            ))),
            BackendUrl::Postgres(_) => Err(anyhow::Error::new(UsageError(
                "postgres:// is a lease store; the PostgreSQL feed source is postgres-outbox://"
                    .into(),
            ))),
            BackendUrl::Cosmos(cosmos) => Ok(Arc::new(cosmos.open_feed().await?)),
        }
    }
}

/// Connects to the outbox `pg` names (creating its tables if missing, not its partitions).
///
/// # Errors
/// The backend's error when it cannot be opened.
pub async fn open_outbox(pg: &PgUrl) -> anyhow::Result<PostgresOutbox> {
    let table = OutboxTable::new(&pg.prefix).map_err(|e| UsageError(format!("prefix: {e}")))?;
    PostgresOutbox::connect(pg.options(), table)
        .await
        .with_context(|| format!("opening outbox {} (prefix {})", redact(&pg.conn), pg.prefix))
}

#[cfg(test)]
mod tests;
