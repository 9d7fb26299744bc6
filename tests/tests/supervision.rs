//! Supervised loops: a worker whose loop dies ends with an error naming it
//! (so `dtq` exits non-zero and its supervisor restarts it) instead of
//! staying up doing nothing; and a completion Redis rejects is dropped,
//! not retried forever while it holds its slot.
//!
//! No loop has a natural way to die, so the first tests use the hidden hook
//! `dtq_host::worker::inject_fault`, keyed by a queue of their own.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dtq_host::store::{GROUP, QueueKeys};
use dtq_host::worker::{self, Fault, WorkerError};
use dtq_tests::Dtq;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// Run a worker on `queue` (of `dtq`'s Redis) with no shutdown; what it
/// ended with, failing if it ran on for [`WAIT`].
async fn run_until_it_ends(dtq: &Dtq, queue: &str) -> Result<Result<(), WorkerError>> {
    let mut config = dtq.config.worker();
    config.queues = vec![queue.parse().expect("a queue name")];
    let never = CancellationToken::new();
    let run = worker::run(
        dtq.store.clone(),
        dtq.sandbox.clone(),
        config,
        never.cancelled_owned(),
    );
    tokio::time::timeout(WAIT, run)
        .await
        .context("the worker ran on with a dead loop")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_fetch_loop_stops_the_worker_with_an_error_naming_it() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    worker::inject_fault("fetch", "sup-fetch", Fault::Panic);
    let err = run_until_it_ends(&dtq, "sup-fetch")
        .await?
        .expect_err("the worker ended without an error");
    let message = err.to_string();
    assert!(matches!(err, WorkerError::LoopEnded(_)), "{message}");
    assert!(
        message.contains("`fetch` panicked") && message.contains("injected fault"),
        "{message}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_loop_returning_early_stops_the_worker_with_an_error_naming_it() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    worker::inject_fault("delayed", "sup-delayed", Fault::Return);
    let err = run_until_it_ends(&dtq, "sup-delayed")
        .await?
        .expect_err("the worker ended without an error");
    assert_eq!(
        err.to_string(),
        "worker loop `delayed mover of queue sup-delayed` ended unexpectedly"
    );
    Ok(())
}

/// A dying loop stops the others gracefully: the task running when it
/// died still completes before the worker returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_loop_lets_running_tasks_finish_before_the_worker_ends() -> Result<()> {
    let dtq = Dtq::start(false, &["--queues", "sup-grace"]).await?;
    let id = dtq
        .submit_new(
            "sup-grace",
            json!({"task": "sleep", "payload": {"ms": 300}}),
            None,
        )
        .await?;
    let mut config = dtq.config.worker();
    config.queues = vec!["sup-grace".parse().expect("a queue name")];
    let never = CancellationToken::new();
    let run = tokio::spawn(worker::run(
        dtq.store.clone(),
        dtq.sandbox.clone(),
        config,
        never.cancelled_owned(),
    ));
    dtq.wait_for("sup-grace", &id, &["RUNNING"], WAIT).await?;
    worker::inject_fault("delayed", "sup-grace", Fault::Panic);
    let ended = tokio::time::timeout(WAIT, run)
        .await
        .context("worker ran on")??;
    let err = ended.expect_err("the worker ended without an error");
    assert!(
        err.to_string()
            .contains("`delayed mover of queue sup-grace` panicked"),
        "{err}"
    );
    let task = dtq.task("sup-grace", &id).await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task}");
    Ok(())
}

/// With one slot, a completion retried forever would hold it, and nothing
/// else would run. The task's hash is replaced by a string while it runs, so
/// the `complete` script fails on it (WRONGTYPE) however often it is tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completion_redis_rejects_is_dropped_and_later_ones_are_written() -> Result<()> {
    let dtq = Dtq::start(true, &["--concurrency", "1"]).await?;
    let keys = QueueKeys::new("default");
    let doomed = dtq
        .submit_new(
            "default",
            json!({"task": "sleep", "payload": {"ms": 500}}),
            None,
        )
        .await?;
    dtq.wait_for("default", &doomed, &["RUNNING"], WAIT).await?;
    let mut conn = dtq.redis.conn().await?;
    let () = redis::cmd("SET")
        .arg(keys.task(&doomed))
        .arg("not a hash")
        .query_async(&mut conn)
        .await?;

    let mut later = Vec::new();
    for i in 0..3 {
        later.push(
            dtq.submit_new("default", json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    for id in &later {
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }

    // The rejected completion was not written: its message is still
    // pending, left to be reclaimed, and its key untouched.
    let start = Instant::now();
    loop {
        let pending: (u64, Option<String>, Option<String>, redis::Value) = redis::cmd("XPENDING")
            .arg(&keys.stream)
            .arg(GROUP)
            .query_async(&mut conn)
            .await?;
        if pending.0 == 1 {
            break;
        }
        if start.elapsed() > WAIT {
            bail!("expected the doomed task's message alone pending: {pending:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let kind: String = redis::cmd("TYPE")
        .arg(keys.task(&doomed))
        .query_async(&mut conn)
        .await?;
    assert_eq!(kind, "string");
    Ok(())
}
