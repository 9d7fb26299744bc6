//! Queue throughput against a real redis-server, in one run
//! (`cargo bench -p dtq-tests --bench queue`):
//!
//! 1. **drain**: `DTQ_BENCH_TASKS` (default 20 000) `echo` tasks are
//!    submitted through the submission path, then one in-process worker
//!    (concurrency `DTQ_BENCH_CONCURRENCY`, default 256) runs them all; the
//!    figure is tasks/s from the worker's start until the queue is empty,
//!    after which every task is checked to be SUCCEEDED.
//! 2. **round trips per executed task**: from [`Store::round_trips`] (the
//!    worker's clones share the counter), cross-checked by Redis: socket
//!    read events (`total_reads_processed`) and top-level calls
//!    (`EVALSHA`, `XREADGROUP`, `XAUTOCLAIM` in `INFO commandstats`).
//! 3. **API submissions**: `DTQ_BENCH_SUBMITS` (default 10 000) HTTP
//!    submissions, each with its own Idempotency-Key, `DTQ_BENCH_IN_FLIGHT`
//!    (default 64) at a time → submissions/s and round trips per submission.
//! 4. **redis-benchmark** `-t set,get -n 100000` (and `-P 16`) against the
//!    same server, for scale: the ratio of drain tasks/s to SET ops/s.
//!
//! Redis, the API, the worker, the HTTP clients and redis-benchmark all share
//! this machine's cores; the table says how many there are and how much CPU
//! Redis used during the drain, which is what bounds it.
//!
//! [`Store::round_trips`]: dtq_host::store::Store::round_trips

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::ingest::{self, SubmitRequest};
use dtq_host::store::QueueKeys;
use dtq_tests::Dtq;
use futures::StreamExt;
use redis::aio::MultiplexedConnection;
use serde_json::json;

const QUEUE: &str = "default";

/// The allocator the `dtq` binary uses, so the in-process worker measured
/// here allocates as it does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{name}={v:?} is not a count")),
        Err(_) => Ok(default),
    }
}

async fn bench() -> Result<()> {
    let tasks = env_usize("DTQ_BENCH_TASKS", 20_000)?;
    let submits = env_usize("DTQ_BENCH_SUBMITS", 10_000)?;
    let concurrency = env_usize("DTQ_BENCH_CONCURRENCY", 256)?;
    let in_flight = env_usize("DTQ_BENCH_IN_FLIGHT", 64)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    // The production visibility timeout (heartbeats every 10 s, not every
    // 333 ms as in the tests), no depth limit.
    let concurrency_flag = concurrency.to_string();
    let dtq = Dtq::start(
        false,
        &[
            "--concurrency",
            &concurrency_flag,
            "--visibility-timeout-ms",
            "30000",
            "--max-queue-depth",
            "0",
        ],
    )
    .await?;
    let mut probe = dtq.redis.conn().await?;
    let version = redis_version(&mut probe).await?;
    println!(
        "dtq queue benchmark: redis-server {version} on 127.0.0.1:{}, {cores} CPU(s) shared by \
         Redis, the API, the worker and the clients",
        dtq.redis.port()
    );

    // --- 1. preload: the submission path, without HTTP --------------------
    let settings = dtq.config.ingest_settings();
    let trips = dtq.store.round_trips();
    let started = Instant::now();
    let ids: Vec<String> = futures::stream::iter(0..tasks)
        .map(|n| {
            let store = dtq.store.clone();
            let settings = settings.clone();
            async move {
                let req = SubmitRequest {
                    task: "echo".into(),
                    payload: json!({"n": n}),
                    idempotency_key: None,
                    max_attempts: None,
                    timeout_ms: None,
                    delay_ms: None,
                    expires_in_ms: None,
                };
                let done = ingest::submit(&store, &settings, QUEUE, None, req, |_| true).await?;
                anyhow::Ok(done.task_id)
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let preload = started.elapsed();
    let preload_trips = dtq.store.round_trips() - trips;

    // --- 2. drain: one worker runs them all -----------------------------
    let before = RedisStats::read(&mut probe).await?;
    let trips = dtq.store.round_trips();
    let cpu = process_cpu()?;
    let mut polls = 0u64;
    let mut dtq = dtq;
    let started = Instant::now();
    dtq.start_worker();
    let keys = QueueKeys::new(QUEUE);
    loop {
        // The completion script removes each entry it acknowledges, so an
        // empty stream with nothing delayed means every task has finished.
        polls += 1;
        let (len, delayed): (u64, u64) = redis::pipe()
            .xlen(&keys.stream)
            .zcard(&keys.delayed)
            .query_async(&mut probe)
            .await?;
        if len == 0 && delayed == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the drain did not finish within 10 minutes ({len} left)");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drain = started.elapsed();
    let drain_trips = dtq.store.round_trips() - trips;
    let worker_cpu = process_cpu()? - cpu;
    let after = RedisStats::read(&mut probe).await?;
    dtq.stop_worker().await?;
    let succeeded = count_succeeded(&mut probe, &keys, &ids).await?;
    ensure!(
        succeeded == ids.len(),
        "only {succeeded} of {} tasks SUCCEEDED",
        ids.len()
    );
    // The probe's own polls (one pipeline of two commands each) and the
    // first INFO are not the worker's.
    let drained = tasks as f64;
    let redis_reads = after.get("total_reads_processed") - before.get("total_reads_processed");
    let redis_reads = redis_reads.saturating_sub(polls + 1) as f64;
    let commands = after.get("total_commands_processed") - before.get("total_commands_processed");
    let commands = commands.saturating_sub(2 * polls + 1) as f64;
    let top_level =
        |s: &RedisStats| s.calls("evalsha") + s.calls("xreadgroup") + s.calls("xautoclaim");
    let top = (top_level(&after) - top_level(&before)) as f64;
    let evalsha = (after.calls("evalsha") - before.calls("evalsha")) as f64;
    let xreadgroup = (after.calls("xreadgroup") - before.calls("xreadgroup")) as f64;
    let redis_cpu = after.cpu() - before.cpu();
    let drain_rate = drained / drain.as_secs_f64();
    let breakdown = after.command_usec_since(&before);

    // --- 3. submissions through the HTTP API, with keys -------------------
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(in_flight)
        .build()?;
    let url = format!("{}/v1/queues/{QUEUE}/tasks", dtq.api);
    let run = uuid::Uuid::now_v7().simple().to_string();
    let before = RedisStats::read(&mut probe).await?;
    let trips = dtq.store.round_trips();
    let started = Instant::now();
    let statuses: Vec<u16> = futures::stream::iter(0..submits)
        .map(|n| {
            let req = http
                .post(&url)
                .header("Idempotency-Key", format!("bench-{run}-{n}"))
                .json(&json!({"task": "echo", "payload": {"n": n}}));
            async move { anyhow::Ok(req.send().await?.status().as_u16()) }
        })
        .buffer_unordered(in_flight)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let api_time = started.elapsed();
    let api_trips = dtq.store.round_trips() - trips;
    let after = RedisStats::read(&mut probe).await?;
    let accepted = statuses.iter().filter(|s| **s == 202).count();
    ensure!(
        accepted == submits,
        "{accepted} of {submits} submissions got 202; statuses seen: {:?}",
        tally(&statuses)
    );
    let api_evalsha = (after.calls("evalsha") - before.calls("evalsha")) as f64;
    let api_reads = (after.get("total_reads_processed") - before.get("total_reads_processed"))
        .saturating_sub(1) as f64;
    let api_redis_cpu = after.cpu() - before.cpu();
    let api_rate = submits as f64 / api_time.as_secs_f64();

    // --- 4. redis-benchmark on the same server ---------------------------
    let plain = redis_benchmark(dtq.redis.port(), 1)?;
    let piped = redis_benchmark(dtq.redis.port(), 16)?;
    let set = plain.get("SET").copied().context("no SET figure")?;

    // --- the table --------------------------------------------------------
    let n = |x: f64| format!("{x:.0}");
    let r = |x: f64| format!("{x:.3}");
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!();
    println!("{:<58} {:>14}  target", "figure", "measured");
    let row = |name: &str, value: String, target: &str, status: &str| {
        println!("{name:<58} {value:>14}  {target:<8} {status}");
    };
    row(
        &format!("drain: {tasks} echo tasks, 1 worker, concurrency {concurrency} (tasks/s)"),
        n(drain_rate),
        "",
        "",
    );
    row(
        "  drain time (s)",
        format!("{:.2}", drain.as_secs_f64()),
        "",
        "",
    );
    row(
        "  Redis CPU during the drain (cores)",
        format!("{:.2}", redis_cpu / drain.as_secs_f64()),
        "",
        "",
    );
    row(
        "  Redis CPU per task (µs)",
        format!("{:.1}", redis_cpu / drained * 1e6),
        "",
        "",
    );
    row(
        "  this process's CPU during the drain (cores)",
        format!("{:.2}", worker_cpu / drain.as_secs_f64()),
        "",
        "",
    );
    row(
        "  this process's CPU per task (µs)",
        format!("{:.1}", worker_cpu / drained * 1e6),
        "",
        "",
    );
    row("redis-benchmark SET, 50 clients (ops/s)", n(set), "", "");
    let ratio = drain_rate / set;
    row(
        "drain tasks/s ÷ SET ops/s",
        r(ratio),
        "≥ 0.333",
        verdict(ratio >= 1.0 / 3.0),
    );
    let per_task = drain_trips as f64 / drained;
    row(
        "round trips per executed task (Store::round_trips)",
        r(per_task),
        "≤ 2",
        verdict(per_task <= 2.0),
    );
    row(
        "  Redis read events per task (total_reads_processed)",
        r(redis_reads / drained),
        "",
        "",
    );
    row(
        "  top-level calls per task (EVALSHA+XREADGROUP+XAUTOCLAIM)",
        r(top / drained),
        "",
        "",
    );
    row("    EVALSHA per task", r(evalsha / drained), "", "");
    row(
        "    tasks per XREADGROUP",
        format!("{:.1}", drained / xreadgroup.max(1.0)),
        "",
        "",
    );
    row(
        "  Redis commands per task, script-internal included",
        format!("{:.1}", commands / drained),
        "",
        "",
    );
    // Where Redis spends its time per task; a script's own time includes
    // the commands it runs, which are listed again by name.
    let mut top: Vec<_> = breakdown.iter().collect();
    top.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    for (command, (calls, usec)) in top.into_iter().take(10) {
        row(
            &format!("    {command}: calls per task, µs per task"),
            format!("{:.2}, {:.2}", *calls as f64 / drained, usec / drained),
            "",
            "",
        );
    }
    row(
        "submission path without HTTP, 256 in flight (tasks/s)",
        n(tasks as f64 / preload.as_secs_f64()),
        "",
        "",
    );
    row(
        "  round trips per submission",
        r(preload_trips as f64 / tasks as f64),
        "1",
        verdict(preload_trips as f64 / (tasks as f64) < 1.01),
    );
    row(
        &format!("API: {submits} keyed submissions, {in_flight} in flight (submissions/s)"),
        n(api_rate),
        "",
        "",
    );
    let per_submit = api_trips as f64 / submits as f64;
    row(
        "  round trips per submission (Store::round_trips)",
        r(per_submit),
        "1",
        verdict(per_submit < 1.01),
    );
    row(
        "  EVALSHA per submission (commandstats)",
        r(api_evalsha / submits as f64),
        "",
        "",
    );
    row(
        "  Redis read events per submission",
        r(api_reads / submits as f64),
        "",
        "",
    );
    row(
        "  Redis CPU per submission (µs)",
        format!("{:.1}", api_redis_cpu / submits as f64 * 1e6),
        "",
        "",
    );
    for (name, figures) in [("", &plain), (" -P 16", &piped)] {
        for test in ["SET", "GET"] {
            if let Some(ops) = figures.get(test) {
                row(
                    &format!("redis-benchmark -t {}{name} (ops/s)", test.to_lowercase()),
                    n(*ops),
                    "",
                    "",
                );
            }
        }
    }
    Ok(())
}

/// How many of `ids` have status SUCCEEDED.
async fn count_succeeded(
    conn: &mut MultiplexedConnection,
    keys: &QueueKeys,
    ids: &[String],
) -> Result<usize> {
    let mut succeeded = 0;
    for chunk in ids.chunks(1_000) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.hget(keys.task(id), "status");
        }
        let statuses: Vec<Option<String>> = pipe.query_async(conn).await?;
        succeeded += statuses
            .iter()
            .filter(|s| s.as_deref() == Some("SUCCEEDED"))
            .count();
    }
    Ok(succeeded)
}

fn tally(statuses: &[u16]) -> HashMap<u16, usize> {
    let mut counts = HashMap::new();
    for s in statuses {
        *counts.entry(*s).or_default() += 1;
    }
    counts
}

/// The figures of `INFO stats commandstats cpu`.
struct RedisStats(HashMap<String, String>);

impl RedisStats {
    async fn read(conn: &mut MultiplexedConnection) -> Result<RedisStats> {
        let text: String = redis::cmd("INFO")
            .arg("stats")
            .arg("commandstats")
            .arg("cpu")
            .query_async(conn)
            .await?;
        Ok(RedisStats(
            text.lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
                .collect(),
        ))
    }

    fn get(&self, name: &str) -> u64 {
        self.0.get(name).and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// `calls=` of `cmdstat_<command>`.
    fn calls(&self, command: &str) -> u64 {
        self.0
            .get(&format!("cmdstat_{command}"))
            .and_then(|v| v.split(',').find_map(|kv| kv.strip_prefix("calls=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Calls and microseconds of every command since `before`, by name.
    fn command_usec_since(&self, before: &RedisStats) -> HashMap<String, (u64, f64)> {
        let field = |v: &str, name: &str| -> f64 {
            v.split(',')
                .find_map(|kv| kv.strip_prefix(name))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        let mut out = HashMap::new();
        for (key, value) in &self.0 {
            let Some(command) = key.strip_prefix("cmdstat_") else {
                continue;
            };
            let old = before.0.get(key).map(String::as_str).unwrap_or("");
            let calls = field(value, "calls=") - field(old, "calls=");
            let usec = field(value, "usec=") - field(old, "usec=");
            if calls > 0.0 && !command.starts_with("info") {
                out.insert(command.to_owned(), (calls as u64, usec));
            }
        }
        out
    }

    /// CPU seconds the server has used (user + system, all its threads).
    fn cpu(&self) -> f64 {
        ["used_cpu_user", "used_cpu_sys"]
            .iter()
            .filter_map(|k| self.0.get(*k).and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }
}

async fn redis_version(conn: &mut MultiplexedConnection) -> Result<String> {
    let text: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_owned())
}

/// CPU seconds this process has used so far (user + system).
fn process_cpu() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("read /proc/self/stat")?;
    // Fields after the command name (which is in parentheses and may hold
    // spaces): utime and stime are fields 14 and 15 of the whole line.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("unexpected /proc/self/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/self/stat")?
            .parse::<f64>()?)
    };
    // Clock ticks; 100 per second on Linux.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// `redis-benchmark -t set,get -n 100000` with `pipeline` commands per
/// round trip; ops/s by test name.
fn redis_benchmark(port: u16, pipeline: usize) -> Result<HashMap<String, f64>> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-t", "set,get", "-n", "100000", "--csv"])
        .args(["-P", &pipeline.to_string()])
        .output()
        .context("cannot run redis-benchmark (Debian: apt-get install redis-tools)")?;
    ensure!(
        out.status.success(),
        "redis-benchmark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut figures = HashMap::new();
    for line in text.lines().skip(1) {
        let cols: Vec<&str> = line.split(',').map(|c| c.trim_matches('"')).collect();
        if let [test, rps, ..] = cols[..] {
            figures.insert(test.to_owned(), rps.parse()?);
        }
    }
    Ok(figures)
}
