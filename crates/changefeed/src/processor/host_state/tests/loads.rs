//! What a host planning by load knows of when each lease last moved.

use super::*;
use crate::processor::host_state::loads::LoadView;

/// A lease seen in another host's hands after a long gap moved no earlier than the last look
/// before it: dated then, not when seen, so that a host back from a cut-off does not hold
/// every lease that changed hands meanwhile for a whole dwell.
#[test]
fn a_change_seen_late_is_dated_at_the_last_look_before_it() {
    let origin = t0();
    let at = |s: u64| origin + Duration::from_secs(s);
    let mut loads = LoadView::new(origin);
    let first = table(
        "c",
        vec![row("0", Some("a"), None, 1), row("1", Some("a"), None, 1)],
    );
    assert!(loads.maps(&first, at(10)).input().moved_at.is_empty());
    // Cut off from 10 s to 50 s; meanwhile lease 0 went to b.
    let later = table(
        "c",
        vec![row("0", Some("b"), None, 2), row("1", Some("a"), None, 1)],
    );
    let maps = loads.maps(&later, at(50));
    let moved = maps.input().moved_at;
    assert_eq!(moved.get(&p("0")), Some(&Duration::from_secs(10)));
    assert_eq!(moved.get(&p("1")), None);
    // Seen at the next look, a change is dated within one look of it.
    let again = table(
        "c",
        vec![row("0", Some("b"), None, 2), row("1", Some("b"), None, 2)],
    );
    let maps = loads.maps(&again, at(52));
    assert_eq!(
        maps.input().moved_at.get(&p("1")),
        Some(&Duration::from_secs(50))
    );
}
