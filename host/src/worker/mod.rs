//! The worker: reads tasks from the queues' streams, runs each through the
//! sandbox, and completes it.
//!
//! A worker is a set of loops sharing one state (`Shared`), each in its own
//! file:
//!
//! - `fetch.rs`: one loop for all the worker's queues, reading each in turn
//!   for only as many messages as there are free execution slots, then one
//!   `start` script per batch (here, on a task of its own, while the loop
//!   reads on);
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
mod partitions;
mod reclaim;
mod retention;
mod schedule;
mod supervise;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::config::WorkerConfig as Config;
use crate::metrics::WorkerMetrics;
use crate::sandbox::{CancelHandle, Sandbox};
use crate::store::{Delivery, StartDecision, Store, StoreError};

pub use completion::backoff_ms;
pub use schedule::{Fired, HOLD, Pass, Scheduler, TickSubmission};
pub use supervise::LoopEnd;
#[doc(hidden)]
pub use supervise::{Fault, inject_fault};

/// Most messages one XREADGROUP asks for, however many slots are free.
const MAX_BATCH: usize = 64;

/// How long the fetch loop waits for new messages before it looks again
/// (see `fetch.rs`); the wait delivers nothing, so shutdown drops it.
const READ_BLOCK: Duration = Duration::from_millis(500);

/// A message this worker holds, and the attempt it runs.
struct Held {
    /// Shared by the messages of one batch.
    queue: Arc<str>,
    delivery: Delivery,
    /// The attempt `start` counted; `None` before `start` has answered, and
    /// for a message it decided not to run (whose completion is on its way).
    attempt: Option<u32>,
    cancel: CancelHandle,
    /// Set once the heartbeat found the task reclaimed elsewhere.
    stale: Arc<AtomicBool>,
}

/// [`Held`] messages by registration id; foldhash: the ids are this
/// process's own, and the map is hashed into three times per task.
type HeldById = HashMap<u64, Held, foldhash::fast::RandomState>;

/// The messages this worker holds: each from just before its `start` until
/// its completion is written. The heartbeat keeps those of started attempts
/// and stamps each attempt still the task's; reclaim leaves alone this
/// worker's own idle messages that are held here; a cancel request finds
/// the attempt's handle here.
///
/// Entries are keyed by a registration id, not by task id: one task can have
/// two attempts here for a moment (a stale one being stopped and the next),
/// and ending the old one must not remove the new one's entry (its
/// heartbeats would stop, and a live attempt would be reclaimed as lost).
#[derive(Default)]
struct Running {
    held: Mutex<HeldById>,
    next_id: AtomicU64,
    /// `dtq_worker_tasks_in_flight`: one per registration alive.
    in_flight: Gauge,
}

impl Running {
    /// An empty set that counts its registrations in `in_flight`.
    fn counted(in_flight: Gauge) -> Running {
        Running {
            in_flight,
            ..Running::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HeldById> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold each message of `deliveries` of `queue` until its returned
    /// guard is dropped (one guard per message, in order). One counts as a
    /// running attempt once [`Running::started_as`] says which.
    fn hold(self: &Arc<Self>, queue: &Arc<str>, deliveries: &[Delivery]) -> Vec<Registration> {
        let mut held = self.lock();
        self.hold_locked(&mut held, queue, deliveries)
    }

    /// [`Running::hold`], the set already locked.
    fn hold_locked(
        self: &Arc<Self>,
        held: &mut HeldById,
        queue: &Arc<str>,
        deliveries: &[Delivery],
    ) -> Vec<Registration> {
        let registrations = deliveries
            .iter()
            .map(|delivery| {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let cancel = CancelHandle::new();
                let stale = Arc::new(AtomicBool::new(false));
                held.insert(
                    id,
                    Held {
                        queue: queue.clone(),
                        // The message, not the task it may carry (its payload).
                        delivery: Delivery {
                            msg_id: delivery.msg_id.clone(),
                            task_id: delivery.task_id.clone(),
                            carried: None,
                        },
                        attempt: None,
                        cancel: cancel.clone(),
                        stale: stale.clone(),
                    },
                );
                Registration {
                    running: self.clone(),
                    id,
                    cancel,
                    stale,
                }
            })
            .collect();
        self.in_flight.inc_by(deliveries.len() as i64);
        registrations
    }

    /// Hold each message of `deliveries` of `queue` that is not held yet,
    /// at most `max` of them, in one step: the messages taken, each with
    /// its guard. Two loops that find the same pending message (the
    /// reclaim of this worker's own, and the fetch loop reading them back)
    /// cannot both take it, so one delivery never runs twice at once.
    fn hold_unheld(
        self: &Arc<Self>,
        queue: &Arc<str>,
        deliveries: Vec<Delivery>,
        max: usize,
    ) -> (Vec<Delivery>, Vec<Registration>) {
        let mut held = self.lock();
        let mut taken = Vec::new();
        for delivery in deliveries {
            if taken.len() == max {
                break;
            }
            let dup = |h: &Held| h.queue == *queue && h.delivery.msg_id == delivery.msg_id;
            if held.values().any(dup)
                || taken.iter().any(|d: &Delivery| d.msg_id == delivery.msg_id)
            {
                continue;
            }
            taken.push(delivery);
        }
        let registrations = self.hold_locked(&mut held, queue, &taken);
        (taken, registrations)
    }

    /// Each registration of `started` runs its task as the attempt given,
    /// from now on.
    fn started_as<'a>(&self, started: impl IntoIterator<Item = (&'a Registration, u32)>) {
        let mut held = self.lock();
        for (registration, attempt) in started {
            if let Some(h) = held.get_mut(&registration.id) {
                h.attempt = Some(attempt);
            }
        }
    }

    /// Whether message `msg_id` of `queue` is held.
    #[cfg(test)]
    fn holds(&self, queue: &str, msg_id: &str) -> bool {
        self.lock()
            .values()
            .any(|h| &*h.queue == queue && h.delivery.msg_id == msg_id)
    }

    /// Interrupt every attempt of task `task_id` of `queue` held here;
    /// whether there was one.
    fn cancel_task(&self, queue: &str, task_id: &str) -> bool {
        let held = self.lock();
        let mut found = false;
        for h in held
            .values()
            .filter(|h| &*h.queue == queue && h.delivery.task_id == task_id)
        {
            h.cancel.cancel();
            found = true;
        }
        found
    }

    /// Interrupt the attempt registered as `id`, if it is still held.
    fn cancel(&self, id: u64) {
        if let Some(h) = self.lock().get(&id) {
            h.cancel.cancel();
        }
    }

    /// Stop the attempt registered as `id` as stale: interrupted, and it
    /// hands over no completion. Returns it the first time only.
    fn stop_stale(&self, id: u64) -> Option<(Delivery, u32)> {
        let held = self.lock();
        let h = held.get(&id)?;
        if h.stale.swap(true, Ordering::AcqRel) {
            return None;
        }
        h.cancel.cancel();
        Some((h.delivery.clone(), h.attempt.unwrap_or(0)))
    }

    /// The started attempts, by queue: registration id, delivery, attempt.
    fn started(&self) -> HashMap<String, Vec<(u64, Delivery, u32)>> {
        let mut by_queue: HashMap<String, Vec<_>> = HashMap::new();
        for (id, h) in self.lock().iter() {
            if let Some(attempt) = h.attempt {
                by_queue.entry(h.queue.to_string()).or_default().push((
                    *id,
                    h.delivery.clone(),
                    attempt,
                ));
            }
        }
        by_queue
    }

    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// A message's entry in [`Running`], removed when this is dropped however
/// its task ends (even by a panic): an entry left behind would keep the
/// heartbeat refreshing a message nobody holds, and it would never be
/// reclaimed.
struct Registration {
    running: Arc<Running>,
    id: u64,
    cancel: CancelHandle,
    stale: Arc<AtomicBool>,
}

impl Registration {
    /// The handle that interrupts the attempt's sandbox call.
    fn cancel_handle(&self) -> &CancelHandle {
        &self.cancel
    }

    /// Whether the attempt was found stale: its task was reclaimed by
    /// another worker, and it must write nothing.
    fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Acquire)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.running.lock().remove(&self.id);
        self.running.in_flight.dec();
    }
}

/// State every loop of one worker shares.
struct Shared {
    store: Store,
    sandbox: Sandbox,
    config: Config,
    /// What `/metrics` shows of this worker.
    metrics: WorkerMetrics,
    /// This worker's consumer name in every queue's group.
    consumer: String,
    /// The key sets this worker consumes: every partition of each of its
    /// queues (a queue nobody partitioned is one), kept current by
    /// `partitions.rs`. The per-queue loops read it each round.
    partitions: watch::Sender<Arc<Vec<String>>>,
    /// One permit per execution slot. The fetch and reclaim loops take
    /// permits before they read, so a worker never holds more messages than
    /// it can run.
    slots: Arc<Semaphore>,
    /// The messages this worker holds, and the attempts it runs.
    running: Arc<Running>,
    /// Set when a reply from Redis may have been lost with messages pending
    /// on this worker that it does not hold (a read, a `start` or a reclaim
    /// that failed): the fetch loop then reads back this worker's pending
    /// messages at once, rather than a visibility timeout later.
    read_back: AtomicBool,
    completions: mpsc::Sender<completion::Pending>,
    /// Every spawned executor, so shutdown can wait for them.
    tracker: TaskTracker,
    /// Cancelled when the grace period is over: executors still running
    /// return without completing, leaving their messages to be reclaimed.
    abandon: CancellationToken,
    /// Where executors, and so sandbox calls, run: a runtime of their own.
    /// A guest computing between two epoch ticks holds its thread; on the
    /// shared runtime, busy guests would starve the API and the heartbeats
    /// (and so get live tasks reclaimed).
    ///
    /// The loops that feed the calls and write their outcomes (fetch,
    /// `start`, the completer) run here too, with a connection of their
    /// own ([`Shared::feed`]): a task then goes from its read to its
    /// completion on one thread, where crossing between runtimes took two
    /// thread hand-offs per batch and a tenth of the worker's CPU per task
    /// (`docs/queue-bench.md`). Busy guests delay them by up to an epoch
    /// tick each, but those loops only feed the same busy CPUs; what must
    /// never wait (heartbeats, reclaim, cancel, the API) stays on the
    /// shared runtime.
    guests: tokio::runtime::Handle,
    /// The store of the fetch loop, `start` and the completer: a clone of
    /// [`Shared::store`] whose connection does its I/O on the guest
    /// runtime.
    feed: Store,
}

impl Shared {
    /// Every partition of every queue of this worker, as last read.
    fn queues(&self) -> Arc<Vec<String>> {
        self.partitions.borrow().clone()
    }

    /// Start a batch of deliveries of `queue` and dispatch each decision; one
    /// permit per delivery. Each message is held from before its `start`
    /// until its completion is written, so this worker's own reclaim never
    /// takes back a message it is starting or running.
    ///
    /// This is for messages that may be held already (this worker's own
    /// pending messages, reclaimed or read back): those held are left
    /// alone, and the permits they would have taken released.
    async fn dispatch_unheld(
        self: &Arc<Self>,
        queue: &str,
        deliveries: Vec<Delivery>,
        permits: Vec<OwnedSemaphorePermit>,
    ) {
        let (deliveries, holds) =
            self.running
                .hold_unheld(&queue.into(), deliveries, permits.len());
        if !deliveries.is_empty() {
            self.dispatch_held(queue, deliveries, holds, permits).await;
        }
    }

    /// [`Shared::dispatch_unheld`] of messages held already, one guard in
    /// `holds` per delivery.
    async fn dispatch_held(
        self: &Arc<Self>,
        queue: &str,
        mut deliveries: Vec<Delivery>,
        holds: Vec<Registration>,
        mut permits: Vec<OwnedSemaphorePermit>,
    ) {
        let now = crate::base::now_ms();
        let decisions = match self
            .feed
            .start(queue, &self.consumer, &mut deliveries, now)
            .await
        {
            Ok(decisions) => decisions,
            Err(e) => {
                // The messages stay pending on this consumer, held no more.
                // The script may have run with its reply lost: started again
                // by this consumer, each resumes its attempt (`start.lua`).
                // After a failure to reach Redis the fetch loop reads them
                // back at once; after any other, this worker reclaims them
                // after the visibility timeout.
                warn!(queue, error = %e, count = deliveries.len(), "start failed");
                if matches!(e, StoreError::Redis(_)) {
                    self.read_back.store(true, Ordering::Release);
                }
                return;
            }
        };
        let mut runs = Vec::with_capacity(deliveries.len());
        for ((delivery, decision), hold) in deliveries.into_iter().zip(decisions).zip(holds) {
            let Some(permit) = permits.pop() else { break };
            match decision {
                StartDecision::Run(task) => runs.push((delivery, task, permit, hold)),
                StartDecision::Skip(status) => {
                    tracing::debug!(queue, task_id = %delivery.task_id, %status, "skipped");
                }
                StartDecision::Corrupt(error) => {
                    error!(queue, task_id = %delivery.task_id, %error, "corrupt task record dead-lettered");
                }
                StartDecision::Expired(task) => {
                    let finish =
                        executor::finish_unrun(self.clone(), delivery, task, true, permit, hold);
                    self.tracker.spawn(finish);
                }
                StartDecision::Exhausted(task) => {
                    let finish =
                        executor::finish_unrun(self.clone(), delivery, task, false, permit, hold);
                    self.tracker.spawn(finish);
                }
            }
        }
        self.running
            .started_as(runs.iter().map(|(_, task, _, hold)| (hold, task.attempts)));
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
    config: Config,
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
    config: Config,
    metrics: WorkerMetrics,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    config.validate().map_err(WorkerError::Config)?;
    let names = partitions::of_queues(&store, &config.queues).await?;
    for name in &names {
        store.ensure_group(name).await?;
    }
    // Each completion holds its task's slot until written: room for one per
    // slot means handing one over never waits.
    let (tx, rx) = mpsc::channel(config.concurrency.max(1));
    let guest_runtime = GuestRuntime::new(config.concurrency)?;
    let feed = {
        let store = store.clone();
        guest_runtime
            .handle
            .spawn(async move { store.with_own_connection().await })
            .await
            .map_err(|e| {
                WorkerError::Config(format!("cannot connect from the guest runtime: {e}"))
            })??
    };
    let consumer = format!("{}-{}", std::process::id(), crate::base::unique_token());
    let _slots = metrics.hold_slots(config.concurrency);
    let shared = Arc::new(Shared {
        partitions: watch::Sender::new(Arc::new(names)),
        slots: Arc::new(Semaphore::new(config.concurrency)),
        store,
        sandbox,
        consumer,
        running: Arc::new(Running::counted(metrics.in_flight())),
        read_back: AtomicBool::new(false),
        metrics,
        completions: tx,
        tracker: TaskTracker::new(),
        abandon: CancellationToken::new(),
        guests: guest_runtime.handle.clone(),
        feed,
        config,
    });
    info!(consumer = %shared.consumer, queues = ?shared.queues(),
        concurrency = shared.config.concurrency, "worker started");

    let stop = CancellationToken::new();
    let finish = CancellationToken::new();
    // Three sets, stopped one after the other at shutdown; each aborts its
    // loops if dropped (see `supervise::Loops`).
    let mut completer = supervise::Loops::default();
    completer.spawn_on(
        "completer",
        completion::run(
            shared.feed.clone(),
            rx,
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
    for name in shared.queues().iter() {
        spawn_partition_loops(&mut loops, &shared, name, &stop);
    }
    for queue in shared.config.queues.clone() {
        let name = format!("scheduler of queue {queue}");
        loops.spawn(name, schedule::run(shared.clone(), queue, stop.clone()));
    }
    let (added_tx, mut added) = mpsc::unbounded_channel();
    loops.spawn(
        "partition watcher",
        partitions::watch(shared.clone(), added_tx, stop.clone()),
    );
    loops.spawn("reclaim", reclaim::run(shared.clone(), stop.clone()));
    loops.spawn(
        "dlq retention",
        retention::run(shared.clone(), stop.clone()),
    );
    loops.spawn(
        "cancel listener",
        cancel::listen(shared.clone(), stop.clone()),
    );
    // Heartbeats outlive `stop`: running tasks keep their messages through
    // the grace period.
    let beats_stop = CancellationToken::new();
    let mut beats = supervise::Loops::default();
    beats.spawn(
        "heartbeats",
        reclaim::heartbeats(shared.clone(), beats_stop.clone()),
    );

    // Until shutdown, no loop may end: one that does (a panic, or a return
    // it should never make) stops the worker, which then ends with an error
    // naming it.
    // New partitions of a raise get their loops here, where they are
    // supervised with the others.
    let mut shutdown = std::pin::pin!(shutdown);
    let failed = loop {
        tokio::select! {
            () = &mut shutdown => break None,
            Some(end) = loops.next_end() => break Some(end),
            Some(end) = completer.next_end() => break Some(end),
            Some(end) = beats.next_end() => break Some(end),
            Some(name) = added.recv() => {
                spawn_partition_loops(&mut loops, &shared, &name, &stop);
            }
        }
    };
    match &failed {
        None => info!(consumer = %shared.consumer, "shutting down: no new tasks"),
        Some(end) => error!(consumer = %shared.consumer, error = %end,
            "a worker loop ended: stopping the worker"),
    }
    stop.cancel();
    let mut failed = failed.or(loops.join().await);
    shared.tracker.close();
    // One grace period for running tasks and the writes of their
    // completions; heartbeats go on until both are done.
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
    failed = failed.or(beats.join().await);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(msg_id: &str, task_id: &str) -> Delivery {
        Delivery {
            msg_id: msg_id.into(),
            task_id: task_id.into(),
            carried: None,
        }
    }

    /// Hold `deliveries` of queue `q`.
    fn hold<const N: usize>(
        running: &Arc<Running>,
        deliveries: [Delivery; N],
    ) -> [Registration; N] {
        let held = running.hold(&"q".into(), &deliveries);
        held.try_into().ok().expect("one registration per delivery")
    }

    #[test]
    fn a_new_attempt_of_a_task_outlives_the_old_ones_registration() {
        let running = Arc::new(Running::default());
        // Attempt 1 of task t, then attempt 2 of the same task (reclaimed
        // here, on another message, while attempt 1 is still being ended).
        let [old] = hold(&running, [delivery("1-0", "t")]);
        running.started_as([(&old, 1)]);
        let [new] = hold(&running, [delivery("2-0", "t")]);
        running.started_as([(&new, 2)]);
        drop(old);

        // The new attempt is still held, still beaten for, and a cancel of
        // the task still finds it.
        assert!(running.holds("q", "2-0"));
        assert!(!running.holds("q", "1-0"));
        let started = running.started();
        assert_eq!(started.len(), 1);
        let beats: Vec<(&str, u32)> = started["q"]
            .iter()
            .map(|(_, d, attempt)| (d.msg_id.as_str(), *attempt))
            .collect();
        assert_eq!(beats, [("2-0", 2)]);
        assert!(running.cancel_task("q", "t"));
        assert!(new.cancel_handle().is_cancelled());

        drop(new);
        assert_eq!(running.len(), 0);
        assert!(!running.cancel_task("q", "t"));
    }

    #[test]
    fn the_same_message_held_twice_is_released_once_per_registration() {
        let running = Arc::new(Running::default());
        let [first, second] = hold(&running, [delivery("1-0", "t"), delivery("1-0", "t")]);
        drop(first);
        assert!(running.holds("q", "1-0"));
        drop(second);
        assert!(!running.holds("q", "1-0"));
    }

    #[test]
    fn a_message_held_already_is_not_taken_again() {
        let running = Arc::new(Running::default());
        // Being run here, then read back (or reclaimed) with two others,
        // one of them twice, and room for one only at first.
        let [_run] = hold(&running, [delivery("1-0", "a")]);
        let pending = || {
            vec![
                delivery("1-0", "a"),
                delivery("2-0", "b"),
                delivery("2-0", "b"),
            ]
        };
        let (taken, holds) = running.hold_unheld(&"q".into(), pending(), 1);
        let ids: Vec<&str> = taken.iter().map(|d| d.msg_id.as_str()).collect();
        assert_eq!((ids, holds.len()), (vec!["2-0"], 1));
        // Read back again while those run: nothing left to take.
        let (taken, holds) = running.hold_unheld(&"q".into(), pending(), 8);
        assert!(taken.is_empty() && holds.is_empty(), "{taken:?}");
        assert_eq!(running.len(), 2);
    }

    #[test]
    fn only_started_attempts_are_beaten_for_and_a_stale_one_is_stopped_once() {
        let running = Arc::new(Running::default());
        let [starting, run] = hold(&running, [delivery("1-0", "a"), delivery("2-0", "b")]);
        assert_eq!(running.in_flight.get(), 2);
        running.started_as([(&run, 3)]);
        let started = running.started();
        let ids: Vec<u64> = started["q"].iter().map(|(id, _, _)| *id).collect();
        assert_eq!(ids.len(), 1);

        let stopped = running.stop_stale(ids[0]);
        assert_eq!(
            stopped.map(|(d, attempt)| (d.task_id, attempt)),
            Some(("b".to_owned(), 3))
        );
        assert!(run.is_stale() && run.cancel_handle().is_cancelled());
        assert!(running.stop_stale(ids[0]).is_none(), "reported twice");
        assert!(!starting.is_stale() && !starting.cancel_handle().is_cancelled());

        // Once its registration is gone, a late report touches nothing.
        drop(run);
        assert!(running.stop_stale(ids[0]).is_none());
    }
}
