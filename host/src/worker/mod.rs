//! The worker: reads tasks from the queues' streams, runs each through the
//! sandbox, and completes it.
//!
//! A worker is a set of loops sharing one state (`Shared`, in `shared.rs`,
//! with the start and dispatch of a batch of messages; `running.rs`: the
//! messages it holds), started by `start.rs`, each loop in its own file:
//!
//! - `fetch.rs`: one loop for all the worker's queues, reading each in turn
//!   for only as many messages as there are free execution slots, then one
//!   `start` script per batch (here, on a task of its own, while the loop
//!   reads on); `wait.rs`: how it waits when every queue is empty;
//! - `executor.rs`: one task through the sandbox, its outcome mapped to a
//!   completion;
//! - `completion.rs`: writes completions in batches (one round trip per
//!   batch; one atomic script call per queue in it);
//! - `reclaim.rs`: heartbeats that stamp a worker alive on each of its queues
//!   and keep its running messages, and the reclaim of messages that dead
//!   workers left pending;
//! - `delayed.rs`: moves due scheduled tasks and retries to the stream;
//! - `expiry.rs`: expires waiting tasks whose expiry has passed, on time;
//! - `schedule.rs`: fires the queues' periodic tasks, one task per tick
//!   across the fleet ([`Scheduler`]);
//! - `cancel.rs`: listens for cancel requests and interrupts running calls;
//! - `retention.rs`: purges dead-lettered tasks past `--dlq-retention-s`
//!   or beyond `--dlq-max`, so the DLQ stays bounded;
//! - `partitions.rs`: follows the partition counts of the worker's queues,
//!   so that a raise is consumed without a restart;
//! - `flow.rs`: follows which of the worker's queues are paused, and their
//!   limits;
//! - `supervise.rs`: names every loop; [`run`] stops with an error naming a
//!   loop that ended on its own, so the process exits and is restarted
//!   instead of staying up doing nothing.
//!
//! What a worker does (attempt outcomes and durations, traps, tasks in
//! flight, slots) is recorded for `/metrics` into the [`WorkerMetrics`]
//! given to [`run_with_metrics`].
//!
//! [`run`] takes its shutdown signal as a future: when it resolves the worker
//! stops fetching, lets running tasks finish for the grace period, and
//! abandons the rest (their messages stay pending, to be reclaimed). Dropped
//! without a shutdown, it stops every loop at once, as a crashed process.

mod cancel;
mod completion;
mod delayed;
mod executor;
mod expiry;
mod fetch;
mod flow;
mod outbox;
mod partitions;
mod reclaim;
mod retention;
mod running;
mod schedule;
mod shared;
mod start;
mod supervise;
mod wait;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::sandbox::Sandbox;
use crate::store::{Store, StoreError};
use running::Registration;
use shared::Shared;

pub use completion::backoff_ms;
pub use schedule::{Fired, HOLD, Pass, Scheduler, TickSubmission};
pub use supervise::LoopEnd;
#[doc(hidden)]
pub use supervise::{Fault, inject_fault};

/// Most messages one XREADGROUP asks for, however many slots are free.
const MAX_BATCH: usize = 64;

/// How long the fetch loop waits for new messages before it looks again
/// (see `fetch.rs`), and so how long a stop may wait for its read.
const READ_BLOCK: Duration = Duration::from_millis(500);

/// Why a worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Redis failed while setting up.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The runtime guests run on could not be started (its threads).
    #[error("cannot start the guest runtime")]
    GuestRuntime(#[source] std::io::Error),
    /// A task set up on the guest runtime did not return (it panicked, or
    /// the runtime shut down under it).
    #[error("a set-up task on the guest runtime failed")]
    GuestTask(#[source] tokio::task::JoinError),
    /// A loop of the worker panicked or returned while it should have run
    /// on; the worker stopped the others and ended.
    #[error(transparent)]
    LoopEnded(#[from] LoopEnd),
}

/// Run a worker until `shutdown` resolves, then shut down gracefully.
/// What it records for `/metrics` goes nowhere: a server process runs
/// [`run_with_metrics`].
pub async fn run(
    store: Store,
    sandbox: Sandbox,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    run_with_metrics(store, sandbox, config, WorkerMetrics::detached(), shutdown).await
}

/// [`run`], recording attempt outcomes and durations, traps, in-flight
/// tasks and slots into `metrics` (the process's, see
/// [`crate::metrics::Metrics::worker`]).
pub async fn run_with_metrics(
    store: Store,
    sandbox: Sandbox,
    config: WorkerConfig,
    metrics: WorkerMetrics,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    let started = start::prepare(store, sandbox, config, metrics).await?;
    let shared = started.shared;
    info!(consumer = %shared.consumer, queues = ?shared.queues(),
        concurrency = shared.config.concurrency, "worker started");
    let mut sets = LoopSets::spawn(&shared, started.completions);
    let failed = sets.supervise(&shared, shutdown).await;
    match &failed {
        None => info!(consumer = %shared.consumer, "shutting down: no new tasks"),
        Some(end) => error!(consumer = %shared.consumer, error = %end,
            "a worker loop ended: stopping the worker"),
    }
    let failed = sets.shut_down(&shared, failed).await;
    drop(started.lives);
    match failed {
        None => {
            info!("worker stopped");
            Ok(())
        }
        Some(end) => {
            error!(error = %end, "worker stopped after a loop failed");
            Err(end.into())
        }
    }
}

/// A worker's loops, in three sets stopped one after the other at
/// shutdown; each aborts its loops if dropped (see `supervise::Loops`).
struct LoopSets {
    /// Everything that fetches, reclaims, schedules or listens: stopped
    /// first, by `stop`.
    loops: supervise::Loops,
    stop: CancellationToken,
    /// Writes the completions: stopped by `finish` once every executor is
    /// done.
    completer: supervise::Loops,
    finish: CancellationToken,
    /// Heartbeats outlive `stop`: running tasks keep their messages
    /// through the grace period. Stopped last, by `beats_stop`.
    beats: supervise::Loops,
    beats_stop: CancellationToken,
    /// Partitions added by a raise, whose loops are to be spawned.
    added: mpsc::UnboundedReceiver<String>,
}

impl LoopSets {
    /// Spawn every loop of the worker; the completer takes `completions`.
    fn spawn(shared: &Arc<Shared>, completions: mpsc::Receiver<completion::Pending>) -> LoopSets {
        let stop = CancellationToken::new();
        let finish = CancellationToken::new();
        let mut completer = supervise::Loops::default();
        completer.spawn_on(
            "completer",
            completion::run(
                shared.feed.clone(),
                shared.config.ingest_settings(),
                completions,
                finish.clone(),
                shared.abandon.clone(),
            ),
            &shared.guests,
        );
        let mut loops = supervise::Loops::default();
        loops.spawn_on(
            "fetch",
            fetch::run(shared.clone(), stop.clone()),
            &shared.guests,
        );
        loops.spawn("flow watcher", flow::watch(shared.clone(), stop.clone()));
        for name in shared.queues().iter() {
            spawn_partition_loops(&mut loops, shared, name, &stop);
        }
        for queue in shared.config.queue_names() {
            let name = format!("scheduler of queue {queue}");
            loops.spawn(name, schedule::run(shared.clone(), queue, stop.clone()));
        }
        let (added_tx, added) = mpsc::unbounded_channel();
        loops.spawn(
            "partition watcher",
            partitions::watch(shared.clone(), added_tx, stop.clone()),
        );
        loops.spawn("reclaim", reclaim::run(shared.clone(), stop.clone()));
        loops.spawn("flow sweep", outbox::sweep(shared.clone(), stop.clone()));
        loops.spawn(
            "dlq retention",
            retention::run(shared.clone(), stop.clone()),
        );
        loops.spawn(
            "cancel listener",
            cancel::listen(shared.clone(), stop.clone()),
        );
        let beats_stop = CancellationToken::new();
        let mut beats = supervise::Loops::default();
        beats.spawn(
            "heartbeats",
            reclaim::heartbeats(shared.clone(), beats_stop.clone()),
        );
        LoopSets {
            loops,
            stop,
            completer,
            finish,
            beats,
            beats_stop,
            added,
        }
    }

    /// Run until `shutdown` resolves (`None`) or a loop ends: until
    /// shutdown, no loop may end, and one that does (a panic, or a return
    /// it should never make) stops the worker, which then ends with an
    /// error naming it. New partitions of a raise get their loops here,
    /// where they are supervised with the others.
    async fn supervise(
        &mut self,
        shared: &Arc<Shared>,
        shutdown: impl Future<Output = ()>,
    ) -> Option<LoopEnd> {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return None,
                Some(end) = self.loops.next_end() => return Some(end),
                Some(end) = self.completer.next_end() => return Some(end),
                Some(end) = self.beats.next_end() => return Some(end),
                Some(name) = self.added.recv() => {
                    spawn_partition_loops(&mut self.loops, shared, &name, &self.stop);
                }
            }
        }
    }

    /// Stop the sets one after the other: no new tasks, then one grace
    /// period for running tasks and the writes of their completions, then
    /// the heartbeats. The first loop that `failed`, or that failed while
    /// stopping.
    async fn shut_down(self, shared: &Shared, failed: Option<LoopEnd>) -> Option<LoopEnd> {
        let LoopSets {
            mut loops,
            stop,
            mut completer,
            finish,
            mut beats,
            beats_stop,
            added: _,
        } = self;
        stop.cancel();
        let mut failed = failed.or(loops.join().await);
        shared.tracker.close();
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(shared.config.shutdown_grace_ms);
        if tokio::time::timeout_at(deadline, shared.tracker.wait())
            .await
            .is_err()
        {
            let left = shared.running.len();
            warn!(
                left,
                "grace period over: abandoning running tasks to be reclaimed"
            );
            shared.abandon.cancel();
            shared.tracker.wait().await;
        }
        // Every executor is done and every completion handed over.
        finish.cancel();
        match tokio::time::timeout_at(deadline, completer.join()).await {
            Ok(end) => failed = failed.or(end),
            Err(_) => {
                warn!("grace period over: abandoning unwritten completions to be reclaimed");
                shared.abandon.cancel();
                failed = failed.or(completer.join().await);
            }
        }
        beats_stop.cancel();
        failed.or(beats.join().await)
    }
}

/// Spawn the loops each partition (key set) `name` has of its own: the
/// delayed mover and the expiry sweep.
fn spawn_partition_loops(
    loops: &mut supervise::Loops,
    shared: &Arc<Shared>,
    name: &str,
    stop: &CancellationToken,
) {
    loops.spawn(
        format!("delayed mover of queue {name}"),
        delayed::run(shared.clone(), name.to_owned(), stop.clone()),
    );
    loops.spawn(
        format!("expiry sweep of queue {name}"),
        expiry::run(shared.clone(), name.to_owned(), stop.clone()),
    );
}

/// A loop's period: ticks every `period` from the first, at once, a late
/// tick delaying the next ones rather than bunching them.
struct Every(tokio::time::Interval);

impl Every {
    fn new(period: Duration) -> Self {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Every(ticks)
    }

    /// Wait for the next tick; `false` once `stop` is cancelled (which wins
    /// over a tick due at the same time).
    async fn tick(&mut self, stop: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            () = stop.cancelled() => false,
            _ = self.0.tick() => true,
        }
    }
}

/// Exponential backoff for loops that retry Redis: 50 ms doubling to 5 s.
#[derive(Default)]
struct Backoff {
    failures: u32,
    /// Whether the last wait was skipped for a broken connection.
    skipped: bool,
}

impl Backoff {
    fn reset(&mut self) {
        self.failures = 0;
        self.skipped = false;
    }

    /// After a failed try: none at all when it found its connection
    /// broken (`dropped`, see [`StoreError::is_connection_dropped`]) and
    /// the try before it did not, else the next delay. `false` when `stop`
    /// ended it early.
    async fn wait_after(&mut self, dropped: bool, stop: &CancellationToken) -> bool {
        if dropped && !self.skipped {
            self.skipped = true;
            return !stop.is_cancelled();
        }
        self.skipped = false;
        self.wait(stop).await
    }

    /// The next delay; each call doubles the one after it.
    fn next_delay(&mut self) -> Duration {
        let ms = (50u64 << self.failures.min(7)).min(5_000);
        self.failures += 1;
        Duration::from_millis(ms)
    }

    /// Sleep the next delay; `false` when `stop` ended it early.
    async fn wait(&mut self, stop: &CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep(self.next_delay()) => true,
            () = stop.cancelled() => false,
        }
    }
}
