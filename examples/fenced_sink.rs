//! A sink that makes a deposed owner harmless, by fencing token:
//! `cargo run -p changefeed-examples --example fenced_sink -- postgres://postgres@127.0.0.1:5432/test`.
//!
//! Leases keep one host delivering a partition at a time: a host that cannot renew its
//! heartbeat fences itself, and the processor drops its handler call, before anyone else may
//! take the partition. But a machine frozen mid-write (a stalled VM, SIGSTOP, a long pause)
//! can wake with a write already on the wire, after its successor has written. Only the sink
//! can refuse that write. So the handler passes `ctx.fencing_token()` with every batch, and
//! the sink (`fenced_sink/sink.rs`) writes a batch only if no higher token has written the
//! partition, in the same transaction. `tests/fenced_sink.rs` freezes an owner mid-write,
//! lets another host take over, resumes the frozen write and shows it refused.
//!
//! Leases, feed (an outbox) and sink all live in the one PostgreSQL database here; run it
//! again and it goes on from the checkpoints, as a new owner with a higher token.

#[path = "fenced_sink/sink.rs"]
mod sink;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use changefeed::model::{Batch, Continuation, Record};
use changefeed::processor::{handler_fn, Processor};
use changefeed_postgres::{OutboxTable, PgOptions, PostgresLeaseStore, PostgresOutbox};
use sink::{FencedSink, Written};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_string());
    let options = PgOptions::new(url.as_str()).prefix("fenced_sink_example");

    // The sink: tables fenced_sink_fences (partition → highest token) and fenced_sink_values.
    let sink = Arc::new(FencedSink::connect(&url, "fenced_sink").await?);
    sink.create_tables().await?;

    // The feed: an outbox of two partitions, with a few records.
    let outbox =
        PostgresOutbox::connect(options.clone(), OutboxTable::new("fenced_sink_example")?).await?;
    outbox.create_partitions(2).await?;
    let mut partition_of_customer_0 = None;
    for i in 0..10 {
        let key = format!("customer-{}", i % 4);
        let appended = outbox
            .append_one(&key, format!("order {i}").as_bytes())
            .await?;
        partition_of_customer_0.get_or_insert(appended.partition);
    }

    let (applied, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (sink, applied, refused) = (sink.clone(), applied.clone(), refused.clone());
        handler_fn(move |ctx, batch| {
            let (sink, applied, refused) = (sink.clone(), applied.clone(), refused.clone());
            async move {
                // The token is the same for this host's whole tenure of the lease, and higher
                // for every later owner.
                let token = ctx.fencing_token();
                match sink.write(ctx.partition().as_str(), token, &batch).await? {
                    Written::Applied(n) => {
                        applied.fetch_add(n, Ordering::Relaxed);
                        println!("{}: {n} records, token {token}", ctx.partition());
                    }
                    // A later owner has written this partition: this host was deposed. Nothing
                    // to retry: the new owner delivers the batch.
                    Written::Refused(n) => {
                        refused.fetch_add(n, Ordering::Relaxed);
                        println!(
                            "{}: {n} records refused, token {token} deposed",
                            ctx.partition()
                        );
                    }
                }
                Ok(())
            }
        })
    };
    let running = Processor::builder()
        .host("example-host")
        .group("fenced-sink")
        .store(Arc::new(PostgresLeaseStore::connect_with(options).await?))
        .source(Arc::new(outbox))
        .handler(handler)
        .build()?
        .start();
    // A real program runs until tokio::signal::ctrl_c(); this one until the records are in.
    tokio::time::timeout(Duration::from_secs(30), async {
        while applied.load(Ordering::Relaxed) < 10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await?;
    running.stop().await?;

    // What a deposed owner's late write looks like to the sink: token 0 is below every
    // owner's, so the guard refuses it and the values stay as they are.
    let mut late = Batch::default();
    late.records.push(Record {
        key: "customer-0".into(),
        data: "stale".into(),
        continuation: Continuation::new("late"),
        timestamp: None,
    });
    if let Some(partition) = partition_of_customer_0 {
        let written = sink.write(partition.as_str(), 0, &late).await;
        let written = written.map_err(|e| anyhow::anyhow!(e))?;
        println!("a late write with token 0 to {partition}: {written:?}");
        assert_eq!(written, Written::Refused(1));
    }
    for (key, value, token) in sink.values().await? {
        println!("{key} = {value:?} (token {token})");
    }
    println!(
        "records refused during the run: {}",
        refused.load(Ordering::Relaxed)
    );
    Ok(())
}
