//! The membership view as one host knows it ([`Members`]), and the leader's judgment that it
//! writes ([`judge`]): pure, time as an argument. The argument for its safety is in
//! `docs/protocol.md`, "The membership view".

use std::collections::BTreeSet;
use std::ops::Not;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Instant;
use crate::model::{Heartbeat, HostLimits, HostName, MembershipView, Version, ViewHost};

/// The membership view this host last read, and when it last changed on this host's clock:
/// its version (a new judgment) or the leader's heartbeat copied into it (the store copies
/// each renewal of the leader's heartbeat into the view in the same write).
#[derive(Debug, Clone, Default)]
pub(crate) struct Members {
    view: Option<MembershipView>,
    changed_at: Option<Instant>,
    /// The live hosts' names, sorted (the view's, kept to hand out as a slice).
    live: Arc<[HostName]>,
    /// The dead hosts (the view's, kept to hand out as a set).
    dead: BTreeSet<HostName>,
}

impl Members {
    /// Takes in the view of a head read that returned at `now`. A view older than the one
    /// known (a read that overtook a write of ours) is ignored.
    pub(crate) fn observe(&mut self, view: Option<&MembershipView>, now: Instant) {
        let Some(view) = view else {
            return;
        };
        let known = self
            .view
            .as_ref()
            .map_or((0, Version(0)), |v| (v.version, v.leader_heartbeat));
        if (view.version, view.leader_heartbeat) <= known {
            return;
        }
        self.changed_at = Some(now);
        if let Some(kept) = self.view.as_mut().filter(|v| v.version == view.version) {
            // The same judgment (a view's version moves with every write of it): only the
            // store's copy of the leader's heartbeat moved, at each of its renewals. A
            // thousand-host view is not copied again for that.
            kept.leader_heartbeat = view.leader_heartbeat;
            return;
        }
        self.live = view.live_hosts().into();
        self.dead = view.dead.iter().cloned().collect();
        self.view = Some(view.clone());
    }

    /// A view this host wrote, stored at `now`.
    pub(crate) fn wrote(&mut self, view: MembershipView, now: Instant) {
        self.observe(Some(&view), now);
    }

    /// The view last read, if any.
    pub(crate) fn view(&self) -> Option<&MembershipView> {
        self.view.as_ref()
    }

    /// The version of the view last read (0: none).
    pub(crate) fn version(&self) -> u64 {
        self.view.as_ref().map_or(0, |v| v.version)
    }

    /// The live hosts of the view, sorted (empty without a view), shared: a host takes them
    /// in at every head read, and a thousand-host fleet's list is not copied each time.
    pub(crate) fn live_shared(&self) -> Arc<[HostName]> {
        Arc::clone(&self.live)
    }

    /// Whether the view moved within `expiry` at `now`: its leader is writing it. A stale
    /// view is still safe to act on (its judgments stay true); it only means the fleet needs
    /// a new leader.
    pub(crate) fn fresh(&self, now: Instant, expiry: Duration) -> bool {
        self.changed_at
            .is_some_and(|at| now.saturating_duration_since(at) < expiry)
    }

    /// Whether the fleet needs a new leader at `now`: there is no view, it went stale, or its
    /// leader gave it up (a leader that stops gracefully writes a last view that does not list
    /// it live).
    pub(crate) fn leaderless(&self, now: Instant, expiry: Duration) -> bool {
        match &self.view {
            None => true,
            Some(v) => !self.fresh(now, expiry) || v.admits(&v.leader, &v.leader_incarnation).not(),
        }
    }

    /// Whether a heartbeat read shows that the view's leader is gone: its row was removed, or
    /// taken over by a later incarnation.
    pub(crate) fn leader_gone(&self, rows: &[Heartbeat]) -> bool {
        self.view.as_ref().is_some_and(|v| {
            !rows
                .iter()
                .any(|hb| hb.host == v.leader && hb.incarnation == v.leader_incarnation)
        })
    }

    /// The last view a leader that stops gracefully writes, with the version to write it at:
    /// the view it leads without itself among the live, so the others elect a new leader at
    /// once rather than after the expiry. It is not listed dead either: any lease it failed
    /// to release is left to expire with its heartbeat, not taken as free.
    pub(crate) fn abdication(&self) -> Option<(MembershipView, u64)> {
        let view = self.view.as_ref()?;
        let mut last = view.clone();
        last.live.retain(|h| h.host != view.leader);
        Some((last, view.version))
    }

    /// Whether the view names `me` in `incarnation` as its leader.
    pub(crate) fn led_by(&self, me: &HostName, incarnation: &str) -> bool {
        self.view
            .as_ref()
            .is_some_and(|v| &v.leader == me && &*v.leader_incarnation == incarnation)
    }

    /// Whether the view lists `me` live in `incarnation`: only then may this host take or
    /// ask for leases.
    pub(crate) fn admits(&self, me: &HostName, incarnation: &str) -> bool {
        self.view
            .as_ref()
            .is_some_and(|v| v.admits(me, incarnation))
    }

    /// Whether `host` is judged dead by the view: its leases are free.
    pub(crate) fn is_dead(&self, host: &HostName) -> bool {
        self.dead.contains(host)
    }

    /// The hosts the view judges dead.
    pub(crate) fn dead(&self) -> &BTreeSet<HostName> {
        &self.dead
    }

    /// Whether `judged` differs from the view last read (or there is none): only then does
    /// the leader write. The leader's renewals keep the view fresh without a write of its own.
    pub(crate) fn should_write(&self, judged: &MembershipView) -> bool {
        self.view
            .as_ref()
            .is_none_or(|view| !view.same_judgment(judged))
    }

    /// Whether there is a view at all.
    pub(crate) fn exists(&self) -> bool {
        self.view.is_some()
    }
}

/// The view a leader writes from its own judgment: the hosts `live` (judged live from the
/// heartbeat `rows` read after the view it will replace), each with the incarnation read;
/// as dead, every other host with a row, and every lease owner in `owners` (from a table
/// listed before that heartbeat read) with no row: a host registers before it takes, so an
/// owner without a row left or was cleared. Each live host is listed with the limits its
/// report publishes (`limits_of`).
pub(crate) fn judge(
    me: &HostName,
    my_row: &Heartbeat,
    rows: &[Heartbeat],
    live: &[HostName],
    owners: &BTreeSet<HostName>,
    limits_of: impl Fn(&HostName) -> Option<HostLimits>,
) -> MembershipView {
    let is_live = |h: &HostName| live.binary_search(h).is_ok();
    let listed = |host: &HostName, incarnation: &Arc<str>| ViewHost {
        limits: limits_of(host),
        ..ViewHost::new(host.clone(), incarnation.clone())
    };
    let mut live_hosts: Vec<ViewHost> = rows
        .iter()
        .filter(|hb| is_live(&hb.host) && &hb.host != me)
        .map(|hb| listed(&hb.host, &hb.incarnation))
        .collect();
    live_hosts.push(listed(me, &my_row.incarnation));
    live_hosts.sort_by(|a, b| a.host.cmp(&b.host));
    live_hosts.dedup_by(|a, b| a.host == b.host);
    let listed: BTreeSet<&HostName> = live_hosts.iter().map(|h| &h.host).collect();
    let mut dead: BTreeSet<HostName> = rows
        .iter()
        .map(|hb| &hb.host)
        .filter(|h| !listed.contains(h))
        .cloned()
        .collect();
    let with_row: BTreeSet<&HostName> = rows.iter().map(|hb| &hb.host).collect();
    dead.extend(
        owners
            .iter()
            .filter(|o| !with_row.contains(o) && !listed.contains(o))
            .cloned(),
    );
    MembershipView {
        version: 0,
        leader: me.clone(),
        leader_incarnation: Arc::clone(&my_row.incarnation),
        leader_heartbeat: my_row.version,
        live: live_hosts,
        dead: dead.into_iter().collect(),
    }
}
