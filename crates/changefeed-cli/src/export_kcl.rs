//! `changefeed export-kcl`: the way back to the KCL. Writes a group's checkpoints into the KCL
//! application's lease table ([`changefeed_dynamodb::export_kcl`]), so that the Java KCL,
//! started again, resumes where changefeed stopped instead of at its checkpoints from before
//! the migration.
//!
//! Our hosts must have stopped first: before writing anything, when the group has heartbeat
//! rows, they are read twice `--expiry` apart (the fleet's `lease_expiry`), and a row whose
//! version moved in between is a running host: the export is refused, naming each. Exit codes:
//! 0 when every lease was exported, 1 when hosts still run, a table could not be read or
//! written, or some leases were skipped (each named, with why), 2 for bad usage.

use changefeed::lease::MembershipStore;
use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Context as _;
use changefeed::model::{GroupName, HostName};
use changefeed_dynamodb::DynamoLeaseStore;

use crate::import_kcl::TableArgs;

/// Arguments of `changefeed export-kcl`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    tables: TableArgs,
    /// The fleet's lease expiry: a host whose heartbeat moves within it is running, and the
    /// export is refused.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    expiry: String,
}

/// `changefeed export-kcl`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (group, options, name, expiry) = match args.tables.resolve_with("--expiry", &args.expiry) {
        Ok(resolved) => resolved,
        Err(e) => return Ok(crate::usage::usage(&e)),
    };
    let table = &args.tables.table;
    let runtime = TableArgs::runtime()?;
    let outcome = runtime.block_on(async {
        let store = args.tables.connect(&options, &name).await?;
        let running = hosts_running(&store, &group, expiry).await?;
        if !running.is_empty() {
            return Ok(Err(running));
        }
        changefeed_dynamodb::export_kcl(&store, table, &group)
            .await
            .map(Ok)
            .with_context(|| format!("writing KCL lease table {table}"))
    })?;
    let report = match outcome {
        Ok(report) => report,
        Err(running) => {
            eprintln!(
                "error: host(s) {} of group {group} still renew their heartbeats; stop every changefeed host of the group (a graceful stop releases its leases at their checkpoints), then run export-kcl again. Nothing was written",
                running
                    .iter()
                    .map(HostName::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            return Ok(ExitCode::from(1));
        }
    };
    if args.tables.json {
        let value = serde_json::json!({
            "group": group.to_string(),
            "kcl_table": table,
            "updated": report.updated,
            "created": report.created,
            "skipped": report
                .skipped
                .iter()
                .map(|(k, why)| serde_json::json!({"partition": k, "reason": why}))
                .collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for key in &report.updated {
            println!("{key}  updated");
        }
        for key in &report.created {
            println!("{key}  created");
        }
        for (partition, why) in &report.skipped {
            println!("{partition}  skipped  {why}");
        }
        println!(
            "{} updated, {} created, {} skipped (KCL table {table}, from group {group})",
            report.updated.len(),
            report.created.len(),
            report.skipped.len()
        );
    }
    Ok(crate::import_kcl::skipped_exit(
        report.skipped.len(),
        "lease(s) were not exported; the KCL starts them at its own checkpoints or its initial position",
    ))
}

/// The hosts of `group` whose heartbeat moved within `expiry`: none without a second read when
/// the group has no heartbeat row.
async fn hosts_running(
    store: &DynamoLeaseStore,
    group: &GroupName,
    expiry: std::time::Duration,
) -> anyhow::Result<Vec<HostName>> {
    let read = || async {
        store
            .membership(group)
            .await
            .with_context(|| format!("reading the heartbeats of group {group}"))
    };
    let before: BTreeMap<HostName, _> = read()
        .await?
        .hosts
        .into_iter()
        .map(|h| (h.host.clone(), (h.incarnation, h.version)))
        .collect();
    if before.is_empty() {
        return Ok(Vec::new());
    }
    eprintln!(
        "checking that no changefeed host of group {group} still runs: watching {} heartbeat row(s) for {expiry:?} (--expiry)",
        before.len()
    );
    tokio::time::sleep(expiry).await;
    Ok(read()
        .await?
        .hosts
        .into_iter()
        .filter(|h| before.get(&h.host) != Some(&(h.incarnation.clone(), h.version)))
        .map(|h| h.host)
        .collect())
}
