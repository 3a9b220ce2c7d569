//! What the console's SVG timeline is drawn with, shared with `changefeed simulate --svg` so
//! that a fleet looks the same in both: the hosts' colours, the ticks, the escaping.

/// The hosts' colours, in order (the simulator's timeline and the live console use the same,
/// so a fleet looks the same in both).
pub const PALETTE: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#86bcb6", "#d37295",
];

/// A round spacing (in seconds) for about a dozen ticks over `total` seconds.
pub fn nice_tick(total: f64) -> f64 {
    for t in [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ] {
        if total / t <= 12.0 {
            return t;
        }
    }
    7200.0
}

/// `s` escaped for SVG text content (not for attributes: quotes are kept).
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
