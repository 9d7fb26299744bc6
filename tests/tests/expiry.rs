//! Eager expiry (issue 13): a waiting task expires at its `expires_at`
//! even while no worker reaches it, exactly as a worker would have expired
//! it (status, error, event, idempotency record, retention), out of the
//! delayed set and the stream, so the queue's depth drops at once; and the
//! index costs nothing for tasks without an expiry.
//!
//! Every test runs against a real redis-server and a real worker (the
//! harness's, with one execution slot kept busy by a `sleep` task), or
//! drives the sweep's store call directly where a worker's other loops
//! would race the state under test.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use dtq_host::store::QueueKeys;
use dtq_tests::Dtq;
use serde_json::{Value, json};

/// Longest wait for a task to reach a status.
const WAIT: Duration = Duration::from_secs(30);

fn keys() -> QueueKeys {
    QueueKeys::new("default")
}

/// Start a worker with one slot and keep it busy with a `sleep` task of
/// `ms`; returns the sleeping task, RUNNING.
async fn busy_worker(dtq: &mut Dtq, ms: u64) -> Result<String> {
    dtq.start_worker();
    let sleeper = dtq
        .submit_new(
            "default",
            json!({"task": "sleep", "payload": {"ms": ms}}),
            None,
        )
        .await?;
    dtq.wait_for("default", &sleeper, &["RUNNING"], WAIT)
        .await?;
    Ok(sleeper)
}

/// The statuses of `id`'s lifecycle events, in order.
async fn events_of(dtq: &Dtq, id: &str) -> Result<Vec<String>> {
    let events = dtq.redis.task_events("default", id).await?;
    Ok(events.into_iter().map(|(status, _)| status).collect())
}

/// The task ids the ready stream holds a message for.
async fn stream_ids(dtq: &Dtq) -> Result<Vec<String>> {
    let mut conn = dtq.redis.conn().await?;
    let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(&keys().stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await?;
    // A message's task id: its `id` field, or the first line of `run`
    // (store/carried.rs).
    Ok(entries
        .into_iter()
        .filter_map(|(_, body)| match body.as_slice() {
            [name, id] if name == "id" => Some(id.clone()),
            [name, run] if name == "run" => run.split('\n').next().map(str::to_owned),
            _ => None,
        })
        .collect())
}

async fn zcard(dtq: &Dtq, key: &str) -> Result<u64> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("ZCARD").arg(key).query_async(&mut conn).await?)
}

/// What a task expired before it started looks like, whichever path
/// expired it.
fn assert_expired_unrun(task: &Value) -> Result<()> {
    ensure!(task["status"] == "EXPIRED", "{task}");
    ensure!(task["attempts"] == 0, "it ran: {task}");
    ensure!(task["started_at"].is_null(), "it started: {task}");
    ensure!(task["error"] == "expired before it started", "{task}");
    let expires_at = task["expires_at"].as_u64().context("expires_at")?;
    let finished_at = task["finished_at"].as_u64().context("finished_at")?;
    ensure!(finished_at >= expires_at, "expired early: {task}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_task_expires_on_time_while_every_slot_is_busy() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--concurrency", "1"]).await?;
    let sleeper = busy_worker(&mut dtq, 6_000).await?;
    let body = json!({"task": "echo", "payload": 1, "expires_in_ms": 300});
    let id = dtq
        .submit_new("default", body.clone(), Some("expires-soon"))
        .await?;

    let task = dtq
        .wait_for("default", &id, &["EXPIRED", "SUCCEEDED"], WAIT)
        .await?;
    assert_expired_unrun(&task)?;
    // The one slot is still busy: the sweep expired it, not a worker
    // reaching it.
    assert_eq!(dtq.task("default", &sleeper).await?["status"], "RUNNING");
    assert_eq!(events_of(&dtq, &id).await?, ["QUEUED", "EXPIRED"]);
    assert!(
        !stream_ids(&dtq).await?.contains(&id),
        "its message is left"
    );
    assert_eq!(zcard(&dtq, &keys().expiry).await?, 0);
    let mut conn = dtq.redis.conn().await?;
    let ttl: i64 = redis::cmd("TTL")
        .arg(keys().task(&id))
        .query_async(&mut conn)
        .await?;
    assert!(ttl > 0, "no retention TTL: {ttl}");

    // Its key replays it as terminal.
    assert_eq!(
        dtq.idem_state("default", "expires-soon").await?.as_deref(),
        Some("failed")
    );
    let (status, replay) = dtq.submit("default", body, Some("expires-soon")).await?;
    assert_eq!(
        (
            status,
            replay["status"].as_str(),
            replay["duplicate"].as_bool()
        ),
        (200, Some("EXPIRED"), Some(true)),
        "{replay}"
    );

    // Once the slot is free, nothing of it is run or left pending.
    dtq.wait_for("default", &sleeper, &["SUCCEEDED"], WAIT)
        .await?;
    assert_expired_unrun(&dtq.task("default", &id).await?)?;
    assert_eq!(dtq.redis.pending("default").await?, Some(0));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_left_by_an_expired_task_is_acknowledged_and_skipped() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--concurrency", "1"]).await?;
    let sleeper = busy_worker(&mut dtq, 6_000).await?;
    // Scheduled, then moved to the stream by the delayed mover (whose
    // message the hash does not name), then expired while it waits there.
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 2, "delay_ms": 100, "expires_in_ms": 2_000}),
            None,
        )
        .await?;
    let queued = dtq
        .wait_for("default", &id, &["QUEUED", "EXPIRED"], WAIT)
        .await?;
    assert_eq!(queued["status"], "QUEUED", "{queued}");
    let task = dtq
        .wait_for("default", &id, &["EXPIRED", "SUCCEEDED"], WAIT)
        .await?;
    assert_expired_unrun(&task)?;
    assert_eq!(dtq.task("default", &sleeper).await?["status"], "RUNNING");
    assert!(
        stream_ids(&dtq).await?.contains(&id),
        "the promoted message is gone"
    );
    assert_eq!(
        events_of(&dtq, &id).await?,
        ["SCHEDULED", "QUEUED", "EXPIRED"]
    );

    // The worker reads it once free: `start` acknowledges and deletes it
    // without running the task.
    dtq.wait_for("default", &sleeper, &["SUCCEEDED"], WAIT)
        .await?;
    let started = std::time::Instant::now();
    while stream_ids(&dtq).await?.contains(&id)
        || dtq.redis.pending("default").await?.unwrap_or(0) > 0
    {
        ensure!(
            started.elapsed() < WAIT,
            "the expired task's message stayed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_expired_unrun(&dtq.task("default", &id).await?)?;
    assert_eq!(
        events_of(&dtq, &id).await?,
        ["SCHEDULED", "QUEUED", "EXPIRED"]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_scheduled_task_past_its_expiry_is_expired_by_the_sweep() -> Result<()> {
    // No worker: its delayed mover would race the sweep for the task.
    let dtq = Dtq::start(false, &[]).await?;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 3, "delay_ms": 1_000, "expires_in_ms": 1_001}),
            Some("scheduled-expiry"),
        )
        .await?;
    let expires_at = dtq.task("default", &id).await?["expires_at"]
        .as_u64()
        .context("expires_at")?;
    assert_eq!(zcard(&dtq, &keys().delayed).await?, 1);
    let before = dtq.store.expire_due("default", expires_at - 1, 16).await?;
    assert_eq!(before, (0, Some(expires_at)), "expired before its time");
    while dtq_host::base::now_ms() <= expires_at {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let (expired, next) = dtq
        .store
        .expire_due("default", dtq_host::base::now_ms(), 16)
        .await?;
    assert_eq!((expired, next), (1, None));
    let task = dtq.task("default", &id).await?;
    assert_expired_unrun(&task)?;
    assert_eq!(
        zcard(&dtq, &keys().delayed).await?,
        0,
        "still in the delayed set"
    );
    assert_eq!(events_of(&dtq, &id).await?, ["SCHEDULED", "EXPIRED"]);
    assert_eq!(
        dtq.idem_state("default", "scheduled-expiry")
            .await?
            .as_deref(),
        Some("failed")
    );
    // A second sweep finds nothing; the mover finds nothing to move.
    let again = dtq
        .store
        .expire_due("default", dtq_host::base::now_ms(), 16)
        .await?;
    assert_eq!(again, (0, None));
    let moved = dtq
        .store
        .promote_due("default", dtq_host::base::now_ms(), 16)
        .await?;
    assert_eq!(moved.0, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_task_leaves_the_queue_depth_at_once() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--concurrency", "1", "--max-queue-depth", "3"]).await?;
    // The running task's message counts: depth 1.
    busy_worker(&mut dtq, 6_000).await?;
    let doomed = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 0, "expires_in_ms": 200}),
            None,
        )
        .await?;
    dtq.wait_for("default", &doomed, &["EXPIRED"], WAIT).await?;
    // Its message left with it: room for two more, and then the queue is
    // full again.
    for n in 1..=2 {
        dtq.submit_new("default", json!({"task": "echo", "payload": n}), None)
            .await?;
    }
    let (status, body) = dtq
        .submit("default", json!({"task": "echo", "payload": 3}), None)
        .await?;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("QUEUE_FULL")),
        "{body}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn only_tasks_with_an_expiry_are_indexed_and_a_started_one_leaves_the_index() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let plain = dtq
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;
    let mut conn = dtq.redis.conn().await?;
    let exists: u64 = redis::cmd("EXISTS")
        .arg(&keys().expiry)
        .query_async(&mut conn)
        .await?;
    assert_eq!(exists, 0, "a task without an expiry was indexed");
    // Its hash names its message, which carries the task (store/carried.rs).
    let msg_id: Option<String> = redis::cmd("HGET")
        .arg(keys().task(&plain))
        .arg("msg_id")
        .query_async(&mut conn)
        .await?;
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&keys().stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await?;
    let [(entry, fields)] = entries.as_slice() else {
        panic!("expected one message, got {entries:?}");
    };
    assert_eq!(msg_id.as_ref(), Some(entry));
    // One field: the task in `run`, its id, task name and payload the
    // first and last two of its six lines.
    assert_eq!(fields.len(), 1, "{fields:?}");
    let run: Vec<&str> = fields["run"].splitn(6, '\n').collect();
    assert_eq!(
        (run.first(), run.get(4), run.get(5)),
        (Some(&plain.as_str()), Some(&"echo"), Some(&"1")),
        "{fields:?}"
    );

    let timed = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 2, "expires_in_ms": 60_000}),
            None,
        )
        .await?;
    assert_eq!(zcard(&dtq, &keys().expiry).await?, 1);
    dtq.start_worker();
    for id in [&plain, &timed] {
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }
    assert_eq!(
        zcard(&dtq, &keys().expiry).await?,
        0,
        "a started task stayed indexed"
    );
    Ok(())
}
