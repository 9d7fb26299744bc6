//! The host side of the WIT `tasks` import (flows): submissions a handler
//! stages, its children, and its wish to wait for them.
//!
//! A submission is checked here, in full, while the handler can still
//! react to a refusal: the operator's grant ([`SubmitGrants`]), the names,
//! the key, the numbers, the payload's size and syntax. It is then only
//! staged, in the call's [`FlowCall`]; the worker writes what a call
//! staged with its completion, and applies it after (`store/flow.rs`).
//! Without a key of the handler's, a submission's key is derived from the
//! running task and its position: among the call's submissions, after
//! those its flow already holds (a run after a wait submits at new
//! positions), so that a re-run stages the same tasks, and its id from its
//! queue and key: a re-run gets the same ids back. On a partitioned queue
//! the id also names the partition the key is routed to when it is staged,
//! where the task is then submitted (unless a raise of the count moved the
//! key's record meanwhile, see `store/submit/route.rs`), so that the id
//! the handler is given finds the task.
//!
//! Inside an idempotent operation a submission belongs to the operation:
//! it is staged into the task's outbox when the operation commits (before
//! the commit's script, naming the operation's claim and this call's owner
//! token) and applies only once that claim is known to be committed by
//! this call, whatever becomes of the attempt after; an operation that
//! does not commit submits nothing (see `operation.rs`, `ingest/flow.rs`).
//! Its derived keys are scoped by the operation's key.

use serde::Serialize;

use super::imports::bindings::dtq::handler::tasks::{self, SubmitOptions};
use super::imports::bindings::dtq::handler::types::HostError;
use super::imports::{HostCtx, HostResult};
use crate::ingest::{
    MAX_ATTEMPTS_LIMIT, MAX_BATCH_BODY_BYTES, MAX_BATCH_ITEMS, MAX_DELAY_MS, validate_group,
    validate_idempotency_key, validate_queue_name, validate_task_name,
};
use crate::store::{Partitioning, Staged, StoreError, partitioned_id, task_ref};

/// The queues, and the tasks in each, a handler may submit to: the
/// operator's grant (`dtq deploy --submit-to`, the worker's `--submit-to
/// TASK=QUEUE[:TASK...]`). Empty, the default: none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SubmitGrants(Vec<SubmitGrant>);

/// One queue of a [`SubmitGrants`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SubmitGrant {
    /// The queue.
    pub queue: String,
    /// The tasks it may submit there; empty: any.
    pub tasks: Vec<String>,
}

impl SubmitGrants {
    /// Parse `QUEUE[:TASK...]`, comma-separated: `orders:pick:charge,mail`
    /// grants tasks `pick` and `charge` of queue `orders`, and any task of
    /// queue `mail`.
    pub fn parse(text: &str) -> Result<SubmitGrants, String> {
        let mut grants = SubmitGrants::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            grants.add(item)?;
        }
        Ok(grants)
    }

    /// Add one `QUEUE[:TASK...]`.
    pub fn add(&mut self, item: &str) -> Result<(), String> {
        let mut parts = item.split(':');
        let queue = parts.next().unwrap_or_default();
        validate_queue_name(queue).map_err(|e| format!("{item:?}: {e}"))?;
        let tasks: Vec<String> = parts.map(str::to_owned).collect();
        for task in &tasks {
            validate_task_name(task).map_err(|e| format!("{item:?}: {e}"))?;
        }
        match self.0.iter_mut().find(|g| g.queue == queue) {
            // Any task stays any task.
            Some(g) if g.tasks.is_empty() || tasks.is_empty() => g.tasks.clear(),
            Some(g) => g.tasks.extend(tasks),
            None => self.0.push(SubmitGrant {
                queue: queue.to_owned(),
                tasks,
            }),
        }
        Ok(())
    }

    /// Add every grant of `other`.
    pub fn extend(&mut self, other: &SubmitGrants) {
        for g in &other.0 {
            let item = std::iter::once(g.queue.as_str())
                .chain(g.tasks.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(":");
            // Checked when `other` was made.
            let _ = self.add(&item);
        }
    }

    /// Whether task `task` may be submitted to queue `queue`.
    pub fn allows(&self, queue: &str, task: &str) -> bool {
        self.0
            .iter()
            .any(|g| g.queue == queue && (g.tasks.is_empty() || g.tasks.iter().any(|t| t == task)))
    }

    /// Whether nothing is granted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Most bytes of submissions one call may stage (operations included): a
/// batch's body's worth, so that no handler makes its worker hold more.
const MAX_STAGED_BYTES: usize = MAX_BATCH_BODY_BYTES;

/// Children read per host call `children` counts: a parent of many
/// children pays for reading them out of its host-call budget.
const CHILDREN_PER_HOST_CALL: usize = 100;

/// What one call staged, and whether it asked to wait for its children.
#[derive(Debug, Default)]
pub(crate) struct FlowCall {
    /// The staged submissions, as the flow's outbox keeps them (JSON).
    pub(crate) staged: Vec<String>,
    /// Bytes of every submission staged (operations' too).
    pub(crate) bytes: usize,
    /// Where the call's derived positions start: the positions the task's
    /// flow had given when the call first submitted without a key (read
    /// once), so that a run after a wait does not reuse an earlier run's
    /// keys, while a retry of a run that staged nothing reads the same.
    pub(crate) base: Option<u64>,
    /// Whether the handler asked to wait for its children.
    pub(crate) wait: bool,
    /// Whether an operation staged submissions into the task's outbox.
    pub(crate) op_staged: bool,
    /// The partitioning of each queue submitted to, as read on the call's
    /// first submission to it.
    pub(crate) partitionings: Vec<(String, Partitioning)>,
}

impl tasks::Host for HostCtx {
    async fn submit(
        &mut self,
        queue: String,
        task: String,
        payload: String,
        options: SubmitOptions,
    ) -> HostResult<String> {
        self.count()?;
        let derives = options.key.is_none() && self.operation.is_none();
        if derives && self.flow.as_ref().is_none_or(|f| f.base.is_none()) {
            let (queue, id) = (self.caller.queue.clone(), self.caller.task_id.clone());
            let base = crate::store::flow_positions(self.redis(), &queue, &id).await;
            let base = match base {
                Ok(base) => base,
                Err(e) => return Ok(Err(store_error(e))),
            };
            self.flow.get_or_insert_with(Default::default).base = Some(base);
        }
        Ok(self.stage_submission(queue, task, payload, options).await)
    }

    async fn children(&mut self) -> HostResult<Vec<tasks::Child>> {
        self.count()?;
        let (queue, id) = (self.caller.queue.clone(), self.caller.task_id.clone());
        let children = crate::store::children(self.redis(), &queue, &id).await;
        if let Ok(children) = &children {
            for _ in 0..children.len() / CHILDREN_PER_HOST_CALL {
                self.count()?;
            }
        }
        Ok(match children {
            Ok(children) => Ok(children
                .into_iter()
                .map(|c| tasks::Child {
                    task_id: c.task_id,
                    queue: c.queue,
                    task: c.task,
                    status: c.status,
                    result: c.result,
                    error: c.error,
                })
                .collect()),
            Err(e) => Err(store_error(e)),
        })
    }

    async fn wait_for_children(&mut self) -> wasmtime::Result<()> {
        self.count()?;
        self.flow.get_or_insert_with(Default::default).wait = true;
        Ok(())
    }
}

impl HostCtx {
    /// Check a submission and stage it; its id, or why it is refused.
    async fn stage_submission(
        &mut self,
        queue: String,
        task: String,
        payload: String,
        options: SubmitOptions,
    ) -> Result<String, HostError> {
        let invalid = |e: crate::ingest::IngestError| HostError::InvalidArgument(e.to_string());
        validate_queue_name(&queue).map_err(invalid)?;
        validate_task_name(&task).map_err(invalid)?;
        if !self.handler.submit_to.allows(&queue, &task) {
            return Err(HostError::InvalidArgument(format!(
                "not granted: this handler may not submit task {task:?} to queue {queue:?} \
                 (the operator grants it with the deploy setting submit_to, or the worker's \
                 --submit-to {}={queue}:{task})",
                self.handler.task
            )));
        }
        if payload.len() > self.handler.limits.max_payload_bytes {
            return Err(HostError::ValueTooLarge(payload.len() as u64));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&payload) {
            return Err(HostError::InvalidArgument(format!(
                "the payload is not JSON: {e}"
            )));
        }
        check_options(&options)?;
        let key = self.submission_key(options.key)?;
        let partition = self.partition_of(&queue, &key).await?;
        let id = partitioned_id(&crate::base::derived_task_id(&queue, &key), partition);
        let parent = options
            .child
            .then(|| task_ref(&self.caller.queue, &self.caller.task_id));
        let staged = Staged {
            queue,
            task,
            payload,
            key,
            id: id.clone(),
            delay_ms: options.delay_ms,
            max_attempts: options.max_attempts,
            group: options.group,
            parent,
            claim: None,
            owner: None,
        };
        let size = staged.payload.len() + staged.key.len() + staged.queue.len() + 128;
        let flow = self.flow.get_or_insert_with(Default::default);
        if flow.bytes + size > MAX_STAGED_BYTES {
            return Err(HostError::ValueTooLarge((flow.bytes + size) as u64));
        }
        flow.bytes += size;
        // An operation's submissions are staged when it commits.
        if let Some(op) = &mut self.operation {
            op.submissions.push(staged);
            return Ok(id);
        }
        let json = serde_json::to_string(&staged)
            .map_err(|e| HostError::InvalidArgument(e.to_string()))?;
        flow.staged.push(json);
        Ok(id)
    }
}

impl HostCtx {
    /// The partition of `queue` a submission keyed `key` goes to, as
    /// `ingest` would route it now: its id names it, so that the id the
    /// handler is given finds the task. The queue's partitioning is read
    /// once per call.
    async fn partition_of(&mut self, queue: &str, key: &str) -> Result<u32, HostError> {
        let conn = self.redis().clone();
        let known = &mut self.flow.get_or_insert_with(Default::default).partitionings;
        let at = match known.iter().position(|(q, _)| q == queue) {
            Some(at) => at,
            None => {
                let part = crate::store::read_partitioning(&conn, queue)
                    .await
                    .map_err(store_error)?;
                known.push((queue.to_owned(), part));
                known.len() - 1
            }
        };
        let now = crate::base::now_ms();
        crate::store::place_of_key(&conn, queue, &known[at].1, key, now, None)
            .await
            .map_err(store_error)
    }

    /// The key of the next submission: the handler's `given` one, checked,
    /// or one derived from the task and the position (the operation's own
    /// positions under its key, inside one).
    fn submission_key(&self, given: Option<String>) -> Result<String, HostError> {
        let (position, scope, base) = match &self.operation {
            Some(op) => (
                op.submissions.len(),
                format!("op:{}:", key_digest(op.key())),
                0,
            ),
            None => (
                self.flow.as_ref().map_or(0, |f| f.staged.len()),
                String::new(),
                self.flow.as_ref().and_then(|f| f.base).unwrap_or(0),
            ),
        };
        if position >= MAX_BATCH_ITEMS {
            return Err(HostError::InvalidArgument(format!(
                "a call (or an operation) may stage at most {MAX_BATCH_ITEMS} submissions"
            )));
        }
        match given {
            Some(key) => {
                validate_idempotency_key(&key)
                    .map_err(|e| HostError::InvalidArgument(e.to_string()))?;
                Ok(key)
            }
            // The parent and the position: the same on every run that
            // stages the same submissions in the same order.
            None => Ok(format!(
                "dtq.flow:{}:{scope}{}",
                self.caller.task_id,
                base + position as u64
            )),
        }
    }
}

/// What a handler is told of a failed read of the host's own records
/// (its flow, its children, a queue's partitioning): `unavailable`, also
/// for a record of the wrong type, which is no value of the handler's.
fn store_error(e: StoreError) -> HostError {
    HostError::Unavailable(e.to_string())
}

/// The first 16 hex digits of the SHA-256 of an operation's key: a
/// derived submission key of bounded length.
fn key_digest(key: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(key.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Check a submission's numbers and group, as a submission from the API.
fn check_options(options: &SubmitOptions) -> Result<(), HostError> {
    let invalid = |e: crate::ingest::IngestError| HostError::InvalidArgument(e.to_string());
    if let Some(n) = options.max_attempts
        && !(1..=MAX_ATTEMPTS_LIMIT).contains(&n)
    {
        return Err(HostError::InvalidArgument(format!(
            "max_attempts must be 1 to {MAX_ATTEMPTS_LIMIT}, not {n}"
        )));
    }
    if let Some(ms) = options.delay_ms
        && ms > MAX_DELAY_MS
    {
        return Err(HostError::InvalidArgument(format!(
            "delay_ms must be at most {MAX_DELAY_MS}, not {ms}"
        )));
    }
    if let Some(group) = &options.group {
        validate_group(group).map_err(invalid)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::SubmitGrants;

    #[test]
    fn grants_name_queues_and_their_tasks() {
        let grants = SubmitGrants::parse("orders:pick:charge, mail").expect("valid");
        assert!(grants.allows("orders", "pick"));
        assert!(grants.allows("orders", "charge"));
        assert!(!grants.allows("orders", "refund"));
        assert!(grants.allows("mail", "anything"));
        assert!(!grants.allows("billing", "pick"));
        assert!(SubmitGrants::default().is_empty());
        assert!(!SubmitGrants::default().allows("orders", "pick"));
        assert!(SubmitGrants::parse("bad queue").is_err());
        assert!(SubmitGrants::parse("orders:bad/task").is_err());
    }

    #[test]
    fn a_queue_granted_whole_stays_whole() {
        let mut grants = SubmitGrants::parse("orders").expect("valid");
        grants.add("orders:pick").expect("valid");
        assert!(grants.allows("orders", "charge"));
    }
}
