//! Redis storage: the key layout (`keys.rs`), the Lua scripts (`lua/`, loaded
//! in `scripts.rs`), the task record (`task.rs`), and [`Store`]: the typed
//! calls the API and the workers make through them, taking and returning the
//! values in `types.rs`. Reading a queue's events stream back
//! (`events.rs`), listing its tasks through the submission index
//! (`listing.rs`), requeueing and purging its DLQ (`dlq.rs`) and finding
//! a task by its idempotency key (`lookup.rs`) are calls of their own
//! files; so are a queue's periodic tasks (`schedules.rs`) and the sweep
//! that expires waiting tasks on time (`expiry.rs`).
//!
//! Every state change of a task is one script, so no reader ever sees a task
//! half-submitted or half-completed. [`Store`] counts the round trips it makes
//! ([`Store::round_trips`]), which the benchmarks report per task, and times
//! each by operation ([`Store::round_trip_latency`], for `/metrics`).

mod batch;
mod carried;
mod conn;
mod dlq;
mod entries;
mod events;
mod expiry;
mod keys;
mod latency;
mod listing;
mod lookup;
mod partitions;
mod schedules;
mod scripts;
mod task;
mod types;

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
pub use events::{
    EventId, EventsGap, EventsStart, InvalidEventId, InvalidStreamId, QueueEvent, StreamId,
};
pub use expiry::EXPIRED_ERROR;
pub use keys::{
    GROUP, QUEUES, QueueKeys, logical_queue, partition_of_id, partition_queue, partitioned_id,
};
pub use listing::{INDEX_TRIM_EVERY, LIST_SCAN_BUDGET, ListCursor, TaskPage, TaskSummary};
pub use lookup::IdempotencyRecord;
pub use partitions::{MAX_PARTITIONS, Partitioning, key_hash};
pub use schedules::{
    CronExpr, FiredTick, InvalidCron, MAX_SCHEDULE_NAME_BYTES, Schedule, ScheduleDef, TIMEZONE,
    tick_key, validate_schedule_name,
};
pub use scripts::Code;
pub use task::{
    ARCHIVED_LOG_MAX_BYTES, AttemptRecord, MAX_ATTEMPT_HISTORY, TaskRecord, TaskStatus,
};
pub use types::{
    CancelOutcome, CompleteOutcome, Completion, CompletionKind, Delivery, NewTask, QueueStats,
    RequeueOutcome, StartDecision, StartedTask, SubmitOutcome,
};

pub use latency::RedisLatency;
use scripts::Scripts;

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
    /// Start every delivery with the `start` script, carried ones too (see
    /// `carried.rs`), so that every attempt has a RUNNING event
    /// (`--events all`).
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

/// What [`Store::reclaim`] claimed for a worker.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Messages of dead workers, now the caller's.
    pub dead: Vec<Delivery>,
    /// The caller's own messages that were idle longer than the visibility
    /// timeout: run those not held (never started), leave the others.
    pub own: Vec<Delivery>,
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

    /// Create the consumer group of `queue` (and its stream) if missing.
    pub async fn ensure_group(&self, queue: &str) -> Result<(), StoreError> {
        let keys = QueueKeys::new(queue);
        let created: Result<(), _> = self
            .trip(
                "ensure_group",
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&keys.stream)
                    .arg(GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut self.conn.clone()),
            )
            .await;
        match created {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Submit a task: one script, one round trip (plus, once per queue and
    /// process, the queue's entry in [`QUEUES`] and its partition count;
    /// plus, within the idempotency TTL after a raise of the count, one
    /// read per replaced count that moved the task's key). Routes `new` to
    /// its partition, which its id then names (see `partitions.rs`).
    pub async fn submit(
        &self,
        new: &mut NewTask,
        max_depth: u64,
    ) -> Result<SubmitOutcome, StoreError> {
        self.register_queue(&new.queue).await?;
        let mut part = self.known_partitioning(&new.queue).await?;
        let (mut pinned, mut forwards) = (None, 0);
        for round in 0.. {
            self.route(new, &part, pinned).await?;
            let inv = self.ingest_call(new, part.count, max_depth);
            let reply: Vec<Value> = self
                .trip("submit", inv.invoke_async(&mut self.conn.clone()))
                .await?;
            match ingested(reply)? {
                Ingested::Done(outcome) => return Ok(outcome),
                Ingested::Repartitioned(found) => {
                    part = self
                        .reread_partitioning(&new.queue, &part, found, round)
                        .await?;
                }
                Ingested::Forwarded(to) => {
                    pinned = Some(follow_forward(new, to, &mut forwards)?);
                }
            }
        }
        unreachable!("the reroutes are bounded")
    }

    /// The ingest script's call for `new`, routed by a count of
    /// `partitions` (see `lua/ingest.lua`).
    fn ingest_call(
        &self,
        new: &NewTask,
        partitions: u32,
        max_depth: u64,
    ) -> redis::ScriptInvocation<'_> {
        let keys = QueueKeys::of_task(&new.queue, &new.id);
        let mut inv = self.scripts.ingest.prepare_invoke();
        inv.key(keys.idempotency(new.idempotency_key.as_deref()))
            .key(keys.task(&new.id))
            .key(&keys.stream)
            .key(&keys.delayed)
            .key(&keys.events)
            .key(&keys.index)
            .key(&keys.expiry)
            .key(&keys.partitions)
            .arg(&new.id)
            .arg(new.now)
            .arg(flag(new.idempotency_key.is_some()))
            .arg(&new.fingerprint)
            .arg(self.settings.idem_ttl_s)
            .arg(max_depth)
            .arg(new.run_at)
            .arg(self.settings.events_max_len)
            .arg(keys.task_prefix())
            .arg(self.index_trim_bound(keys.queue(), new.now))
            .arg(new.expires_at.map(|at| at.to_string()).unwrap_or_default())
            .arg(partitions)
            .arg(carried::run_head(new).unwrap_or_default());
        let mut field = |name: &str, value: &str| {
            inv.arg(name).arg(value);
        };
        // The hash is a listpack while small, where a field is found by a
        // scan from the front: the fields the worker's scripts read and
        // write on every attempt come first, after `status` (ingest.lua).
        // The payload is the fifth, ARGV[23], which the script also
        // appends to the message's `run` field.
        let (now, max_attempts) = (new.now.to_string(), new.max_attempts.to_string());
        field("attempts", "0");
        field("updated_at", &now);
        field("max_attempts", &max_attempts);
        field("task", &new.task);
        field("payload", &new.payload);
        if let Some(t) = new.timeout_ms {
            field("timeout_ms", &t.to_string());
        }
        if let Some(key) = &new.idempotency_key {
            field("idempotency_key", key);
        }
        if let Some(at) = new.expires_at {
            field("expires_at", &at.to_string());
        }
        if new.run_at > new.now {
            field("run_at", &new.run_at.to_string());
        }
        field("budget", &max_attempts);
        field("created_at", &now);
        field("id", &new.id);
        field("queue", &new.queue);
        field("fingerprint", &new.fingerprint);
        inv
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
        inv.key(QUEUES).arg(queue).arg(self.settings.max_queues);
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
    }

    /// The task `id` of `queue`, if its hash exists; RUNNING attempt 1
    /// while a worker runs its carried first attempt (`carried.rs`).
    pub async fn task(&self, queue: &str, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let Some((fields, runner)) = self.read_tasks(&keys, &[id], &[]).await?.pop() else {
            return Err(StoreError::Protocol("task_read answered nothing".into()));
        };
        let fields: HashMap<String, String> = from_value(Some(fields))?;
        if fields.is_empty() {
            return Ok(None);
        }
        let mut record = TaskRecord::from_fields(fields)?;
        if runner.is_some() {
            record.status = TaskStatus::Running;
            record.attempts = 1;
        }
        Ok(Some(record))
    }

    /// Tasks `ids` of one partition (`keys`), in one atomic step
    /// (`lua/task_read.lua`): each one's `fields` (the whole hash when
    /// empty), and the worker running its carried first attempt, if one
    /// does.
    pub(crate) async fn read_tasks(
        &self,
        keys: &QueueKeys,
        ids: &[&str],
        fields: &[&str],
    ) -> Result<Vec<(Value, Option<String>)>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.task_read.prepare_invoke();
        inv.key(&keys.stream);
        for id in ids {
            inv.key(keys.task(id));
        }
        inv.arg(GROUP).arg(fields);
        let reply: Vec<Value> = self
            .trip("task", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        if reply.len() != 2 * ids.len() {
            return Err(StoreError::Protocol(format!(
                "task_read answered {} values for {} tasks",
                reply.len(),
                ids.len()
            )));
        }
        let mut reply = reply.into_iter();
        std::iter::from_fn(|| {
            let fields = reply.next()?;
            Some(from_value(reply.next()).map(|runner| (fields, runner)))
        })
        .collect()
    }

    /// Read up to `count` new messages of `queue` for `consumer`, blocking up
    /// to `block` when there are none. `conn` must be a dedicated connection
    /// (see [`Store::dedicated_connection`]).
    pub async fn read(
        &self,
        conn: &mut Conn,
        queue: &str,
        consumer: &str,
        count: usize,
        block: Duration,
    ) -> Result<Vec<Delivery>, StoreError> {
        let keys = QueueKeys::new(queue);
        let reply: Value = self
            .trip(
                "read",
                redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(GROUP)
                    .arg(consumer)
                    .arg("COUNT")
                    .arg(count)
                    .arg("BLOCK")
                    .arg(block.as_millis() as u64)
                    .arg("STREAMS")
                    .arg(&keys.stream)
                    .arg(">")
                    .query_async(conn),
            )
            .await?;
        fresh_deliveries(queue, reply)
    }

    /// Claim for `consumer` up to `count` messages of `queue` that no live
    /// worker runs: those of workers that have not beaten within
    /// `visibility` (see `lua/reclaim.lua`), and `consumer`'s own that were
    /// idle that long.
    pub async fn reclaim(
        &self,
        queue: &str,
        consumer: &str,
        visibility: Duration,
        count: usize,
    ) -> Result<Reclaimed, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.reclaim.prepare_invoke();
        inv.key(&keys.stream)
            .key(&keys.workers)
            .key(&keys.clock)
            .arg(GROUP)
            .arg(consumer)
            .arg(visibility.as_millis() as u64)
            .arg(count)
            .arg(keys.task_prefix());
        let reply: Vec<Value> = self
            .trip("reclaim", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let mut reclaimed = Reclaimed::default();
        entries::parse(from_value(reply.next())?, None, &mut reclaimed.dead)?;
        entries::parse(from_value(reply.next())?, None, &mut reclaimed.own)?;
        Ok(reclaimed)
    }

    /// Start a batch of deliveries of `queue`: a carried one (see
    /// `carried.rs`) runs as its message says, from `now`, with no round
    /// trip, unless the settings ask for RUNNING events; the others in one
    /// `start` script call for the batch. Decisions in the order of
    /// `deliveries`; the carried tasks are taken out of them (moved into
    /// the decisions, not copied).
    pub async fn start(
        &self,
        queue: &str,
        consumer: &str,
        deliveries: &mut [Delivery],
        now: u64,
    ) -> Result<Vec<StartDecision>, StoreError> {
        let every = self.settings.running_events;
        let scripted: Vec<&Delivery> = deliveries
            .iter()
            .filter(|d| every || d.carried.is_none())
            .collect();
        let mut started = self
            .start_script(queue, consumer, &scripted, now)
            .await?
            .into_iter();
        deliveries
            .iter_mut()
            .map(|d| match d.carried.take().filter(|_| !every) {
                Some(task) => Ok(StartDecision::Run(StartedTask {
                    carried_at: Some(now),
                    ..*task
                })),
                None => started
                    .next()
                    .ok_or_else(|| StoreError::Protocol("start answered too few decisions".into())),
            })
            .collect()
    }

    /// The `start` script for `deliveries` (one round trip for the batch).
    async fn start_script(
        &self,
        queue: &str,
        consumer: &str,
        deliveries: &[&Delivery],
        now: u64,
    ) -> Result<Vec<StartDecision>, StoreError> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.start.prepare_invoke();
        inv.key(&keys.stream)
            .key(&keys.events)
            .key(&keys.expiry)
            .key(&keys.dlq);
        for d in deliveries {
            inv.key(keys.task(&d.task_id));
        }
        inv.arg(GROUP)
            .arg(now)
            .arg(consumer)
            .arg(self.settings.events_max_len)
            .arg(logical_queue(queue));
        for d in deliveries {
            inv.arg(&d.msg_id).arg(&d.task_id);
        }
        let reply: Vec<Value> = self
            .trip("start", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let decisions = deliveries
            .iter()
            .map(|delivery| {
                let code = code_of(reply.next())?;
                match code {
                    Code::Skipped => return Ok(StartDecision::Skip(from_value(reply.next())?)),
                    Code::Corrupt => return Ok(StartDecision::Corrupt(from_value(reply.next())?)),
                    _ => {}
                }
                let task = StartedTask::from_reply(queue, &delivery.task_id, &mut reply)?;
                Ok(match code {
                    Code::Ok => StartDecision::Run(task),
                    Code::Expired => StartDecision::Expired(task),
                    Code::Exhausted => StartDecision::Exhausted(task),
                    other => return Err(unexpected("start", other)),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if reply.next().is_some() {
            return Err(StoreError::Protocol(format!(
                "start answered more than {} decisions",
                deliveries.len()
            )));
        }
        Ok(decisions)
    }

    /// Write a batch of completions: one `complete` script call per queue
    /// (each atomic for all its completions), pipelined into one round trip.
    /// Outcomes come back in the order of `completions`.
    pub async fn complete(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        // Indexes into `completions`, grouped by queue.
        let mut by_queue: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, c) in completions.iter().enumerate() {
            match by_queue.iter_mut().find(|(q, _)| *q == c.queue) {
                Some((_, batch)) => batch.push(i),
                None => by_queue.push((&c.queue, vec![i])),
            }
        }
        let calls: Vec<_> = by_queue
            .iter()
            .map(|(queue, batch)| {
                let batch: Vec<&Completion> = batch.iter().map(|&i| &completions[i]).collect();
                self.completion_call(queue, &batch)
            })
            .collect();
        let replies: Vec<String> = if self.backend.is_cluster() {
            // A pipeline reaches one node: each queue's call goes on its
            // own (its slot's shard), all of them at once.
            futures::future::try_join_all(
                calls.into_iter().map(|call| self.complete_pipeline([call])),
            )
            .await?
            .into_iter()
            .flatten()
            .collect()
        } else {
            self.complete_pipeline(calls).await?
        };
        let mut outcomes: Vec<Option<CompleteOutcome>> = vec![None; completions.len()];
        for ((_, batch), reply) in by_queue.iter().zip(replies) {
            // A word per completion: its status, or `code:status` for a
            // code other than OK (complete.lua).
            let mut reply = reply.split(' ');
            for &i in batch {
                let word = reply.next().ok_or_else(|| {
                    StoreError::Protocol(format!(
                        "complete answered fewer than {} outcomes",
                        batch.len()
                    ))
                })?;
                let (code, status) = match word.split_once(':') {
                    None => (Code::Ok, word),
                    Some((code, status)) => {
                        let known = code.parse().ok().and_then(Code::from_i64);
                        let code = known.ok_or_else(|| {
                            StoreError::Protocol(format!("complete answered {word:?}"))
                        })?;
                        (code, status)
                    }
                };
                outcomes[i] = Some(match code {
                    Code::Ok => CompleteOutcome::Done(status.parse()?),
                    Code::Stale => CompleteOutcome::Stale(status.to_owned()),
                    other => return Err(unexpected("complete", other)),
                });
            }
            if reply.next().is_some() {
                return Err(StoreError::Protocol(format!(
                    "complete answered more than {} outcomes",
                    batch.len()
                )));
            }
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.ok_or_else(|| StoreError::Protocol("complete returned too few outcomes".into()))
            })
            .collect()
    }

    /// Run `calls` of the complete script in one pipeline: one reply each,
    /// in order.
    async fn complete_pipeline(
        &self,
        calls: impl IntoIterator<Item = redis::Cmd>,
    ) -> Result<Vec<String>, StoreError> {
        let mut pipe = redis::pipe();
        for call in calls {
            pipe.add_command(call);
        }
        match self
            .trip("complete", pipe.query_async(&mut self.conn.clone()))
            .await
        {
            Ok(replies) => Ok(replies),
            // The scripts were flushed (a restart or failover): load them and
            // try once more. EVALSHA of a missing script runs nothing.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.load_scripts().await?;
                Ok(self
                    .trip("complete", pipe.query_async(&mut self.conn.clone()))
                    .await?)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The `complete` call for one queue's batch, as the EVALSHA it is:
    /// written straight into one command buffer, where a
    /// `ScriptInvocation` would hold each argument in a buffer of its own
    /// and copy them all into the command when sent. A missing script is
    /// loaded by [`Store::complete_pipeline`].
    fn completion_call(&self, queue: &str, batch: &[&Completion]) -> redis::Cmd {
        let keys = QueueKeys::new(queue);
        let keyed = batch.iter().filter(|c| c.idempotency_key.is_some()).count();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.scripts.complete.get_hash())
            .arg(4 + batch.len() + keyed)
            .arg(&keys.stream)
            .arg(&keys.delayed)
            .arg(&keys.dlq)
            .arg(&keys.events);
        for c in batch {
            cmd.arg(keys.task(&c.task_id));
        }
        // Only the completions with a key name a record (complete.lua).
        for key in batch.iter().filter_map(|c| c.idempotency_key.as_deref()) {
            cmd.arg(keys.idempotency(Some(key)));
        }
        cmd.arg(GROUP)
            .arg(self.settings.task_retention_s)
            .arg(self.settings.events_max_len);
        // Each sends only what its outcome reads (complete.lua): the
        // attempt unless it is a carried one (attempt 1), the retry time
        // only for a failed attempt, the defer limit only for a deferral.
        for c in batch {
            let carried_at = c.carried_at.filter(|_| c.attempt == 1);
            cmd.arg(&c.task_id)
                .arg(&c.msg_id)
                .arg(c.kind.as_str())
                .arg(&c.detail)
                .arg(&c.log)
                .arg(c.now)
                .arg(flag(c.idempotency_key.is_some()))
                .arg(c.digest.as_deref().unwrap_or(""));
            match (carried_at, c.kind) {
                (Some(at), _) => {
                    cmd.arg(at);
                }
                (None, CompletionKind::Expired) => {
                    cmd.arg("").arg("");
                }
                (None, _) => {
                    cmd.arg("").arg(c.attempt);
                }
            }
            match c.kind {
                CompletionKind::Retry | CompletionKind::Lost => {
                    cmd.arg(c.retry_at);
                }
                CompletionKind::Defer => {
                    cmd.arg(c.defer_limit_ms);
                }
                _ => {}
            }
        }
        cmd
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

    /// Move up to `limit` due tasks of `queue` from the delayed set to the
    /// stream. Returns how many moved and the due time of the next waiting
    /// task, if any.
    pub async fn promote_due(
        &self,
        queue: &str,
        now: u64,
        limit: usize,
    ) -> Result<(u64, Option<u64>), StoreError> {
        let keys = QueueKeys::new(queue);
        let (ready, next) = self
            .due_members("promote_scan", &keys.delayed, now, limit)
            .await?;
        if ready.is_empty() {
            return Ok((0, next));
        }
        let ready: Vec<String> = ready.into_iter().map(|(id, _)| id).collect();
        let mut inv = self.scripts.promote.prepare_invoke();
        inv.key(&keys.delayed).key(&keys.stream).key(&keys.events);
        for id in &ready {
            inv.key(keys.task(id));
        }
        inv.arg(now).arg(self.settings.events_max_len).arg("");
        for id in &ready {
            inv.arg(id.as_str());
        }
        let moved: u64 = self
            .trip("promote", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok((moved, next))
    }

    /// Beat for `consumer` on `queue` (it is alive for `visibility` from
    /// now, by Redis's clock) and keep the messages of its running attempts,
    /// each a delivery and the attempt number `start` gave it. Returns one
    /// code per attempt, in order: [`Code::Ok`] (still this attempt's),
    /// [`Code::CancelRequested`] (and asked to cancel) or [`Code::Stale`]
    /// (the task was reclaimed elsewhere). See `lua/heartbeat.lua`.
    pub async fn heartbeat(
        &self,
        queue: &str,
        consumer: &str,
        visibility: Duration,
        running: &[(Delivery, u32)],
    ) -> Result<Vec<Code>, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.heartbeat.prepare_invoke();
        inv.key(&keys.stream).key(&keys.workers).key(&keys.clock);
        for (d, _) in running {
            inv.key(keys.task(&d.task_id));
        }
        inv.arg(GROUP)
            .arg(consumer)
            .arg(visibility.as_millis() as u64);
        for (d, attempt) in running {
            inv.arg(&d.msg_id).arg(attempt);
        }
        let reply: Vec<i64> = self
            .trip("heartbeat", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        if reply.len() != running.len() {
            return Err(StoreError::Protocol(format!(
                "heartbeat answered {} codes for {} attempts",
                reply.len(),
                running.len()
            )));
        }
        reply
            .into_iter()
            .map(|n| match Code::from_i64(n) {
                Some(code @ (Code::Ok | Code::CancelRequested | Code::Stale)) => Ok(code),
                Some(other) => Err(unexpected("heartbeat", other)),
                None => Err(StoreError::Protocol(format!("unknown script code {n}"))),
            })
            .collect()
    }

    /// The idempotency key task `id` was submitted with: the scripts that
    /// change a task outside the worker need its record's name in KEYS.
    async fn idempotency_key_of(
        &self,
        keys: &QueueKeys,
        id: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(self
            .trip(
                "idempotency_key",
                redis::cmd("HGET")
                    .arg(keys.task(id))
                    .arg("idempotency_key")
                    .query_async(&mut self.conn.clone()),
            )
            .await?)
    }

    /// Cancel task `id` of `queue`.
    pub async fn cancel(
        &self,
        queue: &str,
        id: &str,
        now: u64,
    ) -> Result<CancelOutcome, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let idem_key = self.idempotency_key_of(&keys, id).await?;
        let mut inv = self.scripts.cancel.prepare_invoke();
        inv.key(keys.task(id))
            .key(&keys.delayed)
            .key(&keys.events)
            .key(keys.idempotency(idem_key.as_deref()))
            .key(&keys.stream)
            .arg(id)
            .arg(now)
            .arg(flag(idem_key.is_some()))
            .arg(self.settings.task_retention_s)
            .arg(self.settings.events_max_len)
            .arg(keys.cancel_channel())
            .arg(format!("{}\n{id}", keys.queue()))
            .arg(self.conn.publish_command())
            .arg(GROUP);
        let reply: Vec<Value> = self
            .trip("cancel", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let code = code_of(reply.next())?;
        Ok(match code {
            Code::Ok => CancelOutcome::Cancelled,
            Code::CancelRequested => CancelOutcome::Requested,
            Code::Terminal => CancelOutcome::Terminal(from_value::<String>(reply.next())?.parse()?),
            Code::NotFound => CancelOutcome::NotFound,
            other => return Err(unexpected("cancel", other)),
        })
    }

    /// Dead-lettered tasks of `queue` (of every partition), oldest first,
    /// at most `limit`.
    pub async fn dead_letters(
        &self,
        queue: &str,
        limit: usize,
    ) -> Result<Vec<TaskRecord>, StoreError> {
        let names = self.partition_names(queue).await?;
        let mut ids: Vec<(f64, usize, String)> = Vec::new();
        let ranges = futures::future::try_join_all(names.iter().map(|name| {
            let keys = QueueKeys::new(name);
            async move {
                self.trip(
                    "dlq_ids",
                    redis::cmd("ZRANGE")
                        .arg(&keys.dlq)
                        .arg(0)
                        .arg(limit.saturating_sub(1) as i64)
                        .arg("WITHSCORES")
                        .query_async::<Vec<(String, f64)>>(&mut self.conn.clone()),
                )
                .await
            }
        }))
        .await?;
        for (partition, range) in ranges.into_iter().enumerate() {
            ids.extend(range.into_iter().map(|(id, at)| (at, partition, id)));
        }
        ids.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        ids.truncate(limit);
        // One pipeline per partition (a cluster pipeline stays in a slot);
        // the records then in the merged order.
        let mut by_partition: Vec<Vec<&str>> = vec![Vec::new(); names.len()];
        for (_, partition, id) in &ids {
            by_partition[*partition].push(id);
        }
        let hashes =
            futures::future::try_join_all(names.iter().zip(&by_partition).map(|(name, ids)| {
                let keys = QueueKeys::new(name);
                let mut pipe = redis::pipe();
                for id in ids {
                    pipe.hgetall(keys.task(id));
                }
                async move {
                    if ids.is_empty() {
                        return Ok(Vec::new());
                    }
                    self.trip("dlq_tasks", pipe.query_async(&mut self.conn.clone()))
                        .await
                }
            }))
            .await?;
        let mut hashes: Vec<_> = hashes
            .into_iter()
            .map(|h: Vec<HashMap<String, String>>| h.into_iter())
            .collect();
        ids.iter()
            .filter_map(|(_, partition, _)| hashes[*partition].next())
            .filter(|h| !h.is_empty())
            .map(TaskRecord::from_fields)
            .collect()
    }

    /// Counts of `queue`: the sums over its partitions.
    pub async fn stats(&self, queue: &str) -> Result<QueueStats, StoreError> {
        let names = self.partition_names(queue).await?;
        let parts = futures::future::try_join_all(
            names
                .iter()
                .map(|name| self.partition_stats(QueueKeys::new(name))),
        )
        .await?;
        let mut stats = QueueStats {
            queue: queue.to_owned(),
            ready: 0,
            running: 0,
            delayed: 0,
            dead_lettered: 0,
            partitions: names.len() as u32,
        };
        for part in parts {
            stats.ready += part.ready;
            stats.running += part.running;
            stats.delayed += part.delayed;
            stats.dead_lettered += part.dead_lettered;
        }
        Ok(stats)
    }

    /// Counts of one partition's key set.
    async fn partition_stats(&self, keys: QueueKeys) -> Result<QueueStats, StoreError> {
        // XPENDING fails with NOGROUP until a worker has read the queue, so
        // the group's count comes from XINFO GROUPS, which lists none then.
        let mut pipe = redis::pipe();
        pipe.xlen(&keys.stream)
            .zcard(&keys.delayed)
            .zcard(&keys.dlq)
            .exists(&keys.stream);
        let (len, delayed, dead_lettered, exists): (u64, u64, u64, bool) = self
            .trip("stats", pipe.query_async(&mut self.conn.clone()))
            .await?;
        let mut running = 0;
        if exists {
            let groups: Vec<HashMap<String, Value>> = self
                .trip(
                    "stats_groups",
                    redis::cmd("XINFO")
                        .arg("GROUPS")
                        .arg(&keys.stream)
                        .query_async(&mut self.conn.clone()),
                )
                .await?;
            for group in groups {
                if group
                    .get("name")
                    .and_then(|n| String::from_redis_value_ref(n).ok())
                    .as_deref()
                    == Some(GROUP)
                {
                    running = group
                        .get("pending")
                        .map(u64::from_redis_value_ref)
                        .transpose()?
                        .unwrap_or(0);
                }
            }
        }
        Ok(QueueStats {
            queue: keys.queue().to_owned(),
            ready: len.saturating_sub(running),
            running,
            delayed,
            dead_lettered,
            partitions: 1,
        })
    }

    /// Every queue that has received a submission, sorted.
    pub async fn queues(&self) -> Result<Vec<String>, StoreError> {
        let mut queues: Vec<String> = self
            .trip(
                "queues",
                redis::cmd("SMEMBERS")
                    .arg(QUEUES)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        queues.sort();
        Ok(queues)
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

/// What one ingest call did.
enum Ingested {
    /// What the submission came to.
    Done(SubmitOutcome),
    /// Nothing: the queue's partition count, as the partition's slot holds
    /// it, is not the one the task was routed by (see `partitions.rs`).
    Repartitioned(u32),
    /// Nothing: the key's records live in this partition, to which a DLQ
    /// requeue forwarded the key (see `dlq.rs`).
    Forwarded(u32),
}

/// Most forwards one submission follows: a forward leads to the partition
/// of a task, whose record is a plain one, so one is the most a
/// submission meets unless records were written by hand.
const MAX_FORWARDS: u32 = 4;

/// The partition a submission forwarded to `to` goes to (`followed`
/// counts the forwards it met): `to`, unless it is where the submission
/// was (a forward to itself, which no script writes) or forwards keep
/// coming.
pub(super) fn follow_forward(
    new: &NewTask,
    to: u32,
    followed: &mut u32,
) -> Result<u32, StoreError> {
    *followed += 1;
    if to == partition_of_id(&new.id) || *followed > MAX_FORWARDS {
        return Err(StoreError::Corrupt(format!(
            "the idempotency key of a submission to {} forwards in a loop (partition {to})",
            new.queue
        )));
    }
    Ok(to)
}

/// What the ingest script's `reply` says.
fn ingested(reply: Vec<Value>) -> Result<Ingested, StoreError> {
    let mut reply = reply.into_iter();
    let code = code_of(reply.next())?;
    let second = reply.next();
    Ok(Ingested::Done(match code {
        Code::Ok => {
            let status: String = from_value(reply.next())?;
            SubmitOutcome::Created {
                status: status.parse()?,
            }
        }
        Code::Replay => {
            SubmitOutcome::Replay(Box::new(TaskRecord::from_flat(from_value(reply.next())?)?))
        }
        Code::InProgress => SubmitOutcome::InProgress {
            task_id: from_value(second)?,
        },
        Code::KeyMismatch => SubmitOutcome::KeyMismatch {
            task_id: from_value(second)?,
        },
        Code::QueueFull => SubmitOutcome::QueueFull {
            depth: from_value(second)?,
        },
        Code::Repartitioned => return Ok(Ingested::Repartitioned(from_value(second)?)),
        Code::Forwarded => return Ok(Ingested::Forwarded(from_value(second)?)),
        other => return Err(unexpected("ingest", other)),
    }))
}

fn unexpected(script: &str, code: Code) -> StoreError {
    StoreError::Protocol(format!("{script} returned {code:?}, which it never should"))
}
