//! The client in front of each simulated host's store and source: a pool of connections, as a
//! real database or HTTP client keeps, and what a network fault does to them.
//!
//! A call checks a connection out (a new one while fewer than [`PoolConfig::size`] are open,
//! so the pool soon holds its full size, as a pool kept warm does; then the idle one given back
//! longest ago; otherwise it waits for one), makes its request on it and gives it back. A connection is opened by a handshake that is refused while the host's path
//! fails ([`Cut::Fail`]) and held while it is black-holed ([`Cut::Hang`], [`Cut::Forget`]).
//!
//! A [`Cut::Forget`] black-holes the host's network and, when it ends, leaves dead every
//! connection that was open during it: the peer's end of the flow is gone (the server
//! restarted, or a middlebox forgot the flow) and, the packets having been dropped, no reset
//! ever told the client. A request on a dead connection hangs for ever: only its caller's
//! timeout ends it.
//!
//! What the client does then decides whether the host recovers. The correct client
//! ([`PoolConfig::correct`]) closes a connection whose call was cancelled (its future dropped,
//! as a caller's timeout does) or timed out, and may have a per-call timeout of its own: each
//! dead connection costs one call a timeout, and the pool fills up with fresh ones. The broken
//! one ([`PoolConfig::no_timeouts`], the `no-timeouts` variant) has no per-call timeout and
//! gives a cancelled call's connection back to the pool as if nothing had happened: every later
//! call takes a dead connection and hangs again, for ever.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::seams::{Cut, HostCtl};
use super::world::lock;

/// How a simulated host's client treats its connections (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// The most connections open at once: a call that finds none idle and the pool full waits
    /// for one.
    pub size: usize,
    /// The client's own timeout of a call (checking a connection out, opening it, the request
    /// and its answer): a call still unanswered then fails. `None`: the client waits as long
    /// as its caller does.
    pub call_timeout: Option<Duration>,
    /// Whether a connection whose call was cancelled or timed out is closed (the correct
    /// client) or given back to the pool (the bug).
    pub discard_cancelled: bool,
}

impl PoolConfig {
    /// Connections per pool in the random scenario.
    pub const SIZE: usize = 4;

    /// The correct client: closes a connection whose call was cancelled or timed out, with a
    /// per-call timeout of its own or none (then only its callers' bounds end a hung call).
    pub fn correct(call_timeout: Option<Duration>) -> Self {
        Self {
            size: Self::SIZE,
            call_timeout,
            discard_cancelled: true,
        }
    }

    /// The broken client of the `no-timeouts` variant: no per-call timeout, and a cancelled
    /// call's connection goes back to the pool.
    pub fn no_timeouts() -> Self {
        Self {
            size: Self::SIZE,
            call_timeout: None,
            discard_cancelled: false,
        }
    }
}

/// Which of the host's connections a pool holds: a store cut ([`Cut::Fail`], [`Cut::Hang`])
/// reaches only the store; a [`Cut::Forget`] black-holes the host's whole network, its feed
/// too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Net {
    Store,
    Source,
}

/// One open connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Conn {
    /// How many [`Cut::Forget`]s had begun on its host when it was opened: it is dead once
    /// another has.
    gen: u64,
}

/// What a pool has done, for tests and the trace.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolCounts {
    /// Connections opened.
    pub opened: u64,
    /// Connections closed after their call was cancelled or timed out (the correct client).
    pub discarded: u64,
    /// Connections given back to the pool after their call was cancelled or timed out (the
    /// bug).
    pub reused_after_cancel: u64,
    /// Requests made on a dead connection (each hangs until its caller gives up).
    pub dead_requests: u64,
}

#[derive(Debug, Default)]
struct PoolState {
    idle: VecDeque<Conn>,
    /// Connections open or being opened (idle, lent, or connecting).
    open: usize,
    counts: PoolCounts,
}

/// One host incarnation's pool of connections to its store, or to its source.
#[derive(Debug)]
pub(crate) struct Pool {
    cfg: PoolConfig,
    net: Net,
    ctl: Arc<HostCtl>,
    state: Mutex<PoolState>,
    /// Rings when a connection is given back or closed.
    freed: Notify,
}

/// How a lent connection's call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The call was dropped before it answered (its caller gave up, or the client timed out).
    Cancelled,
    /// The call answered (with a result or an error from the server).
    Answered,
    /// The connection failed (refused, reset): every client closes it.
    Failed,
}

/// A connection lent to one call (or a slot for one being opened); given back, or closed, when
/// dropped.
#[derive(Debug)]
pub(crate) struct Lent<'a> {
    pool: &'a Pool,
    conn: Option<Conn>,
    end: End,
}

impl Lent<'_> {
    /// The call answered: the connection goes back to the pool.
    pub(crate) fn answered(&mut self) {
        self.end = End::Answered;
    }

    /// The connection failed: it is closed.
    pub(crate) fn failed(&mut self) {
        self.end = End::Failed;
    }

    /// Whether a [`Cut::Forget`] began since the connection was opened.
    pub(crate) fn is_dead(&self, ctl: &HostCtl) -> bool {
        self.conn.is_some_and(|c| c.gen < ctl.forgets())
    }

    /// Notes a request made on a dead connection.
    pub(crate) fn dead_request(&self) {
        lock(&self.pool.state).counts.dead_requests += 1;
        self.pool.trace("request on a dead connection hangs");
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.pool.state);
        match (self.conn, self.end) {
            (None, _) | (Some(_), End::Failed) => state.open -= 1,
            (Some(c), End::Answered) => state.idle.push_back(c),
            (Some(c), End::Cancelled) => {
                let dead = c.gen < self.pool.ctl.forgets();
                let what = if self.pool.cfg.discard_cancelled {
                    state.open -= 1;
                    state.counts.discarded += 1;
                    "closed"
                } else {
                    state.idle.push_back(c);
                    state.counts.reused_after_cancel += 1;
                    "given back"
                };
                drop(state);
                if dead {
                    self.pool
                        .trace(&format!("call cancelled; its dead connection {what}"));
                }
                self.pool.freed.notify_one();
                return;
            }
        }
        drop(state);
        self.pool.freed.notify_one();
    }
}

impl Pool {
    pub(crate) fn new(cfg: PoolConfig, net: Net, ctl: Arc<HostCtl>) -> Self {
        Self {
            cfg,
            net,
            ctl,
            state: Mutex::new(PoolState::default()),
            freed: Notify::new(),
        }
    }

    fn trace(&self, what: &str) {
        let net = match self.net {
            Net::Store => "store",
            Net::Source => "feed",
        };
        self.ctl.trace(format_args!("pool {net}: {what}"));
    }

    pub(crate) fn counts(&self) -> PoolCounts {
        lock(&self.state).counts
    }

    /// The cut that reaches this pool's connections now.
    fn cut(&self, ctl: &HostCtl) -> Cut {
        let cut = ctl.cut();
        match (self.net, cut) {
            (Net::Store, _) | (Net::Source, Cut::Forget) => cut,
            (Net::Source, _) => Cut::None,
        }
    }

    /// Waits while this pool's path is black-holed.
    pub(crate) async fn wait_out_hang(&self, ctl: &HostCtl) {
        loop {
            let cut = self.cut(ctl);
            if !matches!(cut, Cut::Hang | Cut::Forget) {
                return;
            }
            ctl.cut_changed_from(cut).await;
        }
    }

    /// Whether this pool's path is cut now, and how.
    pub(crate) fn path(&self, ctl: &HostCtl) -> Cut {
        self.cut(ctl)
    }

    /// Lends a connection: a new one if fewer than the pool's size are open (its handshake is
    /// refused while the path fails and held while it is black-holed), the idle one given back
    /// longest ago otherwise, or the first given back after it waits. `Err` if the handshake was refused.
    pub(crate) async fn checkout(&self, ctl: &HostCtl) -> Result<Lent<'_>, ()> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut state = lock(&self.state);
                if state.open < self.cfg.size {
                    state.open += 1;
                    break;
                }
                if let Some(conn) = state.idle.pop_front() {
                    return Ok(Lent {
                        pool: self,
                        conn: Some(conn),
                        end: End::Cancelled,
                    });
                }
            }
            freed.await;
        }
        // A slot is ours: open a connection in it (given back if this is dropped).
        let mut lent = Lent {
            pool: self,
            conn: None,
            end: End::Cancelled,
        };
        loop {
            match self.cut(ctl) {
                Cut::None => break,
                Cut::Fail => {
                    lent.failed();
                    return Err(());
                }
                cut @ (Cut::Hang | Cut::Forget) => ctl.cut_changed_from(cut).await,
            }
        }
        ctl.gate().await;
        lent.conn = Some(Conn { gen: ctl.forgets() });
        lock(&self.state).counts.opened += 1;
        Ok(lent)
    }

    /// Runs `attempt` under the client's own per-call timeout, if it has one; `timed_out` is
    /// the error it fails with then. The timeout runs on the host's timers (a stalled process
    /// runs none).
    pub(crate) async fn timed<T, E>(
        &self,
        ctl: &HostCtl,
        attempt: impl Future<Output = Result<T, E>>,
        timed_out: impl FnOnce() -> E,
    ) -> Result<T, E> {
        let Some(limit) = self.cfg.call_timeout else {
            return attempt.await;
        };
        tokio::select! {
            biased;
            r = attempt => r,
            () = ctl.timer(limit) => Err(timed_out()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Arc;
    use std::time::Duration;

    use rand::SeedableRng;

    use super::*;
    use crate::lease::{MembershipStore, MemoryLeaseStore};
    use crate::model::GroupName;
    use crate::sim::seams::SimStore;
    use crate::sim::world::World;
    use crate::sim::TraceMode;

    /// A host's store behind a pool of two connections made by `client`.
    fn store(client: PoolConfig) -> (SimStore, Arc<Pool>) {
        let world = Arc::new(World::new(
            rand::rngs::SmallRng::seed_from_u64(1),
            TraceMode::Off,
            false,
        ));
        let ctl = Arc::new(HostCtl::new("h", world.clone()));
        let pool = Arc::new(Pool::new(
            PoolConfig { size: 2, ..client },
            Net::Store,
            ctl.clone(),
        ));
        let store = SimStore {
            inner: MemoryLeaseStore::new(),
            ctl,
            world,
            pool: Some(pool.clone()),
        };
        (store, pool)
    }

    fn group() -> GroupName {
        GroupName::new("g").unwrap()
    }

    fn paused() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// The caller's own timeout: `None` when it gave the call up.
    async fn within<T>(d: Duration, call: impl Future<Output = T>) -> Option<T> {
        tokio::time::timeout(d, call).await.ok()
    }

    /// Opens both connections of the pool (calls that answer), then black-holes the path with
    /// a forget cut, and ends it.
    async fn both_connections_through_a_forget(store: &SimStore) {
        for _ in 0..2 {
            store.membership(&group()).await.unwrap();
        }
        store.ctl.set_cut(Cut::Forget);
        store.ctl.set_cut(Cut::None);
    }

    #[test]
    fn a_call_on_a_black_holed_path_hangs_until_its_caller_gives_up() {
        paused().block_on(async {
            let (store, pool) = store(PoolConfig::correct(None));
            store.ctl.set_cut(Cut::Forget);
            // Pending, not failing: only the caller's timeout ends it.
            assert!(within(Duration::from_secs(600), store.membership(&group()))
                .await
                .is_none());
            // Its handshake never completed: nothing was opened, nothing is left open.
            assert_eq!(pool.counts().opened, 0);
            assert_eq!(lock(&pool.state).open, 0);
            store.ctl.set_cut(Cut::None);
            assert!(store.membership(&group()).await.is_ok());
        });
    }

    #[test]
    fn connections_open_during_a_forget_cut_are_dead_after_it_and_the_correct_client_closes_them() {
        paused().block_on(async {
            let (store, pool) = store(PoolConfig::correct(None));
            both_connections_through_a_forget(&store).await;
            // The path is healthy again, but an old connection hangs its call for ever.
            assert!(within(Duration::from_secs(60), store.membership(&group()))
                .await
                .is_none());
            // It was closed when its call was cancelled: the next call opens a fresh one.
            assert!(store.membership(&group()).await.is_ok());
            // The pool is full again; the other old connection is next, and hangs too.
            assert!(within(Duration::from_secs(60), store.membership(&group()))
                .await
                .is_none());
            let counts = pool.counts();
            assert_eq!((counts.dead_requests, counts.discarded), (2, 2));
            for _ in 0..4 {
                assert!(store.membership(&group()).await.is_ok());
            }
            assert_eq!(
                pool.counts().opened,
                4,
                "two fresh connections replace the dead"
            );
        });
    }

    #[test]
    fn the_clients_own_timeout_fails_a_call_on_a_dead_connection() {
        paused().block_on(async {
            let (store, pool) = store(PoolConfig::correct(Some(Duration::from_secs(3))));
            both_connections_through_a_forget(&store).await;
            let started = tokio::time::Instant::now();
            let err = store.membership(&group()).await.unwrap_err();
            assert!(err.is_retryable(), "{err}");
            assert_eq!(started.elapsed(), Duration::from_secs(3));
            assert_eq!(pool.counts().discarded, 1);
        });
    }

    #[test]
    fn the_broken_client_gives_dead_connections_back_and_every_later_call_hangs() {
        paused().block_on(async {
            let (store, pool) = store(PoolConfig::no_timeouts());
            both_connections_through_a_forget(&store).await;
            for _ in 0..10 {
                assert!(within(Duration::from_secs(60), store.membership(&group()))
                    .await
                    .is_none());
            }
            let counts = pool.counts();
            assert_eq!(
                (
                    counts.opened,
                    counts.dead_requests,
                    counts.reused_after_cancel
                ),
                (2, 10, 10),
                "no fresh connection is ever opened"
            );
        });
    }

    #[test]
    fn a_full_pool_makes_a_call_wait_for_a_connection() {
        paused().block_on(async {
            let (store, _pool) = store(PoolConfig::correct(None));
            store.ctl.set_latency(1_000);
            let g = group();
            // Two calls hold both connections for up to a second each; the third waits.
            let (a, b, c) = tokio::join!(store.membership(&g), store.membership(&g), async {
                tokio::task::yield_now().await;
                let started = tokio::time::Instant::now();
                store.membership(&g).await.map(|_| started.elapsed())
            });
            assert!(a.is_ok() && b.is_ok());
            assert!(c.unwrap() > Duration::ZERO, "the third call waited");
        });
    }
}
