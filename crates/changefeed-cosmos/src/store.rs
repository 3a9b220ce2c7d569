//! [`CosmosLeaseStore`]: the lease store seam on one Cosmos DB container.

use changefeed::lease::HeartbeatRole;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::{BackendError, Changes, LeaseRow, LeaseStore, Listing};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    Ownership, PartitionId, Timestamp, Version,
};
use changefeed::LeaseError;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::doc::{
    self, body_etag, deletion_doc, heartbeat_doc, host_id, lease_doc, lease_id, parse_heartbeat,
    parse_lease, CounterDoc, COUNTER_ID, DELETION_PREFIX, HOST_PREFIX, LEASE_PREFIX,
};
use crate::error::CosmosError;
use crate::rest::{etag_of, lock, BatchOp, OpResult, Rest, Usage};

mod members;
mod view;

/// The primary key of the Azure Cosmos DB emulator, published by Microsoft for local use: the
/// default key of [`CosmosOptions`], which the local test server accepts (it checks none).
pub const EMULATOR_KEY: &str =
    "C2y6yDjf5/R+ob0N8A7Cgv30VRDJIWEHLM+4QDU5DE2nQ9nDuVTqobD4b8mGGyPMbIZnqyMsEcaGQy67XIw/Jw==";

/// How many counter moves back a store keeps the deletions `list_changes` reports, by default.
pub const DEFAULT_CHANGES_KEPT: u64 = 16_384;

/// How many times an ownership write is retried when another one moved the group's change
/// counter first (every ownership write of a group goes through that one document). Losses
/// are not independent draws: the last winner knows the counter's new ETag from its own
/// write and can go again at once, while a loser reads first. Four handles creating 10,000
/// leases as fast as they can on a loaded machine starved one of them for 60 attempts in a
/// row; a writer gives up only after about a minute of losing (500 waits of at most 160 ms).
const COUNTER_ATTEMPTS: u32 = 500;

/// The default of [`CosmosOptions::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The default of [`CosmosOptions::timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

/// Attempts of a request that is safe to send again (a read, a query, a `PUT` with
/// `If-Match`) when an attempt gets no answer.
pub const REQUEST_ATTEMPTS: u32 = 2;

/// How long an idle pooled connection is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Idle time of a connection before TCP keepalive probes it.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(10);

/// How many times a write is retried when its row changed without its version moving (a hand
/// edit), before giving up with a retryable error.
const SAME_VERSION_ATTEMPTS: u32 = 3;

static HANDLES: AtomicU64 = AtomicU64::new(0);

/// Where the lease container is and how to reach it.
///
/// ```
/// use changefeed_cosmos::CosmosOptions;
/// let options = CosmosOptions::new("https://my-account.documents.azure.com:443/", "app", "leases")
///     .key("bXkga2V5")
///     .changes_kept(4_096);
/// assert!(!format!("{options:?}").contains("bXkga2V5"), "the key is never printed");
/// ```
#[derive(Clone)]
pub struct CosmosOptions {
    endpoint: String,
    key: String,
    database: String,
    container: String,
    connect_timeout: Duration,
    timeout: Duration,
    changes_kept: u64,
    page_size: i64,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for CosmosOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosOptions")
            .field("endpoint", &self.endpoint)
            .field("key", &"<not shown>")
            .field("database", &self.database)
            .field("container", &self.container)
            .field("connect_timeout", &self.connect_timeout)
            .field("timeout", &self.timeout)
            .field("changes_kept", &self.changes_kept)
            .field("page_size", &self.page_size)
            .finish_non_exhaustive()
    }
}

impl CosmosOptions {
    /// The container `container` of database `database` at the account endpoint `endpoint`
    /// (`https://ACCOUNT.documents.azure.com:443/`, or a local server's `http://127.0.0.1:PORT`).
    /// The key defaults to [`EMULATOR_KEY`]; set the account's with [`CosmosOptions::key`].
    pub fn new(
        endpoint: impl Into<String>,
        database: impl Into<String>,
        container: impl Into<String>,
    ) -> Self {
        Self {
            endpoint: endpoint.into(),
            key: EMULATOR_KEY.into(),
            database: database.into(),
            container: container.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            timeout: DEFAULT_REQUEST_TIMEOUT,
            changes_kept: DEFAULT_CHANGES_KEPT,
            page_size: 1_000,
            clock: Arc::new(SystemClock),
        }
    }

    /// The account's primary or secondary key (base64), which signs every request.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// How long one attempt of a request may take, from connecting to the last byte of its
    /// answer, before it fails (retryable; a read, a query or a `PUT` with `If-Match` is sent
    /// once more first, on another connection). Default [`DEFAULT_REQUEST_TIMEOUT`] (1 s): see
    /// the crate docs, "Timeouts and recovery".
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long opening a TCP connection may take. Default [`DEFAULT_CONNECT_TIMEOUT`] (1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many counter moves back deletions are kept for `list_changes` (at least 1).
    /// Default [`DEFAULT_CHANGES_KEPT`].
    pub fn changes_kept(mut self, moves: u64) -> Self {
        self.changes_kept = moves.max(1);
        self
    }

    /// How many documents one page of `list` and `membership` asks for
    /// (`x-ms-max-item-count`). Default 1,000.
    pub fn page_size(mut self, documents: u32) -> Self {
        self.page_size = i64::from(documents.max(1));
        self
    }

    /// The clock whose wall time dates the requests (`x-ms-date`). Default: the system's.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The database.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The container.
    pub fn container(&self) -> &str {
        &self.container
    }

    /// A REST client of the container these options name (it does not touch the container).
    pub(crate) fn rest(&self) -> Result<Rest, CosmosError> {
        Rest::new(
            &self.endpoint,
            &self.key,
            &self.database,
            &self.container,
            crate::rest::Timeouts {
                connect: self.connect_timeout,
                request: self.timeout,
                attempts: REQUEST_ATTEMPTS,
                pool_idle: POOL_IDLE_TIMEOUT,
                keepalive: TCP_KEEPALIVE,
            },
            self.clock.clone(),
        )
    }

    /// How many documents one page of a query asks for.
    pub(crate) fn query_page_size(&self) -> i64 {
        self.page_size
    }
}

/// The lease store on one Cosmos DB container.
///
/// # Layout
///
/// One container, partition key `/group`: every document of a group (its leases, heartbeats,
/// change counter and deletion records) is in the logical partition of the group's name, so
/// `list`, `membership` and `list_changes` are single-partition queries and an ownership write
/// is a transactional batch. See the `doc` table in the crate docs for the fields.
///
/// # Atomicity
///
/// - `create` writes the lease with `POST` semantics (a batch `Create`, 409 if the id is taken).
/// - A write is a compare-and-swap on the document's `_etag` (`If-Match`): the handle keeps the
///   ETag of each version it read or wrote, and reads the row when it does not know the ETag
///   of the expected version (a different version is a `Conflict` carrying that row, without a
///   write). A 412 means the row changed since: it is read again for the `Conflict`.
/// - A write that changes ownership (and every create and delete) is one transactional batch
///   of two or three operations: the change counter document replaced with the next value
///   (`If-Match` its ETag; `Create` when the group has none yet), then the lease write
///   (stamped `changed_at` with that value), then for a delete the deletion record. Cosmos DB
///   applies all or none. When the counter lost a race the batch is retried on the new
///   counter, after checking that the lease is still as expected.
/// - A checkpoint or a change of properties only is a single `PUT` with `If-Match`: it does not
///   touch the counter, and its ETag precondition pins the ownership it read.
///
/// Handles are cheap to clone (a clone shares the HTTP client and what the handle has seen);
/// [`CosmosLeaseStore::handle`] gives one that shares the client only, as a separate process
/// would.
#[derive(Debug, Clone)]
pub struct CosmosLeaseStore {
    rest: Rest,
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    changes_kept: u64,
    page_size: i64,
    /// The lease rows this handle last read or wrote: their ETag and what they held.
    leases: Mutex<HashMap<LeaseKey, Seen>>,
    /// The heartbeat rows this handle last read or wrote: version and ETag.
    hosts: Mutex<HashMap<(GroupName, HostName), (Version, String)>>,
    /// The change counter documents this handle last read or wrote, each with the `seq` of the
    /// read it goes back to: a read, or a read followed only by this handle's own batches
    /// (each replacing the ETag before it, so no other ownership write came in between).
    counters: Mutex<HashMap<GroupName, (CounterDoc, u64)>>,
    /// A logical clock of this handle's observations: a lease row read when this was `n` was
    /// read after every counter document observed at `n - 1` or earlier.
    seq: AtomicU64,
    rng: Mutex<SmallRng>,
    /// The membership view bodies this handle last read or wrote, by group.
    views: Mutex<HashMap<GroupName, view::CachedBody>>,
}

/// A lease row as this handle last saw it.
#[derive(Debug, Clone)]
struct Seen {
    /// When the handle observed it: `seq` as the read began (or as the write ended).
    seen_at: u64,
    version: Version,
    etag: String,
    ownership: Ownership,
    changed_at: u64,
}

/// The lease part of an ownership batch.
enum LeaseWrite<'a> {
    /// Create the lease at version 1; expects no document.
    Create(&'a LeaseRow),
    /// Replace the document at `etag` with the row at `version`.
    Replace {
        row: &'a LeaseRow,
        version: Version,
        etag: String,
    },
    /// Delete the document at `etag` and write a deletion record.
    Delete { partition: &'a str, etag: String },
}

/// How an ownership batch ended.
enum Outcome {
    /// Applied: the counter value it took, and the lease document's new ETag (none for a
    /// delete).
    Done { stamp: u64, etag: Option<String> },
    /// The lease operation was refused with this status (409 exists, 412 changed, 404 gone);
    /// nothing was written.
    Refused(u16),
}

impl CosmosLeaseStore {
    /// A handle on the container `options` name. Does not touch it: call
    /// [`CosmosLeaseStore::ensure_container`] once to create it if absent, or use
    /// [`CosmosLeaseStore::connect`].
    ///
    /// # Errors
    /// [`LeaseError::Store`] naming the setting (endpoint, key, database, container) that
    /// cannot work.
    pub fn new(options: &CosmosOptions) -> Result<Self, LeaseError> {
        let rest = options.rest().map_err(|e| e.into_lease("connect", None))?;
        Ok(Self::on(rest, options.changes_kept, options.page_size))
    }

    fn on(rest: Rest, changes_kept: u64, page_size: i64) -> Self {
        let seed = HANDLES.fetch_add(1, Ordering::Relaxed);
        Self {
            rest,
            inner: Arc::new(Inner {
                changes_kept,
                page_size,
                leases: Mutex::new(HashMap::new()),
                hosts: Mutex::new(HashMap::new()),
                counters: Mutex::new(HashMap::new()),
                seq: AtomicU64::new(0),
                rng: Mutex::new(SmallRng::seed_from_u64(seed)),
                views: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A handle on the same container and HTTP client that has seen nothing yet, as another
    /// process would be.
    pub fn handle(&self) -> Self {
        Self::on(
            self.rest.clone(),
            self.inner.changes_kept,
            self.inner.page_size,
        )
    }

    /// A handle (as [`CosmosLeaseStore::new`]) whose database and container exist: both are
    /// created if absent, the container with partition key `/group`.
    ///
    /// # Errors
    /// [`LeaseError::Store`] on a bad setting, or if either cannot be created.
    pub async fn connect(options: &CosmosOptions) -> Result<Self, LeaseError> {
        let store = Self::new(options)?;
        store.ensure_container().await?;
        Ok(store)
    }

    /// Creates the database and the container (partition key `/group`) unless they exist.
    ///
    /// # Errors
    /// [`LeaseError::Store`] if either cannot be created.
    pub async fn ensure_container(&self) -> Result<(), LeaseError> {
        self.rest
            .ensure_container(doc::PARTITION_KEY_PATH)
            .await
            .map_err(|e| e.into_lease("ensure_container", Some(self.container_path())))
    }

    /// `database/container`.
    pub fn container_path(&self) -> String {
        format!("{}/{}", self.rest.database, self.rest.container)
    }

    /// Requests and request units this handle's HTTP client has spent (shared by its clones and
    /// [`CosmosLeaseStore::handle`]s).
    pub fn usage(&self) -> Usage {
        self.rest.usage()
    }

    /// The document `id` of `group` as stored, system properties and all; `None` if absent.
    /// For repairs and tests: the lease store never needs it.
    ///
    /// # Errors
    /// [`LeaseError::Store`].
    pub async fn read_document(
        &self,
        group: &GroupName,
        id: &str,
    ) -> Result<Option<Value>, LeaseError> {
        self.rest
            .read(group.as_str(), id)
            .await
            .map(|found| found.map(|(doc, _)| doc))
            .map_err(|e| e.into_lease("read_document", Some(format!("{group}/{id}"))))
    }

    /// Overwrites the document `doc["id"]` of `group` with `doc`, unconditionally (a `PUT`
    /// without `If-Match`), as a person editing the container by hand would. For repairs and
    /// tests: it bypasses every rule of the lease store.
    ///
    /// # Errors
    /// [`LeaseError::Store`], also when there is no such document.
    pub async fn overwrite_document(
        &self,
        group: &GroupName,
        doc: &Value,
    ) -> Result<(), LeaseError> {
        let id = doc.get("id").and_then(Value::as_str).unwrap_or_default();
        let key = format!("{group}/{id}");
        let answer = self
            .rest
            .send(
                http::Method::PUT,
                crate::rest::Resource::Document(id),
                &[
                    (
                        "x-ms-documentdb-partitionkey",
                        Value::Array(vec![group.as_str().into()]).to_string(),
                    ),
                    ("content-type", "application/json".into()),
                ],
                Some(doc::without_system_properties(doc).to_string().into_bytes()),
            )
            .await
            .map_err(|e| e.into_lease("overwrite_document", Some(key.clone())))?;
        if answer.status != 200 {
            return Err(answer
                .into_error()
                .into_lease("overwrite_document", Some(key)));
        }
        lock(&self.inner.leases).retain(|k, _| k.group != *group);
        Ok(())
    }

    /// The ids of the documents of `group` whose id starts with `prefix`, by a single-partition
    /// query (`lease.`, `host.`, `deleted.`, or `counter`).
    ///
    /// # Errors
    /// [`LeaseError::Store`].
    pub async fn document_ids(
        &self,
        group: &GroupName,
        prefix: &str,
    ) -> Result<Vec<String>, LeaseError> {
        let docs = self
            .rest
            .query_all(
                group.as_str(),
                "SELECT c.id FROM c WHERE c.group = @g AND STARTSWITH(c.id, @p)",
                &[("@g", group.as_str().into()), ("@p", prefix.into())],
                self.inner.page_size,
            )
            .await
            .map_err(|e| e.into_lease("document_ids", Some(group.to_string())))?;
        let mut ids: Vec<String> = docs
            .iter()
            .filter_map(|d| d.get("id").and_then(Value::as_str).map(str::to_string))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// The version of the lease document under `key` as stored, whether or not the rest of it
    /// can be read; `None` if there is no document. For repairing a malformed row:
    /// [`LeaseStore::delete`] removes it at this version.
    ///
    /// # Errors
    /// [`LeaseError::Malformed`] if not even the version can be read; [`LeaseError::Store`].
    pub async fn row_version(&self, key: &LeaseKey) -> Result<Option<Version>, LeaseError> {
        let found = self
            .rest
            .read(key.group.as_str(), &lease_id(key.partition.as_str()))
            .await
            .map_err(|e| e.into_lease("get", Some(key.to_string())))?;
        let Some((doc, _)) = found else {
            return Ok(None);
        };
        let version = doc::number(&doc, "version").map_err(|reason| LeaseError::Malformed {
            key: key.to_string(),
            reason,
        })?;
        Ok(Some(Version(version)))
    }

    // ---- what the handle has seen -----------------------------------------------------------

    /// The next value of the handle's observation clock.
    fn tick(&self) -> u64 {
        self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn remember_counter(&self, group: &GroupName, counter: CounterDoc) {
        let at = self.tick();
        lock(&self.inner.counters).insert(group.clone(), (counter, at));
    }

    fn remember(&self, lease: &Lease, etag: String, changed_at: u64) {
        self.remember_at(lease, etag, changed_at, self.tick());
    }

    fn remember_at(&self, lease: &Lease, etag: String, changed_at: u64, seen_at: u64) {
        lock(&self.inner.leases).insert(
            lease.key.clone(),
            Seen {
                seen_at,
                version: lease.version,
                etag,
                ownership: lease.ownership(),
                changed_at,
            },
        );
    }

    fn forget(&self, key: &LeaseKey) {
        lock(&self.inner.leases).remove(key);
    }

    fn known(&self, key: &LeaseKey, version: Version) -> Option<Seen> {
        lock(&self.inner.leases)
            .get(key)
            .filter(|s| s.version == version)
            .cloned()
    }

    /// A random pause after losing the counter to another ownership write, growing with the
    /// attempts (up to 160 ms) so that racing writers do not hammer the server. Shorter caps
    /// were tried: with four writers racing on the local server, their retries crowded out the
    /// reads of the others (the conformance suite's racing-writers check made 165 writes in
    /// 60 s instead of hundreds).
    async fn backoff(&self, attempt: u32) {
        let cap = 5u64 << attempt.min(5);
        let ms = lock(&self.inner.rng).gen_range(1..=cap);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    // ---- reads ------------------------------------------------------------------------------

    /// Reads the lease document of `key`: `None` if absent.
    async fn read_lease(
        &self,
        operation: &'static str,
        key: &LeaseKey,
    ) -> Result<Option<(Lease, Seen)>, LeaseError> {
        let at = self.tick();
        let found = self
            .rest
            .read(key.group.as_str(), &lease_id(key.partition.as_str()))
            .await
            .map_err(|e| e.into_lease(operation, Some(key.to_string())))?;
        let Some((doc, etag)) = found else {
            self.forget(key);
            return Ok(None);
        };
        let parsed = parse_lease(&key.group, &doc)?;
        let seen = Seen {
            seen_at: at,
            version: parsed.lease.version,
            etag,
            ownership: parsed.lease.ownership(),
            changed_at: parsed.changed_at,
        };
        lock(&self.inner.leases).insert(key.clone(), seen.clone());
        Ok(Some((parsed.lease, seen)))
    }

    /// The row of `key` if it is at `expected`: from what the handle saw, or read. A missing row
    /// is `NotFound`, another version a `Conflict` carrying it.
    async fn at_version(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        expected: Version,
    ) -> Result<Seen, LeaseError> {
        if let Some(seen) = self.known(key, expected) {
            return Ok(seen);
        }
        self.read_at_version(operation, key, expected).await
    }

    /// The ETag of the document of `key` if it is at `expected`, even when the rest of it cannot
    /// be read (a delete repairs a malformed row this way); otherwise as [`Self::at_version`].
    async fn etag_at_version(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        expected: Version,
    ) -> Result<(String, u64), LeaseError> {
        if let Some(seen) = self.known(key, expected) {
            return Ok((seen.etag, seen.seen_at));
        }
        let at = self.tick();
        let found = self
            .rest
            .read(key.group.as_str(), &lease_id(key.partition.as_str()))
            .await
            .map_err(|e| e.into_lease(operation, Some(key.to_string())))?;
        match found {
            Some((doc, etag)) if doc::number(&doc, "version").ok() == Some(expected.0) => {
                Ok((etag, at))
            }
            _ => self
                .read_at_version(operation, key, expected)
                .await
                .map(|seen| (seen.etag, seen.seen_at)),
        }
    }

    async fn read_at_version(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        expected: Version,
    ) -> Result<Seen, LeaseError> {
        match self.read_lease(operation, key).await? {
            None => Err(LeaseError::NotFound {
                key: key.to_string(),
            }),
            Some((current, seen)) => {
                if current.version == expected {
                    Ok(seen)
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

    /// The change counter document of `group`, read now.
    async fn read_counter(
        &self,
        operation: &'static str,
        group: &GroupName,
    ) -> Result<CounterDoc, LeaseError> {
        let found = self
            .rest
            .read(group.as_str(), COUNTER_ID)
            .await
            .map_err(|e| e.into_lease(operation, Some(format!("{group}/{COUNTER_ID}"))))?;
        match found {
            None => Ok(CounterDoc::default()),
            Some((doc, etag)) => CounterDoc::parse(group, &doc, etag),
        }
    }

    // ---- ownership writes -------------------------------------------------------------------

    /// Writes `write` to the lease of `key` in one transactional batch with the next value of
    /// the group's change counter, retrying while other ownership writes move the counter
    /// first. `lease_seen_at`: when the handle observed the lease as `write` expects it.
    ///
    /// Before each batch the lease must have been observed after the counter document the
    /// batch replaces: every change of the lease's ETag since then is then a checkpoint (any
    /// ownership write would have moved the counter too, failing the batch's first operation).
    /// When the counter is the newer observation, both are read again first, the counter first. On Cosmos DB
    /// this only saves a batch doomed to fail; on a server that applies a batch in part (the
    /// local test server), it keeps a failed lease operation from following an applied counter
    /// bump except when it races a checkpoint.
    async fn ownership_write(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        write: LeaseWrite<'_>,
        mut lease_seen_at: u64,
    ) -> Result<Outcome, LeaseError> {
        let group = &key.group;
        let name = || Some(key.to_string());
        let id = lease_id(key.partition.as_str());
        let mut fresh = false;
        for attempt in 0..COUNTER_ATTEMPTS {
            let cached = if fresh {
                None
            } else {
                lock(&self.inner.counters).get(group).cloned()
            };
            let (counter, counter_at) = match cached {
                Some((counter, at)) if at <= lease_seen_at => (counter, at),
                // Never seen, lost a race, or newer than what the handle knows of the lease:
                // read both anew, the counter first.
                _ => {
                    let (counter, at, lease) = self.snapshot(operation, key).await?;
                    lease_seen_at = at;
                    if let Some(status) = moved(&write, lease.as_deref()) {
                        return Ok(Outcome::Refused(status));
                    }
                    (counter, at)
                }
            };
            let stamp = counter.counter + 1;
            let deletions_from = match write {
                LeaseWrite::Delete { .. } if stamp > self.inner.changes_kept => {
                    counter.deletions_from.max(stamp - self.inner.changes_kept)
                }
                _ => counter.deletions_from,
            };
            // The view's fields ride along as read: the If-Match pins them.
            let body = counter.with_counter(group, stamp, deletions_from);
            let mut ops = vec![match &counter.etag {
                None => BatchOp::Create(body),
                Some(etag) => BatchOp::Replace {
                    id: COUNTER_ID.into(),
                    body,
                    if_match: etag.clone(),
                },
            }];
            match &write {
                LeaseWrite::Create(row) => ops.push(BatchOp::Create(lease_doc(
                    group,
                    row,
                    Version::FIRST,
                    stamp,
                ))),
                LeaseWrite::Replace { row, version, etag } => ops.push(BatchOp::Replace {
                    id: id.clone(),
                    body: lease_doc(group, row, *version, stamp),
                    if_match: etag.clone(),
                }),
                LeaseWrite::Delete { partition, etag } => {
                    ops.push(BatchOp::Delete {
                        id: id.clone(),
                        if_match: etag.clone(),
                    });
                    ops.push(BatchOp::Create(deletion_doc(group, partition, stamp)));
                }
            }
            let results = self
                .rest
                .batch(group.as_str(), &ops)
                .await
                .map_err(|e| e.into_lease(operation, name()))?;
            let ok = |r: &OpResult| (200..300).contains(&r.status);
            // The counter document as it is now, when its replacement was applied (always with
            // the rest on Cosmos DB; see the crate docs for servers that apply batches in part).
            if ok(&results[0]) {
                let next = CounterDoc {
                    counter: stamp,
                    deletions_from,
                    view: counter.view.clone(),
                    etag: results[0].etag.clone(),
                };
                if next.etag.is_some() {
                    // Replaced at the ETag it was read with: the same basis.
                    lock(&self.inner.counters).insert(group.clone(), (next, counter_at));
                } else {
                    lock(&self.inner.counters).remove(group);
                }
            }
            if results.iter().all(ok) {
                return Ok(Outcome::Done {
                    stamp,
                    etag: results.get(1).and_then(|r| r.etag.clone()),
                });
            }
            // The operation that failed; the others answer 424 (failed dependency).
            let Some((index, failed)) = results
                .iter()
                .enumerate()
                .find(|(_, r)| !ok(r) && r.status != 424)
            else {
                return Err(unexpected(
                    operation,
                    name(),
                    "every operation answered 424",
                ));
            };
            match (index, failed.status) {
                // Another ownership write moved the counter first (or created it).
                // Try again on the counter read anew (and the lease read after it).
                (0, 409 | 412 | 404) => {
                    fresh = true;
                    self.backoff(attempt).await;
                }
                (1, 409 | 412 | 404) => return Ok(Outcome::Refused(failed.status)),
                (_, status) => {
                    let err = CosmosError::Status {
                        request: format!("batch {operation} {key} operation {index}"),
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
                    return Err(err.into_lease(operation, name()));
                }
            }
        }
        Err(unexpected_retryable(
            operation,
            name(),
            format!(
                "the change counter of group {group} kept moving: {COUNTER_ATTEMPTS} attempts \
                 lost to other ownership writes"
            ),
        ))
    }

    /// The change counter document of `key`'s group and then the ETag of `key`'s lease
    /// document (`None`: absent), read one after the other in that order (so the lease is
    /// observed after the counter), and the `seq` of the counter's read. Two point reads: the
    /// local test server answers a query by scanning the whole container.
    async fn snapshot(
        &self,
        operation: &'static str,
        key: &LeaseKey,
    ) -> Result<(CounterDoc, u64, Option<String>), LeaseError> {
        let group = &key.group;
        let counter = self.read_counter(operation, group).await?;
        let at = self.tick();
        let lease = self
            .rest
            .read(group.as_str(), &lease_id(key.partition.as_str()))
            .await
            .map_err(|e| e.into_lease(operation, Some(key.to_string())))?
            .map(|(_, etag)| etag);
        lock(&self.inner.counters).insert(group.clone(), (counter.clone(), at));
        Ok((counter, at, lease))
    }

    /// Removes the deletion records the horizon no longer covers: those at or below
    /// `stamp - changes_kept`. Failures are logged: the next delete removes what is left.
    async fn forget_old_deletions(&self, group: &GroupName, stamp: u64) {
        let Some(cut) = stamp.checked_sub(self.inner.changes_kept) else {
            return;
        };
        if cut == 0 {
            return;
        }
        self.delete_matching(
            group,
            "old deletion record",
            "SELECT c.id FROM c WHERE c.group = @g AND STARTSWITH(c.id, @p) AND c.deleted_at <= @cut",
            &[
                ("@g", group.as_str().into()),
                ("@p", DELETION_PREFIX.into()),
                ("@cut", cut.into()),
            ],
        )
        .await;
    }

    /// Deletes every document of `group` that `query` (selecting `c.id`) finds. Best effort,
    /// for housekeeping (`what` names the documents in the log): a failure is logged, and
    /// what is left is removed by a later call.
    async fn delete_matching(
        &self,
        group: &GroupName,
        what: &'static str,
        query: &str,
        parameters: &[(&str, Value)],
    ) {
        let found = self
            .rest
            .query_all(group.as_str(), query, parameters, self.inner.page_size)
            .await;
        let found = match found {
            Ok(found) => found,
            Err(error) => {
                tracing::warn!(%group, %error, what, "listing documents to remove failed");
                return;
            }
        };
        for id in found
            .iter()
            .filter_map(|d| d.get("id").and_then(Value::as_str))
        {
            self.delete_quietly(group, what, id).await;
        }
    }

    /// Deletes the document `id` of `group`; gone already is fine, a failure is logged.
    async fn delete_quietly(&self, group: &GroupName, what: &'static str, id: &str) {
        match self.rest.delete(group.as_str(), id, None).await {
            Ok(answer) if matches!(answer.status, 200 | 204 | 404) => {}
            Ok(answer) => {
                tracing::warn!(%group, id, what, error = %answer.into_error(), "removing a document failed")
            }
            Err(error) => tracing::warn!(%group, id, what, %error, "removing a document failed"),
        }
    }

    // ---- heartbeats -------------------------------------------------------------------------

    async fn read_heartbeat(
        &self,
        operation: &'static str,
        group: &GroupName,
        host: &HostName,
    ) -> Result<Option<(Heartbeat, String)>, LeaseError> {
        let found = self
            .rest
            .read(group.as_str(), &host_id(host.as_str()))
            .await
            .map_err(|e| e.into_lease(operation, Some(format!("{group}/{host}"))))?;
        match found {
            None => {
                lock(&self.inner.hosts).remove(&(group.clone(), host.clone()));
                Ok(None)
            }
            Some((doc, etag)) => {
                let hb = parse_heartbeat(group, &doc)?;
                lock(&self.inner.hosts)
                    .insert((group.clone(), host.clone()), (hb.version, etag.clone()));
                Ok(Some((hb, etag)))
            }
        }
    }

    fn heartbeat_conflict(
        group: &GroupName,
        host: &HostName,
        current: Option<Heartbeat>,
    ) -> LeaseError {
        LeaseError::HeartbeatConflict {
            group: group.to_string(),
            host: host.to_string(),
            current: current.map(Box::new),
        }
    }
}

fn unexpected(operation: &'static str, key: Option<String>, reason: &str) -> LeaseError {
    CosmosError::Unexpected {
        request: operation.to_string(),
        reason: reason.to_string(),
    }
    .into_lease(operation, key)
}

fn unexpected_retryable(
    operation: &'static str,
    key: Option<String>,
    reason: String,
) -> LeaseError {
    LeaseError::store(
        operation,
        key,
        true,
        CosmosError::Unexpected {
            request: operation.to_string(),
            reason,
        },
    )
}

/// Whether the lease moved away from what `write` expects, given the ETag of its document now
/// (`None`: absent): the status its operation would fail with (409 it exists, 404 it is gone,
/// 412 it changed), or `None`.
fn moved(write: &LeaseWrite<'_>, now: Option<&str>) -> Option<u16> {
    match (write, now) {
        (LeaseWrite::Create(_), None) => None,
        (LeaseWrite::Create(_), Some(_)) => Some(409),
        (_, None) => Some(404),
        (LeaseWrite::Replace { etag, .. } | LeaseWrite::Delete { etag, .. }, Some(now)) => {
            (now != etag).then_some(412)
        }
    }
}

/// Sorts malformed-row errors by the key they name.
fn sort_malformed(errors: &mut [LeaseError]) {
    errors.sort_by(|a, b| {
        let key = |e: &LeaseError| match e {
            LeaseError::Malformed { key, .. } => key.clone(),
            other => other.to_string(),
        };
        key(a).cmp(&key(b))
    });
}

#[async_trait]
impl LeaseStore for CosmosLeaseStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let at = self.tick();
        let docs = self
            .rest
            .query_all(
                group.as_str(),
                "SELECT * FROM c WHERE c.group = @g AND STARTSWITH(c.id, @p)",
                &[("@g", group.as_str().into()), ("@p", LEASE_PREFIX.into())],
                self.inner.page_size,
            )
            .await
            .map_err(|e| e.into_lease("list", Some(group.to_string())))?;
        let mut listing = Listing::default();
        for doc in &docs {
            match parse_lease(group, doc) {
                Ok(parsed) => {
                    if let Some(etag) = body_etag(doc) {
                        self.remember_at(&parsed.lease, etag, parsed.changed_at, at);
                    }
                    listing.leases.push(Arc::new(parsed.lease));
                }
                Err(e) => listing.malformed.push(e),
            }
        }
        listing
            .leases
            .sort_by(|a, b| a.key.partition.cmp(&b.key.partition));
        sort_malformed(&mut listing.malformed);
        Ok(listing)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        Ok(self.read_lease("get", key).await?.map(|(lease, _)| lease))
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        // Known to exist: nothing to write. (Cosmos DB would refuse the batch as a whole; a
        // server that applies batches in part would move the counter for nothing.)
        let checked_at = self.tick();
        if self.read_lease("create", &lease.key).await?.is_some() {
            return Ok(None);
        }
        match self
            .ownership_write("create", &lease.key, LeaseWrite::Create(&row), checked_at)
            .await?
        {
            Outcome::Done { stamp, etag } => {
                let mut stored = lease.clone();
                stored.version = Version::FIRST;
                match etag {
                    Some(etag) => self.remember(&stored, etag, stamp),
                    None => self.forget(&stored.key),
                }
                Ok(Some(stored))
            }
            Outcome::Refused(409) => Ok(None),
            Outcome::Refused(status) => Err(unexpected(
                "create",
                Some(lease.key.to_string()),
                &format!("creating the lease document was refused with HTTP {status}"),
            )),
        }
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        let row = LeaseRow::encode(lease)?;
        let key = &lease.key;
        let next = expected.next();
        let new = lease.ownership();
        let mut stored = lease.clone();
        stored.version = next;
        for _ in 0..SAME_VERSION_ATTEMPTS {
            let seen = self.at_version("replace", key, expected).await?;
            if seen.ownership == new {
                // A checkpoint: one conditional PUT, the stamp unchanged.
                let doc = lease_doc(&key.group, &row, next, seen.changed_at);
                let answer = self
                    .rest
                    .replace(
                        key.group.as_str(),
                        &lease_id(key.partition.as_str()),
                        &doc,
                        &seen.etag,
                    )
                    .await
                    .map_err(|e| e.into_lease("replace", Some(key.to_string())))?;
                match answer.status {
                    200 | 201 => {
                        let body = answer.json().ok();
                        let etag = body
                            .as_ref()
                            .and_then(|b| etag_of(&answer, b).ok())
                            .or_else(|| answer.header("etag").map(str::to_string));
                        match etag {
                            Some(etag) => self.remember(&stored, etag, seen.changed_at),
                            None => self.forget(key),
                        }
                        return Ok(stored);
                    }
                    // Changed since: read it again for the conflict (or, at the same version,
                    // a hand edit: try again on it).
                    412 => self.forget(key),
                    404 => {
                        self.forget(key);
                        return Err(LeaseError::NotFound {
                            key: key.to_string(),
                        });
                    }
                    _ => {
                        return Err(answer
                            .into_error()
                            .into_lease("replace", Some(key.to_string())))
                    }
                }
            } else {
                let write = LeaseWrite::Replace {
                    row: &row,
                    version: next,
                    etag: seen.etag.clone(),
                };
                match self
                    .ownership_write("replace", key, write, seen.seen_at)
                    .await?
                {
                    Outcome::Done { stamp, etag } => {
                        match etag {
                            Some(etag) => self.remember(&stored, etag, stamp),
                            None => self.forget(key),
                        }
                        return Ok(stored);
                    }
                    Outcome::Refused(404) => {
                        self.forget(key);
                        return Err(LeaseError::NotFound {
                            key: key.to_string(),
                        });
                    }
                    Outcome::Refused(_) => self.forget(key),
                }
            }
        }
        Err(unexpected_retryable(
            "replace",
            Some(key.to_string()),
            format!(
                "the document kept changing while at version {expected}: {SAME_VERSION_ATTEMPTS} \
                 attempts"
            ),
        ))
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        for _ in 0..SAME_VERSION_ATTEMPTS {
            let (etag, seen_at) = self.etag_at_version("delete", key, expected).await?;
            let write = LeaseWrite::Delete {
                partition: key.partition.as_str(),
                etag,
            };
            match self.ownership_write("delete", key, write, seen_at).await? {
                Outcome::Done { stamp, .. } => {
                    self.forget(key);
                    self.forget_old_deletions(&key.group, stamp).await;
                    return Ok(());
                }
                Outcome::Refused(404) => {
                    self.forget(key);
                    return Err(LeaseError::NotFound {
                        key: key.to_string(),
                    });
                }
                Outcome::Refused(_) => self.forget(key),
            }
        }
        Err(unexpected_retryable(
            "delete",
            Some(key.to_string()),
            format!(
                "the document kept changing while at version {expected}: {SAME_VERSION_ATTEMPTS} \
                 attempts"
            ),
        ))
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        const QUERY: &str = "SELECT * FROM c WHERE c.group = @g AND (c.id = @counter \
            OR (STARTSWITH(c.id, @lease) AND c.changed_at > @since) \
            OR (STARTSWITH(c.id, @deleted) AND c.deleted_at > @since))";
        let params = [
            ("@g", Value::from(group.as_str())),
            ("@counter", COUNTER_ID.into()),
            ("@lease", LEASE_PREFIX.into()),
            ("@deleted", DELETION_PREFIX.into()),
            ("@since", since.into()),
        ];
        let err = |e: CosmosError| e.into_lease("list_changes", Some(group.to_string()));
        // One page is one read. Should the answer span pages, it is one snapshot only if the
        // counter document did not move meanwhile (every change of hands moves it): checked
        // by reading it after the last page, and read again if it moved.
        for _ in 0..3 {
            let at = self.tick();
            let (mut docs, mut next) = self
                .rest
                .query_page(group.as_str(), QUERY, &params, -1, None)
                .await
                .map_err(err)?;
            let paged = next.is_some();
            while let Some(token) = next {
                let (more, after) = self
                    .rest
                    .query_page(group.as_str(), QUERY, &params, -1, Some(&token))
                    .await
                    .map_err(err)?;
                docs.extend(more);
                next = after;
            }
            let mut counter = CounterDoc::default();
            let mut changes = Changes::default();
            for doc in &docs {
                let id = doc.get("id").and_then(Value::as_str).unwrap_or_default();
                if id == COUNTER_ID {
                    counter = CounterDoc::parse(group, doc, body_etag(doc).unwrap_or_default())?;
                } else if id.starts_with(LEASE_PREFIX) {
                    match parse_lease(group, doc) {
                        Ok(parsed) => {
                            if let Some(etag) = body_etag(doc) {
                                self.remember_at(&parsed.lease, etag, parsed.changed_at, at);
                            }
                            changes.leases.push(Arc::new(parsed.lease));
                        }
                        Err(e) => changes.malformed.push(e),
                    }
                } else if id.starts_with(DELETION_PREFIX) {
                    let partition = doc.get("partition").and_then(Value::as_str).unwrap_or("");
                    match PartitionId::new(partition) {
                        Ok(p) => changes.deleted.push(LeaseKey::new(group.clone(), p)),
                        Err(e) => changes.malformed.push(LeaseError::Malformed {
                            key: format!("{group}/{id}"),
                            reason: format!("the deletion record's partition: {e}"),
                        }),
                    }
                }
            }
            if paged {
                let now = self.read_counter("list_changes", group).await?;
                if now.etag != counter.etag {
                    continue;
                }
            } else if counter.etag.is_some() {
                self.remember_counter(group, counter.clone());
            }
            if since > counter.counter || since < counter.deletions_from {
                return Ok(None);
            }
            changes.counter = counter.counter;
            changes
                .leases
                .sort_by(|a, b| a.key.partition.cmp(&b.key.partition));
            changes
                .deleted
                .sort_by(|a, b| a.partition.cmp(&b.partition));
            changes.deleted.dedup();
            sort_malformed(&mut changes.malformed);
            return Ok(Some(changes));
        }
        // The counter kept moving under a paged answer: let the caller list in full.
        Ok(None)
    }
}
