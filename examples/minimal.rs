//! Process a feed with a closure handler: `cargo run -p changefeed-examples --example minimal`.
use std::sync::Arc;

use changefeed::processor::{handler_fn, Processor};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let db = std::env::temp_dir().join("changefeed-minimal.db");
    let feed = SqliteFeed::open(&db).await?;
    feed.create_partitions(4).await?;
    for i in 0..20 {
        feed.append(&format!("customer-{}", i % 5), format!("order {i}"))
            .await?;
    }
    let running = Processor::builder()
        .host("example-host")
        .group("orders")
        .store(Arc::new(SqliteLeaseStore::open(&db).await?))
        .source(Arc::new(feed))
        .handler(handler_fn(|ctx, batch| async move {
            for r in &batch.records {
                println!(
                    "{} {}: {}",
                    ctx.partition(),
                    r.key,
                    String::from_utf8_lossy(&r.data)
                );
            }
            Ok(())
        }))
        .build()?
        .start();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await; // or tokio::signal::ctrl_c()
    Ok(running.stop().await?)
}
