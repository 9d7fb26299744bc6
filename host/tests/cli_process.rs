//! The `dtq` command as a person and a script use it: real `dtq` processes
//! against a real `redis-server`, running the example handlers.
//!
//! Each test's commands run with stdout a pipe, so what they print is the
//! JSON scripts read (the choice of tables on a terminal is unit-tested in
//! `cli/print.rs`, their look in `cli/table.rs`): the task name in `watch`
//! events, `tasks --task`, `submit --wait` following a key's task in
//! flight, the warning of a queue no worker consumes, and a Redis that
//! refuses connections said as such.

use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_tests::process::{self, DtqProcess, expect_code, stderr_text as stderr, stdout_json};
use dtq_tests::{ApiClient, RedisServer, TempDir, free_port, guests};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// How long a server process may take to be ready (it may compile the
/// handlers when the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Longest wait for anything else.
const WAIT: Duration = Duration::from_secs(30);

/// Start `dtq <role>` on `redis` with the example handlers, plus `extra`,
/// and wait until it is ready.
async fn start(
    dir: &TempDir,
    name: &str,
    role: &str,
    redis: &RedisServer,
    extra: &[&str],
) -> Result<DtqProcess> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut last = None;
    // A port free when probed may be taken before the process binds it.
    for attempt in 0..3 {
        let port = free_port()?;
        let mut cmd = dtq_tests::process::dtq_command(DTQ);
        cmd.arg(role)
            .args(["--redis", &redis.url(), "--handlers", guests::EXAMPLES_DIR])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--cache-dir")
            .arg(&cache)
            .args(extra);
        let log = dir.path.join(format!("{name}-{attempt}.log"));
        let api = format!("http://127.0.0.1:{port}");
        let mut proc = DtqProcess::spawn(name, cmd, log, api)?;
        let ready = if role == "worker" {
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

/// A `dtq` client command, its output piped, killed if dropped.
fn command(args: &[&str]) -> tokio::process::Command {
    process::client_command(DTQ, args)
}

/// Run a `dtq` client command to completion (at most [`WAIT`]).
async fn run(args: &[&str]) -> Result<Output> {
    process::run_client(DTQ, args, WAIT).await
}

/// Wait until the fleet report shows a live worker consuming `queue`.
async fn wait_consumed(api: &ApiClient, queue: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        let (_, body) = api
            .call(reqwest::Method::GET, "/v1/handlers", None, &[])
            .await?;
        let consumed = body["workers"]
            .as_array()
            .is_some_and(|ws| ws.iter().any(|w| w["queues"].to_string().contains(queue)));
        if consumed {
            return Ok(());
        }
        ensure!(
            start.elapsed() < WAIT,
            "no worker reported {queue}: {body:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn output_is_json_without_a_terminal_and_with_the_flag() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    let server = start(&dir, "serve", "serve", &redis, &[]).await?;
    let api = server.api.as_str();
    let id = ApiClient::new(api)
        .submit_new(
            "default",
            json!({"task": "echo", "payload": {"a": 1}}),
            None,
        )
        .await?;
    ApiClient::new(api)
        .wait_for("default", &id, &["SUCCEEDED"], WAIT)
        .await?;

    // Piped, with --json, with DTQ_JSON: the same pretty JSON, the record
    // as the API sent it.
    let piped = run(&["status", "default", &id, "--api", api]).await?;
    expect_code(&piped, 0, "status")?;
    let record = stdout_json(&piped)?;
    assert_eq!(record["result"], json!({"a": 1}), "{record:#}");
    assert!(
        String::from_utf8_lossy(&piped.stdout).starts_with("{\n  \""),
        "not pretty JSON"
    );
    let flagged = run(&["--json", "status", "default", &id, "--api", api]).await?;
    expect_code(&flagged, 0, "--json status")?;
    assert_eq!(flagged.stdout, piped.stdout);
    let after = run(&["status", "default", &id, "--api", api, "--json"]).await?;
    assert_eq!(after.stdout, piped.stdout, "--json after the command");
    let mut by_env = command(&["status", "default", &id, "--api", api]);
    by_env.env("DTQ_JSON", "1");
    let by_env = by_env.output().await?;
    expect_code(&by_env, 0, "DTQ_JSON=1 status")?;
    assert_eq!(by_env.stdout, piped.stdout);

    // The help says how the output is chosen.
    let help = run(&["--help"]).await?;
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("--json") && text.contains("local times"),
        "{text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn events_carry_the_task_name_on_the_stream_and_in_watch() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    let server = start(&dir, "serve", "serve", &redis, &[]).await?;
    let api = server.api.as_str();
    let client = ApiClient::new(api);
    let echo = client
        .submit_new("default", json!({"task": "echo", "payload": {}}), None)
        .await?;
    let sleep = client
        .submit_new(
            "default",
            json!({"task": "sleep", "payload": {"ms": 1}}),
            None,
        )
        .await?;
    for id in [&echo, &sleep] {
        client.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }

    // The SSE event itself: `task` beside `task_id`, from the beginning of
    // the stream.
    let rust = dtq_host::client::Client::new(api)?;
    let mut events = rust.watch("default", None, Some("0".into()))?;
    let mut names = std::collections::BTreeMap::new();
    while names.len() < 2 {
        let next = tokio::time::timeout(WAIT, events.next()).await??;
        let dtq_host::client::events::Watched::Event(event) = next else {
            bail!("the stream broke: {next:?}");
        };
        let data: Value = serde_json::from_str(&event.data)?;
        let id = data["task_id"].as_str().context("task_id")?.to_owned();
        assert!(data.get("task").is_some(), "no task field: {data}");
        if id == echo || id == sleep {
            names.insert(id, data["task"].clone());
        }
    }
    assert_eq!(names[&echo], "echo");
    assert_eq!(names[&sleep], "sleep");

    // `dtq watch` prints it in each line.
    let mut watch = command(&["watch", "default", "--since", "0", "--api", api]).spawn()?;
    let mut lines = BufReader::new(watch.stdout.take().context("stdout")?).lines();
    let mut seen = 0;
    while seen < 2 {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .context("no line from dtq watch")??
            .context("dtq watch ended")?;
        let event: Value = serde_json::from_str(&line)?;
        if event["task_id"] == echo.as_str() && event["event"] == "SUCCEEDED" {
            assert_eq!(event["task"], "echo", "{line}");
            seen += 1;
        }
        if event["task_id"] == sleep.as_str() && event["event"] == "SUCCEEDED" {
            assert_eq!(event["task"], "sleep", "{line}");
            seen += 1;
        }
    }
    watch.kill().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_lists_one_task_name_on_the_server_side() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    // An API only: the tasks stay QUEUED.
    let server = start(&dir, "api", "api", &redis, &[]).await?;
    let api = server.api.as_str();
    let client = ApiClient::new(api);
    let mut echoes = Vec::new();
    for n in 0..3 {
        echoes.push(
            client
                .submit_new(
                    "default",
                    json!({"task": "echo", "payload": {"n": n}}),
                    None,
                )
                .await?,
        );
    }
    let sleep = client
        .submit_new(
            "default",
            json!({"task": "sleep", "payload": {"ms": 1}}),
            None,
        )
        .await?;

    let ids = |page: &Value| -> Vec<String> {
        page["tasks"]
            .as_array()
            .map(|ts| {
                ts.iter()
                    .filter_map(|t| t["task_id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let out = run(&["tasks", "default", "--task", "sleep", "--api", api]).await?;
    expect_code(&out, 0, "tasks --task sleep")?;
    let page = stdout_json(&out)?;
    assert_eq!(ids(&page), [sleep], "{page:#}");
    assert_eq!(page["task"], "sleep", "{page:#}");
    assert_eq!(page["next_cursor"], Value::Null, "{page:#}");

    // Pages of two, newest first, with the status filter too.
    let first = run(&[
        "tasks", "default", "--task", "echo", "--status", "queued", "--limit", "2", "--api", api,
    ])
    .await?;
    expect_code(&first, 0, "tasks --task echo --limit 2")?;
    let first = stdout_json(&first)?;
    assert_eq!(
        ids(&first),
        [echoes[2].clone(), echoes[1].clone()],
        "{first:#}"
    );
    let cursor = first["next_cursor"].as_str().context("a next page")?;
    let rest = run(&[
        "tasks", "default", "--task", "echo", "--cursor", cursor, "--api", api,
    ])
    .await?;
    let rest = stdout_json(&rest)?;
    assert_eq!(ids(&rest), [echoes[0].clone()], "{rest:#}");
    assert_eq!(rest["next_cursor"], Value::Null, "{rest:#}");

    let none = run(&["tasks", "default", "--task", "flaky", "--api", api]).await?;
    assert_eq!(ids(&stdout_json(&none)?), Vec::<String>::new());

    // A name that cannot be a task's is refused with its code.
    let out = run(&["tasks", "default", "--task", "no such/name", "--api", api]).await?;
    expect_code(&out, 1, "tasks --task with a bad name")?;
    assert!(
        stderr(&out).contains("INVALID_TASK_NAME"),
        "{}",
        stderr(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_wait_follows_a_key_in_flight_and_warns_of_a_queue_without_worker() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    // Its worker consumes `default` only.
    let server = start(&dir, "serve", "serve", &redis, &[]).await?;
    let api = server.api.as_str();
    wait_consumed(&ApiClient::new(api), "default").await?;

    // A queue no live worker consumes: the task waits, and stderr says so.
    let payload = r#"{"k": "in flight"}"#;
    let submit = ["submit", "later", "echo", payload, "-k", "K", "--api", api];
    let out = run(&submit).await?;
    expect_code(&out, 0, "submit to a queue without a worker")?;
    let first = stdout_json(&out)?;
    assert_eq!(first["status"], "QUEUED", "{first:#}");
    assert!(
        stderr(&out).contains("warning: no live worker consumes queue \"later\""),
        "{}",
        stderr(&out)
    );

    // The same key while its task is in flight: followed, not refused.
    let mut waiting = command(&[&submit[..], &["--wait"]].concat()).spawn()?;
    let mut err_lines = BufReader::new(waiting.stderr.take().context("stderr")?).lines();
    let following = loop {
        let line = tokio::time::timeout(WAIT, err_lines.next_line())
            .await
            .context("submit --wait said nothing on stderr")??
            .context("submit --wait ended without following the task")?;
        if line.contains("following that task") {
            break line;
        }
    };
    let id = first["task_id"].as_str().context("task_id")?;
    assert!(following.contains(id), "{following}");

    // A worker for the queue: the task runs, and the waiting command
    // prints its result and exits 0.
    let _worker = start(&dir, "worker", "worker", &redis, &["--queues", "later"]).await?;
    let out = tokio::time::timeout(WAIT, waiting.wait_with_output())
        .await
        .context("submit --wait did not end")??;
    expect_code(&out, 0, "submit --wait -k K while K is in flight")?;
    let done = stdout_json(&out)?;
    assert_eq!(done["task_id"], id, "{done:#}");
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"], json!({"k": "in flight"}), "{done:#}");
    assert_eq!(done["duplicate"], true, "{done:#}");

    // Without --wait a key in flight is still the 409, as before.
    let key2 = ["submit", "later2", "echo", "{}", "-k", "K2", "--api", api];
    expect_code(&run(&key2).await?, 0, "submit to later2")?;
    let out = run(&key2).await?;
    expect_code(&out, 1, "resubmit without --wait")?;
    assert!(
        stderr(&out).contains("IDEMPOTENCY_IN_PROGRESS"),
        "{}",
        stderr(&out)
    );

    // A queue a live worker consumes: no warning.
    let out = run(&["submit", "default", "echo", "{}", "--api", api]).await?;
    expect_code(&out, 0, "submit to default")?;
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_report_that_cannot_be_read_does_not_fail_the_submit() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    // No worker at all, and a token that may submit but not read (`GET
    // /v1/handlers` needs `read`): the fleet report is refused.
    let server = start(
        &dir,
        "api",
        "api",
        &redis,
        &["--tokens", "submit-only-token-0123456789abcdef submit solo"],
    )
    .await?;
    let out = run(&[
        "submit",
        "solo",
        "echo",
        "{}",
        "--token",
        "submit-only-token-0123456789abcdef",
        "--api",
        &server.api,
    ])
    .await?;
    expect_code(&out, 0, "submit with a token that cannot read the fleet")?;
    assert_eq!(stdout_json(&out)?["status"], "QUEUED");
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_redis_is_said_to_refuse_and_a_stalled_one_to_be_late() -> Result<()> {
    // At start: a worker pointed at a closed port.
    let closed = free_port()?;
    let out = run(&[
        "worker",
        "--redis",
        &format!("redis://127.0.0.1:{closed}/"),
        "--handlers",
        guests::EXAMPLES_DIR,
    ])
    .await?;
    expect_code(&out, 3, "worker with nothing at --redis")?;
    let err = stderr(&out);
    assert!(
        err.contains(&format!("127.0.0.1:{closed} refused the connection"))
            && err.contains("DTQ_REDIS_URL"),
        "{err}"
    );

    // While running: an API whose Redis went away answers that it refused.
    let dir = TempDir::new("cli")?;
    let redis = RedisServer::start()?;
    let port = redis.port();
    let server = start(&dir, "api", "api", &redis, &[]).await?;
    let api = server.api.clone();
    drop(redis);
    let mut said = Vec::new();
    let refused = loop {
        let out = run(&["queues", "--api", &api]).await?;
        let err = stderr(&out);
        if err.contains("refused the connection") {
            expect_code(&out, 3, "queues with Redis gone")?;
            break err;
        }
        said.push(err);
        ensure!(said.len() < 50, "never said refused: {said:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        refused.contains(&format!("127.0.0.1:{port}")) && refused.contains("--redis"),
        "{refused}"
    );
    // And so does every request after it: each waits for a reconnection,
    // whose tries end within the API's deadline (1 s), so none is answered
    // as a Redis that did not answer.
    for _ in 0..3 {
        let out = run(&["queues", "--api", &api]).await?;
        expect_code(&out, 3, "queues with Redis gone, again")?;
        assert!(
            stderr(&out).contains("refused the connection"),
            "{}",
            stderr(&out)
        );
    }

    // A Redis that is there but does not answer keeps its message.
    let redis = RedisServer::start()?;
    let server = start(&dir, "api2", "api", &redis, &[]).await?;
    let pid = libc::pid_t::try_from(redis.pid())?;
    // SAFETY: kill(2) with the pid of a redis-server child this test owns
    // (it is reaped only when `redis` drops, after SIGCONT below).
    ensure!(unsafe { libc::kill(pid, libc::SIGSTOP) } == 0, "SIGSTOP");
    let out = run(&["queues", "--api", &server.api]).await;
    // SAFETY: as above.
    ensure!(unsafe { libc::kill(pid, libc::SIGCONT) } == 0, "SIGCONT");
    let out = out?;
    expect_code(&out, 3, "queues with Redis stopped")?;
    assert!(
        stderr(&out).contains("did not answer within"),
        "{}",
        stderr(&out)
    );
    Ok(())
}

/// `dtq pause`, `dtq resume` and `dtq limits` with the admin token: each
/// prints the answer, the queue's counts show the pause, and a rate that
/// is not N/MS is refused before anything is sent.
#[tokio::test(flavor = "multi_thread")]
async fn pause_resume_and_limits_from_the_command_line() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("cli")?;
    let admin = "cli-flow-admin-token-7c21";
    let server = start(&dir, "api", "api", &redis, &["--admin-token", admin]).await?;
    let api = server.api.as_str();
    let with = |args: &[&str]| -> Vec<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend([
            "--api".into(),
            api.into(),
            "--admin-token".into(),
            admin.into(),
        ]);
        all
    };
    let run_with = |args: Vec<String>| async move {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&refs).await
    };

    let paused = run_with(with(&["pause", "flowq"])).await?;
    expect_code(&paused, 0, "pause")?;
    assert_eq!(
        stdout_json(&paused)?,
        json!({"queue": "flowq", "paused": true, "changed": true})
    );
    let counts = run_with(with(&["queues", "flowq"])).await?;
    assert_eq!(stdout_json(&counts)?["paused"], true);
    let resumed = run_with(with(&["resume", "flowq"])).await?;
    expect_code(&resumed, 0, "resume")?;
    assert_eq!(stdout_json(&resumed)?["paused"], false);

    let set = run_with(with(&[
        "limits",
        "flowq",
        "--rate",
        "20/1000",
        "--group-concurrency",
        "2",
    ]))
    .await?;
    expect_code(&set, 0, "limits --rate --group-concurrency")?;
    let want = json!({"rate": {"limit": 20, "per_ms": 1000}, "group_concurrency": 2});
    assert_eq!(stdout_json(&set)?["limits"], want);
    let shown = run_with(with(&["limits", "flowq"])).await?;
    assert_eq!(stdout_json(&shown)?["limits"], want);
    let cleared = run_with(with(&["limits", "flowq", "--clear"])).await?;
    expect_code(&cleared, 0, "limits --clear")?;
    assert_eq!(stdout_json(&cleared)?["limits"], json!({}));

    let bad = run_with(with(&["limits", "flowq", "--rate", "20"])).await?;
    expect_code(&bad, 2, "limits --rate 20")?;
    ensure!(stderr(&bad).contains("N/MS"), "{}", stderr(&bad));
    let shown = run_with(with(&["limits", "flowq"])).await?;
    assert_eq!(stdout_json(&shown)?["limits"], json!({}));
    Ok(())
}
