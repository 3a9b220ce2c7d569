//! The processor's one retry policy: how long it waits between attempts, and, for each
//! operation it retries, when it gives up. The workers retry all of them but the last, which
//! the host's stop retries.
//!
//! Every wait is `min_backoff × 2ⁿ` (n the attempt, from 0, capped at 20), at most
//! `max_backoff`, scaled by a jitter in [½, 1] drawn from the worker's seeded RNG, and slept on
//! the injected clock, so the simulator replays it exactly. Only the give-up rule differs:
//!
//! | operation | gives up | and then |
//! |---|---|---|
//! | [`Policy::OPEN_READER`] | on a final source error | releases the lease with its checkpoint unchanged (`SourceFailed`) |
//! | [`Policy::open_handler`] | after `handler_max_retries` retries | releases the lease (`HandlerFailed`) |
//! | [`Policy::READ_LEASE`] | never | — |
//! | [`Policy::READ_BATCH`] | on a final source error | releases the lease at its checkpoint (`SourceFailed`) |
//! | [`Policy::handler_call`] | after `handler_max_retries` retries on this host | releases the lease at its checkpoint (`HandlerFailed`) |
//! | [`Policy::CHECKPOINT`] | on a final store error, or once fenced | stops (`LeaseLost`) |
//! | [`Policy::FINISH`] | on a final store error, or once fenced | stops (`LeaseLost`) |
//! | [`Policy::RELEASE`] | on a final store error, once fenced, or after 2 retries | stops (`LeaseLost`), or leaves the lease to expire |
//! | [`Policy::REMOVE_HEARTBEAT`] | on a final store error, or after 4 retries (or at `shutdown_timeout`) | leaves the heartbeat row to expire |
//!
//! A stop or the fence cuts every wait short (the worker then stops), except a release's:
//! releasing is how a stop ends. A final error is one its seam's `is_retryable` (the one place
//! that decides) calls not worth retrying; a handler's errors are all retried.

use std::time::Duration;

use rand::Rng;

use crate::processor::config::Settings;

/// The waits between attempts: exponential from `min_backoff` to `max_backoff`, jittered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Backoff {
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub(super) fn new(settings: &Settings) -> Self {
        Self {
            min: settings.min_backoff,
            max: settings.max_backoff,
        }
    }

    /// The wait before retry `attempt` (0 after the first failure): `min × 2^attempt` up to
    /// `max`, times a jitter in [½, 1] from `rng`.
    pub(super) fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let base = self
            .min
            .saturating_mul(2u32.saturating_pow(attempt.min(20)))
            .min(self.max);
        base.mul_f64(rng.gen_range(0.5..=1.0))
    }
}

/// When retrying ends: any one condition that holds ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GiveUp {
    /// On an error its seam calls final.
    final_error: bool,
    /// Once the host is fenced (the operation writes the lease, which a fenced host must not).
    fenced: bool,
    /// After this many retries: the attempt after the last retry failed.
    after_retries: Option<u32>,
}

/// Why an operation is no longer retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GaveUp {
    /// The error was final.
    FinalError,
    /// The host is fenced.
    Fenced,
    /// The retries ran out.
    OutOfRetries,
}

/// What the worker retries and when it gives up; see the module doc for the whole list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Policy {
    /// What is retried, for logs.
    what: &'static str,
    give_up: GiveUp,
    /// Whether a stop or the fence ends a wait between attempts.
    stop_ends_wait: bool,
}

impl Policy {
    const fn retry_forever(what: &'static str) -> Self {
        Self {
            what,
            give_up: GiveUp {
                final_error: false,
                fenced: false,
                after_retries: None,
            },
            stop_ends_wait: true,
        }
    }

    const fn unless_final(mut self) -> Self {
        self.give_up.final_error = true;
        self
    }

    const fn unless_fenced(mut self) -> Self {
        self.give_up.fenced = true;
        self
    }

    const fn at_most(mut self, retries: u32) -> Self {
        self.give_up.after_retries = Some(retries);
        self
    }

    /// Opening the partition's reader: retryable source errors until stopped or fenced; a
    /// final one (an unknown continuation or partition) gives up.
    pub(super) const OPEN_READER: Self =
        Self::retry_forever("opening the partition").unless_final();

    /// Reading the lease row before a delivery when nothing else confirmed it lately: every
    /// store error, until stopped or fenced; nothing is delivered until a read succeeds.
    pub(super) const READ_LEASE: Self = Self::retry_forever("reading the lease");

    /// Reading the next batch: retryable source errors until stopped or fenced; a final one
    /// gives up.
    pub(super) const READ_BATCH: Self = Self::retry_forever("reading the partition").unless_final();

    /// Writing a checkpoint: retryable store errors while the host is not fenced.
    pub(super) const CHECKPOINT: Self = Self::retry_forever("writing the checkpoint")
        .unless_final()
        .unless_fenced();

    /// Marking the lease finished at the end of its partition: as a checkpoint.
    pub(super) const FINISH: Self = Self::retry_forever("marking the lease finished")
        .unless_final()
        .unless_fenced();

    /// Releasing the lease (on a stop, a hand-off or a failure): retryable store errors while
    /// not fenced, three attempts in all; a stop does not cut its waits short, since a stop is
    /// what it finishes. A lease not released expires with this host.
    pub(super) const RELEASE: Self = Self {
        stop_ends_wait: false,
        ..Self::retry_forever("releasing the lease")
            .unless_final()
            .unless_fenced()
            .at_most(2)
    };

    /// Removing the host's heartbeat row as it stops: retryable store errors, five attempts in
    /// all (a conflict with a renewal of this incarnation is not a failure: the removal goes
    /// on at the version the store reports). The stop's own deadline bounds it too.
    pub(super) const REMOVE_HEARTBEAT: Self = Self {
        stop_ends_wait: false,
        ..Self::retry_forever("removing the heartbeat row")
            .unless_final()
            .at_most(4)
    };

    /// Opening the handler for the partition: every error, `max_retries` times.
    pub(super) const fn open_handler(max_retries: u32) -> Self {
        Self::retry_forever("opening the handler").at_most(max_retries)
    }

    /// Calling the handler with a batch: every error (a timeout too), `max_retries` times on
    /// this host. The backoff goes on from the failures of earlier owners (see
    /// [`Retry::carrying`]), and the batch may go to the dead-letter sink before it gives up.
    pub(super) const fn handler_call(max_retries: u32) -> Self {
        Self::retry_forever("the handler call").at_most(max_retries)
    }

    /// What is retried.
    pub(super) fn what(&self) -> &'static str {
        self.what
    }

    /// Whether a stop or the fence ends a wait between attempts.
    pub(super) fn stop_ends_wait(&self) -> bool {
        self.stop_ends_wait
    }
}

/// One retried operation in progress: its policy and its failures so far.
#[derive(Debug, Clone)]
pub(super) struct Retry {
    policy: Policy,
    /// Failures before this worker's first attempt, by earlier owners.
    carried: u32,
    /// Failures of this worker's attempts.
    failed: u32,
}

impl Retry {
    pub(super) fn new(policy: Policy) -> Self {
        Self::carrying(policy, 0)
    }

    /// Goes on with something earlier owners already failed `carried` times: the backoff
    /// starts where theirs ended, while only this worker's failures count towards giving up.
    pub(super) fn carrying(policy: Policy, carried: u32) -> Self {
        Self {
            policy,
            carried,
            failed: 0,
        }
    }

    pub(super) fn policy(&self) -> Policy {
        self.policy
    }

    /// The backoff attempt to wait out before this worker's first attempt: earlier owners'
    /// last, if they failed.
    pub(super) fn carried_attempt(&self) -> Option<u32> {
        self.carried.checked_sub(1)
    }

    /// Counts a failed attempt and says what follows: the backoff attempt to wait out before
    /// the next one, or why there is none. `retryable` is what the error's seam says of it;
    /// `fenced` is asked only if the policy gives up when fenced.
    pub(super) fn failed(
        &mut self,
        retryable: bool,
        fenced: impl FnOnce() -> bool,
    ) -> Result<u32, GaveUp> {
        self.failed = self.failed.saturating_add(1);
        let give_up = self.policy.give_up;
        if give_up.final_error && !retryable {
            return Err(GaveUp::FinalError);
        }
        if give_up.fenced && fenced() {
            return Err(GaveUp::Fenced);
        }
        if give_up.after_retries.is_some_and(|n| self.failed > n) {
            return Err(GaveUp::OutOfRetries);
        }
        Ok(self.carried.saturating_add(self.failed - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn backoff() -> Backoff {
        Backoff {
            min: Duration::from_millis(100),
            max: Duration::from_secs(10),
        }
    }

    /// Waits double from `min_backoff`, stop at `max_backoff`, and keep at least half of that.
    #[test]
    fn backoff_doubles_up_to_the_maximum_with_jitter_of_at_most_half() {
        let mut rng = SmallRng::seed_from_u64(1);
        for (attempt, base_ms) in [(0, 100), (1, 200), (3, 800), (6, 6400), (7, 10_000)] {
            for _ in 0..50 {
                let d = backoff().delay(attempt, &mut rng);
                let base = Duration::from_millis(base_ms);
                assert!(d <= base && d >= base / 2, "attempt {attempt}: {d:?}");
            }
        }
        // Far past the cap, the exponent saturates instead of overflowing.
        assert!(backoff().delay(u32::MAX, &mut rng) <= Duration::from_secs(10));
    }

    /// The same seed gives the same waits: the simulator replays them.
    #[test]
    fn backoff_is_determined_by_the_rng() {
        let a: Vec<_> = {
            let mut rng = SmallRng::seed_from_u64(9);
            (0..8).map(|n| backoff().delay(n, &mut rng)).collect()
        };
        let mut rng = SmallRng::seed_from_u64(9);
        let b: Vec<_> = (0..8).map(|n| backoff().delay(n, &mut rng)).collect();
        assert_eq!(a, b);
    }

    /// A policy that never gives up retries forever, even a final error, counting up.
    #[test]
    fn reading_the_lease_never_gives_up() {
        let mut r = Retry::new(Policy::READ_LEASE);
        for n in 0..100 {
            assert_eq!(r.failed(false, || true), Ok(n));
        }
    }

    /// Source reads give up on a final error and retry a retryable one.
    #[test]
    fn reads_give_up_only_on_a_final_error() {
        for policy in [Policy::OPEN_READER, Policy::READ_BATCH] {
            let mut r = Retry::new(policy);
            assert_eq!(r.failed(true, || true), Ok(0));
            assert_eq!(r.failed(true, || true), Ok(1));
            assert_eq!(r.failed(false, || false), Err(GaveUp::FinalError));
        }
    }

    /// Lease writes give up on a final error or once fenced, whichever comes first.
    #[test]
    fn lease_writes_give_up_on_a_final_error_or_the_fence() {
        for policy in [Policy::CHECKPOINT, Policy::FINISH, Policy::RELEASE] {
            let mut r = Retry::new(policy);
            assert_eq!(r.failed(true, || false), Ok(0));
            assert_eq!(r.failed(true, || true), Err(GaveUp::Fenced));
            let mut r = Retry::new(policy);
            assert_eq!(
                r.failed(false, || panic!("not asked after a final error")),
                Err(GaveUp::FinalError)
            );
        }
        assert!(Policy::CHECKPOINT.stop_ends_wait());
        assert!(!Policy::RELEASE.stop_ends_wait());
    }

    /// A release makes three attempts in all.
    #[test]
    fn release_gives_up_after_three_attempts() {
        let mut r = Retry::new(Policy::RELEASE);
        assert_eq!(r.failed(true, || false), Ok(0));
        assert_eq!(r.failed(true, || false), Ok(1));
        assert_eq!(r.failed(true, || false), Err(GaveUp::OutOfRetries));
    }

    /// `handler_max_retries` retries: the call after the last retry is the last call.
    #[test]
    fn handler_gives_up_after_its_retries() {
        for policy in [Policy::handler_call(2), Policy::open_handler(2)] {
            let mut r = Retry::new(policy);
            assert_eq!(r.failed(true, || true), Ok(0));
            assert_eq!(r.failed(true, || true), Ok(1));
            assert_eq!(r.failed(true, || true), Err(GaveUp::OutOfRetries));
        }
        let mut r = Retry::new(Policy::handler_call(0));
        assert_eq!(r.failed(true, || false), Err(GaveUp::OutOfRetries));
    }

    /// A batch earlier owners failed backs off from where they left, but this host still gets
    /// its own retries.
    #[test]
    fn carried_failures_move_the_backoff_not_the_limit() {
        let mut r = Retry::carrying(Policy::handler_call(1), 4);
        assert_eq!(r.carried_attempt(), Some(3));
        assert_eq!(r.failed(true, || false), Ok(4));
        assert_eq!(r.failed(true, || false), Err(GaveUp::OutOfRetries));
        assert_eq!(Retry::new(Policy::handler_call(1)).carried_attempt(), None);
    }
}
