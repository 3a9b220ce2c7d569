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
