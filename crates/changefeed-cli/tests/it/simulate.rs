//! `changefeed simulate` runs the simulator's own executable, `changefeed-sim`, with the same
//! arguments: its output and exit status are the command's, and without it the command says
//! what is missing. (The simulator's flags, checks and timeline are tested with it, in
//! `crates/changefeed-sim`.)

use std::process::Output;

use crate::support::{bin_at, bin_with_simulator, text};

fn simulate(args: &[&str]) -> Output {
    bin_with_simulator()
        .arg("simulate")
        .args(args)
        .output()
        .expect("run changefeed simulate")
}

#[test]
fn simulate_runs_the_simulator_with_the_same_arguments() {
    let out = simulate(&["--seeds", "2", "--faults", "all", "--duration", "30s"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    assert!(
        last.is_some_and(|l| l.starts_with("RESULT seeds=2 violations=0 wall_s=")),
        "{stdout}"
    );
    assert!(stderr.trim().is_empty(), "stderr: {stderr}");
}

#[test]
fn simulate_passes_the_simulator_usage_errors_and_exit_status_through() {
    let out = simulate(&["--hosts", "0"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("--hosts:") && stderr.contains("(got 0)"),
        "stderr: {stderr}"
    );
    assert!(!stdout.contains("RESULT"), "ran anyway:\n{stdout}");

    let out = simulate(&["--no-such-flag"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stderr.contains("--no-such-flag"), "stderr: {stderr}");
}

#[test]
fn simulate_help_is_the_simulator_help() {
    let out = simulate(&["--help"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for flag in [
        "--seeds",
        "--fault-rate",
        "--svg",
        "--large",
        "slow-handler",
    ] {
        assert!(stdout.contains(flag), "no {flag}:\n{stdout}");
    }
    assert!(
        stdout.contains("Usage: changefeed simulate"),
        "usage named as users run it:\n{stdout}"
    );
}

#[test]
fn simulate_without_the_simulator_names_it_and_runs_nothing() {
    // A `changefeed` alone in a directory, with nothing on PATH: as installed from the pip
    // wheel, which carries only `changefeed`.
    let alone = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temporary directory");
    let copy = alone
        .path()
        .join(format!("changefeed{}", std::env::consts::EXE_SUFFIX));
    let built = env!("CARGO_BIN_EXE_changefeed");
    if std::fs::hard_link(built, &copy).is_err() {
        std::fs::copy(built, &copy).expect("copy the binary");
    }
    let empty = tempfile::tempdir().expect("temporary directory");
    let out = bin_at(&copy)
        .env("PATH", empty.path())
        .args(["simulate", "--seeds", "2"])
        .output()
        .expect("run changefeed simulate");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("`changefeed-sim`")
            && stderr.contains("cargo build --release -p changefeed-sim"),
        "stderr: {stderr}"
    );
    assert!(!stdout.contains("RESULT"), "ran anyway:\n{stdout}");
}
