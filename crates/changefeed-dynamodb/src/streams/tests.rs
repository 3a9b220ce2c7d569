//! Lineage and continuations of the Streams source, without a server.

use super::*;

#[test]
fn sequence_numbers_and_shard_ids_are_checked_before_any_call() {
    // Bad input is refused by name, not sent to the service.
    assert!(is_sequence_number("000000000000000000001"));
    assert!(!is_sequence_number("garbage"));
    assert!(!is_sequence_number(""));
    assert!(!is_sequence_number("12"));
    assert!(is_shard_id("shardId-00000001796550077836-c22c8045"));
    assert!(!is_shard_id("no-such-partition"));
}

#[test]
fn a_kcl_checkpoint_with_its_sub_sequence_number_reads_after_the_record() {
    // An adapter's checkpoint, imported as SEQ/SUB, resumes after SEQ: stream records are
    // never aggregated.
    assert_eq!(
        sequence_of("000000000000000000042/0"),
        Some("000000000000000000042")
    );
    assert_eq!(
        sequence_of("000000000000000000042"),
        Some("000000000000000000042")
    );
    assert_eq!(sequence_of("000000000000000000042/"), None);
    assert_eq!(sequence_of("000000000000000000042/x"), None);
    assert_eq!(sequence_of("garbage/0"), None);
}
