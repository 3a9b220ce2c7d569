//! The KCL MultiLangDaemon's `.properties` file, read into `changefeed run`'s settings, so
//! that the file an application already has starts it (`run --properties FILE`).
//!
//! | KCL property | `run` setting |
//! |---|---|
//! | `executableName` (required) | `handler` (run with `sh -c`) |
//! | `streamArn` or `streamName` (one required), `kinesisEndpoint`, `regionName` | `source = kinesis://STREAM?endpoint=…&region=…`; the ARN gives the stream and its region and wins over `streamName`, as in the KCL |
//! | `streamName` or `streamArn` holding a DynamoDB stream ARN (as the DynamoDB Streams adapter's `StreamsMultiLangDaemon` takes it), `kinesisEndpoint` | `source = dynamodb-streams://TABLE?stream=ARN&endpoint=…&region=…`: the adapter's client stands where the Kinesis client stood, so it takes the Kinesis endpoint, and `regionName` (else the ARN's region) |
//! | `applicationName` (required), `dynamoDBEndpoint`, `regionName` | `store = dynamodb://APPLICATION?…` and `group = APPLICATION` |
//! | `initialPositionInStream` | `start_position`: `TRIM_HORIZON` = beginning, `LATEST` = now (any case, as the KCL reads it) |
//! | `initialPositionInStreamExtended` | `start_position = at:MILLIS`: the KCL's `AT_TIMESTAMP`, given as whole seconds since the epoch |
//! | `maxRecords` | `max_batch_size` |
//! | `idleTimeBetweenReadsInMillis` | `poll_delay` |
//! | `failoverTimeMillis` | `lease_expiry` |
//! | `shardSyncIntervalMillis` | `sync_interval` |
//! | `workerId` | `host` |
//! | `retrievalMode` | `FANOUT` = `source = kinesis://…?retrieval=fanout&consumer=…` (enhanced fan-out), `POLLING` = polling (any case); absent = polling, with a warning naming `retrievalMode` (the KCL's default is `FANOUT`) |
//! | `consumerName` | the fan-out consumer's name; `applicationName` when absent, as in the KCL |
//!
//! A setting given as a flag or `CHANGEFEED_*` variable wins over the file; the file wins over
//! `--config`. A `--store dynamodb://…` or `--source kinesis://…` without its own `endpoint=`
//! or `region=` keeps the file's, so pointing the leases at another table does not send them
//! to another server.
//!
//! Without `retrievalMode` the KCL reads by enhanced fan-out; `run` polls, and says so at
//! start: a fan-out consumer is a resource on the stream, billed per shard-hour, that `run`
//! does not register unasked.
//!
//! Every other key of the KCL 2.x/3.x daemon (credentials providers, metrics, polling and
//! KCL 3.x balancing tuning …, [`keys`]) has no meaning here: it is accepted and listed once
//! at start. A key the KCL does not know is ignored by the KCL; here a near miss of a known
//! key (`kinesisEndpiont`) is refused naming both, since the KCL would silently use its
//! default (real AWS endpoints, for an endpoint key), and any other unknown key is warned
//! about with the closest known key.

mod keys;

use std::collections::BTreeMap;

use tracing::{info, warn};

use crate::usage::UsageError;
use keys::Key;

/// What reading the file found to report once the host's logging is up.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Notes {
    /// The file's name.
    file: String,
    /// KCL keys with no meaning here, in file order.
    not_applicable: Vec<String>,
    /// Keys the KCL does not know, each with the closest known key.
    unknown: Vec<(String, &'static str)>,
    /// The stream `streamArn` named: name, region, account.
    arn: Option<(String, String, String)>,
    /// `retrievalMode` is absent: the KCL would read by fan-out, `run` polls.
    retrieval_default: bool,
}

impl Notes {
    /// Logs what the file held that `run` does not use.
    pub(crate) fn log(&self) {
        if let Some((stream, region, account)) = &self.arn {
            info!(file = %self.file, stream = %stream, region = %region, account = %account, "the stream from streamArn");
        }
        if self.retrieval_default {
            warn!(file = %self.file, "retrievalMode is not set: reading by polling (GetRecords), where the KCL would read by enhanced fan-out; set retrievalMode = FANOUT for fan-out (consumer: consumerName, else applicationName), or retrievalMode = POLLING to keep polling without this warning");
        }
        if !self.not_applicable.is_empty() {
            info!(file = %self.file, keys = %self.not_applicable.join(", "), "KCL properties not applicable here, ignored");
        }
        for (key, closest) in &self.unknown {
            warn!(file = %self.file, key = %key, closest = %closest, "not a KCL property, ignored (as the KCL ignores it)");
        }
    }
}

/// A stream named by `streamArn`: `arn:PARTITION:kinesis:REGION:ACCOUNT:stream/NAME`.
#[derive(Debug, PartialEq, Eq)]
struct StreamArn<'a> {
    region: &'a str,
    account: &'a str,
    name: &'a str,
}

/// Reads a Kinesis stream ARN, or says what is wrong with it.
fn stream_arn(arn: &str) -> Result<StreamArn<'_>, String> {
    const FORM: &str = "arn:aws:kinesis:REGION:ACCOUNT:stream/NAME";
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let [prefix, partition, service, region, account, resource] = parts[..] else {
        return Err(format!(
            "\"{}\" is not a stream ARN ({FORM})",
            arn.escape_debug()
        ));
    };
    let rule = |what: &str| {
        Err(format!(
            "\"{}\" is not a stream ARN ({FORM}): {what}",
            arn.escape_debug()
        ))
    };
    if prefix != "arn" || !partition.starts_with("aws") {
        return rule("it must start with arn:aws");
    }
    if service != "kinesis" {
        return rule("the service must be kinesis");
    }
    let region_ok = |r: &str| {
        !r.is_empty()
            && r.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    if !region_ok(region) {
        return rule("the region must be a region name such as us-east-1");
    }
    if account.len() != 12 || !account.bytes().all(|b| b.is_ascii_digit()) {
        return rule("the account must be 12 digits");
    }
    let name_ok = |n: &str| {
        (1..=128).contains(&n.len())
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
    };
    match resource.strip_prefix("stream/") {
        Some(name) if name_ok(name) => Ok(StreamArn {
            region,
            account,
            name,
        }),
        _ => rule("the resource must be stream/NAME (letters, digits, _ . -)"),
    }
}

/// A DynamoDB stream ARN, `arn:PARTITION:dynamodb:REGION:ACCOUNT:table/TABLE/stream/LABEL`,
/// as its table and region; `None` when `arn` does not name the dynamodb service (the
/// caller reads it as a Kinesis stream), the rule broken when it does but is malformed.
fn dynamodb_stream_arn(arn: &str) -> Option<Result<(&str, &str), String>> {
    const FORM: &str = "arn:aws:dynamodb:REGION:ACCOUNT:table/TABLE/stream/LABEL";
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let [prefix, partition, "dynamodb", region, account, resource] = parts[..] else {
        return None;
    };
    let rule = |what: &str| {
        Some(Err(format!(
            "\"{}\" is not a DynamoDB stream ARN ({FORM}): {what}",
            arn.escape_debug()
        )))
    };
    if prefix != "arn" || !partition.starts_with("aws") {
        return rule("it must start with arn:aws");
    }
    if region.is_empty()
        || !region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return rule("the region must be a region name such as us-east-1");
    }
    if account.len() != 12 || !account.bytes().all(|b| b.is_ascii_digit()) {
        return rule("the account must be 12 digits");
    }
    let table = resource
        .strip_prefix("table/")
        .and_then(|r| r.split_once("/stream/"))
        .filter(|(table, label)| {
            (3..=255).contains(&table.len())
                && table
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
                && !label.is_empty()
                && !label.contains(char::is_whitespace)
        });
    match table {
        Some((table, _)) => Some(Ok((table, region))),
        None => rule("the resource must be table/TABLE/stream/LABEL"),
    }
}

/// `url` with `params` (name, value) added to its query where it has none of that name:
/// the file's endpoint and region kept beside a `--store` or `--source` naming its own table
/// or stream.
fn keep_params(url: &str, params: &[(&str, Option<String>)]) -> String {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let has = |name: &str| {
        query
            .split('&')
            .any(|pair| pair.split_once('=').is_some_and(|(k, _)| k == name))
    };
    let mut out = url.to_string();
    for (name, value) in params {
        if let Some(v) = value.as_deref().filter(|v| !v.is_empty()) {
            if !has(name) {
                out.push(if out.contains('?') { '&' } else { '?' });
                out.push_str(&format!("{name}={v}"));
            }
        }
    }
    out
}

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

/// What a KCL properties file sets, as `run` settings (each `None` where the file is silent),
/// for the settings flags and the environment left unset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Properties {
    /// `executableName`.
    pub(crate) handler: String,
    /// The stream, from `streamArn` or `streamName`.
    stream: String,
    /// The Kinesis endpoint, region, retrieval and consumer to keep on any `kinesis://`
    /// source.
    kinesis: [(&'static str, Option<String>); 4],
    /// The source when the file names a DynamoDB stream: `dynamodb-streams://TABLE?stream=ARN…`.
    streams: Option<String>,
    /// `applicationName`: the lease table and the group.
    pub(crate) application: String,
    /// The DynamoDB endpoint and region to keep on any `dynamodb://` store.
    dynamodb: [(&'static str, Option<String>); 2],
    pub(crate) start_position: Option<String>,
    pub(crate) poll_delay: Option<String>,
    pub(crate) lease_expiry: Option<String>,
    pub(crate) sync_interval: Option<String>,
    pub(crate) max_batch_size: Option<String>,
    pub(crate) host: Option<String>,
    /// What to report of the keys it did not use ([`Notes::log`]).
    pub(crate) notes: Notes,
}

impl Properties {
    /// The source: `given` (a flag's) if it is not Kinesis; a `kinesis://` one keeps the
    /// file's endpoint and region unless it names its own; else the file's stream.
    pub(crate) fn source(&self, given: Option<String>) -> String {
        match given {
            // A source that chooses its own retrieval takes neither the file's mode nor its
            // consumer.
            Some(s) if s.starts_with("kinesis://") && s.contains("retrieval=") => {
                keep_params(&s, &self.kinesis[..2])
            }
            Some(s) if s.starts_with("kinesis://") => keep_params(&s, &self.kinesis),
            Some(s) => s,
            None => match &self.streams {
                Some(url) => url.clone(),
                None => keep_params(&format!("kinesis://{}", self.stream), &self.kinesis),
            },
        }
    }

    /// The store, as [`Properties::source`] does for the source: the application's table.
    pub(crate) fn store(&self, given: Option<String>) -> String {
        match given {
            Some(s) if s.starts_with("dynamodb://") => keep_params(&s, &self.dynamodb),
            Some(s) => s,
            None => keep_params(&format!("dynamodb://{}", self.application), &self.dynamodb),
        }
    }
}

/// Reads the KCL properties file `name` with text `text`.
///
/// # Errors
/// [`UsageError`] naming the file and property when a required one is missing, a value is not
/// understood, `streamArn` and `streamName` name different streams, or a key is a near miss of
/// a known one.
pub(crate) fn read(name: &str, text: &str) -> Result<Properties, UsageError> {
    let entries = parse(text);
    let bad = |key: &str, rule: &str| UsageError(format!("properties file {name}: {key}: {rule}"));
    let mut notes = Notes {
        file: name.to_string(),
        ..Notes::default()
    };
    let mut props: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, value) in &entries {
        match keys::classify(key) {
            Key::Used(known) => {
                props.insert(known, value.as_str());
            }
            Key::NotApplicable => {
                if !notes.not_applicable.contains(key) {
                    notes.not_applicable.push(key.clone());
                }
            }
            Key::Unknown { near: Some(known) } => {
                return Err(bad(
                    key,
                    &format!("not a KCL property; did you mean {known}? (the KCL would ignore it and use its default: fix the key, or remove it)"),
                ))
            }
            Key::Unknown { near: None } => notes.unknown.push((key.clone(), keys::closest(key))),
        }
    }
    let given = |key: &str| props.get(key).copied().filter(|v| !v.is_empty());
    let required = |key: &str| {
        given(key)
            .map(str::to_string)
            .ok_or_else(|| bad(key, "is required (the KCL needs it too)"))
    };
    let region = given("regionName");
    let handler = required("executableName")?;
    let owned = |v: Option<&str>| v.map(str::to_string);
    let dynamodb_stream = ["streamArn", "streamName"].into_iter().find_map(|key| {
        let arn = given(key)?;
        Some((key, arn, dynamodb_stream_arn(arn)?))
    });
    let streams = match dynamodb_stream {
        Some((key, arn, parsed)) => {
            let (table, arn_region) = parsed.map_err(|rule| bad(key, &rule))?;
            let params = [
                ("endpoint", owned(given("kinesisEndpoint"))),
                // The adapter reads with the regionName client, whatever region the ARN
                // names (DynamoDB Local's ARNs name "ddblocal").
                ("region", Some(region.unwrap_or(arn_region).to_string())),
            ];
            Some(keep_params(
                &format!("dynamodb-streams://{table}?stream={arn}"),
                &params,
            ))
        }
        None => None,
    };
    let (stream, stream_region) = match given("streamArn").filter(|_| streams.is_none()) {
        Some(arn) => {
            let parsed = stream_arn(arn).map_err(|rule| bad("streamArn", &rule))?;
            if let Some(other) = given("streamName").filter(|s| *s != parsed.name) {
                return Err(bad(
                    "streamArn",
                    &format!(
                        "names stream \"{}\" but streamName names \"{}\": give one, or the same stream in both",
                        parsed.name,
                        other.escape_debug()
                    ),
                ));
            }
            if let Some(r) = region.filter(|r| *r != parsed.region) {
                return Err(bad(
                    "streamArn",
                    &format!(
                        "names a stream in region {} but regionName is {}: the KCL reads the stream with the regionName client",
                        parsed.region,
                        r.escape_debug()
                    ),
                ));
            }
            notes.arn = Some((
                parsed.name.to_string(),
                parsed.region.to_string(),
                parsed.account.to_string(),
            ));
            (parsed.name.to_string(), Some(parsed.region))
        }
        None if streams.is_some() => (String::new(), region),
        None => (
            given("streamName").map(str::to_string).ok_or_else(|| {
                bad(
                    "streamName",
                    "is required, or streamArn (the KCL needs one of them too)",
                )
            })?,
            region,
        ),
    };
    let application = required("applicationName")?;
    let fanout = match given("retrievalMode") {
        None => {
            notes.retrieval_default = true;
            false
        }
        Some(v) if v.eq_ignore_ascii_case("FANOUT") => true,
        Some(v) if v.eq_ignore_ascii_case("POLLING") => false,
        Some(v) => {
            return Err(bad(
                "retrievalMode",
                &format!("\"{}\" must be FANOUT or POLLING", v.escape_debug()),
            ))
        }
    };
    let consumer = fanout.then(|| given("consumerName").unwrap_or(&application).to_string());
    let kinesis = [
        ("endpoint", owned(given("kinesisEndpoint"))),
        ("region", owned(stream_region)),
        ("retrieval", fanout.then(|| "fanout".to_string())),
        ("consumer", consumer),
    ];
    let dynamodb = [
        ("endpoint", owned(given("dynamoDBEndpoint"))),
        ("region", owned(region)),
    ];
    let start_position = start_position(&entries, bad)?;
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
    Ok(Properties {
        handler,
        stream,
        kinesis,
        streams,
        application,
        dynamodb,
        start_position,
        poll_delay: millis("idleTimeBetweenReadsInMillis")?,
        lease_expiry: millis("failoverTimeMillis")?,
        sync_interval: millis("shardSyncIntervalMillis")?,
        max_batch_size: props.get("maxRecords").map(|n| n.to_string()),
        host: owned(given("workerId")),
        notes,
    })
}

#[cfg(test)]
mod tests;
