//! `PUT /v1/queues/{queue}/partitions`: raise a queue's partition count
//! (admin scope on every queue: where a queue's keys live is the fleet's
//! layout, not the queue's), spreading it over that many Redis Cluster
//! slots. See
//! `store::partitions` for how tasks are routed and how keyed submissions
//! behave across the change; the count is never lowered.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::Shared;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{checked_queue, json_body, store_call};
use crate::base::ErrorCode;
use crate::base::now_ms;
use crate::store::MAX_PARTITIONS;

/// The largest body this route reads.
const BODY_LIMIT: usize = 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RaiseBody {
    count: u32,
}

/// `PUT /v1/queues/{queue}/partitions`.
#[utoipa::path(
    put,
    path = "/v1/queues/{queue}/partitions",
    tag = "queues",
    params(QueuePath),
    request_body = schemas::PartitionsRequest,
    responses(
        (status = 200, description = "The count in force, and the one before", body = schemas::Partitions),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_JSON`, `INVALID_REQUEST`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`", body = ErrorBody),
        (status = 422, description = "`INVALID_PARTITIONS`: 0, over the maximum, or below the present count", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn raise(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    shared.auth.authorize_every_queue(&headers, &queue)?;
    checked_queue(&queue)?;
    let RaiseBody { count } = json_body(&shared, &headers, body, BODY_LIMIT).await?;
    if !(1..=MAX_PARTITIONS).contains(&count) {
        return Err(ApiError::new(
            ErrorCode::InvalidPartitions,
            format!("count must be 1 to {MAX_PARTITIONS}, got {count}"),
        )
        .with_details(json!({"max": MAX_PARTITIONS})));
    }
    let store = shared.state.store.clone();
    let q = queue.clone();
    let (previous, in_force) = store_call(&shared, async move {
        let previous = store.partitioning(&q).await?.count;
        if count < previous {
            return Ok::<_, crate::store::StoreError>((previous, None));
        }
        let in_force = store.raise_partitions(&q, count, now_ms()).await?;
        Ok((previous, Some(in_force)))
    })
    .await?;
    let Some(in_force) = in_force else {
        return Err(ApiError::new(
            ErrorCode::InvalidPartitions,
            format!(
                "queue {queue} has {previous} partitions; a count is never lowered \
                 (the tasks and keyed records of the dropped partitions would be stranded)"
            ),
        )
        .with_details(json!({"partitions": previous})));
    };
    if in_force > previous {
        tracing::info!(%queue, previous, partitions = in_force, "partition count raised");
    }
    Ok(Json(json!({"queue": queue, "partitions": in_force, "previous": previous})).into_response())
}

/// The bodies of this route, as types that document their fields. None is
/// ever built: they exist for their schemas.
#[allow(dead_code)]
pub(super) mod schemas {
    use utoipa::ToSchema;

    /// The partition count to raise a queue to.
    #[derive(ToSchema)]
    #[serde(deny_unknown_fields)]
    pub(in crate::api) struct PartitionsRequest {
        /// 1 to 256, at least the present count.
        #[schema(minimum = 1, maximum = 256)]
        count: u32,
    }

    /// A queue's partition count after a raise.
    #[derive(ToSchema)]
    pub(in crate::api) struct Partitions {
        queue: String,
        /// The count in force (a larger concurrent raise may have won).
        partitions: u32,
        /// The count before this request.
        previous: u32,
    }
}
