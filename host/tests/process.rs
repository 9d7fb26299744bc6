//! The `dtq` binary as an operator runs it: real `dtq` child processes
//! against a real `redis-server`, running the example handlers.
//!
//! These tests cover what only separate processes can show: a worker killed
//! with SIGKILL loses its task to another worker after the visibility
//! timeout, a live worker keeps its long task, SIGTERM drains running tasks
//! within the grace period (and abandons them to be reclaimed after it), and
//! the command line's exit codes.
//!
//! Every process listens on its own free loopback port, writes its log to a
//! file in the test's temporary directory (printed when the test fails), and
//! is killed when the test ends, however it ends.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use dtq_tests::process::{self, DtqProcess, expect_code, stderr_text as stderr, stdout_json};
use dtq_tests::{ApiClient, RedisServer, TempDir, free_port, guests};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// How long a server process may take to answer `/healthz` (it may compile
/// the handlers when the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Longest wait for a task to reach a status.
const WAIT: Duration = Duration::from_secs(30);

/// The visibility timeout every server runs with (ms).
const VISIBILITY_MS: u64 = 1_000;

fn dtq_command() -> Command {
    dtq_tests::process::dtq_command(DTQ)
}

/// The flags of every server process: the test's Redis, the example
/// handlers, a shared artifact cache and short timings.
fn server_flags(redis: &RedisServer, port: u16) -> Vec<String> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut flags: Vec<String> = [
        "--redis",
        &redis.url(),
        "--handlers",
        guests::EXAMPLES_DIR,
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--visibility-timeout-ms",
        &VISIBILITY_MS.to_string(),
        "--retry-base-ms",
        "20",
        "--retry-max-ms",
        "100",
        "--cache-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.push(cache.display().to_string());
    flags
}

/// A `dtq` server process (`serve`, `worker` or `api`), killed on drop.
struct Proc(DtqProcess);

impl std::ops::Deref for Proc {
    type Target = DtqProcess;
    fn deref(&self) -> &DtqProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut DtqProcess {
        &mut self.0
    }
}

impl Proc {
    /// Start `dtq <subcommand>` with the server flags plus `extra`, and wait
    /// until it is ready: `/healthz` answers 200 (`serve`, `api`) or the
    /// worker has logged its start (`worker`).
    async fn start(
        dir: &TempDir,
        name: &str,
        subcommand: &str,
        redis: &RedisServer,
        extra: &[&str],
    ) -> Result<Proc> {
        // A port free when probed may be taken before the process binds it;
        // such a start is retried on another port.
        let mut last = None;
        for attempt in 0..3 {
            let port = free_port()?;
            let log = dir.path.join(format!("{name}-{attempt}.log"));
            let mut cmd = dtq_command();
            cmd.arg(subcommand)
                .args(server_flags(redis, port))
                .args(extra);
            let api = format!("http://127.0.0.1:{port}");
            let mut proc = Proc(DtqProcess::spawn(name, cmd, log, api)?);
            let ready = if subcommand == "worker" {
                proc.wait_log("worker started", STARTUP).await
            } else {
                proc.wait_healthy(STARTUP).await
            };
            match ready {
                Ok(()) => return Ok(proc),
                Err(e) if proc.log_text().contains("cannot listen") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("{name} did not start")))
    }
}

/// Wait until no Redis client is blocked in a read (XREADGROUP).
async fn wait_no_blocked_read(redis: &RedisServer) -> Result<()> {
    let mut conn = redis.conn().await?;
    let start = Instant::now();
    loop {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut conn)
            .await?;
        // `cmd` is a client's last command; `flags` has `b` while blocked.
        let blocked = |line: &str| {
            line.split(' ')
                .any(|f| f.strip_prefix("flags=").is_some_and(|v| v.contains('b')))
                && line.contains("cmd=xreadgroup")
        };
        if !clients.lines().any(blocked) {
            return Ok(());
        }
        ensure!(start.elapsed() < WAIT, "a read stayed blocked:\n{clients}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client of one API process, on the default queue.
fn client(proc: &Proc) -> ApiClient {
    ApiClient::new(proc.api.clone())
}

/// The idempotency record of `key` in the default queue, as stored.
async fn idem_record(redis: &RedisServer, key: &str) -> Result<Value> {
    redis
        .idem_record("default", key)
        .await?
        .context("no idempotency record")
}

fn sleep_task(ms: u64) -> Value {
    json!({"task": "sleep", "payload": {"ms": ms}})
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_workers_task_is_reclaimed_and_completes_its_key() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let mut a = Proc::start(&dir, "serve-a", "serve", &redis, &[]).await?;
    // The API stays up across the crash in a process of its own.
    let api_proc = Proc::start(&dir, "api", "api", &redis, &[]).await?;
    let api = client(&api_proc);

    let key = "crash-1";
    let id = api
        .submit_new("default", sleep_task(4_000), Some(key))
        .await?;
    let running = api.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    assert_eq!(running["attempts"], 1, "{running}");

    a.crash()?;
    // The task is not terminal: its key is still in flight.
    let (status, body) = api.submit("default", sleep_task(4_000), Some(key)).await?;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(body["error"]["details"]["task_id"], id.as_str());

    let _b = Proc::start(&dir, "worker-b", "worker", &redis, &[]).await?;
    let done = api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        done["attempts"], 2,
        "the reclaimed run is attempt 2: {done:#}"
    );
    assert_eq!(done["result"], json!({"slept_ms": 4000}), "{done:#}");

    let record = idem_record(&redis, key).await?;
    assert_eq!(record["state"], "completed", "{record}");
    assert_eq!(record["task_id"], id.as_str(), "{record}");

    let (status, body) = api.submit("default", sleep_task(4_000), Some(key)).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["duplicate"], true, "{body}");
    assert_eq!(body["task_id"], id.as_str(), "{body}");
    assert_eq!(body["status"], "SUCCEEDED", "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_worker_keeps_a_task_longer_than_the_visibility_timeout() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let a = Proc::start(&dir, "serve-a", "serve", &redis, &[]).await?;
    let _b = Proc::start(&dir, "serve-b", "serve", &redis, &[]).await?;
    let api = client(&a);

    // 3.5 visibility timeouts: only the owner's heartbeats keep the other
    // worker from reclaiming it.
    let id = api
        .submit_new("default", sleep_task(3_500), Some("long-1"))
        .await?;
    let done = api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        done["attempts"], 1,
        "the task was reclaimed from a live worker: {done:#}"
    );
    assert_eq!(done["result"], json!({"slept_ms": 3500}), "{done:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_busy_workers_beats_take_none_of_its_own_finished_attempts_for_stale() -> Result<()> {
    // A carried attempt's success leaves the hash no trace of its worker,
    // so a beat that reads it between the completion's write and the
    // attempt's release finds the task not this attempt's. That attempt is
    // done, not taken over: it must not be reported as stale. Beats every
    // third of a second against a burst of carried tasks meet many such.
    const TASKS: u64 = 4_000;
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let api_proc = Proc::start(&dir, "api", "api", &redis, &[]).await?;
    let api = client(&api_proc);
    for first in (0..TASKS).step_by(1_000) {
        let tasks: Vec<Value> = (first..first + 1_000)
            .map(|n| json!({"task": "echo", "payload": {"n": n}}))
            .collect();
        let (status, body) = api
            .call(
                reqwest::Method::POST,
                "/v1/queues/default/tasks/batch",
                Some(json!({ "tasks": tasks })),
                &[],
            )
            .await?;
        ensure!(status == 200, "batch: {status} {body}");
    }
    let worker = Proc::start(&dir, "worker", "worker", &redis, &[]).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, stats) = api
            .call(reqwest::Method::GET, "/v1/queues/default", None, &[])
            .await?;
        if stats["ready"] == 0 && stats["running"] == 0 {
            ensure!(stats["dead_lettered"] == 0, "{stats}");
            break;
        }
        ensure!(Instant::now() < deadline, "not drained: {stats}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = worker.log_text();
    let stale = log
        .lines()
        .filter(|line| line.contains("no longer this attempt's"))
        .count();
    assert_eq!(stale, 0, "finished attempts reported stale:\n{log}");
    // Every task succeeded, in its first attempt.
    let mut conn = redis.conn().await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("dtq:task:{default}:*")
        .query_async(&mut conn)
        .await?;
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("HMGET").arg(key).arg("status").arg("attempts");
    }
    let records: Vec<(String, String)> = pipe.query_async(&mut conn).await?;
    let first_time = records
        .iter()
        .filter(|(status, attempts)| status == "SUCCEEDED" && attempts == "1")
        .count();
    assert_eq!((keys.len(), first_time), (TASKS as usize, TASKS as usize));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_running_task_finish_and_takes_no_new_work() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    // Default grace period (10 s).
    let mut a = Proc::start(&dir, "serve-a", "serve", &redis, &[]).await?;
    let api_proc = Proc::start(&dir, "api", "api", &redis, &[]).await?;
    let api = client(&api_proc);

    let id = api
        .submit_new("default", sleep_task(2_500), Some("drain-1"))
        .await?;
    api.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    a.signal(libc::SIGTERM)?;
    let signalled = Instant::now();

    // New work after the signal. It is submitted once the worker has taken
    // the signal and the read that was in flight then (it blocks up to
    // 500 ms, and what it delivers is run, so no message is stranded on a
    // stopping worker) has returned: no client is blocked in XREADGROUP.
    a.wait_log("shutting down: no new tasks", WAIT).await?;
    wait_no_blocked_read(&redis).await?;
    let later = api
        .submit_new(
            "default",
            json!({"task": "echo", "payload": {"n": 1}}),
            None,
        )
        .await?;

    let status = a.wait_exit(Duration::from_secs(9)).await?;
    let took = signalled.elapsed();
    assert!(status.success(), "dtq serve exited with {status}");
    let done = api.task("default", &id).await?;
    assert_eq!(
        done["status"], "SUCCEEDED",
        "the running task must finish in the grace period: {done:#}"
    );
    assert_eq!(done["attempts"], 1, "{done:#}");
    assert_eq!(idem_record(&redis, "drain-1").await?["state"], "completed");
    assert!(
        took >= Duration::from_millis(1_000),
        "exited {took:?} after SIGTERM, before its task could finish"
    );

    // The worker has exited and no other runs: the later task is waiting.
    let waiting = api.task("default", &later).await?;
    assert_eq!(
        waiting["status"], "QUEUED",
        "a stopping worker took new work: {waiting:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_draining_worker_keeps_its_task_through_the_grace_period() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    // Default grace period (10 s), far longer than the visibility timeout.
    let mut a = Proc::start(&dir, "serve-a", "serve", &redis, &[]).await?;
    let id = client(&a)
        .submit_new("default", sleep_task(4_000), Some("grace-1"))
        .await?;
    client(&a)
        .wait_for("default", &id, &["RUNNING"], WAIT)
        .await?;

    // Another worker, ready to reclaim whatever goes idle for 1 s.
    let b = Proc::start(&dir, "serve-b", "serve", &redis, &[]).await?;
    let api = client(&b);
    a.signal(libc::SIGTERM)?;
    let status = a.wait_exit(Duration::from_secs(12)).await?;
    assert!(status.success(), "dtq serve exited with {status}");

    // A finished it during its grace period; its heartbeats went on until
    // then, so B never took it over.
    let done = api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        done["attempts"], 1,
        "the task was reclaimed from a worker draining it: {done:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_grace_period_the_task_is_abandoned_and_reclaimed() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let mut a = Proc::start(
        &dir,
        "serve-a",
        "serve",
        &redis,
        &["--shutdown-grace-ms", "300"],
    )
    .await?;
    let api_proc = Proc::start(&dir, "api", "api", &redis, &[]).await?;
    let api = client(&api_proc);

    let id = api
        .submit_new("default", sleep_task(5_000), Some("abandon-1"))
        .await?;
    api.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    a.signal(libc::SIGTERM)?;
    let signalled = Instant::now();
    let status = a.wait_exit(Duration::from_secs(5)).await?;
    let took = signalled.elapsed();
    assert!(status.success(), "dtq serve exited with {status}");
    // Stop fetching (a read blocks up to 500 ms) + 300 ms grace + exit.
    assert!(
        took < Duration::from_secs(3),
        "took {took:?} to exit with a 300 ms grace period"
    );

    let abandoned = api.task("default", &id).await?;
    assert_eq!(
        abandoned["status"], "RUNNING",
        "an abandoned task is not completed: {abandoned:#}"
    );
    assert_eq!(abandoned["attempts"], 1, "{abandoned:#}");
    assert_eq!(
        idem_record(&redis, "abandon-1").await?["state"],
        "processing"
    );

    let _b = Proc::start(&dir, "worker-b", "worker", &redis, &[]).await?;
    let done = api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["attempts"], 2, "{done:#}");
    assert_eq!(
        idem_record(&redis, "abandon-1").await?["state"],
        "completed"
    );
    Ok(())
}

/// Run a `dtq` client command to completion (at most 30 s).
async fn run(args: &[&str]) -> Result<Output> {
    process::run_client(DTQ, args, Duration::from_secs(30)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn help_documents_the_environment_and_the_exit_codes() -> Result<()> {
    let help = |args: &'static [&'static str]| async move {
        let out = run(args).await?;
        expect_code(&out, 0, &format!("dtq {}", args.join(" ")))?;
        anyhow::Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let has_codes = |text: &str, codes: &[u8]| {
        text.contains("Exit codes:")
            && codes
                .iter()
                .all(|c| text.lines().any(|l| l.starts_with(&format!("  {c}  "))))
    };

    let top = help(&["--help"]).await?;
    for var in ["DTQ_REDIS_URL", "DTQ_HANDLERS"] {
        assert!(top.contains(var), "dtq --help misses {var}:\n{top}");
    }
    assert!(has_codes(&top, &[0, 1, 2, 3, 4, 5]), "dtq --help:\n{top}");

    let submit = help(&["submit", "--help"]).await?;
    assert!(
        has_codes(&submit, &[0, 1, 2, 3, 4, 5]),
        "dtq submit --help:\n{submit}"
    );

    for args in [
        &["serve", "--help"][..],
        &["worker", "--help"],
        &["api", "--help"],
    ] {
        let text = help(args).await?;
        for var in ["DTQ_REDIS_URL", "DTQ_HANDLERS", "DTQ_VISIBILITY_TIMEOUT_MS"] {
            assert!(text.contains(var), "dtq {args:?} misses {var}:\n{text}");
        }
        assert!(has_codes(&text, &[0, 1, 2, 3]), "dtq {args:?}:\n{text}");
    }
    Ok(())
}

/// The binary makes mimalloc commit its arena lazily (an idle worker holds
/// about 20 MiB less), as a default that `MIMALLOC_ARENA_EAGER_COMMIT`
/// still overrides. mimalloc's verbose start-up lists its options by name,
/// which also checks that the option set is the one meant.
#[tokio::test(flavor = "multi_thread")]
async fn the_allocator_commits_lazily_and_uses_no_huge_pages_unless_told_otherwise() -> Result<()> {
    // mimalloc's verbose listing of one option, with `env` set for it.
    let option = |name: &'static str, env: (&'static str, Option<&'static str>)| async move {
        let mut cmd = tokio::process::Command::from(dtq_command());
        cmd.arg("--version")
            .env("MIMALLOC_VERBOSE", "1")
            .env_remove(env.0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(value) = env.1 {
            cmd.env(env.0, value);
        }
        let out = tokio::time::timeout(Duration::from_secs(30), cmd.output()).await??;
        expect_code(&out, 0, "dtq --version")?;
        let text = stderr(&out);
        let prefix = format!("option '{name}':");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .with_context(|| format!("mimalloc listed no {name}:\n{text}"))?;
        anyhow::Ok(line.trim().to_owned())
    };
    for (name, env) in [
        ("arena_eager_commit", "MIMALLOC_ARENA_EAGER_COMMIT"),
        ("allow_thp", "MIMALLOC_ALLOW_THP"),
    ] {
        assert_eq!(
            option(name, (env, None)).await?,
            format!("option '{name}': 0")
        );
        assert_eq!(
            option(name, (env, Some("1"))).await?,
            format!("option '{name}': 1")
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_client_commands_exit_with_the_documented_codes() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let server = Proc::start(&dir, "serve", "serve", &redis, &[]).await?;
    let api = server.api.as_str();

    // 0: submitted and SUCCEEDED; the record is printed as JSON.
    let submit_k = [
        "submit",
        "default",
        "echo",
        r#"{"a":1}"#,
        "--api",
        api,
        "-k",
        "K",
    ];
    let out = run(&[&submit_k[..], &["--wait"]].concat()).await?;
    expect_code(&out, 0, "submit --wait")?;
    let first = stdout_json(&out)?;
    assert_eq!(first["status"], "SUCCEEDED", "{first:#}");
    assert_eq!(first["result"], json!({"a": 1}), "{first:#}");

    // 0 again for the same key: the stored task, marked a duplicate.
    let out = run(&submit_k).await?;
    expect_code(&out, 0, "resubmit")?;
    let again = stdout_json(&out)?;
    assert_eq!(again["duplicate"], true, "{again:#}");
    assert_eq!(again["task_id"], first["task_id"], "{again:#}");
    assert_eq!(again["status"], "SUCCEEDED", "{again:#}");
    // With --wait too: the replayed task has finished, so exit 0.
    let out = run(&[&submit_k[..], &["--wait"]].concat()).await?;
    expect_code(&out, 0, "resubmit --wait")?;
    assert_eq!(stdout_json(&out)?["task_id"], first["task_id"]);

    // 1: the server refused it; stderr has the error code.
    let out = run(&["submit", "default", "no_such_task", "{}", "--api", api]).await?;
    expect_code(&out, 1, "unknown task")?;
    assert!(stderr(&out).contains("UNKNOWN_TASK"), "{}", stderr(&out));

    // 2: bad command line (the payload is not JSON; nothing is sent).
    let out = run(&["submit", "default", "echo", "{not json", "--api", api]).await?;
    expect_code(&out, 2, "non-JSON payload")?;
    assert!(stderr(&out).contains("not JSON"), "{}", stderr(&out));
    let out = run(&["submit", "default"]).await?;
    expect_code(&out, 2, "missing arguments")?;

    // 3: nothing listens there.
    let closed = format!("http://127.0.0.1:{}", free_port()?);
    let out = run(&["submit", "default", "echo", "{}", "--api", &closed]).await?;
    expect_code(&out, 3, "unreachable API")?;

    // 4: --wait on a task that dead-letters.
    let out = run(&[
        "submit",
        "default",
        "flaky",
        r#"{"succeed_on_attempt": 2}"#,
        "--max-attempts",
        "1",
        "--wait",
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 4, "dead-lettered task with --wait")?;
    let dead = stdout_json(&out)?;
    assert_eq!(dead["status"], "DEAD_LETTERED", "{dead:#}");
    let dead_id = dead["task_id"].as_str().context("task_id")?;

    // 5: --wait gives up while the task still runs.
    let out = run(&[
        "submit",
        "default",
        "sleep",
        r#"{"ms": 3000}"#,
        "--wait",
        "--wait-timeout-s",
        "1",
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 5, "--wait-timeout-s")?;

    // Reading commands print JSON and exit 0.
    let out = run(&["status", "default", dead_id, "--api", api]).await?;
    expect_code(&out, 0, "status")?;
    assert_eq!(stdout_json(&out)?["status"], "DEAD_LETTERED");
    let out = run(&["dlq", "list", "default", "--api", api]).await?;
    expect_code(&out, 0, "dlq list")?;
    let listed = stdout_json(&out)?;
    assert!(
        listed.to_string().contains(dead_id),
        "dlq list misses {dead_id}: {listed:#}"
    );
    let out = run(&["queues", "--api", api]).await?;
    expect_code(&out, 0, "queues")?;
    assert!(
        stdout_json(&out)?.to_string().contains("default"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // 1: the admin routes are off without a token.
    let out = run(&["dlq", "requeue", "default", dead_id, "--api", api]).await?;
    expect_code(&out, 1, "dlq requeue without a token")?;
    assert!(stderr(&out).contains("ADMIN_DISABLED"), "{}", stderr(&out));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_batch_prints_a_result_per_line_and_fails_if_any_is_refused() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let server = Proc::start(&dir, "serve", "serve", &redis, &[]).await?;
    let api = server.api.as_str();
    let file = dir.path.join("tasks.jsonl");
    let lines = [
        r#"{"task": "echo", "payload": {"n": 1}, "idempotency_key": "b-1"}"#,
        "",
        r#"{"task": "echo", "payload": {"n": 2}, "run_at": "2001-01-01T00:00:00Z"}"#,
    ];
    std::fs::write(&file, lines.join("\n"))?;
    let path = file.to_string_lossy().into_owned();
    let out = run(&["submit-batch", "default", &path, "--api", api]).await?;
    expect_code(&out, 0, "submit-batch")?;
    let printed: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(printed.len(), 2, "{printed:#?}");
    assert_eq!(
        (&printed[0]["line"], &printed[0]["status"]),
        (&json!(1), &json!(202))
    );
    assert_eq!(
        (&printed[1]["line"], &printed[1]["status"]),
        (&json!(3), &json!(202))
    );
    let id = printed[0]["body"]["task_id"].as_str().context("task_id")?;
    client(&server)
        .wait_for("default", id, &["SUCCEEDED"], WAIT)
        .await?;

    // The same file again: a replay, and a refused line, exit 1.
    let refused = r#"{"task": "no_such_task"}"#;
    std::fs::write(&file, format!("{}\n{refused}\n", lines[0]))?;
    let out = run(&["submit-batch", "default", &path, "--api", api]).await?;
    expect_code(&out, 1, "submit-batch with a refused line")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let printed: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(printed[0]["status"], 200, "{text}");
    assert_eq!(printed[0]["body"]["task_id"], id, "{text}");
    assert_eq!(
        printed[1]["body"]["error"]["code"], "UNKNOWN_TASK",
        "{text}"
    );
    assert!(stderr(&out).contains("1 refused"), "{}", stderr(&out));

    // 2: a line that is not JSON; nothing is sent.
    std::fs::write(&file, "{\"task\": \"echo\"}\n{oops\n")?;
    let out = run(&["submit-batch", "default", &path, "--api", api]).await?;
    expect_code(&out, 2, "submit-batch with a line that is not JSON")?;
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));

    // `submit --run-at` schedules the task at that time.
    let at = dtq_host::base::now_ms() + 3_600_000;
    let out = run(&[
        "submit",
        "default",
        "echo",
        "{}",
        "--run-at",
        &at.to_string(),
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 0, "submit --run-at")?;
    assert_eq!(stdout_json(&out)?["status"], "SCHEDULED");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_that_cannot_start_says_why() -> Result<()> {
    let redis = RedisServer::start()?;
    let port = free_port()?.to_string();
    let listen = format!("127.0.0.1:{port}");

    let out = run(&[
        "serve",
        "--redis",
        &redis.url(),
        "--handlers",
        "/nonexistent",
        "--listen",
        &listen,
    ])
    .await?;
    expect_code(&out, 2, "serve --handlers /nonexistent")?;
    assert!(
        stderr(&out).contains("/nonexistent") && stderr(&out).contains("does not exist"),
        "{}",
        stderr(&out)
    );

    let closed = format!("redis://127.0.0.1:{}/", free_port()?);
    let started = Instant::now();
    let out = run(&[
        "serve",
        "--redis",
        &closed,
        "--handlers",
        guests::EXAMPLES_DIR,
        "--listen",
        &listen,
    ])
    .await?;
    expect_code(&out, 3, "serve with Redis unreachable")?;
    assert!(
        stderr(&out).contains("cannot reach Redis"),
        "{}",
        stderr(&out)
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?} to give up",
        started.elapsed()
    );

    let out = run(&["serve", "--redis", &redis.url(), "--concurrency", "0"]).await?;
    expect_code(&out, 2, "serve --concurrency 0")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_handler_file_is_reported_in_one_line_and_the_rest_run() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let handlers = dir.path.join("handlers");
    std::fs::create_dir(&handlers)?;
    let examples = std::path::Path::new(guests::EXAMPLES_DIR);
    std::fs::copy(examples.join("echo.wasm"), handlers.join("echo.wasm"))?;
    std::fs::write(handlers.join("broken.wasm"), b"not a component")?;

    let port = free_port()?;
    let mut flags = server_flags(&redis, port);
    let at = flags
        .iter()
        .position(|f| f == "--handlers")
        .context("no --handlers flag")?;
    flags[at + 1] = handlers.display().to_string();
    let log = dir.path.join("serve.log");
    let mut cmd = dtq_command();
    cmd.arg("serve").args(&flags);
    let api = format!("http://127.0.0.1:{port}");
    let mut proc = Proc(DtqProcess::spawn("serve", cmd, log, api)?);
    proc.wait_healthy(STARTUP).await?;
    let api = client(&proc);
    let id = api
        .submit_new(
            "default",
            json!({"task": "echo", "payload": {"x": 1}}),
            None,
        )
        .await?;
    let done = api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["result"], json!({"x": 1}), "{done:#}");

    let text = proc.log_text();
    let skipped: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("handler skipped"))
        .collect();
    assert_eq!(skipped.len(), 1, "{text}");
    assert!(skipped[0].contains("broken.wasm"), "{}", skipped[0]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_that_cannot_listen_exits_1_and_says_so_once() -> Result<()> {
    let redis = RedisServer::start()?;
    // Held for the whole test: nothing else can bind it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let listen = taken.local_addr()?.to_string();
    for subcommand in ["api", "serve"] {
        let out = run(&[
            subcommand,
            "--redis",
            &redis.url(),
            "--handlers",
            guests::EXAMPLES_DIR,
            "--listen",
            &listen,
        ])
        .await?;
        expect_code(&out, 1, &format!("{subcommand} on a taken address"))?;
        let err = stderr(&out);
        let reported: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(reported.len(), 1, "{err}");
        assert!(
            reported[0].contains(&format!("cannot listen on {listen}")),
            "{err}"
        );
        assert_eq!(
            err.matches("cannot listen").count(),
            1,
            "the error is printed more than once:\n{err}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_client_encodes_queue_names_and_task_ids_as_one_path_segment() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    let server = Proc::start(&dir, "api", "api", &redis, &[]).await?;
    let api = server.api.as_str();

    // Each id would change the route if sent raw: another segment, an
    // escape, a query, a fragment. Encoded, each reaches the
    // task route as itself, which answers TASK_NOT_FOUND with the id it
    // was given, not the unknown-route NOT_FOUND.
    for id in ["a/b", "a%2Fb", "a b", "a?b=1", "a#b", "a%"] {
        for command in ["status", "cancel"] {
            let out = run(&[command, "default", id, "--api", api]).await?;
            expect_code(&out, 1, &format!("{command} {id:?}"))?;
            let body = stdout_json(&out)?;
            assert_eq!(
                body["error"]["code"], "TASK_NOT_FOUND",
                "{command} {id:?}: {body:#}"
            );
            assert_eq!(
                body["error"]["details"]["task_id"], id,
                "{command} {id:?}: {body:#}"
            );
            assert_eq!(body["error"]["details"]["queue"], "default", "{body:#}");
        }
    }
    // `.` and `..` are path steps even encoded: refused before sending.
    for id in [".", ".."] {
        let out = run(&["status", "default", id, "--api", api]).await?;
        expect_code(&out, 2, &format!("status {id:?}"))?;
    }
    // A queue name holding `/` is one segment too: the API refuses the name
    // (it is not a valid queue name) instead of routing elsewhere.
    let out = run(&["queues", "a/b", "--api", api]).await?;
    expect_code(&out, 1, "queues a/b")?;
    let body = stdout_json(&out)?;
    assert_ne!(body["error"]["code"], "NOT_FOUND", "{body:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_whose_worker_dies_stops_its_api_and_returns_the_error() -> Result<()> {
    use dtq_host::server::{Roles, Server, ServerError};
    let redis = RedisServer::start()?;
    let mut flags = server_flags(&redis, 0);
    flags.extend(["--queues".to_owned(), "srv-dies".to_owned()]);
    let config = dtq_host::Config::from_args(flags)?;
    let server = Server::prepare(config, Roles::SERVE).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let healthz = format!("http://{}/healthz", listener.local_addr()?);
    let running = tokio::spawn(server.serve(Some(listener), std::future::pending()));
    let http = reqwest::Client::new();
    let status = http.get(&healthz).send().await?.status();
    assert_eq!(status, 200, "the API is not up");

    dtq_host::worker::inject_fault("fetch", "srv-dies", dtq_host::worker::Fault::Panic);
    let ended = tokio::time::timeout(WAIT, running)
        .await
        .context("the server ran on after its worker died")??;
    let err = ended.expect_err("the server ended without an error");
    assert!(matches!(err, ServerError::Worker(_)), "{err:?}");
    assert_eq!(err.exit_code(), 1, "{err:?}");
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(chain.contains("injected fault"), "{chain}");
    assert!(
        http.get(&healthz).send().await.is_err(),
        "the API still answers after the server stopped"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_prints_events_and_submit_wait_follows_them() -> Result<()> {
    use tokio::io::{AsyncBufReadExt, BufReader};

    /// Redis clients blocked in XREAD: the API's event streams.
    async fn event_readers(redis: &RedisServer) -> Result<usize> {
        let mut conn = redis.conn().await?;
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut conn)
            .await?;
        Ok(clients
            .lines()
            .filter(|l| {
                l.contains("cmd=xread ")
                    && l.split(' ')
                        .any(|f| f.strip_prefix("flags=").is_some_and(|v| v.contains('b')))
            })
            .count())
    }
    async fn wait_readers(redis: &RedisServer, want: usize) -> Result<()> {
        let start = Instant::now();
        while event_readers(redis).await? != want {
            ensure!(start.elapsed() < WAIT, "never {want} event readers");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    let redis = RedisServer::start()?;
    let dir = TempDir::new("process")?;
    // One event stream at most: `watch` takes it below, and `submit
    // --wait` must then do without.
    let server = Proc::start(
        &dir,
        "serve",
        "serve",
        &redis,
        &["--api-max-event-streams", "1"],
    )
    .await?;
    let api = server.api.as_str();

    // `submit --wait` follows the task on the events stream while it runs.
    let waiting = tokio::spawn({
        let api = api.to_owned();
        async move {
            run(&[
                "submit",
                "default",
                "sleep",
                r#"{"ms": 1500}"#,
                "--wait",
                "--api",
                &api,
            ])
            .await
        }
    });
    wait_readers(&redis, 1).await?;
    let out = waiting.await??;
    expect_code(&out, 0, "submit --wait on the events stream")?;
    let slept = stdout_json(&out)?;
    assert_eq!(slept["status"], "SUCCEEDED", "{slept:#}");
    assert_eq!(slept["duplicate"], false, "{slept:#}");
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    // Its stream is closed with it.
    wait_readers(&redis, 0).await?;

    // A task that ends badly: exit 4 and the record, as before.
    let out = run(&[
        "submit",
        "default",
        "flaky",
        r#"{"succeed_on_attempt": 2}"#,
        "--max-attempts",
        "1",
        "--wait",
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 4, "submit --wait, dead-lettered")?;
    assert_eq!(stdout_json(&out)?["status"], "DEAD_LETTERED");
    // Its stream outlives the command until the API notices the client
    // left; counted below, it would pass for `watch`'s.
    wait_readers(&redis, 0).await?;

    // `dtq watch` prints every event of the queue as a JSON line.
    let mut watch = tokio::process::Command::from(dtq_command());
    watch
        .args(["watch", "default", "--api", api])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut watch = watch.spawn().context("spawn dtq watch")?;
    let mut lines = BufReader::new(watch.stdout.take().context("stdout")?).lines();
    wait_readers(&redis, 1).await?;
    // That count also takes in the worker's own wait for new messages (an
    // XREAD too), so it can be reached before `watch` reads anything. A
    // probe task whose event `watch` prints says its stream is live; one
    // it missed (submitted before the stream opened) is followed by
    // another. Probes are scheduled an hour ahead: they never run, and no
    // listing of SUCCEEDED tasks below shows them.
    let later = (dtq_host::base::now_ms() + 3_600_000).to_string();
    let deadline = Instant::now() + WAIT;
    'live: loop {
        ensure!(
            Instant::now() < deadline,
            "dtq watch printed no probe's event"
        );
        let out = run(&[
            "submit",
            "default",
            "echo",
            r#"{"probe": true}"#,
            "--run-at",
            &later,
            "--api",
            api,
        ])
        .await?;
        expect_code(&out, 0, "submit a probe")?;
        let probe = stdout_json(&out)?["task_id"]
            .as_str()
            .context("task_id")?
            .to_owned();
        while let Ok(line) =
            tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await
        {
            let line = line?.context("dtq watch ended")?;
            let event: Value = serde_json::from_str(&line)
                .with_context(|| format!("not a JSON line: {line:?}"))?;
            if event["task_id"] == probe.as_str() {
                break 'live;
            }
        }
    }

    // The one stream is taken: `submit --wait` polls instead, and nothing
    // it prints or returns shows the difference.
    let out = run(&[
        "submit",
        "default",
        "echo",
        r#"{"w": 1}"#,
        "--wait",
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 0, "submit --wait, polling")?;
    let echoed = stdout_json(&out)?;
    assert_eq!(echoed["result"], json!({"w": 1}), "{echoed:#}");
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    let id = echoed["task_id"].as_str().context("task_id")?;

    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("SUCCEEDED") {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .context("no event line from dtq watch")??
            .context("dtq watch ended")?;
        let event: Value =
            serde_json::from_str(&line).with_context(|| format!("not a JSON line: {line:?}"))?;
        // A late line of a probe.
        if event["task_id"] != id {
            continue;
        }
        assert_eq!(event["event"], event["status"], "{event}");
        assert!(
            event["id"].as_str().is_some_and(|i| i.contains('-')),
            "{event}"
        );
        seen.push(event["status"].as_str().unwrap_or_default().to_owned());
    }
    // A first attempt runs from its message, with no RUNNING event
    // (`--events terminal`, the default).
    assert_eq!(seen, ["QUEUED", "SUCCEEDED"]);

    // `dtq tasks`: newest first, by status, a page at a time.
    let out = run(&[
        "tasks",
        "default",
        "--status",
        "succeeded",
        "--limit",
        "1",
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 0, "tasks")?;
    let page = stdout_json(&out)?;
    assert_eq!(page["tasks"][0]["task_id"], id, "{page:#}");
    let cursor = page["next_cursor"].as_str().context("a next page")?;
    let out = run(&[
        "tasks",
        "default",
        "--status",
        "SUCCEEDED",
        "--cursor",
        cursor,
        "--api",
        api,
    ])
    .await?;
    expect_code(&out, 0, "tasks --cursor")?;
    let rest = stdout_json(&out)?;
    assert_eq!(rest["tasks"][0]["task_id"], slept["task_id"], "{rest:#}");
    assert_eq!(rest["next_cursor"], Value::Null, "{rest:#}");
    let out = run(&["tasks", "default", "--status", "DONE", "--api", api]).await?;
    expect_code(&out, 1, "tasks --status DONE")?;
    assert!(stderr(&out).contains("INVALID_STATUS"), "{}", stderr(&out));

    // Interrupted, `dtq watch` exits 0, and its stream is closed.
    let pid = i32::try_from(watch.id().context("watch's pid")?)?;
    // SAFETY: kill(2) with a child's pid and a signal number; no memory
    // is involved.
    let rc = unsafe { libc::kill(pid, libc::SIGINT) };
    ensure!(rc == 0, "kill failed");
    let status = tokio::time::timeout(WAIT, watch.wait())
        .await
        .context("dtq watch ran on after SIGINT")??;
    assert_eq!(status.code(), Some(0), "{status}");
    wait_readers(&redis, 0).await
}
