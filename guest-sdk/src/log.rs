//! Leveled log lines, captured into the task's log.
//!
//! The host caps how many bytes of log a task may write; lines past the cap
//! are dropped. Anything a handler prints to stdout or stderr lands in the
//! same log, without a level or fields.
//!
//! ```no_run
//! use dtq_guest::log;
//!
//! log::info("charging card");
//! log::fields().with("order_id", "A-1").with("amount_cents", 1_999).info("charged");
//! ```

use core::fmt;

use crate::bindings::dtq::handler::log as wit;

/// How severe a log line is.
///
/// ```no_run
/// dtq_guest::log::write(dtq_guest::log::Level::Warn, "slow gateway", &[]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// Fine detail for debugging a handler.
    Debug,
    /// Normal progress.
    Info,
    /// Something unexpected that the handler recovered from.
    Warn,
    /// A failure.
    Error,
}

impl From<Level> for wit::Level {
    fn from(level: Level) -> Self {
        match level {
            Level::Debug => wit::Level::Debug,
            Level::Info => wit::Level::Info,
            Level::Warn => wit::Level::Warn,
            Level::Error => wit::Level::Error,
        }
    }
}

/// Write one line at `level` with key/value `fields` kept beside the message.
///
/// ```no_run
/// use dtq_guest::log::{self, Level};
/// log::write(Level::Info, "charged", &[("order_id", "A-1"), ("amount_cents", "1999")]);
/// ```
pub fn write(level: Level, message: impl AsRef<str>, fields: &[(&str, &str)]) {
    let fields: Vec<(String, String)> = fields
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    wit::write(level.into(), message.as_ref(), &fields);
}

/// Write a debug line.
///
/// ```no_run
/// dtq_guest::log::debug("cache miss");
/// ```
pub fn debug(message: impl AsRef<str>) {
    wit::write(wit::Level::Debug, message.as_ref(), &[]);
}

/// Write an info line.
///
/// ```no_run
/// dtq_guest::log::info(format!("processing {} lines", 3));
/// ```
pub fn info(message: impl AsRef<str>) {
    wit::write(wit::Level::Info, message.as_ref(), &[]);
}

/// Write a warning line.
///
/// ```no_run
/// dtq_guest::log::warn("gateway slow, retrying once");
/// ```
pub fn warn(message: impl AsRef<str>) {
    wit::write(wit::Level::Warn, message.as_ref(), &[]);
}

/// Write an error line.
///
/// ```no_run
/// dtq_guest::log::error("card declined");
/// ```
pub fn error(message: impl AsRef<str>) {
    wit::write(wit::Level::Error, message.as_ref(), &[]);
}

/// Start a line with fields; add them with [`Fields::with`], then write it
/// with one of the level methods.
///
/// ```no_run
/// dtq_guest::log::fields().with("order_id", "A-1").warn("retrying charge");
/// ```
pub fn fields() -> Fields {
    Fields::default()
}

/// Key/value fields for one log line, built by [`fields`].
///
/// ```no_run
/// let line = dtq_guest::log::fields().with("attempt", 2);
/// line.info("charging");
/// ```
#[derive(Debug, Clone, Default)]
#[must_use = "fields are only written by a level method such as `.info(..)`"]
pub struct Fields {
    fields: Vec<(String, String)>,
}

impl Fields {
    /// Add the field `key` with `value` written by its `Display`.
    ///
    /// ```no_run
    /// dtq_guest::log::fields().with("sku", "B-7").with("quantity", 3).debug("line item");
    /// ```
    pub fn with(mut self, key: impl Into<String>, value: impl fmt::Display) -> Self {
        self.fields.push((key.into(), value.to_string()));
        self
    }

    /// Write the line at `level`.
    ///
    /// ```no_run
    /// use dtq_guest::log::{self, Level};
    /// log::fields().with("attempt", 3).write(Level::Warn, "giving up soon");
    /// ```
    pub fn write(self, level: Level, message: impl AsRef<str>) {
        wit::write(level.into(), message.as_ref(), &self.fields);
    }

    /// Write the line at debug level.
    ///
    /// ```no_run
    /// dtq_guest::log::fields().with("bytes", 512).debug("read body");
    /// ```
    pub fn debug(self, message: impl AsRef<str>) {
        self.write(Level::Debug, message);
    }

    /// Write the line at info level.
    ///
    /// ```no_run
    /// dtq_guest::log::fields().with("order_id", "A-1").info("charged");
    /// ```
    pub fn info(self, message: impl AsRef<str>) {
        self.write(Level::Info, message);
    }

    /// Write the line at warn level.
    ///
    /// ```no_run
    /// dtq_guest::log::fields().with("order_id", "A-1").warn("gateway slow");
    /// ```
    pub fn warn(self, message: impl AsRef<str>) {
        self.write(Level::Warn, message);
    }

    /// Write the line at error level.
    ///
    /// ```no_run
    /// dtq_guest::log::fields().with("order_id", "A-1").error("card declined");
    /// ```
    pub fn error(self, message: impl AsRef<str>) {
        self.write(Level::Error, message);
    }
}
