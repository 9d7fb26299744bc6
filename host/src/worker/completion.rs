//! The completer: writes completions in batches.
//!
//! Executors hand their completion over a channel, with the task's execution
//! slot and its entry in the running set: both are released only once the
//! completion is written, so the heartbeat keeps the message until then and
//! the worker never holds more messages than it has slots. The completer
//! takes whatever has queued up (up to [`MAX_BATCH`]) and writes it in one
//! round trip: one `complete` script call per queue, atomic for all its
//! completions. Under load, batches grow by themselves; when idle, a
//! completion is written at once.
//!
//! A failed write is retried with backoff until it succeeds: a completion is
//! not dropped while the process lives, short of the shutdown grace period
//! running out. If the process dies first, the message stays pending and the
//! task is reclaimed and run again.

use rand::Rng;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Backoff, Registration};
use crate::config::Config;
use crate::store::{CompleteOutcome, Completion, Store};

/// Most completions written in one round trip.
const MAX_BATCH: usize = 128;

/// A completion and what its task holds until it is written; dropped
/// (releasing both) after the write.
pub(super) struct Pending {
    pub(super) completion: Completion,
    pub(super) slot: OwnedSemaphorePermit,
    /// The message's entry in the running set.
    pub(super) registration: Registration,
}

/// Completion writes in flight at once: the next batch is on its way while
/// Redis runs the last one's script.
const WRITERS: usize = 2;

/// The completer loop. Once `finish` is cancelled it takes no new
/// completions and ends when the channel is drained (or when every sender is
/// gone) and every write is done. A write that keeps failing is retried until
/// `abandon` is cancelled; then its tasks' messages stay pending, to be
/// reclaimed and run again.
pub(super) async fn run(
    store: Store,
    mut rx: mpsc::Receiver<Pending>,
    finish: CancellationToken,
    abandon: CancellationToken,
) {
    let mut writes = JoinSet::new();
    let mut batch: Vec<Pending> = Vec::with_capacity(MAX_BATCH);
    let mut finishing = false;
    loop {
        if writes.len() >= WRITERS {
            // Completions queue up meanwhile: the next batch is larger.
            writes.join_next().await;
            continue;
        }
        let received = tokio::select! {
            received = rx.recv_many(&mut batch, MAX_BATCH) => received,
            Some(_) = writes.join_next(), if !writes.is_empty() => continue,
            () = finish.cancelled(), if !finishing => {
                rx.close();
                finishing = true;
                continue;
            }
        };
        if received == 0 {
            break;
        }
        writes.spawn(write(
            store.clone(),
            std::mem::take(&mut batch),
            abandon.clone(),
        ));
    }
    while writes.join_next().await.is_some() {}
}

/// Write one batch, retrying with backoff until it is written or `abandon`
/// is cancelled. What the tasks hold is released when this returns.
async fn write(store: Store, batch: Vec<Pending>, abandon: CancellationToken) {
    let (completions, _held): (Vec<Completion>, Vec<_>) = batch
        .into_iter()
        .map(|p| (p.completion, (p.slot, p.registration)))
        .unzip();
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
    for (completion, outcome) in completions.iter().zip(outcomes) {
        if let CompleteOutcome::Stale(status) = &outcome {
            debug!(task_id = %completion.task_id, %status,
                "completion was stale: the task was reclaimed or completed elsewhere");
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
