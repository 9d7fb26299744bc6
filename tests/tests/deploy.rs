//! The handler registry and what a deploy does, in one process against a
//! real `redis-server`: the registry's bookkeeping (history bound, module
//! collection, unchanged deploys, rollback and undeploy), the checks that
//! keep a bad module from ever reaching a worker, the operator's settings
//! taking effect, and a worker that lacks a handler deferring its task
//! instead of failing it.
//!
//! The real-process rollout (an API and two workers switching versions under
//! load) is `host/tests/deploy_process.rs`.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use dtq_host::deploy::{DeploySettings, HISTORY_LIMIT, Registry, RegistryError};
use dtq_tests::{Dtq, RedisServer, assert_error, guests, sha256_hex};
use reqwest::Method;
use serde_json::json;

const ADMIN: &str = "deploy-admin-token";
const WAIT: Duration = Duration::from_secs(30);

async fn registry(redis: &RedisServer) -> Result<Registry> {
    Ok(Registry::new(redis.manager().await?))
}

/// Keys matching `pattern`.
async fn keys(redis: &RedisServer, pattern: &str) -> Result<Vec<String>> {
    let mut conn = redis.conn().await?;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await?;
    keys.sort();
    Ok(keys)
}

#[tokio::test]
async fn the_history_is_bounded_and_unreferenced_modules_are_collected() -> Result<()> {
    let redis = RedisServer::start()?;
    let registry = registry(&redis).await?;
    let settings = DeploySettings::default;
    // A module deployed for two tasks stays while either references it.
    registry.deploy("other", b"shared", settings(), 1).await?;
    registry.deploy("busy", b"shared", settings(), 2).await?;
    for n in 0..HISTORY_LIMIT + 3 {
        let module = format!("module-{n}");
        registry
            .deploy("busy", module.as_bytes(), settings(), 10 + n as u64)
            .await?;
    }
    let (active, history) = registry.history("busy").await?;
    assert_eq!(history.len(), HISTORY_LIMIT);
    let newest = format!("module-{}", HISTORY_LIMIT + 2);
    let active = active.context("busy is active")?;
    assert_eq!(
        active.version.context("a version")?.digest,
        sha256_hex(newest.as_bytes())
    );

    // Stored: the ten modules of busy's history, and "shared" (other's).
    let mut expected: Vec<String> = (3..HISTORY_LIMIT + 3)
        .map(|n| format!("module-{n}"))
        .chain(["shared".to_owned()])
        .map(|m| format!("dtq:module:{{registry}}:{}", sha256_hex(m.as_bytes())))
        .collect();
    expected.sort();
    assert_eq!(keys(&redis, "dtq:module:*").await?, expected);
    for gone in 0..3 {
        let digest = sha256_hex(format!("module-{gone}").as_bytes());
        ensure!(registry.module(&digest).await?.is_none(), "{gone} kept");
    }
    // The shared module's bytes are intact.
    let shared = registry.module(&sha256_hex(b"shared")).await?;
    assert_eq!(shared.as_deref(), Some(&b"shared"[..]));
    Ok(())
}

#[tokio::test]
async fn deploying_the_same_module_and_settings_again_changes_nothing() -> Result<()> {
    let redis = RedisServer::start()?;
    let registry = registry(&redis).await?;
    let first = registry
        .deploy("t", b"v1", DeploySettings::default(), 1)
        .await?;
    assert!(!first.unchanged && first.previous.is_none());
    let revision = registry.revision().await?;

    let again = registry
        .deploy("t", b"v1", DeploySettings::default(), 2)
        .await?;
    assert!(again.unchanged);
    assert_eq!(again.active, first.active, "the first deploy stays active");
    assert_eq!(registry.revision().await?, revision, "nothing announced");
    assert_eq!(registry.history("t").await?.1.len(), 1);

    // Other settings with the same module are a new version.
    let tuned = DeploySettings {
        max_attempts: Some(7),
        ..DeploySettings::default()
    };
    let second = registry.deploy("t", b"v1", tuned, 3).await?;
    assert!(!second.unchanged);
    assert!(registry.revision().await? > revision);
    assert_eq!(registry.history("t").await?.1.len(), 2);
    Ok(())
}

#[tokio::test]
async fn rollback_returns_to_the_previous_version_or_the_one_named() -> Result<()> {
    let redis = RedisServer::start()?;
    let registry = registry(&redis).await?;
    let digest = |m: &[u8]| sha256_hex(m);
    let active_digest = |e: dtq_host::deploy::Entry| e.version.map(|v| v.digest);

    // Nothing to roll back to yet.
    let err = registry
        .rollback("t", None, 1)
        .await
        .expect_err("no history");
    assert!(matches!(err, RegistryError::UnknownTask(_)), "{err}");
    registry
        .deploy("t", b"v1", DeploySettings::default(), 1)
        .await?;
    let err = registry
        .rollback("t", None, 2)
        .await
        .expect_err("one version");
    assert!(matches!(err, RegistryError::NoEarlierVersion(_)), "{err}");

    registry
        .deploy("t", b"v2", DeploySettings::default(), 3)
        .await?;
    registry
        .deploy("t", b"v3", DeploySettings::default(), 4)
        .await?;
    let back = registry.rollback("t", None, 5).await?;
    assert_eq!(active_digest(back), Some(digest(b"v2")));
    // Rolling back again returns to the version rolled back from.
    let again = registry.rollback("t", None, 6).await?;
    assert_eq!(active_digest(again), Some(digest(b"v3")));
    let to_first = registry.rollback("t", Some(&digest(b"v1")), 7).await?;
    assert_eq!(active_digest(to_first), Some(digest(b"v1")));
    let err = registry
        .rollback("t", Some(&digest(b"never")), 8)
        .await
        .expect_err("not in the history");
    assert!(matches!(err, RegistryError::UnknownVersion { .. }), "{err}");

    let (active, history) = registry.history("t").await?;
    assert_eq!(active.and_then(active_digest), Some(digest(b"v1")));
    let actions: Vec<String> = history
        .iter()
        .map(|e| format!("{:?}", e.action).to_lowercase())
        .collect();
    assert_eq!(
        actions,
        [
            "rollback", "rollback", "rollback", "deploy", "deploy", "deploy"
        ]
    );
    Ok(())
}

#[tokio::test]
async fn undeploy_removes_the_active_version_and_rollback_brings_it_back() -> Result<()> {
    let redis = RedisServer::start()?;
    let registry = registry(&redis).await?;
    let err = registry.undeploy("t", 1).await.expect_err("never deployed");
    assert!(matches!(err, RegistryError::UnknownTask(_)), "{err}");

    registry
        .deploy("t", b"v1", DeploySettings::default(), 1)
        .await?;
    assert!(registry.undeploy("t", 2).await?);
    assert!(!registry.undeploy("t", 3).await?, "already undeployed");
    let (_, active) = registry.active().await?;
    assert!(active.is_empty(), "{active:?}");
    // The module stays with its history entry.
    assert!(registry.module(&sha256_hex(b"v1")).await?.is_some());

    let back = registry.rollback("t", None, 4).await?;
    assert_eq!(
        back.version.map(|v| v.digest),
        Some(sha256_hex(b"v1")),
        "rollback after undeploy restores the last version"
    );
    Ok(())
}

fn read(path: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {path}"))
}

/// A dtq whose API deploys (admin token) and whose worker runs what is
/// deployed.
async fn deploying_dtq(flags: &[&str]) -> Result<Dtq> {
    let mut all = vec!["--admin-token", ADMIN, "--reload-interval-ms", "100"];
    all.extend_from_slice(flags);
    Dtq::start(true, &all).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deployed_handler_runs_with_the_operators_settings() -> Result<()> {
    let dtq = deploying_dtq(&[]).await?;
    let echo = read(guests::ECHO)?;
    let (status, body) = dtq
        .deploy("greeter", echo.clone(), &[("max_attempts", "7")], ADMIN)
        .await?;
    assert_eq!(status, 201, "{body:#}");
    assert_eq!(body["digest"], sha256_hex(&echo), "{body:#}");
    assert_eq!(body["settings"], json!({"max_attempts": 7}), "{body:#}");

    // The API knows it at once (its own deploy); the worker within a pass.
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "greeter", "payload": {"hi": 1}}),
            None,
        )
        .await?;
    let done = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["result"], json!({"hi": 1}));
    assert_eq!(done["max_attempts"], 7, "the deploy's default: {done:#}");
    assert_eq!(done["handler_digest"], sha256_hex(&echo));
    assert_eq!(done["attempt_digests"], json!([sha256_hex(&echo)]));

    // A deadline set at deploy stops a handler the worker's flag would let
    // run for 30 s.
    let sleep = read(guests::SLEEP)?;
    let (status, body) = dtq
        .deploy(
            "napper",
            sleep,
            &[("timeout_ms", "200"), ("max_attempts", "1")],
            ADMIN,
        )
        .await?;
    assert_eq!(status, 201, "{body:#}");
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "napper", "payload": {"ms": 5000}}),
            None,
        )
        .await?;
    let dead = dtq
        .wait_for("default", &id, &["DEAD_LETTERED"], WAIT)
        .await?;
    let error = dead["error"].as_str().unwrap_or_default();
    assert!(error.contains("deadline"), "{dead:#}");

    // Memory set at deploy caps an allocation the worker's 64 MiB allows.
    let adversarial = read(guests::ADVERSARIAL)?;
    let (status, body) = dtq
        .deploy(
            "small",
            adversarial,
            &[("memory_mib", "16"), ("max_attempts", "1")],
            ADMIN,
        )
        .await?;
    assert_eq!(status, 201, "{body:#}");
    let submit = |mb: u64| json!({"task": "small", "payload": {"op": "alloc", "mb": mb}});
    let ok = dtq.submit_new("default", submit(4), None).await?;
    dtq.wait_for("default", &ok, &["SUCCEEDED"], WAIT).await?;
    let bomb = dtq.submit_new("default", submit(32), None).await?;
    let dead = dtq
        .wait_for("default", &bomb, &["DEAD_LETTERED"], WAIT)
        .await?;
    let error = dead["error"].as_str().unwrap_or_default();
    assert!(error.contains("memory"), "{dead:#}");

    // A kv quota set at deploy: 1 MiB for the namespace, where the
    // worker's flag gives 256. 700 KB fits; twice that does not.
    let adversarial = read(guests::ADVERSARIAL)?;
    let (status, body) = dtq
        .deploy(
            "thrifty",
            adversarial,
            &[("kv_quota_mib", "1"), ("max_attempts", "1")],
            ADMIN,
        )
        .await?;
    assert_eq!(status, 201, "{body:#}");
    let value = "v".repeat(700_000);
    let write = |key: &str| json!({"task": "thrifty", "payload": {"op": "keys", "keys": [key], "value": value}});
    let ok = dtq.submit_new("default", write("a"), None).await?;
    dtq.wait_for("default", &ok, &["SUCCEEDED"], WAIT).await?;
    let over = dtq.submit_new("default", write("b"), None).await?;
    let dead = dtq
        .wait_for("default", &over, &["DEAD_LETTERED"], WAIT)
        .await?;
    let error = dead["error"].as_str().unwrap_or_default();
    assert!(error.contains("quota"), "{dead:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_module_or_setting_is_refused_and_changes_nothing() -> Result<()> {
    let dtq = deploying_dtq(&["--max-module-mib", "1"]).await?;
    let echo = read(guests::ECHO)?;
    let (status, _) = dtq.deploy("t", echo.clone(), &[], ADMIN).await?;
    assert_eq!(status, 201);
    let before = dtq.call(Method::GET, "/v1/handlers/t", None, &[]).await?;
    assert_eq!(before.0, 200, "{:#}", before.1);

    // Not a component at all.
    let garbage = dtq.deploy("t", b"not wasm".to_vec(), &[], ADMIN).await?;
    assert_error(&garbage, 422, "INVALID_MODULE");
    let message = garbage.1["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.contains('\n'), "one line: {message}");
    // A component that asks for a namespace its task is not given.
    let namespaced = read(guests::NAMESPACED)?;
    let refused = dtq.deploy("t", namespaced.clone(), &[], ADMIN).await?;
    assert_error(&refused, 422, "INVALID_MODULE");
    let message = refused.1["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("namespace"), "{message}");
    // Over --max-module-mib.
    // Over --max-module-mib, sent without a length (a declared one is
    // refused before the body is read, and a client still sending may then
    // lose the answer to the closed connection): the limit is counted.
    let chunks = (0..9).map(|_| Ok::<_, std::io::Error>(vec![0u8; 128 << 10]));
    let resp = reqwest::Client::new()
        .put(format!("{}/v1/handlers/t", dtq.api))
        .bearer_auth(ADMIN)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await?;
    let big = (resp.status().as_u16(), resp.json().await?);
    assert_error(&big, 413, "MODULE_TOO_LARGE");
    // Settings out of range, or unknown.
    let settings = dtq
        .deploy("t", echo.clone(), &[("memory_mib", "0")], ADMIN)
        .await?;
    assert_error(&settings, 400, "INVALID_SETTINGS");
    assert_eq!(settings.1["error"]["details"]["setting"], "memory_mib");
    let unknown = dtq
        .deploy("t", echo.clone(), &[("memroy_mib", "8")], ADMIN)
        .await?;
    assert_error(&unknown, 400, "INVALID_QUERY");
    // Deploying needs the admin scope.
    let anonymous = dtq.deploy("t", echo.clone(), &[], "not-a-token").await?;
    assert_error(&anonymous, 401, "UNAUTHORIZED");

    let after = dtq.call(Method::GET, "/v1/handlers/t", None, &[]).await?;
    assert_eq!(after, before, "a refused deploy changed the registry");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_without_a_handler_on_the_worker_waits_instead_of_failing() -> Result<()> {
    let dtq = deploying_dtq(&[]).await?;
    // Submitted past the API's check, as an API that knows a handler the
    // worker does not yet would.
    let request: dtq_host::ingest::SubmitRequest =
        serde_json::from_value(json!({"task": "late", "payload": {"n": 1}}))?;
    let submitted = dtq_host::ingest::submit(
        &dtq.store,
        &dtq.config.ingest_settings(),
        "default",
        Some("late-1"),
        request,
        |_| true,
    )
    .await?;
    let id = submitted.task_id;

    // The worker picks it up, has no handler, and gives the attempt back:
    // SCHEDULED again with no attempt counted, more than once.
    let deadline = std::time::Instant::now() + WAIT;
    let deferred = loop {
        let task = dtq.task("default", &id).await?;
        let deferrals = deferrals(&dtq, &id).await?;
        ensure!(
            !["FAILED", "DEAD_LETTERED", "SUCCEEDED"]
                .contains(&task["status"].as_str().unwrap_or("")),
            "a task without a handler ended: {task:#}"
        );
        if deferrals >= 2 && task["status"] == "SCHEDULED" {
            break task;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "never deferred: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(deferred["attempts"], 0, "{deferred:#}");
    assert_eq!(deferred["attempt_digests"], json!([]), "{deferred:#}");
    let error = deferred["error"].as_str().unwrap_or_default();
    assert!(error.contains("late"), "{deferred:#}");
    assert_eq!(
        dtq.idem_state("default", "late-1").await?.as_deref(),
        Some("processing")
    );

    // Once the handler is deployed, the task runs: attempt 1 of its 3.
    let echo = read(guests::ECHO)?;
    let (status, body) = dtq.deploy("late", echo.clone(), &[], ADMIN).await?;
    assert_eq!(status, 201, "{body:#}");
    let done = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["attempts"], 1, "{done:#}");
    assert_eq!(done["result"], json!({"n": 1}));
    assert_eq!(done["handler_digest"], sha256_hex(&echo));
    assert_eq!(
        dtq.idem_state("default", "late-1").await?.as_deref(),
        Some("completed")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_whose_handler_never_comes_fails_past_the_defer_limit() -> Result<()> {
    let dtq = deploying_dtq(&["--defer-limit-ms", "400"]).await?;
    // Submitted past the API's check: no handler of `missing` anywhere.
    let request: dtq_host::ingest::SubmitRequest =
        serde_json::from_value(json!({"task": "missing", "payload": {"n": 1}}))?;
    let submitted = dtq_host::ingest::submit(
        &dtq.store,
        &dtq.config.ingest_settings(),
        "default",
        Some("missing-1"),
        request,
        |_| true,
    )
    .await?;
    let id = submitted.task_id;

    // Deferred (no attempt counted) until the bound, then FAILED with an
    // error that names the handler it waited for.
    let failed = dtq.wait_for("default", &id, &["FAILED"], WAIT).await?;
    assert_eq!(failed["attempts"], 0, "{failed:#}");
    assert_eq!(failed["attempt_digests"], json!([]), "{failed:#}");
    let error = failed["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("missing") && error.contains("defer limit 400 ms"),
        "{failed:#}"
    );
    assert!(deferrals(&dtq, &id).await? >= 1, "{failed:#}");
    assert_eq!(
        dtq.idem_state("default", "missing-1").await?.as_deref(),
        Some("failed")
    );
    Ok(())
}

async fn deferrals(dtq: &Dtq, id: &str) -> Result<u64> {
    let mut conn = dtq.redis.conn().await?;
    let n: Option<u64> = redis::cmd("HGET")
        .arg(format!("dtq:task:{{default}}:{id}"))
        .arg("deferrals")
        .query_async(&mut conn)
        .await?;
    Ok(n.unwrap_or(0))
}

/// Wait until the worker of `dtq` is live in the fleet (its first report
/// is written once it serves).
async fn wait_for_worker(dtq: &Dtq) -> Result<()> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, fleet) = dtq.call(Method::GET, "/v1/handlers", None, &[]).await?;
        if fleet["workers"].as_array().is_some_and(|w| !w.is_empty()) {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no live worker: {fleet:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deploy_no_live_worker_can_run_is_refused_unless_forced() -> Result<()> {
    // The worker's pool slots hold 64 MiB; the deploy asks for 128.
    let dtq = deploying_dtq(&["--memory-mib", "64"]).await?;
    wait_for_worker(&dtq).await?;
    let echo = read(guests::ECHO)?;
    let refused = dtq
        .deploy("greedy", echo.clone(), &[("memory_mib", "128")], ADMIN)
        .await?;
    assert_error(&refused, 409, "NO_WORKER_CAN_RUN");
    let reasons = refused.1["error"]["details"]["workers"]
        .as_object()
        .context("each worker's reason")?;
    assert_eq!(reasons.len(), 1, "{refused:?}");
    for reason in reasons.values() {
        let reason = reason.as_str().unwrap_or_default();
        assert!(reason.contains("--memory-mib 128"), "{refused:?}");
    }
    // Nothing was stored.
    let never = dtq
        .call(Method::GET, "/v1/handlers/greedy", None, &[])
        .await?;
    assert_error(&never, 400, "UNKNOWN_TASK");

    // Forced, it is stored, with a warning; a worker that can run it may
    // come later.
    let (status, body) = dtq
        .deploy(
            "greedy",
            echo,
            &[("memory_mib", "128"), ("force", "true")],
            ADMIN,
        )
        .await?;
    assert_eq!(status, 201, "{body:#}");
    let warning = body["warning"].as_str().unwrap_or_default();
    assert!(warning.contains("no live worker can run it"), "{body:#}");
    let id = dtq
        .submit_new("default", json!({"task": "greedy", "payload": {}}), None)
        .await?;

    // And a fuel budget, which this worker (no --fuel) does not meter.
    let echo = read(guests::ECHO)?;
    let refused = dtq
        .deploy("metered", echo.clone(), &[("fuel", "100000")], ADMIN)
        .await?;
    assert_error(&refused, 409, "NO_WORKER_CAN_RUN");
    let (status, body) = dtq
        .deploy(
            "metered",
            echo,
            &[("fuel", "100000"), ("force", "true")],
            ADMIN,
        )
        .await?;
    assert_eq!(status, 201, "{body:#}");

    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, fleet) = dtq.call(Method::GET, "/v1/handlers", None, &[]).await?;
        let failed = &fleet["workers"][0]["failed"];
        let greedy = failed["greedy"].as_str().unwrap_or("");
        let metered = failed["metered"].as_str().unwrap_or("");
        if greedy.contains("--memory-mib 128") && metered.contains("--fuel") {
            let greedy = &fleet["handlers"][0];
            assert_eq!(greedy["task"], "greedy", "{fleet:#}");
            assert_eq!(
                greedy["workers"],
                json!({"running": 0, "total": 1}),
                "{fleet:#}"
            );
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no failure reported: {fleet:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Deferred, never failed: its attempts are given back.
    while deferrals(&dtq, &id).await? < 2 {
        ensure!(std::time::Instant::now() < deadline, "not deferred");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let task = dtq.task("default", &id).await?;
    assert_eq!(task["attempts"], 0, "{task:#}");
    assert!(
        ["SCHEDULED", "QUEUED", "RUNNING"].contains(&task["status"].as_str().unwrap_or("")),
        "{task:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn each_attempt_records_the_digest_it_ran() -> Result<()> {
    let dtq = deploying_dtq(&[]).await?;
    let flaky = read(guests::FLAKY)?;
    let (status, _) = dtq.deploy("flaky", flaky.clone(), &[], ADMIN).await?;
    assert_eq!(status, 201);
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 3}, "max_attempts": 3}),
            None,
        )
        .await?;
    let done = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    let digest = sha256_hex(&flaky);
    assert_eq!(done["attempts"], 3);
    assert_eq!(done["attempt_digests"], json!([digest, digest, digest]));
    Ok(())
}
