//! A subscriber's reading of its streams: blocked in XREAD on connections
//! of its own, retried with backoff while Redis fails, merged when it
//! follows several partitions, filtered to one task if asked, each event
//! given its task's name.
//!
//! The events stream holds what changes (task id, status, attempt, time)
//! and not the task name, so that the scripts that write an event per task
//! stay small; a subscriber reads the names of a batch's tasks from their
//! records in one pipelined round trip, and keeps the names it has read
//! ([`MAX_CACHED_NAMES`]; a task's name never changes), so the usual
//! QUEUED, then SUCCEEDED costs one read per task.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use axum::response::sse::Event;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;

use crate::store::{Conn, EventId, QueueEvent, Store};

/// How long one XREAD blocks. Shorter than the connection's response
/// timeout ([`READ_TIMEOUT`](super::READ_TIMEOUT)), which is how a connection that died without
/// a word is noticed.
const BLOCK: Duration = Duration::from_secs(10);

/// Entries one XREAD returns at most, over all the streams it reads: what
/// a subscriber holds in memory (an entry of a completion batch holds up
/// to a batch of events).
const READ_COUNT: usize = 64;

/// Task names a subscriber keeps, by task id: a batch that would pass it
/// starts the cache afresh, so a subscriber holds at most this many (or
/// one batch's, if more).
const MAX_CACHED_NAMES: usize = 4_096;

/// Longest pause between reads while Redis fails.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The reading of some partitions' events streams on one connection: every
/// partition's on one server, one partition's on a cluster.
pub(super) struct PartReader {
    pub(super) store: Store,
    /// A connection of its own, blocked in XREAD most of the time.
    pub(super) conn: Conn,
    /// The partitions' key sets (the queue's name for partition 0).
    pub(super) queues: Vec<String>,
    /// The last event read (sent or filtered out) of each.
    pub(super) after: Vec<EventId>,
    /// Backoff waits since the last good read.
    pub(super) failures: u32,
    /// Whether the last failed read was followed by another at once, for
    /// a broken connection, rather than by a backoff.
    pub(super) skipped: bool,
}

impl PartReader {
    /// The next entries, each with the index of its partition in
    /// `queues`; waits until there are some, retrying while Redis fails.
    async fn read(&mut self) -> Vec<(usize, QueueEvent)> {
        loop {
            let read = self
                .store
                .read_events_of(
                    &mut self.conn,
                    &self.queues,
                    &mut self.after,
                    (READ_COUNT / self.queues.len().max(1)).max(1),
                    BLOCK,
                )
                .await;
            match read {
                Ok(events) => {
                    if self.failures > 0 || self.skipped {
                        tracing::info!(queues = ?self.queues, "event stream: Redis read again");
                        self.failures = 0;
                        self.skipped = false;
                    }
                    if !events.is_empty() {
                        return events;
                    }
                }
                Err(e) => {
                    if self.failures == 0 && !self.skipped {
                        tracing::warn!(
                            queues = ?self.queues,
                            error = %e,
                            "event stream: cannot read Redis; retrying"
                        );
                    }
                    tracing::debug!(queues = ?self.queues, error = %e, "event stream: read failed");
                    // A read that found its connection broken is made again
                    // at once, on the new one, unless the one before it was:
                    // a new connection left idle through the backoff could
                    // be cut too, on a link that drops idle connections, and
                    // so could every one after it.
                    if e.is_connection_dropped() && !self.skipped {
                        self.skipped = true;
                        continue;
                    }
                    self.skipped = false;
                    self.failures = self.failures.saturating_add(1);
                    tokio::time::sleep(backoff(self.failures)).await;
                }
            }
        }
    }
}

impl Drop for PartReader {
    fn drop(&mut self) {
        tracing::debug!(queues = ?self.queues, after = ?self.after, "event stream closed");
    }
}

/// One subscriber's reading: of one stream, or of every partition's,
/// merged.
pub(super) struct Reader {
    source: Source,
    /// Only this task's events, if set.
    task: Option<String>,
    /// Where each stream read stands: the last event of each partition
    /// read (sent or filtered out). With several, the event id is where
    /// every partition stands, `<id 0>,<id 1>,...`, which a subscriber
    /// resumes from as it is.
    positions: Vec<EventId>,
    /// The key set (partition) of each stream read, in `positions`' order:
    /// where its events' task records are.
    streams: Vec<String>,
    /// For the task names.
    store: Store,
    /// The names read, by task id.
    names: HashMap<String, String>,
    /// Events read and not yet sent.
    pending: VecDeque<Event>,
    /// The subscriber's slots, released with the reader.
    _slot: OwnedSemaphorePermit,
}

enum Source {
    /// Every stream read here, on one connection.
    One(Box<PartReader>),
    /// One stream per connection (a cluster's partitions), each read by a
    /// task of its own (each blocks on its own connection, to its own
    /// shard), whose events arrive in order per partition, with the
    /// partition's index.
    Merged {
        events: mpsc::Receiver<(usize, QueueEvent)>,
        /// Aborted with the reader.
        _readers: JoinSet<()>,
    },
}

impl Reader {
    pub(super) fn new(
        store: Store,
        mut parts: Vec<PartReader>,
        task: Option<String>,
        slot: OwnedSemaphorePermit,
    ) -> Self {
        let positions = parts.iter().flat_map(|p| p.after.clone()).collect();
        let streams = parts.iter().flat_map(|p| p.queues.clone()).collect();
        let source = if parts.len() == 1 {
            Source::One(Box::new(parts.remove(0)))
        } else {
            let (tx, rx) = mpsc::channel(READ_COUNT);
            let mut readers = JoinSet::new();
            for (i, mut part) in parts.into_iter().enumerate() {
                let tx = tx.clone();
                readers.spawn(async move {
                    loop {
                        for (_, event) in part.read().await {
                            if tx.send((i, event)).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
            Source::Merged {
                events: rx,
                _readers: readers,
            }
        };
        Reader {
            source,
            task,
            positions,
            streams,
            store,
            names: HashMap::new(),
            pending: VecDeque::new(),
            _slot: slot,
        }
    }

    /// The next event to send; waits (for ever) until there is one.
    pub(super) async fn next(&mut self) -> Event {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return event;
            }
            let read = match &mut self.source {
                Source::One(part) => part.read().await,
                // The readers end only with this reader.
                Source::Merged { events, .. } => match events.recv().await {
                    Some(first) => {
                        let mut batch = vec![first];
                        while batch.len() < READ_COUNT
                            && let Ok(more) = events.try_recv()
                        {
                            batch.push(more);
                        }
                        batch
                    }
                    None => return std::future::pending().await,
                },
            };
            let mut kept = Vec::with_capacity(read.len());
            for (i, event) in read {
                self.positions[i] = event.id;
                if self.task.as_ref().is_some_and(|t| *t != event.task_id) {
                    continue;
                }
                let id = match self.positions.as_slice() {
                    [_] => event.id.to_string(),
                    all => all
                        .iter()
                        .map(EventId::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                };
                kept.push((i, event, id));
            }
            self.read_names(&kept).await;
            for (_, event, id) in kept {
                let name = self.names.get(&event.task_id).map(String::as_str);
                self.pending.push_back(sse_event(&event, name, id));
            }
        }
    }

    /// Read the names of the tasks of `events` not known yet, in one
    /// round trip. A failure leaves them unknown (the events go out with a
    /// null name rather than wait for Redis).
    async fn read_names(&mut self, events: &[(usize, QueueEvent, String)]) {
        // Cleared before the batch, not during it, so that every name the
        // batch needs is kept or read.
        if self.names.len() + events.len() > MAX_CACHED_NAMES {
            self.names.clear();
        }
        let mut asked: Vec<(&str, &str)> = Vec::new();
        let mut seen = HashSet::new();
        for (i, event, _) in events {
            let id = event.task_id.as_str();
            if !self.names.contains_key(id) && seen.insert(id) {
                asked.push((self.streams[*i].as_str(), id));
            }
        }
        if asked.is_empty() {
            return;
        }
        match self.store.task_names(&asked).await {
            Ok(found) => {
                for ((_, id), name) in asked.into_iter().zip(found) {
                    if let Some(name) = name {
                        self.names.insert(id.to_owned(), name);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "event stream: cannot read task names");
            }
        }
    }
}

/// 100 ms after the first failure, doubling, at most [`MAX_BACKOFF`].
fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    (Duration::from_millis(100) * (1 << exp)).min(MAX_BACKOFF)
}

/// The SSE event of a stream entry, with event id `id`: its data the
/// entry's fields and the task's name `task`. Its name is the status; a
/// status that could not be an event name (none is written) is sent as
/// `unknown`.
fn sse_event(event: &QueueEvent, task: Option<&str>, id: String) -> Event {
    let name_ok = !event.status.is_empty()
        && event
            .status
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_');
    Event::default()
        .id(id)
        .event(if name_ok {
            event.status.as_str()
        } else {
            "unknown"
        })
        .data(event_data(event, task).to_string())
}

/// The data of an event: `{task_id, task, status, attempt, at}`.
fn event_data(event: &QueueEvent, task: Option<&str>) -> serde_json::Value {
    let mut data = event.to_json();
    if let Some(fields) = data.as_object_mut() {
        fields.insert("task".into(), task.into());
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_carries_its_task_name_or_null() {
        let event = QueueEvent {
            id: EventId::default(),
            task_id: "t1".into(),
            status: "QUEUED".into(),
            attempt: Some(0),
            at: Some(5),
            progress: None,
        };
        assert_eq!(
            event_data(&event, Some("echo")),
            serde_json::json!({"task_id": "t1", "task": "echo", "status": "QUEUED", "attempt": 0, "at": 5})
        );
        assert_eq!(event_data(&event, None)["task"], serde_json::Value::Null);
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(2), Duration::from_millis(200));
        assert_eq!(backoff(7), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
