//! Outbound HTTP: a small blocking client on `wasi:http/outgoing-handler`.
//!
//! ```no_run
//! use dtq_guest::http;
//! use serde_json::{Value, json};
//!
//! # fn run() -> dtq_guest::Result<()> {
//! let rates: Value = http::get("https://rates.example.com/eur")?.error_for_status()?.json()?;
//! let reply = http::post_json("https://api.example.com/orders", &json!({"id": "A-1"}))?;
//! if !reply.is_success() {
//!     dtq_guest::retry!("order service answered {}", reply.status);
//! }
//! # let _ = rates; Ok(()) }
//! ```
//!
//! A handler that never calls this module does not import `wasi:http` at
//! all: the component only imports what its code uses.
//!
//! # What the host allows
//!
//! The operator decides which hosts a handler may call: the deploy setting
//! `allow_hosts` (patterns such as `https://api.example.com` or
//! `http://127.0.0.1:*`), or `dtq serve --allow-host TASK=PATTERN` for
//! handlers run from a `--handlers` directory. A request to any other scheme,
//! host or port is not sent; [`Request::send`] returns an error that names
//! the origin and the setting. The host also bounds every request:
//!
//! | limit | set by | the error |
//! |---|---|---|
//! | requests per attempt | `--http-max-requests` | "… refused: this attempt has made as many requests as the host allows" |
//! | time per request (also capped by the task's remaining deadline) | `--http-timeout-ms` | "… timed out …" |
//! | response body size | `--http-max-response-bytes` | "response from … cut off: its body is over the host's limit of N bytes …" |
//!
//! Cancelling the task, or its deadline, drops a request in flight. Every
//! request is written to the task log (method, origin, status, duration;
//! never bodies or headers).
//!
//! # Errors
//!
//! A request that cannot be sent as written (a URL that does not parse, a
//! header the host forbids, a body that does not serialize) is a fatal
//! [`Error`]: sending it again cannot help. Every other failure (denied,
//! refused, timed out, cut off) is retryable. A response is not an error
//! whatever its status; [`Response::error_for_status`] makes one of a
//! non-2xx status.
//!
//! A request that timed out or lost its connection may or may not have been
//! acted on by the server. Inside an idempotent operation that is what the
//! `Idempotency-Key` below is for.
//!
//! # Idempotency keys
//!
//! A request sent inside an [idempotent operation](crate::idempotency)
//! carries the header `Idempotency-Key`, added by the host: a key derived
//! from the task's queue, the task's submission idempotency key (or else its
//! id) and the operation's key. It is the same on every retry and
//! redelivery of that operation of that task, and differs between
//! operations and between tasks. A server that honours the header (most
//! payment APIs do) then acts on the request once, however often the
//! operation runs: the operation's claim makes the effect at most once, the
//! key makes a repeat that the claim lets through (an attempt that died
//! after sending) harmless.
//!
//! A handler that needs another key (the one a downstream API documents,
//! say a hash of the order) sets the header itself with
//! [`Request::idempotency_key`] or [`Request::header`]; the host then sends
//! the handler's value untouched. Outside an operation the host adds no
//! header.
//!
//! ```no_run
//! use dtq_guest::http::{self, Method, Request};
//! use dtq_guest::idempotent_operation;
//! use serde_json::{Value, json};
//!
//! # fn run() -> dtq_guest::Result<()> {
//! // The host sends the same Idempotency-Key on every retry of this operation.
//! let (_, charge) = idempotent_operation("charge:A-1", 86_400, || {
//!     let body = json!({"order_id": "A-1", "amount_cents": 1999});
//!     http::post_json("https://pay.example.com/charges", &body)?
//!         .error_for_status()?
//!         .json::<Value>()
//! })?;
//!
//! // A key of the handler's own choosing, sent as is.
//! let refund = Request::new(Method::Post, "https://pay.example.com/refunds")
//!     .idempotency_key("refund-A-1")
//!     .json(&json!({"order_id": "A-1"}))
//!     .send()?;
//! # let _ = (charge, refund); Ok(()) }
//! ```

use core::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;
use wasi::http::outgoing_handler;
use wasi::http::types::{
    ErrorCode, Fields, IncomingBody, IncomingResponse, Method as WasiMethod, OutgoingBody,
    OutgoingRequest, Scheme,
};
use wasi::io::streams::{InputStream, StreamError};

use crate::{Error, Result};

/// The header the host adds inside an idempotent operation.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The most bytes asked of the response stream in one read.
const READ_CHUNK: u64 = 64 * 1024;

/// The most bytes `blocking-write-and-flush` takes in one call.
const WRITE_CHUNK: usize = 4096;

/// Send `GET url`.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let page = dtq_guest::http::get("https://example.com/")?;
/// dtq_guest::log::info(format!("{} bytes", page.body.len()));
/// # Ok(()) }
/// ```
pub fn get(url: impl Into<String>) -> Result<Response> {
    Request::new(Method::Get, url).send()
}

/// Send `POST url` with `body` as JSON (`Content-Type: application/json`).
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let body = serde_json::json!({"to": "ada@example.com"});
/// let sent = dtq_guest::http::post_json("https://mail.example.com/emails", &body)?;
/// assert!(sent.is_success());
/// # Ok(()) }
/// ```
pub fn post_json<T: Serialize + ?Sized>(url: impl Into<String>, body: &T) -> Result<Response> {
    Request::new(Method::Post, url).json(body).send()
}

/// An HTTP method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Method {
    /// `GET`
    Get,
    /// `HEAD`
    Head,
    /// `POST`
    Post,
    /// `PUT`
    Put,
    /// `PATCH`
    Patch,
    /// `DELETE`
    Delete,
    /// `OPTIONS`
    Options,
}

impl Method {
    fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
            Method::Options => "OPTIONS",
        }
    }

    fn to_wasi(self) -> WasiMethod {
        match self {
            Method::Get => WasiMethod::Get,
            Method::Head => WasiMethod::Head,
            Method::Post => WasiMethod::Post,
            Method::Put => WasiMethod::Put,
            Method::Patch => WasiMethod::Patch,
            Method::Delete => WasiMethod::Delete,
            Method::Options => WasiMethod::Options,
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request being built; [`Request::send`] sends it.
///
/// Mistakes in building it (a header the host forbids, a body that does not
/// serialize) are reported by `send`, as fatal errors.
///
/// ```no_run
/// use dtq_guest::http::{Method, Request};
///
/// # fn run() -> dtq_guest::Result<()> {
/// let reply = Request::new(Method::Put, "https://api.example.com/users/7")
///     .header("Authorization", "Bearer not-a-secret")
///     .json(&serde_json::json!({"name": "Ada"}))
///     .send()?
///     .error_for_status()?;
/// # let _ = reply; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Request {
    method: Method,
    url: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
    /// The first mistake made while building, reported by `send`.
    invalid: Option<String>,
}

impl Request {
    /// A request of `method` to `url` (`http://` or `https://`), with no
    /// headers and no body.
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Request {
            method,
            url: url.into(),
            headers: Vec::new(),
            body: None,
            invalid: None,
        }
    }

    /// Add the header `name: value` (a repeated name is sent repeated).
    pub fn header(mut self, name: impl Into<String>, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.into(), value.as_ref().to_vec()));
        self
    }

    /// Send `Idempotency-Key: key` instead of the key the host would add
    /// inside an idempotent operation (see the [module docs](self)).
    pub fn idempotency_key(self, key: impl AsRef<[u8]>) -> Self {
        self.header(IDEMPOTENCY_KEY, key)
    }

    /// Send `body` as JSON, with `Content-Type: application/json`.
    pub fn json<T: Serialize + ?Sized>(mut self, body: &T) -> Self {
        match serde_json::to_vec(body) {
            Ok(bytes) => self.header("Content-Type", "application/json").body(bytes),
            Err(e) => {
                self.invalid
                    .get_or_insert(format!("the JSON body does not serialize: {e}"));
                self
            }
        }
    }

    /// Send `bytes` as the body (set `Content-Type` with [`Request::header`]).
    pub fn body(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.body = Some(bytes.into());
        self
    }

    /// Send the request and read the whole response.
    ///
    /// Blocks the handler until the response has arrived or the request
    /// failed. A request the host does not send or that fails on the way is
    /// a retryable error, one that could never be sent is fatal (see the
    /// [module docs](self)).
    pub fn send(self) -> Result<Response> {
        let invalid =
            |why: &dyn fmt::Display| Error::fatal(format!("{} {}: {why}", self.method, self.url));
        let target =
            Target::parse(&self.url).map_err(|why| invalid(&format!("invalid URL: {why}")))?;
        if let Some(why) = &self.invalid {
            return Err(invalid(why));
        }
        let request = self.outgoing(&target).map_err(|why| invalid(&why))?;
        exchange(request, self.body.as_deref()).map_err(|code| request_error(&target, code))
    }

    /// The `outgoing-request` resource of this request, without its body.
    fn outgoing(&self, target: &Target<'_>) -> core::result::Result<OutgoingRequest, String> {
        let mut headers = self.headers.clone();
        let has_length = headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-length"));
        if let (Some(body), false) = (&self.body, has_length) {
            // A known length: the host sends the body as is, not chunked.
            headers.push(("Content-Length".into(), body.len().to_string().into_bytes()));
        }
        let fields = Fields::from_list(&headers).map_err(|e| {
            let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
            format!("invalid or forbidden header among {names:?}: {e:?}")
        })?;
        let request = OutgoingRequest::new(fields);
        let refused = |part: &str| format!("the host refused the URL's {part}");
        request
            .set_method(&self.method.to_wasi())
            .map_err(|()| refused("method"))?;
        request
            .set_scheme(Some(&target.scheme))
            .map_err(|()| refused("scheme"))?;
        request
            .set_authority(Some(target.authority))
            .map_err(|()| refused("authority"))?;
        request
            .set_path_with_query(Some(target.path_with_query))
            .map_err(|()| refused("path"))?;
        Ok(request)
    }
}

/// Hand `request` to the host, stream `body` to it and read the response.
fn exchange(
    request: OutgoingRequest,
    body: Option<&[u8]>,
) -> core::result::Result<Response, ErrorCode> {
    let outgoing_body = match body {
        Some(bytes) => {
            let taken = request.body();
            Some((
                taken.map_err(|()| internal("request body already taken"))?,
                bytes,
            ))
        }
        None => None,
    };
    // The request is handed over before its body is written: the body
    // streams to the host as it is written, so a body larger than the
    // stream's buffer would otherwise never drain.
    let future = outgoing_handler::handle(request, None)?;
    let written = match outgoing_body {
        Some((outgoing_body, bytes)) => write_body(outgoing_body, bytes),
        None => Ok(()),
    };
    future.subscribe().block();
    // When the host refused or dropped the request, writing its body failed
    // too; the response says why.
    let response = match future.get() {
        Some(Ok(Ok(response))) => response,
        Some(Ok(Err(code))) => return Err(code),
        Some(Err(())) | None => return Err(internal("the response was already taken")),
    };
    written?;
    read_response(response)
}

/// A response, read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The headers in the order received, names in lowercase; values that
    /// are not UTF-8 are converted lossily.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// Whether the status is 2xx.
    ///
    /// ```
    /// let ok = dtq_guest::http::Response { status: 201, headers: vec![], body: vec![] };
    /// assert!(ok.is_success());
    /// ```
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The first value of header `name` (any case), if present.
    ///
    /// ```
    /// let reply = dtq_guest::http::Response {
    ///     status: 200,
    ///     headers: vec![("content-type".into(), "text/plain".into())],
    ///     body: vec![],
    /// };
    /// assert_eq!(reply.header("Content-Type"), Some("text/plain"));
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON into `T`; a body that does not parse is a
    /// retryable error.
    ///
    /// ```
    /// let reply = dtq_guest::http::Response { status: 200, headers: vec![], body: br#"{"id": 7}"#.to_vec() };
    /// let value: serde_json::Value = reply.json()?;
    /// assert_eq!(value["id"], 7);
    /// # Ok::<(), dtq_guest::Error>(())
    /// ```
    pub fn json<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::retryable(format!(
                "the response body (HTTP {}) is not the JSON expected: {e}",
                self.status
            ))
        })
    }

    /// The body as text; a body that is not UTF-8 is a retryable error.
    ///
    /// ```
    /// let reply = dtq_guest::http::Response { status: 200, headers: vec![], body: b"pong".to_vec() };
    /// assert_eq!(reply.text()?, "pong");
    /// # Ok::<(), dtq_guest::Error>(())
    /// ```
    pub fn text(&self) -> Result<&str> {
        core::str::from_utf8(&self.body)
            .map_err(|e| Error::retryable(format!("the response body is not UTF-8: {e}")))
    }

    /// The response if its status is 2xx, else a retryable error naming
    /// the status.
    ///
    /// ```
    /// let busy = dtq_guest::http::Response { status: 503, headers: vec![], body: vec![] };
    /// let err = busy.error_for_status().unwrap_err();
    /// assert!(!err.is_fatal());
    /// assert_eq!(err.message(), "the server answered HTTP 503");
    /// ```
    pub fn error_for_status(self) -> Result<Self> {
        if self.is_success() {
            Ok(self)
        } else {
            Err(Error::retryable(format!(
                "the server answered HTTP {}",
                self.status
            )))
        }
    }
}

/// Where a URL points, in the parts an `outgoing-request` takes.
#[derive(Debug, Clone)]
struct Target<'a> {
    scheme: Scheme,
    /// `host[:port]` as written in the URL.
    authority: &'a str,
    /// `/path?query`, without the fragment; `/` when the URL has no path.
    path_with_query: &'a str,
    /// `scheme://host:port` with the port always written: the origin the
    /// allow-list is checked against, as error messages name it.
    origin: String,
}

impl<'a> Target<'a> {
    fn parse(url: &'a str) -> core::result::Result<Self, String> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or("it has no scheme (http:// or https://)")?;
        let (scheme, default_port) = if scheme.eq_ignore_ascii_case("http") {
            (Scheme::Http, 80)
        } else if scheme.eq_ignore_ascii_case("https") {
            (Scheme::Https, 443)
        } else {
            return Err(format!("scheme {scheme:?} is not http or https"));
        };
        let rest = rest.split('#').next().unwrap_or_default();
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        if authority.contains('@') {
            return Err("credentials in the URL are not supported; send a header".into());
        }
        let (host, port) = split_port(authority)?;
        if host.is_empty() {
            return Err("it has no host".into());
        }
        let port = port.unwrap_or(default_port);
        let path_with_query = if path.is_empty() { "/" } else { path };
        if path_with_query.starts_with('?') {
            // `http://h?q`: the request line needs a path before the query.
            return Err("a query needs a path before it (`/?…`)".into());
        }
        let scheme_name = if default_port == 80 { "http" } else { "https" };
        Ok(Target {
            scheme,
            authority,
            path_with_query,
            origin: format!("{scheme_name}://{}:{port}", host.to_ascii_lowercase()),
        })
    }
}

/// `host` and `port` of `host[:port]` (`[v6]:port` for IPv6 literals).
fn split_port(authority: &str) -> core::result::Result<(&str, Option<u16>), String> {
    let (host, port) = match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => (&authority[..i], Some(&authority[i + 1..])),
        _ => (authority, None),
    };
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .map_err(|_| format!("port {p:?} is not a number from 0 to 65535"))
        })
        .transpose()?;
    Ok((host, port))
}

/// Write `bytes` to the request body and finish it.
fn write_body(body: OutgoingBody, bytes: &[u8]) -> core::result::Result<(), ErrorCode> {
    {
        let stream = body
            .write()
            .map_err(|()| internal("request body stream already taken"))?;
        for chunk in bytes.chunks(WRITE_CHUNK) {
            stream
                .blocking_write_and_flush(chunk)
                .map_err(stream_error)?;
        }
        // The stream is a child of the body: dropped before the body finishes.
    }
    OutgoingBody::finish(body, None)
}

/// Read status, headers and the whole body of `response`.
fn read_response(response: IncomingResponse) -> core::result::Result<Response, ErrorCode> {
    let status = response.status();
    let headers = {
        let fields = response.headers();
        fields
            .entries()
            .into_iter()
            .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned()))
            .collect()
    };
    let body = response
        .consume()
        .map_err(|()| internal("response body already taken"))?;
    let bytes = {
        let stream = body
            .stream()
            .map_err(|()| internal("response body stream already taken"))?;
        read_to_end(&stream)?
    };
    // Trailers, or an error that ended the body after its last byte.
    let trailers = IncomingBody::finish(body);
    trailers.subscribe().block();
    if let Some(Ok(Err(code))) = trailers.get() {
        return Err(code);
    }
    Ok(Response {
        status,
        headers,
        body: bytes,
    })
}

/// Read `stream` until it closes: `blocking-read` waits for at least one
/// byte, or for the end.
fn read_to_end(stream: &InputStream) -> core::result::Result<Vec<u8>, ErrorCode> {
    let mut bytes = Vec::new();
    loop {
        match stream.blocking_read(READ_CHUNK) {
            Ok(chunk) => bytes.extend_from_slice(&chunk),
            Err(StreamError::Closed) => return Ok(bytes),
            Err(e) => return Err(stream_error(e)),
        }
    }
}

fn internal(what: &str) -> ErrorCode {
    ErrorCode::InternalError(Some(what.into()))
}

/// The HTTP error behind a failed stream operation.
fn stream_error(err: StreamError) -> ErrorCode {
    match err {
        StreamError::Closed => ErrorCode::ConnectionTerminated,
        StreamError::LastOperationFailed(e) => {
            let detail = e.to_debug_string();
            wasi::http::types::http_error_code(&e).unwrap_or_else(|| untyped_error(detail))
        }
    }
}

/// The error code of a stream error that `http-error-code` did not
/// classify, from its text.
///
/// wasmtime-wasi-http (48) keeps an error that ends a response body as its
/// own error type, which its `http-error-code` does not recognise: the
/// guest gets only the text. The body-size cap is the one such error a
/// handler should be told apart, so its text is recognised here; anything
/// else keeps its text.
fn untyped_error(detail: String) -> ErrorCode {
    const BODY_SIZE: &str = "HTTP response body size exceeds limit";
    match detail.strip_prefix(BODY_SIZE) {
        Some(rest) => {
            let limit = rest.trim_start_matches(": ").trim_end_matches(" bytes");
            ErrorCode::HttpResponseBodySize(limit.parse().ok())
        }
        None => ErrorCode::InternalError(Some(detail)),
    }
}

/// The handler-facing error of a request to `target` that failed with `code`.
fn request_error(target: &Target<'_>, code: ErrorCode) -> Error {
    let origin = &target.origin;
    Error::retryable(match code {
        ErrorCode::HttpRequestDenied => format!(
            "request to {origin} denied: the host is not in this handler's allow-list \
             (deploy setting allow_hosts, or dtq serve --allow-host TASK=PATTERN)"
        ),
        ErrorCode::ConnectionLimitReached => format!(
            "request to {origin} refused: this attempt has made as many requests as the \
             host allows (--http-max-requests)"
        ),
        ErrorCode::ConnectionTimeout => format!(
            "request to {origin} timed out connecting (the per-request timeout is \
             --http-timeout-ms or the task's remaining deadline, whichever is sooner)"
        ),
        ErrorCode::HttpResponseTimeout
        | ErrorCode::ConnectionReadTimeout
        | ErrorCode::ConnectionWriteTimeout => format!(
            "request to {origin} timed out waiting for the response (the per-request timeout \
             is --http-timeout-ms or the task's remaining deadline, whichever is sooner)"
        ),
        ErrorCode::HttpResponseBodySize(limit) => {
            let limit = limit.map_or_else(String::new, |n| format!(" of {n} bytes"));
            format!(
                "response from {origin} cut off: its body is over the host's limit{limit} \
                 (--http-max-response-bytes)"
            )
        }
        ErrorCode::ConnectionRefused => format!("request to {origin}: connection refused"),
        ErrorCode::ConnectionTerminated => {
            format!("request to {origin}: the connection closed before the response ended")
        }
        ErrorCode::DnsError(_) | ErrorCode::DnsTimeout | ErrorCode::DestinationNotFound => {
            format!("request to {origin}: the host name does not resolve")
        }
        ErrorCode::InternalError(Some(detail)) => format!("request to {origin} failed: {detail}"),
        other => format!("request to {origin} failed: {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> core::result::Result<(String, String, String), String> {
        Target::parse(url).map(|t| {
            (
                t.authority.to_string(),
                t.path_with_query.to_string(),
                t.origin,
            )
        })
    }

    fn parts(authority: &str, path: &str, origin: &str) -> (String, String, String) {
        (authority.into(), path.into(), origin.into())
    }

    #[test]
    fn urls_split_into_authority_path_and_origin() {
        assert_eq!(
            parse("http://127.0.0.1:8080/charges?x=1#frag"),
            Ok(parts(
                "127.0.0.1:8080",
                "/charges?x=1",
                "http://127.0.0.1:8080"
            ))
        );
        assert_eq!(
            parse("HTTPS://API.example.com"),
            Ok(parts("API.example.com", "/", "https://api.example.com:443"))
        );
        assert_eq!(
            parse("http://evil.example/x"),
            Ok(parts("evil.example", "/x", "http://evil.example:80"))
        );
        assert_eq!(
            parse("http://[::1]:9000/"),
            Ok(parts("[::1]:9000", "/", "http://[::1]:9000"))
        );
        assert_eq!(
            parse("http://[::1]/"),
            Ok(parts("[::1]", "/", "http://[::1]:80"))
        );
    }

    #[test]
    fn urls_that_cannot_be_sent_are_refused() {
        for url in [
            "example.com/x",
            "ftp://example.com/",
            "http:///path",
            "http://user:pw@example.com/",
            "http://example.com:http/",
            "http://example.com:70000/",
            "http://example.com?q=1",
        ] {
            assert!(parse(url).is_err(), "{url} parsed");
        }
    }

    #[test]
    fn request_errors_name_the_origin_and_the_setting() {
        let target = Target::parse("http://evil.example/steal").unwrap();
        let denied = request_error(&target, ErrorCode::HttpRequestDenied);
        assert!(!denied.is_fatal());
        assert!(
            denied.message().starts_with(
                "request to http://evil.example:80 denied: the host is not in this handler's \
                 allow-list (deploy setting allow_hosts"
            ),
            "{denied}"
        );
        let big = request_error(&target, ErrorCode::HttpResponseBodySize(Some(1000)));
        assert!(big.message().contains("limit of 1000 bytes"), "{big}");
        let slow = request_error(&target, ErrorCode::HttpResponseTimeout);
        assert!(slow.message().contains("timed out"), "{slow}");
    }

    #[test]
    fn an_untyped_body_size_error_is_recognised() {
        let code = untyped_error("HTTP response body size exceeds limit: 1000 bytes".into());
        assert!(
            matches!(code, ErrorCode::HttpResponseBodySize(Some(1000))),
            "{code:?}"
        );
        let code = untyped_error("HTTP response body size exceeds limit".into());
        assert!(
            matches!(code, ErrorCode::HttpResponseBodySize(None)),
            "{code:?}"
        );
        let code = untyped_error("connection reset".into());
        assert!(
            matches!(&code, ErrorCode::InternalError(Some(d)) if d == "connection reset"),
            "{code:?}"
        );
    }

    #[test]
    fn a_bad_url_is_fatal_before_anything_is_sent() {
        let err = Request::new(Method::Get, "not a url").send().unwrap_err();
        assert!(err.is_fatal());
        assert!(
            err.message().starts_with("GET not a url: invalid URL"),
            "{err}"
        );
    }
}
