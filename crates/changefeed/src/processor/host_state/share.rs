//! Lease tables shared between the hosts of one process (the simulator's fleet).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::lineage::ParentsRule;
use crate::model::GroupName;

use super::table::Rows;

/// Lease tables shared between the hosts of one process (the simulator's fleet): a host whose
/// rows come to equal a table another host holds takes that one (O(1)) instead of building
/// its own, so a fleet holds each table once and builds it once. Tables are found by their
/// rows' fingerprint ([`row_print`]) and the parents rule, and held weakly: a table no host
/// holds any more is forgotten.
///
/// Clones share one set of tables. Give the same share to the hosts of one group
/// ([`crate::processor::ProcessorBuilder::share_tables`], which refuses a host of another
/// group: a host fast-forwards to the newest table of its share).
#[derive(Clone, Default)]
pub struct TableShare {
    tables: Arc<Mutex<SharedTables>>,
}

#[derive(Default)]
struct SharedTables {
    /// The group whose hosts share these tables (set by the first).
    group: Option<GroupName>,
    by_print: HashMap<(ParentsRule, u128), Weak<Rows>>,
    /// The table of the highest change counter a host of the share listed its changes up to,
    /// as that list left it (before the host's own writes): the leases as they stood at that
    /// counter, which is all a table at that counter can hold.
    latest: Option<(ParentsRule, u64, Arc<Rows>)>,
    /// How many tables were known after the last sweep of forgotten ones.
    after_sweep: usize,
}

impl std::fmt::Debug for TableShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableShare").finish_non_exhaustive()
    }
}

impl TableShare {
    /// An empty share.
    #[cfg_attr(not(feature = "sim"), allow(dead_code))]
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SharedTables> {
        // The map holds no invariant a panic elsewhere could break half-way.
        self.tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Binds the share to `group`, if it serves no group yet. `Err` names the group it serves
    /// if that is another.
    pub(crate) fn bind(&self, group: &GroupName) -> Result<(), GroupName> {
        let mut tables = self.lock();
        match &tables.group {
            Some(bound) if bound != group => Err(bound.clone()),
            Some(_) => Ok(()),
            None => {
                tables.group = Some(group.clone());
                Ok(())
            }
        }
    }

    /// A held table of rows fingerprinted `print`.
    pub(super) fn find(&self, parents: ParentsRule, print: u128) -> Option<Arc<Rows>> {
        self.lock().by_print.get(&(parents, print))?.upgrade()
    }

    /// Notes `rows` as the table a list of changes up to `counter` left, if no host of the
    /// share listed up to a higher counter.
    pub(super) fn listed(&self, parents: ParentsRule, counter: u64, rows: &Arc<Rows>) {
        let mut tables = self.lock();
        if tables.latest.as_ref().is_none_or(|(_, c, _)| *c < counter) {
            tables.latest = Some((parents, counter, rows.clone()));
        }
    }

    /// The table of the highest counter listed, if above `counter` (any, for `None`).
    pub(super) fn latest_after(
        &self,
        parents: ParentsRule,
        counter: Option<u64>,
    ) -> Option<(u64, Arc<Rows>)> {
        match &self.lock().latest {
            Some((p, c, rows)) if *p == parents && counter.is_none_or(|at| *c > at) => {
                Some((*c, rows.clone()))
            }
            _ => None,
        }
    }

    /// Offers `rows` to hosts that come to hold equal rows.
    pub(super) fn offer(&self, parents: ParentsRule, rows: &Arc<Rows>) {
        let mut tables = self.lock();
        tables
            .by_print
            .insert((parents, rows.print), Arc::downgrade(rows));
        // Sweep the forgotten tables whenever the map doubled: amortised O(1) per offer.
        if tables.by_print.len() > 2 * tables.after_sweep.max(64) {
            tables.by_print.retain(|_, t| t.strong_count() > 0);
            tables.after_sweep = tables.by_print.len();
        }
    }
}
