//! The cycle's steps after the list: the view, the leader's chores, and acting on the plan.

use super::*;

impl HostState {
    /// With a view: when this host leads, or no view is fresh (a leader is needed), read every
    /// heartbeat to judge them, and write the view if this host leads (or is the first live
    /// host by its own judgment) and the view changes. Without a view, the first read was
    /// every heartbeat already.
    ///
    /// The order is the safety argument's (`docs/protocol.md`, "The membership view"): the
    /// view's version and the table were read before the heartbeats, so a host the view
    /// replaced let in has its row in this read, and the write is a CAS on that version.
    pub(super) fn lead(&mut self, c: &mut Cycle, now: &Now) {
        if let Some(m) = c.first_membership.take() {
            c.membership = Some((m, c.sent));
            c.stage = Stage::Sync;
            return;
        }
        if !self.needs_heartbeats(now.at) {
            self.outbox.push(Effect::LeadUntil(None));
            c.stage = Stage::Sync;
            return;
        }
        c.call(
            Call::Membership,
            Stage::AwaitLeadMembership { sent: now.at },
        );
    }

    /// The leader's (or a candidate's) heartbeat read, sent at `sent`, returned at `now`.
    pub(super) fn led(&mut self, c: &mut Cycle, m: Membership, sent: Instant, now: &Now) {
        self.observe(&m, sent, now.at);
        // Renew as the leader until the fence would fall if this host leads a view that stays
        // up to date (its judgment is unchanged, or written below): a leader whose cycles stop
        // keeping it stops looking alive in the view within `E − M`, and the fleet elects
        // another; a slow cycle does not make it look dead.
        let lead_until = now.at + self.config.fence_after;
        let write = self.view_to_write(&m, now.at);
        c.membership = Some((m, sent));
        c.stage = Stage::Sync;
        let Some((view, expected)) = write else {
            let until = self.leads().then_some(lead_until);
            self.outbox.push(Effect::LeadUntil(until));
            return;
        };
        if c.cut_short(now) {
            // Stalled past the fence since the cycle began: the judgment is stale.
            return;
        }
        let changed = !self.same_view(&view);
        c.call(
            Call::WriteView {
                view,
                expected,
                changed,
            },
            Stage::AwaitViewWrite { lead_until },
        );
    }

    /// The leader's partition sync, when it is due or a lease became finished (its children
    /// may need leases).
    pub(super) fn sync_step(&mut self, c: &mut Cycle) {
        // The heartbeat read judged the live hosts anew (the leader, or an election): a host
        // judged dead there frees its leases now, not at the next cycle. The table was listed
        // before that read, as the judgment must be.
        c.live_changed = c.membership.is_some() && self.take_live_change();
        let wanted = self.sync_wanted();
        if !self.leads() {
            // A host that comes to lead syncs at once, and times cleanup delays afresh.
            if self.sync_at.take().is_some() {
                self.outbox.push(Effect::SyncReset);
            }
            self.synced();
            c.stage = Stage::Unowned;
            return;
        }
        let due = self
            .sync_at
            .is_none_or(|t| c.now.saturating_duration_since(t) >= self.config.sync_interval);
        if !wanted && !due {
            c.stage = Stage::Unowned;
            return;
        }
        self.sync_at = Some(c.now);
        c.call(
            Call::Sync {
                rows: self.rows(),
                counter: self.table_counter(),
                now: c.now,
            },
            Stage::AwaitSync,
        );
    }

    /// On the leader, at most every [`UNOWNED_LAG_REFRESH`]: the lag of the partitions no host
    /// reads, so the fleet's lag counts them once.
    pub(super) fn unowned(&mut self, c: &mut Cycle) {
        if !self.leads() {
            if self.unowned_lag_at.take().is_some() {
                self.outbox.push(Effect::UnownedLagCleared);
            }
            c.stage = Stage::Forget(self.dead_rows_of(c));
            return;
        }
        if self
            .unowned_lag_at
            .is_some_and(|t| c.now.saturating_duration_since(t) < UNOWNED_LAG_REFRESH)
        {
            c.stage = Stage::Forget(self.dead_rows_of(c));
            return;
        }
        self.unowned_lag_at = Some(c.now);
        c.call(
            Call::EstimateUnowned { rows: self.rows() },
            Stage::AwaitEstimate,
        );
    }

    /// The leader removes the heartbeat row of a host judged dead once it owns no lease any
    /// more. Otherwise a newcomer, which cannot yet tell a dead row from a live one, would
    /// count it as a host owed a share. The removal is a CAS on the version seen, so a host
    /// that renewed meanwhile keeps its row.
    ///
    /// A host that registers again starts its new row at version 1, so a removal sent on a
    /// stale read could hit the new row of a host that came back: rows are removed only while
    /// the membership read is younger than the safety margin and this host has not stalled
    /// past its fence since the cycle began.
    pub(super) fn forget(&mut self, c: &mut Cycle, mut rows: VecDeque<Heartbeat>, now: &Now) {
        let Some(hb) = rows.pop_front() else {
            c.stage = Stage::Decide;
            return;
        };
        let sent = c.membership.as_ref().map_or(c.sent, |(_, sent)| *sent);
        let age = now.at.saturating_duration_since(sent);
        if c.cut_short(now) || age >= self.config.safety_margin {
            c.stage = Stage::Decide;
            return;
        }
        c.call(Call::RemoveHeartbeat(hb), Stage::AwaitRemove(rows));
    }

    /// Whether to plan: only if something changed hands, a request waits, an outcome asked
    /// for another look, or the strategy plans by load (loads move without a lease changing
    /// hands); never on reads a stall made stale.
    pub(super) fn decide_plan(&mut self, c: &mut Cycle, now: &Now) {
        let moved = c.listed || c.synced || c.live_changed || self.config.strategy.wants_load();
        if !self.wants_plan(moved) {
            // Nothing changed hands and no request waits: the cached list is accurate.
            self.outbox.push(Effect::Gauges);
            return;
        }
        if c.cut_short(now) {
            // Stalled mid-cycle past the fence: what was read is stale, and a fenced host
            // neither takes nor asks.
            self.defer();
            return;
        }
        self.begin_plan();
        c.stage = Stage::Resume(self.to_adopt().into());
    }

    /// The plan: takes and steals, hand-off requests, releases, in that order.
    pub(super) fn balance(&mut self, c: &mut Cycle, now: &Now) {
        // Hand-off requests are timed on this host's own clock from when it first sees them.
        let strategy = self.planning_strategy(c.now);
        let actions = self.actions(c.now, now.at, strategy.as_ref());
        if actions.takes.is_empty() && actions.requests.is_empty() && actions.releases.is_empty() {
            self.outbox.push(Effect::Gauges);
            return;
        }
        c.takes = actions.takes.into();
        c.requests = actions.requests.into();
        c.releases = actions.releases;
        c.stage = Stage::Takes;
    }

    /// Where the requests go on: the next one, or the releases.
    pub(super) fn next_request(c: &Cycle) -> Stage {
        if c.requests.is_empty() {
            Stage::Releases
        } else {
            Stage::Request {
                attempt: 0,
                current: None,
            }
        }
    }

    /// The first waiting request's next write, from the cached row or the store's `current`
    /// after a conflict, while it still makes sense and attempts remain.
    pub(super) fn request(&mut self, c: &mut Cycle, attempt: u8, current: Option<Lease>) {
        let row = c
            .requests
            .front()
            .filter(|_| attempt < REQUEST_ATTEMPTS)
            .and_then(|req| Some((req.from.clone(), self.request_row(req, current.as_ref())?)));
        let Some((from, (lease, next))) = row else {
            c.requests.pop_front();
            c.stage = Self::next_request(c);
            return;
        };
        c.call(
            Call::Write {
                next,
                expected: lease.version,
                why: Why::Request { from },
            },
            Stage::AwaitRequest { attempt },
        );
    }

    /// Takes that conflicted only because their checkpoint had moved are taken again at their
    /// current version, only if the owner is still judged dead by a read made after the
    /// conflict: a host that came back registers before it writes a lease, so an owner that
    /// re-adopted its lease shows a new heartbeat there and keeps it.
    pub(super) fn retry_judged(
        &mut self,
        c: &mut Cycle,
        roll: Option<HeadRead>,
        sent: Instant,
        now: &Now,
    ) {
        let Some(roll) = roll else {
            self.retry_abandoned(c);
            return;
        };
        let by_view = match &roll {
            HeadRead::Head(head) => {
                self.live_after_conflict_head(head, now.at, c.retry.make_contiguous())
            }
            HeadRead::Heartbeats(_) => None,
        };
        let live = match (by_view, roll) {
            (Some(live), _) => live,
            (None, HeadRead::Heartbeats(m)) => self.live_after_conflict(&m, sent, now.at),
            (None, HeadRead::Head(_)) => {
                // Electing a leader: judge from a heartbeat read made after the conflict.
                c.call(
                    Call::Membership,
                    Stage::AwaitRetryMembership { sent: now.at },
                );
                return;
            }
        };
        c.stage = Stage::Retry { live };
    }

    /// The read after a conflict failed: keep the current rows, and plan again next cycle.
    pub(super) fn retry_abandoned(&mut self, c: &mut Cycle) {
        for row in std::mem::take(&mut c.retry) {
            self.keep_and_replan(row);
        }
        c.stage = Self::next_request(c);
    }

    /// The next retried take the hosts `live` after the conflict allow.
    pub(super) fn retry_next(&mut self, c: &mut Cycle, live: Vec<HostName>) {
        while let Some(row) = c.retry.pop_front() {
            if !self.retry_take(&row, &live) {
                continue;
            }
            let next = self.taken_row(&row);
            let why = Why::Take {
                kind: TakeKind::Take,
                previous: row.owner.clone(),
            };
            let expected = row.version;
            c.call(
                Call::Write {
                    next,
                    expected,
                    why,
                },
                Stage::AwaitRetryTake { row, live },
            );
            return;
        }
        c.stage = Self::next_request(c);
    }
}
