//! Shared AWS SDK configuration for the changefeed AWS backends (`changefeed-dynamodb`,
//! `changefeed-kinesis`), so both build their clients the same way.
//!
//! # Timeouts and recovery
//!
//! Every client built here has bounded waits, so that a host cut off from AWS by a silent
//! network fault (packets dropped, nothing reset) gets an error it can act on instead of a call
//! that never returns, and talks again soon after the path is back:
//!
//! | setting | [`Timeouts::DYNAMODB`] | [`Timeouts::KINESIS`] | what it bounds |
//! |---|---|---|---|
//! | `connect` | 1 s | 1 s | opening a connection (TCP and TLS): the SDK's `connect_timeout` |
//! | `request` | 1 s | 5 s | one attempt of a call, from sending it to its last byte: the SDK's `operation_attempt_timeout` and `read_timeout` |
//! | `max_attempts` | 3 | 3 | attempts of one call (timeouts, connection errors, throttling and 5xx are retried) |
//! | backoff | 50 ms doubling to 1 s, full jitter | same | the wait between attempts |
//! | operation | 5 s | 17 s | one call, all attempts and waits: [`Timeouts::operation`] (the SDK's `operation_timeout`) |
//! | `pool_idle` | 5 s | 5 s | how long an idle pooled connection is kept |
//!
//! A failed or timed-out call is an SDK error (`TimeoutError` or `DispatchFailure`), which the lease store and the feed source report as such.
//!
//! - **No connection outlives a failed request.** The HTTP client is hyper-util's legacy
//!   client (HTTP/1.1 pool). A request that times out or is cancelled drops its pooled
//!   connection while the request is in flight; hyper (1.12, hyper-util 0.1.21: `Pooled`'s
//!   `Drop` returns a connection to the pool only when it `is_open()`, which for HTTP/1 means
//!   the dispatcher is waiting for a new request, never while one is in flight; and the
//!   dispatcher closes the connection once the caller of the request in flight is gone)
//!   never hands it out again. The SDK also poisons the connection of an attempt that failed
//!   with a transient error (`ReconnectMode::ReconnectOnTransientError`), and a connection the
//!   server reset is dropped from the pool when it is next checked out.
//! - **Idle connections do not outlive a fault for long.** A pooled connection idle for
//!   `pool_idle` is closed (and never checked out after that), so once the path is back after
//!   a fault longer than `pool_idle`, every call opens a new connection: none is sent on a flow
//!   a NAT or load balancer forgot during the fault. (TCP keepalive cannot be set: the SDK's
//!   HTTP client builder of `aws-smithy-http-client` 1.5 has no such setting.)
//! - **Recovery.** With the processor's defaults (`renew_interval` 2 s, a heartbeat write
//!   abandoned after `min(safety_margin, renew_interval)` = 2 s), a host heartbeats again within
//!   `renew_interval + connect` (3 s) after the path is back: the write in flight then is either
//!   answered (its bytes were only held) or abandoned by its 1 s attempt timeout and sent again
//!   on a new connection within the same heartbeat.
//!
//! [`AwsOptions::connect_timeout`] and [`AwsOptions::request_timeout`] override the first two
//! (the CLI's `?connect_timeout=` and `?request_timeout=`).
#![warn(missing_docs)]

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::Credentials;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};

/// How long the parts of an AWS call may take, and how a call is retried; see the crate docs.
/// Each backend has its defaults ([`Timeouts::DYNAMODB`], [`Timeouts::KINESIS`]);
/// [`AwsOptions`] overrides `connect` and `request`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Opening a connection, TCP and TLS (the SDK's `connect_timeout`).
    pub connect: Duration,
    /// One attempt of a call, from sending it until its answer is read (the SDK's
    /// `operation_attempt_timeout`; also its `read_timeout`, the wait for the answer's head).
    pub request: Duration,
    /// Attempts of one call, the first included (at least 1).
    pub max_attempts: u32,
    /// The first wait before another attempt (full jitter: a random wait up to it); doubles
    /// with each attempt, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The longest wait before another attempt.
    pub max_backoff: Duration,
    /// How long an idle pooled connection is kept before it is closed.
    pub pool_idle: Duration,
}

impl Timeouts {
    /// The DynamoDB lease store's: DynamoDB answers in milliseconds, and a heartbeat write is
    /// abandoned after 2 s by default, so one attempt gets 1 s and a second fits in a
    /// heartbeat.
    pub const DYNAMODB: Timeouts = Timeouts {
        connect: Duration::from_secs(1),
        request: Duration::from_secs(1),
        max_attempts: 3,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(1),
        pool_idle: Duration::from_secs(5),
    };

    /// The Kinesis source's: a `GetRecords` answer may hold up to 10 MB, so one attempt gets
    /// 5 s.
    pub const KINESIS: Timeouts = Timeouts {
        connect: Duration::from_secs(1),
        request: Duration::from_secs(5),
        max_attempts: 3,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(1),
        pool_idle: Duration::from_secs(5),
    };

    /// The longest one call may take, every attempt and wait included: `max_attempts ×
    /// request + (max_attempts − 1) × max_backoff` (the SDK's `operation_timeout`).
    pub fn operation(&self) -> Duration {
        let attempts = self.max_attempts.max(1);
        self.request.saturating_mul(attempts) + self.max_backoff.saturating_mul(attempts - 1)
    }

    /// The SDK's timeout configuration for these timeouts.
    pub fn timeout_config(&self) -> TimeoutConfig {
        TimeoutConfig::builder()
            .connect_timeout(positive(self.connect))
            .read_timeout(positive(self.request))
            .operation_attempt_timeout(positive(self.request))
            .operation_timeout(positive(self.operation()))
            .build()
    }

    /// The SDK's retry configuration for these timeouts (standard mode).
    pub fn retry_config(&self) -> RetryConfig {
        RetryConfig::standard()
            .with_max_attempts(self.max_attempts.max(1))
            .with_initial_backoff(self.initial_backoff)
            .with_max_backoff(self.max_backoff)
    }
}

impl Default for Timeouts {
    /// [`Timeouts::DYNAMODB`].
    fn default() -> Self {
        Timeouts::DYNAMODB
    }
}

/// A zero duration would time everything out at once: at least a millisecond.
fn positive(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

/// Where and as whom to connect, and the timeouts to override. Every field left `None` comes
/// from the standard AWS configuration chain (environment, profile files, SSO, container and
/// instance metadata), or for the timeouts from the backend's [`Timeouts`].
#[derive(Clone, Debug, Default)]
pub struct AwsOptions {
    /// An endpoint URL overriding the region's (DynamoDB Local: `http://127.0.0.1:8000`, kinesis-mock: `http://127.0.0.1:4568`).
    pub endpoint_url: Option<String>,
    /// The region, overriding the chain's.
    pub region: Option<String>,
    /// Static credentials `(access key id, secret key)`, overriding the chain's (for local
    /// servers, which accept any).
    pub static_credentials: Option<(String, String)>,
    /// [`Timeouts::connect`], overriding the backend's default.
    pub connect_timeout: Option<Duration>,
    /// [`Timeouts::request`], overriding the backend's default.
    pub request_timeout: Option<Duration>,
}

impl AwsOptions {
    /// Options for a local server at `endpoint_url`: region `us-east-1` and the static test
    /// credentials `test`/`test`. With both given, the SDK's credential and region chains
    /// are not consulted, so nothing asks the EC2 instance-metadata address: what tests against
    /// DynamoDB Local and kinesis-mock use, so that they never leave the machine.
    pub fn local(endpoint_url: impl Into<String>) -> Self {
        Self {
            endpoint_url: Some(endpoint_url.into()),
            region: Some("us-east-1".into()),
            static_credentials: Some(("test".into(), "test".into())),
            ..Self::default()
        }
    }

    /// These options with [`AwsOptions::connect_timeout`] set.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// These options with [`AwsOptions::request_timeout`] set.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    /// `defaults` with this handle's overrides.
    pub fn timeouts(&self, defaults: Timeouts) -> Timeouts {
        Timeouts {
            connect: self.connect_timeout.unwrap_or(defaults.connect),
            request: self.request_timeout.unwrap_or(defaults.request),
            ..defaults
        }
    }

    /// Loads the SDK configuration with [`Timeouts::default`]: see [`AwsOptions::load_with`].
    pub async fn load(&self) -> SdkConfig {
        self.load_with(Timeouts::default()).await
    }

    /// Loads the SDK configuration: the standard chain with these overrides, over an HTTPS
    /// client using rustls with the ring crypto provider, with `defaults` (less what these
    /// options override) as its timeouts, retries and idle connection lifetime.
    pub async fn load_with(&self, defaults: Timeouts) -> SdkConfig {
        let timeouts = self.timeouts(defaults);
        // hyper-util's legacy pool (HTTP/1.1) under the SDK: a connection whose request was
        // cancelled or timed out is never reused (see the crate docs), and an idle one is
        // closed after `pool_idle`.
        let http = aws_smithy_http_client::Builder::new()
            .pool_idle_timeout(positive(timeouts.pool_idle))
            .tls_provider(Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .timeout_config(timeouts.timeout_config())
            .retry_config(timeouts.retry_config());
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let Some(region) = &self.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some((id, secret)) = &self.static_credentials {
            loader = loader.credentials_provider(Credentials::new(
                id.clone(),
                secret.clone(),
                None,
                None,
                "changefeed-static",
            ));
        }
        loader.load().await
    }
}

/// Longest piece of one cause kept by [`summary`]: some SDK messages embed a `Debug` dump of the
/// whole request.
const MAX_CAUSE: usize = 400;

/// An SDK error in words: its message and each cause's, joined by `: `, each cause once (the
/// SDK's messages often repeat their cause), and none of the `Debug` dumps that the SDK's
/// `DisplayErrorContext` appends. For example `dispatch failure: io error: client error
/// (Connect): tcp connect error: Connection refused (os error 111)`.
pub fn summary(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut link = Some(err);
    while let Some(e) = link {
        let full = e.to_string();
        let full = full.trim();
        let (text, cut) = match full.char_indices().nth(MAX_CAUSE) {
            Some((i, _)) => (&full[..i], true),
            None => (full, false),
        };
        if !text.is_empty() && !out.contains(text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(text);
            if cut {
                out.push('…');
            }
        }
        link = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Link(&'static str, Option<Box<Link>>);

    impl std::fmt::Display for Link {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Link {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn an_operation_is_bounded_by_its_attempts_and_waits_and_options_override_the_defaults() {
        // Every wait of a call is bounded: 3 attempts of 1 s and two waits of at most 1 s.
        assert_eq!(Timeouts::DYNAMODB.operation(), Duration::from_secs(5));
        assert_eq!(Timeouts::KINESIS.operation(), Duration::from_secs(17));
        let config = Timeouts::DYNAMODB.timeout_config();
        assert_eq!(config.connect_timeout(), Some(Duration::from_secs(1)));
        assert_eq!(config.read_timeout(), Some(Duration::from_secs(1)));
        assert_eq!(
            config.operation_attempt_timeout(),
            Some(Duration::from_secs(1))
        );
        assert_eq!(config.operation_timeout(), Some(Duration::from_secs(5)));
        assert_eq!(Timeouts::DYNAMODB.retry_config().max_attempts(), 3);
        let options = AwsOptions::local("http://127.0.0.1:8000")
            .with_connect_timeout(Duration::from_millis(300))
            .with_request_timeout(Duration::from_secs(4));
        let t = options.timeouts(Timeouts::KINESIS);
        assert_eq!(
            (t.connect, t.request, t.max_attempts),
            (Duration::from_millis(300), Duration::from_secs(4), 3)
        );
        assert_eq!(t.operation(), Duration::from_secs(14));
        // Zero would time out every call at once.
        let zero = Timeouts {
            request: Duration::ZERO,
            ..Timeouts::DYNAMODB
        };
        assert_eq!(
            zero.timeout_config().operation_attempt_timeout(),
            Some(Duration::from_millis(1))
        );
    }

    #[test]
    fn a_summary_names_each_cause_once() {
        // Errors read once: causes in order, a cause its wrapper already shows left out.
        let err = Link(
            "dispatch failure",
            Some(Box::new(Link(
                "io error: tcp connect error",
                Some(Box::new(Link(
                    "tcp connect error",
                    Some(Box::new(Link("Connection refused (os error 111)", None))),
                ))),
            ))),
        );
        assert_eq!(
            summary(&err),
            "dispatch failure: io error: tcp connect error: Connection refused (os error 111)"
        );
    }
}
