//! Network faults between workers and Redis: real `dtq worker` processes
//! reach Redis only through a proxy that cuts every connection after a
//! random 0.3–1 s (`dtq_tests::proxy`), reset mid-traffic, so commands run
//! with their replies lost: reads that delivered, `start`s that counted,
//! heartbeats that stamped, completions that were written. No worker dies
//! and Redis stays up; the API talks to Redis directly.
//!
//! Every task allows one attempt (`max_attempts: 1`), so an attempt counted
//! for a delivery no handler ran, or a live worker judged dead, shows as a
//! task dead-lettered. Two tasks in three have an expiry, so that `start`
//! runs for them (a task without one runs its first attempt from its
//! message, with no `start`). Everything runs with `--events all`, so the
//! carried attempts' RUNNING events are written, in the round trip where
//! `start` would be, through the same cut connections: a write whose
//! reply is lost leaves its batch to be read back, and must not count an
//! attempt twice (README, "Carried tasks"). The run prints how many
//! attempts showed RUNNING twice: the cuts seldom land on that small write
//! (one attempt in a handful of runs of 2 400 to 8 000 tasks), so it is
//! not required, and `tests/tests/liveness.rs` builds that state directly.
//! Each task runs an idempotent operation (the test guest `operations`)
//! that increments a kv key of its own and a shared total. At the end,
//! while the cuts go on:
//!
//! - every task SUCCEEDED, with one attempt;
//! - each task's key is 1 and the total is the number of tasks: every
//!   effect applied once;
//! - no task waited from its submission to its completion more than
//!   `MAX_WAIT_VISIBILITIES` visibility timeouts: a delivery lost in
//!   transit is read back at once, not left for the cuts to stop;
//! - every worker is still running.
//!
//! Three shorter tests build the fault that backoff alone would not get
//! through: a process whose retries backed off through an outage (the
//! proxy lets nothing through for seconds), on a link that then cuts every
//! connection within 0.4 s, so that a connection idle through a backoff is
//! always cut. A worker's completion must still be written and a new task
//! read; an API's subscriber to live events must still get them.
//!
//! Sizes come from the environment; the defaults are the short form that
//! `cargo test` (and so CI) runs in well under a minute. `scripts/chaos-network`
//! runs the long form.
//!
//! | variable | default | |
//! |---|---|---|
//! | `DTQ_NETCUT_TASKS` | 2400 | tasks, submitted at an even pace |
//! | `DTQ_NETCUT_SECS` | 15 | seconds over which they are submitted |

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::client::sse::SseReader;
use dtq_host::store::{QueueKeys, TaskStatus, finished_at};
use dtq_tests::process::DtqProcess;
use dtq_tests::proxy::CuttingProxy;
use dtq_tests::{Dtq, TempDir, env_usize, guests};
use serde_json::json;

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The queue every task goes to.
const QUEUE: &str = "default";

/// Workers, each its own process.
const WORKERS: usize = 3;

/// Each worker's execution slots.
const CONCURRENCY: &str = "8";

/// The visibility timeout of every process (ms).
const VISIBILITY_MS: u64 = 1_000;

/// How long a connection through the proxy lives while it cuts.
const LIFETIME: std::ops::Range<Duration> =
    Duration::from_millis(300)..Duration::from_millis(1_000);

/// Longest a task may take from submission to completion, in visibility
/// timeouts, while the cuts go on.
const MAX_WAIT_VISIBILITIES: u64 = 8;

/// How long a worker may take to start (it may compile the handlers when
/// the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Deadline for every task to be done once all are submitted.
const DRAIN: Duration = Duration::from_secs(60);

/// A `dtq worker` reaching Redis through `redis_url`, started and ready.
async fn worker(dir: &Path, i: usize, redis_url: &str) -> Result<DtqProcess> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut cmd = dtq_tests::process::dtq_command(DTQ);
    cmd.env("NO_COLOR", "1").arg("worker").args([
        "--redis",
        redis_url,
        "--handlers",
        guests::TEST_GUESTS_DIR,
        "--concurrency",
        CONCURRENCY,
        "--visibility-timeout-ms",
        &VISIBILITY_MS.to_string(),
        "--cache-dir",
        &cache.display().to_string(),
        "--events",
        "all",
    ]);
    let name = format!("worker-{i}");
    let log = dir.join(format!("{name}.log"));
    let mut proc = DtqProcess::spawn(&name, cmd, log, String::new())?;
    proc.print_log_on_drop = false;
    proc.wait_log("worker started", STARTUP).await?;
    Ok(proc)
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// What the task hashes say: status, attempts, created_at, finished_at,
/// error, updated_at; read straight from Redis. A carried attempt's
/// success writes no `finished_at`: its `updated_at` is that time
/// ([`finished_at`] reads it so).
type Row = (
    Option<String>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<String>,
    Option<u64>,
);

async fn rows(dtq: &Dtq, ids: &[String]) -> Result<Vec<Row>> {
    let mut conn = dtq.redis.conn().await?;
    let keys = QueueKeys::new(QUEUE);
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("HMGET").arg(keys.task(id)).arg(&[
                "status",
                "attempts",
                "created_at",
                "finished_at",
                "error",
                "updated_at",
            ]);
        }
        let got: Vec<Row> = pipe.query_async(&mut conn).await?;
        out.extend(got);
    }
    Ok(out)
}

fn is_terminal(status: Option<&str>) -> bool {
    matches!(
        status,
        Some("SUCCEEDED" | "FAILED" | "DEAD_LETTERED" | "CANCELLED" | "EXPIRED")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tasks_run_once_each_while_every_worker_connection_keeps_breaking() -> Result<()> {
    let tasks = env_usize("DTQ_NETCUT_TASKS", 2_400)?;
    let secs = env_usize("DTQ_NETCUT_SECS", 15)? as u64;
    ensure!(
        tasks > 0 && secs > 0,
        "DTQ_NETCUT_TASKS and _SECS must be positive"
    );
    let dir = TempDir::new("netcut")?;
    let visibility = VISIBILITY_MS.to_string();
    let dtq = Dtq::start(
        false,
        &["--visibility-timeout-ms", &visibility, "--events", "all"],
    )
    .await?;
    let upstream: SocketAddr = format!("127.0.0.1:{}", dtq.redis.single().port()).parse()?;
    let proxy = CuttingProxy::start(upstream, LIFETIME).await?;

    let mut workers = Vec::new();
    for i in 0..WORKERS {
        workers.push(worker(&dir.path, i, &proxy.redis_url()).await?);
    }
    proxy.set_cutting(true);
    let outcome = run(&dtq, &proxy, &mut workers, tasks, secs).await;
    proxy.set_cutting(false);
    if outcome.is_err() {
        for w in &workers {
            eprintln!("--- tail of {} ---\n{}", w.name, tail(&w.log_text(), 60));
        }
    }
    outcome
}

async fn run(
    dtq: &Dtq,
    proxy: &CuttingProxy,
    workers: &mut [DtqProcess],
    tasks: usize,
    secs: u64,
) -> Result<()> {
    // Submissions at an even pace, so that no task waits behind a backlog.
    let pace = Duration::from_secs(secs) / tasks as u32;
    let began = Instant::now();
    let mut ids = Vec::with_capacity(tasks);
    for i in 0..tasks {
        let mut body = json!({
            "task": "operations",
            "payload": {"op": "run", "key": format!("op-{i}"), "incr": [format!("done:{i}"), "total"]},
            "max_attempts": 1,
        });
        // Two tasks in three with an expiry, far off: their messages do not
        // carry them, so each goes through `start` (see `store/carried.rs`).
        if i % 3 != 0 {
            body["expires_in_ms"] = json!(3_600_000);
        }
        ids.push(dtq.submit_new(QUEUE, body, None).await?);
        if let Some(ahead) = (pace * (i as u32 + 1)).checked_sub(began.elapsed()) {
            tokio::time::sleep(ahead).await;
        }
    }

    // Every task done while the cuts go on.
    let deadline = Instant::now() + DRAIN;
    let rows = loop {
        let rows = rows(dtq, &ids).await?;
        if rows.iter().all(|r| is_terminal(r.0.as_deref())) {
            break rows;
        }
        for w in workers.iter_mut() {
            w.check_alive()?;
        }
        if Instant::now() > deadline {
            let open: Vec<_> = ids
                .iter()
                .zip(&rows)
                .filter(|(_, r)| !is_terminal(r.0.as_deref()))
                .map(|(id, r)| format!("{id}: {:?}", r.0))
                .take(20)
                .collect();
            bail!("tasks not done within {DRAIN:?} of the last submission: {open:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for w in workers.iter_mut() {
        w.check_alive()?;
    }

    // The effects: each task's key once, and the total.
    let mut conn = dtq.redis.conn().await?;
    let kv = |k: &str| format!("dtq:guest:{{operations}}:{k}");
    let mut pipe = redis::pipe();
    for i in 0..tasks {
        pipe.cmd("GET").arg(kv(&format!("done:{i}")));
    }
    let done: Vec<Option<i64>> = pipe.query_async(&mut conn).await?;
    let total: Option<i64> = redis::cmd("GET")
        .arg(kv("total"))
        .query_async(&mut conn)
        .await?;

    let mut by_status: HashMap<String, usize> = HashMap::new();
    for r in &rows {
        *by_status
            .entry(r.0.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let waits: Vec<u64> = rows
        .iter()
        .map(|r| {
            let status = r.0.as_deref().and_then(|s| s.parse::<TaskStatus>().ok());
            let finished = status.and_then(|s| finished_at(s, r.3, r.5.unwrap_or(0)));
            finished.unwrap_or(0).saturating_sub(r.2.unwrap_or(0))
        })
        .collect();
    let longest = waits.iter().copied().max().unwrap_or(0);
    let read_backs: usize = workers
        .iter()
        .map(|w| w.log_text().matches("read back messages").count())
        .sum();
    // Attempts shown RUNNING twice: a RUNNING write whose reply was lost
    // (or a `start` read back). Random, so counted, not required.
    let mut running: HashMap<String, usize> = HashMap::new();
    for event in dtq.redis.queue_events(QUEUE).await? {
        if event.status == "RUNNING" {
            *running.entry(event.task_id).or_default() += 1;
        }
    }
    let shown_twice = running.values().filter(|n| **n > 1).count();
    eprintln!(
        "tasks {tasks}, by status {by_status:?}, longest wait {longest} ms, \
         connections cut {}, accepted {}, read-backs {read_backs}, \
         attempts shown RUNNING twice {shown_twice}",
        proxy.cuts(),
        proxy.accepted()
    );
    ensure!(proxy.cuts() > 0, "the proxy cut no connection");

    let failed: Vec<_> = ids
        .iter()
        .zip(&rows)
        .filter(|(_, r)| r.0.as_deref() != Some("SUCCEEDED") || r.1 != Some(1))
        .map(|(id, r)| format!("{id}: {:?} attempts {:?}: {:?}", r.0, r.1, r.4))
        .collect();
    ensure!(
        failed.is_empty(),
        "{} tasks did not succeed in one attempt: {:?}",
        failed.len(),
        &failed[..failed.len().min(20)]
    );
    let wrong: Vec<_> = done
        .iter()
        .enumerate()
        .filter(|(_, v)| **v != Some(1))
        .map(|(i, v)| format!("done:{i} = {v:?}"))
        .collect();
    ensure!(
        wrong.is_empty(),
        "effects not applied once: {:?}",
        &wrong[..wrong.len().min(20)]
    );
    ensure!(
        total == Some(tasks as i64),
        "the total is {total:?}, not {tasks}"
    );
    let bound = MAX_WAIT_VISIBILITIES * VISIBILITY_MS;
    ensure!(
        longest <= bound,
        "a task waited {longest} ms from submission to completion, more than \
         {MAX_WAIT_VISIBILITIES} visibility timeouts ({bound} ms)"
    );
    Ok(())
}

/// How long a connection through the proxy lives in the backed-off worker
/// tests, once their outage is over: well under the backoff they build.
const IDLE_CUT: std::ops::Range<Duration> = Duration::from_millis(300)..Duration::from_millis(400);

/// One worker reaching Redis through a proxy that cuts connections after
/// [`IDLE_CUT`] once it cuts; the API talks to Redis directly.
struct OneWorker {
    dtq: Dtq,
    proxy: CuttingProxy,
    worker: DtqProcess,
    _dir: TempDir,
}

impl OneWorker {
    async fn start(name: &str) -> Result<OneWorker> {
        let dir = TempDir::new(name)?;
        let dtq = Dtq::start(false, &[]).await?;
        let upstream: SocketAddr = format!("127.0.0.1:{}", dtq.redis.single().port()).parse()?;
        let proxy = CuttingProxy::start(upstream, IDLE_CUT).await?;
        let worker = worker(&dir.path, 0, &proxy.redis_url()).await?;
        Ok(OneWorker {
            dtq,
            proxy,
            worker,
            _dir: dir,
        })
    }

    /// Submit task `task` with `payload`, with one attempt.
    async fn submit(&self, task: &str, payload: serde_json::Value) -> Result<String> {
        let body = json!({"task": task, "payload": payload, "max_attempts": 1});
        self.dtq.submit_new(QUEUE, body, None).await
    }

    /// Wait until the worker has logged `n` lines with any of `failures`.
    async fn wait_failures(&mut self, failures: &[&str], n: usize) -> Result<()> {
        wait_logged(&mut self.worker, failures, n).await
    }

    /// Task `id` once SUCCEEDED, in its first attempt.
    async fn succeeded(&mut self, id: &str) -> Result<()> {
        let done = self
            .dtq
            .wait_for(QUEUE, id, &["SUCCEEDED"], Duration::from_secs(15))
            .await;
        self.worker.check_alive()?;
        if done.is_err() {
            let log = self.worker.log_text();
            eprintln!("--- tail of {} ---\n{}", self.worker.name, tail(&log, 400));
        }
        let done = done?;
        assert_eq!(done["attempts"], 1, "{done}");
        Ok(())
    }
}

/// Wait until `process` has logged `n` lines with any of `failures`: that
/// many failed tries, each followed by a longer backoff.
async fn wait_logged(process: &mut DtqProcess, failures: &[&str], n: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        process.check_alive()?;
        let log = process.log_text();
        let logged = log
            .lines()
            .filter(|line| failures.iter().any(|f| line.contains(f)))
            .count();
        if logged >= n {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} logged {logged} of {n} lines with {failures:?}:\n{}",
            process.name,
            tail(&log, 100)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Backoff waits after which the next is 1.6 s or more, well past
/// [`IDLE_CUT`]: the worker's start at 50 ms, the events reader's at
/// 100 ms, each doubling. A try that finds its connection broken is made
/// again at once before each wait, so through an outage a process logs
/// twice as many failed tries.
const BACKED_OFF: usize = 6;

/// A completion whose retries have backed off longer than the link lets a
/// connection live is still written once Redis is reachable: a try that
/// finds its connection broken is made again at once, on the new one,
/// rather than after a backoff that leaves that one idle to be cut too.
///
/// One worker, one task that reports its progress, then runs 1.5 s with no
/// host call. Once the report is seen (the attempt runs), Redis becomes
/// unreachable through the proxy (an outage) until the completion has
/// failed twice [`BACKED_OFF`] times. Then connections get through but live 300
/// to 400 ms, cut while idle, and stay so: a completion tried only after
/// each backoff finds its connection cut every time, and the task stays
/// RUNNING.
#[tokio::test]
async fn a_completion_that_backed_off_is_written_on_a_link_that_drops_idle_connections()
-> Result<()> {
    let mut one = OneWorker::start("netcut-backoff").await?;
    let payload = json!({"reports": [[0.5, "running"]], "spin_ms": 1_500});
    let id = one.submit("progress", payload).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while one.dtq.task(QUEUE, &id).await?["progress"].is_null() {
        ensure!(
            Instant::now() < deadline,
            "task {id} never reported progress"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    one.proxy.set_outage(true);
    one.proxy.set_cutting(true);
    one.wait_failures(&["completion write failed; retrying"], 2 * BACKED_OFF)
        .await?;
    let before = one.dtq.task(QUEUE, &id).await?;
    one.proxy.set_outage(false);
    ensure!(
        before["status"] == "RUNNING",
        "the completion was written during the outage, which tests nothing: {before}"
    );
    one.succeeded(&id).await
}

/// A worker whose reads backed off through an outage still reads new
/// tasks on a link that drops idle connections: a read that finds its
/// connection broken is made again at once, on the new one.
///
/// One idle worker; Redis unreachable through the proxy until its read
/// loop has logged twice [`BACKED_OFF`] failed reads. Then connections get through but live 300
/// to 400 ms, cut while idle, and a task is submitted: a loop that reads
/// only after each backoff finds its connection cut every time, and the
/// task is never read.
#[tokio::test]
async fn a_worker_that_backed_off_reads_on_a_link_that_drops_idle_connections() -> Result<()> {
    let mut one = OneWorker::start("netcut-read").await?;
    one.proxy.set_outage(true);
    one.proxy.set_cutting(true);
    let failures = [
        "read failed; retrying",
        "reading back pending messages failed",
        "waiting for new messages failed",
        "cannot connect for reading",
    ];
    one.wait_failures(&failures, 2 * BACKED_OFF).await?;
    one.proxy.set_outage(false);
    let id = one
        .submit("adversarial", json!({"op": "sleep", "ms": 10}))
        .await?;
    one.succeeded(&id).await
}

/// A subscriber to live events still gets them from an API whose reads
/// backed off through an outage, on a link that drops idle connections: a
/// read that finds its connection broken is made again at once, on the
/// new one.
///
/// A `dtq api` process reaches Redis through the proxy; the worker, and
/// the API the tasks are submitted to, reach it directly. One subscriber of the
/// process's events sees a first task. Then Redis is unreachable through
/// the proxy until the subscriber's reader has logged twice
/// [`BACKED_OFF`] failed reads; then connections get through but live 300
/// to 400 ms, cut while idle, and a second task is submitted: a reader
/// that reads only after each backoff finds its connection cut every
/// time, and the subscriber never sees that task.
#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_of_an_api_that_backed_off_gets_events_on_a_link_that_drops_idle_connections()
-> Result<()> {
    let dir = TempDir::new("netcut-events")?;
    let dtq = Dtq::start(true, &[]).await?;
    let upstream: SocketAddr = format!("127.0.0.1:{}", dtq.redis.single().port()).parse()?;
    let proxy = CuttingProxy::start(upstream, IDLE_CUT).await?;
    let port = dtq_tests::free_port()?;
    let mut cmd = dtq_tests::process::dtq_command(DTQ);
    cmd.env("NO_COLOR", "1")
        .env("DTQ_LOG", "info,dtq_host::api::events=debug")
        .arg("api")
        .args(["--redis", &proxy.redis_url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--handlers")
        .arg(&dir.path);
    let mut api = DtqProcess::spawn(
        "api",
        cmd,
        dir.path.join("api.log"),
        format!("http://127.0.0.1:{port}"),
    )?;
    api.wait_healthy(STARTUP).await?;
    let response = reqwest::Client::new()
        .get(format!("{}/v1/queues/{QUEUE}/events", api.api))
        .header("Accept", "text/event-stream")
        .send()
        .await?;
    ensure!(
        response.status() == 200,
        "subscribe: {} {}",
        response.status(),
        response.text().await?
    );
    let mut events = SseReader::new(response);
    let body = json!({"task": "echo", "payload": 1});
    let first = dtq.submit_new(QUEUE, body.clone(), None).await?;
    sees(&mut events, &first).await?;

    proxy.set_outage(true);
    proxy.set_cutting(true);
    wait_logged(&mut api, &["event stream: read failed"], 2 * BACKED_OFF).await?;
    proxy.set_outage(false);
    let second = dtq.submit_new(QUEUE, body, None).await?;
    let seen = sees(&mut events, &second).await;
    api.check_alive()?;
    if seen.is_err() {
        eprintln!("--- tail of api ---\n{}", tail(&api.log_text(), 100));
    }
    seen
}

/// Read `events` until one of task `id`'s, for up to 20 s.
async fn sees(events: &mut SseReader, id: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = match tokio::time::timeout(left, events.next()).await {
            Ok(event) => event?.context("the stream ended")?,
            Err(_) => bail!("no event of task {id} within 20 s"),
        };
        let data: serde_json::Value = serde_json::from_str(&event.data)?;
        if data["task_id"] == id {
            return Ok(());
        }
    }
}

/// The proxy itself: it forwards, and it cuts.
#[tokio::test]
async fn the_proxy_forwards_until_it_cuts() -> Result<()> {
    let redis = dtq_tests::RedisServer::start()?;
    let upstream: SocketAddr = format!("127.0.0.1:{}", redis.port()).parse()?;
    let proxy = CuttingProxy::start(
        upstream,
        Duration::from_millis(50)..Duration::from_millis(100),
    )
    .await?;
    let client = redis::Client::open(proxy.redis_url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await?;
    assert_eq!(pong, "PONG");
    // Not cutting: the connection outlives many lifetimes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await?;
    assert_eq!(pong, "PONG");
    proxy.set_cutting(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.cuts() == 0 {
        ensure!(Instant::now() < deadline, "never cut");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    assert!(after.is_err(), "a cut connection still answered");
    // A new connection gets through.
    let mut fresh = client
        .get_multiplexed_async_connection()
        .await
        .context("reconnect")?;
    let pong: String = redis::cmd("PING").query_async(&mut fresh).await?;
    assert_eq!(pong, "PONG");
    // An outage resets that connection and refuses new ones until it ends.
    proxy.set_cutting(false);
    proxy.set_outage(true);
    let during: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut fresh).await;
    assert!(during.is_err(), "a connection answered during an outage");
    let refused = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    assert!(
        refused.await.is_err(),
        "a new connection got through an outage"
    );
    proxy.set_outage(false);
    let mut after = client.get_multiplexed_async_connection().await?;
    let pong: String = redis::cmd("PING").query_async(&mut after).await?;
    assert_eq!(pong, "PONG");
    Ok(())
}
