//! A queue's lifecycle events, read back: the capped events stream
//! (`dtq:events:{q}`) that every script appends to (`addEvent`, or
//! `pushEvent` and `flushEvents`, in `lua/include/idem.lua`), as live
//! subscribers of `GET /v1/queues/{q}/events` read it.
//!
//! An entry holds one event, with its four fields (`task_id`, `status`,
//! `attempt`, `at`; a `PROGRESS` event also `fraction` and `message`, see
//! `progress.rs`), or several: `complete` and `start` write one entry per
//! batch, a pair per event (the task id, then `<status> <attempt> <at>`),
//! which saves Redis an XADD per task. An event's id ([`EventId`]) is its
//! entry's id, with the event's place in the entry when more events follow
//! it there, so that a subscriber resumes inside an entry without losing or
//! repeating any.
//!
//! A subscriber starts at a position ([`Store::events_start`]: after an id
//! it saw, or after the newest entry) and then blocks in XREAD on a
//! connection of its own ([`Store::read_events`]), so that its wait never
//! stalls the shared connection; one XREAD reads every partition of a
//! queue on one server ([`Store::read_events_of`]). The stream is capped (`MAXLEN ~`, in
//! entries), so a subscriber that comes back after an id older than what is
//! left has missed events: [`EventsGap`] says so.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use redis::Value;
use serde_json::{Value as Json, json};

use super::stream_id::{InvalidStreamId, StreamId, decimal};
use super::{Conn, QueueKeys, Store, StoreError, from_value};

/// Most events in one entry of a batch's (`EVENTS_PER_ENTRY` in
/// `lua/include/idem.lua`, which writes the scripts' entries).
pub(super) const EVENTS_PER_ENTRY: usize = 128;

/// Where an event is: its entry in the events stream and, in an entry of
/// several events, its place there. Written `<entry>` for an entry's last
/// (or only) event and `<entry>.<k>` for its `k`-th (from 0) when more
/// follow in the same entry: the `id:` of an SSE event, and what a
/// subscriber resumes after. A bare entry id resumes after the whole entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EventId {
    /// The entry.
    pub entry: StreamId,
    /// The event's place in the entry, `None` for its last.
    pub index: Option<u32>,
}

/// In stream order: by entry, then by place in the entry (an entry's last
/// event, without one, after the others).
impl Ord for EventId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let place = |index: Option<u32>| index.map_or(u64::MAX, u64::from);
        (self.entry, place(self.index)).cmp(&(other.entry, place(other.index)))
    }
}

impl PartialOrd for EventId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl From<StreamId> for EventId {
    fn from(entry: StreamId) -> Self {
        EventId { entry, index: None }
    }
}

/// Text that is not an event id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an event id (`<ms>-<seq>`, `<ms>-<seq>.<k>` or `<ms>`, decimal)")]
pub struct InvalidEventId(pub String);

impl FromStr for EventId {
    type Err = InvalidEventId;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidEventId(text.chars().take(64).collect());
        let (entry, index) = match text.split_once('.') {
            Some((entry, index)) => {
                let index = decimal(index).and_then(|k| u32::try_from(k).ok());
                (entry, Some(index.ok_or_else(bad)?))
            }
            None => (text, None),
        };
        Ok(EventId {
            entry: entry.parse().map_err(|_| bad())?,
            index,
        })
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index {
            Some(k) => write!(f, "{}.{k}", self.entry),
            None => write!(f, "{}", self.entry),
        }
    }
}

/// One lifecycle event: a task reached `status`; or, with status
/// `PROGRESS`, its running attempt reported how far it is.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueEvent {
    /// Where it is in the events stream.
    pub id: EventId,
    /// The task.
    pub task_id: String,
    /// Its new status (`QUEUED`, `RUNNING`, ...).
    pub status: String,
    /// The attempt the event belongs to (0 before the first), when known.
    pub attempt: Option<u64>,
    /// When it happened (ms since epoch, the writer's clock).
    pub at: Option<u64>,
    /// A `PROGRESS` event's fraction (0 to 1) and message.
    pub progress: Option<(f64, String)>,
}

impl QueueEvent {
    /// The event as the API sends it: `{task_id, status, attempt, at}`,
    /// and a `PROGRESS` event's `progress: {fraction, message,
    /// updated_at}`, as the task shows it.
    pub fn to_json(&self) -> Json {
        let mut event = json!({
            "task_id": self.task_id,
            "status": self.status,
            "attempt": self.attempt,
            "at": self.at,
        });
        if let Some((fraction, message)) = &self.progress {
            event["progress"] =
                json!({"fraction": fraction, "message": message, "updated_at": self.at});
        }
        event
    }

    /// The events of stream entry `id`, whose body is `[field, value,
    /// ...]`: one event's four fields, or a batch's pairs of a task id and
    /// `<status> <attempt> <at>`. An event without a status (none is
    /// written) is left out.
    pub fn from_entry(id: StreamId, body: Vec<String>) -> Vec<QueueEvent> {
        let single = body
            .first()
            .is_some_and(|f| matches!(f.as_str(), "task_id" | "status" | "attempt" | "at"));
        let mut pairs = body.into_iter();
        // (task id, status, attempt, at) of each event, in order.
        let mut found = Vec::new();
        // A PROGRESS event's (fraction, message): a single event's.
        let mut progress = None;
        if single {
            let (mut task_id, mut status, mut attempt, mut at) = (None, None, None, None);
            let (mut fraction, mut message) = (None, None);
            while let (Some(field), Some(value)) = (pairs.next(), pairs.next()) {
                match field.as_str() {
                    "task_id" => task_id = Some(value),
                    "status" => status = Some(value),
                    "attempt" => attempt = value.parse().ok(),
                    "at" => at = value.parse().ok(),
                    "fraction" => fraction = value.parse::<f64>().ok(),
                    "message" => message = Some(value),
                    _ => {}
                }
            }
            progress = fraction.map(|f| (f, message.unwrap_or_default()));
            found.extend(task_id.zip(status).map(|(t, s)| (t, s, attempt, at)));
        } else {
            while let (Some(task_id), Some(value)) = (pairs.next(), pairs.next()) {
                let mut parts = value.splitn(3, ' ');
                let Some(status) = parts.next().filter(|s| !s.is_empty()) else {
                    continue;
                };
                let mut number = || parts.next().and_then(|n| n.parse().ok());
                let (attempt, at) = (number(), number());
                found.push((task_id, status.to_owned(), attempt, at));
            }
        }
        let last = found.len().saturating_sub(1);
        found
            .into_iter()
            .enumerate()
            .map(|(i, (task_id, status, attempt, at))| QueueEvent {
                id: EventId {
                    entry: id,
                    index: (i < last).then(|| u32::try_from(i).unwrap_or(u32::MAX)),
                },
                task_id,
                status,
                attempt,
                at,
                progress: progress.take(),
            })
            .collect()
    }
}

/// Where a subscriber starts reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsStart {
    /// Read the events after this one.
    pub after: EventId,
    /// Entries after the id asked for were trimmed before it could be read.
    pub gap: Option<EventsGap>,
}

/// Events a subscriber missed: the stream was trimmed past the id it
/// asked to continue after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsGap {
    /// The id the subscriber asked to continue after.
    pub last_event_id: EventId,
    /// The oldest entry left, where reading resumes (`None`: the stream
    /// is empty now).
    pub oldest_id: Option<StreamId>,
}

impl EventsGap {
    /// The gap as the API sends it.
    pub fn to_json(&self) -> Json {
        json!({
            "last_event_id": self.last_event_id.to_string(),
            "oldest_id": self.oldest_id.map(|id| id.to_string()),
        })
    }
}

/// What `XINFO STREAM` says of an events stream.
struct StreamInfo {
    last_generated: StreamId,
    first_entry: Option<StreamId>,
    length: u64,
    /// Entries ever added (Redis 7 and later): more than `length` once
    /// some were trimmed.
    entries_added: Option<u64>,
    /// The newest entry ever deleted by XDEL (Redis 7 and later; trims do
    /// not count here).
    max_deleted: Option<StreamId>,
}

impl StreamInfo {
    /// Whether entries after `since` were removed before they could be
    /// read. Trims remove the oldest entries, so they removed some after
    /// `since` if any were removed and `since` is older than the oldest
    /// left (or than the newest ever, with none left). When `since` was
    /// itself the last entry trimmed, nothing after it was: that case is
    /// reported as a gap too, the one answer that can be wrong, and on the
    /// side of caution. Without Redis 7's `entries-added`, any trim counts.
    fn trimmed_after(&self, since: StreamId) -> bool {
        let removed_any = self.entries_added.is_none_or(|added| added > self.length);
        let oldest_newer = match self.first_entry {
            Some(first) => first > since,
            None => self.last_generated > since,
        };
        (removed_any && oldest_newer) || self.max_deleted.is_some_and(|d| d > since)
    }
}

impl Store {
    /// Where a subscriber of `queue`'s events starts: after `since` (an id
    /// it saw), or after the newest entry (only new events) without one.
    ///
    /// A `since` newer than anything the stream holds (the stream was
    /// deleted, or Redis restarted empty) starts after the newest entry.
    /// A `since` older than a trimmed entry reports the gap, and reading
    /// resumes at the oldest entry left.
    pub async fn events_start(
        &self,
        queue: &str,
        since: Option<EventId>,
    ) -> Result<EventsStart, StoreError> {
        let keys = QueueKeys::new(queue);
        let Some(info) = self.stream_info(&keys.events).await? else {
            // No stream yet: every entry to come is new.
            return Ok(EventsStart {
                after: EventId::default(),
                gap: None,
            });
        };
        let Some(since) = since.filter(|since| since.entry <= info.last_generated) else {
            return Ok(EventsStart {
                after: info.last_generated.into(),
                gap: None,
            });
        };
        // Events after one inside an entry are lost with that entry, so a
        // trim of the entry itself is a gap then too: `trimmed_after` of
        // the entry says so (its oldest left is newer).
        Ok(EventsStart {
            after: since,
            gap: info.trimmed_after(since.entry).then_some(EventsGap {
                last_event_id: since,
                oldest_id: info.first_entry,
            }),
        })
    }

    async fn stream_info(&self, key: &str) -> Result<Option<StreamInfo>, StoreError> {
        let reply: Result<HashMap<String, Value>, _> = self
            .trip(
                "events_info",
                redis::cmd("XINFO")
                    .arg("STREAM")
                    .arg(key)
                    .query_async(&mut self.conn.clone()),
            )
            .await;
        let mut info = match reply {
            Ok(info) => info,
            Err(e) if e.detail().is_some_and(|d| d.contains("no such key")) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let id = |v: Option<Value>| -> Result<Option<StreamId>, StoreError> {
            match v {
                None | Some(Value::Nil) => Ok(None),
                Some(v) => {
                    let text: String = from_value(Some(v))?;
                    text.parse()
                        .map(Some)
                        .map_err(|e: InvalidStreamId| StoreError::Protocol(e.to_string()))
                }
            }
        };
        // `first-entry` is `[id, [field, value, ...]]`, or nil when empty.
        let first_entry = match info.remove("first-entry") {
            None | Some(Value::Nil) => None,
            Some(entry) => {
                let (first, _): (String, Value) = from_value(Some(entry))?;
                Some(
                    first
                        .parse()
                        .map_err(|e: InvalidStreamId| StoreError::Protocol(e.to_string()))?,
                )
            }
        };
        let number = |v: Option<Value>| -> Result<Option<u64>, StoreError> {
            v.map(|v| from_value(Some(v))).transpose()
        };
        Ok(Some(StreamInfo {
            last_generated: id(info.remove("last-generated-id"))?.unwrap_or_default(),
            first_entry,
            length: number(info.remove("length"))?.unwrap_or(0),
            entries_added: number(info.remove("entries-added"))?,
            max_deleted: id(info.remove("max-deleted-entry-id"))?,
        }))
    }

    /// The events of up to `count` entries of `queue` after `after`,
    /// blocking up to `block` while there are none; `after` moves to the
    /// last event read. `conn` must be a connection of the caller's own
    /// ([`Store::dedicated_connection`]) whose response timeout is longer
    /// than `block`.
    pub async fn read_events(
        &self,
        conn: &mut Conn,
        queue: &str,
        after: &mut EventId,
        count: usize,
        block: Duration,
    ) -> Result<Vec<QueueEvent>, StoreError> {
        let read = self
            .read_events_of(
                conn,
                std::slice::from_ref(&queue.to_owned()),
                std::slice::from_mut(after),
                count,
                block,
            )
            .await?;
        Ok(read.into_iter().map(|(_, event)| event).collect())
    }

    /// [`Store::read_events`] of several queues (the partitions of one) in
    /// one XREAD on one connection: up to `count` entries of each of
    /// `queues` after its place in `after`, each event with the index of
    /// its queue, in order per queue; `after` moves as in
    /// [`Store::read_events`]. The queues' events streams must be reachable
    /// by one command: always on one server, on a cluster only in one slot.
    pub async fn read_events_of(
        &self,
        conn: &mut Conn,
        queues: &[String],
        after: &mut [EventId],
        count: usize,
        block: Duration,
    ) -> Result<Vec<(usize, QueueEvent)>, StoreError> {
        let streams: Vec<String> = queues.iter().map(|q| QueueKeys::new(q).events).collect();
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&streams);
        // After an event inside an entry, the entry is read again and the
        // events up to that one are skipped.
        for at in after.iter() {
            let from = match at.index {
                Some(_) => at.entry.before(),
                None => at.entry,
            };
            cmd.arg(from.to_string());
        }
        let reply: Value = self.trip("events_read", cmd.query_async(conn)).await?;
        // nil on timeout; else [[stream, entries]] (RESP2) or a map of
        // stream to entries (RESP3).
        let replied: Vec<(String, Value)> = match reply {
            Value::Nil => return Ok(Vec::new()),
            Value::Map(pairs) => pairs
                .into_iter()
                .map(|(k, v)| Ok((from_value(Some(k))?, v)))
                .collect::<Result<_, StoreError>>()?,
            other => from_value(Some(other))?,
        };
        let mut events = Vec::new();
        // Moved only once the whole reply is read, so that a reply that
        // cannot be read loses nothing.
        let mut moved = after.to_vec();
        for (stream, entries) in replied {
            let i = streams.iter().position(|s| *s == stream).ok_or_else(|| {
                StoreError::Protocol(format!("XREAD answered for stream {stream:?}, not asked"))
            })?;
            let entries: Vec<(String, Option<Vec<String>>)> = from_value(Some(entries))?;
            for (id, body) in entries {
                let id: StreamId = id
                    .parse()
                    .map_err(|e: InvalidStreamId| StoreError::Protocol(e.to_string()))?;
                let seen = match after[i].index {
                    Some(k) if id == after[i].entry => Some(k),
                    _ => None,
                };
                // Whatever is skipped or not an event (none is written) is
                // still read past.
                moved[i] = id.into();
                events.extend(
                    QueueEvent::from_entry(id, body.unwrap_or_default())
                        .into_iter()
                        .skip(seen.map_or(0, |k| k as usize + 1))
                        .map(|event| (i, event)),
                );
            }
        }
        after.copy_from_slice(&moved);
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_holds_as_many_events_as_the_scripts_write() {
        let idem = include_str!("lua/include/idem.lua");
        let stated = format!("local EVENTS_PER_ENTRY = {EVENTS_PER_ENTRY}\n");
        assert!(idem.contains(&stated), "idem.lua does not say {stated:?}");
    }

    #[test]
    fn a_gap_is_a_trim_past_the_id_asked_for() {
        let id = |ms| StreamId { ms, seq: 0 };
        let info = |first: Option<u64>, length, added: Option<u64>| StreamInfo {
            last_generated: id(100),
            first_entry: first.map(id),
            length,
            entries_added: added,
            max_deleted: Some(id(0)),
        };
        // Never trimmed: no gap, even from the beginning.
        assert!(!info(Some(1), 100, Some(100)).trimmed_after(id(0)));
        // Trimmed up to 50: a gap for an id before it, none from it on.
        let trimmed = info(Some(50), 51, Some(100));
        assert!(trimmed.trimmed_after(id(0)));
        assert!(trimmed.trimmed_after(id(49)));
        assert!(!trimmed.trimmed_after(id(50)));
        assert!(!trimmed.trimmed_after(id(70)));
        // Everything trimmed: a gap for anything before the newest.
        let empty = info(None, 0, Some(100));
        assert!(empty.trimmed_after(id(99)));
        assert!(!empty.trimmed_after(id(100)));
        // Before Redis 7: any oldest entry newer than the id is a gap.
        assert!(info(Some(1), 100, None).trimmed_after(id(0)));
        assert!(!info(Some(1), 100, None).trimmed_after(id(1)));
        // An XDEL past the id.
        let deleted = StreamInfo {
            max_deleted: Some(id(60)),
            ..info(Some(1), 99, Some(99))
        };
        assert!(deleted.trimmed_after(id(59)));
        assert!(!deleted.trimmed_after(id(60)));
    }

    #[test]
    fn an_entry_becomes_its_events_with_their_numbers_and_places() {
        let id = StreamId { ms: 1, seq: 0 };
        let body = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .flat_map(|(k, v)| [k.to_string(), v.to_string()])
                .collect::<Vec<_>>()
        };
        let events = QueueEvent::from_entry(
            id,
            body(&[
                ("task_id", "t1"),
                ("status", "RUNNING"),
                ("attempt", "2"),
                ("at", "99"),
            ]),
        );
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].id, EventId::from(id));
        assert_eq!(
            events[0].to_json(),
            json!({"task_id": "t1", "status": "RUNNING", "attempt": 2, "at": 99})
        );
        // A progress event: its fraction and message beside the four.
        let events = QueueEvent::from_entry(
            id,
            body(&[
                ("task_id", "t1"),
                ("status", "PROGRESS"),
                ("attempt", "1"),
                ("at", "99"),
                ("fraction", "0.25"),
                ("message", "a quarter"),
            ]),
        );
        assert_eq!(
            events[0].to_json(),
            json!({"task_id": "t1", "status": "PROGRESS", "attempt": 1, "at": 99,
                "progress": {"fraction": 0.25, "message": "a quarter", "updated_at": 99}})
        );
        // An expired task's event has no attempt.
        let events = QueueEvent::from_entry(
            id,
            body(&[("task_id", "t1"), ("status", "EXPIRED"), ("attempt", "")]),
        );
        assert_eq!(events[0].attempt, None);
        assert!(QueueEvent::from_entry(id, body(&[("status", "QUEUED")])).is_empty());
        // A batch's entry: each event its place but the last.
        let events = QueueEvent::from_entry(
            id,
            body(&[
                ("a", "SUCCEEDED 1 5"),
                ("b", "RETRYING 1 6"),
                ("c", "FAILED 3 7"),
                ("d", "EXPIRED  8"),
            ]),
        );
        let seen: Vec<_> = events
            .iter()
            .map(|e| {
                (
                    e.id.to_string(),
                    e.task_id.as_str(),
                    e.status.as_str(),
                    e.at,
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("1-0.0".to_string(), "a", "SUCCEEDED", Some(5)),
                ("1-0.1".to_string(), "b", "RETRYING", Some(6)),
                ("1-0.2".to_string(), "c", "FAILED", Some(7)),
                ("1-0".to_string(), "d", "EXPIRED", Some(8)),
            ]
        );
        assert_eq!(events[2].attempt, Some(3));
        assert_eq!(events[3].attempt, None);
    }

    #[test]
    fn event_ids_parse_print_and_resume_inside_an_entry() {
        let entry = StreamId { ms: 7, seq: 3 };
        assert_eq!("7-3".parse::<EventId>(), Ok(EventId::from(entry)));
        let inside: EventId = "7-3.12".parse().expect("valid");
        assert_eq!(
            inside,
            EventId {
                entry,
                index: Some(12)
            }
        );
        assert_eq!(inside.to_string(), "7-3.12");
        assert!(inside < EventId::from(entry));
        assert!(
            inside
                > EventId {
                    index: Some(11),
                    ..inside
                }
        );
        assert!(EventId::from(entry.before()) < inside);
        assert_eq!("7".parse::<EventId>().map(|e| e.entry.ms), Ok(7));
        for bad in [
            "",
            ".1",
            "7-3.",
            "7-3.x",
            "7-3.1.2",
            "7-3.-1",
            "x.1",
            "7-3.9999999999",
        ] {
            assert!(bad.parse::<EventId>().is_err(), "{bad:?} parsed");
        }
        // Reading resumes from the entry itself: after the one before it.
        assert_eq!(entry.before(), StreamId { ms: 7, seq: 2 });
        assert_eq!(
            StreamId { ms: 7, seq: 0 }.before(),
            StreamId {
                ms: 6,
                seq: u64::MAX
            }
        );
    }
}
