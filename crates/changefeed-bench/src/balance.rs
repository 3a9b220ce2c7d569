//! `balance`: time of one host's [`EqualShare`] plan on a large lease table, against a trivial
//! O(leases) pass over the same table in the same run.
//!
//! Scenarios (each `--leases` × `--hosts`):
//! - `join`: `hosts − 1` hosts hold every lease evenly and one new host joins; the new host's
//!   plan asks for its whole share by hand-off.
//! - `free10`: every host holds an even share of 90% of the leases, 10% are free; the plan is
//!   for the last host by name.
//! - `steady`: every host holds its share; the plan is empty.
//!
//! The measured time is what a host does with a listing each cycle it plans: take the listed
//! rows in as its table (one pass noting its own leases and the hand-offs asked of it, a sort
//! check), build the snapshot (one view per lease, eligibility by the lineage rule looking
//! parents up in the table, the live hosts sorted) and plan. The plan alone is reported beside
//! it. The listing itself (the store call, which hands over an owned list) is not timed: it is
//! the store's cost, measured by `store`.
//!
//! The baseline counts the leases per owner with a hash map over the same listing: the least
//! any balancer must do. Wall time is read with `std::time::Instant`: measuring real elapsed time is the point of a
//! benchmark.

use std::collections::{BTreeSet, HashMap};
use std::hint::black_box;
use std::time::Instant;

use anyhow::{ensure, Context};
use changefeed::balance::{quotas, BalanceStrategy, EqualShare, LeaseView, Snapshot};
use changefeed::lineage::ready_to_read;
use changefeed::model::{GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position};

/// Arguments of `changefeed-bench balance`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Leases in the table.
    #[arg(long, default_value_t = 100_000)]
    leases: usize,
    /// Live hosts, the planning host included.
    #[arg(long, default_value_t = 1_000)]
    hosts: usize,
    /// Timed runs per scenario; the median is reported.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// A small run for a smoke test: 10,000 leases, 100 hosts, 3 runs.
    #[arg(long)]
    quick: bool,
}

/// One scenario: a lease table, the live hosts, and the host that plans.
struct Scenario {
    name: &'static str,
    leases: Vec<Lease>,
    live: Vec<HostName>,
    me: HostName,
}

/// Runs the benchmark.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if args.quick {
        (args.leases, args.hosts, args.runs) = (10_000, 100, 3);
    }
    ensure!(args.leases > 0, "--leases must be at least 1");
    ensure!(args.hosts >= 2, "--hosts must be at least 2");
    ensure!(args.runs > 0, "--runs must be at least 1");
    let scenarios = build(&args)?;

    println!(
        "balance: one host's EqualShare plan, {} leases x {} hosts, median of {} runs",
        args.leases, args.hosts, args.runs
    );
    println!(
        "{:<8} {:>6} {:>9} {:>6} {:>9} {:>18} {:>12} {:>7}",
        "scenario",
        "take",
        "handoffs",
        "quota",
        "plan ms",
        "snapshot+plan ms",
        "baseline ms",
        "ratio"
    );
    let (mut worst, mut worst_plan, mut worst_baseline) = (0.0f64, 0.0f64, 0.0f64);
    for s in &scenarios {
        let views: Vec<LeaseView<'_>> = s.leases.iter().map(LeaseView::new).collect();
        let snapshot = Snapshot {
            me: &s.me,
            live_hosts: &s.live,
            leases: &views,
        };
        let plan = EqualShare::default().plan(&snapshot);
        let quota = quotas(&s.live, &views).get(&s.me).copied().unwrap_or(0);
        let plan_ms = median_ms(args.runs, || {
            black_box(EqualShare::default().plan(black_box(&snapshot)));
        });
        let full_ms = median_ms_owned(
            args.runs,
            || s.leases.clone(),
            |listing| plan_from_listing(black_box(listing), &s.live, &s.me),
        );
        let baseline_ms = median_ms(args.runs, || {
            black_box(count_owners(black_box(&s.leases)));
        });
        println!(
            "{:<8} {:>6} {:>9} {:>6} {:>9.3} {:>18.3} {:>12.3} {:>7.2}",
            s.name,
            plan.take.len(),
            plan.request_handoff.len(),
            quota,
            plan_ms,
            full_ms,
            baseline_ms,
            full_ms / baseline_ms
        );
        if full_ms > worst {
            (worst, worst_plan, worst_baseline) = (full_ms, plan_ms, baseline_ms);
        }
    }
    // balance_ms (and ratio) include building the snapshot from the listing; plan_only_ms is
    // the plan of the same scenario alone.
    println!(
        "RESULT balance_ms={worst:.3} baseline_ms={worst_baseline:.3} ratio={:.2} plan_only_ms={worst_plan:.3}",
        worst / worst_baseline
    );
    Ok(())
}

/// What a host does with a listing before and while planning: takes the rows in as its table
/// (noting its own leases and the hand-offs asked of it; sorting if the store did not), builds
/// one view per lease (eligible by the lineage rule, looking parents up in the sorted rows)
/// and the sorted live hosts, and plans. Returns the rows (to be dropped outside the timing)
/// and the plan's size.
fn plan_from_listing(
    mut rows: Vec<Lease>,
    live: &[HostName],
    me: &HostName,
) -> (Vec<Lease>, usize) {
    let (mut mine, mut asked) = (BTreeSet::new(), BTreeSet::new());
    let mut sorted = true;
    let mut previous: Option<&PartitionId> = None;
    for l in &rows {
        sorted &= previous.is_none_or(|p| p <= &l.key.partition);
        previous = Some(&l.key.partition);
        if l.is_owned_by(me) {
            mine.insert(l.key.partition.clone());
        }
        if l.next_owner.as_ref() == Some(me) {
            asked.insert(l.key.partition.clone());
        }
    }
    if !sorted {
        rows.sort_by(|a, b| a.key.partition.cmp(&b.key.partition));
    }
    black_box((&mine, &asked));
    let find = |p: &PartitionId| {
        rows.binary_search_by(|l| l.key.partition.cmp(p))
            .ok()
            .map(|i| &rows[i])
    };
    let views: Vec<LeaseView<'_>> = rows
        .iter()
        .map(|lease| LeaseView {
            lease,
            eligible: ready_to_read(lease, find),
            handoff_overdue: false,
        })
        .collect();
    let mut live = live.to_vec();
    live.sort();
    let plan = EqualShare::default().plan(&Snapshot {
        me,
        live_hosts: &live,
        leases: &views,
    });
    let size = plan.take.len() + plan.request_handoff.len();
    drop(views);
    (rows, size)
}

/// The baseline: one pass over the listing counting unfinished leases per owner.
fn count_owners(leases: &[Lease]) -> HashMap<&HostName, usize> {
    let mut counts = HashMap::new();
    for l in leases.iter().filter(|l| l.state != LeaseState::Finished) {
        if let Some(owner) = l.owner.as_ref() {
            *counts.entry(owner).or_insert(0) += 1;
        }
    }
    counts
}

/// Median wall time of `runs` calls of `f`, in milliseconds, after one warm-up call.
fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// As [`median_ms`], for a step that consumes its input: `setup` makes the input untimed, and
/// what the step returns is dropped untimed.
fn median_ms_owned<I, O>(runs: usize, setup: impl Fn() -> I, mut f: impl FnMut(I) -> O) -> f64 {
    drop(f(setup()));
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let input = setup();
            let start = Instant::now();
            let out = black_box(f(input));
            let ms = start.elapsed().as_secs_f64() * 1e3;
            drop(out);
            ms
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn build(args: &Args) -> anyhow::Result<Vec<Scenario>> {
    let group = GroupName::new("bench").context("group name")?;
    let hosts: Vec<HostName> = (0..args.hosts)
        .map(|i| HostName::new(format!("host-{i:06}")))
        .collect::<Result<_, _>>()
        .context("host name")?;
    let lease = |i: usize, owner: Option<&HostName>| -> anyhow::Result<Lease> {
        let partition = PartitionId::new(format!("{i:08}")).context("partition id")?;
        let mut lease = Lease::new(LeaseKey::new(group.clone(), partition), Position::Beginning);
        if let Some(owner) = owner {
            lease.state = LeaseState::Owned;
            lease.owner = Some(owner.clone());
        }
        Ok(lease)
    };
    let last = hosts[hosts.len() - 1].clone();
    let old = &hosts[..hosts.len() - 1];

    let join = (0..args.leases)
        .map(|i| lease(i, Some(&old[i % old.len()])))
        .collect::<anyhow::Result<_>>()?;
    // Every tenth lease is free; the others go round the hosts in turn.
    let free10 = (0..args.leases)
        .map(|i| {
            lease(
                i,
                (i % 10 != 0).then(|| &hosts[(i - i / 10 - 1) % hosts.len()]),
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let steady = (0..args.leases)
        .map(|i| lease(i, Some(&hosts[i % hosts.len()])))
        .collect::<anyhow::Result<_>>()?;
    Ok(vec![
        Scenario {
            name: "join",
            leases: join,
            live: hosts.clone(),
            me: last.clone(),
        },
        Scenario {
            name: "free10",
            leases: free10,
            live: hosts.clone(),
            me: last.clone(),
        },
        Scenario {
            name: "steady",
            leases: steady,
            live: hosts,
            me: last,
        },
    ])
}
