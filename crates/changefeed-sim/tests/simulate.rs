//! `changefeed simulate`: runs the built `changefeed-sim` (which `changefeed simulate` runs
//! with the same arguments) and checks its summary line, exit status, reproduction lines, SVG
//! timeline and argument errors.

use std::process::{Command, Output};

/// The built simulator.
fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_changefeed-sim"))
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn simulate(args: &[&str]) -> Output {
    bin().args(args).output().expect("run changefeed-sim")
}

/// The summary `RESULT seeds=N violations=V wall_s=S …` (the child-wait fields follow), which
/// must be the last non-empty line of stdout: (seeds, violations, wall seconds).
fn result(stdout: &str) -> (u64, u64, f64) {
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_else(|| panic!("no output on stdout"));
    let parse = || -> Option<(u64, u64, f64)> {
        let rest = last.strip_prefix("RESULT seeds=")?;
        let (seeds, rest) = rest.split_once(" violations=")?;
        let (violations, rest) = rest.split_once(" wall_s=")?;
        let wall = rest.split_whitespace().next()?;
        rest.contains(" child_wait_within_2_acquire=")
            .then_some(())?;
        Some((
            seeds.parse().ok()?,
            violations.parse().ok()?,
            wall.parse().ok()?,
        ))
    };
    parse().unwrap_or_else(|| panic!("last stdout line is not a RESULT line: {last:?}\n{stdout}"))
}

/// The indented violation lines printed right after the line at `index`.
#[cfg(feature = "sim-broken")]
fn violations_after(lines: &[&str], index: usize) -> Vec<String> {
    lines[index + 1..]
        .iter()
        .take_while(|l| l.starts_with("  "))
        .map(|l| l.trim().to_owned())
        .collect()
}

#[test]
fn simulate_healthy_seeds_report_no_violation() {
    let out = simulate(&["--seeds", "5", "--faults", "all"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let (seeds, violations, wall) = result(&stdout);
    assert_eq!((seeds, violations), (5, 0), "{stdout}");
    assert!(wall >= 0.0, "{stdout}");
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    assert!(
        last.is_some_and(|l| l.starts_with("RESULT seeds=5 violations=0 wall_s=")),
        "{stdout}"
    );
    // A healthy run prints no reproduction line and nothing on stderr.
    assert!(
        !stdout.contains("changefeed simulate --seed"),
        "reproduction printed for a healthy run:\n{stdout}"
    );
    assert!(stderr.trim().is_empty(), "stderr: {stderr}");
}

#[cfg(feature = "sim-broken")]
#[test]
fn simulate_broken_no_handler_fence_is_caught_and_its_reproduction_fails_the_same_way() {
    // A handler call not raced against the fence applies records after another host began
    // delivering its partition (a stall or cut-off inside a slow call). Most seeds catch it
    // today; ten leave room if the simulator's random choices change.
    let out = simulate(&[
        "--broken",
        "no-handler-fence",
        "--seeds",
        "10",
        "--faults",
        "all",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "broken run passed:\n{stdout}");
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let (seeds, violations, _) = result(&stdout);
    assert_eq!(seeds, 10, "{stdout}");
    assert!(violations >= 1, "{stdout}");

    // Each failing seed prints its reproduction on stdout (not stderr), then its violations.
    assert!(
        !stderr.contains("changefeed simulate --seed"),
        "reproduction on stderr: {stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let repros: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].starts_with("changefeed simulate --seed"))
        .collect();
    assert_eq!(
        u64::try_from(repros.len()).expect("count"),
        violations,
        "one reproduction per failing seed:\n{stdout}"
    );
    let seeds_in_order: Vec<u64> = repros
        .iter()
        .map(|&i| {
            lines[i]
                .split_whitespace()
                .nth(3)
                .and_then(|s| s.parse().ok())
                .expect("a seed after --seed")
        })
        .collect();
    assert!(
        seeds_in_order.windows(2).all(|w| w[0] < w[1]),
        "failing seeds printed in seed order: {seeds_in_order:?}"
    );
    let first = repros[0];
    let repro = lines[first];
    assert!(repro.contains("--broken no-handler-fence"), "{repro}");
    assert!(repro.contains("--faults all"), "{repro}");
    let expected = violations_after(&lines, first);
    assert!(
        !expected.is_empty(),
        "no violation under {repro}:\n{stdout}"
    );
    assert!(
        stdout.contains("\n  overlap: partition "),
        "caught as an overlap of two owners' calls:\n{stdout}"
    );

    // The reproduction, run as printed, is that one seed with the same violations.
    let args: Vec<&str> = repro.split_whitespace().collect();
    assert_eq!(args[..2], ["changefeed", "simulate"], "{repro}");
    let again = bin().args(&args[2..]).output().expect("run reproduction");
    let (stdout2, stderr2) = text(&again);
    assert_eq!(again.status.code(), Some(1), "{stdout2}\n{stderr2}");
    let (seeds2, violations2, _) = result(&stdout2);
    assert_eq!(seeds2, 1, "{stdout2}");
    assert_eq!(
        usize::try_from(violations2).expect("count"),
        expected.len(),
        "{stdout2}"
    );
    // A single seed prefixes its reproduction with "reproduce: ".
    let lines2: Vec<&str> = stdout2.lines().collect();
    let at = lines2
        .iter()
        .position(|l| l.strip_prefix("reproduce: ") == Some(repro))
        .unwrap_or_else(|| panic!("no `reproduce: {repro}` line:\n{stdout2}"));
    let seed_line = lines2
        .iter()
        .rposition(|l| l.starts_with("seed "))
        .unwrap_or_else(|| panic!("no seed summary line:\n{stdout2}"));
    assert!(seed_line < at, "{stdout2}");
    assert_eq!(
        violations_after(&lines2, seed_line),
        expected,
        "the reproduction found other violations:\n{stdout2}"
    );
}

#[test]
fn simulate_svg_writes_a_timeline() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("t.svg");
    let out = bin()
        .args(["--seed", "0", "--faults", "all", "--svg"])
        .arg(&path)
        .output()
        .expect("run changefeed-sim");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(result(&stdout).0, 1, "{stdout}");
    assert!(
        stdout.contains(&format!("timeline written to {}", path.display())),
        "{stdout}"
    );
    let svg = std::fs::read_to_string(&path).expect("SVG file written");
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "not an SVG: {}",
        &svg[..svg.len().min(200)]
    );
    assert!(svg.trim_end().ends_with("</svg>"), "SVG not closed");
    // The title names the run, so the picture can be reproduced.
    assert!(
        svg.contains("changefeed simulate --seed 0 --faults all"),
        "no reproduction in the title"
    );
}

#[test]
fn simulate_svg_refuses_many_seeds() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("t.svg");
    let out = bin()
        .args(["--seeds", "2", "--svg"])
        .arg(&path)
        .output()
        .expect("run changefeed-sim");
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a usage error, not a violation:\n{stdout}"
    );
    assert!(stderr.contains("--svg"), "stderr: {stderr}");
    assert!(!stdout.contains("RESULT"), "ran anyway:\n{stdout}");
    assert!(!path.exists(), "SVG written for many seeds");
}

#[test]
fn simulate_rejects_unknown_faults() {
    let out = simulate(&["--faults", "nonsense", "--seeds", "2"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a usage error, not a violation:\n{stdout}"
    );
    assert!(stderr.contains("--faults"), "stderr: {stderr}");
    assert!(stderr.contains("nonsense"), "stderr: {stderr}");
    assert!(!stdout.contains("RESULT"), "ran anyway:\n{stdout}");
}

/// Runs `args`, expects a usage error naming `flag` and `value` on stderr, and no run.
fn assert_usage_error(args: &[&str], flag: &str, value: &str) {
    let out = simulate(args);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: a usage error, not a violation or a panic:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("{flag}:")) && stderr.contains(&format!("(got {value})")),
        "{args:?}: stderr does not name {flag} and {value}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(
        !stdout.contains("RESULT"),
        "{args:?}: ran anyway:\n{stdout}"
    );
}

#[test]
fn simulate_rejects_fault_rates_that_are_not_finite_numbers_from_0_to_100() {
    for (rate, shown) in [("200", "200"), ("-1", "-1"), ("NaN", "NaN"), ("inf", "inf")] {
        assert_usage_error(
            &["--fault-rate", rate, "--seeds", "2"],
            "--fault-rate",
            shown,
        );
    }
    assert_usage_error(&["--fault-rate=-0.5"], "--fault-rate", "-0.5");
}

#[test]
fn simulate_rejects_zero_seeds_hosts_or_partitions() {
    assert_usage_error(&["--seeds", "0"], "--seeds", "0");
    assert_usage_error(&["--hosts", "0", "--seeds", "2"], "--hosts", "0");
    assert_usage_error(&["--hosts", "0"], "--hosts", "0");
    assert_usage_error(&["--partitions", "0"], "--partitions", "0");
}

#[test]
fn simulate_help_lists_the_slow_handler_fault_and_broken_variants_only_with_sim_broken() {
    let out = simulate(&["--help"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("slow-handler"), "{stdout}");
    assert_eq!(
        stdout.contains("--broken") && stdout.contains("no-handler-fence"),
        cfg!(feature = "sim-broken"),
        "{stdout}"
    );
}

#[cfg(not(feature = "sim-broken"))]
#[test]
fn simulate_without_sim_broken_refuses_broken_as_an_unknown_option() {
    // The default (and release) build carries no broken processor: `--broken` is not an
    // option of it, a usage error, not a run.
    let out = simulate(&["--broken", "no-fencing", "--seeds", "2"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stderr.contains("--broken"), "stderr: {stderr}");
    assert!(!stdout.contains("RESULT"), "ran anyway:\n{stdout}");
}

/// Each broken variant and a rule the checker catches it by in [`CAUGHT_SEEDS`] (today each
/// variant is caught in two or three of those seeds, which leaves room if the simulator's
/// random choices change).
#[cfg(feature = "sim-broken")]
const BROKEN_CAUGHT: [(&str, &str); 5] = [
    ("no-fencing", "two-deliverers"),
    ("checkpoint-without-cas", "continuation-backwards"),
    ("child-before-parent", "parents-first"),
    ("no-handler-fence", "overlap"),
    // A host whose client hangs every call on a connection a forget cut left dead, and
    // gives the connection back when the call is cancelled, stays up and connected and never
    // heartbeats again.
    ("no-timeouts", "liveness"),
];

/// For each variant, one acceptance seed (`--faults all`, 2 virtual minutes) in which it breaks
/// its rule; the real processor passes every one of them. Variants differ a lot in how often a
/// seed catches them, so no short run of seeds catches them all, and a change to the
/// processor's timing or random choices moves which seeds do: the first seed from 1 that
/// catches each is found with `changefeed simulate --seed N --seeds 1 --faults all --broken V`.
#[cfg(feature = "sim-broken")]
const CAUGHT_SEED: [(&str, &str); 5] = [
    ("no-fencing", "14"),
    ("checkpoint-without-cas", "10"),
    ("child-before-parent", "2"),
    ("no-handler-fence", "1"),
    ("no-timeouts", "9"),
];

#[cfg(feature = "sim-broken")]
#[test]
fn simulate_with_sim_broken_catches_each_broken_variant() {
    // The checker catches every deliberately broken processor (exit 1, each failing seed's
    // rerun line naming the variant, then its violations), where the real processor passes
    // the same seeds.
    for (_, seed) in CAUGHT_SEED {
        let healthy = simulate(&["--seed", seed, "--seeds", "1", "--faults", "all"]);
        let (stdout, stderr) = text(&healthy);
        assert!(healthy.status.success(), "seed {seed}: {stdout}\n{stderr}");
    }
    for (variant, rule) in BROKEN_CAUGHT {
        let seed = CAUGHT_SEED
            .iter()
            .find(|(v, _)| *v == variant)
            .map(|(_, s)| *s)
            .expect("every variant has its seed");
        let out = simulate(&[
            "--seed", seed, "--seeds", "1", "--faults", "all", "--broken", variant,
        ]);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{variant} not caught:\n{stdout}\n{stderr}"
        );
        assert!(result(&stdout).1 >= 1, "{variant}:\n{stdout}");
        assert!(
            stdout.contains(&format!(" --broken {variant}\n")),
            "{variant}: no rerun line naming it:\n{stdout}"
        );
        assert!(
            stdout.contains(&format!("\n  {rule}: ")),
            "{variant}: not caught as {rule}:\n{stdout}"
        );
    }
}
