//! What the cycle's answers put into the table: listings, lists of changes, malformed rows,
//! taken leases and their workers.

use super::*;

/// The keys of malformed rows, as the store names them.
fn malformed_keys(errors: &[LeaseError]) -> impl Iterator<Item = &str> {
    errors.iter().filter_map(|e| match e {
        LeaseError::Malformed { key, .. } => Some(key.as_str()),
        _ => None,
    })
}

impl HostState {
    /// Takes in a full listing: rows unreadable in it are kept as they were (their workers
    /// keep running), and counted for the malformed-rows gauge.
    pub(super) fn take_full_list(&mut self, listing: Listing) {
        let unreadable: HashSet<&str> = malformed_keys(&listing.malformed).collect();
        self.malformed = unreadable.iter().map(|k| k.to_string()).collect();
        let group = self.config.group.clone();
        self.replace_table(listing.leases, |p| {
            unreadable.contains(format!("{group}/{p}").as_str())
        });
    }

    /// Takes in a list of changes, and the malformed rows it names (a row read or deleted
    /// since is no longer one).
    pub(super) fn take_change_list(&mut self, changes: Changes) {
        self.malformed
            .extend(malformed_keys(&changes.malformed).map(str::to_string));
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
        self.update_table(&deleted, changes.leases);
        self.offer_table_at(changes.counter);
    }

    /// How many lease rows the store could not read at the last list.
    pub(crate) fn malformed_rows(&self) -> usize {
        self.malformed.len()
    }

    /// A take stored `stored`: cache it and start its worker.
    pub(super) fn took_and_start(&mut self, stored: Lease) {
        self.took(stored.clone());
        self.start_worker(stored);
    }

    /// Starts a worker on `lease` unless one runs.
    pub(super) fn start_worker(&mut self, lease: Lease) {
        if self.running.contains_key(&lease.key.partition) {
            return;
        }
        self.worker_started(&lease);
        self.outbox.push(Effect::StartWorker(lease));
    }

    /// The heartbeat rows of dead hosts to remove, from the cycle's membership read.
    pub(super) fn dead_rows_of(&self, c: &Cycle) -> VecDeque<Heartbeat> {
        match &c.membership {
            Some((m, _)) => self.dead_rows(&m.hosts).into_iter().cloned().collect(),
            None => VecDeque::new(),
        }
    }
}
