//! Bulk DLQ routes (admin scope, like the single requeue):
//!
//! - `POST /v1/queues/{queue}/dlq/requeue`, body `{"ids": [...]}` (at most
//!   [`DLQ_MAX_IDS`]) or `{"all": true}` → `{"requeued", "not_dead_lettered",
//!   "key_taken"}` (`key_taken`: `[{"id", "task_id"}]`, the tasks left
//!   dead-lettered because their idempotency key names task `task_id` now);
//! - `DELETE /v1/queues/{queue}/dlq`, body `{"ids": [...]}`, `{"all":
//!   true}` or `{"older_than_ms": N}` (or `?older_than_ms=N` with no body)
//!   → `{"purged"}`.
//!
//! `all` and `older_than_ms` work through the DLQ oldest first, a chunk
//! ([`DLQ_CHUNK`] ids, one script call) at a time, each under the API's
//! Redis deadline, so no call holds Redis for long. They take only what
//! was dead-lettered when the request began (up to the newest entry then,
//! and no more entries than the DLQ held): tasks dead-lettered meanwhile,
//! including requeued ones that fail again, are left for another request,
//! so the request always ends. See `store/dlq.rs` for what a purge deletes.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::borrow::Cow;

use utoipa::openapi::schema::{
    AdditionalProperties, ArrayBuilder, ObjectBuilder, SchemaType, Type,
};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{IntoParams, PartialSchema, ToSchema};

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::{ApiPath, ApiQuery};
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, read_limited, store_call};
use crate::base::ErrorCode;
use crate::base::now_ms;
use crate::store::{BulkRequeue, DLQ_CHUNK, DLQ_MAX_IDS, PurgeBound};

type ApiResult = Result<Response, ApiError>;

/// Largest body of a bulk route: room for [`DLQ_MAX_IDS`] ids.
const MAX_BODY_BYTES: usize = 256 << 10;

/// Longest task id a bulk route takes, characters.
const MAX_ID_CHARS: usize = 200;

/// A bulk DLQ route's body: which dead-lettered tasks, exactly one of
/// `ids`, `all: true` or (purge only) `older_than_ms`. The document gives
/// each route's as [`RequeueSelection`] and [`PurgeSelection`].
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DlqSelection {
    /// These tasks (at most 1000; duplicates count once).
    ids: Option<Vec<String>>,
    /// Every task the DLQ holds when the request begins.
    #[serde(default)]
    all: bool,
    /// Purge only: the tasks dead-lettered more than this many ms ago.
    older_than_ms: Option<u64>,
}

/// The body of a bulk requeue, as the document gives it: exactly one of
/// `ids` or `all: true`.
pub(super) struct RequeueSelection;

/// The body of a purge, as the document gives it: exactly one of `ids`,
/// `all: true` or `older_than_ms`.
pub(super) struct PurgeSelection;

impl PartialSchema for RequeueSelection {
    fn schema() -> RefOr<Schema> {
        selection_schema(false)
    }
}

impl ToSchema for RequeueSelection {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("RequeueSelection")
    }
}

impl PartialSchema for PurgeSelection {
    fn schema() -> RefOr<Schema> {
        selection_schema(true)
    }
}

impl ToSchema for PurgeSelection {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("PurgeSelection")
    }
}

/// [`DlqSelection`] as [`selection`] reads it: `ids` (absent or null when
/// not used), `all` (absent or false when not used), and for a purge
/// `older_than_ms` (absent or null when not used); nothing else. That
/// exactly one of them selects is the route's rule, told in the
/// description: 400 `INVALID_REQUEST` otherwise.
fn selection_schema(older_than: bool) -> RefOr<Schema> {
    let id = ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(MAX_ID_CHARS));
    let ids = ArrayBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
        .items(id)
        .max_items(Some(DLQ_MAX_IDS))
        .description(Some("These tasks (duplicates count once)."));
    let all = ObjectBuilder::new()
        .schema_type(Type::Boolean)
        .description(Some("Every task the DLQ holds when the request begins."));
    let mut object = ObjectBuilder::new()
        .schema_type(Type::Object)
        .additional_properties(Some(AdditionalProperties::FreeForm(false)))
        .property("ids", ids)
        .property("all", all);
    let mut description = "Exactly one of `ids` or `all: true`.";
    if older_than {
        let ms = ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::Integer, Type::Null]))
            .minimum(Some(0))
            .maximum(Some(u64::MAX))
            .description(Some("The tasks dead-lettered more than this many ms ago."));
        object = object.property("older_than_ms", ms);
        description =
            "Exactly one of `ids`, `all: true` or `older_than_ms` (here or in the query).";
    }
    object.description(Some(description)).into()
}

/// The answer to a bulk requeue.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct BulkRequeued {
    /// Tasks that left the DLQ and are `QUEUED` again.
    requeued: u64,
    /// Named ids that were not requeued: no such task, or not
    /// dead-lettered (with `all`: dangling DLQ entries, removed).
    not_dead_lettered: Vec<String>,
    /// Tasks left dead-lettered because their idempotency key names
    /// another task now: each `{"id", "task_id"}` (the other task).
    key_taken: Vec<KeyTakenEntry>,
}

/// A task a bulk requeue left dead-lettered: its key names another task.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct KeyTakenEntry {
    /// The dead-lettered task.
    id: String,
    /// The task its idempotency key names now.
    task_id: String,
}

/// The answer to a purge.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct Purged {
    /// Tasks removed from the DLQ (each with its task hash and, if it
    /// still named the task, its idempotency record).
    purged: u64,
}

/// The tasks a bulk route works on, checked.
#[derive(Debug, PartialEq, Eq)]
enum Selected {
    Ids(Vec<String>),
    All,
    OlderThan(u64),
}

/// The query of the purge route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct PurgeQuery {
    /// Purge the tasks dead-lettered more than this many ms ago (instead
    /// of a body). (Taken as text so that every bad value gets
    /// `INVALID_QUERY`.)
    #[param(schema_with = super::openapi::whole_number)]
    older_than_ms: Option<String>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, message)
}

/// Read and check a bulk route's body (an empty one selects nothing);
/// `older_than` is the query's, which only the purge takes.
async fn selection(
    shared: &Shared,
    headers: &HeaderMap,
    body: Body,
    query_older_than: Option<u64>,
    allow_older_than: bool,
) -> Result<Selected, ApiError> {
    let too_large = || {
        ApiError::new(ErrorCode::PayloadTooLarge, "request body is too large")
            .with_details(json!({"limit": MAX_BODY_BYTES}))
    };
    let bytes = read_limited(shared, headers, body, MAX_BODY_BYTES, too_large).await?;
    // `null`, as a client serializing "no selection" may send, is no body.
    let mut sel: DlqSelection =
        if bytes.iter().all(u8::is_ascii_whitespace) || bytes.trim_ascii() == b"null" {
            DlqSelection::default()
        } else {
            serde_json::from_slice(&bytes).map_err(|e| {
                let code = if e.is_data() {
                    ErrorCode::InvalidRequest
                } else {
                    ErrorCode::InvalidJson
                };
                ApiError::new(code, format!("request body: {e}"))
            })?
        };
    if let Some(ms) = query_older_than {
        if sel.older_than_ms.is_some_and(|b| b != ms) {
            return Err(invalid(
                "older_than_ms is given twice (query and body) with two values",
            ));
        }
        sel.older_than_ms = Some(ms);
    }
    if sel.older_than_ms.is_some() && !allow_older_than {
        return Err(invalid(
            "older_than_ms is for purges only; name `ids` or `all`",
        ));
    }
    let expected = if allow_older_than {
        "exactly one of `ids`, `all: true` or `older_than_ms`"
    } else {
        "exactly one of `ids` or `all: true`"
    };
    match (sel.ids, sel.all, sel.older_than_ms) {
        (Some(ids), false, None) => Ok(Selected::Ids(checked_ids(ids)?)),
        (None, true, None) => Ok(Selected::All),
        (None, false, Some(ms)) => Ok(Selected::OlderThan(ms)),
        _ => Err(invalid(format!("the body must name {expected}"))),
    }
}

/// `ids` without duplicates (first occurrence kept), at most
/// [`DLQ_MAX_IDS`], each non-empty and at most [`MAX_ID_CHARS`].
fn checked_ids(ids: Vec<String>) -> Result<Vec<String>, ApiError> {
    if ids.len() > DLQ_MAX_IDS {
        return Err(ApiError::new(
            ErrorCode::TooManyIds,
            format!(
                "{} ids named; one request takes at most {DLQ_MAX_IDS} (or `all`)",
                ids.len()
            ),
        )
        .with_details(json!({"count": ids.len(), "max": DLQ_MAX_IDS})));
    }
    if let Some(bad) = ids
        .iter()
        .find(|id| id.is_empty() || id.chars().count() > MAX_ID_CHARS)
    {
        let shown: String = bad.chars().take(64).collect();
        return Err(invalid(format!(
            "task id {shown:?} is empty or longer than {MAX_ID_CHARS} characters"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    Ok(ids
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect())
}

/// `POST /v1/queues/{queue}/dlq/requeue`.
#[utoipa::path(
    operation_id = "requeue_many",
    post,
    path = "/v1/queues/{queue}/dlq/requeue",
    tag = "queues",
    params(QueuePath),
    request_body(content = RequeueSelection, description = "`{\"ids\": [...]}` (at most 1000) or `{\"all\": true}`"),
    responses(
        (status = 200, description = "Requeued; the named ids that were not dead-lettered", body = BulkRequeued),
        (status = 400, description = "`INVALID_JSON`, `INVALID_REQUEST`, `TOO_MANY_IDS`, `INVALID_QUEUE_NAME`", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn requeue(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let selected = selection(&shared, &headers, body, None, false).await?;
    let store = shared.state.store.clone();
    let done = match selected {
        Selected::Ids(ids) => {
            let q = queue.clone();
            store_call(&shared, async move {
                store.requeue_many(&q, &ids, now_ms()).await
            })
            .await?
        }
        Selected::All | Selected::OlderThan(_) => requeue_all(&shared, &queue).await?,
    };
    tracing::info!(queue, requeued = done.requeued, "DLQ requeue");
    Ok(Json(json!({
        "requeued": done.requeued,
        "not_dead_lettered": done.not_dead_lettered,
        "key_taken": done.key_taken,
    }))
    .into_response())
}

/// Requeue what the DLQ of `queue` held when this began, oldest first, a
/// chunk per store call.
async fn requeue_all(shared: &Shared, queue: &str) -> Result<BulkRequeue, ApiError> {
    let store = shared.state.store.clone();
    let (s, q) = (store.clone(), queue.to_owned());
    let extent = store_call(shared, async move { s.dlq_extent(&q).await }).await?;
    let mut done = BulkRequeue::default();
    let Some(newest) = extent.newest else {
        return Ok(done);
    };
    let mut looked = 0u64;
    while looked < extent.len {
        let (s, q) = (store.clone(), queue.to_owned());
        let (chunk, seen) = store_call(shared, async move {
            s.requeue_oldest(&q, Some(newest), now_ms()).await
        })
        .await?;
        done.requeued += chunk.requeued;
        done.not_dead_lettered.extend(chunk.not_dead_lettered);
        done.key_taken.extend(chunk.key_taken);
        looked += seen as u64;
        if seen < DLQ_CHUNK {
            break;
        }
    }
    Ok(done)
}

/// `DELETE /v1/queues/{queue}/dlq`.
#[utoipa::path(
    delete,
    path = "/v1/queues/{queue}/dlq",
    tag = "queues",
    params(QueuePath, PurgeQuery),
    request_body(content = Option<PurgeSelection>, description = "`{\"ids\": [...]}` (at most 1000), `{\"all\": true}` or `{\"older_than_ms\": N}`; or no body and `?older_than_ms=N`"),
    responses(
        (status = 200, description = "Purged", body = Purged),
        (status = 400, description = "`INVALID_JSON`, `INVALID_REQUEST`, `INVALID_QUERY`, `TOO_MANY_IDS`, `INVALID_QUEUE_NAME`", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
    ),
    security(("bearer" = ["admin"])),
)]
pub(super) async fn purge(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    ApiQuery(query): ApiQuery<PurgeQuery>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    authorized(&shared.auth, &headers, Scope::Admin, &queue)?;
    let query_older_than = match query.older_than_ms.as_deref() {
        None => None,
        Some(text) => Some(text.parse::<u64>().map_err(|_| {
            ApiError::new(
                ErrorCode::InvalidQuery,
                "older_than_ms must be a whole number of milliseconds",
            )
        })?),
    };
    let selected = selection(&shared, &headers, body, query_older_than, true).await?;
    let now = now_ms();
    let purged = match selected {
        Selected::Ids(ids) => {
            let (store, q) = (shared.state.store.clone(), queue.clone());
            store_call(&shared, async move {
                store.purge_dead_letters(&q, &ids, now).await
            })
            .await?
        }
        Selected::All => purge_oldest(&shared, &queue, None, now).await?,
        Selected::OlderThan(ms) => {
            purge_oldest(&shared, &queue, Some(now.saturating_sub(ms)), now).await?
        }
    };
    tracing::info!(queue, purged, "DLQ purge");
    Ok(Json(json!({"purged": purged})).into_response())
}

/// Purge, oldest first, what the DLQ of `queue` held when this began that
/// was dead-lettered at or before `latest` (any time when `None`), a chunk
/// per store call.
async fn purge_oldest(
    shared: &Shared,
    queue: &str,
    latest: Option<u64>,
    now: u64,
) -> Result<u64, ApiError> {
    let store = shared.state.store.clone();
    let (s, q) = (store.clone(), queue.to_owned());
    let extent = store_call(shared, async move { s.dlq_extent(&q).await }).await?;
    let Some(newest) = extent.newest else {
        return Ok(0);
    };
    let bound = PurgeBound {
        latest: Some(latest.map_or(newest, |at| at.min(newest))),
        keep: None,
    };
    let (mut purged, mut looked) = (0, 0u64);
    while looked < extent.len {
        let (s, q) = (store.clone(), queue.to_owned());
        let (n, seen) = store_call(shared, async move {
            s.purge_oldest(&q, bound, DLQ_CHUNK, now).await
        })
        .await?;
        purged += n;
        looked += seen as u64;
        if seen < DLQ_CHUNK {
            break;
        }
    }
    Ok(purged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deduplicated_bounded_and_checked() {
        let ids = checked_ids(vec!["a".into(), "b".into(), "a".into()]).expect("ok");
        assert_eq!(ids, ["a", "b"]);
        let many = vec!["x".to_owned(); DLQ_MAX_IDS + 1];
        assert_eq!(
            checked_ids(many).map(|_| ()).unwrap_err().code,
            ErrorCode::TooManyIds
        );
        assert_eq!(
            checked_ids(vec![String::new()])
                .map(|_| ())
                .unwrap_err()
                .code,
            ErrorCode::InvalidRequest
        );
    }
}
