//! A real failure test: four `changefeed run` processes share one PostgreSQL (leases and an
//! outbox), a shell handler records every delivery in a ledger table with `psql`, and the test
//! kills (SIGKILL), pauses (SIGSTOP past the lease expiry, then SIGCONT), restarts and finally
//! cuts one host off from the lease store with a loopback TCP proxy that stops forwarding.
//!
//! At the end the ledger must show every record delivered, each key's first deliveries in
//! order, duplicates only at the start of an ownership run (at most one batch each), and the
//! cut-off host's last delivery before any other host's first delivery of its partitions
//! (design rules 1, 3 and 4). Every delivery is stamped by the handler with this machine's
//! clock (`date +%s%3N`), the same clock the test reads, so the comparison needs no clock
//! agreement. The cut-off host still reaches the outbox and the ledger directly: only its
//! lease store goes through the proxy, so nothing but its own fencing stops it delivering.
//!
//! The waits poll the lease table and the ledger with deadlines; only lease expiry itself
//! (3 s here) is waited for in real time, as it must be with real processes and a real server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, LeaseState};
use changefeed::source::{key_hash, split_key_space};
use changefeed_postgres::{append, OutboxTable, PgOptions, PostgresLeaseStore};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::postgres::{drop_tables, pg_url, raw_client, source_url, store_url, unique_prefix};
use crate::support::bin;

const PARTITIONS: u32 = 8;
const KEYS_PER_PARTITION: usize = 3;
const MAX_BATCH: usize = 50;
const LEASE_EXPIRY_MS: i64 = 3000;
const FENCE_AFTER_MS: i64 = 2000; // lease_expiry − safety_margin
const GROUP: &str = "g";
/// The cut-off host's checkpoint mode (see where it starts).
const H3_CHECKPOINT: &[&str] = &["--checkpoint", "interval:8s"];

/// Short timings: expiry 3 s, fence after 2 s, heartbeat every 0.5 s, balance every 1 s.
const TIMINGS: &[&str] = &[
    "--lease-expiry",
    "3s",
    "--safety-margin",
    "1s",
    "--renew-interval",
    "500ms",
    "--acquire-interval",
    "1s",
    "--sync-interval",
    "2s",
    "--poll-delay",
    "200ms",
    "--max-batch-size",
    "50",
    "--handler-max-retries",
    "1000",
];

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis(),
    )
    .expect("fits")
}

/// A loopback TCP proxy to the server whose switch stops forwarding: existing connections
/// hang (nothing is passed on, nothing is closed) and new ones are accepted but get no reply.
/// (`health.rs` cuts a host off with it too.)
pub(crate) struct Proxy {
    pub(crate) port: u16,
    cut: watch::Sender<bool>,
}

impl Proxy {
    pub(crate) async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (cut, _) = watch::channel(false);
        let cut_rx = cut.subscribe();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let cut = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(pump(ri, wo, cut.clone()), pump(ro, wi, cut));
                });
            }
        });
        Self { port, cut }
    }

    pub(crate) fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// Copies `from` to `to` while the switch is on; while it is off, holds the bytes (and the
/// connection) without passing anything on.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if cut.wait_for(|c| !*c).await.is_err() {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.wait_for(|c| *c) => continue,
        };
        if cut.wait_for(|c| !*c).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// `url` with its host and port replaced by the proxy's; also returns the upstream
/// `host:port` the proxy forwards to.
pub(crate) fn via_proxy(url: &str, proxy_port: u16) -> (String, String) {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let upstream = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5432")
    };
    (
        format!("{scheme}://{userinfo}127.0.0.1:{proxy_port}{tail}"),
        upstream,
    )
}

/// The `run` processes, each in its own process group so that SIGKILL and SIGSTOP reach its
/// handler commands too (as a crashed or frozen machine would). Dropping kills them all.
struct Fleet {
    dir: PathBuf,
    handler: String,
    source: String,
    children: BTreeMap<String, Child>,
}

impl Fleet {
    fn start(&mut self, name: &str, store: &str, extra: &[&str]) {
        let log = std::fs::File::create(self.log(name)).expect("log file");
        let child = bin()
            .args(["run", "--store", store, "--source", &self.source])
            .args(["--group", GROUP, "--host", name, "--handler", &self.handler])
            .args(TIMINGS)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start changefeed run");
        self.children.insert(name.to_string(), child);
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    fn signal(&self, name: &str, signal: Signal) {
        let child = &self.children[name];
        let pgid = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        killpg(pgid, signal).unwrap_or_else(|e| panic!("{signal} to {name}: {e}"));
    }

    fn kill(&mut self, name: &str) {
        self.signal(name, Signal::SIGKILL);
        let mut child = self.children.remove(name).expect("a running host");
        child.wait().expect("reap");
    }

    /// The last lines of every host's log, for a failure message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for name in self.children.keys() {
            let text = std::fs::read_to_string(self.log(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(15)..];
            out.push_str(&format!(
                "--- {name} ({}):\n{}\n",
                self.log(name).display(),
                tail.join("\n")
            ));
        }
        out
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, child) in self.children.iter_mut() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGCONT);
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// One delivery as the handler recorded it.
#[derive(Debug, Clone)]
struct Delivery {
    id: i64,
    host: String,
    partition: String,
    key: String,
    seq: i64,
    at_ms: i64,
}

/// The handler: the batch's JSON lines become one INSERT, stamped with this machine's clock.
fn handler_script(dir: &Path, url: &str, ledger: &str) -> String {
    let script = dir.join("handler.sh");
    let text = format!(
        r#"#!/bin/sh
# One batch of JSON lines on stdin -> one INSERT of (host, partition, key, seq, at_ms).
batch=$(cat)
at=$(date +%s%3N)
exec psql '{url}' -X -q -v ON_ERROR_STOP=1 -v batch="$batch" -v host="$CHANGEFEED_HOST" -v at="$at" <<'SQL'
INSERT INTO {ledger} (host, partition, key, seq, at_ms)
SELECT :'host', r->>'partition', r->>'key', (r->>'data')::bigint, :at
FROM regexp_split_to_table(:'batch', E'\n') WITH ORDINALITY AS t(line, n),
     LATERAL (SELECT line::jsonb AS r) AS j
WHERE line <> ''
ORDER BY n;
SQL
"#
    );
    std::fs::write(&script, text).expect("write handler");
    format!("sh '{}'", script.display())
}

/// Keys chosen so that every partition gets `KEYS_PER_PARTITION` of them.
fn keys() -> Vec<String> {
    let ranges = split_key_space(PARTITIONS);
    let mut per: Vec<Vec<String>> = vec![Vec::new(); ranges.len()];
    for i in 0.. {
        let key = format!("k{i}");
        let h = key_hash(&key);
        let slot = ranges
            .iter()
            .position(|r| r.start <= h && h <= r.end)
            .expect("the ranges cover the key space");
        if per[slot].len() < KEYS_PER_PARTITION {
            per[slot].push(key);
        }
        if per.iter().all(|p| p.len() == KEYS_PER_PARTITION) {
            break;
        }
    }
    per.into_iter().flatten().collect()
}

/// Test state: the fleet, the store (read directly), the ledger, and a timeline for messages.
struct Scenario {
    fleet: Fleet,
    store: PostgresLeaseStore,
    group: GroupName,
    ledger: String,
    client: tokio_postgres::Client,
    started: Instant,
    timeline: Vec<String>,
}

impl Scenario {
    fn note(&mut self, what: impl Into<String>) {
        let line = format!(
            "{:>6.2}s {}",
            self.started.elapsed().as_secs_f64(),
            what.into()
        );
        eprintln!("pg_failure: {line}");
        self.timeline.push(line);
    }

    /// Partition → owner of every owned lease.
    async fn owners(&self) -> BTreeMap<String, String> {
        let listing = self.store.list(&self.group).await.expect("list leases");
        listing
            .leases
            .iter()
            .filter(|l| l.state == LeaseState::Owned)
            .filter_map(|l| Some((l.key.partition.to_string(), l.owner.as_ref()?.to_string())))
            .collect()
    }

    async fn deliveries(&self) -> Vec<Delivery> {
        self.client
            .query(
                &format!(
                    "SELECT id, host, partition, key, seq, at_ms FROM {} ORDER BY id",
                    self.ledger
                ),
                &[],
            )
            .await
            .expect("read the ledger")
            .iter()
            .map(|r| Delivery {
                id: r.get(0),
                host: r.get(1),
                partition: r.get(2),
                key: r.get(3),
                seq: r.get(4),
                at_ms: r.get(5),
            })
            .collect()
    }

    /// Polls `check` every 100 ms until it returns `Some`; fails after `limit` with the
    /// timeline and the hosts' logs.
    async fn until<T>(
        &mut self,
        limit: Duration,
        what: &str,
        mut check: impl AsyncFnMut(&Self) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check(self).await {
                self.note(format!("ok: {what}"));
                return v;
            }
            if Instant::now() >= deadline {
                panic!(
                    "timed out after {limit:?} waiting for {what}\nowners: {:?}\ntimeline:\n{}\n{}",
                    self.owners().await,
                    self.timeline.join("\n"),
                    self.fleet.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until all partitions are owned, by running hosts only, and every host in
    /// `hosts` owns at least one.
    async fn settled(&mut self, hosts: &[&str], what: &str) -> BTreeMap<String, String> {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        self.until(Duration::from_secs(40), what, async |s| {
            let owners = s.owners().await;
            let all = owners.len() == PARTITIONS as usize
                && owners.values().all(|o| hosts.contains(o))
                && hosts.iter().all(|h| owners.values().any(|o| o == h));
            all.then_some(owners)
        })
        .await
    }
}

/// Appends round-robin over `keys`, one record per transaction through the library's
/// [`append`] (as an application would), until `stop`; returns how many records each key got.
async fn writer(prefix: String, keys: Vec<String>, stop: Arc<AtomicBool>) -> HashMap<String, i64> {
    let table = OutboxTable::new(&prefix).expect("outbox table");
    let mut client = raw_client().await;
    let mut next: HashMap<String, i64> = keys.iter().map(|k| (k.clone(), 0)).collect();
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let key = &keys[i % keys.len()];
        let seq = next[key];
        let tx = client.transaction().await.expect("begin");
        append(&tx, &table, key, seq.to_string().as_bytes())
            .await
            .expect("append");
        tx.commit().await.expect("commit");
        next.insert(key.clone(), seq + 1);
        i += 1;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    next
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_survives_kill_pause_restart_and_a_cut_off_host_fences_before_takeover() {
    // DESIGN rules 1, 3, 4 with real processes: at least once, in order, duplicates only
    // after an ownership change, and a host cut off from the store stops before a peer starts.
    let prefix = unique_prefix("pgf");
    let url = pg_url();
    let client = raw_client().await;
    let ledger = format!("\"{prefix}_ledger\"");
    client
        .batch_execute(&format!(
            "CREATE TABLE {ledger} (id bigserial PRIMARY KEY, host text NOT NULL, \
             partition text NOT NULL, key text NOT NULL, seq bigint NOT NULL, at_ms bigint NOT NULL)"
        ))
        .await
        .expect("create the ledger");
    let source = source_url(&prefix);
    let out = bin()
        .args(["outbox", "--source", &source, "create", "--partitions"])
        .arg(PARTITIONS.to_string())
        .output()
        .expect("outbox create");
    assert!(out.status.success(), "{:?}", crate::support::text(&out));

    let dir = tempfile::tempdir().expect("temporary directory");
    let store = store_url(&prefix);
    let proxy = Proxy::start(via_proxy(&url, 0).1).await;
    let (proxied_store, _) = via_proxy(&store, proxy.port);
    let fleet = Fleet {
        dir: dir.path().to_path_buf(),
        handler: handler_script(dir.path(), &url, &ledger),
        source,
        children: BTreeMap::new(),
    };
    let lease_store = PostgresLeaseStore::connect_with(
        PgOptions::new(url.clone())
            .prefix(prefix.clone())
            .pool_size(2),
    )
    .await
    .expect("connect the lease store");
    let mut s = Scenario {
        fleet,
        store: lease_store,
        group: GroupName::new(GROUP).expect("group"),
        ledger: ledger.clone(),
        client,
        started: Instant::now(),
        timeline: Vec::new(),
    };

    let stop = Arc::new(AtomicBool::new(false));
    let writing = tokio::spawn(writer(prefix.clone(), keys(), stop.clone()));
    for h in ["h0", "h1", "h2"] {
        s.fleet.start(h, &store, &[]);
    }
    // h3 reaches the lease store only through the proxy; the outbox and ledger directly. It
    // checkpoints every 8 s rather than every batch, so that once cut off it goes on reading
    // and delivering (no checkpoint write to hang on) until its fence stops it: without the
    // fence it would overlap with the new owner. (At ~3 records/s per partition, 8 s of
    // records still fit in one batch of duplicates.)
    s.fleet.start("h3", &proxied_store, H3_CHECKPOINT);
    s.settled(&["h0", "h1", "h2", "h3"], "4 hosts share the 8 leases")
        .await;

    // A crash: SIGKILL h0 (and its handler), its leases are taken after expiry, it restarts.
    s.fleet.kill("h0");
    s.note("SIGKILL h0");
    s.until(
        Duration::from_secs(20),
        "h0's leases taken by the others",
        async |s| {
            let owners = s.owners().await;
            (owners.len() == PARTITIONS as usize && owners.values().all(|o| o != "h0"))
                .then_some(())
        },
    )
    .await;
    s.fleet.start("h0b", &store, &[]);
    s.note("started h0b");
    s.settled(&["h0b", "h1", "h2", "h3"], "h0b gets a share")
        .await;

    // A freeze: SIGSTOP h1 past the expiry; its leases are taken; SIGCONT; it rejoins.
    s.fleet.signal("h1", Signal::SIGSTOP);
    s.note("SIGSTOP h1");
    s.until(
        Duration::from_secs(20),
        "h1's leases taken while it is frozen",
        async |s| {
            let owners = s.owners().await;
            (owners.len() == PARTITIONS as usize && owners.values().all(|o| o != "h1"))
                .then_some(())
        },
    )
    .await;
    s.fleet.signal("h1", Signal::SIGCONT);
    s.note("SIGCONT h1");

    // A crash and an immediate restart under a new name.
    s.fleet.kill("h2");
    s.fleet.start("h2b", &store, &[]);
    s.note("SIGKILL h2, started h2b");
    let owners = s
        .settled(&["h0b", "h1", "h2b", "h3"], "h1 rejoins, h2b replaces h2")
        .await;

    // The cut: h3 can no longer reach the lease store, but still the outbox and the ledger.
    let cut_partitions: BTreeSet<String> = owners
        .iter()
        .filter(|(_, o)| o.as_str() == "h3")
        .map(|(p, _)| p.clone())
        .collect();
    let t_cut = now_ms();
    proxy.set_cut(true);
    s.note(format!("cut h3 off the store; it owns {cut_partitions:?}"));
    s.until(
        Duration::from_secs(20),
        "h3's leases taken by others",
        async |s| {
            let owners = s.owners().await;
            cut_partitions
                .iter()
                .all(|p| owners.get(p).is_some_and(|o| o != "h3"))
                .then_some(())
        },
    )
    .await;
    let firsts = s
        .until(
            Duration::from_secs(20),
            "the new owners deliver h3's partitions",
            async |s| {
                let rows = s.deliveries().await;
                let mut first: BTreeMap<String, Delivery> = BTreeMap::new();
                for d in rows.iter().filter(|d| d.host != "h3" && d.at_ms > t_cut) {
                    if cut_partitions.contains(&d.partition) {
                        first
                            .entry(d.partition.clone())
                            .or_insert_with(|| d.clone());
                    }
                }
                (first.len() == cut_partitions.len()).then_some(first)
            },
        )
        .await;
    let rows = s.deliveries().await;
    let h3_last = rows
        .iter()
        .filter(|d| d.host == "h3")
        .map(|d| d.at_ms)
        .max()
        .expect("h3 delivered before the cut");
    for (p, first) in &firsts {
        let last_here = rows
            .iter()
            .filter(|d| d.host == "h3" && &d.partition == p)
            .map(|d| d.at_ms)
            .max();
        s.note(format!(
            "partition {p}: h3's last delivery {:?} ms after the cut, {}'s first {} ms after",
            last_here.map(|t| t - t_cut),
            first.host,
            first.at_ms - t_cut
        ));
        assert!(
            last_here.is_none_or(|t| t < first.at_ms),
            "rule 3: cut-off h3 delivered partition {p} at {last_here:?}, after {} began at {} (cut at {t_cut})\n{}",
            first.host,
            first.at_ms,
            s.timeline.join("\n")
        );
    }
    assert!(
        h3_last < t_cut + LEASE_EXPIRY_MS,
        "rule 3: h3 fences {FENCE_AFTER_MS} ms after its last heartbeat, but delivered {} ms after the cut",
        h3_last - t_cut
    );
    let h3_log = std::fs::read_to_string(s.fleet.log("h3")).unwrap_or_default();
    assert!(
        h3_log.contains("fencing: workers stop"),
        "h3 logs its fence:\n{}",
        s.fleet.logs()
    );
    let after_cut = rows
        .iter()
        .filter(|d| d.host == "h3" && d.at_ms > t_cut)
        .count();
    s.note(format!(
        "h3 delivered {after_cut} records after the cut, the last {} ms after it",
        h3_last - t_cut
    ));

    // Heal the cut: h3 lowers its fence and gets a share again.
    proxy.set_cut(false);
    s.note("healed the cut");
    s.settled(&["h0b", "h1", "h2b", "h3"], "h3 rejoins after the cut")
        .await;

    // Stop writing; everything written is delivered.
    stop.store(true, Ordering::SeqCst);
    let written = writing.await.expect("writer");
    let total: i64 = written.values().sum();
    s.note(format!("writer stopped after {total} records"));
    s.until(
        Duration::from_secs(30),
        "every record delivered",
        async |s| {
            let rows = s.deliveries().await;
            let seen: BTreeSet<(&str, i64)> =
                rows.iter().map(|d| (d.key.as_str(), d.seq)).collect();
            written
                .iter()
                .all(|(k, n)| (0..*n).all(|q| seen.contains(&(k.as_str(), q))))
                .then_some(())
        },
    )
    .await;
    for name in s.fleet.children.keys().cloned().collect::<Vec<_>>() {
        s.fleet.signal(&name, Signal::SIGTERM);
    }
    let names: Vec<String> = s.fleet.children.keys().cloned().collect();
    for name in names {
        let deadline = Instant::now() + Duration::from_secs(20);
        let child = s.fleet.children.get_mut(&name).expect("host");
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{name} did not stop after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            status.success(),
            "{name} exits 0 after SIGTERM: {status}\n{}",
            s.fleet.logs()
        );
    }
    s.note("all hosts stopped gracefully");

    // The ledger: in order per key (first deliveries), duplicates only at the start of an
    // ownership run, at most one batch each (rule 4).
    let rows = s.deliveries().await;
    let mut firsts_by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut seen: BTreeSet<(&str, i64)> = BTreeSet::new();
    let mut runs: BTreeMap<&str, (String, usize, bool)> = BTreeMap::new(); // partition → (host, dups, past prefix)
    let mut duplicates = 0usize;
    let mut changes = 0usize;
    for d in &rows {
        let first = seen.insert((d.key.as_str(), d.seq));
        let run = runs
            .entry(d.partition.as_str())
            .or_insert_with(|| (d.host.clone(), 0, false));
        if run.0 != d.host {
            *run = (d.host.clone(), 0, false);
            changes += 1;
        }
        if first {
            firsts_by_key.entry(d.key.as_str()).or_default().push(d.seq);
            run.2 = true;
        } else {
            duplicates += 1;
            run.1 += 1;
            assert!(
                !run.2,
                "rule 4: duplicate {}#{} by {} in partition {} (ledger id {}) after that host had delivered new records: not at an ownership change",
                d.key, d.seq, d.host, d.partition, d.id
            );
            assert!(
                run.1 <= MAX_BATCH,
                "rule 4: more than one batch ({MAX_BATCH}) of duplicates after an ownership change in partition {}",
                d.partition
            );
        }
    }
    for (key, seqs) in &firsts_by_key {
        let expected: Vec<i64> = (0..written[*key]).collect();
        assert_eq!(
            seqs, &expected,
            "rule 4: key {key}'s first deliveries in order"
        );
    }
    s.note(format!(
        "ledger: {} deliveries of {total} records, {duplicates} duplicates over {changes} ownership changes",
        rows.len()
    ));
    drop(s);
    drop_tables(&prefix).await;
}
