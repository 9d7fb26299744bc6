//! `GET /v1/queues/{queue}/tasks`: a queue's tasks, newest first, by
//! status and task name, a page at a time.
//!
//! `?status=` (any status, case-insensitive; all without it), `?task=` (a
//! task name, exactly; all without it; with `status`, both must match),
//! `?limit=` (1
//! to [`MAX_LIST_LIMIT`]), `?cursor=` (a previous page's `next_cursor`,
//! opaque). How the tasks are found, and why a page may be short while
//! `next_cursor` is not null, is the store's submission index
//! ([`crate::store::Store::list_tasks`]): one request reads at most
//! [`LIST_SCAN_BUDGET`] index entries, so its Redis work is bounded
//! whatever the filter.
//!
//! [`MAX_LIST_LIMIT`]: super::MAX_LIST_LIMIT

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa::IntoParams;

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::{ApiPath, ApiQuery};
use super::openapi::ErrorBody;
use super::openapi::schemas::{QueuePath, TaskPage};
use super::routes::{authorized, list_limit, store_call};
use crate::base::ErrorCode;
use crate::ingest::validate_task_name;
use crate::store::{LIST_SCAN_BUDGET, ListCursor, TaskStatus};

/// The query of the listing.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct TaskListParams {
    /// Only tasks of this status (any case).
    #[param(value_type = Option<TaskStatus>)]
    status: Option<String>,
    /// Tasks in the page, 1 to 1000; default 100. (Taken as text so that
    /// every bad value gets `INVALID_LIMIT`.)
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
    /// Only tasks of this name (the handler's), exactly. Read from each
    /// task's record like the status, within the same scan budget.
    #[param(schema_with = super::openapi::name_schema)]
    task: Option<String>,
    /// A previous page's `next_cursor`, as it is.
    #[param(pattern = r"^(?!0*(-0*)?(\.|$))[0-9]{1,19}(-[0-9]{1,19})?(\.[1-9][0-9]{0,8})?$")]
    cursor: Option<String>,
}

/// `GET /v1/queues/{queue}/tasks`.
#[utoipa::path(
    operation_id = "list_tasks",
    get,
    path = "/v1/queues/{queue}/tasks",
    tag = "tasks",
    params(QueuePath, TaskListParams),
    responses(
        (status = 200, description = "A page of tasks, newest first", body = TaskPage),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_STATUS`, `INVALID_TASK_NAME`, `INVALID_LIMIT`, `INVALID_CURSOR`, `INVALID_QUERY`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn list(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    ApiQuery(params): ApiQuery<TaskListParams>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let status = params.status.as_deref().map(parse_status).transpose()?;
    if let Some(task) = &params.task {
        validate_task_name(task)?;
    }
    let limit = list_limit(params.limit.as_deref())?;
    let cursor = params.cursor.as_deref().map(parse_cursor).transpose()?;
    let (store, q, task) = (shared.state.store.clone(), queue.clone(), params.task);
    let name = task.clone();
    let page = store_call(&shared, async move {
        store
            .list_tasks(&q, status, name.as_deref(), limit, cursor)
            .await
    })
    .await?;
    Ok(Json(json!({
        "queue": queue,
        "status": status,
        "task": task,
        "tasks": page.tasks,
        "next_cursor": page.next_cursor.map(|c| c.to_string()),
    }))
    .into_response())
}

/// A status by its name, in any case; 400 `INVALID_STATUS` otherwise.
fn parse_status(text: &str) -> Result<TaskStatus, ApiError> {
    TaskStatus::ALL
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(text))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidStatus,
                format!("{:?} is not a task status", truncated(text)),
            )
            .with_details(json!({"statuses": TaskStatus::ALL}))
        })
}

/// A cursor a previous page gave; 400 `INVALID_CURSOR` otherwise.
fn parse_cursor(text: &str) -> Result<ListCursor, ApiError> {
    let invalid = || {
        ApiError::new(
            ErrorCode::InvalidCursor,
            format!(
                "{:?} is not a cursor: pass a page's `next_cursor` as it is",
                truncated(text)
            ),
        )
    };
    let cursor: ListCursor = text.parse().map_err(|_| invalid())?;
    // No page ends at the first id a stream can hold (`0-0`), and Redis
    // refuses a range that ends before it.
    if cursor.entry.ms == 0 && cursor.entry.seq == 0 {
        return Err(invalid());
    }
    Ok(cursor)
}

/// At most 64 characters of a client's text, for a message.
fn truncated(text: &str) -> String {
    text.chars().take(64).collect()
}

/// A request reads at most [`LIST_SCAN_BUDGET`] entries, which must hold
/// a whole page.
const _: () = assert!(LIST_SCAN_BUDGET >= super::MAX_LIST_LIMIT);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StreamId;

    #[test]
    fn statuses_in_any_case_and_nothing_else() {
        assert_eq!(
            parse_status("dead_lettered").ok(),
            Some(TaskStatus::DeadLettered)
        );
        assert_eq!(parse_status("QUEUED").ok(), Some(TaskStatus::Queued));
        for bad in ["", "done", "QUEUED ", "queued,running"] {
            let err = parse_status(bad).expect_err(bad);
            assert_eq!(err.code, ErrorCode::InvalidStatus);
        }
    }

    #[test]
    fn cursors_are_what_pages_give() {
        let entry = StreamId {
            ms: 1_700_000_000_000,
            seq: 3,
        };
        assert_eq!(
            parse_cursor("1700000000000-3").ok(),
            Some(ListCursor {
                entry,
                partition: 0
            })
        );
        let of_partition = ListCursor {
            entry,
            partition: 2,
        };
        assert_eq!(parse_cursor("1700000000000-3.2").ok(), Some(of_partition));
        assert_eq!(of_partition.to_string(), "1700000000000-3.2");
        for bad in ["", "abc", "(1-0", "1-0-0", "1-0.0", "1-0.x", "1-0."] {
            let err = parse_cursor(bad).expect_err(bad);
            assert_eq!(err.code, ErrorCode::InvalidCursor);
        }
    }
}
