//! The slicing steps of [`EqualShare`]'s plan: which free leases, donors' leases and excess
//! fall to this host, each chosen in a stable order without sorting every lease.
//!
//! [`EqualShare`]: super::EqualShare

use std::cmp::{Ordering, Reverse};

use super::super::LeaseView;
use super::{Fleet, Shares};

/// Step 2b for the whole fleet: `free` leases, in partition order, go to the hosts under quota
/// in name order, each taking its shortfall; `need` drops by what each gets. Returns where
/// `me`'s slice starts in that order and how long it is.
pub(super) fn free_slice(need: &mut [usize], free: usize, me: usize) -> (usize, usize) {
    let mut before = 0usize; // free leases handed to hosts before the current one
    let mut mine = (0, 0);
    for (h, n) in need.iter_mut().enumerate() {
        let got = (*n).min(free.saturating_sub(before));
        if h == me {
            mine = (before, got);
        }
        before += got;
        *n -= got;
    }
    mine
}

/// The hosts over quota with how many leases each gives (its excess, at most what it holds
/// unasked), the most first, ties by name.
pub(super) fn donors(shares: &Shares) -> Vec<(usize, usize)> {
    let mut donors: Vec<(usize, usize)> = (0..shares.quota.len())
        .map(|h| {
            let excess = shares.effective[h].saturating_sub(shares.quota[h]);
            (h, excess.min(shares.requestable[h]))
        })
        .filter(|&(_, give)| give > 0)
        .collect();
    donors.sort_unstable_by_key(|&(h, give)| (Reverse(give), h));
    donors
}

/// Step 3 for `me`: hosts under quota, in name order, draw their remaining `need` from the
/// `donors` in order. Returns `me`'s draws: (donor, offset into the donor's leases in hand-off
/// order, count).
pub(super) fn draws(
    need: &[usize],
    donors: &[(usize, usize)],
    me: usize,
) -> Vec<(usize, usize, usize)> {
    let mut draws = Vec::new();
    let (mut d, mut offset) = (0usize, 0usize);
    'askers: for (asker, &want) in need.iter().enumerate() {
        let mut want = want;
        while want > 0 {
            let Some(&(donor, give)) = donors.get(d) else {
                break 'askers;
            };
            let n = want.min(give - offset);
            if asker == me {
                draws.push((donor, offset, n));
            }
            want -= n;
            offset += n;
            if offset == give {
                d += 1;
                offset = 0;
            }
        }
        if asker == me {
            break;
        }
    }
    draws
}

/// Step 4 for `me`: above its maximum, the range of its unasked leases, in hand-off order, to
/// release. The askers draw from the donors in order, so they draw the first `drawn` of this
/// host's leases; the release takes the next ones, and the plans stay disjoint. `None` when
/// `me` is not above its maximum.
pub(super) fn release_range(
    me: usize,
    shares: &Shares,
    fleet: &Fleet<'_>,
    need: &[usize],
    donors: &[(usize, usize)],
) -> Option<(usize, usize)> {
    let over = shares.effective[me].saturating_sub(fleet.bounds[me].1);
    if over == 0 {
        return None;
    }
    let wanted: usize = need.iter().sum();
    let before: usize = donors
        .iter()
        .take_while(|&&(h, _)| h != me)
        .map(|&(_, give)| give)
        .sum();
    let give = donors
        .iter()
        .find(|&&(h, _)| h == me)
        .map_or(0, |&(_, give)| give);
    let drawn = wanted.saturating_sub(before).min(give);
    Some((drawn, drawn + over.saturating_sub(drawn)))
}

/// The order in which an over-quota host's leases are asked for (and, above its maximum,
/// released): stale requests first (they would otherwise move twice), then by partition.
pub(super) fn by_handoff_order(leases: &[LeaseView<'_>], x: usize, y: usize) -> Ordering {
    let unasked = |i: usize| leases[i].lease.next_owner.is_none();
    unasked(x)
        .cmp(&unasked(y))
        .then_with(|| by_partition(leases, x, y))
}

/// Orders leases by partition id, then by position in the snapshot (a total order even if a
/// snapshot repeats a partition).
pub(super) fn by_partition(leases: &[LeaseView<'_>], x: usize, y: usize) -> Ordering {
    leases[x]
        .lease
        .key
        .partition
        .cmp(&leases[y].lease.key.partition)
        .then(x.cmp(&y))
}

/// Rearranges `items` so that `items[from..to]` holds, sorted, the elements that would be at
/// those positions if all of `items` were sorted by `cmp`, and returns that slice. Expected
/// O(len + k log k): the rest is never fully sorted.
pub(super) fn select_range<T>(
    items: &mut [T],
    from: usize,
    to: usize,
    mut cmp: impl FnMut(&T, &T) -> Ordering,
) -> &[T] {
    let to = to.min(items.len());
    let from = from.min(to);
    if from == to {
        return &[];
    }
    if from > 0 {
        items.select_nth_unstable_by(from, &mut cmp);
    }
    let tail = &mut items[from..];
    if to - from < tail.len() {
        tail.select_nth_unstable_by(to - from, &mut cmp);
    }
    let range = &mut items[from..to];
    range.sort_unstable_by(&mut cmp);
    range
}
