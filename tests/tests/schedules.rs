//! Periodic tasks (issue 13): a schedule makes one task per tick across
//! the whole fleet, however many workers race to fire it, a tick fired
//! again (a scheduler that died between its submit and its advance) makes
//! no second task, missed ticks fire once, a deleted schedule stops, and a
//! bad schedule is refused with nothing written.
//!
//! Every test runs against a real redis-server. Workers run in this process,
//! each with a Redis connection of its own, as separate processes would;
//! the deterministic tests drive the scheduler's steps
//! ([`dtq_host::worker::Scheduler`]) at times of their choosing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::store::{QueueKeys, Store};
use dtq_host::worker::{Fired, Scheduler, TickSubmission};
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const ADMIN: &str = "schedules-admin-token";
const QUEUE: &str = "ticks";

/// Longest wait for something the fleet does on its own.
const WAIT: Duration = Duration::from_secs(60);

async fn start() -> Result<Dtq> {
    Dtq::start(false, &["--admin-token", ADMIN, "--queues", QUEUE]).await
}

/// A call to the API with the admin token.
async fn admin(dtq: &Dtq, method: Method, path: &str, body: Option<Value>) -> Result<(u16, Value)> {
    let auth = format!("Bearer {ADMIN}");
    dtq.call(method, path, body, &[("Authorization", &auth)])
        .await
}

async fn put_schedule(dtq: &Dtq, name: &str, body: Value) -> Result<(u16, Value)> {
    let path = format!("/v1/queues/{QUEUE}/schedules/{name}");
    admin(dtq, Method::PUT, &path, Some(body)).await
}

async fn list(dtq: &Dtq) -> Result<Vec<Value>> {
    let path = format!("/v1/queues/{QUEUE}/schedules");
    let (status, body) = admin(dtq, Method::GET, &path, None).await?;
    ensure!(status == 200, "list: {status} {body}");
    Ok(body["schedules"]
        .as_array()
        .context("no schedules")?
        .clone())
}

async fn next_at(dtq: &Dtq, name: &str) -> Result<u64> {
    list(dtq)
        .await?
        .iter()
        .find(|s| s["name"] == name)
        .and_then(|s| s["next_at"].as_u64())
        .with_context(|| format!("schedule {name} has no next tick"))
}

/// The tick → task of every task `name` made: the idempotency records of
/// its tick keys.
async fn ticks(dtq: &Dtq, name: &str) -> Result<BTreeMap<u64, String>> {
    let prefix = format!("dtq:idempotency:{{{QUEUE}}}:schedule:{name}:");
    let mut out = BTreeMap::new();
    for key in dtq.redis.keys().await? {
        if let Some(tick) = key.strip_prefix(&prefix) {
            let tick: u64 = tick.parse()?;
            let rec = dtq
                .redis
                .idem_record(QUEUE, &format!("schedule:{name}:{tick}"))
                .await?
                .context("a record")?;
            let task_id = rec["task_id"].as_str().context("task_id")?.to_owned();
            out.insert(tick, task_id);
        }
    }
    Ok(out)
}

/// Tasks ever created in the queue: its submission index.
async fn tasks_created(dtq: &Dtq) -> Result<u64> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("XLEN")
        .arg(&QueueKeys::new(QUEUE).index)
        .query_async(&mut conn)
        .await?)
}

fn scheduler(dtq: &Dtq) -> Scheduler {
    Scheduler::new(
        dtq.store.clone(),
        Some(dtq.sandbox.clone()),
        dtq.config.ingest_settings(),
    )
}

/// A worker consuming the queue, run in this process on a Redis connection
/// of its own (as another process would be).
struct Worker {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Worker {
    async fn start(dtq: &Dtq) -> Result<Worker> {
        let config = dtq.config.worker();
        let store =
            Store::connect(&dtq.config.store.redis_url, dtq.config.store_settings()).await?;
        let stop = CancellationToken::new();
        let run = dtq_host::worker::run(
            store,
            dtq.sandbox.clone(),
            config,
            stop.clone().cancelled_owned(),
        );
        let handle = tokio::spawn(async move {
            if let Err(e) = run.await {
                panic!("worker failed: {e}");
            }
        });
        Ok(Worker { stop, handle })
    }

    async fn stop(self) -> Result<()> {
        self.stop.cancel();
        self.handle.await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_tick_makes_one_task_with_three_workers_racing_and_delete_stops_it() -> Result<()> {
    let dtq = start().await?;
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(Worker::start(&dtq).await?);
    }
    let (status, body) = put_schedule(
        &dtq,
        "every-second",
        json!({"cron": "* * * * * *", "task": "echo", "payload": {"n": 1}}),
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["timezone"], "UTC");

    // Let it fire a few ticks, the three schedulers racing for each.
    let started = Instant::now();
    while ticks(&dtq, "every-second").await?.len() < 5 {
        if started.elapsed() > WAIT {
            bail!("fewer than 5 ticks fired in {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let listed = list(&dtq).await?;
    let last = &listed[0]["last"];
    assert!(
        last["tick"].as_u64().is_some() && last["task_id"].is_string(),
        "{listed:?}"
    );

    let path = format!("/v1/queues/{QUEUE}/schedules/every-second");
    let (status, body) = admin(&dtq, Method::DELETE, &path, None).await?;
    assert_eq!(status, 200, "{body}");
    // A tick a scheduler read before the delete may still make its task;
    // after that, nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after_delete = ticks(&dtq, "every-second").await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let fired = ticks(&dtq, "every-second").await?;
    assert_eq!(fired, after_delete, "a deleted schedule fired again");
    assert!(list(&dtq).await?.is_empty());

    // One task per tick: as many tasks as ticks, each tick's its own, on
    // whole seconds; and no task the schedule made without its tick key.
    let distinct: BTreeSet<&String> = fired.values().collect();
    assert_eq!(
        distinct.len(),
        fired.len(),
        "two ticks share a task: {fired:?}"
    );
    assert_eq!(
        tasks_created(&dtq).await?,
        fired.len() as u64,
        "a tick made more than one task: {fired:?}"
    );
    for (tick, id) in &fired {
        assert_eq!(tick % 1000, 0);
        let task = dtq.task(QUEUE, id).await?;
        assert_eq!(
            task["idempotency_key"],
            format!("schedule:every-second:{tick}")
        );
        assert_eq!(task["task"], "echo");
        assert!(task["created_at"].as_u64() >= Some(*tick), "{task}");
    }
    for worker in workers {
        worker.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tick_fired_again_after_a_crash_makes_no_second_task() -> Result<()> {
    let dtq = start().await?;
    let (status, body) = put_schedule(
        &dtq,
        "crashy",
        json!({"cron": "* * * * *", "task": "echo", "payload": "x", "max_attempts": 2}),
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    let due = next_at(&dtq, "crashy").await?;
    let scheduler = scheduler(&dtq);
    let def = dtq
        .store
        .schedule_def(QUEUE, "crashy")
        .await?
        .context("stored")?;

    // A scheduler submits the tick's task and dies before its advance.
    let first = scheduler.submit_tick(QUEUE, "crashy", &def, due).await?;
    let TickSubmission::Task {
        task_id,
        duplicate: false,
    } = first
    else {
        bail!("the first submit made no new task: {first:?}");
    };
    assert_eq!(next_at(&dtq, "crashy").await?, due, "nothing advanced it");

    // The next scheduler fires the same tick: the same task, and it advances.
    let fired = scheduler.fire(QUEUE, "crashy", due, due + 10).await?;
    assert_eq!(
        fired,
        Fired::Advanced {
            next: Some(due + 60_000)
        }
    );
    // A third, which read the same due time, races it and changes nothing.
    let raced = scheduler.fire(QUEUE, "crashy", due, due + 20).await?;
    assert_eq!(raced, Fired::Raced);

    assert_eq!(tasks_created(&dtq).await?, 1);
    assert_eq!(
        ticks(&dtq, "crashy").await?,
        BTreeMap::from([(due, task_id.clone())])
    );
    let listed = list(&dtq).await?;
    assert_eq!(listed[0]["last"]["task_id"], task_id.as_str());
    assert_eq!(listed[0]["last"]["tick"], due);
    assert_eq!(listed[0]["next_at"], due + 60_000);
    let task = dtq.task(QUEUE, &task_id).await?;
    assert_eq!(
        (task["max_attempts"].as_u64(), task["payload"].as_str()),
        (Some(2), Some("x"))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missed_stretch_fires_once_for_its_latest_tick() -> Result<()> {
    let dtq = start().await?;
    let (status, body) = put_schedule(
        &dtq,
        "catch-up",
        json!({"cron": "* * * * * *", "task": "echo"}),
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    let due = next_at(&dtq, "catch-up").await?;
    let scheduler = scheduler(&dtq);

    // Nobody fired it for five and a half seconds: one task, for the
    // latest tick, and the next tick is the first one after now.
    let pass = scheduler.pass(QUEUE, due + 5_500).await?;
    assert_eq!(pass.advanced, 1);
    assert_eq!(
        ticks(&dtq, "catch-up")
            .await?
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        [due + 5_000]
    );
    assert_eq!(tasks_created(&dtq).await?, 1);
    assert_eq!(next_at(&dtq, "catch-up").await?, due + 6_000);

    // Nothing more is due until then.
    let pass = scheduler.pass(QUEUE, due + 5_900).await?;
    assert_eq!((pass.advanced, pass.next), (0, Some(due + 6_000)));
    assert_eq!(tasks_created(&dtq).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_schedule_never_fires_and_is_not_brought_back() -> Result<()> {
    let dtq = start().await?;
    let (status, _) =
        put_schedule(&dtq, "gone", json!({"cron": "* * * * * *", "task": "echo"})).await?;
    assert_eq!(status, 201);
    let due = next_at(&dtq, "gone").await?;
    let path = format!("/v1/queues/{QUEUE}/schedules/gone");
    let (status, _) = admin(&dtq, Method::DELETE, &path, None).await?;
    assert_eq!(status, 200);
    let again = admin(&dtq, Method::DELETE, &path, None).await?;
    assert_error(&again, 404, "UNKNOWN_SCHEDULE");

    // A scheduler that read its due time before the delete advances nothing.
    let scheduler = scheduler(&dtq);
    assert_eq!(
        scheduler.fire(QUEUE, "gone", due, due + 10).await?,
        Fired::Raced
    );
    assert_eq!(scheduler.pass(QUEUE, due + 60_000).await?.advanced, 0);
    assert_eq!(tasks_created(&dtq).await?, 0);
    let left: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:schedule"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn putting_a_schedule_again_replaces_it_and_recomputes_its_next_tick() -> Result<()> {
    let dtq = start().await?;
    let (status, body) =
        put_schedule(&dtq, "report", json!({"cron": "0 0 1 1 *", "task": "echo"})).await?;
    assert_eq!(status, 201, "{body}");
    let yearly = body["next_at"].as_u64().context("next_at")?;
    let before = dtq_host::base::now_ms();
    let (status, body) = put_schedule(
        &dtq,
        "report",
        json!({"cron": "*/5 * * * * *", "task": "echo", "payload": [1]}),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    let listed = list(&dtq).await?;
    assert_eq!(listed.len(), 1);
    let next = listed[0]["next_at"].as_u64().context("next_at")?;
    assert!(
        next < yearly && next > before && next % 5_000 == 0,
        "{listed:?}"
    );
    assert_eq!(listed[0]["cron"], "*/5 * * * * *");
    assert_eq!(listed[0]["payload"], json!([1]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_schedule_is_refused_with_its_code_and_nothing_is_written() -> Result<()> {
    let dtq = start().await?;
    let cases = [
        (
            json!({"cron": "not a cron", "task": "echo"}),
            422,
            "INVALID_CRON",
        ),
        (
            json!({"cron": "* * * *", "task": "echo"}),
            422,
            "INVALID_CRON",
        ),
        (
            json!({"cron": "0 0 0 1 1 * 2030", "task": "echo"}),
            422,
            "INVALID_CRON",
        ),
        (
            json!({"cron": "61 * * * *", "task": "echo"}),
            422,
            "INVALID_CRON",
        ),
        (
            json!({"cron": "0 0 30 2 *", "task": "echo"}),
            422,
            "INVALID_CRON",
        ),
        (
            json!({"cron": "* * * * *", "task": "no_such_task"}),
            400,
            "UNKNOWN_TASK",
        ),
        (
            json!({"cron": "* * * * *", "task": "bad:name"}),
            400,
            "INVALID_TASK_NAME",
        ),
        (
            json!({"cron": "* * * * *", "task": "echo", "max_attempts": 0}),
            400,
            "INVALID_MAX_ATTEMPTS",
        ),
        (
            json!({"cron": "* * * * *", "task": "echo", "max_attempts": "3"}),
            400,
            "INVALID_MAX_ATTEMPTS",
        ),
        (
            json!({"cron": "* * * * *", "task": "echo", "timeout_ms": 0}),
            400,
            "INVALID_TIMEOUT",
        ),
        (
            json!({"cron": "* * * * *", "task": "echo", "delay_ms": 5}),
            400,
            "INVALID_REQUEST",
        ),
        (json!({"task": "echo"}), 400, "INVALID_REQUEST"),
    ];
    for (body, status, code) in cases {
        let response = put_schedule(&dtq, "bad", body.clone()).await?;
        assert_eq!(response.0, status, "{body}: {:?}", response.1);
        assert_error(&response, status, code);
    }
    let response = put_schedule(&dtq, "a:b", json!({"cron": "* * * * *", "task": "echo"})).await?;
    assert_error(&response, 400, "INVALID_SCHEDULE_NAME");
    // Changing schedules needs the admin token.
    let path = format!("/v1/queues/{QUEUE}/schedules/bad");
    let body = json!({"cron": "* * * * *", "task": "echo"});
    let anonymous = dtq.call(Method::PUT, &path, Some(body), &[]).await?;
    assert!(matches!(anonymous.0, 401 | 403), "{anonymous:?}");

    let written: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:schedule"))
        .collect();
    assert!(written.is_empty(), "a refused schedule wrote {written:?}");
    assert!(list(&dtq).await?.is_empty());
    Ok(())
}
