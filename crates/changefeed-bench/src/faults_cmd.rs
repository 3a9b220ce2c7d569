//! `faults`: recovery of a real fleet after network and server faults, per backend and
//! scenario (see [`changefeed_bench::faults`]); one RESULT line per scenario.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use changefeed_bench::faults::{self, Scenario, SourceBackend, StoreBackend, Timings};

/// Arguments of `changefeed-bench faults`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The `changefeed` binary (default: next to this one; build it with `cargo build
    /// --release -p changefeed-cli`).
    #[arg(long)]
    changefeed: Option<PathBuf>,
    /// The lease store's backend.
    #[arg(long, default_value = "postgres", value_parser = ["postgres", "dynamodb", "cosmos"])]
    backend: String,
    /// The source: a PostgreSQL outbox (`postgres`) or a Kinesis stream (`kinesis`, on
    /// `--kinesis-url`), with any backend.
    #[arg(long, default_value = "postgres", value_parser = ["postgres", "kinesis"])]
    source: String,
    /// kinesis-mock's (or another Kinesis endpoint's) URL, for `--source kinesis`.
    #[arg(
        long,
        env = "CHANGEFEED_TEST_KINESIS_URL",
        default_value = "http://127.0.0.1:4568"
    )]
    kinesis_url: String,
    /// DynamoDB Local's endpoint, for `--backend dynamodb`.
    #[arg(
        long,
        env = "CHANGEFEED_TEST_DYNAMODB_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    dynamodb_url: String,
    /// The Cosmos DB server's endpoint, for `--backend cosmos`.
    #[arg(
        long,
        env = "CHANGEFEED_TEST_COSMOS_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    cosmos_url: String,
    /// A scenario (cut-one, cut-then-restart, cut-all, slow-store, source-cut, cut-then-reset,
    /// source-cut-then-reset, source-cut-all) or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// Short timings (3 s expiry, 0.5 s renewals, 5 s cuts) instead of the processor's
    /// defaults (10 s expiry, 2 s renewals, 15 s cuts).
    #[arg(long)]
    quick: bool,
    /// Hosts in the fleet.
    #[arg(long, default_value_t = 3)]
    hosts: usize,
    /// Partitions of the source (the outbox's, or the Kinesis stream's shards).
    #[arg(long, default_value_t = 6)]
    partitions: u32,
    /// A scenario fails when a faulted host has not delivered again this long after the
    /// fault's end.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    recover_within: Duration,
    /// The PostgreSQL server (the outbox for `--source postgres`, the lease store for
    /// `--backend postgres`).
    #[arg(
        long,
        env = "CHANGEFEED_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    postgres_url: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let binary = match &args.changefeed {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the bench binary has no directory")?
            .join("changefeed"),
    };
    if !binary.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p changefeed-cli` or pass --changefeed",
            binary.display()
        );
    }
    let scenarios: Vec<Scenario> = if args.scenario == "all" {
        Scenario::ALL.to_vec()
    } else {
        vec![Scenario::parse(&args.scenario)
            .with_context(|| format!("--scenario {}: not a scenario", args.scenario))?]
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        for scenario in scenarios {
            let timings = if args.quick {
                Timings::quick()
            } else {
                Timings::defaults()
            };
            let backend = match args.backend.as_str() {
                "dynamodb" => StoreBackend::Dynamodb(args.dynamodb_url.clone()),
                "cosmos" => StoreBackend::Cosmos(args.cosmos_url.clone()),
                _ => StoreBackend::Postgres,
            };
            let source = match args.source.as_str() {
                "kinesis" => SourceBackend::Kinesis(args.kinesis_url.clone()),
                _ => SourceBackend::Outbox,
            };
            let setup = faults::setup(
                &binary,
                backend,
                source,
                &args.postgres_url,
                args.hosts,
                args.partitions,
                timings,
            )
            .await?;
            let outcome = faults::run(&setup, scenario, args.recover_within).await?;
            println!(
                "{}: heartbeat again after {:?} s, delivering after {:?} s",
                scenario.name(),
                outcome.heartbeat_s,
                outcome.recovery_s
            );
            println!("{}", outcome.result_line(&args.backend));
        }
        Ok(())
    })
}
