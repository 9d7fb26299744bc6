//! Carried tasks (issue 16): a task submitted to run now without an expiry
//! runs its first attempt from its stream message, with no `start` script,
//! and everything that reads or changes a task still sees that attempt:
//! status queries and listings (RUNNING, attempt 1), cancel, the heartbeat,
//! reclaim after a worker dies, and the completion's staleness check.
//!
//! Each test drives the store's calls as a worker makes them (read, start,
//! heartbeat, complete) where the state between them is what is checked,
//! against a real redis-server; the reclaim test runs a real worker too.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dtq_host::store::{
    CancelOutcome, Code, CompleteOutcome, CompletionKind, Delivery, QueueKeys, StartDecision,
    StartedTask, TaskStatus,
};
use dtq_tests::{Dtq, completion};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

/// Submit `body` (with `key`) to the default queue and take it as
/// "tester": its id, delivery and the attempt `start` gave it.
async fn submit_and_take(
    dtq: &Dtq,
    body: Value,
    key: Option<&str>,
) -> Result<(String, Delivery, StartedTask)> {
    let id = dtq.submit_new("default", body, key).await?;
    let [(delivery, task)] = dtq
        .read_and_start("tester", 10)
        .await?
        .try_into()
        .ok()
        .context("not one task read")?;
    Ok((id, delivery, task))
}

async fn hash_field(dtq: &Dtq, id: &str, field: &str) -> Result<Option<String>> {
    Ok(redis::cmd("HGET")
        .arg(QueueKeys::new("default").task(id))
        .arg(field)
        .query_async(&mut dtq.redis.conn().await?)
        .await?)
}

/// The statuses of task `id`'s lifecycle events, in order.
async fn events(dtq: &Dtq, id: &str) -> Result<Vec<String>> {
    let events = dtq.redis.task_events("default", id).await?;
    Ok(events.into_iter().map(|(status, _)| status).collect())
}

async fn stream_len(dtq: &Dtq) -> Result<u64> {
    Ok(redis::cmd("XLEN")
        .arg(QueueKeys::new("default").stream)
        .query_async(&mut dtq.redis.conn().await?)
        .await?)
}

/// The tasks of the default queue a listing shows with `status`.
async fn listed(dtq: &Dtq, status: &str) -> Result<Vec<Value>> {
    let (code, body) = dtq
        .call(
            reqwest::Method::GET,
            &format!("/v1/queues/default/tasks?status={status}"),
            None,
            &[],
        )
        .await?;
    ensure!(code == 200, "{body}");
    Ok(body["tasks"].as_array().cloned().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_carried_attempt_runs_without_start_and_reads_as_running() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (id, delivery, task) = submit_and_take(
        &dtq,
        json!({"task": "echo", "payload": {"x": 1}, "max_attempts": 4, "timeout_ms": 1500}),
        Some("carried-key"),
    )
    .await?;
    // Everything an attempt needs came with the message.
    assert_eq!(
        (
            task.id.as_str(),
            task.task.as_str(),
            task.payload.as_str(),
            task.attempts,
            task.max_attempts,
            task.timeout_ms,
            task.idempotency_key.as_deref(),
        ),
        (
            id.as_str(),
            "echo",
            r#"{"x":1}"#,
            1,
            4,
            Some(1500),
            Some("carried-key")
        )
    );
    assert!(task.carried_at.is_some());
    // No script wrote it: the hash still says QUEUED, no RUNNING event...
    assert_eq!(
        hash_field(&dtq, &id, "status").await?.as_deref(),
        Some("QUEUED")
    );
    assert_eq!(events(&dtq, &id).await?, ["QUEUED"]);
    // ...but readers see the attempt from the message pending in the group.
    let shown = dtq.task("default", &id).await?;
    assert_eq!(
        (shown["status"].as_str(), shown["attempts"].as_u64()),
        (Some("RUNNING"), Some(1)),
        "{shown:#}"
    );
    let running = listed(&dtq, "RUNNING").await?;
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(
        (
            running[0]["task_id"].as_str(),
            running[0]["attempts"].as_u64()
        ),
        (Some(id.as_str()), Some(1))
    );
    assert!(listed(&dtq, "QUEUED").await?.is_empty());

    // Its completion writes the attempt with the outcome.
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Done(TaskStatus::Succeeded)]);
    let done = dtq.task("default", &id).await?;
    assert_eq!(
        (done["status"].as_str(), done["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(1)),
        "{done:#}"
    );
    assert_eq!(done["started_at"].as_u64(), task.carried_at, "{done:#}");
    assert_eq!(done["result"], json!("done"));
    assert_eq!(events(&dtq, &id).await?, ["QUEUED", "SUCCEEDED"]);
    assert_eq!(
        dtq.idem_state("default", "carried-key").await?.as_deref(),
        Some("completed")
    );
    assert_eq!(stream_len(&dtq).await?, 0);

    // The same completion again, or one for another message, is stale.
    let again = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(again, [CompleteOutcome::Stale("SUCCEEDED".into())]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_batch_of_keyed_and_keyless_successes_settles_each_tasks_own_record() -> Result<()> {
    // Only keyed completions name a record in the script's keys, so the
    // script pairs records with completions by counting: every keyed task
    // must end with its own record completed. A success that logged
    // nothing writes no log; one that logged keeps it.
    let dtq = Dtq::start(false, &[]).await?;
    let keys = [
        Some("mixed-0"),
        None,
        Some("mixed-2"),
        None,
        Some("mixed-4"),
    ];
    let mut ids = Vec::new();
    for (n, key) in keys.iter().enumerate() {
        ids.push(
            dtq.submit_new("default", json!({"task": "echo", "payload": n}), *key)
                .await?,
        );
    }
    let taken = dtq.read_and_start("tester", 10).await?;
    ensure!(taken.len() == keys.len(), "read {} tasks", taken.len());
    let completions: Vec<_> = taken
        .iter()
        .map(|(delivery, task)| {
            let mut c = completion(delivery, task, CompletionKind::Success);
            if task.idempotency_key.as_deref() == Some("mixed-2") {
                c.log = "said hello\n".into();
            }
            c
        })
        .collect();
    let outcomes = dtq.store.complete(&completions).await?;
    assert_eq!(
        outcomes,
        vec![CompleteOutcome::Done(TaskStatus::Succeeded); keys.len()]
    );
    for key in keys.iter().flatten() {
        assert_eq!(
            dtq.idem_state("default", key).await?.as_deref(),
            Some("completed"),
            "record {key}"
        );
    }
    for (id, key) in ids.iter().zip(keys) {
        let shown = dtq.task("default", id).await?;
        assert_eq!(shown["status"], "SUCCEEDED", "{shown:#}");
        if key == Some("mixed-2") {
            assert_eq!(shown["log"], "said hello\n", "{shown:#}");
        } else {
            assert_eq!(hash_field(&dtq, id, "log").await?, None, "task {id}");
            assert_eq!(shown["log"], Value::Null, "{shown:#}");
        }
    }
    Ok(())
}

/// A restarted or failed-over Redis has no scripts: the completion's
/// EVALSHA finds none, and the store loads them and sends it again.
#[tokio::test(flavor = "multi_thread")]
async fn a_completion_after_redis_lost_its_scripts_loads_them_and_lands() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (id, delivery, task) =
        submit_and_take(&dtq, json!({"task": "echo", "payload": 1}), Some("flushed")).await?;
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut dtq.redis.conn().await?)
        .await?;
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Done(TaskStatus::Succeeded)]);
    assert_eq!(
        hash_field(&dtq, &id, "result").await?.as_deref(),
        Some("\"done\"")
    );
    assert_eq!(
        dtq.idem_state("default", "flushed").await?.as_deref(),
        Some("completed")
    );
    assert_eq!(stream_len(&dtq).await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_carried_completion_for_another_message_is_stale() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (id, delivery, task) =
        submit_and_take(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    let forged = Delivery {
        msg_id: "1-1".into(),
        ..delivery.clone()
    };
    let outcome = dtq
        .store
        .complete(&[completion(&forged, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Stale("QUEUED".into())]);
    assert_eq!(hash_field(&dtq, &id, "result").await?, None);
    // And one of a later attempt, which `start` would have counted.
    let later = StartedTask {
        attempts: 2,
        carried_at: None,
        ..task.clone()
    };
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &later, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Stale("QUEUED".into())]);
    assert_eq!(events(&dtq, &id).await?, ["QUEUED"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_stops_a_delivered_carried_attempt_and_drops_an_undelivered_one() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (running, delivery, task) =
        submit_and_take(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    let waiting = dtq
        .submit_new("default", json!({"task": "echo", "payload": 2}), None)
        .await?;
    assert_eq!(stream_len(&dtq).await?, 2);

    // Delivered: asked to stop, as a RUNNING task is; its worker's beat says so.
    let now = dtq_host::base::now_ms();
    assert_eq!(
        dtq.store.cancel("default", &running, now).await?,
        CancelOutcome::Requested
    );
    let beat = dtq
        .store
        .heartbeat(
            "default",
            "tester",
            Duration::from_secs(30),
            &[(delivery.clone(), 1)],
        )
        .await?;
    assert_eq!(beat, [Code::CancelRequested]);
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Cancelled)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Done(TaskStatus::Cancelled)]);

    // Not delivered: CANCELLED at once, and its message leaves the stream,
    // so no worker reads it and the depth drops.
    assert_eq!(
        dtq.store.cancel("default", &waiting, now).await?,
        CancelOutcome::Cancelled
    );
    assert_eq!(stream_len(&dtq).await?, 0);
    assert!(dtq.read_and_start("tester", 10).await?.is_empty());
    assert_eq!(dtq.task("default", &waiting).await?["status"], "CANCELLED");
    assert_eq!(events(&dtq, &waiting).await?, ["QUEUED", "CANCELLED"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_beat_writes_a_carried_attempt_as_start_would() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (id, delivery, task) =
        submit_and_take(&dtq, json!({"task": "echo", "payload": 1}), None).await?;
    let delivered = dtq_host::base::now_ms();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let beat = dtq
        .store
        .heartbeat(
            "default",
            "tester",
            Duration::from_secs(30),
            &[(delivery.clone(), 1)],
        )
        .await?;
    assert_eq!(beat, [Code::Ok]);
    assert_eq!(
        hash_field(&dtq, &id, "status").await?.as_deref(),
        Some("RUNNING")
    );
    assert_eq!(
        hash_field(&dtq, &id, "attempts").await?.as_deref(),
        Some("1")
    );
    assert_eq!(
        hash_field(&dtq, &id, "worker").await?.as_deref(),
        Some("tester")
    );
    // Started when the message was delivered, not at the beat.
    let started: u64 = hash_field(&dtq, &id, "started_at")
        .await?
        .context("no started_at")?
        .parse()?;
    assert!(
        started + 150 < dtq_host::base::now_ms() && started + 100 >= delivered,
        "started_at {started}, delivered about {delivered}"
    );
    // The carried completion is still this attempt's.
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Done(TaskStatus::Succeeded)]);
    let done = dtq.task("default", &id).await?;
    assert_eq!(
        (done["attempts"].as_u64(), done["started_at"].as_u64()),
        (Some(1), Some(started)),
        "{done:#}"
    );
    // A beat of another worker for it is stale, before or after.
    let other = dtq
        .store
        .heartbeat(
            "default",
            "other",
            Duration::from_secs(30),
            &[(delivery, 1)],
        )
        .await?;
    assert_eq!(other, [Code::Stale]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_carried_attempt_whose_worker_died_is_counted_lost_and_run_again() -> Result<()> {
    // The message as this version writes it, and as the one before wrote
    // it (`id`, then `run` without the id): reclaim.lua reads both.
    for previous_form in [false, true] {
        died_and_reclaimed(previous_form)
            .await
            .with_context(|| format!("previous form: {previous_form}"))?;
    }
    Ok(())
}

async fn died_and_reclaimed(previous_form: bool) -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 5, "max_attempts": 2}),
            None,
        )
        .await?;
    if previous_form {
        rewrite_message(&dtq, &id, &[("run", "2\n\n\necho\n5")]).await?;
    }
    // A worker ("ghost") takes the message and dies before its first beat.
    let taken = dtq_host::base::now_ms();
    let ghost = dtq.read_and_start("ghost", 10).await?;
    assert_eq!(ghost.len(), 1);
    // A live worker reclaims it after the visibility timeout (1 s here).
    dtq.start_worker();
    let task = dtq
        .wait_for("default", &id, &["SUCCEEDED", "DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(2)),
        "{task:#}"
    );
    let lost = &task["attempt_history"][0];
    assert_eq!(
        (lost["attempt"].as_u64(), lost["outcome"].as_str()),
        (Some(1), Some("lost")),
        "{task:#}"
    );
    let began = lost["started_at"]
        .as_u64()
        .context("the lost attempt has no start")?;
    assert!(
        began + 100 >= taken && began < taken + 1_000,
        "{lost:#}, taken at {taken}"
    );
    assert!(
        lost["duration_ms"].as_u64().is_some_and(|d| d >= 900),
        "{lost:#}"
    );
    // The second attempt went through `start`, with its RUNNING event.
    assert_eq!(events(&dtq, &id).await?, ["QUEUED", "RUNNING", "SUCCEEDED"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn only_a_task_that_runs_now_without_an_expiry_is_carried() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let plain = dtq
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;
    let timed = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 2, "expires_in_ms": 60_000}),
            None,
        )
        .await?;
    let keyed = dtq
        .submit_new("default", json!({"task": "echo", "payload": 3}), Some("k"))
        .await?;
    dtq.store.ensure_group("default").await?;
    let mut conn = dtq
        .store
        .dedicated_connection(Duration::from_secs(5))
        .await?;
    let mut deliveries = dtq
        .store
        .read(
            &mut conn,
            "default",
            "tester",
            10,
            Duration::from_millis(10),
        )
        .await?;
    let carried: Vec<(&str, bool)> = deliveries
        .iter()
        .map(|d| (d.task_id.as_str(), d.carried.is_some()))
        .collect();
    assert_eq!(
        carried,
        [
            (plain.as_str(), true),
            (timed.as_str(), false),
            (keyed.as_str(), true)
        ]
    );
    // What the message carries is what was submitted.
    let run = deliveries[2].carried.as_deref().context("carried")?;
    assert_eq!(
        (
            run.task.as_str(),
            run.payload.as_str(),
            run.idempotency_key.as_deref(),
            run.attempts,
        ),
        ("echo", "3", Some("k"), 1)
    );
    // The one with an expiry goes through `start`, which writes RUNNING.
    dtq.store
        .start(
            "default",
            "tester",
            &mut deliveries,
            dtq_host::base::now_ms(),
        )
        .await?;
    assert_eq!(
        hash_field(&dtq, &timed, "status").await?.as_deref(),
        Some("RUNNING")
    );
    assert_eq!(
        hash_field(&dtq, &plain, "status").await?.as_deref(),
        Some("QUEUED")
    );
    assert_eq!(events(&dtq, &timed).await?, ["QUEUED", "RUNNING"]);
    assert_eq!(events(&dtq, &plain).await?, ["QUEUED"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_carried_success_after_its_message_was_taken_over_is_stale() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (_, delivery, task) = submit_and_take(
        &dtq,
        json!({"task": "echo", "payload": 1, "max_attempts": 3}),
        None,
    )
    .await?;
    // Twice in one batch: the first is written, the second is stale.
    let twice = dtq
        .store
        .complete(&[
            completion(&delivery, &task, CompletionKind::Success),
            completion(&delivery, &task, CompletionKind::Success),
        ])
        .await?;
    assert_eq!(
        twice,
        [
            CompleteOutcome::Done(TaskStatus::Succeeded),
            CompleteOutcome::Stale("SUCCEEDED".into())
        ]
    );

    // Another one, whose worker stops beating: another worker reclaims its
    // message and starts attempt 2; the first worker's success is refused.
    let (id, delivery, task) = submit_and_take(
        &dtq,
        json!({"task": "echo", "payload": 2, "max_attempts": 3}),
        None,
    )
    .await?;
    let visibility = Duration::from_millis(100);
    // The thief's reclaims tick the queue's liveness clock (as its worker's
    // loops do, well within half a visibility timeout); nobody counts as
    // dead until the clock has run a visibility timeout.
    let deadline = std::time::Instant::now() + WAIT;
    let mut reclaimed = loop {
        let reclaimed = dtq
            .store
            .reclaim("default", "thief", visibility, 10)
            .await?;
        if !reclaimed.dead.is_empty() {
            break reclaimed;
        }
        ensure!(std::time::Instant::now() < deadline, "never reclaimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(reclaimed.dead.len(), 1, "{reclaimed:?}");
    let decisions = dtq
        .store
        .start(
            "default",
            "thief",
            &mut reclaimed.dead,
            dtq_host::base::now_ms(),
        )
        .await?;
    assert!(
        matches!(decisions.as_slice(), [StartDecision::Run(t)] if t.attempts == 2),
        "{decisions:?}"
    );
    let outcome = dtq
        .store
        .complete(&[completion(&delivery, &task, CompletionKind::Success)])
        .await?;
    assert_eq!(outcome, [CompleteOutcome::Stale("RUNNING".into())]);
    let shown = dtq.task("default", &id).await?;
    assert_eq!(
        (shown["status"].as_str(), shown["attempts"].as_u64()),
        (Some("RUNNING"), Some(2)),
        "{shown:#}"
    );
    assert_eq!(shown["attempt_history"][0]["outcome"], "lost", "{shown:#}");
    Ok(())
}

/// Replace the message of waiting task `id` with one of `fields`, as
/// another version of dtq would have written it: the hash names the new
/// message, the old one is gone.
async fn rewrite_message(dtq: &Dtq, id: &str, fields: &[(&str, &str)]) -> Result<()> {
    let keys = QueueKeys::new("default");
    let mut conn = dtq.redis.conn().await?;
    let old: String = redis::cmd("HGET")
        .arg(keys.task(id))
        .arg("msg_id")
        .query_async(&mut conn)
        .await?;
    let mut xadd = redis::cmd("XADD");
    xadd.arg(&keys.stream).arg("*").arg("id").arg(id);
    for (name, value) in fields {
        xadd.arg(*name).arg(*value);
    }
    let new: String = xadd.query_async(&mut conn).await?;
    let () = redis::pipe()
        .hset(keys.task(id), "msg_id", &new)
        .ignore()
        .xdel(&keys.stream, &[&old])
        .ignore()
        .query_async(&mut conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_of_another_version_run_from_their_fields_or_through_start() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // One written before the `run` field (a field per value), one with
    // `id` and then a `run` that does not lead with the id, and one whose
    // `run` this version cannot read: a fleet part-way through an upgrade.
    let old = dtq
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;
    let previous = dtq
        .submit_new("default", json!({"task": "echo", "payload": 3}), None)
        .await?;
    let unreadable = dtq
        .submit_new("default", json!({"task": "echo", "payload": 2}), None)
        .await?;
    rewrite_message(
        &dtq,
        &old,
        &[("max_attempts", "4"), ("task", "echo"), ("payload", "1")],
    )
    .await?;
    rewrite_message(&dtq, &previous, &[("run", "5\n\n\necho\n3")]).await?;
    rewrite_message(&dtq, &unreadable, &[("run", "v9:opaque")]).await?;

    let taken = dtq.read_and_start("tester", 10).await?;
    let [
        (old_delivery, old_task),
        (previous_delivery, previous_task),
        (other_delivery, other_task),
    ] = taken.as_slice()
    else {
        panic!("expected three tasks, got {taken:?}");
    };
    // The older messages carry their attempt, which no script wrote...
    for (task, id, payload, max_attempts) in
        [(old_task, &old, "1", 4), (previous_task, &previous, "3", 5)]
    {
        assert_eq!(&task.id, id);
        assert!(task.carried_at.is_some());
        assert_eq!(
            (task.payload.as_str(), task.max_attempts, task.attempts),
            (payload, max_attempts, 1)
        );
        assert_eq!(
            hash_field(&dtq, id, "status").await?.as_deref(),
            Some("QUEUED")
        );
    }
    // ...and the unreadable one went through `start`, from the hash.
    assert_eq!(other_task.id, unreadable);
    assert!(other_task.carried_at.is_none());
    assert_eq!((other_task.payload.as_str(), other_task.attempts), ("2", 1));
    assert_eq!(
        hash_field(&dtq, &unreadable, "status").await?.as_deref(),
        Some("RUNNING")
    );

    let outcomes = dtq
        .store
        .complete(&[
            completion(old_delivery, old_task, CompletionKind::Success),
            completion(previous_delivery, previous_task, CompletionKind::Success),
            completion(other_delivery, other_task, CompletionKind::Success),
        ])
        .await?;
    assert_eq!(
        outcomes,
        vec![CompleteOutcome::Done(TaskStatus::Succeeded); 3]
    );
    assert_eq!(stream_len(&dtq).await?, 0);
    Ok(())
}
