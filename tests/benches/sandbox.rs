//! Sandbox cost, measured with a plain timing loop (`cargo bench -p dtq-tests
//! --bench sandbox`):
//!
//! - instantiate + call + drop of the `echo` handler, median and p99, beside
//!   a native function doing the same work; the same for `order_total`
//!   (parses and prices JSON) and `counter` (one Redis round trip through the
//!   `kv` import);
//! - the same `echo` call through bare wasmtime (the same engine, pool and
//!   compiled component, `InstancePre`, a new `Store` per call, no WASI
//!   context, host state, limits or deadline: `dtq_host::sandbox::baseline`),
//!   in rounds alternating with dtq's call, and dtq's cost as a ratio of it;
//! - a call that writes 64 KiB to 1 MiB of its heap, in sandboxes sized
//!   for 64 to 8 192 calls: what a handler pays that dirties more than its
//!   slot keeps resident between calls (the pool's share per slot falls as
//!   its slots grow);
//! - calls per second with 1 and 2 concurrent callers;
//! - loading a module cold (compiling it) and cached (deserializing the
//!   artifact), for the smallest and the largest guest.
//!
//! It starts its own `redis-server` for the `kv` calls.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dtq_host::sandbox::baseline::Baseline;
use dtq_host::sandbox::{
    Call, CallReport, CancelHandle, Outcome, Sandbox, SandboxConfig, TaskContext,
};
use dtq_tests::{RedisServer, TempDir, guests};

const WARMUP: usize = 500;
const SAMPLES: usize = 2000;
const THROUGHPUT_CALLS: usize = 10_000;
const LOADS: usize = 20;
const ECHO_PAYLOAD: &str = r#"{"order_id":"A-1","amount_cents":1999,"note":"benchmark"}"#;
const ORDER_PAYLOAD: &str = r#"{"lines":[{"sku":"TEA-1","quantity":3,"unit_price_cents":450,"tax_rate_bp":700},{"sku":"MUG-2","quantity":1,"unit_price_cents":1299}],"shipping_cents":500}"#;
const COUNTER_PAYLOAD: &str = r#"{"name":"bench"}"#;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

async fn bench() -> Result<()> {
    let redis = RedisServer::start()?;
    println!(
        "dtq sandbox benchmark ({} CPUs)",
        std::thread::available_parallelism()?
    );
    println!();

    // --- start-up: cold (compile) vs cached (deserialize) -------------------
    let cache = TempDir::new("bench-artifacts")?;
    let config = || SandboxConfig {
        cache_dir: Some(cache.path.clone()),
        ..SandboxConfig::default()
    };
    let started = Instant::now();
    let sandbox = Sandbox::new(config(), redis.manager().await?)?;
    println!(
        "engine + pool + linker setup:            {}",
        ms(started.elapsed())
    );
    println!(
        "pool slot reset between calls:           {}",
        sandbox.slot_reset().as_str()
    );
    for (task, path) in [
        ("echo", guests::ECHO),
        ("order_total", guests::ORDER_TOTAL),
        ("counter", guests::COUNTER),
        ("adversarial", guests::ADVERSARIAL),
    ] {
        let wasm = std::fs::read(path)?;
        let cold = sandbox.load(task, &wasm)?;
        if cold.from_cache {
            bail!("a fresh cache directory already held the artifact of {task}");
        }
        if task == "counter" {
            continue;
        }
        let mut cached = Vec::with_capacity(LOADS);
        for _ in 0..LOADS {
            // A new sandbox each time: a restarted worker with a warm cache.
            let fresh = Sandbox::new(config(), redis.manager().await?)?;
            let report = fresh.load(task, &wasm)?;
            if !report.from_cache {
                bail!("the second load of {task} did not come from the cache");
            }
            cached.push(report.load_time);
        }
        cached.sort();
        println!(
            "{task} ({} KiB): cold start (compile) {}, cached start (deserialize) median {}, max {}",
            wasm.len() / 1024,
            ms(cold.load_time),
            ms(cached[LOADS / 2]),
            ms(cached[LOADS - 1]),
        );
    }
    println!();

    // --- one call at a time ---------------------------------------------
    let echo = latency(&sandbox, "echo", ECHO_PAYLOAD).await?;
    println!(
        "instantiate + call + drop, echo:         median {}, p99 {} over {SAMPLES} calls",
        us(echo.0),
        us(echo.1)
    );
    let mut native = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let result = native_echo(black_box(&context("echo")), black_box(ECHO_PAYLOAD));
        native.push(started.elapsed());
        let _ = black_box(result);
    }
    native.sort();
    println!(
        "native baseline (same work, no sandbox): median {}, p99 {}",
        us(native[SAMPLES / 2]),
        us(native[SAMPLES * 99 / 100])
    );
    let bare = Baseline::new(&sandbox, &std::fs::read(guests::ECHO)?)?;
    let (dtq_calls, bare_calls) = {
        let (sandbox, bare) = (sandbox.clone(), std::sync::Arc::new(bare));
        tokio::spawn(async move { against_bare(&sandbox, &bare).await }).await??
    };
    println!(
        "echo, dtq beside bare wasmtime, {BARE_ROUNDS} alternating rounds of {} calls each:",
        SAMPLES / BARE_ROUNDS
    );
    println!(
        "  dtq  median {}, p99 {}; bare median {}, p99 {}; dtq ÷ bare: {:.2}× median, {:.2}× p99",
        us(dtq_calls.0),
        us(dtq_calls.1),
        us(bare_calls.0),
        us(bare_calls.1),
        dtq_calls.0.as_secs_f64() / bare_calls.0.as_secs_f64(),
        dtq_calls.1.as_secs_f64() / bare_calls.1.as_secs_f64(),
    );
    let order = latency(&sandbox, "order_total", ORDER_PAYLOAD).await?;
    println!(
        "instantiate + call + drop, order_total:  median {}, p99 {} (parses and prices JSON)",
        us(order.0),
        us(order.1)
    );
    let counter = latency(&sandbox, "counter", COUNTER_PAYLOAD).await?;
    println!(
        "instantiate + call + drop, counter:      median {}, p99 {} (one Redis INCRBY)",
        us(counter.0),
        us(counter.1)
    );
    println!();

    // --- calls that dirty more than their slot keeps ----------------------
    dirtying(&redis, &cache).await?;
    println!();

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
                        check(&sandbox.call(call("echo", ECHO_PAYLOAD), &cancel).await)?;
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
            "throughput, echo, {concurrency} concurrent caller(s):  {:.0} calls/s",
            (per_task * concurrency) as f64 / elapsed.as_secs_f64()
        );
    }
    Ok(())
}

/// Calls in flight a sandbox is sized for, and how much of its heap each
/// call writes, for [`dirtying`].
const DIRTYING_SLOTS: [u32; 4] = [64, 256, 1_024, 8_192];
const DIRTYING_KIB: [usize; 3] = [64, 256, 1_024];

/// What a call that writes more memory than its slot keeps resident
/// between calls pays: `waiter` with no wait, writing `touch_kib` of its
/// heap, one call at a time in a sandbox of each size of
/// [`DIRTYING_SLOTS`]. A slot keeps up to 1 MiB of a call's dirty pages
/// resident (restored with `memcpy`), less past 256 calls (a share of one
/// budget for all, which itself falls past 1,024 calls); what the next
/// call writes beyond that share it takes again from the kernel, a page
/// fault a page.
async fn dirtying(redis: &RedisServer, cache: &TempDir) -> Result<()> {
    println!("waiter writing N KiB of heap, one call at a time, median (p99) per call:");
    let header: Vec<String> = DIRTYING_KIB
        .iter()
        .map(|kib| format!("{:>22}", format!("{kib} KiB")))
        .collect();
    println!("  {:>6}  {}", "slots", header.join("  "));
    let wasm = std::fs::read(guests::WAITER)?;
    for slots in DIRTYING_SLOTS {
        let sandbox = Sandbox::new(
            SandboxConfig {
                cache_dir: Some(cache.path.clone()),
                max_concurrent_calls: slots,
                ..SandboxConfig::default()
            },
            redis.manager().await?,
        )?;
        sandbox.load("waiter", &wasm)?;
        let mut row = Vec::with_capacity(DIRTYING_KIB.len());
        for kib in DIRTYING_KIB {
            let payload = format!(r#"{{"ms":0,"touch_kib":{kib}}}"#);
            let (median, p99) = latency(&sandbox, "waiter", &payload).await?;
            row.push(format!("{:>22}", format!("{} ({})", us(median), us(p99))));
        }
        println!("  {slots:>6}  {}", row.join("  "));
    }
    Ok(())
}

/// Rounds of [`against_bare`]: dtq's calls and bare wasmtime's alternate
/// by rounds, so both see the same machine.
const BARE_ROUNDS: usize = 10;

/// Median and p99 of `echo` through dtq and through bare wasmtime, each
/// after a warm-up, measured in alternating rounds.
async fn against_bare(
    sandbox: &Sandbox,
    bare: &Baseline,
) -> Result<((Duration, Duration), (Duration, Duration))> {
    let cancel = CancelHandle::new();
    for _ in 0..WARMUP {
        check(&sandbox.call(call("echo", ECHO_PAYLOAD), &cancel).await)?;
        bare_echo(bare).await?;
    }
    let (mut dtq, mut plain) = (Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES));
    for _ in 0..BARE_ROUNDS {
        for _ in 0..SAMPLES / BARE_ROUNDS {
            let request = call("echo", ECHO_PAYLOAD);
            let started = Instant::now();
            let report = sandbox.call(request, &cancel).await;
            dtq.push(started.elapsed());
            check(&report)?;
        }
        for _ in 0..SAMPLES / BARE_ROUNDS {
            let started = Instant::now();
            bare_echo(bare).await?;
            plain.push(started.elapsed());
        }
    }
    dtq.sort();
    plain.sort();
    let at = |v: &[Duration], per_mille: usize| v[v.len() * per_mille / 1000];
    Ok((
        (at(&dtq, 500), at(&dtq, 990)),
        (at(&plain, 500), at(&plain, 990)),
    ))
}

/// One bare `echo` call, which must echo.
async fn bare_echo(bare: &Baseline) -> Result<()> {
    match bare.call(black_box(ECHO_PAYLOAD)).await? {
        Ok(out) if out.contains("A-1") => Ok(()),
        other => bail!("bare echo answered {other:?}"),
    }
}

/// Median and p99 of instantiate + call + drop of `task`, after a warm-up.
///
/// Measured in a spawned task, on a runtime worker thread, as the worker's
/// executor runs calls.
async fn latency(sandbox: &Sandbox, task: &str, payload: &str) -> Result<(Duration, Duration)> {
    let (sandbox, task, payload) = (sandbox.clone(), task.to_string(), payload.to_string());
    tokio::spawn(async move { latency_here(&sandbox, &task, &payload).await }).await?
}

async fn latency_here(
    sandbox: &Sandbox,
    task: &str,
    payload: &str,
) -> Result<(Duration, Duration)> {
    let cancel = CancelHandle::new();
    for _ in 0..WARMUP {
        check(&sandbox.call(call(task, payload), &cancel).await)?;
    }
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let request = call(task, payload);
        let started = Instant::now();
        let report = sandbox.call(request, &cancel).await;
        samples.push(started.elapsed());
        check(&report)?;
    }
    samples.sort();
    Ok((samples[SAMPLES / 2], samples[SAMPLES * 99 / 100]))
}

fn context(task: &str) -> TaskContext {
    TaskContext {
        task_id: "0190f3c8-0000-7000-8000-000000000000".to_string(),
        queue: "bench".to_string(),
        task_name: task.to_string(),
        attempt: 1,
        max_attempts: 3,
        idempotency_key: None,
    }
}

fn call(task: &str, payload: &str) -> Call {
    Call {
        task: task.to_string(),
        ctx: context(task),
        payload: payload.to_string(),
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

fn check(report: &CallReport) -> Result<()> {
    match &report.outcome {
        Outcome::Success(_) => Ok(()),
        other => bail!("call failed: {other:?}\n{}", report.log),
    }
}

fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}
