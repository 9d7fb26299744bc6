//! A queue's live events (`GET /v1/queues/{q}/events`): followed across
//! reconnections ([`Watch`]), and used to wait for a task to end
//! ([`Client::wait`]).

use std::time::{Duration, Instant};

use reqwest::{StatusCode, Url};

use super::sse::{SseError, SseEvent, SseReader};
use super::{Client, ClientError, Task, add_query};

/// How far before a task's creation [`Client::wait`] starts reading its
/// events (ms): the task id's time is the API's clock, the events' ids
/// Redis's.
const EVENTS_CLOCK_SLACK_MS: u64 = 2_000;

/// How often [`Client::wait`] reads the record once the events cannot
/// tell it more.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// The longest pause of a [`Watch`] between two connections.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// What [`Watch::next`] read.
#[derive(Debug)]
pub enum Watched {
    /// An event of the queue.
    Event(SseEvent),
    /// The stream was lost; the watch opens it again after a pause, after
    /// the last event read.
    Interrupted(Interruption),
}

/// Why a [`Watch`] lost its stream, for a while.
#[derive(Debug)]
pub enum Interruption {
    /// The server ended the stream.
    Ended,
    /// The stream broke.
    Broken(SseError),
    /// Reconnecting, the server answered 503 (overloaded, or its Redis
    /// is away).
    Unavailable {
        /// The events' URL.
        url: Url,
        /// Its answer.
        status: StatusCode,
    },
    /// Reconnecting, the server could not be reached.
    Unreachable {
        /// The events' URL.
        url: Url,
        /// The transport's error.
        error: reqwest::Error,
    },
}

/// A queue's events, followed until dropped: a stream that ends or
/// breaks is opened again after the last event read (`Last-Event-ID`),
/// with backoff. The first connection's failure is an error, as is any
/// later refusal but a 503; once connected, an unreachable or overloaded
/// server is waited out.
#[derive(Debug)]
pub struct Watch {
    client: Client,
    url: Url,
    /// The id of the last event read (or the one to start after).
    last: Option<String>,
    reader: Option<SseReader>,
    connected: bool,
    /// Reconnections since the last good one: the backoff's exponent.
    failures: u32,
    /// The stream was lost: pause before the next connection.
    pause: bool,
}

impl Watch {
    /// The next event, or why the stream was lost for a while.
    pub async fn next(&mut self) -> Result<Watched, ClientError> {
        loop {
            if let Some(reader) = &mut self.reader {
                let lost = match reader.next().await {
                    Ok(Some(event)) => {
                        if event.id.is_some() {
                            self.last.clone_from(&event.id);
                        }
                        return Ok(Watched::Event(event));
                    }
                    Ok(None) => Interruption::Ended,
                    Err(e) => Interruption::Broken(e),
                };
                return Ok(self.lost(lost));
            }
            if std::mem::take(&mut self.pause) {
                self.failures = self.failures.saturating_add(1);
                let pause = Duration::from_millis(100) * (1u32 << self.failures.min(6));
                tokio::time::sleep(pause.min(MAX_PAUSE)).await;
            }
            match self.connect().await {
                Ok(response) => {
                    self.connected = true;
                    self.failures = 0;
                    self.reader = Some(SseReader::new(response));
                }
                Err(ClientError::Unreachable { url, source }) if self.connected => {
                    let error = source;
                    return Ok(self.lost(Interruption::Unreachable { url, error }));
                }
                Err(e) if self.connected && e.status() == Some(StatusCode::SERVICE_UNAVAILABLE) => {
                    let status = StatusCode::SERVICE_UNAVAILABLE;
                    let url = self.url.clone();
                    return Ok(self.lost(Interruption::Unavailable { url, status }));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether a connection was ever made: before, a failure is the
    /// first connection's.
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// The events' URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    fn lost(&mut self, why: Interruption) -> Watched {
        self.reader = None;
        self.pause = true;
        Watched::Interrupted(why)
    }

    async fn connect(&self) -> Result<reqwest::Response, ClientError> {
        let mut req = self
            .client
            .http
            .get(self.url.clone())
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = &self.last {
            req = req.header("Last-Event-ID", id);
        }
        self.client.open(req, self.url.clone()).await
    }
}

impl Client {
    /// Follow `queue`'s events (only `task`'s, if given), starting after
    /// event `since` if given, else with new ones. Nothing is sent until
    /// the first [`Watch::next`].
    pub fn watch(
        &self,
        queue: &str,
        task: Option<&str>,
        since: Option<String>,
    ) -> Result<Watch, ClientError> {
        let mut url = self.url(&["queues", queue, "events"])?;
        add_query(&mut url, &[("task_id", task)]);
        Ok(Watch {
            client: self.clone(),
            url,
            last: since,
            reader: None,
            connected: false,
            failures: 0,
            pause: false,
        })
    }

    /// Wait until task `id` of `queue` ends or `deadline` passes, and
    /// return its record then (ended or not: see its status).
    ///
    /// The task's events are followed until one says it ended (or a gap
    /// says some were lost) while they can be: from a little before the
    /// task was made, so none already written is missed. Then, or when
    /// they cannot be followed, the record is read every 100 ms. The
    /// record decides in every case; a failure to read it is the error.
    pub async fn wait(
        &self,
        queue: &str,
        id: &str,
        deadline: Instant,
    ) -> Result<Task, ClientError> {
        self.follow_events(queue, id, deadline).await;
        loop {
            let task = self.task(queue, id).await?;
            if task.status.is_terminal() || Instant::now() > deadline {
                return Ok(task);
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Wait until task `id` may have ended, following its events: until
    /// an event of a final status, a gap in the stream, or `deadline`.
    /// Returns early, saying nothing, whenever the events cannot be
    /// followed (the route refused, the stream broke): the caller polls
    /// the record then, which decides in every case.
    ///
    /// The subscription starts a little before the task was created (its
    /// UUIDv7 holds the time), so events already written are read too;
    /// once it is in place, the record is read once, for a task that
    /// ended before anything the stream still holds.
    async fn follow_events(&self, queue: &str, id: &str, deadline: Instant) {
        let since =
            created_ms(id).map(|ms| format!("{}-0", ms.saturating_sub(EVENTS_CLOCK_SLACK_MS)));
        let Ok(mut url) = self.url(&["queues", queue, "events"]) else {
            return;
        };
        add_query(
            &mut url,
            &[("task_id", Some(id)), ("since", since.as_deref())],
        );
        let left = || deadline.saturating_duration_since(Instant::now());
        let opened = tokio::time::timeout(left(), self.open(self.http.get(url.clone()), url)).await;
        let Ok(Ok(response)) = opened else {
            return;
        };
        let mut events = SseReader::new(response);
        match self.task(queue, id).await {
            Ok(task) if !task.status.is_terminal() => {}
            _ => return,
        }
        loop {
            match tokio::time::timeout(left(), events.next()).await {
                Ok(Ok(Some(event))) if ends_the_task(&event) || event.event == "gap" => return,
                Ok(Ok(Some(_))) => {}
                // The deadline, the end of the stream, or a broken one.
                _ => return,
            }
        }
    }
}

/// Whether `event` is a task's entry into a status it ends in.
fn ends_the_task(event: &SseEvent) -> bool {
    event
        .event
        .parse::<crate::store::TaskStatus>()
        .is_ok_and(|status| status.is_terminal())
}

/// When task `id` was created, ms since the Unix epoch: the time of its
/// UUIDv7 (before any `.` suffix).
fn created_ms(id: &str) -> Option<u64> {
    let uuid = uuid::Uuid::parse_str(id.split('.').next().unwrap_or(id)).ok()?;
    let (secs, nanos) = uuid.get_timestamp()?.to_unix();
    Some(secs * 1_000 + u64::from(nanos) / 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_id_tells_when_it_was_made() {
        let before = crate::base::now_ms();
        let id = crate::base::new_task_id();
        let after = crate::base::now_ms();
        let made = created_ms(&id).expect("a UUIDv7");
        assert!((before..=after).contains(&made), "{before} {made} {after}");
        assert_eq!(created_ms(&format!("{id}.2")), Some(made));
        assert_eq!(created_ms("not-a-uuid"), None);
    }

    #[test]
    fn only_an_ending_status_is_final() {
        let event = |name: &str| SseEvent {
            event: name.into(),
            data: String::new(),
            id: None,
        };
        for name in [
            "SUCCEEDED",
            "FAILED",
            "DEAD_LETTERED",
            "CANCELLED",
            "EXPIRED",
        ] {
            assert!(ends_the_task(&event(name)), "{name}");
        }
        for name in [
            "QUEUED",
            "RUNNING",
            "RETRYING",
            "SCHEDULED",
            "gap",
            "succeeded",
        ] {
            assert!(!ends_the_task(&event(name)), "{name}");
        }
    }
}
