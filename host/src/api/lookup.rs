//! `GET /v1/queues/{queue}/idempotency/{key}`: the task an idempotency
//! key was submitted as, `{"queue", "key", "task_id", "state",
//! "updated_at"}`, for a client (the dashboard's search box) that kept its
//! key and not the task id.
//!
//! The key is one path segment, percent-encoded as needed (a `/` in a key
//! is `%2F`). 400 `INVALID_IDEMPOTENCY_KEY` for a key no submission could
//! have used; 404 `UNKNOWN_KEY` when the queue has no record of it (never
//! used, or expired after `--idem-ttl-s`). A record may outlive its task
//! (a terminal task's hash expires with the task retention): `GET
//! .../tasks/{task_id}` then answers 404 `TASK_NOT_FOUND`.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::routes::{authorized, store_call};
use crate::base::ErrorCode;
use crate::ingest::validate_idempotency_key;

/// The task an idempotency key names.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct KeyLookup {
    /// The queue.
    queue: String,
    /// The key, as given.
    key: String,
    /// The task the key was submitted as.
    task_id: String,
    /// `processing` (in flight: waiting, running or retrying), `completed`
    /// (SUCCEEDED) or `failed` (FAILED, DEAD_LETTERED, CANCELLED, EXPIRED).
    state: String,
    /// When the record last changed, ms since the Unix epoch.
    updated_at: Option<u64>,
}

/// `GET /v1/queues/{queue}/idempotency/{key}`.
#[utoipa::path(
    get,
    path = "/v1/queues/{queue}/idempotency/{key}",
    tag = "tasks",
    params(
        ("queue" = String, Path, min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]{1,64}$", description = "The queue: 1 to 64 letters, digits, `_`, `.` or `-`."),
        ("key" = String, Path, min_length = 1, max_length = 255, pattern = r"^[^\u0000-\u001F\u007F-\u009F]+$", description = "The idempotency key, percent-encoded as a path segment: 1 to 255 bytes, no control characters."),
    ),
    responses(
        (status = 200, description = "The key's task and the state of its submission", body = KeyLookup),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`, `INVALID_IDEMPOTENCY_KEY`", body = ErrorBody),
        (status = 404, description = "`UNKNOWN_KEY`: never used in this queue, or its record expired", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn by_key(
    State(shared): State<Shared>,
    ApiPath((queue, key)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    validate_idempotency_key(&key)?;
    let (store, q, k) = (shared.state.store.clone(), queue.clone(), key.clone());
    let Some(record) = store_call(
        &shared,
        async move { store.idempotency_record(&q, &k).await },
    )
    .await?
    else {
        return Err(ApiError::new(
            ErrorCode::UnknownKey,
            format!("no idempotency record of this key in queue {queue:?}"),
        )
        .with_details(json!({"queue": queue, "key": key})));
    };
    Ok(Json(KeyLookup {
        queue,
        key,
        task_id: record.task_id,
        state: record.state,
        updated_at: record.updated_at,
    })
    .into_response())
}
