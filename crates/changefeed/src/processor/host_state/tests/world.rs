//! The harness of the ordering properties: a host's state driven through random cycles
//! against a small random store, with the log of every call, answer and effect.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::*;
use crate::error::LeaseError;
use crate::lease::{Changes, Listing};
use crate::model::{MembershipView, Timestamp};

pub(super) const ME: &str = "m";
const OTHERS: [&str; 2] = ["a", "z"];

/// One entry of a run's log.
#[derive(Debug, Clone)]
pub(super) enum Ev {
    Tick(Now),
    /// A call, the reading it was made on, and whether the state led then.
    Call(Call, Now, bool),
    Answer(Outcome),
    Effect(Effect),
}

/// What an answer was, for the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
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
pub(super) struct World {
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
                    report: None,
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
pub(super) fn run(
    choices: Vec<u8>,
    views: bool,
    cycles: usize,
) -> (Vec<Ev>, Vec<BTreeSet<PartitionId>>) {
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

pub(super) fn outcome(answer: &Answer) -> Outcome {
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
pub(super) fn cycles(log: &[Ev]) -> Vec<(Now, &[Ev])> {
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

pub(super) fn calls(evs: &[Ev]) -> impl Iterator<Item = (usize, &Call, &Now, bool)> {
    evs.iter().enumerate().filter_map(|(i, e)| match e {
        Ev::Call(c, n, leads) => Some((i, c, n, *leads)),
        _ => None,
    })
}

pub(super) fn is_take(call: &Call) -> bool {
    matches!(
        call,
        Call::Write {
            why: Why::Take { .. },
            ..
        }
    )
}

pub(super) fn is_list(call: &Call) -> bool {
    matches!(
        call,
        Call::ListChanges {
            after_sync: false,
            ..
        } | Call::ListAll { after_sync: false }
    )
}
