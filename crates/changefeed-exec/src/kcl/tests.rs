use super::*;
use bytes::Bytes;
use changefeed::model::Record;

fn batch(seqs: &[&str]) -> Batch {
    Batch {
        records: seqs
            .iter()
            .map(|s| Record {
                key: "k".into(),
                data: Bytes::from_static(b"x"),
                continuation: Continuation::new(*s),
                timestamp: None,
            })
            .collect(),
        continuation: seqs.last().map(|s| Continuation::new(*s)),
        end_of_partition: false,
    }
}

#[test]
fn a_checkpoint_goes_where_the_child_asks_within_what_it_was_given() {
    let b = batch(&["100", "105", "110"]);
    let delivered = Continuation::new("110");
    let before = Continuation::new("90");
    let at = |s: &str| Ok(Target::At(Continuation::new(s)));
    // Null: the last record delivered.
    assert_eq!(
        target(None, Some(&b), Some(&delivered), None, false),
        at("110")
    );
    assert_eq!(target(None, None, None, None, false), Ok(Target::Nothing));
    // A record of the batch.
    assert_eq!(
        target(Some(("105", None)), Some(&b), Some(&delivered), None, false),
        at("105")
    );
    // A record of an earlier batch: between the last checkpoint and the last delivered.
    assert_eq!(
        target(
            Some(("95", None)),
            Some(&b),
            Some(&delivered),
            Some(&before),
            false
        ),
        at("95")
    );
    // Beyond what was delivered, behind the checkpoint, or not a sequence number at all.
    for bad in ["111", "1000", "80", "abc"] {
        assert_eq!(
            target(
                Some((bad, None)),
                Some(&b),
                Some(&delivered),
                Some(&before),
                false
            ),
            Err("IllegalArgumentException"),
            "{bad}"
        );
    }
    // Non-decimal continuations (the SQLite feed's) must be records of the batch.
    let s = batch(&["3:1", "3:2"]);
    let last = Continuation::new("3:2");
    assert_eq!(
        target(Some(("3:1", None)), Some(&s), Some(&last), None, false),
        at("3:1")
    );
    assert_eq!(
        target(Some(("3:0", None)), Some(&s), Some(&last), None, false),
        Err("IllegalArgumentException")
    );
}

#[test]
fn a_checkpoint_at_a_sub_sequence_number_goes_to_that_user_record() {
    // KPL-aggregated records: user records share the sequence number and carry their own
    // sub-sequence numbers (continuations SEQ/SUB). A request names one by both numbers; without
    // a sub-sequence number it means sub-sequence 0, as in the KCL.
    let b = batch(&["100", "105/0", "105/1", "105/2"]);
    let delivered = Continuation::new("105/2");
    let at = |s: &str| Ok(Target::At(Continuation::new(s)));
    let ask = |seq, sub| target(Some((seq, sub)), Some(&b), Some(&delivered), None, true);
    assert_eq!(ask("105", Some(1)), at("105/1"));
    assert_eq!(ask("105", None), at("105/0"));
    assert_eq!(ask("100", Some(0)), at("100"));
    assert_eq!(ask("105", Some(3)), Err("IllegalArgumentException"));
    assert_eq!(ask("105/1", None), Err("IllegalArgumentException"));
    // Earlier batches: ordered by sequence, then sub-sequence number; once aggregated records
    // were delivered, a place without a sub-sequence number is SEQ/0 (the rest of that record
    // is read again rather than skipped).
    let before = Continuation::new("90/3");
    let earlier = |seq, sub, aggregated| {
        target(
            Some((seq, sub)),
            Some(&b),
            Some(&delivered),
            Some(&before),
            aggregated,
        )
    };
    assert_eq!(earlier("95", Some(2), false), at("95/2"));
    assert_eq!(earlier("95", None, true), at("95/0"));
    assert_eq!(earlier("95", None, false), at("95"));
    assert_eq!(earlier("90", Some(4), true), at("90/4"));
    assert_eq!(
        earlier("90", Some(2), true),
        Err("IllegalArgumentException")
    );
}
