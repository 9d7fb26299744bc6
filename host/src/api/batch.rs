//! `POST /v1/queues/{queue}/tasks/batch`: up to
//! [`MAX_BATCH_ITEMS`](crate::ingest::MAX_BATCH_ITEMS) submissions to one
//! queue in one request and one Redis round trip
//! ([`Submitter::submit_batch`](crate::ingest::Submitter::submit_batch)).
//!
//! The body is `{"tasks": [item, ...]}`, each item the body of a single
//! submission, its key in the item's `idempotency_key` (the
//! `Idempotency-Key` header names one task, so a batch refuses it). The
//! answer is 200 `{"results": [{"status", "body"}, ...]}`: one result per
//! item, in order, each the HTTP status and body that a single submission
//! of the item would have been answered with (202 new, 200 replay, 409 in
//! flight, 400 with the item's own code, 429 queue full, ...). One bad item
//! never fails the others, and an item refused for any reason writes
//! nothing.
//!
//! What fails the whole batch, with nothing written: the token, the content
//! type, a bad queue name, a body over
//! [`MAX_BATCH_BODY_BYTES`](crate::ingest::MAX_BATCH_BODY_BYTES) (413
//! `PAYLOAD_TOO_LARGE`), a body that is not `{"tasks": [...]}`
//! (`INVALID_JSON`, `INVALID_REQUEST`), no items (400 `EMPTY_BATCH`), more
//! than `MAX_BATCH_ITEMS` (413 `BATCH_TOO_LARGE`). And Redis failing for the
//! whole pipeline or missing the API's Redis deadline (503
//! `STORE_UNAVAILABLE`), after which any item may have been written, as a
//! single submission answered 503 may have been: resubmit with keys.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{read_limited, require_json, store_call, submitted, submitter};
use crate::base::ErrorCode;
use crate::ingest::{self, BatchRequest, IngestError, MAX_BATCH_BODY_BYTES};
use crate::telemetry;
use tracing::Instrument as _;

/// The name of a batch's span: its tasks share its trace.
const BATCH_SPAN: &str = "POST /v1/queues/{queue}/tasks/batch";

/// The answer to a batch: one result per item, in the items' order.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct BatchResults {
    results: Vec<BatchResult>,
}

/// What a single submission of one item would have been answered.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct BatchResult {
    /// Its HTTP status: 202 new, 200 replay, or an error's.
    status: u16,
    /// Its body: the task (`Submitted`) or the error (`ErrorBody`).
    body: Value,
}

#[utoipa::path(
    operation_id = "submit_batch",
    post,
    path = "/v1/queues/{queue}/tasks/batch",
    tag = "tasks",
    params(QueuePath),
    request_body = BatchRequest,
    responses(
        (status = 200, description = "One result per item, in order: each item's own status and body (`Submitted` or `ErrorBody`)", body = BatchResults),
        (status = 400, description = "`INVALID_JSON`, `INVALID_REQUEST`, `EMPTY_BATCH`, `INVALID_QUEUE_NAME`, `INVALID_IDEMPOTENCY_KEY` (the header, which a batch does not take)", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE` (the body), `BATCH_TOO_LARGE` (the items)", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: not sent as `application/json`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub(super) async fn submit(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    shared
        .auth
        .authorize(&headers, Scope::Submit, Some(&queue))?;
    require_json(&headers)?;
    ingest::check_batch(&queue, headers.contains_key("idempotency-key"))?;
    let limit = shared.body_limit.max(MAX_BATCH_BODY_BYTES);
    let too_large = || {
        ApiError::new(ErrorCode::PayloadTooLarge, "batch body is too large")
            .with_details(json!({"limit": limit}))
    };
    let body = read_limited(&shared, &headers, body, limit, too_large).await?;
    let (span, trace) = telemetry::submission(BATCH_SPAN, &queue, &headers);
    let state = shared.state.clone();
    let submit = async move {
        let submitter = submitter(&state, trace.as_deref());
        submitter.submit_batch(&queue, &body).await
    };
    let outcomes = store_call(&shared, submit.instrument(span)).await?;
    let results: Vec<Value> = outcomes.into_iter().map(result).collect();
    Ok(Json(json!({"results": results})).into_response())
}

/// One item's result: the status and body its single submission would
/// have been answered with.
fn result(outcome: Result<ingest::Submitted, IngestError>) -> Value {
    let (status, body) = match outcome {
        Ok(done) => {
            let (status, Json(body)) = submitted(done);
            (status, body)
        }
        Err(e) => {
            let e = ApiError::from(e);
            (e.code.status(), e.into_body())
        }
    };
    json!({"status": status.as_u16(), "body": body})
}
