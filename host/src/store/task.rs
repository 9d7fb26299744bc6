//! The task record as it is stored in its hash, and its statuses.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use serde_json::{Value, json};

use super::StoreError;

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskStatus {
    /// In the ready stream, waiting for a worker.
    Queued,
    /// Waiting in the delayed set for its first run.
    Scheduled,
    /// A worker runs it now.
    Running,
    /// Failed an attempt; waits in the delayed set for the next one.
    Retrying,
    /// The handler returned a result.
    Succeeded,
    /// The handler failed fatally.
    Failed,
    /// Every attempt failed; the task waits in the DLQ for an admin.
    DeadLettered,
    /// Cancelled before or while it ran.
    Cancelled,
    /// Not started before its expiry.
    Expired,
}

impl TaskStatus {
    /// Every status, for listings and tests.
    pub const ALL: [TaskStatus; 9] = [
        TaskStatus::Queued,
        TaskStatus::Scheduled,
        TaskStatus::Running,
        TaskStatus::Retrying,
        TaskStatus::Succeeded,
        TaskStatus::Failed,
        TaskStatus::DeadLettered,
        TaskStatus::Cancelled,
        TaskStatus::Expired,
    ];

    /// The status as stored and shown: `QUEUED`, `DEAD_LETTERED`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Queued => "QUEUED",
            TaskStatus::Scheduled => "SCHEDULED",
            TaskStatus::Running => "RUNNING",
            TaskStatus::Retrying => "RETRYING",
            TaskStatus::Succeeded => "SUCCEEDED",
            TaskStatus::Failed => "FAILED",
            TaskStatus::DeadLettered => "DEAD_LETTERED",
            TaskStatus::Cancelled => "CANCELLED",
            TaskStatus::Expired => "EXPIRED",
        }
    }

    /// Whether the task will not run again (short of an admin requeue).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Succeeded
                | TaskStatus::Failed
                | TaskStatus::DeadLettered
                | TaskStatus::Cancelled
                | TaskStatus::Expired
        )
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaskStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown task status {s:?}")))
    }
}

/// A task as stored in `dtq:task:{q}:<id>`.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    /// The task id (a UUIDv7: time-ordered).
    pub id: String,
    /// The queue it was submitted to.
    pub queue: String,
    /// The task name, which selects the handler.
    pub task: String,
    /// The payload, JSON text.
    pub payload: String,
    /// Where the task is in its life.
    pub status: TaskStatus,
    /// Attempts started so far.
    pub attempts: u32,
    /// Attempts allowed before dead-lettering.
    pub max_attempts: u32,
    /// Per-task deadline of one attempt (ms), when the submission set one.
    pub timeout_ms: Option<u64>,
    /// The submission's idempotency key.
    pub idempotency_key: Option<String>,
    /// The result (JSON text) of a succeeded task.
    pub result: Option<String>,
    /// The last error.
    pub error: Option<String>,
    /// The last attempt's captured log.
    pub log: Option<String>,
    /// When it was submitted (ms since epoch).
    pub created_at: u64,
    /// When it last changed (ms since epoch).
    pub updated_at: u64,
    /// When its last attempt started.
    pub started_at: Option<u64>,
    /// When it reached a terminal status.
    pub finished_at: Option<u64>,
    /// When it is due (scheduled tasks and retries).
    pub run_at: Option<u64>,
    /// When it expires if not started by then.
    pub expires_at: Option<u64>,
    /// The stream message of its current run.
    pub msg_id: Option<String>,
    /// Whether a cancel was requested while it ran.
    pub cancel_requested: bool,
    /// The digest (SHA-256) of the module each attempt ran, in order; `-`
    /// for an attempt whose worker died.
    pub attempt_digests: Vec<String>,
}

/// Field `name` of a task hash, which every task has.
pub(super) fn required(value: Option<String>, name: &str) -> Result<String, StoreError> {
    value.ok_or_else(|| StoreError::Corrupt(format!("task hash lacks field {name:?}")))
}

/// Numeric field `name` of a task hash, if present.
pub(super) fn number(value: Option<String>, name: &str) -> Result<Option<u64>, StoreError> {
    value
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                StoreError::Corrupt(format!("task field {name:?} is not a number: {v:?}"))
            })
        })
        .transpose()
}

impl TaskRecord {
    /// Parse a task hash as HGETALL returns it.
    pub fn from_fields(fields: HashMap<String, String>) -> Result<TaskRecord, StoreError> {
        let mut fields = fields;
        let mut take = |name: &str| fields.remove(name).filter(|v| !v.is_empty());
        let id = required(take("id"), "id")?;
        let status = required(take("status"), "status")?.parse()?;
        Ok(TaskRecord {
            queue: required(take("queue"), "queue")?,
            task: required(take("task"), "task")?,
            payload: required(take("payload"), "payload")?,
            status,
            attempts: number(take("attempts"), "attempts")?.unwrap_or(0) as u32,
            max_attempts: number(take("max_attempts"), "max_attempts")?.unwrap_or(1) as u32,
            timeout_ms: number(take("timeout_ms"), "timeout_ms")?,
            idempotency_key: take("idempotency_key"),
            result: take("result"),
            error: take("error"),
            log: take("log"),
            created_at: number(take("created_at"), "created_at")?.unwrap_or(0),
            updated_at: number(take("updated_at"), "updated_at")?.unwrap_or(0),
            started_at: number(take("started_at"), "started_at")?,
            finished_at: number(take("finished_at"), "finished_at")?,
            run_at: number(take("run_at"), "run_at")?,
            expires_at: number(take("expires_at"), "expires_at")?,
            msg_id: take("msg_id"),
            cancel_requested: take("cancel_requested").as_deref() == Some("1"),
            attempt_digests: take("digests")
                .map(|d| d.split(',').map(str::to_owned).collect())
                .unwrap_or_default(),
            id,
        })
    }

    /// Parse the flat `[name, value, ...]` list that scripts return.
    pub fn from_flat(flat: Vec<String>) -> Result<TaskRecord, StoreError> {
        let mut fields = HashMap::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            fields.insert(k, v);
        }
        TaskRecord::from_fields(fields)
    }

    /// The record as the API shows it: payload and result as JSON values.
    pub fn to_json(&self) -> Value {
        let parse = |text: &str| serde_json::from_str(text).unwrap_or(Value::String(text.into()));
        json!({
            "task_id": self.id,
            "queue": self.queue,
            "task": self.task,
            "status": self.status,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "timeout_ms": self.timeout_ms,
            "idempotency_key": self.idempotency_key,
            "payload": parse(&self.payload),
            "result": self.result.as_deref().map(parse),
            "error": self.error,
            "log": self.log,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "run_at": self.run_at,
            "expires_at": self.expires_at,
            "cancel_requested": self.cancel_requested,
            "handler_digest": self.handler_digest(),
            "attempt_digests": self.attempt_digests,
        })
    }

    /// The digest of the module the last attempt that ran used.
    pub fn handler_digest(&self) -> Option<&str> {
        self.attempt_digests
            .iter()
            .rev()
            .map(String::as_str)
            .find(|d| *d != "-")
    }
}
