//! Applying the submissions a handler staged (flows, see `store/flow.rs`):
//! each through the ordinary submission, with every rule of a submission
//! from the API (names, numbers, the queue's depth, the idempotency
//! record), under its key, then recorded in its parent's flow.

use tracing::{debug, warn};

use super::{IngestError, IngestSettings, SubmitRequest, prepare};
use crate::store::{ClaimOutcome, FlowState, Staged, Store, StoreError, SubmitOutcome, task_ref};

/// What became of a flow's outbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Submissions applied (new tasks, replays, and refusals recorded).
    pub applied: usize,
    /// Submissions left in the outbox for now: their queue is full, or
    /// their operation is still open.
    pub held: usize,
    /// Whether the parent resumed.
    pub resumed: bool,
    /// Tasks of a cancelled parent's flow (its children, and theirs)
    /// cancelled by this look: those its canceller did not reach
    /// ([`repair`]).
    pub cancelled: usize,
}

/// How long after a parent's cancel the sweeper may cancel its children:
/// until then its canceller (`POST .../cancel`) is still at it, and its
/// answer lists the children it cancelled.
const CANCEL_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Apply every staged submission still in the outbox of task `id` of
/// `queue`, in the order they were staged. A submission its queue has no
/// room for stays, to be applied by a later sweep; one refused for good
/// (its key names a task of another payload) is recorded as refused, so
/// that its parent sees it and is not left waiting.
pub async fn apply_outbox(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    id: &str,
) -> Result<Applied, StoreError> {
    let flow: FlowState = store.flow(queue, id).await?;
    let mut applied = Applied::default();
    for (eid, staged) in flow.staged {
        match apply_one(store, settings, queue, id, &eid, staged).await? {
            Some(resumed) => {
                applied.applied += 1;
                applied.resumed |= resumed;
            }
            None => applied.held += 1,
        }
    }
    Ok(applied)
}

/// Apply staged submission `eid` of parent `id` of `queue`: `None` when
/// it is held (its queue is full, or its operation's commit is not known
/// yet), else whether the parent resumed.
async fn apply_one(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    id: &str,
    eid: &str,
    staged: Staged,
) -> Result<Option<bool>, StoreError> {
    // A submission of an idempotent operation applies once its commit is
    // known, and never if the operation did not commit.
    if let (Some(claim), Some(owner)) = (&staged.claim, &staged.owner) {
        match store.claim_outcome(claim, owner).await? {
            ClaimOutcome::Committed => {}
            ClaimOutcome::Open => return Ok(None),
            ClaimOutcome::NotCommitted => {
                debug!(parent = %id, %claim, "staged submission dropped: its operation did not commit");
                return store
                    .flow_record(queue, id, Some(eid), None, false)
                    .await
                    .map(Some);
            }
        }
    }
    let target = staged.queue.clone();
    let is_child = staged.parent.is_some();
    let outcome = submit_staged(store, settings, staged).await;
    let (child, terminal, refusal) = match outcome {
        Ok((task_id, outcome)) => match outcome {
            SubmitOutcome::Created { .. } => (task_ref(&target, &task_id), false, String::new()),
            SubmitOutcome::Replay(record) => (
                task_ref(&target, &record.id),
                record.status.is_terminal(),
                String::new(),
            ),
            // The key's task is in flight: this submission's own, applied
            // before by a run whose record of it was lost, or, for a key
            // the handler chose, another submitter's (the sweeper watches
            // it end).
            SubmitOutcome::InProgress { task_id } => {
                (task_ref(&target, &task_id), false, String::new())
            }
            SubmitOutcome::KeyMismatch { task_id } => (
                task_ref(&target, &format!("!{eid}")),
                true,
                format!(
                    "its idempotency key names task {task_id} of queue {target}, \
                     submitted with another task or payload"
                ),
            ),
            SubmitOutcome::QueueFull { depth } => {
                debug!(parent = %id, queue = %target, depth,
                    "staged submission held: its queue is full");
                return Ok(None);
            }
        },
        Err(Refused::Store(e)) => return Err(e),
        Err(Refused::Invalid(e)) => (
            task_ref(&target, &format!("!{eid}")),
            true,
            format!("{} ({})", e, e.code().as_str()),
        ),
    };
    if !refusal.is_empty() {
        warn!(parent = %id, queue = %target, error = %refusal, "staged submission refused");
    }
    let child = is_child.then_some(child.as_str());
    store
        .flow_record_refusal(queue, id, Some(eid), child, terminal, &refusal)
        .await
        .map(Some)
}

/// Why a staged submission was not submitted.
enum Refused {
    /// Redis failed: try again later.
    Store(StoreError),
    /// A rule refused it: it never will be.
    Invalid(IngestError),
}

/// Submit `staged`: its task id after routing, and the outcome.
async fn submit_staged(
    store: &Store,
    settings: &IngestSettings,
    staged: Staged,
) -> Result<(String, SubmitOutcome), Refused> {
    let payload = serde_json::from_str(&staged.payload).map_err(|e| {
        Refused::Invalid(super::invalid(
            crate::base::ErrorCode::InvalidJson,
            format!("payload: {e}"),
        ))
    })?;
    let req = SubmitRequest {
        task: staged.task,
        payload,
        idempotency_key: Some(staged.key),
        max_attempts: staged.max_attempts,
        delay_ms: staged.delay_ms,
        group: staged.group,
        ..SubmitRequest::default()
    };
    // The handler's grant named the task: whether it is deployed is the
    // worker's to find out (an undeployed task waits, deferred, then
    // fails past the defer limit).
    let mut new =
        prepare(settings, &staged.queue, None, req, |_| true).map_err(Refused::Invalid)?;
    // The partition the sandbox gave the id it returned to the handler:
    // the task goes there unless the key's record is in another.
    let preferred = crate::store::partition_of_id(&staged.id);
    new.id = staged.id;
    new.parent = staged.parent;
    let outcome = store
        .submit_preferring(&mut new, settings.max_queue_depth, Some(preferred))
        .await
        .map_err(Refused::Store)?;
    Ok((new.id, outcome))
}

/// Look again at the flow of task `id` of `queue` at `now` (the sweeper):
/// apply what is still staged, record every child that has ended (a
/// wake-up that was missed), cancel the children still live of a parent
/// cancelled at least `CANCEL_GRACE` (2 s) ago, whose canceller died part-way,
/// and let the flow resume its parent or leave the index. A look that
/// finds nothing to do puts the next one further off
/// ([`Store::flow_unchanged`]); asking a running child to stop again, as
/// each look does until it ends, is not counted as something done.
pub async fn repair(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    id: &str,
    now: u64,
) -> Result<Applied, StoreError> {
    let mut applied = apply_outbox(store, settings, queue, id).await?;
    let flow = store.flow(queue, id).await?;
    let unsettled: Vec<String> = flow
        .children
        .into_iter()
        .filter(|child| !flow.settled.contains(child))
        .collect();
    // Their records in one read (one pipeline; on a cluster, all at once).
    let records = store.children_of(&unsettled).await?;
    let mut ended = 0;
    for (child, record) in unsettled.iter().zip(&records) {
        if record.is_terminal() {
            ended += 1;
            applied.resumed |= store
                .flow_record(queue, id, None, Some(child), true)
                .await?;
        }
    }
    if ended < records.len()
        && let Some(at) = store.cancelled_at(queue, id).await?
        && at.saturating_add(CANCEL_GRACE.as_millis() as u64) <= now
    {
        // What `POST .../cancel` does after the parent: each child, and
        // theirs; each tells its parent as it ends. A running child a
        // cancel asked to stop before is asked again (its worker may have
        // missed the message) but not counted.
        applied.cancelled = store.cancel_children(queue, id).await?.new;
    }
    applied.resumed |= store.flow_record(queue, id, None, None, false).await?;
    let found = applied.applied + applied.held + ended + applied.cancelled;
    if found == 0 && !applied.resumed {
        store.flow_unchanged(queue, id, now).await?;
    }
    Ok(applied)
}
