//! The routes of periodic tasks: set, list and delete a queue's schedules.
//!
//! A schedule submits one task per tick of its cron expression (UTC),
//! fired by the workers consuming the queue (see `worker/schedule.rs`).
//! Setting or deleting one needs the `admin` scope on the queue and a
//! grant that covers the schedule's task (`Auth::authorize_schedule`): a
//! schedule submits its task unattended, on and on, so a queue's admin
//! schedules only the tasks it was granted. Listing needs `read`.
//!
//! `PUT` checks everything before it writes: the name, the expression
//! (422 `INVALID_CRON`, also for one that never fires), and the task as a
//! submission of it would be checked (its name, payload size, attempts,
//! timeout, and a deployed handler: `UNKNOWN_TASK`); a refused request
//! writes nothing.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, read_limited, require_json, store_call};
use crate::base::ErrorCode;
use crate::base::now_ms;
use crate::ingest::{self, IngestError, validate_task_name};
use crate::store::{CronExpr, InvalidCron, Schedule, ScheduleDef, validate_schedule_name};

type ApiResult = Result<Response, ApiError>;

/// The body of `PUT /v1/queues/{queue}/schedules/{name}`. Unknown fields
/// are refused, as in a submission.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    cron: String,
    task: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

fn checked_name(name: &str) -> Result<(), ApiError> {
    validate_schedule_name(name).map_err(|message| {
        ApiError::new(ErrorCode::InvalidScheduleName, message).with_details(json!({"name": name}))
    })
}

fn invalid_cron(e: InvalidCron) -> ApiError {
    let message = e.to_string();
    ApiError::new(ErrorCode::InvalidCron, message).with_details(json!({"cron": e.expr}))
}

fn invalid(code: ErrorCode, message: String) -> ApiError {
    ApiError::from(IngestError::Invalid { code, message })
}

/// Parse and check a `PUT` body: the submission's own parser first, so a
/// bad number gets the code it gets there (`INVALID_MAX_ATTEMPTS`, ...),
/// then the schedule's shape (unknown fields: `INVALID_REQUEST`).
fn parse_body(bytes: &[u8]) -> Result<PutBody, ApiError> {
    let mut value: Value = serde_json::from_slice(bytes)
        .map_err(|e| invalid(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    let original = value.clone();
    if let Value::Object(fields) = &mut value {
        fields.remove("cron");
    }
    ingest::parse_submit_body(value.to_string().as_bytes())?;
    serde_json::from_value(original)
        .map_err(|e| invalid(ErrorCode::InvalidRequest, format!("request body: {e}")))
}

/// The bounds a submission of the schedule's task is held to (see
/// `ingest`'s table), checked when it is set rather than at each tick.
fn check_task(shared: &Shared, body: &PutBody) -> Result<(), ApiError> {
    validate_task_name(&body.task)?;
    let settings = &shared.state.ingest;
    let size = body.payload.to_string().len();
    if size > settings.max_payload_bytes {
        return Err(IngestError::PayloadTooLarge {
            size,
            limit: settings.max_payload_bytes,
        }
        .into());
    }
    let max_attempts = body.max_attempts.unwrap_or(settings.default_max_attempts);
    ingest::check_run_settings(settings, max_attempts, body.timeout_ms)?;
    Ok(())
}

/// `PUT /v1/queues/{queue}/schedules/{name}`: create or replace a schedule.
#[utoipa::path(
    put,
    path = "/v1/queues/{queue}/schedules/{name}",
    tag = "queues",
    params(SchedulePath),
    request_body = schemas::ScheduleRequest,
    responses(
        (status = 201, description = "Created", body = schemas::ScheduleView),
        (status = 200, description = "Replaced; its next tick recomputed", body = schemas::ScheduleView),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_SCHEDULE_NAME`, `INVALID_TASK_NAME`, `INVALID_MAX_ATTEMPTS`, `INVALID_TIMEOUT`, `INVALID_JSON`, `INVALID_REQUEST`, `UNKNOWN_TASK`", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`", body = ErrorBody),
        (status = 422, description = "`INVALID_CRON`: not 5 fields (6 with seconds), or never fires", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn put(
    State(shared): State<Shared>,
    ApiPath((queue, name)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    checked_name(&name)?;
    require_json(&headers)?;
    let too_large = || {
        ApiError::new(ErrorCode::PayloadTooLarge, "request body is too large")
            .with_details(json!({"limit": shared.state.ingest.max_payload_bytes}))
    };
    let bytes = read_limited(&shared, &headers, body, shared.body_limit, too_large).await?;
    let body = parse_body(&bytes)?;
    shared
        .auth
        .authorize_schedule(&headers, &queue, &body.task)?;
    let cron = CronExpr::parse(&body.cron).map_err(invalid_cron)?;
    let now = now_ms();
    let next = cron.next_after(now).ok_or_else(|| {
        invalid_cron(InvalidCron {
            expr: body.cron.clone(),
            reason: "it never fires".into(),
        })
    })?;
    check_task(&shared, &body)?;
    let def = ScheduleDef {
        cron: body.cron,
        task: body.task,
        payload: body.payload,
        max_attempts: body.max_attempts,
        timeout_ms: body.timeout_ms,
        updated_at: now,
    };
    let state = shared.state.clone();
    let (q, n, d) = (queue.clone(), name.clone(), def.clone());
    let created = store_call(&shared, async move {
        // As a submission: a task this process does not know yet may have
        // been deployed a moment ago through another API.
        let known = (state.has_handler)(&d.task)
            || state.deploy.registry.active_entry(&d.task).await?.is_some();
        if !known {
            return Err(ApiError::from(IngestError::UnknownTask(d.task)));
        }
        Ok(state.store.put_schedule(&q, &n, &d, next).await?)
    })
    .await?;
    let last = if created {
        None
    } else {
        let (store, q, n) = (shared.state.store.clone(), queue.clone(), name.clone());
        store_call(&shared, async move {
            let all = store.schedules(&q).await?;
            Ok::<_, crate::store::StoreError>(all.into_iter().find(|s| s.name == n))
        })
        .await?
        .and_then(|s| s.last)
    };
    let schedule = Schedule {
        name,
        def,
        next_at: Some(next),
        last,
    };
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(schedule.to_json(&queue))).into_response())
}

/// `GET /v1/queues/{queue}/schedules`: every schedule, by name, with its
/// next tick and its last fired one.
#[utoipa::path(
    operation_id = "list_schedules",
    get,
    path = "/v1/queues/{queue}/schedules",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "The queue's schedules, by name", body = schemas::ScheduleList),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn list(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    let schedules: Vec<Value> = store_call(&shared, async move { store.schedules(&q).await })
        .await?
        .iter()
        .map(|s| s.to_json(&queue))
        .collect();
    Ok(Json(json!({"queue": queue, "schedules": schedules})).into_response())
}

/// `DELETE /v1/queues/{queue}/schedules/{name}`: no tick of it fires after.
#[utoipa::path(
    delete,
    path = "/v1/queues/{queue}/schedules/{name}",
    tag = "queues",
    params(SchedulePath),
    responses(
        (status = 200, description = "Deleted", body = schemas::ScheduleDeleted),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_SCHEDULE_NAME`, `INVALID_PATH`", body = ErrorBody),
        (status = 404, description = "`UNKNOWN_SCHEDULE`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn delete(
    State(shared): State<Shared>,
    ApiPath((queue, name)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    checked_name(&name)?;
    let (store, q, n) = (shared.state.store.clone(), queue.clone(), name.clone());
    let existing = store_call(&shared, async move {
        let all = store.schedules(&q).await?;
        Ok::<_, crate::store::StoreError>(all.into_iter().find(|s| s.name == n))
    })
    .await?;
    if let Some(schedule) = &existing {
        shared
            .auth
            .authorize_schedule(&headers, &queue, &schedule.def.task)?;
    }
    let (store, q, n) = (shared.state.store.clone(), queue.clone(), name.clone());
    if store_call(&shared, async move { store.delete_schedule(&q, &n).await }).await? {
        Ok(Json(json!({"queue": queue, "name": name, "deleted": true})).into_response())
    } else {
        Err(ApiError::new(
            ErrorCode::UnknownSchedule,
            format!("no schedule {name:?} in queue {queue:?}"),
        )
        .with_details(json!({"queue": queue, "name": name})))
    }
}

/// `{queue}` and `{name}` of a schedule's routes.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Describes the path.
pub(super) struct SchedulePath {
    /// The queue: 1 to 64 letters, digits, `_`, `.` or `-`.
    #[param(schema_with = super::openapi::name_schema, required = true)]
    queue: String,
    /// The schedule: 1 to 64 letters, digits, `_`, `.` or `-`.
    #[param(schema_with = super::openapi::name_schema, required = true)]
    name: String,
}

/// The bodies of these routes, as types that document their fields. None
/// is ever built: they exist for their schemas.
#[allow(dead_code)]
pub(super) mod schemas {
    use serde_json::Value;
    use utoipa::ToSchema;

    /// A schedule to set.
    #[derive(ToSchema)]
    pub(in crate::api) struct ScheduleRequest {
        /// 5 fields (minute hour day-of-month month day-of-week) or 6 with
        /// seconds first; UTC. `@hourly`-style nicknames too.
        cron: String,
        /// The task each tick submits (a deployed handler).
        task: String,
        /// The payload of each tick's task; `null` when absent.
        payload: Option<Value>,
        /// Attempts of each task (the task's deploy default, then the
        /// workers', when absent).
        max_attempts: Option<u32>,
        /// Deadline of one attempt, ms.
        timeout_ms: Option<u64>,
    }

    /// A schedule and its state.
    #[derive(ToSchema)]
    pub(in crate::api) struct ScheduleView {
        /// The queue.
        queue: String,
        /// The schedule's name.
        name: String,
        /// Its cron expression.
        cron: String,
        /// The time zone it ticks in: always `UTC`.
        timezone: String,
        /// The task each tick submits.
        task: String,
        /// The payload of each tick's task.
        payload: Value,
        /// Attempts of each task, if set.
        max_attempts: Option<u32>,
        /// Deadline of one attempt (ms), if set.
        timeout_ms: Option<u64>,
        /// When it was last set (ms since epoch).
        updated_at: u64,
        /// Its next tick (ms since epoch); `null` when it has none left.
        next_at: Option<u64>,
        /// Its last fired tick, if any.
        last: Option<LastTick>,
    }

    /// The last tick a schedule fired.
    #[derive(ToSchema)]
    pub(in crate::api) struct LastTick {
        /// The tick (ms since epoch).
        tick: u64,
        /// The tick's task (idempotency key `schedule:<name>:<tick>`);
        /// `null` when its submission was refused.
        task_id: Option<String>,
        /// When it was fired (ms since epoch).
        fired_at: u64,
        /// Why the tick made no task (code and message), when it made none.
        error: Option<String>,
    }

    /// A queue's schedules.
    #[derive(ToSchema)]
    pub(in crate::api) struct ScheduleList {
        /// The queue.
        queue: String,
        /// Its schedules, by name.
        schedules: Vec<ScheduleView>,
    }

    /// A deleted schedule.
    #[derive(ToSchema)]
    pub(in crate::api) struct ScheduleDeleted {
        /// The queue.
        queue: String,
        /// The schedule.
        name: String,
        /// Always `true`.
        deleted: bool,
    }
}
