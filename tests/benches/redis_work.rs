//! Redis's own work per task, in instructions counted by callgrind
//! (`cargo bench -p dtq-tests --bench redis_work`; needs valgrind).
//!
//! The queue bench times a drain, and its figures move with whatever else
//! the machine is doing. This one counts what `redis-server` executes per
//! task for each step of a task's life, the same from run to run, so that a
//! change to a script or to what the host sends shows as a number:
//!
//! 1. **submit**: `DTQ_BENCH_TASKS` (default 2 000) `echo` tasks through the
//!    submission path (`ingest::submit`), without an idempotency key;
//! 2. **read + start**: the worker's reads (XREADGROUP, batches of 64) and
//!    the `start` script for each batch;
//! 3. **complete**: a success completion of each, in the same batches;
//! 4. the same three steps with an idempotency key per task, then without
//!    one under `--events all` (a RUNNING event for every attempt: the
//!    carried ones' written for each read batch in one entry), under
//!    `--events none` (no lifecycle events), under a rate limit that
//!    does not bind (each read a `read_admit` script, as the worker reads
//!    a queue with limits), and with an expiry on each task (not carried:
//!    every attempt through `start`, the path of a retry, a scheduled or a
//!    requeued task, and of every task before carried tasks).
//!
//! "Drained" is what a queue's backlog costs Redis per task once submitted:
//! read, start and complete.
//!
//! Only user-space instructions of the server count: not the kernel's
//! socket work, which callgrind does not see, so these are not a measure of
//! time. The server runs under callgrind, one instruction stream per step,
//! dumped with `callgrind_control` between steps.
//!
//! `DTQ_BENCH_PAYLOAD_BYTES=N` pads each task's payload with a string of N
//! bytes (default 0: `{"n": <n>}`), to see what a payload's size costs.
//!
//! `DTQ_BENCH_KEEP=DIR` keeps the dumps in DIR and names each step's file,
//! for `callgrind_annotate --inclusive=yes FILE`. Debian's `redis-server`
//! has no symbols; one built from the same source (Debian's source package
//! of the installed version, `make`) and put first in `PATH` shows where
//! each step's work goes.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use dtq_host::Config;
use dtq_host::ingest::{self, SubmitRequest};
use dtq_host::store::{
    CompleteOutcome, Completion, CompletionKind, Delivery, Limits, Rate, StartDecision,
    StartedTask, Store,
};
use dtq_tests::{RedisServer, TempDir, echo_request};
use futures::StreamExt;
use serde_json::json;

const QUEUE: &str = "default";

/// Messages per read and per completion batch, as the worker's reads are
/// at most.
const BATCH: usize = 64;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

async fn bench() -> Result<()> {
    let tasks = match std::env::var("DTQ_BENCH_TASKS") {
        Ok(v) => v
            .parse::<usize>()
            .with_context(|| format!("DTQ_BENCH_TASKS={v:?} is not a count"))?,
        Err(_) => 2_000,
    };
    ensure!(tasks > 0, "DTQ_BENCH_TASKS must be at least 1");
    let pad = "x".repeat(dtq_tests::env_usize("DTQ_BENCH_PAYLOAD_BYTES", 0)?);
    Command::new("callgrind_control")
        .arg("--version")
        .output()
        .context(
            "cannot run `callgrind_control`: install valgrind (Debian: `apt-get install valgrind`)",
        )?;

    let kept = std::env::var_os("DTQ_BENCH_KEEP").map(PathBuf::from);
    // Removed on drop, unless the dumps are kept.
    let mut temp = None;
    let dir = match &kept {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("create DTQ_BENCH_KEEP={}", dir.display()))?;
            std::path::absolute(dir)?
        }
        None => temp.insert(TempDir::new("callgrind")?).path.clone(),
    };
    let out_file = format!("--callgrind-out-file={}/cg.%p", dir.display());
    let redis =
        RedisServer::start_under(&["valgrind", "--tool=callgrind", "--dump-instr=no", &out_file])?;
    let mut counter = Counter {
        pid: redis.pid(),
        dir,
        seen: HashSet::new(),
    };
    println!(
        "Redis instructions per task (callgrind, user space only), {tasks} echo tasks, \
         batches of {BATCH}{}",
        if pad.is_empty() {
            String::new()
        } else {
            format!(", payloads padded by {} bytes", pad.len())
        }
    );
    println!(
        "{:<34} {:>12} {:>12} {:>14} {:>14} {:>14} {:>12}",
        "step", "no key", "with key", "--events all", "--events none", "rate limit", "an expiry"
    );
    let mut rows: Vec<(&str, [f64; COLUMNS.len()])> = vec![
        ("submit (one ingest script)", [0.0; COLUMNS.len()]),
        ("read + start", [0.0; COLUMNS.len()]),
        ("complete (success)", [0.0; COLUMNS.len()]),
        ("all three", [0.0; COLUMNS.len()]),
        ("drained (read + start + complete)", [0.0; COLUMNS.len()]),
    ];
    let mut files = Vec::new();
    for (i, column) in COLUMNS.iter().enumerate() {
        let Column {
            name,
            keyed,
            events,
            limited,
            expiring,
        } = *column;
        let config = Config::from_args([
            "--redis",
            &redis.url(),
            "--max-queue-depth",
            "0",
            "--events",
            events,
        ])?;
        let store = Store::connect(&redis.url(), config.store_settings()).await?;
        store.ensure_group(QUEUE).await?;
        let settings = config.ingest_settings();
        counter.step()?;
        submit(&store, &settings, tasks, keyed, expiring, &pad).await?;
        let (submitted, file) = counter.step()?;
        files.push((rows[0].0, name, file));
        let limits = limited.then_some(Limits {
            rate: Some(Rate {
                limit: 1_000_000,
                per_ms: 1_000,
            }),
            group_concurrency: None,
        });
        let batches = read_and_start(&store, tasks, limits.as_ref()).await?;
        let (started, file) = counter.step()?;
        files.push((rows[1].0, name, file));
        complete(&store, &batches).await?;
        let (completed, file) = counter.step()?;
        files.push((rows[2].0, name, file));
        let per_task = |n: u64| n as f64 / tasks as f64;
        rows[0].1[i] = per_task(submitted);
        rows[1].1[i] = per_task(started);
        rows[2].1[i] = per_task(completed);
        rows[3].1[i] = per_task(submitted + started + completed);
        rows[4].1[i] = per_task(started + completed);
    }
    for (name, [plain, keyed, all, none, limited, expiring]) in rows {
        println!(
            "{name:<34} {plain:>12.0} {keyed:>12.0} {all:>14.0} {none:>14.0} {limited:>14.0} \
             {expiring:>12.0}"
        );
    }
    if kept.is_some() {
        println!("callgrind dumps, kept:");
        for (step, column, file) in files {
            println!("  {step}, {column}: {}", file.display());
        }
    }
    Ok(())
}

/// A column of the bench: its tasks, and the settings they run under.
struct Column {
    name: &'static str,
    /// Each task with an idempotency key of its own.
    keyed: bool,
    /// `--events` (`terminal` is the default).
    events: &'static str,
    /// The queue under a rate limit far above what the bench starts: it
    /// never binds.
    limited: bool,
    /// Each task with an expiry: not carried, so every attempt starts
    /// through `start`.
    expiring: bool,
}

const PLAIN: Column = Column {
    name: "no key",
    keyed: false,
    events: "terminal",
    limited: false,
    expiring: false,
};

const COLUMNS: [Column; 6] = [
    PLAIN,
    Column {
        name: "with key",
        keyed: true,
        ..PLAIN
    },
    Column {
        name: "no key, --events all",
        events: "all",
        ..PLAIN
    },
    Column {
        name: "no key, --events none",
        events: "none",
        ..PLAIN
    },
    Column {
        name: "no key, rate limit",
        limited: true,
        ..PLAIN
    },
    Column {
        name: "no key, an expiry",
        expiring: true,
        ..PLAIN
    },
];

/// Submit `tasks` echo tasks, each with its own key when `keyed` and an
/// expiry an hour off when `expiring`, their payloads padded by `pad` when
/// it is not empty.
async fn submit(
    store: &Store,
    settings: &ingest::IngestSettings,
    tasks: usize,
    keyed: bool,
    expiring: bool,
    pad: &str,
) -> Result<()> {
    let run = uuid::Uuid::now_v7().simple().to_string();
    let results: Vec<Result<()>> = futures::stream::iter(0..tasks)
        .map(|n| {
            let req = SubmitRequest {
                idempotency_key: keyed.then(|| format!("{run}-{n}")),
                expires_in_ms: expiring.then_some(3_600_000),
                ..echo_request(if pad.is_empty() {
                    json!({"n": n})
                } else {
                    json!({"n": n, "pad": pad})
                })
            };
            async move {
                ingest::submit(store, settings, QUEUE, None, req, |_| true).await?;
                Ok(())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Read every queued message in batches and start each batch, as the
/// worker does (a queue with `limits` read through its admission); the
/// batches of started tasks.
async fn read_and_start(
    store: &Store,
    tasks: usize,
    limits: Option<&Limits>,
) -> Result<Vec<Vec<(Delivery, StartedTask)>>> {
    let mut conn = store.dedicated_connection(Duration::from_secs(30)).await?;
    let mut batches = Vec::new();
    let mut read = 0;
    while read < tasks {
        let mut deliveries = match limits {
            None => {
                store
                    .read(&mut conn, QUEUE, "bench", BATCH, Duration::from_millis(100))
                    .await?
            }
            Some(limits) => {
                let grace = Duration::from_secs(30);
                let now = dtq_host::base::now_ms();
                let read = store
                    .read_admitted(&mut conn, QUEUE, "bench", BATCH, limits, 1, grace, now)
                    .await?;
                ensure!(
                    read.deliveries.len() == read.read,
                    "a limit that does not bind held tasks"
                );
                read.deliveries
            }
        };
        ensure!(
            !deliveries.is_empty(),
            "only {read} of {tasks} tasks were read"
        );
        read += deliveries.len();
        let decisions = store
            .start(QUEUE, "bench", &mut deliveries, dtq_host::base::now_ms())
            .await?;
        let batch = deliveries
            .into_iter()
            .zip(decisions)
            .map(|(delivery, decision)| match decision {
                StartDecision::Run(task) => Ok((delivery, task)),
                other => bail!("task {} did not start: {other:?}", delivery.task_id),
            })
            .collect::<Result<_>>()?;
        batches.push(batch);
    }
    Ok(batches)
}

/// Complete every started task with success, a batch per script call.
async fn complete(store: &Store, batches: &[Vec<(Delivery, StartedTask)>]) -> Result<()> {
    for batch in batches {
        let completions: Vec<Completion> = batch
            .iter()
            .map(|(delivery, task)| Completion {
                queue: QUEUE.into(),
                task_id: delivery.task_id.clone(),
                msg_id: delivery.msg_id.clone(),
                idempotency_key: task.idempotency_key.clone(),
                kind: CompletionKind::Success,
                detail: r#"{"n":1}"#.into(),
                log: String::new(),
                attempt: task.attempts,
                retry_at: 0,
                defer_limit_ms: 0,
                now: dtq_host::base::now_ms(),
                digest: None,
                carried_at: task.carried_at,
                staged: Vec::new(),
                op_staged: false,
            })
            .collect();
        let outcomes = store.complete(&completions).await?;
        ensure!(
            outcomes
                .iter()
                .all(|o| matches!(o, CompleteOutcome::Done(_))),
            "not every completion was written: {outcomes:?}"
        );
    }
    Ok(())
}

/// Instructions the server ran, step by step: each `step` dumps callgrind's
/// counts (which zeroes them) and returns those since the previous step,
/// with the dump's file.
struct Counter {
    pid: u32,
    dir: PathBuf,
    /// Dump files already counted.
    seen: HashSet<PathBuf>,
}

impl Counter {
    fn step(&mut self) -> Result<(u64, PathBuf)> {
        let out = Command::new("callgrind_control")
            .arg("--dump")
            .arg(self.pid.to_string())
            .output()
            .context("run callgrind_control")?;
        ensure!(
            out.status.success(),
            "callgrind_control --dump failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut new = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            // Dumps are `cg.<pid>.<part>`; `cg.<pid>`, without a part, is
            // the start-up's (and, at exit, the rest's).
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let is_part = name.starts_with(&format!("cg.{}.", self.pid));
            if is_part && self.seen.insert(path.clone()) {
                new.push(path);
            }
        }
        let [file] = <[PathBuf; 1]>::try_from(new).map_err(|new| {
            anyhow::anyhow!("expected one new callgrind dump, found {}", new.len())
        })?;
        Ok((instructions(&file)?, file))
    }
}

/// The instruction total of one callgrind dump.
fn instructions(path: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(path)?;
    let total = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .with_context(|| format!("no totals in {}", path.display()))?;
    Ok(total.trim().parse()?)
}
