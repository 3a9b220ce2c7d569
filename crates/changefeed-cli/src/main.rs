//! `changefeed`: run the embedded demo, inspect and operate a fleet's lease table.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

// The simulator allocates and frees millions of small rows; mimalloc does that several times
// faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod config;
mod demo;
mod feed;
mod import_kcl;
mod lineage;
mod metrics;
mod ops;
mod outbox;
mod plan;
mod run;
mod simulate;
mod url;

#[derive(Debug, Parser)]
#[command(
    name = "changefeed",
    version,
    about = "Share a partitioned change feed across a fleet of processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write records into a SQLite feed and read them back through leases (embedded, no server).
    Demo(demo::Args),
    /// Show what one host's balancer would do with a JSON snapshot of hosts and leases.
    Plan(plan::Args),
    /// Run one host of a fleet, piping each batch to a handler command as JSON lines.
    Run(Box<config::RunArgs>),
    /// Show a group's lease table: owner, state, checkpoint, lag, owner heartbeat.
    Status(ops::StatusArgs),
    /// Show a group's hosts (heartbeat rows) and how many leases each owns.
    Hosts(ops::HostsArgs),
    /// Show how many records remain after each lease's checkpoint, and the total.
    Lag(ops::LagArgs),
    /// Move one lease's checkpoint (refused while owned unless --force).
    Reset(ops::ResetArgs),
    /// Release a dead host's leases now and remove its heartbeat row.
    Release(ops::ReleaseArgs),
    /// Show which leases the partition sync would create, from JSON partitions and leases.
    Lineage(lineage::Args),
    /// Split or merge partitions of a SQLite feed by hand, or list them.
    Feed(feed::Args),
    /// Create a PostgreSQL outbox with N partitions, append test records, list or reshape it.
    Outbox(outbox::Args),
    /// Run the deterministic fleet simulator: seeds, faults, invariant check, SVG timeline.
    Simulate(simulate::Args),
    /// Create a group's leases from a KCL 2.x lease table, at the same checkpoints.
    ImportKcl(import_kcl::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Run(args) => run::run(*args),
        Command::Status(args) => ops::status(args),
        Command::Hosts(args) => ops::hosts(args),
        Command::Lag(args) => ops::lag(args),
        Command::Reset(args) => ops::reset(args),
        Command::Release(args) => ops::release(args),
        Command::Lineage(args) => lineage::run(args),
        Command::Feed(args) => feed::run(args),
        Command::Outbox(args) => outbox::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::ImportKcl(args) => import_kcl::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(1)
        }
    }
}
