//! Bulk submission (`POST /v1/queues/{queue}/tasks/batch`) and `run_at`,
//! against a real redis-server and the real example handlers.

use std::time::Duration;

use anyhow::{Context, Result};
use dtq_host::base::now_ms;
use dtq_host::ingest::MAX_BATCH_ITEMS;
use dtq_tests::{Dtq, assert_error};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

fn echo(n: u64) -> Value {
    json!({"task": "echo", "payload": {"n": n}})
}

fn keyed(n: u64, key: &str) -> Value {
    let mut item = echo(n);
    item["idempotency_key"] = json!(key);
    item
}

/// POST a batch body to `queue`.
async fn batch(dtq: &Dtq, queue: &str, body: Value) -> Result<(u16, Value)> {
    dtq.call(
        reqwest::Method::POST,
        &format!("/v1/queues/{queue}/tasks/batch"),
        Some(body),
        &[],
    )
    .await
}

/// POST `items` as a batch and return its results, which must be one per
/// item.
async fn results(dtq: &Dtq, queue: &str, items: Vec<Value>) -> Result<Vec<Value>> {
    let n = items.len();
    let (status, body) = batch(dtq, queue, json!({ "tasks": items })).await?;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().context("no results")?.clone();
    assert_eq!(results.len(), n, "{body:#}");
    Ok(results)
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

/// Every key of `queue` in Redis, for "nothing was written" checks.
async fn queue_keys(dtq: &Dtq, queue: &str) -> Result<Vec<String>> {
    let mut keys: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.contains(&format!("{{{queue}}}")))
        .collect();
    keys.sort();
    Ok(keys)
}

fn code(result: &Value) -> &str {
    result["body"]["error"]["code"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mixed_batch_gets_one_result_per_item_as_single_submits_would() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    // A terminal key, and a key in flight (scheduled an hour ahead).
    let done = dtq.submit_new("default", echo(7), Some("done")).await?;
    dtq.wait_for("default", &done, &["SUCCEEDED"], WAIT).await?;
    let mut later = keyed(8, "later");
    later["delay_ms"] = json!(3_600_000);
    let in_flight = dtq.submit_new("default", later.clone(), None).await?;
    let before = task_keys(&dtq, "default").await?.len();

    let mut bad = keyed(9, "bad-item");
    bad["max_attempts"] = json!(0);
    let unknown = json!({"task": "no_such_task", "payload": {}, "idempotency_key": "unknown-item"});
    let items = vec![
        keyed(1, "new-1"),
        keyed(7, "done"),
        later,
        bad,
        unknown,
        keyed(70, "done"),
        json!("not an object"),
        json!({"task": "echo", "colour": "red"}),
        echo(2),
    ];
    let r = results(&dtq, "default", items).await?;

    assert_eq!(r[0]["status"], 202, "{:#}", r[0]);
    assert_eq!(r[0]["body"]["duplicate"], false);
    assert_eq!(r[0]["body"]["status"], "QUEUED");
    let new_id = r[0]["body"]["task_id"].as_str().context("task_id")?;

    assert_eq!(r[1]["status"], 200, "{:#}", r[1]);
    assert_eq!(r[1]["body"]["duplicate"], true);
    assert_eq!(r[1]["body"]["task_id"], done.as_str());
    assert_eq!(r[1]["body"]["result"], json!({"n": 7}));

    assert_eq!(r[2]["status"], 409, "{:#}", r[2]);
    assert_eq!(code(&r[2]), "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(
        r[2]["body"]["error"]["details"]["task_id"],
        in_flight.as_str()
    );

    assert_eq!(r[3]["status"], 400, "{:#}", r[3]);
    assert_eq!(code(&r[3]), "INVALID_MAX_ATTEMPTS");
    assert_eq!(r[4]["status"], 400, "{:#}", r[4]);
    assert_eq!(code(&r[4]), "UNKNOWN_TASK");
    assert_eq!(r[5]["status"], 422, "{:#}", r[5]);
    assert_eq!(code(&r[5]), "IDEMPOTENCY_KEY_MISMATCH");
    assert_eq!(code(&r[6]), "INVALID_REQUEST", "{:#}", r[6]);
    assert_eq!(code(&r[7]), "INVALID_REQUEST", "{:#}", r[7]);
    for refused in &r[2..8] {
        let message = refused["body"]["error"]["message"].as_str();
        assert!(message.is_some_and(|m| !m.is_empty()), "{refused:#}");
    }
    assert_eq!(r[8]["status"], 202, "{:#}", r[8]);

    // Two tasks written (items 0 and 8), no record for a refused key.
    assert_eq!(task_keys(&dtq, "default").await?.len(), before + 2);
    assert!(dtq.idem_record("default", "bad-item").await?.is_none());
    assert!(dtq.idem_record("default", "unknown-item").await?.is_none());
    assert_eq!(
        dtq.idem_record("default", "new-1")
            .await?
            .context("record")?["task_id"],
        new_id
    );
    // The replayed and in-flight keys still name their own tasks.
    assert_eq!(
        dtq.idem_record("default", "done")
            .await?
            .context("record")?["task_id"],
        done.as_str()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_key_twice_in_a_batch_is_a_task_and_then_in_flight() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let r = results(
        &dtq,
        "default",
        vec![keyed(1, "twice"), keyed(1, "twice"), keyed(2, "twice")],
    )
    .await?;
    assert_eq!(r[0]["status"], 202, "{:#}", r[0]);
    let id = &r[0]["body"]["task_id"];
    assert_eq!(r[1]["status"], 409, "{:#}", r[1]);
    assert_eq!(code(&r[1]), "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(&r[1]["body"]["error"]["details"]["task_id"], id);
    // Another payload under the same key: as a second single submit.
    assert_eq!(r[2]["status"], 422, "{:#}", r[2]);
    assert_eq!(code(&r[2]), "IDEMPOTENCY_KEY_MISMATCH");
    assert_eq!(task_keys(&dtq, "default").await?.len(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn oversize_empty_and_malformed_batches_are_refused_and_write_nothing() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // One task, so that the queue has keys to compare.
    dtq.submit_new("default", echo(0), None).await?;
    let keys = queue_keys(&dtq, "default").await?;

    let too_many: Vec<Value> = (0..=MAX_BATCH_ITEMS as u64).map(echo).collect();
    let response = batch(&dtq, "default", json!({ "tasks": too_many })).await?;
    assert_error(&response, 413, "BATCH_TOO_LARGE");
    assert_eq!(response.1["error"]["details"]["limit"], MAX_BATCH_ITEMS);

    let response = batch(&dtq, "default", json!({"tasks": []})).await?;
    assert_error(&response, 400, "EMPTY_BATCH");
    for body in [json!({}), json!({"tasks": {}}), json!([echo(1)])] {
        let response = batch(&dtq, "default", body.clone()).await?;
        assert_error(&response, 400, "INVALID_REQUEST");
    }
    let response = batch(&dtq, "default", json!({"tasks": [echo(1)], "extra": true})).await?;
    assert_error(&response, 400, "INVALID_REQUEST");

    // A key in the header names one task: a batch refuses it.
    let response = dtq
        .call(
            reqwest::Method::POST,
            "/v1/queues/default/tasks/batch",
            Some(json!({"tasks": [echo(1)]})),
            &[("Idempotency-Key", "k")],
        )
        .await?;
    assert_error(&response, 400, "INVALID_IDEMPOTENCY_KEY");

    // A body over the batch limit, refused by its declared length before
    // a byte of it is read (and so sent: the refusal closes the
    // connection, which a client still sending would see as a broken pipe).
    let over = dtq_host::ingest::MAX_BATCH_BODY_BYTES + 1;
    let response = declared_only(&dtq.api, "/v1/queues/default/tasks/batch", over).await?;
    assert_error(&response, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(response.1["error"]["details"]["limit"], over - 1);

    // Not JSON at all, and not declared JSON.
    let raw = reqwest::Client::new();
    let url = format!("{}/v1/queues/default/tasks/batch", dtq.api);
    let resp = raw
        .post(&url)
        .header("Content-Type", "application/json")
        .body("{\"tasks\": [")
        .send()
        .await?;
    let response = (resp.status().as_u16(), resp.json::<Value>().await?);
    assert_error(&response, 400, "INVALID_JSON");
    let resp = raw.post(&url).body("{\"tasks\": []}").send().await?;
    let response = (resp.status().as_u16(), resp.json::<Value>().await?);
    assert_error(&response, 415, "UNSUPPORTED_MEDIA_TYPE");

    assert_eq!(queue_keys(&dtq, "default").await?, keys, "nothing written");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batchs_tasks_run_and_their_results_are_right() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let items: Vec<Value> = (0..50).map(|n| keyed(n, &format!("run-{n}"))).collect();
    let r = results(&dtq, "default", items).await?;
    for (n, result) in r.iter().enumerate() {
        assert_eq!(result["status"], 202, "{result:#}");
        let id = result["body"]["task_id"].as_str().context("task_id")?;
        let task = dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
        assert_eq!(task["result"], json!({"n": n}), "{task:#}");
        assert_eq!(task["idempotency_key"], format!("run-{n}"));
    }
    // Each key is terminal now: the same batch again replays every task.
    let items: Vec<Value> = (0..50).map(|n| keyed(n, &format!("run-{n}"))).collect();
    let again = results(&dtq, "default", items).await?;
    for (first, replay) in r.iter().zip(&again) {
        assert_eq!(replay["status"], 200, "{replay:#}");
        assert_eq!(replay["body"]["duplicate"], true);
        assert_eq!(replay["body"]["task_id"], first["body"]["task_id"]);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_is_one_round_trip() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // The first submission to a queue also registers the queue, once.
    dtq.submit_new("default", echo(0), None).await?;
    for size in [1, 10, MAX_BATCH_ITEMS] {
        let items: Vec<Value> = (0..size as u64)
            .map(|n| keyed(n, &format!("rt-{size}-{n}")))
            .collect();
        let before = dtq.store.round_trips();
        let r = results(&dtq, "default", items).await?;
        assert_eq!(dtq.store.round_trips() - before, 1, "a batch of {size}");
        assert!(r.iter().all(|r| r["status"] == 202));
    }
    // Refused items do not add trips; a batch of only refused items makes
    // none.
    let before = dtq.store.round_trips();
    let r = results(
        &dtq,
        "default",
        vec![
            json!({"task": "echo", "max_attempts": 0}),
            keyed(0, "rt-1-0"),
        ],
    )
    .await?;
    assert_eq!(dtq.store.round_trips() - before, 1);
    assert_eq!(r[1]["status"], 409);
    let before = dtq.store.round_trips();
    results(
        &dtq,
        "default",
        vec![json!({"task": "echo", "timeout_ms": 0})],
    )
    .await?;
    assert_eq!(dtq.store.round_trips() - before, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn flushed_scripts_are_loaded_again_and_each_item_runs_once() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    dtq.submit_new("default", echo(0), None).await?;
    let mut conn = dtq.redis.conn().await?;
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut conn)
        .await?;
    let r = results(
        &dtq,
        "default",
        vec![keyed(1, "flushed"), echo(2), keyed(1, "flushed")],
    )
    .await?;
    assert_eq!(r[0]["status"], 202, "{:#}", r[0]);
    assert_eq!(r[1]["status"], 202, "{:#}", r[1]);
    assert_eq!(r[2]["status"], 409, "{:#}", r[2]);
    assert_eq!(task_keys(&dtq, "default").await?.len(), 3);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_future_run_at_is_scheduled_at_that_time_and_runs_after() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let at = now_ms() + 1_500;
    let mut body = echo(1);
    body["run_at"] = json!(at);
    let (status, submitted) = dtq.submit("default", body, None).await?;
    assert_eq!(status, 202, "{submitted}");
    assert_eq!(submitted["status"], "SCHEDULED");
    let id = submitted["task_id"].as_str().context("task_id")?;
    let task = dtq.task("default", id).await?;
    assert_eq!(task["run_at"], at, "{task:#}");

    // The same through a batch.
    let mut item = echo(2);
    item["run_at"] = json!(at);
    let r = results(&dtq, "default", vec![item]).await?;
    assert_eq!(r[0]["body"]["status"], "SCHEDULED", "{:#}", r[0]);
    let batch_id = r[0]["body"]["task_id"].as_str().context("task_id")?;
    assert_eq!(dtq.task("default", batch_id).await?["run_at"], at);

    for id in [id, batch_id] {
        let done = dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
        let started = done["started_at"].as_u64().context("started_at")?;
        assert!(started >= at, "started at {started}, before run_at {at}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_past_run_at_runs_at_once() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    for run_at in [
        json!(now_ms() - 60_000),
        json!("2001-02-03T04:05:06Z"),
        json!(0),
    ] {
        let mut body = echo(3);
        body["run_at"] = run_at.clone();
        let (status, submitted) = dtq.submit("default", body, None).await?;
        assert_eq!(status, 202, "{run_at}: {submitted}");
        assert_eq!(submitted["status"], "QUEUED", "{run_at}");
        let id = submitted["task_id"].as_str().context("task_id")?;
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_rfc3339_run_at_is_read_with_its_offset() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // 2099-01-01T00:00:00Z is 4070908800 s; more than 30 days ahead.
    let mut body = echo(4);
    body["run_at"] = json!("2099-01-01T01:00:00+01:00");
    let response = dtq.submit("default", body, None).await?;
    assert_error(&response, 400, "INVALID_RUN_AT");

    // Ten days ahead, written with an offset and a fraction.
    let at = (now_ms() / 1000 + 10 * 86_400) * 1000 + 250;
    let text = rfc3339_at_offset(at, -(5 * 60 + 30));
    let mut body = echo(5);
    body["run_at"] = json!(text);
    let (status, submitted) = dtq.submit("default", body, None).await?;
    assert_eq!(status, 202, "{text}: {submitted}");
    assert_eq!(submitted["status"], "SCHEDULED");
    let id = submitted["task_id"].as_str().context("task_id")?;
    assert_eq!(dtq.task("default", id).await?["run_at"], at, "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_run_ats_are_refused_and_write_nothing() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let now = now_ms();
    let cases = [
        json!({"run_at": now + 60_000, "delay_ms": 10}),
        json!({"run_at": now + 31 * 86_400_000}),
        json!({"run_at": "next tuesday"}),
        json!({"run_at": "2026-12-03T14:00:00"}),
        json!({"run_at": -5}),
        json!({"run_at": 1.5}),
    ];
    for extra in &cases {
        let mut body = echo(6);
        for (k, v) in extra.as_object().context("object")? {
            body[k] = v.clone();
        }
        let response = dtq.submit("default", body.clone(), None).await?;
        assert_error(&response, 400, "INVALID_RUN_AT");
        let r = results(&dtq, "default", vec![body]).await?;
        assert_eq!(r[0]["status"], 400, "{extra}: {:#}", r[0]);
        assert_eq!(code(&r[0]), "INVALID_RUN_AT", "{extra}");
    }
    // An expiry that ends before the run time.
    let mut body = echo(7);
    body["run_at"] = json!(now + 600_000);
    body["expires_in_ms"] = json!(60_000);
    let response = dtq.submit("default", body, None).await?;
    assert_error(&response, 400, "INVALID_EXPIRY");
    assert!(task_keys(&dtq, "default").await?.is_empty());
    Ok(())
}

/// POST to `path` a request that declares a JSON body of `length` bytes
/// and sends none of it; the status and the JSON body of the answer.
async fn declared_only(api: &str, path: &str, length: usize) -> Result<(u16, Value)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = api.strip_prefix("http://").context("an http URL")?;
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await?;
    let answer = String::from_utf8(answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").context("no end of headers")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    Ok((status, serde_json::from_str(body)?))
}

/// `at` (ms since the epoch) as RFC 3339 with the offset `offset_min`
/// minutes, e.g. `2026-12-13T08:30:00.250-05:30`.
fn rfc3339_at_offset(at: u64, offset_min: i64) -> String {
    let local = at as i64 + offset_min * 60_000;
    let (secs, millis) = (local.div_euclid(1000), local.rem_euclid(1000));
    let (days, day_secs) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let sign = if offset_min < 0 { '-' } else { '+' };
    let off = offset_min.abs();
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}{sign}{:02}:{:02}",
        day_secs / 3600,
        day_secs / 60 % 60,
        day_secs % 60,
        off / 60,
        off % 60
    )
}
