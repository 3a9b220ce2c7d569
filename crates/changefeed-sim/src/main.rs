//! `changefeed-sim`: the deterministic fleet simulator, run as `changefeed simulate` (the
//! `changefeed` binary runs this executable, found beside it or on `PATH`, with the same
//! arguments) or on its own with the same flags.
//!
//! It is a binary of its own so that what the simulator needs, tokio's paused clock (feature
//! `test-util`) and the core's `sim` feature, is linked here and not into `changefeed`.

use std::process::ExitCode;

use clap::Parser;

// The simulator allocates and frees millions of small rows; mimalloc does that several times
// faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod simulate;
mod svg;

/// Exit status when the runs could not be made (a bad flag or value, a file that cannot be
/// written), the same as every `changefeed` command's usage error.
const USAGE_EXIT: u8 = 2;

/// Named as users run it: `changefeed simulate`, the command every rerun line prints.
#[derive(Debug, Parser)]
#[command(
    name = "changefeed simulate",
    bin_name = "changefeed simulate",
    about = "Run the deterministic fleet simulator: seeds, faults, invariant check, SVG timeline"
)]
struct Cli {
    #[command(flatten)]
    args: simulate::Args,
}

fn main() -> ExitCode {
    simulate::run(Cli::parse().args)
}
