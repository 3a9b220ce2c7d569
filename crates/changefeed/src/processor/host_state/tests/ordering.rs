//! The cycle's ordering rules as properties: the machine driven without a runtime through
//! random cycles against a small random store (answers that succeed, fail, conflict, or come
//! late; fences and lapses; hosts that stop renewing), each rule checked on the log of calls,
//! answers and effects.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::error::LeaseError;
use crate::lease::{Changes, Listing};
use crate::model::{MembershipView, Timestamp};

const ME: &str = "m";
const OTHERS: [&str; 2] = ["a", "z"];

/// One entry of a run's log.
#[derive(Debug, Clone)]
enum Ev {
    Tick(Now),
    /// A call, the reading it was made on, and whether the state led then.
    Call(Call, Now, bool),
    Answer(Outcome),
    Effect(Effect),
}

/// What an answer was, for the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Failed,
    /// A first read at this change counter.
    Head(u64),
    MembershipOk,
    /// A list answered at a counter; `exact`: a list of changes (the store named its counter).
    Listed {
        counter: u64,
        exact: bool,
    },
    Other,
}

/// A small store the answers come from, moved by random choices.
struct World {
    rows: BTreeMap<PartitionId, Lease>,
    counter: u64,
    versions: BTreeMap<&'static str, u64>,
    views: bool,
    view: Option<MembershipView>,
    choices: Vec<u8>,
    next: usize,
}

impl World {
    fn pick(&mut self) -> u8 {
        let c = self.choices[self.next % self.choices.len()];
        self.next += 1;
        c
    }

    fn membership(&self) -> Membership {
        let hosts = std::iter::once(ME)
            .chain(OTHERS)
            .filter_map(|h| {
                let version = *self.versions.get(h)?;
                Some(Heartbeat {
                    group: GroupName::new("g").unwrap(),
                    host: super::h(h),
                    incarnation: "i".into(),
                    version: Version(version),
                    written_at: Timestamp(0),
                })
            })
            .collect();
        Membership {
            hosts,
            change_counter: self.counter,
        }
    }

    fn leases(&self) -> Vec<Arc<Lease>> {
        self.rows.values().cloned().map(Arc::new).collect()
    }

    fn answer(&mut self, call: &Call) -> Answer {
        let c = self.pick();
        match call {
            Call::ReadHead if c % 10 == 0 => Answer::Head(None),
            Call::ReadHead if self.views => Answer::Head(Some(HeadRead::Head(GroupHead {
                change_counter: self.counter,
                view: self.view.clone(),
            }))),
            Call::ReadHead => Answer::Head(Some(HeadRead::Heartbeats(self.membership()))),
            Call::Membership if c % 10 == 0 => Answer::Membership(None),
            Call::Membership => Answer::Membership(Some(self.membership())),
            Call::ListChanges { .. } => Answer::Changes(match c % 10 {
                0 | 1 => Ok(None),
                2 => Err(LeaseError::store("test", None, true, "down")),
                _ => Ok(Some(Changes {
                    counter: self.counter,
                    leases: self.leases(),
                    deleted: Vec::new(),
                    malformed: Vec::new(),
                })),
            }),
            Call::ListAll { .. } if c % 10 == 0 => {
                Answer::Listed(Err(LeaseError::store("test", None, true, "down")))
            }
            Call::ListAll { .. } => Answer::Listed(Ok(Listing {
                leases: self.leases(),
                malformed: Vec::new(),
            })),
            Call::WriteView { view, expected, .. } => {
                let current = self.view.as_ref().map_or(0, |v| v.version);
                if current != *expected || c % 7 == 0 {
                    return Answer::ViewWritten(Err(LeaseError::ViewConflict {
                        group: "g".into(),
                        expected: *expected,
                        current: self.view.clone().map(Box::new),
                    }));
                }
                let mut stored = view.clone();
                stored.version = current + 1;
                self.view = Some(stored.clone());
                Answer::ViewWritten(Ok(stored))
            }
            Call::Sync { .. } => Answer::Synced {
                ok: c % 3 != 0,
                changed: c % 2 == 0,
            },
            Call::EstimateUnowned { .. } | Call::RemoveHeartbeat(_) => Answer::Done,
            Call::Write { next, expected, .. } => Answer::Written(self.write(next, *expected, c)),
        }
    }

    fn write(&mut self, next: &Lease, expected: Version, c: u8) -> Result<Lease, LeaseError> {
        let partition = next.key.partition.clone();
        let Some(current) = self.rows.get_mut(&partition) else {
            return Err(LeaseError::store("test", None, true, "no such row"));
        };
        if c % 6 == 0 {
            return Err(LeaseError::store("test", None, true, "timed out"));
        }
        if c % 6 == 1 {
            // The owner checkpointed meanwhile.
            current.version = Version(current.version.0 + 1);
        }
        if current.version != expected {
            return Err(LeaseError::Conflict {
                key: current.key.to_string(),
                expected,
                current: Box::new(current.clone()),
            });
        }
        let mut stored = next.clone();
        stored.version = Version(expected.0 + 1);
        *current = stored.clone();
        self.counter += 1;
        Ok(stored)
    }

    /// The world moves between cycles: hosts renew or not, leases change hands.
    fn moves(&mut self) {
        let c = self.pick();
        for (i, host) in OTHERS.iter().enumerate() {
            if (c >> i) & 1 == 1 {
                *self.versions.entry(host).or_insert(0) += 1;
            }
        }
        *self.versions.entry(ME).or_insert(0) += 1;
        if c % 5 == 0 {
            let p = super::p(&((c / 5) % 4).to_string());
            if let Some(row) = self.rows.get_mut(&p) {
                let owner = [ME, OTHERS[0], OTHERS[1]][usize::from(c) % 3];
                row.owner = Some(super::h(owner));
                row.state = crate::model::LeaseState::Owned;
                row.version = Version(row.version.0 + 1);
                self.counter += 1;
            }
        }
    }
}

/// A run: `cycles` cycles of a host against the world, with the log of everything.
fn run(choices: Vec<u8>, views: bool, cycles: usize) -> (Vec<Ev>, Vec<BTreeSet<PartitionId>>) {
    let mut world = World {
        rows: (0..4)
            .map(|i| {
                let owner = match i {
                    0 => Some("a"),
                    1 => Some("z"),
                    _ => None,
                };
                (
                    super::p(&i.to_string()),
                    row(&i.to_string(), owner, None, 1),
                )
            })
            .collect(),
        counter: 1,
        versions: BTreeMap::new(),
        views,
        view: None,
        choices,
        next: 0,
    };
    let start = t0();
    // At most two leases a host, so that plans release as well as take.
    let limits = crate::balance::LeaseLimits::new(0, Some(2)).unwrap();
    let config = StateConfig {
        strategy: Arc::new(crate::balance::EqualShare::with_limits(limits)),
        ..config()
    };
    let mut state = HostState::new(h(ME), config, start);
    state.registered_as("i".into());
    let mut log = Vec::new();
    let mut running_per_cycle = Vec::new();
    let mut at = start;
    let mut lapses = 0;
    let mut running: BTreeSet<PartitionId> = BTreeSet::new();
    for _ in 0..cycles {
        world.moves();
        let c = world.pick();
        at += Duration::from_millis(500 * u64::from(c % 8));
        // Now and then a worker exits.
        if c % 9 == 0 {
            if let Some(p) = running.iter().next().cloned() {
                running.remove(&p);
                state.worker_exited(&p);
            }
        }
        running_per_cycle.push(running.clone());
        let fenced = |w: &mut World| w.pick() % 23 == 0;
        let mut now = Now {
            at,
            fenced: fenced(&mut world),
            lapses,
        };
        log.push(Ev::Tick(now));
        state.tick(now);
        for _ in 0..500 {
            let ready = state.ready(now);
            for effect in ready.effects {
                if let Effect::StartWorker(l) = &effect {
                    running.insert(l.key.partition.clone());
                }
                log.push(Ev::Effect(effect));
            }
            let Some(call) = ready.call else {
                break;
            };
            log.push(Ev::Call(call.clone(), now, state.leads()));
            let answer = world.answer(&call);
            log.push(Ev::Answer(outcome(&answer)));
            // The answer comes back later; now and then a stall lapses the fence meanwhile.
            let c = world.pick();
            at += Duration::from_millis(100 * u64::from(c % 30));
            if c % 31 == 0 {
                lapses += 1;
            }
            now = Now {
                at,
                fenced: fenced(&mut world),
                lapses,
            };
            state.advance(answer, now);
        }
    }
    (log, running_per_cycle)
}

fn outcome(answer: &Answer) -> Outcome {
    match answer {
        Answer::Head(Some(roll)) => Outcome::Head(roll.change_counter()),
        Answer::Membership(Some(_)) => Outcome::MembershipOk,
        Answer::Head(None) | Answer::Membership(None) => Outcome::Failed,
        Answer::Changes(Ok(Some(c))) => Outcome::Listed {
            counter: c.counter,
            exact: true,
        },
        Answer::Listed(Ok(_)) => Outcome::Listed {
            counter: 0,
            exact: false,
        },
        Answer::Changes(Err(_)) | Answer::Listed(Err(_)) | Answer::Written(Err(_)) => {
            Outcome::Failed
        }
        _ => Outcome::Other,
    }
}

/// The log split into cycles, each starting at its tick.
fn cycles(log: &[Ev]) -> Vec<(Now, &[Ev])> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < log.len() {
        let Ev::Tick(now) = &log[i] else {
            i += 1;
            continue;
        };
        let end = log[i + 1..]
            .iter()
            .position(|e| matches!(e, Ev::Tick(_)))
            .map_or(log.len(), |j| i + 1 + j);
        out.push((*now, &log[i + 1..end]));
        i = end;
    }
    out
}

fn calls(evs: &[Ev]) -> impl Iterator<Item = (usize, &Call, &Now, bool)> {
    evs.iter().enumerate().filter_map(|(i, e)| match e {
        Ev::Call(c, n, leads) => Some((i, c, n, *leads)),
        _ => None,
    })
}

fn is_take(call: &Call) -> bool {
    matches!(
        call,
        Call::Write {
            why: Why::Take { .. },
            ..
        }
    )
}

fn is_list(call: &Call) -> bool {
    matches!(
        call,
        Call::ListChanges {
            after_sync: false,
            ..
        } | Call::ListAll { after_sync: false }
    )
}

fn runs() -> impl Strategy<Value = (Vec<Ev>, Vec<BTreeSet<PartitionId>>)> {
    (
        proptest::collection::vec(any::<u8>(), 16..64),
        any::<bool>(),
    )
        .prop_map(|(choices, views)| run(choices, views, 12))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_cycle_ends(choices in proptest::collection::vec(any::<u8>(), 16..64), views in any::<bool>()) {
        let (log, _) = run(choices, views, 12);
        for (_, evs) in cycles(&log) {
            prop_assert!(calls(evs).count() < 100, "a cycle made {} calls", calls(evs).count());
        }
    }

    #[test]
    fn a_fenced_host_makes_no_call((log, _) in runs()) {
        for (tick, evs) in cycles(&log) {
            if tick.fenced {
                prop_assert_eq!(calls(evs).count(), 0);
            }
        }
    }

    #[test]
    fn nothing_is_written_from_reads_a_fence_or_lapse_made_stale((log, _) in runs()) {
        for (tick, evs) in cycles(&log) {
            let first_write = calls(evs).find(|(_, c, _, _)| matches!(c, Call::Write { .. }));
            if let Some((_, _, now, _)) = first_write {
                prop_assert!(!now.fenced && now.lapses == tick.lapses, "a write after the cycle was cut short");
            }
        }
    }

    #[test]
    fn no_take_is_issued_from_a_listing_older_than_the_last_counter_read((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            let mut roll_counter = None;
            let mut needs_read = false;
            for (i, e) in evs.iter().enumerate() {
                match e {
                    Ev::Answer(Outcome::Listed { counter, exact }) => {
                        let listed_cycle = matches!(evs.get(i.wrapping_sub(1)), Some(Ev::Call(c, ..)) if is_list(c));
                        if listed_cycle {
                            // A full list, or a list of changes at another counter than the
                            // first read's, may show owners that read did not judge.
                            needs_read = !exact || roll_counter != Some(*counter);
                        }
                    }
                    Ev::Answer(Outcome::Head(counter)) => {
                        roll_counter.get_or_insert(*counter);
                        needs_read = false;
                    }
                    Ev::Answer(Outcome::MembershipOk) => needs_read = false,
                    Ev::Call(c, ..) if is_take(c) => {
                        prop_assert!(!needs_read, "a take from a list no membership read came after");
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn workers_are_told_before_the_view_stamp_and_the_stamp_is_the_first_read((log, _) in runs()) {
        for (tick, evs) in cycles(&log) {
            let list_answer = evs.iter().enumerate().find_map(|(i, e)| match e {
                Ev::Call(c, ..) if is_list(c) => Some(i + 1),
                _ => None,
            });
            for (i, e) in evs.iter().enumerate() {
                if let Ev::Effect(Effect::Confirm(sent)) = e {
                    prop_assert_eq!(*sent, tick.at);
                    if let Some(answered) = list_answer {
                        prop_assert!(i > answered, "the stamp before the list's hints");
                    }
                }
            }
        }
    }

    #[test]
    fn the_view_is_written_only_after_a_heartbeat_read_that_followed_the_list((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            let mut read_since_list = false;
            for e in evs {
                match e {
                    Ev::Call(c, ..) if is_list(c) => read_since_list = false,
                    Ev::Answer(Outcome::MembershipOk) => read_since_list = true,
                    Ev::Call(Call::WriteView { .. }, ..) => prop_assert!(read_since_list),
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn dead_rows_are_removed_only_on_a_fresh_read_and_an_unbroken_fence((log, _) in runs()) {
        for (tick, evs) in cycles(&log) {
            let mut read_sent = Some(tick.at);
            for e in evs {
                match e {
                    Ev::Call(Call::Membership, now, _) => read_sent = Some(now.at),
                    Ev::Call(Call::RemoveHeartbeat(_), now, leads) => {
                        let sent = read_sent.unwrap();
                        prop_assert!(*leads, "only the leader removes rows");
                        prop_assert!(now.at.saturating_duration_since(sent) < config().safety_margin);
                        prop_assert!(!now.fenced && now.lapses == tick.lapses);
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn only_the_leader_syncs_and_estimates_unowned_lag((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            for (_, call, _, leads) in calls(evs) {
                if matches!(call, Call::Sync { .. } | Call::EstimateUnowned { .. }) {
                    prop_assert!(leads);
                }
            }
        }
    }

    #[test]
    fn resumes_then_takes_then_requests_then_releases((log, _) in runs()) {
        fn rank(e: &Ev) -> Option<u8> {
            match e {
                Ev::Call(Call::Write { why: Why::Resume, .. }, ..) => Some(0),
                Ev::Call(Call::Write { why: Why::Take { .. }, .. }, ..) => Some(1),
                Ev::Call(Call::Write { why: Why::Request { .. }, .. }, ..) => Some(2),
                Ev::Effect(Effect::Release(_)) => Some(3),
                _ => None,
            }
        }
        for (_, evs) in cycles(&log) {
            let ranks: Vec<u8> = evs.iter().filter_map(rank).collect();
            let ordered = ranks.windows(2).all(|w| w[0] <= w[1]);
            prop_assert!(ordered, "out of order: {:?}", ranks);
        }
    }

    #[test]
    fn a_hand_off_request_is_written_at_most_three_times_a_cycle((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            let mut writes: BTreeMap<PartitionId, usize> = BTreeMap::new();
            for (_, call, _, _) in calls(evs) {
                if let Call::Write { next, why: Why::Request { .. }, .. } = call {
                    *writes.entry(next.key.partition.clone()).or_default() += 1;
                }
            }
            prop_assert!(writes.values().all(|n| *n <= 3), "{:?}", writes);
        }
    }

    #[test]
    fn writes_say_what_they_claim((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            for (_, call, _, _) in calls(evs) {
                match call {
                    Call::Write { next, why: Why::Take { .. } | Why::Resume, .. } => {
                        prop_assert_eq!(next.owner.clone(), Some(h(ME)));
                        let resume = matches!(call, Call::Write { why: Why::Resume, .. });
                        prop_assert!(next.next_owner.is_none() || resume);
                    }
                    Call::Write { next, why: Why::Request { from }, .. } => {
                        prop_assert_eq!(next.next_owner.clone(), Some(h(ME)));
                        prop_assert_eq!(next.owner.clone(), Some(from.clone()));
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn a_worker_is_started_once_and_never_beside_a_take_of_its_lease((log, running) in runs()) {
        for ((_, evs), before) in cycles(&log).into_iter().zip(running) {
            let mut running = before;
            for e in evs {
                match e {
                    Ev::Effect(Effect::StartWorker(l)) => {
                        prop_assert!(running.insert(l.key.partition.clone()), "started twice: {}", l.key);
                    }
                    Ev::Call(Call::Write { next, why: Why::Take { .. }, .. }, ..) => {
                        prop_assert!(!running.contains(&next.key.partition), "took the lease of a running worker");
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn a_failed_first_read_ends_the_cycle((log, _) in runs()) {
        for (_, evs) in cycles(&log) {
            if let (Some(Ev::Call(Call::ReadHead, ..)), Some(Ev::Answer(Outcome::Failed))) = (evs.iter().find(|e| matches!(e, Ev::Call(..))), evs.iter().find(|e| matches!(e, Ev::Answer(_)))) {
                prop_assert_eq!(calls(evs).count(), 1);
            }
        }
    }
}

/// The runs reach every step the rules speak of: otherwise a rule could hold only because
/// its step never came.
#[test]
fn the_runs_reach_every_step() {
    let mut seen = BTreeSet::new();
    for seed in 0..300u32 {
        let choices: Vec<u8> = (0..48u32)
            .map(|i| (seed.wrapping_mul(2_654_435_761).wrapping_add(i * 40_503) >> 7) as u8)
            .collect();
        let (log, _) = run(choices, seed % 2 == 0, 12);
        for e in &log {
            let name = match e {
                Ev::Call(
                    Call::Write {
                        why: Why::Take { .. },
                        ..
                    },
                    ..,
                ) => "take",
                Ev::Call(
                    Call::Write {
                        why: Why::Request { .. },
                        ..
                    },
                    ..,
                ) => "request",
                Ev::Call(
                    Call::Write {
                        why: Why::Resume, ..
                    },
                    ..,
                ) => "resume",
                Ev::Call(Call::WriteView { .. }, ..) => "view",
                Ev::Call(Call::RemoveHeartbeat(_), ..) => "remove",
                Ev::Call(Call::Sync { .. }, ..) => "sync",
                Ev::Call(Call::ListChanges { .. }, ..) => "changes",
                Ev::Call(Call::ListAll { .. }, ..) => "list",
                Ev::Call(Call::Membership, ..) => "membership",
                Ev::Effect(Effect::Release(_)) => "release",
                Ev::Effect(Effect::Confirm(_)) => "confirm",
                Ev::Effect(Effect::StartWorker(_)) => "start",
                Ev::Tick(now) if now.fenced => "fenced",
                _ => continue,
            };
            seen.insert(name);
        }
    }
    let all = [
        "take",
        "request",
        "resume",
        "view",
        "remove",
        "sync",
        "changes",
        "list",
        "membership",
        "release",
        "confirm",
        "start",
        "fenced",
    ];
    let missing: Vec<&str> = all.into_iter().filter(|n| !seen.contains(n)).collect();
    assert!(missing.is_empty(), "never reached: {missing:?}");
}
