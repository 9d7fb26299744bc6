//! The server loop: accept under a connection cap, serve each connection
//! with hyper's HTTP/1 under its header-read timer, shut down gracefully.
//!
//! `axum::serve` would do the same minus what this is for: it sets no
//! timer (so hyper's header-read timeout never runs) and accepts without a
//! bound.

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::ApiLimits;

/// Pause after an accept that failed for want of a resource (file
/// descriptors, memory), instead of spinning on it.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serve `router` on `listener` until `shutdown` resolves.
pub(super) async fn run(
    listener: TcpListener,
    router: Router,
    limits: ApiLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let cap = connection_cap(limits.max_connections, soft_fd_limit());
    announce(&listener, &limits, cap)?;
    let mut permits = Permits::new(cap);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let Some(permit) = permits.next(&mut shutdown).await else {
            break;
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        // Each response is written whole; Nagle would only delay it.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                // Header timeouts, resets, clients gone: theirs, not ours.
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    let wait = limits.body_timeout + limits.redis_timeout;
    if tokio::time::timeout(wait, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            wait_ms = wait.as_millis() as u64,
            "API connections still open at shutdown are abandoned"
        );
    }
    Ok(())
}

/// Log where the API listens and under which limits, `cap` connections
/// at once (and why, if fewer than configured).
fn announce(listener: &TcpListener, limits: &ApiLimits, cap: usize) -> io::Result<()> {
    if cap < limits.max_connections {
        tracing::warn!(
            configured = limits.max_connections,
            cap,
            "connection cap lowered to half the soft file-descriptor limit (RLIMIT_NOFILE)"
        );
    }
    tracing::info!(
        addr = %listener.local_addr()?,
        max_connections = cap,
        header_timeout_ms = limits.header_timeout.as_millis() as u64,
        body_timeout_ms = limits.body_timeout.as_millis() as u64,
        redis_timeout_ms = limits.redis_timeout.as_millis() as u64,
        "API listening"
    );
    Ok(())
}

/// The connection cap: a permit is taken before each accept, so that
/// beyond the cap new connections wait in the kernel's backlog rather than
/// being accepted with no descriptor left to serve them; it is held until
/// the connection closes.
struct Permits {
    permits: Arc<Semaphore>,
    cap: usize,
    /// Whether the cap was reached since a permit was last free at once:
    /// it is logged once each time.
    at_cap: bool,
}

impl Permits {
    fn new(cap: usize) -> Permits {
        Permits {
            permits: Arc::new(Semaphore::new(cap)),
            cap,
            at_cap: false,
        }
    }

    /// The next connection's permit, waiting for one to close at the cap;
    /// `None` once `shutdown` resolves first.
    async fn next(
        &mut self,
        shutdown: &mut Pin<&mut impl Future<Output = ()>>,
    ) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            self.at_cap = false;
            return Some(permit);
        }
        if !self.at_cap {
            self.at_cap = true;
            tracing::warn!(
                max_connections = self.cap,
                "connection cap reached: new connections wait until one closes"
            );
        }
        tokio::select! {
            () = shutdown => None,
            permit = self.permits.clone().acquire_owned() => permit.ok(),
        }
    }
}

/// An accept error: one connection's (it was reset before we took it) is
/// skipped; any other (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) is a
/// resource that may free up, so the loop pauses before trying again.
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset, Interrupted};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted
    ) {
        return;
    }
    tracing::warn!(error = %e, "accept failed; retrying");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// The connection cap in force: `configured`, but at most half the soft
/// file-descriptor limit (the other half is for Redis connections, module
/// files and the rest), and at least 1.
fn connection_cap(configured: usize, fd_soft_limit: Option<u64>) -> usize {
    let by_fds = fd_soft_limit.map_or(usize::MAX, |n| usize::try_from(n / 2).unwrap_or(usize::MAX));
    configured.min(by_fds).max(1)
}

/// The process's soft `RLIMIT_NOFILE`, if it has one.
#[cfg(unix)]
fn soft_fd_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one `rlimit` through the pointer, which
    // points at a local of that type, live for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not everywhere
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u64)
}

#[cfg(not(unix))]
fn soft_fd_limit() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_under_half_the_descriptor_limit() {
        assert_eq!(connection_cap(1024, None), 1024);
        assert_eq!(connection_cap(1024, Some(1024)), 512);
        assert_eq!(connection_cap(100, Some(1024)), 100);
        assert_eq!(connection_cap(1024, Some(64)), 32);
        assert_eq!(connection_cap(1024, Some(1)), 1);
        assert_eq!(connection_cap(0, None), 1);
    }

    #[test]
    fn this_process_has_a_descriptor_limit() {
        assert!(soft_fd_limit().is_none_or(|n| n > 0));
    }
}
