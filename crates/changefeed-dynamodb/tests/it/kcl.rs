//! Importing a KCL 2.x lease table written by the test in KCL's own shape.

use changefeed::lease::LeaseStore;
use changefeed::model::{Continuation, GroupName, LeaseState, Position};
use changefeed_dynamodb::import_kcl;
use changefeed_dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};

use crate::{fresh_store, fresh_table};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcl_leases_are_imported_at_their_checkpoints() {
    // A team moving from Java KCL keeps every checkpoint: no reprocessing, no gap.
    let store = fresh_store("kcl-ours").await;
    let kcl = fresh_table("kcl-app");
    let client = store.client();
    client
        .create_table()
        .table_name(&kcl)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("leaseKey")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("valid"),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("leaseKey")
                .key_type(KeyType::Hash)
                .build()
                .expect("valid"),
        )
        .send()
        .await
        .expect("create the KCL table");
    let s = |v: &str| AttributeValue::S(v.into());
    let n = |v: u64| AttributeValue::N(v.to_string());
    let rows: Vec<(&str, &str, u64, Vec<&str>)> = vec![
        ("shardId-000000000000", "SHARD_END", 0, vec![]),
        (
            "shardId-000000000001",
            "49590338271490256608559692538361571095921575989136588898",
            0,
            vec![],
        ),
        (
            "shardId-000000000002",
            "TRIM_HORIZON",
            0,
            vec!["shardId-000000000000"],
        ),
        ("shardId-000000000003", "LATEST", 0, vec![]),
        (
            "shardId-000000000004",
            "49590338271490256608559692538361571095921575989136588999",
            7,
            vec![],
        ),
        // KCL's multi-stream mode: `account:stream:creationEpoch:shardId`, parents by shard id
        // (or, as some KCL versions write them, by their full key).
        (
            "123456789012:orders:1700000000:shardId-000000000005",
            "49590338271490256608559692538361571095921575989136589000",
            0,
            vec!["shardId-000000000001"],
        ),
        (
            "123456789012:orders:1700000000:shardId-000000000006",
            "TRIM_HORIZON",
            0,
            vec!["123456789012:orders:1700000000:shardId-000000000001"],
        ),
    ];
    for (key, checkpoint, sub, parents) in &rows {
        let mut req = client
            .put_item()
            .table_name(&kcl)
            .item("leaseKey", s(key))
            .item("checkpoint", s(checkpoint))
            .item("checkpointSubSequenceNumber", n(*sub))
            .item("leaseCounter", n(42))
            .item("leaseOwner", s("java-worker-1"))
            .item("ownerSwitchesSinceCheckpoint", n(3));
        if !parents.is_empty() {
            req = req.item(
                "parentShardIds",
                AttributeValue::Ss(parents.iter().map(|p| p.to_string()).collect()),
            );
        }
        req.send().await.expect("write a KCL lease");
    }
    let group = GroupName::new("migrated").expect("valid");
    let report = import_kcl(&store, &kcl, &group).await.expect("import");
    assert_eq!(report.created.len(), 7, "{report:?}");
    assert!(report.skipped.is_empty(), "{report:?}");
    let leases = store.list(&group).await.expect("list").leases;
    let by = |id: &str| {
        leases
            .iter()
            .find(|l| l.key.partition.as_str() == id)
            .unwrap_or_else(|| panic!("{id} imported"))
    };
    assert_eq!(by("shardId-000000000000").state, LeaseState::Finished);
    let l1 = by("shardId-000000000001");
    assert_eq!(
        l1.continuation,
        Some(Continuation::new(
            "49590338271490256608559692538361571095921575989136588898/0"
        )),
        "the sequence-number checkpoint is kept exactly, at its first user record"
    );
    assert_eq!(
        by("shardId-000000000004").continuation,
        Some(Continuation::new(
            "49590338271490256608559692538361571095921575989136588999/7"
        )),
        "a checkpoint inside a KPL aggregate resumes after its user record 7"
    );
    assert_eq!(
        l1.state,
        LeaseState::Available,
        "nobody owns an imported lease"
    );
    let l2 = by("shardId-000000000002");
    assert_eq!(l2.start, Position::Beginning);
    assert_eq!(l2.parents.len(), 1, "parents are kept for lineage");
    assert_eq!(by("shardId-000000000003").start, Position::Now);
    // Multi-stream keys become MultiFeed's "{stream}:{shard}", parents alike.
    for id in ["orders:shardId-000000000005", "orders:shardId-000000000006"] {
        let l = by(id);
        assert_eq!(
            l.parents.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
            ["orders:shardId-000000000001"],
            "{id}"
        );
        assert_eq!(
            l.properties.get("kcl.streamIdentifier").map(String::as_str),
            Some("123456789012:orders:1700000000"),
            "{id}"
        );
    }
    assert_eq!(
        by("orders:shardId-000000000005").continuation,
        Some(Continuation::new(
            "49590338271490256608559692538361571095921575989136589000/0"
        ))
    );
    // Importing again changes nothing.
    let again = import_kcl(&store, &kcl, &group).await.expect("import");
    assert!(again.created.is_empty());
    assert_eq!(again.existing.len(), 7);
}
