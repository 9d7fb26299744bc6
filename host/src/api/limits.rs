//! `PUT`, `GET` and `DELETE /v1/queues/{queue}/limits`: a queue's limits
//! across the fleet (`store::limits`): at most `rate.limit` task starts per
//! `rate.per_ms` window, and at most `group_concurrency` running tasks of
//! one `group`. Setting and lifting them is the queue's admin's; reading
//! them needs `read`.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, json_body, store_call};
use crate::base::ErrorCode;
use crate::store::Limits;

/// The largest body [`put`] reads.
const BODY_LIMIT: usize = 1024;

/// The largest `rate.limit`.
const MAX_RATE_LIMIT: u32 = 1_000_000;

/// The longest `rate.per_ms`: a day.
const MAX_RATE_PER_MS: u64 = 86_400_000;

/// The largest `group_concurrency`.
const MAX_GROUP_CONCURRENCY: u32 = 100_000;

/// `PUT /v1/queues/{queue}/limits`.
#[utoipa::path(
    put,
    path = "/v1/queues/{queue}/limits",
    operation_id = "set_limits",
    tag = "queues",
    params(QueuePath),
    request_body = schemas::QueueLimits,
    responses(
        (status = 200, description = "The limits in force: those of the body (a limit it leaves out is lifted)", body = schemas::LimitsState),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`, `INVALID_JSON`, `INVALID_REQUEST`, `INVALID_LIMITS`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn put(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let limits: Limits = json_body(&shared, &headers, body, BODY_LIMIT).await?;
    check(&limits)?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    store_call(&shared, async move {
        if limits.any() {
            store.set_limits(&q, &limits).await
        } else {
            store.delete_limits(&q).await.map(drop)
        }
    })
    .await?;
    Ok(Json(json!({"queue": queue, "limits": limits})).into_response())
}

/// `GET /v1/queues/{queue}/limits`.
#[utoipa::path(
    get,
    path = "/v1/queues/{queue}/limits",
    operation_id = "get_limits",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "The queue's limits (`{}`: none)", body = schemas::LimitsState),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn get(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    let mut found = store_call(&shared, async move {
        store.limits_of(std::slice::from_ref(&q)).await
    })
    .await?;
    let limits = found.remove(&queue).unwrap_or_default();
    Ok(Json(json!({"queue": queue, "limits": limits})).into_response())
}

/// `DELETE /v1/queues/{queue}/limits`.
#[utoipa::path(
    delete,
    path = "/v1/queues/{queue}/limits",
    operation_id = "delete_limits",
    tag = "queues",
    params(QueuePath),
    responses(
        (status = 200, description = "Every limit lifted", body = schemas::LimitsState),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_PATH`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn delete(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let (store, q) = (shared.state.store.clone(), queue.clone());
    store_call(&shared, async move { store.delete_limits(&q).await }).await?;
    Ok(Json(json!({"queue": queue, "limits": Limits::default()})).into_response())
}

/// Refuse limits out of their bounds: 400 `INVALID_LIMITS` naming the
/// field.
fn check(limits: &Limits) -> Result<(), ApiError> {
    let bad = |field: &str, why: String| {
        Err(
            ApiError::new(ErrorCode::InvalidLimits, format!("{field} {why}"))
                .with_details(json!({"field": field})),
        )
    };
    if let Some(rate) = limits.rate {
        if !(1..=MAX_RATE_LIMIT).contains(&rate.limit) {
            return bad("rate.limit", format!("must be 1 to {MAX_RATE_LIMIT}"));
        }
        if !(1..=MAX_RATE_PER_MS).contains(&rate.per_ms) {
            return bad("rate.per_ms", format!("must be 1 to {MAX_RATE_PER_MS}"));
        }
    }
    if let Some(k) = limits.group_concurrency
        && !(1..=MAX_GROUP_CONCURRENCY).contains(&k)
    {
        return bad(
            "group_concurrency",
            format!("must be 1 to {MAX_GROUP_CONCURRENCY}"),
        );
    }
    Ok(())
}

/// The bodies of these routes, as types that document their fields. None
/// is ever built: they exist for their schemas.
#[allow(dead_code)]
pub(super) mod schemas {
    use utoipa::ToSchema;

    /// At most `limit` task starts per window of `per_ms`, across the
    /// fleet.
    #[derive(ToSchema)]
    #[serde(deny_unknown_fields)]
    pub(in crate::api) struct RateLimit {
        /// Starts per window, 1 to 1,000,000.
        #[schema(minimum = 1, maximum = 1_000_000)]
        limit: u32,
        /// The window (ms), 1 to 86,400,000.
        #[schema(minimum = 1, maximum = 86_400_000)]
        per_ms: u64,
    }

    /// A queue's limits; a limit left out is lifted.
    #[derive(ToSchema)]
    #[serde(deny_unknown_fields)]
    pub(in crate::api) struct QueueLimits {
        rate: Option<RateLimit>,
        /// Running tasks of one `group` (a submission field) at once,
        /// across the fleet, 1 to 100,000.
        #[schema(minimum = 1, maximum = 100_000)]
        group_concurrency: Option<u32>,
    }

    /// A queue's limits in force.
    #[derive(ToSchema)]
    pub(in crate::api) struct LimitsState {
        queue: String,
        limits: QueueLimits,
    }
}
