//! A handler's own outbound timeouts (wasi:http `request-options`:
//! connect, first byte, between bytes), honoured under the operator's
//! `--http-timeout-ms`, through a whole dtq against slow servers on
//! loopback.
//!
//! The `http_client` guest's `timed` op sends one `GET` with the options it
//! is given and returns `{"fallback": true, "error": code}` when the request
//! fails, so a test reads which wasi:http error code the handler saw, and
//! that the handler went on to its fallback.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dtq_tests::Dtq;
use dtq_tests::services::Service;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How long anything that should happen may take.
const WAIT: Duration = Duration::from_secs(30);

/// A dtq whose `http_client` may reach loopback, with `flags` besides.
async fn dtq(flags: &[&str]) -> Result<Dtq> {
    let mut all = vec!["--allow-host", "http_client=http://127.0.0.1:*"];
    all.extend_from_slice(flags);
    Dtq::start(true, &all).await
}

/// Run `http_client` with `payload` to SUCCEEDED; the task.
async fn run(dtq: &Dtq, payload: Value) -> Result<Value> {
    let body = json!({"task": "http_client", "payload": payload, "max_attempts": 1});
    let id = dtq.submit_new("default", body, None).await?;
    let task = dtq
        .wait_for(
            "default",
            &id,
            &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    ensure!(task["status"] == "SUCCEEDED", "{task:#}");
    Ok(task)
}

/// The error code a `timed` request fell back on; fails when it did not.
fn fallback_of(task: &Value) -> Result<String> {
    ensure!(task["result"]["fallback"] == true, "no fallback: {task:#}");
    task["result"]["error"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("a fallback without its error: {task:#}"))
}

/// The task log of `task`.
fn log_of(task: &Value) -> &str {
    task["log"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_first_byte_timeout_under_the_operators_lets_the_handler_fall_back() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&["--http-timeout-ms", "30000"]).await?;

    let slow = format!("{}/slow?ms=5000", service.url());
    let task = run(
        &dtq,
        json!({"op": "timed", "url": slow, "first_byte_ms": 300}),
    )
    .await?;
    assert_eq!(fallback_of(&task)?, "ConnectionReadTimeout");
    let log = log_of(&task);
    assert!(
        log.contains("no response within the handler's first-byte-timeout of 300 ms"),
        "{log}"
    );
    // The server got the request: the handler's time ran out on the answer.
    assert_eq!(service.requests_to("/slow").len(), 1);

    // The same option against a quick answer: the response, not a fallback.
    let quick = format!("{}/slow?ms=10", service.url());
    let task = run(
        &dtq,
        json!({"op": "timed", "url": quick, "first_byte_ms": 5000}),
    )
    .await?;
    assert_eq!(task["result"], json!({"status": 200, "body": "slow"}));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operators_smaller_timeout_wins_over_a_larger_guest_timeout() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&["--http-timeout-ms", "300"]).await?;

    let slow = format!("{}/slow?ms=5000", service.url());
    let task = run(
        &dtq,
        json!({"op": "timed", "url": slow, "first_byte_ms": 30000, "between_bytes_ms": 30000}),
    )
    .await?;
    // The operator's timeout ended it, with its own code: the handler's
    // 30 s were never waited for.
    assert_eq!(fallback_of(&task)?, "HttpResponseTimeout");
    assert!(
        !log_of(&task).contains("the handler's"),
        "{}",
        log_of(&task)
    );
    Ok(())
}

/// A server that answers every request with its head and the first bytes
/// of a body of 10, then stalls; its address.
async fn stalling_server() -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello";
                if socket.write_all(answer).await.is_ok() {
                    // Hold the connection open, the body unfinished.
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            });
        }
    });
    Ok(addr)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_between_bytes_timeout_ends_a_stalled_body() -> Result<()> {
    let addr = stalling_server().await?;
    let dtq = dtq(&["--http-timeout-ms", "30000"]).await?;

    let url = format!("http://{addr}/stall");
    let task = run(
        &dtq,
        json!({"op": "timed", "url": url, "between_bytes_ms": 300}),
    )
    .await?;
    // wasmtime-wasi-http hands an error that ends a body to the guest as
    // text only (its `http-error-code` does not type it): the text of
    // `connection-read-timeout`.
    assert_eq!(fallback_of(&task)?, "connection read timeout");
    let log = log_of(&task);
    assert!(
        log.contains("body stalled: no bytes within the handler's between-bytes-timeout of 300 ms"),
        "{log}"
    );
    Ok(())
}

/// A listener whose accept queue is full and never drained: a new
/// connection to it waits in SYN_SENT (Linux drops the SYN of a listener
/// whose queue is full) until its client gives up. Kept open as long as
/// the returned socket and connections live.
fn full_listener() -> Result<(tokio::net::TcpListener, Vec<std::net::TcpStream>)> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind("127.0.0.1:0".parse()?)?;
    let listener = socket.listen(0)?;
    let addr = listener.local_addr()?;
    let mut held = Vec::new();
    for _ in 0..8 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(stream) => held.push(stream),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Ok((listener, held)),
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("the accept queue of {addr} never filled")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_connect_timeout_ends_a_connect_that_hangs() -> Result<()> {
    let (listener, _held) = full_listener()?;
    let dtq = dtq(&["--http-timeout-ms", "30000"]).await?;

    let url = format!("http://{}/", listener.local_addr()?);
    let task = run(&dtq, json!({"op": "timed", "url": url, "connect_ms": 300})).await?;
    assert_eq!(fallback_of(&task)?, "ConnectionTimeout");
    let log = log_of(&task);
    assert!(
        log.contains("no connection within the handler's connect-timeout of 300 ms"),
        "{log}"
    );
    Ok(())
}
