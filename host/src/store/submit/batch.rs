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
//! itself in flight (a key). The same holds for tasks that `ingest.lua`
//! refused, writing nothing, because the queue's partition count was not
//! the one they were routed by: they are routed again and sent again, and
//! for keyed tasks that met a forward (`dlq.rs`): they are sent again to
//! the partition it names.

use redis::{ErrorKind, RedisError, ScriptInvocation, ServerErrorKind, Value};

use super::{
    Ingested, NewTask, Store, StoreError, SubmitOutcome, follow_forward, ingested, partition_of_id,
};

/// One task's reply: the script's, or the error Redis answered it with.
type Reply = Result<Vec<Value>, RedisError>;

impl Store {
    /// Submit `tasks`, all of one queue, in one round trip (plus, once per
    /// queue and process, the queue's entry in [`QUEUES`](crate::store::QUEUES) and its
    /// partition count; plus one more for the tasks that met flushed
    /// scripts or a raised partition count, if any did). Each task is
    /// routed to its partition as [`Store::submit`] routes it; on a cluster
    /// each partition's tasks go as a pipeline of their own, all at once.
    /// One outcome per task, in order, each what [`Store::submit`] would
    /// have returned for it. The outer error is Redis failing for a whole
    /// pipeline (a lost connection, a timeout), after which any of the
    /// tasks may have been written.
    pub async fn submit_batch(
        &self,
        tasks: &mut [NewTask],
        max_depth: u64,
    ) -> Result<Vec<Result<SubmitOutcome, StoreError>>, StoreError> {
        let Some(first) = tasks.first() else {
            return Ok(Vec::new());
        };
        let queue = first.queue.clone();
        if tasks.iter().any(|t| t.queue != queue) {
            return Err(StoreError::Protocol(
                "a batch holds the tasks of one queue".into(),
            ));
        }
        self.register_queue(&queue).await?;
        let mut part = self.known_partitioning(&queue).await?;
        let mut outcomes: Vec<Option<Result<SubmitOutcome, StoreError>>> =
            (0..tasks.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..tasks.len()).collect();
        let mut pinned: Vec<Option<u32>> = vec![None; tasks.len()];
        let mut forwards = vec![0; tasks.len()];
        for round in 0.. {
            for &i in &pending {
                self.route(&mut tasks[i], &part, pinned[i], None).await?;
            }
            let calls: Vec<ScriptInvocation<'_>> = pending
                .iter()
                .map(|&i| self.ingest_call(&tasks[i], part.count, max_depth))
                .collect();
            let replies = self.ingest_pipelines(&calls, &pending, tasks).await?;
            drop(calls);
            let (mut unrun, mut flushed, mut repartitioned) = (Vec::new(), false, None);
            for (i, reply) in pending.into_iter().zip(replies) {
                match reply {
                    Err(e) if is_noscript(&e) => {
                        flushed = true;
                        unrun.push(i);
                    }
                    Err(e) => outcomes[i] = Some(Err(e.into())),
                    Ok(reply) => match ingested(reply) {
                        Ok(Ingested::Done(outcome)) => outcomes[i] = Some(Ok(outcome)),
                        Ok(Ingested::Repartitioned(found)) => {
                            repartitioned = repartitioned.max(Some(found));
                            unrun.push(i);
                        }
                        Ok(Ingested::Forwarded(to)) => {
                            match follow_forward(&tasks[i], to, &mut forwards[i]) {
                                Ok(to) => {
                                    pinned[i] = Some(to);
                                    unrun.push(i);
                                }
                                Err(e) => outcomes[i] = Some(Err(e)),
                            }
                        }
                        Err(e) => outcomes[i] = Some(Err(e)),
                    },
                }
            }
            if unrun.is_empty() {
                break;
            }
            // Those ran nothing: send them again once the scripts are
            // loaded or the partitioning read again.
            if flushed {
                self.load_scripts().await?;
            }
            if let Some(found) = repartitioned {
                part = self
                    .reread_partitioning(&queue, &part, found, round)
                    .await?;
            }
            pending = unrun;
        }
        outcomes
            .into_iter()
            .map(|o| o.ok_or_else(|| StoreError::Protocol("a batch item got no outcome".into())))
            .collect()
    }

    /// Send `calls` (the calls of tasks `which` of `tasks`): as one
    /// pipeline on a single server, one round trip; on a cluster one
    /// pipeline per partition, all at once. One reply per call, in order.
    async fn ingest_pipelines(
        &self,
        calls: &[ScriptInvocation<'_>],
        which: &[usize],
        tasks: &[NewTask],
    ) -> Result<Vec<Reply>, StoreError> {
        if !self.backend.is_cluster() {
            return self.ingest_pipeline(calls.iter()).await;
        }
        let mut groups: Vec<(u32, Vec<usize>)> = Vec::new();
        for (at, &i) in which.iter().enumerate() {
            let partition = partition_of_id(&tasks[i].id);
            match groups.iter_mut().find(|(p, _)| *p == partition) {
                Some((_, group)) => group.push(at),
                None => groups.push((partition, vec![at])),
            }
        }
        let replies = futures::future::try_join_all(
            groups
                .iter()
                .map(|(_, group)| self.ingest_pipeline(group.iter().map(|&at| &calls[at]))),
        )
        .await?;
        let mut out: Vec<Option<Reply>> = (0..calls.len()).map(|_| None).collect();
        for ((_, group), replies) in groups.iter().zip(replies) {
            for (&at, reply) in group.iter().zip(replies) {
                out[at] = Some(reply);
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| StoreError::Protocol("a submission got no reply".into())))
            .collect()
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
