//! The membership view on DynamoDB: its small fields in the group's counter item, its host
//! lists in body items read only when they change.
//!
//! The counter item (`H#<group>` / [`COUNTER_SK`]) is written by every ownership transaction,
//! and DynamoDB charges a write by the size of the whole item: a view of 10,000 hosts in it
//! (hundreds of kilobytes) would make every lease transaction cost hundreds of write units, and
//! would not fit the 400 KB item limit at all. So the counter item holds only what a follower
//! needs every cycle, next to the counter, so that one strongly consistent `GetItem` reads both
//! atomically: the view's version, leader, leader incarnation, leader heartbeat, and the id and
//! part count of its body. The body (the live and dead lists, JSON) sits in items of partition
//! `V#<group>`, sort key `body#<id>#<part>`, split into parts below the item limit.
//!
//! Order: a writer puts the body items of a new id first, then points the counter item at them
//! by compare-and-swap on the view version; a reader reads the counter item, then the body of
//! the id it names (or its cached copy of that id). A body is never rewritten (its id holds the
//! version and a random nonce, so two racing writers never share one), and a writer keeps the
//! body it replaced: only bodies older than that are deleted, so a reader's body read can only
//! miss if two views were written between its two reads, and then it reads the head again.

use std::collections::HashMap;

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::{UpdateItemError, UpdateItemOutput};
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, ReturnConsumedCapacity, ReturnValue, ReturnValuesOnConditionCheckFailure,
};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, MembershipView, Timestamp, Version, ViewHost,
};
use changefeed::LeaseError;
use rand::Rng;
use tracing::debug;

use crate::error::{store_error, DynamoError};
use crate::store::{
    heartbeat_pk, lock, n, number, s, text, DynamoLeaseStore, Item, Kind, A_COUNTER, COUNTER_SK,
    PK, SK, TRANSACTION_ATTEMPTS,
};

const A_VIEW_VERSION: &str = "view_version";
const A_VIEW_LEADER: &str = "view_leader";
const A_VIEW_INCARNATION: &str = "view_incarnation";
const A_VIEW_LEADER_HEARTBEAT: &str = "view_leader_heartbeat";
const A_VIEW_BODY: &str = "view_body";
const A_VIEW_PARTS: &str = "view_body_parts";
const A_DATA: &str = "data";
const BODY_PREFIX: &str = "body#";

/// Bytes of body JSON per item: below DynamoDB's 400 KB item limit with room for the key and
/// attribute names. 10,000 hosts with 36-byte incarnations take about 800 KB: three parts.
pub(crate) const BODY_PART_BYTES: usize = 350_000;

/// How many times `head` reads again when the body its head named was replaced twice (and so
/// deleted) before it could read it.
const HEAD_ATTEMPTS: u32 = 5;

/// The partition key of `group`'s view bodies.
pub fn view_pk(group: &GroupName) -> String {
    format!("V#{group}")
}

/// The view's host lists, as stored in its body items.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Body {
    live: Vec<ViewHost>,
    dead: Vec<HostName>,
}

/// A body this handle has read or written, by group: followers read a body only when its id
/// changes, and a leader whose judgment did not change points the new view at the same body.
#[derive(Clone, Debug)]
pub(crate) struct CachedBody {
    id: String,
    parts: u64,
    body: Body,
}

/// The view's fields kept in the counter item.
struct CounterView {
    version: u64,
    leader: HostName,
    incarnation: String,
    leader_heartbeat: Version,
    body: String,
    parts: u64,
}

impl CounterView {
    fn parse(group: &GroupName, item: &Item) -> Result<Option<CounterView>, LeaseError> {
        if !item.contains_key(A_VIEW_VERSION) {
            return Ok(None);
        }
        let bad = |reason: String| LeaseError::Malformed {
            key: format!("{group}/{COUNTER_SK}"),
            reason,
        };
        let required = |attr: &str| -> Result<String, LeaseError> {
            text(item, attr)
                .map_err(bad)?
                .map(str::to_string)
                .ok_or_else(|| bad(format!("no {attr}")))
        };
        Ok(Some(CounterView {
            version: number(item, A_VIEW_VERSION).map_err(bad)?,
            leader: HostName::new(required(A_VIEW_LEADER)?).map_err(|e| bad(e.to_string()))?,
            incarnation: required(A_VIEW_INCARNATION)?,
            leader_heartbeat: Version(number(item, A_VIEW_LEADER_HEARTBEAT).map_err(bad)?),
            body: required(A_VIEW_BODY)?,
            parts: number(item, A_VIEW_PARTS).map_err(bad)?,
        }))
    }

    fn view(self, body: Body) -> MembershipView {
        MembershipView {
            version: self.version,
            leader: self.leader,
            leader_incarnation: self.incarnation.into(),
            leader_heartbeat: self.leader_heartbeat,
            live: body.live,
            dead: body.dead,
        }
    }
}

/// The change counter in a counter item (absent: 0, as a group that no ownership write has
/// touched yet).
pub(crate) fn counter_of(group: &GroupName, item: &Item) -> Result<u64, LeaseError> {
    if !item.contains_key(A_COUNTER) {
        return Ok(0);
    }
    number(item, A_COUNTER).map_err(|reason| LeaseError::Malformed {
        key: format!("{group}/{COUNTER_SK}"),
        reason,
    })
}

fn body_sk(id: &str, part: u64) -> String {
    format!("{BODY_PREFIX}{id}#{part:04}")
}

impl DynamoLeaseStore {
    /// The counter item of `group`, read strongly consistently (empty if there is none).
    pub(crate) async fn counter_item(&self, group: &GroupName) -> Result<Item, LeaseError> {
        let out = self
            .client()
            .get_item()
            .table_name(self.table())
            .key(PK, s(heartbeat_pk(group)))
            .key(SK, s(COUNTER_SK))
            .consistent_read(true)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await
            .map_err(|e| store_error("head", Some(group.to_string()), e))?;
        self.account(Kind::Read, out.consumed_capacity());
        Ok(out.item().cloned().unwrap_or_default())
    }

    /// The group's head: one consistent read of the counter item, then the body its view
    /// names unless this handle has it.
    pub(crate) async fn read_head(&self, group: &GroupName) -> Result<GroupHead, LeaseError> {
        for _ in 0..HEAD_ATTEMPTS {
            let item = self.counter_item(group).await?;
            self.learn_shards(group, &item)?;
            let change_counter = counter_of(group, &item)?;
            let Some(small) = CounterView::parse(group, &item)? else {
                return Ok(GroupHead {
                    change_counter,
                    view: None,
                });
            };
            if let Some(body) = self.body(group, &small.body, small.parts).await? {
                return Ok(GroupHead {
                    change_counter,
                    view: Some(small.view(body)),
                });
            }
            debug!(%group, body = %small.body, "view body replaced while reading it; reading the head again");
        }
        Err(LeaseError::store(
            "head",
            Some(group.to_string()),
            true,
            DynamoError::other("the membership view kept being replaced while it was read"),
        ))
    }

    /// The view a counter item holds, its body read (`None`: no view, or its body is gone).
    async fn view_in(
        &self,
        group: &GroupName,
        item: &Item,
    ) -> Result<Option<MembershipView>, LeaseError> {
        let Some(small) = CounterView::parse(group, item)? else {
            return Ok(None);
        };
        Ok(self
            .body(group, &small.body, small.parts)
            .await?
            .map(|body| small.view(body)))
    }

    /// The body `id` of `group`'s view: this handle's copy, or read from its `parts` items.
    /// `None` if they are gone (deleted after two newer views).
    async fn body(
        &self,
        group: &GroupName,
        id: &str,
        parts: u64,
    ) -> Result<Option<Body>, LeaseError> {
        if let Some(cached) = lock(&self.inner().views).get(group).filter(|c| c.id == id) {
            return Ok(Some(cached.body.clone()));
        }
        let mut bytes = Vec::new();
        let mut read = 0;
        let mut start: Option<Item> = None;
        loop {
            let out = self
                .client()
                .query()
                .table_name(self.table())
                .key_condition_expression("#pk = :pk AND begins_with(#sk, :prefix)")
                .expression_attribute_names("#pk", PK)
                .expression_attribute_names("#sk", SK)
                .expression_attribute_values(":pk", s(view_pk(group)))
                .expression_attribute_values(":prefix", s(format!("{BODY_PREFIX}{id}#")))
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await
                .map_err(|e| store_error("head", Some(group.to_string()), e))?;
            self.account(Kind::Read, out.consumed_capacity());
            for item in out.items() {
                match item.get(A_DATA) {
                    Some(AttributeValue::B(data)) => bytes.extend_from_slice(data.as_ref()),
                    other => return Err(malformed_body(group, id, format!("data: {other:?}"))),
                }
                read += 1;
            }
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
        if read == 0 {
            return Ok(None);
        }
        if read != parts {
            return Err(malformed_body(
                group,
                id,
                format!("{read} parts stored, {parts} expected"),
            ));
        }
        let (live, dead): (Vec<ViewHost>, Vec<HostName>) =
            serde_json::from_slice(&bytes).map_err(|e| malformed_body(group, id, e.to_string()))?;
        let body = Body { live, dead };
        self.cache_body(group, id, parts, &body);
        Ok(Some(body))
    }

    fn cache_body(&self, group: &GroupName, id: &str, parts: u64, body: &Body) {
        lock(&self.inner().views).insert(
            group.clone(),
            CachedBody {
                id: id.to_string(),
                parts,
                body: body.clone(),
            },
        );
    }

    /// The body id and part count for `body` at `version`: this handle's cached body if it
    /// holds the same lists (a leader renewing an unchanged judgment writes no body), else a
    /// new id whose parts are put now, before the head points at them.
    async fn put_body(
        &self,
        group: &GroupName,
        version: u64,
        body: &Body,
    ) -> Result<(String, u64, bool), LeaseError> {
        if let Some(c) = lock(&self.inner().views)
            .get(group)
            .filter(|c| &c.body == body)
        {
            return Ok((c.id.clone(), c.parts, false));
        }
        let nonce: u64 = lock(&self.inner().rng).gen();
        let id = format!("{version:020}#{nonce:016x}");
        let json = serde_json::to_vec(&(&body.live, &body.dead))
            .map_err(|e| LeaseError::store("write_view", Some(group.to_string()), false, e))?;
        let chunks: Vec<&[u8]> = json.chunks(BODY_PART_BYTES).collect();
        for (part, chunk) in chunks.iter().enumerate() {
            let out = self
                .client()
                .put_item()
                .table_name(self.table())
                .item(PK, s(view_pk(group)))
                .item(SK, s(body_sk(&id, part as u64)))
                .item(A_DATA, AttributeValue::B(Blob::new(chunk.to_vec())))
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await
                .map_err(|e| store_error("write_view", Some(group.to_string()), e))?;
            self.account(Kind::Write, out.consumed_capacity());
        }
        Ok((id, chunks.len() as u64, true))
    }

    /// [`MembershipStore::write_view`](changefeed::lease::MembershipStore::write_view): the body first,
    /// then the counter item's view fields by compare-and-swap on `view_version` (the counter
    /// itself untouched, created at 0 if the item is new).
    pub(crate) async fn put_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let version = expected + 1;
        let body = Body {
            live: view.live.clone(),
            dead: view.dead.clone(),
        };
        let (id, parts, fresh) = self.put_body(group, version, &body).await?;
        let mut req = self
            .client()
            .update_item()
            .table_name(self.table())
            .key(PK, s(heartbeat_pk(group)))
            .key(SK, s(COUNTER_SK))
            .update_expression(
                "SET #vv = :vv, #vl = :vl, #vi = :vi, #vh = :vh, #vb = :vb, #vp = :vp, \
                 #c = if_not_exists(#c, :zero)",
            )
            .expression_attribute_names("#vv", A_VIEW_VERSION)
            .expression_attribute_names("#vl", A_VIEW_LEADER)
            .expression_attribute_names("#vi", A_VIEW_INCARNATION)
            .expression_attribute_names("#vh", A_VIEW_LEADER_HEARTBEAT)
            .expression_attribute_names("#vb", A_VIEW_BODY)
            .expression_attribute_names("#vp", A_VIEW_PARTS)
            .expression_attribute_names("#c", A_COUNTER)
            .expression_attribute_values(":vv", n(version))
            .expression_attribute_values(":vl", s(view.leader.as_str()))
            .expression_attribute_values(":vi", s(&*view.leader_incarnation))
            .expression_attribute_values(":vh", n(view.leader_heartbeat.0))
            .expression_attribute_values(":vb", s(&id))
            .expression_attribute_values(":vp", n(parts))
            .expression_attribute_values(":zero", n(0))
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .return_consumed_capacity(ReturnConsumedCapacity::Total);
        req = if expected == 0 {
            req.condition_expression("attribute_not_exists(#vv)")
        } else {
            req.condition_expression("#vv = :exp")
                .expression_attribute_values(":exp", n(expected))
        };
        let result = self.update_counter_item(req).await;
        match result {
            Ok(out) => {
                self.account(Kind::Write, out.consumed_capacity());
                self.cache_body(group, &id, parts, &body);
                let old = out.attributes().cloned().unwrap_or_default();
                if let Some(old) = CounterView::parse(group, &old)?.filter(|o| o.body != id) {
                    self.collect_bodies(group, &old.body).await;
                }
                let mut stored = view.clone();
                stored.version = version;
                Ok(stored)
            }
            Err(err) => match err.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(e)) => {
                    self.account_failed_write();
                    if fresh {
                        self.delete_body(group, &id, parts).await;
                    }
                    let current = e.item().cloned().unwrap_or_default();
                    let current = match self.view_in(group, &current).await? {
                        Some(v) => Some(v),
                        // Its body already replaced twice: the head as it is now.
                        None => self.read_head(group).await?.view,
                    };
                    Err(LeaseError::ViewConflict {
                        group: group.to_string(),
                        expected,
                        current: current.map(Box::new),
                    })
                }
                _ => Err(store_error("write_view", Some(group.to_string()), err)),
            },
        }
    }

    /// Deletes the body items older than `kept` (the body just replaced, which a reader may
    /// still be about to read). Best effort: a leftover costs storage, never correctness.
    async fn collect_bodies(&self, group: &GroupName, kept: &str) {
        let out = self
            .client()
            .query()
            .table_name(self.table())
            .key_condition_expression("#pk = :pk AND #sk < :kept")
            .expression_attribute_names("#pk", PK)
            .expression_attribute_names("#sk", SK)
            .expression_attribute_values(":pk", s(view_pk(group)))
            .expression_attribute_values(":kept", s(format!("{BODY_PREFIX}{kept}")))
            .projection_expression("#pk, #sk")
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await;
        let out = match out {
            Ok(out) => out,
            Err(err) => {
                debug!(%group, error = %store_error("write_view", None, err), "could not list old view bodies");
                return;
            }
        };
        self.account(Kind::Read, out.consumed_capacity());
        for item in out.items() {
            if let Some(sk) = text(item, SK).ok().flatten() {
                self.delete_item_quietly(view_pk(group), sk.to_string())
                    .await;
            }
        }
    }

    async fn delete_body(&self, group: &GroupName, id: &str, parts: u64) {
        for part in 0..parts {
            self.delete_item_quietly(view_pk(group), body_sk(id, part))
                .await;
        }
    }

    async fn delete_item_quietly(&self, pk: String, sk: String) {
        let out = self
            .client()
            .delete_item()
            .table_name(self.table())
            .key(PK, s(pk))
            .key(SK, s(sk.clone()))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await;
        match out {
            Ok(out) => self.account(Kind::Write, out.consumed_capacity()),
            Err(err) => {
                debug!(sk, error = %store_error("write_view", None, err), "could not delete an old view body")
            }
        }
    }

    /// Sends a plain update of a counter item. An ownership transaction on the same item at
    /// the same moment refuses it with TransactionConflict: retried, as the transactions are.
    async fn update_counter_item(
        &self,
        req: UpdateItemFluentBuilder,
    ) -> Result<UpdateItemOutput, SdkError<UpdateItemError, HttpResponse>> {
        let mut attempt = 0;
        loop {
            match req.clone().send().await {
                Err(err)
                    if attempt + 1 < TRANSACTION_ATTEMPTS
                        && err.as_service_error().is_some_and(|e| {
                            e.meta().code() == Some("TransactionConflictException")
                        }) =>
                {
                    attempt += 1;
                    self.backoff(attempt).await;
                }
                result => return result,
            }
        }
    }

    /// The leader's heartbeat: its row's renewal, as any host's, then the copy of the new
    /// version into the view, conditioned on the view naming this host and incarnation as
    /// leader. Two plain writes, not one transaction: DynamoDB bills a transactional write
    /// twice, and a heartbeat is most of an idle fleet's bill. Nothing needs them atomic: the
    /// copy is written after the row, so it never shows a version the row has not reached,
    /// observers count a copy only when it is newer than what they saw, and a copy that fails
    /// (not the leader any more, or conflicts that outlast the retries) leaves the view's copy
    /// one renewal behind, which the next renewal makes good.
    pub(crate) async fn put_lead_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let row = self
            .write_heartbeat(group, host, incarnation, written_at, expected, report)
            .await?;
        if let Err(err) = self.copy_lead_heartbeat(group, host, &row).await {
            debug!(%group, %host, error = %err, "could not copy the leader's heartbeat into the view");
        }
        Ok(row)
    }

    /// Copies the leader's heartbeat `row` into the view's counter item, if the view names its
    /// host and incarnation as leader.
    async fn copy_lead_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        row: &Heartbeat,
    ) -> Result<(), LeaseError> {
        let req = self
            .client()
            .update_item()
            .table_name(self.table())
            .key(PK, s(heartbeat_pk(group)))
            .key(SK, s(COUNTER_SK))
            .update_expression("SET #vh = :vh")
            .condition_expression("#vl = :vl AND #vi = :vi")
            .expression_attribute_names("#vh", A_VIEW_LEADER_HEARTBEAT)
            .expression_attribute_names("#vl", A_VIEW_LEADER)
            .expression_attribute_names("#vi", A_VIEW_INCARNATION)
            .expression_attribute_values(":vh", n(row.version.0))
            .expression_attribute_values(":vl", s(host.as_str()))
            .expression_attribute_values(":vi", s(&*row.incarnation))
            .return_consumed_capacity(ReturnConsumedCapacity::Total);
        let result = self.update_counter_item(req).await;
        match result {
            Ok(out) => {
                self.account(Kind::Write, out.consumed_capacity());
                Ok(())
            }
            Err(err) => match err.as_service_error() {
                // Not (or no longer) the view's leader: the renewal alone was due.
                Some(UpdateItemError::ConditionalCheckFailedException(_)) => {
                    self.account_failed_write();
                    Ok(())
                }
                _ => Err(store_error(
                    "lead_heartbeat",
                    Some(format!("{group}/{host}")),
                    err,
                )),
            },
        }
    }
}

fn malformed_body(group: &GroupName, id: &str, reason: String) -> LeaseError {
    LeaseError::Malformed {
        key: format!("{}/{BODY_PREFIX}{id}", view_pk(group)),
        reason,
    }
}

/// Bodies this handle has read or written, by group.
pub(crate) type ViewCache = HashMap<GroupName, CachedBody>;
