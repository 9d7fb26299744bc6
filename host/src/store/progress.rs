//! A running attempt's progress, as its handler reports it: written into
//! the task's hash (field `progress`) and, where the fleet writes every
//! event (`--events all`), as a `PROGRESS` event, by `lua/progress.lua`.
//!
//! The sandbox reports through [`write_progress`], on its own connection
//! (it has no [`Store`](super::Store)), at most a few times a second per
//! call; the script writes only while the task runs that attempt, so a
//! report that arrives late is dropped rather than written over a
//! completed task or a later attempt. A task shows the progress of its
//! last attempt only ([`TaskProgress`], read with the task in `task.rs`).

use std::sync::LazyLock;

use redis::Script;
use serde::Deserialize;

use super::scripts::{Argv, ArgvLayout, compose};
use super::{Conn, GROUP, QueueKeys, StoreError};

/// `progress.lua`'s ARGV by name.
pub(super) static PROGRESS_ARGV: ArgvLayout = ArgvLayout {
    script: "progress",
    prefix: "ARG_",
    first: 1,
    names: &[
        "GROUP",
        "TASK_ID",
        "ATTEMPT",
        "FRACTION",
        "MESSAGE",
        "AT",
        "EVENTS_MAX_LEN",
    ],
    rest: None,
};

/// `progress.lua` after the fragment that tells a carried first attempt.
static PROGRESS: LazyLock<Script> = LazyLock::new(|| {
    compose(
        &[include_str!("lua/include/carried.lua")],
        include_str!("lua/progress.lua"),
    )
});

/// The attempt a progress report belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportingAttempt {
    /// The queue the task was submitted to (its name, or its partition's).
    pub queue: String,
    /// The task.
    pub task_id: String,
    /// The attempt, from 1.
    pub attempt: u32,
}

/// One progress report, made safe by the sandbox (a fraction in 0..=1, a
/// message within its cap).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProgressReport {
    /// How far the attempt is, 0 to 1.
    pub fraction: f64,
    /// What the handler said of it.
    pub message: String,
    /// When the handler reported it, ms since the Unix epoch.
    pub at: u64,
}

/// Write `report` as the progress of `attempt`, and a `PROGRESS` event
/// unless `events_max_len` is 0. `Ok(false)`: the task does not run that
/// attempt (any more), and nothing was written.
pub async fn write_progress(
    conn: &mut Conn,
    attempt: &ReportingAttempt,
    report: &ProgressReport,
    events_max_len: u64,
) -> Result<bool, StoreError> {
    let keys = QueueKeys::of_task(&attempt.queue, &attempt.task_id);
    let mut inv = PROGRESS.prepare_invoke();
    inv.key(&keys.stream)
        .key(&keys.events)
        .key(keys.task(&attempt.task_id));
    Argv::new(&mut inv, &PROGRESS_ARGV)
        .put("GROUP", GROUP)
        .put("TASK_ID", &attempt.task_id)
        .put("ATTEMPT", attempt.attempt)
        .put("FRACTION", report.fraction.to_string())
        .put("MESSAGE", &report.message)
        .put("AT", report.at)
        .put("EVENTS_MAX_LEN", events_max_len)
        .done();
    let written: i64 = inv.invoke_async(conn).await?;
    Ok(written == 1)
}

/// A task's progress as its hash keeps it (`progress.lua`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TaskProgress {
    /// How far the attempt is, 0 to 1.
    pub fraction: f64,
    /// What the handler said of it.
    pub message: String,
    /// When the handler reported it, ms since the Unix epoch.
    pub updated_at: u64,
    /// The attempt that reported it.
    pub attempt: u32,
}

impl TaskProgress {
    /// The field's JSON text, if it reads as progress: a field that does
    /// not (none is written) shows as no progress rather than making the
    /// whole task unreadable.
    pub(super) fn parse(text: &str) -> Option<TaskProgress> {
        let progress = serde_json::from_str::<TaskProgress>(text);
        if let Err(e) = &progress {
            tracing::debug!(error = %e, "a task's progress field does not parse");
        }
        progress.ok()
    }

    /// `{"fraction", "message", "updated_at"}`, as the API shows it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "fraction": self.fraction,
            "message": self.message,
            "updated_at": self.updated_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_reads_back_and_a_bad_one_is_none() {
        let text = r#"{"fraction":0.5,"message":"half","updated_at":1700000000000,"attempt":2}"#;
        let progress = TaskProgress::parse(text).expect("parses");
        assert_eq!(progress.attempt, 2);
        assert_eq!(
            progress.to_json(),
            serde_json::json!({"fraction": 0.5, "message": "half", "updated_at": 1_700_000_000_000u64})
        );
        // As cjson writes a whole number: without a fraction part.
        let whole = r#"{"fraction":1,"message":"","updated_at":5,"attempt":1}"#;
        assert_eq!(TaskProgress::parse(whole).map(|p| p.fraction), Some(1.0));
        assert_eq!(TaskProgress::parse("not json"), None);
        assert_eq!(TaskProgress::parse(r#"{"fraction":0.5}"#), None);
    }
}
