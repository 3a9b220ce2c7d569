//! Store and source URLs: the one place that turns `--store URL` / `--source URL` into a backend.
//!
//! Each command takes URLs and gets back trait objects (`Arc<dyn LeaseStore>`,
//! `Arc<dyn FeedSource>`), so adding a backend (PostgreSQL, DynamoDB …) means adding a scheme
//! here and nothing elsewhere. Today only `sqlite://PATH` is built in: `sqlite:///abs/file.db`
//! or `sqlite://relative/file.db` (the path is everything after `sqlite://`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use changefeed::lease::LeaseStore;
use changefeed::source::FeedSource;
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use crate::config::UsageError;

/// Schemes this build understands, for error messages.
const SUPPORTED: &str = "sqlite://PATH";

/// A parsed store or source URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// A SQLite database file.
    Sqlite(PathBuf),
}

impl BackendUrl {
    /// Parses `text`; `setting` names the flag for the error message (`--store`).
    ///
    /// # Errors
    /// A [`UsageError`] naming the setting when the scheme is unknown or the path is empty.
    pub fn parse(setting: &str, text: &str) -> Result<Self, UsageError> {
        let bad = |rule: String| UsageError(format!("{setting}: {rule}"));
        let Some((scheme, rest)) = text.split_once("://") else {
            return Err(bad(format!(
                "\"{}\" is not a URL; expected {SUPPORTED}",
                text.escape_debug()
            )));
        };
        match scheme {
            "sqlite" => {
                if rest.is_empty() {
                    return Err(bad(
                        "sqlite:// needs a file path, e.g. sqlite://feed.db".into()
                    ));
                }
                Ok(BackendUrl::Sqlite(PathBuf::from(rest)))
            }
            "postgres" | "postgresql" => Err(bad(format!(
                "{scheme}:// is not supported by this build yet; supported: {SUPPORTED}"
            ))),
            other => Err(bad(format!(
                "unknown scheme \"{}\"; supported: {SUPPORTED}",
                other.escape_debug()
            ))),
        }
    }

    /// Opens the lease store this URL names.
    ///
    /// # Errors
    /// The backend's error when it cannot be opened.
    pub async fn open_store(&self) -> anyhow::Result<Arc<dyn LeaseStore>> {
        match self {
            BackendUrl::Sqlite(path) => {
                let store = SqliteLeaseStore::open(path)
                    .await
                    .with_context(|| format!("opening lease store {}", path.display()))?;
                Ok(Arc::new(store))
            }
        }
    }

    /// Opens the feed source this URL names.
    ///
    /// # Errors
    /// The backend's error when it cannot be opened.
    pub async fn open_source(&self) -> anyhow::Result<Arc<dyn FeedSource>> {
        match self {
            BackendUrl::Sqlite(path) => {
                let feed = SqliteFeed::open(path)
                    .await
                    .with_context(|| format!("opening feed {}", path.display()))?;
                Ok(Arc::new(feed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_keep_the_path_and_other_schemes_are_named() {
        // Bad URLs are usage errors naming the flag and the supported schemes.
        assert_eq!(
            BackendUrl::parse("--store", "sqlite:///tmp/a.db").expect("valid"),
            BackendUrl::Sqlite(PathBuf::from("/tmp/a.db"))
        );
        assert_eq!(
            BackendUrl::parse("--store", "sqlite://a.db").expect("valid"),
            BackendUrl::Sqlite(PathBuf::from("a.db"))
        );
        let err = BackendUrl::parse("--store", "redis://x").expect_err("unknown");
        assert!(
            err.0.contains("--store") && err.0.contains("sqlite://"),
            "{err}"
        );
        let err = BackendUrl::parse("--source", "feed.db").expect_err("not a URL");
        assert!(err.0.contains("--source"), "{err}");
        assert!(BackendUrl::parse("--store", "sqlite://").is_err());
    }
}
