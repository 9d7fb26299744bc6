//! The expiry sweep: expires the queue's waiting tasks whose expiry has
//! passed, on time, even while no worker reaches them (every slot busy,
//! the task scheduled or deep in a backlog). It reads the queue's expiry
//! index, which holds only tasks with an expiry (see `store/expiry.rs`);
//! the `expire` script's ZREM guard makes each expiry exactly-once however
//! many workers sweep at the same time.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Shared, supervise};
use crate::base::now_ms;

/// Longest sleep between two looks at the index: a task submitted with an
/// expiry by another process while this loop sleeps expires at most this
/// late (the delayed mover's cadence).
const MAX_IDLE: Duration = Duration::from_millis(250);

/// Tasks expired per script call.
const BATCH: usize = 256;

/// Expire due tasks of `queue` until `stop`.
pub(super) async fn run(shared: Arc<Shared>, queue: String, stop: CancellationToken) {
    loop {
        if supervise::injected("expiry", &queue) {
            return;
        }
        let now = now_ms();
        let wait = match shared.store.expire_due(&queue, now, BATCH).await {
            Ok((expired, next)) => {
                if expired > 0 {
                    debug!(queue, expired, "expired waiting tasks");
                }
                match next {
                    Some(next) if next <= now => Duration::ZERO,
                    Some(next) => Duration::from_millis(next - now).min(MAX_IDLE),
                    None => MAX_IDLE,
                }
            }
            Err(e) => {
                warn!(queue, error = %e, "expiring due tasks failed");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}
