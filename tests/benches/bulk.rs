//! Bulk submission beside single submissions, on one private redis-server,
//! in one run (`cargo bench -p dtq-tests --bench bulk`).
//!
//! Every figure submits `DTQ_BENCH_SUBMITS` (default 10 000) `echo` tasks,
//! each with its own idempotency key, to a queue of its own (its keys are
//! deleted after it), with no worker running:
//!
//! - **HTTP API**, an in-process `dtq` API on loopback, as clients use it:
//!   single submissions one at a time, then `DTQ_BENCH_IN_FLIGHT` (default
//!   64) at a time; batches (`POST .../tasks/batch`) of 100 and of 1000,
//!   one at a time, and of 100 with 4 in flight;
//! - **submission path without HTTP** (`ingest::submit`,
//!   `ingest::submit_batch` on the API's store): the same shapes, to show
//!   what the HTTP layer costs;
//! - **redis-benchmark** `EVAL "return 1" 0` (50 clients, plain and with
//!   `-P 16`) on the same server: what Redis does with a trivial script
//!   call per request, the ceiling a script per task is measured against.
//!
//! Each figure shows tasks/s, its ratio to single sequential HTTP
//! submissions, round trips per task ([`Store::round_trips`]) and Redis's
//! CPU per task (`INFO cpu`). Everything shares the machine's cores: the
//! figures are for comparing with each other, not absolute.
//!
//! [`Store::round_trips`]: dtq_host::store::Store::round_trips

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use dtq_host::ingest::{self, IngestSettings, SubmitRequest};
use dtq_tests::{Dtq, env_usize};
use futures::StreamExt;
use redis::aio::MultiplexedConnection;
use serde_json::{Value, json};

/// The allocator the `dtq` binary uses.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

/// How one figure submits its tasks.
#[derive(Clone, Copy)]
enum Shape {
    /// Single submissions, this many in flight.
    Single(usize),
    /// Batches of `size`, `in_flight` at a time.
    Batch { size: usize, in_flight: usize },
}

impl Shape {
    fn describe(self) -> String {
        match self {
            Shape::Single(1) => "single, one at a time".into(),
            Shape::Single(n) => format!("single, {n} in flight"),
            Shape::Batch { size, in_flight: 1 } => format!("batches of {size}, one at a time"),
            Shape::Batch { size, in_flight } => {
                format!("batches of {size}, {in_flight} in flight")
            }
        }
    }
}

/// One figure's measurements.
struct Figure {
    name: String,
    rate: f64,
    trips_per_task: f64,
    redis_cpu_us: f64,
}

/// What the figures run against.
struct Bench {
    dtq: Dtq,
    http: reqwest::Client,
    settings: IngestSettings,
    probe: MultiplexedConnection,
    submits: usize,
    run: String,
}

impl Bench {
    /// Submit `self.submits` keyed tasks to a queue of their own in `shape`,
    /// through HTTP or not; check every one was accepted as new.
    async fn figure(&mut self, label: &str, shape: Shape, via_http: bool) -> Result<Figure> {
        let queue = format!("bulk-{label}");
        let items: Vec<Value> = (0..self.submits)
            .map(|n| {
                json!({
                    "task": "echo",
                    "payload": {"n": n},
                    "idempotency_key": format!("{}-{label}-{n}", self.run),
                })
            })
            .collect();
        // The queue's first submission also registers it; not counted.
        self.submit_one(&queue, json!({"task": "echo"})).await?;
        let cpu = redis_cpu(&mut self.probe).await?;
        let trips = self.dtq.store.round_trips();
        let started = Instant::now();
        let accepted = match (shape, via_http) {
            (Shape::Single(in_flight), true) => {
                let url = format!("{}/v1/queues/{queue}/tasks", self.dtq.api);
                let http = &self.http;
                futures::stream::iter(items)
                    .map(|item| {
                        let req = http.post(&url).json(&item);
                        async move { anyhow::Ok(req.send().await?.status() == 202) }
                    })
                    .buffer_unordered(in_flight)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .collect::<Result<Vec<bool>>>()?
                    .into_iter()
                    .filter(|ok| *ok)
                    .count()
            }
            (Shape::Batch { size, in_flight }, true) => {
                let url = format!("{}/v1/queues/{queue}/tasks/batch", self.dtq.api);
                let http = &self.http;
                futures::stream::iter(items.chunks(size))
                    .map(|chunk| {
                        let req = http.post(&url).json(&json!({ "tasks": chunk }));
                        async move {
                            let answer: Value = req.send().await?.json().await?;
                            let results = answer["results"].as_array().context("no results")?;
                            anyhow::Ok(results.iter().filter(|r| r["status"] == 202).count())
                        }
                    })
                    .buffer_unordered(in_flight)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .sum::<Result<usize>>()?
            }
            (Shape::Single(in_flight), false) => {
                let (store, settings, queue) = (&self.dtq.store, &self.settings, &queue);
                futures::stream::iter(items)
                    .map(|item| async move {
                        let req = request(item)?;
                        ingest::submit(store, settings, queue, None, req, |_| true).await?;
                        anyhow::Ok(1)
                    })
                    .buffer_unordered(in_flight)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .sum::<Result<usize>>()?
            }
            (Shape::Batch { size, in_flight }, false) => {
                let (store, settings, queue) = (&self.dtq.store, &self.settings, &queue);
                futures::stream::iter(items.chunks(size))
                    .map(|chunk| async move {
                        let reqs = chunk
                            .iter()
                            .cloned()
                            .map(ingest::parse_submit_value)
                            .collect();
                        let outcomes =
                            ingest::submit_batch(store, settings, queue, reqs, |_| true).await?;
                        anyhow::Ok(outcomes.iter().filter(|o| o.is_ok()).count())
                    })
                    .buffer_unordered(in_flight)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .sum::<Result<usize>>()?
            }
        };
        let elapsed = started.elapsed().as_secs_f64();
        let trips = self.dtq.store.round_trips() - trips;
        let cpu = redis_cpu(&mut self.probe).await? - cpu;
        ensure!(
            accepted == self.submits,
            "{label}: {accepted} of {} submissions accepted",
            self.submits
        );
        delete_queue(&mut self.probe, &queue).await?;
        let n = self.submits as f64;
        let via = if via_http { "HTTP" } else { "no HTTP" };
        Ok(Figure {
            name: format!("{via}: {}", shape.describe()),
            rate: n / elapsed,
            trips_per_task: trips as f64 / n,
            redis_cpu_us: cpu / n * 1e6,
        })
    }

    async fn submit_one(&self, queue: &str, body: Value) -> Result<()> {
        let url = format!("{}/v1/queues/{queue}/tasks", self.dtq.api);
        let status = self.http.post(&url).json(&body).send().await?.status();
        ensure!(status == 202, "warm-up submission: {status}");
        Ok(())
    }
}

/// A submission body as the submission path takes it.
fn request(item: Value) -> Result<SubmitRequest> {
    Ok(ingest::parse_submit_value(item)?)
}

async fn bench() -> Result<()> {
    let submits = env_usize("DTQ_BENCH_SUBMITS", 10_000)?;
    let in_flight = env_usize("DTQ_BENCH_IN_FLIGHT", 64)?;
    ensure!(submits > 0 && in_flight > 0, "counts must be at least 1");
    let dtq = Dtq::start(false, &["--max-queue-depth", "0"]).await?;
    let mut probe = dtq.redis.single().conn().await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut probe)
        .await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "dtq bulk submission benchmark: redis-server {version} on 127.0.0.1:{}, {cores} cores shared by Redis, the API, the clients and redis-benchmark",
        dtq.redis.single().port()
    );
    println!("{submits} keyed echo tasks per figure, no worker");
    let mut bench = Bench {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(in_flight)
            .build()?,
        settings: dtq.config.ingest_settings(),
        dtq,
        probe,
        submits,
        run: uuid::Uuid::now_v7().simple().to_string(),
    };

    let shapes = [
        ("s1", Shape::Single(1)),
        ("sn", Shape::Single(in_flight)),
        (
            "b100",
            Shape::Batch {
                size: 100,
                in_flight: 1,
            },
        ),
        (
            "b1000",
            Shape::Batch {
                size: 1000,
                in_flight: 1,
            },
        ),
        (
            "b100x4",
            Shape::Batch {
                size: 100,
                in_flight: 4,
            },
        ),
    ];
    let mut figures = Vec::new();
    for via_http in [true, false] {
        for (label, shape) in shapes {
            let label = format!("{label}-{}", if via_http { "http" } else { "path" });
            figures.push(bench.figure(&label, shape, via_http).await?);
        }
    }

    let port = bench.dtq.redis.single().port();
    let plain = redis_benchmark_eval(port, 100_000, 1)?;
    let piped = redis_benchmark_eval(port, 200_000, 16)?;

    let base = figures[0].rate;
    println!();
    println!(
        "{:<44} {:>10} {:>10} {:>12} {:>14}",
        "figure", "tasks/s", "× single", "trips/task", "Redis µs/task"
    );
    for f in &figures {
        println!(
            "{:<44} {:>10.0} {:>10.2} {:>12.3} {:>14.1}",
            f.name,
            f.rate,
            f.rate / base,
            f.trips_per_task,
            f.redis_cpu_us
        );
    }
    println!();
    println!(
        "{:<44} {:>10}",
        "redis-benchmark EVAL \"return 1\" 0", "ops/s"
    );
    println!("{:<44} {:>10.0}", "  50 clients", plain);
    println!("{:<44} {:>10.0}", "  50 clients, -P 16", piped);
    println!();
    let best = figures
        .iter()
        .take(shapes.len())
        .max_by(|a, b| a.rate.total_cmp(&b.rate))
        .context("no figures")?;
    println!(
        "best HTTP figure ({}) ÷ EVAL -P 16: {:.3}; ÷ EVAL plain: {:.3}",
        best.name,
        best.rate / piped,
        best.rate / plain
    );
    println!(
        "HTTP single, {in_flight} in flight ÷ EVAL plain: {:.3}",
        figures[1].rate / plain
    );
    Ok(())
}

/// Redis's CPU time so far (user + system), seconds.
async fn redis_cpu(conn: &mut MultiplexedConnection) -> Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| -> Result<f64> {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .with_context(|| format!("INFO cpu has no {name}"))?
            .trim()
            .parse()
            .with_context(|| format!("INFO cpu {name}"))
    };
    Ok(field("used_cpu_user")? + field("used_cpu_sys")?)
}

/// Delete every key of `queue` (its hash tag), so that figures do not
/// pile up in the server's memory.
async fn delete_queue(conn: &mut MultiplexedConnection, queue: &str) -> Result<()> {
    let pattern = format!("*{{{queue}}}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<()>(conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// `redis-benchmark EVAL "return 1" 0` with 50 clients and `pipeline`
/// commands per round trip: requests/s.
fn redis_benchmark_eval(port: u16, requests: usize, pipeline: usize) -> Result<f64> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-n", &requests.to_string(), "-P", &pipeline.to_string()])
        .args(["--csv", "EVAL", "return 1", "0"])
        .output()
        .context("cannot run redis-benchmark (Debian: apt-get install redis-tools)")?;
    ensure!(
        out.status.success(),
        "redis-benchmark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .nth(1)
        .with_context(|| format!("redis-benchmark printed no figure: {text}"))?;
    let rps = line
        .split(',')
        .nth(1)
        .map(|c| c.trim_matches('"'))
        .with_context(|| format!("unexpected redis-benchmark line: {line}"))?;
    Ok(rps.parse()?)
}
