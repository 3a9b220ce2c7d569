//! The load signal on a real SQLite store: a host that publishes loads measures what its
//! handler does on each lease and writes it with its heartbeat, with its capacity and limits;
//! another process reads it back from the row.

use std::sync::Arc;
use std::time::Duration;

use changefeed::balance::LoadShare;
use changefeed::lease::{LeaseStore, MembershipStore};
use changefeed::model::{GroupName, HostName, HostReport, PartitionId};
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

/// Two hosts planning by load on four partitions, one of which keeps its handler busy: each
/// host reads the other's report, and `LoadShare` leaves the hot partition alone on its host,
/// the three light ones on the other, where counts would give two and two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_planning_by_load_leave_a_hot_partition_alone_on_its_host() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changefeed.db");
    let feed = SqliteFeed::open(&path).await.unwrap();
    feed.create_partitions(4).await.unwrap();
    let store = SqliteLeaseStore::open(&path).await.unwrap();
    let hot = PartitionId::new("0").unwrap();
    let start = |name: &str| {
        let hot = hot.clone();
        Processor::builder()
            .host(name)
            .group("orders")
            .settings(settings())
            .strategy(Arc::new(
                LoadShare::default().with_dwell(Duration::from_secs(1)),
            ))
            .publish_load(true)
            .store(Arc::new(store.clone()))
            .source(Arc::new(feed.clone()))
            .handler(handler_fn(move |ctx, _batch| {
                let busy = if ctx.partition() == &hot { 150 } else { 1 };
                async move {
                    tokio::time::sleep(Duration::from_millis(busy)).await;
                    Ok(())
                }
            }))
            .build()
            .unwrap()
            .start()
    };
    // Records keep arriving on every partition while the hosts balance.
    let writing = tokio::spawn({
        let feed = feed.clone();
        async move {
            for _ in 0..3000 {
                for p in 0..4 {
                    let p = PartitionId::new(p.to_string()).unwrap();
                    feed.append_to(&p, "k", "x").await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let a = start("host-a");
    let b = start("host-b");
    let group = GroupName::new("orders").unwrap();
    let owners = wait_for(
        "the hot partition alone on its host, the three others on the other",
        Duration::from_secs(60),
        || async {
            let leases = store.list(&group).await.unwrap().leases;
            let owner_of_hot = leases
                .iter()
                .find(|l| l.key.partition == hot)?
                .owner
                .clone()?;
            let held = |h: &HostName| {
                leases
                    .iter()
                    .filter(|l| l.owner.as_ref() == Some(h))
                    .count()
            };
            let other = leases
                .iter()
                .filter_map(|l| l.owner.clone())
                .find(|o| *o != owner_of_hot)?;
            (held(&owner_of_hot) == 1 && held(&other) == 3).then_some((owner_of_hot, other))
        },
    )
    .await;
    writing.abort();
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    assert_ne!(owners.0, owners.1);
}
