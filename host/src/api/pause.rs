//! `POST /v1/queues/{queue}/pause` and `POST /v1/queues/{queue}/resume`
//! (admin on the queue): a paused queue takes submissions, under the same
//! idempotency contract, but no worker of the fleet starts its tasks;
//! running ones finish. See `store::pause` for how the workers learn it.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, store_call};
use crate::base::now_ms;

/// `POST /v1/queues/{queue}/pause`.
#[utoipa::path(
    post,
    path = "/v1/queues/{queue}/pause",
    operation_id = "pause_queue",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "Paused (`changed`: it was running)", body = schemas::PauseState),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn pause(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    set(shared, queue, headers, true).await
}

/// `POST /v1/queues/{queue}/resume`.
#[utoipa::path(
    post,
    path = "/v1/queues/{queue}/resume",
    operation_id = "resume_queue",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "Running (`changed`: it was paused)", body = schemas::PauseState),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn resume(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    set(shared, queue, headers, false).await
}

/// Pause `queue` (or resume it), answering its state and whether it
/// changed.
async fn set(
    shared: Shared,
    queue: String,
    headers: HeaderMap,
    paused: bool,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    let changed = store_call(&shared, async move {
        if paused {
            store.pause(&q, now_ms()).await
        } else {
            store.resume(&q).await
        }
    })
    .await?;
    Ok(
        Json(serde_json::json!({"queue": queue, "paused": paused, "changed": changed}))
            .into_response(),
    )
}

/// The body of these routes, as a type that documents its fields. None is
/// ever built: it exists for its schema.
#[allow(dead_code)]
pub(super) mod schemas {
    use utoipa::ToSchema;

    /// A queue's pause state after a pause or a resume.
    #[derive(ToSchema)]
    pub(in crate::api) struct PauseState {
        queue: String,
        /// Whether the queue is paused now.
        paused: bool,
        /// Whether this request changed it.
        changed: bool,
    }
}
