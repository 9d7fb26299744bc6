//! The submission path: validation, the payload fingerprint, and the one
//! script that does idempotency, backpressure and the enqueue.
//!
//! Everything a submitter can get wrong is checked here, before anything is
//! written, and reported as an [`IngestError`] with a stable code.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::store::{NewTask, Store, StoreError, SubmitOutcome, TaskRecord, TaskStatus};

/// Longest accepted idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;
/// Longest accepted queue or task name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Most attempts a submission may ask for.
pub const MAX_ATTEMPTS_LIMIT: u32 = 100;
/// Longest delay a submission may ask for: 30 days.
pub const MAX_DELAY_MS: u64 = 30 * 86_400_000;

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
        code: &'static str,
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

fn invalid(code: &'static str, message: impl Into<String>) -> IngestError {
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
    validate_name(queue).map_err(|why| invalid("INVALID_QUEUE_NAME", format!("queue name {why}")))
}

/// Check a task name, by the same rule as queue names.
pub fn validate_task_name(task: &str) -> Result<(), IngestError> {
    validate_name(task).map_err(|why| invalid("INVALID_TASK_NAME", format!("task name {why}")))
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
            "INVALID_IDEMPOTENCY_KEY",
            format!(
                "idempotency key must be 1 to {MAX_IDEMPOTENCY_KEY_BYTES} bytes, got {}",
                key.len()
            ),
        ));
    }
    if key.chars().any(char::is_control) {
        return Err(invalid(
            "INVALID_IDEMPOTENCY_KEY",
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
    req: SubmitRequest,
    has_handler: impl Fn(&str) -> bool,
) -> Result<Submitted, IngestError> {
    validate_queue_name(queue)?;
    validate_task_name(&req.task)?;
    let key = header_key.map(str::to_owned).or(req.idempotency_key);
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
    let max_attempts = req.max_attempts.unwrap_or(settings.default_max_attempts);
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return Err(invalid(
            "INVALID_MAX_ATTEMPTS",
            format!("max_attempts must be 1 to {MAX_ATTEMPTS_LIMIT}, got {max_attempts}"),
        ));
    }
    if let Some(t) = req.timeout_ms
        && (t == 0 || t > settings.max_timeout_ms)
    {
        return Err(invalid(
            "INVALID_TIMEOUT",
            format!(
                "timeout_ms must be 1 to {}, got {t}",
                settings.max_timeout_ms
            ),
        ));
    }
    let delay = req.delay_ms.unwrap_or(0);
    if delay > MAX_DELAY_MS {
        return Err(invalid(
            "INVALID_DELAY",
            format!("delay_ms must be at most {MAX_DELAY_MS}, got {delay}"),
        ));
    }
    if req.expires_in_ms == Some(0) {
        return Err(invalid(
            "INVALID_EXPIRY",
            "expires_in_ms must be at least 1",
        ));
    }
    if !has_handler(&req.task) {
        return Err(IngestError::UnknownTask(req.task));
    }

    let now = now_ms();
    let new = NewTask {
        id: uuid::Uuid::now_v7().to_string(),
        queue: queue.to_owned(),
        fingerprint: fingerprint(&req.task, &payload),
        task: req.task,
        payload,
        idempotency_key: key,
        max_attempts,
        timeout_ms: req.timeout_ms,
        now,
        run_at: now + delay,
        expires_at: req.expires_in_ms.map(|ms| now + ms),
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
}
