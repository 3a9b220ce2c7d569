//! `changefeed demo`.

use std::process::ExitCode;

/// Arguments of `changefeed demo`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the demo.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not written yet")
}
