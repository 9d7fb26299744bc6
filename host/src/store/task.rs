//! The task record as it is stored in its hash, and its statuses.
//!
//! # Attempt history
//!
//! A task's last attempt lives in its hash's own fields (`started_at`,
//! `finished_at`, `error`, `log`, the last entry of `digests`). An attempt
//! that does not end the task (a retry; a lost attempt, whose worker died)
//! is archived by the scripts as one field, `attempt:<n>` (JSON), before
//! the next attempt overwrites those fields: `complete.lua` for a retry,
//! `reclaim.lua` for a lost attempt, `requeue.lua` for the dead-lettered
//! attempt a requeue leaves behind (see `lua/include/attempts.lua`). The
//! happy path writes no such field. [`TaskRecord::attempt_history`] puts
//! the archive and the last attempt together, oldest first, at most
//! [`MAX_ATTEMPT_HISTORY`] attempts.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{StoreError, TaskProgress};

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskStatus {
    /// In the ready stream, waiting for a worker.
    Queued,
    /// Waiting in the delayed set for its first run.
    Scheduled,
    /// A worker runs it now.
    Running,
    /// Failed an attempt; waits in the delayed set for the next one.
    Retrying,
    /// The handler returned a result.
    Succeeded,
    /// The handler failed fatally.
    Failed,
    /// Every attempt failed; the task waits in the DLQ for an admin.
    DeadLettered,
    /// Cancelled before or while it ran.
    Cancelled,
    /// Not started before its expiry.
    Expired,
    /// Ran, and waits for its children (flows) to end, holding no slot;
    /// it runs again, as the same attempt, once they all have.
    Waiting,
}

impl TaskStatus {
    /// Every status, for listings and tests.
    pub const ALL: [TaskStatus; 10] = [
        TaskStatus::Queued,
        TaskStatus::Scheduled,
        TaskStatus::Running,
        TaskStatus::Retrying,
        TaskStatus::Succeeded,
        TaskStatus::Failed,
        TaskStatus::DeadLettered,
        TaskStatus::Cancelled,
        TaskStatus::Expired,
        TaskStatus::Waiting,
    ];

    /// The status as stored and shown: `QUEUED`, `DEAD_LETTERED`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Queued => "QUEUED",
            TaskStatus::Scheduled => "SCHEDULED",
            TaskStatus::Running => "RUNNING",
            TaskStatus::Retrying => "RETRYING",
            TaskStatus::Succeeded => "SUCCEEDED",
            TaskStatus::Failed => "FAILED",
            TaskStatus::DeadLettered => "DEAD_LETTERED",
            TaskStatus::Cancelled => "CANCELLED",
            TaskStatus::Expired => "EXPIRED",
            TaskStatus::Waiting => "WAITING",
        }
    }

    /// Whether the task will not run again (short of an admin requeue).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Succeeded
                | TaskStatus::Failed
                | TaskStatus::DeadLettered
                | TaskStatus::Cancelled
                | TaskStatus::Expired
        )
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaskStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown task status {s:?}")))
    }
}

/// A task as stored in `dtq:task:{q}:<id>`.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    /// The task id (a UUIDv7: time-ordered).
    pub id: String,
    /// The queue it was submitted to.
    pub queue: String,
    /// The task name, which selects the handler.
    pub task: String,
    /// The payload, JSON text.
    pub payload: String,
    /// Where the task is in its life.
    pub status: TaskStatus,
    /// Attempts started so far.
    pub attempts: u32,
    /// Attempts allowed before dead-lettering.
    pub max_attempts: u32,
    /// Per-task deadline of one attempt (ms), when the submission set one.
    pub timeout_ms: Option<u64>,
    /// The submission's idempotency key.
    pub idempotency_key: Option<String>,
    /// The result (JSON text) of a succeeded task.
    pub result: Option<String>,
    /// The last error.
    pub error: Option<String>,
    /// The last attempt's captured log.
    pub log: Option<String>,
    /// When it was submitted (ms since epoch).
    pub created_at: u64,
    /// When it last changed (ms since epoch).
    pub updated_at: u64,
    /// When its last attempt started.
    pub started_at: Option<u64>,
    /// When it reached a terminal status.
    pub finished_at: Option<u64>,
    /// When it is due (scheduled tasks and retries).
    pub run_at: Option<u64>,
    /// When it expires if not started by then.
    pub expires_at: Option<u64>,
    /// The stream message of its current run.
    pub msg_id: Option<String>,
    /// Whether a cancel was requested while it ran.
    pub cancel_requested: bool,
    /// The digest (SHA-256) of the module each attempt ran, in order; `-`
    /// for an attempt whose worker died.
    pub attempt_digests: Vec<String>,
    /// The archived attempts (`attempt:<n>` fields), by attempt number.
    pub archived_attempts: Vec<AttemptRecord>,
    /// The group it belongs to, for a group limit.
    pub group: Option<String>,
    /// What holds it while it waits SCHEDULED under a queue limit (`rate`
    /// or `group`), and until when (ms): see `store::limits`.
    pub held: Option<(String, u64)>,
    /// The last progress a handler reported, of whichever attempt
    /// reported it (`progress.rs`); [`TaskRecord::progress`] shows the last
    /// attempt's.
    pub reported_progress: Option<TaskProgress>,
    /// The task that submitted it as its child (flows), `<queue>/<id>`.
    pub parent: Option<String>,
}

/// How many attempts a task's history keeps: the scripts keep this many
/// archived attempts (`lua/include/attempts.lua`, which must agree), and
/// [`TaskRecord::attempt_history`] shows the last this many of the archive
/// and the last attempt together. Each archived log is at most
/// [`ARCHIVED_LOG_MAX_BYTES`], so a task's history stays under about
/// `MAX_ATTEMPT_HISTORY * ARCHIVED_LOG_MAX_BYTES` of logs however often it
/// is retried or requeued.
pub const MAX_ATTEMPT_HISTORY: usize = 20;

/// Largest log of an archived attempt, bytes; longer ones are cut (at a
/// character boundary, with a marker). The last attempt keeps its whole
/// log (up to the sandbox's log limit) in the task's `log` field.
pub const ARCHIVED_LOG_MAX_BYTES: usize = 8192;

/// One attempt of a task, as its history shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The attempt's number, from 1; numbers keep rising across requeues.
    pub attempt: u32,
    /// How it ended: `success`, `fatal`, `retry`, `lost` (its worker died;
    /// no log), `dead_lettered` (it failed or was lost with no attempt
    /// left, and the task was dead-lettered; its error says which),
    /// `cancelled`, or `running` (not ended yet).
    pub outcome: String,
    /// Its error (none for `success` and `running`).
    #[serde(default)]
    pub error: Option<String>,
    /// Its captured log (none for `lost` and `running`).
    #[serde(default)]
    pub log: Option<String>,
    /// When it started (ms since epoch).
    #[serde(default)]
    pub started_at: Option<u64>,
    /// When it ended (ms since epoch); for `lost`, when the loss was found.
    #[serde(default)]
    pub finished_at: Option<u64>,
    /// The digest of the module it ran (none for `lost` and `running`).
    #[serde(default)]
    pub digest: Option<String>,
}

impl AttemptRecord {
    /// `{"attempt", "outcome", "error", "log", "started_at", "finished_at",
    /// "duration_ms", "digest"}`.
    pub fn to_json(&self) -> Value {
        let duration = match (self.started_at, self.finished_at) {
            (Some(start), Some(end)) => Some(end.saturating_sub(start)),
            _ => None,
        };
        json!({
            "attempt": self.attempt,
            "outcome": self.outcome,
            "error": self.error,
            "log": self.log,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_ms": duration,
            "digest": self.digest,
        })
    }
}

/// Field `name` of a task hash, which every task has.
pub(super) fn required(value: Option<String>, name: &str) -> Result<String, StoreError> {
    value.ok_or_else(|| StoreError::Corrupt(format!("task hash lacks field {name:?}")))
}

/// Numeric field `name` of a task hash, if present.
pub(super) fn number(value: Option<String>, name: &str) -> Result<Option<u64>, StoreError> {
    value
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                StoreError::Corrupt(format!("task field {name:?} is not a number: {v:?}"))
            })
        })
        .transpose()
}

/// When a task reached its terminal status: its field `finished_at`, or,
/// for a success that wrote none, its `updated_at`. A carried attempt's
/// success (`complete.lua`) writes only `updated_at`, with the time
/// `finished_at` would hold: one field less to add to every hash, and
/// nothing changes a succeeded task's `updated_at` after.
pub fn finished_at(status: TaskStatus, finished_at: Option<u64>, updated_at: u64) -> Option<u64> {
    match finished_at {
        None if status == TaskStatus::Succeeded => Some(updated_at),
        finished_at => finished_at,
    }
}

impl TaskRecord {
    /// Parse a task hash as HGETALL returns it.
    pub fn from_fields(fields: HashMap<String, String>) -> Result<TaskRecord, StoreError> {
        let mut fields = fields;
        let archived_attempts = archived(&mut fields)?;
        let mut take = |name: &str| fields.remove(name).filter(|v| !v.is_empty());
        let id = required(take("id"), "id")?;
        let status = required(take("status"), "status")?.parse()?;
        let updated_at = number(take("updated_at"), "updated_at")?.unwrap_or(0);
        let finished = number(take("finished_at"), "finished_at")?;
        Ok(TaskRecord {
            queue: required(take("queue"), "queue")?,
            task: required(take("task"), "task")?,
            payload: required(take("payload"), "payload")?,
            status,
            attempts: number(take("attempts"), "attempts")?.unwrap_or(0) as u32,
            max_attempts: number(take("max_attempts"), "max_attempts")?.unwrap_or(1) as u32,
            timeout_ms: number(take("timeout_ms"), "timeout_ms")?,
            idempotency_key: take("idempotency_key"),
            result: take("result"),
            error: take("error"),
            log: take("log"),
            created_at: number(take("created_at"), "created_at")?.unwrap_or(0),
            updated_at,
            started_at: number(take("started_at"), "started_at")?,
            finished_at: finished_at(status, finished, updated_at),
            run_at: number(take("run_at"), "run_at")?,
            expires_at: number(take("expires_at"), "expires_at")?,
            msg_id: take("msg_id"),
            cancel_requested: take("cancel_requested").as_deref() == Some("1"),
            attempt_digests: take("digests")
                .map(|d| d.split(',').map(str::to_owned).collect())
                .unwrap_or_default(),
            archived_attempts,
            group: take("group"),
            held: match (take("held_by"), number(take("held_until"), "held_until")?) {
                (Some(by), Some(until)) if status == TaskStatus::Scheduled => Some((by, until)),
                _ => None,
            },
            reported_progress: take("progress").as_deref().and_then(TaskProgress::parse),
            parent: take("parent"),
            id,
        })
    }

    /// Parse the flat `[name, value, ...]` list that scripts return.
    pub fn from_flat(flat: Vec<String>) -> Result<TaskRecord, StoreError> {
        let mut fields = HashMap::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            fields.insert(k, v);
        }
        TaskRecord::from_fields(fields)
    }

    /// The record as the API shows it: payload and result as JSON values.
    pub fn to_json(&self) -> Value {
        let parse = |text: &str| serde_json::from_str(text).unwrap_or(Value::String(text.into()));
        json!({
            "task_id": self.id,
            "queue": self.queue,
            "task": self.task,
            "status": self.status,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "timeout_ms": self.timeout_ms,
            "idempotency_key": self.idempotency_key,
            "payload": parse(&self.payload),
            "result": self.result.as_deref().map(parse),
            "error": self.error,
            "log": self.log,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "run_at": self.run_at,
            "expires_at": self.expires_at,
            "cancel_requested": self.cancel_requested,
            "group": self.group,
            "held": self.held.as_ref().map(|(by, until)| json!({"by": by, "until": until})),
            "handler_digest": self.handler_digest(),
            "attempt_digests": self.attempt_digests,
            "attempt_history": self
                .attempt_history()
                .iter()
                .map(AttemptRecord::to_json)
                .collect::<Vec<_>>(),
            "progress": self.progress().map(TaskProgress::to_json),
            "parent": self.parent.as_deref().and_then(super::parse_task_ref).map(|(queue, id)| {
                json!({"queue": super::logical_queue(queue), "task_id": id})
            }),
        })
    }

    /// The progress its last attempt reported, while it runs and after:
    /// none once another attempt began (a retry starts without progress
    /// until its handler reports).
    pub fn progress(&self) -> Option<&TaskProgress> {
        self.reported_progress
            .as_ref()
            .filter(|p| self.attempts > 0 && p.attempt == self.attempts)
    }

    /// Every attempt the task keeps, oldest first: the archived ones and
    /// the last one, at most [`MAX_ATTEMPT_HISTORY`] (the newest).
    pub fn attempt_history(&self) -> Vec<AttemptRecord> {
        let mut history = self.archived_attempts.clone();
        if let Some(last) = self.last_attempt() {
            match history.iter_mut().find(|a| a.attempt == last.attempt) {
                // Archived as lost by reclaim, and the task dead-lettered
                // for it: the archive, as what ended the task.
                Some(archived) if archived.outcome == "lost" && self.ended_lost() => {
                    archived.outcome = last.outcome;
                }
                // Archived as lost by reclaim, yet its worker finished it
                // before the next attempt began: the finish is the truth.
                Some(archived) if archived.outcome == "lost" && last.outcome != "lost" => {
                    *archived = last;
                }
                Some(_) => {}
                None => history.push(last),
            }
        }
        history.sort_by_key(|a| a.attempt);
        let extra = history.len().saturating_sub(MAX_ATTEMPT_HISTORY);
        history.drain(..extra);
        history
    }

    /// The last attempt as the hash's own fields hold it, when they hold
    /// one: the task runs it, or it ended the task. A task waiting for its
    /// next attempt (QUEUED, SCHEDULED, RETRYING) has its last attempt
    /// archived; an EXPIRED one (or one cancelled while waiting) ended
    /// without an attempt.
    fn last_attempt(&self) -> Option<AttemptRecord> {
        if self.attempts == 0 {
            return None;
        }
        let digest = self
            .attempt_digests
            .last()
            .filter(|d| d.as_str() != "-")
            .cloned();
        let lost = self.attempt_digests.last().is_some_and(|d| d == "-");
        let (outcome, error, log) = match self.status {
            TaskStatus::Running => {
                return Some(AttemptRecord {
                    attempt: self.attempts,
                    outcome: "running".into(),
                    error: None,
                    log: None,
                    started_at: self.started_at,
                    finished_at: None,
                    digest: None,
                });
            }
            TaskStatus::Succeeded => ("success", None, self.log.clone()),
            // Its run so far ended asking to wait for its children.
            TaskStatus::Waiting => ("wait", None, self.log.clone()),
            TaskStatus::Failed => ("fatal", self.error.clone(), self.log.clone()),
            TaskStatus::Cancelled => ("cancelled", self.error.clone(), self.log.clone()),
            TaskStatus::DeadLettered if lost => ("dead_lettered", self.error.clone(), None),
            TaskStatus::DeadLettered => ("dead_lettered", self.error.clone(), self.log.clone()),
            TaskStatus::Queued
            | TaskStatus::Scheduled
            | TaskStatus::Retrying
            | TaskStatus::Expired => return None,
        };
        // A task cancelled while waiting keeps the archive of its last
        // attempt, which the caller prefers; this record is then unused.
        Some(AttemptRecord {
            attempt: self.attempts,
            outcome: outcome.into(),
            error,
            log,
            started_at: self.started_at,
            finished_at: self.finished_at,
            digest: if lost { None } else { digest },
        })
    }

    /// Whether the task was dead-lettered by a lost attempt (its worker
    /// died during it, digest "-").
    fn ended_lost(&self) -> bool {
        self.status == TaskStatus::DeadLettered
            && self.attempt_digests.last().is_some_and(|d| d == "-")
    }

    /// The digest of the module the last attempt that ran used.
    pub fn handler_digest(&self) -> Option<&str> {
        self.attempt_digests
            .iter()
            .rev()
            .map(String::as_str)
            .find(|d| *d != "-")
    }
}

/// Take the `attempt:<n>` fields out of `fields`, parsed, by number.
fn archived(fields: &mut HashMap<String, String>) -> Result<Vec<AttemptRecord>, StoreError> {
    let names: Vec<String> = fields
        .keys()
        .filter(|k| k.starts_with("attempt:"))
        .cloned()
        .collect();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let Some(text) = fields.remove(&name) else {
            continue;
        };
        let record: AttemptRecord = serde_json::from_str(&text)
            .map_err(|e| StoreError::Corrupt(format!("task field {name:?}: {e}")))?;
        out.push(record);
    }
    out.sort_by_key(|a| a.attempt);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(extra: &[(&str, &str)]) -> HashMap<String, String> {
        let fields: HashMap<String, String> = [
            ("id", "t1"),
            ("queue", "q"),
            ("task", "flaky"),
            ("payload", "{}"),
            ("max_attempts", "30"),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        fields
    }

    fn archived_field(n: u32, outcome: &str) -> (String, String) {
        (
            format!("attempt:{n}"),
            json!({"attempt": n, "outcome": outcome, "error": format!("e{n}"),
                "started_at": 100 * n, "finished_at": 100 * n + 7, "digest": "d"})
            .to_string(),
        )
    }

    fn record(status: &str, attempts: u32, archive: &[(u32, &str)], digests: &str) -> TaskRecord {
        let mut fields = hash(&[
            ("status", status),
            ("digests", digests),
            ("error", "last error"),
            ("log", "last log"),
            ("started_at", "5000"),
            ("finished_at", "5042"),
        ]);
        fields.insert("attempts".into(), attempts.to_string());
        for (n, outcome) in archive {
            let (k, v) = archived_field(*n, outcome);
            fields.insert(k, v);
        }
        TaskRecord::from_fields(fields).expect("parses")
    }

    fn outcomes(task: &TaskRecord) -> Vec<(u32, String)> {
        task.attempt_history()
            .into_iter()
            .map(|a| (a.attempt, a.outcome))
            .collect()
    }

    #[test]
    fn a_success_without_finished_at_finished_when_it_was_updated() {
        // A carried attempt's success writes `updated_at` only.
        let carried = hash(&[("status", "SUCCEEDED"), ("updated_at", "7000")]);
        let task = TaskRecord::from_fields(carried).expect("parses");
        assert_eq!(task.finished_at, Some(7000));
        let written = hash(&[
            ("status", "SUCCEEDED"),
            ("updated_at", "7000"),
            ("finished_at", "6990"),
        ]);
        let task = TaskRecord::from_fields(written).expect("parses");
        assert_eq!(task.finished_at, Some(6990));
        // Any other status says when it finished itself, if it did.
        for status in ["RUNNING", "FAILED"] {
            let other = hash(&[("status", status), ("updated_at", "7000")]);
            let task = TaskRecord::from_fields(other).expect("parses");
            assert_eq!(task.finished_at, None, "{status}");
        }
    }

    #[test]
    fn a_hold_shows_while_scheduled_only() {
        let held = [
            ("group", "customer-7"),
            ("held_by", "group"),
            ("held_until", "9000"),
        ];
        let waiting = hash(&[&[("status", "SCHEDULED")][..], &held].concat());
        let task = TaskRecord::from_fields(waiting).expect("parses");
        assert_eq!(task.held, Some(("group".to_owned(), 9000)));
        let json = task.to_json();
        assert_eq!(json["held"], json!({"by": "group", "until": 9000}));
        assert_eq!(json["group"], "customer-7");
        // Admitted later, its worker may not have cleared the fields yet:
        // a running task is not held.
        let running = hash(&[&[("status", "RUNNING")][..], &held].concat());
        let task = TaskRecord::from_fields(running).expect("parses");
        assert_eq!(task.held, None);
        assert_eq!(task.to_json()["held"], Value::Null);
    }

    #[test]
    fn the_last_attempt_comes_from_the_hash_and_the_rest_from_the_archive() {
        let task = record("SUCCEEDED", 3, &[(1, "retry"), (2, "lost")], "d,-,d");
        assert_eq!(
            outcomes(&task),
            [
                (1, "retry".into()),
                (2, "lost".into()),
                (3, "success".into())
            ]
        );
        let last = &task.attempt_history()[2];
        assert_eq!(last.error, None);
        assert_eq!(last.log.as_deref(), Some("last log"));
        assert_eq!(last.to_json()["duration_ms"], 42);
        assert_eq!(task.to_json()["attempt_history"][0]["duration_ms"], 7);
    }

    #[test]
    fn a_waiting_task_shows_only_its_archive_and_a_running_one_its_attempt() {
        let retrying = record("RETRYING", 2, &[(1, "retry"), (2, "retry")], "d,d");
        assert_eq!(outcomes(&retrying).len(), 2);
        let running = record("RUNNING", 3, &[(1, "retry"), (2, "retry")], "d,d");
        let last = running.attempt_history().pop().expect("an attempt");
        assert_eq!((last.attempt, last.outcome.as_str()), (3, "running"));
        assert_eq!((last.error, last.log, last.digest), (None, None, None));
        let expired = record("EXPIRED", 1, &[(1, "retry")], "d");
        assert_eq!(outcomes(&expired), [(1, "retry".into())]);
    }

    #[test]
    fn a_dead_lettered_lost_attempt_has_no_log_and_a_late_finish_wins_over_lost() {
        let lost = record("DEAD_LETTERED", 1, &[], "-");
        let last = &lost.attempt_history()[0];
        assert_eq!(
            (last.outcome.as_str(), last.log.as_deref()),
            ("dead_lettered", None)
        );
        // Archived as lost by reclaim; the worker finished it after all.
        let late = record("SUCCEEDED", 1, &[(1, "lost")], "-,d");
        assert_eq!(outcomes(&late), [(1, "success".into())]);
        // Dead-lettered after reclaim archived it: the archive stays,
        // labelled as what ended the task.
        let exhausted = record("DEAD_LETTERED", 1, &[(1, "lost")], "-");
        let last = &exhausted.attempt_history()[0];
        assert_eq!(
            (last.outcome.as_str(), last.error.as_deref()),
            ("dead_lettered", Some("e1"))
        );
        // Failed with no attempt left.
        let spent = record("DEAD_LETTERED", 2, &[(1, "retry")], "d,d");
        assert_eq!(
            outcomes(&spent),
            [(1, "retry".into()), (2, "dead_lettered".into())]
        );
    }

    #[test]
    fn the_history_shows_at_most_the_bound() {
        let archive: Vec<(u32, &str)> = (11..=30).map(|n| (n, "retry")).collect();
        let task = record("DEAD_LETTERED", 31, &archive, "d");
        let history = outcomes(&task);
        assert_eq!(history.len(), MAX_ATTEMPT_HISTORY);
        assert_eq!(history.first().map(|a| a.0), Some(12));
        assert_eq!(history.last().map(|a| a.0), Some(31));
    }

    #[test]
    fn a_task_shows_the_progress_of_its_last_attempt_only() {
        let progress = r#"{"fraction":0.25,"message":"a quarter","updated_at":7,"attempt":2}"#;
        let with = |status: &str, attempts: &str| {
            let mut fields = hash(&[("status", status), ("progress", progress)]);
            fields.insert("attempts".into(), attempts.into());
            TaskRecord::from_fields(fields).expect("parses")
        };
        for (status, attempts) in [("RUNNING", "2"), ("SUCCEEDED", "2"), ("RETRYING", "2")] {
            assert_eq!(
                with(status, attempts).to_json()["progress"],
                json!({"fraction": 0.25, "message": "a quarter", "updated_at": 7}),
                "{status}"
            );
        }
        // The next attempt runs: attempt 2's report is not its progress.
        assert_eq!(with("RUNNING", "3").to_json()["progress"], Value::Null);
        assert!(with("RUNNING", "3").reported_progress.is_some());
        // None reported, or a field that does not read: none shown.
        assert_eq!(
            record("RUNNING", 1, &[], "").to_json()["progress"],
            Value::Null
        );
        let mut bad = hash(&[("status", "RUNNING"), ("attempts", "1"), ("progress", "{")]);
        bad.insert("attempts".into(), "1".into());
        assert_eq!(
            TaskRecord::from_fields(bad)
                .map(|t| t.progress().cloned())
                .ok(),
            Some(None)
        );
    }

    #[test]
    fn the_scripts_bounds_agree_with_the_hosts() {
        let lua = include_str!("lua/include/attempts.lua");
        assert!(lua.contains(&format!(
            "local MAX_ATTEMPT_HISTORY = {MAX_ATTEMPT_HISTORY}\n"
        )));
        assert!(lua.contains(&format!(
            "local ARCHIVED_LOG_MAX_BYTES = {ARCHIVED_LOG_MAX_BYTES}\n"
        )));
    }
}
