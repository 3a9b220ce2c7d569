//! The lease store conformance suite and DynamoDB-specific checks.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{
    GroupName, HostName, Lease, LeaseKey, PartitionId, Position, Timestamp, Version,
};
use changefeed::testkit::{lease_store_conformance, Corruption, LeaseStoreFixture};
use changefeed_dynamodb::sdk::types::AttributeValue;
use changefeed_dynamodb::{
    heartbeat_pk, lease_pk, AwsOptions, DynamoLeaseStore, DEFAULT_HEARTBEAT_SHARDS, PK, SK,
};

use crate::{endpoint, fresh_store, fresh_store_at};

struct Fixture {
    store: DynamoLeaseStore,
    options: AwsOptions,
    at_scale: usize,
}

/// A fixture on a fresh table of the server at `endpoint`, its handles' calls each given
/// `request_timeout` (`None`: the store's default), listing `at_scale` leases in the check at
/// scale.
pub async fn fixture(
    endpoint: String,
    request_timeout: Option<std::time::Duration>,
    at_scale: usize,
) -> Box<dyn LeaseStoreFixture> {
    let mut options = AwsOptions::local(&endpoint);
    if let Some(t) = request_timeout {
        options = options.with_request_timeout(t);
    }
    Box::new(Fixture {
        store: fresh_store_at(&endpoint, "conf").await,
        options,
        at_scale,
    })
}

#[async_trait]
impl LeaseStoreFixture for Fixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        // A new client (and connection pool) per handle, so racing handles really race.
        let config = self
            .options
            .load_with(changefeed_dynamodb::Timeouts::DYNAMODB)
            .await;
        Arc::new(DynamoLeaseStore::new(
            changefeed_dynamodb::sdk::Client::new(&config),
            self.store.table(),
        ))
    }

    fn keeps_view(&self) -> bool {
        true
    }

    fn leases_at_scale(&self) -> usize {
        self.at_scale
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
            .expect("corrupting an item");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance() {
    // Every lease store passes the core's suite against its real server (DESIGN.md).
    lease_store_conformance(|| fixture(endpoint(), None, 10_000)).await;
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

/// Writes a heartbeat row as a process older than sharding does: a plain put under
/// `H#<group>`, without the layout mark.
async fn old_process_heartbeat(store: &DynamoLeaseStore, group: &GroupName, host: &str) {
    store
        .client()
        .put_item()
        .table_name(store.table())
        .item(PK, AttributeValue::S(heartbeat_pk(group)))
        .item(SK, AttributeValue::S(format!("host#{host}")))
        .item("incarnation", AttributeValue::S(format!("inc-{host}")))
        .item("version", AttributeValue::N("1".into()))
        .item("written_at", AttributeValue::N("0".into()))
        .send()
        .await
        .expect("an old process's heartbeat put");
}

async fn keys_holding(store: &DynamoLeaseStore, pk: &str) -> usize {
    store
        .client()
        .query()
        .table_name(store.table())
        .key_condition_expression("pk = :pk")
        .expression_attribute_values(":pk", AttributeValue::S(pk.into()))
        .consistent_read(true)
        .send()
        .await
        .expect("query")
        .items()
        .iter()
        .filter(|i| matches!(i.get(SK), Some(AttributeValue::S(sk)) if sk.starts_with("host#")))
        .count()
}

async fn register(store: &DynamoLeaseStore, g: &GroupName, hosts: std::ops::Range<u32>) {
    for i in hosts {
        let h = HostName::new(format!("h{i:02}")).expect("valid");
        store
            .heartbeat(
                g,
                &h,
                "inc",
                Timestamp(1),
                None,
                HeartbeatRole::Member,
                None,
            )
            .await
            .expect("register");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_grows_from_one_heartbeat_key_to_its_shards_once_its_fleet_outgrows_the_key() {
    // A small fleet pays for one heartbeat query per leader cycle, not one per empty shard;
    // a large one spreads its renewals so that no key takes them all.
    let store = fresh_store("grow").await.with_heartbeat_shards_at(30);
    let g = GroupName::new("g").expect("valid");
    register(&store, &g, 0..29).await;
    let m = store.membership(&g).await.expect("membership");
    assert_eq!(m.hosts.len(), 29);
    assert_eq!(
        keys_holding(&store, &heartbeat_pk(&g)).await,
        29,
        "below the threshold every row stays on the one key"
    );
    assert_eq!(futures_max(&store, &g, DEFAULT_HEARTBEAT_SHARDS).await, 0);

    register(&store, &g, 29..30).await;
    let m = store
        .membership(&g)
        .await
        .expect("the read that finds 30 hosts");
    assert_eq!(m.hosts.len(), 30);
    // Each host moves its row at its next renewal.
    for host in &m.hosts {
        store
            .heartbeat(
                &g,
                &host.host,
                "inc",
                Timestamp(2),
                Some(host.version),
                HeartbeatRole::Member,
                None,
            )
            .await
            .expect("a renewal moves the row to its shard");
    }
    assert_eq!(
        keys_holding(&store, &heartbeat_pk(&g)).await,
        0,
        "every row moved off the one key"
    );
    let busiest = futures_max(&store, &g, DEFAULT_HEARTBEAT_SHARDS).await;
    assert!(
        busiest < 30 && busiest > 0,
        "rows spread: busiest shard holds {busiest}"
    );
    // A host of another process learns the count from the head and registers in its shard.
    let other = DynamoLeaseStore::new(store.client().clone(), store.table());
    other.head(&g).await.expect("head");
    register(&other, &g, 30..31).await;
    assert_eq!(keys_holding(&store, &heartbeat_pk(&g)).await, 0);
    let m = DynamoLeaseStore::new(store.client().clone(), store.table())
        .membership(&g)
        .await
        .expect("membership");
    assert_eq!(m.hosts.len(), 31, "membership reads every shard");
    assert_eq!(
        m.hosts.iter().filter(|h| h.version == Version(2)).count(),
        30,
        "the moved rows at their renewed version"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_told_to_shard_from_the_first_host_spreads_a_new_groups_rows_at_once() {
    let store = fresh_store("shards").await.with_heartbeat_shards_at(1);
    let g = GroupName::new("g").expect("valid");
    register(&store, &g, 0..40).await;
    assert_eq!(
        keys_holding(&store, &heartbeat_pk(&g)).await,
        0,
        "none on the one key"
    );
    let busiest = futures_max(&store, &g, DEFAULT_HEARTBEAT_SHARDS).await;
    assert!(
        busiest < 40 && busiest > 0,
        "rows spread: busiest shard holds {busiest}"
    );
    let other = DynamoLeaseStore::new(store.client().clone(), store.table());
    let m = other.membership(&g).await.expect("membership");
    assert_eq!(m.hosts.len(), 40, "membership reads every shard");
}

async fn futures_max(store: &DynamoLeaseStore, g: &GroupName, shards: u32) -> usize {
    let mut max = 0;
    for k in 0..shards {
        max = max.max(keys_holding(store, &format!("{}#{k}", heartbeat_pk(g))).await);
    }
    max
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_layout_group_is_sharded_only_once_no_old_process_heartbeats() {
    // A fleet in a rolling upgrade keeps one key: an old process reads only `H#<group>`, and
    // would not see hosts that moved (it would take their leases).
    let store = fresh_store("migrate").await;
    let g = GroupName::new("g").expect("valid");
    old_process_heartbeat(&store, &g, "old").await;
    let new = DynamoLeaseStore::new(store.client().clone(), store.table());
    let row = new
        .heartbeat(
            &g,
            &HostName::new("new").expect("valid"),
            "inc",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("a new process joins");
    assert_eq!(
        keys_holding(&store, &heartbeat_pk(&g)).await,
        2,
        "a group with an old-layout row stays on one key"
    );
    let err = new
        .set_heartbeat_shards(&g, 8)
        .await
        .expect_err("refused while an old process heartbeats");
    assert!(
        format!("{err:?}").contains("hosts old of group g"),
        "the refusal names the old host: {err:?}"
    );
    // The old process stops (its row is removed); now the operator may shard.
    new.remove_heartbeat(
        &g,
        &HostName::new("old").expect("valid"),
        "inc-old",
        Version(1),
    )
    .await
    .expect("remove the old row");
    new.set_heartbeat_shards(&g, 8).await.expect("sharded");
    // The next renewal, after a head read, moves the row; membership never misses it.
    new.head(&g).await.expect("head");
    let moved = new
        .heartbeat(
            &g,
            &row.host,
            "inc",
            Timestamp(2),
            Some(row.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("renewal moves the row");
    assert_eq!(moved.version, row.version.next());
    assert_eq!(
        keys_holding(&store, &heartbeat_pk(&g)).await,
        0,
        "moved off the old key"
    );
    let m = store.membership(&g).await.expect("membership");
    assert_eq!(m.hosts.len(), 1);
    assert_eq!(m.hosts[0].version, moved.version);
    assert!(
        new.set_heartbeat_shards(&g, 4).await.is_err(),
        "a sharded group's count is not changed again"
    );
    assert!(
        new.set_heartbeat_shards(&g, 0).await.is_err(),
        "0 shards is refused by name"
    );
}
