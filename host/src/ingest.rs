//! The submission path: validation, the payload fingerprint, and the one
//! script that does idempotency, backpressure and the enqueue.
//!
//! Everything a submitter can get wrong is checked here, before anything is
//! written, and reported as an [`IngestError`] with a stable code.
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


use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::base::now_ms;
use crate::base::ErrorCode;
use crate::store::{NewTask, Store, StoreError, SubmitOutcome, TaskRecord, TaskStatus};

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

/// The body of `POST /v1/queues/{queue}/tasks`. Unknown fields are rejected,
/// so a misspelt option (`max_attempt`) is an error instead of being ignored.
#[derive(Debug, Clone, Default, serde::Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The task name: `<task>.wasm` must be deployed.
    pub task: String,
    /// Any JSON value; `null` when absent.
    #[serde(default)]
    pub payload: Value,
    /// The idempotency key (the `Idempotency-Key` header wins over it).
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Attempts before dead-lettering.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Deadline of one attempt, ms.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Run no earlier than this many ms from now.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Expire if not started within this many ms.
    #[serde(default)]
    pub expires_in_ms: Option<u64>,
    /// Run no earlier than this time, ms since the Unix epoch; sent as that
    /// number or as an RFC 3339 string ([`parse_run_at`]). Not with
    /// `delay_ms`.
    #[serde(default, deserialize_with = "run_at_field")]
    #[schema(value_type = Option<RunAt>)]
    pub run_at: Option<u64>,
}

/// `run_at` as [`parse_run_at`] reads it; `null` is absent.
fn run_at_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(v) => parse_run_at(&v).map(Some).map_err(serde::de::Error::custom),
    }
}

/// Read a `run_at`: a whole number of ms since the Unix epoch, or an RFC
/// 3339 date-time string (`2026-12-03T14:00:00Z`,
/// `2026-12-03T15:00:00.250+01:00`; fractions past the millisecond are
/// dropped). A time before the epoch is 0: it is past, so the task runs
/// at once.
pub fn parse_run_at(value: &Value) -> Result<u64, String> {
    match value {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            format!("run_at must be ms since the Unix epoch (a whole number from 0), got {n}")
        }),
        Value::String(text) => rfc3339_ms(text)
            .map_err(|why| format!("run_at {text:?} is not an RFC 3339 date-time ({why})")),
        _ => Err("run_at must be ms since the Unix epoch or an RFC 3339 string".into()),
    }
}

/// ms since the Unix epoch of an RFC 3339 `date-time`
/// (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `t`, `z` and a space for `T`
/// accepted as RFC 3339 allows), 0 for a time before the epoch.
fn rfc3339_ms(text: &str) -> Result<u64, &'static str> {
    let b = text.as_bytes();
    let digits = |at: usize, n: usize| -> Result<i64, &'static str> {
        let part = b.get(at..at + n).ok_or("too short")?;
        if !part.iter().all(u8::is_ascii_digit) {
            return Err("a digit expected");
        }
        Ok(part.iter().fold(0, |acc, d| acc * 10 + i64::from(d - b'0')))
    };
    let sep = |at: usize, allowed: &[u8]| match b.get(at) {
        Some(c) if allowed.contains(c) => Ok(()),
        _ => Err("a separator is missing"),
    };
    let (year, month, day) = (digits(0, 4)?, digits(5, 2)?, digits(8, 2)?);
    sep(4, b"-")?;
    sep(7, b"-")?;
    sep(10, b"Tt ")?;
    let (hour, minute, second) = (digits(11, 2)?, digits(14, 2)?, digits(17, 2)?);
    sep(13, b":")?;
    sep(16, b":")?;
    let mut at = 19;
    let mut millis = 0;
    if b.get(at) == Some(&b'.') {
        let start = at + 1;
        at = start;
        while b.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        if at == start {
            return Err("a fraction without digits");
        }
        let kept = (at - start).min(3);
        millis = digits(start, kept)? * 10_i64.pow(3 - kept as u32);
    }
    let offset_min = match b.get(at) {
        Some(b'Z' | b'z') if at + 1 == b.len() => 0,
        Some(sign @ (b'+' | b'-')) if at + 6 == b.len() => {
            sep(at + 3, b":")?;
            let (h, m) = (digits(at + 1, 2)?, digits(at + 4, 2)?);
            if h > 23 || m > 59 {
                return Err("the offset is out of range");
            }
            let minutes = h * 60 + m;
            if *sign == b'-' { -minutes } else { minutes }
        }
        _ => return Err("no time zone offset (Z or ±HH:MM) at the end"),
    };
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let february = if leap { 29 } else { 28 };
    let month_days = [31, february, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if !(1..=12).contains(&month) || day < 1 || day > month_days[month as usize - 1] {
        return Err("no such date");
    }
    // Second 60 is a leap second, which the epoch's count does not have:
    // it reads as the next second.
    if hour > 23 || minute > 59 || second > 60 {
        return Err("no such time of day");
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset_min * 60;
    Ok(u64::try_from(seconds * 1000 + millis).unwrap_or(0))
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar
/// (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

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

/// Check a queue name: 1 to 64 bytes of `[A-Za-z0-9_.-]`. Braces and colons
/// would break the key layout's hash tags.
pub fn validate_queue_name(queue: &str) -> Result<(), IngestError> {
    validate_name(queue)
        .map_err(|why| invalid(ErrorCode::InvalidQueueName, format!("queue name {why}")))
}

/// Check a task name, by the same rule as queue names.
pub fn validate_task_name(task: &str) -> Result<(), IngestError> {
    validate_name(task)
        .map_err(|why| invalid(ErrorCode::InvalidTaskName, format!("task name {why}")))
}

fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "must be 1 to {MAX_NAME_BYTES} bytes, got {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        return Err(format!(
            "{name:?} has {c:?}; only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    Ok(())
}

/// Check an idempotency key: 1 to 255 bytes, no control characters.
pub fn validate_idempotency_key(key: &str) -> Result<(), IngestError> {
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
        return Err(invalid(
            ErrorCode::InvalidIdempotencyKey,
            format!(
                "idempotency key must be 1 to {MAX_IDEMPOTENCY_KEY_BYTES} bytes, got {}",
                key.len()
            ),
        ));
    }
    if key.chars().any(char::is_control) {
        return Err(invalid(
            ErrorCode::InvalidIdempotencyKey,
            "idempotency key has control characters",
        ));
    }
    Ok(())
}

/// The fingerprint of a submission: sha256 over the task name and the
/// payload in canonical form, so the same JSON with its keys in another
/// order is the same submission. `canonical_payload` is the payload `Value`
/// serialized: serde_json's Map is ordered by key (no `preserve_order`), so
/// that text is canonical, and it is the text stored, so it is made once.
pub fn fingerprint(task: &str, canonical_payload: &str) -> String {
    let mut h = Sha256::new();
    h.update(task.as_bytes());
    h.update([0]);
    h.update(canonical_payload.as_bytes());
    hex::encode(h.finalize())
}

/// The numeric fields of a submission and the code of each one's errors.
const NUMBER_FIELDS: [(&str, ErrorCode); 4] = [
    ("max_attempts", ErrorCode::InvalidMaxAttempts),
    ("timeout_ms", ErrorCode::InvalidTimeout),
    ("delay_ms", ErrorCode::InvalidDelay),
    ("expires_in_ms", ErrorCode::InvalidExpiry),
];

/// Parse the body of `POST /v1/queues/{queue}/tasks`.
///
/// Not JSON: `INVALID_JSON`. Then as [`parse_submit_value`].
pub fn parse_submit_body(body: &[u8]) -> Result<SubmitRequest, IngestError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| invalid(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    parse_submit_value(value)
}

/// Read a submission from its JSON (a body, or an item of a batch).
///
/// A numeric field that is not a whole number from 0 to `u64::MAX`
/// (`u32::MAX` for `max_attempts`): that field's code (see the module's
/// bounds), where a typed parse would only say `INVALID_REQUEST`; a
/// `run_at` that [`parse_run_at`] cannot read: `INVALID_RUN_AT`. Any other
/// mismatch (not an object, no `task`, an unknown field): `INVALID_REQUEST`.
pub fn parse_submit_value(value: Value) -> Result<SubmitRequest, IngestError> {
    if let Value::Object(fields) = &value {
        if let Some(at) = fields.get("run_at").filter(|v| !v.is_null()) {
            parse_run_at(at).map_err(|why| invalid(ErrorCode::InvalidRunAt, why))?;
        }
        for (name, code) in NUMBER_FIELDS {
            let max = if name == "max_attempts" {
                u64::from(u32::MAX)
            } else {
                u64::MAX
            };
            match fields.get(name) {
                None | Some(Value::Null) => {}
                Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= max) => {}
                Some(other) => {
                    let got = match other {
                        Value::Number(n) => n.to_string(),
                        Value::String(_) => "a string".into(),
                        Value::Bool(b) => b.to_string(),
                        Value::Array(_) => "an array".into(),
                        Value::Object(_) => "an object".into(),
                        Value::Null => "null".into(),
                    };
                    let message = if other.as_u64().is_some() {
                        // Only max_attempts has a bound under u64::MAX.
                        format!("{name} must be 1 to {MAX_ATTEMPTS_LIMIT}, got {got}")
                    } else {
                        format!("{name} must be a whole number, got {got}")
                    };
                    return Err(invalid(code, message));
                }
            }
        }
    }
    serde_json::from_value(value)
        .map_err(|e| invalid(ErrorCode::InvalidRequest, format!("request body: {e}")))
}

/// A submission's numbers, in their bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Numbers {
    max_attempts: u32,
    timeout_ms: Option<u64>,
    start: Start,
    expires_in_ms: Option<u64>,
}

/// When a submission asks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// This many ms after the submission (`delay_ms`; 0 is at once).
    Delay(u64),
    /// At this time, ms since the Unix epoch (`run_at`); at once if past.
    At(u64),
}

/// Check a task's attempt budget and per-attempt deadline against their
/// bounds: a submission's, or a periodic task's, which submits them later.
pub fn check_run_settings(
    settings: &IngestSettings,
    max_attempts: u32,
    timeout_ms: Option<u64>,
) -> Result<(), IngestError> {
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return Err(invalid(
            ErrorCode::InvalidMaxAttempts,
            format!("max_attempts must be 1 to {MAX_ATTEMPTS_LIMIT}, got {max_attempts}"),
        ));
    }
    if let Some(t) = timeout_ms
        && !(1..=settings.max_timeout_ms).contains(&t)
    {
        return Err(invalid(
            ErrorCode::InvalidTimeout,
            format!(
                "timeout_ms must be 1 to {}, got {t}",
                settings.max_timeout_ms
            ),
        ));
    }
    Ok(())
}

/// Check every number of `req` against its bound (see the module's table).
fn check_numbers(settings: &IngestSettings, req: &SubmitRequest) -> Result<Numbers, IngestError> {
    let max_attempts = req.max_attempts.unwrap_or(settings.default_max_attempts);
    check_run_settings(settings, max_attempts, req.timeout_ms)?;
    if let (Some(_), Some(_)) = (req.run_at, req.delay_ms) {
        return Err(invalid(
            ErrorCode::InvalidRunAt,
            "run_at and delay_ms both say when to run: send one of them",
        ));
    }
    let delay_ms = req.delay_ms.unwrap_or(0);
    if delay_ms > MAX_DELAY_MS {
        return Err(invalid(
            ErrorCode::InvalidDelay,
            format!("delay_ms must be 0 to {MAX_DELAY_MS}, got {delay_ms}"),
        ));
    }
    if let Some(e) = req.expires_in_ms {
        if !(1..=MAX_EXPIRES_IN_MS).contains(&e) {
            return Err(invalid(
                ErrorCode::InvalidExpiry,
                format!("expires_in_ms must be 1 to {MAX_EXPIRES_IN_MS}, got {e}"),
            ));
        }
        if e <= delay_ms {
            return Err(invalid(
                ErrorCode::InvalidExpiry,
                format!(
                    "expires_in_ms ({e}) must be over delay_ms ({delay_ms}): \
                     the task would expire before it may run"
                ),
            ));
        }
    }
    let start = match req.run_at {
        Some(at) => Start::At(at),
        None => Start::Delay(delay_ms),
    };
    Ok(Numbers {
        max_attempts,
        timeout_ms: req.timeout_ms,
        start,
        expires_in_ms: req.expires_in_ms,
    })
}

/// When a task submitted at `now` may run, and when it expires: `now` plus
/// the delay (or the `run_at` asked for, `now` if that is past), and `now`
/// plus the expiry. Each addition is checked; one that overflows is
/// refused with the field's code instead of wrapping around to a time
/// before `now`. A `run_at` more than [`MAX_DELAY_MS`] ahead is refused
/// (`INVALID_RUN_AT`), and so is an expiry that does not come after the run
/// time (`INVALID_EXPIRY`).
pub fn schedule(
    now: u64,
    start: Start,
    expires_in_ms: Option<u64>,
) -> Result<(u64, Option<u64>), IngestError> {
    let run_at = match start {
        Start::Delay(delay_ms) => now.checked_add(delay_ms).ok_or_else(|| {
            invalid(
                ErrorCode::InvalidDelay,
                format!("delay_ms {delay_ms} overflows"),
            )
        })?,
        Start::At(at) if at.saturating_sub(now) > MAX_DELAY_MS => {
            return Err(invalid(
                ErrorCode::InvalidRunAt,
                format!("run_at {at} is more than {MAX_DELAY_MS} ms (30 days) after now ({now})"),
            ));
        }
        Start::At(at) => at.max(now),
    };
    let expires_at = match expires_in_ms {
        None => None,
        Some(ms) => Some(now.checked_add(ms).ok_or_else(|| {
            invalid(
                ErrorCode::InvalidExpiry,
                format!("expires_in_ms {ms} overflows"),
            )
        })?),
    };
    if let Some(at) = expires_at
        && at <= run_at
    {
        return Err(invalid(
            ErrorCode::InvalidExpiry,
            format!(
                "expires_in_ms ends at {at}, not after the run time {run_at}: \
                 the task would expire before it may run"
            ),
        ));
    }
    Ok((run_at, expires_at))
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
    let mut outcomes: Vec<Option<Result<Submitted, IngestError>>> = Vec::new();
    let (mut tasks, mut slots) = (Vec::new(), Vec::new());
    for item in items {
        match item.and_then(|req| prepare(settings, queue, None, req, &has_handler)) {
            Ok(new) => {
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

/// `run_at` of a submission: ms since the Unix epoch, or an RFC 3339
/// date-time.
pub struct RunAt;

impl utoipa::PartialSchema for RunAt {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, Type};
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                    .minimum(Some(0)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
            )
            .description(Some(
                "Run no earlier than this time: ms since the Unix epoch, or an RFC 3339 \
                 date-time; a time past runs at once. Not with `delay_ms`.",
            ))
            .into()
    }
}

impl utoipa::ToSchema for RunAt {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("RunAt")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_with_hash_tag_or_separator_characters_are_rejected() {
        for bad in ["", "a{b}", "a:b", "a b", "é", &"x".repeat(65)] {
            assert!(validate_queue_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["default", "emails-v2", "a.b_c", &"x".repeat(64)] {
            assert!(validate_queue_name(good).is_ok(), "{good:?} rejected");
        }
    }

    #[test]
    fn idempotency_keys_are_bounded() {
        assert!(validate_idempotency_key("").is_err());
        assert!(validate_idempotency_key(&"k".repeat(256)).is_err());
        assert!(validate_idempotency_key(&"k".repeat(255)).is_ok());
        assert!(validate_idempotency_key("a\nb").is_err());
    }

    #[test]
    fn fingerprint_ignores_key_order_but_not_values_or_task() {
        let fp = |task: &str, payload: Value| fingerprint(task, &payload.to_string());
        let a = fp("t", json!({"a": 1, "b": [1, 2]}));
        let b = fp(
            "t",
            serde_json::from_str(r#"{"b":[1,2],"a":1}"#).unwrap_or_default(),
        );
        assert_eq!(a, b);
        assert_ne!(a, fp("t", json!({"a": 2, "b": [1, 2]})));
        assert_ne!(a, fp("u", json!({"a": 1, "b": [1, 2]})));
    }

    fn settings() -> IngestSettings {
        IngestSettings {
            max_payload_bytes: 1 << 20,
            max_queue_depth: 0,
            default_max_attempts: 3,
            max_timeout_ms: 30_000,
        }
    }

    fn request(delay_ms: Option<u64>, expires_in_ms: Option<u64>) -> SubmitRequest {
        SubmitRequest {
            task: "echo".into(),
            payload: Value::Null,
            idempotency_key: None,
            max_attempts: None,
            timeout_ms: None,
            delay_ms,
            expires_in_ms,
            run_at: None,
        }
    }

    fn code<T>(r: Result<T, IngestError>) -> &'static str {
        match r {
            Ok(_) => "OK",
            Err(IngestError::Invalid { code, .. }) => code.as_str(),
            Err(_) => "OTHER",
        }
    }

    #[test]
    fn the_overflowing_expiry_of_the_issue_is_refused() {
        let req = request(None, Some(u64::MAX));
        assert_eq!(code(check_numbers(&settings(), &req)), "INVALID_EXPIRY");
        assert_eq!(
            code(schedule(1, Start::Delay(0), Some(u64::MAX))),
            "INVALID_EXPIRY"
        );
        assert_eq!(
            code(schedule(u64::MAX, Start::Delay(1), None)),
            "INVALID_DELAY"
        );
    }

    #[test]
    fn rfc3339_times_read_as_ms_since_the_epoch() {
        for (text, want) in [
            ("1970-01-01T00:00:00Z", 0),
            ("1970-01-01T00:00:01.5Z", 1_500),
            ("2000-02-29T12:00:00Z", 951_825_600_000),
            ("2026-12-03T14:00:00.250Z", 1_796_306_400_250),
            ("2026-12-03t15:00:00.250123+01:00", 1_796_306_400_250),
            ("2026-12-03 09:30:00-04:30", 1_796_306_400_000),
            ("1969-12-31T23:59:59Z", 0),
            ("2016-12-31T23:59:60Z", 1_483_228_800_000),
        ] {
            assert_eq!(rfc3339_ms(text), Ok(want), "{text}");
        }
        for bad in [
            "",
            "2026-12-03",
            "2026-12-03T14:00:00",
            "2026-12-03T14:00Z",
            "2026-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-12-03T24:00:00Z",
            "2026-12-03T14:00:00.Z",
            "2026-12-03T14:00:00+0100",
            "2026-12-03T14:00:00Zjunk",
            "２026-12-03T14:00:00Z",
        ] {
            assert!(rfc3339_ms(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn run_at_is_a_number_or_an_rfc3339_string_and_not_with_delay_ms() {
        for (body, want) in [
            (r#"{"task":"t","run_at":1796306400250}"#, "OK"),
            (r#"{"task":"t","run_at":"2026-12-03T14:00:00Z"}"#, "OK"),
            (r#"{"task":"t","run_at":null}"#, "OK"),
            (r#"{"task":"t","run_at":-1}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":1.5}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":"tomorrow"}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":true}"#, "INVALID_RUN_AT"),
        ] {
            assert_eq!(code(parse_submit_body(body.as_bytes())), want, "{body}");
        }
        let req = parse_submit_body(br#"{"task":"t","run_at":"1970-01-01T00:00:02Z"}"#);
        assert_eq!(req.map(|r| r.run_at).ok(), Some(Some(2_000)));
        let mut both = request(Some(10), None);
        both.run_at = Some(1);
        assert_eq!(code(check_numbers(&settings(), &both)), "INVALID_RUN_AT");
        let now = 1_000_000;
        assert_eq!(
            code(schedule(now, Start::At(now + MAX_DELAY_MS), None)),
            "OK"
        );
        assert_eq!(
            code(schedule(now, Start::At(now + MAX_DELAY_MS + 1), None)),
            "INVALID_RUN_AT"
        );
        assert_eq!(
            schedule(now, Start::At(5), Some(1)).ok(),
            Some((now, Some(now + 1)))
        );
        assert_eq!(
            code(schedule(now, Start::At(now + 100), Some(100))),
            "INVALID_EXPIRY"
        );
    }

    #[test]
    fn numbers_of_the_wrong_kind_get_their_fields_code() {
        for (body, want) in [
            (r#"{"task":"t","max_attempts":-1}"#, "INVALID_MAX_ATTEMPTS"),
            (
                r#"{"task":"t","max_attempts":4294967296}"#,
                "INVALID_MAX_ATTEMPTS",
            ),
            (r#"{"task":"t","timeout_ms":1.5}"#, "INVALID_TIMEOUT"),
            (r#"{"task":"t","delay_ms":"5"}"#, "INVALID_DELAY"),
            (
                r#"{"task":"t","expires_in_ms":18446744073709551616}"#,
                "INVALID_EXPIRY",
            ),
            (r#"{"task":"t","expires_in_ms":1e400}"#, "INVALID_JSON"),
            (r#"{"task":"t","delay_ms":null}"#, "OK"),
            (r#"{"task":"t","colour":1}"#, "INVALID_REQUEST"),
            (r#"{"task":"t""#, "INVALID_JSON"),
        ] {
            assert_eq!(code(parse_submit_body(body.as_bytes())), want, "{body}");
        }
    }

    /// Numbers near the bounds, and anywhere in `u64`.
    fn number() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            0..=MAX_EXPIRES_IN_MS + 10,
            (MAX_DELAY_MS - 5)..=(MAX_DELAY_MS + 5),
            (u64::MAX - 5)..=u64::MAX,
            any::<u64>(),
        ]
    }

    /// A clock now, or anywhere in `u64`, or at its end.
    fn clock() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            Just(now_ms()),
            any::<u64>(),
            (u64::MAX - MAX_EXPIRES_IN_MS)..=u64::MAX,
        ]
    }

    proptest::proptest! {
        /// Whatever the clock and the numbers, an accepted submission
        /// neither runs nor expires before it was made, and expires after
        /// it may run; a refused one is refused with its field's code.
        #[test]
        fn accepted_numbers_never_run_or_expire_before_now(
            now in clock(),
            delay in proptest::option::of(number()),
            expires in proptest::option::of(number()),
        ) {
            let req = request(delay, expires);
            match check_numbers(&settings(), &req) {
                Ok(n) => {
                    proptest::prop_assert!(
                        matches!(n.start, Start::Delay(d) if d <= MAX_DELAY_MS)
                    );
                    proptest::prop_assert!(n.expires_in_ms.is_none_or(|e| e <= MAX_EXPIRES_IN_MS));
                    match schedule(now, n.start, n.expires_in_ms) {
                        Ok((run_at, expires_at)) => {
                            proptest::prop_assert!(run_at >= now);
                            if let Some(at) = expires_at {
                                proptest::prop_assert!(at > now && at > run_at);
                            }
                        }
                        // Only a clock within the bounds' reach of u64::MAX.
                        Err(e) => proptest::prop_assert!(
                            now > u64::MAX - MAX_EXPIRES_IN_MS,
                            "{e} at {now}"
                        ),
                    }
                }
                Err(e) => {
                    let c = code(Err::<(), _>(e));
                    proptest::prop_assert!(c == "INVALID_DELAY" || c == "INVALID_EXPIRY", "{c}");
                }
            }
        }

        /// Whatever the clock, the `run_at` and the expiry, an accepted
        /// `run_at` runs at the time asked for, or now if that is past,
        /// never more than the longest delay ahead, and expires after it
        /// runs; a refused one gets `INVALID_RUN_AT` or `INVALID_EXPIRY`.
        #[test]
        fn an_accepted_run_at_runs_when_asked_and_expires_after(
            now in clock(),
            ahead in number(),
            behind in proptest::prop_oneof![proptest::strategy::Just(false), proptest::strategy::Just(true)],
            expires in proptest::option::of(number()),
        ) {
            let at = if behind { now.saturating_sub(ahead) } else { now.saturating_add(ahead) };
            let mut req = request(None, expires);
            req.run_at = Some(at);
            let checked = check_numbers(&settings(), &req)
                .and_then(|n| schedule(now, n.start, n.expires_in_ms));
            match checked {
                Ok((run_at, expires_at)) => {
                    proptest::prop_assert_eq!(run_at, at.max(now));
                    proptest::prop_assert!(run_at - now <= MAX_DELAY_MS);
                    if let Some(e) = expires_at {
                        proptest::prop_assert!(e > run_at);
                    }
                }
                Err(e) => {
                    let c = code(Err::<(), _>(e));
                    proptest::prop_assert!(c == "INVALID_RUN_AT" || c == "INVALID_EXPIRY", "{c}");
                }
            }
        }
    }
}
