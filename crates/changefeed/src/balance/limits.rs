//! [`LeaseLimits`]: the fewest and most leases a host should hold under [`super::EqualShare`]
//! (Cosmos's `MinPartitionCount` / `MaxPartitionCount`, KCL's `maxLeasesForWorker`), and
//! [`share`], the quota computation that respects them.
//!
//! Limits are configuration, not state: nothing about them is written to the store. Every host
//! plans for the whole fleet (see [`super::EqualShare`]), so every host must know every host's
//! limits; the processor gives each host the same fleet-wide limits
//! ([`crate::processor::Settings::min_leases`] and [`crate::processor::Settings::max_leases`]).

/// The fewest and most eligible leases one host should hold.
///
/// The default ([`LeaseLimits::NONE`]) limits nothing: no minimum, no maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LeaseLimits {
    min: usize,
    max: Option<usize>,
}

/// Limits that break a rule; the message names the setting and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {rule}")]
#[non_exhaustive]
pub struct LimitsError {
    /// `min_leases` or `max_leases`.
    pub setting: &'static str,
    /// The rule, with the values involved.
    pub rule: String,
}

impl LeaseLimits {
    /// No minimum and no maximum: plans are those of plain equal share.
    pub const NONE: LeaseLimits = LeaseLimits { min: 0, max: None };

    /// At least `min_leases` (0: no minimum) and at most `max_leases` (`None`: no maximum).
    ///
    /// # Errors
    /// [`LimitsError`] if `max_leases` is 0 (a host that may hold nothing would never read;
    /// leave the maximum unset instead) or `min_leases` exceeds `max_leases`.
    pub fn new(min_leases: usize, max_leases: Option<usize>) -> Result<Self, LimitsError> {
        match max_leases {
            Some(0) => Err(LimitsError {
                setting: "max_leases",
                rule: "must be at least 1 (a host that may hold no lease reads nothing; leave \
                       max_leases unset for no maximum)"
                    .into(),
            }),
            Some(max) if min_leases > max => Err(LimitsError {
                setting: "min_leases",
                rule: format!("{min_leases} must not exceed max_leases ({max})"),
            }),
            _ => Ok(Self {
                min: min_leases,
                max: max_leases,
            }),
        }
    }

    /// The minimum (0: none).
    pub fn min_leases(&self) -> usize {
        self.min
    }

    /// The maximum, if any.
    pub fn max_leases(&self) -> Option<usize> {
        self.max
    }

    /// Whether these limits limit nothing.
    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    /// `(min, max)` with no maximum as `usize::MAX`.
    pub(super) fn bounds(&self) -> (usize, usize) {
        (self.min, self.max.unwrap_or(usize::MAX))
    }
}

/// Every host's quota of `eligible` leases within its `bounds` (`(min, max)`, `min <= max`),
/// `rank` listing the hosts (indexes into `bounds`) in the order that breaks ties: the hosts
/// holding most first.
///
/// - If the minimums add up to at least `eligible`, the hosts fill up to their minimum one
///   after another in `rank` order, and the rest get nothing: a host under its minimum is
///   served before anyone gets more.
/// - Else, if the maximums add up to at most `eligible`, every host gets its maximum; the other
///   leases are nobody's.
/// - Else every host gets `clamp(level, min, max)` for the highest `level` whose quotas fit in
///   `eligible`, and the leases left over go one each, in `rank` order, to the hosts whose
///   quota `level + 1` would still fit (at least `min`, below `max`).
///
/// Without limits (every bound `(0, usize::MAX)`) this is plain equal share: `eligible /
/// hosts` each, and one more for the first `eligible % hosts` hosts in `rank` order.
pub(super) fn share(eligible: usize, rank: &[usize], bounds: &[(usize, usize)]) -> Vec<usize> {
    let total = |quota: &dyn Fn(usize, usize) -> usize| {
        bounds
            .iter()
            .map(|&(min, max)| quota(min, max))
            .fold(0usize, usize::saturating_add)
    };
    let mut quota = vec![0usize; bounds.len()];
    if total(&|min, _| min) >= eligible {
        let mut left = eligible;
        for &h in rank {
            quota[h] = bounds[h].0.min(left);
            left -= quota[h];
        }
        return quota;
    }
    if total(&|_, max| max) <= eligible {
        for (q, &(_, max)) in quota.iter_mut().zip(bounds) {
            *q = max;
        }
        return quota;
    }
    // The quotas at `level` add up to `at(level)`, which grows with the level: at(0) = sum(min)
    // fits and at(eligible + 1) does not (it is sum(max), or counts some host's eligible + 1).
    let at = |level: usize| total(&|min, max| level.clamp(min, max));
    let level = if bounds.iter().all(|&b| b == (0, usize::MAX)) {
        // No limits: at(level) is hosts × level, so the highest level that fits is known.
        // (`bounds` is not empty: with no hosts, the minimums or the maximums covered it.)
        eligible / bounds.len()
    } else {
        let (mut fits, mut over) = (0usize, eligible.saturating_add(1));
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if at(mid) <= eligible {
                fits = mid;
            } else {
                over = mid;
            }
        }
        fits
    };
    // Fewer than the hosts that may take one more: at(level + 1) does not fit.
    let mut left = eligible - at(level);
    for (q, &(min, max)) in quota.iter_mut().zip(bounds) {
        *q = level.clamp(min, max);
    }
    for &h in rank {
        if left == 0 {
            break;
        }
        let (min, max) = bounds[h];
        if min <= level && level < max {
            quota[h] += 1;
            left -= 1;
        }
    }
    quota
}
