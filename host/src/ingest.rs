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
//!
//! A field that is not a whole number (negative, fractional, a string, past
//! `u64`) gets its field's code too. The run and expiry times are sums of
//! the submission time and these numbers, each addition checked
//! ([`schedule`]): no accepted submission runs or expires before it was made.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::api::error::ErrorCode;
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

/// The body of `POST /v1/queues/{queue}/tasks`. Unknown fields are rejected,
/// so a misspelt option (`max_attempt`) is an error instead of being ignored.
#[derive(Debug, Clone, Deserialize)]
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
/// Not JSON: `INVALID_JSON`. A numeric field that is not a whole number
/// from 0 to `u64::MAX` (`u32::MAX` for `max_attempts`): that field's code
/// (see the module's bounds), where a typed parse would only say
/// `INVALID_REQUEST`. Any other mismatch (no `task`, an unknown field):
/// `INVALID_REQUEST`.
pub fn parse_submit_body(body: &[u8]) -> Result<SubmitRequest, IngestError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| invalid(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    if let Value::Object(fields) = &value {
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
    delay_ms: u64,
    expires_in_ms: Option<u64>,
}

/// Check every number of `req` against its bound (see the module's table).
fn check_numbers(settings: &IngestSettings, req: &SubmitRequest) -> Result<Numbers, IngestError> {
    let max_attempts = req.max_attempts.unwrap_or(settings.default_max_attempts);
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return Err(invalid(
            ErrorCode::InvalidMaxAttempts,
            format!("max_attempts must be 1 to {MAX_ATTEMPTS_LIMIT}, got {max_attempts}"),
        ));
    }
    if let Some(t) = req.timeout_ms
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
    Ok(Numbers {
        max_attempts,
        timeout_ms: req.timeout_ms,
        delay_ms,
        expires_in_ms: req.expires_in_ms,
    })
}

/// When a task submitted at `now` may run, and when it expires: `now` plus
/// the delay, and plus the expiry. Each addition is checked; one that
/// overflows is refused with the field's code instead of wrapping around
/// to a time before `now`.
pub fn schedule(
    now: u64,
    delay_ms: u64,
    expires_in_ms: Option<u64>,
) -> Result<(u64, Option<u64>), IngestError> {
    let run_at = now.checked_add(delay_ms).ok_or_else(|| {
        invalid(
            ErrorCode::InvalidDelay,
            format!("delay_ms {delay_ms} overflows"),
        )
    })?;
    let expires_at = match expires_in_ms {
        None => None,
        Some(ms) => Some(now.checked_add(ms).ok_or_else(|| {
            invalid(
                ErrorCode::InvalidExpiry,
                format!("expires_in_ms {ms} overflows"),
            )
        })?),
    };
    Ok((run_at, expires_at))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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
    mut req: SubmitRequest,
    has_handler: impl Fn(&str) -> bool,
) -> Result<Submitted, IngestError> {
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
    let (run_at, expires_at) = schedule(now, numbers.delay_ms, numbers.expires_in_ms)?;
    let new = NewTask {
        id: uuid::Uuid::now_v7().to_string(),
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
    };
    match store.submit(&new, settings.max_queue_depth).await? {
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
        assert_eq!(code(schedule(1, 0, Some(u64::MAX))), "INVALID_EXPIRY");
        assert_eq!(code(schedule(u64::MAX, 1, None)), "INVALID_DELAY");
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
                    proptest::prop_assert!(n.delay_ms <= MAX_DELAY_MS);
                    proptest::prop_assert!(n.expires_in_ms.is_none_or(|e| e <= MAX_EXPIRES_IN_MS));
                    match schedule(now, n.delay_ms, n.expires_in_ms) {
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
    }
}
