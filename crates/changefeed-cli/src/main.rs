//! `changefeed`: run the embedded demo, inspect and operate a fleet's lease table.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod config;
mod console;
mod demo;
mod export_kcl;
mod feed;
mod import_cosmos;
mod import_kcl;
mod lineage;
mod metrics;
mod ops;
mod outbox;
mod plan;
mod properties;
mod run;
mod simulate;
mod start;
mod url;
mod usage;

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
    /// Serve a live web page of a group: hosts, leases, lag, an ownership timeline, events.
    Console(console::Args),
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
    /// Append records to a SQLite feed, split or merge its partitions by hand, or list them.
    Feed(feed::Args),
    /// Create a PostgreSQL outbox with N partitions, append test records, list or reshape it.
    Outbox(outbox::Args),
    /// Run the deterministic fleet simulator: seeds, faults, invariant check, SVG timeline
    /// (runs the `changefeed-sim` executable, beside this one or on PATH).
    #[command(disable_help_flag = true)]
    Simulate(simulate::Args),
    /// Create a group's leases from a KCL 2.x lease table, at the same checkpoints.
    ImportKcl(import_kcl::Args),
    /// Write a group's checkpoints back into a KCL lease table, so the KCL resumes there.
    ExportKcl(export_kcl::Args),
    /// Create a group's leases from a .NET Cosmos DB change feed processor's lease container.
    ImportCosmos(import_cosmos::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Run(args) => run::run(*args),
        Command::Console(args) => console::run(args),
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
        Command::ExportKcl(args) => export_kcl::run(args),
        Command::ImportCosmos(args) => import_cosmos::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            match err.downcast_ref::<usage::UsageError>() {
                Some(_) => ExitCode::from(usage::USAGE_EXIT),
                None => ExitCode::from(1),
            }
        }
    }
}

/// An error and its causes on one line, each cause once ([`changefeed::error::one_line`]).
pub(crate) fn error_text(err: &anyhow::Error) -> String {
    changefeed::error::one_line(err.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer failed: {source}")]
    struct Embeds {
        source: Inner,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("inner broke")]
    struct Inner {
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_printed_once() {
        // Errors read once: a cause an outer message already shows is not repeated.
        let io = std::io::Error::other("disk on fire");
        let err = anyhow::Error::new(Embeds {
            source: Inner { source: io },
        })
        .context("opening lease store x.db");
        assert_eq!(
            error_text(&err),
            "opening lease store x.db: outer failed: inner broke: disk on fire"
        );
    }
}
