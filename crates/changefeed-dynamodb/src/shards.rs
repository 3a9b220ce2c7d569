//! Heartbeat rows spread over several partition keys once a fleet outgrows one, and the move
//! from the one-key layout.
//!
//! DynamoDB gives one partition key about 1,000 write units a second. Every host renews its
//! heartbeat every few seconds: 10,000 hosts renewing every 3 s write 3,333 items a second,
//! which one key (`H#<group>`) cannot take. With `S` shards, host `h`'s row lives under
//! `H#<group>#<crc32(h) mod S>`; 16 shards take 10,000 hosts at about 210 writes a second
//! each.
//!
//! Shards are not free: the leader reads every one of them each cycle, one query apiece,
//! billed whether the shard holds a row or not. So a group starts on one key, and grows to
//! [`DynamoLeaseStore::with_heartbeat_shards`] shards (default [`DEFAULT_HEARTBEAT_SHARDS`])
//! when a membership read finds [`DynamoLeaseStore::with_heartbeat_shards_at`] hosts or more
//! (default [`DEFAULT_SHARDS_AT_HOSTS`], an eighth of one key's write limit). A group never
//! shrinks back: hosts move rows at their own pace, and a read that could miss a row moving
//! the other way would judge a live host dead.
//!
//! The shard count is stored in the group's counter item (`heartbeat_shards`); absent means 1,
//! the one-key layout, every row under `H#<group>` (what processes older than sharding read
//! and write). A group grows only while `H#<group>` holds no row written by an older process
//! (rows of this version carry `layout = 2`): an old process reads only `H#<group>`, so it
//! would not see the hosts that moved, judge them dead and take their leases. An operator may
//! also shard a group on one key at once with [`DynamoLeaseStore::set_heartbeat_shards`],
//! under the same check.
//!
//! Hosts learn a new count from the head they read every cycle, and move their row at their
//! next renewal in one transaction (delete at the old key conditioned on the version, put at
//! the new key conditioned on absence). `membership` reads `H#<group>` first, then every
//! shard, so a row moving out of `H#<group>` between the two reads is seen (twice, and the
//! newer copy is kept), never missed.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::{
    Delete, Put, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
};
use changefeed::model::{GroupName, Heartbeat, HostName, Membership, Timestamp, Version};
use changefeed::LeaseError;
use tracing::{info, warn};

use crate::error::{store_error, DynamoError};
use crate::store::{
    build_error, heartbeat_pk, lock, n, number, parse_heartbeat, s, DynamoLeaseStore, Item, Kind,
    Refused, A_COUNTER, A_INCARNATION, A_REPORT, A_VERSION, COUNTER_SK, HOST_PREFIX, PK, SK,
};
use crate::view::counter_of;

/// The counter-item attribute holding the group's heartbeat shard count (absent: 1).
pub const A_SHARDS: &str = "heartbeat_shards";
/// The heartbeat attribute that marks a row written by a process that knows the sharded
/// layout (value 2); rows of older processes lack it.
const A_LAYOUT: &str = "layout";
const LAYOUT: u64 = 2;
const A_WRITTEN_AT: &str = "written_at";

/// Heartbeat shards a group grows to: 10,000 hosts renewing every 3 s (the default) write about
/// 210 items a second per key, a fifth of DynamoDB's per-partition limit.
pub const DEFAULT_HEARTBEAT_SHARDS: u32 = 16;
/// Hosts at which a group on one key grows to its shards: 256 hosts renewing every 3 s write
/// 85 items a second, a twelfth of one key's limit, beside the head reads of the counter item
/// on the same key. Below it a fleet pays for one heartbeat query per leader cycle, not 17.
pub const DEFAULT_SHARDS_AT_HOSTS: usize = 256;
/// The most heartbeat shards a group may have (`membership` reads every one of them).
pub const MAX_HEARTBEAT_SHARDS: u32 = 256;

/// The partition key of `host`'s heartbeat in `group` with `shards` shards: `H#<group>` for
/// one (the layout older processes know), `H#<group>#<k>` otherwise.
pub fn heartbeat_shard_pk(group: &GroupName, shards: u32, host: &HostName) -> String {
    if shards <= 1 {
        heartbeat_pk(group)
    } else {
        format!(
            "{}#{}",
            heartbeat_pk(group),
            crc32fast::hash(host.as_str().as_bytes()) % shards
        )
    }
}

/// The shard count a counter item names (`None`: the attribute is absent).
fn shards_in(group: &GroupName, item: &Item) -> Result<Option<u32>, LeaseError> {
    if !item.contains_key(A_SHARDS) {
        return Ok(None);
    }
    let bad = |reason: String| LeaseError::Malformed {
        key: format!("{group}/{COUNTER_SK}"),
        reason,
    };
    let v = number(item, A_SHARDS).map_err(bad)?;
    u32::try_from(v)
        .ok()
        .filter(|v| (1..=MAX_HEARTBEAT_SHARDS).contains(v))
        .map(Some)
        .ok_or_else(|| {
            bad(format!(
                "{A_SHARDS} = {v} is not in 1..={MAX_HEARTBEAT_SHARDS}"
            ))
        })
}

/// Checks a shard count given by a caller.
pub(crate) fn check_shards(shards: u32) -> Result<u32, LeaseError> {
    if (1..=MAX_HEARTBEAT_SHARDS).contains(&shards) {
        Ok(shards)
    } else {
        Err(LeaseError::store(
            "heartbeat_shards",
            None,
            false,
            DynamoError::other(format!(
                "heartbeat_shards ({shards}) must be in 1..={MAX_HEARTBEAT_SHARDS}"
            )),
        ))
    }
}

impl DynamoLeaseStore {
    /// How many heartbeat shards a group on one key grows to once its fleet reaches
    /// [`DynamoLeaseStore::with_heartbeat_shards_at`] hosts (default
    /// [`DEFAULT_HEARTBEAT_SHARDS`]); 1 keeps every group on one key. A group that already has
    /// shards keeps its count: see [`DynamoLeaseStore::set_heartbeat_shards`] and the crate
    /// README.
    ///
    /// # Errors
    /// [`LeaseError::Store`] naming `heartbeat_shards` if it is not in
    /// 1..=[`MAX_HEARTBEAT_SHARDS`].
    pub fn with_heartbeat_shards(mut self, shards: u32) -> Result<Self, LeaseError> {
        self.new_group_shards = check_shards(shards)?;
        Ok(self)
    }

    /// How many hosts a membership read must find before a group on one key grows to its
    /// shards (default [`DEFAULT_SHARDS_AT_HOSTS`]). 0 or 1: a new group gets its shards from
    /// its first host, before anyone reads its membership.
    #[must_use]
    pub fn with_heartbeat_shards_at(mut self, hosts: usize) -> Self {
        self.shards_at_hosts = hosts;
        self
    }

    /// Caches the shard count a counter item names, if it names one.
    pub(crate) fn learn_shards(&self, group: &GroupName, item: &Item) -> Result<(), LeaseError> {
        if let Some(shards) = shards_in(group, item)? {
            lock(&self.inner().shards).insert(group.clone(), shards);
        }
        Ok(())
    }

    /// The group's heartbeat shard count: cached, or read from the counter item; a group with
    /// no count and no heartbeat row yet gets its shards at once if this handle grows groups
    /// from their first host.
    pub(crate) async fn shards(&self, group: &GroupName) -> Result<u32, LeaseError> {
        if let Some(shards) = lock(&self.inner().shards).get(group) {
            return Ok(*shards);
        }
        let item = self.counter_item(group).await?;
        let shards = match shards_in(group, &item)? {
            Some(shards) => shards,
            None if self.new_group_shards > 1
                && self.shards_at_hosts <= 1
                && self.old_layout_rows(group).await?.is_empty() =>
            {
                self.store_shards(group, self.new_group_shards, None)
                    .await?
            }
            None => 1,
        };
        lock(&self.inner().shards).insert(group.clone(), shards);
        Ok(shards)
    }

    /// Sets the count if it is still `from` (`None`: absent); returns the count stored after.
    async fn store_shards(
        &self,
        group: &GroupName,
        shards: u32,
        from: Option<u32>,
    ) -> Result<u32, LeaseError> {
        let mut req = self
            .client()
            .update_item()
            .table_name(self.table())
            .key(PK, s(heartbeat_pk(group)))
            .key(SK, s(COUNTER_SK))
            .update_expression("SET #s = :s, #c = if_not_exists(#c, :zero)")
            .expression_attribute_names("#s", A_SHARDS)
            .expression_attribute_names("#c", A_COUNTER)
            .expression_attribute_values(":s", n(u64::from(shards)))
            .expression_attribute_values(":zero", n(0))
            .return_consumed_capacity(ReturnConsumedCapacity::Total);
        req = match from {
            None => req.condition_expression("attribute_not_exists(#s)"),
            Some(from) => req
                .condition_expression("#s = :from")
                .expression_attribute_values(":from", n(u64::from(from))),
        };
        match req.send().await {
            Ok(out) => {
                self.account(Kind::Write, out.consumed_capacity());
                Ok(shards)
            }
            Err(err)
                if err
                    .as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                self.account_failed_write();
                // Another handle set it first: take what it set.
                let item = self.counter_item(group).await?;
                Ok(shards_in(group, &item)?.unwrap_or(1))
            }
            Err(err) => Err(store_error(
                "heartbeat_shards",
                Some(group.to_string()),
                err,
            )),
        }
    }

    /// Heartbeat rows under the one-key layout's `H#<group>` that lack this version's layout
    /// mark: processes older than sharding (or rows they left).
    async fn old_layout_rows(&self, group: &GroupName) -> Result<Vec<HostName>, LeaseError> {
        let (_, rows) = self.query_heartbeats(group, heartbeat_pk(group)).await?;
        Ok(rows
            .into_iter()
            .filter(|(_, item)| !item.contains_key(A_LAYOUT))
            .map(|(hb, _)| hb.host)
            .collect())
    }

    /// Spreads `group`'s heartbeat rows over `shards` partition keys: the operator's step
    /// once no process older than sharding runs in the group. Only the one-key layout (1) can
    /// be changed; hosts move their rows at their next renewal after their next head read.
    ///
    /// # Errors
    /// [`LeaseError::Store`] naming `heartbeat_shards` if `shards` is out of range, if the
    /// group already has another count above 1, or if `H#<group>` holds a row of an older
    /// process (named): stop or upgrade those hosts, or remove their rows, and retry.
    pub async fn set_heartbeat_shards(
        &self,
        group: &GroupName,
        shards: u32,
    ) -> Result<(), LeaseError> {
        let shards = check_shards(shards)?;
        let item = self.counter_item(group).await?;
        let current = shards_in(group, &item)?;
        let refuse = |why: String| {
            Err(LeaseError::store(
                "heartbeat_shards",
                Some(group.to_string()),
                false,
                DynamoError::other(why),
            ))
        };
        match current.unwrap_or(1) {
            now if now == shards => return Ok(()),
            1 => {}
            now => {
                return refuse(format!(
                    "group {group} has {now} heartbeat shards; only a group on one key (the \
                     layout older processes use) can be given shards"
                ))
            }
        }
        let old = self.old_layout_rows(group).await?;
        if !old.is_empty() {
            let names: Vec<&str> = old.iter().map(HostName::as_str).collect();
            return refuse(format!(
                "heartbeat_shards: hosts {} of group {group} heartbeat in the one-key layout of \
                 processes older than sharding, which would not see the hosts that move; stop \
                 or upgrade them (or remove their rows) and retry",
                names.join(", ")
            ));
        }
        let stored = self.store_shards(group, shards, current).await?;
        lock(&self.inner().shards).insert(group.clone(), stored);
        if stored != shards {
            return refuse(format!(
                "group {group}: another writer set {stored} heartbeat shards first"
            ));
        }
        Ok(())
    }

    /// Every heartbeat item under `pk`, with the counter item's if `pk` holds it.
    async fn query_heartbeats(
        &self,
        group: &GroupName,
        pk: String,
    ) -> Result<(Option<Item>, Vec<(Heartbeat, Item)>), LeaseError> {
        let mut counter = None;
        let mut rows = Vec::new();
        let mut start: Option<Item> = None;
        loop {
            let out = self
                .client()
                .query()
                .table_name(self.table())
                .key_condition_expression("#pk = :pk")
                .expression_attribute_names("#pk", PK)
                .expression_attribute_values(":pk", s(pk.clone()))
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .send()
                .await
                .map_err(|e| store_error("membership", Some(group.to_string()), e))?;
            self.account(Kind::Read, out.consumed_capacity());
            for item in out.items() {
                if crate::store::text(item, SK).ok().flatten() == Some(COUNTER_SK) {
                    counter = Some(item.clone());
                } else {
                    rows.push((parse_heartbeat(group, item)?, item.clone()));
                }
            }
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
        Ok((counter, rows))
    }

    /// [`MembershipStore::membership`](changefeed::lease::MembershipStore::membership): `H#<group>`
    /// (the counter, and rows of the one-key layout), then every shard.
    pub(crate) async fn read_membership(
        &self,
        group: &GroupName,
    ) -> Result<Membership, LeaseError> {
        let (counter, mut rows) = self.query_heartbeats(group, heartbeat_pk(group)).await?;
        let counter = counter.unwrap_or_default();
        self.learn_shards(group, &counter)?;
        let shards = shards_in(group, &counter)?.unwrap_or(1);
        let mut pks: Vec<String> = vec![heartbeat_pk(group); rows.len()];
        let old_layout = rows
            .iter()
            .find(|(_, item)| !item.contains_key(A_LAYOUT))
            .map(|(hb, _)| hb.host.clone());
        if shards > 1 {
            if let Some(old) = &old_layout {
                warn!(%group, host = %old, shards, "a host heartbeats in the one-key layout of processes older than sharding in a sharded group: it does not see the other hosts");
            }
            let reads = (0..shards).map(|k| {
                let pk = format!("{}#{k}", heartbeat_pk(group));
                async move {
                    self.query_heartbeats(group, pk.clone())
                        .await
                        .map(|r| (pk, r.1))
                }
            });
            for (pk, shard_rows) in futures::future::try_join_all(reads).await? {
                pks.extend(std::iter::repeat_n(pk, shard_rows.len()));
                rows.extend(shard_rows);
            }
        }
        let mut by_host: BTreeMap<HostName, (Heartbeat, String)> = BTreeMap::new();
        for ((hb, _), pk) in rows.into_iter().zip(pks) {
            match by_host.get(&hb.host) {
                Some((seen, _)) if seen.version >= hb.version => {}
                _ => {
                    by_host.insert(hb.host.clone(), (hb, pk));
                }
            }
        }
        if shards == 1 {
            self.grow_if_outgrown(group, old_layout.as_ref(), by_host.len())
                .await;
        }
        let mut keys = lock(&self.inner().heartbeat_keys);
        let hosts = by_host
            .into_values()
            .map(|(hb, pk)| {
                keys.insert((group.clone(), hb.host.clone()), pk);
                hb
            })
            .collect();
        drop(keys);
        Ok(Membership {
            hosts,
            change_counter: counter_of(group, &counter)?,
        })
    }

    /// Gives a group on one key its shards once `hosts` reach this handle's threshold, unless
    /// `old_layout` names a host under `H#<group>` that runs a process older than sharding.
    /// The membership just read stays right: rows move at their next renewal. A failed write
    /// is logged, not returned: the membership read succeeded, and the next one tries again.
    async fn grow_if_outgrown(
        &self,
        group: &GroupName,
        old_layout: Option<&HostName>,
        hosts: usize,
    ) {
        if self.new_group_shards <= 1 || hosts < self.shards_at_hosts.max(1) {
            return;
        }
        if let Some(old) = old_layout {
            warn!(%group, host = %old, hosts, "the group has outgrown one heartbeat key but stays on it: a host heartbeats in the layout of processes older than sharding, which would not see the hosts that move");
            return;
        }
        match self.store_shards(group, self.new_group_shards, None).await {
            Ok(stored) => {
                info!(%group, hosts, shards = stored, "heartbeat rows spread over shards: the fleet outgrew one key");
                lock(&self.inner().shards).insert(group.clone(), stored);
            }
            Err(e) => {
                warn!(%group, hosts, error = %changefeed::error::one_line(&e), "could not spread the heartbeat rows over shards; the next membership read tries again");
            }
        }
    }

    /// Where `host`'s row is now, as far as this handle knows, and where its layout puts it.
    async fn heartbeat_keys(
        &self,
        group: &GroupName,
        host: &HostName,
    ) -> Result<(Option<String>, String), LeaseError> {
        let shards = self.shards(group).await?;
        let to = heartbeat_shard_pk(group, shards, host);
        let from = lock(&self.inner().heartbeat_keys)
            .get(&(group.clone(), host.clone()))
            .cloned();
        Ok((from, to))
    }

    /// The partition key `host`'s row is under, for a removal.
    pub(crate) async fn heartbeat_key(
        &self,
        group: &GroupName,
        host: &HostName,
    ) -> Result<String, LeaseError> {
        let (from, to) = self.heartbeat_keys(group, host).await?;
        Ok(from.unwrap_or(to))
    }

    #[allow(clippy::too_many_arguments)]
    fn heartbeat_put(
        &self,
        pk: String,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        version: Version,
        expected: Option<Version>,
        report: Option<&str>,
    ) -> Result<Put, LeaseError> {
        let mut put = Put::builder()
            .table_name(self.table())
            .item(PK, s(pk))
            .item(SK, s(format!("{HOST_PREFIX}{host}")))
            .item(A_INCARNATION, s(incarnation))
            .item(A_VERSION, n(version.0))
            .item(
                A_WRITTEN_AT,
                aws_sdk_dynamodb::types::AttributeValue::N(written_at.millis().to_string()),
            )
            .item(A_LAYOUT, n(LAYOUT))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        if let Some(report) = report {
            put = put.item(A_REPORT, s(report));
        }
        put = match expected {
            None => put
                .condition_expression("attribute_not_exists(#pk)")
                .expression_attribute_names("#pk", PK),
            Some(v) => put
                .condition_expression("#v = :v")
                .expression_attribute_names("#v", A_VERSION)
                .expression_attribute_values(":v", n(v.0)),
        };
        put.build().map_err(build_error("heartbeat"))
    }

    /// [`MembershipStore::heartbeat`](changefeed::lease::MembershipStore::heartbeat): a conditional put
    /// under the row's key, or, if the group's layout moved it, one transaction of the delete
    /// at the old key and the put at the new one.
    pub(crate) async fn write_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let (from, to) = self.heartbeat_keys(group, host).await?;
        let version = expected.map_or(Version::FIRST, Version::next);
        let key = format!("{group}/{host}");
        let to_pk = to.clone();
        let refused = match (from.filter(|f| *f != to), expected) {
            (Some(from), Some(v)) => {
                let delete = Delete::builder()
                    .table_name(self.table())
                    .key(PK, s(from))
                    .key(SK, s(format!("{HOST_PREFIX}{host}")))
                    .condition_expression("#v = :v")
                    .expression_attribute_names("#v", A_VERSION)
                    .expression_attribute_values(":v", n(v.0))
                    .return_values_on_condition_check_failure(
                        ReturnValuesOnConditionCheckFailure::AllOld,
                    )
                    .build()
                    .map_err(build_error("heartbeat"))?;
                let put =
                    self.heartbeat_put(to, host, incarnation, written_at, version, None, report)?;
                let items = vec![
                    TransactWriteItem::builder().delete(delete).build(),
                    TransactWriteItem::builder().put(put).build(),
                ];
                self.transact("heartbeat", key, items)
                    .await?
                    .map(|(_, r)| r)
            }
            _ => {
                let put = self.heartbeat_put(
                    to,
                    host,
                    incarnation,
                    written_at,
                    version,
                    expected,
                    report,
                )?;
                self.put_item(put, "heartbeat", key).await?
            }
        };
        match refused {
            None => {
                let mut row =
                    self.heartbeat_written(to_pk, group, host, incarnation, written_at, version);
                row.report = report.map(Into::into);
                Ok(row)
            }
            Some(refused) => Err(self.heartbeat_refused(group, host, refused)),
        }
    }

    /// The row a heartbeat write stored; remembers its key.
    pub(crate) fn heartbeat_written(
        &self,
        pk: String,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        version: Version,
    ) -> Heartbeat {
        lock(&self.inner().heartbeat_keys).insert((group.clone(), host.clone()), pk);
        Heartbeat {
            group: group.clone(),
            host: host.clone(),
            incarnation: incarnation.into(),
            version,
            written_at,
            report: None,
        }
    }

    /// The conflict a refused heartbeat write reports.
    pub(crate) fn heartbeat_refused(
        &self,
        group: &GroupName,
        host: &HostName,
        refused: Refused,
    ) -> LeaseError {
        let current = match refused {
            Refused::Missing => None,
            Refused::Current(item) => match parse_heartbeat(group, &item) {
                Ok(hb) => Some(Box::new(hb)),
                Err(e) => return e,
            },
        };
        LeaseError::HeartbeatConflict {
            group: group.to_string(),
            host: host.to_string(),
            current,
        }
    }
}
