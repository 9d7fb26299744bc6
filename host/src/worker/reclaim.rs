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
//! it holds, which it is starting or running. A reclaim whose reply is lost
//! may have claimed messages for this worker: it asks the fetch loop to
//! read them back at once (`fetch.rs`).
//!
//! A beat that fails (a connection broken under it) is tried again at
//! once, with a short backoff, until the next beat is due: a live worker's
//! stamp must not grow old because a few beats in a row met broken
//! connections, or it would be judged dead and its attempts counted lost.
//! Each try is bounded by the period, so a reply that never comes holds up
//! no beat. What still makes a live worker look dead is being cut off from
//! Redis, every try failing, for the whole visibility timeout: from Redis's
//! side that is what a dead worker looks like.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Backoff, Every, MAX_BATCH, Shared};
use crate::store::{Code, Delivery, StoreError};

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

/// One beat on every queue, each tried until it lands or the next beat is
/// due; the queues beat side by side, so one that fails delays no other.
async fn heartbeat(shared: &Shared) {
    let mut by_queue = shared.running.started();
    for queue in shared.queues().iter() {
        by_queue.entry(queue.clone()).or_default();
    }
    let due = Instant::now() + period(shared);
    let beats = by_queue
        .into_iter()
        .map(|(queue, attempts)| beat_queue(shared, queue, attempts, due));
    futures::future::join_all(beats).await;
}

/// Beat on `queue` for `attempts` (registration id, delivery, attempt),
/// trying again after a failure until `due`; then act on the codes.
async fn beat_queue(
    shared: &Shared,
    queue: String,
    attempts: Vec<(u64, Delivery, u32)>,
    due: Instant,
) {
    let visibility = shared.config.visibility_timeout();
    let beats: Vec<(Delivery, u32)> = attempts
        .iter()
        .map(|(_, delivery, attempt)| (delivery.clone(), *attempt))
        .collect();
    let mut backoff = Backoff::default();
    let codes = loop {
        let beat = shared
            .store
            .heartbeat(&queue, &shared.consumer, visibility, &beats);
        let failed = match tokio::time::timeout_at(due, beat).await {
            Ok(Ok(codes)) => break codes,
            Ok(Err(e)) => e,
            Err(_) => StoreError::Protocol("no answer before the next beat".into()),
        };
        let retry_at = Instant::now() + backoff.next_delay().min(Duration::from_millis(100));
        if retry_at >= due {
            warn!(queue, error = %failed, "heartbeat failed until the next was due");
            return;
        }
        tracing::debug!(queue, error = %failed, "heartbeat failed; trying again");
        tokio::time::sleep_until(retry_at).await;
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
            // The script may have claimed messages for this worker with
            // its reply lost: read them back.
            warn!(queue, error = %e, "reclaim failed");
            if matches!(e, StoreError::Redis(_)) {
                shared.read_back.store(true, Ordering::Release);
            }
            return;
        }
    };
    // A message held here is being started or run here: never dispatched
    // twice (`dispatch_unheld` leaves it alone). One of a dead worker can be
    // held here too: one this worker still runs that was reclaimed from it,
    // by a worker that died before starting it. Claimed back, it is this
    // worker's again, and its heartbeats keep it.
    let mut deliveries = reclaimed.dead;
    if !deliveries.is_empty() {
        warn!(
            queue,
            count = deliveries.len(),
            "reclaimed tasks of dead workers"
        );
    }
    if !reclaimed.own.is_empty() {
        warn!(
            queue,
            count = reclaimed.own.len(),
            "reclaimed own messages left idle (never started, or being run)"
        );
        deliveries.extend(reclaimed.own);
    }
    // Permits beyond the deliveries are released in `dispatch_unheld`, or
    // here.
    if !deliveries.is_empty() {
        shared.dispatch_unheld(queue, deliveries, permits).await;
    }
}
