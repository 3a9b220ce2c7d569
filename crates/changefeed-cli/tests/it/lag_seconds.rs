//! `changefeed lag` and `status` show lag in time: the age of the first
//! unread record, from the SQLite feed's record timestamps (see `ops.rs`), the PostgreSQL
//! outbox's `created_ms`, Kinesis's `ApproximateArrivalTimestamp` and DynamoDB Streams'
//! `ApproximateCreationDateTime`. Records are stamped by
//! a fixed clock an hour back where the source lets the writer stamp them; kinesis-mock stamps
//! with its own clock, so that test bounds the age by the times around the write.

use std::io::{Read as _, Write as _};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use changefeed::clock::{Clock, SystemClock, VirtualClock};
use changefeed::lease::LeaseStore;
use changefeed::model::{Lease, PartitionId, Position, Timestamp};
use serde_json::Value;

use crate::postgres::{raw_client, source_url, unique_prefix};
use crate::support::{bin, key, rt, terminate, text, wait_exit, wait_for, Fixture};

/// `lag --json` and `status --json` of group `g` on the fixture's store and `source`.
fn lag_and_status(fx: &Fixture, source: &str) -> (Value, Value, String) {
    let run = |args: &[&str]| {
        let out = bin().args(args).output().expect("run the binary");
        assert!(out.status.success(), "{args:?}: {:?}", text(&out));
        out
    };
    let store = fx.url();
    let common = [
        "--store",
        store.as_str(),
        "--source",
        source,
        "--group",
        "g",
    ];
    let lag: Value =
        serde_json::from_slice(&run(&[&["lag"][..], &common[..], &["--json"][..]].concat()).stdout)
            .expect("lag json");
    let status: Value = serde_json::from_slice(
        &run(&[&["status"][..], &common[..], &["--json"][..]].concat()).stdout,
    )
    .expect("status json");
    let table = text(&run(&[&["lag"][..], &common[..]].concat())).0;
    (lag, status, table)
}

/// Creates the lease of `partition` in group `g`, at the beginning and without a checkpoint.
fn lease_at_beginning(fx: &Fixture, partition: &PartitionId) {
    fx.with_store(async |s| {
        let lease = Lease::new(key("g", partition.as_str()), Position::Beginning);
        s.create(&lease).await.expect("create lease");
    });
}

#[test]
fn lag_shows_seconds_for_a_postgres_outbox() {
    // The outbox's created_ms of the first unread record: an hour back on the writer's clock.
    let prefix = unique_prefix("lagsec");
    let source = source_url(&prefix);
    let out = bin()
        .args(["outbox", "--source", &source, "create", "--partitions", "1"])
        .output()
        .expect("outbox create");
    assert!(out.status.success(), "{:?}", text(&out));
    let created: Value = serde_json::from_slice(&out.stdout).expect("json");
    let p = PartitionId::new(created["open"][0].as_str().expect("a partition")).expect("id");
    let hour_ago = Timestamp(SystemClock.wall().0 - 3_600_000);
    rt().block_on(async {
        let mut client = raw_client().await;
        let table = changefeed_postgres::OutboxTable::new(&prefix)
            .expect("prefix")
            .with_clock(Arc::new(VirtualClock::new(hour_ago)));
        let tx = client.transaction().await.expect("begin");
        for i in 0..3 {
            changefeed_postgres::append_to(&tx, &table, &p, "k", format!("r{i}").as_bytes())
                .await
                .expect("append");
        }
        tx.commit().await.expect("commit");
    });
    let fx = Fixture::new();
    lease_at_beginning(&fx, &p);
    let (lag, status, table) = lag_and_status(&fx, &source);
    assert_eq!(lag["total"], 3, "{lag}");
    let secs = lag["partitions"][0]["seconds"].as_f64().expect("seconds");
    assert!((3600.0..4200.0).contains(&secs), "an hour old: {lag}");
    assert_eq!(lag["max_seconds"].as_f64(), Some(secs), "{lag}");
    let st = status["leases"][0]["lag_seconds"]
        .as_f64()
        .expect("lag_seconds");
    assert!(
        (3600.0..4200.0).contains(&st),
        "status shows it too: {status}"
    );
    assert!(
        table.lines().next().unwrap_or_default().contains("SECONDS"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .last()
            .unwrap_or_default()
            .starts_with("total 3, max 36"),
        "{table}"
    );
    rt().block_on(crate::postgres::drop_tables(&prefix));
}

#[test]
fn lag_shows_seconds_for_a_kinesis_stream() {
    // Kinesis cannot count records (LAG `?`), but the first unread record's
    // ApproximateArrivalTimestamp gives the lag in time.
    let endpoint = std::env::var("CHANGEFEED_TEST_KINESIS_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_KINESIS_URL is not set: start kinesis-mock with `bash .ci/run` \
             (or `eval \"$(bash .ci/aws-services.sh)\"`)"
        )
    });
    let stream = format!("lagsec-{}-{}", std::process::id(), SystemClock.wall().0);
    let before = SystemClock.wall();
    let shard = rt().block_on(async {
        let feed = changefeed_kinesis::KinesisFeed::connect(
            &changefeed_kinesis::AwsOptions::local(endpoint.clone()),
            stream.clone(),
        )
        .await;
        feed.create_stream(1).await.expect("create stream");
        let mut shard = None;
        for i in 0..2 {
            let (p, _) = feed
                .put("k", format!("r{i}").into_bytes(), None)
                .await
                .expect("put");
            shard = Some(p);
        }
        shard.expect("a shard")
    });
    let fx = Fixture::new();
    lease_at_beginning(&fx, &shard);
    let source = format!("kinesis://{stream}?endpoint={endpoint}&region=us-east-1");
    let (lag, status, table) = lag_and_status(&fx, &source);
    let after = SystemClock.wall();
    let bound = (after.0 - before.0) as f64 / 1000.0 + 1.0;
    let secs = lag["partitions"][0]["seconds"].as_f64().expect("seconds");
    assert!(
        (0.0..=bound).contains(&secs),
        "between the put and now: {secs} {lag}"
    );
    assert!(
        lag["partitions"][0]["lag"].is_null(),
        "records are not counted: {lag}"
    );
    assert_eq!(lag["max_seconds"].as_f64(), Some(secs), "{lag}");
    assert!(
        status["leases"][0]["lag_seconds"].as_f64().is_some(),
        "status shows it too: {status}"
    );
    assert!(
        table
            .lines()
            .last()
            .unwrap_or_default()
            .starts_with("total 0, max "),
        "{table}"
    );
}

#[test]
fn lag_shows_seconds_for_a_dynamodb_stream() {
    // A stream cannot count records (LAG `?`); the first unread record's
    // ApproximateCreationDateTime gives the lag in time. DynamoDB Local rounds that time down
    // to the minute, so the bound allows a minute more.
    let endpoint = std::env::var("CHANGEFEED_TEST_DYNAMODB_URL").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_DYNAMODB_URL is not set: start DynamoDB Local with `bash .ci/run` \
             (or `eval \"$(bash .ci/aws-services.sh)\"`)"
        )
    });
    let table = format!("lagsec-{}-{}", std::process::id(), SystemClock.wall().0);
    let before = SystemClock.wall();
    let shard = rt().block_on(async {
        let options = changefeed_dynamodb::AwsOptions::local(endpoint.clone());
        let t = changefeed_dynamodb::StreamTable::connect(&options, table.clone()).await;
        let arn = t.create().await.expect("create table");
        for i in 0..2 {
            t.put("k", &format!("r{i}")).await.expect("put");
        }
        let feed = changefeed_dynamodb::DynamoStreamsFeed::connect(
            &options,
            &changefeed_dynamodb::StreamRef::Arn(arn),
            changefeed_dynamodb::StreamsOptions::default(),
        )
        .await
        .expect("the stream");
        changefeed::source::FeedSource::partitions(&feed)
            .await
            .expect("shards")[0]
            .id
            .clone()
    });
    let fx = Fixture::new();
    lease_at_beginning(&fx, &shard);
    let source = format!("dynamodb-streams://{table}?endpoint={endpoint}&region=us-east-1");
    let (lag, status, _) = lag_and_status(&fx, &source);
    let after = SystemClock.wall();
    let bound = (after.0 - before.0) as f64 / 1000.0 + 61.0;
    let secs = lag["partitions"][0]["seconds"].as_f64().expect("seconds");
    assert!(
        (0.0..=bound).contains(&secs),
        "between the put (less a minute) and now: {secs} {lag}"
    );
    assert!(
        lag["partitions"][0]["lag"].is_null(),
        "records are not counted: {lag}"
    );
    assert!(
        status["leases"][0]["lag_seconds"].as_f64().is_some(),
        "status shows it too: {status}"
    );
}

/// The value of `series` (a metric's name and labels, as `name{group="g"}`) in a Prometheus
/// scrape of 127.0.0.1:`port`, once it has one.
fn scrape(port: u16, series: &str) -> Option<f64> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// The host process, killed if the test ends early.
struct Host(Child);

impl Drop for Host {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn run_publishes_lag_seconds_and_counts_the_children_no_host_reads() {
    // The gauges tell the truth. The parent's batch keeps failing, so its children
    // wait without a lease; the leader counts their 10 records in changefeed_lag_records, and
    // changefeed_lag_seconds is the age of the oldest unread record (an hour). With
    // --lag-per-partition, the parent's own series shows its hour too.
    let fx = Fixture::new();
    let hour_ago = Timestamp(SystemClock.wall().0 - 3_600_000);
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let old = changefeed_sqlite::SqliteFeed::open_with_clock(
            &fx.db,
            Arc::new(VirtualClock::new(hour_ago)),
        )
        .await
        .expect("open feed");
        let p0 = PartitionId::new("0").expect("id");
        for i in 0..3 {
            old.append_to(&p0, "k", format!("r{i}"))
                .await
                .expect("append");
        }
        let (a, b) = feed.split(&p0).await.expect("split");
        for (child, n) in [(&a, 4), (&b, 6)] {
            for i in 0..n {
                old.append_to(child, "k", format!("c{i}"))
                    .await
                    .expect("append");
            }
        }
    });
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut host = Host(
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--handler", "exit 1", "--host", "h1", "--group", "g"])
            .args(["--http", &format!("127.0.0.1:{port}")])
            .args(["--renew-interval", "500ms", "--acquire-interval", "200ms"])
            .args(["--poll-delay", "50ms", "--lag-per-partition"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start run"),
    );
    wait_for(
        Duration::from_secs(40),
        "the children's 10 records in changefeed_lag_records",
        || (scrape(port, r#"changefeed_lag_records{group="g"}"#) == Some(10.0)).then_some(()),
    );
    let secs = wait_for(Duration::from_secs(20), "changefeed_lag_seconds", || {
        scrape(port, r#"changefeed_lag_seconds{group="g"}"#).filter(|s| *s > 0.0)
    });
    assert!((3600.0..4200.0).contains(&secs), "an hour behind: {secs}");
    let parent = wait_for(
        Duration::from_secs(20),
        "changefeed_partition_lag_seconds of partition 0",
        || {
            scrape(
                port,
                r#"changefeed_partition_lag_seconds{group="g",partition="0"}"#,
            )
            .filter(|s| *s > 0.0)
        },
    );
    assert!(
        (3600.0..4200.0).contains(&parent),
        "the parent is an hour behind: {parent}"
    );
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(15));
    assert!(status.success(), "graceful stop exits 0: {status}");
}
