//! One acquire cycle as a machine: [`HostState::tick`] starts it, [`HostState::ready`] says
//! what to do next (effects, then at most one call), [`HostState::advance`] takes the call's
//! answer. The shell loops `ready` → carry out → `advance` until no call is left.
//!
//! A cycle: read the head (or every heartbeat); list what changed hands if the counter moved;
//! read membership again if the list is newer than that read; as the view's leader (or to
//! elect one), read every heartbeat and write the view; as the fleet's leader, sync the
//! partitions and estimate the lag of unowned ones, and remove dead hosts' rows; then, if
//! anything changed, resume own leases, take, ask for hand-offs and release by the plan. The
//! rules each step keeps are written where the step is decided.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use super::step::{Answer, Call, Effect, HeadRead, Now, Ready, Why};
use super::{HostState, Read, TakeKind};
use crate::balance::HandoffRequest;
use crate::clock::Instant;
use crate::error::LeaseError;
use crate::lease::{Changes, Listing};
use crate::model::{Heartbeat, HostName, Lease, Membership, PartitionId};

mod rows;
mod steps;

/// How often the leader estimates the lag of the partitions no host reads.
const UNOWNED_LAG_REFRESH: Duration = Duration::from_secs(10);

/// How many times a hand-off request is written again after a conflict that leaves it valid
/// (the owner checkpointed meanwhile).
const REQUEST_ATTEMPTS: u8 = 3;

/// Where a cycle is: a step to decide on, or a call whose answer it waits for.
#[derive(Debug)]
enum Stage {
    Start,
    AwaitFirstRead,
    List,
    AwaitChanges,
    ListAll,
    AwaitListAll,
    AwaitSecondRead { counter: u64, sent: Instant },
    Lead,
    AwaitLeadMembership { sent: Instant },
    AwaitViewWrite { lead_until: Instant },
    Sync,
    AwaitSync,
    AwaitRelistChanges,
    RelistAll,
    AwaitRelistAll,
    Unowned,
    AwaitEstimate,
    Forget(VecDeque<Heartbeat>),
    AwaitRemove(VecDeque<Heartbeat>),
    Decide,
    Resume(VecDeque<Lease>),
    AwaitResume { lease: Lease, rest: VecDeque<Lease> },
    AwaitResumeAgain { rest: VecDeque<Lease> },
    Balance,
    Takes,
    AwaitTake { lease: Lease, kind: TakeKind },
    RetryRead,
    AwaitRetryRead { sent: Instant },
    AwaitRetryMembership { sent: Instant },
    Retry { live: Vec<HostName> },
    AwaitRetryTake { row: Lease, live: Vec<HostName> },
    Request { attempt: u8, current: Option<Lease> },
    AwaitRequest { attempt: u8 },
    Releases,
    Done,
}

/// A cycle in progress.
#[derive(Debug)]
pub(super) struct Cycle {
    stage: Stage,
    /// When the first read was sent, and when it returned (the cycle's time).
    sent: Instant,
    now: Instant,
    /// The fence's lapses when the cycle began: one more since means its reads are stale.
    lapses: u64,
    roll_counter: u64,
    read: Read,
    /// The first read, when it was every heartbeat (a store without a view).
    first_membership: Option<Membership>,
    /// The membership read this cycle judged from, and when it was sent.
    membership: Option<(Membership, Instant)>,
    listed: bool,
    live_changed: bool,
    synced: bool,
    takes: VecDeque<(Lease, TakeKind)>,
    retry: VecDeque<Lease>,
    requests: VecDeque<HandoffRequest>,
    releases: Vec<PartitionId>,
    call: Option<Call>,
}

impl Cycle {
    fn new(now: Now) -> Self {
        Self {
            stage: Stage::Start,
            sent: now.at,
            now: now.at,
            lapses: now.lapses,
            roll_counter: 0,
            read: Read::Nothing,
            first_membership: None,
            membership: None,
            listed: false,
            live_changed: false,
            synced: false,
            takes: VecDeque::new(),
            retry: VecDeque::new(),
            requests: VecDeque::new(),
            releases: Vec::new(),
            call: None,
        }
    }

    /// Whether the host has been fenced, or stalled past its fence (a lapse), since the cycle
    /// began: then what it read is stale.
    fn cut_short(&self, now: &Now) -> bool {
        now.fenced || now.lapses != self.lapses
    }

    /// Waits in `stage` for the answer to `call`.
    fn call(&mut self, call: Call, stage: Stage) {
        self.call = Some(call);
        self.stage = stage;
    }
}

impl HostState {
    /// Starts a cycle at `now` (a cycle still in progress, cut off by a stop, is dropped).
    pub(crate) fn tick(&mut self, now: Now) {
        self.cycle = Some(Cycle::new(now));
    }

    /// What to do now: the effects decided since the last call, in order, and the next call
    /// to make, if any. `now` is the shell's reading when it asks.
    pub(crate) fn ready(&mut self, now: Now) -> Ready {
        let call = self.run_until_call(&now);
        if call.is_none() {
            self.cycle = None;
        }
        Ready {
            effects: self.take_effects(),
            call,
        }
    }

    /// Takes in the answer to the last call, which returned at `now`.
    pub(crate) fn advance(&mut self, answer: Answer, now: Now) {
        let Some(mut c) = self.cycle.take() else {
            return;
        };
        let stage = std::mem::replace(&mut c.stage, Stage::Done);
        self.answered(&mut c, stage, answer, &now);
        self.cycle = Some(c);
    }

    fn run_until_call(&mut self, now: &Now) -> Option<Call> {
        let mut c = self.cycle.take()?;
        loop {
            if let Some(call) = c.call.take() {
                self.cycle = Some(c);
                return Some(call);
            }
            let stage = std::mem::replace(&mut c.stage, Stage::Done);
            if matches!(stage, Stage::Done) {
                return None;
            }
            self.decide(&mut c, stage, now);
        }
    }

    /// One step that needs no answer: it moves `c` to its next stage, or makes a call.
    fn decide(&mut self, c: &mut Cycle, stage: Stage, now: &Now) {
        match stage {
            Stage::Start => {
                if now.fenced {
                    // A fenced host neither takes nor asks; its workers have stopped.
                    return;
                }
                c.call(Call::ReadHead, Stage::AwaitFirstRead);
            }
            Stage::List => {
                // A host sharing its tables starts from the most recent one another host
                // listed.
                self.fast_forward();
                match self.table_counter() {
                    Some(since) => c.call(
                        Call::ListChanges {
                            since,
                            after_sync: false,
                        },
                        Stage::AwaitChanges,
                    ),
                    None => c.stage = Stage::ListAll,
                }
            }
            Stage::ListAll => c.call(Call::ListAll { after_sync: false }, Stage::AwaitListAll),
            Stage::Lead => self.lead(c, now),
            Stage::Sync => self.sync_step(c),
            Stage::RelistAll => c.call(Call::ListAll { after_sync: true }, Stage::AwaitRelistAll),
            Stage::Unowned => self.unowned(c),
            Stage::Forget(rows) => self.forget(c, rows, now),
            Stage::Decide => self.decide_plan(c, now),
            Stage::Resume(mut rest) => match rest.pop_front() {
                Some(lease) => c.call(
                    Call::Write {
                        next: lease.clone(),
                        expected: lease.version,
                        why: Why::Resume,
                    },
                    Stage::AwaitResume { lease, rest },
                ),
                None => c.stage = Stage::Balance,
            },
            Stage::Balance => self.balance(c, now),
            Stage::Takes => match c.takes.pop_front() {
                Some((lease, kind)) => {
                    let next = self.taken_row(&lease);
                    let why = Why::Take {
                        kind,
                        previous: lease.owner.clone(),
                    };
                    let expected = lease.version;
                    c.call(
                        Call::Write {
                            next,
                            expected,
                            why,
                        },
                        Stage::AwaitTake { lease, kind },
                    );
                }
                None if c.retry.is_empty() => c.stage = Self::next_request(c),
                None => c.stage = Stage::RetryRead,
            },
            Stage::RetryRead => c.call(Call::ReadHead, Stage::AwaitRetryRead { sent: now.at }),
            Stage::Retry { live } => self.retry_next(c, live),
            Stage::Request { attempt, current } => self.request(c, attempt, current),
            Stage::Releases => {
                for partition in std::mem::take(&mut c.releases) {
                    self.outbox.push(Effect::Release(partition));
                }
                self.outbox.push(Effect::Gauges);
            }
            Stage::Done
            | Stage::AwaitFirstRead
            | Stage::AwaitChanges
            | Stage::AwaitListAll
            | Stage::AwaitSecondRead { .. }
            | Stage::AwaitLeadMembership { .. }
            | Stage::AwaitViewWrite { .. }
            | Stage::AwaitSync
            | Stage::AwaitRelistChanges
            | Stage::AwaitRelistAll
            | Stage::AwaitEstimate
            | Stage::AwaitRemove(_)
            | Stage::AwaitResume { .. }
            | Stage::AwaitResumeAgain { .. }
            | Stage::AwaitTake { .. }
            | Stage::AwaitRetryRead { .. }
            | Stage::AwaitRetryMembership { .. }
            | Stage::AwaitRetryTake { .. }
            | Stage::AwaitRequest { .. } => {
                // Waiting for an answer that did not come (the shell asked again without
                // answering): the cycle ends, and the next starts afresh.
            }
        }
    }

    /// Takes in the answer to the call made in `stage`.
    fn answered(&mut self, c: &mut Cycle, stage: Stage, answer: Answer, now: &Now) {
        match (stage, answer) {
            (Stage::AwaitFirstRead, Answer::Head(Some(roll))) => self.first_read(c, roll, now),
            (Stage::AwaitChanges, Answer::Changes(Ok(Some(changes)))) => {
                let counter = changes.counter;
                self.take_change_list(changes);
                self.listed_ok(c, counter, true, now);
            }
            (Stage::AwaitChanges, Answer::Changes(Ok(None))) => c.stage = Stage::ListAll,
            (Stage::AwaitListAll, Answer::Listed(Ok(listing))) => {
                self.take_full_list(listing);
                // Listed after the counter was read: at least as new as the leases at it.
                self.offer_table_at(c.roll_counter);
                self.listed_ok(c, c.roll_counter, false, now);
            }
            (Stage::AwaitSecondRead { counter, sent }, Answer::Head(roll)) => {
                let Some(after) = roll else {
                    // The list was not balanced on: list again next cycle rather than skip
                    // balancing until the counter moves.
                    self.invalidate();
                    return;
                };
                self.observe_head_read(&after, sent, now.at);
                self.note_listed(c.read, counter, c.now);
                c.stage = Stage::Lead;
            }
            (Stage::AwaitLeadMembership { sent }, Answer::Membership(m)) => {
                let Some(m) = m else {
                    // Judged from no read made after the list: plan on nothing, and list
                    // again next cycle.
                    self.invalidate();
                    return;
                };
                self.led(c, m, sent, now);
            }
            (Stage::AwaitViewWrite { lead_until }, Answer::ViewWritten(written)) => {
                match written {
                    Ok(stored) => {
                        self.view_written(stored, now.at);
                        self.outbox.push(Effect::LeadUntil(Some(lead_until)));
                    }
                    Err(LeaseError::ViewConflict { current, .. }) => {
                        self.view_conflict(current.as_deref(), now.at);
                    }
                    // Reported by the shell; the view is written again next cycle.
                    Err(_) => {}
                }
                c.stage = Stage::Sync;
            }
            (Stage::AwaitSync, Answer::Synced { ok, changed }) => {
                if ok {
                    self.synced();
                }
                if ok && changed {
                    // Read what the sync (and anyone else) changed since the table's counter:
                    // the table is then at the counter the store answered with. A store that
                    // cannot say is listed in full, and the counter distrusted until the next
                    // list.
                    self.fast_forward();
                    match self.table_counter() {
                        Some(since) => c.call(
                            Call::ListChanges {
                                since,
                                after_sync: true,
                            },
                            Stage::AwaitRelistChanges,
                        ),
                        None => c.stage = Stage::RelistAll,
                    }
                } else {
                    c.stage = Stage::Unowned;
                }
            }
            (Stage::AwaitRelistChanges, Answer::Changes(read)) => match read {
                Ok(Some(changes)) => {
                    let counter = changes.counter;
                    self.take_change_list(changes);
                    self.advanced(counter);
                    c.synced = true;
                    c.stage = Stage::Unowned;
                }
                Ok(None) => c.stage = Stage::RelistAll,
                Err(_) => {
                    self.invalidate();
                    c.stage = Stage::Unowned;
                }
            },
            (Stage::AwaitRelistAll, Answer::Listed(listed)) => {
                match listed {
                    Ok(listing) => {
                        self.replace_table_after_sync(listing.leases);
                        c.synced = true;
                    }
                    Err(_) => self.invalidate(),
                }
                c.stage = Stage::Unowned;
            }
            (Stage::AwaitEstimate, _) => {
                c.stage = Stage::Forget(self.dead_rows_of(c));
            }
            (Stage::AwaitRemove(rest), _) => c.stage = Stage::Forget(rest),
            (Stage::AwaitResume { lease, rest }, Answer::Written(written)) => {
                match written {
                    Ok(stored) => self.start_worker(stored),
                    Err(LeaseError::Conflict { current, .. })
                        if current.is_owned_by(&self.me) && !current.ownership_differs(&lease) =>
                    {
                        // Only its checkpoint moved since it was listed (our own, or the
                        // cached row is older than the one listed): resume it at the current
                        // version.
                        let expected = current.version;
                        c.call(
                            Call::Write {
                                next: *current,
                                expected,
                                why: Why::Resume,
                            },
                            Stage::AwaitResumeAgain { rest },
                        );
                        return;
                    }
                    // It changed hands since it was listed: plan again with the current row.
                    Err(LeaseError::Conflict { current, .. }) => self.keep_and_replan(*current),
                    Err(_) => self.write_failed(),
                }
                c.stage = Stage::Resume(rest);
            }
            (Stage::AwaitResumeAgain { rest }, Answer::Written(written)) => {
                match written {
                    Ok(stored) => self.start_worker(stored),
                    Err(LeaseError::Conflict { current, .. }) => self.keep_and_replan(*current),
                    Err(_) => self.write_failed(),
                }
                c.stage = Stage::Resume(rest);
            }
            (Stage::AwaitTake { lease, kind }, Answer::Written(written)) => {
                match written {
                    Ok(stored) => self.took_and_start(stored),
                    // The cached row is older than the store's. If only its checkpoint moved
                    // (the owner wrote one before it died, after we listed), take it at the
                    // current version once a fresh membership read still shows that owner
                    // dead; otherwise plan again next cycle with the current row.
                    Err(LeaseError::Conflict { current, .. }) => {
                        c.retry.extend(self.take_conflict(&lease, *current, kind));
                    }
                    Err(_) => self.write_failed(),
                }
                c.stage = Stage::Takes;
            }
            (Stage::AwaitRetryRead { sent }, Answer::Head(roll)) => {
                self.retry_judged(c, roll, sent, now)
            }
            (Stage::AwaitRetryMembership { sent }, Answer::Membership(m)) => match m {
                Some(m) => {
                    let live = self.live_after_conflict(&m, sent, now.at);
                    c.stage = Stage::Retry { live };
                }
                None => self.retry_abandoned(c),
            },
            (Stage::AwaitRetryTake { row, live }, Answer::Written(written)) => {
                match written {
                    Ok(stored) => self.took_and_start(stored),
                    Err(LeaseError::Conflict { current, .. }) => self.keep_and_replan(*current),
                    Err(_) => self.keep_and_replan(row),
                }
                c.stage = Stage::Retry { live };
            }
            (Stage::AwaitRequest { attempt }, Answer::Written(written)) => match written {
                Ok(_) => {
                    if let Some(req) = c.requests.pop_front() {
                        // Timed from when the write returned: it landed by then, so the
                        // owner's workers stop delivering within handoff_timeout −
                        // safety_margin of it unless told (see `heartbeat::ViewStamp`).
                        self.requested(req.partition, now.at);
                    }
                    c.stage = Self::next_request(c);
                }
                // A conflict that only reflects a checkpoint of the owner is retried against
                // the current row, as long as the request still makes sense.
                Err(LeaseError::Conflict { current, .. }) => {
                    c.stage = Stage::Request {
                        attempt: attempt + 1,
                        current: Some(*current),
                    };
                }
                Err(_) => {
                    self.write_failed();
                    c.requests.pop_front();
                    c.stage = Self::next_request(c);
                }
            },
            // A failure the shell reported, or an answer to another question: the cycle ends.
            (_, _) => {}
        }
    }

    /// The first read of the cycle returned at `now`: decide what to list.
    fn first_read(&mut self, c: &mut Cycle, roll: HeadRead, now: &Now) {
        // A heartbeat version is first seen when the read completes, however long the store
        // took (rule 2 must not count a slow read's wait as time the version stood still).
        c.now = now.at;
        self.observe_head_read(&roll, c.sent, c.now);
        c.roll_counter = roll.change_counter();
        c.read = self.next_read(c.roll_counter, c.now);
        c.listed = c.read != Read::Nothing;
        if let HeadRead::Heartbeats(m) = roll {
            c.first_membership = Some(m);
        }
        if c.listed {
            // Rows that only moved their checkpoint are not in a list of changes, so a take
            // may find a newer version than the cached one (see the retried takes). The safety
            // net (`Read::Full`) is a list of changes too on a store that can answer one: it
            // reads the rows that changed hands since the counter the table is at, however
            // few, and lists in full only when the store cannot say or the table is not
            // trusted.
            c.stage = Stage::List;
        } else {
            // The counter did not move since the last list, whose hints were sent: no request
            // was written before this read that the workers do not know of.
            self.outbox.push(Effect::Confirm(c.sent));
            c.stage = Stage::Lead;
        }
    }

    /// Takes in a first read of the cycle, sent at `sent`, that returned at `now`.
    fn observe_head_read(&mut self, roll: &HeadRead, sent: Instant, now: Instant) {
        match roll {
            HeadRead::Head(head) => self.observe_head(head, now),
            HeadRead::Heartbeats(membership) => self.observe(membership, sent, now),
        }
    }

    /// The cycle's list succeeded, at `counter` (`exact`: the store said so).
    fn listed_ok(&mut self, c: &mut Cycle, counter: u64, exact: bool, now: &Now) {
        // Workers learn of every request this list holds before the view stamp says they
        // may: hints first, then the stamp.
        self.hint_all();
        self.outbox.push(Effect::Confirm(c.sent));
        // Judge liveness from a membership read made after the list. A host judged dead from
        // the earlier read may have re-registered and taken leases since; its takes can show
        // in the list only with its new heartbeat (it registers first), so this read sees it
        // live and its leases are not taken as free. With a view, the head read after the
        // list holds a view at least as new as the one that let every owner in the list take
        // (it takes only once a view lists it). A list of changes read at the first read's
        // counter shows nothing that changed hands since that read (the safety net, in steady
        // state): that read already judged every owner it shows.
        if !exact || counter != c.roll_counter {
            c.call(
                Call::ReadHead,
                Stage::AwaitSecondRead {
                    counter,
                    sent: now.at,
                },
            );
        } else {
            self.note_listed(c.read, counter, c.now);
            c.stage = Stage::Lead;
        }
    }
}
