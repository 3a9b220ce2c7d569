//! `rebalance` under realistic conditions: ours at its defaults, with records arriving on every
//! partition, first on the ideal store of the other tables, then step by step with
//!
//! - a store latency of 5–10 ms on every call (uniform), as a store in the same region gives;
//! - DynamoDB's shared change counter: our DynamoDB store writes every ownership change in one
//!   transaction with the group's counter item, so two that overlap conflict and one retries
//!   after a back-off (modelled in the simulator: a write holds the item for the shortest round
//!   trip, 5 ms);
//! - handler time: every batch takes 5 ms to 200 ms (log-uniform) to handle, so a hand-off,
//!   written by the owner between batches, waits for the batch in flight.
//!
//! Each condition keeps the ones before it. The simulator's clock is virtual: latency and
//! handler time are waited out in virtual time, so the figures do not depend on the machine.

use std::time::Duration;

use changefeed::sim::{SimFleet, StrategyKind};

use super::{block, change_under, failover, reading_cell, row, Cadence, Change};

/// The store and handler conditions of one column.
#[derive(Debug, Clone, Copy)]
pub(super) struct Conditions {
    /// Every store call takes from `.0` to `.1` (zero: no latency).
    latency: (Duration, Duration),
    /// Ownership writes conflict on a shared change counter (DynamoDB).
    counter: bool,
    /// Every handler call takes from 5 ms to this long (zero: no handler time).
    handler_max: Duration,
}

impl Conditions {
    /// No latency, no counter, a handler that takes no time: the other tables' conditions.
    pub(super) const IDEAL: Conditions = Conditions {
        latency: (Duration::ZERO, Duration::ZERO),
        counter: false,
        handler_max: Duration::ZERO,
    };

    /// Sets the conditions on a fleet before any host starts.
    pub(super) fn apply(&self, fleet: &SimFleet) {
        fleet.store_conditions(self.latency, self.counter);
        if !self.handler_max.is_zero() {
            fleet.slow_handler(1.0, self.handler_max);
        }
    }
}

const LATENCY: (Duration, Duration) = (Duration::from_millis(5), Duration::from_millis(10));

/// The columns: each adds one condition to the one before.
const COLUMNS: [(&str, &str, Conditions); 4] = [
    ("ideal store", "ideal", Conditions::IDEAL),
    (
        "latency 5-10 ms",
        "latency",
        Conditions {
            latency: LATENCY,
            ..Conditions::IDEAL
        },
    ),
    (
        "+ DynamoDB counter",
        "ddb",
        Conditions {
            latency: LATENCY,
            counter: true,
            ..Conditions::IDEAL
        },
    ),
    (
        "+ handler 5-200 ms",
        "busy",
        Conditions {
            latency: LATENCY,
            counter: true,
            handler_max: Duration::from_millis(200),
        },
    ),
];

fn cell(c: &Change) -> String {
    format!(
        "{}{} cyc {:.1} s {} mv",
        if c.done { "" } else { ">" },
        c.cycles,
        c.secs,
        c.moves
    )
}

/// Runs ours under each condition, prints the table and returns the `RESULT` keys to append
/// (each starting with a space).
pub(super) fn run(leases: u32) -> anyhow::Result<String> {
    let ours = StrategyKind::EqualShare;
    // Four records per partition per second, as the reading row of the other tables.
    let busy = u64::from(leases).max(1);
    println!();
    println!(
        "ours at its defaults (renew and acquire 2 s, expiry 10 s), {leases} leases, records arriving (4 per partition per second); each column adds one condition (virtual time)"
    );
    row("", &COLUMNS.map(|(label, _, _)| label.to_string()));
    let mut keys = String::new();
    let mut grow = Vec::new();
    let mut double = Vec::new();
    let mut fail = Vec::new();
    for (_, key, conditions) in COLUMNS {
        let g = block(change_under(
            ours,
            Cadence::Own,
            leases,
            (10, 11),
            busy,
            conditions,
        ))?;
        let d = block(change_under(
            ours,
            Cadence::Own,
            leases,
            (10, 20),
            busy,
            conditions,
        ))?;
        let f = block(failover(ours, Cadence::Own, leases, conditions))?;
        let reading = g.reading.map_or("none".to_string(), |r| format!("{r:.1}"));
        keys.push_str(&format!(
            " cycles_ours_{key}={} balanced_s_ours_{key}={:.1} reading_s_ours_{key}={reading} balanced_s_ours_{key}_10_20={:.1} reading_s_ours_{key}_10_20={} counter_conflicts_ours_{key}_10_20={} failover_s_ours_{key}={f:.1}",
            g.cycles,
            g.secs,
            d.secs,
            d.reading.map_or("none".to_string(), |r| format!("{r:.1}")),
            d.conflicts,
        ));
        grow.push(g);
        double.push(d);
        fail.push(f);
    }
    row("hosts 10 -> 11", &grow.iter().map(cell).collect::<Vec<_>>());
    row(
        "10 -> 11: moved leases read",
        &grow.iter().map(reading_cell).collect::<Vec<_>>(),
    );
    row(
        "hosts 10 -> 20",
        &double.iter().map(cell).collect::<Vec<_>>(),
    );
    row(
        "10 -> 20: moved leases read",
        &double.iter().map(reading_cell).collect::<Vec<_>>(),
    );
    row(
        "10 -> 20: counter conflicts",
        &double
            .iter()
            .map(|d| d.conflicts.to_string())
            .collect::<Vec<_>>(),
    );
    row(
        "failover after a crash (idle)",
        &fail.iter().map(|f| format!("{f:.1} s")).collect::<Vec<_>>(),
    );
    Ok(keys)
}
