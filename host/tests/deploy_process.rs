//! Deploying handlers to a running fleet, with real processes: one
//! `redis-server`, `dtq api`, `dtq worker` and `dtq serve` child processes,
//! the `dtq` client commands, and two versions of one handler
//! (`tests/guests/versioned_v1`, `versioned_v2`) that report which version
//! ran.
//!
//! Each test shows one thing an operator relies on:
//!
//! - a deploy reaches every worker within [`SWITCH`] of being stored, while
//!   the tasks already running finish on the version they started with, and
//!   a rollback brings the old version back
//!   ([`a_deploy_rolls_across_running_workers_and_rolls_back`]);
//! - a module that cannot run is refused at deploy with its reason in one
//!   line, and nothing changes ([`a_refused_module_changes_nothing`]);
//! - a worker started with no handlers directory runs what is deployed
//!   ([`a_worker_started_after_a_deploy_runs_it_from_redis_alone`]);
//! - a task accepted by an API whose handlers a worker has not loaded yet
//!   waits for it instead of failing
//!   ([`a_task_no_worker_has_loaded_yet_waits_and_is_not_failed`]);
//! - a watched handlers directory reloads a changed file without a restart,
//!   skips a bad one, and gives way to a deployed version
//!   ([`a_watched_handlers_directory_reloads_without_restart`]);
//! - a manifest deploys several handlers with their settings, and a bad one
//!   deploys nothing ([`a_manifest_deploys_several_handlers_with_their_settings`]);
//! - settings no live worker can honour are refused with each worker's
//!   reason unless forced; forced, the rollout sees the worker does not run
//!   them (the digest is the same), its tasks wait rather than run on the
//!   old settings, and a rollback clears the failure
//!   ([`a_deploy_no_worker_can_run_is_refused_and_a_forced_one_never_runs_on_old_settings`]);
//! - a refused deploy of a large module shows the server's answer, not a
//!   broken connection ([`a_refused_large_deploy_shows_the_servers_answer`]);
//! - a handlers directory that cannot be listed for a while keeps its
//!   handlers ([`a_handlers_directory_that_cannot_be_listed_keeps_its_handlers`]);
//! - a `dtq serve` that cannot bind its port never appears as a live worker
//!   ([`a_serve_that_cannot_bind_its_port_never_shows_as_a_worker`]).
//!
//! Every process writes its log to a file in the test's temporary directory;
//! the logs are printed when a test fails.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_tests::process::DtqProcess;
use dtq_tests::{ApiClient, RedisServer, TempDir, free_port, guests};
use reqwest::Method;
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// How long a server process may take to start (it may compile handlers
/// when the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Longest wait for a task to reach a status.
const WAIT: Duration = Duration::from_secs(30);

/// How soon after a deploy is stored every worker must run it (the issue's
/// bound).
const SWITCH: Duration = Duration::from_secs(2);

/// How long a process may take to notice a change on its own: a few reload
/// intervals, for the changes no command waits for (a rollback, an undeploy,
/// a file in a watched directory).
const NOTICE: Duration = Duration::from_secs(10);

/// How often every process checks the registry and its directory (ms).
const RELOAD_INTERVAL_MS: &str = "1000";

/// The API's admin token: deploying is running code on the fleet.
const ADMIN_TOKEN: &str = "deploy-test-admin-token";

/// The task name both versions are deployed as.
const TASK: &str = "versioned";

/// The queue every task goes to.
const QUEUE: &str = "default";

/// One redis-server and the `dtq` processes a test starts against it, with
/// their logs in a temporary directory.
struct Fleet {
    redis: RedisServer,
    dir: TempDir,
}

impl Fleet {
    fn new() -> Result<Fleet> {
        Ok(Fleet {
            redis: RedisServer::start()?,
            dir: TempDir::new("deploy")?,
        })
    }

    /// An empty directory `name` in the test's temporary directory.
    fn handlers_dir(&self, name: &str) -> Result<PathBuf> {
        let dir = self.dir.path.join(name);
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(dir)
    }

    /// Start `dtq <subcommand>` with the common server flags plus `extra`,
    /// and wait until it is ready: `/healthz` answers (`api`, `serve`) or
    /// the worker has logged its start (`worker`).
    async fn start(&self, name: &str, subcommand: &str, extra: &[&str]) -> Result<DtqProcess> {
        // A port free when probed may be taken before the process binds it;
        // such a start is retried on another port.
        let mut last = None;
        for attempt in 0..3 {
            let port = free_port()?;
            let log = self.dir.path.join(format!("{name}-{attempt}.log"));
            let mut cmd = dtq_tests::process::dtq_command(DTQ);
            cmd.arg(subcommand)
                .args(self.server_flags(port))
                .args(extra);
            let api = format!("http://127.0.0.1:{port}");
            let mut proc = DtqProcess::spawn(name, cmd, log, api)?;
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

    /// Start `dtq api` with the admin token and `extra` flags.
    async fn start_api(&self, extra: &[&str]) -> Result<(DtqProcess, ApiClient, Cli)> {
        let flags = [&["--admin-token", ADMIN_TOKEN][..], extra].concat();
        let proc = self.start("api", "api", &flags).await?;
        let client = ApiClient::new(proc.api.clone());
        let cli = Cli {
            api: proc.api.clone(),
        };
        Ok((proc, client, cli))
    }

    /// The flags of every server process: this fleet's Redis, no handlers
    /// directory, the artifact cache the other process tests share (so a
    /// component is compiled once per machine, not once per process),
    /// short timings and the reload interval under test.
    fn server_flags(&self, port: u16) -> Vec<String> {
        let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
        let mut flags: Vec<String> = [
            "--redis",
            &self.redis.url(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--visibility-timeout-ms",
            "1000",
            "--retry-base-ms",
            "20",
            "--retry-max-ms",
            "100",
            "--reload-interval-ms",
            RELOAD_INTERVAL_MS,
            "--cache-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.push(cache.display().to_string());
        flags
    }
}

/// The `dtq` client commands against one API. Mutations carry the admin
/// token; reads carry none, as an operator's would.
struct Cli {
    api: String,
}

impl Cli {
    /// Run `dtq <args> --api <api>` to completion (at most 30 s).
    async fn output(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = tokio::process::Command::from(dtq_tests::process::dtq_command(DTQ));
        cmd.args(args)
            .args(["--api", &self.api])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(30), cmd.output())
            .await
            .with_context(|| format!("dtq {args:?} did not finish within 30 s"))?
            .with_context(|| format!("cannot run dtq {args:?}"))
    }

    /// [`Cli::output`] with the admin token.
    async fn admin_output(&self, args: &[&str]) -> Result<Output> {
        self.output(&[args, &["--admin-token", ADMIN_TOKEN]].concat())
            .await
    }

    /// A read command that must succeed; its JSON.
    async fn read(&self, args: &[&str]) -> Result<Value> {
        success_json(&self.output(args).await?, args)
    }

    /// A mutation that must succeed; its JSON.
    async fn admin(&self, args: &[&str]) -> Result<Value> {
        success_json(&self.admin_output(args).await?, args)
    }

    /// `dtq deploy FILE --task TASK <extra>`, which must succeed; its JSON.
    async fn deploy(&self, file: &str, task: &str, extra: &[&str]) -> Result<Value> {
        let args = [&["deploy", file, "--task", task][..], extra].concat();
        let deployed = self.admin(&args).await?;
        assert_eq!(deployed["task"], task, "{deployed:#}");
        assert_eq!(deployed["digest"], sha256_file(file)?, "{deployed:#}");
        assert_eq!(
            deployed["size"],
            std::fs::metadata(file)?.len(),
            "{deployed:#}"
        );
        Ok(deployed)
    }

    /// A mutation the server must refuse with `code`: exit code 1 and one
    /// `error:` line on stderr naming the code and a reason. Returns that
    /// line.
    async fn refused(&self, args: &[&str], code: &str) -> Result<String> {
        let out = self.admin_output(args).await?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        ensure!(
            out.status.code() == Some(1),
            "dtq {args:?}: exit {:?}, want 1 ({code})\nstdout:\n{}\nstderr:\n{stderr}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
        );
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|line| line.starts_with("error:"))
            .collect();
        ensure!(
            errors.len() == 1,
            "dtq {args:?}: want one `error:` line on stderr:\n{stderr}"
        );
        let line = errors[0];
        let (_, after) = line
            .split_once(code)
            .with_context(|| format!("dtq {args:?}: the error is not {code}: {line}"))?;
        // `CODE: reason`, or `CODE (status): reason`.
        let after = after.trim_start();
        let after = match after.strip_prefix('(') {
            Some(status) => status.split_once(')').map_or("", |(_, rest)| rest),
            None => after,
        };
        let reason = after.trim_start_matches([':', ' ']).trim();
        ensure!(
            reason.len() > 3,
            "dtq {args:?}: the refusal gives no reason: {line}"
        );
        Ok(line.to_owned())
    }
}

/// The JSON a command printed, after checking that it exited 0.
fn success_json(out: &Output, args: &[&str]) -> Result<Value> {
    ensure!(
        out.status.code() == Some(0),
        "dtq {args:?}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "dtq {args:?}: stdout is not one JSON value: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The SHA-256 of a file, lowercase hex: the digest a module is known by.
fn sha256_file(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    Ok(dtq_tests::sha256_hex(&bytes))
}

/// Put `from`'s bytes at `to` as a deploy tool would: written under a
/// temporary name in the same directory, then renamed over `to`, so a
/// reader never sees half a file.
fn replace_file(from: impl AsRef<Path>, to: &Path) -> Result<()> {
    let name = to.file_name().context("no file name")?.to_string_lossy();
    let tmp = to.with_file_name(format!(".{name}.tmp"));
    std::fs::copy(from.as_ref(), &tmp).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, to).with_context(|| format!("rename onto {}", to.display()))?;
    Ok(())
}

/// A task of the versioned handler.
fn versioned(n: u64, sleep_ms: u64) -> Value {
    json!({"task": TASK, "payload": {"n": n, "sleep_ms": sleep_ms}})
}

/// Assert that `task` succeeded in one attempt on the module `digest`,
/// which reported `version`, and echoed its `n`.
#[track_caller]
fn assert_ran(task: &Value, version: &str, digest: &str) {
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"]["version"], version, "{task:#}");
    assert_eq!(task["result"]["n"], task["payload"]["n"], "{task:#}");
    assert_eq!(task["attempts"], 1, "{task:#}");
    assert_eq!(task["handler_digest"], digest, "{task:#}");
    assert_eq!(task["attempt_digests"], json!([digest]), "{task:#}");
}

/// Whether the tasks' runs overlap at one moment: each started before any
/// finished. With `k` workers of `c` slots each and `k * c` tasks, it
/// means every worker ran `c` of them.
fn ran_together(tasks: &[Value]) -> bool {
    let started = tasks.iter().filter_map(|t| t["started_at"].as_u64()).max();
    let finished = tasks.iter().filter_map(|t| t["finished_at"].as_u64()).min();
    matches!((started, finished), (Some(s), Some(f)) if s < f)
}

/// Submit `count` tasks of `sleep_ms` each; their ids.
async fn submit_many(api: &ApiClient, count: u64, sleep_ms: u64) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for n in 0..count {
        ids.push(api.submit_new(QUEUE, versioned(n, sleep_ms), None).await?);
    }
    Ok(ids)
}

/// Wait until each task reaches one of `statuses`; their records.
async fn wait_all(api: &ApiClient, ids: &[String], statuses: &[&str]) -> Result<Vec<Value>> {
    let mut tasks = Vec::new();
    for id in ids {
        tasks.push(api.wait_for(QUEUE, id, statuses, WAIT).await?);
    }
    Ok(tasks)
}

/// Submit `body` until the API accepts it, and return the task id: an API
/// learns of a deploy or a file on its own (within [`SWITCH`] or a reload
/// interval), and until then refuses the task as UNKNOWN_TASK. Fail after
/// `timeout`.
async fn submit_once_known(api: &ApiClient, body: Value, timeout: Duration) -> Result<String> {
    let start = Instant::now();
    loop {
        let response = api.submit(QUEUE, body.clone(), None).await?;
        if response.0 == 202 {
            let id = response.1["task_id"].as_str().context("task_id")?;
            return Ok(id.to_owned());
        }
        dtq_tests::assert_error(&response, 400, "UNKNOWN_TASK");
        ensure!(
            start.elapsed() < timeout,
            "the API did not know the task within {timeout:?}: {response:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Submit `body` until the API refuses it as UNKNOWN_TASK (a task accepted
/// before is left waiting); fail after `timeout`.
async fn wait_unknown(api: &ApiClient, body: Value, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let response = api.submit(QUEUE, body.clone(), None).await?;
        if response.0 != 202 {
            dtq_tests::assert_error(&response, 400, "UNKNOWN_TASK");
            return Ok(());
        }
        ensure!(
            start.elapsed() < timeout,
            "the API still accepts the task after {timeout:?}: {response:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The fleet as `GET /v1/handlers` shows it.
async fn get_handlers(api: &ApiClient) -> Result<Value> {
    let (status, body) = api.call(Method::GET, "/v1/handlers", None, &[]).await?;
    ensure!(status == 200, "GET /v1/handlers: {status} {body:#}");
    Ok(body)
}

/// Wait until `GET /v1/handlers` lists exactly `workers` workers and each
/// reports `check(&worker)`; how long that took, and the listing.
async fn wait_workers(
    api: &ApiClient,
    workers: usize,
    timeout: Duration,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Result<(Duration, Value)> {
    let start = Instant::now();
    loop {
        let listing = get_handlers(api).await?;
        let listed = listing["workers"].as_array().map(Vec::as_slice);
        if let Some(listed) = listed
            && listed.len() == workers
            && listed.iter().all(&check)
        {
            return Ok((start.elapsed(), listing));
        }
        if start.elapsed() > timeout {
            bail!("{workers} workers did not report {what} within {timeout:?}: {listing:#}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until exactly `workers` workers report `digest` loaded for `task`.
async fn wait_workers_on(
    api: &ApiClient,
    task: &str,
    digest: &str,
    workers: usize,
    timeout: Duration,
) -> Result<(Duration, Value)> {
    wait_workers(
        api,
        workers,
        timeout,
        &format!("{task} = {digest}"),
        |worker| worker["loaded"][task] == digest,
    )
    .await
}

/// The listing's entry for `task`, if it lists one.
fn handler_entry<'a>(listing: &'a Value, task: &str) -> Option<&'a Value> {
    listing["handlers"]
        .as_array()?
        .iter()
        .find(|h| h["task"] == task)
}

/// The actions and digests of a `dtq handlers history` answer, newest
/// first.
fn history_of(history: &Value) -> Vec<(String, String)> {
    history["history"]
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .map(|e| {
                    let field = |name: &str| e[name].as_str().unwrap_or_default().to_owned();
                    (field("action"), field("digest"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Submit a task (`sleep_ms` 0) and wait for it to succeed, again and again
/// until one runs `want`; fail after `timeout`. Each one before must have
/// run `before` (a process reloads between tasks, never in the middle of
/// one). Returns the task that ran `want`.
async fn run_until_version(
    api: &ApiClient,
    before: &str,
    want: &str,
    timeout: Duration,
) -> Result<Value> {
    let start = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let id = api.submit_new(QUEUE, versioned(n, 0), None).await?;
        let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
        let ran = task["result"]["version"].as_str().unwrap_or_default();
        if ran == want {
            return Ok(task);
        }
        ensure!(ran == before, "ran neither {before} nor {want}: {task:#}");
        ensure!(
            start.elapsed() < timeout,
            "tasks still ran {before} after {timeout:?}: {task:#}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deploy_rolls_across_running_workers_and_rolls_back() -> Result<()> {
    let fleet = Fleet::new()?;
    let (_api_proc, api, cli) = fleet.start_api(&[]).await?;
    // Two slots each: four tasks running at once are two on each worker.
    let workers = ["--concurrency", "2"];
    let _a = fleet.start("worker-a", "worker", &workers).await?;
    let _b = fleet.start("worker-b", "worker", &workers).await?;
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    let v2 = sha256_file(guests::VERSIONED_V2)?;
    assert_ne!(v1, v2, "the two versions must differ");

    // v1: everyone the deploy waited for runs it, and tasks run it.
    let deployed = cli.deploy(guests::VERSIONED_V1, TASK, &[]).await?;
    assert_eq!(deployed["unchanged"], false, "{deployed:#}");
    assert_eq!(deployed["previous"], Value::Null, "{deployed:#}");
    assert_eq!(
        deployed["rollout"]["running"], deployed["rollout"]["workers"],
        "{deployed:#}"
    );
    // The deploy waited for the workers; the API learns of it on its own.
    let id = submit_once_known(&api, versioned(1, 0), SWITCH).await?;
    let first = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&first, "v1", &v1);
    // `dtq status` shows the digest too.
    let status = cli.read(&["status", QUEUE, &id]).await?;
    assert_eq!(status["handler_digest"], v1.as_str(), "{status:#}");
    assert_eq!(status["attempt_digests"], json!([v1]), "{status:#}");
    wait_workers_on(&api, TASK, &v1, 2, NOTICE).await?;

    // v1 tasks running on both workers when v2 is deployed.
    let in_flight = submit_many(&api, 4, 3_000).await?;
    wait_all(&api, &in_flight, &["RUNNING"]).await?;
    let issued = Instant::now();
    let deployed = cli.deploy(guests::VERSIONED_V2, TASK, &[]).await?;
    let returned = Instant::now();
    assert_eq!(deployed["unchanged"], false, "{deployed:#}");
    assert_eq!(deployed["previous"], v1.as_str(), "{deployed:#}");
    let rollout = &deployed["rollout"];
    assert_eq!(rollout["workers"], 2, "{deployed:#}");
    assert_eq!(rollout["running"], 2, "{deployed:#}");
    let waited_ms = rollout["waited_ms"].as_u64().context("rollout.waited_ms")?;
    let deployed_at = deployed["deployed_at"].as_u64().context("deployed_at")?;
    // The command returns once every worker reports v2, so the listing
    // shows both on it at once; [`SWITCH`] bounds it in any case.
    let (_, listing) = wait_workers_on(&api, TASK, &v2, 2, SWITCH).await?;
    let after_return = returned.elapsed();
    eprintln!(
        "deploy of v2: every worker ran it {waited_ms} ms after it was stored (rollout.waited_ms); \
         the listing showed both on v2 {after_return:?} after `dtq deploy` returned; \
         the command took {:?}",
        returned - issued
    );
    assert!(
        waited_ms <= SWITCH.as_millis() as u64,
        "the workers took {waited_ms} ms to switch: {deployed:#}"
    );
    let entry = handler_entry(&listing, TASK).context("the listing lacks the task")?;
    assert_eq!(entry["digest"], v2.as_str(), "{listing:#}");
    assert_eq!(entry["deployed_at"], deployed_at, "{listing:#}");
    assert_eq!(entry["workers"]["running"], 2, "{listing:#}");
    assert_eq!(entry["workers"]["total"], 2, "{listing:#}");

    // The tasks in flight across the switch finish on v1: each started
    // before the deploy was stored and finished after both workers had
    // switched, yet ran v1 in its one attempt.
    let finished = wait_all(&api, &in_flight, &["SUCCEEDED"]).await?;
    for task in &finished {
        assert_ran(task, "v1", &v1);
        let started = task["started_at"].as_u64().context("started_at")?;
        let ended = task["finished_at"].as_u64().context("finished_at")?;
        assert!(
            started < deployed_at && ended > deployed_at + waited_ms,
            "not in flight across the switch (deployed at {deployed_at}, switched \
             {waited_ms} ms later): {task:#}"
        );
    }
    assert!(
        ran_together(&finished),
        "the v1 tasks did not run on both workers at once: {finished:#?}"
    );

    // New tasks run v2, on both workers.
    let after = submit_many(&api, 4, 1_000).await?;
    let after = wait_all(&api, &after, &["SUCCEEDED"]).await?;
    for task in &after {
        assert_ran(task, "v2", &v2);
    }
    assert!(
        ran_together(&after),
        "the v2 tasks did not run on both workers at once: {after:#?}"
    );

    // Rollback: v1 is active again, the workers switch back, tasks run v1.
    let back = cli.admin(&["rollback", TASK]).await?;
    assert_eq!(back["task"], TASK, "{back:#}");
    assert_eq!(back["digest"], v1.as_str(), "{back:#}");
    let (took, _) = wait_workers_on(&api, TASK, &v1, 2, NOTICE).await?;
    eprintln!("rollback: both workers listed on v1 {took:?} after `dtq rollback` returned");
    let again = submit_many(&api, 4, 1_000).await?;
    let again = wait_all(&api, &again, &["SUCCEEDED"]).await?;
    for task in &again {
        assert_ran(task, "v1", &v1);
    }
    assert!(
        ran_together(&again),
        "the tasks after the rollback did not run on both workers at once: {again:#?}"
    );

    let history = cli.read(&["handlers", "history", TASK]).await?;
    assert_eq!(history["task"], TASK, "{history:#}");
    assert_eq!(history["active"]["digest"], v1.as_str(), "{history:#}");
    let want: Vec<(String, String)> = [("rollback", &v1), ("deploy", &v2), ("deploy", &v1)]
        .iter()
        .map(|(action, digest)| (action.to_string(), digest.to_string()))
        .collect();
    assert_eq!(history_of(&history), want, "newest first: {history:#}");
    // The API answers the same.
    let (status, http) = api
        .call(Method::GET, &format!("/v1/handlers/{TASK}"), None, &[])
        .await?;
    assert_eq!(status, 200, "{http:#}");
    assert_eq!(history_of(&http), want, "{http:#}");

    let listing = cli.read(&["handlers"]).await?;
    let entry = handler_entry(&listing, TASK).context("the listing lacks the task")?;
    assert_eq!(entry["digest"], v1.as_str(), "{listing:#}");
    assert_eq!(
        entry["size"],
        std::fs::metadata(guests::VERSIONED_V1)?.len(),
        "{listing:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_module_changes_nothing() -> Result<()> {
    let fleet = Fleet::new()?;
    let (_api_proc, api, cli) = fleet.start_api(&[]).await?;
    let _worker = fleet.start("worker", "worker", &[]).await?;
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    cli.deploy(guests::VERSIONED_V1, TASK, &[]).await?;
    // The same module again is no new version.
    let again = cli.deploy(guests::VERSIONED_V1, TASK, &[]).await?;
    assert_eq!(again["unchanged"], true, "{again:#}");
    wait_workers_on(&api, TASK, &v1, 1, NOTICE).await?;

    let history = cli.read(&["handlers", "history", TASK]).await?;
    let listing = cli.read(&["handlers"]).await?;
    let entry = handler_entry(&listing, TASK)
        .context("the listing lacks the task")?
        .clone();
    assert_eq!(entry["digest"], v1.as_str(), "{listing:#}");

    // Modules that cannot run as a handler, each with its reason.
    let bad = fleet.handlers_dir("bad")?;
    let junk = bad.join("junk.wasm");
    std::fs::write(&junk, b"\x00asm but not really a module at all")?;
    // A valid core module (empty): not a component.
    let core = bad.join("core.wasm");
    std::fs::write(&core, b"\x00asm\x01\x00\x00\x00")?;
    // A valid component (empty): it exports no handler.
    let empty = bad.join("empty.wasm");
    std::fs::write(&empty, b"\x00asm\x0d\x00\x01\x00")?;
    for file in [&junk, &core, &empty] {
        let file = file.to_str().context("UTF-8 path")?;
        let line = cli
            .refused(&["deploy", file, "--task", TASK], "INVALID_MODULE")
            .await?;
        eprintln!("{file}: {line}");
    }
    // A handler that asks for a namespace it is not granted.
    let line = cli
        .refused(
            &["deploy", guests::NAMESPACED, "--task", TASK],
            "INVALID_MODULE",
        )
        .await?;
    assert!(line.contains("namespace"), "{line}");
    let line = cli
        .refused(
            &[
                "deploy",
                guests::NAMESPACED,
                "--task",
                TASK,
                "--namespace",
                "other-ns",
            ],
            "INVALID_MODULE",
        )
        .await?;
    assert!(line.contains("namespace"), "{line}");

    // Over HTTP: refused with the code, and without the admin token not
    // even looked at.
    let http = reqwest::Client::new();
    let url = format!("{}/v1/handlers/{TASK}", api.base);
    let resp = http
        .put(&url)
        .header("content-type", "application/wasm")
        .bearer_auth(ADMIN_TOKEN)
        .body(std::fs::read(&junk)?)
        .send()
        .await?;
    let status = resp.status();
    let body: Value = resp.json().await?;
    assert!(status.is_client_error(), "{status} {body:#}");
    assert_eq!(body["error"]["code"], "INVALID_MODULE", "{body:#}");
    let resp = http
        .put(&url)
        .header("content-type", "application/wasm")
        .body(std::fs::read(guests::VERSIONED_V2)?)
        .send()
        .await?;
    let status = resp.status();
    let body = resp.text().await?;
    assert!(
        matches!(status.as_u16(), 401 | 403),
        "a deploy without the admin token: {status} {body}"
    );

    // Refusals of rollbacks and undeploys that have nothing to act on.
    cli.refused(&["rollback", "never_deployed"], "UNKNOWN_TASK")
        .await?;
    cli.refused(&["undeploy", "never_deployed"], "UNKNOWN_TASK")
        .await?;
    let unknown = "0".repeat(64);
    cli.refused(&["rollback", TASK, "--to", &unknown], "UNKNOWN_VERSION")
        .await?;

    // Nothing changed: the same active version and history, and the
    // worker still runs v1.
    assert_eq!(
        cli.read(&["handlers", "history", TASK]).await?,
        history,
        "a refused deploy changed the history"
    );
    let after = cli.read(&["handlers"]).await?;
    let now = handler_entry(&after, TASK).context("the listing lacks the task")?;
    for field in ["digest", "size", "deployed_at", "settings"] {
        assert_eq!(now[field], entry[field], "{field}: {after:#}");
    }
    let id = api.submit_new(QUEUE, versioned(1, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);

    // The namespaced handler where it is granted its namespace, over HTTP:
    // it runs, and its kv write lands in that namespace.
    let resp = http
        .put(format!(
            "{}/v1/handlers/namespaced?namespace=shared-ns",
            api.base
        ))
        .header("content-type", "application/wasm")
        .bearer_auth(ADMIN_TOKEN)
        .body(std::fs::read(guests::NAMESPACED)?)
        .send()
        .await?;
    let status = resp.status();
    let body: Value = resp.json().await?;
    assert!(status.is_success(), "{status} {body:#}");
    assert_eq!(body["digest"], sha256_file(guests::NAMESPACED)?, "{body:#}");
    assert_eq!(body["settings"]["namespace"], "shared-ns", "{body:#}");
    let task = json!({"task": "namespaced", "payload": {"key": "k", "value": "v"}});
    let id = submit_once_known(&api, task, SWITCH).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["result"], json!({"ok": true}), "{task:#}");
    let keys = fleet.redis.keys().await?;
    assert!(
        keys.iter().any(|k| k == "dtq:guest:{shared-ns}:k"),
        "the kv write is not in the granted namespace: {keys:?}"
    );

    // Undeployed, it is gone from the listing and, once the API has seen
    // it, from what the API accepts.
    let gone = cli.admin(&["undeploy", "namespaced"]).await?;
    assert_eq!(gone, json!({"task": "namespaced", "undeployed": true}));
    let listing = cli.read(&["handlers"]).await?;
    assert!(
        handler_entry(&listing, "namespaced").is_none(),
        "{listing:#}"
    );
    let history = cli.read(&["handlers", "history", "namespaced"]).await?;
    assert_eq!(history["active"], Value::Null, "{history:#}");
    let actions: Vec<String> = history_of(&history).into_iter().map(|(a, _)| a).collect();
    assert_eq!(actions, ["undeploy", "deploy"], "{history:#}");
    let task = json!({"task": "namespaced", "payload": {"key": "k2", "value": "v"}});
    wait_unknown(&api, task, NOTICE).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_started_after_a_deploy_runs_it_from_redis_alone() -> Result<()> {
    let fleet = Fleet::new()?;
    let (_api_proc, api, cli) = fleet.start_api(&[]).await?;
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    let deployed = cli
        .deploy(guests::VERSIONED_V1, TASK, &["--wait-s", "0"])
        .await?;
    assert_eq!(deployed["rollout"]["workers"], 0, "{deployed:#}");
    // No live worker checked the settings: accepted, and said so.
    let warning = deployed["warning"].as_str().unwrap_or_default();
    assert!(warning.contains("no live worker"), "{deployed:#}");
    let waiting = submit_once_known(&api, versioned(1, 0), SWITCH).await?;
    let queued = api.task(QUEUE, &waiting).await?;
    assert_eq!(queued["status"], "QUEUED", "{queued:#}");

    // No handlers directory: what it runs comes from Redis.
    let _worker = fleet.start("worker", "worker", &[]).await?;
    let done = api.wait_for(QUEUE, &waiting, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&done, "v1", &v1);
    let later = api.submit_new(QUEUE, versioned(2, 0), None).await?;
    let done = api.wait_for(QUEUE, &later, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&done, "v1", &v1);
    wait_workers_on(&api, TASK, &v1, 1, NOTICE).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_no_worker_has_loaded_yet_waits_and_is_not_failed() -> Result<()> {
    let fleet = Fleet::new()?;
    // The API knows `late` from its own directory; the worker's directory
    // is empty, and nothing is deployed.
    let api_dir = fleet.handlers_dir("api-handlers")?;
    std::fs::copy(guests::VERSIONED_V1, api_dir.join("late.wasm"))?;
    let worker_dir = fleet.handlers_dir("worker-handlers")?;
    let api_dir = api_dir.to_str().context("UTF-8 path")?;
    let (_api_proc, api, _cli) = fleet.start_api(&["--handlers", api_dir]).await?;
    let worker_dir_flag = worker_dir.to_str().context("UTF-8 path")?;
    let _worker = fleet
        .start("worker", "worker", &["--handlers", worker_dir_flag])
        .await?;
    let v1 = sha256_file(guests::VERSIONED_V1)?;

    let id = api
        .submit_new(QUEUE, json!({"task": "late", "payload": {"n": 1}}), None)
        .await?;

    // The worker gives it back, uncounted, and takes it again after a
    // backoff: wait for the second deferral (a later due time), checking
    // every record seen on the way.
    let start = Instant::now();
    let mut first_due = None;
    loop {
        let task = api.task(QUEUE, &id).await?;
        let status = task["status"].as_str().unwrap_or_default();
        assert!(
            matches!(status, "QUEUED" | "SCHEDULED" | "RUNNING"),
            "a task no worker can run yet must wait: {task:#}"
        );
        if status != "RUNNING" {
            assert_eq!(
                task["attempts"], 0,
                "a deferral counted an attempt: {task:#}"
            );
        }
        if status == "SCHEDULED" {
            let due = task["run_at"]
                .as_u64()
                .context("a SCHEDULED task has run_at")?;
            match first_due {
                None => first_due = Some(due),
                Some(first) if due > first => break,
                Some(_) => {}
            }
        }
        ensure!(
            start.elapsed() < WAIT,
            "the worker did not defer the task twice: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The worker's directory gets the handler: it loads it without a
    // restart and runs the task, as its first attempt.
    let arrived = Instant::now();
    replace_file(guests::VERSIONED_V1, &worker_dir.join("late.wasm"))?;
    let done = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    eprintln!(
        "the deferred task succeeded {:?} after its handler reached the worker's directory",
        arrived.elapsed()
    );
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"], json!({"version": "v1", "n": 1}), "{done:#}");
    assert_eq!(done["attempts"], 1, "{done:#}");
    assert_eq!(done["handler_digest"], v1.as_str(), "{done:#}");
    assert_eq!(done["attempt_digests"], json!([v1]), "{done:#}");
    assert!(
        arrived.elapsed() < NOTICE,
        "took {:?} to run once the handler was there",
        arrived.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_watched_handlers_directory_reloads_without_restart() -> Result<()> {
    let fleet = Fleet::new()?;
    let dir = fleet.handlers_dir("handlers")?;
    let file = dir.join(format!("{TASK}.wasm"));
    std::fs::copy(guests::VERSIONED_V1, &file)?;
    let dir_flag = dir.to_str().context("UTF-8 path")?;
    let mut serve = fleet
        .start(
            "serve",
            "serve",
            &["--handlers", dir_flag, "--admin-token", ADMIN_TOKEN],
        )
        .await?;
    let api = ApiClient::new(serve.api.clone());
    let cli = Cli {
        api: serve.api.clone(),
    };
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    let v2 = sha256_file(guests::VERSIONED_V2)?;

    let id = api.submit_new(QUEUE, versioned(0, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);

    // Replaced by rename, as a deploy tool writes it.
    let changed = Instant::now();
    replace_file(guests::VERSIONED_V2, &file)?;
    let task = run_until_version(&api, "v1", "v2", NOTICE).await?;
    eprintln!("renamed over: v2 ran {:?} later", changed.elapsed());
    assert_ran(&task, "v2", &v2);

    // Overwritten in place (v1 and v2 have the same size).
    let changed = Instant::now();
    std::fs::write(&file, std::fs::read(guests::VERSIONED_V1)?)?;
    let task = run_until_version(&api, "v2", "v1", NOTICE).await?;
    eprintln!("overwritten: v1 ran {:?} later", changed.elapsed());
    assert_ran(&task, "v1", &v1);

    // A bad file is reported and skipped: v1 keeps running.
    let logged = serve.log_text().len();
    let junk = dir.join("junk.tmp");
    std::fs::write(&junk, b"\x00asm\x01\x00\x00\x00 trailing garbage")?;
    std::fs::rename(&junk, &file)?;
    let (_, listing) = wait_workers(&api, 1, NOTICE, "versioned failed", |worker| {
        worker["failed"][TASK].is_string()
    })
    .await?;
    assert_eq!(
        listing["workers"][0]["loaded"][TASK],
        v1.as_str(),
        "{listing:#}"
    );
    let log = serve.log_text();
    let reported = log[logged..]
        .lines()
        .any(|line| (line.contains("WARN") || line.contains("ERROR")) && line.contains(TASK));
    assert!(reported, "the bad file was not logged:\n{}", &log[logged..]);
    let id = api.submit_new(QUEUE, versioned(1, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);
    serve.check_alive()?;

    // Deleted: unloaded, and the API no longer accepts the task.
    std::fs::remove_file(&file)?;
    wait_unknown(&api, versioned(2, 0), NOTICE).await?;

    // Back again: loaded without a restart.
    replace_file(guests::VERSIONED_V1, &file)?;
    let id = submit_once_known(&api, versioned(3, 0), NOTICE).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);

    // A version deployed in Redis wins over the file of the same name.
    let deployed = cli.deploy(guests::VERSIONED_V2, TASK, &[]).await?;
    assert_eq!(deployed["rollout"]["running"], 1, "{deployed:#}");
    let id = api.submit_new(QUEUE, versioned(4, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v2", &v2);
    assert_eq!(sha256_file(&file)?, v1, "the file is still v1");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_deploys_several_handlers_with_their_settings() -> Result<()> {
    let fleet = Fleet::new()?;
    let (_api, api, cli) = fleet.start_api(&[]).await?;
    let _worker = fleet.start("worker", "worker", &[]).await?;

    // Modules are named relative to the manifest.
    let dir = fleet.handlers_dir("manifest")?;
    std::fs::copy(guests::VERSIONED_V1, dir.join("v1.wasm"))?;
    std::fs::copy(guests::ECHO, dir.join("echo.wasm"))?;
    let manifest = dir.join("handlers.toml");
    std::fs::write(
        &manifest,
        r#"
[handlers.versioned]
file = "v1.wasm"
max_attempts = 4
timeout_ms = 5000

[handlers.greeter]
file = "echo.wasm"
namespace = "greetings"
"#,
    )?;
    let manifest_arg = manifest.display().to_string();
    let deployed = cli.admin(&["deploy", "--manifest", &manifest_arg]).await?;
    let deployed = deployed.as_array().context("an array, one per handler")?;
    assert_eq!(deployed.len(), 2, "{deployed:#?}");
    let by_task = |task: &str| {
        deployed
            .iter()
            .find(|d| d["task"] == task)
            .cloned()
            .unwrap_or_default()
    };
    let v1 = by_task(TASK);
    assert_eq!(v1["digest"], sha256_file(guests::VERSIONED_V1)?);
    assert_eq!(
        v1["settings"],
        json!({"max_attempts": 4, "timeout_ms": 5000})
    );
    assert_eq!(v1["rollout"]["running"], 1, "{v1:#}");
    let greeter = by_task("greeter");
    assert_eq!(greeter["digest"], sha256_file(guests::ECHO)?);
    assert_eq!(greeter["settings"], json!({"namespace": "greetings"}));

    // Both run, with their settings: the deploy's max_attempts default.
    let id = api.submit_new(QUEUE, versioned(1, 0), None).await?;
    let done = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&done, "v1", &sha256_file(guests::VERSIONED_V1)?);
    assert_eq!(done["max_attempts"], 4, "{done:#}");
    let id = api
        .submit_new(
            QUEUE,
            json!({"task": "greeter", "payload": {"hi": 1}}),
            None,
        )
        .await?;
    let done = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["result"], json!({"hi": 1}), "{done:#}");

    // A manifest with an unknown setting is refused before anything is
    // sent: exit 2, and the registry is as it was.
    let before = cli.read(&["handlers"]).await?;
    std::fs::write(
        &manifest,
        "[handlers.versioned]\nfile = \"v1.wasm\"\nmemroy_mib = 8\n",
    )?;
    let out = cli
        .admin_output(&["deploy", "--manifest", &manifest_arg])
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("memroy_mib"), "{stderr}");
    let after = cli.read(&["handlers"]).await?;
    assert_eq!(after["handlers"], before["handlers"]);
    Ok(())
}

/// `dtq deploy <args>` refused with `code`: exit 1, the code on stderr, and
/// the error body on stdout; the body.
async fn refused_body(cli: &Cli, args: &[&str], code: &str) -> Result<Value> {
    let out = cli.admin_output(args).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1) && stderr.contains(code),
        "dtq {args:?}: exit {:?}, want 1 and {code}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status.code()
    );
    let body: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("dtq {args:?}: stdout is not the error body: {stdout}"))?;
    assert_eq!(body["error"]["code"], code, "{body:#}");
    Ok(body)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deploy_no_worker_can_run_is_refused_and_a_forced_one_never_runs_on_old_settings()
-> Result<()> {
    let fleet = Fleet::new()?;
    let (_api_proc, api, cli) = fleet.start_api(&[]).await?;
    let _worker = fleet
        .start("worker", "worker", &["--memory-mib", "64"])
        .await?;
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    cli.deploy(guests::VERSIONED_V1, TASK, &[]).await?;
    wait_workers_on(&api, TASK, &v1, 1, NOTICE).await?;

    // The same module with settings the worker's 64 MiB slots cannot
    // honour: refused, with the worker's reason, and nothing changes.
    let args = [
        "deploy",
        guests::VERSIONED_V1,
        "--task",
        TASK,
        "--memory-mib",
        "1000",
    ];
    let body = refused_body(&cli, &args, "NO_WORKER_CAN_RUN").await?;
    let reasons = body["error"]["details"]["workers"]
        .as_object()
        .context("each worker's reason")?;
    assert_eq!(reasons.len(), 1, "{body:#}");
    assert!(
        reasons
            .values()
            .all(|r| r.as_str().is_some_and(|r| r.contains("--memory-mib 1000"))),
        "{body:#}"
    );
    let history = cli.read(&["handlers", "history", TASK]).await?;
    assert_eq!(history["active"]["settings"], json!({}), "{history:#}");
    assert_eq!(history_of(&history).len(), 1, "{history:#}");

    // Forced: stored, and the rollout sees that the worker does not run it
    // although the digest it runs is the same.
    let forced = cli
        .deploy(
            guests::VERSIONED_V1,
            TASK,
            &["--memory-mib", "1000", "--force"],
        )
        .await?;
    assert_eq!(forced["unchanged"], false, "{forced:#}");
    let rollout = &forced["rollout"];
    assert_eq!(rollout["workers"], 1, "{forced:#}");
    assert_eq!(rollout["running"], 0, "{forced:#}");
    let failed = rollout["failed"].as_object().context("rollout.failed")?;
    assert_eq!(failed.len(), 1, "{forced:#}");
    assert!(
        failed
            .values()
            .all(|r| r.as_str().is_some_and(|r| r.contains("--memory-mib 1000"))),
        "{forced:#}"
    );

    // A task of the version nobody can run waits, its attempt given back;
    // it never runs under the old settings.
    let id = api.submit_new(QUEUE, versioned(1, 0), None).await?;
    let start = Instant::now();
    loop {
        let task = api.task(QUEUE, &id).await?;
        let status = task["status"].as_str().unwrap_or_default();
        assert!(
            matches!(status, "QUEUED" | "SCHEDULED" | "RUNNING"),
            "a task no worker can run must wait: {task:#}"
        );
        if status == "SCHEDULED" && task["error"].as_str().is_some_and(|e| e.contains(TASK)) {
            assert_eq!(task["attempts"], 0, "{task:#}");
            break;
        }
        ensure!(
            start.elapsed() < WAIT,
            "the task was not deferred: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Rolled back: the worker runs v1 again, its failure is gone from
    // `dtq handlers`, and the waiting task runs on v1.
    let back = cli.admin(&["rollback", TASK]).await?;
    assert_eq!(back["settings"], json!({}), "{back:#}");
    wait_workers(&api, 1, NOTICE, "v1 and no failure", |worker| {
        worker["loaded"][TASK] == v1.as_str()
            && worker["failed"].as_object().is_none_or(|f| f.is_empty())
    })
    .await?;
    let listing = cli.read(&["handlers"]).await?;
    assert_eq!(listing["workers"][0]["failed"], json!({}), "{listing:#}");
    let entry = handler_entry(&listing, TASK).context("the listing lacks the task")?;
    assert_eq!(entry["workers"]["running"], 1, "{listing:#}");
    let done = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&done, "v1", &v1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_large_deploy_shows_the_servers_answer() -> Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let fleet = Fleet::new()?;
    let (_api_proc, api, cli) = fleet.start_api(&[]).await?;
    // 12 MiB, under the API's 64 MiB limit: the settings are refused
    // before the module is looked at.
    let dir = fleet.handlers_dir("large")?;
    let large = dir.join("large.wasm");
    std::fs::write(&large, vec![0u8; 12 << 20])?;
    let large = large.to_str().context("UTF-8 path")?;
    let line = cli
        .refused(
            &[
                "deploy",
                large,
                "--task",
                TASK,
                "--allow-hosts",
                "ftp://files.example.com",
            ],
            "INVALID_SETTINGS",
        )
        .await?;
    assert!(line.contains("allow_hosts"), "{line}");

    // Underneath: the server reads the whole body before it answers. Were
    // it to answer at once and close, the rest of the body (more than any
    // socket buffer holds) would meet a reset connection, and whether a
    // client read the answer first would be a race.
    let addr = api.base.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&addr).await?;
    let body = vec![0u8; 12 << 20];
    let head = format!(
        "PUT /v1/handlers/{TASK}?allow_hosts=ftp%3A%2F%2Ffiles.example.com HTTP/1.1\r\n\
         Host: {addr}\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\
         Content-Type: application/wasm\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream
        .write_all(&body)
        .await
        .context("the server cut the body off")?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .context("no answer")??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("INVALID_SETTINGS"), "{answer}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handlers_directory_that_cannot_be_listed_keeps_its_handlers() -> Result<()> {
    let fleet = Fleet::new()?;
    let dir = fleet.handlers_dir("handlers")?;
    std::fs::copy(guests::VERSIONED_V1, dir.join(format!("{TASK}.wasm")))?;
    let dir_flag = dir.to_str().context("UTF-8 path")?;
    let serve = fleet
        .start("serve", "serve", &["--handlers", dir_flag])
        .await?;
    let api = ApiClient::new(serve.api.clone());
    let v1 = sha256_file(guests::VERSIONED_V1)?;
    let id = api.submit_new(QUEUE, versioned(0, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);

    // The directory is away (as while it is replaced, or unreadable) for
    // two passes at least: each logs that it cannot be listed.
    let away = fleet.dir.path.join("handlers-away");
    let logged = serve.log_text().len();
    std::fs::rename(&dir, &away)?;
    let start = Instant::now();
    loop {
        let log = serve.log_text();
        let warned = log[logged..]
            .matches("cannot list the handlers directory")
            .count();
        if warned >= 2 {
            break;
        }
        ensure!(
            start.elapsed() < NOTICE,
            "no warning about the directory:\n{}",
            &log[logged..]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its handler is still loaded, known and running.
    let listing = get_handlers(&api).await?;
    assert_eq!(
        listing["workers"][0]["loaded"][TASK],
        v1.as_str(),
        "{listing:#}"
    );
    let id = api.submit_new(QUEUE, versioned(1, 0), None).await?;
    let task = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_ran(&task, "v1", &v1);
    std::fs::rename(&away, &dir)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_serve_that_cannot_bind_its_port_never_shows_as_a_worker() -> Result<()> {
    let fleet = Fleet::new()?;
    let first = fleet.start("first", "serve", &[]).await?;
    let api = ApiClient::new(first.api.clone());
    wait_workers(&api, 1, NOTICE, "the first serve", |_| true).await?;

    // A second `dtq serve` on the same port: it connects to Redis and
    // prepares its worker, then cannot listen, and exits.
    let port: u16 = first.api.rsplit(':').next().context("a port")?.parse()?;
    let mut cmd = dtq_tests::process::dtq_command(DTQ);
    cmd.arg("serve").args(fleet.server_flags(port));
    let log = fleet.dir.path.join("second.log");
    let mut second = DtqProcess::spawn("second", cmd, log, first.api.clone())?;
    let status = second.wait_exit(STARTUP).await?;
    assert_eq!(status.code(), Some(1), "{}", second.log_text());
    assert!(
        second.log_text().contains("cannot listen"),
        "{}",
        second.log_text()
    );
    // Only the first is a live worker, now and in the next reports.
    let listing = get_handlers(&api).await?;
    let workers = listing["workers"].as_array().context("workers")?;
    assert_eq!(workers.len(), 1, "{listing:#}");
    Ok(())
}
