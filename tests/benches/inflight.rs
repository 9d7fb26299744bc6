//! Calls in flight at once (`cargo bench -p dtq-tests --bench inflight`):
//! one in-process worker with `--concurrency N` (`DTQ_BENCH_INFLIGHT`,
//! default 10 000) is given N tasks of the `waiter` test guest, which sleeps
//! `DTQ_BENCH_WAIT_MS` (default 20 000) on a WASI clock subscription,
//! which is a timer of the host and takes no CPU, so all N are live
//! sandboxed calls together: each its own store, instance, linear memory
//! and fiber stack. With `DTQ_BENCH_TOUCH_KIB` (default 0) each call first
//! writes that much of its heap and holds it while it waits.
//!
//! The worker loads the `waiter` handler alone. Prints the process's
//! resident memory before the worker starts (the API, the handler, Redis
//! clients), its peak while the calls are
//! in flight (`VmHWM`, reset first through `/proc/self/clear_refs`), what
//! each call costs on average, the most calls seen in flight, how long
//! the worker took to start them all, and that every task succeeded.
//! With `DTQ_BENCH_SMAPS=1` it also prints, once every call is in flight,
//! the process's largest mappings by resident memory (`/proc/self/smaps`):
//! the pool's linear memories, stacks and tables are mappings of their
//! own, the rest is the heap. The allocator is counted: the bench prints
//! the live heap per call (what the host itself holds for a call in
//! flight, before the allocator's own overhead), and with
//! `DTQ_BENCH_HEAP=1` the allocation sizes holding the most of it.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::ingest;
use dtq_tests::alloc::Counting;
use dtq_tests::{Dtq, TempDir, env_usize, guests};
use serde_json::json;

/// The allocator the `dtq` binary uses, counted from the start of `main`.
#[global_allocator]
static ALLOCATOR: Counting = Counting;

const QUEUE: &str = "default";

fn main() -> Result<()> {
    Counting::start();
    let calls = env_usize("DTQ_BENCH_INFLIGHT", 10_000)?;
    let wait_ms = env_usize("DTQ_BENCH_WAIT_MS", 20_000)?;
    let touch_kib = env_usize("DTQ_BENCH_TOUCH_KIB", 0)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(calls, wait_ms, touch_kib))
}

async fn bench(calls: usize, wait_ms: usize, touch_kib: usize) -> Result<()> {
    let concurrency = calls.to_string();
    // The worker loads `waiter` alone, so the idle figure holds one
    // handler's compiled code and images, as a worker deployed for it would.
    let handlers = TempDir::new("inflight-handlers")?;
    std::fs::copy(guests::WAITER, handlers.path.join("waiter.wasm"))
        .context("copy the waiter guest")?;
    let mut dtq = Dtq::start_with_handlers(
        &handlers.path,
        false,
        &[
            "--concurrency",
            &concurrency,
            "--visibility-timeout-ms",
            "300000",
            "--max-queue-depth",
            "0",
        ],
    )
    .await?;
    let settings = dtq.config.ingest_settings();
    let body = json!({"task": "waiter", "payload": {"ms": wait_ms, "touch_kib": touch_kib}});
    for chunk in (0..calls)
        .collect::<Vec<_>>()
        .chunks(ingest::MAX_BATCH_ITEMS)
    {
        let items = chunk
            .iter()
            .map(|_| ingest::parse_submit_value(body.clone()))
            .collect();
        let done = ingest::submit_batch(&dtq.store, &settings, QUEUE, items, |_| true).await?;
        for item in done {
            item.context("a submission was refused")?;
        }
    }

    let idle = status_kib("VmRSS")?;
    let heap_idle = Counting::live();
    let mut heap_at_peak = heap_idle;
    std::fs::write("/proc/self/clear_refs", "5").context("reset the peak RSS")?;
    let started = Instant::now();
    dtq.start_worker();
    let mut most = 0;
    let mut all_at = None;
    let mut pss_peak = 0;
    // The highest RSS sampled, when, and how many calls were in flight then.
    let mut rss_high = (0, Duration::ZERO, 0);
    loop {
        let in_flight = dtq.sandbox.calls_in_flight();
        most = most.max(in_flight);
        if in_flight > 0 {
            pss_peak = pss_peak.max(rollup_kib("Pss")?);
        }
        let rss = status_kib("VmRSS")?;
        if rss > rss_high.0 {
            rss_high = (rss, started.elapsed(), in_flight);
        }
        if all_at.is_none() && in_flight >= calls {
            all_at = Some(started.elapsed());
            heap_at_peak = Counting::live();
            if std::env::var_os("DTQ_BENCH_HEAP").is_some() {
                print_heap_sizes();
            }
            if std::env::var_os("DTQ_BENCH_SMAPS").is_some() {
                print_mappings()?;
            }
        }
        let stats = dtq.store.stats(QUEUE).await?;
        if stats.ready + stats.running + stats.delayed == 0 {
            ensure!(stats.dead_lettered == 0, "{stats:?}");
            break;
        }
        if started.elapsed() > Duration::from_millis(wait_ms as u64) * 3 + Duration::from_secs(120)
        {
            bail!("the calls did not finish: {stats:?}, {in_flight} in flight");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = started.elapsed();
    let peak = status_kib("VmHWM")?;
    // What the process keeps once no call runs: the pool slots' kept pages
    // among it.
    let after = status_kib("VmRSS")?;
    dtq.stop_worker().await?;

    println!();
    println!(
        "| calls | most in flight | all started after | all done after | RSS idle | peak RSS | per call | peak PSS | per call |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {calls} | {most} | {} | {:.1} s | {:.1} MiB | **{:.1} MiB** | {:.1} KiB | {:.1} MiB | {:.1} KiB |",
        all_at.map_or("never".to_owned(), |t| format!("{:.1} s", t.as_secs_f64())),
        done.as_secs_f64(),
        idle as f64 / 1024.0,
        peak as f64 / 1024.0,
        peak.saturating_sub(idle) as f64 / calls as f64,
        pss_peak as f64 / 1024.0,
        pss_peak.saturating_sub(idle) as f64 / calls as f64,
    );
    println!();
    println!(
        "Live heap: {:.1} MiB idle, {:.1} MiB with every call in flight ({:.1} KiB per call).",
        heap_idle as f64 / (1 << 20) as f64,
        heap_at_peak as f64 / (1 << 20) as f64,
        heap_at_peak.saturating_sub(heap_idle) as f64 / 1024.0 / calls as f64,
    );
    println!(
        "RSS once every call was done: {:.1} MiB.",
        after as f64 / 1024.0
    );
    println!(
        "Highest RSS sampled (every 50 ms): {:.1} MiB at {:.1} s, {} calls in flight then.",
        rss_high.0 as f64 / 1024.0,
        rss_high.1.as_secs_f64(),
        rss_high.2,
    );
    println!();
    println!(
        "Each call sleeps {wait_ms} ms on a WASI clock subscription. Peak RSS is VmHWM of \
         this process (worker, API and the bench's client), reset once the tasks were \
         submitted; it counts a page once per mapping, so the handler's data image, \
         mapped copy-on-write into every instance from one memfd, counts once per call. \
         PSS (sampled while calls run) counts shared pages once in all."
    );
    Ok(())
}

/// This process's resident memory by kind of mapping: mappings of one
/// name and size are one group (the pool's per-slot regions share a size),
/// the ten largest groups by resident memory.
fn print_mappings() -> Result<()> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut groups: std::collections::BTreeMap<(String, u64), (u64, u64)> = Default::default();
    let mut current = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [range, _perms, _offset, _dev, _inode, rest @ ..] if range.contains('-') => {
                let (start, end) = range.split_once('-').context("a range")?;
                let size = u64::from_str_radix(end, 16)? - u64::from_str_radix(start, 16)?;
                let name = rest.first().map_or("[anon]", |n| *n).to_owned();
                current = Some((name, size / 1024));
            }
            ["Rss:", kib, ..] => {
                if let Some(key) = current.clone() {
                    let entry = groups.entry(key).or_default();
                    entry.0 += 1;
                    entry.1 += kib.parse::<u64>()?;
                }
            }
            _ => {}
        }
    }
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort_by_key(|(_, (_, rss))| std::cmp::Reverse(*rss));
    println!("| mapping | each | mappings | resident |");
    println!("|---|---:|---:|---:|");
    for ((name, size), (count, rss)) in groups.iter().take(10) {
        println!(
            "| {name} | {size} KiB | {count} | {:.1} MiB |",
            *rss as f64 / 1024.0
        );
    }
    let total: u64 = groups.iter().map(|(_, (_, rss))| rss).sum();
    println!("| all | | | {:.1} MiB |", total as f64 / 1024.0);
    Ok(())
}

/// A `kB` line of `/proc/self/smaps_rollup`.
fn rollup_kib(field: &str) -> Result<u64> {
    kib_line("/proc/self/smaps_rollup", field)
}

/// A `kB` line of `/proc/self/status`.
fn status_kib(field: &str) -> Result<u64> {
    kib_line("/proc/self/status", field)
}

/// The value of `field` in the `<field>: <n> kB` lines of `path`.
fn kib_line(path: &str, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in {path}"))
}

/// The allocation sizes holding the most live bytes.
fn print_heap_sizes() {
    let mut sizes = Counting::live_by_size();
    sizes.sort_by_key(|(size, n)| std::cmp::Reverse(*size as isize * n));
    println!("| size (up to) | live allocations | bytes |");
    println!("|---:|---:|---:|");
    for (size, n) in sizes.iter().take(25) {
        println!(
            "| {size} | {n} | {:.1} MiB |",
            (*size as isize * n) as f64 / (1 << 20) as f64
        );
    }
}
