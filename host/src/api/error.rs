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

pub use crate::base::ErrorCode;
use crate::ingest::IngestError;
use crate::store::StoreError;

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
        let code = e.code();
        let message = e.to_string();
        let details = match e {
            IngestError::Store(e) => return e.into(),
            IngestError::Invalid { .. } => return ApiError::new(code, message),
            IngestError::BatchTooLarge { items, limit } => json!({"items": items, "limit": limit}),
            IngestError::PayloadTooLarge { size, limit } => json!({"size": size, "limit": limit}),
            IngestError::UnknownTask(task) => json!({"task": task}),
            IngestError::InProgress { task_id } | IngestError::KeyMismatch { task_id } => {
                json!({"task_id": task_id})
            }
            IngestError::QueueFull { queue, depth } => json!({"queue": queue, "depth": depth}),
        };
        ApiError::new(code, message).with_details(details)
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
