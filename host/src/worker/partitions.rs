//! Following the partition counts of the worker's queues.
//!
//! A worker consumes every partition of each of its queues as if each were
//! a queue: the fetch loop reads them in turn, the heartbeat and reclaim go
//! over each, and each has its own delayed mover and expiry sweep. When a
//! queue's count is raised, the new partitions join within
//! [`POLL`]: their groups are created and their loops started, with nothing
//! to restart. Until then their tasks wait in their streams; none is lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Every, Shared};
use crate::store::{Store, StoreError};

/// How often the counts are read again.
pub(super) const POLL: Duration = Duration::from_secs(2);

/// Every partition (key-set name) of each of `queues`, in order.
pub(super) async fn of_queues(store: &Store, queues: &[String]) -> Result<Vec<String>, StoreError> {
    let mut names = Vec::new();
    for queue in queues {
        names.extend(store.partition_names(queue).await?);
    }
    Ok(names)
}

/// Every [`POLL`] until `stop`, read the counts again; on a raise, create
/// the new partitions' groups, publish the new set to the loops, and send
/// each new name to `added` (whose receiver starts its loops).
pub(super) async fn watch(
    shared: Arc<Shared>,
    added: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
) {
    let mut every = Every::new(POLL);
    while every.tick(&stop).await {
        let names = match of_queues(&shared.store, &shared.config.queue_names()).await {
            Ok(names) => names,
            Err(e) => {
                warn!(error = %e, "cannot read the queues' partition counts");
                continue;
            }
        };
        let known = shared.queues();
        let new: Vec<String> = names
            .iter()
            .filter(|n| !known.contains(n))
            .cloned()
            .collect();
        if new.is_empty() {
            continue;
        }
        let mut ready = true;
        for name in &new {
            if let Err(e) = shared.store.ensure_group(name).await {
                warn!(partition = %name, error = %e, "cannot create a new partition's group");
                ready = false;
            }
        }
        if !ready {
            continue;
        }
        info!(partitions = ?new, "consuming new partitions");
        shared.partitions.send_replace(Arc::new(names));
        for name in new {
            if added.send(name).is_err() {
                return;
            }
        }
    }
}
