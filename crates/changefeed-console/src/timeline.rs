//! The console's ownership timeline: who owned each partition over the last minutes, with
//! marks for takes, hand-offs and steals, and fleet events (joins, expiries, splits) as
//! vertical lines; drawn as SVG in the simulator's style (`changefeed simulate --svg`).
//!
//! It keeps only what it is told ([`Timeline::own`], [`Timeline::mark`]) and forgets what
//! falls out of its window; times are the console's wall clock in milliseconds.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::draw::{escape, nice_tick};
use changefeed::model::{HostName, PartitionId};

use super::events::{Change, Kind};

/// One partition's ownership history.
#[derive(Debug, Default)]
struct Row {
    /// Closed stretches: from, to, owner.
    past: Vec<(i64, i64, HostName)>,
    /// The current owner and since when.
    open: Option<(i64, HostName)>,
    /// When its lease was deleted (the row stays until its history leaves the window).
    deleted: Option<i64>,
}

/// A mark at one instant: on a partition's row (a move) or across all rows (a fleet event).
#[derive(Debug, Clone)]
struct Mark {
    at: i64,
    kind: Kind,
    partition: Option<PartitionId>,
    text: String,
}

/// The ownership history of the last `window_ms`.
#[derive(Debug)]
pub struct Timeline {
    window_ms: i64,
    rows: BTreeMap<PartitionId, Row>,
    marks: Vec<Mark>,
    /// When it was first told anything: the axis starts there until the window is full.
    origin: Option<i64>,
}

impl Timeline {
    /// An empty timeline keeping `window_ms` of history.
    pub fn new(window_ms: i64) -> Self {
        Self {
            window_ms: window_ms.max(1_000),
            rows: BTreeMap::new(),
            marks: Vec::new(),
            origin: None,
        }
    }

    /// From `at` on, `partition` is owned by `owner` (or by nobody).
    pub fn own(&mut self, at: i64, partition: &PartitionId, owner: Option<&HostName>) {
        self.origin.get_or_insert(at);
        let row = self.rows.entry(partition.clone()).or_default();
        row.deleted = None;
        if row.open.as_ref().map(|(_, h)| h) == owner {
            return;
        }
        if let Some((from, host)) = row.open.take() {
            row.past.push((from, at, host));
        }
        row.open = owner.map(|h| (at, h.clone()));
    }

    /// `partition`'s lease was deleted at `at`.
    pub fn delete(&mut self, at: i64, partition: &PartitionId) {
        self.own(at, partition, None);
        if let Some(row) = self.rows.get_mut(partition) {
            row.deleted = Some(at);
        }
    }

    /// Draws `change` at `at`: a move on its partition's row, a split or a host event across
    /// the rows; other events are not drawn.
    pub fn mark(&mut self, at: i64, change: &Change) {
        let across = matches!(
            change.kind,
            Kind::Split
                | Kind::Merge
                | Kind::Join
                | Kind::Leave
                | Kind::Restart
                | Kind::Fence
                | Kind::Expire
        );
        if !change.kind.is_move() && !across {
            return;
        }
        self.marks.push(Mark {
            at,
            kind: change.kind,
            partition: change.partition.clone().filter(|_| !across),
            text: change.text.clone(),
        });
    }

    /// Forgets what ended before `now − window`.
    pub fn prune(&mut self, now: i64) {
        let start = now - self.window_ms;
        self.marks.retain(|m| m.at >= start);
        self.rows.retain(|_, row| {
            row.past.retain(|(_, to, _)| *to >= start);
            row.open.is_some() || !row.past.is_empty() || row.deleted.is_some_and(|d| d >= start)
        });
    }

    /// The timeline up to `now` as an SVG document; `colour` gives each host's colour.
    pub fn svg(&self, now: i64, title: &str, colour: &dyn Fn(&HostName) -> &'static str) -> String {
        let mut order: Vec<&PartitionId> = self.rows.keys().collect();
        order.sort_by_key(|p| (p.as_str().parse::<u64>().unwrap_or(u64::MAX), *p));
        let index: BTreeMap<&PartitionId, usize> =
            order.iter().enumerate().map(|(i, p)| (*p, i)).collect();
        let rows = order.len().max(1);
        let row_h = if rows > 60 { 4.0 } else { 14.0 };
        let (left, top, width) = (70.0, 26.0, 1000.0);
        let hosts_drawn = {
            let mut all: Vec<&HostName> = self
                .rows
                .values()
                .flat_map(|r| {
                    r.past
                        .iter()
                        .map(|(_, _, h)| h)
                        .chain(r.open.iter().map(|(_, h)| h))
                })
                .collect();
            all.sort();
            all.dedup();
            all
        };
        let height = top + rows as f64 * row_h + 52.0 + 16.0 * hosts_drawn.len().div_ceil(8) as f64;
        // The whole window once it is full; until then, from the first read (at least 10 s).
        let start = (now - self.window_ms).max(self.origin.unwrap_or(now).min(now - 10_000));
        let span = (now - start) as f64;
        let x = |t: i64| left + ((t.max(start) - start) as f64 / span).min(1.0) * width;
        let y = |r: usize| top + r as f64 * row_h;

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" viewBox="0 0 {w} {height}" font-family="sans-serif" font-size="11" role="img">"#,
            w = left + width + 20.0
        );
        let _ = writeln!(s, r#"<title>{}</title>"#, escape(title));
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        // Time axis: seconds before now.
        let tick = nice_tick(span / 1000.0);
        let mut ago = 0.0;
        while ago <= span / 1000.0 {
            let tx = x(now - (ago * 1000.0) as i64);
            let label = if ago == 0.0 {
                "now".to_string()
            } else {
                format!("−{}s", ago as u64)
            };
            let _ = writeln!(
                s,
                r##"<line x1="{tx:.1}" y1="{top}" x2="{tx:.1}" y2="{}" stroke="#eee"/><text x="{tx:.1}" y="{}" text-anchor="middle" fill="#666">{label}</text>"##,
                y(rows),
                y(rows) + 12.0
            );
            ago += tick;
        }
        for (p, &r) in &index {
            let row = &self.rows[*p];
            let bars = row
                .past
                .iter()
                .map(|(from, to, h)| (*from, *to, h))
                .chain(row.open.iter().map(|(from, h)| (*from, now, h)));
            for (from, to, h) in bars {
                let _ = writeln!(
                    s,
                    r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {}</title></rect>"#,
                    x(from),
                    y(r) + 1.0,
                    (x(to) - x(from)).max(0.5),
                    row_h - 2.0,
                    colour(h),
                    escape(p.as_str()),
                    escape(h.as_str())
                );
            }
            if rows <= 60 || r % 10 == 0 {
                let _ = writeln!(
                    s,
                    r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#333">{}</text>"##,
                    left - 4.0,
                    y(r) + row_h - 3.0,
                    escape(p.as_str())
                );
            }
        }
        for m in &self.marks {
            let mx = x(m.at);
            match &m.partition {
                Some(p) => {
                    let Some(&r) = index.get(p) else { continue };
                    let (cy, rad) = (y(r) + row_h / 2.0, (row_h / 2.5).max(1.5));
                    let shape = match m.kind {
                        Kind::Handoff => format!(
                            r##"<circle cx="{mx:.1}" cy="{cy:.1}" r="{rad:.1}" fill="white" stroke="#222">"##
                        ),
                        Kind::Steal => format!(
                            r##"<circle cx="{mx:.1}" cy="{cy:.1}" r="{rad:.1}" fill="#d00">"##
                        ),
                        _ => format!(
                            r##"<rect x="{:.1}" y="{:.1}" width="{rad:.1}" height="{rad:.1}" fill="#222">"##,
                            mx - rad / 2.0,
                            cy - rad / 2.0
                        ),
                    };
                    let end = if m.kind == Kind::Handoff || m.kind == Kind::Steal {
                        "</circle>"
                    } else {
                        "</rect>"
                    };
                    let _ = writeln!(s, "{shape}<title>{}</title>{end}", escape(&m.text));
                }
                None => {
                    let (stroke, label) = match m.kind {
                        Kind::Expire => ("#d00", "✕"),
                        Kind::Leave => ("#888", "■"),
                        Kind::Join | Kind::Restart => ("#2a2", "▶"),
                        Kind::Fence => ("#a0a", "||"),
                        _ => ("#06c", "Y"),
                    };
                    let _ = writeln!(
                        s,
                        r#"<line x1="{mx:.1}" y1="{top}" x2="{mx:.1}" y2="{:.1}" stroke="{stroke}" stroke-dasharray="2,3" stroke-width="0.8"/><text x="{mx:.1}" y="{}" text-anchor="middle" fill="{stroke}"><title>{}</title>{label}</text>"#,
                        y(rows),
                        top - 4.0,
                        escape(&m.text)
                    );
                }
            }
        }
        // Legend: every host drawn, in name order.
        let drawn = hosts_drawn;
        for (i, h) in drawn.iter().enumerate() {
            let lx = left + (i % 8) as f64 * 120.0;
            let ly = y(rows) + 30.0 + (i / 8) as f64 * 16.0;
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{ly}">{}</text>"#,
                ly - 9.0,
                colour(h),
                lx + 14.0,
                escape(h.as_str())
            );
        }
        let legend_h = 16.0 * drawn.len().div_ceil(8) as f64;
        let _ = writeln!(
            s,
            r##"<text x="{left}" y="{:.1}" fill="#333">○ hand-off   ● steal   ▪ take (free or expired)   ✕ expired   ■ left   ▶ joined   || fenced   Y split/merge</text>"##,
            y(rows) + 34.0 + legend_h
        );
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(h: &str) -> HostName {
        HostName::new(h).expect("host")
    }

    #[test]
    fn ownership_becomes_bars_and_old_history_is_forgotten() {
        // A row per partition, a bar per owner; what left the window is gone.
        let mut t = Timeline::new(60_000);
        let p = PartitionId::new("0").expect("partition");
        t.own(1_000, &p, Some(&host("a")));
        t.own(30_000, &p, Some(&host("b")));
        t.mark(
            30_000,
            &Change {
                kind: Kind::Handoff,
                partition: Some(p.clone()),
                host: Some(host("b")),
                text: "a handed 0 off to b".into(),
            },
        );
        let svg = t.svg(40_000, "g", &|h| {
            if h.as_str() == "a" {
                "#aaa"
            } else {
                "#bbb"
            }
        });
        assert!(svg.contains(r##"fill="#aaa"><title>0 a</title>"##), "{svg}");
        assert!(svg.contains(r##"fill="#bbb"><title>0 b</title>"##), "{svg}");
        assert!(svg.contains("<title>a handed 0 off to b</title>"), "{svg}");
        t.prune(100_000);
        let svg = t.svg(100_000, "g", &|_| "#bbb");
        assert!(
            !svg.contains("<title>0 a</title>"),
            "a's bar left the window: {svg}"
        );
        assert!(!svg.contains("handed"), "so did the mark: {svg}");
        assert!(svg.contains("<title>0 b</title>"), "b still owns it: {svg}");
    }
}
