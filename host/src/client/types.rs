//! The bodies the client sends and the answers it reads, where the server
//! has no public type of its own for them (its answers are mostly built
//! as JSON in the route handlers).
//!
//! An answer a client acts on has those fields typed; a task record, which
//! grows fields as the server does, keeps the rest as sent
//! ([`Task::fields`]), so that printing an answer shows all of it.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::store::TaskStatus;

/// A task as the API shows it (`GET /v1/queues/{q}/tasks/{id}`, a cancel,
/// a requeue): its id and status, and every other field as the server
/// sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// The task id.
    pub task_id: String,
    /// Where it is in its life.
    pub status: TaskStatus,
    /// The record's other fields (`queue`, `task`, `attempts`, `result`,
    /// `error`, `attempt_history`, ...), as sent.
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// The answer to a submission: the task (its record when the server has
/// it, else its id, queue and task name) and whether it was a replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    /// The task, new or the one the idempotency key named.
    #[serde(flatten)]
    pub task: Task,
    /// The idempotency key named a task already: this is that task.
    pub duplicate: bool,
}

/// The body of `POST /v1/queues/{q}/tasks/batch`: each item a single
/// submission's body. Items are sent as given, so that the server judges
/// each one (a bad item is refused alone, in its result).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BatchRequest<'a> {
    /// 1 to [`MAX_BATCH_ITEMS`](crate::ingest::MAX_BATCH_ITEMS) items.
    pub tasks: &'a [Value],
}

/// The answer to a batch: one result per item, in the items' order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchResults {
    /// The results.
    pub results: Vec<BatchResult>,
}

/// What a single submission of one item would have been answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchResult {
    /// Its HTTP status: 202 new, 200 replay, or an error's.
    pub status: u16,
    /// Its body: the task ([`Submitted`]) or the error body.
    pub body: Value,
}

/// Which tasks of a queue a listing asks for
/// ([`Client::tasks`](super::Client::tasks)): every one, newest first, by
/// default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskQuery<'a> {
    /// Only tasks of this status (any case).
    pub status: Option<&'a str>,
    /// Only tasks of this name, exactly.
    pub task: Option<&'a str>,
    /// Tasks per page, 1 to 1000 (the server's default 100).
    pub limit: Option<u32>,
    /// After this page: its `next_cursor`.
    pub cursor: Option<&'a str>,
}

/// One page of a queue's tasks, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskPage {
    /// The queue.
    pub queue: String,
    /// The status asked for, if any.
    pub status: Option<TaskStatus>,
    /// The task name asked for, if any (absent from older servers'
    /// answers).
    #[serde(default)]
    pub task: Option<String>,
    /// The tasks of the page, as sent.
    pub tasks: Vec<Value>,
    /// The cursor of the next page; `None` at the end.
    pub next_cursor: Option<String>,
}

/// Which dead-lettered tasks a bulk requeue or a purge works on: sent as
/// `{"ids": [..]}`, `{"all": true}` or `{"older_than_ms": n}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DlqSelection {
    /// These tasks.
    Ids(Vec<String>),
    /// Every task the DLQ holds when the request begins.
    All,
    /// Purge only: those dead-lettered more than this many ms ago.
    OlderThanMs(u64),
}

impl Serialize for DlqSelection {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = s.serialize_map(Some(1))?;
        match self {
            DlqSelection::Ids(ids) => map.serialize_entry("ids", ids)?,
            DlqSelection::All => map.serialize_entry("all", &true)?,
            DlqSelection::OlderThanMs(ms) => map.serialize_entry("older_than_ms", ms)?,
        }
        map.end()
    }
}

/// The answer to a purge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    /// Tasks removed from the DLQ.
    pub purged: u64,
}

/// The answer to a deploy: the active version now, and what it replaced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployed {
    /// The task.
    pub task: String,
    /// The module's SHA-256, hex.
    pub digest: String,
    /// The version's fingerprint (module and settings): what each worker
    /// reports it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Something the operator should know (the deploy went through).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// The other fields (`size`, `settings`, `unchanged`, `previous`, ...),
    /// as sent.
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// The deployed handlers and what each live process runs
/// (`GET /v1/handlers`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HandlerList {
    /// Each deployed task's active version, with how many workers run it.
    pub handlers: Vec<Value>,
    /// What each live worker reports.
    pub workers: Vec<crate::deploy::FleetReport>,
}

/// The body of a rollback.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RollbackRequest {
    /// The digest to return to; default: the newest different version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// The answer to an undeploy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Undeployed {
    /// The task.
    pub task: String,
    /// Whether it had an active version to remove.
    pub undeployed: bool,
}

/// The body of `PUT /v1/queues/{q}/schedules/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScheduleRequest {
    /// The cron expression: 5 fields, or 6 with seconds first; UTC.
    pub cron: String,
    /// The task each tick submits.
    pub task: String,
    /// The payload of each tick's task.
    pub payload: Value,
    /// Attempts of each task.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Deadline of one attempt, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The answer to a schedule's deletion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleDeleted {
    /// The queue.
    pub queue: String,
    /// The schedule.
    pub name: String,
    /// Always true (an unknown schedule is an error).
    pub deleted: bool,
}

/// The body of `PUT /v1/queues/{q}/partitions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PartitionsRequest {
    /// The new count, at least the present one.
    pub count: u32,
}

/// The answer to a partition count's raise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partitions {
    /// The queue.
    pub queue: String,
    /// The count in force now.
    pub partitions: u32,
    /// The count before.
    pub previous: u32,
}
