//! `GET /v1/queues/{queue}/events`: a queue's lifecycle events, live, as
//! Server-Sent Events.
//!
//! Each event is one entry of the queue's events stream (`dtq:events:{q}`):
//! `id:` the entry's id, `event:` the task's new status, `data:` `{task_id,
//! status, attempt, at}`. A client resumes where it left off with the
//! `Last-Event-ID` header (an `EventSource` sends it by itself when it
//! reconnects) or `?since=<id>`; without either it gets only new events.
//! `?task_id=` keeps one task's events. A partitioned queue has a stream per
//! partition: `?partition=i` follows partition `i`'s, a `task_id` its
//! task's, and neither partition 0's. The stream is capped, so a client
//! that resumes after an id older than what is left first gets `event:
//! gap` (`data: {last_event_id, oldest_id}`): it missed events, and reading
//! goes on from the oldest entry left.
//!
//! # Costs and bounds
//!
//! Each subscriber blocks in XREAD on a Redis connection of its own, so its
//! wait never stalls the shared connection, and holds one API connection.
//! Both are bounded by [`ApiLimits::max_event_streams`]: past it a new
//! subscriber gets 503 `TOO_MANY_EVENT_STREAMS` at once, before anything
//! is opened. A subscriber's stream ends, and its Redis connection and slot
//! are released, when its client goes away (hyper sees the connection
//! close and drops the response) or the server shuts down ([`StreamsStop`],
//! so that a graceful shutdown never waits on a stream that has no end).
//! A comment every [`KEEP_ALIVE`] keeps proxies from closing a quiet
//! stream. The API's other limits leave a stream alone: the header timeout
//! counts only while a request's headers are awaited, and the body timeout
//! applies to request bodies, which this route does not read.
//!
//! While Redis cannot be read the stream stays open and the read is retried
//! with backoff from the last entry sent, so a Redis restart costs a
//! subscriber nothing it can still be given.
//!
//! [`ApiLimits::max_event_streams`]: super::ApiLimits::max_event_streams

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use utoipa::IntoParams;

use super::Shared;
use super::auth::Scope;
use super::error::{ApiError, ErrorCode};
use super::extract::{ApiPath, ApiQuery};
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, store_call};
use crate::store::{Conn, QueueEvent, Store, StreamId, partition_of_id, partition_queue};

/// How often a quiet stream gets a keep-alive comment.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// How long one XREAD blocks. Shorter than the connection's response
/// timeout ([`READ_TIMEOUT`]), which is how a connection that died without
/// a word is noticed.
const BLOCK: Duration = Duration::from_secs(10);

/// The response timeout of a subscriber's connection.
const READ_TIMEOUT: Duration = Duration::from_secs(15);

/// Entries one XREAD returns at most: what a subscriber holds in memory.
const READ_COUNT: usize = 256;

/// Longest pause between reads while Redis fails.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Longest `task_id` filter accepted, bytes.
const MAX_TASK_ID_BYTES: usize = 256;

/// The bound on concurrent event streams: one slot per subscriber, held
/// until its stream ends.
#[derive(Clone)]
pub(super) struct EventStreams {
    slots: Arc<Semaphore>,
    max: usize,
}

impl EventStreams {
    pub(super) fn new(max: usize) -> Self {
        EventStreams {
            slots: Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))),
            max,
        }
    }

    fn take(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::TooManyEventStreams,
                format!(
                    "this server already serves its {} event streams; retry later",
                    self.max
                ),
            )
            .with_details(json!({"max": self.max}))
        })
    }
}

/// Cancelled when the server shuts down, to end every event stream (an
/// extension the server loop adds; without it streams end only with their
/// clients).
#[derive(Clone, Default)]
pub(super) struct StreamsStop(pub(super) CancellationToken);

/// The query of the events route.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct EventParams {
    /// Continue after this entry id (the `Last-Event-ID` header wins).
    since: Option<String>,
    /// Only this task's events (read from the task's partition).
    task_id: Option<String>,
    /// The partition whose events to follow, on a partitioned queue: each
    /// partition has a stream of its own. Default: the task's with
    /// `task_id`, else 0.
    #[param(minimum = 0)]
    partition: Option<u32>,
}

/// `GET /v1/queues/{queue}/events`.
#[utoipa::path(
    get,
    path = "/v1/queues/{queue}/events",
    tag = "tasks",
    params(
        QueuePath,
        EventParams,
        ("Last-Event-ID" = Option<String>, Header, description = "Continue after this event id (wins over `since`)"),
    ),
    responses(
        (status = 200, description = "Server-Sent Events, without end: `event:` a task's new status with `data:` a `QueueEvent`; `event: gap` with `data:` an `EventGap` when events were missed", content_type = "text/event-stream", body = String),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_EVENT_ID`, `INVALID_QUERY`", body = ErrorBody),
        (status = 503, description = "`TOO_MANY_EVENT_STREAMS`, `STORE_UNAVAILABLE`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub(super) async fn subscribe(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    ApiQuery(params): ApiQuery<EventParams>,
    stop: Option<Extension<StreamsStop>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    let since = resume_point(&headers, params.since.as_deref())?;
    let task = match params.task_id {
        Some(t) if t.is_empty() || t.len() > MAX_TASK_ID_BYTES => {
            return Err(ApiError::new(
                ErrorCode::InvalidQuery,
                format!("task_id must be 1 to {MAX_TASK_ID_BYTES} bytes"),
            ));
        }
        t => t,
    };
    let partition = match (params.partition, &task) {
        (Some(p), _) => p,
        (None, Some(task)) => partition_of_id(task),
        (None, None) => 0,
    };
    if partition > 0 {
        let store = shared.state.store.clone();
        let q = queue.clone();
        let count = store_call(&shared, async move { store.partitioning(&q).await })
            .await?
            .count;
        if partition >= count {
            return Err(ApiError::new(
                ErrorCode::InvalidQuery,
                format!("queue {queue} has {count} partition(s): no partition {partition}"),
            )
            .with_details(json!({"partitions": count})));
        }
    }
    let queue = partition_queue(&queue, partition);
    let slot = shared.events.take()?;
    let store = shared.state.store.clone();
    let q = queue.clone();
    let (start, conn) = store_call(&shared, async move {
        let conn = store.dedicated_connection(READ_TIMEOUT).await?;
        let start = store.events_start(&q, since).await?;
        Ok::<_, crate::store::StoreError>((start, conn))
    })
    .await?;
    tracing::debug!(%queue, after = %start.after, task_id = ?task, "event stream opened");
    let gap = start.gap.map(|gap| {
        Ok::<_, Infallible>(
            Event::default()
                .event("gap")
                .data(gap.to_json().to_string()),
        )
    });
    let reader = Reader {
        store: shared.state.store.clone(),
        conn,
        queue,
        after: start.after,
        task,
        pending: VecDeque::new(),
        failures: 0,
        _slot: slot,
    };
    let events = futures::stream::unfold(reader, |mut reader| async move {
        let event = reader.next().await;
        Some((Ok::<_, Infallible>(event), reader))
    });
    let stop = stop.map(|Extension(stop)| stop.0).unwrap_or_default();
    let stream = futures::stream::iter(gap)
        .chain(events)
        .take_until(stop.cancelled_owned());
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response();
    // Tells nginx not to buffer the stream.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// Where to continue: the `Last-Event-ID` header, else `?since=`, else
/// nowhere (new events only). An empty header is no header.
fn resume_point(headers: &HeaderMap, since: Option<&str>) -> Result<Option<StreamId>, ApiError> {
    let header = headers
        .get("last-event-id")
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .filter(|v| !v.is_empty());
    let Some(text) = header.or(since) else {
        return Ok(None);
    };
    text.parse()
        .map(Some)
        .map_err(|e: crate::store::InvalidStreamId| {
            ApiError::new(ErrorCode::InvalidEventId, e.to_string())
        })
}

/// One subscriber's reading of the stream.
struct Reader {
    store: Store,
    /// The subscriber's own connection, blocked in XREAD most of the time.
    conn: Conn,
    queue: String,
    /// The last entry read (sent or filtered out).
    after: StreamId,
    /// Only this task's events, if set.
    task: Option<String>,
    /// Events read and not yet sent.
    pending: VecDeque<Event>,
    /// Reads failed in a row.
    failures: u32,
    /// The subscriber's slot, released with the reader.
    _slot: OwnedSemaphorePermit,
}

impl Reader {
    /// The next event to send; waits (for ever) until there is one.
    async fn next(&mut self) -> Event {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return event;
            }
            let read = self
                .store
                .read_events(&mut self.conn, &self.queue, self.after, READ_COUNT, BLOCK)
                .await;
            match read {
                Ok(events) => {
                    if self.failures > 0 {
                        tracing::info!(queue = %self.queue, "event stream: Redis read again");
                        self.failures = 0;
                    }
                    for event in events {
                        self.after = event.id;
                        if self.task.as_ref().is_none_or(|t| *t == event.task_id) {
                            self.pending.push_back(sse_event(&event));
                        }
                    }
                }
                Err(e) => {
                    if self.failures == 0 {
                        tracing::warn!(
                            queue = %self.queue,
                            error = %e,
                            "event stream: cannot read Redis; retrying"
                        );
                    }
                    self.failures = self.failures.saturating_add(1);
                    tokio::time::sleep(backoff(self.failures)).await;
                }
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        tracing::debug!(queue = %self.queue, after = %self.after, "event stream closed");
    }
}

/// 100 ms after the first failure, doubling, at most [`MAX_BACKOFF`].
fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    (Duration::from_millis(100) * (1 << exp)).min(MAX_BACKOFF)
}

/// The SSE event of a stream entry. Its name is the status; a status that
/// could not be an event name (none is written) is sent as `unknown`.
fn sse_event(event: &QueueEvent) -> Event {
    let name_ok = !event.status.is_empty()
        && event
            .status
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_');
    Event::default()
        .id(event.id.to_string())
        .event(if name_ok {
            event.status.as_str()
        } else {
            "unknown"
        })
        .data(event.to_json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_wins_over_the_query_and_both_must_be_ids() {
        let mut headers = HeaderMap::new();
        assert_eq!(resume_point(&headers, None).ok(), Some(None));
        assert_eq!(
            resume_point(&headers, Some("5-1")).ok(),
            Some(Some(StreamId { ms: 5, seq: 1 }))
        );
        headers.insert("last-event-id", HeaderValue::from_static("7-0"));
        assert_eq!(
            resume_point(&headers, Some("5-1")).ok(),
            Some(Some(StreamId { ms: 7, seq: 0 }))
        );
        headers.insert("last-event-id", HeaderValue::from_static(""));
        assert_eq!(resume_point(&headers, None).ok(), Some(None));
        headers.insert("last-event-id", HeaderValue::from_static("x"));
        let err = resume_point(&headers, None).expect_err("not an id");
        assert_eq!(err.code, ErrorCode::InvalidEventId);
        let err = resume_point(&HeaderMap::new(), Some("$")).expect_err("not an id");
        assert_eq!(err.code, ErrorCode::InvalidEventId);
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(2), Duration::from_millis(200));
        assert_eq!(backoff(7), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }

    #[test]
    fn the_slots_run_out_and_come_back() {
        let streams = EventStreams::new(1);
        let first = streams.take().expect("a slot");
        let err = streams.take().expect_err("no slot left");
        assert_eq!(err.code, ErrorCode::TooManyEventStreams);
        drop(first);
        assert!(streams.take().is_ok());
        assert!(EventStreams::new(0).take().is_err());
    }
}
