//! Flows under chaos: real `dtq` processes (three workers and one API)
//! run hundreds of `fan_out` parents, each fanning out to ten `square`
//! children on queue `kids` and waiting for them, while the test SIGKILLs
//! a random worker every few seconds (starting a new one in its place) and
//! stops and restarts Redis. Redis is a `redis-server` with AOF on, or,
//! with `DTQ_TEST_REDIS=cluster`, a Redis Cluster of three primaries
//! (`dtq_tests::cluster`), where the Redis fault is a primary stopped
//! (`SHUTDOWN SAVE`) and started again on its data: the primary serving
//! `{default}` (the parents) and the one serving `{kids}` (the children)
//! in turn.
//!
//! A parent's submissions are staged with its attempt and applied exactly
//! once, however often it runs; a kill or an outage can fall between any
//! two of its steps (the run, the completion that stages, the application
//! of each child, a child's end, the record of that end in the parent's
//! flow, the resumption, the second run), and whatever a worker leaves
//! undone the sweep of another finishes. At the end the test prints one
//! table and asserts each figure:
//!
//! - every acknowledged parent SUCCEEDED, and its result's
//!   `sum_of_squares` is the sum of the squares of its numbers;
//! - every parent waited exactly once (its hash's `waits` is 1), and its
//!   lifecycle events (`dtq:events:{default}`) show one WAITING and one
//!   resumption (QUEUED right after it);
//! - each parent, as the API shows it, has ten children, all SUCCEEDED,
//!   of task `square` on `kids`, naming it as their parent, whose payloads
//!   are `{"n": x}` for its numbers in their order;
//! - the task hashes of `kids` in Redis are exactly the union of the
//!   parents' children: ten per parent, none twice, none extra; those of
//!   `default` are exactly the acknowledged parents;
//! - no task of either queue is WAITING, QUEUED, RUNNING (or in any other
//!   status but a terminal one);
//! - the queue's flows index (`dtq:flows:{default}`) and the children's
//!   settle index (`dtq:settle:{kids}`) are empty once the sweep has had a
//!   few seconds, and so are the other two (`dtq:flows:{kids}`,
//!   `dtq:settle:{default}`), which nothing here should fill.
//!
//! The parents are submitted in waves, one before each fault, and each
//! fault strikes once half of its wave is acknowledged, so that it
//! interrupts flows midway. Each parent has its own Idempotency-Key and is
//! submitted again (with it) until acknowledged: 202, 200, or 409 with the
//! task in flight.
//!
//! Sizes come from the environment; the defaults are the short form that
//! `cargo test` (and so CI) runs in about a minute.
//! `scripts/chaos-flows` runs the long form.
//!
//! | variable | default | |
//! |---|---|---|
//! | `DTQ_FLOWS_CHAOS_PARENTS` | 200 | `fan_out` parents, ten children each |
//! | `DTQ_FLOWS_CHAOS_SECS` | 30 | seconds of faults (a wave of parents before each), Redis outages aside |
//! | `DTQ_FLOWS_CHAOS_KILL_MS` | 2500 | mean time between worker kills (each drawn from 80 % to 120 % of it) |
//! | `DTQ_FLOWS_CHAOS_REDIS_RESTARTS` | 2 | Redis stops and restarts (a cluster primary's, on a cluster), spread evenly over the run |
//! | `DTQ_FLOWS_CHAOS_DRAIN_SECS` | 120 | deadline for every parent to be terminal once the chaos ends |
//! | `DTQ_FLOWS_CHAOS_SEED` | random | replays a run's workload and fault schedule (it is printed) |
//! | `DTQ_FLOWS_CHAOS_NETCUT_MS` | 0 | above 0, the workers reach Redis through a proxy that cuts each of their connections after a random third of this to all of it (`dtq_tests::proxy`), reset mid-traffic, so replies are lost to commands that ran (a completion that staged a parent's children, a child's record in its parent's flow); one server only |
//! | `DTQ_TEST_REDIS` | `single` | `cluster`: run on a three-primary Redis Cluster |
//!
//! Every process writes its log to a file in the test's temporary
//! directory; when the test fails, the tail of each is printed and the
//! directory is kept. On a cluster, `DTQ_TEST_CLUSTER_LOGS=<dir>` keeps the
//! nodes' logs too.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dtq_host::store::{Conn, GROUP, QueueKeys};
use dtq_tests::chaos::{
    Chaos, ChaosRedis, Figure, REQUEST_TIMEOUT, Servers, Settings, Submission, TERMINAL, Waves,
    env_var, examples, task_fields, wait_terminal,
};
use dtq_tests::cluster::RedisCluster;
use dtq_tests::process::DtqProcess;
use dtq_tests::proxy::CuttingProxy;
use dtq_tests::{ApiClient, PersistentRedis, TempDir};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The parents' queue.
const QUEUE: &str = "default";

/// The children's queue.
const KIDS: &str = "kids";

/// Children per parent.
const CHILDREN: usize = 10;

/// What the workers consume, and what `fan_out` may submit.
const WORKER_QUEUES: &str = "default,kids";
const SUBMIT_TO: &str = "fan_out=kids:square";

/// A parent's numbers are distinct, drawn from this range (so each
/// square, and the sum of ten, fits easily in an i64).
const NUMBERS: std::ops::RangeInclusive<i64> = -9_999..=9_999;

/// Redis persistence (single server): AOF on, fsynced every second; a
/// graceful stop writes and fsyncs the whole AOF (see `chaos.rs`).
const REDIS_PERSISTENCE: &[&str] = &["--appendonly", "yes", "--appendfsync", "everysec"];

/// Workers running at any time.
const WORKERS: usize = 3;

/// Each worker's execution slots.
const CONCURRENCY: &str = "8";

/// The visibility timeout every process runs with (ms): short, so that a
/// killed worker's tasks are reclaimed quickly.
const VISIBILITY_MS: &str = "1000";

/// Every task's attempts, parents (their submissions say it) and children
/// (the workers that apply a parent's submissions default to it): enough
/// that worker kills and outages never exhaust them.
const MAX_ATTEMPTS: &str = "10";

/// Every task's time limit (ms).
const TASK_TIMEOUT_MS: &str = "5000";

/// Submissions in flight at once.
const SUBMITTERS: usize = 16;

/// Reads of the API in flight at once, once the chaos is over.
const READERS: usize = 16;

/// Once every parent is terminal, how long the sweep gets to empty the
/// flow indexes and for every other task to end: a flow unchanged for
/// 10 s is looked at again, swept every second.
const QUIET_DEADLINE: Duration = Duration::from_secs(40);

/// How the parents go: `SUBMITTERS` at a time to `QUEUE`, a fault striking
/// up to 150 ms after half of its wave is acknowledged.
const WAVES: Waves = Waves {
    queue: QUEUE,
    submitters: SUBMITTERS,
    jitter_ms: 150,
    noun: "parents",
};

// ---------------------------------------------------------------------------
// Redis: one server with AOF, or a cluster of three primaries

/// The Redis the processes run on.
enum Redis {
    /// One `redis-server` with AOF on; its fault is a graceful stop and a
    /// start on its data.
    Single(PersistentRedis),
    /// Three primaries, no replicas; its fault is one primary's graceful
    /// stop and start on its data.
    Cluster(RedisCluster),
}

impl Redis {
    /// What `DTQ_TEST_REDIS` asks for: `cluster`, or (unset or `single`)
    /// one server.
    fn start() -> Result<Redis> {
        match std::env::var("DTQ_TEST_REDIS").as_deref() {
            Err(_) | Ok("" | "single") => {
                Ok(Redis::Single(PersistentRedis::start(REDIS_PERSISTENCE)?))
            }
            Ok("cluster") => Ok(Redis::Cluster(RedisCluster::start(3, 0)?)),
            Ok(other) => bail!("DTQ_TEST_REDIS={other:?}: use `single` or `cluster`"),
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Redis::Single(_) => "one redis-server with AOF",
            Redis::Cluster(_) => "a Redis Cluster of three primaries",
        }
    }

    /// The `--redis` value.
    fn url(&self) -> String {
        match self {
            Redis::Single(r) => r.url(),
            Redis::Cluster(c) => c.urls(),
        }
    }

    /// A connection as the host makes one (routed by slot on a cluster).
    async fn conn(&self) -> Result<Conn> {
        match self {
            Redis::Single(r) => r.manager().await,
            Redis::Cluster(c) => c.conn().await,
        }
    }
}

impl ChaosRedis for Redis {
    /// Outage number `n`: stop Redis (on a cluster, the primary of the
    /// parents' slot for an even `n`, of the children's for an odd one)
    /// gracefully, keep it down for `down`, start it again on its data.
    /// Returns what was stopped.
    async fn outage(&mut self, n: usize, down: Duration) -> Result<String> {
        match self {
            Redis::Single(redis) => redis.outage(n, down).await,
            Redis::Cluster(cluster) => {
                let queue = if n.is_multiple_of(2) { QUEUE } else { KIDS };
                tokio::task::block_in_place(|| -> Result<String> {
                    let port = cluster.master_of(&format!("dtq:stream:{{{queue}}}"))?;
                    cluster.restart_node(port, down)?;
                    Ok(format!("the primary on port {port} (serving {{{queue}}})"))
                })
            }
        }
    }

    /// The tail of the server's log (none on a cluster).
    fn log_tail(&self, dir: &Path) -> Option<String> {
        match self {
            Redis::Single(redis) => redis.log_tail(dir),
            Redis::Cluster(_) => None,
        }
    }
}

// ---------------------------------------------------------------------------
// Processes

/// The proxy the workers reach Redis through when
/// `DTQ_FLOWS_CHAOS_NETCUT_MS` is above 0 (not yet cutting).
async fn cutting_proxy(redis: &Redis) -> Result<Option<CuttingProxy>> {
    let longest: u64 = env_var("DTQ_FLOWS_CHAOS_NETCUT_MS", 0)?;
    if longest == 0 {
        return Ok(None);
    }
    let Redis::Single(server) = redis else {
        bail!("DTQ_FLOWS_CHAOS_NETCUT_MS cuts the connections to one server, not to a cluster");
    };
    let upstream = format!("127.0.0.1:{}", server.port()).parse()?;
    let lifetime = Duration::from_millis(longest / 3)..Duration::from_millis(longest);
    eprintln!(
        "flows chaos: every worker connection cut after {:?} to {:?}",
        lifetime.start, lifetime.end
    );
    Ok(Some(CuttingProxy::start(upstream, lifetime).await?))
}

/// The flags of every server process besides the ones all chaos servers
/// run with: both queues, `fan_out`'s grant, and short timings.
fn server_flags() -> Vec<String> {
    [
        "--queues",
        WORKER_QUEUES,
        "--submit-to",
        SUBMIT_TO,
        "--concurrency",
        CONCURRENCY,
        "--visibility-timeout-ms",
        VISIBILITY_MS,
        "--max-attempts",
        MAX_ATTEMPTS,
        "--task-timeout-ms",
        TASK_TIMEOUT_MS,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Where the worker logs what its flow sweep repaired (at debug).
const SWEEP_LOG_TARGET: &str = "dtq_host::worker::outbox";

/// What the workers' logs say the flow sweep did, or was left to do.
#[derive(Default)]
struct SweepWork {
    /// Flows the sweep repaired: staged submissions applied, or a parent
    /// resumed.
    repaired: usize,
    /// Outboxes whose application failed, left to the sweep.
    apply_failed: usize,
    /// Parents whose notice of a child's end failed, left to the sweep.
    notice_failed: usize,
}

impl SweepWork {
    fn count<'a>(procs: impl Iterator<Item = &'a DtqProcess>) -> SweepWork {
        let mut work = SweepWork::default();
        for p in procs {
            let log = p.log_text();
            work.repaired += log.matches("flow repaired by the sweep").count();
            work.apply_failed += log.matches("applying staged submissions failed").count();
            work.notice_failed += log.matches("telling the parent failed").count();
        }
        work
    }
}

// ---------------------------------------------------------------------------
// The workload

/// One parent of the run.
struct Parent {
    /// Its ten distinct numbers, in the order its payload lists them.
    numbers: Vec<i64>,
    /// Its Idempotency-Key.
    key: String,
    /// The submission's body.
    body: Value,
}

impl Parent {
    /// The result it must end with.
    fn expected_sum(&self) -> i64 {
        self.numbers.iter().map(|n| n * n).sum()
    }
}

/// The parents of a run.
fn plan(settings: &Settings, rng: &mut StdRng) -> Vec<Parent> {
    (0..settings.size)
        .map(|p| {
            let mut numbers = Vec::with_capacity(CHILDREN);
            while numbers.len() < CHILDREN {
                let n = rng.random_range(NUMBERS);
                if !numbers.contains(&n) {
                    numbers.push(n);
                }
            }
            let body = json!({
                "task": "fan_out",
                "payload": {"numbers": numbers, "queue": KIDS},
                "max_attempts": MAX_ATTEMPTS.parse::<u32>().unwrap_or(10),
                "timeout_ms": TASK_TIMEOUT_MS.parse::<u64>().unwrap_or(5_000),
            });
            Parent {
                numbers,
                key: format!("parent-{p:06}"),
                body,
            }
        })
        .collect()
}

impl Submission for Parent {
    fn body(&self) -> &Value {
        &self.body
    }

    fn key(&self) -> Option<&str> {
        Some(&self.key)
    }

    fn name(&self) -> String {
        format!("of {}", self.key)
    }
}

/// How long a read of the outcome is retried: twice the longest a
/// process's cluster connection may stall after a primary's restart before
/// it is replaced (30 s, README "Redis Cluster"), during which the API
/// answers 503 `STORE_UNAVAILABLE`.
const READ_RETRY_FOR: Duration = Duration::from_secs(60);

/// GET `path` of the API until it answers 200 (retrying, for up to
/// [`READ_RETRY_FOR`], what may be a passing failure); the body.
async fn get_json(api: &ApiClient, path: &str) -> Result<Value> {
    let mut last = String::new();
    let deadline = Instant::now() + READ_RETRY_FOR;
    while Instant::now() < deadline {
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.call(reqwest::Method::GET, path, None, &[]),
        )
        .await;
        last = match answer {
            Ok(Ok((200, body))) => return Ok(body),
            Ok(Ok((code, body))) if code < 500 => bail!("GET {path}: {code} {body}"),
            Ok(Ok((code, body))) => format!("{code} {body}"),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("GET {path}: {last}")
}

// ---------------------------------------------------------------------------
// Reading the outcome

/// A task hash's fields this test reads.
#[derive(Clone, Debug, Default)]
struct TaskRow {
    status: String,
    attempts: Option<String>,
    waits: Option<String>,
    result: Option<String>,
    error: Option<String>,
}

impl TaskRow {
    fn is_terminal(&self) -> bool {
        TERMINAL.contains(&self.status.as_str())
    }

    fn count(field: &Option<String>) -> u32 {
        field.as_deref().and_then(|a| a.parse().ok()).unwrap_or(0)
    }

    /// Attempts started (0 for a task that never ran).
    fn attempts(&self) -> u32 {
        Self::count(&self.attempts)
    }

    /// Times it went WAITING.
    fn waits(&self) -> u32 {
        Self::count(&self.waits)
    }
}

/// The task hashes of `ids` of `queue` (`None` for a task with no hash).
async fn read_tasks(conn: &mut Conn, queue: &str, ids: &[String]) -> Result<Vec<Option<TaskRow>>> {
    let fields = ["status", "attempts", "waits", "result", "error"];
    let rows = task_fields(conn, queue, ids, &fields).await?;
    Ok(rows
        .into_iter()
        .map(|f| {
            let [status, attempts, waits, result, error] = <[_; 5]>::try_from(f).ok()?;
            Some(TaskRow {
                status: status?,
                attempts,
                waits,
                result,
                error,
            })
        })
        .collect())
}

/// The ids of every task of `queue` (its task hashes in Redis; on a
/// cluster, asked of every primary).
async fn task_ids_in_redis(conn: &mut Conn, queue: &str) -> Result<Vec<String>> {
    let prefix = format!("dtq:task:{{{queue}}}:");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(conn)
        .await?;
    let mut ids: Vec<String> = keys
        .into_iter()
        .filter_map(|k| k.strip_prefix(&prefix).map(str::to_owned))
        .collect();
    ids.sort();
    Ok(ids)
}

/// Where the stream message of task `id` of `queue` stands, for a task
/// left not terminal: the hash's attempt (worker, message, attempt), the
/// message's pending entry (its consumer, idle time, deliveries) or its
/// absence, and when that consumer last beat.
async fn delivery(conn: &mut Conn, queue: &str, id: &str) -> Result<String> {
    let keys = QueueKeys::new(queue);
    let (worker, msg_id, attempts): (Option<String>, Option<String>, Option<String>) =
        redis::cmd("HMGET")
            .arg(keys.task(id))
            .arg(&["worker", "msg_id", "attempts"][..])
            .query_async(conn)
            .await?;
    let attempt = format!(
        "(worker {}, message {}, attempt {})",
        worker.as_deref().unwrap_or("-"),
        msg_id.as_deref().unwrap_or("-"),
        attempts.as_deref().unwrap_or("-"),
    );
    let Some(msg_id) = msg_id else {
        return Ok(attempt);
    };
    let in_stream: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg(&msg_id)
        .arg(&msg_id)
        .query_async(conn)
        .await?;
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&keys.stream)
        .arg(GROUP)
        .arg(&msg_id)
        .arg(&msg_id)
        .arg(1)
        .query_async(conn)
        .await?;
    let message = if in_stream.is_empty() {
        "gone from the stream"
    } else {
        "in the stream"
    };
    let Some((_, consumer, idle, deliveries)) = pending.into_iter().next() else {
        return Ok(format!("{attempt}: message {message}, not pending"));
    };
    let beat: Option<String> = redis::cmd("ZSCORE")
        .arg(&keys.workers)
        .arg(&consumer)
        .query_async(conn)
        .await?;
    Ok(format!(
        "{attempt}: message {message}, pending on {consumer} (idle {idle} ms, \
         {deliveries} deliveries; its last beat {})",
        beat.as_deref().unwrap_or("none")
    ))
}

/// The members of sorted set `key`.
async fn members(conn: &mut Conn, key: &str) -> Result<Vec<String>> {
    Ok(redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await?)
}

/// What a parent's lifecycle events (its queue's events stream) say.
#[derive(Debug, Default)]
struct ParentEvents {
    /// Its statuses, in order.
    statuses: Vec<String>,
}

impl ParentEvents {
    /// Whether its first event, its submission (QUEUED), is still in the
    /// stream: the stream is capped, and trimmed from its oldest.
    fn complete(&self) -> bool {
        self.statuses.first().is_some_and(|s| s == "QUEUED")
    }

    /// The times it went WAITING, and the times it was resumed: QUEUED
    /// right after WAITING (nothing else happens to a waiting task; a
    /// QUEUED after RETRYING is a retry).
    fn waits_and_resumptions(&self) -> (usize, usize) {
        let waits = self.statuses.iter().filter(|s| *s == "WAITING").count();
        let resumed = self
            .statuses
            .windows(2)
            .filter(|w| w[0] == "WAITING" && w[1] == "QUEUED")
            .count();
        (waits, resumed)
    }
}

/// The lifecycle events of every task of `queue`, by task, oldest first.
async fn events_by_task(conn: &mut Conn, queue: &str) -> Result<HashMap<String, ParentEvents>> {
    let key = format!("dtq:events:{{{queue}}}");
    let mut by_task: HashMap<String, ParentEvents> = HashMap::new();
    let mut from = "-".to_owned();
    loop {
        let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(&key)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(1_000)
            .query_async(conn)
            .await?;
        let Some((last, _)) = entries.last() else {
            break;
        };
        from = format!("({last}");
        for (id, body) in entries {
            let id: dtq_host::store::StreamId = id.parse()?;
            for event in dtq_host::store::QueueEvent::from_entry(id, body) {
                by_task
                    .entry(event.task_id)
                    .or_default()
                    .statuses
                    .push(event.status);
            }
        }
    }
    Ok(by_task)
}

/// Every task of both queues that is not terminal, and the members of the
/// four flow indexes, as they are now.
struct Leftovers {
    live: Vec<String>,
    live_by_status: BTreeMap<String, usize>,
    flows_default: Vec<String>,
    settle_kids: Vec<String>,
    other_indexes: Vec<String>,
}

impl Leftovers {
    async fn read(conn: &mut Conn) -> Result<Leftovers> {
        let mut live = Vec::new();
        let mut live_by_status = BTreeMap::new();
        for queue in [QUEUE, KIDS] {
            let ids = task_ids_in_redis(conn, queue).await?;
            for (id, row) in ids.iter().zip(read_tasks(conn, queue, &ids).await?) {
                let Some(row) = row else { continue };
                if !row.is_terminal() {
                    *live_by_status.entry(row.status.clone()).or_default() += 1;
                    let delivery = delivery(conn, queue, id).await?;
                    live.push(format!("{queue}/{id}: {} {delivery}", row.status));
                }
            }
        }
        let mut other_indexes = Vec::new();
        for key in [
            format!("dtq:flows:{{{KIDS}}}"),
            format!("dtq:settle:{{{QUEUE}}}"),
        ] {
            for m in members(conn, &key).await? {
                other_indexes.push(format!("{key}: {m}"));
            }
        }
        Ok(Leftovers {
            live,
            live_by_status,
            flows_default: members(conn, &format!("dtq:flows:{{{QUEUE}}}")).await?,
            settle_kids: members(conn, &format!("dtq:settle:{{{KIDS}}}")).await?,
            other_indexes,
        })
    }

    fn quiet(&self) -> bool {
        self.live.is_empty()
            && self.flows_default.is_empty()
            && self.settle_kids.is_empty()
            && self.other_indexes.is_empty()
    }
}

/// What the API and Redis say of one parent's children.
#[derive(Default)]
struct ChildrenCheck {
    /// The children's ids, in the order the parent lists them.
    ids: Vec<String>,
    /// What is wrong with them, if anything.
    problems: Vec<String>,
}

/// Read parent `id` and each of its children through the API, and check
/// them against `parent`'s numbers.
async fn check_children(api: &ApiClient, id: &str, parent: &Parent) -> Result<ChildrenCheck> {
    let task = get_json(api, &format!("/v1/queues/{QUEUE}/tasks/{id}")).await?;
    let listed = task["children"].as_array().cloned().unwrap_or_default();
    let mut check = ChildrenCheck::default();
    if listed.len() != CHILDREN {
        check
            .problems
            .push(format!("{} children listed, not {CHILDREN}", listed.len()));
    }
    let reads = futures::stream::iter(listed.iter().enumerate())
        .map(|(i, child)| async move {
            let child_id = child["task_id"].as_str().unwrap_or("").to_owned();
            let mut problems = Vec::new();
            if child["queue"] != KIDS || child["task"] != "square" {
                problems.push(format!(
                    "child {i} is {}/{} {child_id}",
                    child["queue"], child["task"]
                ));
            }
            if child["status"] != "SUCCEEDED" {
                problems.push(format!(
                    "child {i} {child_id} is {} ({})",
                    child["status"], child["error"]
                ));
            }
            if child_id.is_empty() {
                problems.push(format!("child {i} has no id: {child}"));
                return (child_id, problems);
            }
            let path = format!("/v1/queues/{KIDS}/tasks/{child_id}");
            let record = match get_json(api, &path).await {
                Ok(record) => record,
                Err(e) => {
                    problems.push(format!("child {i}: {e:#}"));
                    return (child_id, problems);
                }
            };
            let want = parent.numbers.get(i).map(|n| json!({"n": n}));
            if Some(&record["payload"]) != want.as_ref() {
                problems.push(format!(
                    "child {i} {child_id} has payload {}, not {}",
                    record["payload"],
                    want.map_or("none (one child too many)".into(), |w| w.to_string())
                ));
            }
            if record["parent"] != json!({"queue": QUEUE, "task_id": id}) {
                problems.push(format!(
                    "child {i} {child_id} names parent {}",
                    record["parent"]
                ));
            }
            (child_id, problems)
        })
        .buffered(4)
        .collect::<Vec<_>>()
        .await;
    for (child_id, problems) in reads {
        check.ids.push(child_id);
        check.problems.extend(problems);
    }
    Ok(check)
}

fn describe(id: &str, row: Option<&TaskRow>) -> String {
    match row {
        None => format!("{id}: no task hash"),
        Some(r) => format!(
            "{id}: {} attempts {} waits {} result {} error {:?}",
            r.status,
            r.attempts.as_deref().unwrap_or("-"),
            r.waits.as_deref().unwrap_or("-"),
            r.result.as_deref().unwrap_or("-"),
            r.error.as_deref().unwrap_or("")
        ),
    }
}

/// `counts` as `k v, k v`.
fn breakdown<K: std::fmt::Display>(counts: &BTreeMap<K, usize>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---------------------------------------------------------------------------
// The test

#[tokio::test(flavor = "multi_thread")]
async fn flows_resume_once_and_children_exist_once_under_chaos() -> Result<()> {
    let settings = Settings::from_env("DTQ_FLOWS_CHAOS", ("PARENTS", 200), 30, 120)?;
    let redis = Redis::start()?;
    eprintln!(
        "flows chaos: seed {} (DTQ_FLOWS_CHAOS_SEED={} replays it): {} fan_out parents of {} \
         children over {} s on {}, {} workers, a kill every ~{} ms, {} Redis restarts",
        settings.seed,
        settings.seed,
        settings.size,
        CHILDREN,
        settings.secs,
        redis.describe(),
        WORKERS,
        settings.kill_ms,
        settings.redis_restarts
    );
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let parents = plan(&settings, &mut rng);
    let chaos_rng = StdRng::seed_from_u64(rng.random());

    let dir = TempDir::new("flows-chaos")?;
    let t_setup = Instant::now();
    let servers = Servers {
        bin: DTQ,
        redis_url: redis.url(),
        flags: server_flags(),
        // The sweep's repairs, counted in the table.
        log_filter: format!("info,{SWEEP_LOG_TARGET}=debug"),
    };
    let mut api_proc = servers.start(&dir.path, "api", "api").await?;
    // The API talks to Redis directly; the workers through the proxy, if
    // their connections are cut.
    let proxy = cutting_proxy(&redis).await?;
    let worker_servers = match &proxy {
        Some(proxy) => Servers {
            redis_url: proxy.redis_url(),
            ..servers
        },
        None => servers,
    };
    let mut chaos = Chaos::new("flows chaos", dir.path.clone(), redis, worker_servers);
    chaos.start_workers(WORKERS).await?;
    if let Some(proxy) = &proxy {
        proxy.set_cutting(true);
    }
    eprintln!(
        "flows chaos: API and {WORKERS} workers ready in {:.1} s; logs in {}",
        t_setup.elapsed().as_secs_f64(),
        dir.path.display()
    );

    let api = ApiClient::new(api_proc.api.clone());
    let parents = Arc::new(parents);
    let acks = chaos
        .run(WAVES, &settings, chaos_rng, &api, parents.clone())
        .await;
    let t0 = chaos.t0;
    let chaos_ended = t0.elapsed();

    // What was acknowledged: each parent's task.
    let mut parent_ids: Vec<Option<String>> = Vec::with_capacity(parents.len());
    let mut never_acked = Vec::new();
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    let mut retried = 0;
    for (parent, ack) in parents.iter().zip(&acks) {
        match ack {
            Ok(ack) => {
                *codes.entry(ack.code).or_default() += 1;
                if ack.tries > 1 {
                    retried += 1;
                }
                parent_ids.push(Some(ack.task_id.clone()));
            }
            Err(e) => {
                never_acked.push(format!("{}: {e:#}", parent.key));
                parent_ids.push(None);
            }
        }
    }
    let acked_ids: Vec<String> = parent_ids.iter().flatten().cloned().collect();
    let distinct_parents: HashSet<&String> = acked_ids.iter().collect();

    // Wait for every parent to end, then for the sweep to finish what the
    // killed workers left (every task ended, the indexes empty).
    let mut conn = chaos.redis.conn().await?;
    let mut leftovers = None;
    if chaos.error.is_none() {
        let deadline = Instant::now() + Duration::from_secs(settings.drain_secs);
        wait_terminal(&mut conn, "flows chaos", QUEUE, &acked_ids, deadline, t0).await?;
        let quiet_by = Instant::now() + QUIET_DEADLINE;
        loop {
            let now = Leftovers::read(&mut conn).await?;
            let done = now.quiet() || Instant::now() >= quiet_by;
            leftovers = Some(now);
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let leftovers = match leftovers {
        Some(l) => l,
        None => Leftovers::read(&mut conn).await?,
    };
    let drained = t0.elapsed();
    chaos.note_exits(&mut api_proc)?;

    // The parents, from Redis.
    let rows = read_tasks(&mut conn, QUEUE, &acked_ids).await?;
    let row_of: HashMap<&str, Option<&TaskRow>> = acked_ids
        .iter()
        .zip(&rows)
        .map(|(id, r)| (id.as_str(), r.as_ref()))
        .collect();
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let mut waits_count: BTreeMap<u32, usize> = BTreeMap::new();
    let (mut right, mut wrong, mut waited_once, mut waits_off) = (0, vec![], 0, vec![]);
    let (mut parents_retried, mut max_attempts_seen) = (0, 0);
    for (parent, id) in parents.iter().zip(&parent_ids) {
        let Some(id) = id else { continue };
        let row = row_of.get(id.as_str()).copied().flatten();
        let Some(row) = row else {
            wrong.push(format!("{}: {}", parent.key, describe(id, None)));
            waits_off.push(format!("{}: {}", parent.key, describe(id, None)));
            continue;
        };
        *by_status.entry(row.status.clone()).or_default() += 1;
        *waits_count.entry(row.waits()).or_default() += 1;
        if row.attempts() > 1 {
            parents_retried += 1;
        }
        max_attempts_seen = max_attempts_seen.max(row.attempts());
        let result: Value = row
            .result
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or(Value::Null);
        if row.status == "SUCCEEDED" && result == json!({"sum_of_squares": parent.expected_sum()}) {
            right += 1;
        } else {
            wrong.push(format!(
                "{}: {}; want sum_of_squares {}",
                parent.key,
                describe(id, Some(row)),
                parent.expected_sum()
            ));
        }
        if row.waits() == 1 {
            waited_once += 1;
        } else {
            waits_off.push(format!("{}: {}", parent.key, describe(id, Some(row))));
        }
    }

    // The parents' resumptions, from their queue's events.
    let events = events_by_task(&mut conn, QUEUE).await?;
    let (mut resumed_once, mut trimmed, mut resumed_off) = (0, 0, vec![]);
    let mut resumptions: BTreeMap<usize, usize> = BTreeMap::new();
    for (parent, id) in parents.iter().zip(&parent_ids) {
        let Some(id) = id else { continue };
        let Some(ev) = events.get(id).filter(|ev| ev.complete()) else {
            trimmed += 1;
            continue;
        };
        let (waits, resumed) = ev.waits_and_resumptions();
        *resumptions.entry(resumed).or_default() += 1;
        if waits == 1 && resumed == 1 {
            resumed_once += 1;
        } else {
            resumed_off.push(format!("{}: {id}: {}", parent.key, ev.statuses.join(" ")));
        }
    }

    // The parents' children, through the API.
    let checks: Vec<(usize, Result<ChildrenCheck>)> = futures::stream::iter(
        parents
            .iter()
            .zip(&parent_ids)
            .enumerate()
            .filter_map(|(p, (parent, id))| id.as_ref().map(|id| (p, parent, id))),
    )
    .map(|(p, parent, id)| {
        let api = &api;
        async move { (p, check_children(api, id, parent).await) }
    })
    .buffered(READERS.div_ceil(4))
    .collect()
    .await;
    let (mut children_right, mut children_off) = (0, vec![]);
    let mut named: HashMap<String, Vec<String>> = HashMap::new();
    for (p, check) in &checks {
        let key = &parents[*p].key;
        match check {
            Ok(check) => {
                for child in &check.ids {
                    named.entry(child.clone()).or_default().push(key.clone());
                }
                if check.problems.is_empty() {
                    children_right += 1;
                } else {
                    children_off.push(format!("{key}: {}", check.problems.join("; ")));
                }
            }
            Err(e) => children_off.push(format!("{key}: {e:#}")),
        }
    }
    let named_twice: Vec<String> = named
        .iter()
        .filter(|(_, by)| by.len() > 1)
        .map(|(child, by)| format!("{child} named by {by:?}"))
        .collect();

    // Every task hash of both queues.
    let kids_in_redis = task_ids_in_redis(&mut conn, KIDS).await?;
    let parents_in_redis = task_ids_in_redis(&mut conn, QUEUE).await?;
    let kids_set: HashSet<&String> = kids_in_redis.iter().collect();
    let extra_kids: Vec<String> = kids_in_redis
        .iter()
        .filter(|id| !named.contains_key(*id))
        .cloned()
        .collect();
    let mut missing_kids: Vec<String> = named
        .keys()
        .filter(|id| !kids_set.contains(id))
        .map(|id| format!("{id} (named by {:?})", named[id]))
        .collect();
    missing_kids.sort();
    let extra_parents: Vec<String> = parents_in_redis
        .iter()
        .filter(|id| !distinct_parents.contains(id))
        .cloned()
        .collect();
    let (mut kids_retried, mut kids_max_attempts) = (0, 0);
    for row in read_tasks(&mut conn, KIDS, &kids_in_redis)
        .await?
        .into_iter()
        .flatten()
    {
        if row.attempts() > 1 {
            kids_retried += 1;
        }
        kids_max_attempts = kids_max_attempts.max(row.attempts());
    }

    let expected_parents = parents.len();
    let mut figures = vec![
        Figure {
            label: "parents submitted (acknowledged)".into(),
            value: acked_ids.len(),
            expected: expected_parents,
            note: format!(
                "answered 202: {}, 200: {}, 409: {}; {retried} needed more than one try",
                codes.get(&202).unwrap_or(&0),
                codes.get(&200).unwrap_or(&0),
                codes.get(&409).unwrap_or(&0),
            ),
        },
        Figure::none("parents never acknowledged", &never_acked),
        Figure {
            label: "distinct tasks among the acknowledgements".into(),
            value: distinct_parents.len(),
            expected: acked_ids.len(),
            note: String::new(),
        },
        Figure {
            label: "parent task hashes (dtq:task:{default}:*)".into(),
            value: parents_in_redis.len(),
            expected: distinct_parents.len(),
            note: if extra_parents.is_empty() {
                String::new()
            } else {
                format!("not acknowledged:\n{}", examples(&extra_parents))
            },
        },
        Figure {
            label: "parents SUCCEEDED with the right sum".into(),
            value: right,
            expected: acked_ids.len(),
            note: format!(
                "statuses: {}; {parents_retried} took more than one attempt, at most \
                 {max_attempts_seen}\n{}",
                breakdown(&by_status),
                examples(&wrong)
            ),
        },
        Figure {
            label: "parents that waited exactly once".into(),
            value: waited_once,
            expected: acked_ids.len(),
            note: format!(
                "waits: {}\n{}",
                breakdown(&waits_count),
                examples(&waits_off)
            ),
        },
        Figure {
            label: "parents resumed exactly once (their events)".into(),
            value: resumed_once,
            expected: acked_ids.len() - trimmed,
            note: format!(
                "one WAITING, then one resumption (QUEUED right after it); resumptions: {}{}\n{}",
                breakdown(&resumptions),
                if trimmed > 0 {
                    format!(
                        "; {trimmed} parents left out: their first events were trimmed from \
                         the capped stream"
                    )
                } else {
                    String::new()
                },
                examples(&resumed_off)
            ),
        },
        Figure {
            label: "parents whose 10 children are right".into(),
            value: children_right,
            expected: acked_ids.len(),
            note: format!(
                "all SUCCEEDED square on kids, naming the parent, payloads its numbers in \
                 order\n{}",
                examples(&children_off)
            ),
        },
        Figure {
            label: "child task hashes (dtq:task:{kids}:*)".into(),
            value: kids_in_redis.len(),
            expected: acked_ids.len() * CHILDREN,
            note: format!("{kids_retried} took more than one attempt, at most {kids_max_attempts}"),
        },
        Figure::none("children named by two parents", &named_twice),
        Figure::none("children no parent names (extra)", &extra_kids),
        Figure::none("children named with no task hash", &missing_kids),
        Figure {
            label: "tasks not terminal (WAITING, QUEUED, ...)".into(),
            value: leftovers.live.len(),
            expected: 0,
            note: if leftovers.live.is_empty() {
                String::new()
            } else {
                format!(
                    "{}\n{}",
                    breakdown(&leftovers.live_by_status),
                    examples(&leftovers.live)
                )
            },
        },
        Figure::none("dtq:flows:{default} entries", &leftovers.flows_default),
        Figure::none("dtq:settle:{kids} entries", &leftovers.settle_kids),
        Figure::none(
            "dtq:flows:{kids}, dtq:settle:{default} entries",
            &leftovers.other_indexes,
        ),
    ];
    if let Some(proxy) = &proxy {
        // The cuts did happen: each worker connection was cut many times.
        let cuts = usize::try_from(proxy.cuts())?;
        figures.push(Figure {
            label: "worker connections cut (at least)".into(),
            value: cuts.min(WORKERS * 10),
            expected: WORKERS * 10,
            note: format!("{cuts} cuts of {} connections", proxy.accepted()),
        });
    }

    // The table.
    let outages = chaos.outage_summary();
    let mut table = format!(
        "\nflows chaos: seed {}, {}, {} workers killed (SIGKILL), {} Redis restarts ({outages}); \
         submitted and struck for {:.0} s, drained in {:.0} s more, {:.0} s in all\n\n",
        settings.seed,
        chaos.redis.describe(),
        chaos.killed.len(),
        chaos.outages.len(),
        chaos_ended.as_secs_f64(),
        (drained - chaos_ended).as_secs_f64(),
        drained.as_secs_f64()
    );
    let sweep = SweepWork::count(chaos.gone.iter().chain(&chaos.workers));
    table += &format!(
        "the workers' logs: the flow sweep repaired {} flows (staged submissions applied, or a \
         parent resumed); {} applications of an outbox and {} notices to a parent failed, left \
         to the sweep\n\n",
        sweep.repaired, sweep.apply_failed, sweep.notice_failed
    );
    chaos.report(table, figures, 48, &api_proc, dir);
    Ok(())
}
