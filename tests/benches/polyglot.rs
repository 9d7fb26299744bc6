//! The cost of a handler in each language, side by side, in one run
//! (`cargo bench -p dtq-tests --bench polyglot`): the `echo` example built
//! from Rust, Python (componentize-py) and JavaScript (componentize-js).
//!
//! For each, it prints:
//!
//! - the component's size;
//! - the first load: compiling it (an empty artifact cache);
//! - a cached load: a new sandbox (a restarted worker) deserializing the
//!   artifact the first load stored;
//! - a call (fresh instance from the pool, call, drop), median and p99;
//! - memory: the linear memory every instance starts with (declared by the
//!   component, mapped copy-on-write from the module image, so only the
//!   pages a call touches become resident), and the resident memory one live
//!   call adds to the process (RSS growth while several `sleep` calls of the
//!   language's `adversarial` guest run at once, divided by their number).
//!
//! Figures are printed, not asserted. It starts its own `redis-server`.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use dtq_host::sandbox::{Call, CancelHandle, Outcome, Sandbox, SandboxConfig, TaskContext};
use dtq_tests::polyglot::{LANGS, Lang, example_wasm, test_guest_wasm};
use dtq_tests::{RedisServer, TempDir};

const WARMUP: usize = 50;
const SAMPLES: usize = 500;
/// Calls alive at once while resident memory is sampled.
const LIVE_CALLS: usize = 4;
const LIVE_MS: u64 = 400;
const ECHO_PAYLOAD: &str = r#"{"order_id":"A-1","amount_cents":1999,"note":"benchmark"}"#;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

/// One language's figures.
struct Row {
    lang: Lang,
    size: usize,
    compile: Duration,
    cached_load: Duration,
    call_p50: Duration,
    call_p99: Duration,
    initial_memory: u64,
    resident_per_call: Option<u64>,
}

async fn bench() -> Result<()> {
    let redis = RedisServer::start()?;
    println!(
        "dtq polyglot benchmark: the echo handler in each language ({} CPUs, default limits)",
        std::thread::available_parallelism()?
    );
    // Build everything first, so that no build runs beside a measurement.
    for &lang in LANGS {
        example_wasm(lang, "echo").with_context(|| format!("build {lang} echo"))?;
        test_guest_wasm(lang, "adversarial").with_context(|| format!("build {lang} guest"))?;
    }
    let mut rows = Vec::new();
    for &lang in LANGS {
        rows.push(measure(&redis, lang).await?);
    }
    println!();
    println!(
        "{:<8} {:>10} {:>12} {:>12} {:>12} {:>12} {:>14} {:>14}",
        "lang",
        "size",
        "compile",
        "cached load",
        "call p50",
        "call p99",
        "initial mem",
        "RSS/live call"
    );
    for row in &rows {
        println!(
            "{:<8} {:>10} {:>12} {:>12} {:>12} {:>12} {:>14} {:>14}",
            row.lang.to_string(),
            mib(row.size as u64),
            ms(row.compile),
            ms(row.cached_load),
            us(row.call_p50),
            us(row.call_p99),
            mib(row.initial_memory),
            row.resident_per_call.map_or_else(|| "n/a".into(), mib),
        );
    }
    Ok(())
}

async fn measure(redis: &RedisServer, lang: Lang) -> Result<Row> {
    let echo = example_wasm(lang, "echo")?;
    let cache = TempDir::new("polyglot-artifacts")?;
    let config = || SandboxConfig {
        cache_dir: Some(cache.path.clone()),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config(), redis.manager().await?)?;
    let first = sandbox.load("echo", &echo)?;
    if first.from_cache {
        bail!("a fresh cache directory already held the {lang} echo artifact");
    }
    let restarted = Sandbox::new(config(), redis.manager().await?)?;
    let cached = restarted.load("echo", &echo)?;
    if !cached.from_cache {
        bail!("the {lang} echo artifact was not cached");
    }
    let (call_p50, call_p99) = latency(&restarted, "echo").await?;
    let resident_per_call = resident_per_live_call(&restarted, lang).await?;
    Ok(Row {
        lang,
        size: echo.len(),
        compile: first.compile_time.unwrap_or(first.load_time),
        cached_load: cached.load_time,
        call_p50,
        call_p99,
        initial_memory: initial_linear_memory(&echo),
        resident_per_call,
    })
}

/// Median and p99 of instantiate + call + drop, on a runtime worker thread
/// as the worker's executor runs calls.
async fn latency(sandbox: &Sandbox, task: &str) -> Result<(Duration, Duration)> {
    let (sandbox, task) = (sandbox.clone(), task.to_string());
    tokio::spawn(async move {
        let cancel = CancelHandle::new();
        for _ in 0..WARMUP {
            check(&sandbox.call(call(&task, ECHO_PAYLOAD), &cancel).await)?;
        }
        let mut samples = Vec::with_capacity(SAMPLES);
        for _ in 0..SAMPLES {
            let request = call(&task, ECHO_PAYLOAD);
            let started = Instant::now();
            let report = sandbox.call(request, &cancel).await;
            samples.push(started.elapsed());
            check(&report)?;
        }
        samples.sort();
        Ok((samples[SAMPLES / 2], samples[SAMPLES * 99 / 100]))
    })
    .await?
}

/// RSS growth while [`LIVE_CALLS`] calls spin at once, per call: what a
/// live call of this language holds beyond the shared compiled code.
async fn resident_per_live_call(sandbox: &Sandbox, lang: Lang) -> Result<Option<u64>> {
    let Some(before) = rss_bytes() else {
        return Ok(None);
    };
    sandbox.load("adversarial", &test_guest_wasm(lang, "adversarial")?)?;
    // Settle after the load, then sample the peak while the calls run.
    let base = rss_bytes().unwrap_or(before);
    let peak = Arc::new(AtomicU64::new(base));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(rss) = rss_bytes() {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let payload = format!(r#"{{"op": "sleep", "ms": {LIVE_MS}}}"#);
    let calls: Vec<_> = (0..LIVE_CALLS)
        .map(|_| {
            let (sandbox, payload) = (sandbox.clone(), payload.clone());
            tokio::spawn(async move {
                sandbox
                    .call(call("adversarial", &payload), &CancelHandle::new())
                    .await
            })
        })
        .collect();
    for handle in calls {
        check(&handle.await?)?;
    }
    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let grown = peak.load(Ordering::Relaxed).saturating_sub(base);
    Ok(Some(grown / LIVE_CALLS as u64))
}

/// The process's resident set, from `/proc/self/statm` (Linux only).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// The linear memory an instance starts with: the initial size of every
/// memory the component's core modules define (64 KiB pages).
fn initial_linear_memory(wasm: &[u8]) -> u64 {
    let mut total = 0;
    walk_sections(wasm, &mut total);
    total
}

/// Add the memories defined in the module or component `wasm` (and in
/// everything nested inside it) to `total`.
fn walk_sections(wasm: &[u8], total: &mut u64) {
    let Some(mut rest) = wasm.get(8..) else {
        return;
    };
    let is_component = wasm.get(6..8) == Some(&[0x01, 0x00]);
    while let Some((&id, after)) = rest.split_first() {
        let Some((size, after)) = leb(after) else {
            return;
        };
        let Some(body) = after.get(..size as usize) else {
            return;
        };
        rest = &after[size as usize..];
        match (is_component, id) {
            // A nested core module (1) or component (4).
            (true, 1 | 4) => walk_sections(body, total),
            // A core module's memory section: a vector of limits.
            (false, 5) => *total += memory_section(body),
            _ => {}
        }
    }
}

fn memory_section(body: &[u8]) -> u64 {
    let Some((count, mut rest)) = leb(body) else {
        return 0;
    };
    let mut bytes = 0;
    for _ in 0..count {
        let Some((&flags, after)) = rest.split_first() else {
            break;
        };
        let Some((min, after)) = leb(after) else {
            break;
        };
        rest = after;
        if flags & 1 != 0 {
            let Some((_max, after)) = leb(rest) else {
                break;
            };
            rest = after;
        }
        // Custom page sizes (flag 0x08) are not used by these toolchains.
        bytes += min * 65_536;
    }
    bytes
}

/// An unsigned LEB128 number and what follows it.
fn leb(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

fn call(task: &str, payload: &str) -> Call {
    Call {
        task: task.to_string(),
        ctx: TaskContext {
            task_id: "0190f3c8-0000-7000-8000-000000000000".to_string(),
            queue: "bench".to_string(),
            task_name: task.to_string(),
            attempt: 1,
            max_attempts: 3,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    }
}

fn check(report: &dtq_host::sandbox::CallReport) -> Result<()> {
    match &report.outcome {
        Outcome::Success(_) => Ok(()),
        other => bail!("call failed: {other:?}\n{}", report.log),
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn mib(bytes: u64) -> String {
    if bytes < 1 << 20 {
        return format!("{:.0} KiB", bytes as f64 / 1024.0);
    }
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}
