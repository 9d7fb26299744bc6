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
//! A write that fails to reach Redis is retried with backoff until it
//! succeeds: a completion is not dropped while the process lives, short of
//! the shutdown grace period running out. If the process dies first, the
//! message stays pending and the task is reclaimed and run again. A write
//! that finds its connection broken (reset or closed, perhaps while it sat
//! idle) is tried again at once, on the new connection, before any backoff
//! (see [`StoreError::is_connection_dropped`]): otherwise a link that drops
//! connections sooner than the backoff would break every try, leaving the
//! completion unwritten and its task RUNNING for as long as the link stays
//! so.
//!
//! A write Redis rejects is another matter: retrying a script that fails on
//! the data it finds (a task hash of the wrong type, say) fails forever, and
//! each retry holds its tasks' slots. A batch Redis rejects is written again
//! one completion at a time, so that one bad task does not take the others
//! with it; a completion rejected alone is logged at error and dropped, its
//! slot released, and its message left pending, to be reclaimed (and in the
//! end dead-lettered) like that of a crashed worker. Rejections Redis means
//! as "not now" (loading, busy, out of memory, failover) are retried, but
//! only [`MAX_REFUSALS`] times.
//!
//! Flows: once a completion that staged submissions is written, the
//! completer applies them, and tells the parent of a child that ended; both
//! on a task of their own, after the slot is released (`outbox.rs`; the
//! sweeper does what a dead worker left undone).

use std::sync::Arc;

use rand::Rng;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use super::{Backoff, Registration};
use crate::config::WorkerConfig;
use crate::ingest::IngestSettings;
use crate::metrics::{AttemptOutcome, TaskSeries};
use crate::store::{CompleteOutcome, Completion, CompletionKind, Store, StoreError, TaskStatus};

/// Most completions written in one round trip.
const MAX_BATCH: usize = 128;

/// A completion and what its task holds until it is written; dropped
/// (releasing both) after the write.
pub(super) struct Pending {
    pub(super) completion: Completion,
    /// Its task's series in `/metrics`.
    pub(super) series: Arc<TaskSeries>,
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
    ingest: IngestSettings,
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
            ingest.clone(),
            std::mem::take(&mut batch),
            abandon.clone(),
        ));
    }
    while writes.join_next().await.is_some() {}
}

/// Write one batch, retrying with backoff until it is written, rejected
/// (see the module's doc), or `abandon` is cancelled. What the tasks hold is
/// released when this returns.
async fn write(
    store: Store,
    ingest: IngestSettings,
    batch: Vec<Pending>,
    abandon: CancellationToken,
) {
    let mut completions = Vec::with_capacity(batch.len());
    let mut series = Vec::with_capacity(batch.len());
    // Released when this returns (the follow-ups run on tasks of their
    // own).
    let mut held = Vec::with_capacity(batch.len());
    for p in batch {
        completions.push(p.completion);
        series.push(p.series);
        held.push((p.slot, p.registration));
    }
    match write_retrying(&store, &completions, &series, &abandon).await {
        Written::Yes(outcomes) => {
            return super::outbox::follow_up(&store, &ingest, &completions, &outcomes);
        }
        Written::Abandoned => return,
        Written::Rejected(_) if completions.len() > 1 => {
            warn!(
                batch = completions.len(),
                "completion batch rejected by redis; writing its completions one by one"
            );
        }
        Written::Rejected(e) => return rejected(&completions[0], &e),
    }
    for (completion, series) in completions.iter().zip(&series) {
        let one = std::slice::from_ref(completion);
        match write_retrying(&store, one, std::slice::from_ref(series), &abandon).await {
            Written::Yes(outcomes) => super::outbox::follow_up(&store, &ingest, one, &outcomes),
            Written::Abandoned => return,
            Written::Rejected(e) => rejected(completion, &e),
        }
    }
}

/// Most times a write Redis refuses for now (see [`Failure::Refused`]) is
/// tried again before it counts as rejected: about 6 s of backoff.
const MAX_REFUSALS: u32 = 8;

/// What became of a write.
enum Written {
    /// Written, with each completion's outcome.
    Yes(Vec<CompleteOutcome>),
    /// Rejected by Redis: trying again would fail the same way.
    Rejected(StoreError),
    /// Given up at shutdown.
    Abandoned,
}

/// Write `completions` and count the outcome of each in its task's
/// `series` (in the same order), retrying as [`write`] says.
async fn write_retrying(
    store: &Store,
    completions: &[Completion],
    series: &[Arc<TaskSeries>],
    abandon: &CancellationToken,
) -> Written {
    let mut backoff = Backoff::default();
    let mut refusals = 0;
    let outcomes = loop {
        let e = match store.complete(completions).await {
            Ok(outcomes) => break outcomes,
            Err(e) => e,
        };
        let failure = Failure::of(&e);
        match failure {
            Failure::Dropped | Failure::Unreached => {}
            Failure::Refused if refusals < MAX_REFUSALS => refusals += 1,
            Failure::Refused | Failure::Rejected => return Written::Rejected(e),
        }
        warn!(error = %e, batch = completions.len(), "completion write failed; retrying");
        if !backoff
            .wait_after(failure == Failure::Dropped, abandon)
            .await
        {
            warn!(
                batch = completions.len(),
                "shutting down with completions unwritten; they will be reclaimed"
            );
            return Written::Abandoned;
        }
    };
    for ((completion, outcome), series) in completions.iter().zip(&outcomes).zip(series) {
        match outcome {
            CompleteOutcome::Done(status) | CompleteOutcome::Ended { status, .. } => {
                let status = *status;
                if status == TaskStatus::DeadLettered {
                    warn!(task_id = %completion.task_id, queue = %completion.queue,
                        attempt = completion.attempt, outcome = "dead_lettered",
                        error = %completion.detail, "no attempt left: the task is dead-lettered");
                }
                if let Some(outcome) = AttemptOutcome::of(completion.kind, status) {
                    series.count_outcome(outcome);
                }
            }
            CompleteOutcome::Stale(status) => {
                debug!(task_id = %completion.task_id, %status,
                    "completion was stale: the task was reclaimed or completed elsewhere");
            }
        }
    }
    Written::Yes(outcomes)
}

/// How the log of an attempt that failed names its end, before the
/// completion is written: `dead_lettered` for a retry with no attempt left
/// (attempt `attempt` of `max_attempts`), which `complete.lua` turns into
/// DEAD_LETTERED (but for a task whose cancel was asked meanwhile), else the
/// completion's outcome (`retry`, `fatal`, ...).
pub(super) fn failure_label(kind: CompletionKind, attempt: u32, max_attempts: u32) -> &'static str {
    match kind {
        CompletionKind::Retry | CompletionKind::Lost if attempt >= max_attempts => "dead_lettered",
        kind => kind.as_str(),
    }
}

fn rejected(completion: &Completion, e: &StoreError) {
    error!(task_id = %completion.task_id, queue = %completion.queue, error = %e,
        "redis rejected the task's completion: dropped; the message stays pending, \
         to be reclaimed");
}

/// Why a write failed, which decides whether to try it again.
#[derive(Debug, PartialEq, Eq)]
enum Failure {
    /// The connection was found broken (reset, closed, refused): tried
    /// again at once on a new one, then as [`Failure::Unreached`].
    Dropped,
    /// Redis was not reached (a timeout, say): retried until it works (or
    /// shutdown), as nothing else could work either.
    Unreached,
    /// Redis answered with an error that means "not now".
    Refused,
    /// Redis answered with any other error (a script failing on its data,
    /// say), or with a reply the scripts do not make.
    Rejected,
}

/// Error codes of replies that mean "not now" rather than "never".
const REFUSED_CODES: &[&str] = &[
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "MOVED",
    "ASK",
    "OOM",
    "NOSCRIPT",
];

impl Failure {
    fn of(e: &StoreError) -> Self {
        match e {
            StoreError::Protocol(_) | StoreError::Corrupt(_) | StoreError::TooManyQueues { .. } => {
                Failure::Rejected
            }
            e if e.is_connection_dropped() => Failure::Dropped,
            // Server error replies, by their code; anything else is the
            // client's or the connection's.
            StoreError::Redis(e) => match e.clone().into_server_errors() {
                None => Failure::Unreached,
                Some(errors) if errors.is_empty() => Failure::Unreached,
                Some(errors) => {
                    if errors
                        .iter()
                        .all(|(_, err)| REFUSED_CODES.contains(&err.code()))
                    {
                        Failure::Refused
                    } else {
                        Failure::Rejected
                    }
                }
            },
        }
    }
}

/// The delay before retry number `attempt` (1-based: the attempt that just
/// failed): exponential from `retry_base_ms`, capped at `retry_max_ms`, with
/// "equal jitter" (half fixed, half random) so that tasks failing together
/// do not retry together.
pub fn backoff_ms(config: &WorkerConfig, attempt: u32) -> u64 {
    let exp = config
        .retry_base_ms
        .saturating_mul(1u64 << attempt.saturating_sub(1).min(30))
        .min(config.retry_max_ms);
    let half = exp / 2;
    half + rand::rng().random_range(0..=half)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a reply `-<line>` makes.
    fn reply_error(line: &str) -> StoreError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .expect("a RESP error reply");
        StoreError::Redis(value.extract_error().expect_err("an error reply"))
    }

    #[test]
    fn script_errors_are_rejections_and_not_now_replies_are_refusals() {
        let script = "WRONGTYPE Operation against a key holding the wrong kind of value \
                      script: abc, on @user_script:12.";
        assert_eq!(Failure::of(&reply_error(script)), Failure::Rejected);
        assert_eq!(
            Failure::of(&reply_error("ERR user_script:3: bad argument")),
            Failure::Rejected
        );
        assert_eq!(
            Failure::of(&StoreError::Protocol("odd".into())),
            Failure::Rejected
        );
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script",
            "OOM command not allowed when used memory > 'maxmemory'",
            "READONLY You can't write against a read only replica.",
        ] {
            assert_eq!(Failure::of(&reply_error(line)), Failure::Refused, "{line}");
        }
    }

    fn io_error(kind: std::io::ErrorKind) -> StoreError {
        StoreError::Redis(redis::RedisError::from(std::io::Error::from(kind)))
    }

    #[test]
    fn a_broken_connection_is_tried_again_on_a_new_one_and_not_a_rejection() {
        use std::io::ErrorKind;
        for kind in [
            ErrorKind::ConnectionReset,
            ErrorKind::BrokenPipe,
            ErrorKind::UnexpectedEof,
            ErrorKind::ConnectionRefused,
        ] {
            assert_eq!(Failure::of(&io_error(kind)), Failure::Dropped, "{kind:?}");
        }
        // No answer in time says nothing of the connection: backed off.
        assert_eq!(
            Failure::of(&io_error(ErrorKind::TimedOut)),
            Failure::Unreached
        );
    }
}
