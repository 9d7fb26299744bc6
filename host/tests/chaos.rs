//! Chaos: real `dtq` processes (three workers and one API) against a
//! `redis-server` with AOF on, while the test SIGKILLs a random worker every
//! few seconds (starting a new one in its place) and stops and restarts
//! Redis twice. The workload mixes `send_receipt` orders (each with its own
//! Idempotency-Key, some submitted twice with it), `counter` and short
//! `sleep` tasks. At the end it prints one table and asserts each figure:
//! no acknowledged task lost or stuck, no live worker's task dead-lettered
//! as lost, no order charged twice, no order reported SUCCEEDED with no
//! charge.
//!
//! The tasks are submitted in waves, one before each fault, and each fault
//! strikes once half of its wave is acknowledged: the workers are busy, so a
//! kill or an outage interrupts tasks mid-run, not an idle fleet.
//!
//! Only acknowledged submissions count: 202 (new task), 200 (replay of a
//! terminal key) or 409 (key in flight; its task id is in the details). A
//! submission that fails (Redis down, connection dropped, timeout) is sent
//! again, with the same Idempotency-Key when it has one, until acknowledged.
//!
//! Sizes come from the environment; the defaults are the short form that
//! `cargo test` (and so CI) runs in a few minutes. `scripts/chaos` runs the
//! long form.
//!
//! | variable | default | |
//! |---|---|---|
//! | `DTQ_CHAOS_TASKS` | 2000 | submissions (tasks, plus deliberate duplicate submissions of orders) |
//! | `DTQ_CHAOS_SECS` | 60 | seconds of faults (a wave of submissions before each), Redis outages aside |
//! | `DTQ_CHAOS_KILL_MS` | 2500 | mean time between worker kills (each drawn from 80 % to 120 % of it) |
//! | `DTQ_CHAOS_REDIS_RESTARTS` | 2 | Redis stops and restarts, spread evenly over the run |
//! | `DTQ_CHAOS_DRAIN_SECS` | 180 | deadline for every task to be terminal once the chaos ends |
//! | `DTQ_CHAOS_SEED` | random | replays a run's workload and fault schedule (it is printed) |
//!
//! Every process writes its log to a file in the test's temporary
//! directory; when the test fails, the tail of each is printed and the
//! directory is kept.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dtq_tests::process::DtqProcess;
use dtq_tests::{ApiClient, PersistentRedis, TempDir, free_port, guests};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The queue every task goes to.
const QUEUE: &str = "default";

/// Where `send_receipt` counts the charges of order X: the key
/// `CHARGES_PREFIX` + X. A handler's kv key `<key>` lives at
/// `dtq:guest:{<namespace>}:<key>` (the namespace in braces: a Redis Cluster
/// hash tag), and `send_receipt`'s namespace is its task name; the handler
/// increments its kv key `charges:<order_id>` once per charge.
const CHARGES_PREFIX: &str = "dtq:guest:{send_receipt}:charges:";

/// Redis persistence: AOF on, fsynced every second. A graceful stop
/// (SHUTDOWN or SIGTERM) writes and fsyncs the whole AOF before the server
/// exits, and Redis writes each command to the AOF file before it replies,
/// so a graceful stop loses no acknowledged write; `always` would only add
/// an fsync per write, which guards against a machine crash this test does
/// not make.
const REDIS_PERSISTENCE: &[&str] = &["--appendonly", "yes", "--appendfsync", "everysec"];

/// Workers running at any time.
const WORKERS: usize = 3;

/// Each worker's execution slots (the default): what a kill interrupts
/// when the worker is busy.
const CONCURRENCY: &str = "8";

/// The visibility timeout every process runs with (ms): short, so that a
/// killed worker's tasks are reclaimed quickly, and shorter than each Redis
/// outage.
const VISIBILITY_MS: &str = "1000";

/// Every task's attempts: enough that worker kills alone never exhaust them.
const MAX_ATTEMPTS: u32 = 10;

/// Every task's time limit (ms); the longest task busy-waits 200 ms.
const TASK_TIMEOUT_MS: u64 = 5_000;

/// How long a process may take to be ready (it may compile the handlers
/// when the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Longest time one submission is retried before the test gives up on it.
const SUBMIT_GIVE_UP: Duration = Duration::from_secs(120);

/// Longest wait for one HTTP answer; a request that takes longer is sent
/// again.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Submissions in flight at once.
const SUBMITTERS: usize = 32;

/// Statuses after which a task never changes by itself.
const TERMINAL: &[&str] = &[
    "SUCCEEDED",
    "FAILED",
    "DEAD_LETTERED",
    "CANCELLED",
    "EXPIRED",
];

/// The sizes of a run, from the environment.
#[derive(Clone, Debug)]
struct Settings {
    tasks: usize,
    secs: u64,
    kill_ms: u64,
    redis_restarts: usize,
    drain_secs: u64,
    seed: u64,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> Result<T>
        where
            T::Err: std::fmt::Display,
        {
            match std::env::var(name) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .map_err(|e| anyhow::anyhow!("{name}={v:?}: {e}")),
                Err(std::env::VarError::NotPresent) => Ok(default),
                Err(e) => bail!("{name}: {e}"),
            }
        }
        let settings = Settings {
            tasks: var("DTQ_CHAOS_TASKS", 2_000)?,
            secs: var("DTQ_CHAOS_SECS", 60)?,
            kill_ms: var("DTQ_CHAOS_KILL_MS", 2_500)?,
            redis_restarts: var("DTQ_CHAOS_REDIS_RESTARTS", 2)?,
            drain_secs: var("DTQ_CHAOS_DRAIN_SECS", 180)?,
            seed: var("DTQ_CHAOS_SEED", rand::random::<u64>())?,
        };
        anyhow::ensure!(settings.tasks > 0, "DTQ_CHAOS_TASKS must be positive");
        anyhow::ensure!(settings.secs > 0, "DTQ_CHAOS_SECS must be positive");
        anyhow::ensure!(
            settings.kill_ms >= 100,
            "DTQ_CHAOS_KILL_MS must be at least 100"
        );
        Ok(settings)
    }
}

// ---------------------------------------------------------------------------
// Processes

/// A `dtq` command configured by its flags alone, without colour.
fn dtq_command() -> Command {
    let mut cmd = dtq_tests::process::dtq_command(DTQ);
    cmd.env("NO_COLOR", "1");
    cmd
}

/// The flags of every server process: the test's Redis, the example
/// handlers, a shared artifact cache and short timings.
fn server_flags(redis_url: &str) -> Vec<String> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    [
        "--redis",
        redis_url,
        "--handlers",
        guests::EXAMPLES_DIR,
        "--concurrency",
        CONCURRENCY,
        "--visibility-timeout-ms",
        VISIBILITY_MS,
        "--retry-base-ms",
        "20",
        "--retry-max-ms",
        "200",
        "--cache-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([cache.display().to_string()])
    .collect()
}

/// A `dtq worker` or `dtq api` process, killed on drop. Its log is not
/// printed then (the test prints the tails it needs).
struct Proc(DtqProcess);

impl std::ops::Deref for Proc {
    type Target = DtqProcess;
    fn deref(&self) -> &DtqProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut DtqProcess {
        &mut self.0
    }
}

impl Proc {
    /// Start `dtq worker` or `dtq api` and wait until it is ready: the
    /// worker has logged its start, or the API answers `/healthz`.
    async fn start(dir: &Path, name: &str, subcommand: &str, redis_url: &str) -> Result<Proc> {
        // A port free when probed may be taken before the API binds it;
        // such a start is retried on another port.
        let mut last = None;
        for attempt in 0..3 {
            let port = free_port()?;
            let log = dir.join(format!("{name}-{attempt}.log"));
            let mut cmd = dtq_command();
            cmd.arg(subcommand).args(server_flags(redis_url));
            if subcommand == "api" {
                cmd.args(["--listen", &format!("127.0.0.1:{port}")]);
            }
            let api = format!("http://127.0.0.1:{port}");
            let mut proc = Proc(DtqProcess::spawn(name, cmd, log, api)?);
            proc.print_log_on_drop = false;
            let ready = if subcommand == "worker" {
                proc.wait_log("worker started", STARTUP).await
            } else {
                proc.wait_healthy(STARTUP).await
            };
            match ready {
                Ok(()) => return Ok(proc),
                Err(e) if proc.log_text().contains("cannot listen") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("{name} did not start")))
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------
// The workload

/// What one submission is.
enum Work {
    /// `send_receipt` of order `order` (an index into the orders).
    Order(usize),
    Counter,
    Sleep,
}

/// One planned submission.
struct Planned {
    body: Value,
    key: Option<String>,
    work: Work,
}

/// A submission the API acknowledged.
#[derive(Clone, Debug)]
struct Ack {
    task_id: String,
    /// 202, 200 or 409.
    code: u16,
    /// Requests it took (1 when the first one was acknowledged).
    tries: u32,
}

/// The submissions of a run, in order, and the order ids (`Work::Order`
/// indexes them).
fn plan(settings: &Settings, rng: &mut StdRng) -> (Vec<Planned>, Vec<String>) {
    let mut orders: Vec<(String, Value)> = Vec::new();
    let mut planned = Vec::with_capacity(settings.tasks);
    let limits = |mut body: Value| {
        body["max_attempts"] = json!(MAX_ATTEMPTS);
        body["timeout_ms"] = json!(TASK_TIMEOUT_MS);
        body
    };
    for _ in 0..settings.tasks {
        let roll = rng.random_range(0..100);
        if roll < 5 && !orders.is_empty() {
            // A recent order submitted again with its key (often while its
            // task is in flight): the same task.
            let n = rng.random_range(orders.len().saturating_sub(8)..orders.len());
            planned.push(Planned {
                body: orders[n].1.clone(),
                key: Some(format!("order-{}", orders[n].0)),
                work: Work::Order(n),
            });
        } else if roll < 60 {
            let id = format!("ord-{:06}", orders.len());
            let body = limits(json!({
                "task": "send_receipt",
                "payload": {"order_id": id, "amount_cents": rng.random_range(100..100_000)},
            }));
            planned.push(Planned {
                body: body.clone(),
                key: Some(format!("order-{id}")),
                work: Work::Order(orders.len()),
            });
            orders.push((id, body));
        } else if roll < 80 {
            planned.push(Planned {
                body: limits(json!({
                    "task": "counter",
                    "payload": {
                        "name": format!("c{}", rng.random_range(0..16)),
                        "by": rng.random_range(1..=5),
                    },
                })),
                key: None,
                work: Work::Counter,
            });
        } else {
            planned.push(Planned {
                body: limits(json!({
                    "task": "sleep",
                    "payload": {"ms": rng.random_range(20..=200)},
                })),
                key: None,
                work: Work::Sleep,
            });
        }
    }
    (planned, orders.into_iter().map(|(id, _)| id).collect())
}

/// Submit until acknowledged (202, 200, or 409 with the in-flight task's
/// id), resending after a failure that may be Redis being down: a 5xx, a
/// dropped connection, a timeout. Any other answer is an error.
async fn submit_until_acked(api: &ApiClient, planned: &Planned) -> Result<Ack> {
    let start = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.submit(QUEUE, planned.body.clone(), planned.key.as_deref()),
        )
        .await;
        let last = match answer {
            Ok(Ok((code @ (200 | 202), body))) => {
                let task_id = body["task_id"]
                    .as_str()
                    .with_context(|| format!("{code} without a task_id: {body}"))?;
                return Ok(Ack {
                    task_id: task_id.to_owned(),
                    code,
                    tries,
                });
            }
            Ok(Ok((409, body))) if body["error"]["code"] == "IDEMPOTENCY_IN_PROGRESS" => {
                let task_id = body["error"]["details"]["task_id"]
                    .as_str()
                    .with_context(|| format!("409 without a task_id: {body}"))?;
                return Ok(Ack {
                    task_id: task_id.to_owned(),
                    code: 409,
                    tries,
                });
            }
            Ok(Ok((code, body))) if code >= 500 => format!("{code} {body}"),
            Ok(Ok((code, body))) => bail!("submission {} refused: {code} {body}", planned.body),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        if start.elapsed() > SUBMIT_GIVE_UP {
            bail!(
                "submission {} not acknowledged within {SUBMIT_GIVE_UP:?} ({tries} tries); \
                 last: {last}",
                planned.body
            );
        }
        let pause = 100 + u64::from(tries.min(10)) * 20;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

// ---------------------------------------------------------------------------
// The faults

/// The processes the chaos acts on, and what it did.
struct Chaos {
    dir: PathBuf,
    redis: PersistentRedis,
    workers: Vec<Proc>,
    /// Workers that have exited (killed or not), kept for their logs.
    gone: Vec<Proc>,
    /// Pids of the workers this test killed.
    killed: HashSet<u32>,
    /// Each Redis outage: when it began (since the start of the run) and
    /// how long Redis was down.
    outages: Vec<(Duration, Duration)>,
    /// Processes that exited without being killed.
    unexpected_exits: Vec<String>,
    /// A failure that ended the chaos early (a process or Redis that would
    /// not start).
    error: Option<anyhow::Error>,
    workers_started: usize,
}

impl Chaos {
    async fn start_worker(&mut self) -> Result<Proc> {
        self.workers_started += 1;
        let name = format!("worker-{}", self.workers_started);
        Proc::start(&self.dir, &name, "worker", &self.redis.url()).await
    }

    /// SIGKILL worker `i` and start a new one in its place.
    async fn kill_and_replace(&mut self, i: usize) -> Result<()> {
        let pid = self.workers[i].pid();
        self.workers[i].crash()?;
        self.killed.insert(pid);
        let new = self.start_worker().await?;
        let old = std::mem::replace(&mut self.workers[i], new);
        self.gone.push(old);
        Ok(())
    }

    /// Replace every worker that exited without being killed.
    async fn replace_exited(&mut self) -> Result<()> {
        for i in 0..self.workers.len() {
            if let Some(status) = self.workers[i].exit_status()? {
                let w = &self.workers[i];
                let line = format!("{} (pid {}) exited with {status}", w.name, w.pid());
                eprintln!("chaos: {line}");
                self.unexpected_exits.push(line);
                let new = self.start_worker().await?;
                let old = std::mem::replace(&mut self.workers[i], new);
                self.gone.push(old);
            }
        }
        Ok(())
    }

    /// Stop Redis gracefully, keep it down for `down`, start it again.
    async fn redis_outage(&mut self, down: Duration) -> Result<()> {
        tokio::task::block_in_place(|| self.redis.stop())?;
        tokio::time::sleep(down).await;
        tokio::task::block_in_place(|| self.redis.start_again())
    }

    /// The run: one wave of submissions per fault, the fault striking once
    /// half of its wave is acknowledged (so while the workers are busy with
    /// it), the faults spaced as `faults` says. Returns the acknowledgement
    /// of every submission, in the order of `planned`.
    async fn run(
        &mut self,
        faults: &[(Duration, Fault)],
        mut rng: StdRng,
        t0: Instant,
        api: &ApiClient,
        planned: Arc<Vec<Planned>>,
    ) -> Vec<Result<Ack>> {
        let acked = Arc::new(AtomicUsize::new(0));
        let waves = wave_bounds(planned.len(), faults.len().max(1));
        let mut pending = Vec::new();
        let mut next_event = t0;
        let mut next_progress = t0 + Duration::from_secs(10);
        for (w, range) in waves.into_iter().enumerate() {
            let fault = faults.get(w);
            if let Some((gap, _)) = fault {
                next_event += *gap;
            }
            tokio::time::sleep_until(next_event.into()).await;
            let wave_acked = Arc::new(AtomicUsize::new(0));
            let half = range.len().div_ceil(2);
            pending.push(tokio::spawn(submit_wave(
                api.clone(),
                planned.clone(),
                range,
                vec![acked.clone(), wave_acked.clone()],
            )));
            let Some((_, fault)) = fault else {
                continue;
            };
            if self.error.is_some() {
                continue;
            }
            // Strike while the wave runs: once half of it is acknowledged
            // (or after 5 s), and a random moment later.
            let since = Instant::now();
            while wave_acked.load(Ordering::Relaxed) < half
                && since.elapsed() < Duration::from_secs(5)
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..=100))).await;
            let step = async {
                self.replace_exited().await?;
                match fault {
                    Fault::Kill => {
                        let i = rng.random_range(0..self.workers.len());
                        self.kill_and_replace(i).await?;
                    }
                    Fault::RedisOutage => {
                        let down = Duration::from_millis(rng.random_range(1_500..=3_000));
                        let at = t0.elapsed();
                        eprintln!(
                            "chaos: {:>6.1} s  Redis stopped for {down:?}",
                            at.as_secs_f64()
                        );
                        self.redis_outage(down).await?;
                        let took = t0.elapsed() - at;
                        eprintln!(
                            "chaos: {:>6.1} s  Redis back (down {:.1} s with the restart)",
                            t0.elapsed().as_secs_f64(),
                            took.as_secs_f64()
                        );
                        self.outages.push((at, took));
                        // The next faults keep their spacing from here.
                        next_event = Instant::now();
                    }
                }
                anyhow::Ok(())
            };
            if let Err(e) = step.await {
                eprintln!("chaos: stopped early: {e:#}");
                self.error = Some(e);
            }
            if Instant::now() >= next_progress {
                eprintln!(
                    "chaos: {:>6.1} s  {} submissions acknowledged, {} workers killed, \
                     {} Redis restarts",
                    t0.elapsed().as_secs_f64(),
                    acked.load(Ordering::Relaxed),
                    self.killed.len(),
                    self.outages.len()
                );
                next_progress += Duration::from_secs(10);
            }
        }
        let mut acks = Vec::with_capacity(planned.len());
        for wave in pending {
            match wave.await {
                Ok(wave) => acks.extend(wave),
                Err(e) => panic!("a submission task failed: {e}"),
            }
        }
        acks
    }
}

/// A fault the test makes.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL a random worker and start a new one in its place.
    Kill,
    /// Stop Redis gracefully, keep it down 1.5 to 3 s, start it again on
    /// its data.
    RedisOutage,
}

/// The faults of a run, each with the time to wait before it: a kill every
/// `kill_ms` (± 20 %) for `secs`, and `redis_restarts` outages spread evenly
/// among them.
fn fault_plan(settings: &Settings, rng: &mut StdRng) -> Vec<(Duration, Fault)> {
    let mut gap = || Duration::from_millis(settings.kill_ms * rng.random_range(80..=120) / 100);
    let mut faults = Vec::new();
    let mut elapsed = Duration::ZERO;
    loop {
        let g = gap();
        elapsed += g;
        if elapsed > Duration::from_secs(settings.secs) {
            break;
        }
        faults.push((g, Fault::Kill));
    }
    let kills = faults.len();
    for k in (1..=settings.redis_restarts).rev() {
        let at = kills * k / (settings.redis_restarts + 1);
        faults.insert(at, (gap(), Fault::RedisOutage));
    }
    faults
}

/// `n` submissions in `waves` contiguous waves of sizes as even as can be.
fn wave_bounds(n: usize, waves: usize) -> Vec<std::ops::Range<usize>> {
    (0..waves)
        .map(|w| n * w / waves..n * (w + 1) / waves)
        .collect()
}

/// Submit `planned[range]`, `SUBMITTERS` at a time, each until
/// acknowledged; every counter in `acked` counts the acknowledged ones.
async fn submit_wave(
    api: ApiClient,
    planned: Arc<Vec<Planned>>,
    range: std::ops::Range<usize>,
    acked: Vec<Arc<AtomicUsize>>,
) -> Vec<Result<Ack>> {
    futures::stream::iter(range)
        .map(|i| {
            let (api, planned, acked) = (&api, &planned, &acked);
            async move {
                let ack = submit_until_acked(api, &planned[i]).await;
                if ack.is_ok() {
                    for counter in acked {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
                ack
            }
        })
        .buffered(SUBMITTERS)
        .collect()
        .await
}

// ---------------------------------------------------------------------------
// Reading the outcome

/// A task hash's fields this test reads.
#[derive(Clone, Debug, Default)]
struct TaskRow {
    status: String,
    error: Option<String>,
    worker: Option<String>,
    attempts: Option<String>,
}

impl TaskRow {
    fn is_terminal(&self) -> bool {
        TERMINAL.contains(&self.status.as_str())
    }
}

fn task_key(id: &str) -> String {
    format!("dtq:task:{{{QUEUE}}}:{id}")
}

/// The task hashes of `ids` (`None` for a task with no hash), read in
/// pipelined batches.
async fn read_tasks(
    conn: &mut redis::aio::MultiplexedConnection,
    ids: &[String],
) -> Result<Vec<Option<TaskRow>>> {
    let mut rows = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("HMGET")
                .arg(task_key(id))
                .arg(&["status", "error", "worker", "attempts"]);
        }
        let replies: Vec<Vec<Option<String>>> = pipe.query_async(conn).await?;
        for mut f in replies {
            let attempts = f.pop().flatten();
            let worker = f.pop().flatten();
            let error = f.pop().flatten();
            let status = f.pop().flatten();
            rows.push(status.map(|status| TaskRow {
                status,
                error,
                worker,
                attempts,
            }));
        }
    }
    Ok(rows)
}

/// The charge counter of each order in `orders`.
async fn read_charges(
    conn: &mut redis::aio::MultiplexedConnection,
    orders: &[String],
) -> Result<Vec<i64>> {
    let mut charges = Vec::with_capacity(orders.len());
    for chunk in orders.chunks(500) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("GET").arg(format!("{CHARGES_PREFIX}{id}"));
        }
        let replies: Vec<Option<String>> = pipe.query_async(conn).await?;
        for r in replies {
            charges.push(match r {
                Some(v) => v.parse().with_context(|| format!("charges {v:?}"))?,
                None => 0,
            });
        }
    }
    Ok(charges)
}

/// Poll the tasks `ids` until every one that has a hash is terminal, or
/// `deadline`.
async fn wait_terminal(
    conn: &mut redis::aio::MultiplexedConnection,
    ids: &[String],
    deadline: Instant,
    t0: Instant,
) -> Result<()> {
    let mut waiting: Vec<String> = ids.to_vec();
    let mut next_progress = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = read_tasks(conn, &waiting).await?;
        waiting = waiting
            .into_iter()
            .zip(rows)
            .filter(|(_, row)| row.as_ref().is_some_and(|r| !r.is_terminal()))
            .map(|(id, _)| id)
            .collect();
        if waiting.is_empty() || Instant::now() >= deadline {
            return Ok(());
        }
        if Instant::now() >= next_progress {
            eprintln!(
                "chaos: {:>6.1} s  draining: {} tasks not terminal yet",
                t0.elapsed().as_secs_f64(),
                waiting.len()
            );
            next_progress += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One row of the final table.
struct Figure {
    label: String,
    value: usize,
    /// What the value must be.
    expected: usize,
    /// Details: a breakdown, or examples of the offending tasks.
    note: String,
}

/// Up to five examples, one a line, as a note.
fn examples(items: &[String]) -> String {
    let mut note: Vec<String> = items.iter().take(5).cloned().collect();
    if items.len() > 5 {
        note.push(format!("... and {} more", items.len() - 5));
    }
    note.join("\n")
}

fn describe(id: &str, row: Option<&TaskRow>) -> String {
    match row {
        None => format!("{id}: no task hash"),
        Some(r) => format!(
            "{id}: {} attempts {} worker {} error {:?}",
            r.status,
            r.attempts.as_deref().unwrap_or("-"),
            r.worker.as_deref().unwrap_or("-"),
            r.error.as_deref().unwrap_or("")
        ),
    }
}

/// The pid in a consumer name `<pid>-<uuid>`.
fn consumer_pid(worker: &str) -> Option<u32> {
    worker.split('-').next()?.parse().ok()
}

// ---------------------------------------------------------------------------
// The test

#[tokio::test(flavor = "multi_thread")]
async fn chaos_loses_and_doubles_nothing() -> Result<()> {
    let settings = Settings::from_env()?;
    eprintln!(
        "chaos: seed {} (DTQ_CHAOS_SEED={} replays it): {} submissions over {} s, {} workers, \
         a kill every ~{} ms, {} Redis restarts",
        settings.seed,
        settings.seed,
        settings.tasks,
        settings.secs,
        WORKERS,
        settings.kill_ms,
        settings.redis_restarts
    );
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let (planned, orders) = plan(&settings, &mut rng);
    let mut chaos_rng = StdRng::seed_from_u64(rng.random());

    let dir = TempDir::new("chaos")?;
    let redis = PersistentRedis::start(REDIS_PERSISTENCE)?;
    let t_setup = Instant::now();
    let api_proc = Proc::start(&dir.path, "api", "api", &redis.url()).await?;
    let mut chaos = Chaos {
        dir: dir.path.clone(),
        redis,
        workers: Vec::new(),
        gone: Vec::new(),
        killed: HashSet::new(),
        outages: Vec::new(),
        unexpected_exits: Vec::new(),
        error: None,
        workers_started: 0,
    };
    // One at a time: the first one fills the artifact cache.
    for _ in 0..WORKERS {
        let w = chaos.start_worker().await?;
        chaos.workers.push(w);
    }
    eprintln!(
        "chaos: API and {WORKERS} workers ready in {:.1} s; logs in {}",
        t_setup.elapsed().as_secs_f64(),
        dir.path.display()
    );

    let faults = fault_plan(&settings, &mut chaos_rng);
    let api = ApiClient::new(api_proc.api.clone());
    let planned = Arc::new(planned);
    let t0 = Instant::now();
    let acks = chaos
        .run(&faults, chaos_rng, t0, &api, planned.clone())
        .await;
    let chaos_ended = t0.elapsed();
    eprintln!(
        "chaos: {:>6.1} s  every submission acknowledged, chaos over: draining",
        chaos_ended.as_secs_f64(),
    );

    // What was acknowledged.
    let mut task_ids: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut key_tasks: HashMap<String, HashSet<String>> = HashMap::new();
    let mut order_task: HashMap<usize, String> = HashMap::new();
    let mut never_acked = Vec::new();
    let mut retried = 0;
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    let mut expected_tasks = 0;
    let mut first_submission: HashSet<String> = HashSet::new();
    for (p, ack) in planned.iter().zip(&acks) {
        let logical_new = match &p.key {
            Some(k) => first_submission.insert(k.clone()),
            None => true,
        };
        if logical_new {
            expected_tasks += 1;
        }
        let ack = match ack {
            Ok(ack) => ack,
            Err(e) => {
                never_acked.push(format!("{e:#}"));
                continue;
            }
        };
        *codes.entry(ack.code).or_default() += 1;
        if ack.tries > 1 {
            retried += 1;
        }
        if seen.insert(ack.task_id.clone()) {
            task_ids.push(ack.task_id.clone());
        }
        if let Some(k) = &p.key {
            key_tasks
                .entry(k.clone())
                .or_default()
                .insert(ack.task_id.clone());
        }
        if let Work::Order(o) = p.work {
            order_task.entry(o).or_insert_with(|| ack.task_id.clone());
        }
    }

    // Wait for every acknowledged task to be terminal (Redis is up, and the
    // workers are the last three started).
    let mut conn = chaos.redis.conn().await?;
    if chaos.error.is_none() {
        let deadline = Instant::now() + Duration::from_secs(settings.drain_secs);
        wait_terminal(&mut conn, &task_ids, deadline, t0).await?;
    }
    let drained = t0.elapsed();
    for w in &mut chaos.workers {
        if let Some(status) = w.exit_status()? {
            chaos.unexpected_exits.push(format!(
                "{} (pid {}) exited with {status}",
                w.name,
                w.pid()
            ));
        }
    }
    let mut api_proc = api_proc;
    if let Some(status) = api_proc.exit_status()? {
        chaos
            .unexpected_exits
            .push(format!("api (pid {}) exited with {status}", api_proc.pid()));
    }

    // The outcome.
    let rows = read_tasks(&mut conn, &task_ids).await?;
    let row_of: HashMap<&str, Option<&TaskRow>> = task_ids
        .iter()
        .zip(&rows)
        .map(|(id, r)| (id.as_str(), r.as_ref()))
        .collect();
    let charged_orders: Vec<usize> = {
        let mut o: Vec<usize> = order_task.keys().copied().collect();
        o.sort_unstable();
        o
    };
    let order_ids: Vec<String> = charged_orders.iter().map(|o| orders[*o].clone()).collect();
    let charges = read_charges(&mut conn, &order_ids).await?;

    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let (mut lost, mut stuck, mut live_lost, mut other) = (vec![], vec![], vec![], vec![]);
    let mut max_attempts_seen = 0u32;
    let mut retried_tasks = 0;
    for (id, row) in task_ids.iter().zip(&rows) {
        let Some(row) = row else {
            lost.push(describe(id, None));
            continue;
        };
        *by_status.entry(row.status.clone()).or_default() += 1;
        let attempts: u32 = row
            .attempts
            .as_deref()
            .and_then(|a| a.parse().ok())
            .unwrap_or(0);
        max_attempts_seen = max_attempts_seen.max(attempts);
        if attempts > 1 {
            retried_tasks += 1;
        }
        if !row.is_terminal() {
            stuck.push(describe(id, Some(row)));
        } else if row.status != "SUCCEEDED" {
            other.push(describe(id, Some(row)));
        }
        let lost_worker = row.status == "DEAD_LETTERED"
            && row
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("worker lost"));
        let by_killed = row
            .worker
            .as_deref()
            .and_then(consumer_pid)
            .is_some_and(|pid| chaos.killed.contains(&pid));
        if lost_worker && !by_killed {
            live_lost.push(describe(id, Some(row)));
        }
    }
    let (mut twice, mut succeeded_uncharged) = (vec![], vec![]);
    for ((o, id), charges) in charged_orders.iter().zip(&order_ids).zip(&charges) {
        let task = &order_task[o];
        let row = row_of.get(task.as_str()).copied().flatten();
        let line = || {
            format!(
                "order {id}, {} charges; task {}",
                charges,
                describe(task, row)
            )
        };
        if *charges > 1 {
            twice.push(line());
        }
        if *charges == 0 && row.is_some_and(|r| r.status == "SUCCEEDED") {
            succeeded_uncharged.push(line());
        }
    }
    let split_keys: Vec<String> = key_tasks
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(k, ids)| format!("key {k}: tasks {ids:?}"))
        .collect();
    let succeeded = by_status.get("SUCCEEDED").copied().unwrap_or(0);
    let other_breakdown = by_status
        .iter()
        .filter(|(s, _)| s.as_str() != "SUCCEEDED" && TERMINAL.contains(&s.as_str()))
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ");

    let figures = vec![
        Figure {
            label: "tasks submitted (acknowledged)".into(),
            value: task_ids.len(),
            expected: expected_tasks,
            note: format!(
                "{} submissions: {} answered 202, {} 200, {} 409; {} needed more than one try",
                planned.len(),
                codes.get(&202).unwrap_or(&0),
                codes.get(&200).unwrap_or(&0),
                codes.get(&409).unwrap_or(&0),
                retried
            ),
        },
        Figure {
            label: "submissions never acknowledged".into(),
            value: never_acked.len(),
            expected: 0,
            note: examples(&never_acked),
        },
        Figure {
            label: "idempotency keys with two tasks".into(),
            value: split_keys.len(),
            expected: 0,
            note: examples(&split_keys),
        },
        Figure {
            label: "tasks succeeded".into(),
            value: succeeded,
            expected: task_ids.len(),
            note: format!(
                "{retried_tasks} took more than one attempt, at most {max_attempts_seen}"
            ),
        },
        Figure {
            label: "tasks in other terminal statuses".into(),
            value: other.len(),
            expected: 0,
            note: if other.is_empty() {
                String::new()
            } else {
                format!("{other_breakdown}\n{}", examples(&other))
            },
        },
        Figure {
            label: "tasks lost (acknowledged, no record)".into(),
            value: lost.len(),
            expected: 0,
            note: examples(&lost),
        },
        Figure {
            label: "tasks stuck (not terminal by the deadline)".into(),
            value: stuck.len(),
            expected: 0,
            note: examples(&stuck),
        },
        Figure {
            label: "live tasks dead-lettered as lost".into(),
            value: live_lost.len(),
            expected: 0,
            note: examples(&live_lost),
        },
        Figure {
            label: "orders charged twice".into(),
            value: twice.len(),
            expected: 0,
            note: format!("of {} orders\n{}", order_ids.len(), examples(&twice)),
        },
        Figure {
            label: "orders SUCCEEDED with 0 charges".into(),
            value: succeeded_uncharged.len(),
            expected: 0,
            note: examples(&succeeded_uncharged),
        },
        Figure {
            label: "processes that exited unkilled".into(),
            value: chaos.unexpected_exits.len(),
            expected: 0,
            note: examples(&chaos.unexpected_exits),
        },
    ];

    // The table.
    let outages = chaos
        .outages
        .iter()
        .map(|(at, down)| {
            format!(
                "at {:.0} s for {:.1} s",
                at.as_secs_f64(),
                down.as_secs_f64()
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let mut table = format!(
        "\nchaos: seed {}, {} workers killed (SIGKILL), Redis stopped and restarted {} times \
         ({outages}); submitted and struck for {:.0} s, drained in {:.0} s more, {:.0} s in \
         all\n\n",
        settings.seed,
        chaos.killed.len(),
        chaos.outages.len(),
        chaos_ended.as_secs_f64(),
        (drained - chaos_ended).as_secs_f64(),
        drained.as_secs_f64()
    );
    table += &format!("{:<44} {:>7} {:>9}\n", "figure", "value", "expected");
    let mut failed = Vec::new();
    for f in &figures {
        let ok = f.value == f.expected;
        if !ok {
            failed.push(format!(
                "{}: {} (expected {})",
                f.label, f.value, f.expected
            ));
        }
        table += &format!(
            "{:<44} {:>7} {:>9}  {}\n",
            f.label,
            f.value,
            f.expected,
            if ok { "ok" } else { "FAIL" }
        );
        for line in f.note.lines().filter(|l| !l.is_empty()) {
            table += &format!("    {line}\n");
        }
    }
    if let Some(e) = &chaos.error {
        failed.push(format!("the chaos stopped early: {e:#}"));
    }
    if !failed.is_empty() {
        // The logs, and the directory kept for a closer look.
        let redis_log = std::fs::read_to_string(chaos.redis.log_path()).unwrap_or_default();
        let _ = std::fs::write(dir.path.join("redis.log"), &redis_log);
        eprintln!("--- redis.log (tail) ---\n{}", tail(&redis_log, 40));
        for p in chaos
            .gone
            .iter()
            .chain(&chaos.workers)
            .chain(std::iter::once(&api_proc))
        {
            eprintln!(
                "--- {} (pid {}, {}), tail ---\n{}",
                p.name,
                p.pid(),
                p.log.display(),
                tail(&p.log_text(), 30)
            );
        }
        eprintln!("chaos: logs kept in {}", dir.path.display());
        std::mem::forget(dir);
        eprintln!("{table}");
        panic!("chaos figures off:\n{}", failed.join("\n"));
    }
    eprintln!("{table}");
    Ok(())
}
