//! Shared harness for dtq's integration tests.
//!
//! Every test talks to a real `redis-server` that it starts itself on a free
//! loopback port ([`RedisServer::start`]) and runs real guest components that
//! `build.rs` compiled from source ([`guests`]). Nothing here mocks Redis.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub mod alloc;
pub mod chaos;
pub mod cluster;
pub mod polyglot;
pub mod process;
pub mod proxy;
pub mod services;

/// The SHA-256 of `bytes`, lowercase hex: a module's digest as the host
/// records it.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Paths of the guest components `build.rs` compiled for this test run.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/guests.rs"));
}

/// A `redis-server` child process on a free loopback port, killed on drop.
///
/// Each test gets its own server, so tests never share keys and never need to
/// flush anything.
pub struct RedisServer {
    child: Child,
    port: u16,
    /// The command `redis-server` runs under, if any.
    wrapper: Vec<String>,
    _dir: TempDir,
}

impl RedisServer {
    /// Start a fresh `redis-server` with no persistence and wait until it
    /// answers `PING`.
    ///
    /// A missing `redis-server` binary is an error that says how to install it,
    /// never a silently skipped test.
    pub fn start() -> Result<Self> {
        Self::start_under(&[])
    }

    /// [`RedisServer::start`], with `redis-server` run by `wrapper` (a
    /// command and its arguments, such as `valgrind --tool=callgrind`), which
    /// must run it in its own process so that [`RedisServer::pid`] is the
    /// server's.
    pub fn start_under(wrapper: &[&str]) -> Result<Self> {
        // Instrumented servers start slowly.
        let ready_within = Duration::from_secs(if wrapper.is_empty() { 10 } else { 120 });
        let wrapper: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        let mut last_err = None;
        // A port free when probed may be taken before redis binds it, so a
        // failed start is retried on another port.
        for _ in 0..5 {
            let dir = TempDir::new("redis")?;
            let port = free_port()?;
            let mut server = RedisServer {
                child: spawn_redis(&wrapper, port, &dir)?,
                port,
                wrapper: wrapper.clone(),
                _dir: dir,
            };
            match server.wait_ready(ready_within) {
                Ok(()) => return Ok(server),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    /// The server's process id (to pause it with SIGSTOP, say).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kill the server and start an empty one on the same port, as a Redis
    /// restart without persistence (or a failover to an empty replica) looks
    /// to its clients: connections drop, and keys, consumer groups and the
    /// script cache are gone.
    pub fn restart(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        let start = Instant::now();
        loop {
            self.child = spawn_redis(&self.wrapper, self.port, &self._dir)?;
            match self.wait_ready(Duration::from_secs(5)) {
                Ok(()) => return Ok(()),
                // The port may linger for a moment after the kill.
                Err(_) if start.elapsed() < Duration::from_secs(20) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("redis-server exited early with {status}");
            }
            let pong = redis::Client::open(self.url())
                .and_then(|client| client.get_connection())
                .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
            if pong.is_ok() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "redis-server on port {} did not answer PING within {timeout:?}",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A fresh multiplexed async connection.
    pub async fn conn(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// A connection as the host uses one (a connection manager, which
    /// reconnects by itself).
    pub async fn manager(&self) -> Result<dtq_host::store::Conn> {
        let client = redis::Client::open(self.url())?;
        Ok(dtq_host::store::Conn::Single(
            redis::aio::ConnectionManager::new(client).await?,
        ))
    }

    /// The idempotency record of `key` in `queue`, parsed, if it exists.
    pub async fn idem_record(&self, queue: &str, key: &str) -> Result<Option<serde_json::Value>> {
        let mut conn = self.conn().await?;
        let raw: Option<String> = redis::cmd("GET")
            .arg(format!("dtq:idempotency:{{{queue}}}:{key}"))
            .query_async(&mut conn)
            .await?;
        Ok(raw.map(|r| serde_json::from_str(&r)).transpose()?)
    }

    /// Every key in the server, sorted; tests use it to prove where writes landed.
    pub async fn keys(&self) -> Result<Vec<String>> {
        let mut conn = self.conn().await?;
        let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
        keys.sort();
        Ok(keys)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_redis(wrapper: &[String], port: u16, dir: &TempDir) -> Result<Child> {
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg("redis-server");
            command
        }
        None => Command::new("redis-server"),
    };
    command
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir.path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| match wrapper.first() {
            Some(program) => format!("cannot run `{program}`: is it installed?"),
            None => "cannot run `redis-server`: install it (Debian: `apt-get install \
                     redis-server`) or run the tests through .ci/run, which installs it"
                .into(),
        })
}

/// The JSON of a successful sandbox call; anything else fails the test
/// with the call's log.
pub fn success(report: &dtq_host::sandbox::CallReport) -> Result<serde_json::Value> {
    match &report.outcome {
        dtq_host::sandbox::Outcome::Success(json) => Ok(serde_json::from_str(json)?),
        other => bail!("expected success, got {other:?}\nlog:\n{}", report.log),
    }
}

/// The trap of a sandbox call that trapped; anything else fails the test
/// with the call's log.
pub fn trap(report: &dtq_host::sandbox::CallReport) -> Result<dtq_host::sandbox::Trap> {
    match &report.outcome {
        dtq_host::sandbox::Outcome::Trapped(trap) => Ok(trap.clone()),
        other => bail!("expected a trap, got {other:?}\nlog:\n{}", report.log),
    }
}

/// Assert that an API response is the error `code` with HTTP `status`, in
/// the one error body (`{"error": {"code", "message", "details"}}`).
#[track_caller]
pub fn assert_error(response: &(u16, serde_json::Value), status: u16, code: &str) {
    let (got, body) = response;
    assert_eq!(
        (*got, body["error"]["code"].as_str()),
        (status, Some(code)),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(body["error"].get("details").is_some(), "{body}");
}

/// An `echo` submission of `payload`, every option left to its default,
/// for the tests and benchmarks that submit through `ingest::submit`.
pub fn echo_request(payload: serde_json::Value) -> dtq_host::ingest::SubmitRequest {
    dtq_host::ingest::SubmitRequest {
        task: "echo".into(),
        payload,
        ..Default::default()
    }
}

/// A count a benchmark takes from the environment variable `name`, or
/// `default` when it is unset.
pub fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{name}={v:?} is not a count")),
        Err(_) => Ok(default),
    }
}

/// A free TCP port on 127.0.0.1, as the OS hands it out for port 0.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A temporary directory removed on drop.
pub struct TempDir {
    /// The directory's path.
    pub path: PathBuf,
}

impl TempDir {
    /// Create a new, empty, uniquely named directory under the system temp dir.
    pub fn new(prefix: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!("dtq-{prefix}-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A client of one dtq API, for tests: every call returns the status code
/// and the JSON body.
#[derive(Clone)]
pub struct ApiClient {
    /// The API's base URL, `http://127.0.0.1:<port>`.
    pub base: String,
    http: reqwest::Client,
}

impl ApiClient {
    /// A client of the API at `base`.
    pub fn new(base: impl Into<String>) -> Self {
        ApiClient {
            base: base.into(),
            http: reqwest::Client::new(),
        }
    }

    /// A request to the API; returns the status code and the JSON body.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
        headers: &[(&str, &str)],
    ) -> Result<(u16, serde_json::Value)> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            req = req.json(&body);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let body = serde_json::from_str(&text)
            .with_context(|| format!("response is not JSON: {text:?}"))?;
        Ok((status, body))
    }

    /// Deploy module `wasm` as `task` with `settings` (query parameters),
    /// presenting `token` as the bearer token.
    pub async fn deploy(
        &self,
        task: &str,
        wasm: Vec<u8>,
        settings: &[(&str, &str)],
        token: &str,
    ) -> Result<(u16, serde_json::Value)> {
        let resp = self
            .http
            .put(format!("{}/v1/handlers/{task}", self.base))
            .query(settings)
            .bearer_auth(token)
            .header("Content-Type", "application/wasm")
            .body(wasm)
            .send()
            .await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let body = serde_json::from_str(&text)
            .with_context(|| format!("response is not JSON: {text:?}"))?;
        Ok((status, body))
    }

    /// Submit `body` to `queue`, with `Idempotency-Key: key` when given.
    pub async fn submit(
        &self,
        queue: &str,
        body: serde_json::Value,
        key: Option<&str>,
    ) -> Result<(u16, serde_json::Value)> {
        let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        self.call(
            reqwest::Method::POST,
            &format!("/v1/queues/{queue}/tasks"),
            Some(body),
            &headers,
        )
        .await
    }

    /// Submit a task that must be new (202); its id.
    pub async fn submit_new(
        &self,
        queue: &str,
        body: serde_json::Value,
        key: Option<&str>,
    ) -> Result<String> {
        let (status, resp) = self.submit(queue, body, key).await?;
        if status != 202 {
            bail!("submission: {status} {resp}");
        }
        Ok(resp["task_id"].as_str().context("no task_id")?.to_owned())
    }

    /// The task record as the API shows it.
    pub async fn task(&self, queue: &str, id: &str) -> Result<serde_json::Value> {
        let (status, body) = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/queues/{queue}/tasks/{id}"),
                None,
                &[],
            )
            .await?;
        if status != 200 {
            bail!("GET task {id}: {status} {body}");
        }
        Ok(body)
    }

    /// [`ApiClient::wait_for`] a task that may not exist yet: one a handler
    /// submitted, which is created once the handler's attempt completes.
    /// Fails after `timeout` if it never appears.
    pub async fn wait_for_new(
        &self,
        queue: &str,
        id: &str,
        statuses: &[&str],
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let start = Instant::now();
        while self.task(queue, id).await.is_err() {
            if start.elapsed() > timeout {
                bail!("no task {id} in queue {queue} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = timeout.saturating_sub(start.elapsed());
        self.wait_for(queue, id, statuses, left).await
    }

    /// Poll the task until its status is one of `statuses`; fail after
    /// `timeout` with the last record seen.
    pub async fn wait_for(
        &self,
        queue: &str,
        id: &str,
        statuses: &[&str],
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let start = Instant::now();
        loop {
            let task = self.task(queue, id).await?;
            if statuses.iter().any(|s| task["status"] == *s) {
                return Ok(task);
            }
            if start.elapsed() > timeout {
                bail!("task {id} did not reach {statuses:?} within {timeout:?}: {task:#}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The Redis a [`Dtq`] runs on: one `redis-server`, or, when the
/// environment says `DTQ_TEST_REDIS=cluster`, a Redis Cluster of three
/// primaries ([`RedisCluster`](cluster::RedisCluster)), so that a suite
/// written once runs against both.
pub enum TestRedis {
    /// One server.
    Single(RedisServer),
    /// A cluster of three primaries.
    Cluster(cluster::RedisCluster),
}

impl TestRedis {
    /// Start what `DTQ_TEST_REDIS` asks for: `cluster`, or (unset or
    /// `single`) one server. Anything else is an error.
    pub fn start() -> Result<Self> {
        match std::env::var("DTQ_TEST_REDIS").as_deref() {
            Err(_) | Ok("" | "single") => Ok(TestRedis::Single(RedisServer::start()?)),
            Ok("cluster") => Ok(TestRedis::Cluster(cluster::RedisCluster::start(3, 0)?)),
            Ok(other) => bail!("DTQ_TEST_REDIS={other:?}: use `single` or `cluster`"),
        }
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, TestRedis::Cluster(_))
    }

    /// The `--redis` value: a URL, or every node's, comma-separated.
    pub fn url(&self) -> String {
        match self {
            TestRedis::Single(r) => r.url(),
            TestRedis::Cluster(c) => c.urls(),
        }
    }

    /// A connection as the host makes one (routed by slot on a cluster).
    pub async fn conn(&self) -> Result<dtq_host::store::Conn> {
        match self {
            TestRedis::Single(r) => r.manager().await,
            TestRedis::Cluster(c) => c.conn().await,
        }
    }

    /// The single server, for tests that stop, pause or restart it; a
    /// cluster has no one server (those tests run on a single node only).
    pub fn server(&mut self) -> &mut RedisServer {
        match self {
            TestRedis::Single(r) => r,
            TestRedis::Cluster(_) => panic!("this test needs a single redis-server"),
        }
    }

    /// The cluster (a test that started one with [`Dtq::start_on`]).
    pub fn cluster(&mut self) -> &mut cluster::RedisCluster {
        match self {
            TestRedis::Cluster(c) => c,
            TestRedis::Single(_) => panic!("this test needs a cluster"),
        }
    }

    /// The single server, read-only (see [`TestRedis::server`]).
    pub fn single(&self) -> &RedisServer {
        match self {
            TestRedis::Single(r) => r,
            TestRedis::Cluster(_) => panic!("this needs a single redis-server"),
        }
    }

    /// The server's process id (single server only, see
    /// [`TestRedis::server`]).
    pub fn pid(&self) -> u32 {
        match self {
            TestRedis::Single(r) => r.pid(),
            TestRedis::Cluster(_) => panic!("this test needs a single redis-server"),
        }
    }

    /// Restart the server empty (single server only, see
    /// [`RedisServer::restart`]).
    pub fn restart(&mut self) -> Result<()> {
        self.server().restart()
    }

    /// The idempotency record of `key` in `queue`, parsed, if it exists.
    pub async fn idem_record(&self, queue: &str, key: &str) -> Result<Option<serde_json::Value>> {
        let mut conn = self.conn().await?;
        let raw: Option<String> = redis::cmd("GET")
            .arg(format!("dtq:idempotency:{{{queue}}}:{key}"))
            .query_async(&mut conn)
            .await?;
        Ok(raw.map(|r| serde_json::from_str(&r)).transpose()?)
    }

    /// Every lifecycle event of `queue` (one partition's stream), oldest
    /// first, as subscribers read them: an entry of a completion batch
    /// holds several.
    pub async fn queue_events(&self, queue: &str) -> Result<Vec<dtq_host::store::QueueEvent>> {
        let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(dtq_host::store::QueueKeys::new(queue).events)
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn().await?)
            .await?;
        let mut events = Vec::new();
        for (id, body) in entries {
            let id: dtq_host::store::StreamId = id.parse()?;
            events.extend(dtq_host::store::QueueEvent::from_entry(id, body));
        }
        Ok(events)
    }

    /// The lifecycle events of task `id` of `queue`, oldest first: (status,
    /// attempt).
    pub async fn task_events(&self, queue: &str, id: &str) -> Result<Vec<(String, Option<u64>)>> {
        Ok(self
            .queue_events(queue)
            .await?
            .into_iter()
            .filter(|e| e.task_id == id)
            .map(|e| (e.status, e.attempt))
            .collect())
    }

    /// The messages of `queue`'s stream read and not yet acknowledged by
    /// the workers' group, or `None` while the group does not exist (a
    /// worker creates it asynchronously once it has started).
    pub async fn pending(&self, queue: &str) -> Result<Option<u64>> {
        let reply: redis::Value = match redis::cmd("XPENDING")
            .arg(dtq_host::store::QueueKeys::new(queue).stream)
            .arg(dtq_host::store::GROUP)
            .query_async(&mut self.conn().await?)
            .await
        {
            Ok(reply) => reply,
            Err(e) if e.code() == Some("NOGROUP") => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        // The summary form: [count, lowest id, highest id, consumers].
        let count = match reply {
            redis::Value::Array(items) => items.into_iter().next(),
            _ => None,
        };
        match count {
            Some(count) => Ok(Some(redis::from_redis_value(count)?)),
            None => bail!("XPENDING of {queue}: no count in its reply"),
        }
    }

    /// Every key, sorted (on a cluster, of every primary).
    pub async fn keys(&self) -> Result<Vec<String>> {
        let mut conn = self.conn().await?;
        let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
        keys.sort();
        Ok(keys)
    }
}

/// The completion of `task`'s attempt, ended as `kind`, as a worker writes
/// it.
pub fn completion(
    delivery: &dtq_host::store::Delivery,
    task: &dtq_host::store::StartedTask,
    kind: dtq_host::store::CompletionKind,
) -> dtq_host::store::Completion {
    dtq_host::store::Completion {
        queue: task.queue.clone(),
        task_id: task.id.clone(),
        msg_id: delivery.msg_id.clone(),
        idempotency_key: task.idempotency_key.clone(),
        kind,
        detail: "\"done\"".into(),
        log: String::new(),
        attempt: task.attempts,
        retry_at: 0,
        defer_limit_ms: 0,
        now: dtq_host::base::now_ms(),
        digest: None,
        carried_at: task.carried_at,
        staged: Vec::new(),
        op_staged: false,
    }
}

/// A whole dtq in this process: a fresh `redis-server`, the HTTP API on a
/// free loopback port, and (optionally) a worker running the example
/// handlers, with test-friendly timings (retries in tens of ms, a one-second
/// visibility timeout).
pub struct Dtq {
    /// The Redis this dtq uses (a single server unless
    /// `DTQ_TEST_REDIS=cluster`).
    pub redis: TestRedis,
    /// The API's base URL, `http://127.0.0.1:<port>`.
    pub api: String,
    /// A client of the API (also reached through `Deref`: `dtq.submit(..)`).
    pub client: ApiClient,
    /// The store (for reading Redis state the API does not show).
    pub store: dtq_host::store::Store,
    /// The configuration the API and worker run with.
    pub config: dtq_host::Config,
    /// The sandbox with the example handlers loaded.
    pub sandbox: dtq_host::sandbox::Sandbox,
    /// The server the API runs as and workers are started from: the
    /// binary's composition, with the test guests loaded too.
    server: dtq_host::server::Server,
    api_stop: tokio_util::sync::CancellationToken,
    worker: Option<(
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<()>,
    )>,
}

/// Flags every test dtq starts with; a test's own flags come after and win.
fn test_flags(redis_url: &str, handlers: &str) -> Vec<String> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    [
        "--redis",
        redis_url,
        "--handlers",
        handlers,
        "--listen",
        "127.0.0.1:0",
        "--concurrency",
        "4",
        "--retry-base-ms",
        "20",
        "--retry-max-ms",
        "100",
        "--visibility-timeout-ms",
        "1000",
        "--shutdown-grace-ms",
        "5000",
        "--cache-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([cache.display().to_string()])
    .collect()
}

impl Dtq {
    /// Read up to `count` new messages of the default queue as `consumer`
    /// and start them, as a worker does (no worker need run): each delivery
    /// with its started task. A message that does not start is an error.
    pub async fn read_and_start(
        &self,
        consumer: &str,
        count: usize,
    ) -> Result<Vec<(dtq_host::store::Delivery, dtq_host::store::StartedTask)>> {
        let store = &self.store;
        store.ensure_group("default").await?;
        let mut conn = store.dedicated_connection(Duration::from_secs(5)).await?;
        let mut deliveries = store
            .read(
                &mut conn,
                "default",
                consumer,
                count,
                Duration::from_millis(10),
            )
            .await?;
        let decisions = store
            .start(
                "default",
                consumer,
                &mut deliveries,
                dtq_host::base::now_ms(),
            )
            .await?;
        deliveries
            .into_iter()
            .zip(decisions)
            .map(|(delivery, decision)| match decision {
                dtq_host::store::StartDecision::Run(task) => Ok((delivery, task)),
                other => bail!("expected a run, got {other:?}"),
            })
            .collect()
    }

    /// Start Redis and the API, and a worker unless `with_worker` is false
    /// (tests that need tasks to stay queued start it later with
    /// [`Dtq::start_worker`]). `flags` are extra `dtq serve` flags.
    pub async fn start(with_worker: bool, flags: &[&str]) -> Result<Dtq> {
        Dtq::start_on(TestRedis::start()?, with_worker, flags).await
    }

    /// [`Dtq::start`] on a Redis of the caller's.
    pub async fn start_on(redis: TestRedis, with_worker: bool, flags: &[&str]) -> Result<Dtq> {
        Dtq::launch(redis, None, with_worker, flags).await
    }

    /// [`Dtq::start`] with the handlers in `dir` only: neither the examples
    /// nor the test guests, for a bench whose memory figures should hold
    /// one handler's.
    pub async fn start_with_handlers(
        dir: &std::path::Path,
        with_worker: bool,
        flags: &[&str],
    ) -> Result<Dtq> {
        Dtq::launch(TestRedis::start()?, Some(dir), with_worker, flags).await
    }

    /// Start on `redis` with the handlers of `only`, or else the examples
    /// and the test guests.
    async fn launch(
        redis: TestRedis,
        only: Option<&std::path::Path>,
        with_worker: bool,
        flags: &[&str],
    ) -> Result<Dtq> {
        let handlers = match only {
            Some(dir) => dir.to_str().context("a UTF-8 handlers path")?,
            None => guests::EXAMPLES_DIR,
        };
        let mut args = test_flags(&redis.url(), handlers);
        args.extend(flags.iter().map(|s| s.to_string()));
        let config = dtq_host::Config::from_args(args)?;
        let server =
            dtq_host::server::Server::prepare(config.clone(), dtq_host::server::Roles::SERVE)
                .await?;
        let sandbox = server
            .sandbox()
            .context("a server with a worker has its sandbox")?
            .clone();
        // Shared with `server`'s clones: the API knows these tasks too.
        if only.is_none() {
            sandbox.load_dir(std::path::Path::new(guests::TEST_GUESTS_DIR))?;
        }

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let api = format!("http://{}", listener.local_addr()?);
        let api_stop = tokio_util::sync::CancellationToken::new();
        let serve = server
            .with_roles(dtq_host::server::Roles::API)?
            .serve(Some(listener), api_stop.clone().cancelled_owned());
        tokio::spawn(async move {
            if let Err(e) = serve.await {
                eprintln!("the test API stopped: {e}");
            }
        });
        let mut dtq = Dtq {
            client: ApiClient::new(api.as_str()),
            redis,
            api,
            store: server.store().clone(),
            config,
            sandbox,
            server,
            api_stop,
            worker: None,
        };
        if with_worker {
            dtq.start_worker();
        }
        Ok(dtq)
    }

    /// Start the in-process worker (once), as `dtq worker` runs it.
    pub fn start_worker(&mut self) {
        if self.worker.is_some() {
            return;
        }
        let stop = tokio_util::sync::CancellationToken::new();
        let run = self
            .server
            .with_roles(dtq_host::server::Roles::WORKER)
            .expect("the sandbox is loaded, so nothing can fail")
            .serve(None, stop.clone().cancelled_owned());
        let handle = tokio::spawn(async move {
            if let Err(e) = run.await {
                panic!("worker failed: {e}");
            }
        });
        self.worker = Some((stop, handle));
    }

    /// Stop the in-process worker gracefully and wait for it.
    pub async fn stop_worker(&mut self) -> Result<()> {
        if let Some((stop, handle)) = self.worker.take() {
            stop.cancel();
            handle.await?;
        }
        Ok(())
    }

    /// The state of the idempotency record of `key` in `queue`
    /// (`processing`, `completed`, `failed`), or `None` without a record.
    pub async fn idem_state(&self, queue: &str, key: &str) -> Result<Option<String>> {
        Ok(self
            .idem_record(queue, key)
            .await?
            .map(|rec| rec["state"].as_str().unwrap_or_default().to_owned()))
    }

    /// The raw idempotency record of `key` in `queue`, parsed.
    pub async fn idem_record(&self, queue: &str, key: &str) -> Result<Option<serde_json::Value>> {
        self.redis.idem_record(queue, key).await
    }
}

impl std::ops::Deref for Dtq {
    type Target = ApiClient;

    fn deref(&self) -> &ApiClient {
        &self.client
    }
}

impl Drop for Dtq {
    fn drop(&mut self) {
        self.api_stop.cancel();
        if let Some((stop, _)) = &self.worker {
            stop.cancel();
        }
    }
}

/// A `redis-server` whose data outlives a stop: started with extra
/// configuration (such as `--appendonly yes`) in a directory of its own, it
/// can be stopped gracefully ([`PersistentRedis::stop`]) and started again on
/// the same port and directory ([`PersistentRedis::start_again`]), where it
/// loads what it persisted. It derefs to [`RedisServer`] for its URL, port,
/// pid and connections; its log is `redis.log` in its directory
/// ([`PersistentRedis::log_path`]). Killed on drop.
///
/// The server starts with `--save ""` (no RDB snapshots) before the extra
/// arguments, which may override it.
pub struct PersistentRedis {
    server: RedisServer,
    args: Vec<String>,
    running: bool,
}

impl PersistentRedis {
    /// Start a `redis-server` on a free loopback port with `args` added to
    /// its command line, and wait until it answers `PING`.
    pub fn start(args: &[&str]) -> Result<Self> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let mut last_err = None;
        // As in `RedisServer::start_under`: a port free when probed may be
        // taken before redis binds it.
        for _ in 0..5 {
            let dir = TempDir::new("redis-persistent")?;
            let port = free_port()?;
            let child = spawn_persistent_redis(port, &dir, &args)?;
            let mut redis = PersistentRedis {
                server: RedisServer {
                    child,
                    port,
                    wrapper: Vec::new(),
                    _dir: dir,
                },
                args: args.clone(),
                running: true,
            };
            match redis.server.wait_ready(Duration::from_secs(10)) {
                Ok(()) => return Ok(redis),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.server._dir.path.join("redis.log")
    }

    /// The server's directory (its data and its log).
    pub fn dir(&self) -> &std::path::Path {
        &self.server._dir.path
    }

    /// Whether the server is running (not stopped by [`PersistentRedis::stop`]).
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Stop the server gracefully with `SHUTDOWN` (which, with AOF on,
    /// writes and fsyncs the AOF before exiting) and wait until it has
    /// exited. Clients see their connections drop and new ones refused.
    /// Blocks the calling thread (up to 30 s).
    pub fn stop(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        let client = redis::Client::open(self.server.url())?;
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .context("connect to redis-server to stop it")?;
        // A server that stops closes the connection instead of replying, so
        // the reply is an I/O error; a reply is its refusal ("Errors trying
        // to SHUTDOWN"). Whether it stopped is told by its exit.
        let reply = redis::cmd("SHUTDOWN").query::<()>(&mut conn);
        let refused = matches!(&reply, Err(e) if !(e.is_io_error() || e.is_connection_dropped()));
        let start = Instant::now();
        loop {
            if let Some(status) = self.server.child.try_wait()? {
                self.running = false;
                if !status.success() {
                    bail!("redis-server exited with {status} on SHUTDOWN ({reply:?})");
                }
                return Ok(());
            }
            if refused && start.elapsed() > Duration::from_secs(1)
                || start.elapsed() > Duration::from_secs(30)
            {
                bail!("redis-server did not exit after SHUTDOWN ({reply:?})");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Start the stopped server again on the same port, directory and
    /// configuration, and wait until it answers `PING` (it answers once it
    /// has loaded its data). Blocks the calling thread.
    pub fn start_again(&mut self) -> Result<()> {
        anyhow::ensure!(!self.running, "redis-server is already running");
        let start = Instant::now();
        loop {
            self.server.child =
                spawn_persistent_redis(self.server.port, &self.server._dir, &self.args)?;
            match self.server.wait_ready(Duration::from_secs(30)) {
                Ok(()) => {
                    self.running = true;
                    return Ok(());
                }
                // The port may linger for a moment after the stop.
                Err(_) if start.elapsed() < Duration::from_secs(20) => {
                    let _ = self.server.child.kill();
                    let _ = self.server.child.wait();
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`PersistentRedis::stop`], then [`PersistentRedis::start_again`].
    pub fn restart_persistent(&mut self) -> Result<()> {
        self.stop()?;
        self.start_again()
    }
}

impl std::ops::Deref for PersistentRedis {
    type Target = RedisServer;

    fn deref(&self) -> &RedisServer {
        &self.server
    }
}

fn spawn_persistent_redis(port: u16, dir: &TempDir, args: &[String]) -> Result<Child> {
    Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .arg("--dir")
        .arg(&dir.path)
        .arg("--logfile")
        .arg(dir.path.join("redis.log"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context(
            "cannot run `redis-server`: install it (Debian: `apt-get install redis-server`) \
             or run the tests through .ci/run, which installs it",
        )
}
