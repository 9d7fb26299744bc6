//! What a call ended with, and how a wasmtime error is classified into it.

use std::fmt;
use std::time::Duration;

use super::limits::{Limit, LimitTrap};
use super::log::TaskLog;

/// Everything a call produced.
#[derive(Debug, Clone)]
pub struct CallReport {
    /// How the call ended.
    pub outcome: Outcome,
    /// The task log: `log` import lines, stdout and stderr, capped at
    /// [`Limits::max_log_bytes`](super::Limits::max_log_bytes).
    pub log: String,
    /// Host imports the guest called.
    pub host_calls: u64,
    /// Wall-clock time of the call, waiting for a pool slot included.
    pub elapsed: Duration,
    /// The digest (SHA-256, lowercase hex) of the module that ran; `None`
    /// when no handler of the task was loaded.
    pub digest: Option<std::sync::Arc<str>>,
    /// The task name of the handler that ran, one string shared by all its
    /// calls (a known task, so the `task` label `/metrics` gives it);
    /// `None` when no handler of the task was loaded.
    pub task: Option<std::sync::Arc<str>>,
    /// What the call staged (flows): `None` when it staged nothing and did
    /// not ask to wait.
    pub flow: Option<Box<FlowReport>>,
}

/// What a call staged through the `tasks` import (flows).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowReport {
    /// Its staged submissions, as the flow's outbox keeps them (JSON, see
    /// [`crate::store::Staged`]).
    pub staged: Vec<String>,
    /// Whether it asked to wait for its children.
    pub wait: bool,
    /// Whether an idempotent operation of it staged submissions into the
    /// task's outbox (applied once the operation's commit is known).
    pub op_staged: bool,
}

impl FlowReport {
    /// The report of a call's flow state.
    pub(crate) fn of(flow: Option<Box<super::tasks::FlowCall>>) -> Option<Box<FlowReport>> {
        flow.map(|f| {
            Box::new(FlowReport {
                staged: f.staged,
                wait: f.wait,
                op_staged: f.op_staged,
            })
        })
    }
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The handler returned `ok` with this JSON text.
    Success(String),
    /// The handler returned `retryable`: try again later.
    Retryable(String),
    /// The handler returned `fatal`: do not try again.
    Fatal(String),
    /// The call did not return normally.
    Trapped(Trap),
}

impl Outcome {
    /// Whether the task should be tried again (while attempts remain).
    ///
    /// `Retryable` is, `Success` and `Fatal` are not. A trap is retried
    /// unless retrying cannot help or was not wanted:
    /// [`Trap::Cancelled`] (someone asked it to stop),
    /// [`Trap::UnknownHandler`] (no module for the task on this worker; the
    /// task fails fast instead of burning attempts), and the deterministic
    /// ones: [`Limit::Payload`] (the same payload will be too big again)
    /// and [`Limit::Result`] (the same handler given the same payload
    /// returns the same result, too big again), and [`Limit::HostCallData`]
    /// (one import call's data, or a result too big to be copied out: the
    /// same again). Every other trap, including
    /// deadline, out of memory and guest panics, may be transient (a slow
    /// dependency, a bug hit by one input, a worker under load), and the
    /// attempt count bounds the cost of retrying the ones that are not.
    ///
    /// A call whose outbound request the allow-list denied is made fatal by
    /// [`Outcome::after_denial`], which the call applies.
    pub fn is_retryable(&self) -> bool {
        match self {
            Outcome::Success(_) | Outcome::Fatal(_) => false,
            Outcome::Retryable(_) => true,
            Outcome::Trapped(trap) => !matches!(
                trap,
                Trap::Cancelled
                    | Trap::UnknownHandler(_)
                    | Trap::LimitExceeded(Limit::Payload | Limit::Result | Limit::HostCallData)
            ),
        }
    }

    /// This outcome of a call during which the handler's allow-list denied
    /// the outbound request `denied` (`GET https://host:443`), if any.
    ///
    /// A denial is deterministic: the allow-list is the operator's deploy
    /// setting, and the same code with the same payload asks for the same
    /// host again, so a retry is denied again. The guest sees the denial
    /// as a wasi:http error, which it may turn into a retryable error, trap
    /// on, or swallow; the host does not trust it to classify the denial,
    /// so a call that would be retried after a denial is fatal instead,
    /// the denial first in its error. A call that succeeds (the guest
    /// swallowed the denial and finished) or fails fatally stays as it is.
    pub fn after_denial(self, denied: Option<&str>) -> Outcome {
        match denied {
            Some(target) if self.is_retryable() => Outcome::Fatal(format!(
                "outbound request {target} denied by the handler's allow-list \
                 (deploy setting allow_hosts): not retried, a retry would be denied \
                 again; the handler then ended with {self}"
            )),
            _ => self,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Success(_) => f.write_str("success"),
            Outcome::Retryable(msg) => write!(f, "retryable error: {msg}"),
            Outcome::Fatal(msg) => write!(f, "fatal error: {msg}"),
            Outcome::Trapped(trap) => write!(f, "trapped: {trap}"),
        }
    }
}

/// Why a call did not return normally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trap {
    /// The call ran past its deadline.
    DeadlineExceeded,
    /// The guest asked for more linear memory than
    /// [`Limits::memory_bytes`](super::Limits::memory_bytes).
    OutOfMemory,
    /// The guest's wasm stack overflowed
    /// ([`Limits::stack_bytes`](super::Limits::stack_bytes)).
    StackOverflow,
    /// The guest aborted (`unreachable`), e.g. a Rust panic; the panic
    /// message from its stderr when it printed one.
    GuestPanic(String),
    /// The call crossed a limit.
    LimitExceeded(Limit),
    /// The call was cancelled through its [`CancelHandle`](super::CancelHandle).
    Cancelled,
    /// No handler is loaded for this task name.
    UnknownHandler(String),
    /// Any other trap (an out-of-bounds access, a division by zero…) or a
    /// host failure.
    Other(String),
}

impl fmt::Display for Trap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Trap::DeadlineExceeded => f.write_str("deadline exceeded"),
            Trap::OutOfMemory => f.write_str("out of memory"),
            Trap::StackOverflow => f.write_str("stack overflow"),
            Trap::GuestPanic(msg) => write!(f, "guest panicked: {msg}"),
            Trap::LimitExceeded(limit) => write!(f, "{limit} limit exceeded"),
            Trap::Cancelled => f.write_str("cancelled"),
            Trap::UnknownHandler(task) => write!(f, "no handler for task {task:?}"),
            Trap::Other(msg) => write!(f, "{msg}"),
        }
    }
}

/// Why the host interrupted a running guest from the epoch callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Interrupt {
    #[error("call deadline exceeded")]
    Deadline,
    #[error("call cancelled")]
    Cancelled,
}

/// Turn the error a call failed with into a [`Trap`].
///
/// The host's own errors are recognised by type (downcast), never by
/// message; only wasmtime's trap codes are matched on.
/// What wasmtime says when an import call's arguments pass the store's
/// hostcall fuel ([`Limits::max_hostcall_bytes`](super::Limits::max_hostcall_bytes)).
const HOSTCALL_FUEL_EXHAUSTED: &str = "fuel allocated for hostcalls has been exhausted";

pub(crate) fn classify(err: &wasmtime::Error, log: &TaskLog) -> Trap {
    if let Some(interrupt) = err.downcast_ref::<Interrupt>() {
        return match interrupt {
            Interrupt::Deadline => Trap::DeadlineExceeded,
            Interrupt::Cancelled => Trap::Cancelled,
        };
    }
    if let Some(limit) = err.downcast_ref::<LimitTrap>() {
        return match limit {
            LimitTrap::Memory { .. } => Trap::OutOfMemory,
            LimitTrap::Exceeded(limit) => Trap::LimitExceeded(*limit),
        };
    }
    if err
        .downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
        .is_some()
    {
        return Trap::LimitExceeded(Limit::Concurrency);
    }
    // wasmtime's error for this is a private type, so it is the one trap
    // told by its text.
    if error_chain(err).contains(HOSTCALL_FUEL_EXHAUSTED) {
        return Trap::LimitExceeded(Limit::HostCallData);
    }
    if let Some(trap) = err.downcast_ref::<wasmtime::Trap>() {
        return match trap {
            wasmtime::Trap::StackOverflow => Trap::StackOverflow,
            wasmtime::Trap::OutOfFuel => Trap::LimitExceeded(Limit::Fuel),
            wasmtime::Trap::Interrupt => Trap::DeadlineExceeded,
            wasmtime::Trap::UnreachableCodeReached => {
                Trap::GuestPanic(log.panic_message().unwrap_or_else(|| trap.to_string()))
            }
            other => Trap::Other(other.to_string()),
        };
    }
    // The cause first: what wraps it (a wasm backtrace, say) goes to the task
    // log (see `call.rs`).
    Trap::Other(err.root_cause().to_string())
}

/// `outer: inner: root` for an error and its causes.
/// [`error_chain`] on one line: what a load error reports, so that a
/// refused module is one line in a log.
pub(crate) fn error_line(err: &wasmtime::Error) -> String {
    error_chain(err)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn error_chain(err: &wasmtime::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause.to_string());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryability() {
        assert!(Outcome::Retryable("x".into()).is_retryable());
        assert!(!Outcome::Fatal("x".into()).is_retryable());
        assert!(!Outcome::Success("{}".into()).is_retryable());
        assert!(Outcome::Trapped(Trap::DeadlineExceeded).is_retryable());
        assert!(!Outcome::Trapped(Trap::LimitExceeded(Limit::Result)).is_retryable());
        assert!(!Outcome::Trapped(Trap::LimitExceeded(Limit::HostCallData)).is_retryable());
        assert!(Outcome::Trapped(Trap::LimitExceeded(Limit::Fuel)).is_retryable());
        assert!(!Outcome::Trapped(Trap::Cancelled).is_retryable());
        assert!(!Outcome::Trapped(Trap::UnknownHandler("t".into())).is_retryable());
        assert!(!Outcome::Trapped(Trap::LimitExceeded(Limit::Payload)).is_retryable());
    }

    #[test]
    fn a_denial_makes_what_would_be_retried_fatal() {
        let denied = Some("GET http://evil.example:80");
        for retried in [
            Outcome::Retryable("busy".into()),
            Outcome::Trapped(Trap::GuestPanic("unwrap on an Err".into())),
        ] {
            let shown = retried.to_string();
            match retried.after_denial(denied) {
                Outcome::Fatal(msg) => {
                    assert!(msg.starts_with("outbound request GET http://evil.example:80 denied"));
                    assert!(msg.ends_with(&shown), "{msg}");
                }
                other => panic!("{other:?}"),
            }
        }
        for kept in [
            Outcome::Success("{}".into()),
            Outcome::Fatal("bad".into()),
            Outcome::Trapped(Trap::Cancelled),
        ] {
            assert_eq!(kept.clone().after_denial(denied), kept);
        }
        let retried = Outcome::Retryable("busy".into());
        assert_eq!(retried.clone().after_denial(None), retried);
    }

    #[test]
    fn classifies_host_errors_by_type() {
        let log = TaskLog::new(64);
        let err = wasmtime::Error::new(Interrupt::Cancelled).context("while calling");
        assert_eq!(classify(&err, &log), Trap::Cancelled);
        let err = wasmtime::Error::new(LimitTrap::Memory {
            limit: 1,
            desired: 2,
        });
        assert_eq!(classify(&err, &log), Trap::OutOfMemory);
        let err = wasmtime::Error::new(wasmtime::Trap::StackOverflow);
        assert_eq!(classify(&err, &log), Trap::StackOverflow);
    }
}
