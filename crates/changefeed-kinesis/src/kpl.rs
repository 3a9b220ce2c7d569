//! Records written by the Kinesis Producer Library (KPL) with aggregation: one Kinesis record
//! carrying many user records, taken apart here as the KCL takes them apart, so that every
//! handler (whatever protocol it speaks) sees the user records the producer wrote.
//!
//! An aggregated record's data is the magic `F3 89 9A C2`, the protobuf `AggregatedRecord` of
//! the KPL's `messages.proto`, then the 16-byte MD5 of those protobuf bytes. Its user records
//! share the Kinesis record's sequence number and are numbered by their place in it, the
//! *sub-sequence number* 0..n-1. As the KCL does (`AggregatorUtil.deaggregate`), data without
//! the magic, with a digest that does not match, or with a protobuf that does not decode is
//! passed on as the one record it is.
//!
//! Each user record has a hash key: its explicit hash key (a decimal number) when the
//! aggregate's table gives one, else the MD5 of its partition key, as Kinesis routes a record.
//! A KPL that aggregated with a stale shard map (the stream was resharded since) can put user
//! records whose hash key lies outside the shard the aggregate landed in; the KCL 2.5.8
//! (`AggregatorUtil.deaggregate` with the shard's `HashKeyRange`) then drops the whole
//! aggregated record, the user records inside the range too, silently. By default the source
//! does the same ([`outside`]), counting the user records in
//! `changefeed_kinesis_user_records_dropped_total` and logging a warning naming the shard and
//! sequence number; `ReadOptions::deliver_outside_shard` delivers them instead.
//!
//! The continuation of a user record is its [`ExtendedSequenceNumber`] written `SEQ/SUB`; a
//! Kinesis record that was not aggregated keeps its plain sequence number as before.

use bytes::Bytes;
use md5::{Digest as _, Md5};
use prost::Message as _;

use changefeed::model::{Continuation, KeyRange};

/// The four bytes an aggregated record's data starts with.
const MAGIC: [u8; 4] = [0xF3, 0x89, 0x9A, 0xC2];
/// The length of the MD5 digest that ends an aggregated record's data.
const DIGEST_LEN: usize = 16;

/// The KPL's `AggregatedRecord` (`messages.proto`, proto2).
#[derive(Clone, PartialEq, prost::Message)]
struct AggregatedRecord {
    #[prost(string, repeated, tag = "1")]
    partition_key_table: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    explicit_hash_key_table: Vec<String>,
    #[prost(message, repeated, tag = "3")]
    records: Vec<AggregatedUserRecord>,
}

/// One user record of an `AggregatedRecord` (`Record` in `messages.proto`).
#[derive(Clone, PartialEq, prost::Message)]
struct AggregatedUserRecord {
    #[prost(uint64, required, tag = "1")]
    partition_key_index: u64,
    #[prost(uint64, optional, tag = "2")]
    explicit_hash_key_index: Option<u64>,
    #[prost(bytes = "bytes", required, tag = "3")]
    data: Bytes,
    #[prost(message, repeated, tag = "4")]
    tags: Vec<Tag>,
}

/// A user record's tag (`Tag` in `messages.proto`); read and not used, as by the KCL.
#[derive(Clone, PartialEq, prost::Message)]
struct Tag {
    #[prost(string, required, tag = "1")]
    key: String,
    #[prost(string, optional, tag = "2")]
    value: Option<String>,
}

/// A user record taken out of an aggregated record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UserRecord {
    /// Its own partition key (from the table).
    pub key: String,
    pub data: Bytes,
    /// Its hash key: the explicit hash key, or the MD5 of the partition key; `None` for an
    /// explicit hash key that is not a number in `0..=2^128-1` (in no shard).
    pub hash_key: Option<u128>,
}

/// The hash key of a user record: `explicit` read as a decimal number, or the MD5 of
/// `partition_key` as a big-endian number (as Kinesis and the KCL's `effectiveHashKey`).
fn hash_key(partition_key: &str, explicit: Option<&str>) -> Option<u128> {
    match explicit {
        Some(h) => h.parse().ok(),
        None => Some(u128::from_be_bytes(
            Md5::digest(partition_key.as_bytes()).into(),
        )),
    }
}

/// The first user record whose hash key lies outside `range` (the shard's): when there is one,
/// the KCL drops the whole aggregated record.
pub(crate) fn outside(users: &[UserRecord], range: KeyRange) -> Option<&UserRecord> {
    users
        .iter()
        .find(|u| u.hash_key.is_none_or(|h| h < range.start || h > range.end))
}

/// Whether `data` starts with the KPL magic (it may be an aggregated record).
pub(crate) fn maybe_aggregated(data: &[u8]) -> bool {
    data.starts_with(&MAGIC)
}

/// The user records of `data` in order (their sub-sequence numbers are their indexes), or
/// `None` when `data` is not a well-formed aggregated record and is to be delivered as is.
pub(crate) fn deaggregate(data: &Bytes) -> Option<Vec<UserRecord>> {
    if data.len() < MAGIC.len() + DIGEST_LEN || data[..MAGIC.len()] != MAGIC {
        return None;
    }
    let body = data.slice(MAGIC.len()..data.len() - DIGEST_LEN);
    if Md5::digest(&body)[..] != data[data.len() - DIGEST_LEN..] {
        tracing::debug!("a record with the KPL magic has a wrong digest: delivered as is");
        return None;
    }
    let aggregated = AggregatedRecord::decode(body).ok()?;
    let table = &aggregated.partition_key_table;
    let hash_keys = &aggregated.explicit_hash_key_table;
    aggregated
        .records
        .into_iter()
        .map(|r| {
            let key = usize::try_from(r.partition_key_index)
                .ok()
                .and_then(|i| table.get(i))?;
            let explicit = match r.explicit_hash_key_index {
                Some(i) => Some(usize::try_from(i).ok().and_then(|i| hash_keys.get(i))?),
                None => None,
            };
            Some(UserRecord {
                hash_key: hash_key(key, explicit.map(String::as_str)),
                key: key.clone(),
                data: r.data,
            })
        })
        .collect()
}

/// Where a user record is in its shard, as the KCL counts (its `ExtendedSequenceNumber`): the
/// Kinesis record's sequence number and, for a user record of an aggregated record, its
/// sub-sequence number. As a [`Continuation`] it is `SEQ` or `SEQ/SUB`; reading resumes after
/// it (for `SEQ/SUB`: at `SEQ`, skipping its user records up to `SUB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtendedSequenceNumber<'a> {
    /// The Kinesis sequence number: decimal digits, up to 128.
    pub sequence_number: &'a str,
    /// The user record's place in an aggregated record; `None` for a record that was not
    /// aggregated (which the KCL numbers 0).
    pub sub_sequence_number: Option<u64>,
}

impl<'a> ExtendedSequenceNumber<'a> {
    /// Reads a continuation of this source (`SEQ` or `SEQ/SUB`); `None` for anything else.
    pub fn parse(continuation: &'a str) -> Option<Self> {
        let (seq, sub) = match continuation.split_once('/') {
            Some((seq, sub)) => (seq, Some(sub)),
            None => (continuation, None),
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(seq) || seq.len() > 128 {
            return None;
        }
        let sub_sequence_number = match sub {
            Some(s) if digits(s) => Some(s.parse().ok()?),
            Some(_) => return None,
            None => None,
        };
        Some(ExtendedSequenceNumber {
            sequence_number: seq,
            sub_sequence_number,
        })
    }

    /// The sub-sequence number as the KCL reports it: 0 for a record that was not aggregated.
    pub fn sub(&self) -> u64 {
        self.sub_sequence_number.unwrap_or(0)
    }

    /// The continuation that stands for this user record and everything before it.
    pub fn continuation(&self) -> Continuation {
        match self.sub_sequence_number {
            Some(sub) => Continuation::new(format!("{}/{sub}", self.sequence_number)),
            None => Continuation::new(self.sequence_number),
        }
    }

    /// A key that orders like the shard: by sequence number (as a number), then sub-sequence
    /// number.
    pub fn order_key(&self) -> (usize, &'a str, u64) {
        (self.sequence_number.len(), self.sequence_number, self.sub())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An aggregated record's data as the KPL writes it, with `digest` in place of its MD5
    /// when given.
    fn aggregated(records: &[(&str, &[u8])], digest: Option<[u8; 16]>) -> Bytes {
        let records: Vec<(&str, Option<&str>, &[u8])> =
            records.iter().map(|(k, d)| (*k, None, *d)).collect();
        with_hash_keys(&records, digest)
    }

    /// The index of `value` in `table`, added at the end if absent (the KPL's key tables).
    fn index(table: &mut Vec<String>, value: &str) -> u64 {
        let i = table.iter().position(|k| k == value).unwrap_or_else(|| {
            table.push(value.to_string());
            table.len() - 1
        });
        i as u64
    }

    /// As [`aggregated`], each user record with its explicit hash key if given.
    fn with_hash_keys(records: &[(&str, Option<&str>, &[u8])], digest: Option<[u8; 16]>) -> Bytes {
        let mut out = AggregatedRecord {
            partition_key_table: Vec::new(),
            explicit_hash_key_table: Vec::new(),
            records: Vec::new(),
        };
        for (key, hash_key, data) in records {
            let partition_key_index = index(&mut out.partition_key_table, key);
            let explicit_hash_key_index =
                hash_key.map(|h| index(&mut out.explicit_hash_key_table, h));
            out.records.push(AggregatedUserRecord {
                partition_key_index,
                explicit_hash_key_index,
                data: Bytes::copy_from_slice(data),
                tags: Vec::new(),
            });
        }
        let body = out.encode_to_vec();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(&digest.unwrap_or_else(|| Md5::digest(&body).into()));
        Bytes::from(bytes)
    }

    #[test]
    fn an_aggregated_record_gives_its_user_records_in_order() {
        let data = aggregated(&[("a", b"one"), ("b", b"two"), ("a", b"three")], None);
        let got = deaggregate(&data).expect("aggregated");
        let want: Vec<(&str, &[u8])> = vec![("a", b"one"), ("b", b"two"), ("a", b"three")];
        assert_eq!(
            got.iter()
                .map(|r| (r.key.as_str(), r.data.as_ref()))
                .collect::<Vec<_>>(),
            want
        );
    }

    #[test]
    fn anything_else_is_delivered_as_is() {
        // As the KCL: plain data, a wrong digest, a bad protobuf, a key index out of the table.
        assert_eq!(deaggregate(&Bytes::from_static(b"plain")), None);
        let wrong = aggregated(&[("a", b"one")], Some([0; 16]));
        assert_eq!(deaggregate(&wrong), None);
        let mut garbage = MAGIC.to_vec();
        let body = [0xFF_u8, 0xFF, 0xFF];
        garbage.extend_from_slice(&body);
        garbage.extend_from_slice(&Md5::digest(body));
        assert_eq!(deaggregate(&Bytes::from(garbage)), None);
        let mut bad_index = AggregatedRecord {
            partition_key_table: vec!["a".into()],
            explicit_hash_key_table: Vec::new(),
            records: Vec::new(),
        };
        bad_index.records.push(AggregatedUserRecord {
            partition_key_index: 5,
            explicit_hash_key_index: None,
            data: Bytes::from_static(b"x"),
            tags: Vec::new(),
        });
        let body = bad_index.encode_to_vec();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(&Md5::digest(&body));
        assert_eq!(deaggregate(&Bytes::from(bytes)), None);
    }

    #[test]
    fn a_user_record_has_its_explicit_hash_key_or_the_md5_of_its_partition_key() {
        let half = 1u128 << 127;
        let data = with_hash_keys(
            &[
                ("a", Some("5"), b"one"),
                ("a", None, b"two"),
                ("b", Some(&half.to_string()), b"three"),
                ("c", Some("not a number"), b"four"),
            ],
            None,
        );
        let got = deaggregate(&data).expect("aggregated");
        let md5_a = u128::from_str_radix("0cc175b9c0f1b6a831c399e269772661", 16).expect("hex");
        assert_eq!(
            got.iter().map(|u| u.hash_key).collect::<Vec<_>>(),
            [Some(5), Some(md5_a), Some(half), None]
        );
        let lower = KeyRange {
            start: 0,
            end: half - 1,
        };
        let upper = KeyRange {
            start: half,
            end: u128::MAX,
        };
        // MD5("a") = 0x0cc1…: in the lower half.
        assert_eq!(outside(&got[..2], lower), None);
        assert_eq!(outside(&got[..2], upper), Some(&got[0]));
        assert_eq!(outside(&got[2..3], lower), Some(&got[2]));
        assert_eq!(outside(&got[2..3], upper), None);
        assert_eq!(
            outside(&got[3..], KeyRange::FULL),
            Some(&got[3]),
            "in no shard"
        );
    }

    #[test]
    fn an_explicit_hash_key_index_out_of_the_table_is_delivered_as_is() {
        let mut record = AggregatedRecord {
            partition_key_table: vec!["a".into()],
            explicit_hash_key_table: Vec::new(),
            records: Vec::new(),
        };
        record.records.push(AggregatedUserRecord {
            partition_key_index: 0,
            explicit_hash_key_index: Some(3),
            data: Bytes::from_static(b"x"),
            tags: Vec::new(),
        });
        let body = record.encode_to_vec();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(&Md5::digest(&body));
        assert!(maybe_aggregated(&bytes));
        assert_eq!(deaggregate(&Bytes::from(bytes)), None);
    }

    #[test]
    fn extended_sequence_numbers_read_and_order() {
        let plain = ExtendedSequenceNumber::parse("4960").expect("plain");
        assert_eq!(plain.sub_sequence_number, None);
        assert_eq!(plain.continuation().as_str(), "4960");
        let sub = ExtendedSequenceNumber::parse("4960/2").expect("sub");
        assert_eq!((sub.sequence_number, sub.sub()), ("4960", 2));
        assert_eq!(sub.continuation().as_str(), "4960/2");
        assert!(plain.order_key() < sub.order_key());
        let later = ExtendedSequenceNumber::parse("10000").expect("plain");
        assert!(sub.order_key() < later.order_key());
        for bad in ["", "0:5", "49/", "/3", "49/x", "4a", "1/2/3"] {
            assert_eq!(ExtendedSequenceNumber::parse(bad), None, "{bad}");
        }
    }
}
