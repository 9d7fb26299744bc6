//! One task through the sandbox, and its outcome mapped to a completion.
//!
//! | sandbox outcome | completion | status |
//! |---|---|---|
//! | `Success` | success | SUCCEEDED |
//! | `Fatal`, or a trap retrying cannot help ([`Outcome::is_retryable`]) | fatal | FAILED |
//! | `Retryable`, deadline, other traps | retry | RETRYING, or DEAD_LETTERED when attempts are spent |
//! | `Trapped(Cancelled)` | cancelled | CANCELLED |
//! | `Trapped(UnknownHandler)`: no handler of the task loaded here | defer (the attempt is given back) | SCHEDULED, for any worker; FAILED past `--defer-limit-ms` |
//! | `Retryable` or `Fatal` after the handler asked to wait for its children (flows) | wait | WAITING, resumed as the same attempt once its children ended |
//!
//! A success or a wait carries the submissions the call staged (flows);
//! any other outcome drops them: a failed attempt submits nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tracing::{Instrument, Span, debug, debug_span, warn};

use super::completion::{Pending, backoff_ms};
use super::{Registration, Shared};
use crate::base::now_ms;
use crate::metrics::{TaskSeries, TrapClass, WorkerMetrics};
use crate::sandbox::{Call, CallReport, CancelHandle, Outcome, TaskContext, Trap};
use crate::store::{Completion, CompletionKind, Delivery, StartedTask, logical_queue};
use crate::telemetry;

/// Run each task on a tokio task of its own on the guest runtime (see
/// [`Shared::guests`]); each permit and registration is held until its
/// task's completion is written. The batch crosses to the guest runtime once: spawned from there,
/// the tasks go onto its local queues instead of each waking a thread.
pub(super) fn spawn(
    shared: &Arc<Shared>,
    runs: Vec<(Delivery, StartedTask, OwnedSemaphorePermit, Registration)>,
) {
    if runs.is_empty() {
        return;
    }
    let batch = {
        let shared = shared.clone();
        async move {
            for (delivery, task, permit, registration) in runs {
                let span = attempt_span(&task);
                let run =
                    execute(shared.clone(), delivery, task, permit, registration).instrument(span);
                shared.tracker.spawn(run);
            }
        }
    };
    shared.guests.spawn(shared.tracker.track_future(batch));
}

/// The span of `task`'s attempt. Traced, the attempt's span of the trace
/// (see [`crate::telemetry`]), its parent the submission's; else at debug
/// level: with the default filter a span per task would be formatted and
/// stored for every task run. The warnings an attempt logs name its task
/// themselves.
fn attempt_span(task: &StartedTask) -> Span {
    if !telemetry::enabled() {
        return debug_span!("task", task_id = %task.id, queue = %task.queue,
            task = %task.task, attempt = task.attempts);
    }
    let span = tracing::info_span!(target: telemetry::TARGET, "attempt",
        otel.kind = "consumer", task_id = %task.id, queue = %logical_queue(&task.queue),
        task = %task.task, attempt = task.attempts, outcome = tracing::field::Empty,
        trace_id = tracing::field::Empty);
    telemetry::adopt(&span, task.traceparent.as_deref());
    span
}

/// Run one task and hand over its completion, unless it was abandoned at
/// shutdown or found stale meanwhile.
async fn execute(
    shared: Arc<Shared>,
    delivery: Delivery,
    mut task: StartedTask,
    permit: OwnedSemaphorePermit,
    registration: Registration,
) {
    let cancel = registration.cancel_handle().clone();
    // A cancel published before the message was held would be missed by
    // the listener; the record tells.
    if task.cancel_requested {
        cancel.cancel();
    }
    let Some(report) = call(&shared, &mut task, &cancel).await else {
        return;
    };
    // A handler that ran is a known task: its name is its label, with no
    // lookup.
    let queue = logical_queue(&task.queue);
    let series = match &report.task {
        Some(name) => shared.metrics.series(queue, name),
        None => shared
            .metrics
            .series(queue, &shared.metrics.task_label(&task.task)),
    };
    record_call(&shared.metrics, &series, &report);
    if !registration.begin_completion() {
        // Another worker took the task over (the heartbeat that found it
        // logged it): this attempt was interrupted, or finished just before,
        // and writes nothing; its completion would be refused anyway.
        debug!("stale attempt stopped; no completion");
        return;
    }
    let completion = settle(&shared, task, delivery.msg_id, report);
    // Boxed: only now allocated, instead of sizing the state every call in
    // flight holds by the completion it will build.
    Box::pin(hand_over(&shared, completion, series, permit, registration)).await;
}

/// Call `task`'s handler in the sandbox, interrupted by `cancel`; `None`
/// when the worker abandoned the call at shutdown (its message will be
/// reclaimed).
async fn call(
    shared: &Shared,
    task: &mut StartedTask,
    cancel: &CancelHandle,
) -> Option<CallReport> {
    // Boxed: the call's future is large, and unboxed it would make every
    // executor's future as large, copied whole each time one is spawned.
    tokio::select! {
        report = Box::pin(shared.sandbox.call(call_of(task), cancel)) => Some(report),
        () = shared.abandon.cancelled() => {
            cancel.cancel();
            warn!(task_id = %task.id, queue = %task.queue, task = %task.task,
                attempt = task.attempts, "abandoned at shutdown; the message will be reclaimed");
            None
        }
    }
}

/// The sandbox call of `task`. Built where it is moved, and the payload
/// moved out of the task rather than copied (the completion does not need
/// it): a local would stay in the executor's state while the call runs,
/// and a copy of the payload would be held by every call in flight.
fn call_of(task: &mut StartedTask) -> Call {
    Call {
        task: task.task.clone(),
        ctx: TaskContext {
            task_id: task.id.clone(),
            queue: logical_queue(&task.queue).to_owned(),
            task_name: task.task.clone(),
            attempt: task.attempts,
            max_attempts: task.max_attempts,
            idempotency_key: task.idempotency_key.clone(),
        },
        payload: std::mem::take(&mut task.payload),
        deadline: task.timeout_ms.map(Duration::from_millis),
    }
}

/// The completion of `task`'s attempt, delivered as `msg_id`, from what
/// its call `report`ed; the attempt's end is logged here.
fn settle(shared: &Shared, task: StartedTask, msg_id: String, report: CallReport) -> Completion {
    let flow = report.flow.map(|f| *f).unwrap_or_default();
    let waits = flow.wait && matches!(report.outcome, Outcome::Retryable(_) | Outcome::Fatal(_));
    let (kind, detail) = match classify(report.outcome) {
        (_, detail) if waits => (CompletionKind::Wait, detail),
        classified => classified,
    };
    if telemetry::enabled() {
        let outcome = super::completion::failure_label(kind, task.attempts, task.max_attempts);
        Span::current().record("outcome", outcome);
    }
    match kind {
        CompletionKind::Success => {
            debug!(elapsed_ms = report.elapsed.as_millis() as u64, "succeeded")
        }
        CompletionKind::Defer => debug!(error = %detail, "deferred"),
        CompletionKind::Wait => debug!(staged = flow.staged.len(), "waiting for its children"),
        _ => warn!(task_id = %task.id, queue = %task.queue, task = %task.task,
            attempt = task.attempts, error = %detail,
            outcome = super::completion::failure_label(kind, task.attempts, task.max_attempts),
            "attempt failed"),
    }
    let now = now_ms();
    // Only a retry reads its due time; the jitter's random draw is not
    // spent on the others.
    let retry_at = match kind {
        CompletionKind::Retry => now + backoff_ms(&shared.config, task.attempts),
        _ => 0,
    };
    let mut completion = completion_of(task, msg_id, kind, detail, report.log, now, retry_at);
    completion.digest = report.digest;
    completion.defer_limit_ms = shared.config.defer_limit_ms;
    if matches!(kind, CompletionKind::Success | CompletionKind::Wait) {
        completion.staged = flow.staged;
    }
    completion.op_staged = flow.op_staged;
    completion
}

/// What `/metrics` keeps of a handler call: its duration, and its trap's
/// class if it trapped. A call that found no handler ran nothing and counts
/// for neither (its attempt is deferred).
fn record_call(metrics: &WorkerMetrics, series: &TaskSeries, report: &CallReport) {
    if let Outcome::Trapped(trap) = &report.outcome {
        match TrapClass::of(trap) {
            Some(class) => metrics.count_trap(class),
            None => return,
        }
    }
    series.observe_call(report.elapsed);
}

/// Map a sandbox outcome to what the completion script takes.
fn classify(outcome: Outcome) -> (CompletionKind, String) {
    let retryable = outcome.is_retryable();
    match outcome {
        Outcome::Success(result) => (CompletionKind::Success, result),
        Outcome::Retryable(msg) => (CompletionKind::Retry, msg),
        Outcome::Fatal(msg) => (CompletionKind::Fatal, msg),
        Outcome::Trapped(Trap::Cancelled) => {
            (CompletionKind::Cancelled, "cancelled while running".into())
        }
        // Deployed but not (yet) runnable here: another worker, or this one
        // once it has loaded the handler, runs it.
        Outcome::Trapped(Trap::UnknownHandler(task)) => (
            CompletionKind::Defer,
            format!("waiting for a worker that has loaded the handler of {task:?}"),
        ),
        Outcome::Trapped(trap) if retryable => (CompletionKind::Retry, trap.to_string()),
        Outcome::Trapped(trap) => (CompletionKind::Fatal, trap.to_string()),
    }
}

/// Hand a completion to the completer, with the slot and the running-set
/// entry its task holds until it is written; `series` are its task's in
/// `/metrics`.
async fn hand_over(
    shared: &Shared,
    completion: Completion,
    series: Arc<TaskSeries>,
    slot: OwnedSemaphorePermit,
    registration: Registration,
) {
    let pending = Pending {
        completion,
        series,
        slot,
        registration,
    };
    // Boxed for the reason the sandbox call is.
    if let Err(refused) = Box::pin(shared.completions.send(pending)).await {
        let completion = &refused.0.completion;
        warn!(task_id = %completion.task_id, queue = %completion.queue,
            attempt = completion.attempt, "completer gone; the message will be reclaimed");
    }
}

/// The completion of `task`'s current attempt, delivered as `msg_id`,
/// written at `now` (ms since epoch).
fn completion_of(
    task: StartedTask,
    msg_id: String,
    kind: CompletionKind,
    detail: String,
    log: String,
    now: u64,
    retry_at: u64,
) -> Completion {
    Completion {
        queue: task.queue,
        task_id: task.id,
        msg_id,
        idempotency_key: task.idempotency_key,
        kind,
        detail,
        log,
        attempt: task.attempts,
        retry_at,
        defer_limit_ms: 0,
        now,
        digest: None,
        carried_at: task.carried_at,
        staged: Vec::new(),
        op_staged: false,
    }
}

/// Complete a task that `start` decided not to run (`permit` and
/// `registration` are held until the completion is written): one not
/// started before its expiry (EXPIRED),
/// or one whose worker died during its last attempt (a failed attempt, so
/// DEAD_LETTERED).
pub(super) async fn finish_unrun(
    shared: Arc<Shared>,
    delivery: Delivery,
    task: StartedTask,
    expired: bool,
    permit: OwnedSemaphorePermit,
    registration: Registration,
) {
    let series = shared.metrics.series(
        logical_queue(&task.queue),
        &shared.metrics.task_label(&task.task),
    );
    let (kind, detail) = if expired {
        (
            CompletionKind::Expired,
            "expired before it started".to_owned(),
        )
    } else {
        let detail = format!(
            "worker lost during attempt {} of {}",
            task.attempts, task.max_attempts
        );
        (CompletionKind::Lost, detail)
    };
    // Neither retries: a lost last attempt is dead-lettered.
    let completion = completion_of(
        task,
        delivery.msg_id,
        kind,
        detail,
        String::new(),
        now_ms(),
        0,
    );
    hand_over(&shared, completion, series, permit, registration).await;
}
