//! The host side of the WIT `progress` import: how far a running call is,
//! as its handler reports it, written to its task (`store::write_progress`).
//!
//! A handler may report as often as it likes, in a tight loop if it wants:
//! the call keeps only its latest report, and a small task of its own
//! ([`Reporter`]) writes it at most once every [`WRITE_EVERY`], and the
//! last one when the call ends, before its completion is written. So a
//! report costs the guest a copy of its message and never a wait on Redis,
//! and Redis at most a few writes a second per running call. A report is
//! not a host call (it does not count toward
//! [`Limits::max_host_calls`](super::Limits::max_host_calls)), and nothing
//! about it fails the call: a write Redis refuses or cannot take is
//! dropped (the next report is written in its turn), and what the handler
//! says is made safe rather than refused: a fraction below 0 or NaN is 0,
//! above 1 is 1, a message past [`MAX_PROGRESS_MESSAGE_BYTES`] is cut at a
//! character boundary.
//!
//! The first report of a call starts its writer; a call that reports
//! nothing costs nothing.

use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::imports::HostCtx;
use super::imports::bindings::dtq::handler::progress;
use crate::base::now_ms;
use crate::store::{Conn, ProgressReport, ReportingAttempt, write_progress};

/// The longest a progress message is kept, in bytes: enough for a line
/// people read, bounded so that a report costs Redis little however long
/// the handler's text.
pub const MAX_PROGRESS_MESSAGE_BYTES: usize = 1024;

/// The least time between two writes of one call's progress.
pub const WRITE_EVERY: Duration = Duration::from_millis(250);

/// How long the end of a call waits for its last report to be written
/// before the call's completion goes ahead without it (Redis is slow or
/// away; the write may still land while the task runs).
const LAST_WRITE_WAIT: Duration = Duration::from_secs(2);

/// A report numbered in its call, so that the writer knows whether it
/// wrote the latest.
#[derive(Debug, Clone, Default)]
struct Numbered {
    seq: u64,
    report: ProgressReport,
}

/// One call's progress: its latest report, and the task that writes it.
pub(crate) struct Reporter {
    latest: watch::Sender<Numbered>,
    /// Dropped when the call ends: the writer then writes the last report.
    /// Apart from `latest`, so that the writer can wait for the end alone,
    /// without waking at every report of a handler that reports in a loop.
    ended: oneshot::Sender<()>,
    writer: JoinHandle<()>,
}

/// Where a call's reports go: its attempt, on the sandbox's connection,
/// with a `PROGRESS` event in a stream of `events_max_len` (0: none).
pub(crate) struct Destination {
    pub(crate) conn: Conn,
    pub(crate) attempt: ReportingAttempt,
    pub(crate) events_max_len: u64,
}

impl Reporter {
    /// Start the writer of a call whose first report is `first`.
    fn start(first: ProgressReport, to: Destination) -> Reporter {
        let (latest, updates) = watch::channel(Numbered {
            seq: 1,
            report: first,
        });
        let (ended, end) = oneshot::channel();
        let writer = tokio::spawn(write_loop(updates, end, to));
        Reporter {
            latest,
            ended,
            writer,
        }
    }

    /// Replace the latest report with `report`.
    fn report(&self, report: ProgressReport) {
        self.latest.send_modify(|latest| {
            latest.seq += 1;
            latest.report = report;
        });
    }

    /// The call ended: let the writer write the last report, and wait for
    /// it up to [`LAST_WRITE_WAIT`].
    pub(crate) async fn finish(self) {
        let Reporter {
            latest,
            ended,
            writer,
        } = self;
        drop((latest, ended));
        if tokio::time::timeout(LAST_WRITE_WAIT, writer).await.is_err() {
            tracing::debug!("the last progress report is not written yet; the call ends anyway");
        }
    }
}

/// Write the latest report whenever it changed, at most once every
/// [`WRITE_EVERY`], until the call ends (`end` resolves); then the last
/// one, if it was not written yet.
async fn write_loop(
    mut updates: watch::Receiver<Numbered>,
    mut end: oneshot::Receiver<()>,
    mut to: Destination,
) {
    let mut written = 0;
    loop {
        let latest = updates.borrow_and_update().clone();
        if latest.seq != written {
            written = latest.seq;
            write(&mut to, &latest.report).await;
        }
        // The pause between two writes, cut short when the call ends; then,
        // with nothing new to write, the wait for a report or the end.
        // (`end` is never polled again once it resolved.)
        let open = tokio::select! {
            () = tokio::time::sleep(WRITE_EVERY) => true,
            _ = &mut end => false,
        };
        let open = open
            && (updates.borrow().seq != written
                || tokio::select! {
                    changed = updates.changed() => changed.is_ok(),
                    _ = &mut end => false,
                });
        if !open {
            let last = updates.borrow().clone();
            if last.seq != written {
                write(&mut to, &last.report).await;
            }
            return;
        }
    }
}

/// Write one report; a failure is dropped, never the call's.
async fn write(to: &mut Destination, report: &ProgressReport) {
    match write_progress(&mut to.conn, &to.attempt, report, to.events_max_len).await {
        Ok(true) => {}
        Ok(false) => tracing::debug!("progress not written: the attempt no longer runs"),
        Err(e) => tracing::debug!(error = %e, "progress not written"),
    }
}

/// `fraction` in 0..=1: NaN and anything below 0 are 0, anything above 1
/// is 1.
pub(crate) fn clamp_fraction(fraction: f64) -> f64 {
    if fraction.is_nan() || fraction <= 0.0 {
        0.0
    } else {
        fraction.min(1.0)
    }
}

/// `message` cut to [`MAX_PROGRESS_MESSAGE_BYTES`] at a character
/// boundary.
pub(crate) fn cap_message(mut message: String) -> String {
    if message.len() > MAX_PROGRESS_MESSAGE_BYTES {
        let mut end = MAX_PROGRESS_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    message
}

impl progress::Host for HostCtx {
    async fn report(&mut self, fraction: f64, message: String) -> wasmtime::Result<()> {
        let report = ProgressReport {
            fraction: clamp_fraction(fraction),
            message: cap_message(message),
            at: now_ms(),
        };
        match &self.progress {
            Some(reporter) => reporter.report(report),
            None => {
                let to = Destination {
                    conn: self.handler.redis.clone(),
                    attempt: ReportingAttempt {
                        queue: self.caller.queue.clone(),
                        task_id: self.caller.task_id.clone(),
                        attempt: self.caller.attempt,
                    },
                    events_max_len: self.handler.progress_events_max_len,
                };
                self.progress = Some(Box::new(Reporter::start(report, to)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_are_clamped_and_messages_cut_at_a_character() {
        for (asked, kept) in [
            (0.5, 0.5),
            (0.0, 0.0),
            (1.0, 1.0),
            (-0.0, 0.0),
            (-3.0, 0.0),
            (5.0, 1.0),
            (f64::NAN, 0.0),
            (f64::INFINITY, 1.0),
            (f64::NEG_INFINITY, 0.0),
        ] {
            let got = clamp_fraction(asked);
            assert!(got == kept && got.is_sign_positive(), "{asked} gave {got}");
        }
        assert_eq!(cap_message("short".into()), "short");
        let long = "x".repeat(MAX_PROGRESS_MESSAGE_BYTES + 10);
        assert_eq!(cap_message(long).len(), MAX_PROGRESS_MESSAGE_BYTES);
        // Two-byte characters: the cut falls before the one that would
        // cross the cap.
        let accents = "é".repeat(MAX_PROGRESS_MESSAGE_BYTES);
        let cut = cap_message(accents);
        assert_eq!(cut.len(), MAX_PROGRESS_MESSAGE_BYTES);
        let odd = format!("x{}", "é".repeat(MAX_PROGRESS_MESSAGE_BYTES));
        assert_eq!(cap_message(odd).len(), MAX_PROGRESS_MESSAGE_BYTES - 1);
    }
}
