//! Signed modules (`--trusted-keys`) with real processes: one
//! `redis-server`, `dtq api` and `dtq worker` child processes, keys made
//! with `dtq keygen` and deploys signed with `dtq deploy --sign-key`.
//!
//! - the API refuses an unsigned deploy (`SIGNATURE_REQUIRED`) and one
//!   signed by a key it does not trust or over other bytes
//!   (`SIGNATURE_INVALID`), storing nothing; a signed one runs
//!   ([`only_signed_deploys_are_accepted_and_a_signed_one_runs`]);
//! - a version written straight into Redis, around the API, unsigned or
//!   with settings its signature does not cover, is never run by any
//!   worker: each refuses to load it and says so in its fleet report, and
//!   its tasks wait uncounted while a signed task beside them runs
//!   ([`a_version_written_around_the_api_is_run_by_no_worker`]).
//!
//! Every process writes its log to a file in the test's temporary
//! directory.

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use dtq_tests::process::DtqProcess;
use dtq_tests::{ApiClient, RedisServer, TempDir, assert_error, free_port, guests};
use reqwest::Method;
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");
/// How long a server process may take to start (it may compile).
const STARTUP: Duration = Duration::from_secs(120);
/// Longest wait for a condition.
const WAIT: Duration = Duration::from_secs(30);
const ADMIN_TOKEN: &str = "signing-test-admin-token";
const QUEUE: &str = "default";
/// The registry's active versions (`deploy/registry.rs`).
const ACTIVE: &str = "dtq:handlers:{registry}";
const REVISION: &str = "dtq:revision:{registry}";

/// One redis-server, keys, and the processes a test starts.
struct Fleet {
    redis: RedisServer,
    dir: TempDir,
    /// The trusted-keys file: the `release` key's public line.
    trusted: PathBuf,
}

impl Fleet {
    /// A fleet whose trusted-keys file holds one key made by `dtq keygen`
    /// (`release`); a second key (`stranger`) is made but not trusted.
    async fn new() -> Result<Fleet> {
        let dir = TempDir::new("signing")?;
        for name in ["release", "stranger"] {
            let path = dir.path.join(name);
            let made = json_of(&cli(&["keygen", path.to_str().context("UTF-8")?]).await?)?;
            let public = std::fs::read_to_string(dir.path.join(format!("{name}.pub")))?;
            assert_eq!(made["key"].as_str(), Some(public.trim()), "{made}");
            assert!(public.starts_with("dtq-ed25519 "), "{public}");
        }
        let trusted = dir.path.join("trusted-keys");
        let release = std::fs::read_to_string(dir.path.join("release.pub"))?;
        std::fs::write(&trusted, format!("# the release key\n{release}"))?;
        Ok(Fleet {
            redis: RedisServer::start()?,
            dir,
            trusted,
        })
    }

    fn key(&self, name: &str) -> String {
        self.dir.path.join(name).display().to_string()
    }

    /// Start `dtq <subcommand>` against this fleet's Redis with the trusted
    /// keys, and wait until it is ready.
    async fn start(&self, name: &str, subcommand: &str) -> Result<DtqProcess> {
        let port = free_port()?;
        let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
        let mut cmd = dtq_tests::process::dtq_command(DTQ);
        cmd.arg(subcommand)
            .args(["--redis", &self.redis.url()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-token", ADMIN_TOKEN])
            .args(["--reload-interval-ms", "200"])
            .args(["--retry-base-ms", "20", "--retry-max-ms", "100"])
            .arg("--trusted-keys")
            .arg(&self.trusted)
            .arg("--cache-dir")
            .arg(cache);
        let log = self.dir.path.join(format!("{name}.log"));
        let mut proc = DtqProcess::spawn(name, cmd, log, format!("http://127.0.0.1:{port}"))?;
        if subcommand == "worker" {
            proc.wait_log("worker started", STARTUP).await?;
        } else {
            proc.wait_healthy(STARTUP).await?;
        }
        Ok(proc)
    }
}

/// Run `dtq <args>` to completion.
async fn cli(args: &[&str]) -> Result<Output> {
    let mut cmd = tokio::process::Command::from(dtq_tests::process::dtq_command(DTQ));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    tokio::time::timeout(WAIT, cmd.output())
        .await
        .with_context(|| format!("dtq {args:?} did not finish"))?
        .with_context(|| format!("cannot run dtq {args:?}"))
}

/// The JSON a command printed, after checking it exited 0.
fn json_of(out: &Output) -> Result<Value> {
    ensure!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `dtq deploy` of the versioned guest as `task`, signed with `key`.
async fn signed_deploy(api: &str, task: &str, key: &str) -> Result<Output> {
    cli(&[
        "deploy",
        guests::VERSIONED_V1,
        "--task",
        task,
        "--sign-key",
        key,
        "--wait-s",
        "0",
        "--api",
        api,
        "--admin-token",
        ADMIN_TOKEN,
    ])
    .await
}

fn versioned(task: &str, n: u64) -> Value {
    json!({"task": task, "payload": {"n": n, "sleep_ms": 0}})
}

#[tokio::test(flavor = "multi_thread")]
async fn only_signed_deploys_are_accepted_and_a_signed_one_runs() -> Result<()> {
    let fleet = Fleet::new().await?;
    let api_proc = fleet.start("api", "api").await?;
    let _worker = fleet.start("worker", "worker").await?;
    let api = ApiClient::new(api_proc.api.clone());
    let wasm = std::fs::read(guests::VERSIONED_V1)?;

    // Unsigned, and signed badly: refused with their codes, nothing stored.
    let unsigned = api
        .deploy("greeter", wasm.clone(), &[], ADMIN_TOKEN)
        .await?;
    assert_error(&unsigned, 403, "SIGNATURE_REQUIRED");
    let resp = reqwest::Client::new()
        .put(format!("{}/v1/handlers/greeter", api.base))
        .bearer_auth(ADMIN_TOKEN)
        .header("Content-Type", "application/wasm")
        .header("Dtq-Signature", "AAAA")
        .body(wasm)
        .send()
        .await?;
    let malformed = (resp.status().as_u16(), resp.json::<Value>().await?);
    assert_error(&malformed, 403, "SIGNATURE_INVALID");
    let stranger = signed_deploy(&api.base, "greeter", &fleet.key("stranger")).await?;
    let stderr = String::from_utf8_lossy(&stranger.stderr);
    assert_eq!(stranger.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("SIGNATURE_INVALID"), "{stderr}");
    let (status, body) = api
        .call(Method::GET, "/v1/handlers/greeter", None, &[])
        .await?;
    assert_eq!(status, 400, "a refused deploy stored something: {body}");

    // Signed with the trusted key: stored with its signature, and run.
    let deployed = json_of(&signed_deploy(&api.base, "greeter", &fleet.key("release")).await?)?;
    assert!(deployed["digest"].is_string(), "{deployed}");
    let id = api.submit_new(QUEUE, versioned("greeter", 7), None).await?;
    let done = api.wait_for(QUEUE, &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["result"], json!({"version": "v1", "n": 7}), "{done:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_version_written_around_the_api_is_run_by_no_worker() -> Result<()> {
    let fleet = Fleet::new().await?;
    let api_proc = fleet.start("api", "api").await?;
    let _workers = [
        fleet.start("worker-a", "worker").await?,
        fleet.start("worker-b", "worker").await?,
    ];
    let api = ApiClient::new(api_proc.api.clone());
    json_of(&signed_deploy(&api.base, "signed", &fleet.key("release")).await?)?;

    // Written into Redis directly, as someone with Redis access but no
    // trusted key would: the signed version's module, (a) with no
    // signature, (b) with its signature but another namespace.
    let mut redis = fleet.redis.conn().await?;
    let entry: String = redis::cmd("HGET")
        .arg(ACTIVE)
        .arg("signed")
        .query_async(&mut redis)
        .await?;
    let mut parts = entry.splitn(3, ' ');
    let (Some(action), Some(at), Some(json_text)) = (parts.next(), parts.next(), parts.next())
    else {
        anyhow::bail!("not `<action> <at> <version>`: {entry}");
    };
    let head = format!("{action} {at}");
    let signed: Value = serde_json::from_str(json_text)?;
    ensure!(
        signed["signature"].is_string(),
        "the signature is stored: {signed}"
    );
    let mut unsigned = signed.clone();
    unsigned
        .as_object_mut()
        .context("version")?
        .remove("signature");
    unsigned["fingerprint"] = json!("forged-unsigned");
    let mut tampered = signed.clone();
    tampered["settings"] = json!({"namespace": "billing"});
    tampered["fingerprint"] = json!("forged-tampered");
    for (task, version) in [("unsigned", &unsigned), ("tampered", &tampered)] {
        let _: () = redis::cmd("HSET")
            .arg(ACTIVE)
            .arg(task)
            .arg(format!("{head} {version}"))
            .query_async(&mut redis)
            .await?;
    }
    let _: i64 = redis::cmd("INCR")
        .arg(REVISION)
        .query_async(&mut redis)
        .await?;

    // Their tasks are accepted (the API knows the tasks from the registry)
    // beside a signed one.
    let mut forged = Vec::new();
    for task in ["unsigned", "tampered"] {
        forged.push((task, submit_when_known(&api, task).await?));
    }
    let control = api.submit_new(QUEUE, versioned("signed", 1), None).await?;
    api.wait_for(QUEUE, &control, &["SUCCEEDED"], WAIT).await?;

    // Every worker refuses both and reports why.
    wait_refused_by_every_worker(&api, &["unsigned", "tampered"], 2).await?;
    // Their tasks were taken by workers and given back, uncounted, each
    // twice (a later due time), and never run.
    for (task, id) in forged {
        wait_deferred_twice(&api, task, &id).await?;
    }
    Ok(())
}

/// Submit a task of `task` once the API knows it (its next registry pass).
async fn submit_when_known(api: &ApiClient, task: &str) -> Result<String> {
    let start = Instant::now();
    loop {
        let (status, body) = api.submit(QUEUE, versioned(task, 1), None).await?;
        if status == 202 {
            return body["task_id"]
                .as_str()
                .map(str::to_owned)
                .context("task_id");
        }
        ensure!(
            status == 400 && start.elapsed() < WAIT,
            "submitting {task}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until `workers` live workers each report a signature refusal of
/// every one of `tasks` in `GET /v1/handlers` (what `dtq handlers` shows).
async fn wait_refused_by_every_worker(
    api: &ApiClient,
    tasks: &[&str],
    workers: usize,
) -> Result<()> {
    let start = Instant::now();
    loop {
        let (_, fleet) = api.call(Method::GET, "/v1/handlers", None, &[]).await?;
        let reports = fleet["workers"].as_array().cloned().unwrap_or_default();
        let refused = |w: &Value, task: &str| {
            w["loaded"][task].is_null()
                && w["failed"][task]
                    .as_str()
                    .is_some_and(|e| e.contains("signature refused"))
        };
        let all =
            reports.len() == workers && reports.iter().all(|w| tasks.iter().all(|t| refused(w, t)));
        if all {
            return Ok(());
        }
        ensure!(
            start.elapsed() < WAIT,
            "not refused by every worker: {fleet:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until `id` was deferred twice (a SCHEDULED record with a later due
/// time than the first seen), checking on the way that it never ran: no
/// attempt counted, no module recorded, never a terminal status.
async fn wait_deferred_twice(api: &ApiClient, task: &str, id: &str) -> Result<()> {
    let start = Instant::now();
    let mut first_due = None;
    loop {
        let record = api.task(QUEUE, id).await?;
        let status = record["status"].as_str().unwrap_or_default();
        ensure!(
            matches!(status, "QUEUED" | "SCHEDULED" | "RUNNING"),
            "{task}: a version no trusted key signed ran: {record:#}"
        );
        if status != "RUNNING" {
            ensure!(
                record["attempts"] == 0,
                "{task}: an attempt was counted: {record:#}"
            );
            ensure!(
                record["handler_digest"].is_null(),
                "{task}: a module ran: {record:#}"
            );
        }
        if status == "SCHEDULED" {
            let due = record["run_at"].as_u64().context("run_at")?;
            match first_due {
                None => first_due = Some(due),
                Some(first) if due > first => return Ok(()),
                Some(_) => {}
            }
        }
        ensure!(
            start.elapsed() < WAIT,
            "{task} was not deferred twice: {record:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
