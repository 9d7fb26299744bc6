//! Flows on the worker (see `store/flow.rs`): what follows a written
//! completion, and the sweep that finishes what a dead worker left.
//!
//! After a completion that staged submissions (a success, or a wait), the
//! completer applies them ([`crate::ingest::apply_outbox`]); after one
//! that ended a child, it tells the parent ([`Store::settle_child`]). Both
//! run on a task of their own, so the completer writes the next batch
//! meanwhile. A worker that dies before either leaves the work in its
//! queue's indexes, which the sweep of any worker of the queue takes up:
//! every [`SWEEP_EVERY`], the children that ended more than
//! [`SETTLE_GRACE`] ago and were not dropped from the settle index, and the
//! flows unchanged for 10 s (staged submissions not applied, or a parent
//! waiting: its children's statuses are read again, so a missed wake-up is
//! repaired), then after ever longer gaps while a look finds nothing to do
//! ([`Store::flow_unchanged`]).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Every, Shared};
use crate::base::now_ms;
use crate::ingest::{self, IngestSettings};
use crate::store::{CompleteOutcome, Completion, Store, TaskStatus};

/// How often a worker sweeps its queues' flows.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// How long after a child ended the sweep tells its parent, if the
/// worker that ended it has not.
const SETTLE_GRACE: Duration = Duration::from_secs(2);

/// Spawn what follows the written `completions` (their `outcomes`, in the
/// same order): apply the staged submissions of each that staged, and tell
/// the parent of each child that ended.
pub(super) fn follow_up(
    store: &Store,
    ingest: &IngestSettings,
    completions: &[Completion],
    outcomes: &[CompleteOutcome],
) {
    for (completion, outcome) in completions.iter().zip(outcomes) {
        let status = match outcome {
            CompleteOutcome::Done(status) => *status,
            CompleteOutcome::Ended { status, parent } => {
                let (store, parent) = (store.clone(), parent.clone());
                let (queue, id) = (completion.queue.clone(), completion.task_id.clone());
                tokio::spawn(async move {
                    if let Err(e) = store.settle_child(&queue, &id, &parent).await {
                        debug!(task_id = %id, %parent, error = %e,
                            "telling the parent failed; the sweep will");
                    }
                });
                *status
            }
            CompleteOutcome::Stale(_) => continue,
        };
        let applies = matches!(
            status,
            TaskStatus::Succeeded | TaskStatus::Waiting | TaskStatus::Queued
        );
        // An operation's submissions apply (or are dropped) whatever the
        // attempt's outcome: their fate is the operation's commit.
        if (completion.stages() && applies) || completion.op_staged {
            let (store, ingest) = (store.clone(), ingest.clone());
            let (queue, id) = (completion.queue.clone(), completion.task_id.clone());
            tokio::spawn(async move {
                if let Err(e) = ingest::apply_outbox(&store, &ingest, &queue, &id).await {
                    warn!(task_id = %id, %queue, error = %e,
                        "applying staged submissions failed; the sweep will");
                }
            });
        }
    }
}

/// Every [`SWEEP_EVERY`] until `stop`, sweep the flows of every key set of
/// the worker's queues.
pub(super) async fn sweep(shared: Arc<Shared>, stop: CancellationToken) {
    let ingest = shared.config.ingest_settings();
    let mut every = Every::new(SWEEP_EVERY);
    while every.tick(&stop).await {
        for queue in shared.queues().iter() {
            if let Err(e) = sweep_queue(&shared.store, &ingest, queue).await {
                warn!(queue, error = %e, "flow sweep failed");
            }
        }
    }
}

/// One sweep of key set `queue`.
async fn sweep_queue(
    store: &Store,
    ingest: &IngestSettings,
    queue: &str,
) -> Result<(), crate::store::StoreError> {
    let now = now_ms();
    for (id, parent) in store
        .settles_due(queue, now.saturating_sub(SETTLE_GRACE.as_millis() as u64))
        .await?
    {
        // A record gone (past its retention) only leaves the index.
        store
            .settle_child(queue, &id, parent.as_deref().unwrap_or(""))
            .await?;
    }
    for id in store.flows_due(queue, now).await? {
        let repaired = ingest::repair(store, ingest, queue, &id, now).await?;
        if repaired.applied > 0 || repaired.resumed {
            debug!(queue, task_id = %id, applied = repaired.applied,
                resumed = repaired.resumed, "flow repaired by the sweep");
        }
        if repaired.cancelled > 0 {
            warn!(queue, task_id = %id, children = repaired.cancelled,
                "cancelled what a cancelled parent's cancel left running of its children and theirs");
        }
    }
    Ok(())
}
