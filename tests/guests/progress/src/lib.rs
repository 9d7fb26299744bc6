//! `progress`: a handler that reports its progress as the payload asks,
//! for the tests of progress reports (`tests/tests/progress.rs`, and the
//! same guest in Python and JavaScript for `tests/tests/polyglot.rs`).
//!
//! Payload → result:
//!
//! ```text
//! {"reports": [[F, M], [F, M, N], ...]}  →  {"reported": n}
//! {"loop": N}                            →  {"reported": N}
//! ... "gate": true                       →  (waits first, see below)
//! ... "spin_ms": N                       →  (spins N ms first, see below)
//! ```
//!
//! `reports` reports each pair in order: fraction `F` (a number, or
//! `"nan"`, `"inf"`, `"-inf"`) and message `M`, repeated `N` times when
//! given (a message of any length). `loop` reports `N` times in a tight
//! loop, fraction `i / N` and message `step i`, then `1.0`, `"done"`.
//! With `"gate": true` the handler then waits until the kv key
//! `gate:<task id>` exists, polling every 20 ms, before it returns: a test
//! reads the task while it runs, then opens the gate. With `"spin_ms": N`
//! (this Rust guest only) it then spins N ms on the monotonic clock,
//! making no host call: a test sees the report (so the attempt runs), then
//! cuts the host off from Redis while the handler has no need of it.

use std::time::{Duration, Instant};

use dtq_guest::{Context, Result, kv, progress};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Payload {
    #[serde(default)]
    reports: Vec<Vec<Value>>,
    #[serde(default, rename = "loop")]
    tight_loop: u64,
    #[serde(default)]
    gate: bool,
    #[serde(default)]
    spin_ms: u64,
}

/// A report's fraction: a number, or one of the names of the values JSON
/// has no number for.
fn fraction(value: &Value) -> Result<f64> {
    match value {
        Value::String(s) if s == "nan" => Ok(f64::NAN),
        Value::String(s) if s == "inf" => Ok(f64::INFINITY),
        Value::String(s) if s == "-inf" => Ok(f64::NEG_INFINITY),
        other => other
            .as_f64()
            .ok_or_else(|| dtq_guest::Error::fatal(format!("not a fraction: {other}"))),
    }
}

fn report(ctx: Context, payload: Payload) -> Result<Value> {
    let mut reported = 0;
    for entry in &payload.reports {
        let (Some(f), Some(message)) = (entry.first(), entry.get(1).and_then(Value::as_str)) else {
            dtq_guest::fatal!("a report is [fraction, message] or [fraction, message, times]");
        };
        let times = entry.get(2).and_then(Value::as_u64).unwrap_or(1) as usize;
        progress(fraction(f)?, message.repeat(times))?;
        reported += 1;
    }
    let n = payload.tight_loop;
    if n > 0 {
        for i in 0..n {
            progress(i as f64 / n as f64, format!("step {i}"))?;
        }
        progress(1.0, "done")?;
        reported += n;
    }
    if payload.gate {
        let gate = format!("gate:{}", ctx.task_id);
        while !kv::exists(&gate)? {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let spin = Instant::now();
    while spin.elapsed() < Duration::from_millis(payload.spin_ms) {
        std::hint::spin_loop();
    }
    Ok(json!({"reported": reported}))
}

dtq_guest::handler!(report);
