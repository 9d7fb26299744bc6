//! The one error body of the API: `{"error": {"code", "message", "details"}}`.
//!
//! Every answer that is not a success has it: the routes' own errors, the
//! extractors' rejections (a path or query that does not parse), unknown
//! routes and methods, a handler that panicked. Only what hyper refuses
//! before a request reaches the router (a malformed request line, headers
//! over hyper's size limit) is answered by hyper itself, without a body.

use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::ingest::IngestError;
use crate::store::StoreError;

/// An error response: a status, a stable code, a message for a person, and
/// details for a program.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable, documented code, e.g. `IDEMPOTENCY_IN_PROGRESS`.
    pub code: &'static str,
    /// What happened.
    pub message: String,
    /// Machine-readable context (e.g. the in-flight `task_id`).
    pub details: Value,
}

impl ApiError {
    /// An error without details.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
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
            StatusCode::SERVICE_UNAVAILABLE,
            "STORE_UNAVAILABLE",
            format!("storage did not answer within {ms} ms"),
        )
        .with_details(json!({"timeout_ms": ms}))
    }

    /// 500 `INTERNAL_ERROR`: a bug, never the client's doing.
    pub(super) fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"code": self.code, "message": self.message, "details": self.details}});
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
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
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_PATH", e.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_QUERY", e.body_text())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "store failed");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "STORE_UNAVAILABLE",
            format!("storage failed: {e}"),
        )
    }
}

impl From<IngestError> for ApiError {
    fn from(e: IngestError) -> Self {
        let message = e.to_string();
        match e {
            IngestError::Invalid { code, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, code, message)
            }
            IngestError::PayloadTooLarge { size, limit } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE", message)
                    .with_details(json!({"size": size, "limit": limit}))
            }
            IngestError::UnknownTask(task) => {
                ApiError::new(StatusCode::BAD_REQUEST, "UNKNOWN_TASK", message)
                    .with_details(json!({"task": task}))
            }
            IngestError::InProgress { task_id } => {
                ApiError::new(StatusCode::CONFLICT, "IDEMPOTENCY_IN_PROGRESS", message)
                    .with_details(json!({"task_id": task_id}))
            }
            IngestError::KeyMismatch { task_id } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "IDEMPOTENCY_KEY_MISMATCH",
                message,
            )
            .with_details(json!({"task_id": task_id})),
            IngestError::QueueFull { queue, depth } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "QUEUE_FULL", message)
                    .with_details(json!({"queue": queue, "depth": depth}))
            }
            IngestError::Store(e) => e.into(),
        }
    }
}
