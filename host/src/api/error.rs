//! The one error body of the API: `{"error": {"code", "message", "details"}}`.
//!
//! Every answer that is not a success has it: the routes' own errors, the
//! extractors' rejections (a path or query that does not parse), unknown
//! routes and methods, a handler that panicked. Only what hyper refuses
//! before a request reaches the router (a malformed request line, headers
//! over hyper's size limit) is answered by hyper itself, without a body.

use std::fmt;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::ingest::IngestError;
use crate::store::StoreError;

/// Defines [`ErrorCode`] from one table, so that a code's variant, text,
/// status and place in [`ErrorCode::ALL`] cannot drift apart.
macro_rules! error_codes {
    ($($(#[$doc:meta])* $variant:ident = $text:literal, $status:ident;)*) => {
        /// The stable codes of the error body's `code`, each with the one
        /// status it is answered with. Clients match on the text
        /// ([`ErrorCode::as_str`]): a code, once published, keeps its text.
        #[non_exhaustive]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &[ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The code's text in the error body, e.g. `QUEUE_FULL`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $text,)*
                }
            }

            /// The HTTP status the code is answered with.
            pub fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => StatusCode::$status,)*
                }
            }
        }
    };
}

error_codes! {
    /// The body is not JSON.
    InvalidJson = "INVALID_JSON", BAD_REQUEST;
    /// The body is JSON of the wrong shape (a missing or unknown field), or
    /// could not be read.
    InvalidRequest = "INVALID_REQUEST", BAD_REQUEST;
    /// A path segment does not decode or parse (e.g. `%FF`).
    InvalidPath = "INVALID_PATH", BAD_REQUEST;
    /// An unknown or malformed query parameter.
    InvalidQuery = "INVALID_QUERY", BAD_REQUEST;
    /// `?limit=` of a list route out of its bounds.
    InvalidLimit = "INVALID_LIMIT", BAD_REQUEST;
    /// `?status=` of the task listing that is not a task status.
    InvalidStatus = "INVALID_STATUS", BAD_REQUEST;
    /// `?cursor=` of the task listing that no page gave.
    InvalidCursor = "INVALID_CURSOR", BAD_REQUEST;
    /// A `Last-Event-ID` header or `?since=` of the events route that is
    /// not an event id.
    InvalidEventId = "INVALID_EVENT_ID", BAD_REQUEST;
    /// A queue name that is empty, too long or has a forbidden character.
    InvalidQueueName = "INVALID_QUEUE_NAME", BAD_REQUEST;
    /// A task name that is empty, too long or has a forbidden character.
    InvalidTaskName = "INVALID_TASK_NAME", BAD_REQUEST;
    /// A schedule name that is empty, too long or has a forbidden
    /// character.
    InvalidScheduleName = "INVALID_SCHEDULE_NAME", BAD_REQUEST;
    /// An idempotency key that is empty, too long or not visible text.
    InvalidIdempotencyKey = "INVALID_IDEMPOTENCY_KEY", BAD_REQUEST;
    /// `max_attempts` out of its bounds or not a whole number.
    InvalidMaxAttempts = "INVALID_MAX_ATTEMPTS", BAD_REQUEST;
    /// `timeout_ms` out of its bounds or not a whole number.
    InvalidTimeout = "INVALID_TIMEOUT", BAD_REQUEST;
    /// `delay_ms` out of its bounds, not a whole number, or overflowing the
    /// run time.
    InvalidDelay = "INVALID_DELAY", BAD_REQUEST;
    /// `expires_in_ms` out of its bounds, not over `delay_ms`, not a whole
    /// number, or overflowing the expiry time.
    InvalidExpiry = "INVALID_EXPIRY", BAD_REQUEST;
    /// `run_at` neither ms since the epoch nor an RFC 3339 time, more than
    /// 30 days ahead, or sent with `delay_ms`.
    InvalidRunAt = "INVALID_RUN_AT", BAD_REQUEST;
    /// A partition count of 0, over the maximum, or below the queue's
    /// present count.
    InvalidPartitions = "INVALID_PARTITIONS", UNPROCESSABLE_ENTITY;
    /// A batch submission with no items.
    EmptyBatch = "EMPTY_BATCH", BAD_REQUEST;
    /// No handler is deployed for the submitted task name (or, on a
    /// handler route, the task was never deployed).
    UnknownTask = "UNKNOWN_TASK", BAD_REQUEST;
    /// A bulk DLQ request naming more ids than one request takes
    /// (`details.max`).
    TooManyIds = "TOO_MANY_IDS", BAD_REQUEST;
    /// A deploy's setting is out of its range (`details.setting` names it).
    InvalidSettings = "INVALID_SETTINGS", BAD_REQUEST;
    /// No bearer token, or one that is not configured.
    Unauthorized = "UNAUTHORIZED", UNAUTHORIZED;
    /// The token lacks the route's scope, the queue, or (on a fleet route)
    /// the task, namespace, host or quota; `details.scope` names the scope.
    Forbidden = "FORBIDDEN", FORBIDDEN;
    /// An admin or fleet route while no token has the admin or the deploy
    /// scope.
    AdminDisabled = "ADMIN_DISABLED", FORBIDDEN;
    /// A deploy without a `Dtq-Signature` to a fleet that runs signed
    /// modules only (`--trusted-keys`).
    SignatureRequired = "SIGNATURE_REQUIRED", FORBIDDEN;
    /// A deploy whose signature is malformed, or by no trusted key over
    /// this task, module and settings.
    SignatureInvalid = "SIGNATURE_INVALID", FORBIDDEN;
    /// No such task in the queue.
    TaskNotFound = "TASK_NOT_FOUND", NOT_FOUND;
    /// No such route.
    NotFound = "NOT_FOUND", NOT_FOUND;
    /// A rollback to a digest that is not in the task's history.
    UnknownVersion = "UNKNOWN_VERSION", NOT_FOUND;
    /// No schedule of that name in the queue.
    UnknownSchedule = "UNKNOWN_SCHEDULE", NOT_FOUND;
    /// An idempotency key with no record in the queue: never used, or its
    /// record expired (`--idem-ttl-s`).
    UnknownKey = "UNKNOWN_KEY", NOT_FOUND;
    /// The route exists, not with this method.
    MethodNotAllowed = "METHOD_NOT_ALLOWED", METHOD_NOT_ALLOWED;
    /// The request body did not arrive within the body timeout.
    RequestTimeout = "REQUEST_TIMEOUT", REQUEST_TIMEOUT;
    /// The idempotency key's task is still in flight.
    IdempotencyInProgress = "IDEMPOTENCY_IN_PROGRESS", CONFLICT;
    /// Cancel of a task that already ended.
    TaskTerminal = "TASK_TERMINAL", CONFLICT;
    /// Requeue of a task that is not dead-lettered.
    NotDeadLettered = "NOT_DEAD_LETTERED", CONFLICT;
    /// A submission to a new queue while the fleet has as many queues as
    /// `--max-queues` allows (`details.max`).
    TooManyQueues = "TOO_MANY_QUEUES", CONFLICT;
    /// Requeue of a task whose idempotency key names another task now
    /// (`details.task_id`): the task stays dead-lettered.
    IdempotencyKeyTaken = "IDEMPOTENCY_KEY_TAKEN", CONFLICT;
    /// A rollback with no earlier version in the task's history.
    NoEarlierVersion = "NO_EARLIER_VERSION", CONFLICT;
    /// A deploy whose settings no live worker can honour (each worker's
    /// reason in `details`); `force=true` deploys it anyway.
    NoWorkerCanRun = "NO_WORKER_CAN_RUN", CONFLICT;
    /// Live events of a server that writes none (`--events none`).
    EventsOff = "EVENTS_OFF", CONFLICT;
    /// The body or the payload is over its size limit.
    PayloadTooLarge = "PAYLOAD_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A deployed module over `--max-module-mib`.
    ModuleTooLarge = "MODULE_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A batch submission with more items than a batch may hold.
    BatchTooLarge = "BATCH_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A submission not declared `Content-Type: application/json`.
    UnsupportedMediaType = "UNSUPPORTED_MEDIA_TYPE", UNSUPPORTED_MEDIA_TYPE;
    /// A deployed module that cannot run as a handler: not a component, not
    /// of the handler world, an import the host does not provide, or a
    /// namespace not granted. The message is the reason, in one line.
    InvalidModule = "INVALID_MODULE", UNPROCESSABLE_ENTITY;
    /// The idempotency key was used with another task or payload.
    IdempotencyKeyMismatch = "IDEMPOTENCY_KEY_MISMATCH", UNPROCESSABLE_ENTITY;
    /// A schedule's cron expression that does not parse (5 fields, or 6
    /// with seconds first), or that never fires.
    InvalidCron = "INVALID_CRON", UNPROCESSABLE_ENTITY;
    /// The queue is at its depth limit.
    QueueFull = "QUEUE_FULL", TOO_MANY_REQUESTS;
    /// A bug: a handler panicked or a route is miswired.
    InternalError = "INTERNAL_ERROR", INTERNAL_SERVER_ERROR;
    /// Redis failed or did not answer within the API's deadline.
    StoreUnavailable = "STORE_UNAVAILABLE", SERVICE_UNAVAILABLE;
    /// The server serves as many event streams as it may
    /// (`--api-max-event-streams`).
    TooManyEventStreams = "TOO_MANY_EVENT_STREAMS", SERVICE_UNAVAILABLE;
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error response: a stable code (which gives the status), a message
/// for a person, and details for a program.
#[derive(Debug)]
pub struct ApiError {
    /// Stable, documented code, e.g. `IDEMPOTENCY_IN_PROGRESS`.
    pub code: ErrorCode,
    /// What happened.
    pub message: String,
    /// Machine-readable context (e.g. the in-flight `task_id`).
    pub details: Value,
}

impl ApiError {
    /// An error without details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            details: json!({}),
        }
    }

    /// The same error with `details`.
    pub fn with_details(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    /// 503 `STORE_UNAVAILABLE`: Redis did not answer within the API's
    /// per-request deadline.
    pub(super) fn store_timeout(timeout: Duration) -> Self {
        let ms = timeout.as_millis() as u64;
        tracing::warn!(timeout_ms = ms, "store did not answer in time");
        ApiError::new(
            ErrorCode::StoreUnavailable,
            format!("storage did not answer within {ms} ms"),
        )
        .with_details(json!({"timeout_ms": ms}))
    }

    /// 500 `INTERNAL_ERROR`: a bug, never the client's doing.
    pub(super) fn internal(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InternalError, message)
    }

    /// The error body, `{"error": {"code", "message", "details"}}`.
    pub fn into_body(self) -> Value {
        json!({"error": {
            "code": self.code.as_str(),
            "message": self.message,
            "details": self.details,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.code.status();
        let body = self.into_body();
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<PathRejection> for ApiError {
    fn from(e: PathRejection) -> Self {
        if e.status().is_server_error() {
            // A route whose handler expects parameters its path lacks.
            return ApiError::internal(e.body_text());
        }
        ApiError::new(ErrorCode::InvalidPath, e.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        ApiError::new(ErrorCode::InvalidQuery, e.body_text())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        if let StoreError::TooManyQueues { max } = e {
            return ApiError::new(ErrorCode::TooManyQueues, e.to_string())
                .with_details(json!({"max": max}));
        }
        tracing::error!(error = %e, "store failed");
        ApiError::new(ErrorCode::StoreUnavailable, format!("storage failed: {e}"))
    }
}

impl From<IngestError> for ApiError {
    fn from(e: IngestError) -> Self {
        let message = e.to_string();
        match e {
            IngestError::Invalid { code, .. } => ApiError::new(code, message),
            IngestError::PayloadTooLarge { size, limit } => {
                ApiError::new(ErrorCode::PayloadTooLarge, message)
                    .with_details(json!({"size": size, "limit": limit}))
            }
            IngestError::UnknownTask(task) => {
                ApiError::new(ErrorCode::UnknownTask, message).with_details(json!({"task": task}))
            }
            IngestError::InProgress { task_id } => {
                ApiError::new(ErrorCode::IdempotencyInProgress, message)
                    .with_details(json!({"task_id": task_id}))
            }
            IngestError::KeyMismatch { task_id } => {
                ApiError::new(ErrorCode::IdempotencyKeyMismatch, message)
                    .with_details(json!({"task_id": task_id}))
            }
            IngestError::QueueFull { queue, depth } => ApiError::new(ErrorCode::QueueFull, message)
                .with_details(json!({"queue": queue, "depth": depth})),
            IngestError::Store(e) => e.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::ErrorCode;

    /// The README's "HTTP API" section, up to the next section.
    fn http_api_section() -> &'static str {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("\n## HTTP API\n")
            .expect("README.md has an `## HTTP API` section");
        let section = &readme[start + 1..];
        match section.find("\n## ") {
            Some(end) => &section[..end],
            None => section,
        }
    }

    #[test]
    fn codes_are_unique_and_screaming_snake_case() {
        let mut seen = HashSet::new();
        for &code in ErrorCode::ALL {
            let text = code.as_str();
            assert!(seen.insert(text), "{code:?}: {text} is used twice");
            let well_formed = !text.is_empty()
                && !text.starts_with('_')
                && !text.ends_with('_')
                && !text.contains("__")
                && text.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
            assert!(
                well_formed,
                "{code:?}: {text:?} is not SCREAMING_SNAKE_CASE"
            );
        }
    }

    #[test]
    fn the_readme_documents_every_code() {
        let section = http_api_section();
        let missing: Vec<&str> = ErrorCode::ALL
            .iter()
            .map(|code| code.as_str())
            .filter(|text| !section.contains(&format!("`{text}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "README.md's HTTP API section does not mention: {missing:?}"
        );
    }
}
