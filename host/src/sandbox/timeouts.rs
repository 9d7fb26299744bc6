//! A handler's own timeouts for one outbound request: the wasi:http
//! `request-options` it may pass to `outgoing-handler.handle`, honoured
//! when smaller than what the operator allows.
//!
//! | option | measured | the guest gets |
//! |---|---|---|
//! | `connect-timeout` | opening a new connection (none when a pooled one is reused) | `connection-timeout` |
//! | `first-byte-timeout` | from sending the request to its response head (a new connection's connect counts in) | `connection-read-timeout` |
//! | `between-bytes-timeout` | each wait for the next chunk of the response body | `connection-read-timeout` |
//!
//! The codes are those wasmtime-wasi-http's own client gives for the same
//! options, so a handler reads the same error whichever host runs it. Each
//! option is capped by the operator's `--http-timeout-ms` and the call's
//! deadline, which bound the whole request: an option at or over that
//! bound is dropped, and the request then ends as it would without it
//! (`connection-timeout` while connecting, else `HTTP-response-timeout`).
//! So a handler can try a slow service for a second and fall back, but
//! never wait longer than the operator allows.
//!
//! The connect timeout is applied in the client's connector (a layer of
//! its own, [`GuestConnect`]), which runs inside the request's future: a
//! task-local carries the request's timeout to it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt as _};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions};

tokio::task_local! {
    /// The connect timeout of the request being sent on this task.
    static CONNECT_TIMEOUT: Duration;
}

/// A handler's timeouts for one request, each under the operator's bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GuestTimeouts {
    /// Opening a new connection.
    pub(super) connect: Option<Duration>,
    /// Sending the request until its response head arrives.
    pub(super) first_byte: Option<Duration>,
    /// Each wait for the next chunk of the body.
    pub(super) between_bytes: Option<Duration>,
}

impl GuestTimeouts {
    /// The options a guest passed, each kept only when under `bound` (the
    /// operator's timeout or the call's remaining deadline, whichever is
    /// sooner): at or over it, the bound ends the request first.
    pub(super) fn under(options: Option<&RequestOptions>, bound: Duration) -> GuestTimeouts {
        let Some(options) = options else {
            return GuestTimeouts::default();
        };
        let under = |t: Option<Duration>| t.filter(|t| *t < bound);
        GuestTimeouts {
            connect: under(options.connect_timeout),
            first_byte: under(options.first_byte_timeout),
            between_bytes: under(options.between_bytes_timeout),
        }
    }
}

/// Send a request with `send`, under the guest's connect and first-byte
/// timeouts. When the first-byte timeout ends it: the error the guest
/// gets, and the option's name and value for the task log (a connect
/// timeout ends it through the connector, as a failed `send`).
pub(super) async fn send_within<F, T>(
    timeouts: GuestTimeouts,
    send: F,
) -> Result<T, (HttpError, &'static str, Duration)>
where
    F: Future<Output = T>,
{
    let send = async {
        match timeouts.connect {
            Some(connect) => CONNECT_TIMEOUT.scope(connect, send).await,
            None => send.await,
        }
    };
    match timeouts.first_byte {
        Some(first_byte) => tokio::time::timeout(first_byte, send).await.map_err(|_| {
            (
                HttpError::ConnectionReadTimeout,
                "first-byte-timeout",
                first_byte,
            )
        }),
        None => Ok(send.await),
    }
}

/// A connect the guest's `connect-timeout` ended: found in a failed
/// request's error chain, it becomes `connection-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no connection within the handler's connect-timeout of {} ms", .0.as_millis())]
pub(super) struct ConnectTimedOut(pub(super) Duration);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The connector layer that applies the connect timeout of the request
/// being sent ([`send_within`]); requests without one connect as before.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GuestConnect;

impl<S> tower_layer::Layer<S> for GuestConnect {
    type Service = GuestConnectService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GuestConnectService { inner }
    }
}

/// [`GuestConnect`] around the client's connector.
#[derive(Debug, Clone)]
pub(super) struct GuestConnectService<S> {
    inner: S,
}

impl<S, R> tower_service::Service<R> for GuestConnectService<S>
where
    S: tower_service::Service<R, Error = BoxError>,
    S::Future: Send + 'static,
    S::Response: 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, target: R) -> Self::Future {
        // The connector is called while the request's future is polled, so
        // the task-local is the request's (a connect that outlives it, in
        // the pool's background, keeps the timeout it started with).
        let timeout = CONNECT_TIMEOUT.try_with(|t| *t).ok();
        let connect = self.inner.call(target);
        Box::pin(async move {
            match timeout {
                Some(t) => match tokio::time::timeout(t, connect).await {
                    Ok(connected) => connected,
                    Err(_) => Err(Box::new(ConnectTimedOut(t)) as BoxError),
                },
                None => connect.await,
            }
        })
    }
}

/// `chunks`, ended with `connection-read-timeout` when the next chunk takes
/// longer than `gap` to come.
pub(super) fn with_gap<S>(
    chunks: S,
    gap: Duration,
) -> impl Stream<Item = Result<Bytes, HttpError>> + Send
where
    S: Stream<Item = Result<Bytes, HttpError>> + Send + Unpin,
{
    futures::stream::unfold(Some(chunks), move |chunks| async move {
        let mut chunks = chunks?;
        match tokio::time::timeout(gap, chunks.next()).await {
            Ok(Some(chunk)) => Some((chunk, Some(chunks))),
            Ok(None) => None,
            Err(_) => Some((Err(HttpError::ConnectionReadTimeout), None)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(connect: u64, first_byte: u64, between_bytes: u64) -> RequestOptions {
        RequestOptions {
            connect_timeout: Some(Duration::from_millis(connect)),
            first_byte_timeout: Some(Duration::from_millis(first_byte)),
            between_bytes_timeout: Some(Duration::from_millis(between_bytes)),
        }
    }

    #[test]
    fn a_guest_timeout_is_kept_only_under_the_operators() {
        let bound = Duration::from_millis(1_000);
        let kept = GuestTimeouts::under(Some(&options(100, 999, 1_000)), bound);
        assert_eq!(
            kept,
            GuestTimeouts {
                connect: Some(Duration::from_millis(100)),
                first_byte: Some(Duration::from_millis(999)),
                between_bytes: None,
            }
        );
        assert_eq!(
            GuestTimeouts::under(Some(&options(5_000, 5_000, 5_000)), bound),
            GuestTimeouts::default()
        );
        assert_eq!(GuestTimeouts::under(None, bound), GuestTimeouts::default());
    }

    #[tokio::test]
    async fn a_stalled_stream_ends_with_a_read_timeout() {
        let chunks = futures::stream::iter([Ok(Bytes::from_static(b"a"))])
            .chain(futures::stream::pending())
            .boxed();
        let got: Vec<_> = with_gap(chunks, Duration::from_millis(50)).collect().await;
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(matches!(got[1], Err(HttpError::ConnectionReadTimeout)));
    }

    #[tokio::test]
    async fn a_slow_send_ends_with_the_first_byte_timeout() {
        let timeouts = GuestTimeouts {
            first_byte: Some(Duration::from_millis(30)),
            ..GuestTimeouts::default()
        };
        let ended = send_within(timeouts, std::future::pending::<()>()).await;
        assert!(matches!(
            ended,
            Err((HttpError::ConnectionReadTimeout, "first-byte-timeout", _))
        ));
        let quick = send_within(timeouts, async { 7 }).await;
        assert!(matches!(quick, Ok(7)));
    }
}
