//! Outbound HTTP: `wasi:http/outgoing-handler` for handlers, sent by the
//! host's own client under the operator's allow-list.
//!
//! wasmtime-wasi-http implements the WIT resources; every request a guest
//! sends comes to [`OutboundHttp::send_request`], which decides:
//!
//! | check | otherwise |
//! |---|---|
//! | scheme, host and port match a pattern of the handler's [`AllowList`](super::AllowList) | `HTTP-request-denied`; nothing is sent |
//! | a host named by a hostname pattern resolves to public addresses only (loopback, private, link-local and the like need a pattern naming that address or `localhost`) | `destination-IP-prohibited` |
//! | at most [`Limits::max_http_requests`] requests per call, counted with the other host calls | `connection-limit-reached` |
//! | request body at most [`Limits::max_payload_bytes`] | `HTTP-request-body-size` |
//! | the response within [`Limits::http_timeout`] and the call's deadline | `connection-timeout` / `HTTP-response-timeout` |
//! | the handler's own `request-options` (connect, first byte, between bytes), where smaller (`timeouts.rs`) | `connection-timeout` / `connection-read-timeout` |
//! | response body at most [`Limits::max_http_response_bytes`] | `HTTP-response-body-size` (at once when `Content-Length` says so, else when the body crosses it) |
//!
//! Redirects are not followed (a guest sees the 3xx and may ask for the new
//! location, which the allow-list checks again), and no proxy is used. A
//! request made inside an idempotent operation carries `Idempotency-Key`, a
//! keyed digest of the handler's namespace and the operation's key: what
//! names the operation's claim (`fleet_secret.rs`). It is the same on every
//! retry and redelivery, and in whichever task runs the operation (one that
//! takes over the claim of a task that died mid-request included), so a
//! downstream service that honours the header applies the effect once; and
//! no other handler can compute it. A guest that sets the header itself
//! keeps its own, unless it starts with the host's `dtq-`: that request is
//! denied, so no handler can send a key the host made for another
//! namespace. Traced (see [`crate::telemetry`]), each request is a span,
//! a child of the attempt's, and carries its `traceparent` downstream
//! unless the handler set one. Each request is one line of the
//! task log: method, scheme, host and port, status or error, duration; never
//! a path, a header or a body. Cancelling or interrupting the call drops the
//! requests in flight with its store.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use http::header::{CONTENT_LENGTH, HOST, HeaderName};
use http_body_util::{BodyExt as _, Limited, StreamBody};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpHooks};

use super::allow::{default_port, is_public};
use super::call::LoadedHandler;
use super::fleet_secret::{self, FleetSecret};
use super::log::TaskLog;
use super::timeouts::{self, ConnectTimedOut, GuestConnect, GuestTimeouts};
use crate::telemetry;
use tracing::{Instrument as _, Span};

/// The header a request inside an idempotent operation carries.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A host name that resolved to no public address.
#[derive(Debug, thiserror::Error)]
#[error("{0} resolves to no public address")]
struct NotPublic(String);

/// Resolves host names, keeping only public addresses.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await?
                .filter(|addr| is_public(addr.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(Box::new(NotPublic(name)) as _);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The host's HTTP clients, shared by every call of a sandbox: connection
/// pools, TLS with the system's roots, no redirects, no proxy; and the
/// secret that keys the `Idempotency-Key`s they send.
#[derive(Clone)]
pub(crate) struct Clients {
    /// For hosts a hostname pattern allows: public addresses only.
    public: reqwest::Client,
    /// For hosts a pattern names (an address, `localhost`).
    named: reqwest::Client,
    secret: Arc<FleetSecret>,
}

impl Clients {
    pub(crate) fn new(secret: FleetSecret) -> Result<Clients, reqwest::Error> {
        let builder = || {
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .pool_idle_timeout(Duration::from_secs(60))
                .user_agent(concat!("dtq/", env!("CARGO_PKG_VERSION")))
                .connector_layer(GuestConnect)
        };
        Ok(Clients {
            public: builder().dns_resolver(Arc::new(PublicOnly)).build()?,
            named: builder().build()?,
            secret: Arc::new(secret),
        })
    }
}

/// One call's outbound HTTP: the hooks wasmtime-wasi-http sends through.
pub(crate) struct OutboundHttp {
    /// The handler called: its HTTP clients, allow-list, limits, and the
    /// namespace that with an operation's key makes its `Idempotency-Key`.
    handler: Arc<LoadedHandler>,
    log: TaskLog,
    deadline_at: Instant,
    /// Requests sent; shared with the other host imports' count.
    requests: Arc<AtomicU64>,
    /// Host calls of the other imports so far (set before each use).
    pub(crate) other_calls: u64,
    /// The key of the idempotent operation open now (set before each use).
    pub(crate) operation: Option<String>,
    /// The first request the allow-list denied (`GET https://host:443`):
    /// it makes the call's retryable end fatal ([`Outcome::after_denial`]).
    ///
    /// [`Outcome::after_denial`]: super::Outcome::after_denial
    pub(crate) denied: Option<String>,
}

impl OutboundHttp {
    pub(crate) fn new(
        handler: Arc<LoadedHandler>,
        log: TaskLog,
        deadline_at: Instant,
        requests: Arc<AtomicU64>,
    ) -> Self {
        OutboundHttp {
            handler,
            log,
            deadline_at,
            requests,
            other_calls: 0,
            operation: None,
            denied: None,
        }
    }

    /// Check `request` and build what sends it, with the target as the log
    /// names it (`GET https://host:443`) and the operation whose key it is
    /// to carry (none when outside one or the guest set its own); the error
    /// goes to the guest, and is logged.
    fn prepare(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<&RequestOptions>,
    ) -> Result<Prepared, HttpError> {
        let uri = request.uri();
        let scheme = uri.scheme_str().unwrap_or("https").to_ascii_lowercase();
        let host = uri.host().unwrap_or_default().to_owned();
        let port = uri.port_u16().unwrap_or_else(|| default_port(&scheme));
        let target = format!("{} {scheme}://{host}:{port}", request.method());
        let handler = &*self.handler;
        let Some(named) = handler.allow.allows(&scheme, &host, port) else {
            self.log.line([
                "[dtq] http: ",
                &target,
                " denied: not in this handler's allow-list (deploy setting allow_hosts)",
            ]);
            self.denied.get_or_insert(target);
            return Err(HttpError::HttpRequestDenied);
        };
        let sent = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if sent > handler.limits.max_http_requests
            || sent + self.other_calls > handler.limits.max_host_calls
        {
            self.log.line([
                "[dtq] http: ",
                &target,
                " refused: the call has made its limit of requests",
            ]);
            return Err(HttpError::ConnectionLimitReached);
        }
        let timeout = handler
            .limits
            .http_timeout
            .min(self.deadline_at.saturating_duration_since(Instant::now()));
        if timeout.is_zero() {
            return Err(HttpError::ConnectionTimeout);
        }
        let guest_timeouts = GuestTimeouts::under(options, timeout);

        let (parts, body) = request.into_parts();
        let mut headers = parts.headers;
        // The client writes Host itself.
        headers.remove(HOST);
        let own_keys = headers.get_all(IDEMPOTENCY_KEY);
        if own_keys
            .iter()
            .any(|key| fleet_secret::is_host_key(key.as_bytes()))
        {
            self.log.line([
                "[dtq] http: ",
                &target,
                " denied: an Idempotency-Key starting with \"dtq-\" is the host's to set",
            ]);
            return Err(HttpError::HttpRequestDenied);
        }
        let operation = self
            .operation
            .clone()
            .filter(|_| !headers.contains_key(IDEMPOTENCY_KEY));
        let client = if named {
            &handler.http.named
        } else {
            &handler.http.public
        };
        let span = request_span(&parts.method, &scheme, &host, port, &mut headers);
        let url = parts.uri.to_string();
        let builder = client
            .request(parts.method, url)
            .headers(headers)
            .timeout(timeout);
        Ok(Prepared {
            target,
            builder,
            body,
            operation,
            timeouts: guest_timeouts,
            span,
        })
    }
}

/// The span of one outbound request, traced (see [`crate::telemetry`]): a
/// child of the attempt's, its `traceparent` added to `headers` unless the
/// handler set one. `Span::none()` when tracing is off.
fn request_span(
    method: &http::Method,
    scheme: &str,
    host: &str,
    port: u16,
    headers: &mut http::HeaderMap,
) -> Span {
    if !telemetry::enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(target: telemetry::TARGET, "http_request",
        otel.name = %method, otel.kind = "client", http.request.method = %method,
        url.scheme = %scheme, server.address = %host, server.port = port,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty, trace_id = tracing::field::Empty);
    telemetry::adopt(&span, None);
    telemetry::inject(&span, headers);
    span
}

/// A request checked and ready to send.
struct Prepared {
    /// As the log names it: `GET https://host:443`.
    target: String,
    builder: reqwest::RequestBuilder,
    body: WasiBody,
    /// The operation whose `Idempotency-Key` it is to carry.
    operation: Option<String>,
    /// The handler's own timeouts, those under the operator's.
    timeouts: GuestTimeouts,
    /// Its span, when traced.
    span: Span,
}

/// Add the `Idempotency-Key` of `operation` of `handler`'s namespace; the
/// fleet secret may first have to be read from Redis. Without it the
/// request is not sent: sent without its key, it could apply twice.
async fn with_key(
    builder: reqwest::RequestBuilder,
    handler: &LoadedHandler,
    operation: &str,
    log: &TaskLog,
    target: &str,
) -> Result<reqwest::RequestBuilder, HttpError> {
    let mut redis = handler.redis.clone();
    let secret = &handler.http.secret;
    match secret
        .idempotency_key(&mut redis, &handler.namespace, operation)
        .await
    {
        Ok(key) => Ok(builder.header(IDEMPOTENCY_KEY, key)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the fleet secret");
            log.line([
                "[dtq] http: ",
                target,
                " not sent: its Idempotency-Key could not be made (Redis unavailable)",
            ]);
            Err(HttpError::InternalError(Some(
                "the host could not make the request's Idempotency-Key".into(),
            )))
        }
    }
}

/// The error of type `T` in `e`'s chain of causes, if there is one.
fn cause<T: std::error::Error + 'static>(e: &reqwest::Error) -> Option<&T> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(found) = err.downcast_ref::<T>() {
            return Some(found);
        }
        source = err.source();
    }
    None
}

/// A reqwest error as the wasi:http error a guest gets.
fn guest_error(e: &reqwest::Error) -> HttpError {
    if cause::<NotPublic>(e).is_some() {
        return HttpError::DestinationIpProhibited;
    }
    if cause::<ConnectTimedOut>(e).is_some() {
        return HttpError::ConnectionTimeout;
    }
    if e.is_timeout() {
        if e.is_connect() {
            HttpError::ConnectionTimeout
        } else {
            HttpError::HttpResponseTimeout
        }
    } else if e.is_connect() {
        HttpError::ConnectionRefused
    } else {
        HttpError::HttpProtocolError
    }
}

impl WasiHttpHooks for OutboundHttp {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _body_sent: Box<dyn Future<Output = Result<(), HttpError>> + Send>,
    ) -> Box<
        dyn Future<
                Output = Result<
                    (
                        http::Response<WasiBody>,
                        Box<dyn Future<Output = Result<(), HttpError>> + Send>,
                    ),
                    HttpError,
                >,
            > + Send,
    > {
        let started = Instant::now();
        let prepared = self.prepare(request, options.as_ref());
        let span = match &prepared {
            Ok(prepared) => prepared.span.clone(),
            Err(_) => Span::none(),
        };
        let traced = span.clone();
        let log = self.log.clone();
        let handler = self.handler.clone();
        // wasmtime-wasi-http runs it on a task of its own: the span goes
        // with it.
        Box::new(
            async move {
                let response = send(prepared?, &handler, &log, started).await;
                if !traced.is_none() {
                    record_result(&traced, &response);
                }
                let io: Box<dyn Future<Output = Result<(), HttpError>> + Send> =
                    Box::new(async { Ok(()) });
                Ok((response?, io))
            }
            .instrument(span),
        )
    }
}

/// Record how a traced request ended in its `span`.
fn record_result(span: &Span, response: &Result<http::Response<WasiBody>, HttpError>) {
    match response {
        Ok(response) => span.record("http.response.status_code", response.status().as_u16()),
        Err(_) => span.record("otel.status_code", "ERROR"),
    };
}

/// Send `prepared` for `handler` (with its operation's `Idempotency-Key`,
/// its body within the payload limit), log its status or error, and
/// return the response as the guest reads it.
async fn send(
    prepared: Prepared,
    handler: &LoadedHandler,
    log: &TaskLog,
    started: Instant,
) -> Result<http::Response<WasiBody>, HttpError> {
    let Prepared {
        target,
        mut builder,
        body,
        operation,
        timeouts,
        span: _,
    } = prepared;
    if let Some(operation) = operation {
        builder = with_key(builder, handler, &operation, log, &target).await?;
    }
    let body = Limited::new(body, handler.limits.max_payload_bytes)
        .collect()
        .await
        .map_err(|_| HttpError::HttpRequestBodySize(None))?
        .to_bytes();
    let response = match timeouts::send_within(timeouts, builder.body(body).send()).await {
        Ok(Ok(response)) => response,
        Err((error, option, value)) => {
            let ms = started.elapsed().as_millis().to_string();
            let value = value.as_millis().to_string();
            log.line([
                "[dtq] http: ",
                &target,
                " failed: no response within the handler's ",
                option,
                " of ",
                &value,
                " ms (",
                &ms,
                " ms)",
            ]);
            return Err(error);
        }
        Ok(Err(e)) => {
            let error = guest_error(&e);
            let ms = started.elapsed().as_millis().to_string();
            // The handler's own timeout says itself; reqwest's text would
            // name only the URL.
            let why = cause::<ConnectTimedOut>(&e).map_or_else(|| e.to_string(), |t| t.to_string());
            log.line([
                "[dtq] http: ",
                &target,
                " failed: ",
                &why,
                " (",
                &ms,
                " ms)",
            ]);
            return Err(error);
        }
    };
    let ms = started.elapsed().as_millis().to_string();
    log.line([
        "[dtq] http: ",
        &target,
        " -> ",
        response.status().as_str(),
        " (",
        &ms,
        " ms)",
    ]);
    guest_response(
        response,
        handler.limits.max_http_response_bytes,
        timeouts.between_bytes,
        log,
        &target,
    )
}

/// `response` as the guest reads it: refused at once when its
/// `Content-Length` is over `max_response`, else its body streamed and
/// failed when it crosses `max_response`, or when its next chunk takes
/// longer than the handler's `between_bytes` timeout.
fn guest_response(
    response: reqwest::Response,
    max_response: usize,
    between_bytes: Option<Duration>,
    log: &TaskLog,
    target: &str,
) -> Result<http::Response<WasiBody>, HttpError> {
    let declared = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_response as u64) {
        log.line(["[dtq] http: ", target, " response body over the limit"]);
        return Err(HttpError::HttpResponseBodySize(Some(max_response as u64)));
    }
    let mut builder = http::Response::builder().status(response.status());
    if let Some(headers) = builder.headers_mut() {
        *headers = response.headers().clone();
    }
    let chunks = response
        .bytes_stream()
        .map(|chunk| chunk.map_err(|e| guest_error(&e)))
        .boxed();
    let chunks = match between_bytes {
        Some(gap) => {
            let (log, target) = (log.clone(), target.to_owned());
            timeouts::with_gap(chunks, gap)
                .inspect(move |chunk| {
                    if let Err(HttpError::ConnectionReadTimeout) = chunk {
                        let ms = gap.as_millis().to_string();
                        log.line([
                            "[dtq] http: ",
                            &target,
                            " body stalled: no bytes within the handler's between-bytes-timeout of ",
                            &ms,
                            " ms",
                        ]);
                    }
                })
                .boxed()
        }
        None => chunks,
    };
    let mut seen = 0usize;
    let stream = chunks.map(move |chunk| {
        let chunk: Bytes = chunk?;
        seen += chunk.len();
        if seen > max_response {
            return Err(HttpError::HttpResponseBodySize(Some(max_response as u64)));
        }
        Ok(hyper::body::Frame::data(chunk))
    });
    builder
        .body(StreamBody::new(stream).boxed_unsync())
        .map_err(|e| HttpError::InternalError(Some(e.to_string())))
}
