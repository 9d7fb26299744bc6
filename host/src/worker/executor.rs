//! One task through the sandbox, and its outcome mapped to a completion.
//!
//! | sandbox outcome | completion | status |
//! |---|---|---|
//! | `Success` | success | SUCCEEDED |
//! | `Fatal`, or a trap retrying cannot help ([`Outcome::is_retryable`]) | fatal | FAILED |
//! | `Retryable`, deadline, other traps | retry | RETRYING, or DEAD_LETTERED when attempts are spent |
//! | `Trapped(Cancelled)` | cancelled | CANCELLED |

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tracing::{Instrument, debug, info_span, warn};

use super::completion::{Pending, backoff_ms};
use super::{RunningTask, Shared};
use crate::ingest::now_ms;
use crate::sandbox::{Call, CancelHandle, Outcome, TaskContext, Trap};
use crate::store::{Completion, CompletionKind, Delivery, TaskRecord};

/// Run `task` on its own tokio task on the guest runtime (see
/// [`Shared::guests`]), holding `permit` until it is completed.
pub(super) fn spawn(
    shared: &Arc<Shared>,
    delivery: Delivery,
    task: TaskRecord,
    permit: OwnedSemaphorePermit,
) {
    let span = info_span!("task", task_id = %task.id, queue = %task.queue, task = %task.task, attempt = task.attempts);
    let run = execute(shared.clone(), delivery, task, permit).instrument(span);
    shared.guests.spawn(shared.tracker.track_future(run));
}

/// A task's entry in [`Shared::running`], removed however the executor ends
/// (even by a panic): an entry left behind would keep the heartbeat
/// refreshing a message nobody runs, and it would never be reclaimed.
struct Registration<'a> {
    shared: &'a Shared,
    task_id: String,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.shared.lock_running().remove(&self.task_id);
    }
}

async fn execute(
    shared: Arc<Shared>,
    delivery: Delivery,
    task: TaskRecord,
    permit: OwnedSemaphorePermit,
) {
    let cancel = CancelHandle::new();
    shared.lock_running().insert(
        task.id.clone(),
        RunningTask {
            queue: task.queue.clone(),
            msg_id: delivery.msg_id.clone(),
            cancel: cancel.clone(),
        },
    );
    let _registration = Registration {
        shared: &shared,
        task_id: task.id.clone(),
    };
    // A cancel requested between `start` and this registration would be
    // missed by the listener; the record tells.
    if task.cancel_requested {
        cancel.cancel();
    }
    let call = Call {
        task: task.task.clone(),
        ctx: TaskContext {
            task_id: task.id.clone(),
            queue: task.queue.clone(),
            task_name: task.task.clone(),
            attempt: task.attempts,
            max_attempts: task.max_attempts,
            idempotency_key: task.idempotency_key.clone(),
        },
        payload: task.payload.clone(),
        deadline: task.timeout_ms.map(Duration::from_millis),
    };
    let report = tokio::select! {
        report = shared.sandbox.call(call, &cancel) => report,
        () = shared.abandon.cancelled() => {
            cancel.cancel();
            warn!("abandoned at shutdown; the message will be reclaimed");
            return;
        }
    };
    let (kind, detail) = classify(report.outcome);
    match kind {
        CompletionKind::Success => {
            debug!(elapsed_ms = report.elapsed.as_millis() as u64, "succeeded")
        }
        _ => warn!(outcome = ?kind, error = %detail, "attempt failed"),
    }
    let retry_at = now_ms() + backoff_ms(&shared.config, task.attempts);
    let completion = completion_of(task, delivery.msg_id, kind, detail, report.log, retry_at);
    complete(&shared, completion).await;
    drop(permit);
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
        Outcome::Trapped(trap) if retryable => (CompletionKind::Retry, trap.to_string()),
        Outcome::Trapped(trap) => (CompletionKind::Fatal, trap.to_string()),
    }
}

/// Hand a completion to the completer and wait until it is written (or, past
/// the shutdown grace period, abandoned: then the message is reclaimed).
async fn complete(shared: &Shared, completion: Completion) {
    let (done, written) = tokio::sync::oneshot::channel();
    if shared
        .completions
        .send(Pending { completion, done })
        .await
        .is_err()
    {
        warn!("completer gone; the message will be reclaimed");
        return;
    }
    tokio::select! {
        _ = written => {}
        () = shared.abandon.cancelled() => {}
    }
}

/// The completion of `task`'s current attempt, delivered as `msg_id`.
fn completion_of(
    task: TaskRecord,
    msg_id: String,
    kind: CompletionKind,
    detail: String,
    log: String,
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
        now: now_ms(),
    }
}

/// Complete a task that `start` decided not to run, holding `permit` until
/// it is written: one not started before its expiry (EXPIRED), or one whose
/// worker died during its last attempt (a failed attempt, so DEAD_LETTERED).
pub(super) async fn finish_unrun(
    shared: Arc<Shared>,
    delivery: Delivery,
    task: TaskRecord,
    expired: bool,
    permit: OwnedSemaphorePermit,
) {
    let completion = if expired {
        let detail = "expired before it started".to_owned();
        completion_of(
            task,
            delivery.msg_id,
            CompletionKind::Expired,
            detail,
            String::new(),
            0,
        )
    } else {
        let detail = format!(
            "worker lost during attempt {} of {}",
            task.attempts, task.max_attempts
        );
        let log = task.log.clone().unwrap_or_default();
        completion_of(task, delivery.msg_id, CompletionKind::Retry, detail, log, 0)
    };
    complete(&shared, completion).await;
    drop(permit);
}
