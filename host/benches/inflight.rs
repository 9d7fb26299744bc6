//! Calls in flight at once (`cargo bench -p dtq-host --bench inflight`): a
//! `dtq worker` process, the binary as deployed, with `--concurrency N`
//! (`DTQ_BENCH_INFLIGHT`, default 10 000), is given N tasks of a handler
//! that sleeps `DTQ_BENCH_WAIT_MS` (default 20 000) on a WASI clock
//! subscription, which is a timer of the host and takes no CPU, so all N
//! are live sandboxed calls together: each its own store, instance, linear
//! memory and fiber stack.
//!
//! Two handlers, each in a worker of its own (`DTQ_BENCH_HANDLERS`,
//! default `waiter_raw waiter`):
//!
//! - `waiter_raw` reads its payload as a bare number: no serde, a data
//!   image of about 3 KiB;
//! - `waiter` is a typed SDK handler (serde), a data image of about 15 KiB.
//!   With `DTQ_BENCH_TOUCH_KIB` (default 0) each call first writes that
//!   much of its heap and holds it while it waits.
//!
//! Every instance maps its handler's data image, and RSS counts a mapped
//! page once per mapping, so the image is a per-call cost of RSS (not of
//! PSS) that depends on the handler; the rest is the host's.
//!
//! For each handler the bench prints the worker's resident memory once it
//! has started and loaded the handler (idle), its peak while the calls are
//! in flight (`VmHWM`, reset first through `/proc/<pid>/clear_refs`), what
//! each call costs on average, the peak PSS, the most tasks seen running,
//! how long the worker took to start them all, and that every task
//! succeeded. With `DTQ_BENCH_SMAPS=1` it also prints, once every call is
//! in flight, the worker's largest mappings by resident memory
//! (`/proc/<pid>/smaps`): the pool's linear memories, stacks and tables are
//! mappings of their own, the rest is the heap.
//!
//! `DTQ_BENCH_IN_PROCESS=1` runs the worker inside this process instead
//! (with the API and the bench's client), to count its allocator: the live
//! heap per call in flight and, with `DTQ_BENCH_HEAP=1`, the allocation
//! sizes holding the most of it. Its RSS then also holds the submissions'
//! leftovers, and mimalloc runs with its own defaults, not the binary's.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::ingest;
use dtq_tests::alloc::Counting;
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{Dtq, TempDir, env_usize, free_port, guests};
use serde_json::{Value, json};

/// The allocator the `dtq` binary uses, counted from the start of `main`
/// (read only with `DTQ_BENCH_IN_PROCESS`).
#[global_allocator]
static ALLOCATOR: Counting = Counting;

// With the binary's settings (`dtq_host::allocator`).
dtq_host::mimalloc_defaults!();

const QUEUE: &str = "default";

/// The bound for 10 000 calls in flight.
const TARGET_MIB: f64 = 512.0;

/// The knobs of one run.
struct Knobs {
    calls: usize,
    wait_ms: usize,
    touch_kib: usize,
    in_process: bool,
}

/// One handler's figures.
struct Figures {
    handler: String,
    image_kib: f64,
    most: usize,
    all_at: Option<Duration>,
    done: Duration,
    idle_kib: u64,
    peak_kib: u64,
    pss_peak_kib: u64,
    after_kib: u64,
    /// The highest RSS sampled, when, and how many tasks ran then.
    rss_high: (u64, Duration, usize),
    /// Live heap idle and with every call in flight (in process only).
    heap: Option<(usize, usize)>,
}

fn main() -> Result<()> {
    Counting::start();
    let knobs = Knobs {
        calls: env_usize("DTQ_BENCH_INFLIGHT", 10_000)?,
        wait_ms: env_usize("DTQ_BENCH_WAIT_MS", 20_000)?,
        touch_kib: env_usize("DTQ_BENCH_TOUCH_KIB", 0)?,
        in_process: std::env::var_os("DTQ_BENCH_IN_PROCESS").is_some(),
    };
    let handlers =
        std::env::var("DTQ_BENCH_HANDLERS").unwrap_or_else(|_| "waiter_raw waiter".to_owned());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut all = Vec::new();
    for handler in handlers.split_whitespace() {
        // Each handler's component and the payload its tasks get.
        let (wasm, payload) = match handler {
            "waiter_raw" => (guests::WAITER_RAW, json!(knobs.wait_ms)),
            "waiter" => (
                guests::WAITER,
                json!({"ms": knobs.wait_ms, "touch_kib": knobs.touch_kib}),
            ),
            other => bail!("DTQ_BENCH_HANDLERS: unknown handler {other:?} (waiter_raw, waiter)"),
        };
        let body = json!({"task": handler, "payload": payload});
        all.push(runtime.block_on(bench(handler, wasm, &body, &knobs))?);
    }
    report(&all, &knobs);
    Ok(())
}

/// The worker under measurement: a `dtq worker` process, or the harness's
/// worker in this process.
enum Worker {
    Process {
        process: DtqProcess,
        /// Where its log is, removed with it.
        _logs: TempDir,
    },
    InProcess,
}

impl Worker {
    /// Its `/proc` directory.
    fn proc_dir(&self) -> String {
        match self {
            Worker::Process { process, .. } => format!("/proc/{}", process.pid()),
            Worker::InProcess => "/proc/self".to_owned(),
        }
    }
}

async fn bench(handler: &str, wasm: &str, body: &Value, knobs: &Knobs) -> Result<Figures> {
    let concurrency = knobs.calls.to_string();
    let worker_flags = [
        "--concurrency",
        &concurrency,
        "--visibility-timeout-ms",
        "300000",
        "--max-queue-depth",
        "0",
    ];
    // The worker loads this handler alone, so the idle figure holds one
    // handler's compiled code and images, as a worker deployed for it would.
    let handlers = TempDir::new("inflight-handlers")?;
    std::fs::copy(wasm, handlers.path.join(format!("{handler}.wasm")))
        .with_context(|| format!("copy the {handler} guest"))?;
    let mut dtq = Dtq::start_with_handlers(&handlers.path, false, &worker_flags).await?;
    let worker = if knobs.in_process {
        dtq.start_worker();
        Worker::InProcess
    } else {
        let logs = TempDir::new("inflight-worker")?;
        let port = free_port()?;
        let mut cmd = dtq_command(env!("CARGO_BIN_EXE_dtq"));
        cmd.arg("worker")
            .args(["--redis", &dtq.redis.url()])
            .arg("--handlers")
            .arg(&handlers.path)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(worker_flags);
        let mut worker = DtqProcess::spawn(
            "worker",
            cmd,
            logs.path.join("worker.log"),
            format!("http://127.0.0.1:{port}"),
        )?;
        worker.print_log_on_drop = false;
        worker
            .wait_log("worker started", Duration::from_secs(60))
            .await?;
        Worker::Process {
            process: worker,
            _logs: logs,
        }
    };
    // Let start-up settle (the handler's compilation, the first reads).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let proc_dir = worker.proc_dir();

    let idle_kib = kib_line(&proc_dir, "status", "VmRSS")?;
    let heap_idle = Counting::live();
    let mut heap_at_peak = heap_idle;
    std::fs::write(format!("{proc_dir}/clear_refs"), "5").context("reset the peak RSS")?;
    let started = Instant::now();
    submit(&dtq, body, knobs.calls).await?;

    let mut most = 0;
    let mut all_at = None;
    let mut snapshot_taken = false;
    let mut pss_peak_kib = 0;
    let mut rss_high = (0, Duration::ZERO, 0);
    loop {
        let stats = dtq.store.stats(QUEUE).await?;
        let running = stats.running as usize;
        most = most.max(running);
        if running > 0 {
            pss_peak_kib = pss_peak_kib.max(kib_line(&proc_dir, "smaps_rollup", "Pss")?);
        }
        let rss = kib_line(&proc_dir, "status", "VmRSS")?;
        if rss > rss_high.0 {
            rss_high = (rss, started.elapsed(), running);
        }
        if all_at.is_none() && running >= knobs.calls {
            all_at = Some(started.elapsed());
        }
        // A task counts as running from its delivery; its call is live a
        // little later. So the in-flight snapshots wait a second more.
        if let Some(at) = all_at
            && !snapshot_taken
            && started.elapsed() >= at + Duration::from_secs(1)
        {
            snapshot_taken = true;
            heap_at_peak = Counting::live();
            if knobs.in_process && std::env::var_os("DTQ_BENCH_HEAP").is_some() {
                print_heap_sizes();
            }
            if std::env::var_os("DTQ_BENCH_SMAPS").is_some() {
                println!("{handler}, every call in flight ({running} tasks running):");
                print_mappings(&proc_dir)?;
            }
        }
        if stats.ready + stats.running + stats.delayed == 0 {
            ensure!(
                stats.dead_lettered == 0,
                "{handler}: tasks failed: {stats:?}"
            );
            break;
        }
        let limit = Duration::from_millis(knobs.wait_ms as u64) * 3 + Duration::from_secs(120);
        if started.elapsed() > limit {
            bail!("{handler}: the calls did not finish: {stats:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = started.elapsed();
    let peak_kib = kib_line(&proc_dir, "status", "VmHWM")?;
    // What the worker keeps once no call runs: the pool slots' kept pages
    // among it.
    let after_kib = kib_line(&proc_dir, "status", "VmRSS")?;
    match worker {
        Worker::Process { mut process, .. } => process.crash()?,
        Worker::InProcess => dtq.stop_worker().await?,
    }
    Ok(Figures {
        handler: handler.to_owned(),
        image_kib: data_image_bytes(&std::fs::read(wasm)?)? as f64 / 1024.0,
        most,
        all_at,
        done,
        idle_kib,
        peak_kib,
        pss_peak_kib,
        after_kib,
        rss_high,
        heap: knobs.in_process.then_some((heap_idle, heap_at_peak)),
    })
}

/// Submit `calls` tasks of submission `body` through the submission path,
/// a batch at a time.
async fn submit(dtq: &Dtq, body: &Value, calls: usize) -> Result<()> {
    let settings = dtq.config.ingest_settings();
    let mut left = calls;
    while left > 0 {
        let n = left.min(ingest::MAX_BATCH_ITEMS);
        let items = (0..n)
            .map(|_| ingest::parse_submit_value(body.clone()))
            .collect();
        let done = ingest::submit_batch(&dtq.store, &settings, QUEUE, items, |_| true).await?;
        for item in done {
            item.context("a submission was refused")?;
        }
        left -= n;
    }
    Ok(())
}

/// Bytes of data segments in a component's core modules: the data image
/// every instance maps.
fn data_image_bytes(wasm: &[u8]) -> Result<usize> {
    let mut bytes = 0;
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        if let wasmparser::Payload::DataSection(reader) = payload? {
            for data in reader {
                bytes += data?.data.len();
            }
        }
    }
    Ok(bytes)
}

fn report(all: &[Figures], knobs: &Knobs) {
    let mib = |kib: u64| kib as f64 / 1024.0;
    let per_call = |kib: u64, idle: u64| kib.saturating_sub(idle) as f64 / knobs.calls as f64;
    let calls = knobs.calls;
    println!();
    println!(
        "| handler | data image | calls | most running | all started after | all done after | RSS idle | peak RSS | per call | peak PSS | per call | peak RSS ≤ {TARGET_MIB} MiB |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for f in all {
        let verdict = if calls != 10_000 {
            "n/a (the target is for 10 000)"
        } else if mib(f.peak_kib) <= TARGET_MIB {
            "met"
        } else {
            "not met"
        };
        println!(
            "| {} | {:.1} KiB | {calls} | {} | {} | {:.1} s | {:.1} MiB | **{:.1} MiB** | {:.1} KiB | {:.1} MiB | {:.1} KiB | {verdict} |",
            f.handler,
            f.image_kib,
            f.most,
            f.all_at
                .map_or("never".to_owned(), |t| format!("{:.1} s", t.as_secs_f64())),
            f.done.as_secs_f64(),
            mib(f.idle_kib),
            mib(f.peak_kib),
            per_call(f.peak_kib, f.idle_kib),
            mib(f.pss_peak_kib),
            per_call(f.pss_peak_kib, f.idle_kib),
        );
    }
    println!();
    for f in all {
        println!(
            "{}: RSS once every call was done {:.1} MiB; highest RSS sampled (every 50 ms) {:.1} MiB at {:.1} s, {} tasks running then.",
            f.handler,
            mib(f.after_kib),
            mib(f.rss_high.0),
            f.rss_high.1.as_secs_f64(),
            f.rss_high.2,
        );
        if let Some((idle, at_peak)) = f.heap {
            println!(
                "{}: live heap {:.1} MiB idle, {:.1} MiB with every call in flight ({:.1} KiB per call).",
                f.handler,
                idle as f64 / (1 << 20) as f64,
                at_peak as f64 / (1 << 20) as f64,
                at_peak.saturating_sub(idle) as f64 / 1024.0 / calls as f64,
            );
        }
    }
    println!();
    println!(
        "Each call sleeps {} ms on a WASI clock subscription. The worker is {}. Peak RSS is \
         its VmHWM, reset once it had started; it counts a page once per mapping, so the \
         handler's data image, mapped copy-on-write into every instance from one memfd, \
         counts once per call. PSS (sampled while calls run) counts shared pages once in all.",
        knobs.wait_ms,
        if knobs.in_process {
            "in this process, beside the API and the bench's client"
        } else {
            "a `dtq worker` process"
        },
    );
}

/// The worker's resident memory by kind of mapping: mappings of one name
/// and size are one group (the pool's per-slot regions share a size), the
/// ten largest groups by resident memory.
fn print_mappings(proc_dir: &str) -> Result<()> {
    let smaps = std::fs::read_to_string(format!("{proc_dir}/smaps"))?;
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

/// The value of `field` in the `<field>: <n> kB` lines of `<proc_dir>/<file>`.
fn kib_line(proc_dir: &str, file: &str, field: &str) -> Result<u64> {
    let path = format!("{proc_dir}/{file}");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
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
