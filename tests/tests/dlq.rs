//! The dead-letter queue (issue 13): bulk requeue and purge (admin), and
//! the workers' retention sweep, against a real redis-server, real workers
//! and the real `flaky` example (`succeed_on_attempt: 2` with one attempt
//! is dead-lettered at once, and succeeds once requeued).

use std::time::Duration;

use anyhow::{Result, ensure};
use dtq_host::store::{DLQ_CHUNK, QueueKeys, Store};
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);
const ADMIN: &str = "dlq-admin";
const AUTH: (&str, &str) = ("Authorization", "Bearer dlq-admin");

/// Submit a task that is dead-lettered after its one attempt (and would
/// succeed on a second); with `key` as its idempotency key.
async fn doomed(dtq: &Dtq, key: Option<&str>) -> Result<String> {
    dtq.submit_new(
        "default",
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1}),
        key,
    )
    .await
}

/// Dead-letter `n` tasks (keys `<prefix>-<i>` when `prefix` is given) and
/// wait until each is; their ids in submission order.
async fn dead_letter(dtq: &Dtq, n: usize, prefix: Option<&str>) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let key = prefix.map(|p| format!("{p}-{i}"));
        ids.push(doomed(dtq, key.as_deref()).await?);
    }
    for id in &ids {
        dtq.wait_for("default", id, &["DEAD_LETTERED"], WAIT)
            .await?;
    }
    Ok(ids)
}

/// The DLQ of the default queue, oldest first.
async fn dlq(dtq: &Dtq) -> Result<Vec<String>> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("ZRANGE")
        .arg(QueueKeys::new("default").dlq)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await?)
}

/// Set when each of `ids` was dead-lettered (its DLQ score), ms.
async fn set_dead_lettered_at(dtq: &Dtq, ids: &[String], at: u64) -> Result<()> {
    let mut conn = dtq.redis.conn().await?;
    for id in ids {
        let changed: u64 = redis::cmd("ZADD")
            .arg(QueueKeys::new("default").dlq)
            .arg("XX")
            .arg("CH")
            .arg(at)
            .arg(id)
            .query_async(&mut conn)
            .await?;
        ensure!(changed == 1 || at == 0, "{id} is not in the DLQ");
    }
    Ok(())
}

async fn exists(dtq: &Dtq, id: &str) -> Result<bool> {
    let (status, body) = dtq
        .call(
            Method::GET,
            &format!("/v1/queues/default/tasks/{id}"),
            None,
            &[],
        )
        .await?;
    ensure!(status == 200 || status == 404, "{status} {body}");
    Ok(status == 200)
}

/// The statuses of the events of task `id`, in order.
async fn event_statuses(dtq: &Dtq, id: &str) -> Result<Vec<String>> {
    let events = dtq.redis.task_events("default", id).await?;
    Ok(events.into_iter().map(|(status, _)| status).collect())
}

async fn requeue(dtq: &Dtq, body: Value) -> Result<(u16, Value)> {
    dtq.call(
        Method::POST,
        "/v1/queues/default/dlq/requeue",
        Some(body),
        &[AUTH],
    )
    .await
}

async fn purge(dtq: &Dtq, query: &str, body: Option<Value>) -> Result<(u16, Value)> {
    dtq.call(
        Method::DELETE,
        &format!("/v1/queues/default/dlq{query}"),
        body,
        &[AUTH],
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_hash_has_no_ttl() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let ids = dead_letter(&dtq, 1, None).await?;
    let mut conn = dtq.redis.conn().await?;
    let ttl: i64 = redis::cmd("TTL")
        .arg(QueueKeys::new("default").task(&ids[0]))
        .query_async(&mut conn)
        .await?;
    assert_eq!(ttl, -1, "a DLQ entry must never outlive its hash");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bulk_requeue_of_ids_requeues_the_dead_lettered_ones_and_names_the_rest() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let ids = dead_letter(&dtq, 3, None).await?;
    let live = dtq
        .submit_new("default", json!({"task": "echo", "payload": 1}), None)
        .await?;
    dtq.wait_for("default", &live, &["SUCCEEDED"], WAIT).await?;
    dtq.stop_worker().await?;

    let (status, body) = requeue(
        &dtq,
        json!({"ids": [ids[0], "no-such-task", ids[1], live, ids[0]]}),
    )
    .await?;
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(
        body,
        json!({"requeued": 2, "not_dead_lettered": ["no-such-task", live], "key_taken": []})
    );
    assert_eq!(dlq(&dtq).await?, [ids[2].clone()]);
    for id in &ids[..2] {
        let task = dtq.task("default", id).await?;
        assert_eq!(task["status"], "QUEUED", "{task:#}");
    }
    dtq.start_worker();
    for id in &ids[..2] {
        let task = dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
        assert_eq!(task["attempts"], 2, "{task:#}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bulk_requeue_of_all_works_through_more_than_one_chunk() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let n = DLQ_CHUNK + DLQ_CHUNK / 2;
    let ids = dead_letter(&dtq, n, None).await?;
    dtq.stop_worker().await?;
    // A dangling entry (its hash gone) is reported and removed.
    let mut conn = dtq.redis.conn().await?;
    let () = redis::cmd("ZADD")
        .arg(QueueKeys::new("default").dlq)
        .arg(1)
        .arg("dangling")
        .query_async(&mut conn)
        .await?;

    let (status, body) = requeue(&dtq, json!({"all": true})).await?;
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(
        body,
        json!({"requeued": n, "not_dead_lettered": ["dangling"], "key_taken": []})
    );
    assert!(dlq(&dtq).await?.is_empty());
    dtq.start_worker();
    for id in &ids {
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }
    // Nothing left: `all` again requeues nothing.
    let (status, body) = requeue(&dtq, json!({"all": true})).await?;
    assert_eq!(
        (status, body),
        (
            200,
            json!({"requeued": 0, "not_dead_lettered": [], "key_taken": []})
        )
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bulk_requests_are_checked() -> Result<()> {
    let dtq = Dtq::start(false, &["--admin-token", ADMIN]).await?;
    let too_many: Vec<String> = (0..1001).map(|i| format!("t{i}")).collect();
    assert_error(
        &requeue(&dtq, json!({"ids": too_many})).await?,
        400,
        "TOO_MANY_IDS",
    );
    assert_error(&requeue(&dtq, json!({})).await?, 400, "INVALID_REQUEST");
    assert_error(
        &requeue(&dtq, json!({"ids": ["a"], "all": true})).await?,
        400,
        "INVALID_REQUEST",
    );
    assert_error(
        &requeue(&dtq, json!({"older_than_ms": 5})).await?,
        400,
        "INVALID_REQUEST",
    );
    assert_error(
        &requeue(&dtq, json!({"idz": []})).await?,
        400,
        "INVALID_REQUEST",
    );
    assert_error(&purge(&dtq, "", None).await?, 400, "INVALID_REQUEST");
    assert_error(
        &purge(&dtq, "?older_than_ms=soon", None).await?,
        400,
        "INVALID_QUERY",
    );
    assert_error(
        &purge(&dtq, "", Some(json!({"all": true, "older_than_ms": 1}))).await?,
        400,
        "INVALID_REQUEST",
    );
    // Admin only.
    assert_error(
        &dtq.call(
            Method::POST,
            "/v1/queues/default/dlq/requeue",
            Some(json!({"all": true})),
            &[],
        )
        .await?,
        401,
        "UNAUTHORIZED",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_needs_the_admin_scope() -> Result<()> {
    let dtq = Dtq::start(
        false,
        &[
            "--tokens",
            "ops read,submit,cancel default",
            "--admin-token",
            ADMIN,
        ],
    )
    .await?;
    for (method, path) in [
        (Method::DELETE, "/v1/queues/default/dlq"),
        (Method::POST, "/v1/queues/default/dlq/requeue"),
    ] {
        assert_error(
            &dtq.call(
                method,
                path,
                Some(json!({"all": true})),
                &[("Authorization", "Bearer ops")],
            )
            .await?,
            403,
            "FORBIDDEN",
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_by_ids_removes_the_task_and_frees_its_key() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let ids = dead_letter(&dtq, 3, Some("p")).await?;
    dtq.stop_worker().await?;
    let (status, body) = purge(
        &dtq,
        "",
        Some(json!({"ids": [ids[0], ids[1], "no-such-task"]})),
    )
    .await?;
    assert_eq!((status, body), (200, json!({"purged": 2})));
    assert_eq!(dlq(&dtq).await?, [ids[2].clone()]);
    for (i, id) in ids.iter().enumerate().take(2) {
        assert!(!exists(&dtq, id).await?, "{id} still there");
        assert_eq!(dtq.idem_record("default", &format!("p-{i}")).await?, None);
        let events = event_statuses(&dtq, id).await?;
        assert_eq!(
            events.last().map(String::as_str),
            Some("PURGED"),
            "{events:?}"
        );
    }
    assert!(exists(&dtq, &ids[2]).await?);
    assert!(dtq.idem_record("default", "p-2").await?.is_some());

    // The purged key is free: the same submission is a new task.
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1}),
            Some("p-0"),
        )
        .await?;
    assert_eq!(status, 202, "{body:#}");
    assert_ne!(body["task_id"], json!(ids[0]));
    // The kept one's key still replays its dead-lettered task.
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1}),
            Some("p-2"),
        )
        .await?;
    assert_eq!(
        (status, &body["task_id"]),
        (200, &json!(ids[2])),
        "{body:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_of_all_and_of_the_older_ones() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let ids = dead_letter(&dtq, 6, Some("o")).await?;
    dtq.stop_worker().await?;
    let now = dtq_host::base::now_ms();
    // Two dead-lettered an hour ago, two a minute ago, two now.
    set_dead_lettered_at(&dtq, &ids[..2], now - 3_600_000).await?;
    set_dead_lettered_at(&dtq, &ids[2..4], now - 60_000).await?;

    let (status, body) = purge(&dtq, "", Some(json!({"older_than_ms": 600_000}))).await?;
    assert_eq!((status, body), (200, json!({"purged": 2})));
    let mut left = ids[2..].to_vec();
    left.sort();
    let mut now_left = dlq(&dtq).await?;
    now_left.sort();
    assert_eq!(now_left, left);

    // The query form, with no body.
    let (status, body) = purge(&dtq, "?older_than_ms=30000", None).await?;
    assert_eq!((status, body), (200, json!({"purged": 2})));
    assert_eq!(dlq(&dtq).await?.len(), 2);
    for id in &ids[..4] {
        assert!(!exists(&dtq, id).await?, "{id}");
    }

    let (status, body) = purge(&dtq, "", Some(json!({"all": true}))).await?;
    assert_eq!((status, body), (200, json!({"purged": 2})));
    assert!(dlq(&dtq).await?.is_empty());
    for (i, id) in ids.iter().enumerate() {
        assert!(!exists(&dtq, id).await?, "{id}");
        assert_eq!(dtq.idem_record("default", &format!("o-{i}")).await?, None);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_retention_sweep_trims_by_age_and_by_count() -> Result<()> {
    // The harness's worker keeps every dead letter.
    let mut dtq = Dtq::start(
        true,
        &[
            "--dlq-retention-s",
            "0",
            "--dlq-max",
            "0",
            "--admin-token",
            ADMIN,
        ],
    )
    .await?;
    let ids = dead_letter(&dtq, 6, Some("r")).await?;
    dtq.stop_worker().await?;
    let now = dtq_host::base::now_ms();
    // Two dead-lettered two days ago; then four, a second apart.
    set_dead_lettered_at(&dtq, &ids[..2], now - 2 * 86_400_000).await?;
    for (i, id) in ids[2..].iter().enumerate() {
        set_dead_lettered_at(
            &dtq,
            std::slice::from_ref(id),
            now - 10_000 + 1_000 * i as u64,
        )
        .await?;
    }

    // A worker keeping a day's dead letters, at most three.
    let mut config = dtq.config.worker();
    config.dlq_retention_s = 86_400;
    config.dlq_max = 3;
    let store = Store::connect(&dtq.config.store.redis_url, dtq.config.store_settings()).await?;
    let stop = CancellationToken::new();
    let worker = tokio::spawn(dtq_host::worker::run(
        store,
        dtq.sandbox.clone(),
        config,
        stop.clone().cancelled_owned(),
    ));
    let deadline = std::time::Instant::now() + WAIT;
    while dlq(&dtq).await?.len() > 3 {
        ensure!(
            std::time::Instant::now() < deadline,
            "not trimmed: {:?}",
            dlq(&dtq).await?
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The two old ones went by age, then the oldest recent one by count.
    assert_eq!(dlq(&dtq).await?, ids[3..].to_vec());
    for (i, id) in ids.iter().enumerate().take(3) {
        assert!(!exists(&dtq, id).await?, "{id}");
        assert_eq!(dtq.idem_record("default", &format!("r-{i}")).await?, None);
    }
    for id in &ids[3..] {
        assert!(exists(&dtq, id).await?, "{id}");
    }
    stop.cancel();
    worker.await??;
    Ok(())
}

/// One key, one live task (issue 32): a dead-lettered task whose key was
/// taken by a new task (its record expired meanwhile) is not requeued,
/// one id or many; the answer names the task that holds the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_requeue_whose_key_names_another_task_is_refused() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--admin-token", ADMIN]).await?;
    let old = dead_letter(&dtq, 1, Some("moved")).await?.remove(0);
    dtq.stop_worker().await?;
    // The record expires (by hand here), and the key is submitted again:
    // a new task, which holds the key now.
    let mut conn = dtq.redis.conn().await?;
    let () = redis::cmd("DEL")
        .arg(QueueKeys::new("default").idempotency(Some("moved-0")))
        .query_async(&mut conn)
        .await?;
    let new = doomed(&dtq, Some("moved-0")).await?;

    let (status, body) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/dlq/{old}/requeue"),
            None,
            &[AUTH],
        )
        .await?;
    assert_error(&(status, body.clone()), 409, "IDEMPOTENCY_KEY_TAKEN");
    assert_eq!(body["error"]["details"]["task_id"], json!(new), "{body}");
    let (status, body) = requeue(&dtq, json!({"ids": [old]})).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"requeued": 0, "not_dead_lettered": [],
               "key_taken": [{"id": old, "task_id": new}]})
    );
    // Nothing changed: the old task is still dead-lettered, the key still
    // names the new one, and only the new one is live.
    assert_eq!(dlq(&dtq).await?, std::slice::from_ref(&old));
    assert_eq!(dtq.task("default", &old).await?["status"], "DEAD_LETTERED");
    assert_eq!(dtq.task("default", &new).await?["status"], "QUEUED");
    let record = dtq.idem_record("default", "moved-0").await?;
    assert_eq!(record.map(|r| r["task_id"].clone()), Some(json!(new)));
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1}),
            Some("moved-0"),
        )
        .await?;
    assert_eq!(
        (status, &body["error"]["details"]["task_id"]),
        (409, &json!(new)),
        "{body}"
    );

    // Once the new task is purged too, the key is free again and the old
    // task's requeue takes it back.
    dtq.start_worker();
    dtq.wait_for("default", &new, &["DEAD_LETTERED"], WAIT)
        .await?;
    dtq.stop_worker().await?;
    let (status, body) = purge(&dtq, "", Some(json!({"ids": [new]}))).await?;
    assert_eq!((status, &body["purged"]), (200, &json!(1)), "{body}");
    let (status, body) = requeue(&dtq, json!({"ids": [old]})).await?;
    assert_eq!(
        (status, body),
        (
            200,
            json!({"requeued": 1, "not_dead_lettered": [], "key_taken": []})
        )
    );
    let record = dtq.idem_record("default", "moved-0").await?;
    assert_eq!(
        record.map(|r| (r["task_id"].clone(), r["state"].clone())),
        Some((json!(old), json!("processing")))
    );
    dtq.start_worker();
    dtq.wait_for("default", &old, &["SUCCEEDED"], WAIT).await?;
    Ok(())
}
