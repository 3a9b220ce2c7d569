//! `pip install`: the `changefeed` a Python KCL team gets from the wheel (`pyproject.toml`,
//! maturin's `bin` bindings) runs an amazon_kclpy record processor. The README's test command
//! builds the wheel from this checkout, installs it into a fresh venv and names that venv's
//! `changefeed` in `$CHANGEFEED_TEST_WHEEL_BIN`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use changefeed::model::PartitionId;

use super::{delivered, ledger};
use crate::support::{read, terminate, wait_exit, wait_for, Fixture};

/// The `changefeed` the wheel installed, checked to exist.
fn wheel_bin() -> String {
    let bin = std::env::var("CHANGEFEED_TEST_WHEEL_BIN").unwrap_or_else(|_| {
        panic!(
            "CHANGEFEED_TEST_WHEEL_BIN is not set: it names the `changefeed` a pip-installed wheel \
             put in a venv (`scripts/test` builds the wheel with maturin and installs it)"
        )
    });
    assert!(Path::new(&bin).is_file(), "{bin} does not exist");
    bin
}

#[test]
fn the_pip_installed_changefeed_runs_a_kcl_record_processor() {
    let bin = wheel_bin();
    let version = Command::new(&bin)
        .arg("--version")
        .output()
        .expect("run --version");
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("changefeed {}", env!("CARGO_PKG_VERSION")),
        "the wheel carries this version's binary"
    );
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(2).await.expect("partitions");
        for i in 0..20 {
            let p = PartitionId::new((i % 2).to_string()).expect("id");
            feed.append_to(&p, &format!("key-{i}"), format!("r-{i}"))
                .await
                .expect("append");
        }
    });
    let ledger_path = fx.path("ledger.jsonl");
    let stderr = fx.path("h1.stderr");
    let mut host = super::sqlite_kcl_host(Command::new(&bin), &fx, "h1", &ledger_path);
    let want: BTreeSet<String> = (0..20).map(|i| format!("r-{i}")).collect();
    wait_for(Duration::from_secs(60), "every record delivered", || {
        assert!(
            host.0.try_wait().expect("try_wait").is_none(),
            "run exited: {}",
            read(&stderr)
        );
        want.is_subset(&delivered(&ledger(&ledger_path)))
            .then_some(())
    });
    terminate(&host.0);
    let status = wait_exit(&mut host.0, Duration::from_secs(15));
    assert!(status.success(), "graceful stop: {status}");
}
