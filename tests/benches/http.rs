//! The cost of an outbound HTTP request made through the sandbox, beside the
//! same request made from native Rust, in one run (`cargo bench -p
//! dtq-tests --bench http`).
//!
//! Every request is `GET /ok` to a local service (`dtq_tests::services`) on
//! loopback, so the figures are the overhead, not the network:
//!
//! - native: one `reqwest` client (the one the host uses, with the same
//!   settings: pooled connections), requests one after another;
//! - sandbox, per request: one handler call that makes N requests through
//!   `wasi:http` (allow-list check, the host's client, the body streamed
//!   back into the guest), divided by N;
//! - sandbox, per call: a fresh instance that makes one request, as a task
//!   that makes one call does (instantiation included).
//!
//! Medians of several rounds; the ratio to native is printed.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dtq_host::sandbox::{
    AllowList, Call, CancelHandle, HandlerSettings, Limits, Outcome, Sandbox, SandboxConfig,
    TaskContext,
};
use dtq_tests::services::Service;
use dtq_tests::{RedisServer, TempDir, guests};
use serde_json::json;

const ROUNDS: usize = 5;
const REQUESTS: usize = 500;
const CALLS: usize = 300;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

async fn bench() -> Result<()> {
    let redis = RedisServer::start()?;
    let service = Service::start()?;
    let url = format!("{}/ok", service.url());
    println!(
        "dtq outbound HTTP benchmark ({} CPUs): GET {url}",
        std::thread::available_parallelism()?
    );

    // Native: the same client settings the host uses.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .build()?;
    let mut native = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..REQUESTS {
            let resp = client.get(&url).send().await?;
            if !resp.status().is_success() {
                bail!("native GET: {}", resp.status());
            }
            resp.bytes().await?;
        }
        native.push(started.elapsed() / REQUESTS as u32);
    }

    let cache = TempDir::new("bench-http")?;
    let sandbox = Sandbox::new(
        SandboxConfig {
            cache_dir: Some(cache.path.clone()),
            limits: Limits {
                max_http_requests: REQUESTS as u64,
                ..Limits::default()
            },
            ..SandboxConfig::default()
        },
        redis.manager().await?,
    )?;
    let settings = HandlerSettings {
        allow_hosts: AllowList::parse("http://127.0.0.1:*")?,
        ..HandlerSettings::default()
    };
    sandbox.load_with(
        "http_client",
        &std::fs::read(guests::HTTP_CLIENT)?,
        &settings,
    )?;
    let call = |payload: serde_json::Value| Call {
        task: "http_client".into(),
        ctx: TaskContext {
            task_id: "bench".into(),
            queue: "bench".into(),
            task_name: "http_client".into(),
            attempt: 1,
            max_attempts: 1,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: Some(Duration::from_secs(60)),
    };
    let cancel = CancelHandle::new();

    let mut per_request = Vec::new();
    for _ in 0..ROUNDS {
        let payload = json!({"op": "many", "url": url, "n": REQUESTS});
        let started = Instant::now();
        let report = sandbox.call(call(payload), &cancel).await;
        let elapsed = started.elapsed();
        let ok = match &report.outcome {
            Outcome::Success(result) => serde_json::from_str::<serde_json::Value>(result)?,
            other => bail!("{REQUESTS} requests through the sandbox: {other}"),
        };
        if ok["ok"] != REQUESTS {
            bail!("{REQUESTS} requests through the sandbox: {ok}");
        }
        per_request.push(elapsed / REQUESTS as u32);
    }

    let mut per_call = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..CALLS {
            let report = sandbox
                .call(call(json!({"op": "get", "url": url})), &cancel)
                .await;
            if !matches!(report.outcome, Outcome::Success(_)) {
                bail!("one request through the sandbox: {}", report.outcome);
            }
        }
        per_call.push(started.elapsed() / CALLS as u32);
    }

    let native = median(native);
    println!();
    println!("{:<46} {:>10} {:>8}", "", "median", "× native");
    let row = |name: &str, d: Duration| {
        println!(
            "{name:<46} {:>7.1} µs {:>8.2}",
            d.as_secs_f64() * 1e6,
            d.as_secs_f64() / native.as_secs_f64()
        );
    };
    row("native reqwest, one request", native);
    row(
        "sandbox, one request of many in a call",
        median(per_request),
    );
    row("sandbox, a call that makes one request", median(per_call));
    Ok(())
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}
