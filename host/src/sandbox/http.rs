//! Outbound HTTP: `wasi:http/outgoing-handler` for handlers, sent by the
//! host's own client under the operator's allow-list.
//!
//! wasmtime-wasi-http implements the WIT resources; every request a guest
//! sends comes to [`OutboundHttp::send_request`], which decides:
//!
//! | check | otherwise |
//! |---|---|
//! | scheme, host and port match a pattern of the handler's [`AllowList`] | `HTTP-request-denied`; nothing is sent |
//! | a host named by a hostname pattern resolves to public addresses only (loopback, private, link-local and the like need a pattern naming that address or `localhost`) | `destination-IP-prohibited` |
//! | at most [`Limits::max_http_requests`] requests per call, counted with the other host calls | `connection-limit-reached` |
//! | request body at most [`Limits::max_payload_bytes`] | `HTTP-request-body-size` |
//! | the response within [`Limits::http_timeout`] and the call's deadline | `connection-timeout` / `HTTP-response-timeout` |
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
//! namespace. Each request is one line of the
//! task log: method, scheme, host and port, status or error, duration; never
//! a path, a header or a body. Cancelling or interrupting the call drops the
//! requests in flight with its store.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use http::header::{CONTENT_LENGTH, HOST, HeaderName};
use http_body_util::{BodyExt as _, Limited, StreamBody};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpHooks};

use super::call::LoadedHandler;
use super::fleet_secret::{self, FleetSecret};
use super::log::TaskLog;

/// The header a request inside an idempotent operation carries.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Which scheme a pattern allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SchemeMatch {
    Http,
    Https,
    Any,
}

/// Which hosts a pattern allows.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatch {
    /// One host name (lowercase).
    Name(String),
    /// Every host under a domain: `*.example.com` is stored as
    /// `.example.com`.
    Suffix(String),
    /// One address, written as such.
    Ip(IpAddr),
}

/// Which ports a pattern allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PortMatch {
    /// No port in the pattern: the scheme's own (80, 443).
    Default,
    /// `:*`.
    Any,
    /// `:<n>`.
    Exact(u16),
}

/// One `scheme://host[:port]` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostPattern {
    scheme: SchemeMatch,
    host: HostMatch,
    port: PortMatch,
    text: String,
}

/// The hosts one handler may send requests to: patterns of the form
/// `scheme://host[:port]`, where the scheme is `http`, `https` or `*`, the
/// host a name, `*.domain` (every name under it), or an address (`[...]` for
/// IPv6), and the port a number or `*` (absent: the scheme's default).
///
/// A host name is reached only at public addresses; a loopback, private or
/// link-local address must be named by the pattern itself (an address, or
/// `localhost`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    patterns: Vec<HostPattern>,
}

/// A pattern that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allow-list pattern {pattern:?}: {reason}")]
pub struct PatternError {
    pattern: String,
    reason: &'static str,
}

impl AllowList {
    /// Parse comma-separated patterns (blanks around them ignored).
    pub fn parse(text: &str) -> Result<AllowList, PatternError> {
        let patterns = text
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(HostPattern::parse)
            .collect::<Result<_, _>>()?;
        Ok(AllowList { patterns })
    }

    /// This list with `other`'s patterns too.
    pub fn extend(&mut self, other: AllowList) {
        self.patterns.extend(other.patterns);
    }

    /// Whether no host is allowed.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The first pattern of `other` that allows a request this list does
    /// not; `None` when this list allows everything `other` does. An API
    /// token's deploy grant uses it to bound the allow-lists it may give.
    ///
    /// Decided per pattern, conservatively: a pattern is covered by one
    /// pattern of this list whose scheme, port and host each take in its
    /// own (`*://` takes either scheme, `:*` every port, `*.example.com`
    /// every name under it, `*.a.example.com` included; an address or a
    /// name only itself).
    pub fn uncovered<'a>(&self, other: &'a AllowList) -> Option<&'a str> {
        other
            .patterns
            .iter()
            .find(|p| !self.patterns.iter().any(|mine| mine.covers(p)))
            .map(|p| p.text.as_str())
    }

    /// The decision for a request to `scheme://host:port`; `None` when no
    /// pattern allows it. `Some(true)` when the matching pattern names the
    /// address (so it may be a private one).
    fn allows(&self, scheme: &str, host: &str, port: u16) -> Option<bool> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip: Option<IpAddr> = host.parse().ok();
        let host = host.to_ascii_lowercase();
        self.patterns.iter().find_map(|p| {
            let scheme_ok = match p.scheme {
                SchemeMatch::Any => scheme == "http" || scheme == "https",
                SchemeMatch::Http => scheme == "http",
                SchemeMatch::Https => scheme == "https",
            };
            let port_ok = match p.port {
                PortMatch::Any => true,
                PortMatch::Default => port == default_port(scheme),
                PortMatch::Exact(want) => port == want,
            };
            let (host_ok, explicit) = match (&p.host, ip) {
                (HostMatch::Ip(want), Some(ip)) => (*want == ip, true),
                (HostMatch::Ip(_), None) | (_, Some(_)) => (false, false),
                (HostMatch::Name(name), None) => (*name == host, name == "localhost"),
                (HostMatch::Suffix(suffix), None) => (host.ends_with(suffix.as_str()), false),
            };
            (scheme_ok && port_ok && host_ok).then_some(explicit)
        })
    }
}

impl fmt::Display for AllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let texts: Vec<&str> = self.patterns.iter().map(|p| p.text.as_str()).collect();
        f.write_str(&texts.join(","))
    }
}

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" { 443 } else { 80 }
}

impl HostPattern {
    /// Whether every request `other` allows, this pattern allows too.
    fn covers(&self, other: &HostPattern) -> bool {
        let scheme = self.scheme == SchemeMatch::Any || self.scheme == other.scheme;
        let port = self.port == PortMatch::Any || self.port == other.port;
        let host = match (&self.host, &other.host) {
            (HostMatch::Suffix(mine), HostMatch::Name(name) | HostMatch::Suffix(name)) => {
                name.ends_with(mine.as_str())
            }
            (mine, theirs) => mine == theirs,
        };
        scheme && port && host
    }

    fn parse(text: &str) -> Result<HostPattern, PatternError> {
        let error = |reason| PatternError {
            pattern: text.to_owned(),
            reason,
        };
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| error("start it with http://, https:// or *://"))?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => SchemeMatch::Http,
            "https" => SchemeMatch::Https,
            "*" => SchemeMatch::Any,
            _ => return Err(error("the scheme must be http, https or *")),
        };
        if rest.contains(['/', '?', '#', '@']) {
            return Err(error("give a scheme, a host and a port only, no path"));
        }
        // `[v6]:port`, `[v6]`, `host:port`, `host`.
        let (host, port) = match rest.strip_prefix('[') {
            Some(v6) => {
                let (addr, after) = v6
                    .split_once(']')
                    .ok_or_else(|| error("an IPv6 address needs its closing ]"))?;
                let port = match after {
                    "" => None,
                    p => Some(p.strip_prefix(':').ok_or_else(|| error("bad port"))?),
                };
                (addr, port)
            }
            None => match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            },
        };
        let port = match port {
            None => PortMatch::Default,
            Some("*") => PortMatch::Any,
            Some(p) => PortMatch::Exact(
                p.parse::<u16>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| error("the port must be 1 to 65535 or *"))?,
            ),
        };
        let host = if let Ok(ip) = host.parse::<IpAddr>() {
            HostMatch::Ip(ip)
        } else if let Some(domain) = host.strip_prefix("*.") {
            if !valid_name(domain) {
                return Err(error("not a host name after *."));
            }
            HostMatch::Suffix(format!(".{}", domain.to_ascii_lowercase()))
        } else if valid_name(host) {
            HostMatch::Name(host.to_ascii_lowercase())
        } else {
            return Err(error(
                "not a host name or an address (a bare * is not allowed)",
            ));
        };
        Ok(HostPattern {
            scheme,
            host,
            port,
            text: text.to_owned(),
        })
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Whether `ip` is an address on the public internet: not loopback,
/// private, link-local (cloud metadata services live there), shared
/// (CGNAT), unspecified, multicast, broadcast or documentation.
fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
    }
}

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
    fn prepare(&mut self, request: http::Request<WasiBody>) -> Result<Prepared, HttpError> {
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
        })
    }
}

/// A request checked and ready to send.
struct Prepared {
    /// As the log names it: `GET https://host:443`.
    target: String,
    builder: reqwest::RequestBuilder,
    body: WasiBody,
    /// The operation whose `Idempotency-Key` it is to carry.
    operation: Option<String>,
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

/// A reqwest error as the wasi:http error a guest gets.
fn guest_error(e: &reqwest::Error) -> HttpError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.is::<NotPublic>() {
            return HttpError::DestinationIpProhibited;
        }
        source = err.source();
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
        _options: Option<RequestOptions>,
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
        let prepared = self.prepare(request);
        let log = self.log.clone();
        let max_request = self.handler.limits.max_payload_bytes;
        let max_response = self.handler.limits.max_http_response_bytes;
        let handler = self.handler.clone();
        Box::new(async move {
            let Prepared {
                target,
                mut builder,
                body,
                operation,
            } = prepared?;
            if let Some(operation) = operation {
                builder = with_key(builder, &handler, &operation, &log, &target).await?;
            }
            let body = Limited::new(body, max_request)
                .collect()
                .await
                .map_err(|_| HttpError::HttpRequestBodySize(None))?
                .to_bytes();
            let response = match builder.body(body).send().await {
                Ok(response) => response,
                Err(e) => {
                    let error = guest_error(&e);
                    let ms = started.elapsed().as_millis().to_string();
                    log.line([
                        "[dtq] http: ",
                        &target,
                        " failed: ",
                        &e.to_string(),
                        " (",
                        &ms,
                        " ms)",
                    ]);
                    return Err(error);
                }
            };
            let status = response.status();
            let ms = started.elapsed().as_millis().to_string();
            log.line([
                "[dtq] http: ",
                &target,
                " -> ",
                status.as_str(),
                " (",
                &ms,
                " ms)",
            ]);
            let declared = response
                .headers()
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > max_response as u64) {
                log.line(["[dtq] http: ", &target, " response body over the limit"]);
                return Err(HttpError::HttpResponseBodySize(Some(max_response as u64)));
            }
            let mut builder = http::Response::builder().status(status);
            if let Some(headers) = builder.headers_mut() {
                *headers = response.headers().clone();
            }
            let mut seen = 0usize;
            let stream = response.bytes_stream().map(move |chunk| {
                let chunk: Bytes = chunk.map_err(|e| guest_error(&e))?;
                seen += chunk.len();
                if seen > max_response {
                    return Err(HttpError::HttpResponseBodySize(Some(max_response as u64)));
                }
                Ok(hyper::body::Frame::data(chunk))
            });
            let body = StreamBody::new(stream).boxed_unsync();
            let response = builder
                .body(body)
                .map_err(|e| HttpError::InternalError(Some(e.to_string())))?;
            let io: Box<dyn Future<Output = Result<(), HttpError>> + Send> =
                Box::new(async { Ok(()) });
            Ok((response, io))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(list: &str, scheme: &str, host: &str, port: u16) -> Option<bool> {
        AllowList::parse(list)
            .expect("parses")
            .allows(scheme, host, port)
    }

    #[test]
    fn a_list_covers_the_patterns_it_takes_in_and_names_the_first_it_does_not() {
        let list = |text| AllowList::parse(text).expect("parses");
        let grant = list("https://*.example.com, *://10.0.0.1:*, http://localhost:8080");
        for inside in [
            "https://api.example.com",
            "https://*.a.example.com",
            "http://10.0.0.1:9000, https://10.0.0.1",
            "http://localhost:8080",
            "",
        ] {
            assert_eq!(grant.uncovered(&list(inside)), None, "{inside}");
        }
        for (outside, named) in [
            (
                "https://api.example.com, http://api.example.com",
                "http://api.example.com",
            ),
            ("https://example.com", "https://example.com"),
            (
                "https://api.example.com:8443",
                "https://api.example.com:8443",
            ),
            ("http://10.0.0.2:80", "http://10.0.0.2:80"),
            ("http://localhost:*", "http://localhost:*"),
            ("*://*.example.com", "*://*.example.com"),
        ] {
            assert_eq!(grant.uncovered(&list(outside)), Some(named), "{outside}");
        }
    }

    #[test]
    fn patterns_match_scheme_host_and_port() {
        let list = "https://api.example.com, http://127.0.0.1:*, *://*.corp.example:8443";
        assert_eq!(allows(list, "https", "api.example.com", 443), Some(false));
        assert_eq!(allows(list, "https", "API.Example.com", 443), Some(false));
        assert_eq!(allows(list, "http", "api.example.com", 80), None, "scheme");
        assert_eq!(allows(list, "https", "api.example.com", 8443), None, "port");
        assert_eq!(allows(list, "https", "evil.example.com", 443), None);
        assert_eq!(allows(list, "http", "127.0.0.1", 9999), Some(true));
        assert_eq!(allows(list, "http", "127.0.0.2", 9999), None);
        assert_eq!(allows(list, "http", "a.b.corp.example", 8443), Some(false));
        assert_eq!(
            allows(list, "https", "corp.example", 8443),
            None,
            "not under"
        );
        assert_eq!(
            allows("http://[::1]:8080", "http", "[::1]", 8080),
            Some(true)
        );
        assert_eq!(
            allows("http://localhost:*", "http", "localhost", 1),
            Some(true)
        );
        // A name pattern never matches an address that happens to end
        // like it.
        assert_eq!(allows("http://*.1:*", "http", "127.0.0.1", 80), None);
        assert_eq!(allows("", "https", "api.example.com", 443), None);
    }

    #[test]
    fn bad_patterns_say_why() {
        for bad in [
            "api.example.com",
            "ftp://x.example",
            "https://x.example/path",
            "https://*",
            "https://x.example:0",
            "https://x.example:http",
            "https://user@x.example",
            "http://[::1",
        ] {
            assert!(AllowList::parse(bad).is_err(), "{bad} accepted");
        }
        let list = AllowList::parse(" https://a.example , http://10.0.0.1:81 ").expect("parses");
        assert_eq!(list.to_string(), "https://a.example,http://10.0.0.1:81");
    }

    #[test]
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            let ip: IpAddr = private.parse().expect("an address");
            assert!(!is_public(ip), "{private} counted as public");
        }
        for public in ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"] {
            let ip: IpAddr = public.parse().expect("an address");
            assert!(is_public(ip), "{public} counted as private");
        }
    }
}
