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
    /// credentials `test`/`test`.
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
