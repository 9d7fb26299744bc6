//! What the host tells a handler about the call it is running.

use crate::bindings::dtq::handler::types::TaskContext;

/// The task a handler call runs, as the host describes it.
///
/// ```
/// use dtq_guest::{Context, Result};
///
/// fn handle(ctx: Context, _payload: serde_json::Value) -> Result<String> {
///     Ok(format!("task {} attempt {}/{}", ctx.task_id, ctx.attempt, ctx.max_attempts))
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    /// The task's unique id, stable across retries.
    pub task_id: String,
    /// The queue the task was submitted to.
    pub queue: String,
    /// The task name; it selects the handler module.
    pub task_name: String,
    /// The attempt this call is, starting at 1.
    pub attempt: u32,
    /// Attempts the task has in all before it is dead-lettered.
    pub max_attempts: u32,
    /// The submission's idempotency key, if it carried one.
    pub idempotency_key: Option<String>,
    /// Milliseconds left before the host interrupts this call.
    pub deadline_ms: u64,
}

impl Context {
    /// Whether a retryable error from this call dead-letters the task instead
    /// of scheduling another attempt.
    ///
    /// ```
    /// let ctx = dtq_guest::Context {
    ///     task_id: "0197c1d2".into(),
    ///     queue: "billing".into(),
    ///     task_name: "send_receipt".into(),
    ///     attempt: 3,
    ///     max_attempts: 3,
    ///     idempotency_key: None,
    ///     deadline_ms: 30_000,
    /// };
    /// assert!(ctx.is_last_attempt());
    /// ```
    pub fn is_last_attempt(&self) -> bool {
        self.attempt >= self.max_attempts
    }
}

impl From<TaskContext> for Context {
    fn from(ctx: TaskContext) -> Self {
        Context {
            task_id: ctx.task_id,
            queue: ctx.queue,
            task_name: ctx.task_name,
            attempt: ctx.attempt,
            max_attempts: ctx.max_attempts,
            idempotency_key: ctx.idempotency_key,
            deadline_ms: ctx.deadline_ms,
        }
    }
}
