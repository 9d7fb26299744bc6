//! The submission path: one walk from a route's authorized request to the
//! one script that does idempotency, backpressure and the enqueue.
//!
//! [`Submitter`] is what the routes call, once per request: it reads the
//! body, gives the task its deployed defaults ([`Handlers`]), checks every
//! field, and has the store route the task to its partition and run the
//! ingest script ([`Store::submit`], [`Store::submit_batch`]), for a
//! single submission and a batch alike. [`submit`] and [`submit_batch`]
//! are its second half, for callers that hold a parsed request (periodic
//! tasks, the tests and benchmarks).
//!
//! Everything a submitter can get wrong is checked here, before anything is
//! written, and reported as an [`IngestError`] with a stable code.
//!
//! # Layout
//!
//! - `request.rs`: the wire types ([`SubmitRequest`], [`BatchRequest`],
//!   [`KeyHeader`]) and their parse;
//! - `validate.rs`: names, keys, the payload fingerprint, the numbers and
//!   the times computed from them;
//! - `run_at.rs`: `run_at` as ms or as RFC 3339 (chrono reads the latter);
//! - `handlers.rs`: the deployed handlers' defaults, looked up once per
//!   task name;
//! - this file: the limits, the errors, and the path itself.
//!
//! # Bounds
//!
//! Every number a submitter sends has a bound, so none can overflow the
//! times computed from it or ask for something absurd:
//!
//! | field | accepted | code |
//! |---|---|---|
//! | `max_attempts` | 1 to [`MAX_ATTEMPTS_LIMIT`] | `INVALID_MAX_ATTEMPTS` |
//! | `timeout_ms` | 1 to the server's task timeout (`--task-timeout-ms`) | `INVALID_TIMEOUT` |
//! | `delay_ms` | 0 to [`MAX_DELAY_MS`] | `INVALID_DELAY` |
//! | `expires_in_ms` | 1 to [`MAX_EXPIRES_IN_MS`], and over `delay_ms` | `INVALID_EXPIRY` |
//! | `run_at` | ms since the Unix epoch or an RFC 3339 string, at most [`MAX_DELAY_MS`] from now, not with `delay_ms` | `INVALID_RUN_AT` |
//!
//! A field that is not a whole number (negative, fractional, a string, past
//! `u64`) gets its field's code too. The run and expiry times are sums of
//! the submission time and these numbers, each addition checked
//! ([`schedule`]): no accepted submission runs or expires before it was made.
//!
//! `run_at` names the run time instead of a delay: a time already past runs
//! now, and `expires_in_ms` (still counted from the submission) must reach
//! past it, as it must reach past a delay.
//!
//! # Batches
//!
//! [`submit_batch`] runs up to [`MAX_BATCH_ITEMS`] submissions of one queue
//! with one round trip to Redis: each item is validated as [`submit`]
//! validates it, and every valid item's ingest script goes into one
//! pipeline. Each item gets the outcome its own [`submit`] would have had,
//! in order; items are atomic one by one (each is one script), not as a
//! whole, and a later item sees what an earlier one wrote, as a later
//! submission would.

mod flow;
mod handlers;
mod request;
mod run_at;
mod validate;

pub use flow::{Applied, apply_outbox, repair};
pub use handlers::{Deployed, Handlers};
pub use request::{
    BatchRequest, KeyHeader, RunAt, SubmitRequest, parse_batch_body, parse_submit_body,
    parse_submit_value,
};
pub use run_at::parse_run_at;
pub use validate::{
    Start, check_run_settings, fingerprint, schedule, validate_group, validate_idempotency_key,
    validate_queue_name, validate_task_name,
};

/// The clock, from [`crate::base`], where the tests and benchmarks look
/// for it beside the submission path they time.
pub use crate::base::now_ms;

use crate::base::ErrorCode;
use crate::store::{NewTask, Store, StoreError, SubmitOutcome, TaskRecord, TaskStatus};
use validate::check_numbers;

/// Longest accepted idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;
/// Longest accepted queue or task name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Most attempts a submission may ask for.
pub const MAX_ATTEMPTS_LIMIT: u32 = 100;
/// A day, in ms.
const DAY_MS: u64 = 86_400_000;
/// Longest delay a submission may ask for: 30 days.
pub const MAX_DELAY_MS: u64 = 30 * DAY_MS;
/// Longest expiry a submission may ask for: 60 days, so that a task delayed
/// by [`MAX_DELAY_MS`] may still be given a month to start.
pub const MAX_EXPIRES_IN_MS: u64 = 60 * DAY_MS;
/// Most submissions in one batch. Redis serves other clients between a
/// pipeline's scripts, so a batch does not hold Redis for its whole length;
/// the bound is on the work and memory of one request (its body, its items,
/// their replies), and a thousand small items stay well within the API's
/// Redis deadline.
pub const MAX_BATCH_ITEMS: usize = 1000;
/// Largest batch body, bytes: 16 MiB, or a single submission's body limit
/// if that is larger. Each item's payload is held to `--max-payload-bytes`
/// on its own; this caps what one request makes the API hold at once (the
/// body, then its items parsed), which a thousand items each at the
/// payload limit would put at a gigabyte.
pub const MAX_BATCH_BODY_BYTES: usize = 16 << 20;

/// Limits and defaults of the submission path.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    /// Largest payload (serialized JSON), bytes.
    pub max_payload_bytes: usize,
    /// Ready + delayed tasks a queue may hold; 0 is unlimited.
    pub max_queue_depth: u64,
    /// Attempts of a task whose submission does not say.
    pub default_max_attempts: u32,
    /// Longest per-task timeout a submission may ask for, ms.
    pub max_timeout_ms: u64,
}

/// What a submitter got wrong, or what stopped the submission.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The request is not acceptable (400).
    #[error("{message}")]
    Invalid {
        /// A stable code, e.g. `INVALID_QUEUE_NAME`.
        code: ErrorCode,
        /// What is wrong, for a person.
        message: String,
    },
    /// A batch of more items than [`MAX_BATCH_ITEMS`] (413).
    #[error("the batch has {items} tasks; at most {limit} are taken at once")]
    BatchTooLarge {
        /// Its items.
        items: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload is over the limit (413).
    #[error("payload is {size} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// The payload's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// No handler is deployed for the task name (400).
    #[error("no handler is deployed for task {0:?}")]
    UnknownTask(String),
    /// The key's task is still in flight (409).
    #[error("a task with this idempotency key is still in flight")]
    InProgress {
        /// The in-flight task.
        task_id: String,
    },
    /// The key was used with another payload or task (422).
    #[error("this idempotency key was used with a different task or payload")]
    KeyMismatch {
        /// The key's task.
        task_id: String,
    },
    /// The queue is full (429).
    #[error("queue {queue:?} is full ({depth} tasks waiting)")]
    QueueFull {
        /// The queue.
        queue: String,
        /// Its depth.
        depth: u64,
    },
    /// Redis failed (503).
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl IngestError {
    /// The stable code the API answers this refusal with.
    pub fn code(&self) -> ErrorCode {
        match self {
            IngestError::Invalid { code, .. } => *code,
            IngestError::BatchTooLarge { .. } => ErrorCode::BatchTooLarge,
            IngestError::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            IngestError::UnknownTask(_) => ErrorCode::UnknownTask,
            IngestError::InProgress { .. } => ErrorCode::IdempotencyInProgress,
            IngestError::KeyMismatch { .. } => ErrorCode::IdempotencyKeyMismatch,
            IngestError::QueueFull { .. } => ErrorCode::QueueFull,
            IngestError::Store(StoreError::TooManyQueues { .. }) => ErrorCode::TooManyQueues,
            IngestError::Store(_) => ErrorCode::StoreUnavailable,
        }
    }
}

fn invalid(code: ErrorCode, message: impl Into<String>) -> IngestError {
    IngestError::Invalid {
        code,
        message: message.into(),
    }
}

/// What a successful submission returns.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// The task (new, or the replayed one).
    pub task_id: String,
    /// The queue.
    pub queue: String,
    /// The task name.
    pub task: String,
    /// Its status now.
    pub status: TaskStatus,
    /// Whether this is a replay of an earlier submission with the same key.
    pub duplicate: bool,
    /// The replayed task's record.
    pub record: Option<TaskRecord>,
}

/// The submission path as a route walks it: Redis, the limits, and the
/// deployed handlers. Each call is one request, already authorized.
pub struct Submitter<'a, H> {
    /// Where the task goes.
    pub store: &'a Store,
    /// The limits and defaults.
    pub settings: &'a IngestSettings,
    /// Which tasks are deployed, and their defaults.
    pub handlers: &'a H,
    /// The W3C `traceparent` the request's tasks carry to their attempts
    /// (the API's span when it traces, else the one the request sent), or
    /// `None`: nothing is stored for it.
    pub trace: Option<&'a str>,
}

impl<H: Handlers> Submitter<'_, H> {
    /// Submit the body of `POST /v1/queues/{queue}/tasks`: read it
    /// ([`parse_submit_body`]), take the key of its header, give the task
    /// its handler's defaults, then [`submit`]. A lookup that fails is the
    /// handlers' error; anything else that fails, an [`IngestError`].
    pub async fn submit(
        &self,
        queue: &str,
        key_header: KeyHeader,
        body: &[u8],
    ) -> Result<Submitted, H::Error> {
        let mut req = parse_submit_body(body)?;
        let header_key = key_header.key()?;
        let deployed = self.handlers.deployed(&req.task).await?;
        handlers::apply(&mut req, deployed);
        let known = deployed.is_some();
        let mut new = prepare(self.settings, queue, header_key.as_deref(), req, |_| known)?;
        new.traceparent = self.trace.map(str::to_owned);
        let outcome = self
            .store
            .submit(&mut new, self.settings.max_queue_depth)
            .await
            .map_err(IngestError::from)?;
        Ok(settle(new, outcome)?)
    }

    /// Submit the body of `POST /v1/queues/{queue}/tasks/batch` (after
    /// [`check_batch`]): read its items ([`parse_batch_body`]), give each
    /// its task's defaults (each name looked up once), then
    /// [`submit_batch`]. The outer error fails the whole batch; each item
    /// has its own outcome, in order.
    pub async fn submit_batch(
        &self,
        queue: &str,
        body: &[u8],
    ) -> Result<Vec<Result<Submitted, IngestError>>, H::Error> {
        let mut items = parse_batch_body(body)?;
        let known = handlers::apply_to_batch(self.handlers, &mut items).await?;
        let has_handler = |task: &str| known.get(task).is_some_and(Option::is_some);
        let outcomes = run_batch(
            self.store,
            self.settings,
            queue,
            items,
            has_handler,
            self.trace,
        )
        .await
        .map_err(IngestError::from)?;
        Ok(outcomes)
    }
}

/// What refuses a batch before its body is read: a key in the
/// `Idempotency-Key` header (it names one task; a batch takes each item's
/// key in its `idempotency_key`), then a bad queue name.
pub fn check_batch(queue: &str, key_header: bool) -> Result<(), IngestError> {
    if key_header {
        return Err(invalid(
            ErrorCode::InvalidIdempotencyKey,
            "a batch takes each item's key in its `idempotency_key`, not the Idempotency-Key header",
        ));
    }
    validate_queue_name(queue)
}

/// Validate a submission and run it: one round trip to Redis.
///
/// `header_key` is the `Idempotency-Key` header, which wins over the body's
/// field. `has_handler` tells whether a task name is deployed.
pub async fn submit(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    header_key: Option<&str>,
    req: SubmitRequest,
    has_handler: impl Fn(&str) -> bool,
) -> Result<Submitted, IngestError> {
    let mut new = prepare(settings, queue, header_key, req, has_handler)?;
    let outcome = store.submit(&mut new, settings.max_queue_depth).await?;
    settle(new, outcome)
}

/// Validate every item of a batch for `queue` and run the valid ones in
/// one pipeline, one round trip to Redis (see the module's "Batches").
/// `items` are the items as read ([`parse_submit_value`]); one that could
/// not be read keeps its error. The outcome of each item, in order, is
/// what [`submit`] would have returned for it; only Redis failing for the
/// whole pipeline fails the whole batch, and then some items may have been
/// written (their keys make a resubmission safe).
pub async fn submit_batch(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    items: Vec<Result<SubmitRequest, IngestError>>,
    has_handler: impl Fn(&str) -> bool,
) -> Result<Vec<Result<Submitted, IngestError>>, StoreError> {
    run_batch(store, settings, queue, items, has_handler, None).await
}

/// [`submit_batch`], each task carrying `trace` (see [`Submitter::trace`]).
async fn run_batch(
    store: &Store,
    settings: &IngestSettings,
    queue: &str,
    items: Vec<Result<SubmitRequest, IngestError>>,
    has_handler: impl Fn(&str) -> bool,
    trace: Option<&str>,
) -> Result<Vec<Result<Submitted, IngestError>>, StoreError> {
    let mut outcomes: Vec<Option<Result<Submitted, IngestError>>> = Vec::new();
    let (mut tasks, mut slots) = (Vec::new(), Vec::new());
    for item in items {
        match item.and_then(|req| prepare(settings, queue, None, req, &has_handler)) {
            Ok(mut new) => {
                new.traceparent = trace.map(str::to_owned);
                slots.push(outcomes.len());
                tasks.push(new);
                outcomes.push(None);
            }
            Err(e) => outcomes.push(Some(Err(e))),
        }
    }
    let written = store
        .submit_batch(&mut tasks, settings.max_queue_depth)
        .await?;
    for ((slot, new), outcome) in slots.into_iter().zip(tasks).zip(written) {
        outcomes[slot] = Some(
            outcome
                .map_err(IngestError::from)
                .and_then(|o| settle(new, o)),
        );
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or_else(|| StoreError::Protocol("a batch item got no outcome".into())))
        .collect()
}

/// Everything [`submit`] does before Redis: check the submission and make
/// the task it asks for.
fn prepare(
    settings: &IngestSettings,
    queue: &str,
    header_key: Option<&str>,
    mut req: SubmitRequest,
    has_handler: impl Fn(&str) -> bool,
) -> Result<NewTask, IngestError> {
    validate_queue_name(queue)?;
    validate_task_name(&req.task)?;
    let key = header_key
        .map(str::to_owned)
        .or_else(|| req.idempotency_key.take());
    if let Some(key) = &key {
        validate_idempotency_key(key)?;
    }
    if let Some(group) = &req.group {
        validate_group(group)?;
    }
    let payload = req.payload.to_string();
    if payload.len() > settings.max_payload_bytes {
        return Err(IngestError::PayloadTooLarge {
            size: payload.len(),
            limit: settings.max_payload_bytes,
        });
    }
    let numbers = check_numbers(settings, &req)?;
    if !has_handler(&req.task) {
        return Err(IngestError::UnknownTask(req.task));
    }

    let now = now_ms();
    let (run_at, expires_at) = schedule(now, numbers.start, numbers.expires_in_ms)?;
    Ok(NewTask {
        id: crate::base::new_task_id(),
        queue: queue.to_owned(),
        fingerprint: fingerprint(&req.task, &payload),
        task: req.task,
        payload,
        idempotency_key: key,
        max_attempts: numbers.max_attempts,
        timeout_ms: numbers.timeout_ms,
        now,
        run_at,
        expires_at,
        group: req.group,
        traceparent: None,
        parent: None,
    })
}

/// What the ingest script's `outcome` for `new` means to its submitter.
fn settle(new: NewTask, outcome: SubmitOutcome) -> Result<Submitted, IngestError> {
    match outcome {
        SubmitOutcome::Created { status } => Ok(Submitted {
            task_id: new.id,
            queue: new.queue,
            task: new.task,
            status,
            duplicate: false,
            record: None,
        }),
        SubmitOutcome::Replay(record) => Ok(Submitted {
            task_id: record.id.clone(),
            queue: record.queue.clone(),
            task: record.task.clone(),
            status: record.status,
            duplicate: true,
            record: Some(*record),
        }),
        SubmitOutcome::InProgress { task_id } => Err(IngestError::InProgress { task_id }),
        SubmitOutcome::KeyMismatch { task_id } => Err(IngestError::KeyMismatch { task_id }),
        SubmitOutcome::QueueFull { depth } => Err(IngestError::QueueFull {
            queue: new.queue,
            depth,
        }),
    }
}
