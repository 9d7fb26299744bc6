//! The worker side of the contract (rules 12–20): outcomes, completion
//! writes, idempotency record transitions, cancel, expiry, DLQ and delayed
//! tasks, against a real redis-server and the real example handlers.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use dtq_host::store::{
    CompleteOutcome, Completion, CompletionKind, Delivery, GROUP, QueueKeys, StartDecision,
    StartedTask, TaskStatus,
};
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
/// An expiry no test reaches: a task with one is not carried, so its
/// attempts go through `start`.
const LATER_MS: u64 = 600_000;

/// Retries a minute apart, so a failed task sits in RETRYING while a test
/// looks at it.
const SLOW_RETRIES: &[&str] = &["--retry-base-ms", "60000", "--retry-max-ms", "60000"];

fn id_of(body: &Value) -> String {
    body["task_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no task_id in {body}"))
        .to_owned()
}

async fn submit_ok(dtq: &Dtq, body: Value, key: Option<&str>) -> Result<String> {
    let (status, resp) = dtq.submit("default", body, key).await?;
    assert_eq!(status, 202, "{resp}");
    Ok(id_of(&resp))
}

/// Every entry of stream `key`, oldest first: (id, fields and values).
async fn stream_entries(dtq: &Dtq, key: &str) -> Result<Vec<(String, Vec<String>)>> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await?)
}

/// The lifecycle events of one task, in order: (status, attempt).
async fn events(dtq: &Dtq, id: &str) -> Result<Vec<(String, u64)>> {
    let events = dtq.redis.task_events("default", id).await?;
    Ok(events
        .into_iter()
        .map(|(status, attempt)| (status, attempt.unwrap_or(u64::MAX)))
        .collect())
}

/// Read and start up to `count` messages of `queue` as worker `consumer`
/// does, without running them: the deliveries and what `start` decided.
async fn read_and_start(
    dtq: &Dtq,
    queue: &str,
    consumer: &str,
    count: usize,
) -> Result<(Vec<Delivery>, Vec<StartDecision>)> {
    let store = &dtq.store;
    store.ensure_group(queue).await?;
    let mut conn = store.dedicated_connection(Duration::from_secs(5)).await?;
    let mut deliveries = store
        .read(&mut conn, queue, consumer, count, Duration::from_millis(10))
        .await?;
    let decisions = store
        .start(queue, consumer, &mut deliveries, dtq_host::base::now_ms())
        .await?;
    Ok((deliveries, decisions))
}

/// The success completion, with `result`, of attempt `attempt` of the task
/// `delivery` carries.
fn success(queue: &str, delivery: &Delivery, attempt: u32, result: &str) -> Completion {
    Completion {
        queue: queue.into(),
        task_id: delivery.task_id.clone(),
        msg_id: delivery.msg_id.clone(),
        idempotency_key: None,
        kind: CompletionKind::Success,
        detail: result.into(),
        log: String::new(),
        attempt,
        retry_at: 0,
        defer_limit_ms: 0,
        now: dtq_host::base::now_ms(),
        digest: None,
        carried_at: None,
        staged: Vec::new(),
        op_staged: false,
    }
}

/// [`success`] for `task` as `start` gave it: a carried first attempt's
/// completion says when it began.
fn finish(task: &StartedTask, delivery: &Delivery, attempt: u32, result: &str) -> Completion {
    Completion {
        carried_at: task.carried_at,
        staged: Vec::new(),
        op_staged: false,
        ..success(&task.queue, delivery, attempt, result)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_holds_no_more_messages_than_free_slots() -> Result<()> {
    let dtq = Dtq::start(true, &["--concurrency", "2"]).await?;
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(submit_ok(&dtq, json!({"task": "sleep", "payload": {"ms": 300}}), None).await?);
    }
    let mut conn = dtq.redis.conn().await?;
    let start = Instant::now();
    // A running task's message is pending until its completion is written
    // (a carried attempt's hash says QUEUED meanwhile): the pending count
    // bounds the tasks running at once.
    let mut max_pending = 0;
    loop {
        max_pending = max_pending.max(dtq.redis.pending("default").await?.unwrap_or(0));
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.hget(format!("dtq:task:{{default}}:{id}"), "status");
        }
        let statuses: Vec<String> = pipe.query_async(&mut conn).await?;
        let done = statuses.iter().filter(|s| *s == "SUCCEEDED").count();
        if done == ids.len() {
            break;
        }
        assert!(start.elapsed() < WAIT, "tasks did not finish");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(
        max_pending <= 2,
        "a worker with 2 slots held {max_pending} messages"
    );
    assert!(max_pending >= 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn success_keeps_result_log_and_timestamps_and_acks() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "adversarial", "payload": {"op": "stdout", "bytes": 12}}),
        None,
    )
    .await?;
    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["attempts"], 1);
    assert!(task["result"].is_object(), "{task}");
    assert!(
        task["log"].as_str().is_some_and(|l| l.len() >= 12),
        "stdout is captured into the log: {task}"
    );
    for field in ["created_at", "started_at", "finished_at", "updated_at"] {
        assert!(
            task[field].as_u64().is_some_and(|t| t > 0),
            "{field}: {task}"
        );
    }
    // Its first attempt was carried (no `start`, so no RUNNING event);
    // the completion wrote the attempt and when it started.
    assert_eq!(
        events(&dtq, &id).await?,
        vec![("QUEUED".into(), 0), ("SUCCEEDED".into(), 1)]
    );
    // Acknowledged and deleted: nothing pending, nothing left in the stream.
    assert_eq!(dtq.redis.pending("default").await?, Some(0));
    let mut conn = dtq.redis.conn().await?;
    let len: u64 = redis::cmd("XLEN")
        .arg("dtq:stream:{default}")
        .query_async(&mut conn)
        .await?;
    assert_eq!(len, 0);
    // Terminal hashes get the retention TTL.
    let ttl: i64 = redis::cmd("TTL")
        .arg(format!("dtq:task:{{default}}:{id}"))
        .query_async(&mut conn)
        .await?;
    assert!(ttl > 0, "terminal task hash has no retention TTL ({ttl})");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn retryable_errors_retry_with_backoff_then_succeed() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 3}, "max_attempts": 5}),
        Some("flaky-key"),
    )
    .await?;
    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["attempts"], 3);
    assert_eq!(task["result"], json!({"attempt": 3}));
    assert!(
        task["error"].is_null(),
        "a success clears the last attempt's error: {task}"
    );
    let statuses: Vec<String> = events(&dtq, &id)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(
        statuses,
        [
            "QUEUED",
            "RETRYING",
            "QUEUED",
            "RUNNING",
            "RETRYING",
            "QUEUED",
            "RUNNING",
            "SUCCEEDED"
        ]
    );
    assert_eq!(
        dtq.idem_state("default", "flaky-key").await?.as_deref(),
        Some("completed")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn retrying_keeps_the_record_processing_and_resubmission_gets_409() -> Result<()> {
    let dtq = Dtq::start(true, SLOW_RETRIES).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 5}, "max_attempts": 5}),
        Some("retrying"),
    )
    .await?;
    let task = dtq.wait_for("default", &id, &["RETRYING"], WAIT).await?;
    assert!(
        task["run_at"]
            .as_u64()
            .is_some_and(|at| at >= task["updated_at"].as_u64().unwrap_or(0) + 30_000),
        "backoff with equal jitter is at least half the base: {task}"
    );
    assert_eq!(
        dtq.idem_state("default", "retrying").await?.as_deref(),
        Some("processing")
    );
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 5}}),
            Some("retrying"),
        )
        .await?;
    assert_eq!(status, 409, "{body}");
    // It waits in the delayed set.
    let mut conn = dtq.redis.conn().await?;
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("dtq:delayed:{default}")
        .arg(&id)
        .query_async(&mut conn)
        .await?;
    assert!(score.is_some());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn exhausted_retries_dead_letter_and_fail_the_record() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 10}, "max_attempts": 2}),
        Some("dlq-key"),
    )
    .await?;
    let task = dtq
        .wait_for("default", &id, &["DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(task["attempts"], 2);
    assert!(
        task["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{task}"
    );
    assert_eq!(
        dtq.idem_state("default", "dlq-key").await?.as_deref(),
        Some("failed")
    );
    let (status, list) = dtq
        .call(Method::GET, "/v1/queues/default/dlq", None, &[])
        .await?;
    assert_eq!(status, 200);
    let ids: Vec<&str> = list["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .filter_map(|t| t["task_id"].as_str())
        .collect();
    assert_eq!(ids, [id.as_str()]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn fatal_errors_fail_at_once_and_traps_and_deadlines_retry() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let fatal = submit_ok(&dtq, json!({"task": "adversarial", "payload": {"op": "fatal", "message": "bad card"}, "max_attempts": 3}), Some("fatal")).await?;
    let panic = submit_ok(&dtq, json!({"task": "adversarial", "payload": {"op": "panic", "message": "boom"}, "max_attempts": 2}), None).await?;
    let deadline = submit_ok(
        &dtq,
        json!({"task": "sleep", "payload": {"ms": 5000}, "timeout_ms": 100, "max_attempts": 2}),
        None,
    )
    .await?;

    let t = dtq
        .wait_for(
            "default",
            &fatal,
            &["FAILED", "DEAD_LETTERED", "SUCCEEDED"],
            WAIT,
        )
        .await?;
    assert_eq!(
        (t["status"].as_str(), t["attempts"].as_u64()),
        (Some("FAILED"), Some(1)),
        "{t}"
    );
    assert!(
        t["error"].as_str().is_some_and(|e| e.contains("bad card")),
        "{t}"
    );
    assert_eq!(
        dtq.idem_state("default", "fatal").await?.as_deref(),
        Some("failed")
    );

    let t = dtq
        .wait_for(
            "default",
            &panic,
            &["FAILED", "DEAD_LETTERED", "SUCCEEDED"],
            WAIT,
        )
        .await?;
    assert_eq!(
        (t["status"].as_str(), t["attempts"].as_u64()),
        (Some("DEAD_LETTERED"), Some(2)),
        "{t}"
    );
    assert!(
        t["error"].as_str().is_some_and(|e| e.contains("boom")),
        "panic message kept: {t}"
    );

    let t = dtq
        .wait_for(
            "default",
            &deadline,
            &["FAILED", "DEAD_LETTERED", "SUCCEEDED"],
            WAIT,
        )
        .await?;
    assert_eq!(
        (t["status"].as_str(), t["attempts"].as_u64()),
        (Some("DEAD_LETTERED"), Some(2)),
        "{t}"
    );
    assert!(
        t["error"]
            .as_str()
            .is_some_and(|e| e.to_lowercase().contains("deadline")),
        "{t}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn completion_never_creates_a_record_and_keeps_its_ttl() -> Result<()> {
    let dtq = Dtq::start(true, &["--idem-ttl-s", "1000"]).await?;
    // Keyless tasks have no record, before or after.
    let keyless = submit_ok(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    dtq.wait_for("default", &keyless, &["SUCCEEDED"], WAIT)
        .await?;
    let idem: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:idempotency"))
        .collect();
    assert!(idem.is_empty(), "{idem:?}");

    // A record deleted while its task runs is not recreated (SET XX).
    let id = submit_ok(
        &dtq,
        json!({"task": "sleep", "payload": {"ms": 1500}}),
        Some("gone"),
    )
    .await?;
    dtq.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    let mut conn = dtq.redis.conn().await?;
    let _: () = redis::cmd("DEL")
        .arg("dtq:idempotency:{default}:gone")
        .query_async(&mut conn)
        .await?;
    // Only a deletion before the completion tests anything.
    assert_eq!(dtq.task("default", &id).await?["status"], "RUNNING");
    dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert!(dtq.idem_record("default", "gone").await?.is_none());

    // The expiry is kept (KEEPTTL): a short TTL set by hand survives the completion.
    let id = submit_ok(
        &dtq,
        json!({"task": "sleep", "payload": {"ms": 1500}}),
        Some("ttl"),
    )
    .await?;
    dtq.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    let _: () = redis::cmd("EXPIRE")
        .arg("dtq:idempotency:{default}:ttl")
        .arg(50)
        .query_async(&mut conn)
        .await?;
    // Only an expiry set before the completion tests anything.
    assert_eq!(dtq.task("default", &id).await?["status"], "RUNNING");
    dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    let ttl: i64 = redis::cmd("TTL")
        .arg("dtq:idempotency:{default}:ttl")
        .query_async(&mut conn)
        .await?;
    assert!((1..=50).contains(&ttl), "KEEPTTL lost the expiry: {ttl}");
    assert_eq!(
        dtq.idem_state("default", "ttl").await?.as_deref(),
        Some("completed")
    );
    Ok(())
}

/// The name of the idempotency record of `key` in `default`.
fn record_key(key: &str) -> String {
    format!("dtq:idempotency:{{default}}:{key}")
}

/// The idempotency record of `key` in `default`, as it is stored.
async fn raw_record(conn: &mut dtq_host::store::Conn, key: &str) -> Result<String> {
    Ok(redis::cmd("GET")
        .arg(record_key(key))
        .query_async(conn)
        .await?)
}

/// Check that the record of `key` in `default` starts as submission
/// writes it, naming `id`, its state written as `token`.
async fn assert_head(
    conn: &mut dtq_host::store::Conn,
    key: &str,
    id: &str,
    token: &str,
) -> Result<()> {
    let raw = raw_record(conn, key).await?;
    let head = format!(r#"{{"task_id":"{id}","state":{token},"updated_at":"#);
    assert!(raw.starts_with(&head), "{raw} does not start with {head}");
    Ok(())
}

/// The fingerprint of the idempotency record of `key` in `default`.
async fn fingerprint(dtq: &Dtq, key: &str) -> Result<Value> {
    let rec = dtq.idem_record("default", key).await?.context("a record")?;
    Ok(rec["fingerprint"].clone())
}

/// A completion moves its record to its terminal state whatever the
/// record's layout: the one submission writes (its state and time
/// rewritten in place, the state padded to one width), and any other valid
/// JSON (a record written by cjson, in Lua's key order), which is read and
/// rewritten whole; a record that names another task is left alone in
/// either layout. Readers (the key's lookup, a replay) read the padded
/// state as the plain one.
#[tokio::test(flavor = "multi_thread")]
async fn a_completion_moves_a_record_of_any_layout_and_no_other_tasks() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let mut conn = dtq.redis.conn().await?;
    let sleeper = json!({"task": "sleep", "payload": {"ms": 1500}});
    let mut ids = Vec::new();
    for key in ["in-place", "reordered", "taken", "taken-reordered"] {
        ids.push(submit_ok(&dtq, sleeper.clone(), Some(key)).await?);
    }
    for id in &ids {
        dtq.wait_for("default", id, &["RUNNING"], WAIT).await?;
    }
    assert_head(&mut conn, "in-place", &ids[0], r#""processing""#).await?;

    // While the tasks run, rewrite three records as another writer might.
    let reordered = json!({
        "updated_at": 1, "fingerprint": fingerprint(&dtq, "reordered").await?,
        "state": "processing", "task_id": ids[1],
    });
    let other = "00000000-0000-0000-0000-000000000000";
    let taken = format!(
        r#"{{"task_id":"{other}","state":"processing","updated_at":1765000000000,"fingerprint":{}}}"#,
        fingerprint(&dtq, "taken").await?
    );
    let taken_reordered = json!({"state": "processing", "task_id": other, "updated_at": 1});
    for (key, record) in [
        ("reordered", reordered.to_string()),
        ("taken", taken.clone()),
        ("taken-reordered", taken_reordered.to_string()),
    ] {
        let _: () = redis::cmd("SET")
            .arg(record_key(key))
            .arg(&record)
            .arg("KEEPTTL")
            .query_async(&mut conn)
            .await?;
    }
    // Only records rewritten before the completions test anything.
    for id in &ids {
        assert_eq!(dtq.task("default", id).await?["status"], "RUNNING");
    }
    for id in &ids {
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }

    assert_head(&mut conn, "in-place", &ids[0], r#""completed" "#).await?;
    for (key, id) in [("in-place", &ids[0]), ("reordered", &ids[1])] {
        let rec = dtq.idem_record("default", key).await?.context("a record")?;
        assert_eq!(rec["state"], "completed", "{key}: {rec}");
        assert_eq!(rec["task_id"], json!(id), "{key}: {rec}");
        assert!(rec["updated_at"].as_u64() > Some(1), "{key}: {rec}");
        let (status, looked_up) = dtq
            .call(
                Method::GET,
                &format!("/v1/queues/default/idempotency/{key}"),
                None,
                &[],
            )
            .await?;
        assert_eq!(
            (status, &looked_up["state"]),
            (200, &json!("completed")),
            "{looked_up}"
        );
        let (status, replay) = dtq.submit("default", sleeper.clone(), Some(key)).await?;
        assert_eq!(status, 200, "{replay}");
        assert_eq!(replay["duplicate"], true, "{replay}");
        assert_eq!(replay["task_id"], json!(id), "{replay}");
    }
    assert_eq!(
        raw_record(&mut conn, "taken").await?,
        taken,
        "a record naming another task was rewritten"
    );
    let rec = dtq.idem_record("default", "taken-reordered").await?;
    assert_eq!(rec, Some(taken_reordered));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_completion_writes_nothing() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let id = submit_ok(&dtq, json!({"task": "echo", "payload": 1}), Some("stale-c")).await?;
    let before = dtq.task("default", &id).await?;
    // The task is QUEUED, not RUNNING attempt 1: a completion for attempt 1
    // (e.g. from a worker whose task was reclaimed) must be refused whole.
    let outcome = dtq
        .store
        .complete(&[Completion {
            idempotency_key: Some("stale-c".into()),
            ..success(
                "default",
                &Delivery {
                    msg_id: "0-1".into(),
                    task_id: id.clone(),
                    carried: None,
                },
                1,
                "{}",
            )
        }])
        .await?;
    assert_eq!(outcome, vec![CompleteOutcome::Stale("QUEUED".into())]);
    assert_eq!(dtq.task("default", &id).await?, before);
    assert_eq!(
        dtq.idem_state("default", "stale-c").await?.as_deref(),
        Some("processing")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_of_a_queued_task_means_it_never_runs_and_replays() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let body = json!({"task": "counter", "payload": {"name": "never"}});
    let id = submit_ok(&dtq, body.clone(), Some("cancel-q")).await?;
    let (status, resp) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(
        (status, resp["status"].as_str()),
        (200, Some("CANCELLED")),
        "{resp}"
    );
    assert_eq!(
        dtq.idem_state("default", "cancel-q").await?.as_deref(),
        Some("failed")
    );

    dtq.start_worker();
    // A task submitted after the cancel, done: the worker has read the
    // stream past where the cancelled task's message was, and acknowledged
    // all it read.
    let marker = submit_ok(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    dtq.wait_for("default", &marker, &["SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(dtq.redis.pending("default").await?, Some(0));
    let task = dtq.task("default", &id).await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("CANCELLED"), Some(0)),
        "{task}"
    );
    let mut conn = dtq.redis.conn().await?;
    let counter: Option<i64> = redis::cmd("GET")
        .arg("dtq:guest:{counter}:counter:never")
        .query_async(&mut conn)
        .await?;
    assert_eq!(counter, None, "the handler ran");

    let (status, replay) = dtq.submit("default", body, Some("cancel-q")).await?;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(
        (replay["duplicate"].as_bool(), replay["status"].as_str()),
        (Some(true), Some("CANCELLED"))
    );

    // Cancelling again: already terminal.
    assert_error(
        &dtq.call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
            &[],
        )
        .await?,
        409,
        "TASK_TERMINAL",
    );
    assert_error(
        &dtq.call(
            Method::POST,
            "/v1/queues/default/tasks/nope/cancel",
            None,
            &[],
        )
        .await?,
        404,
        "TASK_NOT_FOUND",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_interrupts_a_running_task_inside_the_sandbox() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    // A busy loop that never yields: only preemption can stop it.
    let id = submit_ok(
        &dtq,
        json!({"task": "adversarial", "payload": {"op": "loop"}, "max_attempts": 3}),
        Some("cancel-r"),
    )
    .await?;
    dtq.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    let asked = Instant::now();
    let (status, resp) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(status, 202, "{resp}");
    let task = dtq
        .wait_for(
            "default",
            &id,
            &["CANCELLED", "SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    assert_eq!(task["status"], "CANCELLED", "{task}");
    assert_eq!(task["attempts"], 1, "a cancelled task is not retried");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "cancel took {:?}",
        asked.elapsed()
    );
    assert_eq!(
        dtq.idem_state("default", "cancel-r").await?.as_deref(),
        Some("failed")
    );
    let (status, replay) = dtq
        .submit(
            "default",
            json!({"task": "adversarial", "payload": {"op": "loop"}, "max_attempts": 3}),
            Some("cancel-r"),
        )
        .await?;
    assert_eq!(
        (status, replay["duplicate"].as_bool()),
        (200, Some(true)),
        "{replay}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_of_a_retrying_task_removes_it_from_the_delayed_set() -> Result<()> {
    let dtq = Dtq::start(true, SLOW_RETRIES).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 3}, "max_attempts": 3}),
        None,
    )
    .await?;
    dtq.wait_for("default", &id, &["RETRYING"], WAIT).await?;
    let (status, _) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(status, 200);
    let mut conn = dtq.redis.conn().await?;
    let delayed: u64 = redis::cmd("ZCARD")
        .arg("dtq:delayed:{default}")
        .query_async(&mut conn)
        .await?;
    assert_eq!(delayed, 0);
    assert_eq!(dtq.task("default", &id).await?["status"], "CANCELLED");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_not_started_before_its_expiry_expires() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let body = json!({"task": "counter", "payload": {"name": "late"}, "expires_in_ms": 100});
    let id = submit_ok(&dtq, body.clone(), Some("exp-key")).await?;
    // A task with room to spare runs normally.
    let fresh = submit_ok(
        &dtq,
        json!({"task": "echo", "payload": 1, "expires_in_ms": 60000}),
        None,
    )
    .await?;
    // The worker starts once the first task's expiry has passed.
    let expires_at = dtq.task("default", &id).await?["expires_at"]
        .as_u64()
        .context("no expires_at")?;
    while dtq_host::base::now_ms() <= expires_at {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    dtq.start_worker();
    let task = dtq
        .wait_for("default", &id, &["EXPIRED", "SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("EXPIRED"), Some(0)),
        "{task}"
    );
    dtq.wait_for("default", &fresh, &["SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(
        dtq.idem_state("default", "exp-key").await?.as_deref(),
        Some("failed")
    );
    let (status, replay) = dtq.submit("default", body, Some("exp-key")).await?;
    assert_eq!(
        (
            status,
            replay["status"].as_str(),
            replay["duplicate"].as_bool()
        ),
        (200, Some("EXPIRED"), Some(true))
    );
    assert_eq!(
        dtq.redis.pending("default").await?,
        Some(0),
        "the expired task's message was acknowledged"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn dlq_requeue_is_admin_only_and_resets_the_record_to_processing() -> Result<()> {
    let mut dtq = Dtq::start(
        true,
        &[
            "--admin-token",
            "s3cret",
            "--retry-base-ms",
            "300",
            "--retry-max-ms",
            "300",
        ],
    )
    .await?;
    let body = json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1});
    let id = submit_ok(&dtq, body.clone(), Some("rq")).await?;
    dtq.wait_for("default", &id, &["DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(
        dtq.idem_state("default", "rq").await?.as_deref(),
        Some("failed")
    );

    // No worker while we look at the requeued task's record.
    dtq.stop_worker().await?;
    let path = format!("/v1/queues/default/dlq/{id}/requeue");
    assert_error(
        &dtq.call(Method::POST, &path, None, &[]).await?,
        401,
        "UNAUTHORIZED",
    );
    let (status, _) = dtq
        .call(
            Method::POST,
            &path,
            None,
            &[("Authorization", "Bearer wrong")],
        )
        .await?;
    assert_eq!(status, 401);
    let (status, resp) = dtq
        .call(
            Method::POST,
            &path,
            None,
            &[("Authorization", "Bearer s3cret")],
        )
        .await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(
        dtq.idem_state("default", "rq").await?.as_deref(),
        Some("processing")
    );
    let (status, conflict) = dtq.submit("default", body.clone(), Some("rq")).await?;
    assert_eq!(status, 409, "requeued task is in flight again: {conflict}");
    dtq.start_worker();

    let task = dtq
        .wait_for("default", &id, &["SUCCEEDED", "DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(2)),
        "{task}"
    );
    assert_eq!(
        dtq.idem_state("default", "rq").await?.as_deref(),
        Some("completed")
    );
    let (_, list) = dtq
        .call(Method::GET, "/v1/queues/default/dlq", None, &[])
        .await?;
    assert_eq!(list["tasks"], json!([]));
    // Requeue of a task that is not dead-lettered.
    assert_error(
        &dtq.call(
            Method::POST,
            &path,
            None,
            &[("Authorization", "Bearer s3cret")],
        )
        .await?,
        409,
        "NOT_DEAD_LETTERED",
    );
    assert_error(
        &dtq.call(
            Method::POST,
            "/v1/queues/default/dlq/nope/requeue",
            None,
            &[("Authorization", "Bearer s3cret")],
        )
        .await?,
        404,
        "TASK_NOT_FOUND",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_routes_are_disabled_without_a_token() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    assert_error(
        &dtq.call(
            Method::POST,
            "/v1/queues/default/dlq/x/requeue",
            None,
            &[("Authorization", "Bearer anything")],
        )
        .await?,
        403,
        "ADMIN_DISABLED",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn delayed_tasks_wait_then_run_exactly_once_with_two_movers() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    // A second worker on the same Redis: two delayed movers race for every task.
    let stop = tokio_util::sync::CancellationToken::new();
    let second = tokio::spawn(dtq_host::worker::run(
        dtq.store.clone(),
        dtq.sandbox.clone(),
        dtq.config.worker(),
        stop.clone().cancelled_owned(),
    ));
    let mut ids = Vec::new();
    for i in 0..40 {
        let body =
            json!({"task": "counter", "payload": {"name": format!("d{i}")}, "delay_ms": 400});
        let (status, resp) = dtq.submit("default", body, None).await?;
        assert_eq!(
            (status, resp["status"].as_str()),
            (202, Some("SCHEDULED")),
            "{resp}"
        );
        ids.push(id_of(&resp));
    }
    // None may start before it is due: each one's start is checked below
    // against its own submission, from the record, not after a sleep.
    let mut conn = dtq.redis.conn().await?;
    for (i, id) in ids.iter().enumerate() {
        let task = dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
        assert_eq!(task["attempts"], 1);
        let started = task["started_at"].as_u64().unwrap_or(0);
        assert!(
            started >= task["created_at"].as_u64().unwrap_or(u64::MAX) + 400,
            "started early: {task}"
        );
        let value: i64 = redis::cmd("GET")
            .arg(format!("dtq:guest:{{counter}}:counter:d{i}"))
            .query_async(&mut conn)
            .await?;
        assert_eq!(value, 1, "task {i} ran {value} times");
    }
    stop.cancel();
    second.await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn queue_counts_and_health() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let echo = submit_ok(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    submit_ok(
        &dtq,
        json!({"task": "echo", "payload": 2, "delay_ms": 60000}),
        None,
    )
    .await?;
    let (status, stats) = dtq
        .call(Method::GET, "/v1/queues/default", None, &[])
        .await?;
    assert_eq!(status, 200);
    assert_eq!(
        (
            stats["ready"].as_u64(),
            stats["delayed"].as_u64(),
            stats["dead_lettered"].as_u64()
        ),
        (Some(1), Some(1), Some(0)),
        "{stats}"
    );
    let (_, all) = dtq.call(Method::GET, "/v1/queues", None, &[]).await?;
    assert_eq!(all["queues"][0]["queue"], "default", "{all}");
    let (status, health) = dtq.call(Method::GET, "/healthz", None, &[]).await?;
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    assert_error(
        &dtq.call(Method::GET, "/v1/queues/default/tasks/nope", None, &[])
            .await?,
        404,
        "TASK_NOT_FOUND",
    );
    assert_error(
        &dtq.call(Method::GET, "/nope", None, &[]).await?,
        404,
        "NOT_FOUND",
    );

    // With a worker: the echo is done, a long task shows as running.
    dtq.start_worker();
    dtq.wait_for("default", &echo, &["SUCCEEDED"], WAIT).await?;
    let long = submit_ok(
        &dtq,
        json!({"task": "sleep", "payload": {"ms": 1500}}),
        None,
    )
    .await?;
    dtq.wait_for("default", &long, &["RUNNING"], WAIT).await?;
    let (_, stats) = dtq
        .call(Method::GET, "/v1/queues/default", None, &[])
        .await?;
    assert_eq!(
        (
            stats["ready"].as_u64(),
            stats["running"].as_u64(),
            stats["delayed"].as_u64()
        ),
        (Some(0), Some(1), Some(1)),
        "{stats}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_worker_keeps_a_task_longer_than_the_visibility_timeout() -> Result<()> {
    // Visibility 1 s (the harness default); the task takes 2.5 s. Without
    // heartbeats the worker's own reclaim loop would take the message back
    // and run the task a second time.
    let dtq = Dtq::start(true, &[]).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "sleep", "payload": {"ms": 2500}}),
        None,
    )
    .await?;
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
        (Some("SUCCEEDED"), Some(1)),
        "{task}"
    );
    let runs = events(&dtq, &id)
        .await?
        .into_iter()
        .filter(|(s, _)| s == "RUNNING")
        .count();
    // Its one attempt was carried (no RUNNING event); any other attempt
    // would have been begun by `start`, with one.
    assert_eq!(runs, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_batch_reads_each_completions_own_values_whatever_its_shape() -> Result<()> {
    // A completion sends only what its outcome reads: no attempt for a
    // carried one, a retry time only for a failed one. One batch of every
    // shape, interleaved, must write each task from its own values.
    let dtq = Dtq::start(false, &[]).await?;
    let later = json!(600_000);
    let submissions = [
        (
            "a",
            json!({"task": "echo", "payload": "a"}),
            Some("shape-a"),
        ),
        (
            "b",
            json!({"task": "echo", "payload": "b", "max_attempts": 3}),
            None,
        ),
        (
            "c",
            json!({"task": "echo", "payload": "c", "expires_in_ms": later}),
            None,
        ),
        (
            "d",
            json!({"task": "echo", "payload": "d", "max_attempts": 3, "expires_in_ms": later}),
            Some("shape-d"),
        ),
        ("e", json!({"task": "echo", "payload": "e"}), None),
    ];
    let mut ids = Vec::new();
    for (_, body, key) in &submissions {
        ids.push(submit_ok(&dtq, body.clone(), *key).await?);
    }
    let taken = dtq.read_and_start("tester", 10).await?;
    assert_eq!(taken.len(), ids.len());
    let now = dtq_host::base::now_ms();
    let retry_b = now + 111_000;
    let retry_d = now + 222_000;
    let completions: Vec<Completion> = taken
        .iter()
        .map(|(delivery, task)| {
            let name = submissions[ids.iter().position(|id| *id == task.id).unwrap()].0;
            let mut c = dtq_tests::completion(delivery, task, CompletionKind::Success);
            c.detail = format!("\"{name}\"");
            match name {
                "b" => (c.kind, c.retry_at) = (CompletionKind::Retry, retry_b),
                "c" => c.kind = CompletionKind::Fatal,
                "d" => (c.kind, c.retry_at) = (CompletionKind::Retry, retry_d),
                _ => {}
            }
            c
        })
        .collect();
    // Carried (a, b, e) and begun by `start` (c, d: they have an expiry).
    let carried: Vec<bool> = taken.iter().map(|(_, t)| t.carried_at.is_some()).collect();
    assert_eq!(carried, [true, true, false, false, true]);
    let outcomes = dtq.store.complete(&completions).await?;
    use TaskStatus::*;
    assert_eq!(
        outcomes,
        [Succeeded, Retrying, Failed, Retrying, Succeeded].map(CompleteOutcome::Done)
    );
    // Each task's status, attempt, the field its outcome wrote, and its
    // retry time for the two that retry.
    let want = [
        ("SUCCEEDED", "result", json!("a"), None),
        ("RETRYING", "error", json!("\"b\""), Some(retry_b)),
        ("FAILED", "error", json!("\"c\""), None),
        ("RETRYING", "error", json!("\"d\""), Some(retry_d)),
        ("SUCCEEDED", "result", json!("e"), None),
    ];
    for (id, (status, field, value, run_at)) in ids.iter().zip(want) {
        let shown = dtq.task("default", id).await?;
        assert_eq!(
            (
                shown["status"].as_str(),
                shown["attempts"].as_u64(),
                &shown[field],
                shown["run_at"].as_u64()
            ),
            (Some(status), Some(1), &value, run_at),
            "{shown:#}"
        );
    }
    // a's record completed; d's stays processing while it retries.
    assert_eq!(
        dtq.idem_state("default", "shape-a").await?.as_deref(),
        Some("completed")
    );
    assert_eq!(
        dtq.idem_state("default", "shape-d").await?.as_deref(),
        Some("processing")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completion_batch_spans_queues_and_keeps_its_order() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let store = &dtq.store;
    let mut started = Vec::new();
    for queue in ["qa", "qb"] {
        let (status, _) = dtq
            .submit(queue, json!({"task": "echo", "payload": 1}), None)
            .await?;
        assert_eq!(status, 202);
        let (deliveries, decisions) = read_and_start(&dtq, queue, "tester", 10).await?;
        let [StartDecision::Run(task)] = decisions.as_slice() else {
            panic!("expected one runnable task, got {decisions:?}");
        };
        started.push((deliveries[0].clone(), task.clone()));
    }
    let completion = |i: usize, attempt: u32| {
        let (delivery, task) = &started[i];
        finish(task, delivery, attempt, &format!("{{\"i\":{i}}}"))
    };
    let outcomes = store
        .complete(&[completion(1, 1), completion(0, 7), completion(0, 1)])
        .await?;
    // Attempt 7 is not the carried attempt (always attempt 1) that the
    // task's hash, QUEUED, stands for: stale, with the status found.
    assert_eq!(
        outcomes,
        vec![
            CompleteOutcome::Done(TaskStatus::Succeeded),
            CompleteOutcome::Stale("QUEUED".into()),
            CompleteOutcome::Done(TaskStatus::Succeeded),
        ]
    );
    for (i, (_, task)) in started.iter().enumerate() {
        let record = dtq.task(&task.queue, &task.id).await?;
        assert_eq!(
            (record["status"].as_str(), &record["result"]),
            (Some("SUCCEEDED"), &json!({"i": i}))
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_start_batch_decides_each_message_and_hands_over_each_field() -> Result<()> {
    // Tasks with an expiry are not carried: every message goes through
    // `start`, which is what this tests.
    let dtq = Dtq::start(false, &[]).await?;
    let keys = QueueKeys::new("default");
    let full = submit_ok(
        &dtq,
        json!({"task": "echo", "payload": {"x": [1, "two"]}, "max_attempts": 4,
               "timeout_ms": 1500, "expires_in_ms": LATER_MS}),
        Some("start-key"),
    )
    .await?;
    let echo =
        |payload: Value| json!({"task": "echo", "payload": payload, "expires_in_ms": LATER_MS});
    let gone = submit_ok(&dtq, echo(json!(2)), None).await?;
    let late = submit_ok(
        &dtq,
        json!({"task": "echo", "payload": 3, "max_attempts": 2, "expires_in_ms": 50}),
        None,
    )
    .await?;
    let plain = submit_ok(&dtq, echo(json!("4")), None).await?;
    let done = submit_ok(&dtq, echo(json!(5)), None).await?;
    let mut conn = dtq.redis.conn().await?;
    let () = redis::cmd("DEL")
        .arg(keys.task(&gone))
        .query_async(&mut conn)
        .await?;
    let () = redis::cmd("HSET")
        .arg(keys.task(&done))
        .arg("status")
        .arg("SUCCEEDED")
        .query_async(&mut conn)
        .await?;
    // As a dead worker leaves it: running its first attempt, cancel asked.
    let () = redis::cmd("HSET")
        .arg(keys.task(&plain))
        .arg("status")
        .arg("RUNNING")
        .arg("attempts")
        .arg("1")
        .arg("cancel_requested")
        .arg("1")
        .query_async(&mut conn)
        .await?;
    tokio::time::sleep(Duration::from_millis(150)).await;

    let (deliveries, decisions) = read_and_start(&dtq, "default", "tester", 10).await?;
    let delivered: Vec<&str> = deliveries.iter().map(|d| d.task_id.as_str()).collect();
    assert_eq!(delivered, [&full, &gone, &late, &plain, &done]);
    let [
        StartDecision::Run(full_task),
        StartDecision::Skip(gone_status),
        StartDecision::Expired(late_task),
        StartDecision::Run(plain_task),
        StartDecision::Skip(done_status),
    ] = decisions.as_slice()
    else {
        panic!("expected run, skip, expired, run, skip; got {decisions:?}");
    };
    assert_eq!(
        (gone_status.as_str(), done_status.as_str()),
        ("MISSING", "SUCCEEDED")
    );
    assert_eq!(
        (
            full_task.id.as_str(),
            full_task.task.as_str(),
            full_task.attempts,
            full_task.max_attempts,
            full_task.timeout_ms,
            full_task.idempotency_key.as_deref(),
            full_task.cancel_requested,
        ),
        (
            full.as_str(),
            "echo",
            1,
            4,
            Some(1500),
            Some("start-key"),
            false
        )
    );
    let payload: Value = serde_json::from_str(&full_task.payload)?;
    assert_eq!(payload, json!({"x": [1, "two"]}));
    // Not started: the attempt is not counted and the task is left as it was.
    assert_eq!(
        (
            late_task.id.as_str(),
            late_task.attempts,
            late_task.max_attempts,
            late_task.payload.as_str()
        ),
        (late.as_str(), 0, 2, "3")
    );
    assert_eq!(
        (
            plain_task.id.as_str(),
            plain_task.attempts,
            plain_task.timeout_ms,
            plain_task.idempotency_key.as_deref(),
            plain_task.payload.as_str(),
            plain_task.cancel_requested,
        ),
        (plain.as_str(), 2, None, None, "\"4\"", true)
    );
    for (id, status) in [(&full, "RUNNING"), (&late, "QUEUED"), (&plain, "RUNNING")] {
        assert_eq!(
            dtq.task("default", id).await?["status"].as_str(),
            Some(status),
            "{id}"
        );
    }
    // The skipped messages were acknowledged; the other three are pending.
    assert_eq!(dtq.redis.pending("default").await?, Some(3));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn start_counts_the_attempt_across_every_digit_boundary() -> Result<()> {
    // Every message through `start` (an expiry: not carried), as a
    // promoted or requeued task's is.
    let dtq = Dtq::start(false, &[]).await?;
    let keys = QueueKeys::new("default");
    let mut conn = dtq.redis.conn().await?;
    let mut ids = Vec::new();
    // A queued task's count is taken as found; max_attempts does not bound
    // it here (only a RUNNING one is checked for exhaustion).
    let before = ["0", "1", "8", "9", "10", "19", "99", "109"];
    for attempts in before {
        let id = submit_ok(
            &dtq,
            json!({"task": "echo", "payload": 1, "max_attempts": 100,
                   "expires_in_ms": LATER_MS}),
            None,
        )
        .await?;
        let () = redis::cmd("HSET")
            .arg(keys.task(&id))
            .arg("attempts")
            .arg(attempts)
            .query_async(&mut conn)
            .await?;
        ids.push(id);
    }
    let (_, decisions) = read_and_start(&dtq, "default", "tester", 20).await?;
    let started: Vec<u32> = decisions
        .iter()
        .map(|d| match d {
            StartDecision::Run(task) => task.attempts,
            other => panic!("expected every task to run, got {other:?}"),
        })
        .collect();
    let expected = [1, 2, 9, 10, 11, 20, 100, 110];
    assert_eq!(started, expected);
    for (id, attempt) in ids.iter().zip(expected) {
        let stored: String = redis::cmd("HGET")
            .arg(keys.task(id))
            .arg("attempts")
            .query_async(&mut conn)
            .await?;
        assert_eq!(stored, attempt.to_string(), "{id}");
        assert_eq!(
            events(&dtq, id).await?.last(),
            Some(&("RUNNING".to_owned(), u64::from(attempt))),
            "{id}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn acknowledged_entries_leave_the_stream_and_pending_ones_stay_in_any_order() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    for i in 0..4 {
        submit_ok(&dtq, json!({"task": "echo", "payload": i}), None).await?;
    }
    complete_out_of_order(&dtq).await
}

/// As above, with stream ids whose parts differ in length, as they do once
/// more than ten entries share a millisecond: "10-1" is newer than "9-10"
/// though it is not the greater string.
#[tokio::test(flavor = "multi_thread")]
async fn acknowledged_entries_leave_the_stream_whatever_the_lengths_of_their_ids() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(submit_ok(&dtq, json!({"task": "echo", "payload": i}), None).await?);
    }
    // The same tasks, in a new stream under ids of their own.
    let mut redis = dtq.redis.conn().await?;
    let stream = &QueueKeys::new("default").stream;
    redis::cmd("DEL")
        .arg(stream)
        .query_async::<()>(&mut redis)
        .await?;
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async::<()>(&mut redis)
        .await?;
    for (msg_id, task_id) in ["9-10", "10-1", "10-10", "11-0"].iter().zip(&ids) {
        redis::cmd("XADD")
            .arg(stream)
            .arg(*msg_id)
            .arg("id")
            .arg(task_id)
            .query_async::<()>(&mut redis)
            .await?;
    }
    complete_out_of_order(&dtq).await
}

/// Start the 4 queued tasks and complete them out of order, checking after
/// each completion that the stream holds exactly the pending entries.
async fn complete_out_of_order(dtq: &Dtq) -> Result<()> {
    let (deliveries, decisions) = read_and_start(dtq, "default", "tester", 10).await?;
    assert_eq!(deliveries.len(), 4);
    let tasks: Vec<StartedTask> = decisions
        .iter()
        .map(|d| match d {
            StartDecision::Run(task) => task.clone(),
            other => panic!("expected a runnable task, got {other:?}"),
        })
        .collect();
    let stream = QueueKeys::new("default").stream;
    // A newer entry before older pending ones (deleted), the oldest
    // (trimmed), the newest, then the last one.
    for (done, left) in [
        (1, vec![0, 2, 3]),
        (0, vec![2, 3]),
        (3, vec![2]),
        (2, vec![]),
    ] {
        let outcomes = dtq
            .store
            .complete(&[finish(&tasks[done], &deliveries[done], 1, "null")])
            .await?;
        assert_eq!(outcomes, [CompleteOutcome::Done(TaskStatus::Succeeded)]);
        let entries = stream_entries(dtq, &stream).await?;
        let ids: Vec<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
        let expected: Vec<&str> = left
            .iter()
            .map(|&i: &usize| deliveries[i].msg_id.as_str())
            .collect();
        assert_eq!(ids, expected, "after completing task {done}");
        // A pending entry keeps its body, which a reclaim needs.
        assert!(
            entries.iter().all(|(_, body)| !body.is_empty()),
            "{entries:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn api_and_worker_recover_from_a_redis_restart() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--visibility-timeout-ms", "30000"]).await?;
    let before = submit_ok(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    dtq.wait_for("default", &before, &["SUCCEEDED"], WAIT)
        .await?;

    // An empty Redis on the same port: connections drop; keys, the consumer
    // group and the script cache are gone.
    tokio::task::block_in_place(|| dtq.redis.restart())?;

    // Submissions fail (503) only until the connection is back.
    let start = Instant::now();
    let after = loop {
        let (status, body) = dtq
            .submit(
                "default",
                json!({"task": "counter", "payload": {"name": "restart"}}),
                Some("after"),
            )
            .await?;
        match status {
            202 => break id_of(&body),
            503 if start.elapsed() < WAIT => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => panic!("submission after the restart: {status} {body}"),
        }
    };
    // The worker reconnects, recreates its group, and runs the task.
    let task = dtq
        .wait_for("default", &after, &["SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(
        task["result"],
        json!({"name": "restart", "value": 1}),
        "{task}"
    );
    assert_eq!(
        dtq.idem_state("default", "after").await?.as_deref(),
        Some("completed")
    );

    // The cancel listener resubscribed: a running loop is interrupted at
    // once (heartbeats, the fallback, come only every 10 s here).
    let looping = submit_ok(
        &dtq,
        json!({"task": "adversarial", "payload": {"op": "loop"}}),
        None,
    )
    .await?;
    dtq.wait_for("default", &looping, &["RUNNING"], WAIT)
        .await?;
    let path = format!("/v1/queues/default/tasks/{looping}/cancel");
    let (status, body) = dtq.call(Method::POST, &path, None, &[]).await?;
    assert_eq!(status, 202, "{body}");
    dtq.wait_for("default", &looping, &["CANCELLED"], Duration::from_secs(5))
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_consumes_exactly_the_queues_it_is_given() -> Result<()> {
    let dtq = Dtq::start(true, &["--queues", "emails,reports", "--concurrency", "1"]).await?;
    let mut ids = Vec::new();
    for queue in ["emails", "reports", "other"] {
        let (status, body) = dtq
            .submit(queue, json!({"task": "echo", "payload": queue}), None)
            .await?;
        assert_eq!(status, 202, "{body}");
        ids.push((queue, id_of(&body)));
    }
    for (queue, id) in &ids[..2] {
        let task = dtq.wait_for(queue, id, &["SUCCEEDED"], WAIT).await?;
        assert_eq!(task["result"], json!(queue));
    }
    // Nobody consumes "other": no worker ever joined its stream's group,
    // so its task cannot have been read, however long one waits.
    let (queue, id) = &ids[2];
    assert_eq!(dtq.task(queue, id).await?["status"], "QUEUED");
    let mut conn = dtq.redis.conn().await?;
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(QueueKeys::new(queue).stream)
        .query_async(&mut conn)
        .await?;
    assert!(groups.is_empty(), "a worker joined {queue}: {groups:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_whose_worker_dies_on_its_last_attempt_is_dead_lettered() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let id = submit_ok(
        &dtq,
        json!({"task": "echo", "payload": 1, "max_attempts": 1}),
        Some("lost"),
    )
    .await?;
    // A worker ("ghost") takes the task's only attempt, then dies.
    let (_, started) = read_and_start(&dtq, "default", "ghost", 1).await?;
    assert!(
        matches!(started.as_slice(), [StartDecision::Run(_)]),
        "{started:?}"
    );
    // The log an earlier attempt would have left: dead-lettering keeps it.
    let () = redis::cmd("HSET")
        .arg(format!("dtq:task:{{default}}:{id}"))
        .arg("log")
        .arg("earlier attempt")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;

    // A live worker reclaims it after the visibility timeout (1 s here): no
    // attempts are left, so it is dead-lettered, not run again.
    dtq.start_worker();
    let task = dtq
        .wait_for("default", &id, &["DEAD_LETTERED", "SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("DEAD_LETTERED"), Some(1)),
        "{task}"
    );
    assert!(
        task["error"]
            .as_str()
            .is_some_and(|e| e.contains("worker lost")),
        "{task}"
    );
    assert_eq!(task["log"], "earlier attempt", "{task}");
    assert_eq!(
        dtq.idem_state("default", "lost").await?.as_deref(),
        Some("failed")
    );
    let statuses: Vec<String> = events(&dtq, &id)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    // The ghost's attempt was carried: no `start`, no RUNNING event.
    assert_eq!(statuses, ["QUEUED", "DEAD_LETTERED"]);
    Ok(())
}

/// Send `signal` (STOP or CONT) to the Redis server.
fn signal_redis(dtq: &Dtq, signal: &str) -> Result<()> {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(dtq.redis.pid().to_string())
        .status()?;
    anyhow::ensure!(status.success(), "kill -{signal} failed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completion_redis_cannot_take_does_not_hold_up_shutdown_and_is_not_lost() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--shutdown-grace-ms", "300"]).await?;
    let id = submit_ok(&dtq, json!({"task": "sleep", "payload": {"ms": 600}}), None).await?;
    dtq.wait_for("default", &id, &["RUNNING"], WAIT).await?;
    // Redis stops answering while the task runs: its completion cannot be
    // written.
    signal_redis(&dtq, "STOP")?;
    let stopped = async {
        tokio::time::sleep(Duration::from_millis(900)).await;
        dtq.stop_worker().await
    };
    let outcome = tokio::time::timeout(Duration::from_secs(40), stopped).await;
    signal_redis(&dtq, "CONT")?;
    // Shutdown gives up on the write once the grace period is over (and the
    // calls in flight have timed out) instead of retrying for ever.
    outcome.map_err(|_| anyhow::anyhow!("the worker did not stop"))??;

    // Nothing is lost: the message is still pending, and a new worker
    // reclaims and completes it (unless the write Redis had queued while
    // paused went through once it resumed).
    dtq.start_worker();
    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["result"], json!({"slept_ms": 600}), "{task}");
    Ok(())
}
