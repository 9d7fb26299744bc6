//! The worker: reads tasks from the queues' streams, runs each through the
//! sandbox, and completes it.
//!
//! A worker is a set of loops sharing one state (`Shared`), each in its own
//! file:
//!
//! - the fetch loop (here): per queue, XREADGROUP of only as many messages as
//!   there are free execution slots, then one `start` script for the batch
//!   (on a task of its own, while the loop reads on);
//! - `executor.rs`: one task through the sandbox, its outcome mapped to a
//!   completion;
//! - `completion.rs`: writes completions in batches (one round trip per
//!   batch; one atomic script call per queue in it);
//! - `reclaim.rs`: heartbeats that keep a live worker's messages its own, and
//!   XAUTOCLAIM of the messages dead workers left pending;
//! - `delayed.rs`: moves due scheduled tasks and retries to the stream;
//! - `cancel.rs`: listens for cancel requests and interrupts running calls.
//!
//! [`run`] takes its shutdown signal as a future: when it resolves the worker
//! stops fetching, lets running tasks finish for the grace period, and
//! abandons the rest (their messages stay pending, to be reclaimed).

mod cancel;
mod completion;
mod delayed;
mod executor;
mod reclaim;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::config::Config;
use crate::sandbox::{CancelHandle, Sandbox};
use crate::store::{Delivery, StartDecision, Store, StoreError};

pub use completion::backoff_ms;

/// Most messages one XREADGROUP asks for, however many slots are free.
const MAX_BATCH: usize = 64;

/// How long one blocking read waits for new messages. Shutdown waits for the
/// read in flight rather than dropping it (a dropped read could leave
/// delivered messages unprocessed until reclaimed), so this bounds how long
/// the fetch loop takes to notice a shutdown.
const READ_BLOCK: Duration = Duration::from_millis(500);

/// A task this worker is running.
struct RunningTask {
    queue: String,
    msg_id: String,
    cancel: CancelHandle,
}

/// The tasks this worker holds, by id: from their start until their
/// completion is written. The heartbeat refreshes their messages and a
/// cancel request finds their handle here.
#[derive(Default)]
struct Running(Mutex<HashMap<String, RunningTask>>);

impl Running {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunningTask>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add `task`; it stays until the returned guard is dropped.
    fn register(self: &Arc<Self>, task_id: String, task: RunningTask) -> Registration {
        self.lock().insert(task_id.clone(), task);
        Registration {
            running: self.clone(),
            task_id,
        }
    }
}

/// A task's entry in [`Running`], removed when this is dropped however the
/// task ends (even by a panic): an entry left behind would keep the
/// heartbeat refreshing a message nobody holds, and it would never be
/// reclaimed.
struct Registration {
    running: Arc<Running>,
    task_id: String,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.running.lock().remove(&self.task_id);
    }
}

/// State every loop of one worker shares.
struct Shared {
    store: Store,
    sandbox: Sandbox,
    config: Config,
    /// This worker's consumer name in every queue's group.
    consumer: String,
    /// One permit per execution slot. The fetch and reclaim loops take
    /// permits before they read, so a worker never holds more messages than
    /// it can run.
    slots: Arc<Semaphore>,
    /// The tasks this worker holds.
    running: Arc<Running>,
    completions: mpsc::Sender<completion::Pending>,
    /// Every spawned executor, so shutdown can wait for them.
    tracker: TaskTracker,
    /// Cancelled when the grace period is over: executors still running
    /// return without completing, leaving their messages to be reclaimed.
    abandon: CancellationToken,
    /// Where executors, and so sandbox calls, run: a runtime of their own.
    /// A guest computing between two epoch ticks holds its thread; on the
    /// shared runtime, busy guests would starve the API, the heartbeats (and
    /// so get live tasks reclaimed) and the completer.
    guests: tokio::runtime::Handle,
}

impl Shared {
    /// Start a batch of deliveries of `queue` and dispatch each decision; one
    /// permit per delivery.
    async fn dispatch(
        self: &Arc<Self>,
        queue: &str,
        deliveries: Vec<Delivery>,
        mut permits: Vec<OwnedSemaphorePermit>,
    ) {
        let now = crate::ingest::now_ms();
        let decisions = match self
            .store
            .start(queue, &self.consumer, &deliveries, now)
            .await
        {
            Ok(decisions) => decisions,
            Err(e) => {
                // The messages stay pending on this consumer; they are
                // reclaimed after the visibility timeout.
                warn!(queue, error = %e, count = deliveries.len(), "start failed");
                return;
            }
        };
        let mut runs = Vec::with_capacity(deliveries.len());
        for (delivery, decision) in deliveries.into_iter().zip(decisions) {
            let Some(permit) = permits.pop() else { break };
            match decision {
                StartDecision::Run(task) => runs.push((delivery, task, permit)),
                StartDecision::Skip(status) => {
                    tracing::debug!(queue, task_id = %delivery.task_id, %status, "skipped");
                }
                StartDecision::Expired(task) => {
                    let finish = executor::finish_unrun(self.clone(), delivery, task, true, permit);
                    self.tracker.spawn(finish);
                }
                StartDecision::Exhausted(task) => {
                    let finish =
                        executor::finish_unrun(self.clone(), delivery, task, false, permit);
                    self.tracker.spawn(finish);
                }
            }
        }
        executor::spawn(self, runs);
    }

    /// Take one slot (waiting for it) and as many more as are free, up to
    /// `max`; `None` once `stop` is cancelled.
    async fn take_slots(
        &self,
        max: usize,
        stop: &CancellationToken,
    ) -> Option<Vec<OwnedSemaphorePermit>> {
        // Biased: with a free slot both branches are ready, and a stopping
        // worker must not read again.
        let first = tokio::select! {
            biased;
            () = stop.cancelled() => return None,
            permit = self.slots.clone().acquire_owned() => permit.ok()?,
        };
        let mut permits = vec![first];
        while permits.len() < max {
            match self.slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        Some(permits)
    }
}

/// Why a worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Redis failed while setting up.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// Run a worker until `shutdown` resolves, then shut down gracefully.
pub async fn run(
    store: Store,
    sandbox: Sandbox,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    config.validate().map_err(WorkerError::Config)?;
    for queue in &config.queues {
        store.ensure_group(queue).await?;
    }
    // Each completion holds its task's slot until written: room for one per
    // slot means handing one over never waits.
    let (tx, rx) = mpsc::channel(config.concurrency.max(1));
    let guest_runtime = GuestRuntime::new(config.concurrency)?;
    let consumer = format!("{}-{}", std::process::id(), uuid::Uuid::now_v7().simple());
    let shared = Arc::new(Shared {
        slots: Arc::new(Semaphore::new(config.concurrency)),
        store,
        sandbox,
        consumer,
        running: Arc::default(),
        completions: tx,
        tracker: TaskTracker::new(),
        abandon: CancellationToken::new(),
        guests: guest_runtime.handle.clone(),
        config,
    });
    info!(consumer = %shared.consumer, queues = ?shared.config.queues,
        concurrency = shared.config.concurrency, "worker started");

    let stop = CancellationToken::new();
    let finish = CancellationToken::new();
    let mut completer = tokio::spawn(completion::run(
        shared.store.clone(),
        rx,
        finish.clone(),
        shared.abandon.clone(),
    ));
    let mut loops = Vec::new();
    for queue in shared.config.queues.clone() {
        loops.push(tokio::spawn(fetch_loop(
            shared.clone(),
            queue.clone(),
            stop.clone(),
        )));
        loops.push(tokio::spawn(delayed::run(
            shared.clone(),
            queue,
            stop.clone(),
        )));
    }
    loops.push(tokio::spawn(reclaim::run(shared.clone(), stop.clone())));
    loops.push(tokio::spawn(cancel::listen(shared.clone(), stop.clone())));
    // Heartbeats outlive `stop`: running tasks keep their messages through
    // the grace period.
    let beats_stop = CancellationToken::new();
    let beats = tokio::spawn(reclaim::heartbeats(shared.clone(), beats_stop.clone()));

    shutdown.await;
    info!(consumer = %shared.consumer, "shutting down: no new tasks");
    stop.cancel();
    for l in loops {
        let _ = l.await;
    }
    shared.tracker.close();
    // One grace period for running tasks and the writes of their
    // completions; heartbeats go on until both are done.
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(shared.config.shutdown_grace_ms);
    if tokio::time::timeout_at(deadline, shared.tracker.wait())
        .await
        .is_err()
    {
        let left = shared.running.lock().len();
        warn!(
            left,
            "grace period over: abandoning running tasks to be reclaimed"
        );
        shared.abandon.cancel();
        shared.tracker.wait().await;
    }
    // Every executor is done and every completion handed over.
    finish.cancel();
    if tokio::time::timeout_at(deadline, &mut completer)
        .await
        .is_err()
    {
        warn!("grace period over: abandoning unwritten completions to be reclaimed");
        shared.abandon.cancel();
        let _ = completer.await;
    }
    beats_stop.cancel();
    let _ = beats.await;
    info!("worker stopped");
    Ok(())
}

/// The runtime sandbox calls run on (see [`Shared::guests`]).
///
/// Dropping a tokio runtime blocks until its threads stop, which panics in
/// an async context — and `run`'s future, which owns this, may be dropped in
/// one (an embedding runtime shutting down). So it is shut down in the
/// background instead.
struct GuestRuntime {
    /// Taken only on drop.
    runtime: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
}

impl GuestRuntime {
    fn new(concurrency: usize) -> Result<Self, WorkerError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(concurrency.clamp(
                1,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ))
            .thread_name("dtq-guest")
            .enable_all()
            .build()
            .map_err(|e| WorkerError::Config(format!("cannot start the guest runtime: {e}")))?;
        let handle = runtime.handle().clone();
        Ok(GuestRuntime {
            runtime: Some(runtime),
            handle,
        })
    }
}

impl Drop for GuestRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Read new messages of `queue` while slots are free, until `stop`. Each
/// batch is started and dispatched on a task of its own: the next read does
/// not wait for the last batch's `start` script.
async fn fetch_loop(shared: Arc<Shared>, queue: String, stop: CancellationToken) {
    let mut conn = None;
    let mut backoff = Backoff::default();
    while let Some(permits) = shared.take_slots(MAX_BATCH, &stop).await {
        let conn = match &mut conn {
            Some(conn) => conn,
            None => match shared
                .store
                .dedicated_connection(READ_BLOCK + Duration::from_secs(5))
                .await
            {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    warn!(queue, error = %e, "cannot connect for reading; retrying");
                    drop(permits);
                    backoff.wait(&stop).await;
                    continue;
                }
            },
        };
        let read = shared
            .store
            .read(conn, &queue, &shared.consumer, permits.len(), READ_BLOCK)
            .await;
        match read {
            Ok(deliveries) if deliveries.is_empty() => backoff.reset(),
            Ok(deliveries) => {
                backoff.reset();
                let dispatch = {
                    let shared = shared.clone();
                    let queue = queue.clone();
                    async move { shared.dispatch(&queue, deliveries, permits).await }
                };
                shared.tracker.spawn(dispatch);
            }
            Err(e) => {
                if e.to_string().contains("NOGROUP") {
                    let _ = shared.store.ensure_group(&queue).await;
                }
                warn!(queue, error = %e, "read failed; retrying");
                drop(permits);
                backoff.wait(&stop).await;
            }
        }
    }
}

/// Exponential backoff for loops that retry Redis: 50 ms doubling to 5 s.
#[derive(Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    fn reset(&mut self) {
        self.failures = 0;
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
