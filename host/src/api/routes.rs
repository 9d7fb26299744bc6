//! The route handlers.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::ApiState;
use super::auth::require_admin;
use super::error::ApiError;
use crate::ingest::{self, IngestError, SubmitRequest, now_ms, validate_queue_name};
use crate::store::CancelOutcome;

type ApiResult = Result<Response, ApiError>;

pub(super) async fn healthz(State(state): State<ApiState>) -> ApiResult {
    state.store.queues().await?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

pub(super) async fn submit(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "PAYLOAD_TOO_LARGE",
                "request body is too large",
            )
            .with_details(json!({"limit": state.ingest.max_payload_bytes}))
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", e.body_text())
        }
    })?;
    let req: SubmitRequest = serde_json::from_slice(&body).map_err(|e| {
        let code = if e.is_data() {
            "INVALID_REQUEST"
        } else {
            "INVALID_JSON"
        };
        ApiError::new(StatusCode::BAD_REQUEST, code, format!("request body: {e}"))
    })?;
    let header_key = match headers.get("idempotency-key") {
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::from(IngestError::Invalid {
                code: "INVALID_IDEMPOTENCY_KEY",
                message: "Idempotency-Key header is not visible ASCII".into(),
            })
        })?),
        None => None,
    };
    let has_handler = state.has_handler.clone();
    let done = ingest::submit(&state.store, &state.ingest, &queue, header_key, req, |t| {
        has_handler(t)
    })
    .await?;
    let mut body = match &done.record {
        Some(record) => record.to_json(),
        None => json!({"task_id": done.task_id, "queue": done.queue, "task": done.task}),
    };
    body["status"] = json!(done.status);
    body["duplicate"] = json!(done.duplicate);
    let status = if done.duplicate {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(body)).into_response())
}

fn checked_queue(queue: &str) -> Result<(), ApiError> {
    validate_queue_name(queue).map_err(ApiError::from)
}

fn task_not_found(queue: &str, id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "TASK_NOT_FOUND",
        format!("no task {id:?} in queue {queue:?}"),
    )
    .with_details(json!({"task_id": id, "queue": queue}))
}

pub(super) async fn get_task(
    State(state): State<ApiState>,
    Path((queue, id)): Path<(String, String)>,
) -> ApiResult {
    checked_queue(&queue)?;
    match state.store.task(&queue, &id).await? {
        Some(task) => Ok(Json(task.to_json()).into_response()),
        None => Err(task_not_found(&queue, &id)),
    }
}

pub(super) async fn cancel(
    State(state): State<ApiState>,
    Path((queue, id)): Path<(String, String)>,
) -> ApiResult {
    checked_queue(&queue)?;
    match state.store.cancel(&queue, &id, now_ms()).await? {
        CancelOutcome::Cancelled => {
            Ok(Json(json!({"task_id": id, "queue": queue, "status": "CANCELLED"})).into_response())
        }
        CancelOutcome::Requested => Ok((
            StatusCode::ACCEPTED,
            Json(json!({"task_id": id, "queue": queue, "status": "RUNNING", "cancel_requested": true})),
        )
            .into_response()),
        CancelOutcome::Terminal(status) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "TASK_TERMINAL",
            format!("task {id:?} is already {status}; nothing to cancel"),
        )
        .with_details(json!({"task_id": id, "status": status}))),
        CancelOutcome::NotFound => Err(task_not_found(&queue, &id)),
    }
}

pub(super) async fn list_queues(State(state): State<ApiState>) -> ApiResult {
    let mut queues = Vec::new();
    for q in state.store.queues().await? {
        queues.push(state.store.stats(&q).await?);
    }
    Ok(Json(json!({"queues": queues})).into_response())
}

pub(super) async fn queue_stats(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
) -> ApiResult {
    checked_queue(&queue)?;
    Ok(Json(state.store.stats(&queue).await?).into_response())
}

#[derive(Deserialize)]
pub(super) struct ListParams {
    limit: Option<usize>,
}

pub(super) async fn list_dlq(
    State(state): State<ApiState>,
    Path(queue): Path<String>,
    Query(params): Query<ListParams>,
) -> ApiResult {
    checked_queue(&queue)?;
    let limit = params.limit.unwrap_or(100).clamp(1, 1000);
    let tasks: Vec<Value> = state
        .store
        .dead_letters(&queue, limit)
        .await?
        .iter()
        .map(|t| t.to_json())
        .collect();
    Ok(Json(json!({"queue": queue, "tasks": tasks})).into_response())
}

pub(super) async fn requeue(
    State(state): State<ApiState>,
    Path((queue, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    require_admin(&headers, state.admin_token.as_deref())?;
    checked_queue(&queue)?;
    match state.store.requeue(&queue, &id, now_ms()).await? {
        Ok(()) => {
            Ok(Json(json!({"task_id": id, "queue": queue, "status": "QUEUED"})).into_response())
        }
        Err(None) => Err(task_not_found(&queue, &id)),
        Err(Some(status)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "NOT_DEAD_LETTERED",
            format!("task {id:?} is {status}, not dead-lettered"),
        )
        .with_details(json!({"task_id": id, "status": status}))),
    }
}

pub(super) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such route")
}

pub(super) async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        "method not allowed on this route",
    )
}
