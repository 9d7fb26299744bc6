//! Attempt history (issue 13): every attempt of a task is kept, bounded,
//! and shown as `attempt_history`, against a real redis-server, real
//! workers and the real guests.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dtq_host::store::{MAX_ATTEMPT_HISTORY, QueueKeys, Store};
use dtq_tests::{Dtq, guests, sha256_hex};
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);
const ADMIN: &str = "attempts-admin";

fn history(task: &Value) -> Vec<Value> {
    task["attempt_history"]
        .as_array()
        .cloned()
        .unwrap_or_else(|| panic!("no attempt_history in {task:#}"))
}

fn outcomes(task: &Value) -> Vec<(u64, String)> {
    history(task)
        .iter()
        .map(|a| {
            (
                a["attempt"].as_u64().unwrap_or(0),
                a["outcome"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn read(path: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {path}"))
}

/// The archived attempt fields (`attempt:<n>`) of task `id`'s hash, by n.
async fn archived(dtq: &Dtq, id: &str) -> Result<Vec<u64>> {
    let mut conn = dtq.redis.conn().await?;
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(QueueKeys::new("default").task(id))
        .query_async(&mut conn)
        .await?;
    let mut numbers: Vec<u64> = fields
        .iter()
        .filter_map(|f| f.strip_prefix("attempt:")?.parse().ok())
        .collect();
    numbers.sort_unstable();
    Ok(numbers)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_fails_twice_then_succeeds_shows_three_attempts() -> Result<()> {
    // Retries at least 3 s apart: time to deploy another module between
    // attempts 2 and 3.
    let dtq = Dtq::start(
        true,
        &[
            "--admin-token",
            ADMIN,
            "--reload-interval-ms",
            "100",
            "--retry-base-ms",
            "6000",
            "--retry-max-ms",
            "6000",
        ],
    )
    .await?;
    let adversarial = read(guests::ADVERSARIAL)?;
    let echo = read(guests::ECHO)?;
    let (status, body) = dtq
        .deploy("shifty", adversarial.clone(), &[], ADMIN)
        .await?;
    ensure!(status == 201, "{body:#}");
    let payload = json!({"op": "panic", "message": "boom on purpose"});
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "shifty", "payload": payload, "max_attempts": 3}),
            None,
        )
        .await?;

    // Attempts 1 and 2 panic (a trap, retried); then the handler becomes
    // `echo`, and attempt 3 succeeds.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let task = dtq.task("default", &id).await?;
        if task["status"] == "RETRYING" && task["attempts"] == 2 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "never retrying 2: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = dtq.deploy("shifty", echo.clone(), &[], ADMIN).await?;
    ensure!(status == 201, "{body:#}");
    loop {
        let (_, fleet) = dtq.call(Method::GET, "/v1/handlers", None, &[]).await?;
        if fleet["workers"][0]["loaded"]["shifty"] == sha256_hex(&echo) {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "echo never loaded: {fleet:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retrying = dtq.task("default", &id).await?;
    assert_eq!(
        (retrying["status"].as_str(), retrying["attempts"].as_u64()),
        (Some("RETRYING"), Some(2)),
        "attempt 3 ran before echo was deployed: {retrying:#}"
    );
    // While it waits, its two attempts are archived, and shown.
    assert_eq!(
        outcomes(&retrying),
        [(1, "retry".into()), (2, "retry".into())]
    );

    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["result"], payload, "{task:#}");
    assert_eq!(
        outcomes(&task),
        [
            (1, "retry".into()),
            (2, "retry".into()),
            (3, "success".into())
        ],
        "{task:#}"
    );
    let attempts = history(&task);
    for failed in &attempts[..2] {
        let error = failed["error"].as_str().unwrap_or_default();
        assert!(error.contains("boom on purpose"), "{failed:#}");
        let log = failed["log"].as_str().unwrap_or_default();
        assert!(log.contains("boom on purpose"), "{failed:#}");
        assert_eq!(failed["digest"], sha256_hex(&adversarial), "{failed:#}");
        let (start, end) = (
            failed["started_at"].as_u64(),
            failed["finished_at"].as_u64(),
        );
        assert!(start.is_some() && end >= start, "{failed:#}");
        assert_eq!(
            failed["duration_ms"].as_u64(),
            Some(end.unwrap_or(0) - start.unwrap_or(0))
        );
    }
    assert!(
        attempts[0]["finished_at"].as_u64() <= attempts[1]["started_at"].as_u64(),
        "{task:#}"
    );
    let last = &attempts[2];
    assert_eq!(last["error"], Value::Null, "{last:#}");
    assert_eq!(last["digest"], sha256_hex(&echo), "{last:#}");
    assert_eq!(last["started_at"], task["started_at"], "{last:#}");
    assert_eq!(last["finished_at"], task["finished_at"], "{last:#}");
    assert_eq!(last["log"], task["log"], "{last:#}");
    // The last attempt lives in the hash's own fields: only the retries
    // were archived.
    assert_eq!(archived(&dtq, &id).await?, [1, 2]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_succeeds_at_once_archives_nothing() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let id = dtq
        .submit_new("default", json!({"task": "echo", "payload": 7}), None)
        .await?;
    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(outcomes(&task), [(1, "success".into())]);
    assert!(archived(&dtq, &id).await?.is_empty());
    Ok(())
}

/// A worker beside the harness's, on a Redis connection of its own, that
/// can die as a crashed process does (its future aborted: no shutdown, no
/// more heartbeats, its message left pending).
struct Worker {
    handle: tokio::task::JoinHandle<()>,
    _stop: CancellationToken,
}

impl Worker {
    async fn start(dtq: &Dtq) -> Result<Worker> {
        let mut config = dtq.config.worker();
        config.concurrency = 1;
        let store =
            Store::connect(&dtq.config.store.redis_url, dtq.config.store_settings()).await?;
        let stop = CancellationToken::new();
        let run = dtq_host::worker::run(
            store,
            dtq.sandbox.clone(),
            config,
            stop.clone().cancelled_owned(),
        );
        let handle = tokio::spawn(async move {
            let _ = run.await;
        });
        Ok(Worker {
            handle,
            _stop: stop,
        })
    }

    async fn kill(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_whose_worker_dies_mid_attempt_shows_a_lost_attempt() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--visibility-timeout-ms", "600"]).await?;
    let doomed = Worker::start(&dtq).await?;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "sleep", "payload": {"ms": 1500}, "max_attempts": 3}),
            None,
        )
        .await?;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let task = dtq.task("default", &id).await?;
        if task["status"] == "RUNNING" {
            assert_eq!(outcomes(&task), [(1, "running".into())], "{task:#}");
            break;
        }
        ensure!(std::time::Instant::now() < deadline, "never ran: {task:#}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dtq.start_worker();
    doomed.kill().await;

    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        outcomes(&task),
        [(1, "lost".into()), (2, "success".into())],
        "{task:#}"
    );
    let attempts = history(&task);
    let lost = &attempts[0];
    assert_eq!(lost["log"], Value::Null, "{lost:#}");
    assert_eq!(lost["digest"], Value::Null, "{lost:#}");
    let error = lost["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("worker lost during attempt 1 of 3") && error.contains("no log"),
        "{lost:#}"
    );
    assert!(lost["duration_ms"].is_u64(), "{lost:#}");
    let digest = sha256_hex(&read(guests::SLEEP)?);
    assert_eq!(attempts[1]["digest"], digest, "{task:#}");
    // The lost attempt counts in the digests too.
    assert_eq!(task["attempt_digests"], json!(["-", digest]), "{task:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_history_keeps_the_last_attempts_only() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let attempts = MAX_ATTEMPT_HISTORY as u64 + 5;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": attempts},
                "max_attempts": attempts}),
            None,
        )
        .await?;
    let task = dtq
        .wait_for("default", &id, &["SUCCEEDED", "DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let shown = outcomes(&task);
    let first = attempts - MAX_ATTEMPT_HISTORY as u64 + 1;
    let expected: Vec<(u64, String)> = (first..=attempts)
        .map(|n| {
            let outcome = if n == attempts { "success" } else { "retry" };
            (n, outcome.to_owned())
        })
        .collect();
    assert_eq!(shown, expected);
    for a in &history(&task)[..MAX_ATTEMPT_HISTORY - 1] {
        let n = a["attempt"].as_u64().unwrap_or(0);
        let error = a["error"].as_str().unwrap_or_default();
        assert!(error.starts_with(&format!("attempt {n} of")), "{a:#}");
    }
    // Stored: the last MAX_ATTEMPT_HISTORY retries, no more.
    let stored = archived(&dtq, &id).await?;
    let expected: Vec<u64> = (attempts - MAX_ATTEMPT_HISTORY as u64..attempts).collect();
    assert_eq!(stored, expected);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_requeue_keeps_the_history_and_numbers_go_on() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 3}, "max_attempts": 2}),
            None,
        )
        .await?;
    let dead = dtq
        .wait_for("default", &id, &["DEAD_LETTERED"], WAIT)
        .await?;
    // The attempt that dead-lettered the task says so.
    assert_eq!(
        outcomes(&dead),
        [(1, "retry".into()), (2, "dead_lettered".into())],
        "{dead:#}"
    );
    assert_eq!(history(&dead)[1]["error"], dead["error"]);

    dtq.stop_worker().await?;
    let (status, body) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/dlq/{id}/requeue"),
            None,
            &[("Authorization", &format!("Bearer {ADMIN}"))],
        )
        .await?;
    ensure!(status == 200, "{body:#}");
    let queued = dtq.task("default", &id).await?;
    // The dead-lettered attempt was archived by the requeue.
    assert_eq!(outcomes(&queued), outcomes(&dead), "{queued:#}");
    assert_eq!(history(&queued)[1], history(&dead)[1]);
    assert_eq!(archived(&dtq, &id).await?, [1, 2]);

    dtq.start_worker();
    let done = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        outcomes(&done),
        [
            (1, "retry".into()),
            (2, "dead_lettered".into()),
            (3, "success".into())
        ],
        "{done:#}"
    );
    Ok(())
}

/// Deterministic failures are fatal (issue 32): a result over the size
/// limit (as the result check sees it, and past the host-call data cap,
/// where it is not even copied out), a request the allow-list denies
/// followed by the handler's retryable error, and a payload the guest SDK
/// rejects can never succeed, so each ends FAILED after its first attempt
/// of three, with its cause in the error.
#[tokio::test(flavor = "multi_thread")]
async fn deterministic_failures_fail_at_once_with_their_cause() -> Result<()> {
    // `http_client` is granted no host: every request it makes is denied.
    let dtq = Dtq::start(true, &[]).await?;
    let cases = [
        (
            json!({"task": "adversarial", "payload": {"op": "big_result", "bytes": 2 << 20}}),
            "result size limit exceeded",
        ),
        (
            json!({"task": "adversarial", "payload": {"op": "big_result", "bytes": 8 << 20}}),
            "host-call data limit exceeded",
        ),
        (
            json!({"task": "http_client", "payload":
                {"op": "fail_after_post", "url": "http://127.0.0.1:9/charge", "key": "k"}}),
            "outbound request POST http://127.0.0.1:9 denied by the handler's allow-list",
        ),
        (
            json!({"task": "adversarial", "payload": {"op": "no_such_op"}}),
            "payload does not match the handler's type",
        ),
    ];
    for (mut body, cause) in cases {
        body["max_attempts"] = json!(3);
        let id = dtq.submit_new("default", body.clone(), None).await?;
        let task = dtq
            .wait_for(
                "default",
                &id,
                &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
                WAIT,
            )
            .await?;
        assert_eq!(
            (task["status"].as_str(), task["attempts"].as_u64()),
            (Some("FAILED"), Some(1)),
            "{body}: {task:#}"
        );
        let error = task["error"].as_str().unwrap_or_default();
        assert!(error.contains(cause), "{body}: {error:?}");
        assert_eq!(outcomes(&task), [(1, "fatal".into())], "{task:#}");
    }
    Ok(())
}
