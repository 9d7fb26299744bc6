//! A delivery that never reached a handler is not an attempt (issue 32):
//! `start` is idempotent per delivery (a message started again by the same
//! consumer resumes its attempt), a second message for a running task is a
//! duplicate, acknowledged and never run beside it, and a task record that
//! cannot be read fails alone, its batch started as if it were not there.
//!
//! Each test drives the store as a worker does (read, then `start`) against
//! a real redis-server, with no worker running: what a lost reply leaves
//! behind is written with the store's own calls, replayed.

use std::time::Duration;

use anyhow::{Result, bail, ensure};
use dtq_host::store::{
    CompleteOutcome, CompletionKind, Delivery, GROUP, QueueKeys, StartDecision, TaskStatus,
};
use dtq_tests::{Dtq, completion};
use serde_json::json;

const QUEUE: &str = "default";

/// Submit an `echo` task that `start` must start (an expiry keeps its
/// message from carrying it: see `store/carried.rs`), with `max_attempts`.
async fn submit(dtq: &Dtq, payload: u64, max_attempts: u32) -> Result<String> {
    dtq.submit_new(
        QUEUE,
        json!({"task": "echo", "payload": payload, "max_attempts": max_attempts,
               "expires_in_ms": 600_000}),
        None,
    )
    .await
}

/// Read up to `count` new messages as `consumer`, as the fetch loop does.
async fn read(dtq: &Dtq, consumer: &str, count: usize) -> Result<Vec<Delivery>> {
    dtq.store.ensure_group(QUEUE).await?;
    let mut conn = dtq
        .store
        .dedicated_connection(Duration::from_secs(5))
        .await?;
    Ok(dtq
        .store
        .read(&mut conn, QUEUE, consumer, count, Duration::from_millis(10))
        .await?)
}

async fn start(dtq: &Dtq, consumer: &str, deliveries: &[Delivery]) -> Result<Vec<StartDecision>> {
    let mut deliveries = deliveries.to_vec();
    Ok(dtq
        .store
        .start(QUEUE, consumer, &mut deliveries, dtq_host::base::now_ms())
        .await?)
}

/// Fields of task `id`'s hash.
async fn fields(dtq: &Dtq, id: &str, names: &[&str]) -> Result<Vec<Option<String>>> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("HMGET")
        .arg(QueueKeys::new(QUEUE).task(id))
        .arg(names)
        .query_async(&mut conn)
        .await?)
}

/// The ids of the messages pending in the group, with their consumers.
async fn pending(dtq: &Dtq) -> Result<Vec<(String, String)>> {
    let mut conn = dtq.redis.conn().await?;
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(QueueKeys::new(QUEUE).stream)
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(100)
        .query_async(&mut conn)
        .await?;
    Ok(rows.into_iter().map(|(id, c, _, _)| (id, c)).collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_start_whose_reply_was_lost_resumes_the_same_attempt() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let id = submit(&dtq, 1, 1).await?;
    let deliveries = read(&dtq, "w1", 10).await?;
    ensure!(deliveries.len() == 1, "{deliveries:?}");

    // The first start counted attempt 1; its reply was lost. The worker
    // reads the message back and starts it again: the same attempt, with
    // no attempt left to spend (max_attempts 1), not a second one.
    let decisions = start(&dtq, "w1", &deliveries).await?;
    let [StartDecision::Run(first)] = decisions.as_slice() else {
        bail!("the first start did not run the task");
    };
    let again = start(&dtq, "w1", &deliveries).await?;
    let [StartDecision::Run(resumed)] = again.as_slice() else {
        bail!("started again by its consumer, the task did not resume: {again:?}");
    };
    assert_eq!((first.attempts, resumed.attempts), (1, 1));
    assert_eq!(resumed.task, "echo");
    assert_eq!(
        fields(&dtq, &id, &["status", "attempts", "worker"]).await?,
        [Some("RUNNING".into()), Some("1".into()), Some("w1".into())]
    );
    // One RUNNING event: the resumed start wrote nothing.
    let running: Vec<_> = dtq
        .redis
        .task_events(QUEUE, &id)
        .await?
        .into_iter()
        .filter(|(status, _)| status == "RUNNING")
        .collect();
    assert_eq!(running, [("RUNNING".to_owned(), Some(1))]);

    // The resumed attempt completes as attempt 1.
    let done = dtq
        .store
        .complete(&[completion(&deliveries[0], resumed, CompletionKind::Success)])
        .await?;
    assert_eq!(done, [CompleteOutcome::Done(TaskStatus::Succeeded)]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_reclaimed_from_another_consumer_is_still_a_new_attempt() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let id = submit(&dtq, 1, 3).await?;
    let deliveries = read(&dtq, "dead", 10).await?;
    let [StartDecision::Run(_)] = start(&dtq, "dead", &deliveries).await?.as_slice() else {
        bail!("not started");
    };
    // The same message, under another consumer (what reclaim hands over
    // from a dead worker): attempt 2; and that start's reply lost too, the
    // new consumer's second start resumes attempt 2.
    for _ in 0..2 {
        let decisions = start(&dtq, "heir", &deliveries).await?;
        let [StartDecision::Run(task)] = decisions.as_slice() else {
            bail!("not started by the heir");
        };
        assert_eq!(task.attempts, 2);
    }
    assert_eq!(
        fields(&dtq, &id, &["attempts", "worker"]).await?,
        [Some("2".into()), Some("heir".into())]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_message_for_a_running_task_is_acknowledged_and_not_run() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let id = submit(&dtq, 1, 3).await?;
    let first = read(&dtq, "w1", 10).await?;
    let [StartDecision::Run(_)] = start(&dtq, "w1", &first).await?.as_slice() else {
        bail!("not started");
    };
    // A second message naming the running task.
    let mut conn = dtq.redis.conn().await?;
    let dup: String = redis::cmd("XADD")
        .arg(QueueKeys::new(QUEUE).stream)
        .arg("*")
        .arg("id")
        .arg(&id)
        .query_async(&mut conn)
        .await?;
    let second = read(&dtq, "w2", 10).await?;
    ensure!(second.len() == 1 && second[0].msg_id == dup, "{second:?}");
    let decisions = start(&dtq, "w2", &second).await?;
    assert!(
        matches!(decisions.as_slice(), [StartDecision::Skip(s)] if s == "RUNNING"),
        "the duplicate was not skipped: {decisions:?}"
    );
    // Still w1's attempt 1; the duplicate acknowledged and gone.
    assert_eq!(
        fields(&dtq, &id, &["status", "attempts", "worker", "msg_id"]).await?,
        [
            Some("RUNNING".into()),
            Some("1".into()),
            Some("w1".into()),
            Some(first[0].msg_id.clone())
        ]
    );
    assert_eq!(
        pending(&dtq).await?,
        [(first[0].msg_id.clone(), "w1".to_owned())]
    );
    let left: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(QueueKeys::new(QUEUE).stream)
        .arg(&dup)
        .arg(&dup)
        .query_async(&mut conn)
        .await?;
    assert!(left.is_empty(), "the duplicate is still in the stream");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_that_is_not_a_task_is_dead_lettered_alone_and_its_batch_starts() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(submit(&dtq, i, 1).await?);
    }
    let keys = QueueKeys::new(QUEUE);
    let mut conn = dtq.redis.conn().await?;
    // Task 1's key holds a string; task 2's hash lost its payload.
    let () = redis::cmd("SET")
        .arg(keys.task(&ids[1]))
        .arg("not a task")
        .query_async(&mut conn)
        .await?;
    let _: u64 = redis::cmd("HDEL")
        .arg(keys.task(&ids[2]))
        .arg("payload")
        .query_async(&mut conn)
        .await?;
    let deliveries = read(&dtq, "w1", 10).await?;
    ensure!(deliveries.len() == 4, "{deliveries:?}");

    let decisions = start(&dtq, "w1", &deliveries).await?;
    match decisions.as_slice() {
        [
            StartDecision::Run(a),
            StartDecision::Corrupt(not_hash),
            StartDecision::Corrupt(no_payload),
            StartDecision::Run(d),
        ] => {
            assert_eq!((a.attempts, d.attempts), (1, 1));
            assert!(not_hash.contains("string"), "{not_hash}");
            assert!(no_payload.contains("payload"), "{no_payload}");
        }
        other => bail!("decisions: {other:?}"),
    }
    // The bad records are dead letters, readable, with their error, in the
    // DLQ; the string kept.
    let dlq: Vec<String> = redis::cmd("ZRANGE")
        .arg(&keys.dlq)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await?;
    let mut bad = vec![ids[1].clone(), ids[2].clone()];
    bad.sort();
    let mut listed = dlq.clone();
    listed.sort();
    assert_eq!(listed, bad, "the DLQ holds the two bad records alone");
    for (i, says) in [(1, "not a hash"), (2, "no task name or payload")] {
        let shown = dtq.task(QUEUE, &ids[i]).await?;
        assert_eq!(shown["status"], "DEAD_LETTERED", "{shown:#}");
        let error = shown["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{error}");
    }
    let kept: Option<String> = redis::cmd("HGET")
        .arg(keys.task(&ids[1]))
        .arg("corrupt_record")
        .query_async(&mut conn)
        .await?;
    // DUMP's form of a string starts with its type (0) and length.
    let kept = kept.unwrap_or_default();
    assert!(
        kept.starts_with(&format!("00{:02x}", "not a task".len())),
        "the string was not kept: {kept:?}"
    );
    // Only the two started tasks' messages are pending; started again (the
    // reply lost), the batch spends no attempt.
    let mut pending_ids: Vec<String> = pending(&dtq).await?.into_iter().map(|(m, _)| m).collect();
    pending_ids.sort();
    let mut started = vec![deliveries[0].msg_id.clone(), deliveries[3].msg_id.clone()];
    started.sort();
    assert_eq!(pending_ids, started);
    let again = start(&dtq, "w1", &[deliveries[0].clone(), deliveries[3].clone()]).await?;
    assert!(
        again
            .iter()
            .all(|d| matches!(d, StartDecision::Run(t) if t.attempts == 1)),
        "{again:?}"
    );
    Ok(())
}
