//! Crash recovery: heartbeats for this worker's running messages, and
//! XAUTOCLAIM of messages that dead workers left pending.
//!
//! A message is reclaimed when it has been idle longer than the visibility
//! timeout. Every third of that, the heartbeat resets the idle time of each
//! message this worker is running (and picks up cancel requests it may have
//! missed), so a live worker running a long task keeps it; a dead worker's
//! messages go idle and another worker takes them. The reclaimed task starts
//! again with one more attempt; its worker's last attempt counts as failed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{MAX_BATCH, Shared};
use crate::store::Delivery;

/// How often heartbeats and reclaims run: a third of the visibility timeout.
fn period(shared: &Shared) -> Duration {
    (shared.config.visibility_timeout() / 3).max(Duration::from_millis(20))
}

/// Reclaim dead workers' messages until `stop`.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let visibility = shared.config.visibility_timeout();
    let mut ticks = tokio::time::interval(period(&shared));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    'ticks: loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            _ = ticks.tick() => {}
        }
        for queue in &shared.config.queues {
            // The fetch loop holds every free slot while its read blocks, so
            // a free slot is waited for, not tried for: the semaphore is
            // fair, and the slots the read returns go to this waiter first.
            let Some(permits) = shared.take_slots(MAX_BATCH, &stop).await else {
                break 'ticks;
            };
            reclaim(&shared, queue, visibility, permits).await;
        }
    }
}

/// Refresh this worker's running messages until `stop`. A loop of its own:
/// reclaiming waits for free slots, and heartbeats must never wait behind it;
/// and at shutdown they go on through the grace period, until the last
/// running task is done, so that no other worker takes over a task that is
/// still being finished.
pub(super) async fn heartbeats(shared: Arc<Shared>, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(period(&shared));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        heartbeat(&shared).await;
    }
}

async fn heartbeat(shared: &Shared) {
    let mut by_queue: HashMap<String, Vec<Delivery>> = HashMap::new();
    for (task_id, t) in shared.running.lock().iter() {
        by_queue.entry(t.queue.clone()).or_default().push(Delivery {
            msg_id: t.msg_id.clone(),
            task_id: task_id.clone(),
        });
    }
    for (queue, running) in by_queue {
        match shared
            .store
            .heartbeat(&queue, &shared.consumer, &running)
            .await
        {
            Ok(cancelled) => {
                let map = shared.running.lock();
                for t in map.values().filter(|t| cancelled.contains(&t.msg_id)) {
                    t.cancel.cancel();
                }
            }
            Err(e) => warn!(queue, error = %e, "heartbeat failed"),
        }
    }
}

async fn reclaim(
    shared: &Arc<Shared>,
    queue: &str,
    visibility: Duration,
    permits: Vec<OwnedSemaphorePermit>,
) {
    match shared
        .store
        .reclaim(queue, &shared.consumer, visibility, permits.len())
        .await
    {
        Ok(deliveries) if !deliveries.is_empty() => {
            warn!(
                queue,
                count = deliveries.len(),
                "reclaimed tasks of a dead worker"
            );
            shared.dispatch(queue, deliveries, permits).await;
        }
        Ok(_) => {}
        Err(e) => warn!(queue, error = %e, "reclaim failed"),
    }
}
