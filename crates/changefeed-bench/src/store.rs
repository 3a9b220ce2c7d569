//! `store`: lease store throughput.

/// Arguments of `changefeed-bench store`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the benchmark.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("not written yet")
}
