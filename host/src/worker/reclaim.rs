//! Crash recovery: heartbeats that stamp this worker alive and keep its
//! running messages, and the reclaim of messages no live worker runs.
//!
//! Liveness is per worker, judged by Redis's clock: every third of the
//! visibility timeout, the heartbeat stamps this worker in each queue it
//! consumes (whether or not it runs anything), resets the idle time of the
//! messages it runs, and learns which of its attempts were asked to cancel
//! and which are stale (taken over by another worker: they are stopped and
//! write nothing). A pending message is reclaimed only from a worker that
//! has not beaten within the visibility timeout, and never in the first
//! visibility timeout after an outage that stopped everyone's beats (see
//! `store/lua/include/liveness.lua`); so a live worker keeps its tasks
//! through a Redis outage, and a dead worker's are reclaimed one visibility
//! timeout after it stopped beating (or after Redis came back). The
//! reclaimed task starts again with one more attempt; its worker's last
//! attempt counts as failed.
//!
//! This worker's own messages idle that long come back too: it runs those
//! it does not hold (delivered, but `start` failed) and leaves alone those
//! it holds, which it is starting or running.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Every, MAX_BATCH, Shared};
use crate::store::{Code, Delivery};

/// How often heartbeats and reclaims run: a third of the visibility timeout.
fn period(shared: &Shared) -> Duration {
    (shared.config.visibility_timeout() / 3).max(Duration::from_millis(20))
}

/// Reclaim the messages no live worker runs until `stop`.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let visibility = shared.config.visibility_timeout();
    let mut every = Every::new(period(&shared));
    'ticks: while every.tick(&stop).await {
        for queue in shared.queues().iter() {
            // Under load the fetch loop takes every slot as it frees, so a
            // free slot is waited for, not tried for: the semaphore is
            // fair, and the next slot freed goes to this waiter first.
            let Some(permits) = shared.take_slots(MAX_BATCH, &stop).await else {
                break 'ticks;
            };
            reclaim(&shared, queue, visibility, permits).await;
        }
    }
}

/// Beat for this worker on each of its queues, and keep its running
/// messages, until `stop`. A loop of its own: reclaiming waits for free
/// slots, and heartbeats must never wait behind it; and at shutdown they go
/// on through the grace period, until the last running task is done, so
/// that no other worker takes over a task that is still being finished.
pub(super) async fn heartbeats(shared: Arc<Shared>, stop: CancellationToken) {
    let mut every = Every::new(period(&shared));
    while every.tick(&stop).await {
        heartbeat(&shared).await;
    }
}

async fn heartbeat(shared: &Shared) {
    let visibility = shared.config.visibility_timeout();
    let mut by_queue = shared.running.started();
    for queue in shared.queues().iter() {
        by_queue.entry(queue.clone()).or_default();
    }
    for (queue, attempts) in by_queue {
        let beats: Vec<(Delivery, u32)> = attempts
            .iter()
            .map(|(_, delivery, attempt)| (delivery.clone(), *attempt))
            .collect();
        let codes = match shared
            .store
            .heartbeat(&queue, &shared.consumer, visibility, &beats)
            .await
        {
            Ok(codes) => codes,
            Err(e) => {
                warn!(queue, error = %e, "heartbeat failed");
                continue;
            }
        };
        for ((id, _, _), code) in attempts.iter().zip(codes) {
            match code {
                Code::CancelRequested => shared.running.cancel(*id),
                Code::Stale => {
                    if let Some((delivery, attempt)) = shared.running.stop_stale(*id) {
                        warn!(task_id = %delivery.task_id, queue, attempt,
                            "task no longer this attempt's (taken over by another worker, \
                             or gone): stopping the attempt; it writes nothing");
                    }
                }
                _ => {}
            }
        }
    }
}

async fn reclaim(
    shared: &Arc<Shared>,
    queue: &str,
    visibility: Duration,
    permits: Vec<OwnedSemaphorePermit>,
) {
    let reclaimed = match shared
        .store
        .reclaim(queue, &shared.consumer, visibility, permits.len())
        .await
    {
        Ok(reclaimed) => reclaimed,
        Err(e) => {
            warn!(queue, error = %e, "reclaim failed");
            return;
        }
    };
    // A message held here is being started or run here: never dispatched
    // twice. (One of a dead worker can be held here too: one this worker
    // still runs that was reclaimed from it, by a worker that died before
    // starting it.) Claimed back, it is this worker's again, and its
    // heartbeats keep it.
    let unheld = |deliveries: Vec<Delivery>| -> Vec<Delivery> {
        deliveries
            .into_iter()
            .filter(|d| !shared.running.holds(queue, &d.msg_id))
            .collect()
    };
    let mut deliveries = unheld(reclaimed.dead);
    if !deliveries.is_empty() {
        warn!(
            queue,
            count = deliveries.len(),
            "reclaimed tasks of dead workers"
        );
    }
    let own = unheld(reclaimed.own);
    if !own.is_empty() {
        warn!(
            queue,
            count = own.len(),
            "reclaimed own messages that were never started"
        );
        deliveries.extend(own);
    }
    // Permits beyond the deliveries are released in `dispatch`, or here.
    if !deliveries.is_empty() {
        shared.dispatch(queue, deliveries, permits).await;
    }
}
