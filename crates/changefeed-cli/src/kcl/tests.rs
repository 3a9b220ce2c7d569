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
    assert_eq!(target(None, Some(&b), Some(&delivered), None), at("110"));
    assert_eq!(target(None, None, None, None), Ok(Target::Nothing));
    // A record of the batch.
    assert_eq!(
        target(Some("105"), Some(&b), Some(&delivered), None),
        at("105")
    );
    // A record of an earlier batch: between the last checkpoint and the last delivered.
    assert_eq!(
        target(Some("95"), Some(&b), Some(&delivered), Some(&before)),
        at("95")
    );
    // Beyond what was delivered, behind the checkpoint, or not a sequence number at all.
    for bad in ["111", "1000", "80", "abc"] {
        assert_eq!(
            target(Some(bad), Some(&b), Some(&delivered), Some(&before)),
            Err("IllegalArgumentException"),
            "{bad}"
        );
    }
    // Non-decimal continuations (the SQLite feed's) must be records of the batch.
    let s = batch(&["3:1", "3:2"]);
    let last = Continuation::new("3:2");
    assert_eq!(target(Some("3:1"), Some(&s), Some(&last), None), at("3:1"));
    assert_eq!(
        target(Some("3:0"), Some(&s), Some(&last), None),
        Err("IllegalArgumentException")
    );
}
