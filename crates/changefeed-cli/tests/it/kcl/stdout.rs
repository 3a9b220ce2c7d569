//! A record processor that prints to stdout what is not a protocol message.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use changefeed::model::PartitionId;

use super::{delivered, kclpy_python, ledger};
use crate::health::{free_port, get};
use crate::support::{bin, read, terminate, wait_exit, wait_for, Fixture, KillOnDrop, FAST};

#[test]
fn lines_on_stdout_that_are_not_messages_are_skipped_and_every_record_delivered() {
    // A stdout line that is not a protocol message (a structured logger's JSON, plain text) is
    // skipped, as the Java daemon skips it: the amazon_kclpy processor that prints both before
    // answering initialize and in every batch gets every record, no child is restarted, and
    // each child's first such line is logged once; every one is counted.
    let python = kclpy_python();
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(2).await.expect("partitions");
        for i in 0..100 {
            let p = PartitionId::new(if i % 2 == 0 { "0" } else { "1" }).expect("id");
            feed.append_to(&p, &format!("key-{i}"), format!("r-{i}"))
                .await
                .expect("append");
        }
    });
    let processor = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/record_processor.py");
    let ledger_path = fx.path("ledger.jsonl");
    let stderr = fx.path("stderr");
    let port = free_port();
    let mut host = KillOnDrop(
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--protocol", "kcl", "--host", "h1", "--group", "g"])
            .arg("--handler")
            .arg(format!("'{python}' '{}'", processor.display()))
            .args([
                "--max-batch-size",
                "10",
                "--http",
                &format!("127.0.0.1:{port}"),
            ])
            .args(FAST)
            .env("KCL_TEST_LEDGER", &ledger_path)
            .env("KCL_TEST_STDOUT_NOISE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start run"),
    );
    let want: BTreeSet<String> = (0..100).map(|i| format!("r-{i}")).collect();
    wait_for(Duration::from_secs(60), "every record delivered", || {
        assert!(
            host.0.try_wait().expect("try_wait").is_none(),
            "run exited: {}",
            read(&stderr)
        );
        want.is_subset(&delivered(&ledger(&ledger_path)))
            .then_some(())
    });
    // Two lines at each child's start and two in each of its batches (ten records at most),
    // all counted by the time every record was delivered.
    let skipped = wait_for(Duration::from_secs(10), "the metrics", || {
        get(port, "/metrics")?.body.lines().find_map(|l| {
            l.strip_prefix(r#"changefeed_kcl_stdout_lines_skipped_total{group="g"} "#)
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
    });
    assert!(skipped >= 24.0, "skipped lines counted: {skipped}");
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
    let entries = ledger(&ledger_path);
    let inits = entries.iter().filter(|e| e["ev"] == "init").count();
    assert_eq!(
        inits, 2,
        "one child per partition, none restarted: {entries:?}"
    );
    let log = read(&stderr);
    assert!(!log.contains("handler failed"), "{log}");
    let logged: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("that is not a protocol message"))
        .collect();
    assert_eq!(logged.len(), 2, "logged once per child: {logged:?}");
    assert!(
        logged
            .iter()
            .all(|l| l.contains("starting record processor")),
        "the first skipped line is the logger's: {logged:?}"
    );
}
