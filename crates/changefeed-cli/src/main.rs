//! `changefeed`: run the embedded demo, inspect and operate a fleet's lease table.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod demo;
mod plan;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Plan(args) => plan::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(1)
        }
    }
}
