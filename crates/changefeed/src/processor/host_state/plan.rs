//! Planning from the table (what to take, ask for and release), the workers this host runs,
//! and when the partition sync is wanted.

use super::*;
use crate::balance::{BalanceStrategy, LeaseLimits};
use crate::model::LeaseState;

impl HostState {
    // --- planning --------------------------------------------------------------------------

    /// Whether to plan this cycle: something was listed or synced, a hand-off request is
    /// pending (time alone can make it overdue), or an outcome asked for another look.
    pub(crate) fn wants_plan(&self, changed: bool) -> bool {
        changed || self.requests.any() || self.replan
    }

    /// The cycle was cut short before planning: plan next cycle.
    pub(crate) fn defer(&mut self) {
        self.replan = true;
    }

    /// A write of the plan failed (the store did not answer, or answered with an error that
    /// is not a conflict): plan again next cycle rather than wait for the change counter to
    /// move, which nothing may make it do for a long while.
    pub(crate) fn write_failed(&mut self) {
        self.replan = true;
    }

    /// Planning begins: clears the replan flag (what follows sets it again if it wants another
    /// look) and tells each worker of a newer row from a full listing.
    pub(crate) fn begin_plan(&mut self) {
        self.replan = false;
        self.hint_all();
    }

    /// Leases the table says are ours but no worker runs (a restart under the same name, or a
    /// fence that was lowered): to claim again by CAS at their version.
    ///
    /// None before a view admits this host: an adoption is a take, and a host holding the
    /// view that judged this name dead would take the adopted lease as free.
    pub(crate) fn to_adopt(&self) -> Vec<Lease> {
        if !self.admitted() {
            return Vec::new();
        }
        self.table.to_adopt(|p| self.running.contains_key(p))
    }

    /// A claim of an owned row (an adoption) or a take conflicted with `current`, or a take
    /// was refused: keep the current row and plan again next cycle.
    pub(crate) fn keep_and_replan(&mut self, current: Lease) {
        self.remember(current);
        self.replan = true;
    }

    /// The strategy to plan with at `now`: the configured one, given the lease limits the
    /// live hosts publish ([`BalanceStrategy::with_published_limits`]), as the view lists them
    /// when it decides who is live, else as the heartbeat reports read say. Every host reads
    /// the same, so every host plans every host with that host's own limits. Built again only
    /// when what is published changes.
    pub(crate) fn planning_strategy(&mut self, now: Instant) -> Arc<dyn BalanceStrategy> {
        let published: BTreeMap<HostName, HostLimits> = if self.by_view(now) {
            self.observer
                .members
                .view()
                .map(|v| {
                    v.live
                        .iter()
                        .filter_map(|h| Some((h.host.clone(), h.limits?)))
                        .collect()
                })
                .unwrap_or_default()
        } else {
            self.loads.published_limits()
        };
        if published.is_empty() {
            self.limited = None;
            return self.config.strategy.clone();
        }
        if let Some((seen, strategy)) = &self.limited {
            if *seen == published {
                return strategy.clone();
            }
        }
        let limits: BTreeMap<HostName, LeaseLimits> = published
            .iter()
            .filter_map(|(host, l)| {
                match LeaseLimits::new(l.min_leases.unwrap_or(0), l.max_leases) {
                    Ok(limits) => Some((host.clone(), limits)),
                    Err(err) => {
                        tracing::debug!(%host, error = %err, "ignoring published lease limits");
                        None
                    }
                }
            })
            .collect();
        let strategy = self
            .config
            .strategy
            .with_published_limits(&limits)
            .unwrap_or_else(|| self.config.strategy.clone());
        self.limited = Some((published, strategy.clone()));
        strategy
    }

    /// The plan at `now`. Hand-off requests are timed from `seen` when the table shows them
    /// for the first time. Takes of partitions whose worker of an earlier ownership still runs
    /// wait (it could adopt the new row and write its stale position).
    pub(crate) fn actions(
        &mut self,
        now: Instant,
        seen: Instant,
        strategy: &dyn BalanceStrategy,
    ) -> Actions {
        self.requests.sync(&self.table.asked(), seen);
        if !self.admitted() {
            // Not yet listed live by a view: take and ask for nothing; plan again next cycle.
            self.replan = true;
            return Actions::default();
        }
        let by_view = self.by_view(now);
        let loads = strategy
            .wants_load()
            .then(|| self.loads.maps(&self.table, now));
        let load = loads.as_ref().map(|m| m.input());
        let (plan, held) = plan(
            &PlanInput {
                me: &self.me,
                live: &self.live,
                // With a view, only the owners it lists dead are; an owner it lists neither
                // way is unknown (it took under a view this host has not read, or runs a
                // version without views), and its leases count for nobody.
                dead: by_view.then(|| self.observer.members.dead()),
                table: &self.table,
                requests: &self.requests,
                now,
                registered_at: self.registered_at,
                handoff_timeout: self.config.handoff_timeout,
                grace: self.config.grace,
                parents: self.config.parents,
                load: load.as_ref(),
            },
            strategy,
        );
        self.replan |= held;
        let mut actions = Actions::default();
        let wanted = plan
            .take
            .iter()
            .map(|p| (p, TakeKind::Take))
            .chain(plan.steal.iter().map(|p| (p, TakeKind::Steal)));
        for (partition, kind) in wanted {
            let Some(lease) = self.table.get(partition) else {
                continue;
            };
            if self.running.contains_key(partition) {
                self.replan = true;
                continue;
            }
            actions.takes.push((lease.clone(), kind));
        }
        actions.requests = plan.request_handoff;
        actions.releases = plan.release;
        actions
    }

    /// The row `row` becomes when this host takes it.
    pub(crate) fn taken_row(&self, row: &Lease) -> Lease {
        let mut next = row.clone();
        next.state = LeaseState::Owned;
        next.owner = Some(self.me.clone());
        next.next_owner = None;
        next
    }

    /// A take stored `stored`: cache it (its worker starts next).
    pub(crate) fn took(&mut self, stored: Lease) {
        self.requests.taken(&stored.key.partition);
        self.remember(stored);
    }

    /// A take of `listed` conflicted with the store's `current` row. Returns the row to take
    /// again after a fresh membership read (see [`on_take_conflict`]); otherwise the current
    /// row is kept and the plan runs again next cycle.
    pub(crate) fn take_conflict(
        &mut self,
        listed: &Lease,
        current: Lease,
        kind: TakeKind,
    ) -> Option<Lease> {
        match on_take_conflict(listed, &current, kind == TakeKind::Steal) {
            TakeConflict::RetryAfterMembership => Some(current),
            TakeConflict::Replan => {
                self.keep_and_replan(current);
                None
            }
        }
    }

    /// The hosts judged live from a membership read that returned at `now`, made after a take
    /// conflicted (for [`HostState::retry_take`]).
    pub(crate) fn live_after_conflict(
        &mut self,
        membership: &Membership,
        sent: Instant,
        returned: Instant,
    ) -> Vec<HostName> {
        self.observer.liveness.observe(membership, returned);
        self.observer
            .liveness
            .live(sent.min(returned), self.config.lease_expiry)
    }

    /// The same as [`HostState::live_after_conflict`], from a head read with a view.
    /// `None` while the fleet elects a leader: then judge from a heartbeat read instead.
    pub(crate) fn live_after_conflict_head(
        &mut self,
        head: &GroupHead,
        now: Instant,
        rows: &[Lease],
    ) -> Option<Vec<HostName>> {
        self.observe_head(head, now);
        self.by_view(now).then(|| self.live_for(now, rows))
    }

    /// Whether a take retried after a conflict may go ahead, given the hosts `live` after it
    /// (see [`may_retry_take`]). If not, the row is kept and the plan runs again next cycle.
    pub(crate) fn retry_take(&mut self, row: &Lease, live: &[HostName]) -> bool {
        let ok = may_retry_take(row, live, self.running.contains_key(&row.key.partition));
        if !ok {
            self.keep_and_replan(row.clone());
        }
        ok
    }

    /// The row to write for `request` starting from `current` (the cached row at first, the
    /// store's after a conflict), if the request may still be written (see [`may_request`]).
    pub(crate) fn request_row(
        &self,
        request: &HandoffRequest,
        current: Option<&Lease>,
    ) -> Option<(Lease, Lease)> {
        let lease = current.or_else(|| self.table.get(&request.partition))?;
        if !may_request(lease, &request.from, &self.live) {
            return None;
        }
        let mut next = lease.clone();
        next.next_owner = Some(self.me.clone());
        Some((lease.clone(), next))
    }

    /// A hand-off request for `partition` was written and returned at `now`.
    pub(crate) fn requested(&mut self, partition: PartitionId, now: Instant) {
        self.requests.written(partition, now);
    }

    // --- workers ----------------------------------------------------------------------------

    /// A worker started on `lease`.
    pub(crate) fn worker_started(&mut self, lease: &Lease) {
        self.running
            .insert(lease.key.partition.clone(), lease.version);
    }

    /// The worker of `partition` exited. Whatever the reason, the lease changed hands or
    /// state: plan next cycle (a worker stopped by the fence left the lease ours, and
    /// [`HostState::to_adopt`] resumes it).
    pub(crate) fn worker_exited(&mut self, partition: &PartitionId) {
        self.running.remove(partition);
        self.replan = true;
    }

    /// How many workers run.
    pub(crate) fn running(&self) -> usize {
        self.running.len()
    }

    /// Puts a row newer than the cached one (or a new one) into the table, and tells its
    /// worker if it does not know it yet.
    pub(super) fn remember(&mut self, lease: impl Into<Arc<Lease>>) {
        for row in self.table.apply(&[], vec![lease.into()]) {
            self.hint(&row);
        }
    }

    /// Tells the worker of `row`'s lease, if one runs, of `row` if it is newer than the
    /// version the worker knows. Rows taken in one by one are told as the store gave them:
    /// a table taken from a [`TableShare`] may hold an older version of a row (one that
    /// agrees on ownership), and a worker is never told of a version older than it knows.
    pub(super) fn hint(&mut self, row: &Arc<Lease>) {
        if let Some(known) = self.running.get_mut(&row.key.partition) {
            if row.version > *known {
                *known = row.version;
                self.outbox.push(Effect::Hint(Lease::clone(row)));
            }
        }
    }

    // --- the partition sync ----------------------------------------------------------------

    /// Whether the partition sync should run now, before its interval: a lease became
    /// finished since the last successful sync (its children may need leases). Two hosts
    /// that both sync are harmless: lease creation is create-if-absent.
    pub(crate) fn sync_wanted(&mut self) -> bool {
        self.sync_wanted |= self.table.take_finished();
        self.sync_wanted
    }

    /// A partition sync succeeded, or this host does not lead (a host that comes to lead
    /// syncs at once anyway).
    pub(crate) fn synced(&mut self) {
        self.sync_wanted = false;
    }
}
