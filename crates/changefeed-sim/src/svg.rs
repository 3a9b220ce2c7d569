//! Ownership timelines drawn as SVG: `changefeed simulate --svg` draws a simulated run's
//! (one row per partition, one colour per host, marks for crashes, stalls, hand-offs, steals,
//! splits and merges, from the run's write history), and the live console draws a fleet's in
//! the same style with the same colours and ticks.
//!
//! The simulator only records what happened ([`SimOutcome`]); drawing it is this binary's, with
//! the console's colours and ticks ([`changefeed_console::draw`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use changefeed::model::{Lease, LeaseState, Partition, PartitionId};
use changefeed::sim::{Event, SimOutcome, WriteOp, WriteRec};
use changefeed_console::draw::{escape, nice_tick, PALETTE};

/// How an ownership change happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// The owner wrote the new owner (hand-off honoured).
    Handoff,
    /// A host took a lease a live-looking host owned, after asking (overdue hand-off).
    Steal,
    /// A host took a free or expired lease.
    Take,
}

/// The owner of an owned lease (a free or released row is nobody's).
fn owner_of(l: &Lease) -> Option<&str> {
    (l.state == LeaseState::Owned)
        .then_some(l.owner.as_ref().map(|o| o.as_str()))
        .flatten()
}

/// Renders the timeline of `outcome` as an SVG document.
pub fn render(outcome: &SimOutcome, title: &str) -> String {
    render_parts(
        &outcome.writes,
        &outcome.events,
        &outcome.partitions,
        outcome.virtual_time,
        title,
    )
}

/// Renders a timeline from its parts.
fn render_parts(
    writes: &[WriteRec],
    events: &[Event],
    partitions: &[Partition],
    end: Duration,
    title: &str,
) -> String {
    let mut order: Vec<&Partition> = partitions.iter().collect();
    order.sort_by_key(|p| {
        (
            p.id.as_str().parse::<u64>().unwrap_or(u64::MAX),
            p.id.clone(),
        )
    });
    let row: BTreeMap<&PartitionId, usize> =
        order.iter().enumerate().map(|(i, p)| (&p.id, i)).collect();
    let mut hosts: Vec<String> = writes
        .iter()
        .filter_map(|w| {
            w.after
                .as_ref()
                .and_then(|l| owner_of(l).map(str::to_string))
        })
        .collect();
    hosts.sort();
    hosts.dedup();
    let colour = |h: &str| {
        let i = hosts.iter().position(|x| x == h).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    let rows = order.len().max(1);
    let row_h = if rows > 60 { 4.0 } else { 12.0 };
    let (left, top, width) = (70.0, 40.0, 1100.0);
    let legend_h = 20.0 * (hosts.len().div_ceil(8) as f64) + 30.0;
    let height = top + rows as f64 * row_h + legend_h + 30.0;
    let total = end.as_secs_f64().max(1.0);
    let x = |t: Duration| left + t.as_secs_f64() / total * width;
    let y = |r: usize| top + r as f64 * row_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="18" font-size="14">{}</text>"#,
        escape(title)
    );
    // Time axis.
    let tick = nice_tick(total);
    let mut t = 0.0;
    while t <= total {
        let tx = x(Duration::from_secs_f64(t));
        let _ = writeln!(
            s,
            r##"<line x1="{tx}" y1="{top}" x2="{tx}" y2="{}" stroke="#eee"/><text x="{tx}" y="{}" text-anchor="middle" fill="#666">{}s</text>"##,
            y(rows),
            y(rows) + 12.0,
            t as u64
        );
        t += tick;
    }
    // Ownership bars and moves.
    let mut current: BTreeMap<&PartitionId, (Duration, Option<String>)> = BTreeMap::new();
    let mut marks: Vec<(Duration, usize, Move)> = Vec::new();
    let mut bars: Vec<(usize, Duration, Duration, String)> = Vec::new();
    for w in writes {
        let Some(&r) = row.get(&w.partition) else {
            continue;
        };
        let owner = w
            .after
            .as_ref()
            .and_then(|l| owner_of(l).map(str::to_string));
        let owner = if w.op == WriteOp::Delete { None } else { owner };
        let prev = current.get(&w.partition).cloned();
        let prev_owner = prev.as_ref().and_then(|(_, o)| o.clone());
        if prev_owner == owner {
            continue;
        }
        if let Some((since, Some(o))) = &prev {
            bars.push((r, *since, w.at, o.clone()));
        }
        if let (Some(new), Some(old)) = (&owner, &prev_owner) {
            let kind = if &w.host == old {
                Move::Handoff
            } else if w.next_owner_before.as_ref().map(|h| h.as_str()) == Some(new.as_str()) {
                Move::Steal
            } else {
                Move::Take
            };
            marks.push((w.at, r, kind));
        }
        current.insert(&w.partition, (w.at, owner));
    }
    for (p, (since, owner)) in current {
        if let (Some(o), Some(&r)) = (owner, row.get(p)) {
            bars.push((r, since, end, o));
        }
    }
    for (r, from, to, o) in &bars {
        let _ = writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
            x(*from),
            y(*r) + 1.0,
            (x(*to) - x(*from)).max(0.5),
            row_h - 2.0,
            colour(o)
        );
    }
    for (at, r, kind) in &marks {
        let (cx, cy) = (x(*at), y(*r) + row_h / 2.0);
        let rad = (row_h / 2.5).max(1.5);
        let _ = match kind {
            Move::Handoff => writeln!(
                s,
                r##"<circle cx="{cx:.1}" cy="{cy:.1}" r="{rad:.1}" fill="white" stroke="#222"/>"##
            ),
            Move::Steal => writeln!(
                s,
                r##"<circle cx="{cx:.1}" cy="{cy:.1}" r="{rad:.1}" fill="#d00"/>"##
            ),
            Move::Take => writeln!(
                s,
                r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#222"/>"##,
                cx - rad / 2.0,
                cy - rad / 2.0,
                rad,
                rad
            ),
        };
    }
    // Row labels (every row when few, else every tenth).
    for (p, &r) in &row {
        if rows <= 60 || r % 10 == 0 {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#333">p{}</text>"##,
                left - 4.0,
                y(r) + row_h - 2.0,
                escape(p.as_str())
            );
        }
    }
    // Fleet events as vertical marks.
    for e in events {
        let (stroke, label) = match e.kind {
            "crash" => ("#d00", "✕"),
            "stop" => ("#888", "■"),
            "start" => ("#2a2", "▶"),
            "pause" => ("#a0a", "||"),
            "cut" => ("#f80", "⚡"),
            "split" | "merge" => ("#06c", "Y"),
            _ => continue,
        };
        let ex = x(e.at);
        let _ = writeln!(
            s,
            r#"<line x1="{ex:.1}" y1="{top}" x2="{ex:.1}" y2="{:.1}" stroke="{stroke}" stroke-dasharray="2,3" stroke-width="0.8"/><text x="{ex:.1}" y="{}" text-anchor="middle" fill="{stroke}"><title>{} {} {}</title>{label}</text>"#,
            y(rows),
            top - 4.0,
            e.kind,
            escape(&e.subject),
            escape(&e.detail)
        );
    }
    // Legend.
    let ly = y(rows) + 30.0;
    for (i, h) in hosts.iter().enumerate() {
        let lx = left + (i % 8) as f64 * 130.0;
        let lyy = ly + (i / 8) as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            lyy - 10.0,
            colour(h),
            lx + 16.0,
            lyy,
            escape(h)
        );
    }
    let ky = ly + 20.0 * (hosts.len().div_ceil(8) as f64) + 4.0;
    let _ = writeln!(
        s,
        r##"<text x="{left}" y="{ky}" fill="#333">○ hand-off   ● steal   ▪ take (free or expired)   ✕ crash   ■ stop   ▶ start   || stall   ⚡ store cut   Y split/merge</text>"##
    );
    s.push_str("</svg>\n");
    s
}
