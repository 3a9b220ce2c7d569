//! What the `changefeed` binary links: the core without the simulator, the test kit or the
//! broken variants, and tokio without `test-util` (its paused clock). `changefeed simulate`
//! runs the separate `changefeed-sim` for that.
//!
//! Read from Cargo's own resolution of this package alone (`cargo tree`), which is what
//! `cargo build -p changefeed-cli` and `cargo install` build.

use std::process::Command;

#[test]
fn the_binary_builds_the_core_without_the_simulator_and_tokio_without_test_util() {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-e",
            "features",
            "-p",
            "changefeed-cli",
            "--edges",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        tree.contains("changefeed feature \"default\"") && tree.contains("tokio feature \"rt\""),
        "not a feature tree of the binary:\n{tree}"
    );
    for feature in [
        "tokio feature \"test-util\"",
        "changefeed feature \"sim\"",
        "changefeed feature \"sim-broken\"",
        "changefeed feature \"testkit\"",
    ] {
        assert!(
            !tree.contains(feature),
            "the changefeed binary links {feature}:\n{tree}"
        );
    }
}
