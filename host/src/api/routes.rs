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
use utoipa::IntoParams;

use super::auth::{Auth, Scope};
use super::error::ApiError;
use super::extract::{ApiPath, ApiQuery};
use super::openapi::ErrorBody;
use super::openapi::schemas::{
    Cancelled, DeadLetters, Health, QueueList, QueuePath, QueueStats, Requeued, Submitted, Task,
    TaskPath,
};
use super::{ApiState, DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, Shared};
use crate::base::ErrorCode;
use crate::base::now_ms;
use crate::ingest::{self, Deployed, Handlers, KeyHeader, Submitter, validate_queue_name};
use crate::store::{CancelOutcome, RequeueOutcome, StoreError};
use crate::telemetry;
use tracing::Instrument as _;

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

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "service",
    responses((status = 200, description = "Redis is reachable", body = Health)),
    security(()),
)]
pub(super) async fn healthz(State(shared): State<Shared>) -> ApiResult {
    let store = shared.state.store.clone();
    store_call(&shared, async move { store.queues().await }).await?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

/// 415 unless the body is declared `application/json` (parameters such as
/// `charset=utf-8` allowed). A browser sends a cross-site POST without a
/// preflight only as `text/plain`, a form or multipart, so this keeps a web
/// page from submitting tasks with its visitors' network access.
pub(super) fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
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

/// A small JSON body of an admin route, read whole as [`read_limited`]
/// does within `limit` bytes: 415 unless declared JSON, 413 past the
/// limit, 400 `INVALID_JSON` when it is not JSON, 400 `INVALID_REQUEST`
/// when it is not an object that is a `T`.
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    shared: &Shared,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<T, ApiError> {
    require_json(headers)?;
    let too_large = || {
        ApiError::new(ErrorCode::PayloadTooLarge, "request body is too large")
            .with_details(json!({"limit": limit}))
    };
    let bytes = read_limited(shared, headers, body, limit, too_large).await?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    // serde would read a struct from an array of its fields, in order.
    if !value.is_object() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "request body must be a JSON object",
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("request body: {e}")))
}

fn body_timeout(timeout: Duration) -> ApiError {
    let ms = timeout.as_millis() as u64;
    ApiError::new(
        ErrorCode::RequestTimeout,
        format!("the request body did not arrive within {ms} ms"),
    )
    .with_details(json!({"timeout_ms": ms}))
}

#[utoipa::path(
    post,
    path = "/v1/queues/{queue}/tasks",
    tag = "tasks",
    params(
        QueuePath,
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[!-~]([ -~]*[!-~])?$", description = "The idempotency key, visible ASCII (spaces inside); wins over the body's `idempotency_key`"),
    ),
    request_body = super::openapi::schemas::SubmitRequest,
    responses(
        (status = 202, description = "A new task", body = Submitted),
        (status = 200, description = "A replay of a terminal key: the stored task, `duplicate: true`", body = Submitted),
        (status = 400, description = "`INVALID_JSON`, `INVALID_REQUEST`, `UNKNOWN_TASK`, `INVALID_QUEUE_NAME`, `INVALID_TASK_NAME`, `INVALID_IDEMPOTENCY_KEY`, `INVALID_MAX_ATTEMPTS`, `INVALID_TIMEOUT`, `INVALID_DELAY`, `INVALID_EXPIRY`, `INVALID_RUN_AT`", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 409, description = "`IDEMPOTENCY_IN_PROGRESS`: the key's task is in flight (its `task_id` in `details`)", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: not sent as `application/json`", body = ErrorBody),
        (status = 422, description = "`IDEMPOTENCY_KEY_MISMATCH`: the key was used with another task or payload", body = ErrorBody),
        (status = 429, description = "`QUEUE_FULL`", body = ErrorBody),
    ),
    security(("bearer" = ["submit"])),
)]
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
    let key_header = match headers.get("idempotency-key") {
        None => KeyHeader::Absent,
        Some(v) => v
            .to_str()
            .map_or(KeyHeader::NotText, |key| KeyHeader::Key(key.to_owned())),
    };
    let (span, trace) = telemetry::submission(SUBMIT_SPAN, &queue, &headers);
    let state = shared.state.clone();
    let submit = async move {
        let submitter = submitter(&state, trace.as_deref());
        submitter.submit(&queue, key_header, &body).await
    };
    let done = store_call(&shared, submit.instrument(span)).await?;
    Ok(submitted(done).into_response())
}

/// The answer to a submission that went through: 202 and the new task, or
/// 200 and the replayed task's record.
pub(super) fn submitted(done: ingest::Submitted) -> (StatusCode, Json<Value>) {
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
    (status, Json(body))
}

/// The name of a submission's span (see [`telemetry::submission`]).
const SUBMIT_SPAN: &str = "POST /v1/queues/{queue}/tasks";

/// The submission path on the API's store, limits and handlers, its tasks
/// carrying `trace` (see [`Submitter::trace`]).
pub(super) fn submitter<'a>(
    state: &'a ApiState,
    trace: Option<&'a str>,
) -> Submitter<'a, ApiState> {
    Submitter {
        store: &state.store,
        settings: &state.ingest,
        handlers: state,
        trace,
    }
}

/// The handlers this process loaded, and the registry for the others: a
/// task this process does not know yet may have been deployed a moment
/// ago (through another API).
impl Handlers for ApiState {
    type Error = ApiError;

    async fn deployed(&self, task: &str) -> Result<Option<Deployed>, ApiError> {
        if (self.has_handler)(task) {
            return Ok(Some(Deployed {
                max_attempts: self.catalog.max_attempts(task),
            }));
        }
        let entry = self.deploy.registry.active_entry(task).await?;
        Ok(entry.map(|e| Deployed {
            max_attempts: e
                .version
                .map(|v| v.settings)
                .unwrap_or_default()
                .max_attempts,
        }))
    }
}

pub(super) fn checked_queue(queue: &str) -> Result<(), ApiError> {
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

#[utoipa::path(
    get,
    path = "/v1/queues/{queue}/tasks/{id}",
    tag = "tasks",
    params(TaskPath),
    responses(
        (status = 200, description = "The task", body = Task),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
        (status = 404, description = "`TASK_NOT_FOUND`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn get_task(
    State(shared): State<Shared>,
    ApiPath((queue, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let (store, q, i) = (shared.state.store.clone(), queue.clone(), id.clone());
    // The task and its children read at once: one wait for Redis, not two
    // (a task without a flow has none; its flow's read finds no key).
    let read = async move {
        let (task, children) =
            futures::future::try_join(store.task(&q, &i), store.children(&q, &i)).await?;
        Ok::<_, StoreError>(task.map(|task| (task, children)))
    };
    match store_call(&shared, read).await? {
        Some((task, children)) => {
            let mut json = task.to_json();
            json["children"] = children
                .iter()
                .map(|c| {
                    json!({"task_id": c.task_id, "queue": c.queue, "task": c.task,
                        "status": c.status, "error": c.error})
                })
                .collect();
            Ok(Json(json).into_response())
        }
        None => Err(task_not_found(&queue, &id)),
    }
}

#[utoipa::path(
    post,
    path = "/v1/queues/{queue}/tasks/{id}/cancel",
    tag = "tasks",
    params(TaskPath),
    responses(
        (status = 200, description = "Cancelled: it was waiting", body = Cancelled),
        (status = 202, description = "Running: its worker was asked to interrupt it", body = Cancelled),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
        (status = 404, description = "`TASK_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`TASK_TERMINAL`: it already ended", body = ErrorBody),
    ),
    security(("bearer" = ["cancel"])),
)]
pub(super) async fn cancel(
    State(shared): State<Shared>,
    ApiPath((queue, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Cancel, &queue)?;
    let (store, q, i) = (shared.state.store.clone(), queue.clone(), id.clone());
    // A cancelled parent (flows) takes its children that have not ended
    // with it, and theirs.
    let cancel = async move {
        let outcome = store.cancel(&q, &i, now_ms()).await?;
        let children = match outcome {
            CancelOutcome::Cancelled | CancelOutcome::Requested => {
                store.cancel_children(&q, &i).await?.ids
            }
            CancelOutcome::Terminal(_) | CancelOutcome::NotFound => Vec::new(),
        };
        Ok::<_, StoreError>((outcome, children))
    };
    let (outcome, children) = store_call(&shared, cancel).await?;
    match outcome {
        CancelOutcome::Cancelled => Ok(Json(json!({"task_id": id, "queue": queue,
            "status": "CANCELLED", "cancelled_children": children}))
        .into_response()),
        CancelOutcome::Requested => Ok((
            StatusCode::ACCEPTED,
            Json(json!({"task_id": id, "queue": queue, "status": "RUNNING",
                "cancel_requested": true, "cancelled_children": children})),
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

#[utoipa::path(
    get,
    path = "/v1/queues",
    tag = "queues",
    responses((status = 200, description = "Every queue's counts (those the token may read)", body = QueueList)),
    security(("bearer" = ["read"])),
)]
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

#[utoipa::path(
    get,
    path = "/v1/queues/{queue}",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "The queue's counts", body = QueueStats),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
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
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct ListParams {
    /// Tasks in the page, 1 to 1000; default 100. (Taken as text so that
    /// every bad value gets `INVALID_LIMIT`.)
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
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

#[utoipa::path(
    get,
    path = "/v1/queues/{queue}/dlq",
    tag = "queues",
    params(QueuePath, ListParams),
    responses(
        (status = 200, description = "Dead-lettered tasks", body = DeadLetters),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_LIMIT`, `INVALID_QUERY`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
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

#[utoipa::path(
    post,
    path = "/v1/queues/{queue}/dlq/{id}/requeue",
    tag = "queues",
    params(TaskPath),
    responses(
        (status = 200, description = "Requeued", body = Requeued),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
        (status = 404, description = "`TASK_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`NOT_DEAD_LETTERED`; `IDEMPOTENCY_KEY_TAKEN`: its key names another task now (its `task_id` in `details`)", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
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
        RequeueOutcome::KeyTaken { task_id } => Err(ApiError::new(
            ErrorCode::IdempotencyKeyTaken,
            format!(
                "task {id:?} stays dead-lettered: its idempotency key names task {task_id:?} now"
            ),
        )
        .with_details(json!({"task_id": task_id, "requeued_id": id}))),
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
