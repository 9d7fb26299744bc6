//! The error a handler returns, and how it maps onto the WIT `handler-error`.

use core::fmt;

use crate::bindings::dtq::handler::types::{HandlerError, HostError};

/// A shorthand for `Result<T, dtq_guest::Error>`.
///
/// ```
/// fn parse_amount(text: &str) -> dtq_guest::Result<u64> {
///     Ok(text.parse::<u64>()?)
/// }
/// assert_eq!(parse_amount("1999").unwrap(), 1999);
/// assert!(!parse_amount("lots").unwrap_err().is_fatal());
/// ```
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// Why a handler call failed, and whether the host should try again.
///
/// A *retryable* error makes the host retry the task with backoff until its
/// attempts run out (then it is dead-lettered); a *fatal* error fails the task
/// at once. Retrying is the safe default: `?` on any [`std::error::Error`]
/// gives a retryable error whose message is the error and its sources. Mark
/// an error fatal when running the task again can only fail the same way, for
/// example on input that does not validate: [`Error::fatal`], the
/// [`fatal!`](crate::fatal!) macro or [`ResultExt::fatal`].
///
/// Like `anyhow::Error`, this type does not itself implement
/// [`std::error::Error`]; that is what lets every such error convert into it.
///
/// ```
/// use dtq_guest::{Error, Result};
///
/// fn check_quantity(quantity: i64) -> Result<u64> {
///     if quantity <= 0 {
///         return Err(Error::fatal(format!("quantity must be positive, got {quantity}")));
///     }
///     Ok(quantity as u64)
/// }
/// assert!(check_quantity(-2).unwrap_err().is_fatal());
/// ```
pub struct Error {
    fatal: bool,
    message: String,
    refusal: Option<Refusal>,
}

/// Why a host import refused a request, for a handler that reacts to one
/// case: [`Error::refusal`].
///
/// ```no_run
/// use dtq_guest::{Refusal, kv};
///
/// # fn run() -> dtq_guest::Result<()> {
/// match kv::incr("visits") {
///     Err(e) if e.refusal() == Some(Refusal::OutcomeUnknown) => {
///         // The increment may have happened: do not add it again blindly.
///         return Err(e);
///     }
///     other => { other?; }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// The key is empty or too long (fatal).
    InvalidKey,
    /// A value, or an operation's staged writes, larger than the host
    /// allows (fatal).
    ValueTooLarge,
    /// The stored value is not what the operation needs (retryable).
    WrongType,
    /// Redis could not be reached, or refused the request, and nothing was
    /// written (retryable).
    Unavailable,
    /// An argument out of range: a TTL of 0 or too long, an operation begun
    /// inside another (fatal).
    InvalidArgument,
    /// A write may or may not have taken effect: the connection broke
    /// before Redis answered (retryable).
    OutcomeUnknown,
    /// The idempotency claim was taken over by another attempt, or expired,
    /// before the operation committed; nothing of it applied (retryable).
    ClaimLost,
    /// The write would take the handler's namespace over the Redis budget
    /// the operator set; nothing was written (retryable: keys may expire or
    /// the budget grow).
    QuotaExceeded,
}

impl Error {
    /// A permanent failure: the host marks the task FAILED without retrying.
    ///
    /// ```
    /// let err = dtq_guest::Error::fatal("unknown currency XYZ");
    /// assert!(err.is_fatal());
    /// ```
    pub fn fatal(message: impl fmt::Display) -> Self {
        Error {
            fatal: true,
            message: message.to_string(),
            refusal: None,
        }
    }

    /// A transient failure: the host retries the task with backoff.
    ///
    /// ```
    /// let err = dtq_guest::Error::retryable("payment gateway busy");
    /// assert!(!err.is_fatal());
    /// ```
    pub fn retryable(message: impl fmt::Display) -> Self {
        Error {
            fatal: false,
            message: message.to_string(),
            refusal: None,
        }
    }

    /// Whether the host will fail the task without retrying it.
    ///
    /// ```
    /// assert!(dtq_guest::Error::fatal("bad input").is_fatal());
    /// ```
    pub fn is_fatal(&self) -> bool {
        self.fatal
    }

    /// The message the host records for the task.
    ///
    /// ```
    /// assert_eq!(dtq_guest::Error::retryable("busy").message(), "busy");
    /// ```
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error, made fatal.
    ///
    /// ```
    /// let err = dtq_guest::Error::retryable("no such customer").into_fatal();
    /// assert!(err.is_fatal());
    /// ```
    pub fn into_fatal(mut self) -> Self {
        self.fatal = true;
        self
    }

    /// The same error with `context` in front of its message: `context: message`.
    ///
    /// ```
    /// let err = dtq_guest::Error::retryable("timed out").context("charging card");
    /// assert_eq!(err.message(), "charging card: timed out");
    /// ```
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }

    /// Which refusal of a host import this error is, if it is one.
    ///
    /// ```
    /// assert_eq!(dtq_guest::Error::retryable("busy").refusal(), None);
    /// ```
    pub fn refusal(&self) -> Option<Refusal> {
        self.refusal
    }

    /// Map a refusal of a host import: a request that can never succeed
    /// (a bad key or argument, a value too large) is fatal; the rest are
    /// retryable.
    pub(crate) fn from_host(op: &str, err: HostError) -> Self {
        let (refusal, error) = match err {
            HostError::InvalidKey(why) => (
                Refusal::InvalidKey,
                Error::fatal(format!("{op}: invalid key: {why}")),
            ),
            HostError::ValueTooLarge(size) => (
                Refusal::ValueTooLarge,
                Error::fatal(format!("{op}: {size} bytes is larger than the host allows")),
            ),
            HostError::WrongType(detail) => (
                Refusal::WrongType,
                Error::retryable(format!("{op}: value has the wrong type: {detail}")),
            ),
            HostError::Unavailable(detail) => (
                Refusal::Unavailable,
                Error::retryable(format!("{op}: storage unavailable: {detail}")),
            ),
            HostError::InvalidArgument(detail) => (
                Refusal::InvalidArgument,
                Error::fatal(format!("{op}: invalid argument: {detail}")),
            ),
            HostError::OutcomeUnknown(detail) => (
                Refusal::OutcomeUnknown,
                Error::retryable(format!(
                    "{op}: outcome unknown, the write may or may not have applied: {detail}"
                )),
            ),
            HostError::ClaimLost(detail) => (
                Refusal::ClaimLost,
                Error::retryable(format!("{op}: claim lost: {detail}")),
            ),
            HostError::QuotaExceeded(detail) => (
                Refusal::QuotaExceeded,
                Error::retryable(format!("{op}: namespace quota exceeded: {detail}")),
            ),
        };
        Error {
            refusal: Some(refusal),
            ..error
        }
    }
}

impl<E: std::error::Error> From<E> for Error {
    /// A retryable error whose message is `err` followed by its sources.
    fn from(err: E) -> Self {
        let mut message = err.to_string();
        let mut source = err.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Error::retryable(message)
    }
}

impl From<Error> for HandlerError {
    fn from(err: Error) -> Self {
        if err.fatal {
            HandlerError::Fatal(err.message)
        } else {
            HandlerError::Retryable(err.message)
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.fatal { "fatal" } else { "retryable" };
        write!(f, "{kind} error: {}", self.message)
    }
}

/// Adjust the error of a `Result` on its way out of a handler.
///
/// Implemented for every `Result<T, E>` whose error converts into [`Error`]:
/// any [`std::error::Error`], and [`Error`] itself.
///
/// ```
/// use dtq_guest::{ResultExt, Result};
///
/// fn parse_line(line: &str) -> Result<u32> {
///     // Malformed input stays malformed: no point retrying.
///     line.trim().parse::<u32>().context("parsing quantity").fatal()
/// }
/// let err = parse_line("three").unwrap_err();
/// assert!(err.is_fatal());
/// assert_eq!(err.message(), "parsing quantity: invalid digit found in string");
/// ```
pub trait ResultExt<T> {
    /// Make the error, if any, fatal.
    ///
    /// ```
    /// use dtq_guest::ResultExt;
    /// let n: dtq_guest::Result<u8> = "300".parse::<u8>().fatal();
    /// assert!(n.unwrap_err().is_fatal());
    /// ```
    fn fatal(self) -> Result<T>;

    /// Put `context` in front of the error's message, if any.
    ///
    /// ```
    /// use dtq_guest::ResultExt;
    /// let n = "x".parse::<u8>().context("reading count");
    /// assert!(n.unwrap_err().message().starts_with("reading count: "));
    /// ```
    fn context(self, context: impl fmt::Display) -> Result<T>;
}

impl<T, E: Into<Error>> ResultExt<T> for core::result::Result<T, E> {
    fn fatal(self) -> Result<T> {
        self.map_err(|err| err.into().into_fatal())
    }

    fn context(self, context: impl fmt::Display) -> Result<T> {
        self.map_err(|err| err.into().context(context))
    }
}

/// Return early from a handler with a fatal [`Error`] built like `format!`.
///
/// ```
/// fn check(quantity: i64) -> dtq_guest::Result<()> {
///     if quantity < 0 {
///         dtq_guest::fatal!("quantity must not be negative, got {quantity}");
///     }
///     Ok(())
/// }
/// let err = check(-1).unwrap_err();
/// assert!(err.is_fatal());
/// assert_eq!(err.message(), "quantity must not be negative, got -1");
/// ```
#[macro_export]
macro_rules! fatal {
    ($($arg:tt)+) => {
        return ::core::result::Result::Err($crate::Error::fatal(::std::format!($($arg)+)))
    };
}

/// Return early from a handler with a retryable [`Error`] built like `format!`.
///
/// ```
/// fn check(gateway_busy: bool) -> dtq_guest::Result<()> {
///     if gateway_busy {
///         dtq_guest::retry!("payment gateway busy, trying later");
///     }
///     Ok(())
/// }
/// assert!(!check(true).unwrap_err().is_fatal());
/// ```
#[macro_export]
macro_rules! retry {
    ($($arg:tt)+) => {
        return ::core::result::Result::Err($crate::Error::retryable(::std::format!($($arg)+)))
    };
}
