//! Sandbox cost, measured with a plain timing loop (`cargo bench -p dtq-tests
//! --bench sandbox`):
//!
//! - instantiate + call + drop of the `echo` handler, median and p99, beside
//!   a native function doing the same work;
//! - calls per second with 1 and 2 concurrent callers;
//! - loading one module cold (compiling it) and cached (deserializing the
//!   artifact).
//!
//! It starts its own `redis-server` (the sandbox needs a connection even
//! though `echo` makes no host calls).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dtq_host::sandbox::{Call, CancelHandle, Outcome, Sandbox, SandboxConfig, TaskContext};
use dtq_tests::{RedisServer, TempDir, guests};

const WARMUP: usize = 500;
const SAMPLES: usize = 2000;
const THROUGHPUT_CALLS: usize = 4000;
const LOADS: usize = 20;
const PAYLOAD: &str = r#"{"order_id":"A-1","amount_cents":1999,"note":"benchmark"}"#;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

async fn bench() -> Result<()> {
    let redis = RedisServer::start()?;
    let echo = std::fs::read(guests::ECHO)?;
    println!(
        "sandbox benchmark (echo handler, {} byte payload)",
        PAYLOAD.len()
    );

    // --- start-up: cold (compile) vs cached (deserialize) -------------------
    let cache = TempDir::new("bench-artifacts")?;
    let config = || SandboxConfig {
        cache_dir: Some(cache.path.clone()),
        ..SandboxConfig::default()
    };
    let started = Instant::now();
    let sandbox = Sandbox::new(config(), redis.manager().await?)?;
    let engine_time = started.elapsed();
    let cold = sandbox.load("echo", &echo)?;
    if cold.from_cache {
        bail!("a fresh cache directory already held the artifact");
    }
    let mut cached = Vec::with_capacity(LOADS);
    for _ in 0..LOADS {
        // A new sandbox each time: a restarted worker with a warm disk cache.
        let fresh = Sandbox::new(config(), redis.manager().await?)?;
        let report = fresh.load("echo", &echo)?;
        if !report.from_cache {
            bail!("the second load did not come from the cache");
        }
        cached.push(report.load_time);
    }
    cached.sort();
    println!("engine + pool + linker setup: {}", ms(engine_time));
    println!(
        "cold start (compile {} KiB component):  {}",
        echo.len() / 1024,
        ms(cold.load_time)
    );
    println!(
        "cached start (deserialize artifact):    median {}, max {} over {LOADS} loads",
        ms(cached[LOADS / 2]),
        ms(cached[LOADS - 1])
    );

    // --- one call at a time ---------------------------------------------
    let cancel = CancelHandle::new();
    for _ in 0..WARMUP {
        check(sandbox.call(call(), &cancel).await)?;
    }
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let report = sandbox.call(call(), &cancel).await;
        samples.push(started.elapsed());
        check(report)?;
    }
    samples.sort();
    println!(
        "instantiate + call + drop (echo):       median {}, p99 {} over {SAMPLES} calls",
        us(samples[SAMPLES / 2]),
        us(samples[SAMPLES * 99 / 100])
    );

    let mut native = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let result = native_echo(black_box(&context()), black_box(PAYLOAD));
        native.push(started.elapsed());
        let _ = black_box(result);
    }
    native.sort();
    println!(
        "native baseline (same work, no sandbox): median {}, p99 {}",
        us(native[SAMPLES / 2]),
        us(native[SAMPLES * 99 / 100])
    );

    // --- throughput -------------------------------------------------------
    for concurrency in [1, 2] {
        let per_task = THROUGHPUT_CALLS / concurrency;
        let started = Instant::now();
        let tasks: Vec<_> = (0..concurrency)
            .map(|_| {
                let sandbox = sandbox.clone();
                tokio::spawn(async move {
                    let cancel = CancelHandle::new();
                    for _ in 0..per_task {
                        check(sandbox.call(call(), &cancel).await)?;
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        let elapsed = started.elapsed();
        println!(
            "throughput, {concurrency} concurrent caller(s):     {:.0} calls/s",
            (per_task * concurrency) as f64 / elapsed.as_secs_f64()
        );
    }
    Ok(())
}

fn context() -> TaskContext {
    TaskContext {
        task_id: "0190f3c8-0000-7000-8000-000000000000".to_string(),
        queue: "bench".to_string(),
        task_name: "echo".to_string(),
        attempt: 1,
        max_attempts: 3,
        idempotency_key: None,
    }
}

fn call() -> Call {
    Call {
        task: "echo".to_string(),
        ctx: context(),
        payload: PAYLOAD.to_string(),
        deadline: None,
    }
}

/// What the `echo` guest does, natively: take the context and the payload,
/// hand back an owned copy of the payload.
#[inline(never)]
fn native_echo(ctx: &TaskContext, payload: &str) -> Result<String, String> {
    black_box(ctx);
    Ok(payload.to_string())
}

fn check(report: dtq_host::sandbox::CallReport) -> Result<()> {
    match report.outcome {
        Outcome::Success(out) if out == PAYLOAD => Ok(()),
        other => bail!("echo failed: {other:?}\n{}", report.log),
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}
