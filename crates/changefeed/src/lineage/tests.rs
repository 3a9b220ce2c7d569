use std::collections::BTreeMap;

use super::*;
use crate::model::{Continuation, GroupName, KeyRange, LeaseKey};

fn id(s: &str) -> PartitionId {
    PartitionId::new(s).expect("valid id")
}

fn part(name: &str, parents: &[&str], closed: bool) -> Partition {
    Partition {
        id: id(name),
        parents: parents.iter().map(|p| id(p)).collect(),
        closed,
        key_range: None,
    }
}

fn lease(name: &str, state: LeaseState) -> Lease {
    let key = LeaseKey::new(GroupName::new("g").expect("valid"), id(name));
    let mut l = Lease::new(key, Position::Beginning);
    l.state = state;
    if state == LeaseState::Owned {
        l.owner = Some(crate::model::HostName::new("h").expect("valid"));
    }
    l
}

fn started(mut l: Lease, offset: u32) -> Lease {
    l.continuation = Some(Continuation::new(format!("{}:{offset}", l.key.partition)));
    l
}

/// The worked example of `reference/kcl-lease-lifecycle.md` and DESIGN "Partition lineage".
fn worked_example() -> Vec<Partition> {
    vec![
        part("0", &[], true),
        part("1", &[], true),
        part("2", &[], true),
        part("3", &[], true),
        part("4", &[], false),
        part("5", &[], true),
        part("6", &["0", "1"], true),
        part("7", &["2", "3"], true),
        part("8", &["6", "7"], false),
        part("9", &["5"], false),
        part("10", &["5"], false),
    ]
}

/// When each closed partition of the worked example closed: 0–3 at 102, 5, 6 and 7 at 205.
fn worked_example_closed_at() -> BTreeMap<PartitionId, Timestamp> {
    [
        ("0", 102),
        ("1", 102),
        ("2", 102),
        ("3", 102),
        ("5", 205),
        ("6", 205),
        ("7", 205),
    ]
    .into_iter()
    .map(|(p, t)| (id(p), Timestamp(t)))
    .collect()
}

fn created(plan: &Plan) -> Vec<(String, Position)> {
    plan.create
        .iter()
        .map(|n| (n.partition.to_string(), n.start.clone()))
        .collect()
}

fn names(plan: &Plan) -> Vec<String> {
    plan.create
        .iter()
        .map(|n| n.partition.to_string())
        .collect()
}

fn run(partitions: &[Partition], leases: &[Lease], start: Position) -> Plan {
    plan(&Input::new(partitions, leases, &start))
}

#[test]
fn worked_example_now_creates_only_the_gap_next_to_a_leased_sibling() {
    // DESIGN "Partition lineage": with (4, 5, 7), Now creates (6), at the beginning.
    let leases = [
        lease("4", LeaseState::Owned),
        lease("5", LeaseState::Owned),
        lease("7", LeaseState::Available),
    ];
    let p = run(&worked_example(), &leases, Position::Now);
    assert_eq!(created(&p), vec![("6".into(), Position::Beginning)]);
    assert!(p.errors.is_empty());
}

#[test]
fn worked_example_beginning_creates_the_roots_of_the_uncovered_branch() {
    // DESIGN "Partition lineage": with (4, 5, 7), Beginning creates (0, 1).
    let leases = [
        lease("4", LeaseState::Owned),
        lease("5", LeaseState::Owned),
        lease("7", LeaseState::Available),
    ];
    let p = run(&worked_example(), &leases, Position::Beginning);
    assert_eq!(
        created(&p),
        vec![
            ("0".into(), Position::Beginning),
            ("1".into(), Position::Beginning)
        ]
    );
    assert_eq!(p.create[0].parents, Vec::<PartitionId>::new());
}

#[test]
fn worked_example_at_time_200_creates_the_roots_starting_at_200() {
    // DESIGN "Partition lineage": with (4, 5, 7), AtTime(200) creates (0, 1), as KCL does
    // even though 0 and 1 closed at 102 (their readers find nothing and finish at once).
    let leases = [
        lease("4", LeaseState::Owned),
        lease("5", LeaseState::Owned),
        lease("7", LeaseState::Available),
    ];
    let partitions = worked_example();
    let start = Position::AtTime(Timestamp(200));
    for closed_at in [BTreeMap::new(), worked_example_closed_at()] {
        let p = plan(&Input::new(&partitions, &leases, &start).with_closed_at(closed_at));
        assert_eq!(
            created(&p),
            vec![("0".into(), start.clone()), ("1".into(), start.clone())]
        );
    }
}

#[test]
fn at_time_on_an_empty_table_skips_partitions_closed_before_the_time() {
    // KCL seeds an empty table with the shards open at t: a partition closed before t is not
    // needed, its children are.
    let partitions = worked_example();
    let start = Position::AtTime(Timestamp(200));
    let p = plan(&Input::new(&partitions, &[], &start).with_closed_at(worked_example_closed_at()));
    assert_eq!(names(&p), vec!["4", "5", "6", "7"]);
    assert!(p.create.iter().all(|n| n.start == start));
    // Without close times it walks back to the roots, like Beginning.
    let p = run(&partitions, &[], start.clone());
    assert_eq!(names(&p), vec!["0", "1", "2", "3", "4", "5"]);
}

#[test]
fn empty_table_now_creates_the_open_leaves_at_now() {
    // KCL LATEST on an empty table: only the open shards, at LATEST.
    let p = run(&worked_example(), &[], Position::Now);
    assert_eq!(names(&p), vec!["10", "4", "8", "9"]);
    assert!(p.create.iter().all(|n| n.start == Position::Now));
}

#[test]
fn empty_table_beginning_creates_every_root() {
    // TRIM_HORIZON on an empty table: every root, at the beginning.
    let p = run(&worked_example(), &[], Position::Beginning);
    assert_eq!(names(&p), vec!["0", "1", "2", "3", "4", "5"]);
}

#[test]
fn children_are_created_at_the_beginning_once_every_parent_is_finished() {
    // Rule 5 / lifecycle: a child is created when its parents reach SHARD_END, never at Now.
    let partitions = [
        part("0", &[], true),
        part("1", &["0"], false),
        part("2", &["0"], false),
    ];
    let p = run(&partitions, &[lease("0", LeaseState::Owned)], Position::Now);
    assert!(p.create.is_empty(), "parent still being read: {p:?}");
    let p = run(
        &partitions,
        &[lease("0", LeaseState::Finished)],
        Position::Now,
    );
    assert_eq!(
        created(&p),
        vec![
            ("1".into(), Position::Beginning),
            ("2".into(), Position::Beginning)
        ]
    );
    assert_eq!(p.create[0].parents, vec![id("0")]);
}

#[test]
fn merge_child_waits_while_one_parent_is_finished_and_the_other_mid_way() {
    // Parents first: a merge child is not created until both parents are finished.
    let partitions = [
        part("a", &[], true),
        part("b", &[], true),
        part("c", &["a", "b"], false),
    ];
    let leases = [
        lease("a", LeaseState::Finished),
        started(lease("b", LeaseState::Owned), 17),
    ];
    for start in [Position::Beginning, Position::Now] {
        let p = run(&partitions, &leases, start);
        assert!(p.create.is_empty(), "{p:?}");
    }
    let leases = [
        lease("a", LeaseState::Finished),
        started(lease("b", LeaseState::Finished), 30),
    ];
    let p = run(&partitions, &leases, Position::Now);
    assert_eq!(created(&p), vec![("c".into(), Position::Beginning)]);
}

#[test]
fn split_children_listed_before_the_parent_closes_wait_for_it() {
    // A child is not read until its parent is finished, even if the source lists it early.
    let partitions = [
        part("p", &[], false),
        part("l", &["p"], false),
        part("r", &["p"], false),
    ];
    let p = run(
        &partitions,
        &[lease("p", LeaseState::Owned)],
        Position::Beginning,
    );
    assert!(p.create.is_empty(), "{p:?}");
    // With no lease yet, only the parent is created, whatever the start.
    for start in [Position::Beginning, Position::Now] {
        let p = run(&partitions, &[], start.clone());
        assert_eq!(created(&p), vec![("p".into(), start)]);
    }
    // A finished lease on a partition the source still lists as open does not make it ready.
    let p = run(
        &partitions,
        &[lease("p", LeaseState::Finished)],
        Position::Now,
    );
    assert!(p.create.is_empty(), "{p:?}");
}

#[test]
fn missing_parent_trimmed_by_retention_counts_as_finished() {
    // A parent the source no longer lists was trimmed: nothing of it can be read.
    let partitions = [part("b", &[], true), part("c", &["a", "b"], false)];
    let p = run(
        &partitions,
        &[lease("b", LeaseState::Finished)],
        Position::Now,
    );
    assert_eq!(created(&p), vec![("c".into(), Position::Beginning)]);
    // A child whose only parent was trimmed is a root.
    let partitions = [part("c", &["a"], false)];
    let p = run(&partitions, &[], Position::Beginning);
    assert_eq!(created(&p), vec![("c".into(), Position::Beginning)]);
    assert!(p.errors.is_empty());
    assert_eq!(p.create[0].parents, vec![id("a")]);
}

#[test]
fn unknown_parent_is_an_error_naming_the_partition_when_the_source_never_trims() {
    // Corrupt source data: named, no panic, no lease from it or below it; the rest stands.
    let partitions = [
        part("c", &["ghost"], false),
        part("d", &["c"], false),
        part("x", &[], false),
    ];
    let p = plan(
        &Input::new(&partitions, &[], &Position::Beginning)
            .with_missing_parents(MissingParents::Error),
    );
    assert_eq!(names(&p), vec!["x"]);
    assert_eq!(
        p.errors,
        vec![
            LineageError::UnknownParent {
                partition: id("c"),
                parent: id("ghost")
            },
            LineageError::Descends {
                partition: id("d"),
                from: id("c")
            },
        ]
    );
    assert_eq!(
        p.errors[0].to_string(),
        "partition c: names unknown parent ghost"
    );
}

#[test]
fn self_parent_is_an_error_naming_the_partition() {
    // Corrupt source data: a partition that is its own parent gets no lease.
    let partitions = [part("s", &["s"], false), part("ok", &[], false)];
    let p = run(&partitions, &[], Position::Beginning);
    assert_eq!(names(&p), vec!["ok"]);
    assert_eq!(
        p.errors,
        vec![LineageError::SelfParent { partition: id("s") }]
    );
    assert_eq!(
        p.errors[0].to_string(),
        "partition s: names itself as a parent"
    );
}

#[test]
fn cycle_is_an_error_naming_the_partitions_on_it() {
    // Corrupt source data: a cycle and everything below it gets no lease; no panic, no loop.
    let partitions = [
        part("a", &["c"], true),
        part("b", &["a"], true),
        part("c", &["b"], true),
        part("d", &["c"], false),
        part("ok", &[], false),
    ];
    for start in [Position::Beginning, Position::Now] {
        let p = run(&partitions, &[], start);
        assert_eq!(names(&p), vec!["ok"]);
        assert_eq!(p.errors.len(), 2, "{:?}", p.errors);
        assert_eq!(
            p.errors[0].to_string(),
            "partition a: its parents form a cycle (a → c → b → a)"
        );
        assert!(matches!(
            &p.errors[1],
            LineageError::Descends { partition, .. } if partition.as_str() == "d"
        ));
    }
}

#[test]
fn duplicate_partition_is_an_error() {
    // Corrupt source data: an id listed twice is refused.
    let partitions = [part("a", &[], false), part("a", &[], true)];
    let p = run(&partitions, &[], Position::Beginning);
    assert!(p.create.is_empty());
    assert_eq!(
        p.errors,
        vec![LineageError::Duplicate { partition: id("a") }]
    );
}

#[test]
fn partitions_behind_a_leased_descendant_are_never_recreated() {
    // Cleaned-up or skipped ancestors stay gone: the fleet is already past them.
    let leases = [
        started(lease("8", LeaseState::Owned), 3),
        lease("4", LeaseState::Owned),
        lease("9", LeaseState::Owned),
        lease("10", LeaseState::Owned),
    ];
    for start in [Position::Beginning, Position::Now] {
        let p = run(&worked_example(), &leases, start);
        assert!(p.create.is_empty(), "{p:?}");
    }
}

#[test]
fn sibling_of_a_leased_split_child_is_created_without_reprocessing_the_parent() {
    // Parent 5 was cleaned up after 9 started; 10 is ready, 5 is not read again.
    let leases = [
        lease("4", LeaseState::Owned),
        lease("8", LeaseState::Owned),
        lease("9", LeaseState::Owned),
    ];
    let p = run(&worked_example(), &leases, Position::Beginning);
    assert_eq!(created(&p), vec![("10".into(), Position::Beginning)]);
}

#[test]
fn plans_are_one_level_at_a_time_and_converge_to_every_partition() {
    // Applying plans and finishing leases level by level reaches every partition once.
    let partitions = worked_example();
    for start in [
        Position::Beginning,
        Position::Now,
        Position::AtTime(Timestamp(200)),
    ] {
        let mut leases: Vec<Lease> = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..10 {
            let p = run(&partitions, &leases, start.clone());
            assert!(p.errors.is_empty());
            for n in p.create {
                assert!(
                    seen.insert(n.partition.clone()),
                    "{} created twice",
                    n.partition
                );
                leases.push(lease(n.partition.as_str(), LeaseState::Available));
            }
            // Every closed partition with a lease, whose parents are finished, finishes.
            let finished: Vec<PartitionId> = leases
                .iter()
                .filter(|l| {
                    partitions
                        .iter()
                        .find(|p| p.id == l.key.partition)
                        .is_some_and(|p| p.closed)
                })
                .map(|l| l.key.partition.clone())
                .collect();
            for l in &mut leases {
                if finished.contains(&l.key.partition) {
                    l.state = LeaseState::Finished;
                }
            }
        }
        let open: Vec<&str> = vec!["10", "4", "8", "9"];
        for o in open {
            assert!(seen.contains(&id(o)), "{start}: open partition {o} reached");
        }
        if start == Position::Beginning {
            assert_eq!(seen.len(), partitions.len(), "Beginning reads everything");
        }
    }
}

#[test]
fn finished_lease_is_deletable_only_after_every_child_started() {
    // Rule 5: a finished lease is deleted only after all its children have started.
    let partitions = [
        part("0", &[], true),
        part("1", &["0"], false),
        part("2", &["0"], false),
    ];
    let mut leases = vec![
        lease("0", LeaseState::Finished),
        lease("1", LeaseState::Owned),
    ];
    assert!(
        deletable(&partitions, &leases).is_empty(),
        "child 2 has no lease"
    );
    leases.push(lease("2", LeaseState::Owned));
    assert!(
        deletable(&partitions, &leases).is_empty(),
        "no child checkpointed"
    );
    leases[1] = started(lease("1", LeaseState::Owned), 1);
    assert!(
        deletable(&partitions, &leases).is_empty(),
        "child 2 not started"
    );
    leases[2] = lease("2", LeaseState::Finished);
    assert_eq!(deletable(&partitions, &leases), vec![id("0")]);
}

#[test]
fn chains_are_deleted_oldest_first_and_childless_tombstones_stay() {
    // A child lease is never deleted while its parent's lease remains; a finished partition
    // without children is kept until the source trims it.
    let partitions = [
        part("0", &[], true),
        part("1", &["0"], true),
        part("2", &["1"], false),
        part("z", &[], true),
    ];
    let leases = [
        lease("0", LeaseState::Finished),
        lease("1", LeaseState::Finished),
        started(lease("2", LeaseState::Owned), 1),
        lease("z", LeaseState::Finished),
    ];
    assert_eq!(deletable(&partitions, &leases), vec![id("0")]);
    assert_eq!(deletable(&partitions, &leases[1..]), vec![id("1")]);
    // Once z is trimmed, its tombstone may go.
    assert_eq!(deletable(&partitions[..3], &leases[3..]), vec![id("z")]);
}

fn ranged(name: &str, state: LeaseState, start: u128, end: u128) -> Lease {
    let mut l = lease(name, state);
    l.properties.insert(
        RANGE_PROPERTY.to_string(),
        range_property(KeyRange { start, end }),
    );
    l
}

#[test]
fn listing_is_skipped_only_when_leases_cover_the_key_space_and_none_finished() {
    // KCL's "avoid a shard sync".
    let half = u128::MAX / 2;
    let full = [
        ranged("a", LeaseState::Owned, 0, half),
        ranged("b", LeaseState::Available, half + 1, u128::MAX),
    ];
    assert!(covers_key_space(&full));
    assert!(!covers_key_space::<Lease>(&[]));
    assert!(!covers_key_space(&full[..1]), "a hole");
    let mut finished = full.clone();
    finished[1].state = LeaseState::Finished;
    assert!(
        !covers_key_space(&finished),
        "a finished lease means children may be due"
    );
    let mut unknown = full.to_vec();
    unknown.push(lease("c", LeaseState::Owned));
    assert!(!covers_key_space(&unknown), "a lease without a range");
    assert_eq!(
        lease_range(&full[0]),
        Some(KeyRange {
            start: 0,
            end: half
        })
    );
}

#[test]
fn created_leases_carry_the_partition_range() {
    // The sync stores each lease's range so that later syncs can skip the listing.
    let mut partitions = vec![part("0", &[], false)];
    partitions[0].key_range = Some(KeyRange::FULL);
    let p = run(&partitions, &[], Position::Now);
    assert_eq!(p.create[0].key_range, Some(KeyRange::FULL));
}

fn run_continuing(partitions: &[Partition], leases: &[Lease], start: Position) -> Plan {
    plan(&Input::new(partitions, leases, &start).with_child_start(ChildStart::ParentContinuation))
}

#[test]
fn child_of_one_parent_continues_from_its_final_continuation() {
    // Cosmos DB: a child key range also holds its keys' changes from before the split, so
    // both children of a split continue where the parent's lease ended, whatever the start.
    let partitions = [
        part("0", &[], true),
        part("1", &["0"], false),
        part("2", &["0"], false),
    ];
    let parent = started(lease("0", LeaseState::Finished), 42);
    let after = Position::Continuation(Continuation::new("0:42"));
    for start in [
        Position::Beginning,
        Position::Now,
        Position::AtTime(Timestamp(7)),
    ] {
        let p = run_continuing(&partitions, std::slice::from_ref(&parent), start.clone());
        assert_eq!(
            created(&p),
            vec![("1".into(), after.clone()), ("2".into(), after.clone())],
            "start {start}"
        );
        // The default rule is unchanged.
        let p = run(&partitions, std::slice::from_ref(&parent), start.clone());
        assert_eq!(p.create[0].start, child_start(&start), "start {start}");
    }
    // Still only once the parent is finished.
    let reading = started(lease("0", LeaseState::Owned), 42);
    let p = run_continuing(&partitions, &[reading], Position::Beginning);
    assert!(p.create.is_empty(), "{p:?}");
}

#[test]
fn child_of_a_parent_that_never_checkpointed_starts_where_the_parent_started() {
    let partitions = [part("0", &[], true), part("1", &["0"], false)];
    // A parent imported at a continuation, or started at a time, that read nothing more.
    for parent_start in [
        Position::Continuation(Continuation::new("\"17\"")),
        Position::AtTime(Timestamp(5)),
        Position::Beginning,
    ] {
        let mut parent = lease("0", LeaseState::Finished);
        parent.start = parent_start.clone();
        let p = run_continuing(&partitions, &[parent], Position::Now);
        assert_eq!(created(&p), vec![("1".into(), parent_start)]);
    }
    // A parent started at `Now` that read nothing: its position is gone, and the child starts
    // at the beginning (records again rather than a gap).
    let mut parent = lease("0", LeaseState::Finished);
    parent.start = Position::Now;
    let p = run_continuing(&partitions, &[parent], Position::Now);
    assert_eq!(created(&p), vec![("1".into(), Position::Beginning)]);
}

#[test]
fn merge_child_starts_at_the_beginning_even_when_continuing() {
    // Two parents' continuations are opaque to the core and cannot be ordered: the child of a
    // merge starts at the beginning (or the group's time), which loses nothing.
    let partitions = [
        part("a", &[], true),
        part("b", &[], true),
        part("c", &["a", "b"], false),
    ];
    let leases = [
        started(lease("a", LeaseState::Finished), 10),
        started(lease("b", LeaseState::Finished), 30),
    ];
    let p = run_continuing(&partitions, &leases, Position::Now);
    assert_eq!(created(&p), vec![("c".into(), Position::Beginning)]);
    let p = run_continuing(&partitions, &leases, Position::AtTime(Timestamp(9)));
    assert_eq!(
        created(&p),
        vec![("c".into(), Position::AtTime(Timestamp(9)))]
    );
    // One parent listed, the other trimmed: still a merge, still the beginning.
    let partitions = [part("a", &[], true), part("c", &["a", "gone"], false)];
    let p = run_continuing(&partitions, &leases[..1], Position::Now);
    assert_eq!(created(&p), vec![("c".into(), Position::Beginning)]);
}
