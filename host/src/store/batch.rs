//! Submitting many tasks with one round trip: the ingest script call of
//! each task, the very call [`Store::submit`] makes, all in one pipeline.
//!
//! Redis runs a pipeline's commands in order and each script atomically,
//! so a batch does what the same submissions made one after another would
//! do, less the round trips: a later task sees what an earlier one wrote
//! (two tasks with one key: the second finds the first in flight). A batch
//! is not atomic as a whole: other clients' commands may run between its
//! scripts, as they may between single submissions.
//!
//! The pipeline is read with `ignore_errors`, so an error reply to one
//! script is that task's outcome, not the batch's. A `NOSCRIPT` reply (the
//! scripts were flushed: a restart or a failover) ran nothing, so those
//! tasks, and only those, are sent once more after the scripts are loaded,
//! as [`redis::ScriptInvocation::invoke_async`] does for a single
//! submission. Nothing else is sent twice: a task whose script ran is never
//! resubmitted, which could make it a task of its own (no key) or find
//! itself in flight (a key).

use std::collections::HashSet;

use redis::{ErrorKind, RedisError, ScriptInvocation, ServerErrorKind, Value};

use super::{NewTask, Store, StoreError, SubmitOutcome, submit_outcome};

/// One task's reply: the script's, or the error Redis answered it with.
type Reply = Result<Vec<Value>, RedisError>;

impl Store {
    /// Submit `tasks` in one round trip (plus, once per queue and process,
    /// the queue's entry in [`super::QUEUES`]; plus one more for the tasks
    /// that met flushed scripts, if any did). One outcome per task, in
    /// order, each what [`Store::submit`] would have returned for it. The
    /// outer error is Redis failing for the whole pipeline (a lost
    /// connection, a timeout), after which any of the tasks may have been
    /// written.
    pub async fn submit_batch(
        &self,
        tasks: &[NewTask],
        max_depth: u64,
    ) -> Result<Vec<Result<SubmitOutcome, StoreError>>, StoreError> {
        if tasks.is_empty() {
            return Ok(Vec::new());
        }
        let mut queues = HashSet::new();
        for task in tasks {
            if queues.insert(task.queue.as_str()) {
                self.register_queue(&task.queue).await?;
            }
        }
        let calls: Vec<ScriptInvocation<'_>> = tasks
            .iter()
            .map(|task| self.ingest_call(task, max_depth))
            .collect();
        let mut replies = self.ingest_pipeline(calls.iter()).await?;
        let unrun: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Err(e) if is_noscript(e)))
            .collect();
        if !unrun.is_empty() {
            self.load_scripts().await?;
            let again = self
                .ingest_pipeline(unrun.iter().map(|&i| &calls[i]))
                .await?;
            for (i, reply) in unrun.into_iter().zip(again) {
                replies[i] = reply;
            }
        }
        Ok(replies
            .into_iter()
            .map(|reply| reply.map_err(StoreError::from).and_then(submit_outcome))
            .collect())
    }

    /// Send `calls` as one pipeline (one round trip); one reply per call.
    async fn ingest_pipeline<'a>(
        &self,
        calls: impl Iterator<Item = &'a ScriptInvocation<'a>>,
    ) -> Result<Vec<Reply>, StoreError> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for call in calls {
            pipe.invoke_script(call);
        }
        let sent = pipe.len();
        let replies: Vec<Value> = self
            .trip("submit_batch", pipe.query_async(&mut self.conn.clone()))
            .await?;
        if replies.len() != sent {
            return Err(StoreError::Protocol(format!(
                "a pipeline of {sent} submissions got {} replies",
                replies.len()
            )));
        }
        Ok(replies.into_iter().map(reply).collect())
    }
}

/// One pipeline reply as the task's: an error reply is its error.
fn reply(value: Value) -> Reply {
    match value {
        Value::ServerError(e) => Err(e.into()),
        other => Ok(redis::from_redis_value(other)?),
    }
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}
