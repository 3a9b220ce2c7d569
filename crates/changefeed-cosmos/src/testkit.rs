//! Test support (feature `testkit`): a container to write documents into as another program
//! would, and the documents of a .NET change feed processor's lease container.
//!
//! The lease store and the importer never use it: the import tests write a .NET processor's
//! documents into the local server with it, then import them.

use serde_json::{json, Value};

use changefeed::model::Timestamp;

use crate::error::CosmosError;
use crate::import::format_dotnet_time;
use crate::rest::{Resource, Rest};
use crate::store::CosmosOptions;

/// A container partitioned by a top-level field (`/id`, `/partitionKey` …), written to
/// document by document, with no rules of ours.
#[derive(Debug, Clone)]
pub struct RawContainer {
    rest: Rest,
    field: String,
}

impl RawContainer {
    /// The container `options` name, with the database, created if absent with partition key
    /// path `partition_key_path` (a top-level field, `/id` as the .NET processor requires
    /// or `/partitionKey`).
    ///
    /// # Errors
    /// [`CosmosError`] on a bad setting or when either cannot be created.
    pub async fn create(
        options: &CosmosOptions,
        partition_key_path: &str,
    ) -> Result<Self, CosmosError> {
        let field = partition_key_path
            .strip_prefix('/')
            .filter(|f| !f.is_empty() && !f.contains('/'))
            .ok_or_else(|| CosmosError::Setting {
                setting: "partition_key_path",
                reason: format!("{partition_key_path:?} is not a top-level field such as /id"),
            })?
            .to_string();
        let rest = options.rest()?;
        rest.ensure_container(partition_key_path).await?;
        Ok(Self { rest, field })
    }

    /// Creates `doc` (`POST`) in the logical partition of its partition key field.
    ///
    /// # Errors
    /// [`CosmosError`], also when the id is taken (409) or the document has no partition key.
    pub async fn create_document(&self, doc: &Value) -> Result<(), CosmosError> {
        let key = doc
            .get(&self.field)
            .cloned()
            .ok_or_else(|| CosmosError::Setting {
                setting: "document",
                reason: format!("no {} field (the partition key) in {doc}", self.field),
            })?;
        let answer = self
            .rest
            .send(
                http::Method::POST,
                Resource::Documents,
                &[
                    (
                        "x-ms-documentdb-partitionkey",
                        Value::Array(vec![key]).to_string(),
                    ),
                    ("content-type", "application/json".into()),
                ],
                Some(doc.to_string().into_bytes()),
            )
            .await?;
        match answer.status {
            201 => Ok(()),
            _ => Err(answer.into_error()),
        }
    }

    /// Deletes the container (a test's on a real account, which costs while it exists).
    ///
    /// # Errors
    /// [`CosmosError`] unless Cosmos DB answers 204 or 404.
    pub async fn delete(&self) -> Result<(), CosmosError> {
        let answer = self
            .rest
            .send(http::Method::DELETE, Resource::Container, &[], None)
            .await?;
        match answer.status {
            204 | 404 => Ok(()),
            _ => Err(answer.into_error()),
        }
    }
}

/// The documents of a .NET change feed processor's lease container, field for field as the
/// .NET serializer (Newtonsoft.Json) writes them; the `_` fields Cosmos DB fills are left out.
///
/// Read from Azure/azure-cosmos-dotnet-v3 (`Microsoft.Azure.Cosmos/src/ChangeFeedProcessor/
/// LeaseManagement/DocumentServiceLeaseCoreEpk.cs`, `DocumentServiceLeaseCore.cs`,
/// `DocumentServiceLeaseStoreCosmos.cs`) and Azure/azure-documentdb-changefeedprocessor-dotnet
/// (`src/DocumentDB.ChangeFeedProcessor/LeaseManagement/DocumentServiceLease.cs`,
/// `DocumentServiceLeaseStore.cs`).
pub mod dotnet {
    use super::*;

    /// What a lease holds besides its id and token. (A lease's id is the processor's lease
    /// prefix, `..` and its token; the prefix is the builder's lease prefix, the account host,
    /// `_`, the monitored database's resource id, `_`, the monitored container's.)
    #[derive(Debug, Clone, Default)]
    pub struct LeaseFields<'a> {
        /// `Owner`.
        pub owner: Option<&'a str>,
        /// `ContinuationToken` (for v3, the quoted LSN: `"\"42\""`).
        pub continuation: Option<&'a str>,
        /// `timestamp`: the last renewal.
        pub renewed_at: Option<Timestamp>,
        /// `properties`.
        pub properties: &'a [(&'a str, &'a str)],
    }

    fn properties(state: &LeaseFields<'_>) -> Value {
        Value::Object(
            state
                .properties
                .iter()
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .collect(),
        )
    }

    fn timestamp(state: &LeaseFields<'_>) -> Value {
        state
            .renewed_at
            .map(|t| Value::String(format_dotnet_time(t)))
            .unwrap_or(Value::Null)
    }

    /// A v3 SDK EPK-range lease (`DocumentServiceLeaseCoreEpk`, `version: 1`) of `token`
    /// over `[min, max)`.
    pub fn v3_epk_lease(
        prefix: &str,
        token: &str,
        (min, max): (&str, &str),
        state: &LeaseFields<'_>,
    ) -> Value {
        json!({
            "id": format!("{prefix}..{token}"),
            "version": 1,
            "_etag": null,
            "LeaseToken": token,
            "FeedRange": { "Range": { "min": min, "max": max } },
            "Owner": state.owner,
            "ContinuationToken": state.continuation,
            "properties": properties(state),
            "timestamp": timestamp(state),
        })
    }

    /// A v3 SDK partition-key-range lease (`DocumentServiceLeaseCore`, `version: 0`) of range
    /// `token`.
    pub fn v3_pkrange_lease(prefix: &str, token: &str, state: &LeaseFields<'_>) -> Value {
        json!({
            "id": format!("{prefix}..{token}"),
            "version": 0,
            "_etag": null,
            "LeaseToken": token,
            "Owner": state.owner,
            "ContinuationToken": state.continuation,
            "properties": properties(state),
            "timestamp": timestamp(state),
        })
    }

    /// A v2 library lease (`DocumentServiceLease`) of partition key range `partition_id`.
    pub fn v2_lease(prefix: &str, partition_id: &str, state: &LeaseFields<'_>) -> Value {
        let id = format!("{prefix}..{partition_id}");
        json!({
            "id": id,
            "gremlincompatid": id,
            "_etag": null,
            "PartitionId": partition_id,
            "Owner": state.owner,
            "ContinuationToken": state.continuation,
            "properties": properties(state),
            "timestamp": timestamp(state),
        })
    }

    /// The v3 `.info` marker: the processor finished creating its leases.
    pub fn v3_info(prefix: &str) -> Value {
        json!({ "id": format!("{prefix}.info") })
    }

    /// The v3 `.lock` marker (time to live in seconds): a processor is creating its leases.
    pub fn v3_lock(prefix: &str, ttl: u32) -> Value {
        json!({ "id": format!("{prefix}.lock"), "ttl": ttl })
    }

    /// The v2 `.info` marker.
    pub fn v2_info(prefix: &str) -> Value {
        let id = format!("{prefix}.info");
        json!({ "id": id, "gremlincompatid": id })
    }
}
