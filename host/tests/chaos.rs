//! Chaos: real `dtq` processes (three workers and one API) against a
//! `redis-server` with AOF on, while the test SIGKILLs a random worker every
//! few seconds (starting a new one in its place) and stops and restarts
//! Redis twice. The workload is mostly `send_receipt` orders (each with its
//! own Idempotency-Key, some submitted twice with it), with `counter` and
//! short `sleep` tasks. `send_receipt` charges each order through a payment
//! service and emails its receipt through an email service, over HTTP: both
//! are real HTTP servers that this test runs in its own process
//! (`dtq_tests::services`), on loopback, which the workers are allowed to
//! reach (`--allow-host send_receipt=http://127.0.0.1:*`). Both honour
//! `Idempotency-Key` as payment APIs do, and record every request, charge
//! and email.
//!
//! At the end the test prints one table and asserts each figure: no
//! acknowledged task lost or stuck, no live worker's task dead-lettered as
//! lost, and, from the services' own records:
//!
//! - every order whose task SUCCEEDED was charged exactly once, no order
//!   more than once, and no order whose task never ran at all (about one
//!   order in a hundred is held back, `delay_ms` an hour, and cancelled
//!   before it runs; any other task that ends with no attempt counts too);
//! - each SUCCEEDED task's result names the charge the service recorded
//!   for its order (`charge_id`);
//! - every charge request of an order carried one and the same
//!   Idempotency-Key (the host derives it from the handler's namespace and
//!   the operation key `charge:<order_id>`), so a request repeated after a
//!   kill (the table counts these replays) was answered with the stored
//!   charge instead of charging again;
//! - every SUCCEEDED order got exactly one email, naming its charge, and a
//!   never-run order none. At least one, because a task succeeds only once
//!   its `receipt:<order_id>` operation is done, and that operation is done
//!   only after the email service answered 2xx, and it records the email
//!   before it answers. At most one, because that operation's requests, too,
//!   carry one Idempotency-Key, which the test's email service honours; an
//!   email service that ignored the header could send a second email when a
//!   worker dies between the request and the operation's commit.
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
//! | `DTQ_CHAOS_TASKS` | 4000 | submissions (tasks, plus deliberate duplicate submissions of orders); about 70 % are new orders |
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
use dtq_tests::services::{Recorded, Service};
use dtq_tests::{ApiClient, PersistentRedis, TempDir, free_port, guests};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The queue every task goes to.
const QUEUE: &str = "default";

/// What the workers let `send_receipt` reach: the test's services, on
/// loopback (`--allow-host`).
const ALLOW_SERVICES: &str = "send_receipt=http://127.0.0.1:*";

/// The delay of the orders held back so that they never run (ms): far
/// beyond the end of any run. They are cancelled once the chaos is over.
const HELD_BACK_DELAY_MS: u64 = 3_600_000;

/// One new order in this many is held back.
const HELD_BACK_EVERY: usize = 100;

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
            tasks: var("DTQ_CHAOS_TASKS", 4_000)?,
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
/// handlers (`send_receipt` allowed to reach the test's services), a shared
/// artifact cache and short timings.
fn server_flags(redis_url: &str) -> Vec<String> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    [
        "--redis",
        redis_url,
        "--handlers",
        guests::EXAMPLES_DIR,
        "--allow-host",
        ALLOW_SERVICES,
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

/// An order of the run.
struct Order {
    /// `ord-NNNNNN`.
    id: String,
    /// Held back (`delay_ms` an hour): it must never run. It is cancelled
    /// once the chaos is over.
    held_back: bool,
}

/// The base URLs the `send_receipt` payloads carry.
struct Services<'a> {
    payment_url: &'a str,
    email_url: &'a str,
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

/// The submissions of a run, in order, and the orders (`Work::Order`
/// indexes them): about 70 % new orders, 5 % orders submitted again, 15 %
/// counters and 10 % sleeps.
fn plan(
    settings: &Settings,
    rng: &mut StdRng,
    services: &Services<'_>,
) -> (Vec<Planned>, Vec<Order>) {
    let mut orders: Vec<(Order, Value)> = Vec::new();
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
                key: Some(format!("order-{}", orders[n].0.id)),
                work: Work::Order(n),
            });
        } else if roll < 75 {
            let id = format!("ord-{:06}", orders.len());
            let held_back = orders.len() % HELD_BACK_EVERY == HELD_BACK_EVERY / 2;
            let mut body = limits(json!({
                "task": "send_receipt",
                "payload": {
                    "order_id": id,
                    "amount_cents": rng.random_range(100..100_000),
                    "payment_url": services.payment_url,
                    "email_url": services.email_url,
                },
            }));
            if held_back {
                body["delay_ms"] = json!(HELD_BACK_DELAY_MS);
            }
            planned.push(Planned {
                body: body.clone(),
                key: Some(format!("order-{id}")),
                work: Work::Order(orders.len()),
            });
            orders.push((Order { id, held_back }, body));
        } else if roll < 90 {
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
    (
        planned,
        orders.into_iter().map(|(order, _)| order).collect(),
    )
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

/// Cancel the held-back task `id`, retrying what may be a passing failure
/// (a 5xx, a dropped connection, a timeout); the answer, or the last
/// failure.
async fn cancel(api: &ApiClient, id: &str) -> String {
    let path = format!("/v1/queues/{QUEUE}/tasks/{id}/cancel");
    let mut last = String::new();
    for _ in 0..20 {
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.call(reqwest::Method::POST, &path, None, &[]),
        )
        .await;
        last = match answer {
            Ok(Ok((code, body))) if code < 500 => return format!("{code} {body}"),
            Ok(Ok((code, body))) => format!("{code} {body}"),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    last
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
    /// The handler's result (JSON), once SUCCEEDED.
    result: Option<String>,
}

impl TaskRow {
    fn is_terminal(&self) -> bool {
        TERMINAL.contains(&self.status.as_str())
    }

    /// Attempts started (0 for a task that never ran).
    fn attempts(&self) -> u32 {
        self.attempts
            .as_deref()
            .and_then(|a| a.parse().ok())
            .unwrap_or(0)
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
                .arg(&["status", "error", "worker", "attempts", "result"]);
        }
        let replies: Vec<Vec<Option<String>>> = pipe.query_async(conn).await?;
        for mut f in replies {
            let result = f.pop().flatten();
            let attempts = f.pop().flatten();
            let worker = f.pop().flatten();
            let error = f.pop().flatten();
            let status = f.pop().flatten();
            rows.push(status.map(|status| TaskRow {
                status,
                error,
                worker,
                attempts,
                result,
            }));
        }
    }
    Ok(rows)
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

/// How many of `requests` carried an Idempotency-Key that an earlier one
/// had carried already: repeats the service answered from what it stored.
fn replays(requests: &[Recorded]) -> usize {
    let mut keys = HashSet::new();
    requests
        .iter()
        .filter_map(|r| r.idempotency_key.as_deref())
        .filter(|k| !keys.insert(*k))
        .count()
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
    // The services `send_receipt` calls, in this process: they outlive
    // every worker.
    let payments = Service::start()?;
    let email_service = Service::start()?;
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let services = Services {
        payment_url: payments.url(),
        email_url: email_service.url(),
    };
    let (planned, orders) = plan(&settings, &mut rng, &services);
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
        "chaos: API and {WORKERS} workers ready in {:.1} s; payment service {}, email service \
         {}; logs in {}",
        t_setup.elapsed().as_secs_f64(),
        payments.url(),
        email_service.url(),
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
    let (mut counters, mut sleeps) = (0, 0);
    for (p, ack) in planned.iter().zip(&acks) {
        let logical_new = match &p.key {
            Some(k) => first_submission.insert(k.clone()),
            None => true,
        };
        if logical_new {
            expected_tasks += 1;
            match p.work {
                Work::Order(_) => {}
                Work::Counter => counters += 1,
                Work::Sleep => sleeps += 1,
            }
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

    // The held-back orders never run: cancel them, while they wait.
    let mut held_tasks: HashSet<String> = HashSet::new();
    let mut cancel_answers: HashMap<String, String> = HashMap::new();
    for (o, order) in orders.iter().enumerate() {
        if let (true, Some(task)) = (order.held_back, order_task.get(&o)) {
            held_tasks.insert(task.clone());
            cancel_answers.insert(task.clone(), cancel(&api, task).await);
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

    // The outcome: the tasks.
    let rows = read_tasks(&mut conn, &task_ids).await?;
    let row_of: HashMap<&str, Option<&TaskRow>> = task_ids
        .iter()
        .zip(&rows)
        .map(|(id, r)| (id.as_str(), r.as_ref()))
        .collect();

    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let mut other_status: BTreeMap<String, usize> = BTreeMap::new();
    let (mut lost, mut stuck, mut live_lost, mut other) = (vec![], vec![], vec![], vec![]);
    let (mut held_unrun, mut held_off) = (0, vec![]);
    let mut max_attempts_seen = 0u32;
    let mut retried_tasks = 0;
    for (id, row) in task_ids.iter().zip(&rows) {
        let held = held_tasks.contains(id);
        let Some(row) = row else {
            lost.push(describe(id, None));
            continue;
        };
        *by_status.entry(row.status.clone()).or_default() += 1;
        let attempts = row.attempts();
        max_attempts_seen = max_attempts_seen.max(attempts);
        if attempts > 1 {
            retried_tasks += 1;
        }
        if held {
            if row.status == "CANCELLED" && attempts == 0 {
                held_unrun += 1;
            } else {
                held_off.push(format!(
                    "{}; cancel answered {}",
                    describe(id, Some(row)),
                    cancel_answers.get(id).map_or("-", String::as_str)
                ));
            }
        }
        if !row.is_terminal() {
            stuck.push(describe(id, Some(row)));
        } else if row.status != "SUCCEEDED" && !held {
            *other_status.entry(row.status.clone()).or_default() += 1;
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

    // The outcome: what the payment and email services recorded.
    let charges = payments.charges();
    let charge_requests = payments.requests_to("/charges");
    let emails = email_service.emails();
    let email_requests = email_service.requests_to("/emails");
    let planned_orders: HashSet<&str> = orders.iter().map(|o| o.id.as_str()).collect();
    let mut charges_of: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut unknown_effects = Vec::new();
    for c in &charges {
        charges_of
            .entry(c.order_id.as_str())
            .or_default()
            .push(c.charge_id.as_str());
        if !planned_orders.contains(c.order_id.as_str()) {
            unknown_effects.push(format!("charge {c:?} of an order never planned"));
        }
    }
    let mut emails_of: HashMap<&str, Vec<&Value>> = HashMap::new();
    for e in &emails {
        let order = e.body["order_id"].as_str().unwrap_or("?");
        emails_of.entry(order).or_default().push(&e.body);
        if !planned_orders.contains(order) {
            unknown_effects.push(format!("email {} of an order never planned", e.body));
        }
    }
    // The Idempotency-Keys each order's charge requests carried.
    let mut keys_of: HashMap<String, Vec<Option<String>>> = HashMap::new();
    for r in &charge_requests {
        let order = serde_json::from_str::<Value>(&r.body)
            .ok()
            .and_then(|b| b["order_id"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "?".into());
        keys_of
            .entry(order)
            .or_default()
            .push(r.idempotency_key.clone());
    }

    let (mut succeeded_orders, mut charged_once) = (0, 0);
    let (mut not_once, mut twice, mut unrun_effects) = (vec![], vec![], vec![]);
    let (mut wrong_result, mut key_off, mut email_off) = (vec![], vec![], vec![]);
    let mut unrun_orders = 0;
    for (o, order) in orders.iter().enumerate() {
        let id = order.id.as_str();
        let order_charges = charges_of.get(id).map_or(&[][..], Vec::as_slice);
        let order_emails = emails_of.get(id).map_or(&[][..], Vec::as_slice);
        let Some(task) = order_task.get(&o) else {
            // Never acknowledged (a figure of its own): whether it ran is
            // not known.
            continue;
        };
        let row = row_of.get(task.as_str()).copied().flatten();
        let line = |what: &str| format!("order {id}: {what}; task {}", describe(task, row));
        if order_charges.len() > 1 {
            twice.push(line(&format!("charges {order_charges:?}")));
        }
        if let Some(keys) = keys_of.get(id) {
            let distinct: HashSet<&Option<String>> = keys.iter().collect();
            if distinct.len() != 1 || distinct.contains(&None) {
                key_off.push(line(&format!("charge requests' keys {keys:?}")));
            }
        }
        let ran = row.is_some_and(|r| r.attempts() > 0);
        if !ran {
            unrun_orders += 1;
            if !order_charges.is_empty() || !order_emails.is_empty() {
                unrun_effects.push(line(&format!(
                    "never ran, yet charges {order_charges:?}, {} emails",
                    order_emails.len()
                )));
            }
        }
        let Some(row) = row.filter(|r| r.status == "SUCCEEDED") else {
            continue;
        };
        succeeded_orders += 1;
        if order_charges.len() == 1 {
            charged_once += 1;
        } else {
            not_once.push(line(&format!("charges {order_charges:?}")));
        }
        let result: Value = row
            .result
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or(Value::Null);
        let charge_id = result["charge_id"].as_str().unwrap_or("");
        if result["order_id"] != id || !order_charges.contains(&charge_id) {
            wrong_result.push(line(&format!(
                "result {result}, charges recorded {order_charges:?}"
            )));
        }
        if order_emails.len() != 1 || order_emails[0]["charge_id"] != charge_id {
            let sent: Vec<&Value> = order_emails.iter().map(|e| &e["charge_id"]).collect();
            email_off.push(line(&format!(
                "{} emails (naming charges {sent:?}), result {result}",
                order_emails.len()
            )));
        }
    }
    unrun_effects.extend(unknown_effects);
    let split_keys: Vec<String> = key_tasks
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(k, ids)| format!("key {k}: tasks {ids:?}"))
        .collect();
    let succeeded = by_status.get("SUCCEEDED").copied().unwrap_or(0);
    let other_breakdown = other_status
        .iter()
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let charge_replays = replays(&charge_requests);
    let email_replays = replays(&email_requests);

    let figures = vec![
        Figure {
            label: "tasks submitted (acknowledged)".into(),
            value: task_ids.len(),
            expected: expected_tasks,
            note: format!(
                "{} submissions: {} answered 202, {} 200, {} 409; {} needed more than one try\n\
                 tasks: {} send_receipt orders, {counters} counter, {sleeps} sleep",
                planned.len(),
                codes.get(&202).unwrap_or(&0),
                codes.get(&200).unwrap_or(&0),
                codes.get(&409).unwrap_or(&0),
                retried,
                orders.len(),
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
            expected: task_ids.len() - held_tasks.len(),
            note: format!(
                "{retried_tasks} took more than one attempt, at most {max_attempts_seen}"
            ),
        },
        Figure {
            label: "held-back orders cancelled before a run".into(),
            value: held_unrun,
            expected: held_tasks.len(),
            note: format!(
                "submitted with delay_ms {HELD_BACK_DELAY_MS}, cancelled once the chaos was over\n{}",
                examples(&held_off)
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
            label: "SUCCEEDED orders charged exactly once".into(),
            value: charged_once,
            expected: succeeded_orders,
            note: format!(
                "the payment service: {} charges, {} charge requests, {charge_replays} of them \
                 a key it had answered\n(a request repeated after a kill: answered with the \
                 stored charge, nothing charged)\n{}",
                charges.len(),
                charge_requests.len(),
                examples(&not_once)
            ),
        },
        Figure {
            label: "orders charged more than once".into(),
            value: twice.len(),
            expected: 0,
            note: format!("of {} orders\n{}", orders.len(), examples(&twice)),
        },
        Figure {
            label: "charges+emails of never-run/unknown orders".into(),
            value: unrun_effects.len(),
            expected: 0,
            note: format!(
                "{unrun_orders} orders never ran ({} held back)\n{}",
                held_tasks.len(),
                examples(&unrun_effects)
            ),
        },
        Figure {
            label: "SUCCEEDED results not naming their charge".into(),
            value: wrong_result.len(),
            expected: 0,
            note: examples(&wrong_result),
        },
        Figure {
            label: "orders not sending one Idempotency-Key".into(),
            value: key_off.len(),
            expected: 0,
            note: format!(
                "every charge request of an order must carry the same key\n{}",
                examples(&key_off)
            ),
        },
        Figure {
            label: "SUCCEEDED orders without exactly one email".into(),
            value: email_off.len(),
            expected: 0,
            note: format!(
                "the email service: {} emails, {} email requests, {email_replays} of them a key \
                 it had answered\n{}",
                emails.len(),
                email_requests.len(),
                examples(&email_off)
            ),
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
