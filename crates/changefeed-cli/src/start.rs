//! `changefeed run`'s start: opening the lease store and the feed source, retrying the faults
//! that may pass for `start_timeout`, and exiting at once on those that will not.
//!
//! Which faults may pass is the backend's own word, the one place each crate decides it: the
//! `is_retryable` of the core's [`LeaseError`] and [`SourceError`] (which carry what the
//! backend said, e.g. `PostgresError::is_retryable`: connection failures, a name that does not
//! resolve, a refused connection, timeouts, a server starting up or shutting down) and of
//! [`CosmosError`]. Nothing here looks at error texts. An attempt that gets no answer within
//! what is left of `start_timeout` is a transient fault too.
//!
//! - A transient fault is logged, one line naming the URL (never a password), and retried after
//!   a capped exponential backoff (250 ms doubling up to 5 s, ±20 % jitter) until
//!   `start_timeout` has passed; then the host exits with [`TRANSIENT_EXIT`] (75, `EX_TEMPFAIL`).
//!   A `start_timeout` of zero tries once.
//! - A permanent fault (authentication refused, unknown database, tables of a newer schema, a
//!   setting the backend refuses, a file that cannot be opened) exits at once with
//!   [`PERMANENT_EXIT`] (78, `EX_CONFIG`): retrying cannot help, and a supervisor should not
//!   restart the host until its configuration or the server is fixed.
//!
//! Either way the last line on stderr is `error: ` and the error, once, naming the URL.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use changefeed::lease::BackendError as _;
use changefeed::{LeaseError, SourceError};
use changefeed_cosmos::CosmosError;
use rand::Rng as _;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::usage::UsageError;

/// Exit code when a store or source could not be reached within `start_timeout`: transient
/// faults (`EX_TEMPFAIL` of `sysexits.h`). A supervisor may restart the host.
pub const TRANSIENT_EXIT: u8 = 75;

/// Exit code when a store or source refused the host for good at start (`EX_CONFIG` of
/// `sysexits.h`): fix the URL, the credentials or the server before restarting.
pub const PERMANENT_EXIT: u8 = 78;

/// The first wait after a transient fault.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The least time an attempt is given, even at the end of `start_timeout`.
const MIN_ATTEMPT: Duration = Duration::from_secs(1);

/// Why the host could not start.
#[derive(Debug)]
pub enum StartError {
    /// A usage error (exit 2), e.g. a store URL given as a source.
    Usage(anyhow::Error),
    /// Transient faults did not pass within `start_timeout`.
    Unavailable {
        /// The last fault.
        error: anyhow::Error,
        /// How many attempts were made.
        attempts: u32,
        /// How long they took in all.
        took: Duration,
        /// The setting.
        start_timeout: Duration,
    },
    /// A fault retrying cannot fix.
    Refused {
        /// The fault.
        error: anyhow::Error,
        /// What refused: `lease store` or `feed source`.
        what: &'static str,
    },
}

impl StartError {
    /// Prints the one-line error and returns the exit code.
    pub fn exit(self) -> ExitCode {
        match self {
            StartError::Usage(error) => {
                eprintln!("error: {}", crate::error_text(&error));
                ExitCode::from(crate::usage::USAGE_EXIT)
            }
            StartError::Unavailable {
                error,
                attempts,
                took,
                start_timeout,
            } => {
                let text = crate::error_text(&error);
                tracing::error!(error = %text, attempts, "could not start: still failing after start_timeout");
                eprintln!(
                    "error: {text} (still failing after {attempts} attempt{} in {:.1?}; start_timeout {start_timeout:?})",
                    if attempts == 1 { "" } else { "s" },
                    Duration::from_millis(took.as_millis() as u64),
                );
                ExitCode::from(TRANSIENT_EXIT)
            }
            StartError::Refused { error, what } => {
                let text = crate::error_text(&error);
                tracing::error!(error = %text, "could not start: the {what} refused the host");
                eprintln!("error: {text} (not retried: the {what} refused it; fix the URL, the credentials or the server)");
                ExitCode::from(PERMANENT_EXIT)
            }
        }
    }
}

/// Whether `err` may pass if tried again, as the backend classified it.
pub fn is_transient(err: &anyhow::Error) -> bool {
    for link in err.chain() {
        if let Some(e) = link.downcast_ref::<LeaseError>() {
            return e.is_retryable();
        }
        if let Some(e) = link.downcast_ref::<SourceError>() {
            return e.is_retryable();
        }
        if let Some(e) = link.downcast_ref::<CosmosError>() {
            return e.is_retryable();
        }
        if link.is::<NoAnswer>() {
            return true;
        }
    }
    false
}

/// An attempt that got no answer within the time left of `start_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no answer within {0:?}")]
struct NoAnswer(Duration);

/// The start window: when it began and how long transient faults are retried.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    began: Instant,
    timeout: Duration,
}

impl Window {
    /// A window of `timeout` from now.
    pub fn new(timeout: Duration) -> Self {
        Self {
            began: Instant::now(),
            timeout,
        }
    }

    fn left(&self) -> Duration {
        (self.began + self.timeout).saturating_duration_since(Instant::now())
    }
}

/// Opens `what` (`lease store` or `feed source`) at `url` (printable: no password) with
/// `open`, retrying transient faults within `window`.
///
/// # Errors
/// [`StartError`]: a usage error, transient faults that outlasted the window, or a fault
/// retrying cannot fix.
pub async fn open<T, F, Fut>(
    what: &'static str,
    url: &str,
    window: Window,
    mut open: F,
) -> Result<T, StartError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let result =
            if window.timeout.is_zero() {
                // One attempt, bounded by the backend's own timeouts.
                open().await
            } else {
                let bound = window.left().max(MIN_ATTEMPT);
                match tokio::time::timeout(bound, open()).await {
                    Ok(result) => result,
                    Err(_) => Err(anyhow::Error::new(NoAnswer(bound))
                        .context(format!("opening {what} {url}"))),
                }
            };
        let error = match result {
            Ok(opened) => {
                if attempts > 1 {
                    info!(%url, attempts, "{what} reachable; starting");
                }
                return Ok(opened);
            }
            Err(error) => error,
        };
        if error.downcast_ref::<UsageError>().is_some() {
            return Err(StartError::Usage(error));
        }
        if !is_transient(&error) {
            return Err(StartError::Refused { error, what });
        }
        let left = window.left();
        if left.is_zero() {
            return Err(StartError::Unavailable {
                error,
                attempts,
                took: window.began.elapsed(),
                start_timeout: window.timeout,
            });
        }
        let jitter = rand::thread_rng().gen_range(0.8..1.2);
        let wait = backoff.mul_f64(jitter).min(left);
        warn!(
            %url,
            attempt = attempts,
            retry_in = ?Duration::from_millis(wait.as_millis() as u64),
            start_timeout_left = ?Duration::from_millis(left.as_millis() as u64),
            error = %crate::error_text(&error),
            "{what} unavailable at start; retrying"
        );
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(retryable: bool) -> anyhow::Error {
        anyhow::Error::new(LeaseError::store(
            "connect",
            None,
            retryable,
            std::io::Error::other("boom"),
        ))
        .context("opening lease store x")
    }

    #[test]
    fn the_backend_decides_what_is_transient() {
        assert!(is_transient(&lease(true)));
        assert!(!is_transient(&lease(false)));
        let source = anyhow::Error::new(SourceError::source(
            "connect",
            None,
            true,
            std::io::Error::other("boom"),
        ));
        assert!(is_transient(&source));
        assert!(is_transient(&anyhow::Error::new(NoAnswer(MIN_ATTEMPT))));
        // Nothing a backend classified: not retried.
        assert!(!is_transient(&anyhow::anyhow!("something else")));
    }

    #[tokio::test(start_paused = true)]
    async fn transient_faults_are_retried_with_growing_waits_until_the_window_closes() {
        let window = Window::new(Duration::from_secs(10));
        let mut tries = Vec::new();
        let err = open("lease store", "x://", window, || {
            tries.push(Instant::now());
            async { Err::<(), _>(lease(true)) }
        })
        .await
        .expect_err("never opens");
        let StartError::Unavailable { attempts, took, .. } = err else {
            panic!("transient: {err:?}");
        };
        assert_eq!(attempts as usize, tries.len());
        assert!(
            took >= Duration::from_secs(10) && took < Duration::from_secs(11),
            "{took:?}"
        );
        let waits: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(waits[0] >= Duration::from_millis(200), "{waits:?}");
        assert!(waits[1] > waits[0], "growing: {waits:?}");
        assert!(
            waits.iter().all(|w| *w <= MAX_BACKOFF.mul_f64(1.2)),
            "capped: {waits:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_fault_or_a_zero_window_fails_at_once_and_success_ends_the_retries() {
        let mut n = 0;
        let err = open(
            "lease store",
            "x://",
            Window::new(Duration::from_secs(60)),
            || {
                n += 1;
                async { Err::<(), _>(lease(false)) }
            },
        )
        .await
        .expect_err("refused");
        assert!(matches!(err, StartError::Refused { .. }), "{err:?}");
        assert_eq!(n, 1);
        let mut n = 0;
        let err = open("lease store", "x://", Window::new(Duration::ZERO), || {
            n += 1;
            async { Err::<(), _>(lease(true)) }
        })
        .await
        .expect_err("no retries");
        assert!(
            matches!(err, StartError::Unavailable { attempts: 1, .. }),
            "{err:?}"
        );
        assert_eq!(n, 1);
        let mut n = 0;
        let opened = open(
            "lease store",
            "x://",
            Window::new(Duration::from_secs(60)),
            || {
                n += 1;
                let now = n;
                async move {
                    if now < 3 {
                        Err(lease(true))
                    } else {
                        Ok(now)
                    }
                }
            },
        )
        .await
        .expect("opens on the third attempt");
        assert_eq!(opened, 3);
    }
}
