//! The values the store's operations take and return.

use redis::Value;

use super::task::{number, required};
use super::{StoreError, TaskRecord, TaskStatus};

/// A task to create, as validated by [`crate::ingest`].
#[derive(Debug, Clone)]
pub struct NewTask {
    /// A fresh task id.
    pub id: String,
    /// The queue.
    pub queue: String,
    /// The task name.
    pub task: String,
    /// The payload, JSON text.
    pub payload: String,
    /// sha256 of task name and canonical payload, to detect key reuse.
    pub fingerprint: String,
    /// The submission's idempotency key.
    pub idempotency_key: Option<String>,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Deadline of one attempt (ms), if set.
    pub timeout_ms: Option<u64>,
    /// Submission time (ms since epoch).
    pub now: u64,
    /// Due time (ms since epoch); later than `now` schedules the task.
    pub run_at: u64,
    /// Expiry (ms since epoch) if not started by then.
    pub expires_at: Option<u64>,
    /// The group it belongs to, for a group limit (`store::limits`).
    pub group: Option<String>,
    /// The W3C `traceparent` of the submission (see [`crate::telemetry`]):
    /// the parent of the task's attempts' spans. Set only when the API
    /// traces or the submitter sent one, so that other tasks cost nothing.
    pub traceparent: Option<String>,
    /// The task that submitted it as its child (flows), `<queue>/<id>`.
    pub parent: Option<String>,
}

/// What a submission did.
#[derive(Debug, Clone)]
pub enum SubmitOutcome {
    /// A new task.
    Created {
        /// QUEUED or SCHEDULED.
        status: TaskStatus,
    },
    /// The key's task is terminal: the stored task, no new one.
    Replay(Box<TaskRecord>),
    /// The key's task is still in flight.
    InProgress {
        /// The in-flight task.
        task_id: String,
    },
    /// The key was used for another payload or task name.
    KeyMismatch {
        /// The key's task.
        task_id: String,
    },
    /// The queue is at its depth limit.
    QueueFull {
        /// Ready plus delayed tasks.
        depth: u64,
    },
}

/// A stream message: which task it delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The stream entry id (needed to ACK).
    pub msg_id: String,
    /// The task id it carries.
    pub task_id: String,
    /// The task itself, when the message carries it (a first delivery of a
    /// task submitted to run now, without an expiry; see
    /// `store/carried.rs`): it runs as attempt 1 with no `start` script.
    /// Only a fresh read sets it: a reclaimed message always goes through
    /// `start`.
    pub carried: Option<Box<StartedTask>>,
}

/// What `start` decided for one delivery.
#[derive(Debug, Clone)]
pub enum StartDecision {
    /// Run it: the task, now RUNNING with its attempt counted.
    Run(StartedTask),
    /// Terminal or gone; acknowledged already.
    Skip(String),
    /// Not started before its expiry; complete it as expired.
    Expired(StartedTask),
    /// Its worker died with no attempts left; dead-letter it.
    Exhausted(StartedTask),
    /// Its record is not a readable task: `start` dead-lettered it alone
    /// (DEAD_LETTERED, in the DLQ, with this error) and acknowledged its
    /// message.
    Corrupt(String),
}

/// What a worker needs of a task to run and complete one attempt: the part
/// of its record `start` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartedTask {
    /// The task id.
    pub id: String,
    /// Its queue.
    pub queue: String,
    /// The task name, which selects the handler.
    pub task: String,
    /// The payload, JSON text.
    pub payload: String,
    /// Attempts started, this one included.
    pub attempts: u32,
    /// Attempts allowed before dead-lettering.
    pub max_attempts: u32,
    /// Deadline of one attempt (ms), when the submission set one.
    pub timeout_ms: Option<u64>,
    /// The submission's idempotency key.
    pub idempotency_key: Option<String>,
    /// Whether a cancel was requested (while it ran, or just now).
    pub cancel_requested: bool,
    /// When a carried attempt started (ms since epoch): the attempt no
    /// `start` wrote, which its completion writes (see `Delivery::carried`).
    pub carried_at: Option<u64>,
    /// The submission's W3C `traceparent`, when it was stored: the parent
    /// of the attempt's span.
    pub traceparent: Option<String>,
}

impl StartedTask {
    /// Take the task `start` returns from its flat reply: the values of
    /// `RETURNED` in `start.lua`, in that order, nil where the hash lacks a
    /// field.
    pub(super) fn from_reply(
        queue: &str,
        id: &str,
        reply: &mut impl Iterator<Item = Value>,
    ) -> Result<Self, StoreError> {
        let mut next = || -> Result<Option<String>, StoreError> {
            let v = reply.next().ok_or_else(|| {
                StoreError::Protocol(format!("start's reply ends inside task {id}"))
            })?;
            Ok(redis::from_redis_value(v)?)
        };
        let attempts = next()?;
        let max_attempts = next()?;
        let task = next()?;
        let payload = next()?;
        let timeout_ms = next()?;
        let idempotency_key = next()?;
        let cancel_requested = next()?;
        let traceparent = next()?;
        Ok(StartedTask {
            id: id.to_owned(),
            queue: queue.to_owned(),
            task: required(task, "task")?,
            payload: required(payload, "payload")?,
            attempts: number(attempts, "attempts")?.unwrap_or(0) as u32,
            max_attempts: number(max_attempts, "max_attempts")?.unwrap_or(1) as u32,
            timeout_ms: number(timeout_ms, "timeout_ms")?,
            idempotency_key: idempotency_key.filter(|k| !k.is_empty()),
            cancel_requested: cancel_requested.as_deref() == Some("1"),
            carried_at: None,
            traceparent,
        })
    }
}

/// How an attempt ended, as the completion script takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// The handler returned a result.
    Success,
    /// A permanent failure.
    Fatal,
    /// A transient failure: retry while attempts remain, else dead-letter.
    Retry,
    /// Interrupted by a cancel.
    Cancelled,
    /// Its worker died during the attempt: a failed attempt like
    /// [`CompletionKind::Retry`] that left no log, so the task's log (an
    /// earlier attempt's) is left as it is.
    Lost,
    /// Not started before its expiry.
    Expired,
    /// Not run: this worker has no handler for the task (not loaded yet,
    /// or it cannot run it). The attempt is given back and the task waits,
    /// SCHEDULED, for any worker, after a backoff of its own, and ends
    /// FAILED once it has waited past the defer limit (see `complete.lua`).
    Defer,
    /// The handler asked to wait for its children (flows): the attempt
    /// ends with the task WAITING, its staged submissions applied, and the
    /// task resumes, as the same attempt, once its children are terminal.
    Wait,
}

impl CompletionKind {
    /// The outcome's name in the `complete` script's ARGV (and in logs).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CompletionKind::Success => "success",
            CompletionKind::Fatal => "fatal",
            CompletionKind::Retry => "retry",
            CompletionKind::Cancelled => "cancelled",
            CompletionKind::Lost => "lost",
            CompletionKind::Expired => "expired",
            CompletionKind::Defer => "defer",
            CompletionKind::Wait => "wait",
        }
    }
}

/// One completion to write.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The task's queue.
    pub queue: String,
    /// The task.
    pub task_id: String,
    /// Its stream message ("" for a task not in the stream).
    pub msg_id: String,
    /// The task's idempotency key.
    pub idempotency_key: Option<String>,
    /// How the attempt ended.
    pub kind: CompletionKind,
    /// The result (JSON) for success, else the error message.
    pub detail: String,
    /// The attempt's captured log (ignored for [`CompletionKind::Lost`]).
    pub log: String,
    /// The attempt this completes (0 for expiry, which has none).
    pub attempt: u32,
    /// When a retry is due (ms since epoch): read for a retry or a lost
    /// attempt only.
    pub retry_at: u64,
    /// How long (ms) a task may wait for a handler before it ends FAILED
    /// (`--defer-limit-ms`; 0: no bound): read for a
    /// [`CompletionKind::Defer`] only (see `complete.lua`).
    pub defer_limit_ms: u64,
    /// Now (ms since epoch).
    pub now: u64,
    /// The digest of the module the attempt ran, when one did.
    pub digest: Option<std::sync::Arc<str>>,
    /// When the attempt started, for a carried attempt (see
    /// [`StartedTask::carried_at`]); `None` for one `start` began.
    pub carried_at: Option<u64>,
    /// The submissions the attempt staged (flows; JSON, see
    /// [`Staged`](super::Staged)), applied with a success or a wait and
    /// dropped with any other outcome.
    pub staged: Vec<String>,
    /// Whether the attempt staged submissions of an idempotent operation
    /// into the task's outbox before its commit (they apply once the
    /// commit is known, whatever the attempt's outcome).
    pub op_staged: bool,
}

impl Completion {
    /// Whether the completion writes its task's flow: a wait, or a success
    /// that staged submissions.
    pub(crate) fn stages(&self) -> bool {
        match self.kind {
            CompletionKind::Wait => true,
            CompletionKind::Success => !self.staged.is_empty(),
            _ => false,
        }
    }

    /// The outcome's name in the `complete` script's ARGV: a success that
    /// staged submissions is `staged`.
    pub(crate) fn outcome(&self) -> &'static str {
        if self.kind == CompletionKind::Success && !self.staged.is_empty() {
            "staged"
        } else {
            self.kind.as_str()
        }
    }
}

/// What a completion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompleteOutcome {
    /// Written; the task's new status.
    Done(TaskStatus),
    /// Written, and the task, which has a parent (flows), ended: the
    /// parent (`<queue>/<id>`) is told next (`Store::settle_child`).
    Ended {
        /// The task's new status.
        status: TaskStatus,
        /// Its parent.
        parent: String,
    },
    /// The task was no longer this attempt's (reclaimed, or completed
    /// already); nothing written. Carries the status found.
    Stale(String),
}

/// What a cancel did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The task was waiting and is now CANCELLED.
    Cancelled,
    /// The task is running; its worker was asked to interrupt it.
    Requested,
    /// The task is already terminal.
    Terminal(TaskStatus),
    /// No such task.
    NotFound,
}

/// What a DLQ requeue did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequeueOutcome {
    /// The task left the DLQ and is QUEUED again.
    Requeued,
    /// The task is not dead-lettered: its status.
    NotDeadLettered(TaskStatus),
    /// No such task.
    NotFound,
    /// The task's idempotency key names another task now: this one stays
    /// dead-lettered (one key, one live task).
    KeyTaken {
        /// The task the key names.
        task_id: String,
    },
}

/// Counts of one queue.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueStats {
    /// The queue.
    pub queue: String,
    /// Tasks in the ready stream not yet delivered to a worker.
    pub ready: u64,
    /// Delivered and not acknowledged: running, or held by a dead worker.
    pub running: u64,
    /// Scheduled tasks and retries.
    pub delayed: u64,
    /// Parents WAITING for their children (flows): acknowledged, holding
    /// no slot, counted in none of the above.
    pub waiting: u64,
    /// Dead-lettered tasks.
    pub dead_lettered: u64,
    /// Partitions the queue is spread over (see `store::partitions`); the
    /// counts above are their sums.
    pub partitions: u32,
    /// Whether the queue is paused: it takes submissions, but no worker
    /// starts its tasks (see `store::pause`).
    pub paused: bool,
}
