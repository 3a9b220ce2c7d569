//! The KCL MultiLangDaemon's `.properties` file, read into `changefeed run`'s settings, so
//! that the file an application already has starts it (`run --properties FILE`).
//!
//! | KCL property | `run` setting |
//! |---|---|
//! | `executableName` (required) | `handler` (run with `sh -c`) |
//! | `streamName` (required), `kinesisEndpoint`, `regionName` | `source = kinesis://STREAM?endpoint=…&region=…` |
//! | `applicationName` (required), `dynamoDBEndpoint`, `regionName` | `store = dynamodb://APPLICATION?…` and `group = APPLICATION` |
//! | `initialPositionInStream` | `start_position`: `TRIM_HORIZON` = beginning, `LATEST` = now (any case, as the KCL reads it) |
//! | `initialPositionInStreamExtended` | `start_position = at:MILLIS`: the KCL's `AT_TIMESTAMP`, given as whole seconds since the epoch |
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
/// comments, a trailing backslash continuing a line. The entries come in file order (a key
/// given twice appears twice; the later one wins, as in `java.util.Properties`).
fn parse(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
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
        out.push((key.trim().to_string(), value.trim().to_string()));
    }
    out
}

/// The position the KCL 2.x MultiLangDaemon starts new leases at, from its two properties,
/// as a `start_position` value (`None`: neither is given).
///
/// The daemon sets each property on its configuration in turn
/// (`MultiLangDaemonConfiguration`): `initialPositionInStream` (`TRIM_HORIZON` or `LATEST`,
/// upper-cased first; `AT_TIMESTAMP` it refuses, "Invalid InitialPosition") and
/// `initialPositionInStreamExtended`, which it reads as `Long.parseLong` seconds since the
/// epoch and turns into `AT_TIMESTAMP` at that second; both set the one field, so the later
/// line of the file wins, as it does in the daemon. Unlike the daemon, `initialPositionInStream
/// = AT_TIMESTAMP` is accepted when `initialPositionInStreamExtended` gives the time (the
/// combination's meaning is plain), and refused with the property to add when it does not.
fn start_position(
    entries: &[(String, String)],
    bad: impl Fn(&str, &str) -> UsageError,
) -> Result<Option<String>, UsageError> {
    const POSITION: &str = "initialPositionInStream";
    const EXTENDED: &str = "initialPositionInStreamExtended";
    let has_time = entries.iter().any(|(k, _)| k == EXTENDED);
    let mut start = None;
    for (key, value) in entries {
        if key == EXTENDED {
            let millis = value
                .parse::<i64>()
                .ok()
                .and_then(|secs| secs.checked_mul(1000))
                .ok_or_else(|| {
                    bad(
                        EXTENDED,
                        &format!(
                            "\"{}\" is not a time: the KCL reads whole seconds since the epoch (e.g. 1636609142)",
                            value.escape_debug()
                        ),
                    )
                })?;
            start = Some(format!("at:{millis}"));
        } else if key == POSITION {
            match value.to_ascii_uppercase().as_str() {
                "TRIM_HORIZON" => start = Some("beginning".into()),
                "LATEST" => start = Some("now".into()),
                // The time comes from the other property, whichever line is later.
                "AT_TIMESTAMP" if has_time => {}
                "AT_TIMESTAMP" => {
                    return Err(bad(
                        POSITION,
                        &format!("AT_TIMESTAMP needs the time in {EXTENDED} (whole seconds since the epoch, e.g. {EXTENDED} = 1636609142), as the KCL reads it"),
                    ))
                }
                _ => {
                    return Err(bad(
                        POSITION,
                        &format!(
                            "\"{}\" must be TRIM_HORIZON or LATEST (or give the time in {EXTENDED})",
                            value.escape_debug()
                        ),
                    ))
                }
            }
        }
    }
    Ok(start)
}

/// Fills the settings of `args` that flags and the environment left unset from the KCL
/// properties file `name` with text `text`.
///
/// # Errors
/// [`UsageError`] naming the file and property when a required one is missing or a value is
/// not understood.
pub(crate) fn apply(args: &mut RunArgs, name: &str, text: &str) -> Result<(), UsageError> {
    let entries = parse(text);
    let props: BTreeMap<&str, &str> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let bad = |key: &str, rule: &str| UsageError(format!("properties file {name}: {key}: {rule}"));
    let required = |key: &str| {
        props
            .get(key)
            .filter(|v| !v.is_empty())
            .map(|v| v.to_string())
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
    if let Some(start) = start_position(&entries, bad)? {
        fill(&mut args.start_position, start);
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
        fill(&mut args.max_batch_size, n.to_string());
    }
    if let Some(w) = props.get("workerId").filter(|v| !v.is_empty()) {
        fill(&mut args.host, w.to_string());
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

    /// The start position `apply` makes of `FILE` with `lines` appended.
    fn start(lines: &str) -> Result<Option<String>, String> {
        let mut args = RunArgs::default();
        apply(&mut args, "a.properties", &format!("{FILE}{lines}"))
            .map(|()| args.start_position)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_start_time_is_read_as_the_kcl_reads_it() {
        // The KCL 2.5.8 MultiLangDaemon reads initialPositionInStreamExtended as whole seconds
        // since the epoch (AT_TIMESTAMP at that second), upper-cases initialPositionInStream,
        // and lets the later of the two lines win.
        assert_eq!(
            start("initialPositionInStreamExtended = 1636609142\n"),
            Ok(Some("at:1636609142000".into()))
        );
        assert_eq!(
            start("initialPositionInStreamExtended = -5\n"),
            Ok(Some("at:-5000".into()))
        );
        assert_eq!(
            start("initialPositionInStream = latest\n"),
            Ok(Some("now".into()))
        );
        let time_then_position =
            "initialPositionInStreamExtended = 1636609142\ninitialPositionInStream = LATEST\n";
        assert_eq!(start(time_then_position), Ok(Some("now".into())));
        let with_at = "initialPositionInStream = AT_TIMESTAMP\ninitialPositionInStreamExtended = 1636609142\n";
        assert_eq!(start(with_at), Ok(Some("at:1636609142000".into())));
        let at_first = "initialPositionInStreamExtended = 1636609142\ninitialPositionInStream = AT_TIMESTAMP\n";
        assert_eq!(start(at_first), Ok(Some("at:1636609142000".into())));
    }

    #[test]
    fn a_bad_start_time_names_the_property() {
        for bad in [
            "2021-11-11T05:39:02Z",
            "1636609142.5",
            "",
            "99999999999999999999",
        ] {
            let err = start(&format!("initialPositionInStreamExtended = {bad}\n"))
                .expect_err("not seconds");
            assert_eq!(
                err,
                format!("properties file a.properties: initialPositionInStreamExtended: \"{bad}\" is not a time: the KCL reads whole seconds since the epoch (e.g. 1636609142)")
            );
        }
        let err = start("initialPositionInStream = AT_TIMESTAMP\n").expect_err("no time");
        assert!(
            err.contains("initialPositionInStream: AT_TIMESTAMP needs the time in initialPositionInStreamExtended"),
            "{err}"
        );
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
