//! The route handlers.
//!
//! Each one checks the request's token first ([`Auth::authorize`]), then
//! its input, then calls the store under the API's Redis deadline
//! ([`store_call`]).

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::LengthLimitError;
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::{Auth, Scope};
use super::error::{ApiError, ErrorCode};
use super::extract::{ApiPath, ApiQuery};
use super::{DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, Shared};
use crate::ingest::{self, IngestError, now_ms, validate_queue_name};
use crate::store::{CancelOutcome, RequeueOutcome};

type ApiResult = Result<Response, ApiError>;

/// Run a store call under the API's Redis deadline: past it the request is
/// answered 503 `STORE_UNAVAILABLE` instead of waiting out the store's own
/// reconnect and response timeouts (seconds) while Redis is down.
///
/// The call runs in a task of its own and is left to finish, not dropped,
/// at the deadline: a store call cut between two awaits could leave the
/// store's per-process state half-updated, and the store's own timeouts
/// still bound it.
pub(super) async fn store_call<T, E>(
    shared: &Shared,
    call: impl Future<Output = Result<T, E>> + Send + 'static,
) -> Result<T, ApiError>
where
    T: Send + 'static,
    E: Send + 'static,
    ApiError: From<E>,
{
    let timeout = shared.limits.redis_timeout;
    match tokio::time::timeout(timeout, tokio::spawn(call)).await {
        Ok(Ok(result)) => result.map_err(ApiError::from),
        Ok(Err(e)) => Err(ApiError::internal(format!("the store call failed: {e}"))),
        Err(_) => Err(ApiError::store_timeout(timeout)),
    }
}

pub(super) async fn healthz(State(shared): State<Shared>) -> ApiResult {
    let store = shared.state.store.clone();
    store_call(&shared, async move { store.queues().await }).await?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

/// 415 unless the body is declared `application/json` (parameters such as
/// `charset=utf-8` allowed). A browser sends a cross-site POST without a
/// preflight only as `text/plain`, a form or multipart, so this keeps a web
/// page from submitting tasks with its visitors' network access.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let essence = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim());
    if essence.is_some_and(|e| e.eq_ignore_ascii_case("application/json")) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::UnsupportedMediaType,
        "a submission's body must be sent with `Content-Type: application/json`",
    ))
}

/// Read a submission's whole body within the body timeout and the body
/// limit.
async fn read_body(shared: &Shared, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(ErrorCode::PayloadTooLarge, "request body is too large")
            .with_details(json!({"limit": shared.state.ingest.max_payload_bytes}))
    };
    read_limited(shared, headers, body, shared.body_limit, too_large).await
}

/// Read a whole body within the body timeout and `limit` bytes; over the
/// limit (declared, which is refused before a byte is read, or counted) it
/// is `too_large()`.
pub(super) async fn read_limited(
    shared: &Shared,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    too_large: impl Fn() -> ApiError,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let timeout = shared.limits.body_timeout;
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.downcast_ref::<LengthLimitError>().is_some() {
                Err(too_large())
            } else {
                Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("cannot read the request body: {e}"),
                ))
            }
        }
        Err(_) => Err(body_timeout(timeout)),
    }
}

fn body_timeout(timeout: Duration) -> ApiError {
    let ms = timeout.as_millis() as u64;
    ApiError::new(
        ErrorCode::RequestTimeout,
        format!("the request body did not arrive within {ms} ms"),
    )
    .with_details(json!({"timeout_ms": ms}))
}

pub(super) async fn submit(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    shared
        .auth
        .authorize(&headers, Scope::Submit, Some(&queue))?;
    require_json(&headers)?;
    let body = read_body(&shared, &headers, body).await?;
    let req = ingest::parse_submit_body(&body)?;
    let header_key = match headers.get("idempotency-key") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| {
                    ApiError::from(IngestError::Invalid {
                        code: ErrorCode::InvalidIdempotencyKey,
                        message: "Idempotency-Key header is not visible ASCII".into(),
                    })
                })?
                .to_owned(),
        ),
        None => None,
    };
    let mut req = req;
    let state = shared.state.clone();
    let done = store_call(&shared, async move {
        let known = if (state.has_handler)(&req.task) {
            if req.max_attempts.is_none() {
                // The operator's default for the task, set at deploy.
                req.max_attempts = state.catalog.max_attempts(&req.task);
            }
            true
        } else {
            // A task this process does not know yet may have been deployed
            // a moment ago (through another API): the registry decides.
            match state.deploy.registry.active_entry(&req.task).await? {
                Some(entry) => {
                    let settings = entry.version.map(|v| v.settings).unwrap_or_default();
                    req.max_attempts = req.max_attempts.or(settings.max_attempts);
                    true
                }
                None => false,
            }
        };
        ingest::submit(
            &state.store,
            &state.ingest,
            &queue,
            header_key.as_deref(),
            req,
            |_| known,
        )
        .await
        .map_err(ApiError::from)
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
        ErrorCode::TaskNotFound,
        format!("no task {id:?} in queue {queue:?}"),
    )
    .with_details(json!({"task_id": id, "queue": queue}))
}

/// Authorize `scope` on `queue` and check the queue's name.
pub(super) fn authorized(
    auth: &Auth,
    headers: &HeaderMap,
    scope: Scope,
    queue: &str,
) -> Result<(), ApiError> {
    auth.authorize(headers, scope, Some(queue))?;
    checked_queue(queue)
}

pub(super) async fn get_task(
    State(shared): State<Shared>,
    ApiPath((queue, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let (store, q, i) = (shared.state.store.clone(), queue.clone(), id.clone());
    match store_call(&shared, async move { store.task(&q, &i).await }).await? {
        Some(task) => Ok(Json(task.to_json()).into_response()),
        None => Err(task_not_found(&queue, &id)),
    }
}

pub(super) async fn cancel(
    State(shared): State<Shared>,
    ApiPath((queue, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Cancel, &queue)?;
    let (store, q, i) = (shared.state.store.clone(), queue.clone(), id.clone());
    let outcome = store_call(&shared, async move { store.cancel(&q, &i, now_ms()).await }).await?;
    match outcome {
        CancelOutcome::Cancelled => {
            Ok(Json(json!({"task_id": id, "queue": queue, "status": "CANCELLED"})).into_response())
        }
        CancelOutcome::Requested => Ok((
            StatusCode::ACCEPTED,
            Json(json!({"task_id": id, "queue": queue, "status": "RUNNING", "cancel_requested": true})),
        )
            .into_response()),
        CancelOutcome::Terminal(status) => Err(ApiError::new(
            ErrorCode::TaskTerminal,
            format!("task {id:?} is already {status}; nothing to cancel"),
        )
        .with_details(json!({"task_id": id, "status": status}))),
        CancelOutcome::NotFound => Err(task_not_found(&queue, &id)),
    }
}

pub(super) async fn list_queues(State(shared): State<Shared>, headers: HeaderMap) -> ApiResult {
    let access = shared.auth.authorize(&headers, Scope::Read, None)?;
    let store = shared.state.store.clone();
    let queues = store_call(&shared, async move {
        let mut queues = Vec::new();
        for q in store.queues().await? {
            if access.allows(&q) {
                queues.push(store.stats(&q).await?);
            }
        }
        Ok::<_, crate::store::StoreError>(queues)
    })
    .await?;
    Ok(Json(json!({"queues": queues})).into_response())
}

pub(super) async fn queue_stats(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let store = shared.state.store.clone();
    let stats = store_call(&shared, async move { store.stats(&queue).await }).await?;
    Ok(Json(stats).into_response())
}

/// The query of list routes. Unknown parameters are refused (400
/// `INVALID_QUERY`), as unknown body fields are.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListParams {
    /// Taken as text so that every bad value gets `INVALID_LIMIT`.
    limit: Option<String>,
}

impl ListParams {
    /// `limit`, see [`list_limit`].
    fn limit(&self) -> Result<usize, ApiError> {
        list_limit(self.limit.as_deref())
    }
}

/// A list route's `?limit=`, 1 to [`MAX_LIST_LIMIT`] ([`DEFAULT_LIST_LIMIT`]
/// if absent); 400 `INVALID_LIMIT` otherwise.
pub(super) fn list_limit(text: Option<&str>) -> Result<usize, ApiError> {
    let Some(text) = text else {
        return Ok(DEFAULT_LIST_LIMIT);
    };
    match text.parse::<usize>() {
        Ok(n) if (1..=MAX_LIST_LIMIT).contains(&n) => Ok(n),
        _ => Err(ApiError::new(
            ErrorCode::InvalidLimit,
            format!("limit must be a whole number from 1 to {MAX_LIST_LIMIT}"),
        )
        .with_details(json!({"max": MAX_LIST_LIMIT}))),
    }
}

pub(super) async fn list_dlq(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    ApiQuery(params): ApiQuery<ListParams>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let limit = params.limit()?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    let tasks: Vec<Value> = store_call(&shared, async move { store.dead_letters(&q, limit).await })
        .await?
        .iter()
        .map(|t| t.to_json())
        .collect();
    Ok(Json(json!({"queue": queue, "tasks": tasks})).into_response())
}

pub(super) async fn requeue(
    State(shared): State<Shared>,
    ApiPath((queue, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let (store, q, i) = (shared.state.store.clone(), queue.clone(), id.clone());
    match store_call(
        &shared,
        async move { store.requeue(&q, &i, now_ms()).await },
    )
    .await?
    {
        RequeueOutcome::Requeued => {
            Ok(Json(json!({"task_id": id, "queue": queue, "status": "QUEUED"})).into_response())
        }
        RequeueOutcome::NotFound => Err(task_not_found(&queue, &id)),
        RequeueOutcome::NotDeadLettered(status) => Err(ApiError::new(
            ErrorCode::NotDeadLettered,
            format!("task {id:?} is {status}, not dead-lettered"),
        )
        .with_details(json!({"task_id": id, "status": status}))),
    }
}

pub(super) async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such route")
}

pub(super) async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "method not allowed on this route",
    )
}

/// A handler that panicked: 500 in the one error body, and the panic in
/// the log.
pub(super) fn panicked(panic: Box<dyn Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(not a string)");
    tracing::error!(panic = what, "an API handler panicked");
    ApiError::internal("the server failed while handling this request").into_response()
}
