//! Shared helpers: a temporary SQLite store and feed, the binary, and polling with a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use changefeed::lease::LeaseStore;
use changefeed::model::{GroupName, Lease, LeaseKey, PartitionId};
use changefeed_sqlite::{SqliteFeed, SqliteLeaseStore};

/// A temporary directory holding one SQLite file used as both store and feed.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub db: PathBuf,
}

impl Fixture {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let db = dir.path().join("feed.db");
        Self { dir, db }
    }

    pub fn url(&self) -> String {
        format!("sqlite://{}", self.db.display())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Opens the store on a fresh current-thread runtime and runs `f` with it.
    pub fn with_store<T>(&self, f: impl AsyncFnOnce(&SqliteLeaseStore) -> T) -> T {
        rt().block_on(async {
            let store = SqliteLeaseStore::open(&self.db).await.expect("open store");
            f(&store).await
        })
    }

    pub fn with_feed<T>(&self, f: impl AsyncFnOnce(&SqliteFeed) -> T) -> T {
        rt().block_on(async {
            let feed = SqliteFeed::open(&self.db).await.expect("open feed");
            f(&feed).await
        })
    }

    /// The lease of `partition` in `group`, as stored.
    pub fn lease(&self, group: &str, partition: &str) -> Option<Lease> {
        self.with_store(async |s| s.get(&key(group, partition)).await.expect("get lease"))
    }
}

pub fn key(group: &str, partition: &str) -> LeaseKey {
    LeaseKey::new(
        GroupName::new(group).expect("group"),
        PartitionId::new(partition).expect("partition"),
    )
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The built binary.
///
/// It runs with static test credentials and `AWS_EC2_METADATA_DISABLED=true`: without
/// credentials the AWS SDK asks the instance-metadata address (169.254.169.254), which is not
/// on loopback, and tests never leave the machine. DynamoDB Local and kinesis-mock accept any
/// credentials.
pub fn bin() -> Command {
    bin_at(Path::new(env!("CARGO_BIN_EXE_changefeed")))
}

/// The built binary at `path` (a link or copy of it), with the environment [`bin`] gives it.
pub fn bin_at(path: &Path) -> Command {
    let mut c = Command::new(path);
    // Nothing from the developer's environment may change the settings under test.
    for (k, _) in std::env::vars() {
        if k.starts_with("CHANGEFEED_") || k.starts_with("AWS_") {
            c.env_remove(k);
        }
    }
    c.env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true");
    c
}

/// The built binary, with `changefeed-sim` beside it, where `changefeed simulate` looks for it
/// first. `cargo nextest run --workspace` builds it there; a run of this package's tests alone
/// does not, so then it is built here, with the profile and target directory of the binary
/// under test.
pub fn bin_with_simulator() -> Command {
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let name = format!("changefeed-sim{}", std::env::consts::EXE_SUFFIX);
        let dir = Path::new(env!("CARGO_BIN_EXE_changefeed"))
            .parent()
            .expect("the binary's directory");
        if dir.join(&name).is_file() {
            return;
        }
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev",
            Some(other) => other,
            None => panic!("no profile directory in {}", dir.display()),
        };
        let target = dir.parent().expect("the target directory");
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "-p",
                "changefeed-sim",
                "--profile",
                profile,
            ])
            .env("CARGO_TARGET_DIR", target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run cargo build -p changefeed-sim");
        assert!(
            out.status.success(),
            "cargo build -p changefeed-sim --profile {profile} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            dir.join(&name).is_file(),
            "cargo built changefeed-sim, but not into {}",
            dir.display()
        );
    });
    bin()
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `f` every 50 ms until it returns `Some`, failing after `limit` with `what`.
pub fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends SIGTERM to a child process.
pub fn terminate(child: &std::process::Child) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
}

/// Waits (bounded) for a child to exit.
pub fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    wait_for(limit, "the process to exit", || {
        child.try_wait().expect("try_wait")
    })
}

/// Fast timing flags for `run` in tests.
pub const FAST: &[&str] = &[
    "--lease-expiry",
    "3s",
    "--safety-margin",
    "1s",
    "--renew-interval",
    "500ms",
    "--acquire-interval",
    "200ms",
    "--poll-delay",
    "50ms",
];

/// Reads a file, or an empty string if it does not exist yet.
pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Runs the binary with `args`, asserting it exits 0.
pub fn run_ok(args: &[&str]) -> Output {
    let out = bin().args(args).output().expect("run the binary");
    assert!(out.status.success(), "{args:?}: {:?}", text(&out));
    out
}

/// Standard output of `out` as JSON.
pub fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {:?}", text(out)))
}

/// Group `g`'s leases in `store`, as `status --json` shows them.
pub fn status(store: &str) -> serde_json::Value {
    json(&run_ok(&[
        "status", "--store", store, "--group", "g", "--json",
    ]))
}

/// How many leases of `status` are owned by `host`.
pub fn owned_by(status: &serde_json::Value, host: &str) -> usize {
    status["leases"]
        .as_array()
        .map(|ls| ls.iter().filter(|l| l["owner"] == host).count())
        .unwrap_or(0)
}

/// A host `h2` of group `g` on `store` and `source` takes all `leases`, is killed (SIGKILL,
/// no release), keeps them, and `release --host h2` frees them: the operator's way out when a
/// dead host's leases must not wait for expiry.
pub fn killed_host_keeps_its_leases_until_release(store: &str, source: &str, leases: usize) {
    let mut killed = bin()
        .args(["run", "--store", store, "--source", source])
        .args([
            "--group",
            "g",
            "--host",
            "h2",
            "--handler",
            "cat > /dev/null",
        ])
        .args(FAST)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start run");
    wait_for(Duration::from_secs(20), "h2 to own every lease", || {
        (owned_by(&status(store), "h2") == leases).then_some(())
    });
    killed.kill().expect("SIGKILL");
    killed.wait().expect("reap");
    let s = status(store);
    assert_eq!(
        owned_by(&s, "h2"),
        leases,
        "a killed host keeps its leases: {s}"
    );
    run_ok(&[
        "release", "--store", store, "--group", "g", "--host", "h2", "--wait", "1s",
    ]);
    let s = status(store);
    assert_eq!(owned_by(&s, "h2"), 0, "{s}");
}

/// A child process (a `changefeed run` host), killed if the test ends early.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Whether process `pid` exists and is not a zombie.
pub fn process_alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| t.rsplit_once(')').map(|(_, r)| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}
