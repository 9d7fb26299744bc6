//! Cancel requests of running tasks, from the cancel channel.
//!
//! The `cancel` script flags a running task and publishes `<queue>\n<id>` on
//! [`CANCEL_CHANNEL`]; the worker running it interrupts the sandbox call
//! (epoch interruption: preemptive, within one tick). A message missed while
//! this listener reconnects is caught by the next heartbeat, which reads the
//! flag.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Backoff, Shared};
use crate::store::CANCEL_CHANNEL;

/// Listen until `stop`, resubscribing with backoff when the connection drops.
pub(super) async fn listen(shared: Arc<Shared>, stop: CancellationToken) {
    let mut backoff = Backoff::default();
    loop {
        let subscribed = async {
            let mut pubsub = shared.store.client().get_async_pubsub().await?;
            pubsub.subscribe(CANCEL_CHANNEL).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = tokio::select! {
            r = subscribed => r,
            () = stop.cancelled() => return,
        };
        match pubsub {
            Ok(mut pubsub) => {
                backoff.reset();
                let mut messages = pubsub.on_message();
                loop {
                    let msg = tokio::select! {
                        m = messages.next() => m,
                        () = stop.cancelled() => return,
                    };
                    let Some(msg) = msg else { break };
                    let Ok(body) = msg.get_payload::<String>() else {
                        continue;
                    };
                    let Some((queue, id)) = body.split_once('\n') else {
                        continue;
                    };
                    if shared.running.cancel_task(queue, id) {
                        debug!(task_id = id, queue, "cancel requested: interrupting");
                    }
                }
                warn!("cancel channel closed; resubscribing");
            }
            Err(e) => warn!(error = %e, "cannot subscribe to the cancel channel; retrying"),
        }
        if !backoff.wait(&stop).await {
            return;
        }
    }
}
