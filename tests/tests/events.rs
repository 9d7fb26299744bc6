//! Live events (`GET /v1/queues/{queue}/events`, Server-Sent Events) against
//! a real redis-server, the real API and worker, and the example handlers:
//! the statuses of a task in order with their ids, resuming with
//! `Last-Event-ID` (or `?since=`) without loss or duplicates, the task
//! filter, the gap after the capped stream was trimmed, the bound on
//! concurrent streams and its release when clients leave or the server
//! shuts down, and the route's refusals.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use dtq_host::client::sse::{SseEvent, SseReader};
use dtq_host::store::{CompleteOutcome, CompletionKind, EventId, QueueKeys};
use dtq_tests::{Dtq, RedisServer, assert_error, completion};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

/// How long a test waits to be sure no event comes.
const QUIET: Duration = Duration::from_millis(500);

/// Open `/v1/queues/default/events{query}`, with `Last-Event-ID` when
/// given and `token` as the bearer token; the raw response.
async fn open(
    dtq: &Dtq,
    query: &str,
    last_event_id: Option<&str>,
    token: Option<&str>,
) -> Result<reqwest::Response> {
    let mut req = reqwest::Client::new()
        .get(format!("{}/v1/queues/default/events{query}", dtq.api))
        .header("Accept", "text/event-stream");
    if let Some(id) = last_event_id {
        req = req.header("Last-Event-ID", id);
    }
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    Ok(req.send().await?)
}

/// A subscription that must be accepted (200, `text/event-stream`).
async fn subscribe(dtq: &Dtq, query: &str, last_event_id: Option<&str>) -> Result<SseReader> {
    let response = open(dtq, query, last_event_id, None).await?;
    let status = response.status();
    if status != 200 {
        bail!("subscribe {query}: {status} {}", response.text().await?);
    }
    let kind = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    ensure!(kind.starts_with("text/event-stream"), "content-type {kind}");
    Ok(SseReader::new(response))
}

/// A refused subscription: its status and JSON error body.
async fn refused(
    dtq: &Dtq,
    query: &str,
    last_event_id: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, Value)> {
    let response = open(dtq, query, last_event_id, token).await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let body = serde_json::from_str(&text).with_context(|| format!("not JSON: {text:?}"))?;
    Ok((status, body))
}

/// The next event, within `WAIT`.
async fn next(events: &mut SseReader) -> Result<SseEvent> {
    match tokio::time::timeout(WAIT, events.next()).await {
        Ok(Ok(Some(event))) => Ok(event),
        Ok(Ok(None)) => bail!("the stream ended"),
        Ok(Err(e)) => bail!("the stream broke: {e}"),
        Err(_) => bail!("no event within {WAIT:?}"),
    }
}

/// Nothing arrives within [`QUIET`].
async fn quiet(events: &mut SseReader) -> Result<()> {
    match tokio::time::timeout(QUIET, events.next()).await {
        Err(_) => Ok(()),
        Ok(got) => bail!("expected no event, got {got:?}"),
    }
}

/// An event's data, parsed, checked against its name and id.
fn data(event: &SseEvent) -> Result<Value> {
    let data: Value = serde_json::from_str(&event.data)?;
    ensure!(
        data["status"] == event.event.as_str(),
        "event {} has data {data}",
        event.event
    );
    let id = event.id.as_deref().context("a status event has an id")?;
    id.parse::<EventId>()
        .with_context(|| format!("id {id:?}"))?;
    Ok(data)
}

/// The id of a status event.
fn id(event: &SseEvent) -> EventId {
    event
        .id
        .as_deref()
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no id on {event:?}"))
}

/// Events until one of a final status of task `task`; (status, attempt)
/// of each of that task's, in order, and every id seen.
async fn until_final(events: &mut SseReader, task: &str) -> Result<Vec<(String, u64)>> {
    let mut seen = Vec::new();
    let mut last: Option<EventId> = None;
    loop {
        let event = next(events).await?;
        let d = data(&event)?;
        let this = id(&event);
        ensure!(
            last.is_none_or(|l| l < this),
            "ids out of order: {last:?} then {this}"
        );
        last = Some(this);
        if d["task_id"] != task {
            continue;
        }
        seen.push((
            event.event.clone(),
            d["attempt"].as_u64().unwrap_or(u64::MAX),
        ));
        if matches!(
            event.event.as_str(),
            "SUCCEEDED" | "FAILED" | "DEAD_LETTERED"
        ) {
            return Ok(seen);
        }
    }
}

fn pairs(statuses: &[(&str, u64)]) -> Vec<(String, u64)> {
    statuses.iter().map(|(s, a)| (s.to_string(), *a)).collect()
}

async fn submit(dtq: &Dtq, body: Value) -> Result<String> {
    dtq.submit_new("default", body, None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn running_events_show_every_attempt_start() -> Result<()> {
    let dtq = Dtq::start(true, &["--events", "all"]).await?;
    let mut events = subscribe(&dtq, "", None).await?;
    let echo = submit(&dtq, json!({"task": "echo", "payload": {"a": 1}})).await?;
    assert_eq!(
        until_final(&mut events, &echo).await?,
        pairs(&[("QUEUED", 0), ("RUNNING", 1), ("SUCCEEDED", 1)])
    );
    let flaky = submit(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}}),
    )
    .await?;
    assert_eq!(
        until_final(&mut events, &flaky).await?,
        pairs(&[
            ("QUEUED", 0),
            ("RUNNING", 1),
            ("RETRYING", 1),
            ("QUEUED", 1),
            ("RUNNING", 2),
            ("SUCCEEDED", 2),
        ])
    );
    Ok(())
}

/// With `--events all` a carried first attempt still starts without the
/// `start` script: the store writes the RUNNING events of a read's carried
/// deliveries as one entry, beside the script's call for the others (whose
/// events the script writes, in an entry of its own), before any of them
/// runs. With the default, a carried attempt has no RUNNING event.
#[tokio::test(flavor = "multi_thread")]
async fn carried_attempts_get_their_running_events_in_one_entry_without_start() -> Result<()> {
    for (flags, written) in [(&["--events", "all"][..], true), (&[][..], false)] {
        let dtq = Dtq::start(false, flags).await?;
        let mut carried = Vec::new();
        for n in 0..3 {
            carried.push(submit(&dtq, json!({"task": "echo", "payload": n})).await?);
        }
        // An expiry: not carried, started by the script.
        let scripted = submit(
            &dtq,
            json!({"task": "echo", "payload": 3, "expires_in_ms": 600_000}),
        )
        .await?;
        let runs = dtq.read_and_start("tester", 10).await?;
        for (delivery, task) in &runs {
            let by_script = delivery.task_id == scripted;
            assert_eq!(task.carried_at.is_none(), by_script, "{task:?}");
        }
        assert_eq!(runs.len(), 4);

        let events = dtq.redis.queue_events("default").await?;
        let running = |id: &String| {
            events
                .iter()
                .find(|e| &e.task_id == id && e.status == "RUNNING")
                .map(|e| (e.attempt, e.id.entry))
        };
        let script_entry = running(&scripted).context("the script's RUNNING event")?;
        assert_eq!(script_entry.0, Some(1));
        let entries: Vec<_> = carried.iter().map(running).collect();
        if written {
            let first = entries[0].context("a carried attempt's RUNNING event")?;
            assert_eq!(first.0, Some(1));
            assert!(entries.iter().all(|e| *e == Some(first)), "{entries:?}");
            assert_ne!(first.1, script_entry.1, "the script writes its own entry");
        } else {
            assert!(entries.iter().all(Option::is_none), "{entries:?}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn with_events_off_nothing_is_written_and_the_route_says_so() -> Result<()> {
    let dtq = Dtq::start(true, &["--events", "none"]).await?;
    let flaky = submit(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}}),
    )
    .await?;
    let task = dtq
        .wait_for("default", &flaky, &["SUCCEEDED"], Duration::from_secs(20))
        .await?;
    assert_eq!(task["attempts"], 2, "{task:#}");
    let cancelled = dtq
        .submit_new(
            "default",
            json!({"task": "echo", "payload": 1, "delay_ms": 60_000}),
            None,
        )
        .await?;
    let (status, body) = dtq
        .call(
            reqwest::Method::POST,
            &format!("/v1/queues/default/tasks/{cancelled}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    let exists: u64 = redis::cmd("EXISTS")
        .arg(QueueKeys::new("default").events)
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    assert_eq!(exists, 0, "an events stream was written");
    let response = dtq
        .call(reqwest::Method::GET, "/v1/queues/default/events", None, &[])
        .await?;
    assert_error(&response, 409, "EVENTS_OFF");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_sees_each_status_in_order_with_ids() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let mut events = subscribe(&dtq, "", None).await?;

    // A first attempt is carried by its message, with no `start`: it has no
    // RUNNING event (see `running_events_show_every_attempt_start`).
    let echo = submit(&dtq, json!({"task": "echo", "payload": {"a": 1}})).await?;
    assert_eq!(
        until_final(&mut events, &echo).await?,
        pairs(&[("QUEUED", 0), ("SUCCEEDED", 1)])
    );

    // A retry: the failed attempt, its wait, and the attempt that succeeds,
    // begun by `start`.
    let flaky = submit(
        &dtq,
        json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}}),
    )
    .await?;
    assert_eq!(
        until_final(&mut events, &flaky).await?,
        pairs(&[
            ("QUEUED", 0),
            ("RETRYING", 1),
            ("QUEUED", 1),
            ("RUNNING", 2),
            ("SUCCEEDED", 2),
        ])
    );
    // The data's `at` is a time, and nothing else was sent.
    let task = dtq.task("default", &flaky).await?;
    assert_eq!(task["status"], "SUCCEEDED");
    quiet(&mut events).await
}

#[tokio::test(flavor = "multi_thread")]
async fn resuming_after_last_event_id_loses_and_repeats_nothing() -> Result<()> {
    // No worker: each submission is one QUEUED event, in submission order.
    let dtq = Dtq::start(false, &[]).await?;
    let mut first = subscribe(&dtq, "", None).await?;
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(submit(&dtq, json!({"task": "echo", "payload": n})).await?);
    }
    let mut read = Vec::new();
    for _ in 0..2 {
        read.push(next(&mut first).await?);
    }
    drop(first);
    for n in 5..10 {
        ids.push(submit(&dtq, json!({"task": "echo", "payload": n})).await?);
    }
    let last = read[1].id.clone().context("an id")?;

    // With the header, as an EventSource reconnects.
    let mut resumed = subscribe(&dtq, "", Some(&last)).await?;
    for want in &ids[2..] {
        let event = next(&mut resumed).await?;
        assert_eq!(
            (event.event.as_str(), &data(&event)?["task_id"]),
            ("QUEUED", &json!(want))
        );
    }
    quiet(&mut resumed).await?;

    // With `?since=`; the header wins over it.
    let mut since = subscribe(&dtq, &format!("?since={last}"), None).await?;
    let event = next(&mut since).await?;
    assert_eq!(data(&event)?["task_id"], json!(ids[2]));
    let after_fifth = read_id_of_nth(&dtq, 5).await?;
    let mut both = subscribe(&dtq, "?since=0-0", Some(&after_fifth)).await?;
    let event = next(&mut both).await?;
    assert_eq!(data(&event)?["task_id"], json!(ids[5]));

    // Without either: only what happens from now on.
    let mut fresh = subscribe(&dtq, "", None).await?;
    quiet(&mut fresh).await?;
    let eleventh = submit(&dtq, json!({"task": "echo", "payload": 10})).await?;
    assert_eq!(data(&next(&mut fresh).await?)?["task_id"], json!(eleventh));

    // An id newer than anything the stream holds (Redis restarted empty,
    // say) is read as "new events only".
    let mut ahead = subscribe(&dtq, "", Some("99999999999999-0")).await?;
    quiet(&mut ahead).await?;
    let twelfth = submit(&dtq, json!({"task": "echo", "payload": 11})).await?;
    assert_eq!(data(&next(&mut ahead).await?)?["task_id"], json!(twelfth));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completion_batch_is_one_entry_and_resumes_inside_it() -> Result<()> {
    // No worker: the test reads, runs and completes the tasks as one, so
    // that their four completions are one batch.
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for n in 0..4 {
        ids.push(submit(&dtq, json!({"task": "echo", "payload": n})).await?);
    }
    let mut live = subscribe(&dtq, "", None).await?;
    let entries_before = stream_ids(&dtq.redis).await?.len();

    let taken = dtq.read_and_start("test", 16).await?;
    ensure!(taken.len() == 4, "read {} of 4", taken.len());
    let completions: Vec<_> = taken
        .iter()
        .map(|(delivery, task)| completion(delivery, task, CompletionKind::Success))
        .collect();
    let outcomes = dtq.store.complete(&completions).await?;
    ensure!(
        outcomes
            .iter()
            .all(|o| matches!(o, CompleteOutcome::Done(_))),
        "{outcomes:?}"
    );
    let entries = stream_ids(&dtq.redis).await?;
    assert_eq!(entries.len(), entries_before + 1, "one entry for the batch");
    let entry = entries.last().context("an entry")?;

    // Each event its own id: its place in the entry, but the last.
    let mut seen = Vec::new();
    for _ in 0..4 {
        let event = next(&mut live).await?;
        let d = data(&event)?;
        seen.push((event.id.clone().context("an id")?, d["task_id"].clone()));
    }
    let want: Vec<(String, Value)> = ["0", "1", "2", ""]
        .iter()
        .zip(&ids)
        .map(|(k, task)| {
            let id = if k.is_empty() {
                entry.clone()
            } else {
                format!("{entry}.{k}")
            };
            (id, json!(task))
        })
        .collect();
    assert_eq!(seen, want);
    quiet(&mut live).await?;

    // Resumed after the second, with the header or `?since=`: the third
    // and fourth, nothing repeated.
    let second = &want[1].0;
    for (query, header) in [
        ("", Some(second.as_str())),
        (&format!("?since={second}"), None),
    ] {
        let mut resumed = subscribe(&dtq, query, header).await?;
        for (id, task) in &want[2..] {
            let event = next(&mut resumed).await?;
            assert_eq!(
                (event.id.as_ref(), &data(&event)?["task_id"]),
                (Some(id), task)
            );
        }
        quiet(&mut resumed).await?;
    }
    // After the last: nothing of the entry.
    let mut after_all = subscribe(&dtq, "", Some(entry)).await?;
    quiet(&mut after_all).await?;
    // The task filter keeps its place inside the entry too.
    let mut one = subscribe(&dtq, &format!("?task_id={}&since=0", ids[2]), None).await?;
    assert_eq!(data(&next(&mut one).await?)?["status"], "QUEUED");
    let event = next(&mut one).await?;
    assert_eq!(event.id.as_ref(), Some(&want[2].0));
    quiet(&mut one).await
}

/// The id of the `n`th (from 1) entry of the default queue's events stream.
async fn read_id_of_nth(dtq: &Dtq, n: usize) -> Result<String> {
    let entries = stream_ids(&dtq.redis).await?;
    entries.get(n - 1).cloned().context("fewer entries")
}

/// Every entry id of the default queue's events stream, oldest first.
async fn stream_ids(redis: &dtq_tests::TestRedis) -> Result<Vec<String>> {
    let mut conn = redis.conn().await?;
    let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(QueueKeys::new("default").events)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await?;
    Ok(entries.into_iter().map(|(id, _)| id).collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_task_filter_keeps_one_tasks_events() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let a = submit(&dtq, json!({"task": "echo", "payload": "a"})).await?;
    let b = submit(&dtq, json!({"task": "echo", "payload": "b"})).await?;
    let c = submit(&dtq, json!({"task": "echo", "payload": "c"})).await?;

    // From the start of the stream, B's events only.
    let mut events = subscribe(&dtq, &format!("?task_id={b}&since=0"), None).await?;
    let queued = next(&mut events).await?;
    assert_eq!(
        (queued.event.as_str(), &data(&queued)?["task_id"]),
        ("QUEUED", &json!(b))
    );
    // A's and C's cancels come first and are not sent.
    for id in [&a, &c, &b] {
        let (status, body) = dtq
            .call(
                reqwest::Method::POST,
                &format!("/v1/queues/default/tasks/{id}/cancel"),
                None,
                &[],
            )
            .await?;
        assert_eq!(status, 200, "{body}");
    }
    let cancelled = next(&mut events).await?;
    assert_eq!(
        (cancelled.event.as_str(), &data(&cancelled)?["task_id"]),
        ("CANCELLED", &json!(b))
    );
    assert!(id(&cancelled) > id(&queued));
    quiet(&mut events).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_behind_the_trimmed_stream_is_told_of_the_gap() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for n in 0..10 {
        ids.push(submit(&dtq, json!({"task": "echo", "payload": n})).await?);
    }
    let entries = stream_ids(&dtq.redis).await?;
    assert_eq!(entries.len(), 10);
    // The stream's cap at work (MAXLEN ~ trims whole nodes of 100 entries,
    // so a handful of events is trimmed exactly here): the oldest 5 go.
    let mut conn = dtq.redis.conn().await?;
    let trimmed: u64 = redis::cmd("XTRIM")
        .arg(QueueKeys::new("default").events)
        .arg("MAXLEN")
        .arg(5)
        .query_async(&mut conn)
        .await?;
    assert_eq!(trimmed, 5);

    // After the 3rd: the 4th and 5th are gone. A gap first, then the rest
    // from the oldest left.
    let mut events = subscribe(&dtq, "", Some(&entries[2])).await?;
    let gap = next(&mut events).await?;
    assert_eq!(gap.event, "gap");
    assert_eq!(gap.id, None, "a gap is not a place to resume from");
    assert_eq!(
        serde_json::from_str::<Value>(&gap.data)?,
        json!({"last_event_id": entries[2], "oldest_id": entries[5]})
    );
    for want in &ids[5..] {
        assert_eq!(data(&next(&mut events).await?)?["task_id"], json!(want));
    }
    quiet(&mut events).await?;

    // From the beginning, too: events were lost.
    let mut all = subscribe(&dtq, "?since=0", None).await?;
    assert_eq!(next(&mut all).await?.event, "gap");

    // After the 6th, which is still there: no gap.
    let mut later = subscribe(&dtq, "", Some(&entries[5])).await?;
    let event = next(&mut later).await?;
    assert_eq!(
        (event.event.as_str(), &data(&event)?["task_id"]),
        ("QUEUED", &json!(ids[6]))
    );
    Ok(())
}

/// Redis clients blocked in XREAD: the event streams' connections.
async fn blocked_xreads(redis: &RedisServer) -> Result<usize> {
    let mut conn = redis.conn().await?;
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await?;
    Ok(clients
        .lines()
        .filter(|line| {
            line.contains("cmd=xread ")
                && line
                    .split(' ')
                    .any(|f| f.strip_prefix("flags=").is_some_and(|v| v.contains('b')))
        })
        .count())
}

async fn wait_blocked_xreads(redis: &RedisServer, want: usize) -> Result<()> {
    let start = Instant::now();
    loop {
        let n = blocked_xreads(redis).await?;
        if n == want {
            return Ok(());
        }
        ensure!(start.elapsed() < WAIT, "{n} blocked XREADs, want {want}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_are_bounded_and_released_when_their_clients_leave() -> Result<()> {
    let dtq = Dtq::start(false, &["--api-max-event-streams", "2"]).await?;
    let first = subscribe(&dtq, "", None).await?;
    let mut second = subscribe(&dtq, "", None).await?;
    // Each holds a Redis connection of its own, blocked in XREAD.
    wait_blocked_xreads(dtq.redis.single(), 2).await?;

    let full = refused(&dtq, "", None, None).await?;
    assert_error(&full, 503, "TOO_MANY_EVENT_STREAMS");
    assert_eq!(full.1["error"]["details"]["max"], 2);

    // A client that goes away gives its slot and its connection back.
    drop(first);
    wait_blocked_xreads(dtq.redis.single(), 1).await?;
    let start = Instant::now();
    let mut third = loop {
        let response = open(&dtq, "", None, None).await?;
        if response.status() == 200 {
            break SseReader::new(response);
        }
        ensure!(start.elapsed() < WAIT, "the slot did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    wait_blocked_xreads(dtq.redis.single(), 2).await?;

    // Both streams still work.
    let id = submit(&dtq, json!({"task": "echo", "payload": 1})).await?;
    for events in [&mut second, &mut third] {
        assert_eq!(data(&next(events).await?)?["task_id"], json!(id));
    }
    drop((second, third));
    wait_blocked_xreads(dtq.redis.single(), 0).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_outlives_the_header_and_body_timeouts() -> Result<()> {
    let dtq = Dtq::start(
        false,
        &[
            "--api-header-timeout-ms",
            "200",
            "--api-body-timeout-ms",
            "200",
        ],
    )
    .await?;
    let mut events = subscribe(&dtq, "", None).await?;
    // Quiet for several times both timeouts; then an event still comes.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let id = submit(&dtq, json!({"task": "echo", "payload": 1})).await?;
    assert_eq!(data(&next(&mut events).await?)?["task_id"], json!(id));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_survives_a_redis_restart() -> Result<()> {
    let mut dtq = Dtq::start(false, &[]).await?;
    let mut events = subscribe(&dtq, "", None).await?;
    let before = submit(&dtq, json!({"task": "echo", "payload": 1})).await?;
    let first = next(&mut events).await?;
    assert_eq!(data(&first)?["task_id"], json!(before));
    wait_blocked_xreads(dtq.redis.single(), 1).await?;

    // Connections drop and the data is gone; the stream stays open, reads
    // again with backoff, and goes on with what happens next.
    dtq.redis.restart()?;
    let start = Instant::now();
    let after = loop {
        match submit(&dtq, json!({"task": "echo", "payload": 2})).await {
            Ok(id) => break id,
            Err(e) => {
                ensure!(
                    start.elapsed() < WAIT,
                    "no submission after the restart: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let event = next(&mut events).await?;
    assert_eq!(data(&event)?["task_id"], json!(after));
    assert!(id(&event) > id(&first));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_ends_open_streams() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut events = subscribe(&dtq, "", None).await?;
    let started = Instant::now();
    // Stops the API (and Redis): the stream must end, not hang until the
    // graceful shutdown gives up on it.
    drop(dtq);
    match tokio::time::timeout(WAIT, events.next()).await {
        Ok(Ok(None) | Err(_)) => {}
        Ok(Ok(Some(event))) => bail!("an event after the shutdown: {event:?}"),
        Err(_) => bail!("the stream is still open {WAIT:?} after the shutdown"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_subscriptions_are_refused_with_a_code() -> Result<()> {
    let dtq = Dtq::start(
        false,
        &["--tokens", "submitter submit default;reader read default"],
    )
    .await?;
    let reader = Some("reader");
    assert_error(
        &refused(&dtq, "?since=yesterday", None, reader).await?,
        400,
        "INVALID_EVENT_ID",
    );
    assert_error(
        &refused(&dtq, "", Some("$"), reader).await?,
        400,
        "INVALID_EVENT_ID",
    );
    assert_error(
        &refused(&dtq, "?from=0", None, reader).await?,
        400,
        "INVALID_QUERY",
    );
    assert_error(
        &refused(&dtq, "?task_id=", None, reader).await?,
        400,
        "INVALID_QUERY",
    );
    assert_error(&refused(&dtq, "", None, None).await?, 401, "UNAUTHORIZED");
    assert_error(
        &refused(&dtq, "", None, Some("submitter")).await?,
        403,
        "FORBIDDEN",
    );
    let ok = open(&dtq, "", None, reader).await?;
    assert_eq!(ok.status(), 200);
    Ok(())
}

/// Every Redis client connected now (CLIENT LIST), read on `conn`.
async fn redis_clients(conn: &mut redis::aio::MultiplexedConnection) -> Result<usize> {
    let clients: String = redis::cmd("CLIENT").arg("LIST").query_async(conn).await?;
    Ok(clients.lines().filter(|l| !l.trim().is_empty()).count())
}

/// Bounded connections (issue 31): a subscriber of a partitioned queue's
/// merged events holds one Redis connection, whatever the partition
/// count, and each counts once against `--api-max-event-streams`.
#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_of_every_partition_holds_one_redis_connection() -> Result<()> {
    const PARTITIONS: u32 = 8;
    let dtq = Dtq::start(false, &["--api-max-event-streams", "2"]).await?;
    dtq.store
        .raise_partitions("default", PARTITIONS, dtq_host::base::now_ms())
        .await?;
    let redis = dtq.redis.single();
    let mut probe = redis.conn().await?;

    // One connection blocked in one XREAD per subscriber, whatever the
    // partition count (a connection per partition made it 8, then 16).
    // Counted as blocked XREADs, not as clients: the API opens other
    // connections of its own (its store, its registry) when it likes.
    let mut first = subscribe(&dtq, "", None).await?;
    wait_blocked_xreads(redis, 1).await?;
    let second = subscribe(&dtq, "", None).await?;
    wait_blocked_xreads(redis, 2).await?;
    let clients = redis_clients(&mut probe).await?;
    assert_eq!(
        blocked_xreads(redis).await?,
        2,
        "two subscribers of {PARTITIONS} partitions ({clients} Redis clients)"
    );
    let full = refused(&dtq, "", None, None).await?;
    assert_error(&full, 503, "TOO_MANY_EVENT_STREAMS");

    // The one connection reads every partition: unkeyed tasks spread over
    // all of them, and each one's QUEUED arrives.
    let mut ids = std::collections::BTreeSet::new();
    for i in 0..2 * PARTITIONS {
        ids.insert(submit(&dtq, json!({"task": "echo", "payload": i})).await?);
    }
    let partitions: std::collections::BTreeSet<u32> = ids
        .iter()
        .map(|id| dtq_host::store::partition_of_id(id))
        .collect();
    assert_eq!(partitions.len(), PARTITIONS as usize, "{ids:?}");
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < ids.len() {
        let event = next(&mut first).await?;
        let id = event.id.clone().context("an id")?;
        assert_eq!(id.split(',').count(), PARTITIONS as usize, "{id}");
        let data: Value = serde_json::from_str(&event.data)?;
        seen.insert(data["task_id"].as_str().context("task_id")?.to_owned());
    }
    assert_eq!(seen, ids);
    drop((first, second));
    wait_blocked_xreads(redis, 0).await
}
