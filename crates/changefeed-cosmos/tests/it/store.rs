//! The lease store conformance suite and what is Cosmos DB's own.

use changefeed::lease::{HeartbeatRole, MembershipStore};
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::LeaseStore;
use changefeed::model::{
    GroupName, HostName, Lease, LeaseKey, LeaseState, MembershipView, PartitionId, Position,
    Timestamp, Version, ViewHost,
};
use changefeed::testkit::{lease_store_conformance, Corruption, LeaseStoreFixture};
use changefeed::LeaseError;
use changefeed_cosmos::doc::{lease_id, DELETION_PREFIX};
use changefeed_cosmos::{CosmosLeaseStore, CosmosOptions};

use crate::{connect, fresh_options, fresh_store};

/// Deletions kept for `list_changes`, in counter moves: short, so the suite's horizon check
/// (which writes twice as many) stays quick.
const HORIZON: u64 = 64;

struct Fixture {
    options: CosmosOptions,
    store: CosmosLeaseStore,
}

#[async_trait]
impl LeaseStoreFixture for Fixture {
    async fn connect(&self) -> Arc<dyn LeaseStore> {
        // A new HTTP client (connection pool) per handle, so racing handles really race.
        Arc::new(CosmosLeaseStore::new(&self.options).expect("valid options"))
    }

    async fn corrupt(&self, key: &LeaseKey, how: Corruption) {
        let id = lease_id(key.partition.as_str());
        let mut doc = self
            .store
            .read_document(&key.group, &id)
            .await
            .expect("reading a document of the local server")
            .unwrap_or_else(|| panic!("no document {id} to corrupt"));
        let (field, value) = match how {
            Corruption::BadPropertiesJson => ("properties", "{not json"),
            Corruption::UnknownState => ("state", "bogus"),
        };
        doc[field] = value.into();
        self.store
            .overwrite_document(&key.group, &doc)
            .await
            .expect("overwriting a document of the local server");
    }

    fn answers_changes(&self) -> bool {
        true
    }

    fn keeps_view(&self) -> bool {
        true
    }

    fn changes_horizon(&self) -> Option<u64> {
        Some(HORIZON)
    }

    async fn deletion_records(&self, group: &GroupName) -> Option<u64> {
        let ids = self
            .store
            .document_ids(group, DELETION_PREFIX)
            .await
            .expect("querying the local server");
        Some(ids.len() as u64)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance() {
    // Every lease store passes the core's suite against its real server (DESIGN.md).
    lease_store_conformance(|| async {
        let options = fresh_options("conf").changes_kept(HORIZON);
        let store = connect(&options).await;
        Box::new(Fixture { options, store }) as Box<dyn LeaseStoreFixture>
    })
    .await;
}

fn group(name: &str) -> GroupName {
    GroupName::new(name).expect("valid")
}

fn key(g: &str, p: &str) -> LeaseKey {
    LeaseKey::new(group(g), PartitionId::new(p).expect("valid"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_through_a_prefix_query() {
    // list is one single-partition prefix query, followed page by page (continuation tokens).
    let options = fresh_options("page").page_size(7);
    let store = connect(&options).await;
    for i in 0..50 {
        let lease = Lease::new(key("g", &format!("{i:03}")), Position::Beginning);
        store.create(&lease).await.expect("create").expect("new");
    }
    // Another group's leases, and this group's heartbeat, are not listed.
    store
        .create(&Lease::new(key("other", "000"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    store
        .heartbeat(
            &group("g"),
            &HostName::new("h").expect("valid"),
            "inc",
            changefeed::model::Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("heartbeat");
    let before = store.usage();
    let listing = store.list(&group("g")).await.expect("list");
    let after = store.usage();
    let ids: Vec<String> = listing
        .leases
        .iter()
        .map(|l| l.key.partition.to_string())
        .collect();
    let expected: Vec<String> = (0..50).map(|i| format!("{i:03}")).collect();
    assert_eq!(
        ids, expected,
        "every lease of the group, in partition order"
    );
    assert_eq!(
        after.requests - before.requests,
        8,
        "50 leases in pages of 7: 8 pages"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_changes_are_one_batch_and_checkpoints_one_put() {
    // What a write costs: a take is one transactional batch (lease + change counter) once the
    // handle knows the counter's ETag; a checkpoint is one conditional PUT and leaves the
    // counter alone. The documents hold the documented fields.
    let store = fresh_store("cost").await;
    let g = group("cost");
    let created = store
        .create(&Lease::new(key("cost", "p/1"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    let mut take = created.clone();
    take.state = LeaseState::Owned;
    take.owner = Some(HostName::new("a").expect("valid"));
    let before = store.usage();
    let taken = store.replace(&take, created.version).await.expect("take");
    assert_eq!(
        store.usage().requests - before.requests,
        1,
        "a take is one batch"
    );
    let mut checkpoint = taken.clone();
    checkpoint.continuation = Some(changefeed::model::Continuation::new("42"));
    let before = store.usage();
    let done = store
        .replace(&checkpoint, taken.version)
        .await
        .expect("checkpoint");
    assert_eq!(
        store.usage().requests - before.requests,
        1,
        "a checkpoint is one PUT"
    );
    assert_eq!(
        store
            .membership(&g)
            .await
            .expect("membership")
            .change_counter,
        2
    );

    let doc = store
        .read_document(&g, &lease_id("p/1"))
        .await
        .expect("read")
        .expect("present");
    assert_eq!(
        doc["id"], "lease.p~2F1",
        "ids escape what Cosmos DB refuses"
    );
    assert_eq!(doc["group"], "cost", "the partition key is the group");
    assert_eq!(doc["partition"], "p/1");
    assert_eq!(doc["state"], "owned");
    assert_eq!(doc["owner"], "a");
    assert_eq!(doc["continuation"], "42");
    assert_eq!(doc["start"], "beginning");
    assert_eq!(doc["version"], done.version.0);
    assert_eq!(
        doc["changed_at"], 2,
        "stamped by the take, not the checkpoint"
    );
    assert!(doc["properties"].is_object());
    let counter = store
        .read_document(&g, "counter")
        .await
        .expect("read")
        .expect("present");
    assert_eq!(counter["counter"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_handle_learns_the_current_row_from_the_conflict() {
    // A CAS lost to another handle (another process) is a Conflict carrying the current row,
    // read after the 412, and the loser's next write at that version goes through.
    let store = fresh_store("stale").await;
    let other = store.handle();
    let v1 = store
        .create(&Lease::new(key("s", "0"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    // Both handles know version 1 and its ETag.
    other.get(&v1.key).await.expect("get");
    let mut cp = v1.clone();
    cp.continuation = Some(changefeed::model::Continuation::new("1"));
    let v2 = other.replace(&cp, v1.version).await.expect("checkpoint");
    let mut late = v1.clone();
    late.continuation = Some(changefeed::model::Continuation::new("0"));
    match store.replace(&late, v1.version).await {
        Err(LeaseError::Conflict { current, .. }) => assert_eq!(*current, v2),
        other => panic!("expected a Conflict, got {other:?}"),
    }
    let mut next = v2.clone();
    next.continuation = Some(changefeed::model::Continuation::new("2"));
    store
        .replace(&next, v2.version)
        .await
        .expect("at the current version");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_there_is_a_retryable_error_naming_the_request() {
    // Nothing listens on port 1: the error says which request failed and may be retried.
    let options = CosmosOptions::new("http://127.0.0.1:1", "db", "leases")
        .timeout(std::time::Duration::from_secs(5));
    let err = CosmosLeaseStore::connect(&options)
        .await
        .expect_err("nothing listens there");
    assert!(err.is_retryable(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("ensure_container") && text.contains("POST dbs"),
        "{text}"
    );
    // Settings that cannot work are refused by name, before any request.
    let bad_key = CosmosOptions::new(crate::endpoint(), "db", "leases").key("not base64!");
    let err = CosmosLeaseStore::new(&bad_key).expect_err("bad key");
    assert!(err.to_string().contains("setting key"), "{err}");
    assert!(
        !err.to_string().contains("not base64!"),
        "the key is never shown: {err}"
    );
    let bad_endpoint = CosmosOptions::new("ftp://x", "db", "leases");
    let err = CosmosLeaseStore::new(&bad_endpoint).expect_err("bad endpoint");
    assert!(err.to_string().contains("setting endpoint"), "{err}");
    let bad_container = CosmosOptions::new(crate::endpoint(), "db", "a/b");
    let err = CosmosLeaseStore::new(&bad_container).expect_err("bad container");
    assert!(err.to_string().contains("setting container"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_row_is_deleted_at_its_stored_version() {
    // The repair path (`changefeed reset --force` on other stores): row_version reads the
    // version of a row nothing else of can be read, and delete removes it at that version,
    // moving the counter like any delete.
    let store = fresh_store("repair").await;
    let g = group("r");
    let lease = store
        .create(&Lease::new(key("r", "0"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    let mut doc = store
        .read_document(&g, &lease_id("0"))
        .await
        .expect("read")
        .expect("present");
    doc["state"] = "bogus".into();
    store.overwrite_document(&g, &doc).await.expect("overwrite");
    let fresh = store.handle();
    assert!(matches!(
        fresh.get(&lease.key).await,
        Err(LeaseError::Malformed { .. })
    ));
    let version = fresh
        .row_version(&lease.key)
        .await
        .expect("row_version")
        .expect("present");
    assert_eq!(version, lease.version);
    let before = fresh
        .membership(&g)
        .await
        .expect("membership")
        .change_counter;
    fresh.delete(&lease.key, version).await.expect("delete");
    assert!(fresh.get(&lease.key).await.expect("get").is_none());
    assert_eq!(
        fresh
            .membership(&g)
            .await
            .expect("membership")
            .change_counter,
        before + 1
    );
}

fn view_of(leader: &str, heartbeat: u64, live: &[&str]) -> MembershipView {
    MembershipView {
        version: 0,
        leader: HostName::new(leader).expect("valid"),
        leader_incarnation: format!("inc-{leader}").into(),
        leader_heartbeat: Version(heartbeat),
        live: live
            .iter()
            .map(|h| ViewHost::new(HostName::new(*h).expect("valid"), format!("inc-{h}").into()))
            .collect(),
        dead: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_document_of_a_version_without_views_reads_as_no_view_and_takes_one() {
    // A group written before the view existed (its counter document holds only the counter)
    // reads as "no view yet"; the first view goes in beside the counter, ownership batches
    // keep it, and it is in the documented fields.
    let store = fresh_store("view-old").await;
    let g = group("view-old");
    store
        .create(&Lease::new(key("view-old", "p"), Position::Beginning))
        .await
        .expect("create")
        .expect("new");
    let old = serde_json::json!({"id": "counter", "group": "view-old", "counter": 1, "deletions_from": 0});
    store.overwrite_document(&g, &old).await.expect("old shape");
    let other = store.handle();
    let head = other
        .head(&g)
        .await
        .expect("head")
        .expect("a store with views");
    assert_eq!((head.change_counter, head.view), (1, None), "no view yet");

    let written = other
        .write_view(&g, &view_of("a", 3, &["a", "b"]), 0)
        .await
        .expect("first view");
    assert_eq!(written.version, 1);
    let lease = store.list(&g).await.expect("list").leases[0].clone();
    let mut taken = Lease::clone(&lease);
    taken.state = LeaseState::Owned;
    taken.owner = Some(HostName::new("b").expect("valid"));
    store.replace(&taken, lease.version).await.expect("take");
    let head = store.handle().head(&g).await.expect("head").expect("view");
    assert_eq!(head.change_counter, 2, "the take moved the counter");
    assert_eq!(head.view, Some(written), "and kept the view");

    let counter = store
        .read_document(&g, "counter")
        .await
        .expect("read")
        .expect("present");
    assert_eq!(counter["counter"], 2);
    assert_eq!(counter["view_version"], 1);
    assert_eq!(counter["view_leader"], "a");
    assert_eq!(counter["view_incarnation"], "inc-a");
    assert_eq!(counter["view_leader_heartbeat"], 3);
    assert_eq!(counter["view_parts"], 1);
    let body = counter["view_body"].as_str().expect("a body id");
    assert_eq!(
        store.document_ids(&g, "view.").await.expect("ids"),
        vec![format!("view.{body}.0")],
        "one body document"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_is_one_read_and_a_leaders_renewal_one_batch() {
    // What the view costs on Cosmos DB: a follower's head is one point read once it has the
    // body; the leader's renewal with the copy is one transactional batch; a new judgment
    // leaves one body behind it (the one just replaced) and removes older ones.
    let store = fresh_store("view-cost").await;
    let g = group("view-cost");
    let a = HostName::new("a").expect("valid");
    let hb = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("register");
    let v1 = store
        .write_view(&g, &view_of("a", hb.version.0, &["a"]), 0)
        .await
        .expect("view");
    let follower = store.handle();
    follower.head(&g).await.expect("head");
    let before = follower.usage();
    let head = follower.head(&g).await.expect("head").expect("view");
    assert_eq!(
        follower.usage().requests - before.requests,
        1,
        "a head whose body the handle has is one point read"
    );
    assert_eq!(head.view.as_ref().map(|v| v.version), Some(v1.version));

    let before = store.usage();
    let renewed = store
        .heartbeat(
            &g,
            &a,
            "inc-a",
            Timestamp(2),
            Some(hb.version),
            HeartbeatRole::Leader,
            None,
        )
        .await
        .expect("lead renewal");
    assert_eq!(
        store.usage().requests - before.requests,
        1,
        "the renewal and the copy are one batch"
    );
    let head = follower.head(&g).await.expect("head").expect("view");
    assert_eq!(head.view.map(|v| v.leader_heartbeat), Some(renewed.version));

    let v2 = store
        .write_view(
            &g,
            &view_of("a", renewed.version.0, &["a", "b"]),
            v1.version,
        )
        .await
        .expect("second");
    let v3 = store
        .write_view(
            &g,
            &view_of("a", renewed.version.0, &["a", "c"]),
            v2.version,
        )
        .await
        .expect("third");
    let bodies = store.document_ids(&g, "view.").await.expect("ids");
    assert_eq!(
        bodies.len(),
        2,
        "the current body and the one it replaced: {bodies:?}"
    );
    let head = store.handle().head(&g).await.expect("head").expect("view");
    assert_eq!(head.view, Some(v3));
}
