//! A graceful stop of `changefeed run --protocol kcl` whose record processor keeps failing.

use std::process::Stdio;
use std::time::{Duration, Instant};

use changefeed::model::PartitionId;

use crate::support::{
    bin, owned_by, read, status, terminate, wait_exit, wait_for, KillOnDrop, FAST,
};

#[test]
fn a_stop_releases_the_leases_of_a_record_processor_that_keeps_failing() {
    // DESIGN rule 6: a graceful stop releases every lease, whatever state its worker is in.
    // Here each worker is restarting an executable that exits at once (the child never
    // answers `initialize`), backing off between attempts; SIGTERM must still leave every
    // lease without an owner, and the host must exit 0 within its shutdown timeout.
    let fx = crate::support::Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(3).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        feed.append_to(&p, "k", "r-0").await.expect("append");
    });
    let stderr = fx.path("stderr");
    let mut host = KillOnDrop(
        bin()
            .args(["run", "--store", &fx.url(), "--source", &fx.url()])
            .args(["--protocol", "kcl", "--host", "h1", "--group", "g"])
            .args(["--handler", "echo 'cannot start' >&2; exit 3"])
            .args(["--handler-max-retries", "1000", "--shutdown-timeout", "2s"])
            .args(FAST)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start run"),
    );
    wait_for(
        Duration::from_secs(30),
        "h1 to own every lease while its children keep failing",
        || {
            assert!(
                host.0.try_wait().expect("try_wait").is_none(),
                "run exited: {}",
                read(&stderr)
            );
            let failures = read(&stderr).matches("handler open failed").count();
            (owned_by(&status(&fx.url()), "h1") == 3 && failures >= 6).then_some(())
        },
    );
    let stopping = Instant::now();
    terminate(&host.0);
    let exit = wait_exit(&mut host.0, Duration::from_secs(10));
    let took = stopping.elapsed();
    assert!(exit.success(), "graceful stop: {exit}: {}", read(&stderr));
    // The shutdown timeout (2 s) bounds the stop; the rest is the process's own start-up
    // and exit on a busy machine.
    assert!(took < Duration::from_secs(5), "stopped in {took:?}");
    let s = status(&fx.url());
    let leases = s["leases"].as_array().expect("leases");
    assert_eq!(leases.len(), 3, "{s}");
    for lease in leases {
        assert!(
            lease["owner"].is_null(),
            "a lease left owned after a graceful stop: {lease}"
        );
    }
}
