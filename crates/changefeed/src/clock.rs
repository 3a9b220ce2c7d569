//! The injectable clock: every read of time in the library goes through [`Clock`].
//!
//! Monotonic time is a [`tokio::time::Instant`], so a test that pauses tokio's clock
//! (`#[tokio::test(start_paused = true)]`) drives every timer and expiry in virtual time.
//! Wall time is only used for `AtTime` positions and for display; the lease protocol never
//! compares wall times of different hosts.

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point on the monotonic clock: tokio's `Instant`, so that paused tokio time (tests, the
/// simulator) is virtual time. Pure code names it through this alias and only does arithmetic
/// with it; it never reads the time.
pub use tokio::time::Instant;

use crate::model::Timestamp;

/// A boxed sleep future.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A source of monotonic and wall time, and of sleeps measured on the same monotonic time.
pub trait Clock: Send + Sync + Debug {
    /// Monotonic now, on this host's clock.
    fn now(&self) -> Instant;
    /// Wall time now, on this host's clock (may disagree with other hosts').
    fn wall(&self) -> Timestamp;
    /// Completes once `duration` has passed on this clock.
    fn sleep(&self, duration: Duration) -> Sleep;
}

/// The real clock: tokio's monotonic time and the system's wall time.
///
/// Under a paused tokio runtime its monotonic time is virtual; its wall time stays real.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_else(|e| -(e.duration().as_millis() as i64));
        Timestamp(ms)
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// A fully virtual clock for tests and the simulator: wall time starts at a chosen instant
/// and advances with tokio's (paused) clock, optionally skewed by a fixed offset and running
/// at a rate other than 1 (clock drift).
#[derive(Debug, Clone)]
pub struct VirtualClock {
    origin: Instant,
    wall_origin: Timestamp,
    skew_ms: i64,
    /// Parts per million faster (+) or slower (−) than tokio's clock.
    drift_ppm: i64,
}

impl VirtualClock {
    /// A clock reading `wall_origin` now, with no skew or drift.
    pub fn new(wall_origin: Timestamp) -> Self {
        Self {
            origin: Instant::now(),
            wall_origin,
            skew_ms: 0,
            drift_ppm: 0,
        }
    }

    /// The same clock with its wall time shifted by `skew_ms` (negative: behind).
    pub fn with_skew(mut self, skew_ms: i64) -> Self {
        self.skew_ms = skew_ms;
        self
    }

    /// The same clock running `drift_ppm` parts per million fast (negative: slow), for both
    /// its monotonic time and its sleeps.
    pub fn with_drift(mut self, drift_ppm: i64) -> Self {
        self.drift_ppm = drift_ppm;
        self
    }

    fn scale(&self, d: Duration) -> Duration {
        let nanos = d.as_nanos() as i128;
        let scaled = nanos + nanos * self.drift_ppm as i128 / 1_000_000;
        Duration::from_nanos(scaled.max(0) as u64)
    }

    fn unscale(&self, d: Duration) -> Duration {
        let nanos = d.as_nanos() as i128;
        let scaled = nanos * 1_000_000 / (1_000_000 + self.drift_ppm as i128).max(1);
        Duration::from_nanos(scaled.max(0) as u64)
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Instant {
        self.origin + self.scale(Instant::now().saturating_duration_since(self.origin))
    }

    fn wall(&self) -> Timestamp {
        let elapsed = self.now().saturating_duration_since(self.origin);
        Timestamp(self.wall_origin.0 + elapsed.as_millis() as i64 + self.skew_ms)
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(self.unscale(duration)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn virtual_clock_follows_paused_tokio_time_with_skew_and_drift() {
        // Time is injectable: a paused runtime moves every clock without real waiting.
        let plain = VirtualClock::new(Timestamp(1_000));
        let skewed = VirtualClock::new(Timestamp(1_000)).with_skew(-600_000);
        let fast = VirtualClock::new(Timestamp(1_000)).with_drift(10_000); // 1% fast
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(plain.wall(), Timestamp(101_000));
        assert_eq!(skewed.wall(), Timestamp(101_000 - 600_000));
        assert_eq!(fast.wall(), Timestamp(102_000));
        let start = fast.now();
        let real_start = Instant::now();
        fast.sleep(Duration::from_secs(101)).await;
        assert!(fast.now() - start >= Duration::from_secs(101));
        assert!(Instant::now() - real_start <= Duration::from_millis(100_001));
    }
}
