//! A subscriber's reading of its streams: blocked in XREAD on connections
//! of its own, retried with backoff while Redis fails, merged when it
//! follows several partitions, filtered to one task if asked.

use std::collections::VecDeque;
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
    /// Reads failed in a row.
    pub(super) failures: u32,
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
                    if self.failures > 0 {
                        tracing::info!(queues = ?self.queues, "event stream: Redis read again");
                        self.failures = 0;
                    }
                    if !events.is_empty() {
                        return events;
                    }
                }
                Err(e) => {
                    if self.failures == 0 {
                        tracing::warn!(
                            queues = ?self.queues,
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
        mut parts: Vec<PartReader>,
        task: Option<String>,
        slot: OwnedSemaphorePermit,
    ) -> Self {
        let positions = parts.iter().flat_map(|p| p.after.clone()).collect();
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
                    Some(event) => vec![event],
                    None => return std::future::pending().await,
                },
            };
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
                self.pending.push_back(sse_event(&event, id));
            }
        }
    }
}

/// 100 ms after the first failure, doubling, at most [`MAX_BACKOFF`].
fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    (Duration::from_millis(100) * (1 << exp)).min(MAX_BACKOFF)
}

/// The SSE event of a stream entry, with event id `id`. Its name is the
/// status; a status that could not be an event name (none is written) is
/// sent as `unknown`.
fn sse_event(event: &QueueEvent, id: String) -> Event {
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
        .data(event.to_json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap() {
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(2), Duration::from_millis(200));
        assert_eq!(backoff(7), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
