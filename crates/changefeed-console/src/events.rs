//! What happened between two reads of the store: the console's events, derived by comparing
//! lease rows and heartbeat rows, with no agent on the hosts.
//!
//! Pure: [`lease_moves`] compares a lease's previous row with its new one, [`births`] names the
//! splits and merges among newly created leases. The caller ([`super::watch`]) says which
//! hosts it judges alive and how long a hand-off request has waited; nothing here reads a
//! clock or the store.
//!
//! How an ownership change is named, from the rows alone:
//!
//! | previous row                          | new row        | event      |
//! |---------------------------------------|----------------|------------|
//! | no owner                              | owner B        | `take`     |
//! | owner A, judged dead (or no heartbeat) | owner B       | `take` (of an expired lease) |
//! | owner A alive, request by B pending less than the hand-off timeout, or not seen | owner B | `handoff` |
//! | owner A alive, request by B pending at least the hand-off timeout | owner B | `steal` |
//! | owner A                               | no owner       | `release` (`finish` when finished) |
//! | no request                            | next owner B   | `request`  |
//!
//! A hand-off requested and completed between two reads shows as a `handoff` without its
//! `request`: the console sees rows, not writes.

use std::collections::BTreeMap;
use std::fmt;

use changefeed::model::{HostName, Lease, LeaseState, MembershipView, PartitionId};
use serde::Serialize;

/// The kind of an event, as the API and the page name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A host took a free or expired lease.
    Take,
    /// The owner passed the lease to the host that asked for it.
    Handoff,
    /// A host took a lease whose live owner did not honour a hand-off in time.
    Steal,
    /// The owner let the lease go (graceful stop, or released by an operator).
    Release,
    /// The lease's partition was read to its end.
    Finish,
    /// A host asked the owner to hand the lease over.
    Request,
    /// A lease without parents was created.
    Create,
    /// Leases were created for the children of one partition.
    Split,
    /// A lease was created for a child of several partitions.
    Merge,
    /// A lease was deleted (a finished parent cleaned up, or by an operator).
    Delete,
    /// A heartbeat row appeared.
    Join,
    /// A heartbeat row disappeared.
    Leave,
    /// A host's heartbeat row was written by a new process (another incarnation).
    Restart,
    /// A host's heartbeat stood still past `lease_expiry − safety_margin`: it has fenced itself.
    Fence,
    /// A host's heartbeat stood still past `lease_expiry`: its leases are free to take.
    Expire,
    /// A fenced or expired host's heartbeat moved again (or the view lists it live again).
    Resume,
    /// A host leads the membership view (it wrote a view naming itself leader).
    Lead,
}

impl Kind {
    /// The name the API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Take => "take",
            Kind::Handoff => "handoff",
            Kind::Steal => "steal",
            Kind::Release => "release",
            Kind::Finish => "finish",
            Kind::Request => "request",
            Kind::Create => "create",
            Kind::Split => "split",
            Kind::Merge => "merge",
            Kind::Delete => "delete",
            Kind::Join => "join",
            Kind::Leave => "leave",
            Kind::Restart => "restart",
            Kind::Fence => "fence",
            Kind::Expire => "expire",
            Kind::Resume => "resume",
            Kind::Lead => "lead",
        }
    }

    /// Whether the event moves a lease to a new owner (drawn as a mark on its row).
    pub fn is_move(self) -> bool {
        matches!(self, Kind::Take | Kind::Handoff | Kind::Steal)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event, without its time (the caller stamps it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// What happened.
    pub kind: Kind,
    /// The lease's partition, for lease events.
    pub partition: Option<PartitionId>,
    /// The host it happened to (the new owner of a move, the asker of a request).
    pub host: Option<HostName>,
    /// One line for people, naming who and what.
    pub text: String,
}

impl Change {
    fn lease(kind: Kind, partition: &PartitionId, host: Option<&HostName>, text: String) -> Self {
        Self {
            kind,
            partition: Some(partition.clone()),
            host: host.cloned(),
            text,
        }
    }

    /// An event about a host.
    pub fn host(kind: Kind, host: &HostName, text: String) -> Self {
        Self {
            kind,
            partition: None,
            host: Some(host.clone()),
            text,
        }
    }
}

/// What the caller knows of the fleet when comparing rows.
pub trait Judge {
    /// Whether `host`'s heartbeat is alive (seen moving within `lease_expiry`).
    fn alive(&self, host: &HostName) -> bool;
    /// Whether the hand-off request on `partition` has been pending at least the hand-off
    /// timeout (`false` when none was seen).
    fn request_overdue(&self, partition: &PartitionId) -> bool;
}

/// The events between `before` and `after`, two rows of one lease (`before` is `None` for a
/// lease created since the last read; [`births`] names those).
pub fn lease_moves(before: &Lease, after: &Lease, judge: &dyn Judge) -> Vec<Change> {
    let p = &after.key.partition;
    let mut out = Vec::new();
    match (&before.owner, &after.owner) {
        (None, Some(b)) => {
            out.push(Change::lease(
                Kind::Take,
                p,
                Some(b),
                format!("{b} took {p}"),
            ));
        }
        (Some(a), Some(b)) if a != b => {
            let change = if !judge.alive(a) {
                Change::lease(
                    Kind::Take,
                    p,
                    Some(b),
                    format!("{b} took {p} from {a} (expired)"),
                )
            } else if judge.request_overdue(p) {
                Change::lease(
                    Kind::Steal,
                    p,
                    Some(b),
                    format!("{b} stole {p} from {a} (hand-off not honoured in time)"),
                )
            } else {
                Change::lease(
                    Kind::Handoff,
                    p,
                    Some(b),
                    format!("{a} handed {p} off to {b}"),
                )
            };
            out.push(change);
        }
        (Some(a), None) => {
            let (kind, text) = if after.state == LeaseState::Finished {
                (Kind::Finish, format!("{a} finished {p}"))
            } else {
                (Kind::Release, format!("{a} released {p}"))
            };
            out.push(Change::lease(kind, p, Some(a), text));
        }
        _ => {}
    }
    if after.owner.is_some() && after.owner == before.owner {
        if let (Some(b), true) = (&after.next_owner, after.next_owner != before.next_owner) {
            let owner = after.owner.as_ref().map(HostName::as_str).unwrap_or("-");
            out.push(Change::lease(
                Kind::Request,
                p,
                Some(b),
                format!("{b} asked {owner} to hand off {p}"),
            ));
        }
    }
    let unowned = before.owner.is_none() && after.owner.is_none();
    if unowned && after.state == LeaseState::Finished && before.state != LeaseState::Finished {
        out.push(Change::lease(
            Kind::Finish,
            p,
            None,
            format!("{p} finished"),
        ));
    }
    out
}

/// The events for leases created since the last read: one `split` per parent whose children
/// appeared, one `merge` per child of several parents, one `create` per lease without
/// parents.
pub fn births(created: &[&Lease]) -> Vec<Change> {
    let mut out = Vec::new();
    let mut splits: BTreeMap<&PartitionId, Vec<&PartitionId>> = BTreeMap::new();
    for lease in created {
        let p = &lease.key.partition;
        match lease.parents.as_slice() {
            [] => out.push(Change::lease(
                Kind::Create,
                p,
                None,
                format!("lease created for {p}"),
            )),
            [parent] => splits.entry(parent).or_default().push(p),
            parents => {
                let names: Vec<&str> = parents.iter().map(PartitionId::as_str).collect();
                out.push(Change::lease(
                    Kind::Merge,
                    p,
                    None,
                    format!("{} merged into {p}", names.join(" + ")),
                ));
            }
        }
    }
    for (parent, children) in splits {
        let names: Vec<&str> = children.iter().map(|c| c.as_str()).collect();
        out.push(Change::lease(
            Kind::Split,
            parent,
            None,
            format!("{parent} split into {}", names.join(" + ")),
        ));
    }
    out
}

/// The events between two views: a host the new one lists live that the old did not is a
/// `join` (a `resume` if it was listed dead, a `restart` if in another incarnation); one it
/// newly lists dead is an `expire`; one it no longer lists at all is a `leave`; a new leader is
/// a `lead`. Without an old view (the first one written), only the leader.
pub(super) fn view_changes(old: Option<&MembershipView>, new: &MembershipView) -> Vec<Change> {
    let mut out = Vec::new();
    let leader = &new.leader;
    if old.is_none_or(|o| o.leader != new.leader || o.leader_incarnation != new.leader_incarnation)
    {
        out.push(Change::host(
            Kind::Lead,
            leader,
            format!("{leader} leads the membership view"),
        ));
    }
    let Some(old) = old else {
        return out;
    };
    for h in &new.live {
        let host = &h.host;
        let before = old.live.iter().find(|o| o.host == *host);
        let change = match before {
            Some(o) if o.incarnation == h.incarnation => None,
            Some(_) => Some((Kind::Restart, format!("{host} restarted (new incarnation)"))),
            None if old.dead.contains(host) => Some((
                Kind::Resume,
                format!("{host} is live again ({leader}'s membership view)"),
            )),
            None => Some((
                Kind::Join,
                format!("{host} joined ({leader}'s membership view lists it live)"),
            )),
        };
        if let Some((kind, text)) = change {
            out.push(Change::host(kind, host, text));
        }
    }
    for host in new.dead.iter().filter(|h| !old.dead.contains(h)) {
        out.push(Change::host(
            Kind::Expire,
            host,
            format!("{host} expired: judged dead by {leader}'s membership view"),
        ));
    }
    let listed = |v: &MembershipView, h: &HostName| {
        v.dead.contains(h) || v.live.iter().any(|l| l.host == *h)
    };
    for host in old.live.iter().map(|h| &h.host).chain(&old.dead) {
        if !listed(new, host) {
            out.push(Change::host(
                Kind::Leave,
                host,
                format!("{host} left ({leader}'s membership view lists it no more)"),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use changefeed::model::{GroupName, LeaseKey, Position};
    use std::collections::BTreeSet;

    struct Fleet {
        dead: BTreeSet<&'static str>,
        overdue: bool,
    }

    impl Judge for Fleet {
        fn alive(&self, host: &HostName) -> bool {
            !self.dead.contains(host.as_str())
        }
        fn request_overdue(&self, _: &PartitionId) -> bool {
            self.overdue
        }
    }

    fn lease(p: &str, owner: Option<&str>, next: Option<&str>) -> Lease {
        let mut l = Lease::new(
            LeaseKey::new(
                GroupName::new("g").expect("group"),
                PartitionId::new(p).expect("partition"),
            ),
            Position::Beginning,
        );
        l.owner = owner.map(|o| HostName::new(o).expect("host"));
        l.next_owner = next.map(|o| HostName::new(o).expect("host"));
        if owner.is_some() {
            l.state = LeaseState::Owned;
        }
        l
    }

    fn kinds(changes: &[Change]) -> Vec<Kind> {
        changes.iter().map(|c| c.kind).collect()
    }

    #[test]
    fn an_owner_change_is_named_by_the_old_owners_liveness_and_the_request() {
        // The table in the module doc: take, take of an expired lease, hand-off, steal,
        // request, release, finish.
        let alive = Fleet {
            dead: BTreeSet::new(),
            overdue: false,
        };
        let a_dead = Fleet {
            dead: ["a"].into(),
            overdue: false,
        };
        let overdue = Fleet {
            dead: BTreeSet::new(),
            overdue: true,
        };
        let free = lease("0", None, None);
        let by_a = lease("0", Some("a"), None);
        let asked = lease("0", Some("a"), Some("b"));
        let by_b = lease("0", Some("b"), None);
        assert_eq!(kinds(&lease_moves(&free, &by_a, &alive)), [Kind::Take]);
        assert_eq!(kinds(&lease_moves(&by_a, &by_b, &a_dead)), [Kind::Take]);
        assert_eq!(kinds(&lease_moves(&asked, &by_b, &alive)), [Kind::Handoff]);
        assert_eq!(kinds(&lease_moves(&asked, &by_b, &overdue)), [Kind::Steal]);
        assert_eq!(kinds(&lease_moves(&by_a, &asked, &alive)), [Kind::Request]);
        assert_eq!(kinds(&lease_moves(&by_a, &free, &alive)), [Kind::Release]);
        let mut done = free.clone();
        done.state = LeaseState::Finished;
        assert_eq!(kinds(&lease_moves(&by_a, &done, &alive)), [Kind::Finish]);
        assert!(lease_moves(&by_a, &by_a, &alive).is_empty(), "a checkpoint");
        let text = &lease_moves(&by_a, &by_b, &a_dead)[0].text;
        assert_eq!(text, "b took 0 from a (expired)");
    }

    #[test]
    fn new_children_are_one_split_per_parent_and_a_merge_per_child() {
        // Lineage: children of one parent are a split; a child of two parents is a merge.
        let parent = PartitionId::new("0").expect("partition");
        let a = lease("1", None, None).with_parents(vec![parent.clone()]);
        let b = lease("2", None, None).with_parents(vec![parent]);
        let m = lease("3", None, None).with_parents(vec![
            PartitionId::new("1").expect("p"),
            PartitionId::new("2").expect("p"),
        ]);
        let plain = lease("4", None, None);
        let changes = births(&[&a, &b, &m, &plain]);
        let texts: Vec<&str> = changes.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "1 + 2 merged into 3",
                "lease created for 4",
                "0 split into 1 + 2"
            ]
        );
        assert_eq!(
            changes[2].partition.as_ref().map(PartitionId::as_str),
            Some("0"),
            "a split is marked on the parent's row"
        );
    }
}
