//! What a run cost this process, from `getrusage`: CPU seconds and peak resident memory. Wall
//! time on a machine shared with other work says little; CPU time and memory travel.

use std::time::Instant;

use nix::sys::resource::{getrusage, UsageWho};

/// User and system CPU seconds `who` has used so far.
pub(crate) fn cpu_seconds(who: UsageWho) -> anyhow::Result<f64> {
    let usage = getrusage(who)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(secs(usage.user_time()) + secs(usage.system_time()))
}

/// This process's peak resident memory so far, in MB.
pub(crate) fn peak_rss_mb() -> anyhow::Result<u64> {
    // Linux reports the peak in kilobytes.
    Ok(u64::try_from(getrusage(UsageWho::RUSAGE_SELF)?.max_rss()).unwrap_or(0) / 1024)
}

/// The wall time and this process's CPU time since it was started, and the peak memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunCost {
    wall: Instant,
    cpu: f64,
}

impl RunCost {
    /// Starts measuring now.
    pub(crate) fn start() -> anyhow::Result<Self> {
        Ok(Self {
            wall: Instant::now(),
            cpu: cpu_seconds(UsageWho::RUSAGE_SELF)?,
        })
    }

    /// The `RESULT` fields `wall_s=… cpu_s=… peak_rss_mb=…` so far.
    pub(crate) fn fields(&self) -> anyhow::Result<String> {
        Ok(format!(
            "wall_s={:.1} cpu_s={:.1} peak_rss_mb={}",
            self.wall.elapsed().as_secs_f64(),
            cpu_seconds(UsageWho::RUSAGE_SELF)? - self.cpu,
            peak_rss_mb()?
        ))
    }
}
