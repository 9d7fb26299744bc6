//! Cancel requests of running tasks, from the queues' cancel channels.
//!
//! The `cancel` script flags a running task and publishes `<queue>\n<id>`
//! on the queue's channel ([`QueueKeys::cancel_channel`]; sharded pub/sub on a
//! cluster); the worker running it interrupts the sandbox call (epoch
//! interruption: preemptive, within one tick). A message missed while this
//! listener reconnects is caught by the next heartbeat, which reads the
//! flag.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Backoff, Shared};
use crate::store::QueueKeys;

/// Listen until `stop`, resubscribing with backoff when the connection
/// drops, and at once when the worker's partitions change (each partition
/// has its own channel).
pub(super) async fn listen(shared: Arc<Shared>, stop: CancellationToken) {
    let mut changes = shared.partitions.subscribe();
    let mut backoff = Backoff::default();
    loop {
        changes.mark_unchanged();
        let channels: Vec<String> = shared
            .queues()
            .iter()
            .map(|q| QueueKeys::new(q).cancel_channel().to_owned())
            .collect();
        let subscribed = tokio::select! {
            r = shared.store.backend().subscribe(&channels) => r,
            () = stop.cancelled() => return,
        };
        match subscribed {
            Ok(mut subscription) => {
                backoff.reset();
                let mut repartitioned = false;
                loop {
                    let payload = tokio::select! {
                        p = subscription.next_payload() => p,
                        () = stop.cancelled() => return,
                        _ = changes.changed() => {
                            repartitioned = true;
                            break;
                        }
                    };
                    let Some(payload) = payload else { break };
                    let Some((queue, id)) = std::str::from_utf8(&payload)
                        .ok()
                        .and_then(|body| body.split_once('\n'))
                    else {
                        continue;
                    };
                    if shared.running.cancel_task(queue, id) {
                        debug!(task_id = id, queue, "cancel requested: interrupting");
                    }
                }
                if repartitioned {
                    continue;
                }
                warn!("cancel channels closed; resubscribing");
            }
            Err(e) => warn!(error = %e, "cannot subscribe to the cancel channels; retrying"),
        }
        if !backoff.wait(&stop).await {
            return;
        }
    }
}
