//! The KCL MultiLangDaemon's `.properties` file, read into `changefeed run`'s settings, so
//! that the file an application already has starts it (`run --properties FILE`).
//!
//! | KCL property | `run` setting |
//! |---|---|
//! | `executableName` (required) | `handler` (run with `sh -c`) |
//! | `streamName` (required), `kinesisEndpoint`, `regionName` | `source = kinesis://STREAM?endpoint=…&region=…` |
//! | `applicationName` (required), `dynamoDBEndpoint`, `regionName` | `store = dynamodb://APPLICATION?…` and `group = APPLICATION` |
//! | `initialPositionInStream` | `start_position`: `TRIM_HORIZON` = beginning, `LATEST` = now |
//! | `maxRecords` | `max_batch_size` |
//! | `idleTimeBetweenReadsInMillis` | `poll_delay` |
//! | `failoverTimeMillis` | `lease_expiry` |
//! | `shardSyncIntervalMillis` | `sync_interval` |
//! | `workerId` | `host` |
//!
//! Every other property (credentials providers, metrics, retrieval tuning …) has no meaning
//! here and is ignored. A setting given as a flag or `CHANGEFEED_*` variable wins over the
//! file; the file wins over `--config`.

use std::collections::BTreeMap;

use crate::config::{RunArgs, UsageError};

/// Reads a Java properties text: `key=value`, `key: value` or `key value` lines, `#` and `!`
/// comments, a trailing backslash continuing a line.
fn parse(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut logical = String::new();
    for raw in text.lines() {
        let line = raw.trim_start();
        if logical.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with('!'))
        {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                logical.push_str(head);
                continue;
            }
            None => logical.push_str(line),
        }
        let entry = std::mem::take(&mut logical);
        let split = entry
            .find(['=', ':'])
            .or_else(|| entry.find(char::is_whitespace));
        let (key, value) = match split {
            Some(i) => (&entry[..i], &entry[i + 1..]),
            None => (entry.as_str(), ""),
        };
        out.insert(key.trim().to_string(), value.trim().to_string());
    }
    out
}

/// Fills the settings of `args` that flags and the environment left unset from the KCL
/// properties file `name` with text `text`.
///
/// # Errors
/// [`UsageError`] naming the file and property when a required one is missing or a value is
/// not understood.
pub(crate) fn apply(args: &mut RunArgs, name: &str, text: &str) -> Result<(), UsageError> {
    let props = parse(text);
    let bad = |key: &str, rule: &str| UsageError(format!("properties file {name}: {key}: {rule}"));
    let required = |key: &str| {
        props
            .get(key)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or_else(|| bad(key, "is required (the KCL needs it too)"))
    };
    let query = |endpoint_key: &str| {
        let mut q = Vec::new();
        if let Some(e) = props.get(endpoint_key).filter(|v| !v.is_empty()) {
            q.push(format!("endpoint={e}"));
        }
        if let Some(r) = props.get("regionName").filter(|v| !v.is_empty()) {
            q.push(format!("region={r}"));
        }
        if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        }
    };
    let fill = |slot: &mut Option<String>, value: String| {
        if slot.is_none() {
            *slot = Some(value);
        }
    };
    fill(&mut args.handler, required("executableName")?);
    let stream = required("streamName")?;
    fill(
        &mut args.source,
        format!("kinesis://{stream}{}", query("kinesisEndpoint")),
    );
    let application = required("applicationName")?;
    fill(
        &mut args.store,
        format!("dynamodb://{application}{}", query("dynamoDBEndpoint")),
    );
    fill(&mut args.group, application);
    if let Some(position) = props.get("initialPositionInStream") {
        let start = match position.as_str() {
            "TRIM_HORIZON" => "beginning",
            "LATEST" => "now",
            "AT_TIMESTAMP" => {
                return Err(bad(
                    "initialPositionInStream",
                    "AT_TIMESTAMP is not read from the file; pass --start-position at:MILLIS",
                ))
            }
            other => {
                return Err(bad(
                    "initialPositionInStream",
                    &format!(
                        "\"{}\" must be TRIM_HORIZON or LATEST",
                        other.escape_debug()
                    ),
                ))
            }
        };
        fill(&mut args.start_position, start.into());
    }
    let millis = |key: &str| -> Result<Option<String>, UsageError> {
        match props.get(key) {
            None => Ok(None),
            Some(v) => v
                .parse::<u64>()
                .map(|n| Some(format!("{n}ms")))
                .map_err(|_| {
                    bad(
                        key,
                        &format!("\"{}\" is not milliseconds", v.escape_debug()),
                    )
                }),
        }
    };
    if let Some(d) = millis("idleTimeBetweenReadsInMillis")? {
        fill(&mut args.poll_delay, d);
    }
    if let Some(d) = millis("failoverTimeMillis")? {
        fill(&mut args.lease_expiry, d);
    }
    if let Some(d) = millis("shardSyncIntervalMillis")? {
        fill(&mut args.sync_interval, d);
    }
    if let Some(n) = props.get("maxRecords") {
        fill(&mut args.max_batch_size, n.clone());
    }
    if let Some(w) = props.get("workerId").filter(|v| !v.is_empty()) {
        fill(&mut args.host, w.clone());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# The sample.properties of amazon-kinesis-client-python, trimmed
executableName = python3 sample_kclpy_app.py
streamName=orders
applicationName: orders-app
processingLanguage = python/3.11
initialPositionInStream = TRIM_HORIZON
AWSCredentialsProvider = DefaultCredentialsProvider
regionName = us-east-1
kinesisEndpoint = http://127.0.0.1:4568
dynamoDBEndpoint = http://127.0.0.1:8000
maxRecords = 500
idleTimeBetweenReadsInMillis \\
    = 250
failoverTimeMillis = 10000
";

    #[test]
    fn a_kcl_properties_file_fills_the_run_settings() {
        let mut args = RunArgs::default();
        apply(&mut args, "app.properties", FILE).expect("valid");
        assert_eq!(args.handler.as_deref(), Some("python3 sample_kclpy_app.py"));
        assert_eq!(
            args.source.as_deref(),
            Some("kinesis://orders?endpoint=http://127.0.0.1:4568&region=us-east-1")
        );
        assert_eq!(
            args.store.as_deref(),
            Some("dynamodb://orders-app?endpoint=http://127.0.0.1:8000&region=us-east-1")
        );
        assert_eq!(args.group.as_deref(), Some("orders-app"));
        assert_eq!(args.start_position.as_deref(), Some("beginning"));
        assert_eq!(args.max_batch_size.as_deref(), Some("500"));
        assert_eq!(args.poll_delay.as_deref(), Some("250ms"));
        assert_eq!(args.lease_expiry.as_deref(), Some("10000ms"));
    }

    #[test]
    fn flags_win_and_bad_properties_are_named() {
        let mut args = RunArgs {
            group: Some("mine".into()),
            ..RunArgs::default()
        };
        apply(&mut args, "a.properties", FILE).expect("valid");
        assert_eq!(args.group.as_deref(), Some("mine"));
        let err = apply(&mut RunArgs::default(), "a.properties", "streamName = s\n")
            .expect_err("no executable");
        assert_eq!(
            err.to_string(),
            "properties file a.properties: executableName: is required (the KCL needs it too)"
        );
        let text = format!("{FILE}initialPositionInStream = SOMEWHERE\n");
        let err = apply(&mut RunArgs::default(), "a.properties", &text).expect_err("position");
        assert!(
            err.to_string()
                .contains("initialPositionInStream: \"SOMEWHERE\""),
            "{err}"
        );
        let text = format!("{FILE}failoverTimeMillis = soon\n");
        let err = apply(&mut RunArgs::default(), "a.properties", &text).expect_err("millis");
        assert!(
            err.to_string().contains("failoverTimeMillis: \"soon\""),
            "{err}"
        );
    }
}
