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

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{MAX_BATCH, Shared};
use crate::store::Delivery;

/// Heartbeat and reclaim until `stop`.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let visibility = shared.config.visibility_timeout();
    let heartbeat_every = (visibility / 3).max(Duration::from_millis(20));
    let mut ticks = tokio::time::interval(heartbeat_every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = stop.cancelled() => return,
        }
        heartbeat(&shared).await;
        for queue in &shared.config.queues {
            reclaim(&shared, queue, visibility).await;
        }
    }
}

async fn heartbeat(shared: &Shared) {
    let mut by_queue: HashMap<String, Vec<Delivery>> = HashMap::new();
    for (task_id, t) in shared.lock_running().iter() {
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
                let map = shared.lock_running();
                for t in map.values().filter(|t| cancelled.contains(&t.msg_id)) {
                    t.cancel.cancel();
                }
            }
            Err(e) => warn!(queue, error = %e, "heartbeat failed"),
        }
    }
}

async fn reclaim(shared: &Arc<Shared>, queue: &str, visibility: Duration) {
    let mut permits = Vec::new();
    while permits.len() < MAX_BATCH {
        match shared.slots.clone().try_acquire_owned() {
            Ok(p) => permits.push(p),
            Err(_) => break,
        }
    }
    if permits.is_empty() {
        return;
    }
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
