//! What an observer remembers of each host's heartbeat, and when it judges a host dead: when
//! it has seen the same heartbeat version for `lease_expiry` on its own monotonic clock.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Instant;

use crate::model::{Heartbeat, HostName, Membership, Version};

/// What an observer remembers of each host's heartbeat.
#[derive(Debug, Default, Clone)]
pub struct Liveness {
    /// Sorted by host name.
    seen: Vec<(HostName, Seen)>,
}

#[derive(Debug, Clone)]
struct Seen {
    version: Version,
    incarnation: Arc<str>,
    changed_at: Instant,
}

impl Seen {
    fn new(hb: &Heartbeat, now: Instant) -> Self {
        Self {
            version: hb.version,
            incarnation: hb.incarnation.clone(),
            changed_at: now,
        }
    }

    fn observe(&mut self, hb: &Heartbeat, now: Instant) {
        if self.version != hb.version || self.incarnation != hb.incarnation {
            self.version = hb.version;
            if self.incarnation != hb.incarnation {
                self.incarnation = hb.incarnation.clone();
            }
            self.changed_at = now;
        }
    }
}

impl Liveness {
    /// Takes in a membership read made at `now` (this host's monotonic clock).
    pub fn observe(&mut self, membership: &Membership, now: Instant) {
        // Every host observes every other every cycle, and the membership rarely changes:
        // when it lists the same hosts in the same order, update in place.
        let same_hosts = self.seen.len() == membership.hosts.len()
            && self
                .seen
                .iter()
                .zip(&membership.hosts)
                .all(|((host, _), hb)| *host == hb.host);
        if same_hosts {
            for ((_, seen), hb) in self.seen.iter_mut().zip(&membership.hosts) {
                seen.observe(hb, now);
            }
            return;
        }
        let old = std::mem::take(&mut self.seen);
        for hb in &membership.hosts {
            let seen = match old.binary_search_by(|(h, _)| h.cmp(&hb.host)) {
                Ok(i) => {
                    let mut seen = old[i].1.clone();
                    seen.observe(hb, now);
                    seen
                }
                Err(_) => Seen::new(hb, now),
            };
            self.seen.push((hb.host.clone(), seen));
        }
        self.seen.sort_by(|a, b| a.0.cmp(&b.0));
        self.seen.dedup_by(|a, b| a.0 == b.0);
    }

    /// Takes in a copy of `host`'s heartbeat, seen at `now` in a row written after its
    /// heartbeat row (the leader's, in the membership view): the copy counts as an observation
    /// of the row only when it is newer than what was seen, since a copy may lag the row.
    pub fn observe_copy(
        &mut self,
        host: &HostName,
        incarnation: &Arc<str>,
        version: Version,
        now: Instant,
    ) {
        match self.seen.binary_search_by(|(h, _)| h.cmp(host)) {
            Ok(i) => {
                let seen = &mut self.seen[i].1;
                if seen.incarnation != *incarnation || version > seen.version {
                    seen.version = version;
                    seen.incarnation = Arc::clone(incarnation);
                    seen.changed_at = now;
                }
            }
            Err(i) => self.seen.insert(
                i,
                (
                    host.clone(),
                    Seen {
                        version,
                        incarnation: Arc::clone(incarnation),
                        changed_at: now,
                    },
                ),
            ),
        }
    }

    /// The hosts whose heartbeat changed less than `expiry` ago, sorted by name.
    pub fn live(&self, now: Instant, expiry: Duration) -> Vec<HostName> {
        self.seen
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.changed_at) < expiry)
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// When `host`'s heartbeat was last seen to change, if it is known.
    pub fn changed_at(&self, host: &HostName) -> Option<Instant> {
        self.seen
            .binary_search_by(|(h, _)| h.cmp(host))
            .ok()
            .map(|i| self.seen[i].1.changed_at)
    }
}
