//! Table tests of the host's decisions: a snapshot in, the decision out; no runtime, no store.
//! `parts` tests the pure parts one by one, `state` the whole [`HostState`] driven as the shell
//! drives it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;
use crate::balance::{EqualShare, Plan};
use crate::model::{Continuation, GroupName, LeaseKey, LeaseState, Position, Timestamp, Version};

fn h(name: &str) -> HostName {
    HostName::new(name).unwrap()
}

fn p(id: &str) -> PartitionId {
    PartitionId::new(id).unwrap()
}

/// A lease row: partition, owner (None: available), next owner, version.
fn row(id: &str, owner: Option<&str>, next: Option<&str>, version: u64) -> Lease {
    let mut l = Lease::new(
        LeaseKey::new(GroupName::new("g").unwrap(), p(id)),
        Position::Beginning,
    );
    if let Some(o) = owner {
        l.state = LeaseState::Owned;
        l.owner = Some(h(o));
    }
    l.next_owner = next.map(h);
    l.version = Version(version);
    l
}

fn finished(id: &str, version: u64) -> Lease {
    let mut l = row(id, None, None, version);
    l.state = LeaseState::Finished;
    l
}

fn child(id: &str, parents: &[&str]) -> Lease {
    row(id, None, None, 1).with_parents(parents.iter().map(|x| p(x)).collect())
}

fn heartbeat(host: &str) -> Heartbeat {
    Heartbeat {
        group: GroupName::new("g").unwrap(),
        host: h(host),
        incarnation: "i".into(),
        version: Version(1),
        written_at: Timestamp(0),
        report: None,
    }
}

fn table(me: &str, rows: Vec<Lease>) -> LeaseTable {
    let mut t = LeaseTable::new(h(me), ParentsRule::Wait, None);
    t.replace_all(rows);
    t
}

fn hosts(names: &[&str]) -> Vec<HostName> {
    names.iter().map(|n| h(n)).collect()
}

fn t0() -> Instant {
    Instant::now()
}

const SECOND: Duration = Duration::from_secs(1);

/// Plans for `me` over `rows` with `live`, long after registering, no request pending.
fn plan_for(me: &str, live: &[&str], rows: Vec<Lease>) -> Plan {
    let t = table(me, rows);
    let start = t0();
    plan(
        &PlanInput {
            me: &h(me),
            live: &hosts(live),
            dead: None,
            table: &t,
            requests: &Requests::default(),
            now: start + 60 * SECOND,
            registered_at: start,
            handoff_timeout: 10 * SECOND,
            grace: 2 * SECOND,
            parents: ParentsRule::Wait,
            load: None,
        },
        &EqualShare::default(),
    )
    .0
}

fn config() -> StateConfig {
    StateConfig {
        lease_expiry: 10 * SECOND,
        full_list_interval: 300 * SECOND,
        handoff_timeout: 10 * SECOND,
        grace: 2 * SECOND,
        admission: true,
        parents: ParentsRule::Wait,
        acquire_interval: 2 * SECOND,
        safety_margin: 2 * SECOND,
        head_reads_per_second: None,
        share: None,
        fence_after: 8 * SECOND,
        sync_interval: 60 * SECOND,
        strategy: std::sync::Arc::new(EqualShare::default()),
        group: GroupName::new("g").unwrap(),
    }
}

fn membership(live: &[&str], counter: u64) -> Membership {
    Membership {
        hosts: live.iter().map(|n| heartbeat(n)).collect(),
        change_counter: counter,
    }
}

/// The state of `me`, registered at `start`, having read `live` and listed `rows` at counter 1.
fn state(me: &str, live: &[&str], rows: Vec<Lease>, start: Instant) -> HostState {
    let mut s = HostState::new(h(me), config(), start);
    s.observe(&membership(live, 1), start, start);
    assert_eq!(s.next_read(1, start), Read::Full);
    s.replace_table(rows, |_| false);
    s.note_listed(Read::Full, 1, start);
    s
}

fn partitions(takes: &[(Lease, TakeKind)]) -> Vec<(PartitionId, TakeKind)> {
    takes
        .iter()
        .map(|(l, k)| (l.key.partition.clone(), *k))
        .collect()
}

mod census;
mod loads;
mod ordering;
mod parts;
mod state;
mod view;
mod world;
