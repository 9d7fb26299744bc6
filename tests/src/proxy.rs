//! A TCP proxy that cuts connections: the network fault between workers
//! and Redis, as a flaky link or a load balancer that drops connections
//! makes it.
//!
//! [`CuttingProxy`] listens on a free loopback port and forwards each
//! connection to an upstream address (a `redis-server`). While cutting is
//! on ([`CuttingProxy::set_cutting`]), each connection is cut after a
//! random lifetime drawn from the range given: both sockets are closed with
//! a reset (zero linger) at whatever point the traffic has reached, so a
//! command may have reached Redis and run while its reply is lost, as
//! happens when a real link breaks. Connections opened while cutting is off
//! are cut once it is on, at the end of their current lifetime. New
//! connections are always accepted: a client that reconnects gets through,
//! until its next cut. During an outage ([`CuttingProxy::set_outage`])
//! nothing gets through: every connection is reset at once, and each new
//! one as soon as it is accepted, as when Redis is down.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use rand::Rng;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A proxy on a loopback port; stopped (every connection closed) on drop.
pub struct CuttingProxy {
    port: u16,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

struct Shared {
    upstream: SocketAddr,
    lifetime: Range<Duration>,
    cutting: AtomicBool,
    outage: watch::Sender<bool>,
    cuts: AtomicU64,
    accepted: AtomicU64,
}

impl CuttingProxy {
    /// Forward a free loopback port to `upstream`, cutting each connection
    /// after a lifetime drawn uniformly from `lifetime` while cutting is on
    /// (it starts off).
    pub async fn start(upstream: SocketAddr, lifetime: Range<Duration>) -> Result<CuttingProxy> {
        anyhow::ensure!(!lifetime.is_empty(), "an empty lifetime range");
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            upstream,
            lifetime,
            cutting: AtomicBool::new(false),
            outage: watch::Sender::new(false),
            cuts: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept(listener, shared.clone(), stop.clone()));
        Ok(CuttingProxy { port, shared, stop })
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Start or end an outage: while it lasts, every connection is reset at
    /// once, and each new one as soon as it is accepted.
    pub fn set_outage(&self, on: bool) {
        self.shared.outage.send_replace(on);
    }

    /// Start or stop cutting connections.
    pub fn set_cutting(&self, on: bool) {
        self.shared.cutting.store(on, Ordering::Release);
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> u64 {
        self.shared.cuts.load(Ordering::Acquire)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Acquire)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let client = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
            () = stop.cancelled() => return,
        };
        shared.accepted.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(forward(client, shared.clone(), stop.clone()));
    }
}

/// Forward one connection until either side closes it, the proxy stops, a
/// lifetime ends while cutting is on, or an outage begins.
async fn forward(mut client: TcpStream, shared: Arc<Shared>, stop: CancellationToken) {
    let mut outage = shared.outage.subscribe();
    if *outage.borrow_and_update() {
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(mut server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let cut = {
        let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
        tokio::pin!(copy);
        loop {
            let lifetime = rand::rng().random_range(shared.lifetime.clone());
            tokio::select! {
                _ = &mut copy => break false,
                () = stop.cancelled() => break true,
                _ = outage.wait_for(|down| *down) => {
                    shared.cuts.fetch_add(1, Ordering::AcqRel);
                    break true;
                }
                () = tokio::time::sleep(lifetime) => {
                    if shared.cutting.load(Ordering::Acquire) {
                        shared.cuts.fetch_add(1, Ordering::AcqRel);
                        break true;
                    }
                }
            }
        }
    };
    if cut {
        // Reset, not a graceful close: whatever was in flight is lost.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}
