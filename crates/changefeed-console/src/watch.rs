//! The console's view of one group, kept up to date from the store the way a host that does
//! not lead keeps its own: the head row per refresh (the change counter and the membership
//! view, [`MembershipStore::head`]), the leases that changed hands when the counter moved
//! ([`LeaseStore::list_changes`]), and a full list only every `list_every` (for the
//! checkpoints, which do not move the counter, and so for the lag).
//!
//! Liveness comes from the view while a leader keeps it fresh: live, judged dead, or unknown
//! (in neither list), and who leads. The heartbeat rows are read only when they must be: when
//! the view's version moved (a new judgment: someone joined, died or came back), every
//! `heartbeats_every` (so the heartbeat ages shown stay roughly fresh), and every refresh while
//! there is no fresh view (the fleet elects a leader, and the console judges each heartbeat on
//! its own clock as the hosts then do). A store that keeps no view is read as before the view:
//! every heartbeat each refresh, judged on the console's clock.
//!
//! It owns the leases and heartbeats last read, the events derived by comparing them
//! ([`super::events`]) and the [`Timeline`]. It writes nothing. Every store call goes
//! through a [`CountingStore`], so [`Watch::cost`] tells what the console costs the store.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use changefeed::clock::{Clock, Instant};
use changefeed::lease::{CountingStore, LeaseStore, StoreCounts, StoreStats};
use changefeed::model::{
    GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView, PartitionId,
};
use changefeed::processor::GroupObserver;
use changefeed::source::FeedSource;
use changefeed::LeaseError;

use super::events::{births, lease_moves, view_changes, Change, Judge, Kind};
pub use super::settings::Judged;
use super::settings::Settings;
use super::timeline::Timeline;

/// How many events the console remembers.
const EVENTS_KEPT: usize = 500;

/// A host as the console last saw it.
#[derive(Debug)]
pub struct HostView {
    /// Its heartbeat row.
    pub heartbeat: Heartbeat,
    /// Its heartbeat has stood still past `fence_after`: it has stopped its workers.
    pub fenced: bool,
    /// Its heartbeat has stood still past `expire_after`: its leases are free to take.
    pub expired: bool,
}

/// Lag of one partition, as of the last full list.
#[derive(Debug, Clone, Default)]
pub struct Lag {
    /// Records after the checkpoint, when the source can say.
    pub records: Option<u64>,
    /// Age of the first unread record, in milliseconds, when the source can say.
    pub age_ms: Option<u64>,
    /// What the source answered instead, if asking failed.
    pub error: Option<String>,
}

/// An event with its time (the console's wall clock, milliseconds).
#[derive(Debug, Clone)]
pub struct Event {
    /// When the console saw it.
    pub at_ms: i64,
    /// What it saw.
    pub change: Change,
}

/// One group, watched.
#[derive(Debug)]
pub struct Watch {
    store: Arc<dyn LeaseStore>,
    stats: Arc<StoreStats>,
    source: Option<Arc<dyn FeedSource>>,
    clock: Arc<dyn Clock>,
    pub(super) group: GroupName,
    settings: Settings,
    pub(super) leases: BTreeMap<PartitionId, Lease>,
    /// Rows that could not be read, as errors naming their key.
    pub(super) malformed: Vec<String>,
    /// Partitions the source lists that have no lease yet, with their lag.
    pub(super) unleased: Vec<PartitionId>,
    pub(super) lag: HashMap<PartitionId, Lag>,
    pub(super) hosts: BTreeMap<HostName, HostView>,
    /// The store answered the last head read: it keeps a membership view.
    pub(super) views: bool,
    /// The membership view and the heartbeats as the console has read them, judged as a
    /// host judges them.
    pub(super) observer: GroupObserver,
    /// When the heartbeat rows were last read, and the view's version then.
    heartbeats_read_at: Option<(Instant, u64)>,
    /// Wall time of the last heartbeat read: the age of the heartbeat ages shown.
    pub(super) heartbeats_at_ms: i64,
    /// Heartbeat reads (calls) so far.
    pub(super) heartbeat_reads: u64,
    /// The colour index of every host ever seen, in order of first sight.
    colours: BTreeMap<HostName, usize>,
    /// When each pending hand-off request was first seen.
    requests: HashMap<PartitionId, Instant>,
    counter: Option<u64>,
    last_full: Option<Instant>,
    /// Wall time of the last full list: the age of the checkpoints shown.
    pub(super) listed_at_ms: i64,
    pub(super) events: VecDeque<Event>,
    pub(super) timeline: Timeline,
    pub(super) refreshes: u64,
    /// The last refresh's error, cleared by a refresh that succeeds.
    pub(super) error: Option<String>,
}

impl Judge for Watch {
    fn alive(&self, host: &HostName) -> bool {
        match self.judged(self.clock.now()) {
            // An owner the view does not list dead counts as live, as the hosts count it.
            Judged::View => !self.observer.dead_by_view(host),
            Judged::Heartbeats => self.hosts.get(host).is_some_and(|h| !h.expired),
        }
    }

    fn request_overdue(&self, partition: &PartitionId) -> bool {
        self.requests.get(partition).is_some_and(|seen| {
            self.clock.now().saturating_duration_since(*seen) >= self.settings.handoff_timeout
        })
    }
}

impl Watch {
    /// Watches `group` in `store` (and the lag in `source`, if given), reading nothing yet.
    pub fn new(
        store: Arc<dyn LeaseStore>,
        source: Option<Arc<dyn FeedSource>>,
        group: GroupName,
        settings: Settings,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let stats = Arc::new(StoreStats::default());
        let window = settings.window.as_millis().min(i64::MAX as u128) as i64;
        Self {
            store: Arc::new(CountingStore::new(store, stats.clone())),
            stats,
            source,
            clock,
            group,
            settings,
            leases: BTreeMap::new(),
            malformed: Vec::new(),
            unleased: Vec::new(),
            lag: HashMap::new(),
            hosts: BTreeMap::new(),
            views: false,
            observer: GroupObserver::default(),
            heartbeats_read_at: None,
            heartbeats_at_ms: 0,
            heartbeat_reads: 0,
            colours: BTreeMap::new(),
            requests: HashMap::new(),
            counter: None,
            last_full: None,
            listed_at_ms: 0,
            events: VecDeque::new(),
            timeline: Timeline::new(window),
            refreshes: 0,
            error: None,
        }
    }

    /// What the console's reads have cost the store so far.
    pub fn cost(&self) -> StoreCounts {
        self.stats.snapshot()
    }

    /// The colour of `host` (a new host gets the next one).
    pub fn colour(&self, host: &HostName) -> &'static str {
        let palette = &crate::draw::PALETTE;
        let i = self.colours.get(host).copied().unwrap_or(0);
        palette[i % palette.len()]
    }

    fn see_host(&mut self, host: &HostName) {
        let next = self.colours.len();
        self.colours.entry(host.clone()).or_insert(next);
    }

    /// When the heartbeat rows were last read, on the console's clock.
    pub fn heartbeats_read_at(&self) -> Option<Instant> {
        self.heartbeats_read_at.map(|(at, _)| at)
    }

    /// The console's monotonic time now.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Wall time now, in milliseconds.
    pub fn wall_ms(&self) -> i64 {
        self.clock.wall().millis()
    }

    fn record(&mut self, at_ms: i64, change: Change) {
        self.timeline.mark(at_ms, &change);
        self.events.push_back(Event { at_ms, change });
        while self.events.len() > EVENTS_KEPT {
            self.events.pop_front();
        }
    }

    /// Reads what changed and updates the view, the events and the timeline. On an error the
    /// view keeps what it had, and the error is kept in [`Watch::error`] too.
    ///
    /// # Errors
    /// The store's, naming the read.
    pub async fn refresh(&mut self) -> anyhow::Result<()> {
        let result = self.read().await;
        self.error = result
            .as_ref()
            .err()
            .map(|e| changefeed::error::one_line(e.as_ref()));
        result
    }

    /// How liveness is judged at `now`: by the view while one is fresh (its version or its
    /// copy of the leader's heartbeat moved within `expire_after`) and lists its leader live,
    /// as a host goes by it; otherwise from the heartbeat rows.
    pub fn judged(&self, now: Instant) -> Judged {
        if self.observer.by_view(now, self.settings.expire_after) {
            Judged::View
        } else {
            Judged::Heartbeats
        }
    }

    /// The membership view last read, if any.
    pub fn view(&self) -> Option<&MembershipView> {
        self.observer.view()
    }

    /// How long `host`'s heartbeat had stood still at `now`, on the console's clock.
    pub(super) fn unchanged_for(&self, host: &HostName, now: Instant) -> Option<Duration> {
        self.observer
            .standing_since(host)
            .map(|since| now.saturating_duration_since(since))
    }

    /// Whether this refresh reads the heartbeat rows (a store with a view, read at `now`).
    fn heartbeats_due(&self, now: Instant) -> bool {
        let version = self.view().map_or(0, |v| v.version);
        self.judged(now) == Judged::Heartbeats
            || self.heartbeats_read_at.is_none_or(|(at, seen)| {
                seen != version
                    || now.saturating_duration_since(at) >= self.settings.heartbeats_every
            })
    }

    async fn read(&mut self) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let first = self.refreshes == 0;
        let head = self
            .store
            .head(&self.group)
            .await
            .context("reading the group's head row")?;
        let now = self.clock.now();
        let at = self.wall_ms();
        self.views = head.is_some();
        let counter = match head {
            Some(head) => {
                self.take_view(head.view.as_ref(), now, at, first);
                if self.heartbeats_due(now) {
                    let membership = self.read_heartbeats().await?;
                    let now = self.clock.now();
                    let judge = self.judged(now) == Judged::Heartbeats;
                    self.observe_hosts(membership, now, at, first, judge);
                }
                head.change_counter
            }
            None => {
                let membership = self.read_heartbeats().await?;
                let counter = membership.change_counter;
                self.observe_hosts(membership, now, at, first, true);
                counter
            }
        };
        let full_due = self
            .last_full
            .is_none_or(|t| now.saturating_duration_since(t) >= self.settings.list_every);
        let mut changed: Vec<PartitionId> = Vec::new();
        if full_due {
            self.full_list(counter, at, first).await?;
        } else if self.counter != Some(counter) {
            let since = self.counter.unwrap_or(0);
            let changes = self
                .store
                .list_changes(&self.group, since)
                .await
                .context("reading the leases that changed hands")?;
            match changes {
                Some(changes) => {
                    if changes.counter != counter {
                        // Leases changed hands after the head was read: a take among them was
                        // made under a view at least as new as the head holding its counter,
                        // so read that before naming the takes (as a host re-reads it).
                        self.reread_head(at).await?;
                    }
                    for bad in &changes.malformed {
                        let text = bad.to_string();
                        if !self.malformed.contains(&text) {
                            self.malformed.push(text);
                        }
                    }
                    for key in &changes.deleted {
                        self.remove(key, at);
                    }
                    changed = changes
                        .leases
                        .iter()
                        .map(|l| l.key.partition.clone())
                        .collect();
                    self.apply(changes.leases, at, first);
                    self.counter = Some(changes.counter);
                }
                None => self.full_list(counter, at, first).await?,
            }
        }
        self.track_requests(now);
        if full_due {
            self.estimate_all().await;
        } else {
            self.estimate(&changed).await;
        }
        self.timeline.prune(at);
        self.refreshes += 1;
        Ok(())
    }

    /// Every heartbeat row and the change counter, in one read.
    async fn read_heartbeats(&mut self) -> anyhow::Result<changefeed::model::Membership> {
        use anyhow::Context as _;
        let membership = self
            .store
            .membership(&self.group)
            .await
            .context("reading the heartbeats")?;
        let version = self.view().map_or(0, |v| v.version);
        self.heartbeats_read_at = Some((self.clock.now(), version));
        self.heartbeats_at_ms = self.wall_ms();
        self.heartbeat_reads += 1;
        Ok(membership)
    }

    /// Reads the head again, for its view only (a store with a view; nothing otherwise).
    async fn reread_head(&mut self, at: i64) -> anyhow::Result<()> {
        use anyhow::Context as _;
        if !self.views {
            return Ok(());
        }
        let head = self
            .store
            .head(&self.group)
            .await
            .context("reading the group's head row")?;
        if let Some(head) = head {
            let now = self.clock.now();
            self.take_view(head.view.as_ref(), now, at, false);
        }
        Ok(())
    }

    /// Takes in the view of a head read that returned at `now`: a newer one (by version, or
    /// by its copy of the leader's heartbeat) replaces the one known, and the hosts whose
    /// judgment it changed are events (none at the first read, the baseline).
    fn take_view(&mut self, view: Option<&MembershipView>, now: Instant, at: i64, first: bool) {
        let Some(new) = view else {
            return;
        };
        let old = self.observer.view().cloned();
        // The observer takes the copy of the leader's heartbeat as a sighting of its row at
        // that version, as a host does: should the view go stale, the leader is judged from
        // it at once.
        if !self.observer.observe_view(Some(new), now) {
            return;
        }
        if let Some(row) = self.hosts.get_mut(&new.leader) {
            if *row.heartbeat.incarnation == *new.leader_incarnation
                && row.heartbeat.version < new.leader_heartbeat
            {
                row.heartbeat.version = new.leader_heartbeat;
                row.fenced = false;
                row.expired = false;
            }
        }
        for host in new.live.iter().map(|h| &h.host).chain(&new.dead) {
            self.see_host(host);
        }
        // Hosts the console already judged expired itself (the view had gone stale): the new
        // view listing them dead is not a second expiry.
        let expired: BTreeSet<HostName> = new
            .dead
            .iter()
            .filter(|h| self.hosts.get(*h).is_some_and(|r| r.expired))
            .cloned()
            .collect();
        self.expire_the_views_dead();
        if first {
            return;
        }
        for change in view_changes(old.as_ref(), new) {
            let known = change.kind == Kind::Expire
                && change.host.as_ref().is_some_and(|h| expired.contains(h));
            if !known {
                self.record(at, change);
            }
        }
    }

    /// Takes in the heartbeat rows read at `now`. With `judge`, the console judges the hosts
    /// from them (fence, expiry) and tells what changed as events; without (the view judges),
    /// the rows are only kept, for their ages.
    fn observe_hosts(
        &mut self,
        membership: Membership,
        now: Instant,
        at: i64,
        first: bool,
        judge: bool,
    ) {
        self.observer.observe_heartbeats(&membership, now);
        let rows = membership.hosts;
        let present: BTreeSet<HostName> = rows.iter().map(|h| h.host.clone()).collect();
        let gone: Vec<HostName> = self
            .hosts
            .keys()
            .filter(|h| !present.contains(*h))
            .cloned()
            .collect();
        for host in gone {
            self.hosts.remove(&host);
            if judge {
                self.record(
                    at,
                    Change::host(
                        Kind::Leave,
                        &host,
                        format!("{host} left (heartbeat row removed)"),
                    ),
                );
            }
        }
        for row in rows {
            let host = row.host.clone();
            self.see_host(&host);
            let change = match self.hosts.get_mut(&host) {
                None => {
                    self.hosts.insert(
                        host.clone(),
                        HostView {
                            heartbeat: row,
                            fenced: false,
                            expired: false,
                        },
                    );
                    (!first).then(|| Change::host(Kind::Join, &host, format!("{host} joined")))
                }
                Some(view)
                    if view.heartbeat.version != row.version
                        || view.heartbeat.incarnation != row.incarnation =>
                {
                    let restarted = view.heartbeat.incarnation != row.incarnation;
                    let was_stale = view.fenced || view.expired;
                    view.heartbeat = row;
                    view.fenced = false;
                    view.expired = false;
                    if restarted {
                        Some(Change::host(
                            Kind::Restart,
                            &host,
                            format!("{host} restarted (new incarnation)"),
                        ))
                    } else if was_stale {
                        Some(Change::host(
                            Kind::Resume,
                            &host,
                            format!("{host}'s heartbeat moves again"),
                        ))
                    } else {
                        None
                    }
                }
                Some(view) => {
                    // The version seen already (perhaps first from the view's copy of the
                    // leader's): the row as read, for its write time.
                    view.heartbeat = row;
                    let still = self
                        .observer
                        .standing_since(&host)
                        .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
                    if !view.expired && still >= self.settings.expire_after {
                        view.expired = true;
                        view.fenced = true;
                        Some(Change::host(
                            Kind::Expire,
                            &host,
                            format!(
                                "{host} expired: heartbeat unchanged for {:.1}s",
                                still.as_secs_f64()
                            ),
                        ))
                    } else if !view.fenced && still >= self.settings.fence_after {
                        view.fenced = true;
                        Some(Change::host(
                            Kind::Fence,
                            &host,
                            format!(
                                "{host} fenced: heartbeat unchanged for {:.1}s",
                                still.as_secs_f64()
                            ),
                        ))
                    } else {
                        None
                    }
                }
            };
            if let Some(change) = change.filter(|_| judge) {
                self.record(at, change);
            }
        }
        if !judge {
            self.expire_the_views_dead();
        }
    }

    /// A host the view judges dead is expired to the console's own judgment too, should it
    /// have to judge (the view goes stale): not announced twice, and its heartbeat moving
    /// after that is a `resume`.
    fn expire_the_views_dead(&mut self) {
        let Some(view) = self.observer.view() else {
            return;
        };
        for host in &view.dead {
            if let Some(row) = self.hosts.get_mut(host) {
                row.fenced = true;
                row.expired = true;
            }
        }
    }

    async fn full_list(&mut self, counter: u64, at: i64, first: bool) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let listing = self
            .store
            .list(&self.group)
            .await
            .context("listing the leases")?;
        let present: BTreeSet<&PartitionId> =
            listing.leases.iter().map(|l| &l.key.partition).collect();
        let gone: Vec<LeaseKey> = self
            .leases
            .values()
            .filter(|l| !present.contains(&l.key.partition))
            .map(|l| l.key.clone())
            .collect();
        for key in &gone {
            self.remove(key, at);
        }
        self.malformed = listing
            .malformed
            .iter()
            .map(LeaseError::to_string)
            .collect();
        self.apply(listing.leases, at, first);
        self.counter = Some(counter);
        self.last_full = Some(self.clock.now());
        self.listed_at_ms = at;
        Ok(())
    }

    fn remove(&mut self, key: &LeaseKey, at: i64) {
        if let Some(old) = self.leases.remove(&key.partition) {
            self.timeline.delete(at, &old.key.partition);
            self.lag.remove(&old.key.partition);
            let p = &old.key.partition;
            let change = Change {
                kind: Kind::Delete,
                partition: Some(p.clone()),
                host: None,
                text: format!("lease of {p} deleted"),
            };
            self.record(at, change);
        }
    }

    /// Takes in new rows: events against the old ones, the timeline, then the rows.
    fn apply(&mut self, rows: Vec<Arc<Lease>>, at: i64, first: bool) {
        let rows: Vec<Lease> = rows.into_iter().map(Arc::unwrap_or_clone).collect();
        let mut changes = Vec::new();
        let created: Vec<&Lease> = rows
            .iter()
            .filter(|l| !self.leases.contains_key(&l.key.partition))
            .collect();
        if !first {
            changes.extend(births(&created));
        }
        for lease in &rows {
            if let Some(owner) = &lease.owner {
                self.see_host(owner);
            }
            match self.leases.get(&lease.key.partition) {
                Some(old) => changes.extend(lease_moves(old, lease, self)),
                None if !first => {
                    // A lease born owned (taken between two reads) is a take too.
                    let free = Lease::new(lease.key.clone(), lease.start.clone());
                    changes.extend(lease_moves(&free, lease, self));
                }
                None => {}
            }
        }
        for lease in rows {
            self.timeline
                .own(at, &lease.key.partition, lease.owner.as_ref());
            self.leases.insert(lease.key.partition.clone(), lease);
        }
        // A partition that got its lease since the last full list (a split's child) is no
        // longer one without: it is shown once, with its lease.
        let leases = &self.leases;
        self.unleased.retain(|p| !leases.contains_key(p));
        for change in changes {
            self.record(at, change);
        }
    }

    fn track_requests(&mut self, now: Instant) {
        self.requests
            .retain(|p, _| self.leases.get(p).is_some_and(|l| l.next_owner.is_some()));
        for lease in self.leases.values() {
            if lease.next_owner.is_some() {
                self.requests
                    .entry(lease.key.partition.clone())
                    .or_insert(now);
            }
        }
    }

    async fn estimate_all(&mut self) {
        let Some(source) = self.source.clone() else {
            return;
        };
        let all: Vec<PartitionId> = self.leases.keys().cloned().collect();
        self.estimate(&all).await;
        let leases: Vec<Lease> = self.leases.values().cloned().collect();
        let now = self.clock.wall();
        match changefeed::lag::unleased(source.as_ref(), &leases, &BTreeSet::new()).await {
            Ok(missing) => {
                self.unleased.clear();
                for (partition, start) in missing {
                    let records =
                        changefeed::lag::lag_after(source.as_ref(), &partition, None, &start).await;
                    let age =
                        changefeed::lag::age_after(source.as_ref(), &partition, None, &start, now)
                            .await;
                    self.lag.insert(partition.clone(), lag_of(records, age));
                    self.unleased.push(partition);
                }
            }
            Err(err) => self.error = Some(format!("listing the source's partitions: {err}")),
        }
    }

    async fn estimate(&mut self, partitions: &[PartitionId]) {
        let Some(source) = self.source.clone() else {
            return;
        };
        let now = self.clock.wall();
        for p in partitions {
            let Some(lease) = self.leases.get(p) else {
                continue;
            };
            let records = changefeed::lag::lease_lag(source.as_ref(), lease).await;
            let age = changefeed::lag::lease_age_ms(source.as_ref(), lease, now).await;
            self.lag.insert(p.clone(), lag_of(records, age));
        }
    }
}

fn lag_of(
    records: Result<Option<u64>, changefeed::SourceError>,
    age: Result<Option<u64>, changefeed::SourceError>,
) -> Lag {
    let error = match (&records, &age) {
        (Err(e), _) | (_, Err(e)) => Some(e.to_string()),
        _ => None,
    };
    Lag {
        records: records.ok().flatten(),
        age_ms: age.ok().flatten(),
        error,
    }
}
