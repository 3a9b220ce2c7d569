//! The console's view against scripted store changes on the in-memory store, on virtual time.

use super::*;
use crate::http::tests::body;
use changefeed::clock::VirtualClock;
use changefeed::lease::MemoryLeaseStore;
use changefeed::model::{
    Heartbeat, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position, Timestamp,
};

fn settings() -> Settings {
    Settings {
        list_every: Duration::from_secs(60),
        fence_after: Duration::from_secs(2),
        expire_after: Duration::from_secs(3),
        handoff_timeout: Duration::from_secs(5),
        window: Duration::from_secs(120),
    }
}

/// A group `g` in a memory store, with helpers to write what hosts would.
struct Script {
    store: Arc<MemoryLeaseStore>,
    group: GroupName,
}

impl Script {
    fn new() -> Self {
        Self {
            store: Arc::new(MemoryLeaseStore::new()),
            group: GroupName::new("g").expect("group"),
        }
    }

    fn key(&self, p: &str) -> LeaseKey {
        LeaseKey::new(self.group.clone(), PartitionId::new(p).expect("partition"))
    }

    async fn create(&self, p: &str, parents: &[&str]) {
        let parents = parents
            .iter()
            .map(|x| PartitionId::new(*x).expect("partition"))
            .collect();
        let lease = Lease::new(self.key(p), Position::Beginning).with_parents(parents);
        self.store.create(&lease).await.expect("create");
    }

    /// Rewrites lease `p` with `edit`, as a host's compare-and-swap would.
    async fn write(&self, p: &str, edit: impl FnOnce(&mut Lease)) {
        let mut lease = self
            .store
            .get(&self.key(p))
            .await
            .expect("get")
            .expect("exists");
        let expected = lease.version;
        edit(&mut lease);
        self.store.replace(&lease, expected).await.expect("replace");
    }

    async fn own(&self, p: &str, owner: Option<&str>, next: Option<&str>) {
        self.write(p, |l| {
            l.owner = owner.map(host);
            l.next_owner = next.map(host);
            l.state = if owner.is_some() {
                LeaseState::Owned
            } else {
                LeaseState::Available
            };
        })
        .await;
    }

    async fn beat(&self, h: &str, last: Option<&Heartbeat>) -> Heartbeat {
        self.store
            .heartbeat(
                &self.group,
                &host(h),
                &format!("inc-{h}"),
                Timestamp(0),
                last.map(|b| b.version),
            )
            .await
            .expect("heartbeat")
    }

    fn watch(&self) -> Watch {
        Watch::new(
            self.store.clone(),
            None,
            self.group.clone(),
            settings(),
            Arc::new(VirtualClock::new(Timestamp(1_000_000))),
        )
    }
}

fn host(h: &str) -> HostName {
    HostName::new(h).expect("host")
}

/// The events since the `seen`th, as `kind text`.
fn new_events(watch: &Watch, seen: &mut usize) -> Vec<String> {
    let out = watch
        .events
        .iter()
        .skip(*seen)
        .map(|e| format!("{} {}", e.change.kind, e.change.text))
        .collect();
    *seen = watch.events.len();
    out
}

#[tokio::test(start_paused = true)]
async fn events_are_derived_from_successive_reads_of_the_store() {
    // Issue 22: the console derives takes, requests, hand-offs, fencing, expiry, takes of
    // expired leases, splits, deletions and departures from the rows alone.
    let s = Script::new();
    for p in ["0", "1", "2"] {
        s.create(p, &[]).await;
    }
    let mut a = s.beat("a", None).await;
    let mut b = s.beat("b", None).await;
    s.own("0", Some("a"), None).await;
    s.own("1", Some("b"), None).await;
    let mut w = s.watch();
    let mut seen = 0;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        Vec::<String>::new(),
        "the first read is the baseline"
    );

    s.own("2", Some("a"), None).await;
    w.refresh().await.expect("refresh");
    assert_eq!(new_events(&w, &mut seen), ["take a took 2"]);

    s.own("0", Some("a"), Some("b")).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["request b asked a to hand off 0"]
    );

    s.own("0", Some("b"), None).await;
    w.refresh().await.expect("refresh");
    assert_eq!(new_events(&w, &mut seen), ["handoff a handed 0 off to b"]);

    // a stops heartbeating; b goes on.
    tokio::time::advance(Duration::from_millis(2_100)).await;
    b = s.beat("b", Some(&b)).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["fence a fenced: heartbeat unchanged for 2.1s"]
    );
    tokio::time::advance(Duration::from_millis(1_000)).await;
    b = s.beat("b", Some(&b)).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["expire a expired: heartbeat unchanged for 3.1s"]
    );
    s.own("2", Some("b"), None).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["take b took 2 from a (expired)"]
    );

    // A request left pending past the hand-off timeout ends in a steal.
    a = s.beat("a", Some(&a)).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["resume a's heartbeat moves again"]
    );
    s.own("1", Some("b"), Some("a")).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["request a asked b to hand off 1"]
    );
    for _ in 0..6 {
        tokio::time::advance(Duration::from_secs(1)).await;
        a = s.beat("a", Some(&a)).await;
        b = s.beat("b", Some(&b)).await;
        w.refresh().await.expect("refresh");
    }
    s.own("1", Some("a"), None).await;
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["steal a stole 1 from b (hand-off not honoured in time)"]
    );

    // Lineage and cleanup.
    s.create("3", &["1"]).await;
    s.create("4", &["1"]).await;
    w.refresh().await.expect("refresh");
    assert_eq!(new_events(&w, &mut seen), ["split 1 split into 3 + 4"]);
    let one = s
        .store
        .get(&s.key("1"))
        .await
        .expect("get")
        .expect("exists");
    s.store
        .delete(&s.key("1"), one.version)
        .await
        .expect("delete");
    w.refresh().await.expect("refresh");
    assert_eq!(new_events(&w, &mut seen), ["delete lease of 1 deleted"]);

    s.store
        .remove_heartbeat(&s.group, &host("b"), "inc-b", b.version)
        .await
        .expect("remove");
    w.refresh().await.expect("refresh");
    assert_eq!(
        new_events(&w, &mut seen),
        ["leave b left (heartbeat row removed)"]
    );
    let _ = a;
}

#[tokio::test(start_paused = true)]
async fn a_refresh_reads_the_membership_and_only_the_leases_that_changed_hands() {
    // Issue 22: the console costs the store no more than a host: a membership read per
    // refresh, the changed rows when the change counter moved, a full list every list_every.
    let s = Script::new();
    for i in 0..100 {
        s.create(&i.to_string(), &[]).await;
        s.own(&i.to_string(), Some("a"), None).await;
    }
    s.beat("a", None).await;
    let mut w = s.watch();
    w.refresh().await.expect("refresh");
    let first = w.cost();
    assert_eq!(
        (first.reads, first.lists, first.lease_rows_read),
        (2, 1, 100)
    );

    let before = w.cost();
    w.refresh().await.expect("refresh");
    let idle = w.cost().since(&before);
    assert_eq!(
        (idle.reads, idle.lease_rows_read, idle.heartbeat_rows_read),
        (1, 0, 1)
    );

    // A checkpoint does not move the change counter: nothing more is read.
    s.write("7", |l| {
        l.continuation = Some(changefeed::model::Continuation::new("7:10"))
    })
    .await;
    let before = w.cost();
    w.refresh().await.expect("refresh");
    assert_eq!(w.cost().since(&before).lease_rows_read, 0);

    s.own("7", Some("b"), None).await;
    let before = w.cost();
    w.refresh().await.expect("refresh");
    let moved = w.cost().since(&before);
    assert_eq!((moved.reads, moved.lists, moved.lease_rows_read), (2, 0, 1));
    assert_eq!(
        w.leases[&PartitionId::new("7").expect("p")].owner,
        Some(host("b"))
    );

    tokio::time::advance(settings().list_every).await;
    let before = w.cost();
    w.refresh().await.expect("refresh");
    let full = w.cost().since(&before);
    assert_eq!((full.reads, full.lists, full.lease_rows_read), (2, 1, 100));
    assert_eq!(full.writes, 0, "the console never writes");
}

#[tokio::test(start_paused = true)]
async fn the_api_serves_hosts_leases_events_and_the_timeline_as_documented() {
    // The JSON shape docs/operations.md documents, and the page and its routes.
    let s = Script::new();
    s.create("0", &[]).await;
    s.create("1", &[]).await;
    s.beat("a", None).await;
    let mut w = s.watch();
    w.refresh().await.expect("refresh");
    s.own("0", Some("a"), None).await;
    w.refresh().await.expect("refresh");
    s.own("0", Some("a"), Some("b")).await;
    w.refresh().await.expect("refresh");
    let p = publish(&w);
    let get = |path: &str| answer(&p, &Method::GET, path);
    let json = |text: String| -> serde_json::Value { serde_json::from_str(&text).expect("JSON") };

    let hosts = json(body(get("/api/hosts")).await);
    assert_eq!(hosts["group"], "g");
    let a = &hosts["hosts"][0];
    assert_eq!(
        (
            a["name"].as_str(),
            a["status"].as_str(),
            a["leases_owned"].as_u64(),
            a["fenced"].as_bool()
        ),
        (Some("a"), Some("live"), Some(1), Some(false))
    );
    assert!(
        a["heartbeat_age_ms"].is_i64() && a["colour"].is_string(),
        "{a}"
    );

    let leases = json(body(get("/api/leases")).await);
    let rows = leases["leases"].as_array().expect("leases");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["partition"], "0");
    assert_eq!(rows[0]["owner"], "a");
    assert_eq!(rows[0]["state"], "owned");
    assert_eq!(rows[0]["handoff_requested"], true);
    assert_eq!(rows[0]["next_owner"], "b");
    for key in ["checkpoint", "lag_records", "lag_seconds", "lag_error"] {
        assert!(rows[1].get(key).is_some(), "{key} missing from {}", rows[1]);
    }

    let events = json(body(get("/api/events")).await);
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(kinds, ["take", "request"]);

    let svg = body(get("/api/timeline.svg")).await;
    assert!(
        svg.starts_with("<svg") && svg.contains("<title>0 a</title>"),
        "{svg}"
    );
    let page = body(get("/")).await;
    assert!(page.contains("<table") && !page.contains("http://") && !page.contains("https://"));
    assert_eq!(get("/nope").status(), StatusCode::NOT_FOUND);
    assert_eq!(
        answer(&p, &Method::POST, "/api/hosts").status(),
        StatusCode::METHOD_NOT_ALLOWED
    );
}
