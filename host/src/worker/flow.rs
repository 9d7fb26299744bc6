//! Following the flow control of the worker's queues: which are paused
//! (`store::pause`), and their limits (`store::limits`).
//!
//! Every [`PAUSE_POLL`] the worker reads both for all its queues and
//! publishes a change ([`Shared::flow`]).
//!
//! Paused: the fetch loop reads only the partitions of running queues, and
//! waits on them alone; a batch delivered just before a pause (a wait that
//! returned, a reclaim) is not started but left pending on this worker,
//! held no more. On a resume the fetch loop reads its own pending messages
//! back and starts those: nothing waits a visibility timeout. A queue thus
//! stops starting tasks within about [`PAUSE_POLL`] on every worker, and a
//! worker started during a pause reads it before its first fetch
//! (`start.rs`). Heartbeats, reclaim, the delayed mover and the sweeps go
//! on: a paused queue's running tasks finish, and its scheduled ones come
//! due into its stream as usual.
//!
//! Limits: a batch of a queue with limits is admitted by the store before
//! it starts, by the read itself in the fetch loop
//! ([`crate::store::Store::read_admitted`]), else on its own
//! ([`crate::store::Store::admit`]); the ones held leave the stream for the
//! delayed set, and their slots are free at once for other work. A limit
//! set or lifted applies within the same poll.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Every, Shared};
use crate::store::{Limits, PAUSE_POLL, Store, StoreError};

/// The flow control of a worker's queues, as last read.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Flow {
    /// The paused queues.
    pub(super) paused: HashSet<String>,
    /// The limits of each queue that has some.
    pub(super) limits: HashMap<String, Limits>,
}

impl Flow {
    /// Read the flow control of `queues` (logical names).
    pub(super) async fn read(store: &Store, queues: &[String]) -> Result<Flow, StoreError> {
        let (paused, limits) =
            futures::future::try_join(store.paused(queues), store.limits_of(queues)).await?;
        Ok(Flow { paused, limits })
    }
}

/// Every [`PAUSE_POLL`] until `stop`, read the flow control of the worker's
/// queues and publish a change.
pub(super) async fn watch(shared: Arc<Shared>, stop: CancellationToken) {
    let queues = shared.config.queue_names();
    let mut every = Every::new(PAUSE_POLL);
    while every.tick(&stop).await {
        match Flow::read(&shared.store, &queues).await {
            Ok(flow) => publish(&shared, flow),
            // Keep the last state known: a Redis that cannot be read
            // cannot start tasks either.
            Err(e) => warn!(error = %e, "cannot read the queues' pause state and limits"),
        }
    }
}

/// Publish `flow` if it differs from the state last published.
fn publish(shared: &Shared, flow: Flow) {
    shared.flow.send_if_modified(|known| {
        if **known == flow {
            return false;
        }
        let mut paused: Vec<&String> = flow.paused.iter().collect();
        paused.sort();
        info!(?paused, limits = ?flow.limits, "the queues' flow control changed");
        *known = Arc::new(flow);
        true
    });
}
