//! Prometheus metrics: one registry per process, shared by its worker and
//! its API, served at `GET /metrics` (scope `read`) by the API and, with
//! `--metrics-listen ADDR`, on an address of its own (for a `dtq worker`,
//! which has no API).
//!
//! The registry, the metric types and the text exposition are
//! `prometheus-client`'s (the Prometheus org's Rust client); the text is
//! OpenMetrics 1.0, which Prometheus asks for first and parses (a counter
//! family `x` is exposed as the sample `x_total`; the text ends with
//! `# EOF`).
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `dtq_attempt_outcomes_total` | counter | `queue`, `task`, `outcome` | completions this worker wrote, by how the attempt ended ([`AttemptOutcome`]) |
//! | `dtq_attempt_duration_seconds` | histogram | `queue`, `task` | wall-clock time of each handler call this worker ran, waiting for a pool slot included |
//! | `dtq_sandbox_traps_total` | counter | `class` | handler calls that trapped, by class ([`TrapClass`]) |
//! | `dtq_worker_tasks_in_flight` | gauge | | tasks this worker holds: from its `start` until its completion is written |
//! | `dtq_worker_slots` | gauge | | tasks this worker may hold at once (`--concurrency`; 0 without a worker) |
//! | `dtq_handler_info` | gauge | `task`, `digest` | 1 for each handler this process's worker has loaded, with its module's SHA-256 |
//! | `dtq_sandbox_slot_reset` | gauge | `mode` | 1 for how this process's worker resets a pool slot between calls ([`SlotReset`]) |
//! | `dtq_redis_round_trip_seconds` | histogram | `operation` | each round trip the store makes to Redis, by operation (the scripts and commands of [`crate::store::Store`]; `read`, the worker's blocking read, includes its wait for a message, up to 500 ms) |
//! | `dtq_queue_depth` | gauge | `queue`, `state` | tasks of each queue by state (`ready`, `running`, `delayed`, `waiting`, `dead_lettered`), read from Redis at scrape time |
//! | `dtq_redis_up` | gauge | | 1 if this scrape read the queue depths within the API's Redis deadline, else 0 (and no `dtq_queue_depth`) |
//!
//! # Cardinality
//!
//! Every label takes values from a bounded set, so no client can make a
//! process grow a series per request:
//!
//! - `task`: the task names this process knows (its loaded handlers and
//!   the catalog of deployed ones and handler files); any other name, which
//!   only a task submitted before its handler was undeployed can carry, is
//!   counted as `other` ([`OTHER`]);
//! - `queue`: of the worker's series, its `--queues`; of `dtq_queue_depth`,
//!   the queues that exist in Redis, at most [`MAX_DEPTH_QUEUES`] of them
//!   (by name);
//! - `outcome`, `class`, `state`, `operation`, `mode`: fixed lists in this
//!   crate;
//! - `digest`: one per loaded handler.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::deploy::Catalog;
use crate::sandbox::{Sandbox, SlotReset, Trap};
use crate::store::{CompletionKind, QueueStats, Store, StoreError, TaskStatus};

/// The `Content-Type` of the exposition (OpenMetrics text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `task` label of a task name this process does not know.
pub const OTHER: &str = "other";

/// Most queues whose depth one scrape reports (the first by name).
pub const MAX_DEPTH_QUEUES: usize = 1000;

/// Queue-depth reads in flight at once during a scrape.
const DEPTH_READS: usize = 16;

/// Buckets of attempt durations (s): 1 ms to 60 s, about ×2.5 apart.
const ATTEMPT_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// How an attempt ended, as `dtq_attempt_outcomes_total` counts it: by the
/// status its completion wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptOutcome {
    /// SUCCEEDED.
    Success,
    /// Failed (a retryable error or a trap) with attempts left: RETRYING.
    Retry,
    /// Failed for good: FAILED.
    Fatal,
    /// Failed with no attempts left: DEAD_LETTERED.
    DeadLettered,
    /// CANCELLED while it ran (or while it waited to retry).
    Cancelled,
    /// Not started before its expiry: EXPIRED (no handler ran).
    Expired,
    /// Its worker died during the last attempt; dead-lettered by this
    /// worker when it found the task (no handler ran here).
    Lost,
    /// Given back: this worker had no runnable handler for the task, which
    /// waits, SCHEDULED, for any worker.
    Deferred,
}

impl AttemptOutcome {
    /// Every outcome, in declaration order (so `outcome as usize` is its
    /// index here).
    pub const ALL: [AttemptOutcome; 8] = [
        AttemptOutcome::Success,
        AttemptOutcome::Retry,
        AttemptOutcome::Fatal,
        AttemptOutcome::DeadLettered,
        AttemptOutcome::Cancelled,
        AttemptOutcome::Expired,
        AttemptOutcome::Lost,
        AttemptOutcome::Deferred,
    ];

    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Success => "success",
            AttemptOutcome::Retry => "retry",
            AttemptOutcome::Fatal => "fatal",
            AttemptOutcome::DeadLettered => "dead_lettered",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Expired => "expired",
            AttemptOutcome::Lost => "lost",
            AttemptOutcome::Deferred => "deferred",
        }
    }

    /// The outcome of a completion of `kind` that left its task `status`;
    /// `None` for a status no completion writes.
    pub fn of(kind: CompletionKind, status: TaskStatus) -> Option<AttemptOutcome> {
        if kind == CompletionKind::Lost {
            return Some(AttemptOutcome::Lost);
        }
        Some(match status {
            TaskStatus::Succeeded => AttemptOutcome::Success,
            TaskStatus::Retrying => AttemptOutcome::Retry,
            TaskStatus::Failed => AttemptOutcome::Fatal,
            TaskStatus::DeadLettered => AttemptOutcome::DeadLettered,
            TaskStatus::Cancelled => AttemptOutcome::Cancelled,
            TaskStatus::Expired => AttemptOutcome::Expired,
            TaskStatus::Scheduled => AttemptOutcome::Deferred,
            TaskStatus::Queued | TaskStatus::Running | TaskStatus::Waiting => return None,
        })
    }
}

/// The class of a sandbox trap, as `dtq_sandbox_traps_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrapClass {
    /// The call ran past its deadline.
    Deadline,
    /// The guest asked for more linear memory than allowed.
    OutOfMemory,
    /// The guest's stack overflowed.
    StackOverflow,
    /// The guest aborted (a Rust panic, `unreachable`).
    Panic,
    /// A limit of the sandbox: fuel, payload, result, host calls, ...
    Limit,
    /// Interrupted by a cancel (or stopped because the task was taken over
    /// by another worker).
    Cancelled,
    /// Any other trap, or a host failure.
    Other,
}

impl TrapClass {
    /// Every class.
    pub const ALL: [TrapClass; 7] = [
        TrapClass::Deadline,
        TrapClass::OutOfMemory,
        TrapClass::StackOverflow,
        TrapClass::Panic,
        TrapClass::Limit,
        TrapClass::Cancelled,
        TrapClass::Other,
    ];

    /// The `class` label.
    pub fn as_str(self) -> &'static str {
        match self {
            TrapClass::Deadline => "deadline",
            TrapClass::OutOfMemory => "out_of_memory",
            TrapClass::StackOverflow => "stack_overflow",
            TrapClass::Panic => "panic",
            TrapClass::Limit => "limit",
            TrapClass::Cancelled => "cancelled",
            TrapClass::Other => "other",
        }
    }

    /// The class of `trap`; `None` for "no handler loaded", which ran
    /// nothing (the attempt is deferred).
    pub fn of(trap: &Trap) -> Option<TrapClass> {
        Some(match trap {
            Trap::UnknownHandler(_) => return None,
            Trap::DeadlineExceeded => TrapClass::Deadline,
            Trap::OutOfMemory => TrapClass::OutOfMemory,
            Trap::StackOverflow => TrapClass::StackOverflow,
            Trap::GuestPanic(_) => TrapClass::Panic,
            Trap::LimitExceeded(_) => TrapClass::Limit,
            Trap::Cancelled => TrapClass::Cancelled,
            // `Other`, and whatever class the sandbox adds later.
            _ => TrapClass::Other,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    queue: Arc<str>,
    task: Arc<str>,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TaskLabels {
    queue: Arc<str>,
    task: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TrapLabels {
    class: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HandlerLabels {
    task: String,
    digest: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResetLabels {
    mode: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DepthLabels {
    queue: String,
    state: &'static str,
}

/// A histogram family with fixed buckets.
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn attempt_histogram() -> Histogram {
    Histogram::new(ATTEMPT_BUCKETS)
}

/// Label values, one shared string per distinct value: the worker's
/// series are looked up per task with labels cloned from here, not built
/// as new strings each time. Holds no more values than the series do.
#[derive(Clone, Default)]
struct LabelValues(Arc<RwLock<HashSet<Arc<str>, FastHash>>>);

type FastHash = foldhash::fast::RandomState;

impl LabelValues {
    fn get(&self, value: &str) -> Arc<str> {
        if let Some(known) = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(value)
        {
            return known.clone();
        }
        let mut values = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = values.get(value) {
            return known.clone();
        }
        let value: Arc<str> = value.into();
        values.insert(value.clone());
        value
    }
}

/// What names a `task` label may take: the tasks this process knows.
#[derive(Clone, Default)]
struct TaskNames {
    catalog: Catalog,
    /// The worker's sandbox, once there is one.
    sandbox: Arc<RwLock<Option<Sandbox>>>,
}

impl TaskNames {
    /// `task` if this process knows it, else [`OTHER`].
    fn label<'a>(&self, task: &'a str) -> &'a str {
        let loaded = || {
            self.sandbox
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .is_some_and(|s| s.has_handler(task))
        };
        if self.catalog.has(task) || loaded() {
            task
        } else {
            OTHER
        }
    }

    /// How the worker's sandbox resets its pool slots, once there is one.
    fn slot_reset(&self) -> Option<SlotReset> {
        self.sandbox
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Sandbox::slot_reset)
    }

    /// The loaded handlers' digests, by task.
    fn loaded(&self) -> BTreeMap<String, String> {
        self.sandbox
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Sandbox::loaded)
            .unwrap_or_default()
    }
}

/// The series of one task of one queue: found once per attempt
/// ([`WorkerMetrics::series`]) and carried with it to its completion, so
/// that recording its call and its outcome looks nothing up. Each series
/// is created in its family the first time it is recorded, so an outcome
/// that never happened shows no zero series.
pub struct TaskSeries {
    labels: TaskLabels,
    duration: OnceLock<Histogram>,
    outcomes: [OnceLock<Counter>; AttemptOutcome::ALL.len()],
    durations: Histograms<TaskLabels>,
    outcome_families: Family<OutcomeLabels, Counter>,
}

impl TaskSeries {
    /// One handler call that took `elapsed`.
    pub fn observe_call(&self, elapsed: Duration) {
        self.duration
            .get_or_init(|| self.durations.get_or_create_owned(&self.labels))
            .observe(elapsed.as_secs_f64());
    }

    /// One completion written, which ended its attempt as `outcome`.
    pub fn count_outcome(&self, outcome: AttemptOutcome) {
        self.outcomes[outcome as usize]
            .get_or_init(|| {
                self.outcome_families.get_or_create_owned(&OutcomeLabels {
                    queue: self.labels.queue.clone(),
                    task: self.labels.task.clone(),
                    outcome: outcome.as_str(),
                })
            })
            .inc();
    }
}

impl std::fmt::Debug for TaskSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskSeries")
            .field("queue", &self.labels.queue)
            .field("task", &self.labels.task)
            .finish_non_exhaustive()
    }
}

/// The [`TaskSeries`] made so far, by queue, then by task label. Never
/// shrinks, as the series themselves do not.
type SeriesByQueue = HashMap<Arc<str>, HashMap<Arc<str>, Arc<TaskSeries>, FastHash>, FastHash>;

/// What a worker records. Cheap to clone; clones share the series.
#[derive(Clone)]
pub struct WorkerMetrics {
    outcomes: Family<OutcomeLabels, Counter>,
    durations: Histograms<TaskLabels>,
    traps: Family<TrapLabels, Counter>,
    in_flight: Gauge,
    slots: Gauge,
    names: TaskNames,
    values: LabelValues,
    series: Arc<RwLock<SeriesByQueue>>,
}

impl WorkerMetrics {
    fn new(names: TaskNames) -> WorkerMetrics {
        let metrics = WorkerMetrics {
            outcomes: Family::default(),
            durations: Family::new_with_constructor(attempt_histogram),
            traps: Family::default(),
            in_flight: Gauge::default(),
            slots: Gauge::default(),
            names,
            values: LabelValues::default(),
            series: Arc::default(),
        };
        // Every class from the start, so a first trap is a rise from 0.
        for class in TrapClass::ALL {
            let _ = metrics.traps.get_or_create_owned(&TrapLabels {
                class: class.as_str(),
            });
        }
        metrics
    }

    /// Metrics no registry exposes, for a worker run without one.
    pub fn detached() -> WorkerMetrics {
        WorkerMetrics::new(TaskNames::default())
    }

    /// The `task` label of task name `task`: itself if this process knows
    /// it, else [`OTHER`].
    pub fn task_label(&self, task: &str) -> Arc<str> {
        self.values.get(self.names.label(task))
    }

    /// The series of `queue`'s task `task` (a label from
    /// [`WorkerMetrics::task_label`], or a loaded handler's name).
    pub fn series(&self, queue: &str, task: &Arc<str>) -> Arc<TaskSeries> {
        if let Some(found) = self
            .series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(queue)
            .and_then(|tasks| tasks.get(&**task))
        {
            return found.clone();
        }
        let queue = self.values.get(queue);
        let task = self.values.get(task);
        let mut series = self.series.write().unwrap_or_else(PoisonError::into_inner);
        series
            .entry(queue.clone())
            .or_default()
            .entry(task.clone())
            .or_insert_with(|| {
                Arc::new(TaskSeries {
                    labels: TaskLabels { queue, task },
                    duration: OnceLock::new(),
                    outcomes: Default::default(),
                    durations: self.durations.clone(),
                    outcome_families: self.outcomes.clone(),
                })
            })
            .clone()
    }

    /// One handler call that trapped.
    pub fn count_trap(&self, class: TrapClass) {
        self.traps
            .get_or_create(&TrapLabels {
                class: class.as_str(),
            })
            .inc();
    }

    /// The in-flight gauge, which the worker's running set moves.
    pub fn in_flight(&self) -> Gauge {
        self.in_flight.clone()
    }

    /// Add `slots` execution slots to `dtq_worker_slots` until the guard is
    /// dropped (when the worker stops, or its future is dropped).
    pub fn hold_slots(&self, slots: usize) -> SlotsHeld {
        let slots = i64::try_from(slots).unwrap_or(i64::MAX);
        self.slots.inc_by(slots);
        SlotsHeld {
            gauge: self.slots.clone(),
            slots,
        }
    }
}

/// A worker's slots in `dtq_worker_slots`, taken out again on drop.
pub struct SlotsHeld {
    gauge: Gauge,
    slots: i64,
}

impl Drop for SlotsHeld {
    fn drop(&mut self) {
        self.gauge.dec_by(self.slots);
    }
}

/// `dtq_handler_info` and `dtq_sandbox_slot_reset`, read from the sandbox
/// at each scrape.
struct HandlerInfo(TaskNames);

impl std::fmt::Debug for HandlerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandlerInfo")
    }
}

impl Collector for HandlerInfo {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "dtq_handler_info",
            "1 for each handler this process's worker has loaded: its task and the SHA-256 \
             of its module.",
            None,
            MetricType::Gauge,
        )?;
        for (task, digest) in self.0.loaded() {
            let labels = HandlerLabels { task, digest };
            ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
        }
        let Some(reset) = self.0.slot_reset() else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(
            "dtq_sandbox_slot_reset",
            "1 for how this process's worker resets a pool slot between handler calls: \
             pagemap_scan (only the pages a call dirtied), madvise (as configured), \
             madvise_no_pagemap_scan (the kernel has no PAGEMAP_SCAN) or madvise_swap_on \
             (swap may hold a page of the pool); the madvise modes cost about 3x per call",
            None,
            MetricType::Gauge,
        )?;
        let labels = ResetLabels {
            mode: reset.as_str(),
        };
        ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
        Ok(())
    }
}

/// A process's metrics: the one registry, what the worker records into it,
/// and what is read at scrape time. Cheap to clone; clones share all.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    worker: WorkerMetrics,
    names: TaskNames,
}

impl Metrics {
    /// The registry of a process whose store is `store` (its round-trip
    /// latency is exposed) and whose known tasks are `catalog`'s and, once
    /// [`Metrics::set_sandbox`] gives it, the worker's.
    pub fn new(store: &Store, catalog: Catalog) -> Metrics {
        let names = TaskNames {
            catalog,
            sandbox: Arc::default(),
        };
        let worker = WorkerMetrics::new(names.clone());
        let mut registry = Registry::default();
        registry.register(
            "dtq_attempt_outcomes",
            "Completions this worker wrote, by queue, task and outcome: success, retry \
             (failed, attempts left), fatal, dead_lettered (failed, none left), cancelled, \
             expired (not started before its expiry), lost (its worker died during the last \
             attempt), deferred (no runnable handler here; given back)",
            worker.outcomes.clone(),
        );
        registry.register_with_unit(
            "dtq_attempt_duration",
            "Wall-clock time of each handler call this worker ran, by queue and task \
             (waiting for a pool slot included)",
            Unit::Seconds,
            worker.durations.clone(),
        );
        registry.register(
            "dtq_sandbox_traps",
            "Handler calls that trapped, by class: deadline, out_of_memory, stack_overflow, \
             panic, limit, cancelled, other",
            worker.traps.clone(),
        );
        registry.register(
            "dtq_worker_tasks_in_flight",
            "Tasks this worker holds: from their start until their completion is written",
            worker.in_flight.clone(),
        );
        registry.register(
            "dtq_worker_slots",
            "Tasks this worker may hold at once (--concurrency); 0 in a process without a worker",
            worker.slots.clone(),
        );
        store.round_trip_latency().register(&mut registry);
        registry.register_collector(Box::new(HandlerInfo(names.clone())));
        Metrics {
            inner: Arc::new(Inner {
                registry,
                worker,
                names,
            }),
        }
    }

    /// The worker's sandbox: its handlers are `dtq_handler_info` and known
    /// task names.
    pub fn set_sandbox(&self, sandbox: Sandbox) {
        *self
            .inner
            .names
            .sandbox
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(sandbox);
    }

    /// What a worker of this process records.
    pub fn worker(&self) -> WorkerMetrics {
        self.inner.worker.clone()
    }

    /// The exposition: every metric of the registry, then the queue depths
    /// (`None`: they could not be read, so `dtq_redis_up` is 0).
    pub fn render(&self, depths: Option<&[QueueStats]>) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail, and the encoders fail only
        // when their writer does.
        let _ = self.encode(&mut text, depths);
        text
    }

    fn encode(&self, text: &mut String, depths: Option<&[QueueStats]>) -> std::fmt::Result {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        encode_registry(text, &self.inner.registry)?;
        encode_registry(text, &depth_registry(depths))?;
        encode_eof(text)
    }
}

/// The scrape-time series, in a registry made for one scrape.
fn depth_registry(depths: Option<&[QueueStats]>) -> Registry {
    let mut registry = Registry::default();
    let up: Gauge = Gauge::default();
    up.set(i64::from(depths.is_some()));
    registry.register(
        "dtq_redis_up",
        "1 if this scrape read the queue depths from Redis within the API's Redis deadline, \
         else 0 (and no dtq_queue_depth series)",
        up,
    );
    let family: Family<DepthLabels, Gauge> = Family::default();
    for stats in depths.unwrap_or_default() {
        for (state, n) in [
            ("ready", stats.ready),
            ("running", stats.running),
            ("delayed", stats.delayed),
            ("waiting", stats.waiting),
            ("dead_lettered", stats.dead_lettered),
        ] {
            family
                .get_or_create(&DepthLabels {
                    queue: stats.queue.clone(),
                    state,
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    registry.register(
        "dtq_queue_depth",
        "Tasks of each queue that exists in Redis, by state: ready (not yet delivered), \
         running (delivered, not acknowledged), delayed (scheduled and retries), waiting \
         (parents waiting for their children), dead_lettered; read at scrape time",
        family,
    );
    registry
}

/// The counts of the queues that exist in Redis, at most
/// [`MAX_DEPTH_QUEUES`] of them, read a few at a time.
pub async fn read_depths(store: &Store) -> Result<Vec<QueueStats>, StoreError> {
    let mut queues = store.queues().await?;
    queues.truncate(MAX_DEPTH_QUEUES);
    futures::stream::iter(queues)
        .map(|queue| async move { store.stats(&queue).await })
        .buffered(DEPTH_READS)
        .try_collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::Limit;

    #[test]
    fn outcomes_follow_the_status_written() {
        use CompletionKind as K;
        use TaskStatus as S;
        let of = |kind, status| AttemptOutcome::of(kind, status).map(AttemptOutcome::as_str);
        assert_eq!(of(K::Success, S::Succeeded), Some("success"));
        assert_eq!(of(K::Retry, S::Retrying), Some("retry"));
        assert_eq!(of(K::Retry, S::DeadLettered), Some("dead_lettered"));
        // A retry whose cancel was asked for while it ran.
        assert_eq!(of(K::Retry, S::Cancelled), Some("cancelled"));
        assert_eq!(of(K::Fatal, S::Failed), Some("fatal"));
        assert_eq!(of(K::Lost, S::DeadLettered), Some("lost"));
        assert_eq!(of(K::Expired, S::Expired), Some("expired"));
        assert_eq!(of(K::Defer, S::Scheduled), Some("deferred"));
        assert_eq!(of(K::Success, S::Running), None);
    }

    #[test]
    fn traps_have_a_class_and_an_unknown_handler_has_none() {
        let class = |t: Trap| TrapClass::of(&t).map(TrapClass::as_str);
        assert_eq!(class(Trap::DeadlineExceeded), Some("deadline"));
        assert_eq!(class(Trap::OutOfMemory), Some("out_of_memory"));
        assert_eq!(class(Trap::StackOverflow), Some("stack_overflow"));
        assert_eq!(class(Trap::GuestPanic("x".into())), Some("panic"));
        assert_eq!(class(Trap::LimitExceeded(Limit::Fuel)), Some("limit"));
        assert_eq!(class(Trap::Cancelled), Some("cancelled"));
        assert_eq!(class(Trap::Other("x".into())), Some("other"));
        assert_eq!(class(Trap::UnknownHandler("t".into())), None);
    }

    #[test]
    fn a_task_this_process_does_not_know_is_other() {
        let metrics = WorkerMetrics::detached();
        assert_eq!(&*metrics.task_label("anything"), OTHER);
    }

    #[test]
    fn a_label_value_is_one_shared_string() {
        let values = LabelValues::default();
        let first = values.get("emails");
        assert!(Arc::ptr_eq(&first, &values.get("emails")));
        assert_eq!(&*values.get("reports"), "reports");
        assert!(!Arc::ptr_eq(&first, &values.get("reports")));
        let metrics = WorkerMetrics::detached();
        assert!(Arc::ptr_eq(
            &metrics.task_label("anything"),
            &metrics.task_label("something else")
        ));
    }

    #[test]
    fn a_task_s_series_are_made_once_and_show_only_what_was_recorded() {
        let metrics = WorkerMetrics::detached();
        let mut registry = Registry::default();
        registry.register("outcomes", "", metrics.outcomes.clone());
        registry.register("durations", "", metrics.durations.clone());
        let render = || {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
            text
        };
        let echo: Arc<str> = "echo".into();
        let series = metrics.series("emails", &echo);
        assert!(Arc::ptr_eq(&series, &metrics.series("emails", &echo)));
        assert!(!Arc::ptr_eq(&series, &metrics.series("reports", &echo)));
        // Nothing recorded yet: no series at all, not even zeros.
        assert!(!render().contains("echo"), "{}", render());

        series.count_outcome(AttemptOutcome::Success);
        series.count_outcome(AttemptOutcome::Success);
        metrics
            .series("emails", &"echo".into())
            .count_outcome(AttemptOutcome::Retry);
        series.observe_call(Duration::from_millis(3));
        let text = render();
        let labels = |outcome| format!("queue=\"emails\",task=\"echo\",outcome=\"{outcome}\"");
        assert!(
            text.contains(&format!("outcomes_total{{{}}} 2\n", labels("success"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("outcomes_total{{{}}} 1\n", labels("retry"))),
            "{text}"
        );
        assert!(!text.contains("outcome=\"fatal\""), "{text}");
        assert!(!text.contains("queue=\"reports\""), "{text}");
        assert!(
            text.contains("durations_count{queue=\"emails\",task=\"echo\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn the_slots_gauge_follows_its_guards() {
        let metrics = WorkerMetrics::detached();
        let first = metrics.hold_slots(4);
        let second = metrics.hold_slots(2);
        assert_eq!(metrics.slots.get(), 6);
        drop(first);
        assert_eq!(metrics.slots.get(), 2);
        drop(second);
        assert_eq!(metrics.slots.get(), 0);
    }

    #[test]
    fn depths_are_rendered_and_a_failed_read_says_so() {
        let mut text = String::new();
        let stats = QueueStats {
            queue: "emails".into(),
            ready: 3,
            running: 1,
            delayed: 2,
            waiting: 4,
            dead_lettered: 0,
            partitions: 1,
            paused: false,
        };
        prometheus_client::encoding::text::encode(&mut text, &depth_registry(Some(&[stats])))
            .expect("encodes");
        assert!(text.contains("dtq_redis_up 1\n"), "{text}");
        assert!(
            text.contains("dtq_queue_depth{queue=\"emails\",state=\"ready\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("dtq_queue_depth{queue=\"emails\",state=\"dead_lettered\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("dtq_queue_depth{queue=\"emails\",state=\"waiting\"} 4\n"),
            "{text}"
        );
        text.clear();
        prometheus_client::encoding::text::encode(&mut text, &depth_registry(None))
            .expect("encodes");
        assert!(text.contains("dtq_redis_up 0\n"), "{text}");
        assert!(!text.contains("dtq_queue_depth{"), "{text}");
    }
}
