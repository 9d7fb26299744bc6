//! DLQ retention: the dead-letter queue must not grow without bound.
//!
//! Dead-lettered task hashes have no TTL (a DLQ entry must never outlive
//! its hash), so every worker sweeps the DLQs of its queues every
//! [`PERIOD`]: it purges the tasks dead-lettered longer ago than
//! `--dlq-retention-s`, then the oldest beyond `--dlq-max` entries, through
//! the same script as the admin purge (`store/lua/dlq_purge.lua`: task
//! hash, DLQ entry, idempotency record if it still names the task, a
//! `PURGED` event each). A run purges at most [`MAX_PER_RUN`] tasks per
//! queue, in chunks of [`DLQ_CHUNK`], so a sweep never holds Redis for long;
//! a larger backlog goes in later runs.
//!
//! Several workers sweep the same queue without coordinating: the script
//! skips ids already gone, re-checks each one's dead-letter time, and stops
//! trimming to the count once the set is down to `--dlq-max`, so they never
//! purge more than is due.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Every, Shared};
use crate::base::now_ms;
use crate::store::{DLQ_CHUNK, PurgeBound, Store, StoreError};

/// How often a worker sweeps its queues' DLQs.
pub(super) const PERIOD: Duration = Duration::from_secs(5);

/// Most tasks one run purges from one queue.
pub(super) const MAX_PER_RUN: usize = 1000;

/// What the sweep keeps: dead-lettered tasks younger than `max_age`, at
/// most `max_len` of them per queue; `None` is unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Retention {
    pub(super) max_age: Option<Duration>,
    pub(super) max_len: Option<u64>,
}

impl Retention {
    /// From `--dlq-retention-s` and `--dlq-max` (0: unbounded).
    pub(super) fn new(retention_s: u64, max: u64) -> Retention {
        Retention {
            max_age: (retention_s > 0).then(|| Duration::from_secs(retention_s)),
            max_len: (max > 0).then_some(max),
        }
    }
}

/// Sweep the DLQs of this worker's queues every [`PERIOD`] until `stop`.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let retention = Retention::new(shared.config.dlq_retention_s, shared.config.dlq_max);
    if retention.max_age.is_none() && retention.max_len.is_none() {
        // Nothing to do, but a supervised loop may not end before `stop`.
        stop.cancelled().await;
        return;
    }
    let mut every = Every::new(PERIOD);
    while every.tick(&stop).await {
        for queue in shared.queues().iter() {
            match sweep(&shared.store, queue, retention, now_ms()).await {
                Ok(0) => {}
                Ok(purged) => info!(queue, purged, "purged dead-lettered tasks past retention"),
                Err(e) => warn!(queue, error = %e, "DLQ retention sweep failed"),
            }
        }
    }
}

/// One run on `queue`: purge what `retention` no longer keeps, at most
/// [`MAX_PER_RUN`] tasks. Returns how many were purged.
pub(super) async fn sweep(
    store: &Store,
    queue: &str,
    retention: Retention,
    now: u64,
) -> Result<u64, StoreError> {
    let mut budget = MAX_PER_RUN;
    let mut purged = 0;
    if let Some(age) = retention.max_age {
        let bound = PurgeBound {
            latest: Some(now.saturating_sub(age.as_millis() as u64)),
            keep: None,
        };
        while budget > 0 {
            let count = budget.min(DLQ_CHUNK);
            let (n, seen) = store.purge_oldest(queue, bound, count, now).await?;
            purged += n;
            budget -= seen;
            if seen < count || n == 0 {
                break;
            }
        }
    }
    if let Some(max) = retention.max_len {
        let bound = PurgeBound {
            latest: None,
            keep: Some(max),
        };
        let mut excess = store.dlq_extent(queue).await?.len.saturating_sub(max);
        while budget > 0 && excess > 0 {
            let count = budget.min(DLQ_CHUNK).min(excess as usize);
            let (n, seen) = store.purge_oldest(queue, bound, count, now).await?;
            purged += n;
            budget -= seen;
            excess = excess.saturating_sub(seen as u64);
            if n == 0 {
                break;
            }
        }
    }
    Ok(purged)
}
