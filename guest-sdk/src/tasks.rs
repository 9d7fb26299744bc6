//! Submit tasks from a handler, exactly once, and wait for children
//! (flows).
//!
//! A submission is *staged*: nothing reaches a queue while the handler
//! runs. The host applies what an attempt staged with its success (an `Ok`
//! result, or `Err(wait_for_children())`): an attempt that fails, panics or
//! is lost submits nothing, and one that succeeds submits each of its
//! tasks exactly once, however many times it ran before. Without a
//! [`key`](Submit::key), a submission is keyed by the running task and its
//! position (among the call's submissions, after those of the task's
//! earlier runs), so a retry stages the same tasks and gets the same ids
//! back, and a run after a wait submits new ones.
//!
//! The operator grants the queues and tasks a handler may submit to
//! (`dtq deploy --submit-to QUEUE[:TASK...]`, or the worker's
//! `--submit-to TASK=QUEUE[:TASK...]`); a handler is granted none by
//! default, and a submission without a grant is refused with a fatal
//! [`Refusal::InvalidArgument`](crate::Refusal::InvalidArgument) before the
//! handler returns. So are a bad name, key or number, a payload that is not
//! JSON, and a submission inside an [`idempotent_operation`](crate::idempotent_operation).
//!
//! # Fan out, then gather
//!
//! A parent submits its children with [`Submit::child`], then returns
//! `Err(`[`wait_for_children()`]`)`: the task goes `WAITING`, holding no
//! execution slot, and runs again (the same attempt) once every child has
//! ended. On that run [`children()`] lists them, with their results:
//!
//! ```no_run
//! use dtq_guest::{Context, Result, tasks};
//! use serde_json::json;
//!
//! fn sum_of_squares(_ctx: Context, numbers: Vec<i64>) -> Result<i64> {
//!     let children = tasks::children()?;
//!     if children.is_empty() {
//!         for n in &numbers {
//!             tasks::Submit::new("default", "square", &json!({ "n": n }))?
//!                 .child()
//!                 .send()?;
//!         }
//!         return Err(tasks::wait_for_children());
//!     }
//!     let mut sum = 0;
//!     for child in children {
//!         // A child that failed is reported, not hidden: the parent decides.
//!         let value = child.result.ok_or_else(|| {
//!             dtq_guest::Error::fatal(format!("child {} ended {}", child.task_id, child.status))
//!         })?;
//!         sum += value.as_i64().unwrap_or(0);
//!     }
//!     Ok(sum)
//! }
//! # fn main() {}
//! ```

use serde::Serialize;
use serde_json::Value;

use crate::bindings::dtq::handler::tasks as wit;
use crate::{Error, Result};

/// The message of the error [`wait_for_children`] returns.
pub const WAITING_FOR_CHILDREN: &str = "waiting for children";

/// Submit task `task` with `payload` to `queue`; returns the task's id.
/// The same as `Submit::new(queue, task, payload)?.send()`.
///
/// ```no_run
/// use dtq_guest::tasks;
///
/// # fn run() -> dtq_guest::Result<()> {
/// let id = tasks::submit("mail", "send_receipt", &serde_json::json!({"order": 42}))?;
/// # let _ = id; Ok(()) }
/// ```
pub fn submit(queue: &str, task: &str, payload: &impl Serialize) -> Result<String> {
    Submit::new(queue, task, payload)?.send()
}

/// A submission being built: [`Submit::new`], then options, then
/// [`send`](Submit::send).
#[derive(Debug, Clone)]
pub struct Submit {
    queue: String,
    task: String,
    payload: String,
    options: wit::SubmitOptions,
}

impl Submit {
    /// A submission of `task` with `payload` to `queue`. Fails (fatal) when
    /// the payload does not serialize to JSON.
    pub fn new(queue: &str, task: &str, payload: &impl Serialize) -> Result<Submit> {
        let payload = serde_json::to_string(payload)
            .map_err(|e| Error::fatal(format!("tasks.submit: the payload: {e}")))?;
        Ok(Submit {
            queue: queue.to_owned(),
            task: task.to_owned(),
            payload,
            options: wit::SubmitOptions {
                key: None,
                delay_ms: None,
                max_attempts: None,
                group: None,
                child: false,
            },
        })
    }

    /// Its idempotency key in its queue (instead of the one derived from
    /// the running task and the submission's position).
    pub fn key(mut self, key: impl Into<String>) -> Submit {
        self.options.key = Some(key.into());
        self
    }

    /// Run it no earlier than `ms` milliseconds after it is applied.
    pub fn delay_ms(mut self, ms: u64) -> Submit {
        self.options.delay_ms = Some(ms);
        self
    }

    /// Give it `n` attempts in all.
    pub fn max_attempts(mut self, n: u32) -> Submit {
        self.options.max_attempts = Some(n);
        self
    }

    /// Put it in `group`, for its queue's group limit.
    pub fn group(mut self, group: impl Into<String>) -> Submit {
        self.options.group = Some(group.into());
        self
    }

    /// Submit it as a child of the running task: [`children`] lists it,
    /// and a task waiting for its children ([`wait_for_children`]) runs
    /// again once all have ended.
    pub fn child(mut self) -> Submit {
        self.options.child = true;
        self
    }

    /// Stage it; returns its task id. A refusal (no grant, a bad name,
    /// key or number) is fatal; see the module's doc.
    pub fn send(self) -> Result<String> {
        wit::submit(&self.queue, &self.task, &self.payload, &self.options)
            .map_err(|e| Error::from_host("tasks.submit", e))
    }
}

/// One child of the running task, as it is now.
#[derive(Debug, Clone, PartialEq)]
pub struct Child {
    /// Its task id.
    pub task_id: String,
    /// Its queue.
    pub queue: String,
    /// Its task name.
    pub task: String,
    /// Its status: `QUEUED`, `RUNNING`, `SUCCEEDED`, `FAILED`,
    /// `DEAD_LETTERED`, `CANCELLED`, `EXPIRED`, ...; `REFUSED` when its
    /// submission was refused when applied (its key named a task of
    /// another payload), `MISSING` when its record is gone.
    pub status: String,
    /// Its result, once it succeeded.
    pub result: Option<Value>,
    /// Its error, once it failed (or its last, while it retries).
    pub error: Option<String>,
}

impl Child {
    /// Whether it succeeded.
    pub fn succeeded(&self) -> bool {
        self.status == "SUCCEEDED"
    }
}

/// The running task's children, in submission order; empty before any was
/// submitted (and applied: a child staged by this very call is not listed
/// yet). A child that failed is listed with its status and error.
pub fn children() -> Result<Vec<Child>> {
    let children = wit::children().map_err(|e| Error::from_host("tasks.children", e))?;
    children
        .into_iter()
        .map(|c| {
            let result = c
                .result
                .map(|text| serde_json::from_str(&text))
                .transpose()
                .map_err(|e| Error::retryable(format!("tasks.children: a result: {e}")))?;
            Ok(Child {
                task_id: c.task_id,
                queue: c.queue,
                task: c.task,
                status: c.status,
                result,
                error: c.error,
            })
        })
        .collect()
}

/// The error to return to wait for the running task's children: the
/// attempt ends with its submissions applied and the task `WAITING`; it
/// runs again, as the same attempt, once every child has ended.
///
/// ```no_run
/// # fn handler() -> dtq_guest::Result<()> {
/// return Err(dtq_guest::tasks::wait_for_children());
/// # }
/// ```
pub fn wait_for_children() -> Error {
    wit::wait_for_children();
    Error::retryable(WAITING_FOR_CHILDREN)
}
