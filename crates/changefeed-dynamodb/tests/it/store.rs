//! The lease store conformance suite and DynamoDB-specific checks.

use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
use changefeed::testkit::{lease_store_conformance, Corruption, LeaseStoreFixture};
use changefeed_dynamodb::sdk::types::AttributeValue;
use changefeed_dynamodb::{lease_pk, AwsOptions, DynamoLeaseStore, PK, SK};

use crate::{endpoint, fresh_store};

struct Fixture {
    store: DynamoLeaseStore,
}

#[async_trait]
impl LeaseStoreFixture for Fixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        // A new client (and connection pool) per handle, so racing handles really race.
        let config = AwsOptions::local(endpoint()).load().await;
        Arc::new(DynamoLeaseStore::new(
            changefeed_dynamodb::sdk::Client::new(&config),
            self.store.table(),
        ))
    }

    fn keeps_view(&self) -> bool {
        true
    }

    async fn corrupt(&self, key: &LeaseKey, how: Corruption) {
        let (attr, value) = match how {
            Corruption::BadPropertiesJson => ("properties", "{not json"),
            Corruption::UnknownState => ("state", "bogus"),
        };
        self.store
            .client()
            .update_item()
            .table_name(self.store.table())
            .key(PK, AttributeValue::S(lease_pk(&key.group)))
            .key(SK, AttributeValue::S(key.partition.to_string()))
            .update_expression("SET #a = :v")
            .expression_attribute_names("#a", attr)
            .expression_attribute_values(":v", AttributeValue::S(value.into()))
            .send()
            .await
            .expect("corrupting an item of DynamoDB Local");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance() {
    // Every lease store passes the core's suite against its real server (DESIGN.md).
    lease_store_conformance(|| async {
        Box::new(Fixture {
            store: fresh_store("conf").await,
        }) as Box<dyn LeaseStoreFixture>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_is_a_paginated_query_and_reports_capacity() {
    // list pages through one partition-key range (1 MB pages) and DynamoDB reports what it cost.
    let store = fresh_store("page").await;
    let group = GroupName::new("g").expect("valid");
    let mut lease = Lease::new(
        LeaseKey::new(group.clone(), PartitionId::new("p").expect("valid")),
        Position::Beginning,
    );
    // Big properties so 600 leases span several 1 MB query pages.
    lease.properties.insert("pad".into(), "x".repeat(5_000));
    for i in 0..600 {
        lease.key.partition = PartitionId::new(format!("{i:04}")).expect("valid");
        store.create(&lease).await.expect("create").expect("new");
    }
    let before = store.capacity();
    let listing = store.list(&group).await.expect("list");
    assert_eq!(listing.leases.len(), 600);
    let after = store.capacity();
    assert!(
        after.calls >= before.calls + 3,
        "several pages: {before:?} -> {after:?}"
    );
    assert!(after.read_units > before.read_units, "reads are accounted");
}
