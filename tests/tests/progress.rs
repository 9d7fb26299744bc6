//! Progress reported by handlers (issue 35): a running handler's reports
//! show in its task's JSON while it runs and after, as `PROGRESS` events
//! with `--events all` only; reports are coalesced (a loop of 100,000 costs
//! a few writes), bad values are made safe rather than failures, and a
//! report is written only while the task runs the attempt that made it.
//!
//! The tests run a real worker with the `progress` test guest
//! (`tests/guests/progress`), or drive the store's calls as a worker makes
//! them where the state between them is what is checked, against a real
//! redis-server.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dtq_host::sandbox::MAX_PROGRESS_MESSAGE_BYTES;
use dtq_host::store::{
    CompletionKind, ProgressReport, QueueEvent, QueueKeys, ReportingAttempt, write_progress,
};
use dtq_tests::{Dtq, completion};
use serde_json::{Value, json};

/// Longest a task may take to reach what a test waits for before it is a
/// failure.
const WAIT: Duration = Duration::from_secs(30);

const TERMINAL: [&str; 3] = ["SUCCEEDED", "FAILED", "DEAD_LETTERED"];

/// Submit a `progress` task with `payload`; its id.
async fn submit(dtq: &Dtq, payload: Value) -> Result<String> {
    dtq.submit_new(
        "default",
        json!({"task": "progress", "payload": payload}),
        None,
    )
    .await
}

/// Poll task `id` until its progress is `(fraction, message)`; the task
/// as read then.
async fn wait_for_progress(dtq: &Dtq, id: &str, fraction: f64, message: &str) -> Result<Value> {
    let start = std::time::Instant::now();
    loop {
        let task = dtq.task("default", id).await?;
        let progress = &task["progress"];
        if progress["fraction"].as_f64() == Some(fraction) && progress["message"] == message {
            return Ok(task);
        }
        ensure!(
            start.elapsed() < WAIT,
            "task {id} did not show progress ({fraction}, {message:?}): {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Let the `progress` guest running task `id` return.
async fn open_gate(dtq: &Dtq, id: &str) -> Result<()> {
    let () = redis::cmd("SET")
        .arg(format!("dtq:guest:{{progress}}:gate:{id}"))
        .arg("1")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(())
}

/// Task `id`'s events, oldest first.
async fn events_of(dtq: &Dtq, id: &str) -> Result<Vec<QueueEvent>> {
    let mut events = dtq.redis.queue_events("default").await?;
    events.retain(|e| e.task_id == id);
    Ok(events)
}

/// The (fraction, message) of task `id`'s `PROGRESS` events, oldest first.
async fn progress_events(dtq: &Dtq, id: &str) -> Result<Vec<(f64, String)>> {
    let events = events_of(dtq, id).await?;
    events
        .into_iter()
        .filter(|e| e.status == "PROGRESS")
        .map(|e| e.progress.context("a PROGRESS event without its report"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn progress_shows_while_the_handler_runs_and_stays_after() -> Result<()> {
    let dtq = Dtq::start(true, &["--events", "all"]).await?;
    let id = submit(
        &dtq,
        json!({"reports": [[0.25, "a quarter"], [0.5, "half way"]], "gate": true}),
    )
    .await?;

    // While the handler waits at its gate, the task runs and shows its
    // last report.
    let running = wait_for_progress(&dtq, &id, 0.5, "half way").await?;
    assert_eq!(running["status"], "RUNNING", "{running:#}");
    let reported_at = running["progress"]["updated_at"]
        .as_u64()
        .context("updated_at")?;
    assert!(
        reported_at >= running["created_at"].as_u64().context("created_at")?,
        "{running:#}"
    );

    open_gate(&dtq, &id).await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(
        done["progress"],
        json!({"fraction": 0.5, "message": "half way", "updated_at": reported_at}),
        "the last report stays after the task ended"
    );

    // The events stream has the reports, the last one last, each before
    // the task's end.
    let events = events_of(&dtq, &id).await?;
    let statuses: Vec<&str> = events.iter().map(|e| e.status.as_str()).collect();
    let last_progress = statuses.iter().rposition(|s| *s == "PROGRESS");
    let succeeded = statuses.iter().position(|s| *s == "SUCCEEDED");
    assert!(
        last_progress.is_some() && last_progress < succeeded,
        "{statuses:?}"
    );
    let reports = progress_events(&dtq, &id).await?;
    assert_eq!(
        reports.last(),
        Some(&(0.5, "half way".to_owned())),
        "{reports:?}"
    );
    let event = events
        .iter()
        .rev()
        .find(|e| e.status == "PROGRESS")
        .context("a PROGRESS event")?;
    assert_eq!(event.attempt, Some(1));
    assert_eq!(
        event.to_json()["progress"],
        json!({"fraction": 0.5, "message": "half way", "updated_at": event.at})
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_events_all_progress_reaches_the_task_but_writes_no_event() -> Result<()> {
    // The default `--events terminal`: the first attempt runs carried (no
    // `start`), and its progress shows all the same.
    let dtq = Dtq::start(true, &[]).await?;
    let id = submit(&dtq, json!({"reports": [[0.75, "most"]], "gate": true})).await?;
    let running = wait_for_progress(&dtq, &id, 0.75, "most").await?;
    assert_eq!(
        (running["status"].as_str(), running["attempts"].as_u64()),
        (Some("RUNNING"), Some(1)),
        "{running:#}"
    );
    open_gate(&dtq, &id).await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["progress"]["message"], "most", "{done:#}");
    let events = events_of(&dtq, &id).await?;
    assert!(
        events.iter().all(|e| e.status != "PROGRESS") && !events.is_empty(),
        "{events:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_thousand_reports_in_a_loop_cost_a_few_writes() -> Result<()> {
    let dtq = Dtq::start(true, &["--events", "all"]).await?;
    // More reports than the handler's host-call limit (10,000): reports
    // are not host calls.
    let id = submit(&dtq, json!({"loop": 100_000})).await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"], json!({"reported": 100_000}));
    // The last report, made just before the handler returned, was written
    // before the completion.
    assert_eq!(done["progress"]["fraction"].as_f64(), Some(1.0), "{done:#}");
    assert_eq!(done["progress"]["message"], "done", "{done:#}");

    // One write per event: the latest report when the writer starts, then
    // at most one per write interval of the call, and the last.
    let writes = progress_events(&dtq, &id).await?;
    let ran_ms = done["finished_at"].as_u64().context("finished_at")?
        - done["started_at"].as_u64().context("started_at")?;
    let interval_ms = dtq_host::sandbox::PROGRESS_WRITE_EVERY.as_millis() as u64;
    let bound = 2 + ran_ms / interval_ms;
    assert!(
        !writes.is_empty() && writes.len() as u64 <= bound,
        "{} writes in {ran_ms} ms, more than {bound}",
        writes.len()
    );
    assert_eq!(writes.last(), Some(&(1.0, "done".to_owned())));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_fractions_and_long_messages_are_made_safe_not_failures() -> Result<()> {
    let dtq = Dtq::start(true, &["--events", "all"]).await?;
    // The last report of each is written when the call ends.
    let nan = submit(
        &dtq,
        json!({"reports": [[0.5, "x"], ["nan", "not a number"]]}),
    )
    .await?;
    let over = submit(&dtq, json!({"reports": [[5.0, "é", 4000]]})).await?;
    let under = submit(&dtq, json!({"reports": [["-inf", "below"]]})).await?;
    for id in [&nan, &over, &under] {
        let done = dtq.wait_for("default", id, &TERMINAL, WAIT).await?;
        assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    }
    let nan = dtq.task("default", &nan).await?;
    assert_eq!(nan["progress"]["fraction"].as_f64(), Some(0.0), "{nan:#}");
    assert_eq!(nan["progress"]["message"], "not a number", "{nan:#}");
    let over = dtq.task("default", &over).await?;
    assert_eq!(over["progress"]["fraction"].as_f64(), Some(1.0));
    let message = over["progress"]["message"].as_str().context("a message")?;
    assert_eq!(message, "é".repeat(MAX_PROGRESS_MESSAGE_BYTES / 2));
    let under = dtq.task("default", &under).await?;
    assert_eq!(under["progress"]["fraction"].as_f64(), Some(0.0));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_report_is_written_only_while_its_attempt_runs() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut conn = dtq.redis.conn().await?;
    let report = |message: &str| ProgressReport {
        fraction: 0.5,
        message: message.to_owned(),
        at: dtq_host::base::now_ms(),
    };
    let body = json!({"task": "echo", "payload": {"x": 1}, "max_attempts": 3});

    // No such task: nothing written, no hash made.
    let ghost = ReportingAttempt {
        queue: "default".into(),
        task_id: "no-such-task".into(),
        attempt: 1,
    };
    assert!(!write_progress(&mut conn, &ghost, &report("ghost"), 0).await?);
    let exists: u64 = redis::cmd("EXISTS")
        .arg(QueueKeys::new("default").task("no-such-task"))
        .query_async(&mut conn)
        .await?;
    assert_eq!(exists, 0);

    // Waiting: no attempt runs.
    let id = dtq.submit_new("default", body, None).await?;
    let attempt = |n| ReportingAttempt {
        queue: "default".into(),
        task_id: id.clone(),
        attempt: n,
    };
    assert!(!write_progress(&mut conn, &attempt(1), &report("early"), 0).await?);

    // A carried first attempt (its hash still QUEUED, its message pending
    // on its worker): attempt 1 is written, no other.
    let [(delivery, task)] = dtq
        .read_and_start("tester", 10)
        .await?
        .try_into()
        .ok()
        .context("not one task read")?;
    assert!(task.carried_at.is_some(), "the first attempt is carried");
    assert!(!write_progress(&mut conn, &attempt(2), &report("other attempt"), 0).await?);
    assert!(write_progress(&mut conn, &attempt(1), &report("carried"), 0).await?);
    let running = dtq.task("default", &id).await?;
    assert_eq!(running["status"], "RUNNING");
    assert_eq!(running["progress"]["message"], "carried", "{running:#}");

    // A retry: attempt 1's report stays with the task, but the next
    // attempt shows none of its own until its handler reports.
    let retry = completion(&delivery, &task, CompletionKind::Retry);
    dtq.store.complete(std::slice::from_ref(&retry)).await?;
    assert!(!write_progress(&mut conn, &attempt(1), &report("late"), 0).await?);
    let retrying = dtq.task("default", &id).await?;
    assert_eq!(retrying["status"], "RETRYING");
    assert_eq!(retrying["progress"]["message"], "carried", "{retrying:#}");
    dtq.store
        .promote_due("default", dtq_host::base::now_ms() + 1_000, 10)
        .await?;
    let [(delivery, task)] = dtq
        .read_and_start("tester", 10)
        .await?
        .try_into()
        .ok()
        .context("not the retry read")?;
    assert_eq!(task.attempts, 2);
    let second = dtq.task("default", &id).await?;
    assert_eq!(second["progress"], Value::Null, "{second:#}");
    assert!(!write_progress(&mut conn, &attempt(1), &report("stale"), 0).await?);
    assert!(write_progress(&mut conn, &attempt(2), &report("second"), 0).await?);
    assert_eq!(
        dtq.task("default", &id).await?["progress"]["message"],
        "second"
    );

    // Completed: nothing lands after the end.
    let success = completion(&delivery, &task, CompletionKind::Success);
    dtq.store.complete(std::slice::from_ref(&success)).await?;
    assert!(!write_progress(&mut conn, &attempt(2), &report("after the end"), 0).await?);
    let done = dtq.task("default", &id).await?;
    assert_eq!(done["status"], "SUCCEEDED");
    assert_eq!(done["progress"]["message"], "second", "{done:#}");
    Ok(())
}
