//! `changefeed-bench`: benchmarks for changefeed. Each subcommand measures the thing and its
//! baseline in the same run, prints a short table, and ends with one line
//! `RESULT key=value …` so figures can be compared across machines.

use clap::{Parser, Subcommand};

mod balance;
mod dynamodb_cost;
mod dynamodb_keys;
mod faults_cmd;
mod hotspots;
mod key_parallel;
mod latency;
mod outbox;
mod rebalance;
mod report;
mod run_throughput;
mod store;
mod store_io;
mod throughput;
mod usage;

#[derive(Debug, Parser)]
#[command(
    name = "changefeed-bench",
    about = "changefeed benchmarks; each ends with a RESULT line"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Rebalancing cycles, failover and store calls: ours against KCL-like and Cosmos-like.
    Rebalance(rebalance::Args),
    /// One host's EqualShare plan on a large lease table, against an O(leases) baseline.
    Balance(balance::Args),
    /// DynamoDB capacity per minute of a fleet (DynamoDB Local), ours against KCL's pattern.
    DynamodbCost(dynamodb_cost::Args),
    /// Request units per second on each DynamoDB partition key of a real fleet (DynamoDB Local).
    DynamodbKeys(dynamodb_keys::Args),
    /// PostgreSQL outbox: read records/s per partition and append/s, against the in-memory feed.
    Outbox(outbox::Args),
    /// Lease store operations: CAS replace/s and list of N leases, SQLite against memory.
    Store(store::Args),
    /// Records/s through one host against raw source reads (in-memory feed, no-op handler).
    Throughput(throughput::Args),
    /// Store reads and writes per host in steady state (10 hosts, virtual time).
    StoreIo(store_io::Args),
    /// Records/s through `changefeed run`: per-batch, long-lived and KCL protocol modes.
    RunThroughput(run_throughput::Args),
    /// Placement by measured load (LoadShare) against counts and a KCL 3.x model, on a workload model.
    Hotspots(hotspots::Args),
    /// Records/s of one hot partition with 1, 4 and 16 handler calls at once, split by key.
    KeyParallel(key_parallel::Args),
    /// Recovery of a real fleet after network and server faults injected at the socket.
    Faults(faults_cmd::Args),
    /// PutRecord-to-handler latency on kinesis-mock, polling against enhanced fan-out.
    Latency(latency::Args),
    /// The figures table the README quotes, from the quick benchmarks or saved RESULT lines.
    Report(report::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Balance(args) => balance::run(args),
        Command::Rebalance(args) => rebalance::run(args),
        Command::DynamodbCost(args) => dynamodb_cost::run(args),
        Command::DynamodbKeys(args) => dynamodb_keys::run(args),
        Command::Outbox(args) => outbox::run(args),
        Command::Store(args) => store::run(args),
        Command::Throughput(args) => throughput::run(args),
        Command::StoreIo(args) => store_io::run(args),
        Command::RunThroughput(args) => run_throughput::run(args),
        Command::Faults(args) => faults_cmd::run(args),
        Command::KeyParallel(args) => key_parallel::run(args),
        Command::Hotspots(args) => hotspots::run(args),
        Command::Latency(args) => latency::run(args),
        Command::Report(args) => report::run(args),
    }
}
