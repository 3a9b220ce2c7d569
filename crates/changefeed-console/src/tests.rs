//! The console's view against scripted store changes on the in-memory store, on virtual time.

use super::*;
use changefeed::clock::VirtualClock;
use changefeed::lease::{ForwardingStore, MemoryLeaseStore};
use changefeed::lease::{HeartbeatRole, MembershipStore};
use changefeed::model::{
    GroupHead, Heartbeat, HostName, Lease, LeaseKey, LeaseState, MembershipView, PartitionId,
    Position, Timestamp, ViewHost,
};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};

/// The memory store as a store that keeps no membership view: `head` answers `None`.
#[derive(Debug)]
struct NoView(Arc<MemoryLeaseStore>);

#[async_trait::async_trait]
impl ForwardingStore for NoView {
    fn inner(&self) -> &dyn LeaseStore {
        &*self.0
    }

    async fn head(&self, _: &GroupName) -> Result<Option<GroupHead>, changefeed::LeaseError> {
        Ok(None)
    }
}

/// A response's body as text.
async fn body(response: Response<Full<Bytes>>) -> String {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a full body cannot fail")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

fn settings() -> Settings {
    Settings {
        list_every: Duration::from_secs(60),
        fence_after: Duration::from_secs(2),
        expire_after: Duration::from_secs(3),
        handoff_timeout: Duration::from_secs(5),
        window: Duration::from_secs(120),
        heartbeats_every: Duration::from_secs(10),
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
                HeartbeatRole::Member,
                None,
            )
            .await
            .expect("heartbeat")
    }

    /// Renews `h`'s heartbeat as the view's leader: the store copies it into the view.
    async fn lead(&self, h: &str, last: &Heartbeat) -> Heartbeat {
        self.lead_at(h, last, Timestamp(0)).await
    }

    /// [`Script::lead`], written at `at` (wall clock).
    async fn lead_at(&self, h: &str, last: &Heartbeat, at: Timestamp) -> Heartbeat {
        self.store
            .heartbeat(
                &self.group,
                &host(h),
                &format!("inc-{h}"),
                at,
                Some(last.version),
                HeartbeatRole::Leader,
                None,
            )
            .await
            .expect("lead heartbeat")
    }

    /// Writes a view led by `leader` (whose heartbeat is `beat`) listing `live` and `dead`.
    async fn view(&self, beat: &Heartbeat, live: &[&str], dead: &[&str]) -> MembershipView {
        let current = self
            .store
            .head(&self.group)
            .await
            .expect("head")
            .and_then(|h| h.view)
            .map_or(0, |v| v.version);
        let view = MembershipView {
            version: 0,
            leader: beat.host.clone(),
            leader_incarnation: beat.incarnation.clone(),
            leader_heartbeat: beat.version,
            live: live
                .iter()
                .map(|h| ViewHost::new(host(h), format!("inc-{h}").into()))
                .collect(),
            dead: dead.iter().map(|h| host(h)).collect(),
        };
        self.store
            .write_view(&self.group, &view, current)
            .await
            .expect("write view")
    }

    fn watch(&self) -> Watch {
        self.watch_of(self.store.clone())
    }

    fn watch_of(&self, store: Arc<dyn LeaseStore>) -> Watch {
        Watch::new(
            store,
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
    // The console derives takes, requests, hand-offs, fencing, expiry, takes of
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
    // From a store without a membership view, the console costs the store no more
    // than a host: a membership read per refresh, the changed rows when the change counter
    // moved, a full list every list_every.
    let s = Script::new();
    for i in 0..100 {
        s.create(&i.to_string(), &[]).await;
        s.own(&i.to_string(), Some("a"), None).await;
    }
    s.beat("a", None).await;
    let mut w = s.watch_of(Arc::new(NoView(s.store.clone())));
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

/// The reads of one refresh: (calls, head rows, heartbeat rows, lease rows).
async fn one_refresh(w: &mut Watch) -> (u64, u64, u64, u64) {
    let before = w.cost();
    w.refresh().await.expect("refresh");
    let c = w.cost().since(&before);
    (
        c.reads,
        c.head_rows_read,
        c.heartbeat_rows_read,
        c.lease_rows_read,
    )
}

#[tokio::test(start_paused = true)]
async fn with_a_view_a_refresh_reads_the_head_and_the_heartbeats_only_when_it_must() {
    // The console reads as a host that does not lead: one head row per refresh. Every
    // heartbeat is read at the first refresh, when the view's version moves, every
    // heartbeats_every, and every refresh while no leader keeps the view fresh.
    let s = Script::new();
    for i in 0..10 {
        s.create(&i.to_string(), &[]).await;
        s.own(
            &i.to_string(),
            Some(if i % 2 == 0 { "a" } else { "b" }),
            None,
        )
        .await;
    }
    let mut a = s.beat("a", None).await;
    let mut b = s.beat("b", None).await;
    s.view(&a, &["a", "b"], &[]).await;
    let mut w = s.watch();
    assert_eq!(
        one_refresh(&mut w).await,
        (3, 1, 2, 10),
        "head, heartbeats, list"
    );
    assert_eq!(w.judged(w.now()), super::watch::Judged::View);

    // Steady state: the leader's renewals keep the view fresh; one head row a refresh, and
    // the heartbeats once every heartbeats_every (10 s here).
    let mut rows = Vec::new();
    for _ in 0..12 {
        tokio::time::advance(Duration::from_secs(1)).await;
        a = s.lead("a", &a).await;
        b = s.beat("b", Some(&b)).await;
        rows.push(one_refresh(&mut w).await);
    }
    let heartbeat_reads: Vec<usize> = (0..12).filter(|i| rows[*i].2 > 0).collect();
    assert_eq!(heartbeat_reads, [9], "{rows:?}");
    assert!(rows.iter().all(|r| r.1 == 1 && r.3 == 0), "{rows:?}");
    assert_eq!(rows[0], (1, 1, 0, 0));

    // A new judgment (b dead) moves the version: the rows are read at once, and b's lease
    // taken by a is a take of an expired lease.
    s.view(&a, &["a"], &["b"]).await;
    let mut seen = w.events.len();
    assert_eq!(one_refresh(&mut w).await, (2, 1, 2, 0));
    assert_eq!(
        new_events(&w, &mut seen),
        ["expire b expired: judged dead by a's membership view"]
    );
    s.own("1", Some("a"), None).await;
    assert_eq!(one_refresh(&mut w).await, (2, 1, 0, 1));
    assert_eq!(
        new_events(&w, &mut seen),
        ["take a took 1 from b (expired)"]
    );

    // The leader stops renewing: once the view has stood still for lease_expiry, no leader
    // keeps it and the console judges the heartbeats itself, reading them every refresh.
    tokio::time::advance(settings().expire_after).await;
    assert_eq!(one_refresh(&mut w).await, (2, 1, 2, 0));
    assert_eq!(w.judged(w.now()), super::watch::Judged::Heartbeats);
    assert_eq!(one_refresh(&mut w).await, (2, 1, 2, 0));
    assert_eq!(
        new_events(&w, &mut seen),
        ["expire a expired: heartbeat unchanged for 3.0s"],
        "a's copy in the view counts as a sighting of its heartbeat"
    );
    assert_eq!(w.cost().writes, 0, "the console never writes");
}

#[tokio::test(start_paused = true)]
async fn the_hosts_api_gives_the_views_judgment_and_the_age_of_the_heartbeat_read() {
    // /api/hosts with a fresh view: each host live, dead or unknown as the view lists it, the
    // leader marked, heartbeat ages as of the last heartbeat read, and how old that read is.
    let s = Script::new();
    for p in ["0", "1", "2"] {
        s.create(p, &[]).await;
    }
    let mut a = s.beat("a", None).await;
    s.beat("b", None).await;
    s.own("0", Some("a"), None).await;
    s.own("1", Some("b"), None).await;
    s.own("2", Some("c"), None).await;
    s.view(&a, &["a"], &["b"]).await;
    let mut w = s.watch();
    w.refresh().await.expect("refresh");
    tokio::time::advance(Duration::from_secs(4)).await;
    a = s.lead("a", &a).await;
    w.refresh().await.expect("refresh");
    let v = api::hosts(&w, w.wall_ms());
    assert_eq!(v["judged_by"], "view");
    assert_eq!(v["view"]["leader"], "a");
    assert_eq!(v["heartbeats_read_age_ms"], 4000, "{v}");
    let by_name = |n: &str| {
        v["hosts"]
            .as_array()
            .expect("hosts")
            .iter()
            .find(|h| h["name"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("{n} missing from {v}"))
    };
    let (ha, hb, hc) = (by_name("a"), by_name("b"), by_name("c"));
    assert_eq!(ha["heartbeat_age_ms"], hb["heartbeat_age_ms"], "{v}");
    assert_eq!(
        (&ha["status"], &ha["leader"], &ha["in_view"]),
        (&json!("live"), &json!(true), &json!("live"))
    );
    assert_eq!(
        (&hb["status"], &hb["expired"]),
        (&json!("dead"), &json!(true))
    );
    assert_eq!(
        (&hc["status"], &hc["leader"]),
        (&json!("unknown"), &json!(false))
    );
    assert_eq!(hc["heartbeat_age_ms"], Value::Null, "c has no row");
    // Heartbeats written at wall 0, read at the console's wall clock at the first refresh.
    assert_eq!(ha["heartbeat_age_ms"], json!(v["heartbeats_as_of_ms"]));
    assert_eq!(
        (&ha["heartbeat_version"], &hb["heartbeat_version"]),
        (&json!(2), &json!(1)),
        "the newest version seen: the leader's from the view's copy"
    );

    // The leader's row read at the version its copy showed first: its write time as read.
    tokio::time::advance(settings().heartbeats_every).await;
    let now = Timestamp(w.wall_ms());
    s.lead_at("a", &a, now).await;
    w.refresh().await.expect("refresh");
    let v = api::hosts(&w, w.wall_ms());
    assert_eq!(v["heartbeats_read_age_ms"], 0, "{v}");
    assert_eq!(v["hosts"][0]["name"], "a");
    assert_eq!(
        (
            &v["hosts"][0]["heartbeat_version"],
            &v["hosts"][0]["heartbeat_age_ms"]
        ),
        (&json!(3), &json!(0)),
        "{v}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_split_child_leased_between_full_lists_is_shown_once() {
    let s = Script::new();
    let feed = Arc::new(changefeed::source::MemoryFeed::new(1));
    let root = PartitionId::new("0").expect("p");
    s.create("0", &[]).await;
    s.own("0", Some("a"), None).await;
    s.beat("a", None).await;
    let (left, right) = feed.split(&root).expect("split");
    let mut w = Watch::new(
        Arc::new(NoView(s.store.clone())),
        Some(feed.clone()),
        s.group.clone(),
        settings(),
        Arc::new(VirtualClock::new(Timestamp(1_000_000))),
    );
    w.refresh().await.expect("refresh");
    assert_eq!(w.unleased, vec![left.clone(), right.clone()]);

    // The leader creates the children's leases; the next refresh reads only what changed.
    s.create(left.as_str(), &["0"]).await;
    s.own(left.as_str(), Some("a"), None).await;
    w.refresh().await.expect("refresh");
    assert!(w.leases.contains_key(&left));
    assert_eq!(
        w.unleased,
        vec![right.clone()],
        "the leased child is not also unleased"
    );
    let api = api::leases(&w, 0);
    let listed: Vec<&str> = api["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .filter_map(|l| l["partition"].as_str())
        .filter(|p| *p == left.as_str())
        .collect();
    assert_eq!(listed.len(), 1, "{api}");
}
