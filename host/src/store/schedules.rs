//! Periodic tasks: a queue's schedules, as stored, and the cron
//! expressions that time them.
//!
//! # Keys
//!
//! | key | type | holds |
//! |---|---|---|
//! | `dtq:schedules:{q}` | hash | name → definition, JSON ([`ScheduleDef`]) |
//! | `dtq:schedule-due:{q}` | sorted set | name → its next tick (ms, UTC) |
//! | `dtq:schedule-fired:{q}` | hash | name → its last fired tick, JSON ([`FiredTick`]) |
//!
//! A definition and its next tick are written together
//! (`lua/schedule_put.lua`) and deleted together with the last fired tick
//! (`lua/schedule_delete.lua`). The schedulers (`worker/schedule.rs`) read
//! the due names ([`Store::due_schedules`]), submit each tick's task, and
//! move the due time on with a compare-and-set on the time they read
//! ([`Store::advance_schedule`], `lua/schedule_advance.lua`).
//!
//! # Time
//!
//! Cron expressions ([`CronExpr`]) have 5 fields (minute, hour, day of
//! month, month, day of week) or 6 with seconds first, read as croner reads
//! them (POSIX/Vixie cron: `0` and `7` are Sunday, names such as `MON` and
//! `JAN`, `L`, `#`, `W`, and `@hourly`-style nicknames), and tick in UTC
//! ([`TIMEZONE`]): no daylight-saving gap or repeat ever skips or doubles a
//! tick. Ticks are whole seconds, kept as ms since the epoch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::scripts::{Argv, ArgvLayout};
use super::{QueueKeys, Store, StoreError};

/// `schedule_put.lua`'s ARGV by name.
pub(super) static SCHEDULE_PUT_ARGV: ArgvLayout = ArgvLayout {
    script: "schedule_put",
    prefix: "ARG_",
    first: 1,
    names: &["NAME", "DEFINITION", "NEXT_TICK"],
    rest: None,
};

/// `schedule_delete.lua`'s ARGV by name.
pub(super) static SCHEDULE_DELETE_ARGV: ArgvLayout = ArgvLayout {
    script: "schedule_delete",
    prefix: "ARG_",
    first: 1,
    names: &["NAME"],
    rest: None,
};

/// `schedule_advance.lua`'s ARGV by name.
pub(super) static SCHEDULE_ADVANCE_ARGV: ArgvLayout = ArgvLayout {
    script: "schedule_advance",
    prefix: "ARG_",
    first: 1,
    names: &["NAME", "READ", "NEXT_TICK", "FIRED"],
    rest: None,
};

/// The time zone every schedule ticks in.
pub const TIMEZONE: &str = "UTC";

/// The longest schedule name, in bytes (as queue and task names).
pub const MAX_SCHEDULE_NAME_BYTES: usize = 64;

/// A schedule as stored in `dtq:schedules:{q}`: what to submit, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleDef {
    /// The cron expression (see [`CronExpr`]).
    pub cron: String,
    /// The task name each tick submits.
    pub task: String,
    /// The payload of each tick's task.
    #[serde(default)]
    pub payload: Value,
    /// Attempts of each task; `None`: the task's deploy default, then the
    /// workers' `--max-attempts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Deadline of one attempt (ms); `None`: the handler's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// When the schedule was last set (ms since epoch).
    #[serde(default)]
    pub updated_at: u64,
}

/// What the last fired tick of a schedule did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FiredTick {
    /// The tick (ms since epoch, UTC).
    pub tick: u64,
    /// The tick's task; `None` when the submission was refused.
    #[serde(default)]
    pub task_id: Option<String>,
    /// When it was fired (ms since epoch).
    pub fired_at: u64,
    /// Why the tick made no task (the submission's error code and
    /// message), when it made none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A schedule with its state, as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Its name, unique in the queue.
    pub name: String,
    /// What it submits and when.
    pub def: ScheduleDef,
    /// Its next tick (ms since epoch); `None` when the expression has no
    /// tick left.
    pub next_at: Option<u64>,
    /// Its last fired tick, if any.
    pub last: Option<FiredTick>,
}

impl Schedule {
    /// The schedule as the API shows it.
    pub fn to_json(&self, queue: &str) -> Value {
        json!({
            "queue": queue,
            "name": self.name,
            "cron": self.def.cron,
            "timezone": TIMEZONE,
            "task": self.def.task,
            "payload": self.def.payload,
            "max_attempts": self.def.max_attempts,
            "timeout_ms": self.def.timeout_ms,
            "updated_at": self.def.updated_at,
            "next_at": self.next_at,
            "last": self.last,
        })
    }
}

/// The idempotency key of `schedule`'s task for `tick`: every scheduler
/// that fires the tick submits with it, so the tick makes one task.
pub fn tick_key(schedule: &str, tick: u64) -> String {
    format!("schedule:{schedule}:{tick}")
}

/// Check a schedule name: 1 to [`MAX_SCHEDULE_NAME_BYTES`] bytes of
/// `[A-Za-z0-9_.-]`, the rule of queue and task names, so that the tick's
/// idempotency key ([`tick_key`]) is always a valid key.
pub fn validate_schedule_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_SCHEDULE_NAME_BYTES {
        return Err(format!(
            "schedule name must be 1 to {MAX_SCHEDULE_NAME_BYTES} bytes, got {}",
            name.len()
        ));
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        Some(c) => Err(format!(
            "schedule name {name:?} has {c:?}; only letters, digits, '_', '.' and '-' are allowed"
        )),
        None => Ok(()),
    }
}

/// A cron expression that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron expression {expr:?}: {reason}")]
pub struct InvalidCron {
    /// The expression (its first 200 characters).
    pub expr: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A parsed cron expression: 5 fields, or 6 with seconds first; UTC.
#[derive(Debug, Clone)]
pub struct CronExpr(Cron);

impl CronExpr {
    /// Parse `expr`. Seven fields (a year) are refused: the documented
    /// forms are 5 and 6 fields.
    pub fn parse(expr: &str) -> Result<CronExpr, InvalidCron> {
        let invalid = |reason: String| InvalidCron {
            expr: expr.chars().take(200).collect(),
            reason,
        };
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        parser
            .parse(expr)
            .map(CronExpr)
            .map_err(|e| invalid(e.to_string()))
    }

    /// The first tick strictly after `ms` (ms since epoch), if any.
    pub fn next_after(&self, ms: u64) -> Option<u64> {
        let from = whole_second(ms)?;
        self.0.find_next_occurrence(&from, false).ok().map(to_ms)
    }

    /// The last tick at or before `ms`, if any.
    pub fn latest_at_or_before(&self, ms: u64) -> Option<u64> {
        let from = whole_second(ms)?;
        self.0.find_previous_occurrence(&from, true).ok().map(to_ms)
    }
}

/// `ms` rounded down to its second, as a UTC time: ticks are whole seconds.
fn whole_second(ms: u64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(i64::try_from(ms / 1000).ok()?, 0)
}

fn to_ms(at: DateTime<Utc>) -> u64 {
    u64::try_from(at.timestamp_millis()).unwrap_or(0)
}

fn corrupt(what: &str, name: &str, e: serde_json::Error) -> StoreError {
    StoreError::Corrupt(format!("{what} of schedule {name:?}: {e}"))
}

impl Store {
    /// Create or replace schedule `name` of `queue`, due first at `next`
    /// (see `lua/schedule_put.lua`). Returns whether it is new.
    pub async fn put_schedule(
        &self,
        queue: &str,
        name: &str,
        def: &ScheduleDef,
        next: u64,
    ) -> Result<bool, StoreError> {
        let keys = QueueKeys::new(queue);
        let text = serde_json::to_string(def).map_err(|e| corrupt("definition", name, e))?;
        let mut inv = self.scripts.schedule_put.prepare_invoke();
        inv.key(&keys.schedules).key(&keys.schedule_due);
        Argv::new(&mut inv, &SCHEDULE_PUT_ARGV)
            .put("NAME", name)
            .put("DEFINITION", text)
            .put("NEXT_TICK", next)
            .done();
        let created: i64 = self
            .trip("schedule_put", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok(created == 1)
    }

    /// Delete schedule `name` of `queue`; `false` when there was none.
    pub async fn delete_schedule(&self, queue: &str, name: &str) -> Result<bool, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.schedule_delete.prepare_invoke();
        inv.key(&keys.schedules)
            .key(&keys.schedule_due)
            .key(&keys.schedule_fired);
        Argv::new(&mut inv, &SCHEDULE_DELETE_ARGV)
            .put("NAME", name)
            .done();
        let deleted: i64 = self
            .trip("schedule_delete", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok(deleted == 1)
    }

    /// The definition of schedule `name` of `queue`, if it exists.
    pub async fn schedule_def(
        &self,
        queue: &str,
        name: &str,
    ) -> Result<Option<ScheduleDef>, StoreError> {
        let keys = QueueKeys::new(queue);
        let text: Option<String> = self
            .trip(
                "schedule_def",
                redis::cmd("HGET")
                    .arg(&keys.schedules)
                    .arg(name)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        text.map(|t| serde_json::from_str(&t).map_err(|e| corrupt("definition", name, e)))
            .transpose()
    }

    /// Every schedule of `queue`, by name, with its next and last tick.
    pub async fn schedules(&self, queue: &str) -> Result<Vec<Schedule>, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut pipe = redis::pipe();
        pipe.hgetall(&keys.schedules)
            .cmd("ZRANGE")
            .arg(&keys.schedule_due)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .hgetall(&keys.schedule_fired);
        type Reply = (
            HashMap<String, String>,
            Vec<(String, f64)>,
            HashMap<String, String>,
        );
        let (defs, due, mut fired): Reply = self
            .trip("schedules", pipe.query_async(&mut self.conn.clone()))
            .await?;
        let due: HashMap<String, u64> = due.into_iter().map(|(n, at)| (n, at as u64)).collect();
        let mut out = defs
            .into_iter()
            .map(|(name, text)| {
                let def =
                    serde_json::from_str(&text).map_err(|e| corrupt("definition", &name, e))?;
                let last = fired
                    .remove(&name)
                    .map(|t| serde_json::from_str(&t).map_err(|e| corrupt("last tick", &name, e)))
                    .transpose()?;
                Ok(Schedule {
                    next_at: due.get(&name).copied(),
                    name,
                    def,
                    last,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Up to `limit` schedules of `queue` due at `now`, each with the due
    /// time read (what [`Store::advance_schedule`] compares), and the next
    /// due time after `now`, if any (`Some(now)` when more than `limit` are
    /// due: the caller comes back at once).
    pub async fn due_schedules(
        &self,
        queue: &str,
        now: u64,
        limit: usize,
    ) -> Result<(Vec<(String, u64)>, Option<u64>), StoreError> {
        let keys = QueueKeys::new(queue);
        self.due_members("schedule_due", &keys.schedule_due, now, limit)
            .await
    }

    /// Move schedule `name`'s due time from `read` (the time the caller
    /// read and fired) to `next` (`None`: no tick left), recording `fired`;
    /// only if it is still `read` (see `lua/schedule_advance.lua`).
    /// Returns whether it moved.
    pub async fn advance_schedule(
        &self,
        queue: &str,
        name: &str,
        read: u64,
        next: Option<u64>,
        fired: Option<&FiredTick>,
    ) -> Result<bool, StoreError> {
        let keys = QueueKeys::new(queue);
        let fired = fired
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| corrupt("last tick", name, e))?
            .unwrap_or_default();
        let mut inv = self.scripts.schedule_advance.prepare_invoke();
        inv.key(&keys.schedule_due).key(&keys.schedule_fired);
        Argv::new(&mut inv, &SCHEDULE_ADVANCE_ARGV)
            .put("NAME", name)
            .put("READ", read)
            .put("NEXT_TICK", next.map(|n| n.to_string()).unwrap_or_default())
            .put("FIRED", fired)
            .done();
        let moved: i64 = self
            .trip("schedule_advance", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok(moved == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-01-01T00:00:00Z, a Thursday.
    const NEW_YEAR: u64 = 1_767_225_600_000;

    #[test]
    fn five_and_six_fields_parse_and_seven_or_garbage_do_not() {
        for good in [
            "* * * * *",
            "*/5 * * * *",
            "0 0 * * MON",
            "*/2 * * * * *",
            "@hourly",
        ] {
            assert!(CronExpr::parse(good).is_ok(), "{good:?} refused");
        }
        for bad in [
            "",
            "* * * *",
            "0 0 0 1 1 * 2030",
            "61 * * * *",
            "every minute",
            "* * * * * * * *",
        ] {
            assert!(CronExpr::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ticks_are_whole_seconds_in_utc_strictly_after_and_at_or_before() {
        let every_minute = CronExpr::parse("* * * * *").expect("parses");
        assert_eq!(every_minute.next_after(NEW_YEAR), Some(NEW_YEAR + 60_000));
        assert_eq!(
            every_minute.next_after(NEW_YEAR + 1),
            Some(NEW_YEAR + 60_000)
        );
        assert_eq!(every_minute.latest_at_or_before(NEW_YEAR), Some(NEW_YEAR));
        assert_eq!(
            every_minute.latest_at_or_before(NEW_YEAR + 59_999),
            Some(NEW_YEAR)
        );
        let every_second = CronExpr::parse("* * * * * *").expect("parses");
        assert_eq!(
            every_second.next_after(NEW_YEAR + 500),
            Some(NEW_YEAR + 1000)
        );
        assert_eq!(
            every_second.latest_at_or_before(NEW_YEAR + 3_500),
            Some(NEW_YEAR + 3_000)
        );
        // 09:30 UTC on weekdays: New Year's Day 2026 is a Thursday.
        let weekdays = CronExpr::parse("30 9 * * 1-5").expect("parses");
        assert_eq!(weekdays.next_after(NEW_YEAR), Some(NEW_YEAR + 34_200_000));
    }

    #[test]
    fn an_expression_that_never_matches_has_no_tick() {
        let never = CronExpr::parse("0 0 30 2 *").expect("parses: 30 February");
        assert_eq!(never.next_after(NEW_YEAR), None);
    }

    #[test]
    fn schedule_names_follow_the_queue_name_rule() {
        assert!(validate_schedule_name("nightly-report.v2").is_ok());
        for bad in ["", "a:b", "a b", "a{b}", &"x".repeat(65)] {
            assert!(validate_schedule_name(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(tick_key("n", 42), "schedule:n:42");
    }
}
