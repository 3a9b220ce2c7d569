//! KPL-aggregated records whose user records lie outside their shard, on kinesis-mock: dropped
//! whole as the KCL 2.5.8 drops them (observed with the real KCL in `changefeed-cli`'s
//! `kcl::real_kcl` test), counted, or delivered with `deliver_outside_shard`.

use changefeed::model::{KeyRange, Position};
use changefeed::source::FeedSource;
use changefeed_kinesis::{ExtendedSequenceNumber, KinesisFeed, ReadOptions};
use md5::{Digest as _, Md5};
use prost::Message as _;

use crate::fresh_feed;

/// The KPL's `AggregatedRecord` (`messages.proto`), written here as a producer writes it.
#[derive(Clone, PartialEq, prost::Message)]
struct AggregatedRecord {
    #[prost(string, repeated, tag = "1")]
    partition_key_table: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    explicit_hash_key_table: Vec<String>,
    #[prost(message, repeated, tag = "3")]
    records: Vec<UserRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct UserRecord {
    #[prost(uint64, required, tag = "1")]
    partition_key_index: u64,
    #[prost(uint64, optional, tag = "2")]
    explicit_hash_key_index: Option<u64>,
    #[prost(bytes = "vec", required, tag = "3")]
    data: Vec<u8>,
}

/// An aggregated record of `(data, explicit hash key)` user records, each with a partition key
/// of its own: the magic, the protobuf, its MD5.
fn aggregate(users: &[(&str, u128)]) -> Vec<u8> {
    let mut record = AggregatedRecord {
        partition_key_table: Vec::new(),
        explicit_hash_key_table: Vec::new(),
        records: Vec::new(),
    };
    for (i, (data, hash_key)) in users.iter().enumerate() {
        record.partition_key_table.push(format!("key-{data}"));
        record.explicit_hash_key_table.push(hash_key.to_string());
        record.records.push(UserRecord {
            partition_key_index: i as u64,
            explicit_hash_key_index: Some(i as u64),
            data: data.as_bytes().to_vec(),
        });
    }
    let body = record.encode_to_vec();
    let mut out = vec![0xF3, 0x89, 0x9A, 0xC2];
    out.extend_from_slice(&body);
    out.extend_from_slice(&Md5::digest(&body));
    out
}

/// Every user record of `shard` from its start: (data, sequence number, sub-sequence number).
async fn read_all(
    feed: &KinesisFeed,
    shard: &changefeed::model::PartitionId,
) -> Vec<(String, String, u64)> {
    let mut reader = feed.open(shard, &Position::Beginning).await.expect("open");
    let mut out = Vec::new();
    loop {
        let batch = reader.next_batch(100).await.expect("read");
        if batch.records.is_empty() {
            return out;
        }
        for r in batch.records {
            let at = ExtendedSequenceNumber::parse(r.continuation.as_str()).expect("continuation");
            out.push((
                String::from_utf8(r.data.to_vec()).expect("utf-8"),
                at.sequence_number.to_string(),
                at.sub(),
            ));
        }
    }
}

fn names(records: &[(String, String, u64)]) -> Vec<&str> {
    records.iter().map(|(d, _, _)| d.as_str()).collect()
}

#[tokio::test]
async fn an_aggregate_with_a_user_record_outside_its_shard_is_dropped_whole_and_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    // The test runs on one thread (current-thread runtime): the source's counter lands here.
    let _guard = metrics::set_default_local_recorder(&recorder);
    let feed = fresh_feed("kpl-outside", 2).await;
    let partitions = feed.partitions().await.expect("shards");
    let range = |i: usize| partitions[i].key_range.unwrap_or(KeyRange::FULL);
    let (inside, outside) = if range(0).start == 0 { (0, 1) } else { (1, 0) };
    let shard = partitions[inside].id.clone();
    let (lo, other) = (range(inside).start, range(outside).start);
    // A in the shard; B with r-3's explicit hash key in the other shard; C in the shard.
    for users in [
        &[("r-0", lo + 1), ("r-1", lo + 2)][..],
        &[("r-2", lo + 3), ("r-3", other + 3), ("r-4", lo + 4)],
        &[("r-5", lo + 5)],
    ] {
        let (at, _) = feed
            .put("outer", aggregate(users), Some(lo + 1))
            .await
            .expect("put an aggregated record");
        assert_eq!(at, shard, "routed by the outer explicit hash key");
    }
    let got = read_all(&feed, &shard).await;
    assert_eq!(
        names(&got),
        ["r-0", "r-1", "r-5"],
        "B dropped whole, as the KCL"
    );
    let scrape = metrics.render();
    assert!(
        scrape.contains("changefeed_kinesis_user_records_dropped_total 3"),
        "the three user records of B counted: {scrape}"
    );

    // With deliver_outside_shard, every user record at its place.
    let client = feed.client().clone();
    let delivering = KinesisFeed::with_options(
        client,
        feed.stream(),
        ReadOptions {
            deliver_outside_shard: true,
            ..ReadOptions::default()
        },
    );
    let all = read_all(&delivering, &shard).await;
    assert_eq!(names(&all), ["r-0", "r-1", "r-2", "r-3", "r-4", "r-5"]);
    let b: Vec<(&str, u64)> = all[2..5]
        .iter()
        .map(|(_, s, sub)| (s.as_str(), *sub))
        .collect();
    let seq_b = all[2].1.as_str();
    assert_eq!(b, [(seq_b, 0), (seq_b, 1), (seq_b, 2)]);
    assert_eq!(all[..2], got[..2], "the same places for what both deliver");
    assert_eq!(all[5], got[2]);
    feed.delete_stream().await.expect("delete stream");
}
