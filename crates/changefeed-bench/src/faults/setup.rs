//! Where a fault fleet runs: the lease store's backend, the source (a PostgreSQL outbox or a
//! Kinesis stream), the proxies' upstream addresses and URLs with `{addr}` where a proxy's
//! address goes.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use changefeed::lease::LeaseStore;
use changefeed_postgres::{PgOptions, PostgresLeaseStore};

use super::source::{kinesis_feed, SourceBackend};
use super::{Setup, Timings};

/// `host:port` of a `scheme://[user@]host[:port]/…` URL, and the URL with `{addr}` in its place.
pub(super) fn split_addr(url: &str) -> anyhow::Result<(String, String)> {
    let (scheme, rest) = url.split_once("://").context("a URL with a scheme")?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let upstream = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5432")
    };
    Ok((upstream, format!("{scheme}://{userinfo}{{addr}}{tail}")))
}

/// The lease store a fleet runs on.
#[derive(Debug, Clone)]
pub enum StoreBackend {
    /// The same PostgreSQL server as the outbox.
    Postgres,
    /// DynamoDB Local (or another DynamoDB endpoint) at this `http://host:port`.
    Dynamodb(String),
    /// A Cosmos DB server (the emulator or a local server) at this `http://host:port`.
    Cosmos(String),
}

impl StoreBackend {
    /// The name in RESULT lines and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            StoreBackend::Postgres => "postgres",
            StoreBackend::Dynamodb(_) => "dynamodb",
            StoreBackend::Cosmos(_) => "cosmos",
        }
    }
}

/// A fleet on `backend` reading `source`, with PostgreSQL (the outbox, and the store of
/// [`StoreBackend::Postgres`]) at `pg_url` (a plain `postgres://` URL), under a fresh table
/// prefix (the Kinesis stream's name too), the ledger and logs in a new temporary directory
/// (kept, so that a failure can be read).
///
/// # Errors
///
/// A server cannot be reached, or the directory cannot be made.
pub async fn setup(
    changefeed: &Path,
    backend: StoreBackend,
    source: SourceBackend,
    pg_url: &str,
    hosts: usize,
    partitions: u32,
    timings: Timings,
) -> anyhow::Result<Setup> {
    let prefix = format!(
        "flt{}p{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
            % 10_000_000_000,
        std::process::id()
    );
    let (pg_upstream, template) = split_addr(pg_url)?;
    let sep = if template.contains('?') { '&' } else { '?' };
    let (store_url, store_upstream, store): (String, String, Arc<dyn LeaseStore>) = match &backend {
        StoreBackend::Postgres => {
            let store = PostgresLeaseStore::connect_with(
                PgOptions::new(pg_url.to_string())
                    .prefix(prefix.clone())
                    .pool_size(2),
            )
            .await
            .with_context(|| format!("connect to PostgreSQL at {pg_upstream}"))?;
            (
                format!("{template}{sep}prefix={prefix}"),
                pg_upstream.clone(),
                Arc::new(store),
            )
        }
        StoreBackend::Dynamodb(endpoint) => {
            let (upstream, _) = split_addr(endpoint)?;
            let table = prefix.replace('_', "-");
            let config = changefeed_dynamodb::AwsOptions::local(endpoint.clone())
                .load()
                .await;
            let store = changefeed_dynamodb::DynamoLeaseStore::new(
                changefeed_dynamodb::sdk::Client::new(&config),
                &table,
            );
            store
                .ensure_table()
                .await
                .with_context(|| format!("DynamoDB at {endpoint}"))?;
            (
                format!("dynamodb://{table}?endpoint=http://{{addr}}&region=us-east-1"),
                upstream,
                Arc::new(store),
            )
        }
        StoreBackend::Cosmos(endpoint) => {
            let (upstream, _) = split_addr(endpoint)?;
            let options =
                changefeed_cosmos::CosmosOptions::new(endpoint.clone(), "faults", &prefix);
            let store = changefeed_cosmos::CosmosLeaseStore::connect(&options)
                .await
                .with_context(|| format!("Cosmos DB at {endpoint}"))?;
            (
                format!("cosmos://local/faults/{prefix}?endpoint=http://{{addr}}"),
                upstream,
                Arc::new(store),
            )
        }
    };
    let (source_url, source_upstream) = match &source {
        SourceBackend::Outbox => (
            format!(
                "{}{sep}prefix={prefix}",
                template.replacen("postgres://", "postgres-outbox://", 1)
            ),
            pg_upstream,
        ),
        SourceBackend::Kinesis(endpoint) => {
            let (upstream, _) = split_addr(endpoint)?;
            kinesis_feed(endpoint, &prefix)
                .await
                .create_stream(i32::try_from(partitions)?)
                .await
                .with_context(|| format!("create a stream on Kinesis at {endpoint}"))?;
            (
                format!("kinesis://{prefix}?endpoint=http://{{addr}}&region=us-east-1"),
                upstream,
            )
        }
    };
    let dir = tempfile::Builder::new().prefix("faults").tempdir()?.keep();
    Ok(Setup {
        changefeed: changefeed.to_path_buf(),
        backend: backend.name().to_string(),
        store_url,
        store_upstream,
        store,
        source,
        source_url,
        pg_url: pg_url.to_string(),
        source_upstream,
        prefix,
        hosts,
        partitions,
        timings,
        dir,
    })
}

#[cfg(test)]
mod tests {
    use super::split_addr;

    #[test]
    fn the_address_is_cut_out_of_a_url_and_a_placeholder_put_in_its_place() {
        let (upstream, template) =
            split_addr("postgres://postgres@127.0.0.1:5433/test?sslmode=disable").expect("a URL");
        assert_eq!(upstream, "127.0.0.1:5433");
        assert_eq!(template, "postgres://postgres@{addr}/test?sslmode=disable");
        let (upstream, template) = split_addr("http://127.0.0.1:4568").expect("a URL");
        assert_eq!(upstream, "127.0.0.1:4568");
        assert_eq!(template, "http://{addr}");
        let (upstream, _) = split_addr("postgres://db/test").expect("a URL");
        assert_eq!(upstream, "db:5432", "PostgreSQL's port when none is given");
    }
}
