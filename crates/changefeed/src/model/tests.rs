use super::*;

#[test]
fn lease_key_round_trips_and_splits_on_the_first_separator() {
    // A partition id may contain the separator; the group may not, so parsing is unambiguous.
    let key = LeaseKey::new(
        GroupName::new("orders").expect("valid"),
        PartitionId::new("stream/shard-1").expect("valid"),
    );
    assert_eq!(key.to_string(), "orders/stream/shard-1");
    assert_eq!(
        LeaseKey::parse("orders/stream/shard-1").expect("parses"),
        key
    );
}

#[test]
fn bad_names_are_rejected_with_the_rule() {
    let err = GroupName::new("a/b").expect_err("separator");
    assert!(err.to_string().contains("must not contain '/'"), "{err}");
    let err = PartitionId::new("").expect_err("empty");
    assert!(err.to_string().contains("partition id"), "{err}");
    assert!(err.to_string().contains("must not be empty"), "{err}");
    let err = HostName::new("x".repeat(200)).expect_err("long");
    assert!(err.to_string().contains("at most 128 bytes"), "{err}");
    let err = HostName::new("a\u{7}b").expect_err("control");
    assert!(err.to_string().contains("printable"), "{err}");
    let err = LeaseKey::parse("nogroup").expect_err("no separator");
    assert!(err.to_string().contains("GROUP/PARTITION"), "{err}");
}

#[test]
fn positions_round_trip_through_text() {
    for p in [
        Position::Beginning,
        Position::Now,
        Position::AtTime(Timestamp(200)),
        Position::Continuation(Continuation::new("42:x")),
    ] {
        assert_eq!(p.to_string().parse::<Position>().expect("parses"), p);
    }
    assert!("later".parse::<Position>().is_err());
}

#[test]
fn numbered_continuations_round_trip_and_refuse_foreign_tokens() {
    // A feed reads back exactly the tokens it issued for the partition, up to its end.
    const OFFSETS: NumberedContinuation = NumberedContinuation {
        placeholder: "OFFSET",
        noun: "offset",
    };
    let p = PartitionId::new("shard:7").expect("valid");
    let c = NumberedContinuation::format(&p, 42);
    assert_eq!(c.as_str(), "shard:7:42");
    assert_eq!(OFFSETS.parse(&p, &c, 42).expect("ours"), 42);
    assert_eq!(NumberedContinuation::number(&c), Some(42));
    let reason = |c: &str, last| match OFFSETS.parse(&p, &Continuation::new(c), last) {
        Err(SourceError::InvalidContinuation { reason, .. }) => reason,
        other => panic!("{c} must be refused, got {other:?}"),
    };
    assert_eq!(reason("garbage", 42), "expected PARTITION:OFFSET");
    assert_eq!(reason("shard:8:1", 42), "belongs to another partition");
    assert_eq!(reason("shard:7:x", 42), "offset is not a number");
    assert_eq!(reason("shard:7:43", 42), "is past the end of the partition");
}

#[test]
fn inconsistent_leases_are_named() {
    let key = LeaseKey::parse("g/p").expect("valid");
    let mut lease = Lease::new(key, Position::Beginning);
    lease.validate().expect("a new lease is valid");
    lease.state = LeaseState::Owned;
    let err = lease.validate().expect_err("owned without owner");
    assert!(err.to_string().contains("g/p"), "{err}");
}

proptest::proptest! {
    #[test]
    fn a_split_range_merges_back_into_itself(start in proptest::prelude::any::<u128>(), len in proptest::prelude::any::<u128>()) {
        let range = KeyRange { start, end: start.saturating_add(len) };
        match range.split() {
            None => proptest::prop_assert_eq!(range.start, range.end),
            Some((lower, upper)) => {
                proptest::prop_assert!(lower.end < upper.start && lower.start == range.start && upper.end == range.end);
                proptest::prop_assert_eq!(upper.merge(lower), Some(range));
                proptest::prop_assert_eq!(lower.merge(upper), Some(range));
            }
        }
    }
}

#[test]
fn ranges_that_do_not_touch_do_not_merge() {
    let a = KeyRange { start: 0, end: 9 };
    let c = KeyRange { start: 11, end: 20 };
    assert_eq!(a.merge(c), None);
    assert_eq!(a.merge(a), None);
    assert_eq!(KeyRange { start: 5, end: 5 }.split(), None);
}
