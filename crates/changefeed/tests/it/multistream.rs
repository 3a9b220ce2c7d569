//! Multi-stream: one fleet, one lease table, several streams added and removed at runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use changefeed::clock::{Clock, VirtualClock};
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::model::{Batch, GroupName, Timestamp};
use changefeed::processor::{CloseReason, Context, Handler, HandlerError, Processor};
use changefeed::source::{MemoryFeed, MultiFeed};
use changefeed::testkit::fleet::scenario_settings;

/// Every delivered payload, with the partition it came from.
#[derive(Debug, Default)]
struct Seen(Mutex<Vec<(String, String)>>, Mutex<Vec<String>>);

#[derive(Debug)]
struct Recorder(Arc<Seen>);

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, ctx: &Context, batch: &Batch) -> Result<(), HandlerError> {
        let mut seen = self.0 .0.lock().unwrap();
        for r in &batch.records {
            let data = std::str::from_utf8(&r.data)?.to_string();
            seen.push((ctx.partition().to_string(), data));
        }
        Ok(())
    }

    async fn close(&self, ctx: &Context, _reason: CloseReason) {
        self.0 .1.lock().unwrap().push(ctx.partition().to_string());
    }
}

/// Streams by name, and the payloads written to each.
struct Writer {
    feeds: BTreeMap<String, MemoryFeed>,
    written: BTreeMap<String, BTreeSet<String>>,
}

impl Writer {
    fn write(&mut self, stream: &str, n: usize) {
        let feed = &self.feeds[stream];
        let written = self.written.entry(stream.to_string()).or_default();
        for _ in 0..n {
            let data = format!("{stream}/{}", written.len());
            feed.append(&format!("key-{}", written.len() % 13), data.clone());
            written.insert(data);
        }
    }
}

async fn partitions(store: &MemoryLeaseStore, group: &GroupName) -> BTreeSet<String> {
    store
        .list(group)
        .await
        .unwrap()
        .leases
        .into_iter()
        .map(|l| l.key.partition.to_string())
        .collect()
}

fn delivered(seen: &Seen, stream: &str) -> BTreeSet<String> {
    let prefix = format!("{stream}:");
    seen.0
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p.starts_with(&prefix))
        .map(|(p, d)| {
            assert!(
                d.starts_with(&format!("{stream}/")),
                "{d} delivered from {p}: streams are not mixed"
            );
            d.clone()
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn streams_added_at_runtime_are_read_and_removed_ones_retired() {
    // KCL's multi-stream mode: the sync discovers a new stream's partitions and creates their
    // leases; a removed stream's leases are deleted (retired), not kept as "missing".
    let store = MemoryLeaseStore::new();
    let group = GroupName::new("multi").unwrap();
    let multi = MultiFeed::new();
    let mut w = Writer {
        feeds: BTreeMap::new(),
        written: BTreeMap::new(),
    };
    for (name, n) in [("orders", 2), ("payments", 3), ("refunds", 2)] {
        w.feeds.insert(name.to_string(), MemoryFeed::new(n));
    }
    for name in ["orders", "payments"] {
        multi
            .add_stream(name, Arc::new(w.feeds[name].clone()))
            .unwrap();
    }
    let mut settings = scenario_settings();
    settings.sync_interval = settings.acquire_interval;
    settings.cleanup_delay = Duration::from_secs(4);
    let seen = Arc::new(Seen::default());
    let mut hosts = Vec::new();
    for (i, name) in ["host-a", "host-b"].into_iter().enumerate() {
        let clock: Arc<dyn Clock> = Arc::new(VirtualClock::new(Timestamp(1_700_000_000_000)));
        let p = Processor::builder()
            .host(name)
            .group(group.as_str())
            .store(Arc::new(store.clone()))
            .source(Arc::new(multi.clone()))
            .handler(Recorder(seen.clone()))
            .clock(clock)
            .seed(i as u64 + 1)
            .settings(settings.clone())
            .build()
            .unwrap();
        hosts.push(p.start());
    }

    // Two streams: one lease per partition, keys carrying the stream.
    for _ in 0..10 {
        w.write("orders", 5);
        w.write("payments", 5);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let expected: BTreeSet<String> = [
        "orders:0",
        "orders:1",
        "payments:0",
        "payments:1",
        "payments:2",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(partitions(&store, &group).await, expected);
    assert_eq!(delivered(&seen, "orders"), w.written["orders"]);
    assert_eq!(delivered(&seen, "payments"), w.written["payments"]);

    // A third stream, added at runtime: discovered, leased and read.
    w.write("refunds", 20);
    multi
        .add_stream("refunds", Arc::new(w.feeds["refunds"].clone()))
        .unwrap();
    for _ in 0..10 {
        w.write("orders", 3);
        w.write("payments", 3);
        w.write("refunds", 3);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let leased = partitions(&store, &group).await;
    assert!(
        leased.contains("refunds:0") && leased.contains("refunds:1"),
        "{leased:?}"
    );
    for stream in ["orders", "payments", "refunds"] {
        assert_eq!(delivered(&seen, stream), w.written[stream], "{stream}");
    }

    // One removed: its leases are retired; the others keep flowing.
    assert!(multi.remove_stream("payments"));
    for _ in 0..10 {
        w.write("orders", 3);
        w.write("refunds", 3);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let leased = partitions(&store, &group).await;
    let expected: BTreeSet<String> = ["orders:0", "orders:1", "refunds:0", "refunds:1"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(leased, expected, "the payments leases are retired");
    // Their workers stopped when the leases were deleted, though their partitions are idle.
    let closed = seen.1.lock().unwrap().clone();
    for p in ["payments:0", "payments:1"] {
        assert!(
            closed.iter().any(|c| c == p),
            "worker of {p} stopped: {closed:?}"
        );
    }
    for stream in ["orders", "refunds"] {
        assert_eq!(delivered(&seen, stream), w.written[stream], "{stream}");
    }
    // Reads still flow after the retirement (no worker stuck on a deleted lease).
    w.write("orders", 10);
    w.write("refunds", 10);
    tokio::time::sleep(Duration::from_secs(10)).await;
    for stream in ["orders", "refunds"] {
        assert_eq!(delivered(&seen, stream), w.written[stream], "{stream}");
    }
    for h in hosts {
        h.stop().await.unwrap();
    }
}
