//! `changefeed import-cosmos`: create a group's leases from a .NET change feed processor's lease
//! container, at the same continuations.
//!
//! A team moving from the Azure Cosmos DB change feed processor (.NET v3 SDK or the v2 library)
//! keeps its place in the feed: each .NET lease becomes one of our leases, available, at its
//! continuation (see [`changefeed_cosmos::import`]). The .NET container is only read. While any
//! .NET lease is owned and was renewed within `--expiry`, nothing is written (no flag overrides
//! that: stop the .NET fleet or wait). Running it again creates nothing new. Exit codes: 0 when
//! every .NET lease was imported (or was there already), 1 when the import was refused or
//! failed, or some leases were skipped (each named, with why), 2 for bad usage.

use std::process::ExitCode;

use anyhow::Context as _;
use changefeed::model::{GroupName, Position};
use changefeed_cosmos::import::{ImportOutcome, ImportReport};
use changefeed_cosmos::{import_dotnet_leases, DotnetLeaseContainer, ImportOptions};

use crate::url::{BackendUrl, COSMOS_KEY_VAR};
use crate::usage::UsageError;

/// Arguments of `changefeed import-cosmos`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .NET processor's lease container, only read:
    /// cosmos://ACCOUNT/DATABASE/CONTAINER[?endpoint=URL] (key from CHANGEFEED_COSMOS_KEY).
    #[arg(long, value_name = "URL")]
    lease_container: String,
    /// Our lease store and the group the imported leases belong to.
    #[command(flatten)]
    target: crate::ops::Target,
    /// How long after its last renewal an owned .NET lease counts as live (the .NET fleet's
    /// LeaseExpirationInterval).
    #[arg(long, value_name = "DURATION", default_value = "60s")]
    expiry: String,
    /// Where a .NET lease without a continuation starts: beginning, now or at:MILLIS.
    #[arg(long, value_name = "POSITION", default_value = "beginning")]
    start_position: String,
    /// Import the processor whose lease prefix starts with this, when the container holds the
    /// leases of several.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
    /// Replace leases already in our store with the .NET lease (never one our host owns).
    #[arg(long)]
    force: bool,
    /// Read and check everything, write nothing; report what would be done.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_start(value: &str) -> Result<Position, UsageError> {
    let bad = |why: String| UsageError(format!("--start-position: {why}"));
    match value.parse::<Position>().map_err(|e| bad(e.to_string()))? {
        Position::Continuation(_) => Err(bad(
            "must be beginning, now or at:MILLIS (a continuation belongs to one partition)".into(),
        )),
        p => Ok(p),
    }
}

/// `changefeed import-cosmos`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let usage = |e: UsageError| Ok(crate::usage::usage(&e));
    let group = match args.target.group_name() {
        Ok(g) => g,
        Err(e) => return usage(e),
    };
    let dotnet = match BackendUrl::parse("--lease-container", &args.lease_container) {
        Ok(BackendUrl::Cosmos(url)) => url,
        Ok(_) => {
            return usage(UsageError(
                "--lease-container: the .NET processor's lease container is a Cosmos DB container, cosmos://ACCOUNT/DATABASE/CONTAINER[?endpoint=URL]".into(),
            ))
        }
        Err(e) => return usage(e),
    };
    let store = match args.target.store_url() {
        Ok(store) => store,
        Err(e) => return usage(e),
    };
    if let BackendUrl::Cosmos(ours) = &store {
        if ours.endpoint() == dotnet.endpoint()
            && ours.database == dotnet.database
            && ours.container == dotnet.container
        {
            return usage(UsageError(
                "--store: our leases need a container of their own (partition key /group), not the .NET lease container".into(),
            ));
        }
    }
    let expiry = match crate::usage::parse_duration("--expiry", &args.expiry) {
        Ok(d) => d,
        Err(e) => return usage(e),
    };
    if expiry < changefeed_cosmos::import::DEFAULT_DOTNET_LEASE_EXPIRY {
        eprintln!(
            "warning: --expiry {} is below the .NET default LeaseExpirationInterval (60s): a lease renewed longer ago than that counts as free, so it must be what the .NET fleet is configured with",
            args.expiry.trim()
        );
    }
    let start = match parse_start(&args.start_position) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let cosmos_options = match dotnet.options(std::env::var(COSMOS_KEY_VAR).ok()) {
        Ok(o) => o,
        Err(e) => return usage(UsageError(format!("--lease-container: {}", e.0))),
    };
    let container_path = format!("{}/{}", dotnet.database, dotnet.container);
    let mut options = ImportOptions::default()
        .expiry(expiry)
        .start(start)
        .force(args.force)
        .dry_run(args.dry_run);
    if let Some(prefix) = &args.prefix {
        options = options.processor(prefix.clone());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let report = runtime.block_on(async {
        let source = DotnetLeaseContainer::new(&cosmos_options)?;
        let target = store.open_store().await?;
        import_dotnet_leases(&source, target.as_ref(), &group, &options)
            .await
            .with_context(|| {
                format!(
                    "importing the .NET lease container {container_path} at {}",
                    dotnet.endpoint()
                )
            })
    })?;
    if args.json {
        print_json(&report, &group, &container_path)?;
    } else {
        print_table(&report, &group, &container_path);
    }
    if !report.initialized {
        eprintln!(
            "warning: the lease container has no {}.info document: the .NET processor never finished creating its leases, so some ranges may have none; those start where `changefeed run --start-position` says",
            report.processor
        );
    }
    if report.initialization_lock {
        eprintln!(
            "warning: {}.lock is present: a .NET processor was creating its leases (or died doing so); make sure none is running",
            report.processor
        );
    }
    let skipped = report.count("skipped");
    if skipped == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "error: {skipped} .NET lease(s) were not imported (see DETAIL); fix what is named and run again"
        );
        Ok(ExitCode::from(1))
    }
}

/// What to say about one lease besides its outcome.
fn detail(outcome: &ImportOutcome, dotnet_owner: Option<&str>) -> String {
    match outcome {
        ImportOutcome::Skipped { reason } => reason.clone(),
        ImportOutcome::Existing {
            same_position: false,
        } => "ours resumes elsewhere; --force replaces it".into(),
        ImportOutcome::Existing {
            same_position: true,
        } => "already at the .NET continuation".into(),
        _ => dotnet_owner
            .map(|o| format!(".NET owner {o} expired"))
            .unwrap_or_default(),
    }
}

fn print_table(report: &ImportReport, group: &GroupName, container: &str) {
    let rows: Vec<[String; 4]> = report
        .leases
        .iter()
        .map(|l| {
            [
                l.key.partition.to_string(),
                l.outcome.as_str().to_string(),
                l.continuation
                    .as_ref()
                    .map(|c| c.as_str().to_string())
                    .unwrap_or_else(|| format!("({})", l.start)),
                detail(&l.outcome, l.dotnet_owner.as_deref()),
            ]
        })
        .collect();
    let header = ["PARTITION", "RESULT", "CONTINUATION", "DETAIL"];
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .max()
            .unwrap_or(0)
            .max(header[i].len())
    };
    let (w0, w1, w2) = (width(0), width(1), width(2));
    let line = |r: [&str; 4]| {
        println!(
            "{}",
            format!("{:<w0$}  {:<w1$}  {:<w2$}  {}", r[0], r[1], r[2], r[3]).trim_end()
        )
    };
    line(header);
    for r in &rows {
        line([&r[0], &r[1], &r[2], &r[3]]);
    }
    let verb = if report.dry_run {
        "dry run, nothing written"
    } else {
        "written"
    };
    println!(
        "{} created, {} already present, {} replaced, {} skipped ({verb}; group {group}, from .NET processor {} in {container})",
        report.count("created") + report.count("would-create"),
        report.count("existing"),
        report.count("replaced") + report.count("would-replace"),
        report.count("skipped"),
        report.processor,
    );
    if !report.other_processors.is_empty() {
        println!(
            "left alone: the leases of {} other processor(s): {}",
            report.other_processors.len(),
            report.other_processors.join(", ")
        );
    }
    println!(
        "RESULT created={} existing={} replaced={} skipped={} dry_run={}",
        report.count("created") + report.count("would-create"),
        report.count("existing"),
        report.count("replaced") + report.count("would-replace"),
        report.count("skipped"),
        report.dry_run
    );
}

fn print_json(report: &ImportReport, group: &GroupName, container: &str) -> anyhow::Result<()> {
    let leases: Vec<serde_json::Value> = report
        .leases
        .iter()
        .map(|l| {
            serde_json::json!({
                "partition": l.key.partition.as_str(),
                "result": l.outcome.as_str(),
                "continuation": l.continuation.as_ref().map(|c| c.as_str()),
                "start": l.start.to_string(),
                "dotnet_id": l.dotnet_id,
                "schema": l.schema.as_str(),
                "dotnet_owner": l.dotnet_owner,
                "detail": detail(&l.outcome, l.dotnet_owner.as_deref()),
            })
        })
        .collect();
    let value = serde_json::json!({
        "group": group.as_str(),
        "lease_container": container,
        "processor": report.processor,
        "initialized": report.initialized,
        "initialization_lock": report.initialization_lock,
        "dry_run": report.dry_run,
        "leases": leases,
        "other_processors": report.other_processors,
    });
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}
