//! Flow control: queue weights (`--queues hi:6,lo:1`), strict priority,
//! and pausing a queue across the fleet.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use dtq_host::base::now_ms;
use dtq_host::store::{Admission, Conn, Limits, QueueKeys, Rate};
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The admin token of the dtq under test.
const ADMIN: &str = "flow-control-admin-token-0b4e";

/// Longest wait for a task to finish.
const WAIT: Duration = Duration::from_secs(60);

/// A worker of `dtq`'s configuration beside its own, in this process (a
/// consumer of its own, as another host would be); stopped by `stop`.
fn spawn_worker(dtq: &Dtq, stop: &CancellationToken) -> tokio::task::JoinHandle<()> {
    let run = dtq_host::worker::run(
        dtq.store.clone(),
        dtq.sandbox.clone(),
        dtq.config.worker(),
        stop.clone().cancelled_owned(),
    );
    tokio::spawn(async move { run.await.expect("the extra worker runs") })
}

/// Submit `n` tasks of the example `sleep` handler (`ms` each) to `queue`.
async fn submit_sleeps(dtq: &Dtq, queue: &str, n: usize, ms: u64) -> Result<Vec<String>> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(
            dtq.submit_new(queue, json!({"task": "sleep", "payload": {"ms": ms}}), None)
                .await?,
        );
    }
    Ok(ids)
}

/// Wait for every task of `ids` in `queue` to succeed; their records.
async fn succeeded(dtq: &Dtq, queue: &str, ids: &[String]) -> Result<Vec<Value>> {
    let mut tasks = Vec::with_capacity(ids.len());
    for id in ids {
        tasks.push(dtq.wait_for(queue, id, &["SUCCEEDED"], WAIT).await?);
    }
    Ok(tasks)
}

/// The queue of each task of `tasks`, in the order they started.
fn start_order(tasks: Vec<Value>) -> Result<Vec<String>> {
    let mut started = tasks
        .into_iter()
        .map(|t| {
            let at = t["started_at"].as_u64().context("started_at")?;
            Ok((at, t["queue"].as_str().context("queue")?.to_owned()))
        })
        .collect::<Result<Vec<_>>>()?;
    started.sort();
    Ok(started.into_iter().map(|(_, q)| q).collect())
}

/// With both queues full and one slot, the first 35 tasks started are
/// `hi`'s and `lo`'s in the ratio 6 to 1 (30 and 5, give or take the
/// first round).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weighted_queues_share_the_slots_by_weight() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--queues", "hi:6,lo:1", "--concurrency", "1"]).await?;
    let mut ids = Vec::new();
    for queue in ["lo", "hi"] {
        ids.push((queue, submit_sleeps(&dtq, queue, 42, 5).await?));
    }
    dtq.start_worker();
    let mut tasks = Vec::new();
    for (queue, ids) in &ids {
        tasks.extend(succeeded(&dtq, queue, ids).await?);
    }
    dtq.stop_worker().await?;
    let order = start_order(tasks)?;
    let hi = order[..35].iter().filter(|q| *q == "hi").count();
    ensure!(
        (28..=32).contains(&hi),
        "{hi} of the first 35 started were hi's, not about 30: {order:?}"
    );
    Ok(())
}

/// `--strict-priority`: every task of the first queue starts before any
/// of the second, whatever their weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn strict_priority_drains_the_queues_in_order() -> Result<()> {
    let mut dtq = Dtq::start(
        false,
        &[
            "--queues",
            "first,second:9",
            "--strict-priority",
            "--concurrency",
            "2",
        ],
    )
    .await?;
    let second = submit_sleeps(&dtq, "second", 10, 5).await?;
    let first = submit_sleeps(&dtq, "first", 10, 5).await?;
    dtq.start_worker();
    let mut tasks = succeeded(&dtq, "first", &first).await?;
    tasks.extend(succeeded(&dtq, "second", &second).await?);
    dtq.stop_worker().await?;
    let order = start_order(tasks)?;
    let firsts = order.iter().take_while(|q| *q == "first").count();
    ensure!(
        firsts == 10,
        "not every task of first started first: {order:?}"
    );
    Ok(())
}

/// A bad weight is refused with the form it takes.
#[tokio::test]
async fn a_bad_weight_is_refused() -> Result<()> {
    for bad in ["hi:0", "hi:x", "hi:1001", "hi:6,hi:2"] {
        let err = match dtq_host::Config::from_args(["--queues", bad]) {
            Ok(config) => match config.worker().check() {
                Ok(()) => anyhow::bail!("--queues {bad} was accepted"),
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        ensure!(
            err.contains("weight") || err.contains("named twice"),
            "--queues {bad}: {err}"
        );
    }
    let config = dtq_host::Config::from_args(["--queues", "high:6,default,low:1"])?;
    let worker = config.worker();
    assert_eq!(worker.queue_names(), ["high", "default", "low"]);
    assert_eq!(
        [
            worker.weight_of("high"),
            worker.weight_of("default"),
            worker.weight_of("low")
        ],
        [6, 1, 1]
    );
    Ok(())
}

/// `POST /v1/queues/{queue}/pause` or `/resume` as the admin.
async fn set_paused(dtq: &Dtq, queue: &str, paused: bool) -> Result<Value> {
    let action = if paused { "pause" } else { "resume" };
    let auth = format!("Bearer {ADMIN}");
    let (status, body) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/{queue}/{action}"),
            None,
            &[("Authorization", &auth)],
        )
        .await?;
    ensure!(status == 200, "{action}: {status} {body}");
    Ok(body)
}

/// A paused queue takes submissions (and keeps their idempotency), and no
/// worker starts its tasks: not the two running when it was paused, nor
/// one started during the pause; the task running when it was paused
/// finishes. Resumed, every task runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_queue_holds_its_tasks_across_the_fleet_until_resumed() -> Result<()> {
    let q = "paused-q";
    let dtq = Dtq::start(true, &["--queues", q, "--admin-token", ADMIN]).await?;
    let stop = CancellationToken::new();
    let second = spawn_worker(&dtq, &stop);

    let running = submit_sleeps(&dtq, q, 1, 1_500).await?;
    dtq.wait_for(q, &running[0], &["RUNNING"], WAIT).await?;
    let body = set_paused(&dtq, q, true).await?;
    assert_eq!(body, json!({"queue": q, "paused": true, "changed": true}));
    let again = set_paused(&dtq, q, true).await?;
    assert_eq!(again["changed"], false, "{again}");
    // Every worker learns of it within a poll.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let held = submit_sleeps(&dtq, q, 12, 1).await?;
    let (status, dup) = dtq
        .submit(q, json!({"task": "echo", "payload": 1}), Some("paused-key"))
        .await?;
    ensure!(status == 202, "{dup}");
    let (status, busy) = dtq
        .submit(q, json!({"task": "echo", "payload": 1}), Some("paused-key"))
        .await?;
    ensure!(
        status == 409 && busy["error"]["details"]["task_id"] == dup["task_id"],
        "{busy}"
    );
    let third = spawn_worker(&dtq, &stop);

    // The running task finishes; nothing else starts.
    dtq.wait_for(q, &running[0], &["SUCCEEDED"], WAIT).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in &held {
        let task = dtq.task(q, id).await?;
        ensure!(
            task["status"] == "QUEUED",
            "a paused queue started a task: {task}"
        );
    }
    let (_, stats) = dtq
        .call(Method::GET, &format!("/v1/queues/{q}"), None, &[])
        .await?;
    ensure!(stats["paused"] == true && stats["ready"] == 13, "{stats}");
    let (_, list) = dtq.call(Method::GET, "/v1/queues", None, &[]).await?;
    ensure!(list["queues"][0]["paused"] == true, "{list}");

    let body = set_paused(&dtq, q, false).await?;
    assert_eq!(body, json!({"queue": q, "paused": false, "changed": true}));
    succeeded(&dtq, q, &held).await?;
    let (_, stats) = dtq
        .call(Method::GET, &format!("/v1/queues/{q}"), None, &[])
        .await?;
    ensure!(stats["paused"] == false, "{stats}");
    stop.cancel();
    second.await?;
    third.await?;
    Ok(())
}

/// Pausing is the queue's admin's: refused without a token, with a bad
/// queue name, and where no admin token is configured.
#[tokio::test]
async fn pausing_needs_the_admin_scope() -> Result<()> {
    let dtq = Dtq::start(false, &["--admin-token", ADMIN]).await?;
    let r = dtq
        .call(Method::POST, "/v1/queues/q/pause", None, &[])
        .await?;
    assert_error(&r, 401, "UNAUTHORIZED");
    let auth = format!("Bearer {ADMIN}");
    let r = dtq
        .call(
            Method::POST,
            "/v1/queues/bad%20name/pause",
            None,
            &[("Authorization", &auth)],
        )
        .await?;
    assert_error(&r, 400, "INVALID_QUEUE_NAME");
    let open = Dtq::start(false, &[]).await?;
    let r = open
        .call(Method::POST, "/v1/queues/q/resume", None, &[])
        .await?;
    assert_error(&r, 403, "ADMIN_DISABLED");
    Ok(())
}

/// `PUT /v1/queues/{queue}/limits` as the admin: the answer's `limits`.
async fn set_limits(dtq: &Dtq, queue: &str, limits: Value) -> Result<Value> {
    let auth = format!("Bearer {ADMIN}");
    let (status, body) = dtq
        .call(
            Method::PUT,
            &format!("/v1/queues/{queue}/limits"),
            Some(limits),
            &[("Authorization", &auth)],
        )
        .await?;
    ensure!(status == 200, "limits: {status} {body}");
    // Every worker learns of them within a poll.
    tokio::time::sleep(Duration::from_millis(800)).await;
    Ok(body["limits"].clone())
}

/// The `started_at` of each task of `tasks`, sorted.
fn start_times(tasks: &[Value]) -> Result<Vec<u64>> {
    let mut times = tasks
        .iter()
        .map(|t| t["started_at"].as_u64().context("started_at"))
        .collect::<Result<Vec<_>>>()?;
    times.sort_unstable();
    Ok(times)
}

/// 60 tasks under `{"limit": 20, "per_ms": 1000}` on two workers: no
/// window admits more than 20 (counted over each window less its first
/// 250 ms, since a task's start is stamped a moment after Redis admitted
/// it), so the starts span more than one window; none is an extra attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(
    clippy::print_stdout,
    reason = "the test reports how long the tasks took"
)]
async fn a_rate_limit_bounds_the_starts_of_the_whole_fleet() -> Result<()> {
    let q = "rated";
    let dtq = Dtq::start(true, &["--queues", q, "--admin-token", ADMIN]).await?;
    let stop = CancellationToken::new();
    let second = spawn_worker(&dtq, &stop);
    let limits = set_limits(&dtq, q, json!({"rate": {"limit": 20, "per_ms": 1000}})).await?;
    assert_eq!(limits, json!({"rate": {"limit": 20, "per_ms": 1000}}));
    let mut ids = Vec::new();
    for i in 0..60 {
        ids.push(
            dtq.submit_new(q, json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    let tasks = succeeded(&dtq, q, &ids).await?;
    let times = start_times(&tasks)?;
    for window in times[0] / 1000..=times[59] / 1000 {
        let (from, to) = (window * 1000 + 250, (window + 1) * 1000);
        let n = times.iter().filter(|&&t| (from..to).contains(&t)).count();
        ensure!(n <= 20, "{n} starts in [{from}, {to}): {times:?}");
    }
    let span = times[59] - times[0];
    println!("60 tasks at 20 per 1000 ms on two workers: starts spanned {span} ms");
    ensure!(
        span > 1000,
        "60 starts within {span} ms at 20 per s: {times:?}"
    );
    ensure!(
        tasks.iter().all(|t| t["attempts"] == 1),
        "a hold counted an attempt"
    );
    stop.cancel();
    second.await?;
    Ok(())
}

/// A rate limit of `limit` starts in a window longer than any test (a
/// window is counted from the epoch), and `group` running tasks per group.
fn one_window(limit: u32, group: Option<u32>) -> Limits {
    Limits {
        rate: Some(Rate {
            limit,
            per_ms: 1_000_000_000_000,
        }),
        group_concurrency: group,
    }
}

/// A dtq with no worker whose queue `q` holds a task of each of `bodies`,
/// their ids, and a connection to read `q` on, as the fetch loop's.
async fn backlog(q: &str, bodies: Vec<Value>) -> Result<(Dtq, Vec<String>, Conn)> {
    let dtq = Dtq::start(false, &["--admin-token", ADMIN]).await?;
    dtq.store.ensure_group(q).await?;
    let mut ids = Vec::with_capacity(bodies.len());
    for body in bodies {
        ids.push(dtq.submit_new(q, body, None).await?);
    }
    let conn = dtq.store.dedicated_connection(WAIT).await?;
    Ok((dtq, ids, conn))
}

/// One read of a queue whose rate limit admits 3 in a window, with 5
/// tasks and a message naming no task in its stream: the read and its
/// admission are one round trip, which returns the first 3 tasks admitted
/// (carried: they run with no `start`) and counts the stray message as
/// read without charging it, and holds the other 2 (SCHEDULED, held by the
/// rate, out of the stream, in the delayed set). A second read in the same
/// window holds every new task.
#[tokio::test]
async fn a_read_of_a_limited_queue_admits_what_it_reads_in_one_round_trip() -> Result<()> {
    let q = "read-admit";
    let echoes = (0..5).map(|i| json!({"task": "echo", "payload": i}));
    let (dtq, ids, mut conn) = backlog(q, echoes.collect()).await?;
    let store = &dtq.store;
    let keys = QueueKeys::new(q);
    let mut redis = dtq.redis.conn().await?;
    let _: String = redis::cmd("XADD")
        .arg(&keys.stream)
        .arg("*")
        .arg("other")
        .arg("x")
        .query_async(&mut redis)
        .await?;
    let limits = one_window(3, None);
    let grace = Duration::from_secs(30);
    let trips = store.round_trips();
    let read = store
        .read_admitted(&mut conn, q, "reader", 10, &limits, 1, grace, now_ms())
        .await?;
    assert_eq!(store.round_trips() - trips, 1, "a read and its admission");
    assert_eq!(read.read, 6, "every message read, the stray one included");
    let admitted: Vec<&str> = read.deliveries.iter().map(|d| d.task_id.as_str()).collect();
    assert_eq!(admitted, ids[..3], "the first three admitted, in order");
    ensure!(
        read.deliveries.iter().all(|d| d.carried.is_some()),
        "an admitted task lost what its message carries: {:?}",
        read.deliveries
    );
    let held_by_rate = |task: &Value| task["status"] == "SCHEDULED" && task["held"]["by"] == "rate";
    for id in &ids[3..] {
        let task = dtq.task(q, id).await?;
        ensure!(held_by_rate(&task), "{task}");
    }
    let stream_len: u64 = redis::cmd("XLEN")
        .arg(&keys.stream)
        .query_async(&mut redis)
        .await?;
    assert_eq!(stream_len, 4, "the held ones leave the stream");
    assert_eq!(pending_consumers(&dtq, q).await?, ["reader"]);
    let delayed: Vec<String> = redis::cmd("ZRANGE")
        .arg(&keys.delayed)
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await?;
    let mut want = ids[3..].to_vec();
    want.sort();
    let mut delayed = delayed;
    delayed.sort();
    assert_eq!(delayed, want);

    // The window's count was kept: the next read holds all it reads.
    let mut late = Vec::new();
    for i in 0..2 {
        late.push(
            dtq.submit_new(q, json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    let read = store
        .read_admitted(&mut conn, q, "reader", 10, &limits, 1, grace, now_ms())
        .await?;
    assert_eq!((read.read, read.deliveries.len()), (2, 0));
    for id in &late {
        let task = dtq.task(q, id).await?;
        ensure!(held_by_rate(&task), "{task}");
    }

    // A queue whose group is gone (a Redis restarted without its data):
    // Redis's own code, which the fetch loop answers by making the group.
    let gone = store
        .read_admitted(
            &mut conn,
            "no-group",
            "reader",
            10,
            &limits,
            1,
            grace,
            now_ms(),
        )
        .await;
    match gone {
        Err(dtq_host::store::StoreError::Redis(e)) => {
            assert_eq!(e.code(), Some("NOGROUP"), "{e}");
        }
        other => panic!("a read without a group answered {other:?}"),
    }
    Ok(())
}

/// How many round trips of `operation` the store made, as `/metrics`
/// shows them (0 for one it never made).
async fn trips_of(dtq: &Dtq, operation: &str) -> Result<u64> {
    let auth = format!("Bearer {ADMIN}");
    let response = reqwest::Client::new()
        .get(format!("{}/metrics", dtq.api))
        .header("Authorization", auth)
        .send()
        .await?;
    ensure!(response.status() == 200, "/metrics: {}", response.status());
    let text = response.text().await?;
    let series = format!("dtq_redis_round_trip_seconds_count{{operation=\"{operation}\"}} ");
    Ok(text
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .map(str::parse)
        .transpose()?
        .unwrap_or(0))
}

/// A busy queue under a limit that does not bind, its backlog drained four
/// slots at a time by a worker started after it: every batch is admitted
/// by the read that delivers it, with no `admit` round trip of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_limited_queue_is_admitted_by_its_reads() -> Result<()> {
    let q = "busy-limited";
    let dtq = Dtq::start(
        false,
        &["--queues", q, "--concurrency", "4", "--admin-token", ADMIN],
    )
    .await?;
    dtq.store
        .set_limits(
            q,
            &Limits {
                rate: Some(Rate {
                    limit: 1_000_000,
                    per_ms: 1_000,
                }),
                group_concurrency: None,
            },
        )
        .await?;
    let mut ids = Vec::new();
    for i in 0..100 {
        ids.push(
            dtq.submit_new(q, json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    // A worker reads its queues' limits before its first fetch.
    let stop = CancellationToken::new();
    let worker = spawn_worker(&dtq, &stop);
    succeeded(&dtq, q, &ids).await?;
    let (admits, reads) = (
        trips_of(&dtq, "admit").await?,
        trips_of(&dtq, "read_admit").await?,
    );
    ensure!(
        reads >= 25,
        "100 tasks four at a time in {reads} admitting reads"
    );
    ensure!(
        admits == 0,
        "{admits} admit round trips beside {reads} reads"
    );
    stop.cancel();
    worker.await?;
    Ok(())
}

/// A read whose reply is lost: its worker reads the messages back and
/// admits them again (`admit.lua`), which counts them in the rate window a
/// second time but never takes a second group slot. Two tasks of one group
/// under `group_concurrency: 1`: the first is admitted by the read, the
/// second held; admitted again, the first keeps its one slot, and the
/// window has counted it twice (it admits fewer, never more).
#[tokio::test]
async fn a_read_whose_reply_is_lost_is_admitted_again_in_the_same_slot() -> Result<()> {
    let q = "lost-read";
    let grouped = (0..2).map(|i| json!({"task": "echo", "payload": i, "group": "g"}));
    let (dtq, ids, mut conn) = backlog(q, grouped.collect()).await?;
    let store = &dtq.store;
    let keys = QueueKeys::new(q);
    let limits = one_window(10, Some(1));
    let grace = Duration::from_secs(30);
    let read = store
        .read_admitted(&mut conn, q, "reader", 10, &limits, 1, grace, now_ms())
        .await?;
    let admitted: Vec<&str> = read.deliveries.iter().map(|d| d.task_id.as_str()).collect();
    assert_eq!((read.read, admitted), (2, vec![ids[0].as_str()]));

    // The reply lost: the same messages, read back, admitted again.
    let again = store
        .admit(q, &read.deliveries, &limits, 1, grace, now_ms())
        .await?;
    assert_eq!(again, [Admission::Admitted]);
    let mut redis = dtq.redis.conn().await?;
    let slots: Vec<String> = redis::cmd("ZRANGE")
        .arg(format!("{}g", keys.group_prefix()))
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await?;
    assert_eq!(slots, [ids[0].clone()], "one slot, taken once");
    let counted: Option<u64> = redis::cmd("HGET")
        .arg(keys.rate())
        .arg("n")
        .query_async(&mut redis)
        .await?;
    assert_eq!(counted, Some(2), "the window counted the start twice");
    let held = dtq.task(q, &ids[1]).await?;
    ensure!(
        held["status"] == "SCHEDULED" && held["held"]["by"] == "group",
        "{held}"
    );
    Ok(())
}

/// Whether intervals `a` and `b` (start, end) overlap.
fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// `group_concurrency: 1` on two workers: the tasks of one group run one
/// at a time, tasks of different groups at the same time, and a task
/// waiting for its group shows it (SCHEDULED, held by its group).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_limit_runs_a_group_one_at_a_time_and_groups_side_by_side() -> Result<()> {
    let q = "grouped";
    let dtq = Dtq::start(true, &["--queues", q, "--admin-token", ADMIN]).await?;
    let stop = CancellationToken::new();
    let second = spawn_worker(&dtq, &stop);
    set_limits(&dtq, q, json!({"group_concurrency": 1})).await?;
    let mut ids = Vec::new();
    for i in 0..20 {
        let group = format!("customer-{}", i % 4);
        let body = json!({"task": "sleep", "payload": {"ms": 150}, "group": group});
        ids.push((group, dtq.submit_new(q, body, None).await?));
    }
    let mut seen_held = None;
    let mut seen_listed = false;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut tasks = Vec::new();
    while tasks.len() < ids.len() {
        tasks.clear();
        let (_, page) = dtq
            .call(
                Method::GET,
                &format!("/v1/queues/{q}/tasks?status=SCHEDULED"),
                None,
                &[],
            )
            .await?;
        seen_listed |= page["tasks"]
            .as_array()
            .is_some_and(|ts| ts.iter().any(|t| t["held_by"] == "group"));
        for (_, id) in &ids {
            let task = dtq.task(q, id).await?;
            if task["status"] == "SCHEDULED" && task["held"]["by"] == "group" {
                seen_held.get_or_insert(task.clone());
            }
            if task["status"] == "SUCCEEDED" {
                tasks.push(task);
            }
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "not done: {tasks:?}"
        );
    }
    let held = seen_held.context("no task was ever seen held by its group")?;
    ensure!(
        seen_listed,
        "the listing never said a task was held by its group"
    );
    ensure!(
        held["group"]
            .as_str()
            .is_some_and(|g| g.starts_with("customer-")),
        "{held}"
    );
    let span = |t: &Value| -> Result<(u64, u64)> {
        Ok((
            t["started_at"].as_u64().context("started_at")?,
            t["finished_at"].as_u64().context("finished_at")?,
        ))
    };
    let mut across = false;
    for (i, a) in tasks.iter().enumerate() {
        for b in &tasks[i + 1..] {
            let (sa, sb) = (span(a)?, span(b)?);
            if a["group"] == b["group"] {
                ensure!(
                    !overlap(sa, sb),
                    "two tasks of one group overlapped: {a} {b}"
                );
            } else {
                across |= overlap(sa, sb);
            }
        }
    }
    ensure!(across, "no two groups ever ran side by side");
    ensure!(
        tasks.iter().all(|t| t["attempts"] == 1),
        "a hold counted an attempt"
    );
    stop.cancel();
    second.await?;
    Ok(())
}

/// A worker that dies while its task holds its group's only slot: the
/// task is dead-lettered by a reclaim (it had one attempt), which gives
/// the slot back, and the group's next task runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_workers_group_slot_comes_back_with_the_reclaim() -> Result<()> {
    let q = "grouped-crash";
    let dtq = Dtq::start(false, &["--queues", q, "--admin-token", ADMIN]).await?;
    set_limits(&dtq, q, json!({"group_concurrency": 1})).await?;
    let first = dtq
        .submit_new(
            q,
            json!({"task": "sleep", "payload": {"ms": 5_000}, "group": "g", "max_attempts": 1}),
            None,
        )
        .await?;
    let stop = CancellationToken::new();
    let doomed = spawn_worker(&dtq, &stop);
    dtq.wait_for(q, &first, &["RUNNING"], WAIT).await?;
    // Dropped without a shutdown: as a process killed.
    doomed.abort();
    let _ = doomed.await;
    let next = dtq
        .submit_new(
            q,
            json!({"task": "sleep", "payload": {"ms": 10}, "group": "g"}),
            None,
        )
        .await?;
    let survivor = spawn_worker(&dtq, &stop);
    let dead = dtq.wait_for(q, &first, &["DEAD_LETTERED"], WAIT).await?;
    let done = dtq.wait_for(q, &next, &["SUCCEEDED"], WAIT).await?;
    let (dead_at, started) = (
        dead["updated_at"].as_u64().context("updated_at")?,
        done["started_at"].as_u64().context("started_at")?,
    );
    ensure!(
        started >= dead_at,
        "the next task started while the slot was held: {dead} {done}"
    );
    stop.cancel();
    survivor.await?;
    Ok(())
}

/// The limits routes: set, read, lift; bad limits and bad groups refused
/// with their codes.
#[tokio::test]
async fn limits_are_set_read_and_lifted_and_bad_ones_refused() -> Result<()> {
    let dtq = Dtq::start(false, &["--admin-token", ADMIN]).await?;
    let auth = format!("Bearer {ADMIN}");
    let admin = [("Authorization", auth.as_str())];
    let path = "/v1/queues/lim/limits";
    let (_, none) = dtq.call(Method::GET, path, None, &[]).await?;
    assert_eq!(none, json!({"queue": "lim", "limits": {}}));
    let body = json!({"rate": {"limit": 5, "per_ms": 200}, "group_concurrency": 3});
    let (status, set) = dtq
        .call(Method::PUT, path, Some(body.clone()), &admin)
        .await?;
    assert_eq!((status, &set["limits"]), (200, &body));
    let (_, read) = dtq.call(Method::GET, path, None, &[]).await?;
    assert_eq!(read["limits"], body);
    for (bad, code) in [
        (
            json!({"rate": {"limit": 0, "per_ms": 1000}}),
            "INVALID_LIMITS",
        ),
        (json!({"rate": {"limit": 5, "per_ms": 0}}), "INVALID_LIMITS"),
        (json!({"group_concurrency": 0}), "INVALID_LIMITS"),
        (json!({"rate": {"limit": 5}}), "INVALID_REQUEST"),
        (json!({"burst": 1}), "INVALID_REQUEST"),
        (json!([null, null]), "INVALID_REQUEST"),
    ] {
        let r = dtq
            .call(Method::PUT, path, Some(bad.clone()), &admin)
            .await?;
        assert_error(&r, 400, code);
    }
    let r = dtq.call(Method::PUT, path, Some(json!({})), &[]).await?;
    assert_error(&r, 401, "UNAUTHORIZED");
    let (_, kept) = dtq.call(Method::GET, path, None, &[]).await?;
    assert_eq!(kept["limits"], body, "a refused change changed the limits");
    let (status, lifted) = dtq.call(Method::DELETE, path, None, &admin).await?;
    assert_eq!((status, &lifted["limits"]), (200, &json!({})));
    let (_, read) = dtq.call(Method::GET, path, None, &[]).await?;
    assert_eq!(read["limits"], json!({}));

    for group in [String::new(), "g".repeat(129), "a\nb".into()] {
        let r = dtq
            .submit("lim", json!({"task": "echo", "group": group}), None)
            .await?;
        assert_error(&r, 400, "INVALID_GROUP");
    }
    let id = dtq
        .submit_new(
            "lim",
            json!({"task": "echo", "group": "g".repeat(128)}),
            None,
        )
        .await?;
    assert_eq!(dtq.task("lim", &id).await?["group"], "g".repeat(128));
    Ok(())
}

/// XPENDING's summary: the count, the lowest and highest ids, and each
/// consumer with its count.
type PendingSummary = (
    u64,
    Option<String>,
    Option<String>,
    Option<Vec<(String, String)>>,
);

/// The consumers a queue's pending messages are on (XPENDING's summary).
async fn pending_consumers(dtq: &Dtq, queue: &str) -> Result<Vec<String>> {
    let reply: PendingSummary = redis::cmd("XPENDING")
        .arg(QueueKeys::new(queue).stream)
        .arg(dtq_host::store::GROUP)
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(reply
        .3
        .unwrap_or_default()
        .into_iter()
        .map(|(c, _)| c)
        .collect())
}

/// A worker killed (dropped without a shutdown) while its task runs on a
/// paused queue: another worker reclaims the message but does not start
/// it while the queue is paused; once resumed, it reads the message back
/// and runs the task's next attempt. Nothing is lost and nothing starts
/// during the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_workers_task_on_a_paused_queue_waits_for_the_resume() -> Result<()> {
    let q = "paused-crash";
    let dtq = Dtq::start(false, &["--queues", q, "--admin-token", ADMIN]).await?;
    let id = dtq
        .submit_new(
            q,
            json!({"task": "sleep", "payload": {"ms": 3_000}, "max_attempts": 3}),
            None,
        )
        .await?;
    let stop = CancellationToken::new();
    let doomed = spawn_worker(&dtq, &stop);
    dtq.wait_for(q, &id, &["RUNNING"], WAIT).await?;
    let dead = pending_consumers(&dtq, q).await?;
    ensure!(dead.len() == 1, "{dead:?}");
    set_paused(&dtq, q, true).await?;
    doomed.abort();
    let _ = doomed.await;

    let survivor = spawn_worker(&dtq, &stop);
    // The reclaim moves the message to the survivor after the visibility
    // timeout.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = pending_consumers(&dtq, q).await?;
        if !now.is_empty() && now != dead {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "never reclaimed: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let task = dtq.task(q, &id).await?;
    ensure!(
        task["attempts"] == 1 && task["status"] != "SUCCEEDED",
        "a paused queue started a reclaimed task: {task}"
    );

    set_paused(&dtq, q, false).await?;
    let done = dtq.wait_for(q, &id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["attempts"], 2, "{done}");
    stop.cancel();
    survivor.await?;
    Ok(())
}
