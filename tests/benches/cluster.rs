//! One Redis against a three-primary Redis Cluster, in one run
//! (`cargo bench -p dtq-tests --bench cluster`):
//!
//! - **single**: `DTQ_BENCH_TASKS` (default 20 000) `echo` tasks submitted
//!   to one queue through the submission path, then drained by one
//!   in-process worker (concurrency `DTQ_BENCH_CONCURRENCY`, default 256);
//! - **cluster**: the same number of tasks spread over three queues, one
//!   on each primary's slots, submitted and drained the same way by one
//!   worker that consumes the three;
//! - **partitioned**: the same number of tasks to one queue of three
//!   partitions, one on each primary (unkeyed: round-robin), submitted and
//!   drained the same way.
//!
//! For each: submissions/s, drain tasks/s, and each Redis node's CPU time
//! per task it served (from `INFO cpu`). Every node here shares this
//! machine's cores with the others and with the worker, so the raw rates
//! say little about a cluster on its own machines; the per-shard CPU does:
//! a shard that spends `c` µs of CPU per task can serve `1e6 / c` tasks/s
//! with a core of its own, and the fleet's ceiling is the sum over the
//! shards (queues spread evenly). The table prints that projection.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::ingest;
use dtq_host::store::{QueueKeys, partition_of_id, partition_queue};
use dtq_tests::cluster::RedisCluster;
use dtq_tests::{Dtq, RedisServer, TestRedis, echo_request, env_usize};
use futures::StreamExt;
use serde_json::json;

/// The allocator the `dtq` binary uses.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let tasks = env_usize("DTQ_BENCH_TASKS", 20_000)?;
    let concurrency = env_usize("DTQ_BENCH_CONCURRENCY", 256)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let single = {
                let redis = RedisServer::start()?;
                let shards = vec![("default".to_owned(), redis.port())];
                run(
                    "single",
                    TestRedis::Single(redis),
                    &["default".to_owned()],
                    1,
                    &shards,
                    tasks,
                    concurrency,
                )
                .await?
            };
            let cluster = {
                let cluster = RedisCluster::start(3, 0)?;
                let queues = cluster.queues_on_distinct_shards(3)?;
                let shards = shards_of(&cluster, &queues)?;
                run(
                    "cluster (3 primaries)",
                    TestRedis::Cluster(cluster),
                    &queues,
                    1,
                    &shards,
                    tasks,
                    concurrency,
                )
                .await?
            };
            let partitioned = {
                let cluster = RedisCluster::start(3, 0)?;
                let queue = cluster.queue_spanning_shards(3)?;
                let names: Vec<String> = (0..3).map(|i| partition_queue(&queue, i)).collect();
                let shards = shards_of(&cluster, &names)?;
                run(
                    "one queue, 3 partitions",
                    TestRedis::Cluster(cluster),
                    &[queue],
                    3,
                    &shards,
                    tasks,
                    concurrency,
                )
                .await?
            };
            print_table(&[single, cluster, partitioned]);
            Ok(())
        })
}

/// Each key set of `names` with the port of the primary that serves it.
fn shards_of(cluster: &RedisCluster, names: &[String]) -> Result<Vec<(String, u16)>> {
    names
        .iter()
        .map(|name| {
            Ok((
                name.clone(),
                cluster.master_of(&format!("dtq:stream:{{{name}}}"))?,
            ))
        })
        .collect()
}

/// One setup's figures.
struct Run {
    name: &'static str,
    tasks: usize,
    submit: Duration,
    drain: Duration,
    /// Per node: tasks it served, and its CPU seconds for the submissions
    /// and for the drain.
    shards: Vec<(usize, f64, f64)>,
}

/// Submit `tasks` echo tasks round-robin over `queues`, each of
/// `partitions` partitions, drain them with one worker, and read the CPU
/// of each node of `shards` (every key set of the queues, with the port of
/// the node that serves it) before and after.
async fn run(
    name: &'static str,
    redis: TestRedis,
    queues: &[String],
    partitions: u32,
    shards: &[(String, u16)],
    tasks: usize,
    concurrency: usize,
) -> Result<Run> {
    let concurrency = concurrency.to_string();
    let mut dtq = Dtq::start_on(
        redis,
        false,
        &[
            "--queues",
            &queues.join(","),
            "--concurrency",
            &concurrency,
            "--max-queue-depth",
            "0",
        ],
    )
    .await?;
    let settings = dtq.config.ingest_settings();
    for queue in queues {
        dtq.store
            .raise_partitions(queue, partitions, dtq_host::base::now_ms())
            .await?;
    }
    let ports: Vec<u16> = shards.iter().map(|(_, port)| *port).collect();
    let ports = &ports[..];

    let cpu0 = node_cpus(ports)?;
    let started = Instant::now();
    let submitted: Vec<Result<String>> = futures::stream::iter(0..tasks)
        .map(|n| {
            let store = dtq.store.clone();
            let settings = settings.clone();
            let queue = queues[n % queues.len()].clone();
            async move {
                let req = echo_request(json!({"n": n}));
                let done = ingest::submit(&store, &settings, &queue, None, req, |_| true).await?;
                anyhow::Ok(partition_queue(&queue, partition_of_id(&done.task_id)))
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let submit = started.elapsed();
    let cpu1 = node_cpus(ports)?;
    let mut served = vec![0usize; shards.len()];
    for key_set in submitted {
        let key_set = key_set?;
        let at = shards
            .iter()
            .position(|(name, _)| *name == key_set)
            .with_context(|| format!("{name}: a task went to {key_set}, no shard of the run"))?;
        served[at] += 1;
    }

    let mut probe = dtq.redis.conn().await?;
    let started = Instant::now();
    dtq.start_worker();
    loop {
        let mut left = 0u64;
        for (key_set, _) in shards {
            let keys = QueueKeys::new(key_set);
            let (len, delayed): (u64, u64) = redis::pipe()
                .xlen(&keys.stream)
                .zcard(&keys.delayed)
                .query_async(&mut probe)
                .await?;
            left += len + delayed;
        }
        if left == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("{name}: the drain did not finish within 10 minutes ({left} left)");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drain = started.elapsed();
    let cpu2 = node_cpus(ports)?;
    dtq.stop_worker().await?;

    for queue in queues {
        let stats = dtq.store.stats(queue).await?;
        ensure!(
            stats.dead_lettered == 0 && stats.partitions == partitions,
            "{name}: {queue}: {stats:?}"
        );
    }
    Ok(Run {
        name,
        tasks,
        submit,
        drain,
        shards: (0..shards.len())
            .map(|i| (served[i], cpu1[i] - cpu0[i], cpu2[i] - cpu1[i]))
            .collect(),
    })
}

/// CPU seconds (user + system) each node on `ports` has used.
fn node_cpus(ports: &[u16]) -> Result<Vec<f64>> {
    ports
        .iter()
        .map(|port| {
            let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
            let mut conn = client.get_connection()?;
            let info: String = redis::cmd("INFO").arg("cpu").query(&mut conn)?;
            Ok(info
                .lines()
                .filter_map(|l| l.split_once(':'))
                .filter(|(k, _)| matches!(*k, "used_cpu_user" | "used_cpu_sys"))
                .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
                .sum())
        })
        .collect()
}

fn print_table(runs: &[Run]) {
    println!();
    println!(
        "| setup | tasks | submit/s | drain/s | shard | tasks on it | Redis CPU µs/submit | Redis CPU µs/drained task | drain/s with a core per shard |"
    );
    println!("|---|---:|---:|---:|---|---:|---:|---:|---:|");
    for run in runs {
        let mut ceiling = 0.0;
        for (i, (served, submit_cpu, drain_cpu)) in run.shards.iter().enumerate() {
            let per_submit = submit_cpu * 1e6 / *served as f64;
            let per_task = drain_cpu * 1e6 / *served as f64;
            let one_core = 1e6 / per_task;
            ceiling += one_core;
            let (setup, tasks, submit, drain) = if i == 0 {
                (
                    run.name.to_owned(),
                    run.tasks.to_string(),
                    format!("{:.0}", run.tasks as f64 / run.submit.as_secs_f64()),
                    format!("{:.0}", run.tasks as f64 / run.drain.as_secs_f64()),
                )
            } else {
                Default::default()
            };
            println!(
                "| {setup} | {tasks} | {submit} | {drain} | {i} | {served} | {per_submit:.1} | {per_task:.1} | {one_core:.0} |"
            );
        }
        println!("| {} | | | | all | | | | **{ceiling:.0}** |", run.name);
    }
    println!();
    println!(
        "Every node shares this machine's cores with the others and with the worker; \
         the last column is what each shard's CPU per task allows with a core of its \
         own, and its sum what the fleet's Redis could drain with queues spread evenly."
    );
}
