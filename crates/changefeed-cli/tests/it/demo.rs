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

/// The database path the demo names on its `kept the database: PATH (…` or
/// `removing the database PATH (…` line.
fn database_line(stdout: &str, prefix: &str) -> std::path::PathBuf {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line:\n{stdout}"));
    let path = line.split(" (").next().expect("a path");
    std::path::PathBuf::from(path)
}

#[test]
fn demo_keeps_its_database_only_when_asked_and_says_where() {
    // `demo --keep` keeps the database it made and says where, so the
    // operator commands can look at it; without --keep it says it removes it, and does.
    let tmp = tempfile::tempdir().expect("temporary directory");
    let demo = |keep: bool| {
        let mut cmd = bin();
        cmd.args([
            "demo",
            "--duration",
            "4",
            "--partitions",
            "2",
            "--hosts",
            "1",
        ])
        .args(["--no-split", "--rate", "50", "--seed", "3"])
        .env("TMPDIR", tmp.path());
        if keep {
            cmd.arg("--keep");
        }
        let out = cmd.output().expect("demo");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let last = stdout.lines().last().unwrap_or_default();
        assert!(last.contains(" lost=0 reordered=0"), "{stdout}");
        stdout
    };

    let stdout = demo(true);
    let db = database_line(&stdout, "kept the database: ");
    assert!(db.starts_with(tmp.path()), "{}", db.display());
    assert!(db.is_file(), "{} is kept", db.display());
    assert!(
        db.with_file_name("host-1.log").is_file(),
        "the hosts' logs are kept beside it"
    );
    let url = format!("sqlite://{}", db.display());
    let out = bin()
        .args(["status", "--store", &url, "--group", "demo", "--json"])
        .output()
        .expect("status");
    assert!(out.status.success(), "{:?}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        status["leases"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );

    let stdout = demo(false);
    let db = database_line(&stdout, "removing the database ");
    assert!(db.starts_with(tmp.path()), "{}", db.display());
    assert!(!db.exists(), "{} is removed", db.display());
}
