//! `changefeed simulate`: runs the simulator's own executable, `changefeed-sim`, with the same
//! arguments.
//!
//! The simulator runs the real processor on tokio's paused clock, which only tokio's
//! `test-util` offers; keeping it in a binary of its own keeps that, the core's `sim` feature
//! and the simulator out of `changefeed`, which every fleet host runs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::usage::UsageError;

/// The simulator's executable.
const SIMULATOR: &str = "changefeed-sim";

/// Arguments of `changefeed simulate`: every one goes to `changefeed-sim` as given, `--help`
/// too, so its flags are defined (and documented) in one place.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The simulator's flags (see `changefeed simulate --help`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 0..,
        value_name = "FLAGS"
    )]
    args: Vec<OsString>,
}

/// Replaces this process with `changefeed-sim`, found beside this executable (as `cargo build`
/// and `cargo install` place them), else on `PATH`: its output, exit status and signals are
/// then the command's own.
///
/// # Errors
/// A [`UsageError`] naming `changefeed-sim` when neither place has it, or when it cannot be
/// started.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    let Some(path) = find(beside.as_deref(), std::env::var_os("PATH")) else {
        let place = beside.map_or_else(String::new, |dir| format!(" ({})", dir.display()));
        return Err(UsageError(format!(
            "changefeed simulate runs the simulator's executable `{SIMULATOR}`, which is neither \
             beside this `changefeed`{place} nor on PATH: build it with \
             `cargo build --release -p {SIMULATOR}` and put it beside `changefeed` \
             (the pip wheel does not carry it)"
        ))
        .into());
    };
    let err = exec(&path, &args.args);
    Err(UsageError(format!(
        "cannot start {SIMULATOR} ({}): {err}",
        path.display()
    ))
    .into())
}

/// The simulator in `beside` (this executable's directory), else the first in `path_var`.
fn find(beside: Option<&Path>, path_var: Option<OsString>) -> Option<PathBuf> {
    let name = format!("{SIMULATOR}{}", std::env::consts::EXE_SUFFIX);
    beside
        .map(|dir| dir.join(&name))
        .filter(|p| p.is_file())
        .or_else(|| {
            std::env::split_paths(&path_var?)
                .map(|dir| dir.join(&name))
                .find(|p| p.is_file())
        })
}

/// Runs `path` in place of this process; returns only if that fails.
#[cfg(unix)]
fn exec(path: &Path, args: &[OsString]) -> std::io::Error {
    use std::os::unix::process::CommandExt as _;
    std::process::Command::new(path).args(args).exec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulator_beside_this_executable_comes_before_path() {
        let beside = tempfile::tempdir().expect("temporary directory");
        let on_path = tempfile::tempdir().expect("temporary directory");
        let name = format!("{SIMULATOR}{}", std::env::consts::EXE_SUFFIX);
        std::fs::write(on_path.path().join(&name), "").expect("write");
        let path_var = || Some(std::env::join_paths([on_path.path()]).expect("PATH"));
        assert_eq!(
            find(Some(beside.path()), path_var()),
            Some(on_path.path().join(&name))
        );
        std::fs::write(beside.path().join(&name), "").expect("write");
        assert_eq!(
            find(Some(beside.path()), path_var()),
            Some(beside.path().join(&name))
        );
        assert_eq!(find(None, None), None);
        let empty = tempfile::tempdir().expect("temporary directory");
        assert_eq!(find(Some(empty.path()), None), None);
    }
}
