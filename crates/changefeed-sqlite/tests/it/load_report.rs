//! The load signal on a real SQLite store: a host that publishes loads measures what its
//! handler does on each lease and writes it with its heartbeat, with its capacity and limits;
//! another process reads it back from the row.

use std::sync::Arc;
use std::time::Duration;

use changefeed::lease::MembershipStore;
use changefeed::model::{GroupName, HostReport, PartitionId};
use changefeed::processor::{handler_fn, Processor, Settings};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

use super::dead_letter::{settings, wait_for};

/// Partition 0 gets ten times the records of partition 1, each record costing the handler
/// 2 ms: the published report names both, with partition 0 the busier by records and by
/// handler time, and carries the capacity and `max_leases` the host was built with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_publishes_each_leases_measured_load_with_its_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changefeed.db");
    let feed = SqliteFeed::open(&path).await.unwrap();
    feed.create_partitions(2).await.unwrap();
    let store = SqliteLeaseStore::open(&path).await.unwrap();
    let handler = handler_fn(|_ctx, batch| async move {
        // The handler's own work, proportional to the records.
        tokio::time::sleep(Duration::from_millis(2 * batch.records.len() as u64)).await;
        Ok(())
    });
    let running = Processor::builder()
        .host("host-a")
        .group("orders")
        .settings(Settings {
            max_batch_size: 20,
            ..settings()
        })
        .capacity(Some(3.0))
        .max_leases(Some(5))
        .publish_load(true)
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler)
        .build()
        .unwrap()
        .start();
    let hot = PartitionId::new("0").unwrap();
    let cold = PartitionId::new("1").unwrap();
    for _ in 0..50 {
        for _ in 0..10 {
            feed.append_to(&hot, "h", "x".repeat(100)).await.unwrap();
        }
        feed.append_to(&cold, "c", "x".repeat(100)).await.unwrap();
    }
    let group = GroupName::new("orders").unwrap();
    let report = wait_for(
        "a report naming both leases, the hot one busier",
        Duration::from_secs(30),
        || async {
            let m = store.membership(&group).await.unwrap();
            let row = m.hosts.iter().find(|h| h.host.as_str() == "host-a")?;
            let report = HostReport::parse(row.report.as_deref()?).unwrap();
            let (h, c) = (report.leases.get(&hot)?, report.leases.get(&cold)?);
            (h.records_per_second > 5.0 * c.records_per_second && h.busy > c.busy).then_some(report)
        },
    )
    .await;
    running.stop().await.unwrap();
    assert_eq!(report.capacity, 3.0);
    assert_eq!(report.max_leases, Some(5));
    assert_eq!(report.min_leases, None);
    let h = report.leases[&hot];
    assert!(h.bytes_per_second > 50.0 * h.records_per_second, "{h:?}");
}
