//! The delayed mover: scheduled tasks and retries wait in the queue's
//! delayed set until due; this loop moves them to the stream with the
//! `promote` script, whose ZREM guard makes the move exactly-once however
//! many workers run it at the same time.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Shared, supervise};
use crate::base::now_ms;

/// Longest sleep between two looks at the delayed set: a task scheduled by
/// another process while this loop sleeps is moved at most this late.
const MAX_IDLE: Duration = Duration::from_millis(250);

/// Tasks moved per script call.
const BATCH: usize = 256;

/// Move due tasks of `queue` until `stop`.
pub(super) async fn run(shared: Arc<Shared>, queue: String, stop: CancellationToken) {
    loop {
        if supervise::injected("delayed", &queue) {
            return;
        }
        let now = now_ms();
        let wait = match shared.store.promote_due(&queue, now, BATCH).await {
            Ok((_, Some(next))) if next <= now => Duration::ZERO,
            Ok((_, Some(next))) => Duration::from_millis(next - now).min(MAX_IDLE),
            Ok((_, None)) => MAX_IDLE,
            Err(e) => {
                warn!(queue, error = %e, "moving due tasks failed");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}
