//! The membership view on Cosmos DB: its small fields in the group's counter document, its
//! host lists in body documents read only when they change.
//!
//! The counter document is replaced by every ownership batch, and a follower reads it every
//! cycle: a view of 10,000 hosts in it (about a megabyte) would make each of those cost a
//! megabyte. So it holds only what a follower needs each cycle, beside the counter, so that
//! one point read gives both atomically ([`ViewHead`]): the view's version, leader, leader
//! incarnation, leader heartbeat, and the id and part count of its body. The body (the live
//! and dead lists as the JSON `[live, dead]`) sits in documents `view.<id>.<part>` of the
//! group's logical partition, split below the 2 MB document limit.
//!
//! Order: a writer creates the body documents of a new id first, then points the counter
//! document at them by a replace with `If-Match` on its `_etag`, after checking the view
//! version it read there; a reader reads the counter document, then the body of the id it
//! names (or its cached copy of that id). A body is never rewritten (its id holds the version
//! and a random nonce, so two racing writers never share one), and a writer keeps the body it
//! replaced: only bodies older than that are deleted, so a reader's body read can only miss if
//! two views were written between its two reads, and then it reads the head again.
//!
//! The leader's renewal ([`LeaseStore::lead_heartbeat`]) is one transactional batch: first the
//! counter document with the new version copied into `view_leader_heartbeat` (`If-Match`),
//! then the heartbeat document (`If-Match`, or `Create`). Cosmos DB applies both or neither.
//! A server that applies a batch in part (the local test server) can leave the copy without
//! the renewal, never the renewal without the copy, and that is safe: see the crate README,
//! "The membership view".

use changefeed::lease::HeartbeatRole;
use changefeed::lease::{BackendError, MembershipStore};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, MembershipView, Timestamp, Version, ViewHost,
};
use changefeed::LeaseError;
use rand::Rng;
use serde_json::{json, Value};

use super::{unexpected, unexpected_retryable, CosmosLeaseStore, COUNTER_ATTEMPTS};
use crate::doc::{
    heartbeat_doc, host_id, view_body_id, CounterDoc, ViewHead, COUNTER_ID, VIEW_PREFIX,
};
use crate::error::CosmosError;
use crate::rest::{etag_of, lock, BatchOp, OpResult};

/// Bytes of body JSON per document. The JSON goes in a string field, whose escaping can at
/// most double it: below Cosmos DB's 2 MB document limit. 10,000 hosts with 60-byte
/// incarnations take about 1.1 MB: two parts.
pub(crate) const BODY_PART_BYTES: usize = 700_000;

/// How many times `head` reads again when the body its head named was replaced twice (and so
/// deleted) before it could read it.
const HEAD_ATTEMPTS: u32 = 5;

/// The view's host lists, as stored in its body documents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Body {
    live: Vec<ViewHost>,
    dead: Vec<HostName>,
}

/// A body this handle has read or written: followers read a body only when its id changes,
/// and a leader whose judgment did not change points the new view at the same body.
#[derive(Clone, Debug)]
pub(crate) struct CachedBody {
    id: String,
    parts: u64,
    body: Body,
}

fn view_of(head: &ViewHead, body: Body) -> MembershipView {
    MembershipView {
        version: head.version,
        leader: head.leader.clone(),
        leader_incarnation: head.incarnation.as_str().into(),
        leader_heartbeat: head.leader_heartbeat,
        live: body.live,
        dead: body.dead,
    }
}

/// `json` cut into slices of at most `max` bytes, each ending on a character boundary.
fn slices(json: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = json;
    while !rest.is_empty() {
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end == 0 {
            // One character longer than `max`: it goes whole.
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (head, tail) = rest.split_at(end);
        out.push(head);
        rest = tail;
    }
    if out.is_empty() {
        out.push("");
    }
    out
}

fn malformed_body(group: &GroupName, id: &str, reason: String) -> LeaseError {
    LeaseError::Malformed {
        key: format!("{group}/{VIEW_PREFIX}{id}"),
        reason,
    }
}

impl CosmosLeaseStore {
    /// The group's head: one point read of the counter document, then the body its view
    /// names unless this handle has it.
    pub(super) async fn read_head(&self, group: &GroupName) -> Result<GroupHead, LeaseError> {
        for _ in 0..HEAD_ATTEMPTS {
            let counter = self.read_counter("head", group).await?;
            if counter.etag.is_some() {
                self.remember_counter(group, counter.clone());
            }
            let Some(head) = counter.view else {
                return Ok(GroupHead {
                    change_counter: counter.counter,
                    view: None,
                });
            };
            if let Some(body) = self.body(group, &head.body, head.parts).await? {
                return Ok(GroupHead {
                    change_counter: counter.counter,
                    view: Some(view_of(&head, body)),
                });
            }
            tracing::debug!(%group, body = %head.body, "view body replaced while reading it; reading the head again");
        }
        Err(unexpected_retryable(
            "head",
            Some(group.to_string()),
            "the membership view kept being replaced while it was read".into(),
        ))
    }

    /// The body `id` of `group`'s view: this handle's copy, or read from its `parts`
    /// documents. `None` if they are gone (deleted after two newer views).
    async fn body(
        &self,
        group: &GroupName,
        id: &str,
        parts: u64,
    ) -> Result<Option<Body>, LeaseError> {
        if let Some(cached) = lock(&self.inner.views).get(group).filter(|c| c.id == id) {
            return Ok(Some(cached.body.clone()));
        }
        let mut json = String::new();
        for part in 0..parts {
            let doc_id = view_body_id(id, part);
            let found = self
                .rest
                .read(group.as_str(), &doc_id)
                .await
                .map_err(|e| e.into_lease("head", Some(format!("{group}/{doc_id}"))))?;
            let Some((doc, _)) = found else {
                return Ok(None);
            };
            match doc.get("data").and_then(Value::as_str) {
                Some(data) => json.push_str(data),
                None => return Err(malformed_body(group, id, format!("part {part}: no data"))),
            }
        }
        let (live, dead): (Vec<ViewHost>, Vec<HostName>) =
            serde_json::from_str(&json).map_err(|e| malformed_body(group, id, e.to_string()))?;
        let body = Body { live, dead };
        self.cache_body(group, id, parts, &body);
        Ok(Some(body))
    }

    fn cache_body(&self, group: &GroupName, id: &str, parts: u64, body: &Body) {
        lock(&self.inner.views).insert(
            group.clone(),
            CachedBody {
                id: id.to_string(),
                parts,
                body: body.clone(),
            },
        );
    }

    /// The view a counter document holds, its body read (`None`: no view, or its body gone).
    async fn view_in(
        &self,
        group: &GroupName,
        counter: &CounterDoc,
    ) -> Result<Option<MembershipView>, LeaseError> {
        let Some(head) = &counter.view else {
            return Ok(None);
        };
        Ok(self
            .body(group, &head.body, head.parts)
            .await?
            .map(|body| view_of(head, body)))
    }

    /// The body id and part count for `body` at `version`: this handle's cached body if it
    /// holds the same lists (a leader renewing an unchanged judgment writes no body), else a
    /// new id whose documents are created now, before the head points at them.
    async fn put_body(
        &self,
        group: &GroupName,
        version: u64,
        body: &Body,
    ) -> Result<(String, u64, bool), LeaseError> {
        if let Some(c) = lock(&self.inner.views)
            .get(group)
            .filter(|c| &c.body == body)
        {
            return Ok((c.id.clone(), c.parts, false));
        }
        let nonce: u64 = lock(&self.inner.rng).gen();
        let id = format!("{version:020}.{nonce:016x}");
        let json = serde_json::to_string(&(&body.live, &body.dead))
            .map_err(|e| LeaseError::store("write_view", Some(group.to_string()), false, e))?;
        let parts = slices(&json, BODY_PART_BYTES);
        for (part, data) in parts.iter().enumerate() {
            let doc_id = view_body_id(&id, part as u64);
            let doc = json!({ "id": doc_id, "group": group.as_str(), "data": data });
            let name = || Some(format!("{group}/{doc_id}"));
            let answer = self
                .rest
                .create(group.as_str(), &doc)
                .await
                .map_err(|e| e.into_lease("write_view", name()))?;
            if !matches!(answer.status, 200 | 201) {
                return Err(answer.into_error().into_lease("write_view", name()));
            }
        }
        Ok((id, parts.len() as u64, true))
    }

    /// [`MembershipStore::write_view`]: the body first, then the counter document's view fields by
    /// a replace with `If-Match` on the ETag of the document read with the expected version
    /// (the counter itself untouched; created at 0 if the group has no counter document). A
    /// 412 (an ownership write or a copy of the leader's heartbeat moved the document) reads
    /// it again: only a different view version is a conflict.
    pub(super) async fn put_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let name = || Some(group.to_string());
        let version = expected + 1;
        let body = Body {
            live: view.live.clone(),
            dead: view.dead.clone(),
        };
        let (id, parts, fresh) = self.put_body(group, version, &body).await?;
        let head = ViewHead {
            version,
            leader: view.leader.clone(),
            incarnation: view.leader_incarnation.to_string(),
            leader_heartbeat: view.leader_heartbeat,
            body: id.clone(),
            parts,
        };
        for attempt in 0..COUNTER_ATTEMPTS {
            let counter = self.read_counter("write_view", group).await?;
            let current = counter.view.as_ref().map_or(0, |v| v.version);
            if current != expected {
                if fresh {
                    self.delete_body(group, &id, parts).await;
                }
                let current = match self.view_in(group, &counter).await? {
                    Some(v) => Some(v),
                    // Its body already replaced twice: the head as it is now.
                    None => self.read_head(group).await?.view,
                };
                return Err(LeaseError::ViewConflict {
                    group: group.to_string(),
                    expected,
                    current: current.map(Box::new),
                });
            }
            let answer = match &counter.etag {
                Some(etag) => self
                    .rest
                    .replace(
                        group.as_str(),
                        COUNTER_ID,
                        &counter.with_view(group, &head),
                        etag,
                    )
                    .await
                    .map_err(|e| e.into_lease("write_view", name()))?,
                None => self
                    .rest
                    .create(group.as_str(), &counter.with_view(group, &head))
                    .await
                    .map_err(|e| e.into_lease("write_view", name()))?,
            };
            match answer.status {
                200 | 201 => {
                    let etag = answer.json().ok().and_then(|b| etag_of(&answer, &b).ok());
                    match etag {
                        Some(etag) => self.remember_counter(
                            group,
                            CounterDoc {
                                view: Some(head.clone()),
                                etag: Some(etag),
                                ..counter.clone()
                            },
                        ),
                        None => {
                            lock(&self.inner.counters).remove(group);
                        }
                    }
                    self.cache_body(group, &id, parts, &body);
                    if let Some(old) = counter.view.filter(|o| o.body != id) {
                        self.collect_bodies(group, &old.body).await;
                    }
                    let mut stored = view.clone();
                    stored.version = version;
                    return Ok(stored);
                }
                // The document moved (or was created) since it was read: look again.
                412 | 409 | 404 => self.backoff(attempt).await,
                _ => return Err(answer.into_error().into_lease("write_view", name())),
            }
        }
        Err(unexpected_retryable(
            "write_view",
            name(),
            format!(
                "the counter document of group {group} kept moving: {COUNTER_ATTEMPTS} attempts"
            ),
        ))
    }

    /// Deletes the body documents older than `kept` (the body just replaced, which a reader
    /// may still be about to read). Best effort: a leftover costs storage, never correctness.
    async fn collect_bodies(&self, group: &GroupName, kept: &str) {
        self.delete_matching(
            group,
            "old view body",
            "SELECT c.id FROM c WHERE c.group = @g AND STARTSWITH(c.id, @p) AND c.id < @kept",
            &[
                ("@g", group.as_str().into()),
                ("@p", VIEW_PREFIX.into()),
                ("@kept", view_body_id(kept, 0).into()),
            ],
        )
        .await;
    }

    async fn delete_body(&self, group: &GroupName, id: &str, parts: u64) {
        for part in 0..parts {
            self.delete_quietly(group, "old view body", &view_body_id(id, part))
                .await;
        }
    }

    /// The ETag of `host`'s heartbeat document at `expected`: known to the handle, or read.
    /// Another version, or none, is the caller's `HeartbeatConflict`.
    async fn heartbeat_etag(
        &self,
        group: &GroupName,
        host: &HostName,
        expected: Version,
    ) -> Result<String, LeaseError> {
        let known = lock(&self.inner.hosts)
            .get(&(group.clone(), host.clone()))
            .filter(|(v, _)| *v == expected)
            .map(|(_, etag)| etag.clone());
        if let Some(etag) = known {
            return Ok(etag);
        }
        match self.read_heartbeat("lead_heartbeat", group, host).await? {
            None => Err(Self::heartbeat_conflict(group, host, None)),
            Some((current, _)) if current.version != expected => {
                Err(Self::heartbeat_conflict(group, host, Some(current)))
            }
            Some((_, etag)) => Ok(etag),
        }
    }

    /// [`LeaseStore::lead_heartbeat`]: when the counter document's view names this host and
    /// incarnation as leader, one transactional batch of the copy (the counter document with
    /// `view_leader_heartbeat` set to the new version, `If-Match`) and then the heartbeat
    /// write; otherwise a plain [`MembershipStore::heartbeat`]. The counter document is the one
    /// this handle last saw, read again when that does not name it leader or moved since.
    pub(super) async fn put_lead_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let name = || Some(format!("{group}/{host}"));
        let leads = |c: &CounterDoc| {
            c.etag.is_some()
                && c.view
                    .as_ref()
                    .is_some_and(|v| &v.leader == host && v.incarnation == incarnation)
        };
        let version = expected.map_or(Version::FIRST, Version::next);
        let mut fresh = false;
        for attempt in 0..COUNTER_ATTEMPTS {
            let cached = if fresh {
                None
            } else {
                lock(&self.inner.counters)
                    .get(group)
                    .map(|(c, _)| c.clone())
                    .filter(leads)
            };
            let counter = match cached {
                Some(counter) => counter,
                None => {
                    let counter = self.read_counter("lead_heartbeat", group).await?;
                    if counter.etag.is_some() {
                        self.remember_counter(group, counter.clone());
                    }
                    counter
                }
            };
            let (Some(head), Some(counter_etag)) = (&counter.view, &counter.etag) else {
                return self
                    .heartbeat(
                        group,
                        host,
                        incarnation,
                        written_at,
                        expected,
                        HeartbeatRole::Member,
                        report,
                    )
                    .await;
            };
            if !leads(&counter) {
                // Not (or no longer) the view's leader: a plain renewal.
                return self
                    .heartbeat(
                        group,
                        host,
                        incarnation,
                        written_at,
                        expected,
                        HeartbeatRole::Member,
                        report,
                    )
                    .await;
            }
            let row = heartbeat_doc(group, host, incarnation, written_at, version, report);
            let write = match expected {
                None => BatchOp::Create(row),
                Some(expected) => BatchOp::Replace {
                    id: host_id(host.as_str()),
                    body: row,
                    if_match: self.heartbeat_etag(group, host, expected).await?,
                },
            };
            let copied = ViewHead {
                leader_heartbeat: version,
                ..head.clone()
            };
            let ops = [
                BatchOp::Replace {
                    id: COUNTER_ID.into(),
                    body: counter.with_view(group, &copied),
                    if_match: counter_etag.clone(),
                },
                write,
            ];
            let results = self
                .rest
                .batch(group.as_str(), &ops)
                .await
                .map_err(|e| e.into_lease("lead_heartbeat", name()))?;
            let ok = |r: &OpResult| (200..300).contains(&r.status);
            if ok(&results[0]) {
                match results[0].etag.clone() {
                    Some(etag) => self.remember_counter(
                        group,
                        CounterDoc {
                            view: Some(copied),
                            etag: Some(etag),
                            ..counter.clone()
                        },
                    ),
                    None => {
                        lock(&self.inner.counters).remove(group);
                    }
                }
            }
            let slot = (group.clone(), host.clone());
            if results.iter().all(ok) {
                match results.get(1).and_then(|r| r.etag.clone()) {
                    Some(etag) => lock(&self.inner.hosts).insert(slot, (version, etag)),
                    None => lock(&self.inner.hosts).remove(&slot),
                };
                return Ok(Heartbeat {
                    group: group.clone(),
                    host: host.clone(),
                    incarnation: incarnation.into(),
                    version,
                    written_at,
                    report: report.map(Into::into),
                });
            }
            let Some((index, failed)) = results
                .iter()
                .enumerate()
                .find(|(_, r)| !ok(r) && r.status != 424)
            else {
                return Err(unexpected(
                    "lead_heartbeat",
                    name(),
                    "every operation answered 424",
                ));
            };
            match (index, failed.status) {
                // The counter document moved (an ownership write, a view write): read it again.
                (0, 409 | 412 | 404) => {
                    fresh = true;
                    self.backoff(attempt).await;
                }
                // The heartbeat row moved or is gone (or exists, for a create): the conflict.
                (1, 409 | 412 | 404) => {
                    lock(&self.inner.hosts).remove(&slot);
                    let current = self.read_heartbeat("lead_heartbeat", group, host).await?;
                    return Err(Self::heartbeat_conflict(
                        group,
                        host,
                        current.map(|(h, _)| h),
                    ));
                }
                (_, status) => {
                    let err = CosmosError::Status {
                        request: format!("batch lead_heartbeat {group}/{host} operation {index}"),
                        status,
                        substatus: None,
                        message: failed
                            .body
                            .as_ref()
                            .and_then(|b| b.get("message"))
                            .and_then(Value::as_str)
                            .unwrap_or("refused")
                            .to_string(),
                    };
                    return Err(err.into_lease("lead_heartbeat", name()));
                }
            }
        }
        Err(unexpected_retryable(
            "lead_heartbeat",
            name(),
            format!(
                "the counter document of group {group} kept moving: {COUNTER_ATTEMPTS} attempts"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::slices;

    #[test]
    fn body_slices_end_on_character_boundaries_and_join_back() {
        // A part boundary inside a multi-byte character would leave a part that is no string.
        let json = "[\"hôst-é\",\"ü\"]".repeat(50);
        for max in [1, 2, 3, 7, 64, 10_000] {
            let parts = slices(&json, max);
            assert_eq!(parts.concat(), json, "max {max}");
            assert!(parts.iter().all(|p| p.len() <= max.max(4)), "max {max}");
        }
        assert_eq!(slices("", 10), vec![""], "an empty body is one empty part");
    }
}
