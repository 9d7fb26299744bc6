//! The state every loop of one worker shares ([`Shared`]), and how a batch
//! of delivered messages is started and dispatched to the executors.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, warn};

use super::flow::Flow;
use super::running::{Registration, Running};
use super::{completion, executor};
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::sandbox::Sandbox;
use crate::store::{Admission, Delivery, Limits, StartDecision, Store, StoreError, logical_queue};

/// Whether a batch of a queue with limits is admitted yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// Admit it before it starts, if its queue has limits
    /// ([`Store::admit`]): delivered by a wait, a reclaim, a read back.
    Due,
    /// Admitted by the read that delivered it ([`Store::read_admitted`]).
    Done,
}

/// State every loop of one worker shares.
pub(super) struct Shared {
    pub(super) store: Store,
    pub(super) sandbox: Sandbox,
    pub(super) config: WorkerConfig,
    /// What `/metrics` shows of this worker.
    pub(super) metrics: WorkerMetrics,
    /// This worker's consumer name in every queue's group.
    pub(super) consumer: String,
    /// The key sets this worker consumes: every partition of each of its
    /// queues (a queue nobody partitioned is one), kept current by
    /// `partitions.rs`. The per-queue loops read it each round.
    pub(super) partitions: watch::Sender<Arc<Vec<String>>>,
    /// Which of the worker's queues are paused, and their limits, kept
    /// current by `flow.rs`: the fetch loop reads no paused queue, a batch
    /// of one is not started, and a batch of a queue with limits is
    /// admitted first.
    pub(super) flow: watch::Sender<Arc<Flow>>,
    /// One permit per execution slot. The fetch and reclaim loops take
    /// permits before they read, so a worker never holds more messages than
    /// it can run.
    pub(super) slots: Arc<Semaphore>,
    /// The messages this worker holds, and the attempts it runs.
    pub(super) running: Arc<Running>,
    /// Set when a reply from Redis may have been lost with messages pending
    /// on this worker that it does not hold (a read, a `start` or a reclaim
    /// that failed): the fetch loop then reads back this worker's pending
    /// messages at once, rather than a visibility timeout later.
    pub(super) read_back: AtomicBool,
    pub(super) completions: mpsc::Sender<completion::Pending>,
    /// Every spawned executor, so shutdown can wait for them.
    pub(super) tracker: TaskTracker,
    /// Cancelled when the grace period is over: executors still running
    /// return without completing, leaving their messages to be reclaimed.
    pub(super) abandon: CancellationToken,
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
    pub(super) guests: tokio::runtime::Handle,
    /// The store of the fetch loop, `start` and the completer: a clone of
    /// [`Shared::store`] whose connection does its I/O on the guest
    /// runtime.
    pub(super) feed: Store,
}

impl Shared {
    /// Every partition of every queue of this worker, as last read.
    pub(super) fn queues(&self) -> Arc<Vec<String>> {
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
    pub(super) async fn dispatch_unheld(
        self: &Arc<Self>,
        queue: &str,
        deliveries: Vec<Delivery>,
        permits: Vec<OwnedSemaphorePermit>,
    ) {
        let (deliveries, holds) =
            self.running
                .hold_unheld(&queue.into(), deliveries, permits.len());
        if !deliveries.is_empty() {
            self.dispatch_held(queue, deliveries, Admit::Due, holds, permits)
                .await;
        }
    }

    /// Whether the queue of partition `queue` is paused.
    pub(super) fn is_paused(&self, queue: &str) -> bool {
        self.flow.borrow().paused.contains(logical_queue(queue))
    }

    /// The limits of the queue of partition `queue`, if it has some, and
    /// its partition count as this worker knows it.
    pub(super) fn limits_of(&self, queue: &str) -> Option<(Limits, u32)> {
        let logical = logical_queue(queue);
        let limits = *self.flow.borrow().limits.get(logical)?;
        let partitions = self
            .queues()
            .iter()
            .filter(|q| logical_queue(q) == logical)
            .count();
        Some((limits, partitions as u32))
    }

    /// Admit `deliveries` of `queue` under its limits, if it has some
    /// (`store::limits`): those admitted, with their holds and permits;
    /// the holds and permits of the others are dropped (the slots free at
    /// once). `None` when the admission failed: nothing is started, the
    /// messages stay pending on this consumer, as after a failed `start`.
    async fn admitted(
        &self,
        queue: &str,
        deliveries: Vec<Delivery>,
        holds: Vec<Registration>,
        permits: Vec<OwnedSemaphorePermit>,
    ) -> Option<(Vec<Delivery>, Vec<Registration>, Vec<OwnedSemaphorePermit>)> {
        let Some((limits, partitions)) = self.limits_of(queue) else {
            return Some((deliveries, holds, permits));
        };
        let grace = self.config.visibility_timeout();
        let now = crate::base::now_ms();
        let admissions = match self
            .feed
            .admit(queue, &deliveries, &limits, partitions, grace, now)
            .await
        {
            Ok(admissions) => admissions,
            Err(e) => {
                warn!(queue, error = %e, count = deliveries.len(), "admission failed");
                if matches!(e, StoreError::Redis(_)) {
                    self.read_back.store(true, Ordering::Release);
                }
                return None;
            }
        };
        let mut kept = (Vec::new(), Vec::new(), Vec::new());
        let mut permits = permits.into_iter();
        for ((delivery, hold), admission) in deliveries.into_iter().zip(holds).zip(admissions) {
            let permit = permits.next();
            if admission == Admission::Admitted {
                kept.0.push(delivery);
                kept.1.push(hold);
                kept.2.extend(permit);
            } else {
                tracing::debug!(queue, task_id = %delivery.task_id, ?admission, "held by a limit");
            }
        }
        Some(kept)
    }

    /// [`Shared::dispatch_unheld`] of messages held already, one guard in
    /// `holds` per delivery, admitted first if `admit` says it is due.
    ///
    /// Deliveries of a paused queue (a wait or a reclaim that returned as
    /// the queue was paused) are not started: they stay pending on this
    /// consumer, held no more, and the fetch loop reads them back when the
    /// queue resumes (`pause.rs`).
    pub(super) async fn dispatch_held(
        self: &Arc<Self>,
        queue: &str,
        deliveries: Vec<Delivery>,
        admit: Admit,
        holds: Vec<Registration>,
        permits: Vec<OwnedSemaphorePermit>,
    ) {
        if self.is_paused(queue) {
            tracing::debug!(queue, count = deliveries.len(), "paused: not started");
            return;
        }
        let (mut deliveries, holds, mut permits) = match admit {
            Admit::Done => (deliveries, holds, permits),
            Admit::Due => match self.admitted(queue, deliveries, holds, permits).await {
                Some(admitted) => admitted,
                None => return,
            },
        };
        if deliveries.is_empty() {
            return;
        }
        // After the admission: a start is never stamped before it.
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
    pub(super) async fn take_slots(
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
