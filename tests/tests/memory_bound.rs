//! The worker's memory bound against a guest built to amplify: in a test
//! binary of its own, so that the process's peak RSS is this test's alone.
//!
//! docs/sandbox.md states the bound: per concurrent call, the guest's linear
//! memory (`memory_bytes`) plus what the host may hold for it (at most
//! `max_hostcall_bytes` copied out of one import call or the result, the
//! staged writes of one operation, the capped log and result). A guest that
//! names one buffer as many `log.write` fields asks the host to copy it
//! that many times; four such guests took a worker from 200 MiB to 1 GiB
//! before the hostcall cap.

use std::time::Duration;

use anyhow::{Context as _, Result};
use dtq_host::sandbox::{
    Call, CancelHandle, Limit, Limits, Outcome, Sandbox, SandboxConfig, TaskContext, Trap,
};
use dtq_tests::{RedisServer, guests};
use serde_json::json;

const CALLS: usize = 4;
const MIB: u64 = 1 << 20;

/// The process's peak resident set (VmHWM), in bytes.
fn peak_rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("no VmHWM")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("no value")?
        .parse()?;
    Ok(kib * 1024)
}

/// Start measuring the peak afresh from the current resident set.
fn reset_peak_rss() -> Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// A call of `log.write` with `n` fields naming one `mb` MiB buffer.
fn amplify(mb: usize, n: usize) -> Call {
    Call {
        task: "adversarial".into(),
        ctx: TaskContext {
            task_id: uuid::Uuid::now_v7().to_string(),
            queue: "default".into(),
            task_name: "adversarial".into(),
            attempt: 1,
            max_attempts: 1,
            idempotency_key: None,
        },
        payload: json!({"op": "log_fields", "mb": mb, "n": n}).to_string(),
        deadline: Some(Duration::from_secs(20)),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn amplifying_guests_stay_within_the_stated_memory_bound() -> Result<()> {
    let redis = RedisServer::start()?;
    // Small linear memories, so the host's share dominates the bound.
    let limits = Limits {
        memory_bytes: 16 << 20,
        ..Limits::default()
    };
    let config = SandboxConfig {
        limits: limits.clone(),
        max_concurrent_calls: CALLS as u32,
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, redis.manager().await?)?;
    sandbox.load("adversarial", &std::fs::read(guests::ADVERSARIAL)?)?;
    // Warm: one small call of each size class, so the measure below is the
    // amplifying calls, not first-use allocations.
    for _ in 0..2 {
        let report = sandbox.call(amplify(1, 2), &CancelHandle::new()).await;
        assert!(
            matches!(report.outcome, Outcome::Success(_)),
            "{:?}",
            report.outcome
        );
    }

    reset_peak_rss()?;
    let before = peak_rss()?;
    let calls = (0..CALLS).map(|_| {
        let sandbox = sandbox.clone();
        // 12 MiB of linear memory each, named twelve times: 144 MiB to
        // copy, more than wasmtime's default hostcall fuel (128 MiB) stops.
        tokio::spawn(async move { sandbox.call(amplify(12, 12), &CancelHandle::new()).await })
    });
    for report in futures::future::join_all(calls).await {
        let report = report?;
        assert_eq!(
            report.outcome,
            Outcome::Trapped(Trap::LimitExceeded(Limit::HostCallData))
        );
    }
    let growth = peak_rss()?.saturating_sub(before);

    // The stated bound: per call, linear memory plus the host's share.
    let per_call = limits.memory_bytes as u64
        + limits.max_hostcall_bytes as u64
        + limits.max_operation_bytes as u64
        + limits.max_log_bytes as u64
        + limits.max_result_bytes as u64;
    let bound = CALLS as u64 * per_call;
    eprintln!(
        "{CALLS} amplifying calls (12 fields naming one 12 MiB buffer each): \
         peak RSS grew {} MiB; bound {} MiB",
        growth / MIB,
        bound / MIB
    );
    assert!(
        growth < bound,
        "peak RSS grew {} MiB, over the bound of {} MiB",
        growth / MIB,
        bound / MIB
    );
    Ok(())
}
