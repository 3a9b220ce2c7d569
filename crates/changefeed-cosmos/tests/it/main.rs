//! The Cosmos DB lease store against `@vercel/cosmosdb-server` (started by `.ci/run` through
//! `.ci/cosmos-server.sh`): the core's lease store conformance suite and fleet scenarios, and
//! what is Cosmos DB's own (paged prefix queries, ids, usage, errors); taking over a .NET
//! change feed processor's lease container; the feed source's listing (`feed.rs`).
//!
//! Every test uses the real server and fails, saying how to start it, when
//! `CHANGEFEED_TEST_COSMOS_URL` is unset or nothing answers there; but the feed source's
//! reading needs a real change feed: it runs against an account or emulator only when
//! `CHANGEFEED_TEST_COSMOS_SOURCE_URL` and `CHANGEFEED_TEST_COSMOS_KEY` are set, and
//! otherwise the test named for it says it did not run (see `feed.rs`).

mod faults;
mod feed;
mod fleet;
mod import;
mod store;

use std::sync::atomic::{AtomicU64, Ordering};

use changefeed_cosmos::{CosmosLeaseStore, CosmosOptions};

/// The local server's endpoint, or a panic saying how to start it.
pub fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_COSMOS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_COSMOS_URL is not set: start the local Cosmos DB server with \
             `eval \"$(bash .ci/cosmos-server.sh)\"` (or run `bash .ci/run`), which exports \
             CHANGEFEED_TEST_COSMOS_URL=http://127.0.0.1:PORT"
        )
    })
}

/// A container name no other test (or earlier run) uses.
pub fn fresh_container(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Options for a fresh container of the test database on the local server.
pub fn fresh_options(prefix: &str) -> CosmosOptions {
    CosmosOptions::new(endpoint(), "changefeed-test", fresh_container(prefix))
}

/// A store on a fresh container of the local server.
pub async fn fresh_store(prefix: &str) -> CosmosLeaseStore {
    connect(&fresh_options(prefix)).await
}

/// A store on the container `options` name, created if absent.
pub async fn connect(options: &CosmosOptions) -> CosmosLeaseStore {
    CosmosLeaseStore::connect(options)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach the local Cosmos DB server at {} ({e}): start it with \
             `eval \"$(bash .ci/cosmos-server.sh)\"`",
                endpoint()
            )
        })
}
