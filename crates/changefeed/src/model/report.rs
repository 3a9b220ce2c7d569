//! What a host publishes about itself with its heartbeat: [`HostReport`].
//!
//! A strategy that balances measured load (rather than lease counts) needs, for every host, its
//! capacity and the load of each lease it holds, and a fleet whose hosts differ needs each
//! host's own lease limits. The host writes them in the heartbeat row it renews anyway, so
//! they cost no write of their own; the stores keep the text as they get it
//! ([`super::Heartbeat::report`]) and only the readers parse it.
//!
//! Size: about 20 bytes, plus about 45 per lease held (its partition id and three numbers
//! rounded to three significant digits). A host of 100 leases writes a row of about 5 KB: on
//! DynamoDB, which bills a write per KB of the item, five write units per renewal instead of
//! one. So a host publishes loads only when asked to
//! ([`crate::processor::ProcessorBuilder::publish_load`]); its capacity and limits alone are a
//! few bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::PartitionId;

/// The format [`HostReport::to_json`] writes. A reader ignores a report of a version it does
/// not know rather than misreading it.
pub const REPORT_VERSION: u32 = 1;

/// The load one lease puts on its owner, as moving averages over the last half minute or so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseLoad {
    /// Records delivered to the handler per second.
    #[serde(rename = "r")]
    pub records_per_second: f64,
    /// Bytes of record data delivered per second.
    #[serde(rename = "b")]
    pub bytes_per_second: f64,
    /// Handler busy time per second: the fraction of the time a handler call of this lease
    /// was running (above 1 when calls run side by side, with key concurrency).
    #[serde(rename = "u")]
    pub busy: f64,
}

/// What a host publishes with its heartbeat; see the module doc.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostReport {
    /// [`REPORT_VERSION`] when written.
    #[serde(rename = "v")]
    pub version: u32,
    /// The host's capacity weight: how much load it takes relative to the others (default
    /// its available cores).
    #[serde(rename = "c")]
    pub capacity: f64,
    /// This host's own `min_leases`, if it sets one.
    #[serde(rename = "min", default, skip_serializing_if = "Option::is_none")]
    pub min_leases: Option<usize>,
    /// This host's own `max_leases`, if it sets one.
    #[serde(rename = "max", default, skip_serializing_if = "Option::is_none")]
    pub max_leases: Option<usize>,
    /// The measured load of each lease it holds, when it publishes loads.
    #[serde(rename = "l", default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leases: BTreeMap<PartitionId, LeaseLoad>,
}

/// Why a report could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    /// Not a report at all.
    #[error("not a host report: {0}")]
    Malformed(String),
    /// Written by a newer format.
    #[error("host report version {0} is not known to this version of changefeed")]
    UnknownVersion(u32),
}

impl HostReport {
    /// A report of `capacity` and nothing else.
    pub fn new(capacity: f64) -> Self {
        HostReport {
            version: REPORT_VERSION,
            capacity,
            min_leases: None,
            max_leases: None,
            leases: BTreeMap::new(),
        }
    }

    /// The lease limits this report publishes, if it sets any.
    pub fn limits(&self) -> Option<super::HostLimits> {
        super::HostLimits {
            min_leases: self.min_leases,
            max_leases: self.max_leases,
        }
        .some()
    }

    /// The text stored in the heartbeat row: compact JSON, each figure rounded to three
    /// significant digits (a moving average carries no more).
    pub fn to_json(&self) -> String {
        let mut rounded = self.clone();
        rounded.capacity = round3(rounded.capacity);
        for load in rounded.leases.values_mut() {
            load.records_per_second = round3(load.records_per_second);
            load.bytes_per_second = round3(load.bytes_per_second);
            load.busy = round3(load.busy);
        }
        // A struct of numbers and strings always serialises.
        serde_json::to_string(&rounded).unwrap_or_default()
    }

    /// Reads a report written by [`HostReport::to_json`].
    ///
    /// # Errors
    /// [`ReportError::Malformed`] if `text` is not a report, [`ReportError::UnknownVersion`]
    /// if a newer format wrote it.
    pub fn parse(text: &str) -> Result<Self, ReportError> {
        #[derive(Deserialize)]
        struct VersionOnly {
            v: u32,
        }
        let version: VersionOnly =
            serde_json::from_str(text).map_err(|e| ReportError::Malformed(e.to_string()))?;
        if version.v != REPORT_VERSION {
            return Err(ReportError::UnknownVersion(version.v));
        }
        serde_json::from_str(text).map_err(|e| ReportError::Malformed(e.to_string()))
    }
}

/// `x` rounded to three significant digits (finite values; others become 0).
fn round3(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return 0.0;
    }
    let magnitude = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(2 - magnitude);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str) -> PartitionId {
        PartitionId::new(id).expect("a valid partition id")
    }

    #[test]
    fn a_report_round_trips_rounded_to_three_digits() {
        let mut r = HostReport::new(2.0);
        r.max_leases = Some(40);
        r.leases.insert(
            p("shardId-000000000007"),
            LeaseLoad {
                records_per_second: 123.456_7,
                bytes_per_second: 98_765.4,
                busy: 0.123_456,
            },
        );
        let text = r.to_json();
        assert_eq!(
            text,
            r#"{"v":1,"c":2.0,"max":40,"l":{"shardId-000000000007":{"r":123.0,"b":98800.0,"u":0.123}}}"#
        );
        let back = HostReport::parse(&text).expect("parses");
        assert_eq!(back.max_leases, Some(40));
        assert_eq!(back.min_leases, None);
        assert_eq!(back.leases[&p("shardId-000000000007")].busy, 0.123);
    }

    #[test]
    fn a_report_of_capacity_alone_is_a_few_bytes() {
        assert_eq!(HostReport::new(4.0).to_json(), r#"{"v":1,"c":4.0}"#);
    }

    #[test]
    fn a_newer_or_broken_report_is_refused_by_name() {
        assert_eq!(
            HostReport::parse(r#"{"v":2,"c":1.0}"#),
            Err(ReportError::UnknownVersion(2))
        );
        assert!(matches!(
            HostReport::parse("not json"),
            Err(ReportError::Malformed(_))
        ));
        assert!(matches!(
            HostReport::parse(r#"{"v":1,"c":"x"}"#),
            Err(ReportError::Malformed(_))
        ));
    }

    #[test]
    fn rounding_keeps_three_significant_digits() {
        assert_eq!(round3(0.0), 0.0);
        assert_eq!(round3(f64::NAN), 0.0);
        assert_eq!(round3(1234.0), 1230.0);
        assert_eq!(round3(0.000_123_45), 0.000_123);
        assert_eq!(round3(-5.678), -5.68);
    }
}
