//! Starting a worker: what it needs before its loops run. The partitions
//! of its queues and their groups, the runtime guests run on, the feed
//! connection that does its I/O there, and the state the loops share.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::flow::Flow;
use super::running::Running;
use super::{Shared, WorkerError, completion, partitions};
use crate::config::WorkerConfig;
use crate::metrics::{SlotsHeld, WorkerMetrics};
use crate::sandbox::Sandbox;
use crate::store::Store;

/// A worker ready for its loops.
pub(super) struct Started {
    pub(super) shared: Arc<Shared>,
    /// Where executors hand over completions, for the completer.
    pub(super) completions: mpsc::Receiver<completion::Pending>,
    /// Kept as long as the worker runs: dropped, it shuts down the runtime
    /// and takes the slots out of `dtq_worker_slots`.
    pub(super) lives: (GuestRuntime, SlotsHeld),
}

/// Check `config`, find the partitions of its queues and make their
/// groups, start the guest runtime and connect from it, and build the
/// shared state.
pub(super) async fn prepare(
    store: Store,
    sandbox: Sandbox,
    config: WorkerConfig,
    metrics: WorkerMetrics,
) -> Result<Started, WorkerError> {
    config.validate().map_err(WorkerError::Config)?;
    let names = partitions::of_queues(&store, &config.queue_names()).await?;
    // Before the first fetch: a worker started during a pause obeys it.
    let flow = Flow::read(&store, &config.queue_names()).await?;
    for name in &names {
        store.ensure_group(name).await?;
    }
    // Each completion holds its task's slot until written: room for one per
    // slot means handing one over never waits.
    let (tx, completions) = mpsc::channel(config.concurrency.max(1));
    let guest_runtime = GuestRuntime::new(config.concurrency)?;
    let feed = {
        let store = store.clone();
        guest_runtime
            .handle
            .spawn(async move { store.with_own_connection().await })
            .await
            .map_err(WorkerError::GuestTask)??
    };
    let consumer = format!("{}-{}", std::process::id(), crate::base::unique_token());
    let slots = metrics.hold_slots(config.concurrency);
    let shared = Arc::new(Shared {
        partitions: watch::Sender::new(Arc::new(names)),
        flow: watch::Sender::new(Arc::new(flow)),
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
    Ok(Started {
        shared,
        completions,
        lives: (guest_runtime, slots),
    })
}

/// The runtime sandbox calls run on (see [`Shared::guests`]).
///
/// Dropping a tokio runtime blocks until its threads stop, which panics in
/// an async context — and `run`'s future, which owns this, may be dropped in
/// one (an embedding runtime shutting down). So it is shut down in the
/// background instead.
pub(super) struct GuestRuntime {
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
            .map_err(WorkerError::GuestRuntime)?;
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
