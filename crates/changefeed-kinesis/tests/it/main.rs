//! The Kinesis source against kinesis-mock (started by `.ci/run`).
//!
//! Every client here is built from `AwsOptions::local`: static test credentials and a region,
//! so the AWS SDK never asks the EC2 instance-metadata address; tests never leave the machine.

mod e2e;
mod faults;
mod feed;
mod kpl;

use std::sync::atomic::{AtomicU64, Ordering};

use changefeed_kinesis::{AwsOptions, KinesisFeed};

/// The kinesis-mock endpoint, or a panic saying how to start it.
pub fn endpoint() -> String {
    std::env::var("CHANGEFEED_TEST_KINESIS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_KINESIS_URL is not set: start kinesis-mock with `bash .ci/run` \
             (or `eval \"$(bash .ci/aws-services.sh)\"`), which exports \
             CHANGEFEED_TEST_KINESIS_URL=http://127.0.0.1:4568"
        )
    })
}

/// A stream name no other test (or earlier run) uses.
pub fn fresh_stream(prefix: &str) -> String {
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

/// A new, active stream of `shards` shards on kinesis-mock.
pub async fn fresh_feed(prefix: &str, shards: i32) -> KinesisFeed {
    let feed = KinesisFeed::connect(&AwsOptions::local(endpoint()), fresh_stream(prefix)).await;
    feed.create_stream(shards).await.unwrap_or_else(|e| {
        panic!(
            "cannot create a stream on kinesis-mock at {}: {e}",
            endpoint()
        )
    });
    feed
}
