//! The task log: one capped buffer per call that collects `log` import lines
//! and everything the guest writes to stdout and stderr.
//!
//! Output past [`Limits::max_log_bytes`](super::Limits::max_log_bytes) is
//! counted and dropped, never refused: a guest whose `println!` failed would
//! panic, turning log flooding into a task failure. The finished log ends
//! with a marker line saying how much was dropped.
//!
//! Lines the guest writes to stdout and stderr are marked `[stdout] ` and
//! `[stderr] `, so a guest's own text never reads as the host's words; lines
//! of the `log` import start with their level.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi_io::bytes::Bytes;
use wasmtime_wasi_io::poll::Pollable;
use wasmtime_wasi_io::streams::{OutputStream, StreamResult};

/// The most a single stdout/stderr write is offered by `check-write`. The
/// guest's bytes are copied into host memory per write, so this bounds that
/// copy (as WASI's own streams do) independently of the log cap.
const WRITE_PERMIT: usize = 64 << 10;

/// How much of the end of stderr is kept aside for reading a panic message,
/// even when the log itself is already full.
const STDERR_TAIL: usize = 4 << 10;

/// A cheaply cloned handle on one call's log.
#[derive(Clone, Debug)]
pub(crate) struct TaskLog(Arc<Mutex<LogBuf>>);

#[derive(Debug)]
struct LogBuf {
    bytes: Vec<u8>,
    cap: usize,
    dropped: u64,
    stderr_tail: Vec<u8>,
    /// Whether the next byte starts a line (so a stream's mark goes first).
    line_start: bool,
}

impl TaskLog {
    pub(crate) fn new(cap: usize) -> Self {
        TaskLog(Arc::new(Mutex::new(LogBuf {
            bytes: Vec::new(),
            cap,
            dropped: 0,
            stderr_tail: Vec::new(),
            line_start: true,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, LogBuf> {
        // A panic while holding this lock cannot leave the buffer in a state
        // worse than "partially appended", so a poisoned lock is still usable.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Append one line made of `parts` and a newline. Nothing is assembled
    /// first: each part is copied only as far as the cap leaves room, so a
    /// guest's huge line costs the host no more than the log's cap.
    pub(crate) fn line<'a>(&self, parts: impl IntoIterator<Item = &'a str>) {
        let mut buf = self.lock();
        if !buf.line_start {
            buf.append(b"\n");
        }
        for part in parts {
            buf.append(part.as_bytes());
        }
        buf.append(b"\n");
        buf.line_start = true;
    }

    /// Append what the guest wrote to stdout or stderr, each line marked.
    fn append_stream(&self, kind: StreamKind, data: &[u8]) {
        let mut buf = self.lock();
        let mark: &[u8] = match kind {
            StreamKind::Stdout => b"[stdout] ",
            StreamKind::Stderr => b"[stderr] ",
        };
        for piece in data.split_inclusive(|b| *b == b'\n') {
            if buf.line_start {
                buf.append(mark);
            }
            buf.append(piece);
            buf.line_start = piece.ends_with(b"\n");
        }
        if let StreamKind::Stderr = kind {
            let tail = &mut buf.stderr_tail;
            tail.extend_from_slice(&data[data.len().saturating_sub(STDERR_TAIL)..]);
            if tail.len() > STDERR_TAIL {
                tail.drain(..tail.len() - STDERR_TAIL);
            }
        }
    }

    /// The log as text, with a marker line if anything was dropped.
    pub(crate) fn finish(&self) -> String {
        let buf = self.lock();
        let mut text = String::from_utf8_lossy(&buf.bytes).into_owned();
        if buf.dropped > 0 {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!(
                "[dtq: log truncated at {} bytes, {} more bytes dropped]\n",
                buf.cap, buf.dropped
            ));
        }
        text
    }

    /// The message of a Rust panic printed to stderr, if there is one.
    ///
    /// Rust's panic hook writes `thread '…' panicked at <file>:<line>:<col>:`
    /// followed by the message on the next lines; a `note:` line may follow.
    pub(crate) fn panic_message(&self) -> Option<String> {
        let buf = self.lock();
        let tail = String::from_utf8_lossy(&buf.stderr_tail);
        let start = tail.rfind("panicked at ")?;
        let text = &tail[start..];
        let mut lines = text.lines();
        let location = lines.next()?.trim_end_matches(':');
        let message: Vec<&str> = lines
            .take_while(|l| !l.starts_with("note: "))
            .filter(|l| !l.is_empty())
            .collect();
        Some(if message.is_empty() {
            location.to_string()
        } else {
            format!("{} ({location})", message.join("\n"))
        })
    }

    /// A WASI stdout or stderr stream writing into this log.
    pub(crate) fn stream(&self, kind: StreamKind) -> LogStream {
        LogStream {
            log: self.clone(),
            kind,
        }
    }
}

impl LogBuf {
    fn append(&mut self, data: &[u8]) {
        let room = self.cap.saturating_sub(self.bytes.len());
        let kept = data.len().min(room);
        self.bytes.extend_from_slice(&data[..kept]);
        self.dropped += (data.len() - kept) as u64;
    }
}

/// Which standard stream a [`LogStream`] stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StreamKind {
    Stdout,
    Stderr,
}

/// The guest's stdout or stderr: every write lands in the task log.
#[derive(Clone, Debug)]
pub(crate) struct LogStream {
    log: TaskLog,
    kind: StreamKind,
}

impl LogStream {
    fn write_bytes(&self, data: &[u8]) {
        self.log.append_stream(self.kind, data);
    }
}

impl IsTerminal for LogStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogStream {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi_io::async_trait]
impl Pollable for LogStream {
    async fn ready(&mut self) {}
}

impl OutputStream for LogStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.write_bytes(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

impl AsyncWrite for LogStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let n = buf.len().min(WRITE_PERMIT);
        self.write_bytes(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_cap_and_marks_the_rest() {
        let log = TaskLog::new(8);
        log.line(["0123456789"]);
        assert_eq!(
            log.finish(),
            "01234567\n[dtq: log truncated at 8 bytes, 3 more bytes dropped]\n"
        );
    }

    #[test]
    fn a_huge_line_is_never_assembled() {
        let log = TaskLog::new(16);
        let field = "x".repeat(1 << 20);
        log.line(std::iter::repeat_n(field.as_str(), 100));
        let buf = log.lock();
        assert_eq!(buf.bytes.len(), 16);
        assert!(buf.bytes.capacity() < 1 << 20, "{}", buf.bytes.capacity());
        assert_eq!(buf.dropped, 100 * (1 << 20) + 1 - 16);
    }

    #[test]
    fn stream_lines_are_marked_as_the_guest_s() {
        let log = TaskLog::new(1 << 10);
        log.append_stream(StreamKind::Stderr, b"error: disk ");
        log.append_stream(StreamKind::Stderr, b"full\nsecond\n");
        log.line(["INFO ", "done"]);
        log.append_stream(StreamKind::Stdout, b"out");
        log.line(["WARN ", "late"]);
        assert_eq!(
            log.finish(),
            "[stderr] error: disk full\n[stderr] second\nINFO done\n[stdout] out\nWARN late\n"
        );
    }

    #[test]
    fn finds_a_rust_panic_message() {
        let log = TaskLog::new(0);
        log.append_stream(
            StreamKind::Stderr,
            b"\nthread '<unnamed>' panicked at src/lib.rs:7:9:\nboom\nnote: run with `RUST_BACKTRACE=1`\n",
        );
        assert_eq!(
            log.panic_message().as_deref(),
            Some("boom (panicked at src/lib.rs:7:9)")
        );
    }
}
