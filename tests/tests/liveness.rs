//! Worker liveness (issue 9, point 4): a message is reclaimed only from a
//! worker that stopped beating, Redis outages do not make live workers look
//! dead, a stale attempt is stopped and writes nothing.
//!
//! Every test runs against a real redis-server; an outage is the server
//! stopped with SIGSTOP and resumed with SIGCONT (its clients see no error,
//! only silence, as with a hung or overloaded server). Workers run in this
//! process: the harness's, and more started here, each with a Redis
//! connection of its own; a worker "dies" when its future is aborted, which
//! stops every loop it runs without a shutdown.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::store::{GROUP, QueueKeys, Store};
use dtq_tests::{Dtq, RedisServer};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The visibility timeout of every test here.
const VISIBILITY: Duration = Duration::from_millis(600);

/// Longest wait for a task to reach a status.
const WAIT: Duration = Duration::from_secs(30);

fn flags() -> Vec<String> {
    vec![
        "--visibility-timeout-ms".into(),
        VISIBILITY.as_millis().to_string(),
    ]
}

async fn start(with_worker: bool, extra: &[&str]) -> Result<Dtq> {
    let mut all = flags();
    all.extend(extra.iter().map(|s| s.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    Dtq::start(with_worker, &all).await
}

/// Submit a `sleep` task of `ms` milliseconds to the default queue.
async fn submit_sleep(dtq: &Dtq, ms: u64, max_attempts: u32) -> Result<String> {
    dtq.submit_new(
        "default",
        json!({"task": "sleep", "payload": {"ms": ms}, "max_attempts": max_attempts}),
        None,
    )
    .await
}

/// A worker run in this process beside the harness's, on a Redis
/// connection of its own (as another process would have).
struct Worker {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Worker {
    async fn start(dtq: &Dtq, concurrency: usize) -> Result<Worker> {
        let mut config = dtq.config.worker();
        config.concurrency = concurrency;
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

    /// Die as a crashed process does: no shutdown, no more heartbeats, the
    /// running calls dropped, their messages left pending.
    async fn kill(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }

    async fn shutdown(self) -> Result<()> {
        self.stop.cancel();
        Ok(self.handle.await?)
    }
}

/// Pause the Redis server (SIGSTOP) for `length`, then resume it (SIGCONT).
/// Returns when it has been resumed.
async fn outage(redis: &RedisServer, length: Duration) -> Result<()> {
    signal(redis, libc::SIGSTOP)?;
    tokio::time::sleep(length).await;
    signal(redis, libc::SIGCONT)
}

fn signal(redis: &RedisServer, signal: libc::c_int) -> Result<()> {
    // The harness reaps its redis-server child only on drop.
    dtq_tests::process::send_signal(redis.pid(), signal)
}

/// One field of the task hash of `id` in the default queue.
async fn task_field(dtq: &Dtq, id: &str, field: &str) -> Result<Option<String>> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("HGET")
        .arg(QueueKeys::new("default").task(id))
        .arg(field)
        .query_async(&mut conn)
        .await?)
}

/// The consumer task `id`'s current message is pending on: the worker
/// running it (a carried first attempt names no worker in the hash).
async fn runner(dtq: &Dtq, id: &str) -> Result<Option<String>> {
    let Some(msg_id) = task_field(dtq, id, "msg_id").await? else {
        return Ok(None);
    };
    let mut conn = dtq.redis.conn().await?;
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(QueueKeys::new("default").stream)
        .arg(GROUP)
        .arg(&msg_id)
        .arg(&msg_id)
        .arg(1)
        .query_async(&mut conn)
        .await?;
    Ok(pending.into_iter().next().map(|(_, owner, _, _)| owner))
}

/// The lifecycle events of task `id`, in order: (status, attempt).
async fn events(dtq: &Dtq, id: &str) -> Result<Vec<(String, String)>> {
    let events = dtq.redis.task_events("default", id).await?;
    Ok(events
        .into_iter()
        .map(|(status, attempt)| (status, attempt.map(|a| a.to_string()).unwrap_or_default()))
        .collect())
}

fn statuses(events: &[(String, String)]) -> Vec<&str> {
    events.iter().map(|(s, _)| s.as_str()).collect()
}

/// Dead-lettered task ids of the default queue.
async fn dead_letters(dtq: &Dtq) -> Result<Vec<String>> {
    let mut conn = dtq.redis.conn().await?;
    Ok(redis::cmd("ZRANGE")
        .arg(QueueKeys::new("default").dlq)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await?)
}

/// Poll `check` until it returns `Some`, failing after `timeout` with `what`.
async fn wait_until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        ensure!(start.elapsed() < timeout, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Wait until task `id` is RUNNING its attempt `attempt`; its record.
async fn wait_running(dtq: &Dtq, id: &str, attempt: u64) -> Result<Value> {
    wait_until(WAIT, &format!("{id} running attempt {attempt}"), || async {
        let task = dtq.task("default", id).await?;
        Ok((task["status"] == "RUNNING" && task["attempts"] == attempt).then_some(task))
    })
    .await
}

async fn wait_terminal(dtq: &Dtq, id: &str) -> Result<Value> {
    dtq.wait_for(
        "default",
        id,
        &["SUCCEEDED", "FAILED", "DEAD_LETTERED", "CANCELLED"],
        WAIT,
    )
    .await
}

/// Assert that task `id` ran once, in one attempt, and succeeded.
async fn assert_ran_once(dtq: &Dtq, id: &str, ms: u64) -> Result<()> {
    let task = wait_terminal(dtq, id).await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(1)),
        "{task:#}"
    );
    assert_eq!(task["result"], json!({"slept_ms": ms}), "{task:#}");
    // A carried first attempt writes no RUNNING event; any other attempt,
    // begun by `start`, would.
    let events = events(dtq, id).await?;
    assert_eq!(statuses(&events), ["QUEUED", "SUCCEEDED"], "{events:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_worker_keeps_its_task_through_a_redis_outage() -> Result<()> {
    let dtq = start(true, &[]).await?;
    // One attempt only: were the task reclaimed from its live worker, it
    // would be dead-lettered as lost.
    let id = submit_sleep(&dtq, 3_000, 1).await?;
    wait_running(&dtq, &id, 1).await?;
    outage(dtq.redis.single(), VISIBILITY * 2).await?;
    assert_ran_once(&dtq, &id, 3_000).await?;
    assert!(dead_letters(&dtq).await?.is_empty());

    // And again with attempts to spare: the task is not run a second time.
    let id = submit_sleep(&dtq, 3_000, 3).await?;
    wait_running(&dtq, &id, 1).await?;
    outage(dtq.redis.single(), VISIBILITY * 2).await?;
    assert_ran_once(&dtq, &id, 3_000).await
}

#[tokio::test(flavor = "multi_thread")]
async fn another_live_worker_does_not_take_a_task_across_a_redis_outage() -> Result<()> {
    let dtq = start(true, &[]).await?;
    let other = Worker::start(&dtq, 4).await?;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(submit_sleep(&dtq, 3_000, 1).await?);
    }
    let mut owners = Vec::new();
    for id in &ids {
        wait_running(&dtq, id, 1).await?;
        owners.push(runner(&dtq, id).await?.context("no worker")?);
    }
    outage(dtq.redis.single(), VISIBILITY * 2).await?;
    for (id, owner) in ids.iter().zip(&owners) {
        // Still pending on the worker that ran it before the outage.
        if let Some(now) = runner(&dtq, id).await? {
            assert_eq!(&now, owner, "{id}");
        }
        assert_ran_once(&dtq, id, 3_000).await?;
    }
    assert!(dead_letters(&dtq).await?.is_empty());
    other.shutdown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_workers_task_is_reclaimed_after_the_visibility_timeout() -> Result<()> {
    let mut dtq = start(false, &[]).await?;
    let doomed = Worker::start(&dtq, 1).await?;
    let id = submit_sleep(&dtq, 2_000, 3).await?;
    wait_running(&dtq, &id, 1).await?;
    let dead_owner = runner(&dtq, &id).await?;

    dtq.start_worker();
    doomed.kill().await;
    let died = Instant::now();
    wait_running(&dtq, &id, 2).await?;
    let took = died.elapsed();
    // Its last beat may have been up to a heartbeat period (a third of the
    // visibility timeout) before it died.
    assert!(
        took >= VISIBILITY * 2 / 3 - Duration::from_millis(20),
        "reclaimed {took:?} after its worker died, before the visibility timeout"
    );
    assert_ne!(task_field(&dtq, &id, "worker").await?, dead_owner);
    // The dead worker's carried attempt 1 was counted, and lost.
    let lost = wait_terminal(&dtq, &id).await?;
    assert_eq!(lost["attempt_history"][0]["outcome"], "lost", "{lost:#}");
    let task = wait_terminal(&dtq, &id).await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(2)),
        "{task:#}"
    );

    // The dead worker, with nothing pending any more, leaves the group and
    // the workers set.
    let dead_owner = dead_owner.context("no worker")?;
    let keys = QueueKeys::new("default");
    wait_until(WAIT, "the dead consumer removed", || async {
        let mut conn = dtq.redis.conn().await?;
        let consumers: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&keys.stream)
            .arg(GROUP)
            .query_async(&mut conn)
            .await?;
        let listed = consumers
            .iter()
            .any(|c| c.contains(&redis::Value::BulkString(dead_owner.clone().into_bytes())));
        let beat: Option<f64> = redis::cmd("ZSCORE")
            .arg(&keys.workers)
            .arg(&dead_owner)
            .query_async(&mut conn)
            .await?;
        Ok((!listed && beat.is_none()).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn after_an_outage_a_dead_workers_task_is_reclaimed_and_a_live_ones_is_not() -> Result<()> {
    let mut dtq = start(false, &[]).await?;
    // The doomed worker has one slot: it takes the first task only.
    let doomed = Worker::start(&dtq, 1).await?;
    let orphan = submit_sleep(&dtq, 2_000, 3).await?;
    wait_running(&dtq, &orphan, 1).await?;
    dtq.start_worker();
    let kept = submit_sleep(&dtq, 3_000, 1).await?;
    wait_running(&dtq, &kept, 1).await?;

    // The doomed worker dies just before Redis stops answering for twice
    // the visibility timeout.
    doomed.kill().await;
    outage(dtq.redis.single(), VISIBILITY * 2).await?;
    let resumed = Instant::now();

    // Its task is reclaimed, but only once the survivors have had a whole
    // visibility timeout to beat again: no sooner than that after Redis is
    // back (and not much later).
    wait_running(&dtq, &orphan, 2).await?;
    let took = resumed.elapsed();
    assert!(
        took >= VISIBILITY - Duration::from_millis(20),
        "reclaimed {took:?} after Redis resumed: live workers had no time to beat"
    );
    assert!(
        took < VISIBILITY * 4,
        "reclaimed only {took:?} after Redis resumed"
    );
    let task = wait_terminal(&dtq, &orphan).await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("SUCCEEDED"), Some(2)),
        "{task:#}"
    );
    // The live worker's task stayed its own.
    assert_ran_once(&dtq, &kept, 3_000).await?;
    assert!(dead_letters(&dtq).await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_attempt_is_stopped_and_writes_nothing() -> Result<()> {
    let dtq = start(true, &["--concurrency", "1"]).await?;
    let keys = QueueKeys::new("default");
    let id = submit_sleep(&dtq, 20_000, 3).await?;
    wait_running(&dtq, &id, 1).await?;
    let msg_id = task_field(&dtq, &id, "msg_id")
        .await?
        .context("no msg_id")?;

    // Another worker, alive (it beats, far ahead), takes the message over and
    // starts attempt 2, as `reclaim` and `start` would.
    let mut conn = dtq.redis.conn().await?;
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let () = redis::cmd("ZADD")
        .arg(&keys.workers)
        .arg((now_s + 3_600) * 1_000)
        .arg("thief")
        .query_async(&mut conn)
        .await?;
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&keys.stream)
        .arg(GROUP)
        .arg("thief")
        .arg(0)
        .arg(&msg_id)
        .arg("JUSTID")
        .query_async(&mut conn)
        .await?;
    let () = redis::cmd("HSET")
        .arg(keys.task(&id))
        .arg("status")
        .arg("RUNNING")
        .arg("worker")
        .arg("thief")
        .arg("attempts")
        .arg(2)
        .query_async(&mut conn)
        .await?;
    let taken = Instant::now();

    // The worker's one slot is free again only once the stale call has
    // stopped: a task submitted now runs well before the 20 s sleep ends.
    let echo = dtq
        .submit_new("default", json!({"task": "echo", "payload": 7}), None)
        .await?;
    let done = dtq
        .wait_for("default", &echo, &["SUCCEEDED"], Duration::from_secs(10))
        .await?;
    assert_eq!(done["result"], json!(7));
    assert!(
        taken.elapsed() < VISIBILITY * 5,
        "the stale call went on for {:?}",
        taken.elapsed()
    );

    // It wrote nothing: no completion, no cancel, no event; the task is the
    // thief's, running its attempt 2. (A completion holds its slot until it
    // is written, so any would have been written before the echo ran.)
    let task = dtq.task("default", &id).await?;
    assert_eq!(
        (task["status"].as_str(), task["attempts"].as_u64()),
        (Some("RUNNING"), Some(2)),
        "{task:#}"
    );
    for field in ["result", "error", "log", "finished_at", "cancel_requested"] {
        assert_eq!(
            task_field(&dtq, &id, field).await?,
            None,
            "{field}: {task:#}"
        );
    }
    let events = events(&dtq, &id).await?;
    assert_eq!(statuses(&events), ["QUEUED"], "{events:?}");
    // And the message stays the thief's: the stale worker's heartbeats did
    // not claim it back.
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&keys.stream)
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(10)
        .query_async(&mut conn)
        .await?;
    let owners: Vec<(&str, &str)> = pending
        .iter()
        .map(|(id, owner, _, _)| (id.as_str(), owner.as_str()))
        .collect();
    assert_eq!(owners, [(msg_id.as_str(), "thief")]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_worker_keeps_its_task_through_a_redis_restart_that_keeps_its_data() -> Result<()> {
    let mut dtq = start(true, &[]).await?;
    let id = submit_sleep(&dtq, 4_000, 1).await?;
    wait_running(&dtq, &id, 1).await?;
    // A snapshot of the task running, then Redis hangs for twice the
    // visibility timeout and is restarted from the snapshot, as a server
    // restarted with persistence: connections drop, commands sent while it
    // hung are lost, the script cache is empty.
    let () = redis::cmd("SAVE")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    signal(dtq.redis.single(), libc::SIGSTOP)?;
    tokio::time::sleep(VISIBILITY * 2).await;
    tokio::task::block_in_place(|| dtq.redis.restart())?;
    assert_eq!(
        dtq.task("default", &id).await?["status"],
        "RUNNING",
        "the snapshot was not loaded"
    );
    assert_ran_once(&dtq, &id, 4_000).await?;
    assert!(dead_letters(&dtq).await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_beats_on_every_queue_it_consumes_by_redis_clock_even_when_idle() -> Result<()> {
    let dtq = start(true, &["--queues", "default,emails"]).await?;
    let mut conn = dtq.redis.conn().await?;
    for queue in ["default", "emails"] {
        let keys = QueueKeys::new(queue);
        // Two beats in a row, each stamped with Redis's time.
        let mut last = None;
        for _ in 0..2 {
            let beat = wait_until(WAIT, &format!("a new beat on {queue}"), || async {
                let beats: Vec<(String, f64)> = redis::cmd("ZRANGE")
                    .arg(&keys.workers)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(&mut dtq.redis.conn().await?)
                    .await?;
                Ok(match beats.as_slice() {
                    [(_, at)] if Some(*at as u64) != last => Some(*at as u64),
                    _ => None,
                })
            })
            .await?;
            let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
            let now = s * 1_000 + us / 1_000;
            assert!(
                beat <= now && now - beat < VISIBILITY.as_millis() as u64,
                "beat {beat}, Redis's time {now}"
            );
            last = Some(beat);
        }
        let clock: std::collections::HashMap<String, u64> = redis::cmd("HGETALL")
            .arg(&keys.clock)
            .query_async(&mut conn)
            .await?;
        let (resumed, last) = (clock.get("resumed"), clock.get("last"));
        assert!(
            matches!((resumed, last), (Some(r), Some(l)) if r <= l),
            "{clock:?}"
        );
    }
    Ok(())
}

/// Make message `msg_id`, pending on another consumer, pending on the
/// harness's worker (started here) instead, as if that worker had read it
/// and never started it; the worker's consumer name.
async fn hand_to_worker(dtq: &mut Dtq, msg_id: &str) -> Result<String> {
    dtq.start_worker();
    let keys = QueueKeys::new("default");
    let consumer = wait_until(WAIT, "the worker's first beat", || async {
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&keys.workers)
            .arg(0)
            .arg(-1)
            .query_async(&mut dtq.redis.conn().await?)
            .await?;
        Ok(members.into_iter().next())
    })
    .await?;
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&keys.stream)
        .arg(GROUP)
        .arg(&consumer)
        .arg(0)
        .arg(msg_id)
        .arg("JUSTID")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(consumer)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_a_worker_was_given_but_never_started_comes_back_to_it() -> Result<()> {
    let mut dtq = start(false, &["--concurrency", "1"]).await?;
    let id = dtq
        .submit_new("default", json!({"task": "echo", "payload": 5}), None)
        .await?;
    // Delivered, but never started (as when `start` fails): the message is
    // pending on a consumer that does not run it...
    dtq.store.ensure_group("default").await?;
    let mut read = dtq
        .store
        .dedicated_connection(Duration::from_secs(5))
        .await?;
    let delivered = dtq
        .store
        .read(&mut read, "default", "nobody", 1, Duration::from_millis(10))
        .await?;
    assert_eq!(delivered.len(), 1);
    // ...and that consumer is the live worker itself.
    let consumer = hand_to_worker(&mut dtq, &delivered[0].msg_id).await?;
    let handed = Instant::now();

    // The worker holds no such message: it reclaims it from itself once it
    // has been idle for the visibility timeout, and runs it.
    let task = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(task["attempts"], 1, "{task:#}");
    assert!(
        handed.elapsed() >= VISIBILITY - Duration::from_millis(20),
        "ran {:?} after it was handed over",
        handed.elapsed()
    );
    assert_eq!(task_field(&dtq, &id, "worker").await?, Some(consumer));
    Ok(())
}

/// With `--events all`, a worker's read batch has its RUNNING events
/// written before it runs. When that write runs but its reply is lost, the
/// worker does not run the batch: it stays pending on the worker, which
/// takes it back and starts it through `start`. The attempt is counted
/// once and shows RUNNING twice (README, "Carried tasks"). This builds
/// that state: `host/tests/netcut.rs` cuts connections under `--events
/// all` too, but its random cuts seldom land on that small write.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_running_events_reply_was_lost_runs_once_and_shows_running_twice()
-> Result<()> {
    let mut dtq = start(false, &["--concurrency", "1", "--events", "all"]).await?;
    let id = dtq
        .submit_new("default", json!({"task": "echo", "payload": 6}), None)
        .await?;
    // The read and the RUNNING write the worker makes, then nothing: what
    // a worker whose write's reply was lost holds.
    let runs = dtq.read_and_start("nobody", 1).await?;
    let [(delivery, task)] = &runs[..] else {
        bail!("expected one delivery, got {runs:?}");
    };
    assert!(task.carried_at.is_some(), "a carried attempt: {task:?}");
    let queued = ("QUEUED".to_string(), "0".to_string());
    let running = ("RUNNING".to_string(), "1".to_string());
    assert_eq!(events(&dtq, &id).await?, [queued.clone(), running.clone()]);
    let consumer = hand_to_worker(&mut dtq, &delivery.msg_id).await?;

    let done = dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["attempts"], 1, "{done:#}");
    // `start` names the worker in the hash; a carried attempt does not.
    assert_eq!(task_field(&dtq, &id, "worker").await?, Some(consumer));
    assert_eq!(
        events(&dtq, &id).await?,
        [
            queued,
            running.clone(),
            running,
            ("SUCCEEDED".into(), "1".into())
        ]
    );
    Ok(())
}
