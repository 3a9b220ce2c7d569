//! Reading the lease table: a full list, or the rows that changed hands since a counter.

use std::collections::HashSet;

use tracing::warn;

use super::{malformed_key, Host};
use crate::error::LeaseError;
use crate::model::PartitionId;

impl Host {
    /// Lists every lease. Returns the change counter the listing is at least as new as.
    pub(super) async fn full_list(&mut self, counter: u64) -> Result<u64, LeaseError> {
        let listing = self.p.store.list(&self.p.group).await?;
        // Repeated at every full list while the rows stay unreadable: an operator fixes them
        // with `changefeed reset --force`.
        for bad in &listing.malformed {
            warn!(error = %bad, "unreadable lease row skipped; fix it with `changefeed reset --force`");
        }
        self.malformed = listing.malformed.iter().filter_map(malformed_key).collect();
        // A row that is only unreadable does not count as deleted: its worker keeps running.
        let unreadable: HashSet<&str> = listing
            .malformed
            .iter()
            .filter_map(|e| match e {
                LeaseError::Malformed { key, .. } => Some(key.as_str()),
                _ => None,
            })
            .collect();
        let group = &self.p.group;
        self.state.listed_all(listing.leases, |p| {
            unreadable.contains(format!("{group}/{p}").as_str())
        });
        // Listed after the counter was read: at least as new as the leases at `counter`.
        self.state.listed_up_to(counter);
        self.flush();
        Ok(counter)
    }

    /// Reads only what changed hands since the last list, when the store can say; lists in
    /// full otherwise. Returns the change counter the cached leases are now at.
    ///
    /// Also returns whether the store said the counter the list was read at (a list of
    /// changes does; a full list is taken to be at `counter`, read before it).
    pub(super) async fn list_changes(&mut self, counter: u64) -> Result<(u64, bool), LeaseError> {
        match self.read_changes().await? {
            Some(at) => Ok((at, true)),
            None => self.full_list(counter).await.map(|at| (at, false)),
        }
    }

    /// Reads what changed hands since the counter the table is at, if the table is trusted
    /// and the store can say. Returns the counter the table is now at, or `None` when nothing
    /// was read (the caller lists in full).
    pub(super) async fn read_changes(&mut self) -> Result<Option<u64>, LeaseError> {
        // A host sharing its tables starts from the most recent one another host listed.
        if self.state.fast_forward() {
            self.flush();
        }
        let Some(since) = self.state.listed_counter() else {
            return Ok(None);
        };
        let Some(changes) = self.p.store.list_changes(&self.p.group, since).await? else {
            return Ok(None);
        };
        for bad in &changes.malformed {
            warn!(error = %bad, "unreadable lease row skipped; fix it with `changefeed reset --force`");
        }
        self.malformed
            .extend(changes.malformed.iter().filter_map(malformed_key));
        for lease in &changes.leases {
            self.malformed.remove(lease.key.to_string().as_str());
        }
        for key in &changes.deleted {
            self.malformed.remove(key.to_string().as_str());
        }
        let deleted: Vec<PartitionId> = changes
            .deleted
            .iter()
            .map(|k| k.partition.clone())
            .collect();
        self.state.listed_changes(&deleted, changes.leases);
        self.state.listed_up_to(changes.counter);
        self.flush();
        Ok(Some(changes.counter))
    }
}
