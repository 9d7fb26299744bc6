//! The API against hostile and careless clients (issue 10, the API half):
//! slow and idle connections are cut off, a connection cap holds, Redis
//! being down is answered at once, submissions must be JSON, every error
//! has the JSON body, tokens carry scopes, and no number a client sends
//! overflows the times computed from it.
//!
//! Each test runs the real API server (`dtq_host::api::serve_with`,
//! configured from the same flags as `dtq serve`) on a loopback port,
//! against its own real `redis-server`. The slow clients are raw TCP
//! sockets, so nothing between the test and the server smooths them over.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::api::{self, ApiState};
use dtq_host::ingest::{MAX_ATTEMPTS_LIMIT, MAX_DELAY_MS, MAX_EXPIRES_IN_MS};
use dtq_host::store::{QueueKeys, Store};
use dtq_tests::{ApiClient, RedisServer, TempDir, assert_error};
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Longest any single wait in these tests may take before it is a failure.
const GUARD: Duration = Duration::from_secs(20);

/// Scheduling slack on top of a timeout the server is expected to honour.
const SLACK: Duration = Duration::from_secs(2);

/// The task timeout the test servers run with (`--task-timeout-ms`), the
/// bound of a submission's `timeout_ms`.
const TASK_TIMEOUT_MS: u64 = 30_000;

/// An API server on a loopback port, with its own `redis-server`; only the
/// `echo` task is deployed. Stopped on drop.
struct Api {
    redis: RedisServer,
    addr: SocketAddr,
    client: ApiClient,
    stop: CancellationToken,
}

impl Api {
    /// Start the API with `flags` (those of `dtq serve`) on a fresh Redis.
    async fn start(flags: &[&str]) -> Result<Api> {
        let redis = RedisServer::start()?;
        let mut args = vec![
            "--redis".to_owned(),
            redis.url(),
            "--max-queue-depth".into(),
            "0".into(),
            "--task-timeout-ms".into(),
            TASK_TIMEOUT_MS.to_string(),
        ];
        args.extend(flags.iter().map(|s| s.to_string()));
        let config = dtq_host::Config::from_args(args)?;
        config.validate().map_err(anyhow::Error::msg)?;
        let settings = config.api_settings().map_err(anyhow::Error::msg)?;
        let store = Store::connect(&config.store.redis_url, config.store_settings()).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let deploy = api::DeployState {
            registry: dtq_host::deploy::Registry::new(store.connection()),
            checker: dtq_host::sandbox::Sandbox::new(config.sandbox_config(), store.connection())?,
            max_module_bytes: config.deploy.max_module_bytes(),
        };
        let state = ApiState {
            store,
            ingest: config.ingest_settings(),
            admin_token: config.api.admin_token.clone(),
            has_handler: Arc::new(|task: &str| task == "echo"),
            catalog: Default::default(),
            deploy,
        };
        let stop = CancellationToken::new();
        tokio::spawn(api::serve_with(
            listener,
            state,
            settings,
            stop.clone().cancelled_owned(),
        ));
        Ok(Api {
            redis,
            addr,
            client: ApiClient::new(format!("http://{addr}")),
            stop,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A raw TCP connection to the API.
    async fn connect(&self) -> Result<TcpStream> {
        Ok(TcpStream::connect(self.addr).await?)
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A request with `token` as its bearer token, if any; the status and the
/// JSON body.
async fn call(
    api: &Api,
    method: Method,
    path: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> Result<(u16, Value)> {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| ("Authorization", a))
        .into_iter()
        .collect();
    api.client.call(method, path, body, &headers).await
}

/// Read one response off a raw connection: its status and JSON body
/// (framed by `Content-Length`, as the API frames every answer).
async fn read_response(rd: &mut (impl AsyncRead + Unpin)) -> Result<(u16, Value)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end])?.to_owned();
            let status: u16 = head.split(' ').nth(1).context("no status line")?.parse()?;
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .with_context(|| format!("no Content-Length in {head:?}"))?;
            while buf.len() < end + 4 + length {
                let n = rd.read(&mut chunk).await?;
                ensure!(n > 0, "closed in the middle of the body");
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = serde_json::from_slice(&buf[end + 4..end + 4 + length])?;
            return Ok((status, body));
        }
        let n = rd.read(&mut chunk).await?;
        if n == 0 {
            bail!(
                "closed before a response: {:?}",
                String::from_utf8_lossy(&buf)
            );
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Wait until the server closes the connection (end of stream or reset),
/// discarding whatever it sends; fails after `within`.
async fn closed(rd: &mut (impl AsyncRead + Unpin), within: Duration) -> Result<Instant> {
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match rd.read(&mut chunk).await {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(_) => {}
            }
        }
    })
    .await
    .with_context(|| format!("the server kept the connection open for {within:?}"))
}

/// Send `head` (a request without its final byte), then trickle one more
/// byte every 200 ms, until the server closes the connection; how long it
/// held on.
async fn trickle(api: &Api, head: &[u8]) -> Result<(Duration, Vec<u8>)> {
    let (mut rd, mut wr) = api.connect().await?.into_split();
    wr.write_all(head).await?;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        tokio::select! {
            read = rd.read(&mut chunk) => match read {
                Ok(0) | Err(_) => return Ok((started.elapsed(), got)),
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            },
            _ = tick.tick() => {
                if wr.write_all(b"a").await.is_err() {
                    return Ok((started.elapsed(), got));
                }
                ensure!(
                    started.elapsed() < GUARD,
                    "a client trickling bytes was held {GUARD:?} and never cut off"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn trickled_headers_are_cut_off_after_the_header_timeout() -> Result<()> {
    let api = Api::start(&["--api-header-timeout-ms", "1000"]).await?;
    let (held, _) = trickle(&api, b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: ").await?;
    assert!(
        held >= Duration::from_millis(900) && held < Duration::from_secs(1) + SLACK,
        "held {held:?}"
    );
    // The server still answers others.
    assert_eq!(
        api.client.call(Method::GET, "/healthz", None, &[]).await?.0,
        200
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_new_or_kept_alive_are_closed_after_the_header_timeout() -> Result<()> {
    let timeout = Duration::from_millis(1000);
    let api = Api::start(&["--api-header-timeout-ms", "1000"]).await?;

    // A connection that never sends a byte.
    let (mut rd, _wr) = api.connect().await?.into_split();
    let opened = Instant::now();
    let at = closed(&mut rd, GUARD).await?;
    let idle = at - opened;
    assert!(
        idle >= timeout - Duration::from_millis(100) && idle < timeout + SLACK,
        "{idle:?}"
    );

    // A keep-alive connection after a complete exchange.
    let (mut rd, mut wr) = api.connect().await?.into_split();
    wr.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await?;
    let (status, body) = read_response(&mut rd).await?;
    assert_eq!(status, 200, "{body}");
    let answered = Instant::now();
    let idle = closed(&mut rd, GUARD).await? - answered;
    assert!(
        idle >= timeout - Duration::from_millis(100) && idle < timeout + SLACK,
        "{idle:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trickled_body_is_cut_off_with_408_after_the_body_timeout() -> Result<()> {
    let api = Api::start(&["--api-body-timeout-ms", "1000"]).await?;
    let head = b"POST /v1/queues/default/tasks HTTP/1.1\r\nHost: t\r\n\
                 Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"task\": ";
    let (held, got) = trickle(&api, head).await?;
    assert!(held < Duration::from_secs(1) + SLACK, "held {held:?}");
    let (status, body) = read_response(&mut got.as_slice()).await?;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (408, Some("REQUEST_TIMEOUT")),
        "{body}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn beyond_the_connection_cap_a_new_client_waits_for_a_slot() -> Result<()> {
    let timeout = Duration::from_millis(1500);
    let api = Api::start(&[
        "--api-max-connections",
        "2",
        "--api-header-timeout-ms",
        "1500",
    ])
    .await?;
    // Two clients take both slots: each is served once, then idles.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let (mut rd, mut wr) = api.connect().await?.into_split();
        wr.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await?;
        assert_eq!(read_response(&mut rd).await?.0, 200);
        holders.push((rd, wr));
    }
    let idle_since = Instant::now();
    let (first_close_tx, mut first_close) = tokio::sync::mpsc::channel(2);
    for (mut rd, wr) in holders {
        let tx = first_close_tx.clone();
        tokio::spawn(async move {
            let _wr = wr;
            if let Ok(at) = closed(&mut rd, GUARD).await {
                let _ = tx.send(at).await;
            }
        });
    }

    // A third client is served only once a slot is free: after an idle
    // holder was closed by the header timeout.
    let (mut rd, mut wr) = api.connect().await?.into_split();
    wr.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await?;
    let (status, _) = tokio::time::timeout(GUARD, read_response(&mut rd)).await??;
    let answered = Instant::now();
    assert_eq!(status, 200);
    let waited = answered - idle_since;
    assert!(
        waited >= timeout - Duration::from_millis(100),
        "the third client was served after {waited:?}, while both slots were held"
    );
    let first = tokio::time::timeout(Duration::from_secs(1), first_close.recv())
        .await
        .context("no holder was closed before the third client was served")?
        .context("holders gone")?;
    assert!(first <= answered + Duration::from_millis(50));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn under_many_idle_connections_a_new_client_is_answered_within_the_caps_design() -> Result<()>
{
    let (cap, idle, timeout) = (4u32, 12u32, Duration::from_millis(1000));
    let api = Api::start(&[
        "--api-max-connections",
        &cap.to_string(),
        "--api-header-timeout-ms",
        &timeout.as_millis().to_string(),
    ])
    .await?;
    let mut idlers = Vec::new();
    for _ in 0..idle {
        idlers.push(api.connect().await?.into_split());
    }
    // The backlog is served in order, `cap` at a time, each idle batch
    // closed by the header timeout: the new client waits for at most
    // idle / cap of them.
    let design = timeout * idle.div_ceil(cap);
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .get(api.url("/healthz"))
        .timeout(design + SLACK)
        .send()
        .await
        .context("the new client was not answered within the cap's design")?;
    assert_eq!(resp.status().as_u16(), 200);
    assert!(
        started.elapsed() < design + SLACK,
        "{:?}",
        started.elapsed()
    );
    for (mut rd, _wr) in idlers {
        closed(&mut rd, SLACK).await?;
    }
    Ok(())
}

/// Requests of every route while Redis cannot answer; each must get 503
/// `STORE_UNAVAILABLE` well before the store's own timeouts (seconds).
async fn every_route_fails_fast(api: &Api, id: &str) -> Result<()> {
    let routes = [
        (Method::GET, "/healthz".to_owned(), None),
        (
            Method::POST,
            "/v1/queues/default/tasks".to_owned(),
            Some(json!({"task": "echo", "payload": 2})),
        ),
        (Method::GET, format!("/v1/queues/default/tasks/{id}"), None),
        (
            Method::POST,
            format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
        ),
        (Method::GET, "/v1/queues".to_owned(), None),
        (Method::GET, "/v1/queues/default".to_owned(), None),
        (Method::GET, "/v1/queues/default/dlq".to_owned(), None),
    ];
    for (method, path, body) in routes {
        let started = Instant::now();
        let response = api.client.call(method.clone(), &path, body, &[]).await?;
        let took = started.elapsed();
        assert_error(&response, 503, "STORE_UNAVAILABLE");
        assert!(
            took < Duration::from_millis(1500),
            "{method} {path} took {took:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn while_redis_is_down_or_paused_requests_fail_fast_with_503() -> Result<()> {
    let mut api = Api::start(&["--api-redis-timeout-ms", "300"]).await?;
    let id = api
        .client
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;

    // Paused (SIGSTOP): connections stay up, nothing answers.
    signal(&api.redis, libc::SIGSTOP)?;
    let paused = every_route_fails_fast(&api, &id).await;
    signal(&api.redis, libc::SIGCONT)?;
    paused?;
    wait_healthy(&api).await?;

    let pid = api.redis.pid();
    // Killed outright, with its port closed: connections are refused.
    // SAFETY: kill(2) on the redis-server child the harness owns and has
    // not reaped.
    ensure!(unsafe { libc::kill(libc::pid_t::try_from(pid)?, libc::SIGKILL) } == 0);
    every_route_fails_fast(&api, &id).await?;
    api.redis.restart()?;
    wait_healthy(&api).await?;
    Ok(())
}

fn signal(redis: &RedisServer, signal: libc::c_int) -> Result<()> {
    let pid = libc::pid_t::try_from(redis.pid())?;
    // SAFETY: kill(2) on the pid of the redis-server child the harness owns
    // and has not reaped (it is reaped only on drop or restart).
    let rc = unsafe { libc::kill(pid, signal) };
    ensure!(rc == 0, "kill: {}", std::io::Error::last_os_error());
    Ok(())
}

/// Poll `/healthz` until it answers 200: the API recovered with Redis.
async fn wait_healthy(api: &Api) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Ok((200, _)) = api.client.call(Method::GET, "/healthz", None, &[]).await {
            return Ok(());
        }
        ensure!(
            started.elapsed() < GUARD,
            "the API did not recover with Redis"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_must_be_sent_as_json() -> Result<()> {
    let api = Api::start(&[]).await?;
    let send = |content_type: Option<&'static str>| {
        let mut req = reqwest::Client::new()
            .post(api.url("/v1/queues/default/tasks"))
            .body(r#"{"task": "echo", "payload": 1}"#);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        async move {
            let resp = req.send().await?;
            let status = resp.status().as_u16();
            Ok::<_, anyhow::Error>((status, resp.json::<Value>().await?))
        }
    };
    // What a web page can send cross-site without a preflight, and nothing.
    for ct in [
        Some("text/plain"),
        Some("text/plain; charset=utf-8"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        None,
    ] {
        assert_error(&send(ct).await?, 415, "UNSUPPORTED_MEDIA_TYPE");
    }
    let tasks = api.redis.keys().await?;
    assert!(
        !tasks.iter().any(|k| k.starts_with("dtq:task")),
        "{tasks:?}"
    );
    for ct in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON;charset=UTF-8",
    ] {
        let (status, body) = send(Some(ct)).await?;
        assert_eq!(status, 202, "{ct}: {body}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_error_has_the_json_error_body() -> Result<()> {
    let api = Api::start(&[]).await?;
    let json = r#"{"task": "echo", "payload": 1}"#;
    let cases: [(Method, &str, u16, &str); 11] = [
        (Method::GET, "/v1/queues/%FF/tasks/x", 400, "INVALID_PATH"),
        (Method::POST, "/v1/queues/%FF/tasks", 400, "INVALID_PATH"),
        (Method::GET, "/v1/queues/%FF", 400, "INVALID_PATH"),
        (
            Method::GET,
            "/v1/queues/default/dlq?limit=abc",
            400,
            "INVALID_LIMIT",
        ),
        (
            Method::GET,
            "/v1/queues/default/dlq?limit=0",
            400,
            "INVALID_LIMIT",
        ),
        (
            Method::GET,
            "/v1/queues/default/dlq?limit=1001",
            400,
            "INVALID_LIMIT",
        ),
        (
            Method::GET,
            "/v1/queues/default/dlq?limit=-1",
            400,
            "INVALID_LIMIT",
        ),
        (
            Method::GET,
            "/v1/queues/default/dlq?colour=1",
            400,
            "INVALID_QUERY",
        ),
        (Method::GET, "/v2/nothing", 404, "NOT_FOUND"),
        (Method::DELETE, "/v1/queues", 405, "METHOD_NOT_ALLOWED"),
        (
            Method::PUT,
            "/v1/queues/default/tasks",
            405,
            "METHOD_NOT_ALLOWED",
        ),
    ];
    for (method, path, status, code) in cases {
        let resp = reqwest::Client::new()
            .request(method.clone(), api.url(path))
            .header("content-type", "application/json")
            .body(json)
            .send()
            .await?;
        let got = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let text = resp.text().await?;
        assert_eq!(content_type, "application/json", "{method} {path}: {text}");
        let body: Value = serde_json::from_str(&text)
            .with_context(|| format!("{method} {path}: not JSON: {text:?}"))?;
        assert_error(&(got, body), status, code);
    }
    // A limit in its bounds is fine.
    let (status, body) = call(
        &api,
        Method::GET,
        "/v1/queues/default/dlq?limit=1000",
        None,
        None,
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_grant_scopes_on_queues() -> Result<()> {
    let dir = TempDir::new("tokens")?;
    let file = dir.path.join("tokens");
    let hashed = "a-token-stored-only-as-its-digest";
    let digest = api::Tokens::hashed(hashed);
    std::fs::write(
        &file,
        format!(
            "# dtq API tokens\n\
             submitter  submit  default\n\
             reader     read    default\n\n\
             {digest}  cancel\n"
        ),
    )?;
    let api = Api::start(&[
        "--tokens-file",
        &file.display().to_string(),
        "--tokens",
        "ops *;lister read",
        "--admin-token",
        "adm",
    ])
    .await?;
    let submit = |queue: &str| {
        (
            Method::POST,
            format!("/v1/queues/{queue}/tasks"),
            Some(json!({"task": "echo", "payload": 1})),
        )
    };

    // No token, an unknown one: 401, with the scheme to use.
    let (m, p, b) = submit("default");
    assert_error(
        &call(&api, m.clone(), &p, b.clone(), None).await?,
        401,
        "UNAUTHORIZED",
    );
    assert_error(
        &call(&api, m.clone(), &p, b.clone(), Some("nope")).await?,
        401,
        "UNAUTHORIZED",
    );
    assert_error(
        &call(&api, m.clone(), &p, b.clone(), Some("submitte")).await?,
        401,
        "UNAUTHORIZED",
    );
    let resp = reqwest::Client::new()
        .post(api.url(&p))
        .json(&json!({"task": "echo", "payload": 1}))
        .send()
        .await?;
    assert_eq!(
        resp.headers().get("www-authenticate").map(|v| v.as_bytes()),
        Some(&b"Bearer"[..])
    );

    // submit: on its queue only, and nothing else.
    let (status, body) = call(&api, m.clone(), &p, b.clone(), Some("submitter")).await?;
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().context("task_id")?.to_owned();
    let (m2, p2, b2) = submit("other");
    assert_error(
        &call(&api, m2.clone(), &p2, b2.clone(), Some("submitter")).await?,
        403,
        "FORBIDDEN",
    );
    let task = format!("/v1/queues/default/tasks/{id}");
    assert_error(
        &call(&api, Method::GET, &task, None, Some("submitter")).await?,
        403,
        "FORBIDDEN",
    );

    // read: tasks, counts and the DLQ of its queue; no cancel, no submit.
    assert_eq!(
        call(&api, Method::GET, &task, None, Some("reader"))
            .await?
            .0,
        200
    );
    assert_eq!(
        call(
            &api,
            Method::GET,
            "/v1/queues/default/dlq",
            None,
            Some("reader")
        )
        .await?
        .0,
        200
    );
    assert_error(
        &call(
            &api,
            Method::GET,
            "/v1/queues/other/dlq",
            None,
            Some("reader"),
        )
        .await?,
        403,
        "FORBIDDEN",
    );
    assert_error(
        &call(&api, Method::GET, "/v1/queues/other", None, Some("reader")).await?,
        403,
        "FORBIDDEN",
    );
    let cancel = format!("{task}/cancel");
    assert_error(
        &call(&api, Method::POST, &cancel, None, Some("reader")).await?,
        403,
        "FORBIDDEN",
    );
    assert_error(
        &call(&api, m.clone(), &p, b.clone(), Some("reader")).await?,
        403,
        "FORBIDDEN",
    );
    // Without a token nobody reads or cancels.
    assert_error(
        &call(&api, Method::GET, "/v1/queues/default/dlq", None, None).await?,
        401,
        "UNAUTHORIZED",
    );
    assert_error(
        &call(&api, Method::POST, &cancel, None, None).await?,
        401,
        "UNAUTHORIZED",
    );

    // The queue listing shows a token only its queues.
    assert_eq!(call(&api, m2, &p2, b2, Some("ops")).await?.0, 202);
    let names = |body: &Value| -> Vec<String> {
        body["queues"]
            .as_array()
            .map(|qs| {
                qs.iter()
                    .filter_map(|q| q["queue"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (_, all) = call(&api, Method::GET, "/v1/queues", None, Some("lister")).await?;
    assert_eq!(names(&all), ["default", "other"], "{all}");
    let (_, own) = call(&api, Method::GET, "/v1/queues", None, Some("reader")).await?;
    assert_eq!(names(&own), ["default"], "{own}");

    // cancel, by a token the file holds only as a digest.
    let (status, body) = call(&api, Method::POST, &cancel, None, Some(hashed)).await?;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("CANCELLED")),
        "{body}"
    );

    // admin: the --admin-token is a token with the admin scope only.
    let requeue = format!("/v1/queues/default/dlq/{id}/requeue");
    assert_error(
        &call(&api, Method::POST, &requeue, None, Some("reader")).await?,
        403,
        "FORBIDDEN",
    );
    assert_error(
        &call(&api, Method::POST, &requeue, None, None).await?,
        401,
        "UNAUTHORIZED",
    );
    assert_error(
        &call(&api, Method::POST, &requeue, None, Some("adm")).await?,
        409,
        "NOT_DEAD_LETTERED",
    );
    assert_error(
        &call(&api, Method::GET, &task, None, Some("adm")).await?,
        403,
        "FORBIDDEN",
    );
    assert_error(
        &call(&api, Method::POST, &requeue, None, Some("ops")).await?,
        409,
        "NOT_DEAD_LETTERED",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_tokens_the_api_is_open_but_admin_routes_are_not() -> Result<()> {
    let api = Api::start(&[]).await?;
    let id = api
        .client
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;
    let (status, _) = call(
        &api,
        Method::POST,
        &format!("/v1/queues/default/tasks/{id}/cancel"),
        None,
        None,
    )
    .await?;
    assert_eq!(status, 200);
    let requeue = format!("/v1/queues/default/dlq/{id}/requeue");
    assert_error(
        &call(&api, Method::POST, &requeue, None, Some("x")).await?,
        403,
        "ADMIN_DISABLED",
    );
    Ok(())
}

#[test]
fn a_bad_tokens_file_is_refused_with_its_line() -> Result<()> {
    let dir = TempDir::new("tokens")?;
    let file = dir.path.join("tokens");
    std::fs::write(&file, "# ok\nt read\nt reed default\n")?;
    let path = file.display().to_string();
    let config = dtq_host::Config::from_args(["--tokens-file", path.as_str()])?;
    let err = config
        .api_settings()
        .err()
        .context("a bad scope was accepted")?;
    assert!(err.contains("entry 3") && err.contains("reed"), "{err}");
    let config = dtq_host::Config::from_args(["--tokens-file", "/nonexistent/tokens"])?;
    assert!(config.api_settings().is_err());
    Ok(())
}

/// A number field of a submission as its JSON text, with what the model
/// of the bounds makes of it.
#[derive(Debug, Clone)]
enum Field {
    Absent,
    Null,
    /// A whole number (perhaps past `u64` either way).
    Whole(i128),
    /// Any other JSON value: a fraction, a string, a boolean.
    Other(&'static str),
}

impl Field {
    fn json(&self) -> Option<String> {
        match self {
            Field::Absent => None,
            Field::Null => Some("null".into()),
            Field::Whole(n) => Some(n.to_string()),
            Field::Other(text) => Some((*text).into()),
        }
    }

    /// `Ok(None)`: absent; `Ok(Some(n))`: a whole number within
    /// `0..=max`; `Err(())`: anything else.
    fn value(&self, max: u64) -> Result<Option<u64>, ()> {
        match self {
            Field::Absent | Field::Null => Ok(None),
            Field::Whole(n) if (0..=i128::from(max)).contains(n) => Ok(Some(*n as u64)),
            _ => Err(()),
        }
    }
}

fn field(near: u64) -> impl proptest::strategy::Strategy<Value = Field> {
    use proptest::prelude::*;
    let near = i128::from(near);
    prop_oneof![
        Just(Field::Absent),
        Just(Field::Null),
        (0..=near + 2).prop_map(Field::Whole),
        (near - 2..=near + 2).prop_map(Field::Whole),
        any::<u64>().prop_map(|n| Field::Whole(i128::from(n))),
        (i128::from(u64::MAX) - 1..=i128::from(u64::MAX) + 2).prop_map(Field::Whole),
        (-3i128..0).prop_map(Field::Whole),
        prop_oneof![
            Just("1.5"),
            Just("1e3"),
            Just("\"5\""),
            Just("true"),
            Just("[1]"),
        ]
        .prop_map(Field::Other),
    ]
}

/// The codes the bounds (the README's table) give a submission with these
/// fields: empty when it is acceptable.
fn expected_codes(
    attempts: &Field,
    timeout: &Field,
    delay: &Field,
    expires: &Field,
) -> Vec<&'static str> {
    let mut codes = Vec::new();
    match attempts.value(u64::from(u32::MAX)) {
        Ok(Some(n)) if !(1..=u64::from(MAX_ATTEMPTS_LIMIT)).contains(&n) => {
            codes.push("INVALID_MAX_ATTEMPTS")
        }
        Ok(_) => {}
        Err(()) => codes.push("INVALID_MAX_ATTEMPTS"),
    }
    match timeout.value(u64::MAX) {
        Ok(Some(n)) if !(1..=TASK_TIMEOUT_MS).contains(&n) => codes.push("INVALID_TIMEOUT"),
        Ok(_) => {}
        Err(()) => codes.push("INVALID_TIMEOUT"),
    }
    let delay_ms = match delay.value(u64::MAX) {
        Ok(n) if n.unwrap_or(0) <= MAX_DELAY_MS => Some(n.unwrap_or(0)),
        _ => {
            codes.push("INVALID_DELAY");
            None
        }
    };
    match expires.value(u64::MAX) {
        Ok(Some(n))
            if !(1..=MAX_EXPIRES_IN_MS).contains(&n) || delay_ms.is_some_and(|d| n <= d) =>
        {
            codes.push("INVALID_EXPIRY")
        }
        Ok(_) => {}
        Err(()) => codes.push("INVALID_EXPIRY"),
    }
    codes
}

/// Submit one body built from the fields; check the answer against the
/// model, and an accepted task's stored times against its creation.
async fn submit_numbers(
    api: &Api,
    attempts: &Field,
    timeout: &Field,
    delay: &Field,
    expires: &Field,
) -> Result<()> {
    let mut body = String::from(r#"{"task": "echo", "payload": 1"#);
    for (name, field) in [
        ("max_attempts", attempts),
        ("timeout_ms", timeout),
        ("delay_ms", delay),
        ("expires_in_ms", expires),
    ] {
        if let Some(text) = field.json() {
            body.push_str(&format!(r#", "{name}": {text}"#));
        }
    }
    body.push('}');
    let resp = reqwest::Client::new()
        .post(api.url("/v1/queues/default/tasks"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await?;
    let status = resp.status().as_u16();
    let answer: Value = resp.json().await?;
    let expected = expected_codes(attempts, timeout, delay, expires);
    if !expected.is_empty() {
        ensure!(
            status == 400,
            "{body} got {status} {answer}, expected one of {expected:?}"
        );
        let code = answer["error"]["code"].as_str().unwrap_or_default();
        ensure!(
            expected.contains(&code),
            "{body} got {code}, expected one of {expected:?}"
        );
        return Ok(());
    }
    ensure!(status == 202, "{body} got {status} {answer}");
    let id = answer["task_id"].as_str().context("task_id")?;
    let mut conn = api.redis.conn().await?;
    let hash: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(QueueKeys::new("default").task(id))
        .query_async(&mut conn)
        .await?;
    let number = |name: &str| -> Result<Option<u64>> {
        hash.get(name)
            .map(|v| v.parse::<u64>())
            .transpose()
            .with_context(|| format!("{name} of {hash:?}"))
    };
    let created = number("created_at")?.context("created_at")?;
    let run_at = number("run_at")?.unwrap_or(created);
    let delay_ms = delay.value(u64::MAX).ok().flatten().unwrap_or(0);
    ensure!(
        run_at >= created && run_at - created == delay_ms,
        "{body}: {hash:?}"
    );
    match (
        expires.value(u64::MAX).ok().flatten(),
        number("expires_at")?,
    ) {
        (None, None) => {}
        (Some(ms), Some(at)) => ensure!(
            at > created && at > run_at && at - created == ms,
            "{body}: {hash:?}"
        ),
        other => bail!("{body}: expiry {other:?} in {hash:?}"),
    }
    let attempts_stored = number("max_attempts")?.context("max_attempts")?;
    ensure!(
        (1..=u64::from(MAX_ATTEMPTS_LIMIT)).contains(&attempts_stored),
        "{hash:?}"
    );
    if let Some(t) = number("timeout_ms")? {
        ensure!((1..=TASK_TIMEOUT_MS).contains(&t), "{hash:?}");
    }
    Ok(())
}

/// No number a client sends overflows or makes a task run or expire before
/// it was created; every refused one gets 400 with its field's code.
#[test]
fn submission_numbers_are_bounded_and_never_overflow() -> Result<()> {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let rt = tokio::runtime::Runtime::new()?;
    let api = rt.block_on(Api::start(&[]))?;
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        field(u64::from(MAX_ATTEMPTS_LIMIT)),
        field(TASK_TIMEOUT_MS),
        field(MAX_DELAY_MS),
        field(MAX_EXPIRES_IN_MS),
    );
    let result = runner.run(&strategy, |(attempts, timeout, delay, expires)| {
        rt.block_on(submit_numbers(&api, &attempts, &timeout, &delay, &expires))
            .map_err(|e| TestCaseError::fail(format!("{e:#}")))
    });
    // The overflow of the issue, by name.
    rt.block_on(async {
        assert_error(
            &api.client
                .submit(
                    "default",
                    json!({"task": "echo", "payload": 1, "expires_in_ms": u64::MAX}),
                    None,
                )
                .await?,
            400,
            "INVALID_EXPIRY",
        );
        anyhow::Ok(())
    })?;
    result.map_err(|e| anyhow::anyhow!("{e}"))
}
