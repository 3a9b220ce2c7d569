//! The fence covers the batch in flight, with real `changefeed run` processes and
//! shell handlers that are slow or hang.
//!
//! - A host frozen (SIGSTOP) while writing a batch larger than the pipe buffer into its slow
//!   handler, and woken (SIGCONT) after the other host took the partition and delivered from
//!   it, must kill its handler before it reads the rest: on SQLite and on PostgreSQL.
//! - A host whose handler hangs stops within `shutdown_timeout` on SIGTERM (exit 0), kills the
//!   handler's whole process group, releases its lease and removes its heartbeat.
//! - A second signal kills every handler process group and exits at once (exit 1).
//!
//! Handlers stamp their ledger lines with this machine's clock (`date +%s%3N`), one `echo`
//! (one O_APPEND write) per line. The only real-time waits that are not bounded polls are the
//! freeze itself (14 s, the scenario) and nothing else.

use changefeed::lease::MembershipStore;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use changefeed::model::{GroupName, HostName, PartitionId};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

use crate::postgres::{drop_tables, raw_client, source_url, store_url, unique_prefix};
use crate::support::{bin, read, rt, text, wait_for, Fixture};

/// The issue's timings: expiry 6 s (fence after 4 s), batches of 40 records of ~4 KB.
const SLOW_TIMINGS: &[&str] = &[
    "--lease-expiry",
    "6s",
    "--safety-margin",
    "2s",
    "--renew-interval",
    "1s",
    "--acquire-interval",
    "500ms",
    "--sync-interval",
    "1s",
    "--poll-delay",
    "100ms",
    "--max-batch-size",
    "40",
    "--shutdown-timeout",
    "4s",
    "--handler-max-retries",
    "1000",
];
const MAX_BATCH: usize = 40;
/// Six batches: the new owner is still delivering when the frozen host wakes.
const RECORDS: usize = 240;
/// About 4 KB per record: one batch (~160 KB) does not fit the 64 KB pipe buffer.
const PAD: usize = 4000;
const FREEZE: Duration = Duration::from_secs(14);

/// A host process (in a process group of its own, so that cleanup reaches it) and its log.
struct Host {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Host {
    fn start(dir: &Path, name: &str, args: &[&str]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = bin()
            .arg("run")
            .args(args)
            .args(["--group", "g", "--host", name])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .process_group(0)
            .spawn()
            .expect("start changefeed run");
        Self {
            name: name.to_string(),
            child,
            log,
        }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid"))
    }

    /// Signals the host process only (not its process group).
    fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).unwrap_or_else(|e| panic!("{signal} to {}: {e}", self.name));
    }

    fn log_tail(&self) -> String {
        let text = read(&self.log);
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- {} ({}):\n{}",
            self.name,
            self.log.display(),
            lines[lines.len().saturating_sub(25)..].join("\n")
        )
    }

    /// Waits (bounded) for the host to exit; returns its status and how long it took.
    fn wait_exit(&mut self, limit: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        let deadline = started + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return (status, started.elapsed());
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {limit:?}\n{}",
                self.name,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Kills every host and every process group the handlers recorded, whatever the test's end.
struct Cleanup {
    hosts: Vec<Host>,
    /// The pids the handlers recorded so far.
    handler_pids: Box<dyn Fn() -> Vec<i32>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for host in &mut self.hosts {
            let _ = killpg(host.pid(), Signal::SIGCONT);
            let _ = killpg(host.pid(), Signal::SIGKILL);
            let _ = host.child.wait();
        }
        let own = pgrp_of(i32::try_from(std::process::id()).unwrap_or(0));
        for pid in (self.handler_pids)().into_iter().filter(|p| *p > 1) {
            match pgrp_of(pid) {
                Some(pgid) if Some(pgid) != own && pgid > 1 => {
                    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                }
                _ => {}
            }
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// The pids in `text`, one per line.
fn pids_in(text: &str) -> Vec<i32> {
    text.split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// `/proc/PID/stat` after the command name: state, ppid, pgrp, ….
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// Whether `pid` is a live process: present and not a zombie.
fn alive(pid: i32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().map(String::as_str) != Some("Z"))
}

fn pgrp_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// Live (non-zombie) processes of process group `pgid`.
fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| alive(*pid) && pgrp_of(*pid) == Some(pgid))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The frozen host and the slow handler.

/// A handler call's start line: `start ID HOST PID PARTITION RECORDS TOKEN START_MS`.
#[derive(Debug, Clone)]
struct Call {
    id: String,
    host: String,
    pid: i32,
    partition: String,
    token: u64,
    start: i64,
}

/// A delivered batch: `done ID HOST PID PARTITION RECORDS TOKEN READ START_MS END_MS`, and the
/// sequence numbers of the records the handler read (from its saved input).
#[derive(Debug, Clone)]
struct Done {
    id: String,
    host: String,
    partition: String,
    records: usize,
    token: u64,
    read: usize,
    start: i64,
    end: i64,
    seqs: Vec<u64>,
}

/// Writes the slow handler: a start line, 3 s of sleep, all of stdin to a file, then one
/// delivered line. Returns the `--handler` command.
fn slow_handler(dir: &Path, ledger: &Path) -> String {
    let script = dir.join("slow-handler.sh");
    let inputs = dir.join("inputs");
    std::fs::create_dir_all(&inputs).expect("inputs directory");
    let text = format!(
        r#"#!/bin/sh
id="$CHANGEFEED_HOST.$$.$(date +%s%N)"
start=$(date +%s%3N)
echo "start $id $CHANGEFEED_HOST $$ $CHANGEFEED_PARTITION $CHANGEFEED_RECORDS $CHANGEFEED_FENCING_TOKEN $start" >> '{ledger}'
sleep 3
cat > '{inputs}'/"$id.jsonl" || exit 1
n=$(wc -l < '{inputs}'/"$id.jsonl")
echo "done $id $CHANGEFEED_HOST $$ $CHANGEFEED_PARTITION $CHANGEFEED_RECORDS $CHANGEFEED_FENCING_TOKEN $n $start $(date +%s%3N)" >> '{ledger}'
"#,
        ledger = ledger.display(),
        inputs = inputs.display(),
    );
    std::fs::write(&script, text).expect("write the handler");
    format!("sh '{}'", script.display())
}

fn calls(ledger: &Path) -> Vec<Call> {
    read(ledger)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&"start") && f.len() == 8).then(|| Call {
                id: f[1].into(),
                host: f[2].into(),
                pid: f[3].parse().expect("pid"),
                partition: f[4].into(),
                token: f[6].parse().expect("fencing token"),
                start: f[7].parse().expect("start"),
            })
        })
        .collect()
}

fn dones(dir: &Path, ledger: &Path) -> Vec<Done> {
    read(ledger)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&"done") && f.len() == 10).then(|| {
                let input = read(&dir.join("inputs").join(format!("{}.jsonl", f[1])));
                let seqs = input
                    .lines()
                    .map(|line| {
                        let v: Value = serde_json::from_str(line).expect("a JSON line");
                        let data = v["data"].as_str().expect("text data");
                        let (_, seq) = data.rsplit_once('-').expect("PAD-SEQ");
                        seq.parse().expect("a sequence number")
                    })
                    .collect();
                Done {
                    id: f[1].into(),
                    host: f[2].into(),
                    partition: f[4].into(),
                    records: f[5].parse().expect("records"),
                    token: f[6].parse().expect("fencing token"),
                    read: f[7].parse().expect("read"),
                    start: f[8].parse().expect("start"),
                    end: f[9].parse().expect("end"),
                    seqs,
                }
            })
        })
        .collect()
}

/// The records' payloads: `PAD-SEQ`, PAD about 4 KB.
fn pad() -> String {
    "x".repeat(PAD)
}

/// Two hosts, one partition of `RECORDS` records already written; the handler sleeps 3 s
/// before reading its batch. SIGSTOP the host whose handler starts first, for 14 s, then
/// SIGCONT, and check the ledger.
fn frozen_host_never_finishes_its_cut_batch(store: &str, source: &str, dir: &Path) {
    let ledger = dir.join("ledger");
    let handler = slow_handler(dir, &ledger);
    let args: Vec<&str> = ["--store", store, "--source", source, "--handler", &handler]
        .into_iter()
        .chain(SLOW_TIMINGS.iter().copied())
        .collect();
    let mut fleet = Cleanup {
        hosts: vec![Host::start(dir, "h1", &args), Host::start(dir, "h2", &args)],
        handler_pids: {
            let ledger = ledger.clone();
            Box::new(move || calls(&ledger).iter().map(|c| c.pid).collect())
        },
    };
    let logs = |fleet: &Cleanup| {
        let mut out = format!("ledger:\n{}", read(&ledger));
        for h in &fleet.hosts {
            out.push('\n');
            out.push_str(&h.log_tail());
        }
        out
    };

    // The first call: its host is writing ~160 KB into a pipe its handler does not read yet.
    let cut = wait_for(Duration::from_secs(30), "a first handler call", || {
        calls(&ledger).into_iter().next()
    });
    let victim = fleet
        .hosts
        .iter()
        .position(|h| h.name == cut.host)
        .expect("a known host");
    let other = 1 - victim;
    let other_name = fleet.hosts[other].name.clone();
    fleet.hosts[victim].signal(Signal::SIGSTOP);
    let stopped_at = Instant::now();
    eprintln!(
        "fence: SIGSTOP {} during call {} (pid {})",
        cut.host, cut.id, cut.pid
    );
    // The other host takes the partition after the expiry and delivers while the first sleeps.
    wait_for(FREEZE, "the other host to deliver a batch", || {
        dones(dir, &ledger)
            .into_iter()
            .any(|d| d.host == other_name)
            .then_some(())
    });
    std::thread::sleep(FREEZE.saturating_sub(stopped_at.elapsed()));
    fleet.hosts[victim].signal(Signal::SIGCONT);
    eprintln!("fence: SIGCONT {}", cut.host);
    // Woken, the frozen host is fenced: it kills the handler before it could read the rest.
    wait_for(
        Duration::from_secs(5),
        "the cut handler to be killed",
        || (!alive(cut.pid)).then_some(()),
    );
    wait_for(Duration::from_secs(60), "every record delivered", || {
        let seen: BTreeSet<u64> = dones(dir, &ledger)
            .iter()
            .flat_map(|d| d.seqs.iter().copied())
            .collect();
        (seen.len() == RECORDS).then_some(())
    });
    for h in &fleet.hosts {
        h.signal(Signal::SIGTERM);
    }
    for h in &mut fleet.hosts {
        let (status, _) = h.wait_exit(Duration::from_secs(15));
        assert!(
            status.success(),
            "{} exits 0 after SIGTERM: {status}",
            h.name
        );
    }

    let report = logs(&fleet);
    let calls = calls(&ledger);
    let mut dones = dones(dir, &ledger);
    dones.sort_by_key(|d| (d.end, d.start));
    eprintln!("fence: {report}");
    // The cut-short call never delivered, and nothing delivered a partial batch.
    assert!(
        dones.iter().all(|d| d.id != cut.id),
        "the frozen host's cut-short call {} reached the ledger\n{report}",
        cut.id
    );
    for d in &dones {
        assert!(
            d.read == d.records && d.seqs.len() == d.records && d.records <= MAX_BATCH,
            "call {} delivered {} of {} records\n{report}",
            d.id,
            d.read,
            d.records
        );
    }
    // No two hosts' deliveries of one partition overlap in time.
    for a in &dones {
        for b in &dones {
            if a.partition == b.partition && a.host != b.host {
                assert!(
                    a.end < b.start || b.end < a.start,
                    "{} delivered {} over [{}, {}] and {} delivered {} over [{}, {}]: they overlap\n{report}",
                    a.host,
                    a.partition,
                    a.start,
                    a.end,
                    b.host,
                    b.partition,
                    b.start,
                    b.end
                );
            }
        }
    }
    // Nothing lost; duplicates only in the first batch after an ownership change; fencing
    // tokens never go down, and go up when the owner changes.
    let mut seen: BTreeSet<u64> = BTreeSet::new();
    let mut last: BTreeMap<&str, (&str, u64)> = BTreeMap::new();
    let mut changes = 0;
    for d in &dones {
        let previous = last.insert(&d.partition, (&d.host, d.token));
        let new_run = previous.is_none_or(|(h, _)| h != d.host);
        if let Some((h, token)) = previous {
            if h != d.host {
                changes += 1;
                assert!(
                    d.token > token,
                    "{} after {h}: token {} not above {token}\n{report}",
                    d.host,
                    d.token
                );
            } else {
                assert_eq!(d.token, token, "one tenure, one token\n{report}");
            }
        }
        let dups = d.seqs.iter().filter(|s| !seen.insert(**s)).count();
        assert!(
            dups == 0 || new_run,
            "call {} re-delivered {dups} records without an ownership change\n{report}",
            d.id
        );
    }
    assert_eq!(
        seen,
        (0..RECORDS as u64).collect::<BTreeSet<_>>(),
        "every record delivered\n{report}"
    );
    let other_first = dones
        .iter()
        .find(|d| d.host == other_name && d.partition == cut.partition)
        .expect("the other host delivered the frozen host's partition");
    assert!(
        other_first.token > cut.token,
        "the new owner's token {} is above the frozen host's {}\n{report}",
        other_first.token,
        cut.token
    );
    let cut_calls = calls.iter().filter(|c| c.host == cut.host).count();
    eprintln!(
        "fence: {} batches delivered, {changes} ownership changes, {} calls of the frozen host; \
         its cut call started at {}, the new owner's first batch ran [{}, {}]",
        dones.len(),
        cut_calls,
        cut.start,
        other_first.start,
        other_first.end
    );
}

#[test]
fn frozen_host_kills_its_slow_handler_before_it_reads_the_rest_sqlite() {
    // A host woken after its lease was taken must not finish the batch in flight.
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        let pad = pad();
        for i in 0..RECORDS {
            feed.append_to(&p, "k", format!("{pad}-{i}"))
                .await
                .expect("append");
        }
    });
    frozen_host_never_finishes_its_cut_batch(&fx.url(), &fx.url(), fx.dir.path());
}

#[test]
fn frozen_host_kills_its_slow_handler_before_it_reads_the_rest_postgres() {
    // On PostgreSQL (leases and outbox): the same rule, another store.
    let prefix = unique_prefix("fence");
    rt().block_on(raw_client());
    let (store, source) = (store_url(&prefix), source_url(&prefix));
    let out = bin()
        .args(["outbox", "--source", &source, "create", "--partitions", "1"])
        .output()
        .expect("outbox create");
    assert!(out.status.success(), "{:?}", text(&out));
    let out = bin()
        .args(["outbox", "--source", &source, "append", "--key", "k"])
        .args(["--data", &pad(), "--count", &RECORDS.to_string()])
        .output()
        .expect("outbox append");
    assert!(out.status.success(), "{:?}", text(&out));
    let dir = tempfile::tempdir().expect("temporary directory");
    frozen_host_never_finishes_its_cut_batch(&store, &source, dir.path());
    rt().block_on(drop_tables(&prefix));
}

// ---------------------------------------------------------------------------------------------
// The hung handler.

const HUNG_TIMINGS: &[&str] = &[
    "--renew-interval",
    "500ms",
    "--safety-margin",
    "2s",
    "--acquire-interval",
    "200ms",
    "--poll-delay",
    "50ms",
    "--handler-max-retries",
    "1000",
];

/// A one-partition SQLite feed with a few records, one host whose handler reads its batch and
/// then hangs in `sleep` with a backgrounded `sleep` grandchild; waits until both pids are
/// recorded. Returns the fixture, the host and the handler's pids.
fn hung_host(lease_expiry: &str, shutdown_timeout: &str) -> (Fixture, Cleanup, Vec<i32>) {
    let fx = Fixture::new();
    fx.with_feed(async |feed| {
        feed.create_partitions(1).await.expect("partitions");
        let p = PartitionId::new("0").expect("id");
        for i in 0..3 {
            feed.append_to(&p, "k", format!("r{i}"))
                .await
                .expect("append");
        }
    });
    let pids = fx.path("pids");
    let handler = format!(
        "echo $$ >> '{p}'; cat > /dev/null; sleep 1000 & echo $! >> '{p}'; sleep 1000",
        p = pids.display()
    );
    let url = fx.url();
    let mut args = vec!["--store", &url, "--source", &url, "--handler", &handler];
    args.extend([
        "--lease-expiry",
        lease_expiry,
        "--shutdown-timeout",
        shutdown_timeout,
    ]);
    args.extend(HUNG_TIMINGS);
    let host = Host::start(fx.dir.path(), "h1", &args);
    let cleanup = Cleanup {
        hosts: vec![host],
        handler_pids: {
            let pids = pids.clone();
            Box::new(move || pids_in(&read(&pids)))
        },
    };
    let recorded = wait_for(Duration::from_secs(30), "the handler's two pids", || {
        let p = pids_in(&read(&pids));
        (p.len() >= 2 && p.iter().all(|pid| alive(*pid))).then_some(p)
    });
    (fx, cleanup, recorded)
}

/// Fails unless every recorded pid, and every process of their groups, is gone within 2 s
/// (SIGKILL is asynchronous: the kernel may still be tearing a process down).
fn assert_no_handler_process(pids: &[i32], groups: &[i32], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let left: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|p| alive(*p))
            .chain(groups.iter().flat_map(|g| group_members(*g)))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: handler processes {left:?} survived (recorded {pids:?}, groups {groups:?})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_with_a_hung_handler_stops_within_shutdown_timeout_and_kills_its_process_group() {
    // A stop is bounded by shutdown_timeout; the hung command and its grandchild are
    // killed; the lease is released and the heartbeat removed (a graceful stop, exit 0).
    let (fx, mut cleanup, pids) = hung_host("6s", "4s");
    let groups: Vec<i32> = pids.iter().filter_map(|p| pgrp_of(*p)).collect();
    assert!(
        groups.iter().all(|g| *g != cleanup.hosts[0].pid().as_raw()),
        "the handler runs in a process group of its own, not the host's: {groups:?}"
    );
    cleanup.hosts[0].signal(Signal::SIGTERM);
    let (status, took) = cleanup.hosts[0].wait_exit(Duration::from_secs(4 + 3));
    assert!(
        status.success(),
        "a bounded graceful stop exits 0: {status}\n{}",
        cleanup.hosts[0].log_tail()
    );
    eprintln!("fence: stopped in {took:?}");
    assert_no_handler_process(&pids, &groups, "after a graceful stop");
    let lease = fx.lease("g", "0").expect("lease");
    assert_eq!(lease.owner, None, "the stop released the lease: {lease:?}");
    let group = GroupName::new("g").expect("group");
    let hosts = fx.with_store(async |s| s.membership(&group).await.expect("membership").hosts);
    assert!(hosts.is_empty(), "the heartbeat row is removed: {hosts:?}");
}

#[test]
fn second_signal_kills_the_handler_process_groups_and_exits_at_once() {
    // A second SIGTERM exits with 1 at once, leaving no handler process behind (the
    // lease stays owned until it expires).
    let (fx, mut cleanup, pids) = hung_host("10s", "10s");
    let groups: Vec<i32> = pids.iter().filter_map(|p| pgrp_of(*p)).collect();
    cleanup.hosts[0].signal(Signal::SIGTERM);
    let log = cleanup.hosts[0].log.clone();
    wait_for(
        Duration::from_secs(5),
        "the first SIGTERM to be seen",
        || {
            read(&log)
                .contains("SIGTERM: stopping gracefully")
                .then_some(())
        },
    );
    // The batch in flight has 5 s of grace: only the second signal can end it this soon.
    cleanup.hosts[0].signal(Signal::SIGTERM);
    let (status, took) = cleanup.hosts[0].wait_exit(Duration::from_secs(2));
    assert_eq!(
        status.code(),
        Some(1),
        "{status}\n{}",
        cleanup.hosts[0].log_tail()
    );
    eprintln!("fence: exited {took:?} after the second signal");
    assert_no_handler_process(&pids, &groups, "after a second signal");
    let lease = fx.lease("g", "0").expect("lease");
    assert_eq!(
        lease.owner,
        Some(HostName::new("h1").expect("host")),
        "a second signal does not release"
    );
}
