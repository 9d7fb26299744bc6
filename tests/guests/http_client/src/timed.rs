//! `{"op": "timed", …}`: one `GET` sent through `wasi:http` directly, with
//! the handler's own `request-options` (the SDK's client sets none), so the
//! tests can see which timeout ended a request and that the handler can
//! fall back.

use serde_json::{Value, json};
use wasi::http::outgoing_handler;
use wasi::http::types::{
    ErrorCode, Fields, IncomingBody, IncomingResponse, OutgoingRequest, RequestOptions, Scheme,
};
use wasi::io::streams::StreamError;

/// A handler's timeouts, ms; `None` leaves the option unset.
pub struct Timeouts {
    pub connect_ms: Option<u64>,
    pub first_byte_ms: Option<u64>,
    pub between_bytes_ms: Option<u64>,
}

/// `GET url` (`http://host:port/path`) with `timeouts`: `{"status", "body"}`,
/// or `{"fallback": true, "error": code}` when it failed, `code` the
/// wasi:http error code (its debug form; the text of the stream error
/// when the body failed without one).
pub fn get(url: &str, timeouts: &Timeouts) -> Value {
    match exchange(url, timeouts) {
        Ok((status, body)) => json!({"status": status, "body": body}),
        Err(code) => json!({"fallback": true, "error": code}),
    }
}

fn exchange(url: &str, timeouts: &Timeouts) -> Result<(u16, String), String> {
    let rest = url.strip_prefix("http://").ok_or("an http:// URL")?;
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, "/"),
    };
    let request = OutgoingRequest::new(Fields::new());
    request.set_scheme(Some(&Scheme::Http)).map_err(|()| "scheme")?;
    request.set_authority(Some(authority)).map_err(|()| "authority")?;
    request.set_path_with_query(Some(path)).map_err(|()| "path")?;
    let options = RequestOptions::new();
    let ns = |ms: Option<u64>| ms.map(|ms| ms * 1_000_000);
    options
        .set_connect_timeout(ns(timeouts.connect_ms))
        .map_err(|()| "connect-timeout refused")?;
    options
        .set_first_byte_timeout(ns(timeouts.first_byte_ms))
        .map_err(|()| "first-byte-timeout refused")?;
    options
        .set_between_bytes_timeout(ns(timeouts.between_bytes_ms))
        .map_err(|()| "between-bytes-timeout refused")?;
    let future = outgoing_handler::handle(request, Some(options)).map_err(code)?;
    future.subscribe().block();
    let response = match future.get() {
        Some(Ok(Ok(response))) => response,
        Some(Ok(Err(e))) => return Err(code(e)),
        _ => return Err("no response".into()),
    };
    read(response)
}

fn read(response: IncomingResponse) -> Result<(u16, String), String> {
    let status = response.status();
    let body = response.consume().map_err(|()| "body taken")?;
    let mut bytes = Vec::new();
    {
        let stream = body.stream().map_err(|()| "stream taken")?;
        loop {
            match stream.blocking_read(64 * 1024) {
                Ok(chunk) => bytes.extend_from_slice(&chunk),
                Err(StreamError::Closed) => break,
                Err(StreamError::LastOperationFailed(e)) => {
                    return Err(match wasi::http::types::http_error_code(&e) {
                        Some(typed) => code(typed),
                        None => e.to_debug_string(),
                    });
                }
            }
        }
    }
    drop(IncomingBody::finish(body));
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

/// The error code's name (`ConnectionTimeout`), from its debug form.
fn code(e: ErrorCode) -> String {
    let debug = format!("{e:?}");
    debug
        .strip_prefix("ErrorCode::")
        .map_or_else(|| debug.clone(), str::to_owned)
}
