//! The same suites against moto's server, an open-source implementation of the AWS APIs
//! (DynamoDB Local is AWS's own, under AWS's terms): the lease store conformance suite and the
//! DynamoDB Streams source's feed conformance suite. Where the two servers differ is listed in
//! `docs/backends.md`.

use std::time::Duration;

use changefeed::testkit::{feed_source_conformance, lease_store_conformance};
use changefeed_dynamodb::AwsOptions;

use crate::moto_endpoint;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_store_conformance_on_moto() {
    // Every lease store passes the core's suite against each server it is tested on.
    // moto answers one request at a time (.ci/moto-serial.py), so four racing clients wait
    // their turn: a call gets 30 s rather than the store's 1 s, or a create that timed out
    // on the client but was done by the server would be retried and find its own row. moto
    // slows down as a table grows (a few calls a second at thousands of items), so the
    // listing at scale lists 1,000 leases (four 1 MB pages are not reached; the paging itself
    // is checked on DynamoDB Local).
    let timeout = Some(Duration::from_secs(30));
    lease_store_conformance(|| crate::store::fixture(moto_endpoint(), timeout, 1_000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_conformance_on_moto() {
    // The Streams source passes the core's feed suite against moto's Streams API too; moto
    // accepts a sequence number past the shard's last record, so that one refusal is not
    // checked here (DynamoDB Local's run checks it).
    // Its calls get 30 s: moto answers one request at a time, and the lease suite may be
    // running against it at once.
    let options = AwsOptions::local(moto_endpoint()).with_request_timeout(Duration::from_secs(30));
    feed_source_conformance(|| crate::streams::fixture(options.clone(), false, 1_500)).await;
}
