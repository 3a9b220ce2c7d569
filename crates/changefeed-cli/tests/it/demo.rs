//! `changefeed demo`: a short run of real host processes ends with nothing lost or reordered.

use crate::support::{bin, text};

#[test]
fn short_demo_loses_and_reorders_nothing() {
    // DESIGN rules 4-6 end to end: SIGKILL a host, add one, split a partition, stop gracefully;
    // the ledger is complete and in order per key.
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = bin()
        .args([
            "demo",
            "--duration",
            "8",
            "--partitions",
            "4",
            "--hosts",
            "2",
            "--seed",
            "7",
        ])
        .arg("--db")
        .arg(dir.path().join("demo.db"))
        .output()
        .expect("demo");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("RESULT written="), "{stdout}");
    assert!(last.contains(" lost=0 reordered=0"), "{stdout}");
    assert!(stdout.contains("killed host-"), "{stdout}");
    assert!(stdout.contains("added host-3"), "{stdout}");
    assert!(stdout.contains("split partition"), "{stdout}");
    let written: u64 = last
        .split_whitespace()
        .find_map(|f| f.strip_prefix("written="))
        .and_then(|n| n.parse().ok())
        .expect("written=N");
    assert!(written > 100, "{stdout}");
}
