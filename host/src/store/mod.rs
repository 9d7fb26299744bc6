//! Redis storage: the key layout (`keys.rs`), the Lua scripts (`lua/`, loaded
//! in `scripts.rs`), the task record (`task.rs`), and [`Store`]: the typed
//! calls the API and the workers make through them, taking and returning the
//! values in `types.rs`.
//!
//! This file holds the [`Store`] itself (connection, round trips, script
//! loading), its errors and the helpers its operations share. Each
//! operation is a file of its own, with the `Store` methods that run it:
//!
//! - submission: [`Store::submit`] (`submit.rs`), batches
//!   (`submit/batch.rs`) and routing to a partition (`submit/route.rs`;
//!   the partition counts themselves in `partitions.rs`);
//! - a worker's walk: reading and starting deliveries and the heartbeat
//!   (`start.rs`), completing attempts (`complete.rs`), reclaiming the
//!   messages of dead workers (`reclaim.rs`), promoting delayed tasks
//!   (`promote.rs`), expiring waiting tasks on time (`expiry.rs`), a
//!   queue's periodic tasks (`schedules.rs`);
//! - a handler's progress, which the sandbox reports on its own connection
//!   (`progress.rs`);
//! - outside the worker: reading tasks by id (`task_read.rs`), cancelling
//!   (`cancel.rs`), the DLQ (`dlq.rs`), counts and queue names
//!   (`stats.rs`), pausing a queue (`pause.rs`), its limits and the
//!   admission of a batch under them (`limits.rs`), the events stream (`events.rs`; entry ids in
//!   `stream_id.rs`), listing a queue's tasks (`listing.rs`), finding a
//!   task by its idempotency key (`lookup.rs`).
//!
//! Every state change of a task is one script, so no reader ever sees a task
//! half-submitted or half-completed. [`Store`] counts the round trips it makes
//! ([`Store::round_trips`]), which the benchmarks report per task, and times
//! each by operation ([`Store::round_trip_latency`], for `/metrics`).

#[cfg(test)]
pub(crate) mod argv_check;
mod cancel;
mod carried;
mod complete;
mod conn;
mod dlq;
mod entries;
mod events;
mod expiry;
mod flow;
mod keys;
mod latency;
mod limits;
mod listing;
mod lookup;
mod partitions;
mod pause;
mod progress;
mod promote;
mod reclaim;
mod schedules;
pub(crate) mod scripts;
pub mod sentinel;
mod start;
mod stats;
mod stream_id;
mod submit;
mod task;
mod task_read;
mod types;
mod watched;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{FromRedisValue, Value};

pub use conn::{Backend, Conn, Subscription};
pub use dlq::{
    BulkRequeue, DLQ_CHUNK, DLQ_MAX_IDS, DlqExtent, FORWARD_MARGIN_S, KeyTaken, PurgeBound,
};
pub use entries::OwnPending;
pub(crate) use entries::{fresh_deliveries, own_pending};
pub use events::{EventId, EventsGap, EventsStart, InvalidEventId, QueueEvent};
pub use expiry::EXPIRED_ERROR;
pub use flow::{
    Child, ChildrenCancelled, ClaimOutcome, FlowState, REFUSED, Staged, children, children_of,
    flow_positions, parse_task_ref, stage_outbox, task_ref,
};
pub use keys::{
    GROUP, LIMITS, PAUSED, QUEUES, QueueKeys, logical_queue, partition_of_id, partition_queue,
    partitioned_id,
};
pub use limits::{Admission, Limits, MAX_GROUP_BYTES, Rate, ReadAdmitted};
pub use listing::{INDEX_TRIM_EVERY, LIST_SCAN_BUDGET, ListCursor, TaskPage, TaskSummary};
pub use lookup::IdempotencyRecord;
pub use partitions::{MAX_PARTITIONS, Partitioning, key_hash, read_partitioning};
pub use pause::PAUSE_POLL;
pub use progress::{ProgressReport, ReportingAttempt, TaskProgress, write_progress};
pub use reclaim::Reclaimed;
pub use schedules::{
    CronExpr, FiredTick, InvalidCron, MAX_SCHEDULE_NAME_BYTES, Schedule, ScheduleDef, TIMEZONE,
    tick_key, validate_schedule_name,
};
pub use scripts::Code;
pub use stream_id::{InvalidStreamId, StreamId};
pub use submit::place_of_key;
pub use task::{
    ARCHIVED_LOG_MAX_BYTES, AttemptRecord, MAX_ATTEMPT_HISTORY, TaskRecord, TaskStatus, finished_at,
};
pub use types::{
    CancelOutcome, CompleteOutcome, Completion, CompletionKind, Delivery, NewTask, QueueStats,
    RequeueOutcome, StartDecision, StartedTask, SubmitOutcome,
};
pub use watched::WatchedCluster;

pub use latency::RedisLatency;
use scripts::{Argv, ArgvLayout, Scripts};

/// `queue_register.lua`'s ARGV by name.
static QUEUE_REGISTER_ARGV: ArgvLayout = ArgvLayout {
    script: "queue_register",
    prefix: "ARG_",
    first: 1,
    names: &["QUEUE", "MAX"],
    rest: None,
};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not be reached or answered with an error.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A script answered with something its header does not list.
    #[error("unexpected reply from redis: {0}")]
    Protocol(String),
    /// A task hash that cannot be parsed.
    #[error("corrupt task record: {0}")]
    Corrupt(String),
    /// A submission to a new queue while the registry of queue names
    /// holds as many as it may ([`StoreSettings::max_queues`]).
    #[error("the fleet has its {max} queues (--max-queues); this one is not among them")]
    TooManyQueues {
        /// The bound.
        max: u64,
    },
}

impl StoreError {
    /// Whether this says the connection was found broken (reset, closed or
    /// refused), not that Redis was slow or refused the command. The
    /// connection manager is already making a new connection when the call
    /// returns, so a call Redis may safely see twice is best made again at
    /// once, on that one: waiting first would leave it idle too, and a link
    /// that drops idle connections (a load balancer's idle timeout, a
    /// flaky network) could cut it before every try.
    pub fn is_connection_dropped(&self) -> bool {
        matches!(self, StoreError::Redis(e) if e.is_connection_dropped())
    }
}

impl From<redis::ParsingError> for StoreError {
    fn from(e: redis::ParsingError) -> Self {
        StoreError::Protocol(e.to_string())
    }
}

/// Settings of the store that scripts need.
#[derive(Debug, Clone, Copy)]
pub struct StoreSettings {
    /// TTL of idempotency records (s).
    pub idem_ttl_s: u64,
    /// TTL of terminal task hashes (s), after which a record that points at
    /// them is stale.
    pub task_retention_s: u64,
    /// Approximate cap of each queue's events stream; 0 writes no events
    /// (`--events none`).
    pub events_max_len: u64,
    /// Write a RUNNING event for every attempt, a carried first attempt's
    /// too (see `carried.rs`): the worker writes a read batch's as one
    /// events entry before running it (`--events all`).
    pub running_events: bool,
    /// Most queue names the registry ([`QUEUES`]) holds, and each
    /// process's per-queue maps (`--max-queues`): any submitter may name a
    /// new queue, so both are bounded.
    pub max_queues: u64,
}

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            idem_ttl_s: 86_400,
            task_retention_s: 7 * 86_400,
            events_max_len: 10_000,
            running_events: false,
            max_queues: 10_000,
        }
    }
}

/// How long a command on a store's shared connection may wait for its
/// reply.
const SHARED_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The Redis side of dtq, on one server or a cluster ([`Backend`]). Cheap
/// to clone: clones share one multiplexed connection, which reconnects by
/// itself.
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    conn: Conn,
    scripts: Arc<Scripts>,
    settings: StoreSettings,
    round_trips: Arc<AtomicU64>,
    /// How long each round trip took, by operation (`/metrics`).
    latency: RedisLatency,
    /// Queues this process already added to [`QUEUES`]: the set is written
    /// once per queue and process, not once per submission.
    registered: Arc<Mutex<HashSet<String>>>,
    /// Submissions to each queue by this process, counted so that one in
    /// `INDEX_TRIM_EVERY` trims the queue's index (see `listing.rs`).
    index_trims: Arc<Mutex<HashMap<String, u64>>>,
    /// The partitioning of each queue as this process last read it; what
    /// its submissions route by (see `partitions.rs`).
    partitionings: Arc<Mutex<HashMap<String, Partitioning>>>,
    /// A gate per queue whose partitioning is being read because none was
    /// known: concurrent first submissions wait for one read instead of
    /// each sending its own (see `submit/route.rs`).
    partition_reads: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    /// Round-robin counter of unkeyed submissions over partitions.
    spread: Arc<AtomicU64>,
}

impl Store {
    /// Connect to `urls` (one `redis://` URL, or several nodes of one
    /// cluster, comma-separated; see [`Backend::open`]) and load the
    /// scripts.
    pub async fn connect(urls: &str, settings: StoreSettings) -> Result<Store, StoreError> {
        let backend = Backend::open(urls).await?;
        let conn = backend.connect(SHARED_RESPONSE_TIMEOUT).await?;
        let store = Store {
            backend,
            conn,
            scripts: Arc::new(Scripts::new()),
            settings,
            round_trips: Arc::new(AtomicU64::new(0)),
            latency: RedisLatency::default(),
            registered: Arc::new(Mutex::new(HashSet::new())),
            index_trims: Arc::new(Mutex::new(HashMap::new())),
            partitionings: Arc::new(Mutex::new(HashMap::new())),
            partition_reads: Arc::new(Mutex::new(HashMap::new())),
            spread: Arc::new(AtomicU64::new(0)),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    /// The settings the store was made with.
    pub fn settings(&self) -> StoreSettings {
        self.settings
    }

    /// The shared connection (for the sandbox's host imports).
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// A new dedicated connection whose replies may take up to `timeout`: for
    /// blocking reads, which would stall every other command on the shared
    /// multiplexed connection.
    pub async fn dedicated_connection(&self, timeout: Duration) -> Result<Conn, StoreError> {
        self.backend.connect(timeout).await
    }

    /// A clone of this store with a shared connection of its own, whose
    /// I/O runs on the runtime this is called on.
    pub async fn with_own_connection(&self) -> Result<Store, StoreError> {
        let conn = self.backend.connect(SHARED_RESPONSE_TIMEOUT).await?;
        Ok(Store {
            conn,
            ..self.clone()
        })
    }

    /// What the store is connected to (for pub/sub, and to know whether it
    /// is a cluster).
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Round trips to Redis made through this store (and its clones) so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// The latency of this store's round trips (and its clones'), by
    /// operation.
    pub fn round_trip_latency(&self) -> &RedisLatency {
        &self.latency
    }

    /// Make one round trip, `call`, to Redis as `operation`: counted, and
    /// timed when it completes.
    async fn trip<T>(&self, operation: &'static str, call: impl Future<Output = T>) -> T {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let out = call.await;
        self.latency.observe(operation, started.elapsed());
        out
    }

    /// Load every script: in one pipeline on a single server; on a
    /// cluster one `SCRIPT LOAD` each, which the client sends to every
    /// primary (a pipeline would reach one node only).
    async fn load_scripts(&self) -> Result<(), StoreError> {
        if self.backend.is_cluster() {
            for script in self.scripts.all() {
                self.trip("load_scripts", script.load_async(&mut self.conn.clone()))
                    .await?;
            }
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for script in self.scripts.all() {
            pipe.load_script(script).ignore();
        }
        self.trip(
            "load_scripts",
            pipe.query_async::<()>(&mut self.conn.clone()),
        )
        .await?;
        Ok(())
    }

    /// Add `queue` to the registry (`lua/queue_register.lua`), once per
    /// queue and process; refused past [`StoreSettings::max_queues`].
    async fn register_queue(&self, queue: &str) -> Result<(), StoreError> {
        // Marked before the script, so concurrent first submissions send one.
        if !bounded(&self.registered, self.settings.max_queues, |known| {
            known.insert(queue.to_owned())
        }) {
            return Ok(());
        }
        let mut inv = self.scripts.queue_register.prepare_invoke();
        inv.key(QUEUES);
        Argv::new(&mut inv, &QUEUE_REGISTER_ARGV)
            .put("QUEUE", queue)
            .put("MAX", self.settings.max_queues)
            .done();
        let added: Result<bool, _> = self
            .trip("register_queue", inv.invoke_async(&mut self.conn.clone()))
            .await;
        match added {
            Ok(true) => Ok(()),
            refused => {
                lock(&self.registered).remove(queue);
                refused?;
                Err(StoreError::TooManyQueues {
                    max: self.settings.max_queues,
                })
            }
        }
    }

    /// How many queue names this process's per-queue maps hold, the largest
    /// of them: at most [`StoreSettings::max_queues`] (each is cleared when
    /// it would pass it; they are caches, read again from Redis).
    pub fn known_queue_names(&self) -> usize {
        lock(&self.registered)
            .len()
            .max(lock(&self.index_trims).len())
            .max(lock(&self.partitionings).len())
            .max(lock(&self.partition_reads).len())
    }

    /// The members of the time-ordered sorted set `key` due at `now` (score
    /// at or before it), up to `limit`, each with its score; and when to
    /// look again: `Some(now)` when `limit` were due (more may be), else
    /// the first score after `now`, if any. One round trip, named `op` in
    /// the round-trip metric.
    async fn due_members(
        &self,
        op: &'static str,
        key: &str,
        now: u64,
        limit: usize,
    ) -> Result<(Vec<(String, u64)>, Option<u64>), StoreError> {
        let scanned: Vec<(String, f64)> = self
            .trip(
                op,
                redis::cmd("ZRANGE")
                    .arg(key)
                    .arg("-inf")
                    .arg("+inf")
                    .arg("BYSCORE")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(limit + 1)
                    .arg("WITHSCORES")
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        let mut due = Vec::with_capacity(scanned.len().min(limit));
        let mut later = None;
        for (member, at) in scanned {
            let at = at as u64;
            if at > now {
                later = Some(at);
                break;
            }
            if due.len() < limit {
                due.push((member, at));
            }
        }
        let next = if due.len() == limit { Some(now) } else { later };
        Ok((due, next))
    }
}

/// Run `change` on the per-queue map `map`, first emptied when it holds
/// `max` names or more: any client may name a new queue, so a map keyed by
/// queue names is a cache whose size is bounded, not a record.
fn bounded<M: QueueMap, T>(map: &Mutex<M>, max: u64, change: impl FnOnce(&mut M) -> T) -> T {
    let mut map = lock(map);
    if map.names() as u64 >= max {
        map.clear_all();
    }
    change(&mut map)
}

/// A map or set keyed by queue names ([`bounded`]).
trait QueueMap {
    fn names(&self) -> usize;
    fn clear_all(&mut self);
}

impl QueueMap for HashSet<String> {
    fn names(&self) -> usize {
        self.len()
    }
    fn clear_all(&mut self) {
        self.clear();
    }
}

impl<V> QueueMap for HashMap<String, V> {
    fn names(&self) -> usize {
        self.len()
    }
    fn clear_all(&mut self) {
        self.clear();
    }
}

fn flag(on: bool) -> &'static str {
    if on { "1" } else { "0" }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn from_value<T: FromRedisValue>(v: Option<Value>) -> Result<T, StoreError> {
    let v = v.ok_or_else(|| StoreError::Protocol("reply is shorter than expected".into()))?;
    Ok(redis::from_redis_value(v)?)
}

fn code_of(v: Option<Value>) -> Result<Code, StoreError> {
    let n: i64 = from_value(v)?;
    Code::from_i64(n).ok_or_else(|| StoreError::Protocol(format!("unknown script code {n}")))
}

fn unexpected(script: &str, code: Code) -> StoreError {
    StoreError::Protocol(format!("{script} returned {code:?}, which it never should"))
}
