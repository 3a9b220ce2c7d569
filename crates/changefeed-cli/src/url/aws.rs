//! `dynamodb://`, `dynamodb-streams://` and `kinesis://` URLs: a table or stream and the
//! overrides of the standard AWS configuration chain.

use changefeed_dynamodb::RecordShape;
use changefeed_kinesis::Retrieval;

use super::parse_timeout;
use crate::usage::UsageError;

/// A `dynamodb://`, `dynamodb-streams://` or `kinesis://` URL: the table or stream, and
/// optional overrides of the standard AWS configuration chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsUrl {
    /// The table or stream name.
    pub name: String,
    /// `?endpoint=URL`: an endpoint overriding the region's (a local server).
    pub endpoint: Option<String>,
    /// `?region=R`.
    pub region: Option<String>,
    /// `?connect_timeout=`: opening a connection.
    pub connect_timeout: Option<std::time::Duration>,
    /// `?request_timeout=`: one attempt of one call.
    pub request_timeout: Option<std::time::Duration>,
    /// `?stream=ARN` (`dynamodb-streams://` only): the stream to read, instead of the table's
    /// latest.
    pub stream: Option<String>,
    /// `?record=plain|adapter` (`dynamodb-streams://` only): the shape of each record's data;
    /// `None` when not given, for `run` to choose by its protocol.
    pub record: Option<RecordShape>,
    /// `?retrieval=fanout&consumer=NAME` or `?retrieval=polling` (`kinesis://` only): how the
    /// shards are read; polling when absent.
    pub retrieval: Retrieval,
}

impl AwsUrl {
    pub(super) fn parse(setting: &str, scheme: &str, rest: &str) -> Result<Self, UsageError> {
        let bad = |rule: String| UsageError(format!("{setting}: {rule}"));
        let (name, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut url = AwsUrl {
            name: name.to_string(),
            endpoint: None,
            region: None,
            connect_timeout: None,
            request_timeout: None,
            stream: None,
            record: None,
            retrieval: Retrieval::Polling,
        };
        let mut retrieval: Option<&str> = None;
        let mut consumer: Option<&str> = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("endpoint", v)) if !v.is_empty() => {
                    check_endpoint(v).map_err(|rule| {
                        bad(format!(
                            "{scheme}:// parameter endpoint: \"{}\" {rule}",
                            v.escape_debug()
                        ))
                    })?;
                    url.endpoint = Some(v.to_string());
                }
                Some(("region", v)) if !v.is_empty() => {
                    if !v
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    {
                        return Err(bad(format!(
                            "{scheme}:// parameter region: \"{}\" must be a region name such as eu-west-1",
                            v.escape_debug()
                        )));
                    }
                    url.region = Some(v.to_string());
                }
                Some((name @ ("connect_timeout" | "request_timeout"), v)) => {
                    let d = parse_timeout(v).map_err(|rule| {
                        bad(format!(
                            "{scheme}:// parameter {name}: \"{}\" {rule}",
                            v.escape_debug()
                        ))
                    })?;
                    if name == "connect_timeout" {
                        url.connect_timeout = Some(d);
                    } else {
                        url.request_timeout = Some(d);
                    }
                }
                Some(("stream", v)) if scheme == "dynamodb-streams" => {
                    // A stream ARN: arn:PARTITION:dynamodb:REGION:ACCOUNT:table/T/stream/LABEL.
                    let ok = v.starts_with("arn:")
                        && v.contains(":table/")
                        && v.contains("/stream/")
                        && !v.contains(char::is_whitespace);
                    if !ok {
                        return Err(bad(format!(
                            "dynamodb-streams:// parameter stream: \"{}\" must be a stream ARN such as arn:aws:dynamodb:eu-west-1:123456789012:table/orders/stream/2024-01-01T00:00:00.000",
                            v.escape_debug()
                        )));
                    }
                    url.stream = Some(v.to_string());
                }
                Some(("record", v)) if scheme == "dynamodb-streams" => {
                    url.record = Some(RecordShape::parse(v).ok_or_else(|| {
                        bad(format!(
                            "dynamodb-streams:// parameter record: \"{}\" must be plain (one JSON document of the change) or adapter (the KCL DynamoDB Streams adapter's typed record)",
                            v.escape_debug()
                        ))
                    })?);
                }
                Some(("retrieval", v)) if scheme == "kinesis" => {
                    if !matches!(v, "fanout" | "polling") {
                        return Err(bad(format!(
                            "kinesis:// parameter retrieval: \"{}\" must be fanout (enhanced fan-out, with consumer=NAME) or polling",
                            v.escape_debug()
                        )));
                    }
                    retrieval = Some(v);
                }
                Some(("consumer", v)) if scheme == "kinesis" => {
                    if !consumer_name_ok(v) {
                        return Err(bad(format!(
                            "kinesis:// parameter consumer: \"{}\" must be 1 to 128 characters of A-Z, a-z, 0-9, '_', '-' and '.'",
                            v.escape_debug()
                        )));
                    }
                    consumer = Some(v);
                }
                _ => {
                    let stream = match scheme {
                        "dynamodb-streams" => ", ?stream=ARN, ?record=plain|adapter",
                        "kinesis" => ", ?retrieval=fanout|polling, ?consumer=NAME",
                        _ => "",
                    };
                    return Err(bad(format!(
                        "{scheme}:// accepts only ?endpoint=URL, ?region=R{stream}, ?connect_timeout=DURATION and ?request_timeout=DURATION, got \"{}\"",
                        pair.escape_debug()
                    )));
                }
            }
        }
        url.retrieval = match (retrieval, consumer) {
            (Some("fanout"), Some(c)) => Retrieval::FanOut {
                consumer_name: c.to_string(),
            },
            (Some("fanout"), None) => {
                return Err(bad(
                    "kinesis:// parameter retrieval=fanout needs consumer=NAME, the stream consumer to register or reuse".to_string(),
                ))
            }
            (_, Some(_)) => {
                return Err(bad(
                    "kinesis:// parameter consumer is for enhanced fan-out: add retrieval=fanout"
                        .to_string(),
                ))
            }
            _ => Retrieval::Polling,
        };
        if name.is_empty() || name.contains('/') {
            return Err(bad(format!(
                "{scheme}:// needs a name without '/', e.g. {scheme}://orders"
            )));
        }
        if scheme == "kinesis"
            && name
                .split(',')
                .any(|s| s.is_empty() || s.contains(changefeed::source::STREAM_SEPARATOR))
        {
            return Err(bad(format!(
                "kinesis:// takes one stream or a comma-separated list without empty names or ':', got \"{}\"",
                name.escape_debug()
            )));
        }
        // AWS's naming rules, so a bad name is a usage error here, not a service error later.
        let (what, lengths) = match scheme {
            "kinesis" => ("stream", 1..=128),
            _ => ("table", 3..=255),
        };
        for one in name.split(',') {
            let chars_ok = one
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !chars_ok || !lengths.contains(&one.len()) {
                return Err(bad(format!(
                    "{scheme}:// {what} name \"{}\" must be {} to {} characters of A-Z, a-z, 0-9, '_', '-' and '.'",
                    one.escape_debug(),
                    lengths.start(),
                    lengths.end()
                )));
            }
        }
        Ok(url)
    }

    /// The SDK options: endpoint, region and timeouts as given, the rest from the AWS chain.
    pub fn options(&self) -> changefeed_dynamodb::AwsOptions {
        changefeed_dynamodb::AwsOptions {
            endpoint_url: self.endpoint.clone(),
            region: self.region.clone(),
            static_credentials: None,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
        }
    }
}

/// Checks an `?endpoint=` value: `http://` or `https://`, a host, an optional port, and
/// nothing the SDK would refuse only when the first request is sent. Returns the rule broken.
pub(super) fn check_endpoint(v: &str) -> Result<(), &'static str> {
    const RULE: &str = "must be an http:// or https:// URL such as http://127.0.0.1:8000";
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or(RULE)?;
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let (host, port) = match authority.strip_prefix('[') {
        Some(bracketed) => {
            let (ip, after) = bracketed.split_once(']').ok_or(RULE)?;
            if ip.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(RULE);
            }
            match after {
                "" => (ip, None),
                p => (ip, Some(p.strip_prefix(':').ok_or(RULE)?)),
            }
        }
        None => match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let host_ok = !host.is_empty()
        && (authority.starts_with('[')
            || host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')));
    if !host_ok || port.is_some_and(|p| p.parse::<u16>().is_err()) {
        return Err(RULE);
    }
    if rest.contains(char::is_whitespace) {
        return Err(RULE);
    }
    Ok(())
}

/// Kinesis's rule for a stream consumer's name: 1 to 128 of A-Z, a-z, 0-9, '_', '-' and '.'.
pub fn consumer_name_ok(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}
