//! `flows`: a handler that submits tasks and waits for its children, for
//! the flow tests (`tests/tests/flows.rs`, the chaos test, and the same
//! guest in Python and JavaScript for `tests/tests/polyglot.rs`, which take
//! the first four payloads).
//!
//! | payload | does | result |
//! |---|---|---|
//! | `{"fan_out": N, "queue": Q, "task": T}` | with no children yet: submits N children (task T on queue Q, payload `{"n": i}`), then waits | once all ended: `{"sum": Σ n of those that SUCCEEDED, "children": count, "failed": count not SUCCEEDED}` |
//! | `{"submit": {"queue": Q, "task": T, "payload": P, "key": K}}` | submits one task (not a child); `key` optional | `{"id": <its id>}` |
//! | `{"submit_then_fail": {"queue": Q, "task": T}}` | submits one task, then fails (retryable): nothing is submitted | none |
//! | `{"denied": {"queue": Q, "task": T}}` | tries to submit where it is not granted | `{"refused": <message>}`, or `{"refused": null}` |
//!
//! And, for the Rust tests only:
//! - `"hold": true` in `submit`: after the submission, records the id it
//!   was given under kv `submitted:<task id>`, then returns only once kv
//!   `release:<task id>` exists (looked at every 10 ms; failing fatally
//!   after 20 s), so that a test changes the target queue in between;
//! - `"fail": [i, ...]` with `fan_out`: those children get `"fail": true`;
//! - `"crash_first": true` with `fan_out`: attempt 1 submits the children,
//!   records their ids under kv `ids:<task id>`, then fails (retryable);
//! - `"slow_ms": M` with `fan_out`: each child gets `"sleep_ms": M`;
//! - `"fail_resumed": true` with `fan_out`: the run after the wait fails
//!   (retryable);
//! - as a child, `{"n": i}` → `{"n": i}`, after sleeping `sleep_ms`,
//!   failing fatally when `"fail": true`;
//! - `{"op_submit": {"queue": Q, "task": T, "key": K, "fail_after": B,
//!   "abort": A}}`: inside the idempotent operation `K`, submits one task
//!   (payload `{"n": 1}`) as a child; with `abort`, the operation's effect
//!   then fails (so it does not commit) and the handler returns
//!   `{"aborted": true}`; with `fail_after`, attempt 1 fails (retryable)
//!   after the commit. Returns `{"ran": <whether the effect ran>, "id":
//!   <its id, when it ran>}`;
//! - `{"phases": [[a, b, ...], [c, ...], ...], "queue": Q, "task": T}`:
//!   a run that finds k children submits the next phase after the k
//!   numbers its phases so far hold (one child per number, payload
//!   `{"n": x}`), then waits; once none is left, returns `{"sum": Σ n
//!   of the children that SUCCEEDED, "children": count, "statuses": [...]}`;
//! - `{"flood": {"queue": Q, "task": T, "bytes": B}}`: submits payloads of
//!   B bytes until the host refuses one, then fails fatally with the
//!   refusal and how many were staged (a handler that would make its
//!   worker hold too much).

use std::time::Duration;

use dtq_guest::{Context, Error, Refusal, Result, idempotent_operation, kv, tasks};
use serde_json::{Value, json};

fn flows(ctx: Context, payload: Value) -> Result<Value> {
    if let Some(n) = payload.get("fan_out").and_then(Value::as_u64) {
        return fan_out(&ctx, &payload, n);
    }
    if let Some(s) = payload.get("submit") {
        let mut submit = tasks::Submit::new(text(s, "queue")?, text(s, "task")?, &s["payload"])?;
        if let Some(key) = s.get("key").and_then(Value::as_str) {
            submit = submit.key(key);
        }
        let id = submit.send()?;
        if s.get("hold") == Some(&Value::Bool(true)) {
            kv::set(format!("submitted:{}", ctx.task_id), &id)?;
            hold_until_released(&ctx)?;
        }
        return Ok(json!({ "id": id }));
    }
    if let Some(s) = payload.get("submit_then_fail") {
        tasks::submit(text(s, "queue")?, text(s, "task")?, &json!({}))?;
        return Err(Error::retryable("failed after submitting"));
    }
    if let Some(s) = payload.get("op_submit") {
        return op_submit(&ctx, s);
    }
    if let Some(phases) = payload.get("phases").and_then(Value::as_array) {
        return in_phases(&payload, phases);
    }
    if let Some(s) = payload.get("flood") {
        let bytes = s.get("bytes").and_then(Value::as_u64).unwrap_or(1 << 19) as usize;
        let filler = "x".repeat(bytes);
        for i in 0.. {
            if let Err(e) = tasks::submit(text(s, "queue")?, text(s, "task")?, &json!({ "f": filler })) {
                return Err(Error::fatal(format!("refused after {i}: {}", e.message())));
            }
        }
    }
    if let Some(s) = payload.get("denied") {
        return match tasks::submit(text(s, "queue")?, text(s, "task")?, &json!({})) {
            Ok(_) => Ok(json!({ "refused": null })),
            Err(e) if e.refusal() == Some(Refusal::InvalidArgument) => {
                Ok(json!({ "refused": e.message() }))
            }
            Err(e) => Err(e),
        };
    }
    if let Some(n) = payload.get("n") {
        if let Some(ms) = payload.get("sleep_ms").and_then(Value::as_u64) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        if payload.get("fail") == Some(&Value::Bool(true)) {
            return Err(Error::fatal(format!("child {n} fails, as asked")));
        }
        return Ok(json!({ "n": n }));
    }
    Err(Error::fatal(format!("unknown payload {payload}")))
}

/// Return once kv `release:<task id>` exists; fail fatally after 20 s.
fn hold_until_released(ctx: &Context) -> Result<()> {
    let release = format!("release:{}", ctx.task_id);
    for _ in 0..2_000 {
        if kv::get(&release)?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(Error::fatal("never released"))
}

fn fan_out(ctx: &Context, payload: &Value, n: u64) -> Result<Value> {
    let children = tasks::children()?;
    if children.is_empty() {
        let failing: Vec<u64> = payload
            .get("fail")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let slow = payload.get("slow_ms").cloned();
        let mut ids = Vec::new();
        for i in 0..n {
            let mut child = json!({ "n": i });
            if failing.contains(&i) {
                child["fail"] = json!(true);
            }
            if let Some(ms) = &slow {
                child["sleep_ms"] = ms.clone();
            }
            let submit = tasks::Submit::new(text(payload, "queue")?, text(payload, "task")?, &child)?;
            ids.push(submit.child().send()?);
        }
        if payload.get("crash_first") == Some(&Value::Bool(true)) && ctx.attempt == 1 {
            kv::set(format!("ids:{}", ctx.task_id), json!(ids).to_string())?;
            return Err(Error::retryable("failing after staging the children"));
        }
        return Err(tasks::wait_for_children());
    }
    if payload.get("fail_resumed") == Some(&Value::Bool(true)) {
        return Err(Error::retryable("the resumed run fails, as asked"));
    }
    let succeeded: Vec<&tasks::Child> = children.iter().filter(|c| c.succeeded()).collect();
    let sum: i64 = succeeded
        .iter()
        .filter_map(|c| c.result.as_ref()?.get("n")?.as_i64())
        .sum();
    Ok(json!({
        "sum": sum,
        "children": children.len(),
        "failed": children.len() - succeeded.len(),
        "ids": children.iter().map(|c| c.task_id.clone()).collect::<Vec<_>>(),
        "statuses": children.iter().map(|c| c.status.clone()).collect::<Vec<_>>(),
    }))
}

fn in_phases(payload: &Value, phases: &[Value]) -> Result<Value> {
    let children = tasks::children()?;
    let mut seen = 0;
    for phase in phases {
        let numbers = phase.as_array().cloned().unwrap_or_default();
        if seen == children.len() {
            for n in numbers {
                tasks::Submit::new(text(payload, "queue")?, text(payload, "task")?, &json!({ "n": n }))?
                    .child()
                    .send()?;
            }
            return Err(tasks::wait_for_children());
        }
        seen += numbers.len();
    }
    let sum: i64 = children
        .iter()
        .filter(|c| c.succeeded())
        .filter_map(|c| c.result.as_ref()?.get("n")?.as_i64())
        .sum();
    Ok(json!({
        "sum": sum,
        "children": children.len(),
        "statuses": children.iter().map(|c| c.status.clone()).collect::<Vec<_>>(),
    }))
}

fn op_submit(ctx: &Context, s: &Value) -> Result<Value> {
    let (queue, task) = (text(s, "queue")?, text(s, "task")?);
    let abort = s.get("abort") == Some(&Value::Bool(true));
    let ran = idempotent_operation(text(s, "key")?, 3600, || {
        let id = tasks::Submit::new(queue, task, &json!({ "n": 1 }))?
            .child()
            .send()?;
        if abort {
            return Err(Error::retryable("the operation's effect fails"));
        }
        Ok(id)
    });
    let (ran, id) = match ran {
        Err(e) if abort && e.message().contains("effect fails") => {
            return Ok(json!({ "aborted": true }));
        }
        other => other?,
    };
    if s.get("fail_after") == Some(&Value::Bool(true)) && ctx.attempt == 1 {
        return Err(Error::retryable("failing after the operation committed"));
    }
    Ok(json!({ "ran": ran, "id": id }))
}

fn text<'a>(value: &'a Value, field: &str) -> Result<&'a str> {
    value
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| Error::fatal(format!("{field} is missing")))
}

dtq_guest::handler!(flows);
