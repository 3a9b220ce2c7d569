//! The DynamoDB lease store against DynamoDB Local (started by `.ci/run`): the core's lease
//! store conformance suite and fleet scenarios, and what is DynamoDB's own (paged lists, KCL
//! import).
//!
//! Every client here is built from `AwsOptions::local`: static test credentials and a region,
//! so the AWS SDK never asks the EC2 instance-metadata address; tests never leave the machine.

mod faults;
mod fleet;
mod kcl;
mod moto;
mod replay;
mod store;
mod streams;
mod streams_errors;
mod streams_lineage;

use std::sync::atomic::{AtomicU64, Ordering};

use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore};

/// The DynamoDB Local endpoint, or a panic saying how to start it.
pub fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with `bash .ci/run` \
             (or `.ci/services.sh`) and export CHANGEFEED_TEST_DYNAMODB_URL=http://127.0.0.1:8000"
        )
    })
}

/// moto's server endpoint (the open-source server the suites also run against), or a panic
/// saying how to start it.
pub fn moto_endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_MOTO_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_MOTO_URL is not set: start moto's server with `scripts/test` \
             (or `eval \"$(bash .ci/moto-server.sh)\"`), which exports \
             CHANGEFEED_TEST_MOTO_URL=http://127.0.0.1:5001"
        )
    })
}

/// A table name no other test (or earlier run) uses.
pub fn fresh_table(prefix: &str) -> String {
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

/// A store on a fresh table of DynamoDB Local.
pub async fn fresh_store(prefix: &str) -> DynamoLeaseStore {
    fresh_store_at(&endpoint(), prefix).await
}

/// A store on a fresh table of the server at `endpoint`.
pub async fn fresh_store_at(endpoint: &str, prefix: &str) -> DynamoLeaseStore {
    DynamoLeaseStore::connect(&AwsOptions::local(endpoint), fresh_table(prefix))
        .await
        .unwrap_or_else(|e| panic!("cannot reach the DynamoDB server at {endpoint}: {e}"))
}
