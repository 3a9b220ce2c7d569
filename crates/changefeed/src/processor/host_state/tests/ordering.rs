//! The cycle's ordering rules as properties: the machine driven without a runtime through
//! random cycles against a small random store (answers that succeed, fail, conflict, or come
//! late; fences and lapses; hosts that stop renewing), each rule checked on the log of calls,
//! answers and effects.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::world::*;
use super::*;

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
