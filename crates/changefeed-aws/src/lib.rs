//! Shared AWS SDK configuration for the changefeed AWS backends (`changefeed-dynamodb`,
//! `changefeed-kinesis`), so both build their clients the same way.
#![warn(missing_docs)]

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::Credentials;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};

/// Where and as whom to connect. Every field left `None` comes from the standard AWS
/// configuration chain (environment, profile files, SSO, container and instance metadata).
#[derive(Clone, Debug, Default)]
pub struct AwsOptions {
    /// An endpoint URL overriding the region's (DynamoDB Local: `http://127.0.0.1:8000`, kinesis-mock: `http://127.0.0.1:4568`).
    pub endpoint_url: Option<String>,
    /// The region, overriding the chain's.
    pub region: Option<String>,
    /// Static credentials `(access key id, secret key)`, overriding the chain's (for local
    /// servers, which accept any).
    pub static_credentials: Option<(String, String)>,
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
        }
    }

    /// Loads the SDK configuration: the standard chain with these overrides, over an HTTPS
    /// client using rustls with the ring crypto provider.
    pub async fn load(&self) -> SdkConfig {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http);
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
