//! Pacing the head (`docs/protocol.md`, "Pacing the head"): on a store that limits the fleet's
//! head reads, hosts stretch their acquire cycle so that the fleet stays within the limit,
//! and still balance. Virtual time throughout.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::{LeaseStore, MemoryLeaseStore, StoreCounts};
use changefeed::processor::{handler_fn, Processor, ProcessorHandle};

use crate::common::{group, setup};

const HOSTS: usize = 30;
const PARTITIONS: u32 = 90;
/// The window the head reads are counted over, after the fleet balanced.
const WINDOW: Duration = Duration::from_secs(120);

/// Starts `HOSTS` hosts on `store` (default settings: a 2 s acquire interval), lets them
/// balance, and returns the fleet's head reads per second over [`WINDOW`] and the leases
/// each host owns at its end.
async fn head_reads_per_second(store: MemoryLeaseStore) -> (f64, BTreeMap<String, usize>) {
    let (seeded, feed) = setup(PARTITIONS).await;
    // The leases `setup` created, in the store under test.
    for lease in seeded.list(&group()).await.unwrap().leases {
        store.create(&lease).await.unwrap();
    }
    let hosts: Vec<ProcessorHandle> = (0..HOSTS)
        .map(|h| {
            Processor::builder()
                .host(format!("h{h:02}"))
                .group("g")
                .store(Arc::new(store.clone()))
                .source(Arc::new(feed.clone()))
                .handler(handler_fn(|_, _| async { Ok(()) }))
                .seed(h as u64)
                .build()
                .unwrap()
                .start()
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(90)).await;
    let before: Vec<StoreCounts> = hosts.iter().map(|h| h.store_stats().snapshot()).collect();
    tokio::time::sleep(WINDOW).await;
    let heads: u64 = hosts
        .iter()
        .zip(&before)
        .map(|(h, b)| h.store_stats().snapshot().since(b).head_rows_read)
        .sum();
    let mut owned = BTreeMap::new();
    for lease in store.list(&group()).await.unwrap().leases {
        if let Some(owner) = &lease.owner {
            *owned.entry(owner.to_string()).or_insert(0) += 1;
        }
    }
    for h in hosts {
        h.stop().await.unwrap();
    }
    (heads as f64 / WINDOW.as_secs_f64(), owned)
}

#[tokio::test(start_paused = true)]
async fn a_store_limiting_head_reads_slows_the_fleets_cycle_to_its_limit() {
    // Unpaced: every host reads the head once per 2 s cycle, 15 reads/s for 30 hosts.
    let (free, owned) = head_reads_per_second(MemoryLeaseStore::new()).await;
    assert!(free > 14.0, "unpaced fleet read the head {free:.2} times/s");
    assert_eq!(owned.len(), HOSTS, "unpaced fleet balanced: {owned:?}");
    // A limit of 10 reads/s: each host's cycle stretches to 30 / 10 = 3 s (within the bound
    // of 0.45 × (10 s − 2 s) = 3.6 s), so the fleet reads at most 10 times a second.
    let limited = MemoryLeaseStore::new().with_head_reads_per_second(10.0);
    let (paced, owned) = head_reads_per_second(limited).await;
    assert!(
        paced <= 10.0 && paced > 9.0,
        "paced fleet read the head {paced:.2} times/s (limit 10)"
    );
    assert_eq!(owned.len(), HOSTS, "paced fleet balanced: {owned:?}");
    assert!(
        owned.values().all(|&n| n == 3),
        "paced fleet balanced evenly: {owned:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn pacing_never_stretches_the_cycle_past_what_hand_offs_allow() {
    // A limit of 1 read/s for 30 hosts would ask for 30 s cycles; the hand-off protocol needs
    // a cycle within half of handoff_timeout − safety_margin (4 s by default), so the cycle
    // stops at 3.6 s: 30 / 3.6 = 8.3 reads/s.
    let limited = MemoryLeaseStore::new().with_head_reads_per_second(1.0);
    let (paced, owned) = head_reads_per_second(limited).await;
    assert!(
        (8.0..=8.5).contains(&paced),
        "capped fleet read the head {paced:.2} times/s"
    );
    assert_eq!(owned.len(), HOSTS, "capped fleet balanced: {owned:?}");
}
