//! The completer: writes completions in batches.
//!
//! Executors hand their completion over a channel and wait for it to be
//! written before they release their slot and drop their heartbeat. The
//! completer takes whatever has queued up (up to [`MAX_BATCH`]) and writes it
//! in one round trip: one `complete` script call per queue, atomic for all
//! its completions. Under load, batches grow by themselves; when idle, a
//! completion is written at once.
//!
//! A failed write is retried with backoff until it succeeds: a completion is
//! not dropped while the process lives, short of the shutdown grace period
//! running out. If the process dies first, the message stays pending and the
//! task is reclaimed and run again.

use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Backoff;
use crate::config::Config;
use crate::store::{CompleteOutcome, Completion, Store};

/// Most completions written in one round trip.
const MAX_BATCH: usize = 128;

/// A completion and who waits for it.
pub(super) struct Pending {
    pub(super) completion: Completion,
    pub(super) done: oneshot::Sender<CompleteOutcome>,
}

/// The completer loop; ends when every sender is gone and the channel
/// drained, or when `abandon` is cancelled while a write keeps failing (the
/// unwritten tasks' messages stay pending, to be reclaimed and run again).
pub(super) async fn run(store: Store, mut rx: mpsc::Receiver<Pending>, abandon: CancellationToken) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let (completions, waiters): (Vec<Completion>, Vec<_>) =
            batch.drain(..).map(|p| (p.completion, p.done)).unzip();
        let mut backoff = Backoff::default();
        let outcomes = loop {
            match store.complete(&completions).await {
                Ok(outcomes) => break outcomes,
                Err(e) => {
                    warn!(error = %e, batch = completions.len(), "completion write failed; retrying");
                    if !backoff.wait(&abandon).await {
                        warn!(
                            batch = completions.len(),
                            "shutting down with completions unwritten; they will be reclaimed"
                        );
                        return;
                    }
                }
            }
        };
        for ((completion, done), outcome) in completions.iter().zip(waiters).zip(outcomes) {
            if let CompleteOutcome::Stale(status) = &outcome {
                debug!(task_id = %completion.task_id, %status,
                    "completion was stale: the task was reclaimed or completed elsewhere");
            }
            let _ = done.send(outcome);
        }
    }
}

/// The delay before retry number `attempt` (1-based: the attempt that just
/// failed): exponential from `retry_base_ms`, capped at `retry_max_ms`, with
/// "equal jitter" (half fixed, half random) so that tasks failing together
/// do not retry together.
pub fn backoff_ms(config: &Config, attempt: u32) -> u64 {
    let exp = config
        .retry_base_ms
        .saturating_mul(1u64 << attempt.saturating_sub(1).min(30))
        .min(config.retry_max_ms);
    let half = exp / 2;
    half + rand::rng().random_range(0..=half)
}
