//! Setup shared by the processor tests on the in-memory store and feed.

use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId, Position};
use changefeed::source::MemoryFeed;

/// The group every test uses, `g`.
pub fn group() -> GroupName {
    GroupName::new("g").unwrap()
}

/// A store with a lease at the beginning of each of `partitions` partitions `0`, `1` …, and a
/// feed with that many empty partitions.
pub async fn setup(partitions: u32) -> (MemoryLeaseStore, MemoryFeed) {
    let store = MemoryLeaseStore::new();
    let feed = MemoryFeed::new(partitions);
    for i in 0..partitions {
        let key = LeaseKey::new(group(), PartitionId::new(i.to_string()).unwrap());
        store
            .create(&Lease::new(key, Position::Beginning))
            .await
            .unwrap();
    }
    (store, feed)
}
