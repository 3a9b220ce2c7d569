//! The documents of the lease container: their ids, what they hold, and reading them back.
//!
//! Every document of a group has the group's name in `group`, the container's partition key, so
//! a group is one logical partition: its leases are listed by one single-partition query, and
//! an ownership write and the change counter go in one transactional batch.
//!
//! | document | id | fields |
//! |---|---|---|
//! | lease | `lease.` + the partition id, escaped | `partition`, `state`, `owner`, `next_owner`, `continuation`, `start`, `parents`, `properties`, `version`, `changed_at` |
//! | heartbeat | `host.` + the host name, escaped | `host`, `incarnation`, `version`, `written_at` |
//! | change counter | `counter` | `counter`, `deletions_from`; with a membership view `view_version`, `view_leader`, `view_incarnation`, `view_leader_heartbeat`, `view_body`, `view_parts` |
//! | deletion record | `deleted.` + the counter value | `partition`, `deleted_at` |
//! | view body | `view.` + body id + `.` + part | `data`: a slice of the JSON `[live, dead]` |
//!
//! Ids keep letters, digits, `-`, `_` and `.`; any other byte of the UTF-8 text is written `~`
//! and two hex digits, so an id never holds a character Cosmos DB refuses (`/ \ ? #`) nor one
//! a URL must escape. An id that would pass 250 characters is `lease.~~` (or `host.~~`) and
//! the SHA-256 of the text in hex instead; the text itself is always in the document.

use changefeed::lease::LeaseRow;
use changefeed::model::{GroupName, Heartbeat, HostName, Lease, Timestamp, Version};
use changefeed::LeaseError;
use serde_json::{json, Map, Value};
use sha2::Digest;

/// The container's partition key path: every document's group.
pub const PARTITION_KEY_PATH: &str = "/group";
/// The id prefix of lease documents.
pub const LEASE_PREFIX: &str = "lease.";
/// The id prefix of heartbeat documents.
pub const HOST_PREFIX: &str = "host.";
/// The id prefix of deletion records.
pub const DELETION_PREFIX: &str = "deleted.";
/// The id of a group's change-counter document.
pub const COUNTER_ID: &str = "counter";

const MAX_ID: usize = 250;

/// The id of the lease document of `partition`.
pub fn lease_id(partition: &str) -> String {
    encode_id(LEASE_PREFIX, partition)
}

/// The id of the heartbeat document of `host`.
pub fn host_id(host: &str) -> String {
    encode_id(HOST_PREFIX, host)
}

/// The id of the deletion record written with counter value `stamp`.
pub fn deletion_id(stamp: u64) -> String {
    format!("{DELETION_PREFIX}{stamp:020}")
}

fn encode_id(prefix: &str, text: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + text.len());
    id.push_str(prefix);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            id.push(b as char);
        } else {
            id.push_str(&format!("~{b:02X}"));
        }
    }
    if id.len() <= MAX_ID {
        return id;
    }
    let digest = sha2::Sha256::digest(text.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}~~{hex}")
}

/// The lease document of `row` in `group`, at `version`, stamped with the counter value of
/// its last change of hands.
pub fn lease_doc(group: &GroupName, row: &LeaseRow, version: Version, changed_at: u64) -> Value {
    // The properties are stored as a JSON object (LeaseRow holds them as its JSON text).
    let properties: Value = serde_json::from_str(&row.properties)
        .unwrap_or_else(|_| Value::String(row.properties.clone()));
    json!({
        "id": lease_id(&row.partition),
        "group": group.as_str(),
        "partition": row.partition,
        "state": row.state,
        "owner": row.owner,
        "next_owner": row.next_owner,
        "continuation": row.continuation,
        "start": row.start,
        "parents": row.parents,
        "properties": properties,
        "version": version.0,
        "changed_at": changed_at,
    })
}

/// `group/partition` of a lease document, for error messages, even when it does not parse.
pub fn lease_key_text(group: &str, doc: &Value) -> String {
    let partition = doc
        .get("partition")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| {
            doc.get("id")
                .and_then(Value::as_str)
                .map(|id| id.strip_prefix(LEASE_PREFIX).unwrap_or(id).to_string())
        })
        .unwrap_or_else(|| "?".into());
    format!("{group}/{partition}")
}

/// A lease document read back: the lease and its stamp.
#[derive(Debug, Clone)]
pub struct LeaseDoc {
    /// The lease.
    pub lease: Lease,
    /// The counter value of its last change of hands.
    pub changed_at: u64,
}

/// Reads a lease document of `group`, or says (naming its key) what is wrong with it.
pub fn parse_lease(group: &GroupName, doc: &Value) -> Result<LeaseDoc, LeaseError> {
    let bad = |reason: String| LeaseError::Malformed {
        key: lease_key_text(group.as_str(), doc),
        reason,
    };
    if let Some(g) = doc.get("group").and_then(Value::as_str) {
        if g != group.as_str() {
            return Err(bad(format!("group is {g:?}, not {:?}", group.as_str())));
        }
    }
    let row = lease_row(doc).map_err(bad)?;
    let changed_at = number(doc, "changed_at").map_err(bad)?;
    let lease = row.decode(group).map_err(bad)?;
    Ok(LeaseDoc { lease, changed_at })
}

fn lease_row(doc: &Value) -> Result<LeaseRow, String> {
    let required = |field: &str| text(doc, field)?.ok_or_else(|| format!("no {field}"));
    let parents = match doc.get("parents") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|p| match p {
                Value::String(p) => Ok(p.clone()),
                other => Err(format!("parents: {other} is not a partition id")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("parents is not a list: {other}")),
    };
    let properties = match doc.get("properties") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::Object(map)) => Value::Object(map.clone()).to_string(),
        // Not an object: the codec says what is wrong with the text.
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Ok(LeaseRow {
        partition: required("partition")?,
        state: required("state")?,
        owner: text(doc, "owner")?,
        next_owner: text(doc, "next_owner")?,
        continuation: text(doc, "continuation")?,
        start: required("start")?,
        parents,
        properties,
        version: number(doc, "version")?,
    })
}

/// The heartbeat document of `host` in `group`.
pub fn heartbeat_doc(
    group: &GroupName,
    host: &HostName,
    incarnation: &str,
    written_at: Timestamp,
    version: Version,
    report: Option<&str>,
) -> Value {
    let mut doc = json!({
        "id": host_id(host.as_str()),
        "group": group.as_str(),
        "host": host.as_str(),
        "incarnation": incarnation,
        "version": version.0,
        "written_at": written_at.millis(),
    });
    if let (Some(report), Some(fields)) = (report, doc.as_object_mut()) {
        fields.insert("report".into(), Value::from(report));
    }
    doc
}

/// Reads a heartbeat document of `group`.
pub fn parse_heartbeat(group: &GroupName, doc: &Value) -> Result<Heartbeat, LeaseError> {
    let name = doc
        .get("host")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| {
            doc.get("id")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string()
        });
    let bad = |reason: String| LeaseError::Malformed {
        key: format!("{group}/{HOST_PREFIX}{name}"),
        reason,
    };
    Ok(Heartbeat {
        group: group.clone(),
        host: HostName::new(name.clone()).map_err(|e| bad(e.to_string()))?,
        incarnation: text(doc, "incarnation")
            .map_err(bad)?
            .unwrap_or_default()
            .into(),
        version: Version(number(doc, "version").map_err(bad)?),
        written_at: Timestamp(doc.get("written_at").and_then(Value::as_i64).unwrap_or(0)),
        // Advisory: a report that cannot be read leaves the row without one, never unreadable.
        report: text(doc, "report").ok().flatten().map(Into::into),
    })
}

/// A group's change-counter document as read: the counter, how far back deletions are kept,
/// the membership view's small fields, and its ETag (`None`: there is no document yet, the
/// counter is 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterDoc {
    /// The change counter.
    pub counter: u64,
    /// Every deletion after this counter value has its record.
    pub deletions_from: u64,
    /// The membership view's fields kept here (`None`: no view yet, as in every document
    /// written before the view existed).
    pub view: Option<ViewHead>,
    /// The document's ETag; `None` when there is no document.
    pub etag: Option<String>,
}

/// The membership view's fields in the counter document: what a follower needs every cycle,
/// read with the counter in one point read. The host lists sit in the body documents
/// `view.<body>.<part>`, which never change once written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewHead {
    /// `view_version`: the view's version, the compare-and-swap's.
    pub version: u64,
    /// `view_leader`.
    pub leader: HostName,
    /// `view_incarnation`: the leader's.
    pub incarnation: String,
    /// `view_leader_heartbeat`: the leader's heartbeat version, copied by its renewals.
    pub leader_heartbeat: Version,
    /// `view_body`: the id of the body (its documents are `view.<body>.<part>`).
    pub body: String,
    /// `view_parts`: how many body documents.
    pub parts: u64,
}

/// The id prefix of view body documents.
pub const VIEW_PREFIX: &str = "view.";

/// The id of part `part` of the view body `body`.
pub fn view_body_id(body: &str, part: u64) -> String {
    format!("{VIEW_PREFIX}{body}.{part}")
}

impl CounterDoc {
    /// The document for `counter` and `deletions_from` in `group`, without a view.
    pub fn body(group: &GroupName, counter: u64, deletions_from: u64) -> Value {
        Self::doc(group, counter, deletions_from, None)
    }

    /// This document with `counter` and `deletions_from`, its view kept.
    pub fn with_counter(&self, group: &GroupName, counter: u64, deletions_from: u64) -> Value {
        Self::doc(group, counter, deletions_from, self.view.as_ref())
    }

    /// This document with `view` in place of its view, the counter kept.
    pub fn with_view(&self, group: &GroupName, view: &ViewHead) -> Value {
        Self::doc(group, self.counter, self.deletions_from, Some(view))
    }

    fn doc(group: &GroupName, counter: u64, deletions_from: u64, view: Option<&ViewHead>) -> Value {
        let mut doc = json!({
            "id": COUNTER_ID,
            "group": group.as_str(),
            "counter": counter,
            "deletions_from": deletions_from,
        });
        if let (Some(v), Some(map)) = (view, doc.as_object_mut()) {
            map.insert("view_version".into(), v.version.into());
            map.insert("view_leader".into(), v.leader.as_str().into());
            map.insert("view_incarnation".into(), v.incarnation.as_str().into());
            map.insert("view_leader_heartbeat".into(), v.leader_heartbeat.0.into());
            map.insert("view_body".into(), v.body.as_str().into());
            map.insert("view_parts".into(), v.parts.into());
        }
        doc
    }

    /// Reads the counter document of `group` with its ETag. A document without
    /// `view_version` (no view yet, or written by a version of this crate without views)
    /// has no view.
    pub fn parse(group: &GroupName, doc: &Value, etag: String) -> Result<Self, LeaseError> {
        let bad = |reason: String| LeaseError::Malformed {
            key: format!("{group}/{COUNTER_ID}"),
            reason,
        };
        let view = match doc.get("view_version") {
            None | Some(Value::Null) => None,
            Some(_) => {
                let required = |field: &str| -> Result<String, LeaseError> {
                    text(doc, field)
                        .map_err(bad)?
                        .ok_or_else(|| bad(format!("no {field}")))
                };
                Some(ViewHead {
                    version: number(doc, "view_version").map_err(bad)?,
                    leader: HostName::new(required("view_leader")?)
                        .map_err(|e| bad(format!("view_leader: {e}")))?,
                    incarnation: required("view_incarnation")?,
                    leader_heartbeat: Version(number(doc, "view_leader_heartbeat").map_err(bad)?),
                    body: required("view_body")?,
                    parts: number(doc, "view_parts").map_err(bad)?,
                })
            }
        };
        Ok(Self {
            counter: number(doc, "counter").map_err(bad)?,
            deletions_from: match doc.get("deletions_from") {
                None | Some(Value::Null) => 0,
                Some(_) => number(doc, "deletions_from").map_err(bad)?,
            },
            view,
            etag: Some(etag),
        })
    }
}

/// The deletion record of `partition` in `group`, written with counter value `stamp`.
pub fn deletion_doc(group: &GroupName, partition: &str, stamp: u64) -> Value {
    json!({
        "id": deletion_id(stamp),
        "group": group.as_str(),
        "partition": partition,
        "deleted_at": stamp,
    })
}

fn text(doc: &Value, field: &str) -> Result<Option<String>, String> {
    match doc.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{field} is not a string: {other}")),
    }
}

/// An unsigned integer field.
pub fn number(doc: &Value, field: &str) -> Result<u64, String> {
    match doc.get(field) {
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("{field} is not an unsigned integer: {v}")),
        None => Err(format!("no {field}")),
    }
}

/// The ETag of a document body (`_etag`).
pub fn body_etag(doc: &Value) -> Option<String> {
    doc.get("_etag").and_then(Value::as_str).map(str::to_string)
}

/// `doc` without the properties Cosmos DB adds (`_etag`, `_rid`, `_self`, `_ts`, `_attachments`).
pub fn without_system_properties(doc: &Value) -> Value {
    match doc {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| !k.starts_with('_'))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<Map<_, _>>(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_hold_only_characters_cosmos_and_urls_accept() {
        // Partition ids may hold any printable text; ids may not hold / \ ? #.
        assert_eq!(
            lease_id("shardId-000000000001"),
            "lease.shardId-000000000001"
        );
        assert_eq!(lease_id("a/b?c#d\\e f"), "lease.a~2Fb~3Fc~23d~5Ce~20f");
        assert_eq!(lease_id("ünï"), "lease.~C3~BCn~C3~AF");
        assert_eq!(host_id("host-ä"), "host.host-~C3~A4");
        assert_eq!(deletion_id(42), "deleted.00000000000000000042");
        // Escaping is one to one: different texts, different ids.
        assert_ne!(lease_id("~41"), lease_id("A"));
        let long = "é".repeat(128);
        let id = lease_id(&long);
        assert!(
            id.starts_with("lease.~~") && id.len() == LEASE_PREFIX.len() + 2 + 64,
            "{id}"
        );
        assert_ne!(id, lease_id(&"é".repeat(127)));
        for id in [lease_id("a/b?c#d\\e f"), id] {
            assert!(id.len() <= 255);
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.~".contains(&b)),
                "{id}"
            );
        }
    }
}
