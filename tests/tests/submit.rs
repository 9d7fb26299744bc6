//! The submission contract (rules 1–11 of the idempotency spec), against a
//! real redis-server and the real example handlers.

use std::time::Duration;

use anyhow::Result;
use dtq_host::ingest::{self, SubmitRequest};
use dtq_host::store::{Store, StoreSettings};
use dtq_tests::{Dtq, assert_error};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

fn echo(n: u64) -> Value {
    json!({"task": "echo", "payload": {"n": n}})
}

async fn task_keys(dtq: &Dtq, queue: &str) -> Result<Vec<String>> {
    Ok(dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with(&format!("dtq:task:{{{queue}}}:")))
        .collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn header_key_wins_over_body_field_and_scope_is_per_queue() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut body = echo(1);
    body["idempotency_key"] = json!("from-body");
    let (status, first) = dtq.submit("q1", body.clone(), Some("from-header")).await?;
    assert_eq!(status, 202, "{first}");
    assert!(dtq.idem_record("q1", "from-header").await?.is_some());
    assert!(
        dtq.idem_record("q1", "from-body").await?.is_none(),
        "the body's key must lose"
    );

    // Without the header, the body's key is used.
    let (status, _) = dtq.submit("q1", body, None).await?;
    assert_eq!(status, 202);
    assert!(dtq.idem_record("q1", "from-body").await?.is_some());

    // The same key on another queue is another record and another task.
    let (status, other) = dtq.submit("q2", echo(1), Some("from-header")).await?;
    assert_eq!(status, 202, "{other}");
    assert_ne!(other["task_id"], first["task_id"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn winner_gets_202_and_a_processing_record_with_ttl() -> Result<()> {
    let dtq = Dtq::start(false, &["--idem-ttl-s", "600"]).await?;
    let (status, body) = dtq.submit("default", echo(1), Some("k1")).await?;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["duplicate"], false);
    assert_eq!(body["status"], "QUEUED");
    assert_eq!(body["queue"], "default");
    assert_eq!(body["task"], "echo");
    let rec = dtq.idem_record("default", "k1").await?.expect("record");
    assert_eq!(rec["task_id"], body["task_id"]);
    assert_eq!(rec["state"], "processing");
    assert!(rec["updated_at"].as_u64().is_some_and(|t| t > 0), "{rec}");
    assert!(
        rec["fingerprint"].as_str().is_some_and(|f| f.len() == 64),
        "{rec}"
    );
    let mut conn = dtq.redis.conn().await?;
    let ttl: i64 = redis::cmd("TTL")
        .arg("dtq:idempotency:{default}:k1")
        .query_async(&mut conn)
        .await?;
    assert!((1..=600).contains(&ttl), "ttl {ttl}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn in_flight_key_gets_409_with_the_task_id() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (_, first) = dtq.submit("default", echo(1), Some("k")).await?;
    let (status, body) = dtq.submit("default", echo(1), Some("k")).await?;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(body["error"]["details"]["task_id"], first["task_id"]);
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert_eq!(task_keys(&dtq, "default").await?.len(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn terminal_key_replays_the_stored_task_with_200() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let (_, first) = dtq.submit("default", echo(7), Some("done")).await?;
    let id = first["task_id"].as_str().expect("id");
    dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    for _ in 0..3 {
        let (status, body) = dtq.submit("default", echo(7), Some("done")).await?;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["duplicate"], true);
        assert_eq!(body["task_id"], id);
        assert_eq!(body["status"], "SUCCEEDED");
        assert_eq!(
            body["result"],
            json!({"n": 7}),
            "the replay carries the stored result"
        );
    }
    assert_eq!(
        task_keys(&dtq, "default").await?.len(),
        1,
        "no second logical task"
    );

    // A failed task replays too.
    let (_, failed) = dtq
        .submit(
            "default",
            json!({"task": "order_total", "payload": {"bogus": true}}),
            Some("bad"),
        )
        .await?;
    let fid = failed["task_id"].as_str().expect("id");
    dtq.wait_for("default", fid, &["FAILED"], WAIT).await?;
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "order_total", "payload": {"bogus": true}}),
            Some("bad"),
        )
        .await?;
    assert_eq!(
        (status, &body["duplicate"], &body["status"]),
        (200, &json!(true), &json!("FAILED")),
        "{body}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_record_makes_a_new_task() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let (_, first) = dtq.submit("default", echo(1), Some("exp")).await?;
    let id1 = first["task_id"].as_str().expect("id").to_owned();
    dtq.wait_for("default", &id1, &["SUCCEEDED"], WAIT).await?;
    // The record expires (its TTL ran out) while the task hash lives on.
    let mut conn = dtq.redis.conn().await?;
    let _: () = redis::cmd("PEXPIRE")
        .arg("dtq:idempotency:{default}:exp")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    while dtq.idem_record("default", "exp").await?.is_some() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (status, second) = dtq.submit("default", echo(1), Some("exp")).await?;
    assert_eq!(status, 202, "{second}");
    assert_eq!(second["duplicate"], false);
    assert_ne!(second["task_id"], id1);
    let rec = dtq
        .idem_record("default", "exp")
        .await?
        .expect("record re-acquired");
    assert_eq!(rec["task_id"], second["task_id"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_record_is_repaired_and_the_submission_is_new_work() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (_, first) = dtq.submit("default", echo(1), Some("stale")).await?;
    let id1 = first["task_id"].as_str().expect("id").to_owned();
    // The task hash is gone (retention expiry) but the record still points at it.
    let mut conn = dtq.redis.conn().await?;
    let _: () = redis::cmd("DEL")
        .arg(format!("dtq:task:{{default}}:{id1}"))
        .query_async(&mut conn)
        .await?;
    let (status, second) = dtq.submit("default", echo(1), Some("stale")).await?;
    assert_eq!(status, 202, "{second}");
    assert_ne!(second["task_id"], id1);
    let rec = dtq.idem_record("default", "stale").await?.expect("record");
    assert_eq!(rec["task_id"], second["task_id"]);
    assert_eq!(rec["state"], "processing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_refuses_new_work_but_never_a_replay() -> Result<()> {
    let mut dtq = Dtq::start(true, &["--max-queue-depth", "1"]).await?;
    let (_, done) = dtq.submit("default", echo(1), Some("replayable")).await?;
    let id = done["task_id"].as_str().expect("id").to_owned();
    dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    dtq.stop_worker().await?;

    let (status, _) = dtq.submit("default", echo(2), None).await?;
    assert_eq!(status, 202, "the first waiting task fits");
    let (status, full) = dtq.submit("default", echo(3), Some("new-key")).await?;
    assert_eq!(status, 429, "{full}");
    assert_eq!(full["error"]["code"], "QUEUE_FULL");
    assert!(
        dtq.idem_record("default", "new-key").await?.is_none(),
        "a refused submission claims nothing"
    );

    let (status, replay) = dtq.submit("default", echo(1), Some("replayable")).await?;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(replay["duplicate"], true);
    assert_eq!(replay["task_id"], id.as_str());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn reusing_a_key_for_other_work_is_422() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let (_, first) = dtq.submit("default", echo(1), Some("k")).await?;
    for other in [echo(2), json!({"task": "counter", "payload": {"n": 1}})] {
        let (status, body) = dtq.submit("default", other, Some("k")).await?;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["code"], "IDEMPOTENCY_KEY_MISMATCH");
        assert_eq!(body["error"]["details"]["task_id"], first["task_id"]);
    }
    // The same payload with its keys in another order is the same work.
    let (status, body) = dtq
        .submit(
            "default",
            json!({"payload": {"n": 1}, "task": "echo"}),
            Some("k"),
        )
        .await?;
    assert_eq!(status, 409, "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_a_coded_4xx_and_creates_nothing() -> Result<()> {
    let dtq = Dtq::start(false, &["--max-payload-bytes", "1024"]).await?;
    let raw = |body: &'static str| {
        let url = format!("{}/v1/queues/default/tasks", dtq.api);
        async move {
            let resp = reqwest::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await?;
            let status = resp.status().as_u16();
            Ok::<_, anyhow::Error>((status, resp.json::<Value>().await?))
        }
    };
    let (status, body) = raw("{not json").await?;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("INVALID_JSON")),
        "{body}"
    );

    let long_key = "k".repeat(256);
    let cases: Vec<(&str, Value, Option<&str>, u16, &str)> = vec![
        (
            "default",
            json!({"payload": {}}),
            None,
            400,
            "INVALID_REQUEST",
        ),
        (
            "default",
            json!({"task": "nope", "payload": {}}),
            None,
            400,
            "UNKNOWN_TASK",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}, "colour": 1}),
            None,
            400,
            "INVALID_REQUEST",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}}),
            Some(long_key.as_str()),
            400,
            "INVALID_IDEMPOTENCY_KEY",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}, "idempotency_key": ""}),
            None,
            400,
            "INVALID_IDEMPOTENCY_KEY",
        ),
        (
            "a:b",
            json!({"task": "echo", "payload": {}}),
            None,
            400,
            "INVALID_QUEUE_NAME",
        ),
        (
            "a{b}",
            json!({"task": "echo", "payload": {}}),
            None,
            400,
            "INVALID_QUEUE_NAME",
        ),
        (
            "default",
            json!({"task": "echo", "payload": "x".repeat(2000)}),
            None,
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}, "max_attempts": 0}),
            None,
            400,
            "INVALID_MAX_ATTEMPTS",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}, "timeout_ms": 0}),
            None,
            400,
            "INVALID_TIMEOUT",
        ),
        (
            "default",
            json!({"task": "echo", "payload": {}, "expires_in_ms": 0}),
            None,
            400,
            "INVALID_EXPIRY",
        ),
    ];
    for (queue, body, key, want_status, want_code) in cases {
        assert_error(&dtq.submit(queue, body, key).await?, want_status, want_code);
    }
    // A body far over the limit is refused by size before it is parsed.
    let huge = json!({"task": "echo", "payload": "y".repeat(200_000)});
    assert_error(
        &dtq.submit("default", huge, None).await?,
        413,
        "PAYLOAD_TOO_LARGE",
    );

    let dtq_keys: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:task") || k.starts_with("dtq:idem"))
        .collect();
    assert!(dtq_keys.is_empty(), "bad input created {dtq_keys:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_duplicates_make_exactly_one_task() -> Result<()> {
    let dtq = std::sync::Arc::new(Dtq::start(true, &[]).await?);
    let mut handles = Vec::new();
    for _ in 0..50 {
        let dtq = dtq.clone();
        handles.push(tokio::spawn(async move {
            dtq.submit("default", echo(9), Some("race")).await
        }));
    }
    let mut created = Vec::new();
    for h in handles {
        let (status, body) = h.await??;
        match status {
            202 => created.push(body["task_id"].clone()),
            409 => assert_eq!(body["error"]["code"], "IDEMPOTENCY_IN_PROGRESS"),
            200 => assert_eq!(body["duplicate"], true),
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(created.len(), 1, "exactly one winner: {created:?}");
    assert_eq!(task_keys(&dtq, "default").await?.len(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_is_one_round_trip() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // The first submission to a queue also registers the queue, once.
    dtq.submit("default", echo(0), None).await?;
    for (i, key) in [None, Some("rt-key"), Some("rt-key")]
        .into_iter()
        .enumerate()
    {
        let before = dtq.store.round_trips();
        dtq.submit("default", echo(i as u64 + 1), key).await?;
        assert_eq!(
            dtq.store.round_trips() - before,
            1,
            "submission {i} ({key:?})"
        );
    }
    Ok(())
}

/// A process's first burst of submissions to a queue, all in flight before
/// any has its answer, reads the queue's partition count once: the first
/// reads it and the others wait for that read, where each used to send its
/// own (a herd of reads on every API restart under load).
#[tokio::test(flavor = "multi_thread")]
async fn a_first_burst_of_submissions_reads_the_partition_count_once() -> Result<()> {
    const BURST: u64 = 64;
    let dtq = Dtq::start(false, &[]).await?;
    let settings = dtq.config.ingest_settings();
    // A process of its own: nothing of the queue known yet.
    let cold = Store::connect(&dtq.redis.url(), StoreSettings::default()).await?;
    let before = cold.round_trips();
    let submissions = (0..BURST).map(|n| {
        let req: SubmitRequest = serde_json::from_value(echo(n)).expect("a valid request");
        ingest::submit(&cold, &settings, "burst", None, req, |_| true)
    });
    for submitted in futures::future::join_all(submissions).await {
        submitted.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    // One ingest per task, the queue's registration, one partition read.
    assert_eq!(cold.round_trips() - before, BURST + 2);
    let (status, stats) = dtq
        .call(reqwest::Method::GET, "/v1/queues/burst", None, &[])
        .await?;
    assert_eq!(status, 200, "{stats}");
    assert_eq!(stats["ready"], json!(BURST), "{stats}");
    Ok(())
}
