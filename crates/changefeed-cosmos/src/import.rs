//! Taking over a .NET change feed processor's lease container: the same leases, at the same
//! continuations, in any lease store.
//!
//! A team running the Azure Cosmos DB change feed processor of the .NET v3 SDK
//! (`Container.GetChangeFeedProcessorBuilder`) or of the older v2 library
//! (`Microsoft.Azure.DocumentDB.ChangeFeedProcessor`) moves to changefeed without reading
//! anything twice or skipping anything: [`import_dotnet_leases`] reads every document of the
//! .NET lease container, recognises the leases, refuses while a .NET host may still hold one,
//! and creates one of our leases per .NET lease, available, at its continuation.
//!
//! This module owns reading the .NET documents ([`parse_dotnet_document`]), choosing what to
//! import and refusing what must not be ([`plan_import`], a pure function of the documents and
//! the time), and writing the plan through any [`LeaseStore`]. What a continuation means to the
//! Cosmos DB change feed is the feed source's business; the target store's rules (create if
//! absent, compare-and-swap) are the store's.
//!
//! # The .NET documents
//!
//! Every lease id is the processor's *lease prefix*, `..` and the lease token; the prefix is
//! the builder's `leasePrefix` followed by `{account host}_{database rid}_{container rid}`, so
//! one lease container can hold the leases of several processors. Fields as the .NET
//! serializer writes them (Newtonsoft.Json; `_etag`, `_ts` and the other `_` fields are
//! Cosmos DB's):
//!
//! | document | written by | fields read here |
//! |---|---|---|
//! | EPK-range lease, `version: 1` | v3 SDK (`DocumentServiceLeaseCoreEpk`) | `id`, `LeaseToken` (`"0"`, or `"{min}-{max}"` after a merge, or a split under such a lease), `FeedRange` (`{"Range":{"min":"","max":"FF"}}`), `Owner`, `ContinuationToken` (`"\"42\""`: the quoted LSN), `timestamp`, `properties`, `Mode` |
//! | partition-key-range lease, `version: 0` or none | v3 SDK (`DocumentServiceLeaseCore`) | as above; `PartitionId` too when it was a v2 lease once |
//! | partition lease | v2 library (`DocumentServiceLease`) | `id`, `PartitionId`, `Owner`, `ContinuationToken`, `timestamp`, `properties` (and `gremlincompatid`, unused) |
//! | `{prefix}.info` | both | `id` only: the processor finished creating its leases |
//! | `{prefix}.lock` | both | `id`, `ttl`: a processor is creating its leases (or died doing so) |
//!
//! `timestamp` is the last renewal or checkpoint, ISO 8601 as Newtonsoft writes a `DateTime`
//! (`2024-05-06T07:08:09.1234567Z`); when it is absent the .NET processor uses `_ts`, and so
//! does this module.
//!
//! # What maps to what
//!
//! | .NET | ours |
//! |---|---|
//! | `LeaseToken` (v3) or `PartitionId` (v2) | the partition id |
//! | `ContinuationToken` | the continuation, as is (`"\"42\""`); empty or null: none, and the lease starts at [`ImportOptions::start`] (beginning by default) |
//! | `Owner`, `timestamp` | nothing: the lease is available, with no owner (but see *refused*) |
//! | `id`, the schema, `FeedRange` | properties `dotnet.id`, `dotnet.schema` (`v3-epk`, `v3-pkrange`, `v2`), `dotnet.feed_range` (`{"min":"","max":"FF"}`) |
//! | `properties` | properties `dotnet.property.{key}` |
//!
//! # What is refused
//!
//! Nothing is written when any of these holds; the error names every document concerned.
//!
//! - A lease is **owned and fresh**: `Owner` is set and `timestamp` is less than
//!   [`ImportOptions::expiry`] old (default 60 s, the .NET `LeaseExpirationInterval`), or in
//!   the future. A .NET host may still be reading that range. Stop the .NET processors
//!   (`StopAsync` releases their leases) or wait for the expiry. No option overrides this.
//! - A document is **not recognised**: neither a lease (no `LeaseToken` or `PartitionId`, an
//!   unknown `version`, an id that does not end with `..` and the token, a field of the wrong
//!   type) nor a `.info` or `.lock` marker; or a lease of the all-versions-and-deletes mode
//!   (`Mode`), whose continuations are of another feed.
//! - The container holds **no lease**, or the leases of **several processors** and
//!   [`ImportOptions::processor`] does not choose one.
//!
//! A lease already in the target store is left as it is and reported; with
//! [`ImportOptions::force`] it is replaced by the .NET lease unless one of our hosts owns it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use changefeed::clock::{Clock, SystemClock};
use changefeed::lease::LeaseStore;
use changefeed::model::{
    Continuation, GroupName, Lease, LeaseKey, LeaseState, PartitionId, Position, Timestamp,
};
use changefeed::LeaseError;
use serde_json::Value;

use crate::error::CosmosError;
use crate::rest::Rest;
use crate::store::CosmosOptions;

/// How long after its last renewal a .NET lease counts as live, by default: the .NET
/// processor's default `LeaseExpirationInterval`.
pub const DEFAULT_DOTNET_LEASE_EXPIRY: Duration = Duration::from_secs(60);

/// The prefix of the properties an imported lease gets from its .NET lease.
pub const PROPERTY_PREFIX: &str = "dotnet.";

/// Which .NET library wrote a lease document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DotnetSchema {
    /// The v3 SDK's lease of an EPK range (`version: 1`, `DocumentServiceLeaseCoreEpk`).
    V3Epk,
    /// The v3 SDK's lease of a partition key range (`version: 0` or none, `LeaseToken`,
    /// `DocumentServiceLeaseCore`).
    V3PartitionKeyRange,
    /// The v2 library's lease of a partition key range (`PartitionId`, no `LeaseToken`).
    V2,
}

impl DotnetSchema {
    /// `v3-epk`, `v3-pkrange` or `v2`.
    pub fn as_str(self) -> &'static str {
        match self {
            DotnetSchema::V3Epk => "v3-epk",
            DotnetSchema::V3PartitionKeyRange => "v3-pkrange",
            DotnetSchema::V2 => "v2",
        }
    }
}

impl fmt::Display for DotnetSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The effective partition key range of a v3 lease (`FeedRange.Range`): `min` inclusive,
/// `max` exclusive, hex strings (`""` and `"FF"` for the whole container).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedRange {
    /// The lower bound.
    pub min: String,
    /// The upper bound.
    pub max: String,
}

/// A .NET lease document, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DotnetLease {
    /// The document id: `processor`, `..`, `token`.
    pub id: String,
    /// The processor's lease prefix (the id without `..` and the token).
    pub processor: String,
    /// Which library wrote it.
    pub schema: DotnetSchema,
    /// `LeaseToken` (v3) or `PartitionId` (v2).
    pub token: String,
    /// `FeedRange`, when the document has one.
    pub feed_range: Option<FeedRange>,
    /// `Owner`; `None` when null, empty or blank (as the .NET balancer reads it).
    pub owner: Option<String>,
    /// `ContinuationToken`; `None` when null or empty.
    pub continuation: Option<String>,
    /// The last renewal: `timestamp`, or `_ts` without it (0 without either), as the .NET
    /// processor reads it.
    pub renewed_at: Timestamp,
    /// `properties`.
    pub properties: BTreeMap<String, String>,
}

/// What a document of a .NET lease container is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DotnetDocument {
    /// A lease.
    Lease(DotnetLease),
    /// `{processor}.info`: the processor finished creating its leases.
    Initialized {
        /// The processor's lease prefix.
        processor: String,
    },
    /// `{processor}.lock`: a processor is creating its leases, or died doing so.
    InitializationLock {
        /// The processor's lease prefix.
        processor: String,
    },
}

/// A document that cannot be imported, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentProblem {
    /// The document id (`?` when it has none).
    pub id: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for DocumentProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.id, self.reason)
    }
}

/// A .NET lease that is owned and was renewed within the expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveLease {
    /// The document id.
    pub id: String,
    /// The lease token.
    pub token: String,
    /// The .NET host that owns it.
    pub owner: String,
    /// Its last renewal.
    pub renewed_at: Timestamp,
    /// How long before the import's clock reading that was, in milliseconds (negative: the
    /// timestamp is in the future, the clocks disagree).
    pub age_ms: i64,
}

impl fmt::Display for LiveLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let when = if self.age_ms >= 0 {
            format!("{} ago", seconds(self.age_ms))
        } else {
            format!("{} in the future", seconds(-self.age_ms))
        };
        write!(
            f,
            "{:?} (lease token {:?}, owner {:?}, renewed {} at {})",
            self.id,
            self.token,
            self.owner,
            when,
            format_dotnet_time(self.renewed_at)
        )
    }
}

/// `60s`, `0.1s`: milliseconds as seconds, to a tenth.
fn seconds(ms: i64) -> String {
    match (ms / 1000, (ms % 1000) / 100) {
        (s, 0) => format!("{s}s"),
        (s, tenths) => format!("{s}.{tenths}s"),
    }
}

fn list<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why an import did not happen (or stopped).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The .NET lease container cannot be reached or read (or a setting is wrong).
    #[error("reading the .NET lease container {container}: {source}")]
    Read {
        /// `database/container`.
        container: String,
        /// Cosmos DB's answer or the transport's error.
        #[source]
        source: CosmosError,
    },
    /// The .NET lease container does not exist.
    #[error(
        "the .NET lease container {container} does not exist at {endpoint} (database or container not found)"
    )]
    NoContainer {
        /// `database/container`.
        container: String,
        /// The account endpoint.
        endpoint: String,
    },
    /// Some documents are neither .NET leases nor their `.info` / `.lock` markers, or are
    /// leases this importer will not carry over. Nothing was written.
    #[error(
        "{} document(s) of the lease container cannot be imported, so nothing was: {}",
        documents.len(),
        list(documents)
    )]
    Unrecognised {
        /// Each document and why.
        documents: Vec<DocumentProblem>,
    },
    /// The container holds no .NET lease.
    #[error(
        "the lease container holds no .NET change feed processor lease (no document with LeaseToken or PartitionId); is it the processor's lease container?"
    )]
    NoLeases,
    /// The container holds the leases of several processors and the options do not choose
    /// one.
    #[error(
        "the lease container holds the leases of {} .NET processors{}; choose one by its lease prefix (ImportOptions::processor, --prefix): {}",
        processors.len(),
        asked.as_ref().map(|a| format!(" whose lease prefix starts with {a:?}")).unwrap_or_default(),
        processors.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
    )]
    SeveralProcessors {
        /// The prefix asked for, if any.
        asked: Option<String>,
        /// The lease prefixes found.
        processors: Vec<String>,
    },
    /// No processor's lease prefix starts with the one asked for.
    #[error(
        "no .NET processor's lease prefix starts with {asked:?}; the lease container holds: {}",
        processors.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
    )]
    UnknownProcessor {
        /// The prefix asked for.
        asked: String,
        /// The lease prefixes found.
        processors: Vec<String>,
    },
    /// .NET leases are owned and fresh: a .NET host may still be reading them. Nothing was
    /// written.
    #[error(
        "refusing to import: {} .NET lease(s) of processor {processor:?} are owned and were renewed less than {} ago, so a .NET host may still be reading them: {}. Stop the .NET processors (StopAsync releases their leases) or wait until every lease is older than {}, then run again. Nothing was written.",
        leases.len(),
        seconds(expiry.as_millis().min(i64::MAX as u128) as i64),
        list(leases),
        seconds(expiry.as_millis().min(i64::MAX as u128) as i64)
    )]
    Live {
        /// The processor's lease prefix.
        processor: String,
        /// The expiry used.
        expiry: Duration,
        /// Each live lease.
        leases: Vec<LiveLease>,
    },
    /// Writing to the target store failed. The leases before this one were written; running
    /// the import again creates the rest.
    #[error("writing lease {key} to the target store: {source}")]
    Write {
        /// Our lease key.
        key: String,
        /// The store's error.
        #[source]
        source: LeaseError,
    },
}

/// How to import.
///
/// ```
/// use std::time::Duration;
/// use changefeed::model::Position;
/// use changefeed_cosmos::import::ImportOptions;
/// let options = ImportOptions::default()
///     .expiry(Duration::from_secs(30))
///     .start(Position::Now)
///     .processor("orders")
///     .dry_run(true);
/// assert_eq!(options.expiry_value(), Duration::from_secs(30));
/// ```
#[derive(Clone, Debug)]
pub struct ImportOptions {
    expiry: Duration,
    start: Position,
    force: bool,
    dry_run: bool,
    processor: Option<String>,
    clock: Arc<dyn Clock>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            expiry: DEFAULT_DOTNET_LEASE_EXPIRY,
            start: Position::Beginning,
            force: false,
            dry_run: false,
            processor: None,
            clock: Arc::new(SystemClock),
        }
    }
}

impl ImportOptions {
    /// How long after its `timestamp` an owned .NET lease still counts as live. Set it to the
    /// .NET fleet's `LeaseExpirationInterval` if it is not the default 60 s.
    pub fn expiry(mut self, expiry: Duration) -> Self {
        self.expiry = expiry;
        self
    }

    /// Where a lease without a continuation starts. Default [`Position::Beginning`], which never
    /// skips a change. (The .NET v3 processor starts such a lease at its own start time unless
    /// told otherwise; that time is not in the lease container, and `Now` would skip the
    /// changes since.)
    pub fn start(mut self, start: Position) -> Self {
        self.start = start;
        self
    }

    /// Replace leases already in the target store (unless one of our hosts owns them) with
    /// the .NET lease. Default: leave them and report them.
    pub fn force(mut self, force: bool) -> Self {
        self.force = force;
        self
    }

    /// Read and check everything, write nothing: the report says what would be done.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Import the processor whose lease prefix is this, or starts with this (one must).
    /// Needed only when the container holds the leases of several processors.
    pub fn processor(mut self, prefix: impl Into<String>) -> Self {
        self.processor = Some(prefix.into());
        self
    }

    /// The clock whose wall time judges the .NET timestamps. Default: the system's.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The expiry.
    pub fn expiry_value(&self) -> Duration {
        self.expiry
    }
}

/// A .NET lease and the lease it becomes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedLease {
    /// The .NET lease.
    pub dotnet: DotnetLease,
    /// Ours: available, no owner, at the .NET continuation.
    pub lease: Lease,
}

/// What [`plan_import`] decided: the leases to write, and what else it saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportPlan {
    /// The processor whose leases are imported (its lease prefix).
    pub processor: String,
    /// Its leases, ordered by partition id.
    pub leases: Vec<PlannedLease>,
    /// Whether its `.info` document is there (it finished creating its leases). When it is
    /// not, some of its ranges may have no lease yet.
    pub initialized: bool,
    /// Whether its `.lock` document is there (it was creating its leases).
    pub initialization_lock: bool,
    /// The lease prefixes of the other processors in the container, left alone.
    pub other_processors: Vec<String>,
}

/// What happened to one lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportOutcome {
    /// Created in the target store.
    Created,
    /// Would be created (dry run).
    WouldCreate,
    /// Already in the target store, left as it is. `same_position`: it already resumes
    /// where the .NET lease does.
    Existing {
        /// Whether it resumes where the .NET lease does.
        same_position: bool,
    },
    /// Replaced by the .NET lease ([`ImportOptions::force`]).
    Replaced,
    /// Would be replaced (dry run with force).
    WouldReplace,
    /// Not written, and why.
    Skipped {
        /// Why.
        reason: String,
    },
}

impl ImportOutcome {
    /// `created`, `would-create`, `existing`, `replaced`, `would-replace` or `skipped`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ImportOutcome::Created => "created",
            ImportOutcome::WouldCreate => "would-create",
            ImportOutcome::Existing { .. } => "existing",
            ImportOutcome::Replaced => "replaced",
            ImportOutcome::WouldReplace => "would-replace",
            ImportOutcome::Skipped { .. } => "skipped",
        }
    }
}

/// One imported lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportedLease {
    /// The .NET lease document id.
    pub dotnet_id: String,
    /// Which library wrote it.
    pub schema: DotnetSchema,
    /// Our lease key.
    pub key: LeaseKey,
    /// The continuation it carries over (`None`: it starts at `start`).
    pub continuation: Option<Continuation>,
    /// Where it starts without a continuation.
    pub start: Position,
    /// The .NET owner it had (an expired one, or none).
    pub dotnet_owner: Option<String>,
    /// What happened.
    pub outcome: ImportOutcome,
}

/// What [`import_dotnet_leases`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportReport {
    /// The processor imported (its lease prefix).
    pub processor: String,
    /// Whether its `.info` document is there.
    pub initialized: bool,
    /// Whether its `.lock` document is there.
    pub initialization_lock: bool,
    /// Whether this was a dry run (nothing written).
    pub dry_run: bool,
    /// Each lease, ordered by partition id.
    pub leases: Vec<ImportedLease>,
    /// The other processors' lease prefixes, left alone.
    pub other_processors: Vec<String>,
}

impl ImportReport {
    /// How many leases ended with an outcome named `outcome` ([`ImportOutcome::as_str`]).
    pub fn count(&self, outcome: &str) -> usize {
        self.leases
            .iter()
            .filter(|l| l.outcome.as_str() == outcome)
            .count()
    }
}

/// A read-only handle on a .NET processor's lease container, partitioned by `/id` or
/// `/partitionKey` (or not at all): it reads every document with a cross-partition query and
/// never writes, nor creates the container.
#[derive(Clone, Debug)]
pub struct DotnetLeaseContainer {
    rest: Rest,
    page_size: i64,
    endpoint: String,
}

impl DotnetLeaseContainer {
    /// A handle on the container `options` name.
    ///
    /// # Errors
    /// [`ImportError::Read`] naming the setting that cannot work.
    pub fn new(options: &CosmosOptions) -> Result<Self, ImportError> {
        let rest = options.rest().map_err(|source| ImportError::Read {
            container: format!("{}/{}", options.database(), options.container()),
            source,
        })?;
        Ok(Self {
            rest,
            page_size: options.query_page_size(),
            endpoint: options.endpoint().to_string(),
        })
    }

    /// `database/container`.
    pub fn container_path(&self) -> String {
        format!("{}/{}", self.rest.database, self.rest.container)
    }

    /// Every document of the container, as stored.
    ///
    /// # Errors
    /// [`ImportError::NoContainer`]; [`ImportError::Read`].
    pub async fn documents(&self) -> Result<Vec<Value>, ImportError> {
        self.rest
            .query_all_partitions("SELECT * FROM c", &[], self.page_size)
            .await
            .map_err(|source| match source.status() {
                Some(404) => ImportError::NoContainer {
                    container: self.container_path(),
                    endpoint: self.endpoint.clone(),
                },
                _ => ImportError::Read {
                    container: self.container_path(),
                    source,
                },
            })
    }
}

/// Reads every document of `source`, plans the import ([`plan_import`], on `options`' clock)
/// and writes our leases into `group` of `target`: each created if absent; one already there is
/// left as it is and reported, or with [`ImportOptions::force`] replaced unless one of our
/// hosts owns it. Running it again creates nothing new.
///
/// # Errors
/// Everything [`plan_import`] refuses, before anything is written; [`ImportError::Read`] or
/// [`ImportError::NoContainer`] when the .NET container cannot be read;
/// [`ImportError::Write`] when the target store fails (the leases before were written).
pub async fn import_dotnet_leases(
    source: &DotnetLeaseContainer,
    target: &dyn LeaseStore,
    group: &GroupName,
    options: &ImportOptions,
) -> Result<ImportReport, ImportError> {
    let documents = source.documents().await?;
    let now = options.clock.wall();
    let plan = plan_import(&documents, group, now, options)?;
    let mut leases = Vec::with_capacity(plan.leases.len());
    for planned in plan.leases {
        let outcome = write_one(target, &planned.lease, options).await?;
        leases.push(ImportedLease {
            dotnet_id: planned.dotnet.id,
            schema: planned.dotnet.schema,
            key: planned.lease.key,
            continuation: planned.lease.continuation,
            start: planned.lease.start,
            dotnet_owner: planned.dotnet.owner,
            outcome,
        });
    }
    Ok(ImportReport {
        processor: plan.processor,
        initialized: plan.initialized,
        initialization_lock: plan.initialization_lock,
        dry_run: options.dry_run,
        leases,
        other_processors: plan.other_processors,
    })
}

async fn write_one(
    target: &dyn LeaseStore,
    lease: &Lease,
    options: &ImportOptions,
) -> Result<ImportOutcome, ImportError> {
    let failed = |source: LeaseError| ImportError::Write {
        key: lease.key.to_string(),
        source,
    };
    let current = target.get(&lease.key).await.map_err(failed)?;
    let Some(current) = current else {
        if options.dry_run {
            return Ok(ImportOutcome::WouldCreate);
        }
        return match target.create(lease).await.map_err(failed)? {
            Some(_) => Ok(ImportOutcome::Created),
            // Created by someone else since the read.
            None => Ok(ImportOutcome::Existing {
                same_position: false,
            }),
        };
    };
    let same_position = current.resume_position() == lease.resume_position();
    if !options.force {
        return Ok(ImportOutcome::Existing { same_position });
    }
    if current.state == LeaseState::Owned {
        let owner = current
            .owner
            .as_ref()
            .map(|o| o.to_string())
            .unwrap_or_default();
        return Ok(ImportOutcome::Skipped {
            reason: format!(
                "owned by our host {owner:?}: force replaces only leases nobody owns; stop that host or release the lease first"
            ),
        });
    }
    if same_position && current.properties == lease.properties && current.parents.is_empty() {
        return Ok(ImportOutcome::Existing { same_position });
    }
    if options.dry_run {
        return Ok(ImportOutcome::WouldReplace);
    }
    match target.replace(lease, current.version).await {
        Ok(_) => Ok(ImportOutcome::Replaced),
        Err(LeaseError::Conflict { .. } | LeaseError::NotFound { .. }) => {
            Ok(ImportOutcome::Skipped {
                reason: "changed in the target store while importing; run the import again".into(),
            })
        }
        Err(e) => Err(failed(e)),
    }
}

/// Decides what to import from the documents of a .NET lease container, at wall time `now`:
/// the chosen processor's leases mapped to ours in `group` (see the module docs for the
/// mapping), or why nothing may be imported. Pure: no I/O, no clock.
///
/// # Errors
/// [`ImportError::Unrecognised`] naming every document that is neither a .NET lease nor a
/// marker, or a lease that cannot be carried over; [`ImportError::NoLeases`];
/// [`ImportError::SeveralProcessors`] / [`ImportError::UnknownProcessor`] when the
/// processor is not chosen; [`ImportError::Live`] naming every owned lease renewed within the
/// expiry.
pub fn plan_import(
    documents: &[Value],
    group: &GroupName,
    now: Timestamp,
    options: &ImportOptions,
) -> Result<ImportPlan, ImportError> {
    let mut problems = Vec::new();
    let mut leases = Vec::new();
    let mut initialized = BTreeSet::new();
    let mut locked = BTreeSet::new();
    for doc in documents {
        match parse_dotnet_document(doc) {
            Ok(DotnetDocument::Lease(lease)) => leases.push(lease),
            Ok(DotnetDocument::Initialized { processor }) => {
                initialized.insert(processor);
            }
            Ok(DotnetDocument::InitializationLock { processor }) => {
                locked.insert(processor);
            }
            Err(problem) => problems.push(problem),
        }
    }
    if !problems.is_empty() {
        problems.sort_by(|a, b| a.id.cmp(&b.id));
        return Err(ImportError::Unrecognised {
            documents: problems,
        });
    }
    let processors: BTreeSet<&str> = leases.iter().map(|l| l.processor.as_str()).collect();
    let chosen = choose_processor(&processors, options.processor.as_deref())?.to_string();
    let other_processors = processors
        .iter()
        .filter(|p| **p != chosen)
        .map(|p| p.to_string())
        .collect();
    let mut chosen_leases: Vec<DotnetLease> = leases
        .into_iter()
        .filter(|l| l.processor == chosen)
        .collect();
    chosen_leases.sort_by(|a, b| a.token.cmp(&b.token));

    let expiry_ms = i64::try_from(options.expiry.as_millis()).unwrap_or(i64::MAX);
    let live: Vec<LiveLease> = chosen_leases
        .iter()
        .filter_map(|l| {
            let owner = l.owner.as_ref()?;
            let age_ms = now.millis().saturating_sub(l.renewed_at.millis());
            (age_ms <= expiry_ms).then(|| LiveLease {
                id: l.id.clone(),
                token: l.token.clone(),
                owner: owner.clone(),
                renewed_at: l.renewed_at,
                age_ms,
            })
        })
        .collect();
    if !live.is_empty() {
        return Err(ImportError::Live {
            processor: chosen,
            expiry: options.expiry,
            leases: live,
        });
    }

    let mut planned = Vec::with_capacity(chosen_leases.len());
    for dotnet in chosen_leases {
        match our_lease(group, &dotnet, &options.start) {
            Ok(lease) => planned.push(PlannedLease { dotnet, lease }),
            Err(reason) => problems.push(DocumentProblem {
                id: dotnet.id.clone(),
                reason,
            }),
        }
    }
    if !problems.is_empty() {
        return Err(ImportError::Unrecognised {
            documents: problems,
        });
    }
    planned.sort_by(|a, b| a.lease.key.partition.cmp(&b.lease.key.partition));
    Ok(ImportPlan {
        initialized: initialized.contains(&chosen),
        initialization_lock: locked.contains(&chosen),
        processor: chosen,
        leases: planned,
        other_processors,
    })
}

fn choose_processor<'a>(
    processors: &BTreeSet<&'a str>,
    asked: Option<&str>,
) -> Result<&'a str, ImportError> {
    let all = || processors.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    if processors.is_empty() {
        return Err(ImportError::NoLeases);
    }
    let Some(asked) = asked else {
        return match processors.iter().next() {
            Some(only) if processors.len() == 1 => Ok(only),
            _ => Err(ImportError::SeveralProcessors {
                asked: None,
                processors: all(),
            }),
        };
    };
    if let Some(exact) = processors.iter().find(|p| **p == asked) {
        return Ok(exact);
    }
    let matching: Vec<&'a str> = processors
        .iter()
        .copied()
        .filter(|p| p.starts_with(asked))
        .collect();
    match matching[..] {
        [one] => Ok(one),
        [] => Err(ImportError::UnknownProcessor {
            asked: asked.to_string(),
            processors: all(),
        }),
        _ => Err(ImportError::SeveralProcessors {
            asked: Some(asked.to_string()),
            processors: matching.iter().map(|p| p.to_string()).collect(),
        }),
    }
}

fn our_lease(group: &GroupName, dotnet: &DotnetLease, start: &Position) -> Result<Lease, String> {
    let partition = PartitionId::new(dotnet.token.as_str())
        .map_err(|e| format!("its lease token cannot be a partition id: {e}"))?;
    let mut lease = Lease::new(LeaseKey::new(group.clone(), partition), start.clone());
    lease.continuation = dotnet.continuation.clone().map(Continuation::new);
    let props = &mut lease.properties;
    props.insert(format!("{PROPERTY_PREFIX}id"), dotnet.id.clone());
    props.insert(
        format!("{PROPERTY_PREFIX}schema"),
        dotnet.schema.as_str().into(),
    );
    if let Some(range) = &dotnet.feed_range {
        // As the .NET serializer writes a range: min, then max.
        props.insert(
            format!("{PROPERTY_PREFIX}feed_range"),
            format!(
                "{{\"min\":{},\"max\":{}}}",
                Value::String(range.min.clone()),
                Value::String(range.max.clone())
            ),
        );
    }
    for (k, v) in &dotnet.properties {
        props.insert(format!("{PROPERTY_PREFIX}property.{k}"), v.clone());
    }
    Ok(lease)
}

/// Reads one document of a .NET lease container: a lease (of any of the three schemas), a
/// `.info` or `.lock` marker, or a problem naming the document.
///
/// # Errors
/// A [`DocumentProblem`] when it is none of these, or a lease that cannot be carried over.
pub fn parse_dotnet_document(doc: &Value) -> Result<DotnetDocument, DocumentProblem> {
    let id = match doc.get("id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        _ => {
            return Err(DocumentProblem {
                id: "?".into(),
                reason: format!("a document without an id: {}", brief(doc)),
            })
        }
    };
    let bad = |reason: String| DocumentProblem {
        id: id.clone(),
        reason,
    };
    let version = match doc.get("version") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n @ (0 | 1)) => Some(n),
            _ => {
                return Err(bad(format!(
                    "version {v} is not a lease schema this importer knows (0: partition key range, 1: EPK range)"
                )))
            }
        },
    };
    let lease_token = text(doc, "LeaseToken").map_err(&bad)?;
    let partition_id = text(doc, "PartitionId").map_err(&bad)?;
    let (token, schema) = match (lease_token, partition_id, version) {
        (None, None, None) => {
            let marker = |suffix: &str| id.strip_suffix(suffix).filter(|p| !p.is_empty());
            if let Some(processor) = marker(".info") {
                return Ok(DotnetDocument::Initialized {
                    processor: processor.to_string(),
                });
            }
            if let Some(processor) = marker(".lock") {
                return Ok(DotnetDocument::InitializationLock {
                    processor: processor.to_string(),
                });
            }
            return Err(bad(
                "neither a lease (no LeaseToken or PartitionId) nor a .info or .lock marker of a .NET change feed processor".into(),
            ));
        }
        (None, None, Some(_)) => {
            return Err(bad(
                "a lease document (it has a version) without a LeaseToken".into(),
            ))
        }
        (Some(a), Some(b), _) if a != b => {
            return Err(bad(format!(
                "LeaseToken {a:?} and PartitionId {b:?} disagree"
            )))
        }
        (Some(token), _, Some(1)) => (token, DotnetSchema::V3Epk),
        (None, Some(_), Some(1)) => {
            return Err(bad(
                "an EPK-range lease (version 1) without a LeaseToken".into()
            ))
        }
        (Some(token), _, _) => (token, DotnetSchema::V3PartitionKeyRange),
        (None, Some(token), _) => (token, DotnetSchema::V2),
    };
    if token.is_empty() {
        return Err(bad("an empty lease token".into()));
    }
    let processor = id
        .strip_suffix(token.as_str())
        .and_then(|p| p.strip_suffix(".."))
        .ok_or_else(|| {
            bad(format!(
                "the id does not end with \"..\" and its lease token {token:?}, as the .NET processor names its leases"
            ))
        })?
        .to_string();
    let mode = text(doc, "Mode").map_err(&bad)?;
    if let Some(mode) = mode.filter(|m| !m.is_empty()) {
        let normal: String = mode
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase();
        match normal.as_str() {
            "incrementalfeed" | "latestversion" => {}
            "fullfidelityfeed" | "allversionsanddeletes" => {
                return Err(bad(format!(
                    "Mode {mode:?} is the all-versions-and-deletes change feed; its continuations do not carry over to the latest-version feed changefeed reads"
                )))
            }
            _ => return Err(bad(format!("Mode {mode:?} is not a change feed mode this importer knows"))),
        }
    }
    let feed_range = match doc.get("FeedRange") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let range = v.get("Range");
            let bound = |name: &str| range.and_then(|r| r.get(name)).and_then(Value::as_str);
            match (bound("min"), bound("max")) {
                (Some(min), Some(max)) => Some(FeedRange {
                    min: min.to_string(),
                    max: max.to_string(),
                }),
                _ => {
                    return Err(bad(format!(
                        "FeedRange {} is not an EPK range ({{\"Range\":{{\"min\":…,\"max\":…}}}})",
                        brief(v)
                    )))
                }
            }
        }
    };
    let owner = text(doc, "Owner")
        .map_err(&bad)?
        .filter(|o| !o.trim().is_empty());
    let continuation = text(doc, "ContinuationToken")
        .map_err(&bad)?
        .filter(|c| !c.is_empty());
    let renewed_at = match text(doc, "timestamp").map_err(&bad)? {
        Some(t) => parse_dotnet_time(&t)
            .ok_or_else(|| bad(format!("timestamp {t:?} is not an ISO 8601 time")))?,
        None => match doc.get("_ts") {
            None | Some(Value::Null) => Timestamp(0),
            Some(ts) => ts
                .as_i64()
                .and_then(|s| s.checked_mul(1000))
                .map(Timestamp)
                .ok_or_else(|| bad(format!("_ts {ts} is not a number of seconds")))?,
        },
    };
    let properties = match doc.get("properties") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(map)) => {
            let mut props = BTreeMap::new();
            for (k, v) in map {
                match v {
                    Value::String(s) => {
                        props.insert(k.clone(), s.clone());
                    }
                    Value::Null => {}
                    other => {
                        return Err(bad(format!(
                            "properties.{k} is not a string: {}",
                            brief(other)
                        )))
                    }
                }
            }
            props
        }
        Some(other) => {
            return Err(bad(format!(
                "properties is not an object: {}",
                brief(other)
            )))
        }
    };
    Ok(DotnetDocument::Lease(DotnetLease {
        id,
        processor,
        schema,
        token,
        feed_range,
        owner,
        continuation,
        renewed_at,
        properties,
    }))
}

fn text(doc: &Value, field: &str) -> Result<Option<String>, String> {
    match doc.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{field} is not a string: {}", brief(other))),
    }
}

/// A value as JSON text, cut short.
fn brief(value: &Value) -> String {
    let mut text = value.to_string();
    if text.len() > 120 {
        let mut end = 120;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Reads a time as Newtonsoft.Json writes a .NET `DateTime` (ISO 8601,
/// `yyyy-MM-ddTHH:mm:ss`, then up to seven fraction digits if not zero, then `Z`, an offset
/// such as `+02:00`, or nothing for an unspecified kind, read as UTC). `None` if it is not one.
///
/// ```
/// use changefeed::model::Timestamp;
/// use changefeed_cosmos::import::parse_dotnet_time;
/// assert_eq!(parse_dotnet_time("1970-01-01T00:00:01.5Z"), Some(Timestamp(1_500)));
/// assert_eq!(parse_dotnet_time("1970-01-01T02:00:00+02:00"), Some(Timestamp(0)));
/// assert_eq!(parse_dotnet_time("yesterday"), None);
/// ```
pub fn parse_dotnet_time(text: &str) -> Option<Timestamp> {
    let b = text.as_bytes();
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let part = text.get(from..to)?;
        if part.bytes().all(|c| c.is_ascii_digit()) {
            part.parse().ok()
        } else {
            None
        }
    };
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, minute, second) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut rest = &text[19..];
    let mut millis = 0;
    if let Some(fraction) = rest.strip_prefix('.') {
        let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 9 {
            return None;
        }
        let first3: String = fraction[..digits.min(3)].chars().collect();
        millis = first3.parse::<i64>().ok()? * 10_i64.pow(3 - first3.len() as u32);
        rest = &fraction[digits..];
    }
    let offset_secs = match rest {
        "" | "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes()[0] {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let zone = &rest[1..];
            let (h, m) = match zone.len() {
                5 if zone.as_bytes()[2] == b':' => (zone.get(0..2)?, zone.get(3..5)?),
                4 => (zone.get(0..2)?, zone.get(2..4)?),
                2 => (zone, "00"),
                _ => return None,
            };
            let digits = |s: &str| -> Option<i64> {
                s.bytes()
                    .all(|c| c.is_ascii_digit())
                    .then(|| s.parse().ok())?
            };
            let (h, m) = (digits(h)?, digits(m)?);
            if h > 23 || m > 59 {
                return None;
            }
            sign * (h * 3600 + m * 60)
        }
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_secs;
    Some(Timestamp(secs * 1000 + millis))
}

/// Writes `t` as the .NET processor writes a UTC `timestamp`: ISO 8601 with seven fraction
/// digits and `Z` (`2024-05-06T07:08:09.1230000Z`).
///
/// ```
/// use changefeed::model::Timestamp;
/// use changefeed_cosmos::import::{format_dotnet_time, parse_dotnet_time};
/// assert_eq!(format_dotnet_time(Timestamp(1_500)), "1970-01-01T00:00:01.5000000Z");
/// let t = Timestamp(1_714_979_289_123);
/// assert_eq!(parse_dotnet_time(&format_dotnet_time(t)), Some(t));
/// ```
pub fn format_dotnet_time(t: Timestamp) -> String {
    let ms = t.millis();
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let (days, of_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}0000Z",
        of_day / 3600,
        (of_day / 60) % 60,
        of_day % 60
    )
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests;
