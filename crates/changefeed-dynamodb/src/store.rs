//! [`DynamoLeaseStore`]: the lease store seam on one DynamoDB table.

mod members;

use changefeed::lease::HeartbeatRole;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConsumedCapacity, KeySchemaElement, KeyType,
    Put, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure, ScalarAttributeType,
    TransactWriteItem, Update,
};
use aws_sdk_dynamodb::Client;
use changefeed::lease::{LeaseRow, LeaseStore, Listing};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    Ownership, Timestamp, Version,
};
use changefeed::LeaseError;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::error::{store_error, DynamoError};
use crate::shards::{DEFAULT_HEARTBEAT_SHARDS, DEFAULT_SHARDS_AT_HOSTS};
use crate::table::{until_active, TableWait};

pub(crate) type Item = HashMap<String, AttributeValue>;

/// The partition-key attribute: `L#<group>` for a group's leases, `H#<group>` for its
/// heartbeats and change counter.
pub const PK: &str = "pk";
/// The sort-key attribute: the partition id of a lease, `host#<name>` of a heartbeat,
/// [`COUNTER_SK`] of the change counter.
pub const SK: &str = "sk";
/// The sort key of a group's change-counter item (in the `H#<group>` partition).
pub const COUNTER_SK: &str = "counter";
pub(crate) const HOST_PREFIX: &str = "host#";

pub(crate) const A_VERSION: &str = "version";
const A_STATE: &str = "state";
const A_OWNER: &str = "owner";
const A_NEXT_OWNER: &str = "next_owner";
const A_CONTINUATION: &str = "continuation";
const A_START: &str = "start";
const A_PARENTS: &str = "parents";
const A_PROPERTIES: &str = "properties";
pub(crate) const A_INCARNATION: &str = "incarnation";
const A_WRITTEN_AT: &str = "written_at";
/// What the host published with its heartbeat ([`changefeed::model::HostReport`], JSON).
pub(crate) const A_REPORT: &str = "report";
pub(crate) const A_COUNTER: &str = "change_counter";

/// How many times a write is retried when a DynamoDB transaction conflicts with another one
/// on the same items (the change counter is shared by a group's ownership writes).
pub(crate) const TRANSACTION_ATTEMPTS: u32 = 60;

static HANDLES: AtomicU64 = AtomicU64::new(0);

/// Read and write capacity units a store handle has consumed, as DynamoDB reported them
/// (`ReturnConsumedCapacity=TOTAL` on every call). Writes refused by their condition also cost
/// write units, but DynamoDB does not report them; [`Capacity::failed_writes`] counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Capacity {
    /// Read capacity units.
    pub read_units: f64,
    /// Write capacity units.
    pub write_units: f64,
    /// Calls made.
    pub calls: u64,
    /// Conditional writes refused (each costs at least one write unit on DynamoDB).
    pub failed_writes: u64,
}

/// The lease store on one DynamoDB table.
///
/// # Table layout
///
/// One table, key `(pk, sk)`, both strings. A group's leases are the items of partition key
/// `L#<group>`, sorted by partition id, so `list` is one paginated `Query` over one
/// partition-key range and never a `Scan`; groups cannot see each other's items. Its
/// heartbeats and its change counter are the items of `H#<group>`, so `membership` is one
/// `Query` of O(hosts) items.
///
/// # Atomicity
///
/// - Every write is conditional on the item's `version` attribute (`ConditionExpression`),
///   with `ReturnValuesOnConditionCheckFailure=ALL_OLD`: a lost compare-and-swap returns the
///   current row with the failure, without a second read.
/// - `create` is `attribute_not_exists(pk)`.
/// - A write that changes ownership (and every create and delete) is a `TransactWriteItems`
///   of the lease write and `ADD change_counter 1` on the counter item: both or neither.
/// - A checkpoint is a single `PutItem` whose condition also requires the stored `state`,
///   `owner` and `next_owner` to equal the new ones, so it can only succeed when ownership
///   does not change, and so never needs the counter. When the handle does not know the old
///   row, it first tries that form; if the condition fails with the row still at the expected
///   version, ownership is changing, and it retries as a transaction conditioned on the old
///   ownership it just got back. Either way no write that changes ownership can skip the
///   counter.
#[derive(Debug, Clone)]
pub struct DynamoLeaseStore {
    client: Client,
    table: String,
    pub(crate) new_group_shards: u32,
    pub(crate) shards_at_hosts: usize,
    head_reads_per_second: f64,
    inner: Arc<Inner>,
}

/// The default of [`DynamoLeaseStore::with_head_reads_per_second`]: DynamoDB serves about
/// 3,000 read units a second on one partition key, and a head read is one strongly
/// consistent read of the counter item (under 4 KB: one unit); a fifth is left for the
/// leader's reads and the ownership transactions on the same item.
pub const DEFAULT_HEAD_READS_PER_SECOND: f64 = 2_400.0;

#[derive(Debug)]
pub(crate) struct Inner {
    /// Ownership of rows this handle last saw, by key: lets `replace` pick the checkpoint or
    /// the transaction form first time. Only a hint: conditions decide.
    seen: Mutex<HashMap<LeaseKey, (Version, Ownership)>>,
    capacity: Mutex<Capacity>,
    pub(crate) rng: Mutex<SmallRng>,
    /// The membership view bodies this handle read or wrote, by group.
    pub(crate) views: Mutex<crate::view::ViewCache>,
    /// Heartbeat shard counts of groups, as last read.
    pub(crate) shards: Mutex<HashMap<GroupName, u32>>,
    /// The partition key each heartbeat row was last written or read under.
    pub(crate) heartbeat_keys: Mutex<HashMap<(GroupName, HostName), String>>,
}

/// How a conditional write ended when its condition failed.
pub(crate) enum Refused {
    /// No item.
    Missing,
    /// The item as it is now.
    Current(Item),
}

impl DynamoLeaseStore {
    /// A store on `table` through `client`. Does not touch the table: call
    /// [`DynamoLeaseStore::ensure_table`] once to create it if absent.
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        let seed = HANDLES.fetch_add(1, Ordering::Relaxed);
        Self::with_seed(client, table, seed)
    }

    /// As [`DynamoLeaseStore::new`], with the seed of the RNG that jitters retry back-off.
    pub fn with_seed(client: Client, table: impl Into<String>, seed: u64) -> Self {
        Self {
            client,
            table: table.into(),
            new_group_shards: DEFAULT_HEARTBEAT_SHARDS,
            shards_at_hosts: DEFAULT_SHARDS_AT_HOSTS,
            head_reads_per_second: DEFAULT_HEAD_READS_PER_SECOND,
            inner: Arc::new(Inner {
                seen: Mutex::new(HashMap::new()),
                capacity: Mutex::new(Capacity::default()),
                rng: Mutex::new(SmallRng::seed_from_u64(seed)),
                views: Mutex::new(HashMap::new()),
                shards: Mutex::new(HashMap::new()),
                heartbeat_keys: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The most head reads per second (one read of a group's counter item each) this handle
    /// asks a fleet to make ([`MembershipStore::head_reads_per_second`]; default
    /// [`DEFAULT_HEAD_READS_PER_SECOND`]): hosts stretch their acquire cycle to `live hosts ÷
    /// limit` when that is longer, so a fleet of 10,000 keeps the counter item's key within
    /// DynamoDB's per-partition read limit. A table with more provisioned or on-demand
    /// headroom cannot raise one key's limit, so lower it only to leave room for other
    /// readers of the item.
    ///
    /// # Errors
    /// [`LeaseError::Store`] naming `head_reads_per_second` if it is not a positive finite
    /// number.
    pub fn with_head_reads_per_second(mut self, limit: f64) -> Result<Self, LeaseError> {
        if !(limit.is_finite() && limit > 0.0) {
            return Err(LeaseError::store(
                "head_reads_per_second",
                None,
                false,
                DynamoError::other(format!(
                    "head_reads_per_second must be a positive finite number (got {limit})"
                )),
            ));
        }
        self.head_reads_per_second = limit;
        Ok(self)
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Connects with `options` (endpoint, region, credentials, timeouts; the rest from the
    /// standard AWS chain), and creates the table if absent. The client's timeouts are
    /// [`Timeouts::DYNAMODB`](crate::Timeouts::DYNAMODB) less what `options` overrides: see
    /// the crate docs, "Timeouts and recovery".
    ///
    /// # Errors
    /// [`LeaseError::Store`] if the table cannot be described or created.
    pub async fn connect(
        options: &crate::AwsOptions,
        table: impl Into<String>,
    ) -> Result<Self, LeaseError> {
        let config = options.load_with(crate::Timeouts::DYNAMODB).await;
        let store = Self::new(Client::new(&config), table);
        store.ensure_table().await?;
        Ok(store)
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Capacity consumed by this handle (and its clones) so far.
    pub fn capacity(&self) -> Capacity {
        *lock(&self.inner.capacity)
    }

    /// Creates the table if it does not exist (key `pk`/`sk`, on-demand billing) and waits
    /// until it is active.
    ///
    /// # Errors
    /// [`LeaseError::Store`] if it cannot be described or created, or is not active within a
    /// minute.
    pub async fn ensure_table(&self) -> Result<(), LeaseError> {
        let created = self
            .client
            .create_table()
            .table_name(&self.table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(attr_def(PK)?)
            .attribute_definitions(attr_def(SK)?)
            .key_schema(key_elem(PK, KeyType::Hash)?)
            .key_schema(key_elem(SK, KeyType::Range)?)
            .send()
            .await;
        if let Err(err) = created {
            let exists = err
                .as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception());
            if !exists {
                return Err(store_error("create_table", Some(self.table.clone()), err));
            }
        }
        match until_active(&self.client, &self.table).await {
            Ok(table) => crate::kcl::check_key_schema(&self.table, &table),
            Err(TableWait::Describe(e)) => {
                Err(store_error("describe_table", Some(self.table.clone()), *e))
            }
            Err(TableWait::NeverActive) => Err(LeaseError::store(
                "create_table",
                Some(self.table.clone()),
                true,
                DynamoError::other(format!("table {} did not become active", self.table)),
            )),
        }
    }

    pub(crate) fn account(&self, kind: Kind, consumed: Option<&ConsumedCapacity>) {
        self.account_all(kind, consumed.into_iter());
    }

    fn account_all<'a>(&self, kind: Kind, consumed: impl Iterator<Item = &'a ConsumedCapacity>) {
        let mut cap = lock(&self.inner.capacity);
        cap.calls += 1;
        for c in consumed {
            // With TOTAL, DynamoDB reports the units of the call as `CapacityUnits`; which kind
            // they are follows from the call.
            let units = c.capacity_units().unwrap_or_else(|| {
                c.read_capacity_units().unwrap_or(0.0) + c.write_capacity_units().unwrap_or(0.0)
            });
            match kind {
                Kind::Read => cap.read_units += units,
                Kind::Write => cap.write_units += units,
            }
        }
    }

    pub(crate) fn account_failed_write(&self) {
        let mut cap = lock(&self.inner.capacity);
        cap.calls += 1;
        cap.failed_writes += 1;
    }

    fn remember(&self, lease: &Lease) {
        lock(&self.inner.seen).insert(lease.key.clone(), (lease.version, lease.ownership()));
    }

    fn forget(&self, key: &LeaseKey) {
        lock(&self.inner.seen).remove(key);
    }

    fn known(&self, key: &LeaseKey, version: Version) -> Option<Ownership> {
        lock(&self.inner.seen)
            .get(key)
            .filter(|(v, _)| *v == version)
            .map(|(_, o)| o.clone())
    }

    pub(crate) async fn backoff(&self, attempt: u32) {
        let cap = 5u64 << attempt.min(5);
        let ms = lock(&self.inner.rng).gen_range(1..=cap);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    fn counter_update(&self, group: &GroupName) -> Result<TransactWriteItem, LeaseError> {
        let update = Update::builder()
            .table_name(&self.table)
            .key(PK, s(heartbeat_pk(group)))
            .key(SK, s(COUNTER_SK))
            .update_expression("ADD #c :one")
            .expression_attribute_names("#c", A_COUNTER)
            .expression_attribute_values(":one", n(1))
            .build()
            .map_err(build_error("transact_write_items"))?;
        Ok(TransactWriteItem::builder().update(update).build())
    }

    /// Runs a transaction of `first` and the counter bump of `group`, retrying conflicts with
    /// other transactions. `Ok(None)`: done; `Ok(Some(refused))`: `first`'s condition failed.
    async fn transact_with_counter(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        first: TransactWriteItem,
    ) -> Result<Option<Refused>, LeaseError> {
        let counter = self.counter_update(&key.group)?;
        let refused = self
            .transact(operation, key.to_string(), vec![first, counter])
            .await?;
        Ok(refused.map(|(_, refused)| refused))
    }

    /// Runs a transaction of `items`, retrying conflicts with other transactions (throttling,
    /// a transaction in progress on the same items). `Ok(None)`: done; `Ok(Some((i,
    /// refused)))`: the condition of `items[i]` failed, and nothing was written.
    pub(crate) async fn transact(
        &self,
        operation: &'static str,
        key: String,
        items: Vec<TransactWriteItem>,
    ) -> Result<Option<(usize, Refused)>, LeaseError> {
        let mut attempt = 0;
        loop {
            let result = self
                .client
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await;
            let err = match result {
                Ok(out) => {
                    self.account_all(Kind::Write, out.consumed_capacity().iter());
                    return Ok(None);
                }
                Err(err) => err,
            };
            let reasons = err.as_service_error().and_then(|e| match e {
                TransactWriteItemsError::TransactionCanceledException(c) => {
                    Some(c.cancellation_reasons().to_vec())
                }
                _ => None,
            });
            let retry_conflict = match &reasons {
                Some(reasons) => {
                    let failed = reasons
                        .iter()
                        .position(|r| r.code() == Some("ConditionalCheckFailed"));
                    if let Some(i) = failed {
                        self.account_failed_write();
                        let item = reasons[i].item().cloned();
                        return Ok(Some((
                            i,
                            match item {
                                Some(item) if !item.is_empty() => Refused::Current(item),
                                _ => Refused::Missing,
                            },
                        )));
                    }
                    reasons.iter().any(|r| {
                        matches!(
                            r.code(),
                            Some("TransactionConflict")
                                | Some("ThrottlingError")
                                | Some("ProvisionedThroughputExceeded")
                        )
                    })
                }
                None => err
                    .as_service_error()
                    .is_some_and(|e| e.is_transaction_in_progress_exception()),
            };
            attempt += 1;
            if retry_conflict && attempt < TRANSACTION_ATTEMPTS {
                self.backoff(attempt).await;
                continue;
            }
            return Err(store_error(operation, Some(key), err));
        }
    }

    fn lease_put(
        &self,
        group: &GroupName,
        row: &LeaseRow,
        version: Version,
        condition: Condition<'_>,
    ) -> Result<Put, LeaseError> {
        let mut put = Put::builder()
            .table_name(&self.table)
            .set_item(Some(lease_item(group, row, version)))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        let (expr, names, values) = condition.render();
        put = put
            .condition_expression(expr)
            .set_expression_attribute_names(Some(names));
        if !values.is_empty() {
            put = put.set_expression_attribute_values(Some(values));
        }
        put.build().map_err(build_error("put"))
    }

    pub(crate) async fn put_item(
        &self,
        put: Put,
        operation: &'static str,
        key: impl std::fmt::Display,
    ) -> Result<Option<Refused>, LeaseError> {
        let result = self
            .client
            .put_item()
            .table_name(put.table_name())
            .set_item(Some(put.item().clone()))
            .set_condition_expression(put.condition_expression().map(str::to_string))
            .set_expression_attribute_names(put.expression_attribute_names().cloned())
            .set_expression_attribute_values(put.expression_attribute_values().cloned())
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await;
        match result {
            Ok(out) => {
                self.account(Kind::Write, out.consumed_capacity());
                Ok(None)
            }
            Err(err) => match err.as_service_error() {
                Some(PutItemError::ConditionalCheckFailedException(e)) => {
                    self.account_failed_write();
                    Ok(Some(match e.item() {
                        Some(item) if !item.is_empty() => Refused::Current(item.clone()),
                        _ => Refused::Missing,
                    }))
                }
                _ => Err(store_error(operation, Some(key.to_string()), err)),
            },
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Read,
    Write,
}

/// A condition on a lease item: its version, and optionally its ownership.
enum Condition<'a> {
    Absent,
    At(Version, Option<&'a Ownership>),
}

impl Condition<'_> {
    fn render(&self) -> (String, HashMap<String, String>, Item) {
        let mut names = HashMap::new();
        let mut values = Item::new();
        match self {
            Condition::Absent => {
                names.insert("#pk".into(), PK.into());
                ("attribute_not_exists(#pk)".into(), names, values)
            }
            Condition::At(version, ownership) => {
                names.insert("#v".into(), A_VERSION.into());
                values.insert(":v".into(), n(version.0));
                let mut expr = "#v = :v".to_string();
                if let Some(o) = ownership {
                    names.insert("#st".into(), A_STATE.into());
                    values.insert(":st".into(), s(o.state.as_str()));
                    expr.push_str(" AND #st = :st");
                    for (attr, alias, value) in [
                        (A_OWNER, "ow", &o.owner),
                        (A_NEXT_OWNER, "nx", &o.next_owner),
                    ] {
                        names.insert(format!("#{alias}"), attr.into());
                        match value {
                            None => expr.push_str(&format!(" AND attribute_not_exists(#{alias})")),
                            Some(h) => {
                                values.insert(format!(":{alias}"), s(h.as_str()));
                                expr.push_str(&format!(" AND #{alias} = :{alias}"));
                            }
                        }
                    }
                }
                (expr, names, values)
            }
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves plain data behind: keep going.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn build_error(
    operation: &'static str,
) -> impl Fn(aws_sdk_dynamodb::error::BuildError) -> LeaseError {
    move |e| LeaseError::store(operation, None, false, e)
}

fn attr_def(name: &str) -> Result<AttributeDefinition, LeaseError> {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(ScalarAttributeType::S)
        .build()
        .map_err(build_error("create_table"))
}

fn key_elem(name: &str, kind: KeyType) -> Result<KeySchemaElement, LeaseError> {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .map_err(build_error("create_table"))
}

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

/// The partition key of `group`'s leases.
pub fn lease_pk(group: &GroupName) -> String {
    format!("L#{group}")
}

/// The partition key of `group`'s heartbeats and change counter.
pub fn heartbeat_pk(group: &GroupName) -> String {
    format!("H#{group}")
}

/// The item of a lease of `group` at `version`: its [`LeaseRow`], unset values left out and the
/// parents as a list of strings.
fn lease_item(group: &GroupName, row: &LeaseRow, version: Version) -> Item {
    let mut item = Item::new();
    item.insert(PK.into(), s(lease_pk(group)));
    item.insert(SK.into(), s(row.partition.as_str()));
    item.insert(A_VERSION.into(), n(version.0));
    item.insert(A_STATE.into(), s(row.state.as_str()));
    for (attr, value) in [
        (A_OWNER, &row.owner),
        (A_NEXT_OWNER, &row.next_owner),
        (A_CONTINUATION, &row.continuation),
    ] {
        if let Some(v) = value {
            item.insert(attr.into(), s(v.as_str()));
        }
    }
    item.insert(A_START.into(), s(row.start.as_str()));
    item.insert(
        A_PARENTS.into(),
        AttributeValue::L(row.parents.iter().map(|p| s(p.as_str())).collect()),
    );
    item.insert(A_PROPERTIES.into(), s(row.properties.as_str()));
    item
}

pub(crate) fn text<'a>(item: &'a Item, attr: &str) -> Result<Option<&'a str>, String> {
    match item.get(attr) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::S(v)) => Ok(Some(v)),
        Some(other) => Err(format!("attribute {attr} is not a string: {other:?}")),
    }
}

pub(crate) fn number(item: &Item, attr: &str) -> Result<u64, String> {
    match item.get(attr) {
        Some(AttributeValue::N(v)) => v
            .parse()
            .map_err(|_| format!("attribute {attr} is not an unsigned integer: {v}")),
        other => Err(format!(
            "attribute {attr} missing or not a number: {other:?}"
        )),
    }
}

/// The key an item names, as text, for error messages (even when it does not parse).
fn item_key(item: &Item) -> String {
    let pk = text(item, PK).ok().flatten().unwrap_or("?");
    let sk = text(item, SK).ok().flatten().unwrap_or("?");
    format!("{}/{sk}", pk.strip_prefix("L#").unwrap_or(pk))
}

fn parse_lease(item: &Item) -> Result<Lease, LeaseError> {
    let key_text = item_key(item);
    let bad = |reason: String| LeaseError::Malformed {
        key: key_text.clone(),
        reason,
    };
    let pk = text(item, PK).map_err(bad)?.unwrap_or_default();
    let group = pk
        .strip_prefix("L#")
        .ok_or_else(|| bad(format!("partition key {pk:?} is not a lease key")))?;
    let group = GroupName::new(group).map_err(|e| bad(e.to_string()))?;
    lease_row(item)
        .and_then(|row| row.decode(&group))
        .map_err(bad)
}

/// The [`LeaseRow`] a lease item holds, or which attribute is wrong.
fn lease_row(item: &Item) -> Result<LeaseRow, String> {
    let owned = |attr: &str| text(item, attr).map(|t| t.map(str::to_string));
    let required = |attr: &str| owned(attr)?.ok_or_else(|| format!("no {attr}"));
    let parents = match item.get(A_PARENTS) {
        None => Vec::new(),
        Some(AttributeValue::L(list)) => list
            .iter()
            .map(|v| match v {
                AttributeValue::S(p) => Ok(p.clone()),
                other => Err(format!("parent is not a string: {other:?}")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("parents is not a list: {other:?}")),
    };
    Ok(LeaseRow {
        partition: owned(SK)?.unwrap_or_default(),
        state: required(A_STATE)?,
        owner: owned(A_OWNER)?,
        next_owner: owned(A_NEXT_OWNER)?,
        continuation: owned(A_CONTINUATION)?,
        start: required(A_START)?,
        parents,
        // An item without properties has none.
        properties: owned(A_PROPERTIES)?.unwrap_or_else(|| "{}".into()),
        version: number(item, A_VERSION)?,
    })
}

pub(crate) fn parse_heartbeat(group: &GroupName, item: &Item) -> Result<Heartbeat, LeaseError> {
    let sk = text(item, SK)
        .ok()
        .flatten()
        .unwrap_or_default()
        .to_string();
    let bad = |reason: String| LeaseError::Malformed {
        key: format!("{group}/{sk}"),
        reason,
    };
    let name = sk
        .strip_prefix(HOST_PREFIX)
        .ok_or_else(|| bad("not a heartbeat".into()))?;
    Ok(Heartbeat {
        group: group.clone(),
        host: HostName::new(name).map_err(|e| bad(e.to_string()))?,
        incarnation: text(item, A_INCARNATION)
            .map_err(bad)?
            .unwrap_or_default()
            .into(),
        version: Version(number(item, A_VERSION).map_err(bad)?),
        written_at: Timestamp(number(item, A_WRITTEN_AT).unwrap_or(0) as i64),
        // Advisory: a report that cannot be read leaves the row without one, never unreadable.
        report: text(item, A_REPORT).ok().flatten().map(Into::into),
    })
}

impl DynamoLeaseStore {
    /// The version of the lease item under `key` as stored, whether or not the rest of it can
    /// be read; `None` if there is no item. For repairing a malformed row (`changefeed reset
    /// --force`): [`LeaseStore::delete`] removes it at this version.
    ///
    /// # Errors
    /// [`LeaseError::Malformed`] if not even the version can be read; [`LeaseError::Store`].
    pub async fn row_version(&self, key: &LeaseKey) -> Result<Option<Version>, LeaseError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(PK, s(lease_pk(&key.group)))
            .key(SK, s(key.partition.as_str()))
            .consistent_read(true)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await
            .map_err(|e| store_error("get", Some(key.to_string()), e))?;
        self.account(Kind::Read, out.consumed_capacity());
        out.item()
            .map(|item| {
                number(item, A_VERSION)
                    .map(Version)
                    .map_err(|reason| LeaseError::Malformed {
                        key: key.to_string(),
                        reason,
                    })
            })
            .transpose()
    }

    fn refused_to_error(
        &self,
        key: &LeaseKey,
        expected: Version,
        refused: Refused,
    ) -> Result<Lease, LeaseError> {
        match refused {
            Refused::Missing => {
                self.forget(key);
                Err(LeaseError::NotFound {
                    key: key.to_string(),
                })
            }
            Refused::Current(item) => {
                let current = parse_lease(&item)?;
                self.remember(&current);
                if current.version == expected {
                    // Only the ownership part of the condition failed: the caller retries.
                    Ok(current)
                } else {
                    Err(LeaseError::Conflict {
                        key: key.to_string(),
                        expected,
                        current: Box::new(current),
                    })
                }
            }
        }
    }
}

#[async_trait]
impl LeaseStore for DynamoLeaseStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let mut listing = Listing::default();
        let mut start: Option<Item> = None;
        loop {
            let out = self
                .client
                .query()
                .table_name(&self.table)
                .key_condition_expression("#pk = :pk")
                .expression_attribute_names("#pk", PK)
                .expression_attribute_values(":pk", s(lease_pk(group)))
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await
                .map_err(|e| store_error("list", Some(group.to_string()), e))?;
            self.account(Kind::Read, out.consumed_capacity());
            for item in out.items() {
                match parse_lease(item) {
                    Ok(lease) => {
                        self.remember(&lease);
                        listing.leases.push(Arc::new(lease));
                    }
                    Err(e) => listing.malformed.push(e),
                }
            }
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
        Ok(listing)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(PK, s(lease_pk(&key.group)))
            .key(SK, s(key.partition.as_str()))
            .consistent_read(true)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await
            .map_err(|e| store_error("get", Some(key.to_string()), e))?;
        self.account(Kind::Read, out.consumed_capacity());
        match out.item() {
            None => Ok(None),
            Some(item) => {
                let lease = parse_lease(item)?;
                self.remember(&lease);
                Ok(Some(lease))
            }
        }
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        let put = self.lease_put(&lease.key.group, &row, Version::FIRST, Condition::Absent)?;
        let first = TransactWriteItem::builder().put(put).build();
        match self
            .transact_with_counter("create", &lease.key, first)
            .await?
        {
            None => {
                let mut stored = lease.clone();
                stored.version = Version::FIRST;
                self.remember(&stored);
                Ok(Some(stored))
            }
            Some(_) => Ok(None),
        }
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        let new = lease.ownership();
        let mut old = self
            .known(&lease.key, expected)
            .unwrap_or_else(|| new.clone());
        let next = expected.next();
        for _ in 0..3 {
            let condition = Condition::At(expected, Some(&old));
            let refused = if old == new {
                let put = self.lease_put(&lease.key.group, &row, next, condition)?;
                self.put_item(put, "replace", &lease.key).await?
            } else {
                let put = self.lease_put(&lease.key.group, &row, next, condition)?;
                let first = TransactWriteItem::builder().put(put).build();
                self.transact_with_counter("replace", &lease.key, first)
                    .await?
            };
            match refused {
                None => {
                    let mut stored = lease.clone();
                    stored.version = next;
                    self.remember(&stored);
                    return Ok(stored);
                }
                Some(refused) => {
                    let current = self.refused_to_error(&lease.key, expected, refused)?;
                    old = current.ownership();
                }
            }
        }
        Err(LeaseError::store(
            "replace",
            Some(lease.key.to_string()),
            true,
            DynamoError::other("the row kept changing ownership at the same version"),
        ))
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        let delete = aws_sdk_dynamodb::types::Delete::builder()
            .table_name(&self.table)
            .key(PK, s(lease_pk(&key.group)))
            .key(SK, s(key.partition.as_str()))
            .condition_expression("#v = :v")
            .expression_attribute_names("#v", A_VERSION)
            .expression_attribute_values(":v", n(expected.0))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(build_error("delete"))?;
        let first = TransactWriteItem::builder().delete(delete).build();
        match self.transact_with_counter("delete", key, first).await? {
            None => {
                self.forget(key);
                Ok(())
            }
            Some(Refused::Missing) => Err(LeaseError::NotFound {
                key: key.to_string(),
            }),
            Some(Refused::Current(item)) => {
                let current = parse_lease(&item)?;
                Err(LeaseError::Conflict {
                    key: key.to_string(),
                    expected,
                    current: Box::new(current),
                })
            }
        }
    }
}
