//! What the chaos tests of the binary (`host/tests/chaos.rs`,
//! `host/tests/flows_chaos.rs`) share: `dtq worker` and `dtq api`
//! processes started from one set of flags, a schedule of faults (worker
//! SIGKILLs and Redis outages) read from the environment, submissions sent
//! in waves with a fault striking midway through each, the reading of task
//! hashes once the chaos is over, and the final table of figures. Each test
//! keeps its own workload, its Redis, its checks and its figures.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use futures::StreamExt;
use rand::Rng;
use rand::rngs::StdRng;
use serde_json::Value;

use crate::process::DtqProcess;
use crate::{ApiClient, PersistentRedis, TempDir, free_port, guests};

/// How long a process may take to be ready (it may compile the handlers
/// when the artifact cache is cold).
pub const STARTUP: Duration = Duration::from_secs(120);

/// Longest time one submission is retried before the test gives up on it.
pub const SUBMIT_GIVE_UP: Duration = Duration::from_secs(120);

/// Longest wait for one HTTP answer; a request that takes longer is sent
/// again.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Statuses after which a task never changes by itself.
pub const TERMINAL: &[&str] = &[
    "SUCCEEDED",
    "FAILED",
    "DEAD_LETTERED",
    "CANCELLED",
    "EXPIRED",
];

// ---------------------------------------------------------------------------
// Settings

/// Environment variable `name` parsed as a `T`, or `default` when it is
/// unset; an error names the variable and its value.
pub fn env_var<T: FromStr>(name: &str, default: T) -> Result<T>
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

/// The sizes of a run, as the environment sets them: its workload, its
/// faults and its deadline.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How much work: submissions, parents (each test says).
    pub size: usize,
    /// Seconds of faults (a wave of submissions before each), Redis
    /// outages aside.
    pub secs: u64,
    /// Mean time between worker kills (ms); each gap is drawn from 80 % to
    /// 120 % of it.
    pub kill_ms: u64,
    /// Redis outages, spread evenly over the run.
    pub redis_restarts: usize,
    /// Deadline for the tasks to be terminal once the chaos ends (s).
    pub drain_secs: u64,
    /// The seed that replays a run's workload and faults.
    pub seed: u64,
}

impl Settings {
    /// Read `<prefix>_<size_name>` (default `size`), `<prefix>_SECS`
    /// (default `secs`), `<prefix>_KILL_MS` (2500),
    /// `<prefix>_REDIS_RESTARTS` (2), `<prefix>_DRAIN_SECS` (default
    /// `drain_secs`) and `<prefix>_SEED` (random), and check that there is
    /// work, that the run lasts and that kills are at least 100 ms apart.
    pub fn from_env(
        prefix: &str,
        (size_name, size): (&str, usize),
        secs: u64,
        drain_secs: u64,
    ) -> Result<Settings> {
        let size_var = format!("{prefix}_{size_name}");
        let settings = Settings {
            size: env_var(&size_var, size)?,
            secs: env_var(&format!("{prefix}_SECS"), secs)?,
            kill_ms: env_var(&format!("{prefix}_KILL_MS"), 2_500)?,
            redis_restarts: env_var(&format!("{prefix}_REDIS_RESTARTS"), 2)?,
            drain_secs: env_var(&format!("{prefix}_DRAIN_SECS"), drain_secs)?,
            seed: env_var(&format!("{prefix}_SEED"), rand::random::<u64>())?,
        };
        ensure!(settings.size > 0, "{size_var} must be positive");
        ensure!(settings.secs > 0, "{prefix}_SECS must be positive");
        ensure!(
            settings.kill_ms >= 100,
            "{prefix}_KILL_MS must be at least 100"
        );
        Ok(settings)
    }
}

// ---------------------------------------------------------------------------
// Processes

/// How a test starts its `dtq worker` and `dtq api` processes.
#[derive(Clone, Debug)]
pub struct Servers {
    /// The binary under test.
    pub bin: &'static str,
    /// The `--redis` value.
    pub redis_url: String,
    /// The test's own flags (queues, grants, concurrency, timings), passed
    /// after the ones every chaos server runs with: the test's Redis, the
    /// example handlers, a shared artifact cache and short retries.
    pub flags: Vec<String>,
    /// `DTQ_LOG`: `info`, or more where the test counts what a component
    /// logs at debug.
    pub log_filter: String,
}

impl Servers {
    /// Start `dtq <subcommand>` (`worker` or `api`) and wait until it is
    /// ready: the worker has logged its start, or the API answers
    /// `/healthz`. Its log goes to `<name>-<attempt>.log` in `dir` and is
    /// not printed when it is dropped (the test prints the tails it needs).
    pub async fn start(&self, dir: &Path, name: &str, subcommand: &str) -> Result<DtqProcess> {
        let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
        // A port free when probed may be taken before the API binds it;
        // such a start is retried on another port.
        let mut last = None;
        for attempt in 0..3 {
            let port = free_port()?;
            let mut cmd = crate::process::dtq_command(self.bin);
            cmd.env("NO_COLOR", "1")
                .env("DTQ_LOG", &self.log_filter)
                .arg(subcommand)
                .args(["--redis", &self.redis_url])
                .args(["--handlers", guests::EXAMPLES_DIR])
                .args(["--retry-base-ms", "20", "--retry-max-ms", "200"])
                .arg("--cache-dir")
                .arg(&cache)
                .args(&self.flags);
            if subcommand == "api" {
                cmd.args(["--listen", &format!("127.0.0.1:{port}")]);
            }
            let log = dir.join(format!("{name}-{attempt}.log"));
            let api = format!("http://127.0.0.1:{port}");
            let mut proc = DtqProcess::spawn(name, cmd, log, api)?;
            proc.print_log_on_drop = false;
            let ready = match subcommand {
                "worker" => proc.wait_log("worker started", STARTUP).await,
                _ => proc.wait_healthy(STARTUP).await,
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
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------
// Submissions

/// One submission of a chaos test's workload.
pub trait Submission: Send + Sync + 'static {
    /// The request body.
    fn body(&self) -> &Value;

    /// Its Idempotency-Key, sent with every try, if it has one.
    fn key(&self) -> Option<&str>;

    /// How a message names it: `submission <name> not acknowledged`. Its
    /// body unless the test says otherwise.
    fn name(&self) -> String {
        self.body().to_string()
    }
}

/// A submission the API acknowledged.
#[derive(Clone, Debug)]
pub struct Ack {
    /// The task it created, or the one its key already stood for.
    pub task_id: String,
    /// 202, 200 or 409.
    pub code: u16,
    /// Requests it took (1 when the first one was acknowledged).
    pub tries: u32,
}

/// Submit `item` to `queue` until acknowledged (202, 200, or 409 with the
/// in-flight task's id), resending, with the same key, after a failure
/// that may be Redis being down: a 5xx, a dropped connection, a timeout.
/// Any other answer is an error, and so is no acknowledgement within
/// [`SUBMIT_GIVE_UP`].
pub async fn submit_until_acked(
    api: &ApiClient,
    queue: &str,
    item: &impl Submission,
) -> Result<Ack> {
    let start = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.submit(queue, item.body().clone(), item.key()),
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
            Ok(Ok((code, body))) => bail!("submission {} refused: {code} {body}", item.body()),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        if start.elapsed() > SUBMIT_GIVE_UP {
            bail!(
                "submission {} not acknowledged within {SUBMIT_GIVE_UP:?} ({tries} tries); \
                 last: {last}",
                item.name()
            );
        }
        let pause = 100 + u64::from(tries.min(10)) * 20;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// How a run sends its submissions.
#[derive(Clone, Copy, Debug)]
pub struct Waves {
    /// The queue every submission goes to.
    pub queue: &'static str,
    /// Submissions in flight at once.
    pub submitters: usize,
    /// A fault strikes a random moment of up to this many milliseconds
    /// after half of its wave is acknowledged.
    pub jitter_ms: u64,
    /// What the progress lines call the submissions ("submissions",
    /// "parents").
    pub noun: &'static str,
}

/// `n` submissions in `waves` contiguous waves of sizes as even as can be.
pub fn wave_bounds(n: usize, waves: usize) -> Vec<std::ops::Range<usize>> {
    (0..waves)
        .map(|w| n * w / waves..n * (w + 1) / waves)
        .collect()
}

/// Submit `items[range]`, `waves.submitters` at a time, each until
/// acknowledged; every counter in `acked` counts the acknowledged ones.
async fn submit_wave<T: Submission>(
    api: ApiClient,
    waves: Waves,
    items: Arc<Vec<T>>,
    range: std::ops::Range<usize>,
    acked: Vec<Arc<AtomicUsize>>,
) -> Vec<Result<Ack>> {
    futures::stream::iter(range)
        .map(|i| {
            let (api, items, acked) = (&api, &items, &acked);
            async move {
                let ack = submit_until_acked(api, waves.queue, &items[i]).await;
                if ack.is_ok() {
                    for counter in acked {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
                ack
            }
        })
        .buffered(waves.submitters)
        .collect()
        .await
}

// ---------------------------------------------------------------------------
// The faults

/// A fault the test makes.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// SIGKILL a random worker and start a new one in its place.
    Kill,
    /// Stop Redis (or a part of it) gracefully, keep it down 1.5 to 3 s,
    /// start it again on its data.
    RedisOutage,
}

/// The faults of a run, each with the time to wait before it: a kill every
/// `kill_ms` (± 20 %) for `secs`, and `redis_restarts` outages spread evenly
/// among them.
pub fn fault_plan(settings: &Settings, rng: &mut StdRng) -> Vec<(Duration, Fault)> {
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

/// The Redis a chaos test runs on, as the chaos acts on it.
pub trait ChaosRedis {
    /// Outage number `n` (from 0): stop Redis, or the part of it the test
    /// chooses for `n`, gracefully, keep it down for `down`, and start it
    /// again on its data. Returns what was stopped, for the messages.
    fn outage(&mut self, n: usize, down: Duration) -> impl Future<Output = Result<String>>;

    /// The tail of the server's log, when there is one, also copied into
    /// `dir` (the directory kept when the test fails).
    fn log_tail(&self, dir: &Path) -> Option<String>;
}

impl ChaosRedis for PersistentRedis {
    async fn outage(&mut self, _n: usize, down: Duration) -> Result<String> {
        tokio::task::block_in_place(|| self.stop())?;
        tokio::time::sleep(down).await;
        tokio::task::block_in_place(|| self.start_again())?;
        Ok("Redis".into())
    }

    fn log_tail(&self, dir: &Path) -> Option<String> {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let _ = std::fs::write(dir.join("redis.log"), &log);
        Some(tail(&log, 40))
    }
}

/// One Redis outage of a run.
#[derive(Clone, Debug)]
pub struct Outage {
    /// What was stopped.
    pub what: String,
    /// When it began, since the start of the run.
    pub at: Duration,
    /// How long it was down, the restart included.
    pub down: Duration,
}

/// The processes the chaos acts on, and what it did.
pub struct Chaos<R> {
    /// What the test's messages start with ("chaos", "flows chaos").
    pub label: &'static str,
    /// Where the processes' logs go.
    pub dir: PathBuf,
    /// How workers are started.
    pub servers: Servers,
    /// The Redis the processes run on.
    pub redis: R,
    /// The workers running now.
    pub workers: Vec<DtqProcess>,
    /// Workers that have exited (killed or not), kept for their logs.
    pub gone: Vec<DtqProcess>,
    /// Pids of the workers this test killed.
    pub killed: std::collections::HashSet<u32>,
    /// Each Redis outage, in order.
    pub outages: Vec<Outage>,
    /// Processes that exited without being killed.
    pub unexpected_exits: Vec<String>,
    /// A failure that ended the chaos early (a process or Redis that would
    /// not start).
    pub error: Option<anyhow::Error>,
    /// When the run began ([`Chaos::run`]); the times of the messages and
    /// of the outages count from it.
    pub t0: Instant,
    workers_started: usize,
}

impl<R: ChaosRedis> Chaos<R> {
    /// No workers yet, nothing done.
    pub fn new(label: &'static str, dir: PathBuf, redis: R, servers: Servers) -> Chaos<R> {
        Chaos {
            label,
            dir,
            servers,
            redis,
            workers: Vec::new(),
            gone: Vec::new(),
            killed: Default::default(),
            outages: Vec::new(),
            unexpected_exits: Vec::new(),
            error: None,
            t0: Instant::now(),
            workers_started: 0,
        }
    }

    /// Start `n` workers, one at a time: the first one fills the artifact
    /// cache.
    pub async fn start_workers(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let w = self.start_worker().await?;
            self.workers.push(w);
        }
        Ok(())
    }

    async fn start_worker(&mut self) -> Result<DtqProcess> {
        self.workers_started += 1;
        let name = format!("worker-{}", self.workers_started);
        self.servers.start(&self.dir, &name, "worker").await
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
                eprintln!("{}: {line}", self.label);
                self.unexpected_exits.push(line);
                let new = self.start_worker().await?;
                let old = std::mem::replace(&mut self.workers[i], new);
                self.gone.push(old);
            }
        }
        Ok(())
    }

    /// The run, from now ([`Chaos::t0`]): the faults of `settings`
    /// ([`fault_plan`], drawn from `rng`), one wave of `items` before
    /// each, the fault striking once half of its wave is acknowledged (so
    /// while the workers are busy with it). Returns the acknowledgement of
    /// every item, in order.
    pub async fn run<T: Submission>(
        &mut self,
        waves: Waves,
        settings: &Settings,
        mut rng: StdRng,
        api: &ApiClient,
        items: Arc<Vec<T>>,
    ) -> Vec<Result<Ack>> {
        let label = self.label;
        self.t0 = Instant::now();
        let t0 = self.t0;
        let faults = fault_plan(settings, &mut rng);
        let acked = Arc::new(AtomicUsize::new(0));
        let bounds = wave_bounds(items.len(), faults.len().max(1));
        let mut pending = Vec::new();
        let mut next_event = t0;
        let mut next_progress = t0 + Duration::from_secs(10);
        for (w, range) in bounds.into_iter().enumerate() {
            let fault = faults.get(w);
            if let Some((gap, _)) = fault {
                next_event += *gap;
            }
            tokio::time::sleep_until(next_event.into()).await;
            let wave_acked = Arc::new(AtomicUsize::new(0));
            let half = range.len().div_ceil(2);
            pending.push(tokio::spawn(submit_wave(
                api.clone(),
                waves,
                items.clone(),
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
            let jitter = rng.random_range(0..=waves.jitter_ms);
            tokio::time::sleep(Duration::from_millis(jitter)).await;
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
                        let n = self.outages.len();
                        eprintln!(
                            "{label}: {:>6.1} s  Redis outage {} for {down:?}",
                            at.as_secs_f64(),
                            n + 1
                        );
                        let what = self.redis.outage(n, down).await?;
                        let took = t0.elapsed() - at;
                        eprintln!(
                            "{label}: {:>6.1} s  {what} back (down {:.1} s with the restart)",
                            t0.elapsed().as_secs_f64(),
                            took.as_secs_f64()
                        );
                        self.outages.push(Outage {
                            what,
                            at,
                            down: took,
                        });
                        // The next faults keep their spacing from here.
                        next_event = Instant::now();
                    }
                }
                anyhow::Ok(())
            };
            if let Err(e) = step.await {
                eprintln!("{label}: stopped early: {e:#}");
                self.error = Some(e);
            }
            if Instant::now() >= next_progress {
                eprintln!(
                    "{label}: {:>6.1} s  {} {} acknowledged, {} workers killed, {} Redis \
                     restarts",
                    t0.elapsed().as_secs_f64(),
                    acked.load(Ordering::Relaxed),
                    waves.noun,
                    self.killed.len(),
                    self.outages.len()
                );
                next_progress += Duration::from_secs(10);
            }
        }
        let mut acks = Vec::with_capacity(items.len());
        for wave in pending {
            match wave.await {
                Ok(wave) => acks.extend(wave),
                Err(e) => panic!("a submission task failed: {e}"),
            }
        }
        eprintln!(
            "{label}: {:>6.1} s  all {} acknowledged, chaos over: draining",
            t0.elapsed().as_secs_f64(),
            waves.noun
        );
        acks
    }

    /// The outages, as `<what> at <s> s for <s> s, ...`.
    pub fn outage_summary(&self) -> String {
        self.outages
            .iter()
            .map(|o| {
                format!(
                    "{} at {:.0} s for {:.1} s",
                    o.what,
                    o.at.as_secs_f64(),
                    o.down.as_secs_f64()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Count, among the unexpected exits, the workers and the API `api`
    /// that have exited by now.
    pub fn note_exits(&mut self, api: &mut DtqProcess) -> Result<()> {
        for p in self.workers.iter_mut().chain(std::iter::once(api)) {
            if let Some(status) = p.exit_status()? {
                let line = format!("{} (pid {}) exited with {status}", p.name, p.pid());
                self.unexpected_exits.push(line);
            }
        }
        Ok(())
    }

    /// End the test: print `table` followed by `figures` and a last one,
    /// the processes that exited unkilled (the first column `width`
    /// wide), and fail if a figure is off or the chaos stopped early,
    /// after printing the logs' tails and keeping `dir`, the test's
    /// directory, for a closer look.
    pub fn report(
        &self,
        mut table: String,
        mut figures: Vec<Figure>,
        width: usize,
        api: &DtqProcess,
        dir: TempDir,
    ) {
        figures.push(Figure::none(
            "processes that exited unkilled",
            &self.unexpected_exits,
        ));
        let (rows, mut failed) = figure_table(&figures, width);
        table += &rows;
        if let Some(e) = &self.error {
            failed.push(format!("the chaos stopped early: {e:#}"));
        }
        if !failed.is_empty() {
            self.print_logs(api);
            std::mem::forget(dir);
            eprintln!("{table}");
            panic!("{} figures off:\n{}", self.label, failed.join("\n"));
        }
        eprintln!("{table}");
    }

    /// Print, for a failed run, the tail of Redis's log and of every
    /// process's log (the workers gone, the workers running, the API
    /// `api`), and where the logs are.
    fn print_logs(&self, api: &DtqProcess) {
        if let Some(log) = self.redis.log_tail(&self.dir) {
            eprintln!("--- redis.log (tail) ---\n{log}");
        }
        for p in self
            .gone
            .iter()
            .chain(&self.workers)
            .chain(std::iter::once(api))
        {
            eprintln!(
                "--- {} (pid {}, {}), tail ---\n{}",
                p.name,
                p.pid(),
                p.log.display(),
                tail(&p.log_text(), 30)
            );
        }
        eprintln!("{}: logs kept in {}", self.label, self.dir.display());
    }
}

// ---------------------------------------------------------------------------
// Reading the outcome

/// The key of task `id`'s hash on `queue`.
pub fn task_key(queue: &str, id: &str) -> String {
    format!("dtq:task:{{{queue}}}:{id}")
}

/// The `fields` of the task hashes of `ids` on `queue`, each in the order
/// asked (all `None` for a task with no hash), read in pipelined batches
/// (the keys of a queue share one slot).
pub async fn task_fields(
    conn: &mut impl redis::aio::ConnectionLike,
    queue: &str,
    ids: &[String],
    fields: &[&str],
) -> Result<Vec<Vec<Option<String>>>> {
    let mut rows = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("HMGET").arg(task_key(queue, id)).arg(fields);
        }
        let replies: Vec<Vec<Option<String>>> = pipe.query_async(conn).await?;
        rows.extend(replies);
    }
    Ok(rows)
}

/// Poll the tasks `ids` of `queue` until every one that has a hash is
/// terminal, or `deadline`, printing every 10 s how many are not yet (by
/// status), after `label` and the time since `t0`.
pub async fn wait_terminal(
    conn: &mut impl redis::aio::ConnectionLike,
    label: &str,
    queue: &str,
    ids: &[String],
    deadline: Instant,
    t0: Instant,
) -> Result<()> {
    let mut waiting: Vec<String> = ids.to_vec();
    let mut next_progress = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = task_fields(conn, queue, &waiting, &["status"]).await?;
        let mut by_status = std::collections::BTreeMap::<String, usize>::new();
        waiting = waiting
            .into_iter()
            .zip(rows)
            .filter_map(|(id, mut row)| {
                let status = row.pop().flatten()?;
                if TERMINAL.contains(&status.as_str()) {
                    return None;
                }
                *by_status.entry(status).or_default() += 1;
                Some(id)
            })
            .collect();
        if waiting.is_empty() || Instant::now() >= deadline {
            return Ok(());
        }
        if Instant::now() >= next_progress {
            eprintln!(
                "{label}: {:>6.1} s  draining: {} {queue} tasks not terminal yet {by_status:?}",
                t0.elapsed().as_secs_f64(),
                waiting.len()
            );
            next_progress += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

// ---------------------------------------------------------------------------
// The table

/// One row of a chaos test's final table.
pub struct Figure {
    /// What it counts.
    pub label: String,
    /// What the run gave.
    pub value: usize,
    /// What the value must be.
    pub expected: usize,
    /// Details: a breakdown, or examples of the offending tasks.
    pub note: String,
}

impl Figure {
    /// A figure that must be 0: how many `offences` there are, with up to
    /// five of them as its note.
    pub fn none(label: &str, offences: &[String]) -> Figure {
        Figure {
            label: label.to_owned(),
            value: offences.len(),
            expected: 0,
            note: examples(offences),
        }
    }
}

/// Up to five examples, one a line, as a note.
pub fn examples(items: &[String]) -> String {
    let mut note: Vec<String> = items.iter().take(5).cloned().collect();
    if items.len() > 5 {
        note.push(format!("... and {} more", items.len() - 5));
    }
    note.join("\n")
}

/// `figures` as a table whose first column is `width` wide, a row each
/// (`ok` or `FAIL`) with its note indented below; and a line for every
/// figure off.
fn figure_table(figures: &[Figure], width: usize) -> (String, Vec<String>) {
    let mut table = format!("{:<width$} {:>7} {:>9}\n", "figure", "value", "expected");
    let mut failed = Vec::new();
    for f in figures {
        let ok = f.value == f.expected;
        if !ok {
            failed.push(format!(
                "{}: {} (expected {})",
                f.label, f.value, f.expected
            ));
        }
        table += &format!(
            "{:<width$} {:>7} {:>9}  {}\n",
            f.label,
            f.value,
            f.expected,
            if ok { "ok" } else { "FAIL" }
        );
        for line in f.note.lines().filter(|l| !l.is_empty()) {
            table += &format!("    {line}\n");
        }
    }
    (table, failed)
}
