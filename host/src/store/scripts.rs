//! The Lua scripts and the codes they return.
//!
//! One file per operation under `lua/`; shared fragments under
//! `lua/include/` are prepended at compile time, never copied (`idem.lua`
//! to every script, others to the scripts that name them). Each script
//! opens with a header naming its KEYS, ARGV, outputs and events; [`Code`]
//! mirrors the codes those headers list.

use redis::Script;

macro_rules! script {
    ($name:literal $(, $include:literal)*) => {
        Script::new(concat!(
            include_str!("lua/include/idem.lua"),
            $(include_str!(concat!("lua/include/", $include, ".lua")),)*
            include_str!(concat!("lua/", $name, ".lua"))
        ))
    };
}

/// Every script, loaded once per process.
pub(crate) struct Scripts {
    pub(crate) ingest: Script,
    pub(crate) start: Script,
    pub(crate) complete: Script,
    pub(crate) promote: Script,
    pub(crate) cancel: Script,
    pub(crate) requeue: Script,
    pub(crate) heartbeat: Script,
    pub(crate) reclaim: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            ingest: script!("ingest"),
            start: script!("start"),
            complete: script!("complete"),
            promote: script!("promote"),
            cancel: script!("cancel"),
            requeue: script!("requeue"),
            heartbeat: script!("heartbeat", "liveness"),
            reclaim: script!("reclaim", "liveness"),
        }
    }

    pub(crate) fn all(&self) -> [&Script; 8] {
        [
            &self.ingest,
            &self.start,
            &self.complete,
            &self.promote,
            &self.cancel,
            &self.requeue,
            &self.heartbeat,
            &self.reclaim,
        ]
    }
}

/// The return codes of the scripts, as their headers list them. Codes are
/// unique across scripts, so a code means one thing wherever it appears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// start: the message's task is terminal or gone; acknowledged.
    Skipped,
    /// Done: ingest created the task, complete/cancel/requeue applied;
    /// heartbeat: the task is still the attempt's.
    Ok,
    /// ingest: the key's task is terminal; this is a replay.
    Replay,
    /// cancel: the task is running; its worker was asked to interrupt it.
    /// heartbeat: the attempt's task was asked to cancel.
    CancelRequested,
    /// start: the task was not started before its expiry.
    Expired,
    /// start: the task's worker died and no attempts are left.
    Exhausted,
    /// ingest: the key's task is still in flight.
    InProgress,
    /// ingest: the key was used with another payload or task name.
    KeyMismatch,
    /// ingest: the queue is at its depth limit.
    QueueFull,
    /// complete: the task is not in the state this completion belongs to;
    /// heartbeat: the task is no longer the attempt's (reclaimed elsewhere).
    Stale,
    /// cancel: the task is already terminal.
    Terminal,
    /// cancel: no such task.
    NotFound,
    /// requeue: the task is not dead-lettered.
    NotInDlq,
}

impl Code {
    /// The code a script returned, or `None` for a number no script returns.
    pub fn from_i64(code: i64) -> Option<Code> {
        Some(match code {
            0 => Code::Skipped,
            1 => Code::Ok,
            2 => Code::Replay,
            3 => Code::CancelRequested,
            4 => Code::Expired,
            5 => Code::Exhausted,
            -1 => Code::InProgress,
            -2 => Code::KeyMismatch,
            -3 => Code::QueueFull,
            -4 => Code::Stale,
            -5 => Code::Terminal,
            -6 => Code::NotFound,
            -7 => Code::NotInDlq,
            _ => return None,
        })
    }
}
