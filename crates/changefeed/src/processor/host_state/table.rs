//! The parts of the host state and the pure decisions over them: the lease table
//! ([`LeaseTable`]: the listed rows, the partitions this host owns and was asked for, and
//! whether the workers must be told of a whole new listing), the listing state ([`Listing`]:
//! counter, live hosts and time of the last list), the hand-off requests this host waits on
//! ([`Requests`]), the plan built from them ([`plan`]), leader choice, dead hosts' rows, and
//! what a conflicting take or hand-off request leads to.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::balance::{holder, BalanceStrategy, Census, CensusSnapshot, LeaseView, Plan, Snapshot};
use crate::clock::Instant;
use crate::lineage::{ready_to_read, ParentsRule};
use crate::model::{Heartbeat, HostName, Lease, LeaseState, PartitionId};

/// The leases this host has listed, sorted by partition, and what they say of this host.
///
/// Rows are shared (`Arc<Lease>`): a store that hands out its own rows (the in-memory store)
/// costs each table one pointer per lease, which lets the simulator hold a thousand hosts'
/// tables of 100,000 leases. Alongside the rows the table keeps the [`Census`] of its
/// eligible leases up to date with every row it takes in, so that planning costs
/// O(changed leases + hosts), not O(leases).
#[derive(Debug, Clone)]
pub(crate) struct LeaseTable {
    me: HostName,
    parents: ParentsRule,
    leases: Vec<Arc<Lease>>,
    /// The eligible leases (design rule 5), indexed for the balancer.
    census: Census,
    /// Per partition named as a parent: the listed leases naming it. Their eligibility
    /// follows its row, so they are counted again when it changes.
    children: BTreeMap<PartitionId, Vec<PartitionId>>,
    /// The partitions `leases` lists as owned by this host.
    mine: BTreeSet<PartitionId>,
    /// The partitions `leases` lists with this host as `next_owner`.
    asked: BTreeSet<PartitionId>,
    /// Set when `leases` was replaced whole: every worker's row must be compared before the
    /// next hints (rows taken in one by one are compared as they come).
    hint_all: bool,
    /// Set when a listed lease became finished (its partition closed and was read to the
    /// end): its children may now need leases, so the leader syncs at once rather than at
    /// its next `sync_interval`. Cleared by [`LeaseTable::take_finished`].
    finished: bool,
}

impl LeaseTable {
    pub(crate) fn new(me: HostName, parents: ParentsRule) -> Self {
        Self {
            me,
            parents,
            leases: Vec::new(),
            census: Census::new(),
            children: BTreeMap::new(),
            mine: BTreeSet::new(),
            asked: BTreeSet::new(),
            hint_all: false,
            finished: false,
        }
    }

    /// Takes in a fresh listing whole (sorted here if the store did not list in key order).
    pub(crate) fn replace_all(&mut self, leases: Vec<impl Into<Arc<Lease>>>) {
        let mut leases: Vec<Arc<Lease>> = leases.into_iter().map(Into::into).collect();
        // One pass: the rows are many, and each pass over them is a trip through memory.
        self.mine.clear();
        self.asked.clear();
        self.children.clear();
        let mut sorted = true;
        let mut previous: Option<&PartitionId> = None;
        for l in &leases {
            let partition = &l.key.partition;
            sorted &= previous.is_none_or(|p| p <= partition);
            previous = Some(partition);
            if l.is_owned_by(&self.me) {
                self.mine.insert(partition.clone());
            }
            if l.next_owner.as_ref() == Some(&self.me) {
                self.asked.insert(partition.clone());
            }
        }
        if !sorted {
            leases.sort_by(|a, b| a.key.partition.cmp(&b.key.partition));
        }
        // Only finished rows are looked up in the old table: they are few.
        self.finished |= leases.iter().any(|l| {
            l.state == LeaseState::Finished
                && self
                    .get(&l.key.partition)
                    .is_none_or(|old| old.state != LeaseState::Finished)
        });
        self.leases = leases;
        for i in 0..self.leases.len() {
            let row = self.leases[i].clone();
            self.link(&row);
        }
        self.census = Census::new();
        for i in 0..self.leases.len() {
            let row = self.leases[i].clone();
            self.count(&row);
        }
        self.hint_all = true;
    }

    /// Takes in one row if it is newer than the cached one (or new). Returns the row if it
    /// was taken in, so its worker can be told.
    pub(crate) fn remember(&mut self, lease: impl Into<Arc<Lease>>) -> Option<&Lease> {
        let lease: Arc<Lease> = lease.into();
        let finishes = lease.state == LeaseState::Finished;
        let at = self.index(&lease.key.partition);
        match at {
            Ok(i) if self.leases[i].version < lease.version => {
                self.finished |= finishes && self.leases[i].state != LeaseState::Finished;
            }
            Ok(_) => return None,
            Err(_) => self.finished |= finishes,
        }
        let i = self.put(at, Some(lease))?;
        Some(&self.leases[i])
    }

    /// Forgets a deleted lease.
    pub(crate) fn remove(&mut self, partition: &PartitionId) {
        let at = self.index(partition);
        if at.is_ok() {
            self.put(at, None);
        }
    }

    /// Puts `new` at `at` (`Ok`: over the row there; `Err`: inserted there), or removes the
    /// row at `at` when `new` is `None`, keeping the census, the children index and this
    /// host's marks in step. Returns where the new row is.
    fn put(&mut self, at: Result<usize, usize>, new: Option<Arc<Lease>>) -> Option<usize> {
        let old = at.ok().map(|i| self.leases[i].clone());
        let partition = new
            .as_ref()
            .or(old.as_ref())
            .map(|l| l.key.partition.clone())?;
        // The leases naming this one as a parent: their eligibility may follow its change.
        let kids = self.kids_of(&partition);
        for kid in &kids {
            self.uncount(kid);
        }
        if let Some(old) = &old {
            self.uncount(old);
            self.unlink(old);
        }
        let me = &self.me;
        let marks = |l: Option<&Arc<Lease>>| {
            l.map_or((false, false), |l| {
                (l.is_owned_by(me), l.next_owner.as_ref() == Some(me))
            })
        };
        let (before, after) = (marks(old.as_ref()), marks(new.as_ref()));
        let placed = match (at, new) {
            (Ok(i), Some(new)) => {
                self.leases[i] = new;
                Some(i)
            }
            (Err(i), Some(new)) => {
                self.leases.insert(i, new);
                Some(i)
            }
            (Ok(i), None) => {
                self.leases.remove(i);
                None
            }
            (Err(_), None) => None,
        };
        if let Some(i) = placed {
            let row = self.leases[i].clone();
            self.link(&row);
            self.count(&row);
        }
        for kid in &kids {
            self.count(kid);
        }
        for (set, was, is) in [
            (&mut self.mine, before.0, after.0),
            (&mut self.asked, before.1, after.1),
        ] {
            match (was, is) {
                (false, true) => {
                    set.insert(partition.clone());
                }
                (true, false) => {
                    set.remove(&partition);
                }
                _ => {}
            }
        }
        placed
    }

    /// The listed rows of the leases naming `partition` as a parent (not itself).
    fn kids_of(&self, partition: &PartitionId) -> Vec<Arc<Lease>> {
        let Some(kids) = self.children.get(partition) else {
            return Vec::new();
        };
        let mut kids: Vec<&PartitionId> = kids.iter().filter(|k| *k != partition).collect();
        kids.sort_unstable();
        kids.dedup();
        kids.into_iter()
            .filter_map(|k| self.index(k).ok().map(|i| self.leases[i].clone()))
            .collect()
    }

    /// Notes `row` as a child of each of its parents.
    fn link(&mut self, row: &Lease) {
        for parent in &row.parents {
            self.children
                .entry(parent.clone())
                .or_default()
                .push(row.key.partition.clone());
        }
    }

    /// Forgets `row` as a child of its parents.
    fn unlink(&mut self, row: &Lease) {
        for parent in &row.parents {
            if let Some(kids) = self.children.get_mut(parent) {
                if let Some(k) = kids.iter().position(|k| *k == row.key.partition) {
                    kids.swap_remove(k);
                }
                if kids.is_empty() {
                    self.children.remove(parent);
                }
            }
        }
    }

    /// Counts `row` in the census if it is eligible now.
    fn count(&mut self, row: &Arc<Lease>) {
        if self.eligible(row, self.parents) {
            self.census.insert(row.clone());
        }
    }

    /// Stops counting `row` (as it was counted: call before anything it depends on changes).
    fn uncount(&mut self, row: &Lease) {
        if self.eligible(row, self.parents) {
            self.census.remove(row);
        }
    }

    fn index(&self, partition: &PartitionId) -> Result<usize, usize> {
        self.leases
            .binary_search_by(|l| l.key.partition.cmp(partition))
    }

    /// The listed row of `partition`, if any.
    pub(crate) fn get(&self, partition: &PartitionId) -> Option<&Lease> {
        self.index(partition).ok().map(|i| &*self.leases[i])
    }

    /// Every listed row, sorted by partition.
    pub(crate) fn rows(&self) -> &[Arc<Lease>] {
        &self.leases
    }

    /// The eligible leases, indexed for the balancer.
    pub(crate) fn census(&self) -> &Census {
        &self.census
    }

    /// The partitions listed with this host as `next_owner`.
    pub(crate) fn asked(&self) -> &BTreeSet<PartitionId> {
        &self.asked
    }

    /// Whether the table was replaced whole since the last call (then every worker's row must
    /// be compared); resets the flag.
    pub(crate) fn take_hint_all(&mut self) -> bool {
        std::mem::take(&mut self.hint_all)
    }

    /// Whether a listed lease became finished since the last call; resets the flag.
    pub(crate) fn take_finished(&mut self) -> bool {
        std::mem::take(&mut self.finished)
    }

    /// Whether any listed lease names `host` as its owner.
    pub(crate) fn owns_any(&self, host: &HostName) -> bool {
        self.leases.iter().any(|l| l.owner.as_ref() == Some(host))
    }

    /// Whether `lease` may be read now (design rule 5, see [`ready_to_read`]).
    pub(crate) fn eligible(&self, lease: &Lease, parents: ParentsRule) -> bool {
        ready_to_read(lease, |p| self.get(p), parents)
    }

    /// The leases this host owns by the table whose partitions `running` does not list: to
    /// resume (a restart under the same name, or a fence that was lowered).
    pub(crate) fn to_adopt(&self, running: impl Fn(&PartitionId) -> bool) -> Vec<Lease> {
        self.mine
            .iter()
            .filter(|p| !running(p))
            .filter_map(|p| self.get(p).cloned())
            .collect()
    }
}

/// What the host should read after a membership read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// The cached table is accurate: the counter has not moved and the live hosts are the
    /// same.
    Nothing,
    /// Only what changed since the last list (the store may answer with a full list).
    Changes,
    /// The safety net is due: the changes since the table's counter on a store that can say
    /// (however few), every lease on one that cannot.
    Full,
}

/// When and at what change counter this host last listed the leases.
#[derive(Debug, Clone, Default)]
pub(crate) struct Listing {
    /// The change counter the cached table is at, if it is trusted.
    pub(crate) counter: Option<u64>,
    /// The live hosts when the table was last balanced on.
    live: Vec<HostName>,
    last_full: Option<Instant>,
}

impl Listing {
    /// What to read after a membership read at `now` showing `counter` and `live`.
    pub(crate) fn next_read(
        &self,
        counter: u64,
        live: &[HostName],
        now: Instant,
        full_every: Duration,
    ) -> Read {
        let full_due = self
            .last_full
            .is_none_or(|t| now.saturating_duration_since(t) >= full_every);
        if full_due {
            Read::Full
        } else if self.counter != Some(counter) || live != self.live.as_slice() {
            Read::Changes
        } else {
            Read::Nothing
        }
    }

    /// A read chosen by [`Listing::next_read`] succeeded at `counter`, and `live` was judged
    /// from a membership read made after it.
    pub(crate) fn listed(&mut self, read: Read, counter: u64, live: &[HostName], now: Instant) {
        self.counter = Some(counter);
        self.live = live.to_vec();
        if read == Read::Full {
            self.last_full = Some(now);
        }
    }

    /// Whether `live` differs from the live hosts the table was last balanced on; if so, it is
    /// balanced on `live` from now.
    pub(crate) fn rejudged(&mut self, live: &[HostName]) -> bool {
        if self.live == live {
            return false;
        }
        self.live = live.to_vec();
        true
    }

    /// A list of changes took the trusted table to `counter` (an untrusted one stays so).
    pub(crate) fn advanced(&mut self, counter: u64) {
        if self.counter.is_some() {
            self.counter = Some(counter);
        }
    }

    /// The cached table can no longer be trusted at its counter (a failed read after a list,
    /// or this host's own writes): list again next cycle.
    pub(crate) fn invalidate(&mut self) {
        self.counter = None;
    }
}

/// The live hosts from `liveness_live` (those whose heartbeat moved within the expiry),
/// with this host always counted: it is alive by definition while it runs.
pub(crate) fn live_hosts(mut live: Vec<HostName>, me: &HostName) -> Vec<HostName> {
    if !live.contains(me) {
        live.push(me.clone());
        live.sort();
    }
    live
}

/// Whether `me` leads the fleet: the first live host by name (two hosts that both believe
/// they lead are harmless: every leader write is create-if-absent or a CAS).
pub(crate) fn leads(me: &HostName, live: &[HostName]) -> bool {
    live.iter().min() == Some(me)
}

/// The heartbeat rows the leader removes: hosts judged dead that own no listed lease any
/// more (a newcomer would otherwise count them as owed a share).
pub(crate) fn dead_rows<'a>(
    hosts: &'a [Heartbeat],
    live: &[HostName],
    table: &LeaseTable,
) -> Vec<&'a Heartbeat> {
    hosts
        .iter()
        .filter(|hb| !live.contains(&hb.host) && !table.owns_any(&hb.host))
        .collect()
}

/// The hand-off requests this host has made and waits on: when it first saw each, on its
/// own clock.
#[derive(Debug, Clone, Default)]
pub(crate) struct Requests {
    asked_at: BTreeMap<PartitionId, Instant>,
}

impl Requests {
    /// A request for `partition` was written and returned at `at`.
    pub(crate) fn written(&mut self, partition: PartitionId, at: Instant) {
        self.asked_at.insert(partition, at);
    }

    /// The lease was taken (no longer waited on).
    pub(crate) fn taken(&mut self, partition: &PartitionId) {
        self.asked_at.remove(partition);
    }

    /// Whether any request is pending (then time alone can change the plan).
    pub(crate) fn any(&self) -> bool {
        !self.asked_at.is_empty()
    }

    /// Keeps only the requests the table still shows (`asked`), timing those it shows for the
    /// first time from `seen` (no earlier than the list that showed them: a request of ours
    /// whose reply was lost landed before that list returned).
    pub(crate) fn sync(&mut self, asked: &BTreeSet<PartitionId>, seen: Instant) {
        self.asked_at.retain(|p, _| asked.contains(p));
        for p in asked {
            self.asked_at.entry(p.clone()).or_insert(seen);
        }
    }

    /// Whether the request for `partition` has waited `timeout` at `now`.
    pub(crate) fn overdue(&self, partition: &PartitionId, now: Instant, timeout: Duration) -> bool {
        self.asked_at
            .get(partition)
            .is_some_and(|at| now.saturating_duration_since(*at) >= timeout)
    }
}

/// What [`plan`] needs to know.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanInput<'a> {
    pub me: &'a HostName,
    pub live: &'a [HostName],
    /// The hosts judged dead, whose leases are free. `None`: every owner not in `live` is
    /// dead (judged from the heartbeats by this host). With `Some` (a membership view), an
    /// owner neither live nor dead is unknown: its leases are neither free nor counted in any
    /// quota, as if they were ineligible.
    pub dead: Option<&'a BTreeSet<HostName>>,
    pub table: &'a LeaseTable,
    pub requests: &'a Requests,
    /// Now, on this host's clock.
    pub now: Instant,
    /// When this host registered.
    pub registered_at: Instant,
    pub handoff_timeout: Duration,
    /// The start-up grace: hand-off requests wait this long after registering, so that hosts
    /// started together see each other before computing shares (otherwise the first to run
    /// would ask for a share of a smaller fleet, and leases would move twice).
    pub grace: Duration,
    pub parents: ParentsRule,
}

/// The strategy's plan over the table, with hand-offs marked overdue after the timeout and
/// requests held back during the start-up grace. Returns the plan and whether something was
/// held back (then plan again next cycle even if nothing changes).
///
/// A strategy that plans from the table's census ([`BalanceStrategy::plan_census`], the
/// default [`crate::balance::EqualShare`]) costs O(changed leases + hosts); any other gets a
/// snapshot of every lease ([`snapshot_plan`]).
pub(crate) fn plan(input: &PlanInput<'_>, strategy: &dyn BalanceStrategy) -> (Plan, bool) {
    let overdue = |partition: &PartitionId| {
        input
            .requests
            .overdue(partition, input.now, input.handoff_timeout)
    };
    let census = CensusSnapshot {
        me: input.me,
        live_hosts: input.live,
        dead_hosts: input.dead,
        census: input.table.census(),
        handoff_overdue: &overdue,
    };
    let mut plan = strategy
        .plan_census(&census)
        .unwrap_or_else(|| snapshot_plan(input, strategy));
    let in_grace = input.now.saturating_duration_since(input.registered_at) < input.grace;
    let held = in_grace && !plan.request_handoff.is_empty();
    if held {
        plan.request_handoff.clear();
    }
    (plan, held)
}

/// The strategy's plan over a snapshot of every listed lease: eligible by the parents rule,
/// except leases whose owner is unknown (neither live nor dead, see [`PlanInput::dead`]).
pub(crate) fn snapshot_plan(input: &PlanInput<'_>, strategy: &dyn BalanceStrategy) -> Plan {
    let live: HashSet<&HostName> = input.live.iter().collect();
    let unknown = |lease: &Lease| {
        input.dead.is_some_and(|dead| {
            holder(lease).is_some_and(|owner| !live.contains(owner) && !dead.contains(owner))
        })
    };
    let views: Vec<LeaseView<'_>> = input
        .table
        .rows()
        .iter()
        .map(|lease| LeaseView {
            lease,
            eligible: input.table.eligible(lease, input.parents) && !unknown(lease),
            handoff_overdue: input.requests.overdue(
                &lease.key.partition,
                input.now,
                input.handoff_timeout,
            ),
        })
        .collect();
    strategy.plan(&Snapshot {
        me: input.me,
        live_hosts: input.live,
        leases: &views,
    })
}

/// Whether a hand-off request for `lease` from `owner` may be written now: the lease is still
/// owned by `owner`, and no request from another live host is pending (a request naming a
/// dead host is stale and may be overwritten).
pub(crate) fn may_request(lease: &Lease, owner: &HostName, live: &[HostName]) -> bool {
    let pending = lease
        .next_owner
        .as_ref()
        .is_some_and(|n| n != owner && live.contains(n));
    lease.is_owned_by(owner) && !pending
}

/// What to do with a take that conflicted with the store's `current` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TakeConflict {
    /// Only the checkpoint moved since the row was listed (its owner wrote one before it
    /// died): take it again at the current version once a fresh membership read still shows
    /// the owner dead.
    RetryAfterMembership,
    /// Ownership changed: keep the current row and plan again next cycle.
    Replan,
}

/// Decides what a conflicting take (`steal`: of an unhonoured hand-off) leads to.
pub(crate) fn on_take_conflict(listed: &Lease, current: &Lease, steal: bool) -> TakeConflict {
    if !steal && !current.ownership_differs(listed) {
        TakeConflict::RetryAfterMembership
    } else {
        TakeConflict::Replan
    }
}

/// Whether a take retried after a conflict may go ahead: its owner is still judged dead by a
/// membership read made after the conflict, and no worker of an earlier ownership of this
/// host still runs on it.
pub(crate) fn may_retry_take(row: &Lease, live: &[HostName], worker_running: bool) -> bool {
    !row.owner.as_ref().is_some_and(|o| live.contains(o)) && !worker_running
}
