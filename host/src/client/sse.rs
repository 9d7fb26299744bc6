//! A Server-Sent Events reader: the client side of `GET
//! /v1/queues/{q}/events`, under [`Watch`](super::Watch),
//! [`Client::wait`](super::Client::wait) and tests.
//!
//! The format is a few rules (lines of `field: value`, a blank line ends
//! an event, `:` starts a comment, lines end with LF, CRLF or CR), so it is
//! read here, as the HTML standard's "event stream interpretation" says,
//! over reqwest's streamed body, rather than with one more dependency.
//! `retry:` is ignored: reconnecting is the caller's ([`Watch`](super::Watch)'s).

use std::collections::VecDeque;

/// The longest line read, bytes: a server that never ends a line cannot
/// make the reader hold more.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// One event of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// Its `event:` name; `message` when it has none.
    pub event: String,
    /// Its `data:` lines, joined by `\n`.
    pub data: String,
    /// Its `id:`, if it carried one.
    pub id: Option<String>,
}

/// Why the stream could not be read on.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    /// The connection failed or the body could not be read.
    #[error("reading the event stream: {0}")]
    Http(#[from] reqwest::Error),
    /// A line longer than [`MAX_LINE_BYTES`].
    #[error("the event stream has a line longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
}

/// The event stream parser: bytes in, events out.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The line read so far.
    line: Vec<u8>,
    /// The last byte fed ended a line with CR, so an LF next is its end too.
    after_cr: bool,
    /// A line was read (a byte-order mark may only start the first).
    started: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    id: Option<String>,
    /// The id of the last event that carried one.
    last_event_id: Option<String>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        SseParser::default()
    }

    /// Read `bytes`, appending the events they complete to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut VecDeque<SseEvent>) -> Result<(), SseError> {
        for &b in bytes {
            let after_cr = std::mem::replace(&mut self.after_cr, false);
            match b {
                b'\n' if after_cr => {}
                b'\n' => self.end_line(out),
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(out);
                }
                _ => {
                    if self.line.len() >= MAX_LINE_BYTES {
                        return Err(SseError::LineTooLong);
                    }
                    self.line.push(b);
                }
            }
        }
        Ok(())
    }

    /// The id of the last event that carried one: what a client sends as
    /// `Last-Event-ID` when it reconnects.
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_event_id.as_deref()
    }

    fn end_line(&mut self, out: &mut VecDeque<SseEvent>) {
        let mut line = std::mem::take(&mut self.line);
        if !std::mem::replace(&mut self.started, true) && line.starts_with(b"\xEF\xBB\xBF") {
            line.drain(..3);
        }
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        let line = String::from_utf8_lossy(&line);
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (&*line, ""),
        };
        match field {
            "event" => self.event = Some(value.to_owned()),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {}
        }
    }

    fn dispatch(&mut self, out: &mut VecDeque<SseEvent>) {
        let event = self.event.take();
        let id = self.id.take();
        if id.is_some() {
            self.last_event_id.clone_from(&id);
        }
        if !std::mem::take(&mut self.has_data) {
            return;
        }
        out.push_back(SseEvent {
            event: event
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "message".to_owned()),
            data: std::mem::take(&mut self.data),
            id,
        });
    }
}

/// Events read from a response's body as it arrives.
#[derive(Debug)]
pub struct SseReader {
    response: reqwest::Response,
    parser: SseParser,
    ready: VecDeque<SseEvent>,
}

impl SseReader {
    /// Read the events of `response` (a `text/event-stream` body).
    pub fn new(response: reqwest::Response) -> Self {
        SseReader {
            response,
            parser: SseParser::new(),
            ready: VecDeque::new(),
        }
    }

    /// The next event; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<SseEvent>, SseError> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(Some(event));
            }
            match self.response.chunk().await? {
                Some(bytes) => self.parser.feed(&bytes, &mut self.ready)?,
                None => return Ok(None),
            }
        }
    }

    /// See [`SseParser::last_event_id`].
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunks: &[&[u8]]) -> (Vec<SseEvent>, SseParser) {
        let mut parser = SseParser::new();
        let mut out = VecDeque::new();
        for chunk in chunks {
            parser.feed(chunk, &mut out).expect("parses");
        }
        (out.into(), parser)
    }

    fn event(name: &str, data: &str, id: Option<&str>) -> SseEvent {
        SseEvent {
            event: name.into(),
            data: data.into(),
            id: id.map(Into::into),
        }
    }

    #[test]
    fn events_as_the_api_sends_them() {
        let (events, parser) = parse(&[
            b": keep-alive\n\n",
            b"event: gap\ndata: {\"last_event_id\":\"1-0\"}\n\n",
            b"id: 5-0\nevent: QUEUED\ndata: {\"a\":1}\n\n",
        ]);
        assert_eq!(
            events,
            [
                event("gap", r#"{"last_event_id":"1-0"}"#, None),
                event("QUEUED", r#"{"a":1}"#, Some("5-0")),
            ]
        );
        assert_eq!(parser.last_event_id(), Some("5-0"));
    }

    #[test]
    fn any_line_ending_and_any_split() {
        let text = b"\xEF\xBB\xBFid: 1\r\ndata: a\r\ndata:b\r\rdata\nid\n\nevent: x\rdata: c\n\n";
        let want = [
            event("message", "a\nb", Some("1")),
            event("message", "", Some("")),
            event("x", "c", None),
        ];
        let (whole, _) = parse(&[text]);
        assert_eq!(whole, want);
        // Byte by byte: a CR and its LF in different chunks too.
        let bytes: Vec<&[u8]> = text.chunks(1).collect();
        let (split, parser) = parse(&bytes);
        assert_eq!(split, want);
        assert_eq!(parser.last_event_id(), Some(""));
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_but_its_id_counts() {
        let (events, parser) = parse(&[b"id: 9-9\nevent: x\n\n: only a comment\n\n"]);
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(parser.last_event_id(), Some("9-9"));
    }

    #[test]
    fn an_endless_line_is_an_error() {
        let mut parser = SseParser::new();
        let mut out = VecDeque::new();
        let chunk = vec![b'a'; MAX_LINE_BYTES];
        parser.feed(&chunk, &mut out).expect("at the limit");
        assert!(matches!(
            parser.feed(b"a", &mut out),
            Err(SseError::LineTooLong)
        ));
    }
}
