//! The one error body of the API: `{"error": {"code", "message", "details"}}`.

use axum::Json;
use axum::http::StatusCode;
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"code": self.code, "message": self.message, "details": self.details}});
        (self.status, Json(body)).into_response()
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
