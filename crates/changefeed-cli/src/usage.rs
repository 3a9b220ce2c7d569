//! Usage errors and the exit codes of every command: a leaf every module may import.

use std::process::ExitCode;
use std::time::Duration;

use changefeed::processor::MAX_DURATION;

/// Exit code for usage errors: a bad flag, environment variable or config file value.
pub const USAGE_EXIT: u8 = 2;

/// A usage error: bad flag, environment or file value. The message names the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Prints a usage error and returns exit code 2.
pub(crate) fn usage(err: &UsageError) -> ExitCode {
    eprintln!("error: {err}");
    ExitCode::from(USAGE_EXIT)
}

/// Parses a duration such as `10s`, `500ms` or `1m 30s`, naming `setting` on error.
///
/// # Errors
/// [`UsageError`] naming the setting.
pub fn parse_duration(setting: &str, value: &str) -> Result<Duration, UsageError> {
    let d = humantime::parse_duration(value.trim()).map_err(|e| {
        UsageError(format!(
            "{setting}: \"{}\" is not a duration such as 10s or 500ms ({e})",
            value.escape_debug()
        ))
    })?;
    // The library refuses these too; saying so here quotes the value as it was written.
    if d > MAX_DURATION {
        return Err(UsageError(format!(
            "{setting}: \"{}\" is longer than the longest accepted duration, {} days",
            value.escape_debug(),
            MAX_DURATION.as_secs() / 86_400
        )));
    }
    Ok(d)
}
