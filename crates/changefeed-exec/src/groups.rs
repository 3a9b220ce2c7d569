//! Process groups: every command a host starts runs as the leader of a group of its own,
//! registered in the host's [`ProcessGroups`], so that nothing it starts outlives the call that
//! started it (the [`GroupGuard`]), and a host that exits can stop them all
//! ([`ProcessGroups::finish`], [`ProcessGroups::kill_all_and_exit`]).
//!
//! A command that moves its children into other process groups or sessions (`setsid`) takes
//! them out of the host's reach.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::process::ChildStdin;
use tokio::time::Instant;
use tracing::warn;

/// How long a command's process group has between SIGTERM and SIGKILL.
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// How often a signalled process group is checked for having gone.
const REAP_POLL: Duration = Duration::from_millis(50);

/// The process groups of the commands this host started that may still have processes: shared
/// by the handlers (which add and signal them) and the signal task (which kills them all).
///
/// Each entry carries a generation, so that a group id the kernel reuses for a new command is
/// never signalled on behalf of the old one.
#[derive(Debug, Clone, Default)]
pub struct ProcessGroups(Arc<Mutex<GroupTable>>);

#[derive(Debug, Default)]
struct GroupTable {
    /// Process group id → generation of the entry.
    live: HashMap<i32, u64>,
    next: u64,
    /// Set once the process is exiting: nothing more may be started.
    closed: bool,
}

impl ProcessGroups {
    fn lock(&self) -> MutexGuard<'_, GroupTable> {
        // A panic elsewhere while holding the lock leaves the table usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `command` as the leader of a new process group and registers the group, holding
    /// the lock across the start so that an exiting host cannot miss it.
    pub fn spawn(&self, command: &mut tokio::process::Command) -> std::io::Result<Running> {
        let mut table = self.lock();
        if table.closed {
            return Err(std::io::Error::other("the host is exiting"));
        }
        let mut child = command.process_group(0).kill_on_drop(false).spawn()?;
        let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
            return Err(std::io::Error::other("the command has no process id"));
        };
        table.next += 1;
        let generation = table.next;
        table.live.insert(pid, generation);
        let stdin = child.stdin.take();
        Ok(Running {
            child,
            guard: GroupGuard {
                pgid: pid,
                generation,
                groups: self.clone(),
                stdin,
            },
        })
    }

    /// As [`ProcessGroups::spawn`], on the blocking pool: starting a process holds the calling
    /// thread until the child has executed the command (`posix_spawn` waits for the `exec`),
    /// so a host starting a command per batch would otherwise hold a runtime worker for that
    /// long, and its partitions would take turns starting their commands. Dropped before the
    /// start ends, the command is still registered and its group signalled at once (the
    /// [`GroupGuard`] in the dropped result).
    pub async fn spawn_off_runtime(
        &self,
        mut command: tokio::process::Command,
    ) -> std::io::Result<Running> {
        let groups = self.clone();
        tokio::task::spawn_blocking(move || groups.spawn(&mut command))
            .await
            .map_err(std::io::Error::other)?
    }

    fn is_current(&self, pgid: i32, generation: u64) -> bool {
        self.lock().live.get(&pgid) == Some(&generation)
    }

    fn remove(&self, pgid: i32, generation: u64) {
        let mut table = self.lock();
        if table.live.get(&pgid) == Some(&generation) {
            table.live.remove(&pgid);
        }
    }

    /// Waits until every registered group is gone or `deadline` passes, then SIGKILLs the rest.
    pub async fn finish(&self, deadline: Instant) {
        for pgid in self.lock().live.keys() {
            let _ = killpg(Pid::from_raw(*pgid), Signal::SIGTERM);
        }
        loop {
            let left: Vec<i32> = self.lock().live.keys().copied().collect();
            let alive = left.iter().filter(|g| group_alive(**g)).count();
            if alive == 0 {
                return;
            }
            if Instant::now() >= deadline {
                warn!(
                    groups = alive,
                    "handler commands still running at exit; killing them"
                );
                let mut table = self.lock();
                table.closed = true;
                for pgid in table.live.keys() {
                    let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
                }
                return;
            }
            tokio::time::sleep(REAP_POLL).await;
        }
    }

    /// SIGKILLs every registered group and exits with `code`, holding the lock so that no
    /// command starts in between.
    pub fn kill_all_and_exit(&self, code: i32) -> ! {
        let mut table = self.lock();
        table.closed = true;
        for pgid in table.live.keys() {
            let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
        }
        std::process::exit(code);
    }
}

/// Whether process group `pgid` still has a process that is not a zombie. A group whose last
/// members are zombies (children orphaned to an init that does not reap them) counts as gone.
fn group_alive(pgid: i32) -> bool {
    if killpg(Pid::from_raw(pgid), None).is_err() {
        return false;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        // No procfs: the kernel's word is all there is.
        return true;
    };
    entries.flatten().any(|e| {
        let Ok(text) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        // `pid (comm) state ppid pgrp …`; comm may contain spaces and parentheses.
        let Some((_, rest)) = text.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        pgrp == Some(pgid) && state != Some("Z")
    })
}

/// A command just started: its child handle and the guard of its process group.
#[derive(Debug)]
pub struct Running {
    /// The command's process.
    pub child: tokio::process::Child,
    /// Its process group's guard, holding its stdin.
    pub guard: GroupGuard,
}

/// Owns a command's process group and the write end of its stdin. Dropped (the call ended, or
/// its future was dropped), it sends the group SIGTERM, then SIGKILL after [`KILL_GRACE`] from
/// a thread if anything of it is still there; the stdin pipe stays open until then, so a
/// command cut short never reads an end of input after a partial batch.
#[derive(Debug)]
pub struct GroupGuard {
    pgid: i32,
    generation: u64,
    groups: ProcessGroups,
    /// The write end of the command's stdin (`None` once closed).
    pub stdin: Option<ChildStdin>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let (pgid, generation) = (self.pgid, self.generation);
        if !self.groups.is_current(pgid, generation)
            || killpg(Pid::from_raw(pgid), Signal::SIGTERM).is_err()
        {
            // The group is gone (ESRCH): nothing of the command is left.
            self.groups.remove(pgid, generation);
            return;
        }
        let stdin = self.stdin.take();
        let groups = self.groups.clone();
        let reaper = move || {
            let _open_until_gone = stdin;
            let polls = KILL_GRACE.as_millis() / REAP_POLL.as_millis();
            for _ in 0..polls {
                if !groups.is_current(pgid, generation) || !group_alive(pgid) {
                    groups.remove(pgid, generation);
                    return;
                }
                std::thread::sleep(REAP_POLL);
            }
            if groups.is_current(pgid, generation) {
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                groups.remove(pgid, generation);
            }
        };
        if std::thread::Builder::new()
            .name("changefeed-reap".into())
            .spawn(reaper)
            .is_err()
        {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            self.groups.remove(pgid, generation);
        }
    }
}
