//! Partitioned queues: a queue spread over several key sets (slots), keyed
//! submissions routed by their key so that one key stays one task, unkeyed
//! ones spread, workers consuming every partition (new ones without a
//! restart), counts, listing and the DLQ over all partitions, and a raise
//! of the count that loses no task and splits no key; and a handler's
//! submission given the id of the task it becomes, partition included.
//! On one Redis here; `scripts/test` runs this file on a three-primary
//! cluster too (`DTQ_TEST_REDIS=cluster`), where each partition is a slot
//! of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use dtq_host::client::sse::SseReader;
use dtq_host::store::{Store, StoreSettings, key_hash, partition_of_id};
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::{Value, json};

const ADMIN: &str = "partitions-admin-token";
const WAIT: Duration = Duration::from_secs(30);

async fn start(with_worker: bool) -> Result<Dtq> {
    Dtq::start(with_worker, &["--admin-token", ADMIN]).await
}

/// `PUT /v1/queues/{queue}/partitions` with the admin token.
async fn raise(dtq: &Dtq, queue: &str, count: u32) -> Result<(u16, Value)> {
    let auth = format!("Bearer {ADMIN}");
    dtq.call(
        Method::PUT,
        &format!("/v1/queues/{queue}/partitions"),
        Some(json!({ "count": count })),
        &[("Authorization", &auth)],
    )
    .await
}

/// `GET /v1/queues/{queue}`: the queue's counts.
async fn queue_stats(dtq: &Dtq, queue: &str) -> Result<Value> {
    let (status, stats) = dtq
        .call(Method::GET, &format!("/v1/queues/{queue}"), None, &[])
        .await?;
    ensure!(status == 200, "{status} {stats}");
    Ok(stats)
}

fn home(key: &str, count: u32) -> u32 {
    (key_hash(key) % u64::from(count)) as u32
}

/// Return once Redis's clock has moved past the millisecond it reads now:
/// a stream entry added after this has a later id than any added before.
async fn past_this_redis_millisecond(dtq: &Dtq) -> Result<()> {
    let mut conn = dtq.redis.conn().await?;
    let mut now_ms = async || -> Result<u64> {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        Ok(s * 1000 + us / 1000)
    };
    let started = now_ms().await?;
    while now_ms().await? <= started {}
    Ok(())
}

fn echo(payload: Value) -> Value {
    json!({"task": "echo", "payload": payload})
}

/// Wait until every task of `ids` has SUCCEEDED.
async fn all_succeed(dtq: &Dtq, queue: &str, ids: impl IntoIterator<Item = &String>) -> Result<()> {
    for id in ids {
        dtq.wait_for(queue, id, &["SUCCEEDED"], WAIT).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_queue_routes_keys_spreads_the_rest_and_shows_one_queue() -> Result<()> {
    const Q: &str = "default";
    let mut dtq = start(false).await?;
    let (status, resp) = raise(&dtq, Q, 4).await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp, json!({"queue": Q, "partitions": 4, "previous": 1}));

    // Unkeyed: round-robin over the four. As one batch, so that the
    // partitions' index entries share ids (one millisecond of one server),
    // which the listing below must still page through whole.
    let items: Vec<Value> = (0..40).map(|i| echo(json!(i))).collect();
    let (status, batch) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/{Q}/tasks/batch"),
            Some(json!({ "tasks": items })),
            &[],
        )
        .await?;
    assert_eq!(status, 200, "{batch}");
    let unkeyed: Vec<String> = batch["results"]
        .as_array()
        .context("results")?
        .iter()
        .map(|r| {
            ensure!(r["status"] == 202, "{r}");
            Ok(r["body"]["task_id"].as_str().context("task_id")?.to_owned())
        })
        .collect::<Result<_>>()?;
    let mut per_partition = BTreeMap::new();
    for id in &unkeyed {
        *per_partition.entry(partition_of_id(id)).or_insert(0) += 1;
    }
    assert_eq!(
        per_partition,
        BTreeMap::from([(0, 10), (1, 10), (2, 10), (3, 10)]),
        "{unkeyed:?}"
    );
    // Keyed: each to its key's partition, and a second submission of a
    // key finds the first in flight there.
    let mut keyed = BTreeMap::new();
    for i in 0..20 {
        let key = format!("order-{i}");
        if i == 19 {
            // The listing orders partitions' entries by their ids, which
            // are to the millisecond of Redis's clock; within one
            // millisecond, by partition. The last key below must head the
            // listing, so it goes in a millisecond of its own.
            past_this_redis_millisecond(&dtq).await?;
        }
        let id = dtq.submit_new(Q, echo(json!({"k": i})), Some(&key)).await?;
        assert_eq!(partition_of_id(&id), home(&key, 4), "{key} → {id}");
        let again = dtq.submit(Q, echo(json!({"k": i})), Some(&key)).await?;
        assert_error(&again, 409, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(
            again.1["error"]["details"]["task_id"],
            json!(id),
            "{again:?}"
        );
        keyed.insert(key, id);
    }
    let spread: BTreeSet<u32> = keyed.values().map(|id| partition_of_id(id)).collect();
    ensure!(spread.len() == 4, "20 keys landed in only {spread:?}");
    // Each task's record is in its partition's slot.
    let keys = dtq.redis.keys().await?;
    for id in keyed.values().chain(&unkeyed) {
        let slot = match partition_of_id(id) {
            0 => Q.to_owned(),
            i => format!("{Q}#{i}"),
        };
        let key = format!("dtq:task:{{{slot}}}:{id}");
        ensure!(keys.contains(&key), "{key} missing");
    }

    // One queue to a reader: counts summed, the listing merged.
    let stats = queue_stats(&dtq, Q).await?;
    assert_eq!(
        (&stats["ready"], &stats["partitions"]),
        (&json!(60), &json!(4)),
        "{stats}"
    );
    let mut listed = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let query = match &cursor {
            Some(c) => format!("?limit=7&cursor={c}"),
            None => "?limit=7".to_owned(),
        };
        let (status, page) = dtq
            .call(
                Method::GET,
                &format!("/v1/queues/{Q}/tasks{query}"),
                None,
                &[],
            )
            .await?;
        assert_eq!(status, 200, "{page}");
        for task in page["tasks"].as_array().context("tasks")? {
            listed.push(task["task_id"].as_str().context("task_id")?.to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
        ensure!(listed.len() <= 60, "the listing repeats: {listed:?}");
    }
    let all: BTreeSet<String> = keyed.values().chain(&unkeyed).cloned().collect();
    assert_eq!(listed.iter().cloned().collect::<BTreeSet<_>>(), all);
    assert_eq!(listed.len(), 60, "a task was listed twice");
    // Newest first across partitions: the last keyed task submitted heads
    // the listing.
    assert_eq!(listed.first(), keyed.get("order-19"));

    // A worker consumes every partition; keys replay from theirs.
    dtq.start_worker();
    all_succeed(&dtq, Q, keyed.values().chain(&unkeyed)).await?;
    for (i, (key, id)) in keyed.iter().enumerate().take(5) {
        let n: u32 = key.trim_start_matches("order-").parse()?;
        let (status, replay) = dtq.submit(Q, echo(json!({"k": n})), Some(key)).await?;
        assert_eq!(
            (status, &replay["task_id"]),
            (200, &json!(id)),
            "{i}: {replay}"
        );
        assert_eq!(replay["duplicate"], json!(true));
        let (status, found) = dtq
            .call(
                Method::GET,
                &format!("/v1/queues/{Q}/idempotency/{key}"),
                None,
                &[],
            )
            .await?;
        assert_eq!((status, &found["task_id"]), (200, &json!(id)), "{found}");
    }

    // Dead letters of every partition show in the one DLQ, and requeue by id.
    let mut failing = Vec::new();
    for _ in 0..4 {
        failing.push(
            dtq.submit_new(
                Q,
                json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1}),
                None,
            )
            .await?,
        );
    }
    for id in &failing {
        dtq.wait_for(Q, id, &["DEAD_LETTERED"], WAIT).await?;
    }
    let parts: BTreeSet<u32> = failing.iter().map(|id| partition_of_id(id)).collect();
    ensure!(
        parts.len() > 1,
        "the failing tasks shared a partition: {failing:?}"
    );
    let (_, dlq) = dtq
        .call(Method::GET, &format!("/v1/queues/{Q}/dlq"), None, &[])
        .await?;
    let dead: BTreeSet<String> = dlq["tasks"]
        .as_array()
        .context("dlq tasks")?
        .iter()
        .map(|t| t["task_id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(dead, failing.iter().cloned().collect(), "{dlq}");
    let stats = queue_stats(&dtq, Q).await?;
    assert_eq!(stats["dead_lettered"], json!(4), "{stats}");
    let auth = format!("Bearer {ADMIN}");
    let target = failing
        .iter()
        .find(|id| partition_of_id(id) > 0)
        .context("one in partition > 0")?;
    let (status, resp) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/{Q}/dlq/{target}/requeue"),
            None,
            &[("Authorization", &auth)],
        )
        .await?;
    assert_eq!(status, 200, "{resp}");
    // flaky succeeds on its second attempt.
    dtq.wait_for(Q, target, &["SUCCEEDED"], WAIT).await?;

    // Events: the task's partition by default; a partition that does not
    // exist is refused.
    let (status, resp) = dtq
        .call(
            Method::GET,
            &format!("/v1/queues/{Q}/events?partition=4"),
            None,
            &[],
        )
        .await?;
    assert_error(&(status, resp), 400, "INVALID_QUERY");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn raising_the_count_loses_no_task_and_keeps_one_task_per_key() -> Result<()> {
    const Q: &str = "default";
    let dtq = start(true).await?;
    // Before: one partition. Half of these wait for a while, so the raise
    // happens with keys in flight as well as done.
    let mut before = BTreeMap::new();
    for i in 0..30 {
        let key = format!("before-{i}");
        let body = if i % 2 == 0 {
            echo(json!({"b": i}))
        } else {
            json!({"task": "sleep", "payload": {"ms": 1500}})
        };
        let id = dtq.submit_new(Q, body, Some(&key)).await?;
        assert_eq!(partition_of_id(&id), 0);
        before.insert(key, (id, i));
    }

    let (status, resp) = raise(&dtq, Q, 3).await?;
    assert_eq!((status, &resp["partitions"]), (200, &json!(3)), "{resp}");
    // Every key submitted before is still its one task, whichever
    // partition the new count gives it: in flight (409) or done (200).
    let moved = before.keys().filter(|k| home(k, 3) != 0).count();
    ensure!(
        moved >= 10,
        "only {moved} of 30 keys moved: the test would show little"
    );
    for (key, (id, i)) in &before {
        let body = if i % 2 == 0 {
            echo(json!({"b": i}))
        } else {
            json!({"task": "sleep", "payload": {"ms": 1500}})
        };
        let (status, resp) = dtq.submit(Q, body, Some(key)).await?;
        let same = match status {
            200 => &resp["task_id"],
            409 => &resp["error"]["details"]["task_id"],
            _ => anyhow::bail!("{key}: {status} {resp}"),
        };
        assert_eq!(same, &json!(id), "{key} became another task: {resp}");
    }
    // New submissions use the new count, and the running worker consumes
    // the new partitions without a restart.
    let mut after = Vec::new();
    for i in 0..30 {
        let key = format!("after-{i}");
        let id = dtq.submit_new(Q, echo(json!({"a": i})), Some(&key)).await?;
        assert_eq!(partition_of_id(&id), home(&key, 3), "{key} → {id}");
        after.push(id);
        after.push(dtq.submit_new(Q, echo(json!({"u": i})), None).await?);
    }
    let used: BTreeSet<u32> = after.iter().map(|id| partition_of_id(id)).collect();
    assert_eq!(used, BTreeSet::from([0, 1, 2]));
    all_succeed(&dtq, Q, before.values().map(|(id, _)| id).chain(&after)).await?;

    // Lowering is refused, and so are 0 and more than 256; nothing changes.
    assert_error(&raise(&dtq, Q, 2).await?, 422, "INVALID_PARTITIONS");
    assert_error(&raise(&dtq, Q, 0).await?, 422, "INVALID_PARTITIONS");
    assert_error(&raise(&dtq, Q, 257).await?, 422, "INVALID_PARTITIONS");
    let stats = queue_stats(&dtq, Q).await?;
    assert_eq!(stats["partitions"], json!(3), "{stats}");
    // Without the admin token, no raise.
    let (status, _) = dtq
        .call(
            Method::PUT,
            &format!("/v1/queues/{Q}/partitions"),
            Some(json!({"count": 5})),
            &[],
        )
        .await?;
    ensure!(
        status == 401 || status == 403,
        "a raise without the admin token: {status}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submitter_that_knows_an_old_count_is_routed_again() -> Result<()> {
    const Q: &str = "default";
    let dtq = start(false).await?;
    // The API's store learns the count (1) with its first submission.
    dtq.submit_new(Q, echo(json!(0)), Some("warm-up")).await?;
    // Another process raises it; the API's knowledge is now out of date.
    let other = Store::connect(&dtq.redis.url(), StoreSettings::default()).await?;
    assert_eq!(
        other
            .raise_partitions(Q, 4, dtq_host::base::now_ms())
            .await?,
        4
    );
    let key = (0..)
        .map(|i| format!("stale-{i}"))
        .find(|k| home(k, 4) != 0)
        .context("a key off partition 0")?;
    // The ingest script refuses the route by count 1; the API reads the
    // count again and the task lands in the key's partition under count 4.
    let id = dtq.submit_new(Q, echo(json!(1)), Some(&key)).await?;
    assert_eq!(partition_of_id(&id), home(&key, 4), "{id}");
    let (status, resp) = dtq.submit(Q, echo(json!(1)), Some(&key)).await?;
    assert_eq!(status, 409, "{resp}");
    Ok(())
}

/// Open the events of `queue` (all partitions, merged), resuming after
/// `last` when given.
async fn events(dtq: &Dtq, queue: &str, last: Option<&str>) -> Result<SseReader> {
    let mut req = reqwest::Client::new()
        .get(format!("{}/v1/queues/{queue}/events", dtq.api))
        .header("Accept", "text/event-stream");
    if let Some(id) = last {
        req = req.header("Last-Event-ID", id);
    }
    let response = req.send().await?;
    ensure!(response.status() == 200, "events: {}", response.status());
    Ok(SseReader::new(response))
}

/// Events until `want` tasks have each sent `status`; (task, event id) of
/// each.
async fn read_until(
    events: &mut SseReader,
    status: &str,
    want: usize,
) -> Result<Vec<(String, String)>> {
    let mut seen = Vec::new();
    while seen.len() < want {
        let event = tokio::time::timeout(WAIT, events.next())
            .await
            .context("no event in time")??
            .context("the stream ended")?;
        if event.event != status {
            continue;
        }
        let data: Value = serde_json::from_str(&event.data)?;
        let task = data["task_id"].as_str().context("task_id")?.to_owned();
        seen.push((task, event.id.context("an id")?));
    }
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_events_of_every_partition_arrive_on_one_stream_and_resume() -> Result<()> {
    const Q: &str = "default";
    let dtq = start(false).await?;
    raise(&dtq, Q, 3).await?;
    let mut stream = events(&dtq, Q, None).await?;
    let mut first = Vec::new();
    for i in 0..6 {
        first.push(dtq.submit_new(Q, echo(json!(i)), None).await?);
    }
    let seen = read_until(&mut stream, "QUEUED", 6).await?;
    assert_eq!(
        seen.iter().map(|(t, _)| t.clone()).collect::<BTreeSet<_>>(),
        first.iter().cloned().collect::<BTreeSet<_>>(),
        "the merged stream missed a partition's events"
    );
    // The id says where each of the three partitions stands.
    let (_, last) = seen.last().context("events")?;
    assert_eq!(last.split(',').count(), 3, "{last}");
    drop(stream);

    // Resuming from that id: the events after it, from every partition,
    // and none of those already seen.
    let mut later = Vec::new();
    for i in 0..6 {
        later.push(dtq.submit_new(Q, echo(json!(i)), None).await?);
    }
    let mut resumed = events(&dtq, Q, Some(last)).await?;
    let again = read_until(&mut resumed, "QUEUED", 6).await?;
    assert_eq!(
        again
            .iter()
            .map(|(t, _)| t.clone())
            .collect::<BTreeSet<_>>(),
        later.iter().cloned().collect::<BTreeSet<_>>(),
    );
    // An id of another number of partitions is refused.
    let response = reqwest::Client::new()
        .get(format!("{}/v1/queues/{Q}/events", dtq.api))
        .header("Last-Event-ID", "1-0,2-0")
        .send()
        .await?;
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    assert_error(&(status, body), 400, "INVALID_EVENT_ID");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_raise_that_stopped_half_way_is_finished_by_the_next_submitter() -> Result<()> {
    const Q: &str = "default";
    let dtq = start(false).await?;
    raise(&dtq, Q, 2).await?;
    // A raise to 4 whose process died after it wrote partitions 3, 2 and 1,
    // before partition 0: submitters still read 2 from partition 0, and
    // partition 1 refuses what they route there.
    let mut conn = dtq.redis.conn().await?;
    for i in 1..4 {
        redis::cmd("SET")
            .arg(format!("dtq:partitions:{{{Q}#{i}}}"))
            .arg(4)
            .query_async::<()>(&mut conn)
            .await?;
    }
    // Submissions go on. An unkeyed one refused there goes round-robin to
    // the next partition; a keyed one of partition 1 is refused until the
    // submitter, seeing the count stay put, finishes the raise.
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(dtq.submit_new(Q, echo(json!(i)), None).await?);
    }
    let keys: Vec<String> = (0..)
        .map(|i| format!("half-{i}"))
        .filter(|k| home(k, 2) == 1)
        .take(4)
        .collect();
    for key in &keys {
        let id = dtq.submit_new(Q, echo(json!(key)), Some(key)).await?;
        assert_eq!(partition_of_id(&id), home(key, 4), "{key} → {id}");
        ids.push(id);
    }
    let stats = queue_stats(&dtq, Q).await?;
    assert_eq!(
        (&stats["partitions"], &stats["ready"]),
        (&json!(4), &json!(8)),
        "{stats} {ids:?}"
    );
    let used: BTreeSet<u32> = ids.iter().map(|id| partition_of_id(id)).collect();
    ensure!(
        used.iter().any(|p| *p >= 2),
        "nothing went to the new partitions: {ids:?}"
    );
    Ok(())
}

/// A doomed task: dead-lettered after its one attempt, would succeed on a
/// second.
fn doomed() -> Value {
    json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1})
}

/// Submit `doomed()` with `key` through `store`, a process of its own.
async fn submit_from(
    store: &Store,
    dtq: &Dtq,
    key: &str,
) -> Result<Result<dtq_host::ingest::Submitted, dtq_host::ingest::IngestError>> {
    let req: dtq_host::ingest::SubmitRequest = serde_json::from_value(doomed())?;
    let settings = dtq.config.ingest_settings();
    Ok(dtq_host::ingest::submit(store, &settings, "default", Some(key), req, |_| true).await)
}

/// One key, one task across a raise and a requeue (issue 32): a task
/// dead-lettered before a raise and requeued after it, its key routed to
/// another partition now, is found by keyed submissions and lookups from
/// then on, also by a process that never knew the old count (it looks
/// only in the key's partition); and a requeue whose key was taken in
/// its new partition is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_requeue_after_a_raise_keeps_the_key_where_submissions_look() -> Result<()> {
    const Q: &str = "default";
    let mut dtq = start(true).await?;
    let keys: Vec<String> = (0..)
        .map(|i| format!("raised-{i}"))
        .filter(|k| home(k, 4) != 0)
        .take(2)
        .collect();
    let (kept, lost) = (&keys[0], &keys[1]);
    let mut ids = Vec::new();
    for key in &keys {
        let id = dtq.submit_new(Q, doomed(), Some(key)).await?;
        dtq.wait_for(Q, &id, &["DEAD_LETTERED"], WAIT).await?;
        assert_eq!(partition_of_id(&id), 0, "{id}");
        ids.push(id);
    }
    dtq.stop_worker().await?;
    raise(&dtq, Q, 4).await?;
    // The idempotency TTL after the raise has passed (by hand here): keyed
    // submissions no longer look where the old count routed keys.
    let mut conn = dtq.redis.conn().await?;
    let () = redis::cmd("DEL")
        .arg(dtq_host::store::QueueKeys::new(Q).partition_history)
        .query_async(&mut conn)
        .await?;
    // Another process, which never knew the old count.
    let other = Store::connect(&dtq.redis.url(), StoreSettings::default()).await?;
    // `lost`'s key is taken in its new partition meanwhile.
    let taker = match submit_from(&other, &dtq, lost).await? {
        Ok(submitted) if !submitted.duplicate => submitted.task_id,
        other => anyhow::bail!("a new task for {lost}: {other:?}"),
    };
    assert_eq!(partition_of_id(&taker), home(lost, 4), "{taker}");

    let auth = format!("Bearer {ADMIN}");
    let (status, body) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/{Q}/dlq/requeue"),
            Some(json!({"ids": ids})),
            &[("Authorization", &auth)],
        )
        .await?;
    assert_eq!(
        (status, body.clone()),
        (
            200,
            json!({"requeued": 1, "not_dead_lettered": [],
                   "key_taken": [{"id": ids[1], "task_id": taker}]})
        ),
        "{body}"
    );
    // The requeued task holds its key for every submitter: this process,
    // the other one, and the lookup.
    let (status, resp) = dtq.submit(Q, doomed(), Some(kept)).await?;
    assert_eq!(
        (status, &resp["error"]["details"]["task_id"]),
        (409, &json!(ids[0])),
        "{resp}"
    );
    match submit_from(&other, &dtq, kept).await? {
        Err(dtq_host::ingest::IngestError::InProgress { task_id }) => {
            assert_eq!(task_id, ids[0]);
        }
        other => anyhow::bail!("{kept} is the requeued task, in flight: {other:?}"),
    }
    let (status, resp) = dtq
        .call(
            Method::GET,
            &format!("/v1/queues/{Q}/idempotency/{kept}"),
            None,
            &[],
        )
        .await?;
    assert_eq!((status, &resp["task_id"]), (200, &json!(ids[0])), "{resp}");
    // It runs, succeeds, and its key replays it.
    dtq.start_worker();
    dtq.wait_for(Q, &ids[0], &["SUCCEEDED"], WAIT).await?;
    match submit_from(&other, &dtq, kept).await? {
        Ok(submitted) => assert_eq!(
            (submitted.task_id, submitted.duplicate),
            (ids[0].clone(), true)
        ),
        other => anyhow::bail!("{kept} replays the requeued task: {other:?}"),
    }
    // The refused one is still dead-lettered, unchanged.
    assert_eq!(dtq.task(Q, &ids[1]).await?["status"], "DEAD_LETTERED");
    Ok(())
}

/// Submit to `default` a `flows` task whose payload's `submit` is
/// `submit`: the parent's id.
async fn submit_parent(dtq: &Dtq, submit: Value) -> Result<String> {
    let parent = json!({"task": "flows", "payload": {"submit": submit}});
    dtq.submit_new("default", parent, None).await
}

/// Wait for parent `parent` to succeed: its task, whose result holds the
/// id its handler was given.
async fn parent_done(dtq: &Dtq, parent: &str) -> Result<Value> {
    let ended = ["SUCCEEDED", "FAILED", "DEAD_LETTERED"];
    let done = dtq.wait_for("default", parent, &ended, WAIT).await?;
    ensure!(done["status"] == "SUCCEEDED", "{done:#}");
    Ok(done)
}

/// Submit to `default` a `flows` task that submits one task to `kids`
/// with `key` (a derived one when `None`), and wait for it: the id the
/// handler was given.
async fn handler_submits(dtq: &Dtq, n: u64, key: Option<&str>) -> Result<String> {
    let mut submit = json!({"queue": "kids", "task": "flows", "payload": {"n": n}});
    if let Some(key) = key {
        submit["key"] = json!(key);
    }
    let parent = submit_parent(dtq, submit).await?;
    let done = parent_done(dtq, &parent).await?;
    Ok(done["result"]["id"]
        .as_str()
        .context("the id the handler was given")?
        .to_owned())
}

/// Wait for task `id` of `queue`, submitted after its parent's
/// completion (so perhaps not there yet), to succeed with result `{"n":
/// n}`: the id names the task the handler submitted.
async fn applied(dtq: &Dtq, queue: &str, id: &str, n: u64) -> Result<()> {
    let done = dtq.wait_for_new(queue, id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["result"], json!({"n": n}), "{id}: {done:#}");
    Ok(())
}

/// The worker of the partition tests with flows: it runs `default` and
/// `kids`, and the `flows` guest may submit to `kids`.
async fn start_flows() -> Result<Dtq> {
    let flags = [
        "--admin-token",
        ADMIN,
        "--queues",
        "default,kids",
        "--submit-to",
        "flows=kids:flows",
    ];
    Dtq::start(true, &flags).await
}

/// A handler's submission to a partitioned queue is given the id of the
/// task it becomes, partition included: with its own key, routed by the
/// key's hash; with a derived key; and after a raise, both for a key whose
/// record stayed in the partition the old count gave it (the handler is
/// given that task's id) and for a new key (the new count's partition).
#[tokio::test(flavor = "multi_thread")]
async fn a_handlers_submission_to_a_partitioned_queue_is_given_its_tasks_id() -> Result<()> {
    let dtq = start_flows().await?;
    let (status, body) = raise(&dtq, "kids", 4).await?;
    ensure!(status == 200, "{status} {body}");
    let keys: Vec<String> = (0..8).map(|i| format!("child-{i}")).collect();
    ensure!(
        keys.iter().any(|k| home(k, 4) != 0),
        "no key outside partition 0"
    );
    let mut given = BTreeMap::new();
    for (n, key) in (0..).zip(&keys) {
        let id = handler_submits(&dtq, n, Some(key)).await?;
        assert_eq!(partition_of_id(&id), home(key, 4), "{key}: {id}");
        applied(&dtq, "kids", &id, n).await?;
        given.insert(key.clone(), id);
    }
    let mut partitions = BTreeSet::new();
    for n in 100..108 {
        let id = handler_submits(&dtq, n, None).await?;
        applied(&dtq, "kids", &id, n).await?;
        partitions.insert(partition_of_id(&id));
    }
    ensure!(
        partitions.iter().any(|&p| p != 0),
        "eight derived keys all in partition 0: {partitions:?}"
    );

    let (status, body) = raise(&dtq, "kids", 8).await?;
    ensure!(status == 200, "{status} {body}");
    let moved = keys
        .iter()
        .find(|k| home(k, 8) != home(k, 4))
        .context("no key the raise moves")?;
    let again = handler_submits(&dtq, 0, Some(moved)).await?;
    assert_eq!(again, given[moved], "{moved}: the task its record names");
    let fresh: String = (0..)
        .map(|i| format!("after-raise-{i}"))
        .find(|k| home(k, 8) != home(k, 4) && home(k, 8) != 0)
        .context("a key of a new partition")?;
    let id = handler_submits(&dtq, 200, Some(&fresh)).await?;
    assert_eq!(partition_of_id(&id), home(&fresh, 8), "{fresh}: {id}");
    applied(&dtq, "kids", &id, 200).await?;
    Ok(())
}

/// A raise of the count between a handler's submission and its
/// application (after the handler returns) does not change where the task
/// goes: the handler was given the id of the partition the old count
/// routes its key to, and the task is there, where keyed submissions look
/// for it until the idempotency TTL after the raise has passed.
#[tokio::test(flavor = "multi_thread")]
async fn a_raise_before_a_handlers_submission_applies_keeps_the_id_it_was_given() -> Result<()> {
    let dtq = start_flows().await?;
    let (status, body) = raise(&dtq, "kids", 4).await?;
    ensure!(status == 200, "{status} {body}");
    let key: String = (0..)
        .map(|i| format!("held-{i}"))
        .find(|k| home(k, 8) != home(k, 4))
        .context("a key the raise moves")?;
    let submit = json!({"queue": "kids", "task": "flows", "payload": {"n": 5},
                        "key": key, "hold": true});
    let parent = submit_parent(&dtq, submit).await?;
    // The handler has been given its id, and holds on until released.
    let mut conn = dtq.redis.conn().await?;
    let started = std::time::Instant::now();
    let given = loop {
        let given: Option<String> = redis::cmd("GET")
            .arg(format!("dtq:guest:{{flows}}:submitted:{parent}"))
            .query_async(&mut conn)
            .await?;
        if let Some(given) = given {
            break given;
        }
        ensure!(started.elapsed() < WAIT, "the handler never submitted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(partition_of_id(&given), home(&key, 4), "{key}: {given}");
    let (status, body) = raise(&dtq, "kids", 8).await?;
    ensure!(status == 200, "{status} {body}");
    let () = redis::cmd("SET")
        .arg(format!("dtq:guest:{{flows}}:release:{parent}"))
        .arg("1")
        .query_async(&mut conn)
        .await?;
    let done = parent_done(&dtq, &parent).await?;
    assert_eq!(done["result"]["id"], json!(given), "{done:#}");
    ensure!(
        done["attempts"] == 1,
        "a second attempt staged after the raise: {done:#}"
    );
    applied(&dtq, "kids", &given, 5).await?;
    let (status, record) = dtq
        .call(
            Method::GET,
            &format!("/v1/queues/kids/idempotency/{key}"),
            None,
            &[],
        )
        .await?;
    assert_eq!(
        (status, &record["task_id"]),
        (200, &json!(given)),
        "{record}"
    );
    Ok(())
}

/// A queue's partition count that is not a count (a record not as the
/// host wrote it) makes a handler's submission to it fail with
/// `unavailable`, rather than give an id that may name no task, and
/// creates nothing; once the record is mended, the same submission goes
/// through.
#[tokio::test(flavor = "multi_thread")]
async fn a_handlers_submission_to_a_queue_whose_count_is_unreadable_is_refused() -> Result<()> {
    let dtq = start_flows().await?;
    let mut conn = dtq.redis.conn().await?;
    let count_key = dtq_host::store::QueueKeys::new("kids").partitions;
    let () = redis::cmd("SET")
        .arg(&count_key)
        .arg("not a count")
        .query_async(&mut conn)
        .await?;
    let submit = json!({"queue": "kids", "task": "flows", "payload": {"n": 1}, "key": "k"});
    let body = json!({"task": "flows", "payload": {"submit": submit}, "max_attempts": 1});
    let parent = dtq.submit_new("default", body, None).await?;
    let ended = ["SUCCEEDED", "FAILED", "DEAD_LETTERED"];
    let done = dtq.wait_for("default", &parent, &ended, WAIT).await?;
    ensure!(done["status"] != "SUCCEEDED", "{done:#}");
    let error = done["error"].as_str().unwrap_or_default();
    ensure!(
        error.contains("tasks.submit: storage unavailable"),
        "{done:#}"
    );
    let kids: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:task:{kids"))
        .collect();
    assert_eq!(kids, Vec::<String>::new(), "a task was created");

    let () = redis::cmd("DEL")
        .arg(&count_key)
        .query_async(&mut conn)
        .await?;
    let id = handler_submits(&dtq, 1, Some("k")).await?;
    applied(&dtq, "kids", &id, 1).await?;
    Ok(())
}
