//! `changefeed import-kcl`: create a group's leases from an existing KCL 2.x lease table.
//!
//! A team moving a Kinesis consumer from Java KCL keeps every checkpoint: each KCL lease
//! becomes one of our leases, available, at the same continuation (see
//! [`changefeed_dynamodb::import_kcl`]). Running it again creates nothing new.
//!
//! The KCL must have stopped first: two fleets on one stream would both deliver. So before
//! writing anything, when any KCL lease has an owner, the KCL table is read twice
//! `--failover-time` apart (the KCL's `failoverTimeMillis`, 10 s by default), and a lease whose
//! `leaseCounter` or owner moved in between is held by a live KCL worker, as the KCL itself
//! judges it: the import is refused, naming each such lease and its owner. No flag overrides
//! that. Exit codes: 0 when every KCL lease was imported (or already existed), 1 when KCL
//! workers still hold leases, a table could not be read or written, or some KCL leases were
//! skipped (each named, with why), 2 for bad usage.

use std::process::ExitCode;

use anyhow::Context as _;
use changefeed::model::GroupName;
use changefeed_dynamodb::{AwsOptions, DynamoLeaseStore};

use crate::url::BackendUrl;
use crate::usage::UsageError;

/// The two tables of `import-kcl` and `export-kcl`.
#[derive(Debug, clap::Args)]
pub struct TableArgs {
    /// The KCL 2.x lease table (KCL's application name).
    #[arg(long, value_name = "TABLE")]
    pub(crate) table: String,
    /// Our lease store (a DynamoDB table, dynamodb://TABLE[?endpoint=URL&region=R]) and the
    /// group of our leases.
    #[command(flatten)]
    target: crate::ops::Target,
    /// The DynamoDB endpoint (a local server), unless the store URL gives ?endpoint=.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// The AWS region, unless the store URL gives ?region=.
    #[arg(long, value_name = "REGION")]
    region: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

impl TableArgs {
    /// The group, and our store's table with the options that reach it (both tables through
    /// one client).
    ///
    /// # Errors
    /// A [`UsageError`] naming the flag.
    pub(crate) fn resolve(&self) -> Result<(GroupName, AwsOptions, String), UsageError> {
        let group = self.target.group_name()?;
        let aws = match self.target.store_url()? {
            BackendUrl::Dynamodb(aws) => aws,
            _ => {
                return Err(UsageError(
                    "--store: the KCL's tables are DynamoDB tables; give a DynamoDB lease store, dynamodb://TABLE[?endpoint=URL&region=R]"
                        .into(),
                ))
            }
        };
        if self.table.is_empty() {
            return Err(UsageError(
                "--table: the KCL lease table name must not be empty".into(),
            ));
        }
        let endpoint_url = merge("endpoint", self.endpoint.clone(), aws.endpoint.clone())?;
        let region = merge("region", self.region.clone(), aws.region.clone())?;
        let options = AwsOptions {
            endpoint_url,
            region,
            static_credentials: None,
            ..aws.options()
        };
        Ok((group, options, aws.name.clone()))
    }

    /// [`TableArgs::resolve`], and the duration flag `flag` given as `value`.
    ///
    /// # Errors
    /// A [`UsageError`] naming the flag.
    pub(crate) fn resolve_with(
        &self,
        flag: &str,
        value: &str,
    ) -> Result<(GroupName, AwsOptions, String, std::time::Duration), UsageError> {
        let (group, options, name) = self.resolve()?;
        let duration = crate::usage::parse_duration(flag, value)?;
        Ok((group, options, name, duration))
    }

    /// A runtime for one command's calls.
    ///
    /// # Errors
    /// If tokio cannot start one.
    pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")
    }

    /// Connects to our store's table.
    ///
    /// # Errors
    /// If it cannot be reached, or is not a changefeed lease table.
    pub(crate) async fn connect(
        &self,
        options: &AwsOptions,
        name: &str,
    ) -> anyhow::Result<DynamoLeaseStore> {
        DynamoLeaseStore::connect(options, name)
            .await
            .with_context(|| format!("opening DynamoDB lease table {name}"))
    }
}

/// Arguments of `changefeed import-kcl`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    tables: TableArgs,
    /// The KCL application's failover time (its `failoverTimeMillis`): a KCL lease whose
    /// counter moves within it is held by a live worker, and the import is refused.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    failover_time: String,
}

/// Both tables are reached through one client, so a flag and the store URL must agree.
fn merge(
    flag: &str,
    from_flag: Option<String>,
    from_url: Option<String>,
) -> Result<Option<String>, UsageError> {
    match (from_flag, from_url) {
        (Some(a), Some(b)) if a != b => Err(UsageError(format!(
            "--{flag} \"{}\" disagrees with the store URL's ?{flag}=\"{}\"",
            a.escape_debug(),
            b.escape_debug()
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

/// `changefeed import-kcl`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (group, options, name, failover) = match args
        .tables
        .resolve_with("--failover-time", &args.failover_time)
    {
        Ok(resolved) => resolved,
        Err(e) => return Ok(crate::usage::usage(&e)),
    };
    let table = &args.tables.table;
    let runtime = TableArgs::runtime()?;
    let outcome = runtime.block_on(async {
        let store = args.tables.connect(&options, &name).await?;
        let live = kcl_workers_alive(&store, table, failover).await?;
        if !live.is_empty() {
            return Ok(Err(live));
        }
        changefeed_dynamodb::import_kcl(&store, table, &group)
            .await
            .map(Ok)
            .with_context(|| format!("importing KCL lease table {table}"))
    })?;
    let report = match outcome {
        Ok(report) => report,
        Err(live) => {
            for (key, now, before) in &live {
                let counter = match before {
                    Some(b) => format!("leaseCounter {b} -> {}", now.counter),
                    None => format!("new, leaseCounter {}", now.counter),
                };
                eprintln!(
                    "  {key}: held by {} ({counter} within {})",
                    now.owner.as_deref().unwrap_or("?"),
                    args.failover_time.trim()
                );
            }
            eprintln!(
                "error: {} lease(s) of KCL table {} are held by running KCL workers (listed above); stop every worker of the KCL application, then run import-kcl again. Nothing was imported",
                live.len(),
                table
            );
            return Ok(ExitCode::from(1));
        }
    };
    if args.tables.json {
        let key = |k: &changefeed::model::LeaseKey| k.partition.to_string();
        let value = serde_json::json!({
            "group": group.to_string(),
            "kcl_table": table,
            "created": report.created.iter().map(key).collect::<Vec<_>>(),
            "existing": report.existing.iter().map(key).collect::<Vec<_>>(),
            "skipped": report
                .skipped
                .iter()
                .map(|(k, why)| serde_json::json!({"lease_key": k, "reason": why}))
                .collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        let mut rows: Vec<(String, &str, String)> = Vec::new();
        rows.extend(
            report
                .created
                .iter()
                .map(|k| (k.partition.to_string(), "created", String::new())),
        );
        rows.extend(
            report
                .existing
                .iter()
                .map(|k| (k.partition.to_string(), "existing", String::new())),
        );
        rows.extend(
            report
                .skipped
                .iter()
                .map(|(k, why)| (k.clone(), "skipped", why.clone())),
        );
        let width = rows
            .iter()
            .map(|r| r.0.chars().count())
            .max()
            .unwrap_or(0)
            .max("PARTITION".len());
        println!("{:<width$}  {:<8}  DETAIL", "PARTITION", "RESULT");
        for (partition, result, detail) in &rows {
            println!(
                "{}",
                format!("{partition:<width$}  {result:<8}  {detail}").trim_end()
            );
        }
        println!(
            "{} created, {} already present, {} skipped (group {group}, from KCL table {})",
            report.created.len(),
            report.existing.len(),
            report.skipped.len(),
            table
        );
    }
    Ok(skipped_exit(
        report.skipped.len(),
        "KCL lease(s) were not imported; create them by hand (changefeed reset) or fix the KCL table and run again",
    ))
}

/// 0 when no lease was skipped; otherwise says how many and `what` of them, and 1.
pub(crate) fn skipped_exit(skipped: usize, what: &str) -> ExitCode {
    if skipped == 0 {
        return ExitCode::SUCCESS;
    }
    eprintln!("error: {skipped} {what}");
    ExitCode::from(1)
}

/// The KCL leases live workers hold: none without reading twice when no lease has an owner;
/// otherwise those whose counter or owner moved within `failover`.
async fn kcl_workers_alive(
    store: &DynamoLeaseStore,
    table: &str,
    failover: std::time::Duration,
) -> anyhow::Result<Vec<(String, changefeed_dynamodb::KclHolder, Option<u64>)>> {
    let read = || async {
        changefeed_dynamodb::kcl_holders(store, table)
            .await
            .with_context(|| format!("reading KCL lease table {table}"))
    };
    let before = read().await?;
    let owned = before.values().filter(|h| h.owner.is_some()).count();
    if owned == 0 {
        return Ok(Vec::new());
    }
    eprintln!(
        "checking that no KCL worker still holds a lease: watching the counters of {owned} owned KCL lease(s) for {failover:?} (--failover-time)"
    );
    tokio::time::sleep(failover).await;
    let after = read().await?;
    Ok(changefeed_dynamodb::live_kcl_leases(&before, &after))
}
