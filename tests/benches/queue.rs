//! Queue throughput against a real redis-server, in one run
//! (`cargo bench -p dtq-tests --bench queue`):
//!
//! 1. **drain rounds** (`DTQ_BENCH_ROUNDS`, default 5), each:
//!    `DTQ_BENCH_TASKS` (default 20 000) `echo` tasks are submitted through
//!    the submission path, then one in-process worker (concurrency
//!    `DTQ_BENCH_CONCURRENCY`, default 256) runs them all — tasks/s from the
//!    worker's start until the queue is empty, after which every task is
//!    checked to be SUCCEEDED — and then `redis-benchmark -t set -n 50000`
//!    measures the same server. The ratio of the two is taken per round, so
//!    a round's figures share the machine's state, and the verdict is on
//!    the median.
//!    One more drain, not timed, counts what this process allocates
//!    meanwhile (calls and bytes per task: the worker's hot path, the
//!    probe's polls aside).
//! 2. **round trips per executed task**: from [`Store::round_trips`] (the
//!    worker's clones share the counter), cross-checked by Redis: socket
//!    read events (`total_reads_processed`) and top-level calls
//!    (`EVALSHA`, `XREADGROUP`, `XAUTOCLAIM` in `INFO commandstats`).
//! 3. **API submissions**: `DTQ_BENCH_SUBMITS` (default 10 000) HTTP
//!    submissions, each with its own Idempotency-Key, `DTQ_BENCH_IN_FLIGHT`
//!    (default 64) at a time → submissions/s and round trips per submission.
//! 4. **redis-benchmark** `-t set,get` plain and with `-P 16`, for scale.
//! 5. **limits that do not bind**: `DTQ_BENCH_LIMIT_PAIRS` (default 3)
//!    pairs of drains as in 1., the second of each under a rate limit of
//!    1,000,000 starts per second, far above the drain rate: the ratio of
//!    the two rates, per pair, and its median, beside what each drain cost
//!    Redis and this process in CPU per task, which the machine's noise
//!    moves less than the rates (run between 1. and 3.).
//!    `DTQ_BENCH_LIMIT_CONTROL=1` runs both drains of each pair free: what
//!    the second drain's place in a pair alone does to the ratio.
//!
//! **CPUs.** With two or more CPUs, Redis gets the first one to itself and
//! this process (API, worker, clients) and redis-benchmark the others, so
//! that the drain and redis-benchmark each measure a Redis with a core of
//! its own, as a fleet's Redis would have. `DTQ_BENCH_PIN=0` lets them share
//! every core instead; the table then shows how long Redis waited for a CPU
//! during the drains, which is what sharing costs it.
//!
//! [`Store::round_trips`]: dtq_host::store::Store::round_trips

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::ingest;
use dtq_host::store::{QueueKeys, Store};
use dtq_tests::alloc::{Allocated, Counting};
use dtq_tests::{Dtq, echo_request, env_usize};
use futures::StreamExt;
use redis::aio::MultiplexedConnection;
use serde_json::json;

const QUEUE: &str = "default";

/// SETs of each round's redis-benchmark run: about as long as the drain
/// before it, so that the two see the machine in the same state.
const ROUND_SETS: usize = 50_000;

/// The allocator the `dtq` binary uses, so the in-process worker measured
/// here allocates as it does; counted during the counted drain only.
#[global_allocator]
static ALLOCATOR: Counting = Counting;

// With the binary's settings (`dtq_host::allocator`).
dtq_host::mimalloc_defaults!();

fn main() -> Result<()> {
    // Logging as the `dtq` binary's (`DTQ_LOG`, default `info`), so that
    // the worker's spans and events cost here what they cost a fleet.
    dtq_host::server::init_tracing("text");
    // `scripts/bench-peers`: only the drain rounds, on its redis-server.
    if let Some(port) = peers::port()? {
        return peers::main(port);
    }
    // Before any thread exists, so that every thread of this process, and
    // every process it starts, inherits the CPUs left to it.
    let pinning = if env_usize("DTQ_BENCH_PIN", 1)? == 0 {
        None
    } else {
        Pinning::split()?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(pinning))
}

/// Redis on one CPU, this process on the rest.
struct Pinning {
    redis: usize,
    rest: Vec<usize>,
}

impl Pinning {
    /// Take the first CPU this process may use for Redis and keep the others;
    /// `None` with fewer than two.
    fn split() -> Result<Option<Pinning>> {
        let allowed = cpus_of(0)?;
        let Some((&redis, rest)) = allowed.split_first() else {
            return Ok(None);
        };
        if rest.is_empty() {
            return Ok(None);
        }
        set_cpus(0, rest)?;
        Ok(Some(Pinning {
            redis,
            rest: rest.to_vec(),
        }))
    }

    /// Move every thread of process `pid` to the Redis CPU.
    fn pin_redis(&self, pid: u32) -> Result<()> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .with_context(|| format!("list the threads of process {pid}"))?;
        for task in tasks {
            let tid: libc::pid_t = task?.file_name().to_string_lossy().parse()?;
            set_cpus(tid, &[self.redis])?;
        }
        Ok(())
    }
}

/// The CPUs thread `tid` (0: the calling thread) may run on.
fn cpus_of(tid: libc::pid_t) -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; the kernel writes at most
    // `size_of::<cpu_set_t>()` bytes into it.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error()).context("sched_getaffinity");
        }
        set
    };
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, the size of the set.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Let thread `tid` (0: the calling thread) run on `cpus` only.
fn set_cpus(tid: libc::pid_t, cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `cpus_of`; every CPU number comes from `cpus_of`, so it
    // is below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("sched_setaffinity({tid}, {cpus:?})"));
        }
    }
    Ok(())
}

/// Seconds process `pid`'s threads have spent runnable but waiting for a
/// CPU (the second field of `/proc/<pid>/task/*/schedstat`).
fn cpu_wait(pid: u32) -> Result<f64> {
    let mut wait = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        wait += text
            .split_whitespace()
            .nth(1)
            .context("short schedstat")?
            .parse::<u64>()?;
    }
    Ok(wait as f64 / 1e9)
}

/// CPU seconds this process's sandbox threads (the worker's guest runtime,
/// threads named `dtq-guest`) have used so far (the first field of
/// `/proc/self/task/*/schedstat`). The worker's other threads (fetch,
/// completion, the Redis client) are the rest of [`process_cpu`].
fn guest_cpu() -> Result<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        // A thread may end between the listing and the reads.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if !comm.starts_with("dtq-guest") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        ns += text
            .split_whitespace()
            .next()
            .context("short schedstat")?
            .parse::<u64>()?;
    }
    Ok(ns as f64 / 1e9)
}

/// One drain round's figures.
struct Round {
    tasks: usize,
    preload: Duration,
    preload_trips: u64,
    drain: Duration,
    trips: u64,
    /// The probe's polls of the stream during the drain.
    polls: u64,
    before: RedisStats,
    after: RedisStats,
    worker_cpu: f64,
    /// Of `worker_cpu`, what the sandbox threads used.
    guest_cpu: f64,
    /// Seconds Redis's threads spent waiting for a CPU during the drain.
    redis_wait: f64,
    set: f64,
    /// Redis CPU seconds redis-benchmark's SETs took.
    set_cpu: f64,
    /// What this process allocated during the drain, when counted.
    allocated: Option<Allocated>,
}

impl Round {
    fn rate(&self) -> f64 {
        self.tasks as f64 / self.drain.as_secs_f64()
    }

    fn ratio(&self) -> f64 {
        self.rate() / self.set
    }
}

/// Submit `tasks` echo tasks, drain them with the worker (counting what
/// this process allocates meanwhile when `count`), then measure SET.
async fn round(
    dtq: &mut Dtq,
    probe: &mut MultiplexedConnection,
    tasks: usize,
    count: bool,
) -> Result<Round> {
    // --- preload: the submission path, without HTTP --------------------
    // Through a store of its own, whose count of round trips is then the
    // submissions' alone: `dtq.store`'s clones also count the in-process
    // API's background work. (Its first submission also registers the
    // queue and reads its partition count: two round trips a round.)
    let submitter = Store::connect(&dtq.redis.url(), dtq.config.store_settings()).await?;
    let settings = dtq.config.ingest_settings();
    let trips = submitter.round_trips();
    let started = Instant::now();
    let ids: Vec<String> = futures::stream::iter(0..tasks)
        .map(|n| {
            let store = submitter.clone();
            let settings = settings.clone();
            async move {
                let req = echo_request(json!({"n": n}));
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
    let preload_trips = submitter.round_trips() - trips;

    // --- drain: one worker runs them all -----------------------------
    let redis_pid = dtq.redis.pid();
    let before = RedisStats::read(probe).await?;
    let trips = dtq.store.round_trips();
    let cpu = process_cpu()?;
    let guests = guest_cpu()?;
    let wait = cpu_wait(redis_pid)?;
    let mut polls = 0u64;
    if count {
        Counting::start();
    }
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
            .query_async(probe)
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
    let allocated = count.then(Counting::stop);
    let trips = dtq.store.round_trips() - trips;
    let worker_cpu = process_cpu()? - cpu;
    // Before the worker stops: its guest threads end with it.
    let guest_cpu = guest_cpu()? - guests;
    let redis_wait = cpu_wait(redis_pid)? - wait;
    let after = RedisStats::read(probe).await?;
    dtq.stop_worker().await?;
    let succeeded = count_succeeded(probe, &keys, &ids).await?;
    ensure!(
        succeeded == ids.len(),
        "only {succeeded} of {} tasks SUCCEEDED",
        ids.len()
    );

    // --- the same server's SET rate, right after ---------------------
    let cpu = RedisStats::read(probe).await?.cpu();
    let set = redis_benchmark(dtq.redis.single().port(), "set", ROUND_SETS, 1)?
        .get("SET")
        .copied()
        .context("no SET figure")?;
    let set_cpu = RedisStats::read(probe).await?.cpu() - cpu;
    Ok(Round {
        tasks,
        preload,
        preload_trips,
        drain,
        trips,
        polls,
        before,
        after,
        worker_cpu,
        guest_cpu,
        redis_wait,
        set,
        set_cpu,
        allocated,
    })
}

/// The median of `values` (the upper one of an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

async fn bench(pinning: Option<Pinning>) -> Result<()> {
    let tasks = env_usize("DTQ_BENCH_TASKS", 20_000)?;
    let rounds = env_usize("DTQ_BENCH_ROUNDS", 5)?.max(1);
    let submits = env_usize("DTQ_BENCH_SUBMITS", 10_000)?;
    let concurrency = env_usize("DTQ_BENCH_CONCURRENCY", 256)?;
    let in_flight = env_usize("DTQ_BENCH_IN_FLIGHT", 64)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    // The production visibility timeout (heartbeats every 10 s, not every
    // 333 ms as in the tests), no depth limit.
    let concurrency_flag = concurrency.to_string();
    let mut dtq = Dtq::start(
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
    if let Some(pinning) = &pinning {
        pinning.pin_redis(dtq.redis.pid())?;
    }
    let mut probe = dtq.redis.single().conn().await?;
    let version = redis_version(&mut probe).await?;
    println!(
        "dtq queue benchmark: redis-server {version} on 127.0.0.1:{}",
        dtq.redis.single().port()
    );
    match &pinning {
        Some(p) => println!(
            "CPUs: Redis on CPU {}; this process (API, worker, clients) and redis-benchmark on {:?}",
            p.redis, p.rest
        ),
        None => println!(
            "CPUs: Redis, this process (API, worker, clients) and redis-benchmark share {cores}"
        ),
    }

    let mut all = Vec::with_capacity(rounds);
    println!();
    println!(
        "{:>5} {:>10} {:>9} {:>10} {:>8} {:>11} {:>12} {:>12}",
        "round",
        "drain/s",
        "time (s)",
        "SET/s",
        "ratio",
        "Redis cores",
        "Redis waits",
        "worker cores"
    );
    for i in 1..=rounds {
        let r = round(&mut dtq, &mut probe, tasks, false).await?;
        let secs = r.drain.as_secs_f64();
        println!(
            "{i:>5} {:>10.0} {:>9.2} {:>10.0} {:>8.3} {:>11.2} {:>11.0}% {:>12.2}",
            r.rate(),
            secs,
            r.set,
            r.ratio(),
            (r.after.cpu() - r.before.cpu()) / secs,
            r.redis_wait / secs * 100.0,
            r.worker_cpu / secs,
        );
        all.push(r);
    }
    // --- what this process allocates per task: one more drain, counted,
    // apart from the timed ones ------------------------------------------
    let counted = round(&mut dtq, &mut probe, tasks, true).await?;
    let allocated = counted.allocated.unwrap_or_default();

    // --- the drain figures, over all rounds -------------------------------
    let drained = (tasks * rounds) as f64;
    let sum = |f: &dyn Fn(&Round) -> f64| all.iter().map(f).sum::<f64>();
    let drain_secs = sum(&|r| r.drain.as_secs_f64());
    let delta = |r: &Round, name: &str| (r.after.get(name) - r.before.get(name)) as f64;
    let calls =
        |r: &Round, command: &str| (r.after.calls(command) - r.before.calls(command)) as f64;
    // The probe's own polls (one pipeline of two commands each) and the
    // first INFO are not the worker's.
    let redis_reads = sum(&|r| delta(r, "total_reads_processed") - (r.polls + 1) as f64);
    let commands = sum(&|r| delta(r, "total_commands_processed") - (2 * r.polls + 1) as f64);
    let top = sum(&|r| calls(r, "evalsha") + calls(r, "xreadgroup") + calls(r, "xautoclaim"));
    let evalsha = sum(&|r| calls(r, "evalsha"));
    let xreadgroup = sum(&|r| calls(r, "xreadgroup"));
    let redis_cpu = sum(&|r| r.after.cpu() - r.before.cpu());
    let redis_wait = sum(&|r| r.redis_wait);
    let worker_cpu = sum(&|r| r.worker_cpu);
    let guest_cpu = sum(&|r| r.guest_cpu);
    let drain_trips = sum(&|r| r.trips as f64);
    let preload_secs = sum(&|r| r.preload.as_secs_f64());
    let preload_trips = sum(&|r| r.preload_trips as f64);
    let mut breakdown: HashMap<String, (u64, f64)> = HashMap::new();
    for r in &all {
        for (command, (n, usec)) in r.after.command_usec_since(&r.before) {
            let entry = breakdown.entry(command).or_default();
            entry.0 += n;
            entry.1 += usec;
        }
    }
    let ratios: Vec<f64> = all.iter().map(Round::ratio).collect();
    let ratio = median(&ratios);
    let rate = median(&all.iter().map(Round::rate).collect::<Vec<_>>());
    let set = median(&all.iter().map(|r| r.set).collect::<Vec<_>>());
    let (low, high) = ratios
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));

    // --- limits that do not bind: pairs of drains, without then with a
    // rate limit far above the drain rate -----------------------------------
    let pairs = env_usize("DTQ_BENCH_LIMIT_PAIRS", 3)?;
    let limit = dtq_host::store::Limits {
        rate: Some(dtq_host::store::Rate {
            limit: 1_000_000,
            per_ms: 1_000,
        }),
        group_concurrency: None,
    };
    // Beside the rates, what each drain cost per task (µs of CPU, free →
    // limited), Redis's and this process's: those hold still where the
    // machine's noise moves the rates.
    // `DTQ_BENCH_LIMIT_CONTROL=1`: both drains of each pair free, to see
    // what the second drain of a pair gives or loses by its place alone.
    let control = env_usize("DTQ_BENCH_LIMIT_CONTROL", 0)? == 1;
    let mut limit_ratios = Vec::with_capacity(pairs);
    let mut limit_costs = Vec::with_capacity(pairs);
    if pairs > 0 {
        println!();
        println!(
            "{:>5} {:>14} {:>16} {:>8} {:>18} {:>18}",
            "pair", "drain/s", "limited drain/s", "ratio", "Redis µs/task", "worker µs/task"
        );
    }
    let per_task = |r: &Round| {
        (
            (r.after.cpu() - r.before.cpu()) / r.tasks as f64 * 1e6,
            r.worker_cpu / r.tasks as f64 * 1e6,
        )
    };
    for i in 1..=pairs {
        dtq.store.delete_limits(QUEUE).await?;
        let free = round(&mut dtq, &mut probe, tasks, false).await?;
        if !control {
            dtq.store.set_limits(QUEUE, &limit).await?;
        }
        let limited = round(&mut dtq, &mut probe, tasks, false).await?;
        let ratio = limited.rate() / free.rate();
        let (cost, limited_cost) = (per_task(&free), per_task(&limited));
        println!(
            "{i:>5} {:>14.0} {:>16.0} {ratio:>8.3} {:>18} {:>18}",
            free.rate(),
            limited.rate(),
            format!("{:.1} → {:.1}", cost.0, limited_cost.0),
            format!("{:.1} → {:.1}", cost.1, limited_cost.1),
        );
        limit_ratios.push(ratio);
        limit_costs.push((limited_cost.0 / cost.0, limited_cost.1 / cost.1));
    }
    dtq.store.delete_limits(QUEUE).await?;

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
    let plain = redis_benchmark(dtq.redis.single().port(), "set,get", 100_000, 1)?;
    let piped = redis_benchmark(dtq.redis.single().port(), "set,get", 100_000, 16)?;

    // --- the table --------------------------------------------------------
    let n = |x: f64| format!("{x:.0}");
    let r = |x: f64| format!("{x:.3}");
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!();
    println!("{:<58} {:>14}  target", "figure", "measured");
    let row = |name: &str, value: String, target: &str, status: &str| {
        println!("{name:<58} {value:>14}  {target:<8} {status}");
    };
    // A figure with no target.
    let info = |name: &str, value: String| row(name, value, "", "");
    row(
        &format!("drain: {tasks} echo tasks, 1 worker, concurrency {concurrency} (tasks/s)"),
        n(rate),
        "",
        "median",
    );
    if !limit_ratios.is_empty() {
        let ratio = median(&limit_ratios);
        if control {
            row(
                &format!("control: a free drain ÷ the free one before it, median of {pairs}"),
                r(ratio),
                "",
                "",
            );
        } else {
            row(
                &format!("drain under a 1,000,000/s rate limit ÷ without, median of {pairs}"),
                r(ratio),
                "≥ 0.95",
                verdict(ratio >= 0.95),
            );
        }
        let redis = median(&limit_costs.iter().map(|c| c.0).collect::<Vec<_>>());
        let worker = median(&limit_costs.iter().map(|c| c.1).collect::<Vec<_>>());
        info("  Redis CPU per task, limited ÷ free, median", r(redis));
        info(
            "  this process's CPU per task, limited ÷ free, median",
            r(worker),
        );
    }
    row(
        "redis-benchmark SET, 50 clients (ops/s)",
        n(set),
        "",
        "median",
    );
    row(
        &format!("drain tasks/s ÷ SET ops/s, median of {rounds} rounds"),
        r(ratio),
        "≥ 0.333",
        verdict(ratio >= 1.0 / 3.0),
    );
    info(
        "  lowest and highest round",
        format!("{low:.3} – {high:.3}"),
    );
    info(
        "  Redis CPU during the drains (cores)",
        format!("{:.2}", redis_cpu / drain_secs),
    );
    info(
        "  Redis waiting for a CPU during the drains (share)",
        format!("{:.0}%", redis_wait / drain_secs * 100.0),
    );
    info(
        "  Redis CPU per task (µs)",
        format!("{:.1}", redis_cpu / drained * 1e6),
    );
    // SET's cost by the same measure: what a task costs in SETs, whatever
    // share of a CPU Redis got in either measurement.
    let set_usec = sum(&|r| r.set_cpu) / (ROUND_SETS * rounds) as f64 * 1e6;
    info(
        "  Redis CPU per SET of redis-benchmark (µs)",
        format!("{set_usec:.1}"),
    );
    info(
        "  Redis CPU per task ÷ per SET",
        format!("{:.2}", redis_cpu / drained * 1e6 / set_usec),
    );
    info(
        "  this process's CPU during the drains (cores)",
        format!("{:.2}", worker_cpu / drain_secs),
    );
    info(
        "  this process's CPU per task (µs)",
        format!("{:.1}", worker_cpu / drained * 1e6),
    );
    // The guest runtime has a thread per CPU the worker may use, so its
    // share spreads over the cores a worker is given; the rest runs on the
    // worker's main runtime.
    info(
        "    on sandbox threads (dtq-guest)",
        format!("{:.1}", guest_cpu / drained * 1e6),
    );
    info(
        "    on the other threads (fetch, completion, Redis client)",
        format!("{:.1}", (worker_cpu - guest_cpu) / drained * 1e6),
    );
    info(
        "  this process's allocations per task (one more drain, counted)",
        format!(
            "{:.1} ({:.0} bytes)",
            allocated.allocations as f64 / tasks as f64,
            allocated.bytes as f64 / tasks as f64
        ),
    );
    let per_task = drain_trips / drained;
    row(
        "round trips per executed task (Store::round_trips)",
        r(per_task),
        "≤ 2",
        verdict(per_task <= 2.0),
    );
    info(
        "  Redis read events per task (total_reads_processed)",
        r(redis_reads / drained),
    );
    info(
        "  top-level calls per task (EVALSHA+XREADGROUP+XAUTOCLAIM)",
        r(top / drained),
    );
    info("    EVALSHA per task", r(evalsha / drained));
    info(
        "    tasks per XREADGROUP",
        format!("{:.1}", drained / xreadgroup.max(1.0)),
    );
    info(
        "  Redis commands per task, script-internal included",
        format!("{:.1}", commands / drained),
    );
    // Where Redis spends its time per task; a script's own time includes
    // the commands it runs, which are listed again by name.
    let mut top: Vec<_> = breakdown.iter().collect();
    top.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    for (command, (calls, usec)) in top.into_iter().take(10) {
        info(
            &format!("    {command}: calls per task, µs per task"),
            format!("{:.2}, {:.2}", *calls as f64 / drained, usec / drained),
        );
    }
    info(
        "submission path without HTTP, 256 in flight (tasks/s)",
        n(drained / preload_secs),
    );
    row(
        "  round trips per submission",
        r(preload_trips / drained),
        "1",
        verdict(preload_trips / drained < 1.01),
    );
    info(
        &format!("API: {submits} keyed submissions, {in_flight} in flight (submissions/s)"),
        n(api_rate),
    );
    let per_submit = api_trips as f64 / submits as f64;
    row(
        "  round trips per submission (Store::round_trips)",
        r(per_submit),
        "1",
        verdict(per_submit < 1.01),
    );
    info(
        "  EVALSHA per submission (commandstats)",
        r(api_evalsha / submits as f64),
    );
    info(
        "  Redis read events per submission",
        r(api_reads / submits as f64),
    );
    info(
        "  Redis CPU per submission (µs)",
        format!("{:.1}", api_redis_cpu / submits as f64 * 1e6),
    );
    for (name, figures) in [("", &plain), (" -P 16", &piped)] {
        for test in ["SET", "GET"] {
            if let Some(ops) = figures.get(test) {
                info(
                    &format!("redis-benchmark -t {}{name} (ops/s)", test.to_lowercase()),
                    n(*ops),
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
        self.cpu_user() + self.cpu_sys()
    }

    /// CPU seconds the server has used in user space (all its threads).
    fn cpu_user(&self) -> f64 {
        self.seconds("used_cpu_user")
    }

    /// CPU seconds the kernel has used for the server (all its threads).
    fn cpu_sys(&self) -> f64 {
        self.seconds("used_cpu_sys")
    }

    fn seconds(&self, name: &str) -> f64 {
        self.0
            .get(name)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
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

/// CPU seconds this process has used so far (user + system), to the
/// microsecond: `getrusage` sums every thread's exact run time, where
/// `/proc/self/stat` rounds it to clock ticks (10 ms, a few percent of a
/// drain's CPU).
fn process_cpu() -> Result<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` through the pointer, which is
    // valid for it.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getrusage");
    }
    // SAFETY: getrusage succeeded, so it wrote the struct.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(secs(usage.ru_utime) + secs(usage.ru_stime))
}

/// `redis-benchmark -t <tests> -n <requests>` with 50 clients and `pipeline`
/// commands per round trip; ops/s by test name.
fn redis_benchmark(
    port: u16,
    tests: &str,
    requests: usize,
    pipeline: usize,
) -> Result<HashMap<String, f64>> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-t", tests, "-n", &requests.to_string(), "--csv"])
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

/// **Peer mode**, for `scripts/bench-peers`: with `DTQ_BENCH_REDIS_PORT` set,
/// only the drain rounds run, against the `redis-server` the script started
/// on that loopback port (and pinned; this mode pins nothing and leaves the
/// server running), and nothing else above does. The worker runs with the
/// fleet's defaults except `--concurrency` (`DTQ_BENCH_CONCURRENCY`, default
/// 256, as above): `dtq worker` with the examples as `--handlers` and the
/// tests' `--cache-dir`, and no other flag. Each round flushes the
/// server, then is measured as above, and printed as a table row and as one
/// `peer-result {json}` line for the script. With `DTQ_BENCH_STEP=1` it
/// prints `peer-ready` when the worker's handlers are loaded and then runs
/// one round per line read on stdin (until stdin ends), so that the script
/// can interleave its rounds with the other queues' in one process.
mod peers {
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail, ensure};
    use dtq_host::ingest;
    use dtq_host::server::{Roles, Server};
    use dtq_host::store::QueueKeys;
    use dtq_tests::echo_request;
    use futures::StreamExt;
    use redis::aio::MultiplexedConnection;
    use serde_json::json;

    use super::{
        QUEUE, ROUND_SETS, RedisStats, count_succeeded, env_usize, process_cpu, redis_benchmark,
    };

    /// The port of `DTQ_BENCH_REDIS_PORT`, if it is set.
    pub(super) fn port() -> Result<Option<u16>> {
        match std::env::var("DTQ_BENCH_REDIS_PORT") {
            Ok(v) => Ok(Some(v.parse().with_context(|| {
                format!("DTQ_BENCH_REDIS_PORT={v:?} is not a port")
            })?)),
            Err(_) => Ok(None),
        }
    }

    pub(super) fn main(port: u16) -> Result<()> {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(run(port))
    }

    async fn run(port: u16) -> Result<()> {
        let tasks = env_usize("DTQ_BENCH_TASKS", 20_000)?;
        let rounds = env_usize("DTQ_BENCH_ROUNDS", 5)?.max(1);
        let step = env_usize("DTQ_BENCH_STEP", 0)? != 0;
        let concurrency = env_usize("DTQ_BENCH_CONCURRENCY", 256)?;
        let url = format!("redis://127.0.0.1:{port}/");
        let mut probe = redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connect to the redis-server at {url}"))?;
        // The tests' artifact cache, so that the examples are compiled once.
        let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
        let concurrency_flag = concurrency.to_string();
        let config = dtq_host::Config::from_args([
            "--redis",
            url.as_str(),
            "--handlers",
            dtq_tests::guests::EXAMPLES_DIR,
            "--concurrency",
            &concurrency_flag,
            "--cache-dir",
            &cache.display().to_string(),
        ])?;
        let server = Server::prepare(config.clone(), Roles::WORKER).await?;
        let config_text = format!("1 worker, concurrency {concurrency}");
        println!("dtq queue benchmark, peer mode: {config_text}, on 127.0.0.1:{port}");
        println!(
            "{:>5} {:>10} {:>9} {:>10} {:>8} {:>15}",
            "round", "drain/s", "time (s)", "SET/s", "ratio", "Redis µs/task"
        );
        if step {
            println!("peer-ready");
        }
        for i in 1..=rounds {
            if step && !next_line().await? {
                break;
            }
            redis::cmd("FLUSHALL").query_async::<()>(&mut probe).await?;
            let r = round(&server, &config, &mut probe, port, tasks).await?;
            let rate = tasks as f64 / r.drain.as_secs_f64();
            let per_task = |x: f64| x / tasks as f64;
            let cpu_per_task = per_task(r.redis_cpu) * 1e6;
            println!(
                "{i:>5} {rate:>10.0} {:>9.2} {:>10.0} {:>8.3} {cpu_per_task:>15.1}",
                r.drain.as_secs_f64(),
                r.set,
                rate / r.set,
            );
            let line = json!({
                "system": "dtq",
                "name": "dtq",
                "version": env!("CARGO_PKG_VERSION"),
                "config": config_text,
                "procs": 1,
                "concurrency": concurrency,
                "round": i,
                "tasks": tasks,
                "fill_s": r.preload.as_secs_f64(),
                "drain_s": r.drain.as_secs_f64(),
                "rate": rate,
                "set": r.set,
                "redis_cpu_per_task_us": cpu_per_task,
                "redis_cpu_user_per_task_us": per_task(r.redis_cpu_user) * 1e6,
                "redis_cpu_sys_per_task_us": per_task(r.redis_cpu_sys) * 1e6,
                "redis_reads_per_task": per_task(r.redis_reads),
                "redis_commands_per_task": per_task(r.redis_commands),
                "client_cpu_per_task_us": per_task(r.worker_cpu) * 1e6,
                "redis_cpu_per_set_us": r.set_cpu / ROUND_SETS as f64 * 1e6,
            });
            println!("peer-result {line}");
        }
        Ok(())
    }

    /// Wait for a line on stdin; false at its end.
    async fn next_line() -> Result<bool> {
        tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            Ok(std::io::stdin().read_line(&mut line)? > 0)
        })
        .await?
    }

    struct PeerRound {
        preload: Duration,
        drain: Duration,
        /// Redis CPU seconds during the drain, and of it in user space
        /// and in the kernel.
        redis_cpu: f64,
        redis_cpu_user: f64,
        redis_cpu_sys: f64,
        /// Redis's read events (`total_reads_processed`) and commands
        /// (`total_commands_processed`, the scripts' included) during the
        /// drain, the probe's polls and INFO aside.
        redis_reads: f64,
        redis_commands: f64,
        /// This process's CPU seconds during the drain: the worker's, with
        /// the probe's polls.
        worker_cpu: f64,
        set: f64,
        /// Redis CPU seconds of redis-benchmark's SETs.
        set_cpu: f64,
    }

    /// One round, as `super::round` measures it: preload through the
    /// submission path, drain with one worker (the clock stops when the
    /// stream is empty and nothing is delayed), check every task
    /// SUCCEEDED, then SET.
    async fn round(
        server: &Server,
        config: &dtq_host::Config,
        probe: &mut MultiplexedConnection,
        port: u16,
        tasks: usize,
    ) -> Result<PeerRound> {
        let settings = config.ingest_settings();
        let store = server.store();
        let started = Instant::now();
        let ids: Vec<String> = futures::stream::iter(0..tasks)
            .map(|n| {
                let store = store.clone();
                let settings = settings.clone();
                async move {
                    let req = echo_request(json!({"n": n}));
                    let done =
                        ingest::submit(&store, &settings, QUEUE, None, req, |_| true).await?;
                    anyhow::Ok(done.task_id)
                }
            })
            .buffer_unordered(256)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let preload = started.elapsed();

        let keys = QueueKeys::new(QUEUE);
        let before = RedisStats::read(probe).await?;
        let cpu = process_cpu()?;
        let mut polls = 0u64;
        let stop = tokio_util::sync::CancellationToken::new();
        let started = Instant::now();
        let worker = server.with_roles(Roles::WORKER)?;
        let run = worker.serve(None, stop.clone().cancelled_owned());
        let handle = tokio::spawn(run);
        loop {
            let (len, delayed): (u64, u64) = redis::pipe()
                .xlen(&keys.stream)
                .zcard(&keys.delayed)
                .query_async(probe)
                .await?;
            polls += 1;
            if len == 0 && delayed == 0 {
                break;
            }
            if handle.is_finished() {
                bail!("the worker stopped with {len} tasks left");
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("the drain did not finish within 10 minutes ({len} left)");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let drain = started.elapsed();
        let worker_cpu = process_cpu()? - cpu;
        let after = RedisStats::read(probe).await?;
        let delta = |name: &str| after.get(name).saturating_sub(before.get(name)) as f64;
        // The probe's polls (one pipeline of two commands each) and an
        // INFO are not the worker's.
        let redis_reads = delta("total_reads_processed") - (polls + 1) as f64;
        let redis_commands = delta("total_commands_processed") - (2 * polls + 1) as f64;
        stop.cancel();
        handle.await??;
        let succeeded = count_succeeded(probe, &keys, &ids).await?;
        ensure!(
            succeeded == ids.len(),
            "only {succeeded} of {} tasks SUCCEEDED",
            ids.len()
        );

        let cpu = RedisStats::read(probe).await?.cpu();
        let set = redis_benchmark(port, "set", ROUND_SETS, 1)?
            .get("SET")
            .copied()
            .context("no SET figure")?;
        let set_cpu = RedisStats::read(probe).await?.cpu() - cpu;
        Ok(PeerRound {
            preload,
            drain,
            redis_cpu: after.cpu() - before.cpu(),
            redis_cpu_user: after.cpu_user() - before.cpu_user(),
            redis_cpu_sys: after.cpu_sys() - before.cpu_sys(),
            redis_reads,
            redis_commands,
            worker_cpu,
            set,
            set_cpu,
        })
    }
}
