//! Watching the fleet from the store, every 100 ms: each host's heartbeat (when it last
//! changed) and the owners of the leases.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, LeaseState};
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Debug, Default)]
pub(super) struct Seen {
    /// Host → (incarnation, version) last read, and every time it was seen changed.
    heartbeats: BTreeMap<String, ((String, u64), Vec<Instant>)>,
    /// Partition → owner, as last read.
    owners: BTreeMap<String, String>,
    /// Host → every time it was seen not owning a partition it owned before.
    lost: BTreeMap<String, Vec<Instant>>,
}

impl Seen {
    pub(super) fn owned_total(&self) -> usize {
        self.owners.len()
    }

    pub(super) fn owns(&self, host: &str) -> usize {
        self.owners.values().filter(|o| *o == host).count()
    }
}

/// Reads the store in the background; the readings are looked at through its methods.
pub(super) struct Watcher {
    seen: Arc<Mutex<Seen>>,
    task: JoinHandle<()>,
}

impl Watcher {
    pub(super) fn start(store: Arc<dyn LeaseStore>, group: GroupName, _hosts: Vec<String>) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let now = Instant::now();
                if let (Ok(m), Ok(l)) = (store.membership(&group).await, store.list(&group).await) {
                    let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
                    for hb in &m.hosts {
                        let id = (hb.incarnation.to_string(), hb.version.0);
                        let entry = s
                            .heartbeats
                            .entry(hb.host.to_string())
                            .or_insert_with(|| (id.clone(), vec![now]));
                        if entry.0 != id {
                            entry.0 = id;
                            entry.1.push(now);
                        }
                    }
                    let owners: BTreeMap<String, String> = l
                        .leases
                        .iter()
                        .filter(|l| l.state == LeaseState::Owned)
                        .filter_map(|l| {
                            Some((l.key.partition.to_string(), l.owner.as_ref()?.to_string()))
                        })
                        .collect();
                    let before = std::mem::replace(&mut s.owners, owners);
                    for (p, o) in before {
                        if s.owners.get(&p) != Some(&o) {
                            s.lost.entry(o).or_default().push(now);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Watcher { seen, task }
    }

    fn with<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Waits up to `limit` for `check` to hold; whether it did.
    pub(super) async fn until(&mut self, limit: Duration, check: impl Fn(&Seen) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.with(&check) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// The partitions `host` owns now.
    pub(super) fn owned_by(&self, host: &str) -> BTreeSet<String> {
        self.with(|s| {
            s.owners
                .iter()
                .filter(|(_, o)| *o == host)
                .map(|(p, _)| p.clone())
                .collect()
        })
    }

    /// When `host` was first seen losing a partition at or after `since`, if it was.
    pub(super) fn lost_since(&self, host: &str, since: Instant) -> Option<Instant> {
        self.with(|s| {
            s.lost
                .get(host)
                .and_then(|at| at.iter().find(|t| **t >= since).copied())
        })
    }

    /// When `host`'s heartbeat row was first seen changed after `after`, if it was.
    pub(super) fn heartbeat_after(&self, host: &str, after: Instant) -> Option<Instant> {
        self.with(|s| {
            s.heartbeats
                .get(host)
                .and_then(|(_, changes)| changes.iter().find(|at| **at > after).copied())
        })
    }

    pub(super) fn stop(self) {
        self.task.abort();
    }
}
