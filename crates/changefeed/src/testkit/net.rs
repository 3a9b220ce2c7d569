//! Network faults below the client: a loopback TCP proxy that passes, black-holes, resets,
//! delays or refuses the connections of one client (feature `testkit`).
//!
//! A fault model at the level of store calls cannot show what breaks in production: a
//! connection that hangs with nothing closed, a pool whose slots are held by calls that never
//! return, a timeout that was never set. Put a [`FaultProxy`] between one host and its server
//! (give the host the proxy's address instead of the server's) and switch it while the host
//! runs. Each proxy is one path: a fleet test gives every host its own, so that one host can
//! be cut off while the others are not.
//!
//! The faults, as a client meets them on a real network:
//!
//! | switch | what the client sees |
//! |---|---|
//! | [`FaultProxy::pass`] | bytes flow both ways; connections held by a black hole resume, their held bytes delivered in order (TCP retransmitting once the path is back) |
//! | [`FaultProxy::black_hole`] | a dead switch or a security-group change: every byte of every connection, open or new, is held; nothing is answered, nothing closed, no reset |
//! | [`FaultProxy::pass_forgetting_held`] | the path is back, but connections that lived through the black hole stay held for ever (a NAT or load balancer that lost their flow state drops their packets silently); new connections pass |
//! | [`FaultProxy::reset_all`] | every open connection is reset at once (a server restart or failover as the client sees it); the switch is otherwise unchanged |
//! | [`FaultProxy::refuse`] | new connections are reset as they arrive (a server not yet listening); open ones pass |
//! | [`FaultProxy::delay`] | every chunk of bytes is passed on after a delay (a slow server or a congested path) |
//!
//! The proxy connects upstream only when a connection's bytes may first pass, so a connection
//! opened into a black hole reaches the server only once the path is back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does now; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    BlackHole,
    Refuse,
    Delay(Duration),
}

#[derive(Debug, Clone, Copy)]
struct Switch {
    mode: Mode,
    /// Connections numbered below this are held for ever ([`FaultProxy::pass_forgetting_held`]).
    forgotten_below: u64,
    /// Bumped by every [`FaultProxy::reset_all`]; a connection opened at an older count is reset.
    resets: u64,
}

impl Switch {
    fn may_pass(&self, id: u64) -> bool {
        id >= self.forgotten_below && self.mode != Mode::BlackHole
    }
}

/// A loopback TCP proxy to one upstream address whose faults a test switches; see the module
/// doc. Dropping it stops accepting and closes every connection it holds.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    switch: watch::Sender<Switch>,
    open: Arc<AtomicUsize>,
    /// The id the next accepted connection gets.
    next_id: Arc<std::sync::atomic::AtomicU64>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on an ephemeral loopback port and forwards each connection to `upstream`
    /// (`host:port`), passing bytes until switched.
    ///
    /// # Errors
    ///
    /// Binding the loopback port failed.
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<FaultProxy> {
        let upstream: Arc<str> = upstream.into().into();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (switch, _) = watch::channel(Switch {
            mode: Mode::Pass,
            forgotten_below: 0,
            resets: 0,
        });
        let open = Arc::new(AtomicUsize::new(0));
        let next_id = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let accept = tokio::spawn(accept_loop(
            listener,
            upstream,
            switch.subscribe(),
            Arc::clone(&open),
            Arc::clone(&next_id),
        ));
        Ok(FaultProxy {
            addr,
            switch,
            open,
            next_id,
            accept,
        })
    }

    /// The address clients connect to instead of the server's.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Connections the proxy holds open now (passing, held or delayed).
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Bytes flow; connections held by a black hole resume (except those forgotten).
    pub fn pass(&self) {
        self.switch.send_modify(|s| s.mode = Mode::Pass);
    }

    /// Holds every byte of every connection, open and new: nothing answered, nothing closed.
    pub fn black_hole(&self) {
        self.switch.send_modify(|s| s.mode = Mode::BlackHole);
    }

    /// Bytes flow for new connections; every connection opened before now stays held for ever.
    pub fn pass_forgetting_held(&self) {
        let below = self.next_id.load(Ordering::SeqCst);
        self.switch.send_modify(|s| {
            s.mode = Mode::Pass;
            s.forgotten_below = below;
        });
    }

    /// Resets every connection open now, both ways; the switch is otherwise unchanged.
    pub fn reset_all(&self) {
        self.switch.send_modify(|s| s.resets += 1);
    }

    /// Resets new connections as they arrive; open ones pass.
    pub fn refuse(&self) {
        self.switch.send_modify(|s| s.mode = Mode::Refuse);
    }

    /// Passes every chunk of bytes on after `delay`, both ways.
    pub fn delay(&self, delay: Duration) {
        self.switch.send_modify(|s| s.mode = Mode::Delay(delay));
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Ends every connection task: each watches the switch and stops when it is gone.
        self.switch.send_modify(|s| s.resets += 1);
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: Arc<str>,
    switch: watch::Receiver<Switch>,
    open: Arc<AtomicUsize>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        let id = next_id.fetch_add(1, Ordering::SeqCst);
        let now = *switch.borrow();
        if now.mode == Mode::Refuse {
            reset(inbound);
            continue;
        }
        let upstream = Arc::clone(&upstream);
        let switch = switch.clone();
        let open = Arc::clone(&open);
        open.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            connection(id, now.resets, inbound, &upstream, switch).await;
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Closes `stream` with a reset (RST) rather than an orderly close.
fn reset(stream: TcpStream) {
    // SO_LINGER 0 makes the close a reset; failing to set it leaves an orderly close.
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn connection(
    id: u64,
    resets_at_open: u64,
    inbound: TcpStream,
    upstream: &str,
    mut switch: watch::Receiver<Switch>,
) {
    let reset_seen = |s: &Switch| s.resets != resets_at_open;
    // Connect upstream only once bytes may pass: a connection opened into a black hole does
    // not reach the server until the path is back.
    let ready = tokio::select! {
        s = until(&mut switch, |s| reset_seen(s) || s.may_pass(id)) => s.is_some_and(|s| !reset_seen(&s)),
        _ = closed(&inbound) => false,
    };
    if !ready {
        return reset(inbound);
    }
    let Ok(outbound) = TcpStream::connect(upstream).await else {
        return reset(inbound);
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let _ = inbound.set_zero_linger();
    let _ = outbound.set_zero_linger();
    let (ri, wi) = inbound.into_split();
    let (ro, wo) = outbound.into_split();
    let pumps = async {
        tokio::join!(
            pump(id, ri, wo, switch.clone()),
            pump(id, ro, wi, switch.clone())
        )
    };
    let mut resets = switch.clone();
    tokio::select! {
        // Both halves dropped here: with SO_LINGER 0 each side gets a reset.
        _ = until(&mut resets, |s| reset_seen(s)) => {}
        _ = pumps => {}
    }
}

/// Waits until the switch satisfies `f`; `None` once the proxy is gone. (Copies the switch
/// out, so the caller's future holds no lock on it.)
async fn until(
    switch: &mut watch::Receiver<Switch>,
    f: impl FnMut(&Switch) -> bool,
) -> Option<Switch> {
    switch.wait_for(f).await.ok().map(|s| *s)
}

/// Resolves when the peer closes `stream` (or it fails) before anything is forwarded; never
/// once it has sent bytes (they wait for the switch, the caller's other branch).
async fn closed(stream: &TcpStream) {
    let mut probe = [0u8; 1];
    match stream.peek(&mut probe).await {
        Ok(0) | Err(_) => {}
        Ok(_) => std::future::pending().await,
    }
}

/// Copies `from` to `to` while the switch lets connection `id` pass; while it does not, holds
/// what was read (and the connection) without passing anything on.
async fn pump(
    id: u64,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut switch: watch::Receiver<Switch>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if until(&mut switch, |s| s.may_pass(id)).await.is_none() {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            _ = until(&mut switch, |s| !s.may_pass(id)) => continue,
        };
        let delay = match until(&mut switch, |s| s.may_pass(id)).await {
            Some(Switch {
                mode: Mode::Delay(d),
                ..
            }) => d,
            Some(_) => Duration::ZERO,
            None => return,
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
            if until(&mut switch, |s| s.may_pass(id)).await.is_none() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, within: Duration) -> Option<std::io::Result<Vec<u8>>> {
        let mut buf = [0u8; 5];
        tokio::time::timeout(within, async {
            s.write_all(b"hello").await?;
            s.read_exact(&mut buf).await?;
            Ok(buf.to_vec())
        })
        .await
        .ok()
    }

    const SHORT: Duration = Duration::from_millis(300);
    const LONG: Duration = Duration::from_secs(5);

    // A black hole holds bytes without closing; the path back delivers them in order.
    #[tokio::test]
    async fn black_hole_holds_and_pass_resumes() {
        let proxy = FaultProxy::start(echo_server().await.to_string())
            .await
            .expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            round_trip(&mut s, LONG)
                .await
                .expect("answered")
                .expect("echo"),
            b"hello"
        );
        proxy.black_hole();
        assert!(
            round_trip(&mut s, SHORT).await.is_none(),
            "a black hole answers nothing"
        );
        let mut fresh = TcpStream::connect(proxy.addr()).await.expect("accepted");
        assert!(
            round_trip(&mut fresh, SHORT).await.is_none(),
            "nor a new connection"
        );
        proxy.pass();
        let mut buf = [0u8; 5];
        tokio::time::timeout(LONG, s.read_exact(&mut buf))
            .await
            .expect("held bytes delivered")
            .expect("read");
        assert_eq!(&buf, b"hello");
        assert_eq!(
            round_trip(&mut fresh, LONG)
                .await
                .expect("answered")
                .expect("echo"),
            b"hello"
        );
    }

    // A forgotten flow stays held for ever; a new connection passes.
    #[tokio::test]
    async fn forgotten_connections_stay_held_and_new_ones_pass() {
        let proxy = FaultProxy::start(echo_server().await.to_string())
            .await
            .expect("proxy");
        let mut old = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(round_trip(&mut old, LONG).await.is_some());
        proxy.black_hole();
        proxy.pass_forgetting_held();
        assert!(
            round_trip(&mut old, SHORT).await.is_none(),
            "the old flow is gone"
        );
        let mut new = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            round_trip(&mut new, LONG)
                .await
                .expect("answered")
                .expect("echo"),
            b"hello"
        );
        assert_eq!(proxy.open_connections(), 2);
    }

    // A reset reaches every open connection; refused connections are reset on arrival.
    #[tokio::test]
    async fn reset_and_refuse_reach_the_client_as_resets() {
        let proxy = FaultProxy::start(echo_server().await.to_string())
            .await
            .expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(round_trip(&mut s, LONG).await.is_some());
        proxy.reset_all();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(LONG, s.read(&mut buf))
            .await
            .expect("closed");
        assert!(matches!(read, Ok(0) | Err(_)), "reset: {read:?}");
        proxy.refuse();
        let mut r = TcpStream::connect(proxy.addr())
            .await
            .expect("accepted then reset");
        let got = round_trip(&mut r, LONG).await.expect("fails fast");
        assert!(got.is_err(), "a refused connection fails: {got:?}");
        proxy.pass();
        let mut ok = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(round_trip(&mut ok, LONG).await.expect("answered").is_ok());
    }

    // A delay holds each answer for at least the delay.
    #[tokio::test]
    async fn delay_slows_every_answer() {
        let proxy = FaultProxy::start(echo_server().await.to_string())
            .await
            .expect("proxy");
        proxy.delay(Duration::from_millis(400));
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        let started = tokio::time::Instant::now();
        assert!(round_trip(&mut s, LONG).await.expect("answered").is_ok());
        assert!(
            started.elapsed() >= Duration::from_millis(800),
            "{:?}",
            started.elapsed()
        );
    }
}
