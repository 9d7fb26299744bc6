//! `GET /v1/queues/{queue}/events`: a queue's lifecycle events, live, as
//! Server-Sent Events.
//!
//! Each event comes from the queue's events stream (`dtq:events:{q}`),
//! whose entries hold one event each or, from a batch, several: `id:` the
//! event's id (the entry's id, `<entry>.<k>` for the `k`-th event of an
//! entry when more follow it there), `event:` the task's new status,
//! `data:` `{task_id, task, status, attempt, at}`, where `task` (the task's
//! name) is not in the stream but read from the task's record as the event
//! is sent (`reader.rs`; null once the record is gone). A client resumes
//! where it left off with the `Last-Event-ID` header (an `EventSource` sends
//! it by itself when it reconnects) or `?since=<id>`; without either it gets
//! only new events. `?task_id=` keeps one task's events. A partitioned queue has a
//! stream per partition: `?partition=i` follows partition `i`'s, a
//! `task_id` its task's, and neither every partition's, merged (each
//! partition's events in their order; the event id is then where each
//! partition stands, `<id 0>,<id 1>,...`, which resumes as any id does).
//! The stream is capped, so a client that resumes after an id older than
//! what is left first gets `event: gap` (`data: {last_event_id,
//! oldest_id}`): it missed events, and reading goes on from the oldest
//! entry left.
//!
//! # Costs and bounds
//!
//! Each subscriber blocks in XREAD on a Redis connection of its own, so its
//! wait never stalls the shared connection, and holds one API connection.
//! On one Redis server that is one connection whatever the partition count:
//! one XREAD reads every partition's stream. On a Redis Cluster each
//! partition is a slot of its own, which no one command spans, so a
//! subscriber of every partition blocks on a connection per partition, and
//! each counts as a stream.
//! Redis connections are bounded by [`ApiLimits::max_event_streams`]: a
//! subscriber takes a slot per connection it opens, and past the bound a
//! new subscriber gets 503 `TOO_MANY_EVENT_STREAMS` at once, before
//! anything is opened. A subscriber's stream ends, and its Redis connection and slot
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

mod reader;

use reader::{PartReader, Reader};

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::{ApiPath, ApiQuery};
use super::openapi::ErrorBody;
use super::openapi::schemas::QueuePath;
use super::routes::{authorized, store_call};
use crate::base::ErrorCode;
use crate::store::{EventId, EventsGap, partition_of_id, partition_queue};

/// How often a quiet stream gets a keep-alive comment.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The response timeout of a subscriber's connection.
const READ_TIMEOUT: Duration = Duration::from_secs(15);

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

    /// Slots for a subscriber that opens `conns` Redis connections.
    fn take(&self, conns: usize) -> Result<OwnedSemaphorePermit, ApiError> {
        let refused = || {
            ApiError::new(
                ErrorCode::TooManyEventStreams,
                format!(
                    "this server already serves as many event streams as its {} Redis \
                     connections for them allow (this one needs {conns}); retry later",
                    self.max
                ),
            )
            .with_details(json!({"max": self.max, "needed": conns}))
        };
        let n = u32::try_from(conns).map_err(|_| refused())?;
        self.slots
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| refused())
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
    /// Continue after this event id (the `Last-Event-ID` header wins):
    /// `<ms>-<seq>`, `<ms>-<seq>.<k>` or `<ms>`, decimal.
    #[param(pattern = r"^[0-9]{1,19}(-[0-9]{1,19})?(\.[0-9]{1,9})?$")]
    since: Option<String>,
    /// Only this task's events (read from the task's partition).
    #[param(min_length = 1, max_length = 256)]
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
        ("Last-Event-ID" = Option<String>, Header, pattern = r"^[0-9]{1,19}(-[0-9]{1,19})?(\.[0-9]{1,9})?$", description = "Continue after this event id (wins over `since`)"),
    ),
    responses(
        (status = 200, description = "Server-Sent Events, without end: `event:` a task's new status with `data:` a `QueueEvent`; `event: gap` with `data:` an `EventGap` when events were missed", content_type = "text/event-stream", body = String),
        (status = 400, description = "`INVALID_QUEUE_NAME`, `INVALID_EVENT_ID`, `INVALID_QUERY`", body = ErrorBody),
        (status = 409, description = "`EVENTS_OFF`: the server runs with `--events none`", body = ErrorBody),
        (status = 503, description = "`TOO_MANY_EVENT_STREAMS`, `STORE_UNAVAILABLE`", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn subscribe(
    State(shared): State<Shared>,
    ApiPath(queue): ApiPath<String>,
    ApiQuery(params): ApiQuery<EventParams>,
    stop: Option<Extension<StreamsStop>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&shared.auth, &headers, Scope::Read, &queue)?;
    if shared.state.store.settings().events_max_len == 0 {
        return Err(ApiError::new(
            ErrorCode::EventsOff,
            "this server writes no lifecycle events (--events none)",
        ));
    }
    let since = resume_point(&headers, params.since.as_deref())?;
    let task = task_filter(params.task_id)?;
    let store = shared.state.store.clone();
    let q = queue.clone();
    let count = store_call(&shared, async move { store.partitioning(&q).await })
        .await?
        .count;
    let partitions = partitions_to_read(&queue, count, params.partition, task.as_deref())?;
    let since = resume_each(since, partitions.len())?;
    let names: Vec<String> = partitions
        .iter()
        .map(|p| partition_queue(&queue, *p))
        .collect();
    let (parts, gaps, slot) = open(&shared, &names, since).await?;
    tracing::debug!(partitions = ?names, task_id = ?task, "event stream opened");
    let stop = stop.map(|Extension(stop)| stop.0).unwrap_or_default();
    let reader = Reader::new(shared.state.store.clone(), parts, task, slot);
    Ok(event_stream(gaps, reader, stop))
}

/// The `task_id` filter, checked.
fn task_filter(task_id: Option<String>) -> Result<Option<String>, ApiError> {
    match task_id {
        Some(t) if t.is_empty() || t.len() > MAX_TASK_ID_BYTES => Err(ApiError::new(
            ErrorCode::InvalidQuery,
            format!("task_id must be 1 to {MAX_TASK_ID_BYTES} bytes"),
        )),
        t => Ok(t),
    }
}

/// The partitions whose streams a subscriber reads, of `count`: the one
/// asked for, the task's, or the only one; else every partition's, merged.
fn partitions_to_read(
    queue: &str,
    count: u32,
    partition: Option<u32>,
    task: Option<&str>,
) -> Result<Vec<u32>, ApiError> {
    let partitions: Vec<u32> = match (partition, task) {
        (Some(p), _) => vec![p],
        (None, Some(task)) => vec![partition_of_id(task)],
        (None, None) => (0..count).collect(),
    };
    if let Some(p) = partitions.iter().find(|p| **p >= count) {
        return Err(ApiError::new(
            ErrorCode::InvalidQuery,
            format!("queue {queue} has {count} partition(s): no partition {p}"),
        )
        .with_details(json!({"partitions": count})));
    }
    Ok(partitions)
}

/// Where each of `n` streams continues.
fn resume_each(since: Option<Resume>, n: usize) -> Result<Vec<Option<EventId>>, ApiError> {
    match since {
        None => Ok(vec![None; n]),
        Some(Resume::Each(id)) => Ok(vec![Some(id); n]),
        Some(Resume::Per(ids)) if ids.len() == n => Ok(ids.into_iter().map(Some).collect()),
        Some(Resume::Per(ids)) => Err(ApiError::new(
            ErrorCode::InvalidEventId,
            format!(
                "an event id of {} partitions for a stream of {n}",
                ids.len(),
            ),
        )),
    }
}

/// Take the slots of a subscriber of the streams of `names`, find where
/// each continues (and what it missed), and open its connections: one on
/// one server, one per partition on a cluster.
async fn open(
    shared: &Shared,
    names: &[String],
    since: Vec<Option<EventId>>,
) -> Result<(Vec<PartReader>, Vec<EventsGap>, OwnedSemaphorePermit), ApiError> {
    let per_conn = if shared.state.store.backend().is_cluster() {
        1
    } else {
        names.len().max(1)
    };
    let slot = shared.events.take(names.len().div_ceil(per_conn))?;
    let store = shared.state.store.clone();
    let opened = names.to_vec();
    let (parts, gaps) = store_call(shared, async move {
        let mut starts = Vec::with_capacity(opened.len());
        for (name, since) in opened.iter().zip(since) {
            starts.push(store.events_start(name, since).await?);
        }
        let gaps: Vec<_> = starts.iter().filter_map(|s| s.gap.clone()).collect();
        let mut parts = Vec::new();
        for (queues, starts) in opened.chunks(per_conn).zip(starts.chunks(per_conn)) {
            parts.push(PartReader {
                conn: store.dedicated_connection(READ_TIMEOUT).await?,
                store: store.clone(),
                queues: queues.to_vec(),
                after: starts.iter().map(|s| s.after).collect(),
                failures: 0,
                skipped: false,
            });
        }
        Ok::<_, crate::store::StoreError>((parts, gaps))
    })
    .await?;
    Ok((parts, gaps, slot))
}

/// The response: a `gap` event for each stream that missed events, then
/// what `reader` reads, until `stop`; a keep-alive comment while quiet.
fn event_stream(gaps: Vec<EventsGap>, reader: Reader, stop: CancellationToken) -> Response {
    let gaps: Vec<_> = gaps
        .iter()
        .map(|gap| {
            Ok::<_, Infallible>(
                Event::default()
                    .event("gap")
                    .data(gap.to_json().to_string()),
            )
        })
        .collect();
    let events = futures::stream::unfold(reader, |mut reader| async move {
        let event = reader.next().await;
        Some((Ok::<_, Infallible>(event), reader))
    });
    let stream = futures::stream::iter(gaps)
        .chain(events)
        .take_until(stop.cancelled_owned());
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response();
    // Tells nginx not to buffer the stream.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// Where a subscriber continues.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resume {
    /// After this id in every stream it reads (an id of one stream, or a
    /// time: `<ms>-0`).
    Each(EventId),
    /// After the id of each partition's stream: an id of a merged stream
    /// (`<id of partition 0>,<id of partition 1>,...`).
    Per(Vec<EventId>),
}

/// Where to continue: the `Last-Event-ID` header, else `?since=`, else
/// nowhere (new events only). An empty header is no header.
fn resume_point(headers: &HeaderMap, since: Option<&str>) -> Result<Option<Resume>, ApiError> {
    let header = headers
        .get("last-event-id")
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .filter(|v| !v.is_empty());
    let Some(text) = header.or(since) else {
        return Ok(None);
    };
    let invalid =
        |e: crate::store::InvalidEventId| ApiError::new(ErrorCode::InvalidEventId, e.to_string());
    if text.contains(',') {
        let ids = text
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<EventId>, _>>()
            .map_err(invalid)?;
        return Ok(Some(Resume::Per(ids)));
    }
    text.parse()
        .map(|id| Some(Resume::Each(id)))
        .map_err(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_wins_over_the_query_and_both_must_be_ids() {
        let id = |ms, seq| EventId::from(crate::store::StreamId { ms, seq });
        let mut headers = HeaderMap::new();
        assert_eq!(resume_point(&headers, None).ok(), Some(None));
        assert_eq!(
            resume_point(&headers, Some("5-1")).ok(),
            Some(Some(Resume::Each(id(5, 1))))
        );
        headers.insert("last-event-id", HeaderValue::from_static("7-0"));
        assert_eq!(
            resume_point(&headers, Some("5-1")).ok(),
            Some(Some(Resume::Each(id(7, 0))))
        );
        // An event inside an entry of several.
        headers.insert("last-event-id", HeaderValue::from_static("7-0.4"));
        assert_eq!(
            resume_point(&headers, None).ok(),
            Some(Some(Resume::Each(EventId {
                index: Some(4),
                ..id(7, 0)
            })))
        );
        // A merged stream's id: one per partition.
        headers.insert("last-event-id", HeaderValue::from_static("7-0,0-0,9-2.1"));
        assert_eq!(
            resume_point(&headers, None).ok(),
            Some(Some(Resume::Per(vec![
                id(7, 0),
                EventId::default(),
                EventId {
                    index: Some(1),
                    ..id(9, 2)
                }
            ])))
        );
        headers.insert("last-event-id", HeaderValue::from_static("7-0,"));
        let err = resume_point(&headers, None).expect_err("an empty part");
        assert_eq!(err.code, ErrorCode::InvalidEventId);
        headers.insert("last-event-id", HeaderValue::from_static(""));
        assert_eq!(resume_point(&headers, None).ok(), Some(None));
        headers.insert("last-event-id", HeaderValue::from_static("x"));
        let err = resume_point(&headers, None).expect_err("not an id");
        assert_eq!(err.code, ErrorCode::InvalidEventId);
        let err = resume_point(&HeaderMap::new(), Some("$")).expect_err("not an id");
        assert_eq!(err.code, ErrorCode::InvalidEventId);
    }

    #[test]
    fn the_slots_run_out_and_come_back() {
        let streams = EventStreams::new(1);
        let first = streams.take(1).expect("a slot");
        let err = streams.take(1).expect_err("no slot left");
        assert_eq!(err.code, ErrorCode::TooManyEventStreams);
        drop(first);
        assert!(streams.take(1).is_ok());
        assert!(EventStreams::new(0).take(1).is_err());
        // A subscriber of several connections takes a slot for each.
        let streams = EventStreams::new(3);
        let two = streams.take(2).expect("two slots");
        assert!(streams.take(2).is_err());
        drop(two);
        assert!(streams.take(3).is_ok());
        assert!(EventStreams::new(3).take(4).is_err());
    }
}
