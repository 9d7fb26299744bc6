//! What the commands print for a person at a terminal: tables, times in
//! the local time zone, durations as people say them (`1m 30s`).
//!
//! Each answer is read as the JSON the API sent ([`Value`]), so a table
//! shows the same answer a script gets with `--json`; a field a table has
//! no column for is still in the JSON. A time is a field named `at`,
//! `tick` or `*_at` holding ms since the epoch; a duration one named
//! `*_ms`. Tables are drawn by comfy-table (column widths over Unicode
//! text), without borders, in the manner of `kubectl get`.

use std::time::Duration;

use chrono::{Local, TimeZone as _};
use comfy_table::{Table, presets};
use serde_json::{Map, Value};

/// Which answer a value is, for its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    /// A task's record, or a submission's answer: its fields, then its
    /// attempts.
    Task,
    /// A page of `dtq tasks`.
    TaskPage,
    /// `dtq queues`: every queue's counts, or one's.
    Queues,
    /// `dtq dlq list`.
    DeadLetters,
    /// `dtq handlers`: the deployed handlers, then the fleet.
    Handlers,
    /// `dtq handlers history`.
    History,
    /// `dtq schedule list`.
    Schedules,
    /// Any other answer: its fields, one a row.
    Record,
}

/// `value` (an answer of the kind `view` says) as text for a terminal,
/// ending with a newline.
pub(crate) fn render(view: View, value: &Value) -> String {
    let text = match (view, value) {
        (View::Task, Value::Object(task)) => task_text(task),
        (View::TaskPage, Value::Object(page)) => page_text(page),
        (View::Queues, Value::Object(answer)) => queues_text(answer),
        (View::DeadLetters, Value::Object(answer)) => dead_letters_text(answer),
        (View::Handlers, Value::Object(answer)) => handlers_text(answer),
        (View::History, Value::Object(answer)) => history_text(answer),
        (View::Schedules, Value::Object(answer)) => schedules_text(answer),
        (_, Value::Array(items)) => items
            .iter()
            .map(|item| render(view, item))
            .collect::<Vec<_>>()
            .join("\n"),
        (_, Value::Object(fields)) => record(fields, &[], &[]).to_string(),
        (_, other) => cell("", other),
    };
    let mut text = text.trim_end().to_owned();
    text.push('\n');
    text
}

/// `ms` since the epoch in the local time zone: `2026-12-06 11:40:29`.
pub(crate) fn local_time(ms: u64) -> String {
    local(ms, "%Y-%m-%d %H:%M:%S")
}

/// `ms` since the epoch as a time of day, to the ms: `11:40:29.123`.
pub(crate) fn local_clock(ms: u64) -> String {
    local(ms, "%H:%M:%S%.3f")
}

fn local(ms: u64, format: &str) -> String {
    match i64::try_from(ms)
        .ok()
        .and_then(|ms| Local.timestamp_millis_opt(ms).single())
    {
        Some(at) => at.format(format).to_string(),
        None => ms.to_string(),
    }
}

/// A duration in ms as people write it: `250ms`, `1s 500ms`, `1h 30m`.
pub(crate) fn duration(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

/// One field's value as a cell: a time in local time, a duration in
/// words, text as it is, `-` for nothing, anything else as compact JSON.
pub(crate) fn cell(key: &str, value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::Number(n) => match n.as_u64() {
            Some(ms) if is_time(key) => local_time(ms),
            Some(ms) if key.ends_with("_ms") => duration(ms),
            _ => n.to_string(),
        },
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn is_time(key: &str) -> bool {
    key == "at" || key == "tick" || key.ends_with("_at")
}

/// A table without borders, its header as given.
fn new_table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_preset(presets::NOTHING)
        .set_header(header.to_vec());
    table
}

/// The fields of `fields` as `NAME  value` rows: those in `first` first,
/// in that order, then the others, but none in `skip` and none null (the
/// JSON has them).
fn record(fields: &Map<String, Value>, first: &[&str], skip: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING);
    let rest = fields
        .keys()
        .map(String::as_str)
        .filter(|k| !first.contains(k));
    for key in first.iter().copied().chain(rest) {
        if skip.contains(&key) {
            continue;
        }
        if let Some(value) = fields.get(key).filter(|v| !v.is_null()) {
            table.add_row(vec![heading(key), cell(key, value)]);
        }
    }
    table
}

/// A field's name as a heading: `max_attempts` is `MAX ATTEMPTS`, and a
/// duration's says no unit (`timeout_ms` is `TIMEOUT`: its cell does).
fn heading(key: &str) -> String {
    let key = key.strip_suffix("_ms").unwrap_or(key);
    key.replace('_', " ").to_uppercase()
}

/// The first `max` characters of `text` on one line, `…` if cut.
fn short(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or_default();
    let cut: String = line.chars().take(max).collect();
    if cut.len() < text.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

fn field<'a>(fields: &'a Map<String, Value>, key: &str) -> &'a Value {
    fields.get(key).unwrap_or(&Value::Null)
}

fn text_of(fields: &Map<String, Value>, key: &str) -> String {
    cell(key, field(fields, key))
}

/// `n of max` attempts.
fn attempts(fields: &Map<String, Value>) -> String {
    match (field(fields, "attempts"), field(fields, "max_attempts")) {
        (Value::Null, _) => "-".into(),
        (n, Value::Null) => n.to_string(),
        (n, max) => format!("{n} of {max}"),
    }
}

fn items<'a>(fields: &'a Map<String, Value>, key: &str) -> &'a [Value] {
    fields
        .get(key)
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
}

fn task_text(task: &Map<String, Value>) -> String {
    const FIRST: &[&str] = &[
        "task_id",
        "queue",
        "task",
        "status",
        "duplicate",
        "attempts",
        "idempotency_key",
        "created_at",
        "run_at",
        "started_at",
        "finished_at",
        "expires_at",
        "updated_at",
        "timeout_ms",
        "payload",
        "result",
        "error",
    ];
    let skip = [
        "max_attempts",
        "attempt_history",
        "attempt_digests",
        "log",
        "children",
    ];
    let mut shown = task.clone();
    if shown.contains_key("attempts") {
        shown.insert("attempts".into(), Value::String(attempts(task)));
    }
    if let Some(parent) = task.get("parent").and_then(Value::as_object) {
        let parent = format!(
            "{}/{}",
            text_of(parent, "queue"),
            text_of(parent, "task_id")
        );
        shown.insert("parent".into(), Value::String(parent));
    }
    let mut text = record(&shown, FIRST, &skip).to_string();
    if let Some(log) = task
        .get("log")
        .and_then(Value::as_str)
        .filter(|l| !l.is_empty())
    {
        text.push_str("\n\nLOG\n");
        text.push_str(log.trim_end());
    }
    let children = items(task, "children");
    if !children.is_empty() {
        let mut rows = new_table(&["CHILD", "QUEUE", "TASK", "STATUS", "ERROR"]);
        for child in children.iter().filter_map(Value::as_object) {
            rows.add_row(vec![
                text_of(child, "task_id"),
                text_of(child, "queue"),
                text_of(child, "task"),
                text_of(child, "status"),
                short(&text_of(child, "error"), 60),
            ]);
        }
        text.push_str("\n\n");
        text.push_str(&rows.to_string());
    }
    let history = items(task, "attempt_history");
    if !history.is_empty() {
        let mut rows = new_table(&["ATTEMPT", "OUTCOME", "STARTED", "DURATION", "ERROR"]);
        for attempt in history.iter().filter_map(Value::as_object) {
            rows.add_row(vec![
                text_of(attempt, "attempt"),
                text_of(attempt, "outcome"),
                text_of(attempt, "started_at"),
                text_of(attempt, "duration_ms"),
                short(&text_of(attempt, "error"), 60),
            ]);
        }
        text.push_str("\n\n");
        text.push_str(&rows.to_string());
    }
    text
}

fn page_text(page: &Map<String, Value>) -> String {
    let tasks = items(page, "tasks");
    let mut text = if tasks.is_empty() {
        "no tasks on this page".to_owned()
    } else {
        let mut table = new_table(&[
            "TASK ID", "TASK", "STATUS", "ATTEMPTS", "CREATED", "FINISHED", "KEY",
        ]);
        for task in tasks.iter().filter_map(Value::as_object) {
            table.add_row(vec![
                text_of(task, "task_id"),
                text_of(task, "task"),
                text_of(task, "status"),
                attempts(task),
                text_of(task, "created_at"),
                text_of(task, "finished_at"),
                text_of(task, "idempotency_key"),
            ]);
        }
        table.to_string()
    };
    if let Some(cursor) = page.get("next_cursor").and_then(Value::as_str) {
        text.push_str(&format!("\n\nmore: add --cursor {cursor}"));
    }
    text
}

fn queues_text(answer: &Map<String, Value>) -> String {
    let one = [Value::Object(answer.clone())];
    let queues = match answer.get("queues") {
        Some(Value::Array(queues)) => queues.as_slice(),
        _ => &one,
    };
    if queues.is_empty() {
        return "no queues".into();
    }
    let columns = [
        "queue",
        "paused",
        "ready",
        "running",
        "delayed",
        "waiting",
        "dead_lettered",
        "partitions",
    ];
    let header: Vec<String> = columns.iter().map(|c| heading(c)).collect();
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(header);
    for queue in queues.iter().filter_map(Value::as_object) {
        table.add_row(
            columns
                .iter()
                .map(|c| text_of(queue, c))
                .collect::<Vec<_>>(),
        );
    }
    table.to_string()
}

fn dead_letters_text(answer: &Map<String, Value>) -> String {
    let tasks = items(answer, "tasks");
    if tasks.is_empty() {
        return format!("no dead-lettered tasks in {}", text_of(answer, "queue"));
    }
    let mut table = new_table(&["TASK ID", "TASK", "ATTEMPTS", "DEAD-LETTERED", "ERROR"]);
    for task in tasks.iter().filter_map(Value::as_object) {
        table.add_row(vec![
            text_of(task, "task_id"),
            text_of(task, "task"),
            attempts(task),
            text_of(task, "finished_at"),
            short(&text_of(task, "error"), 60),
        ]);
    }
    table.to_string()
}

/// The first 12 hex digits of a digest, as `git` shortens a hash.
fn digest(value: &Value) -> String {
    match value.as_str() {
        Some(d) => d.chars().take(12).collect(),
        None => "-".into(),
    }
}

fn handlers_text(answer: &Map<String, Value>) -> String {
    let handlers = items(answer, "handlers");
    let mut text = if handlers.is_empty() {
        "no deployed handlers".to_owned()
    } else {
        let mut table = new_table(&["TASK", "DIGEST", "DEPLOYED", "WORKERS RUNNING IT"]);
        for handler in handlers.iter().filter_map(Value::as_object) {
            let workers = field(handler, "workers");
            table.add_row(vec![
                text_of(handler, "task"),
                digest(field(handler, "digest")),
                text_of(handler, "deployed_at"),
                format!("{} of {}", workers["running"], workers["total"]),
            ]);
        }
        table.to_string()
    };
    text.push_str("\n\n");
    text.push_str(&fleet_text(items(answer, "workers")));
    text
}

/// The live workers: what each consumes and runs, and when it last
/// reported.
fn fleet_text(workers: &[Value]) -> String {
    if workers.is_empty() {
        return "no live worker".into();
    }
    let mut table = new_table(&["WORKER", "QUEUES", "HANDLERS", "FAILED", "SEEN"]);
    for worker in workers.iter().filter_map(Value::as_object) {
        let names = |key: &str| match field(worker, key).as_object() {
            Some(map) if !map.is_empty() => map.keys().cloned().collect::<Vec<_>>().join(", "),
            _ => "-".into(),
        };
        let queues: Vec<String> = items(worker, "queues")
            .iter()
            .map(|q| cell("", q))
            .collect();
        table.add_row(vec![
            text_of(worker, "id"),
            queues.join(", "),
            names("loaded"),
            names("failed"),
            text_of(worker, "seen_at"),
        ]);
    }
    table.to_string()
}

fn history_text(answer: &Map<String, Value>) -> String {
    let mut text = format!("{}: ", text_of(answer, "task"));
    match field(answer, "active").as_object() {
        Some(active) => text.push_str(&format!(
            "{} active since {}",
            digest(field(active, "digest")),
            text_of(active, "deployed_at")
        )),
        None => text.push_str("no active version"),
    }
    let mut table = new_table(&["ACTION", "AT", "DIGEST", "SIZE", "SETTINGS"]);
    for entry in items(answer, "history").iter().filter_map(Value::as_object) {
        table.add_row(vec![
            text_of(entry, "action"),
            text_of(entry, "at"),
            digest(field(entry, "digest")),
            text_of(entry, "size"),
            text_of(entry, "settings"),
        ]);
    }
    text.push_str("\n\n");
    text.push_str(&table.to_string());
    text
}

fn schedules_text(answer: &Map<String, Value>) -> String {
    let schedules = items(answer, "schedules");
    if schedules.is_empty() {
        return format!("no schedules in {}", text_of(answer, "queue"));
    }
    let mut table = new_table(&["NAME", "CRON", "TASK", "NEXT", "LAST", "LAST TASK"]);
    for schedule in schedules.iter().filter_map(Value::as_object) {
        let last = field(schedule, "last");
        let last_task = match (last["task_id"].as_str(), last["error"].as_str()) {
            (Some(id), _) => id.to_owned(),
            (None, Some(error)) => short(error, 60),
            (None, None) => "-".into(),
        };
        table.add_row(vec![
            text_of(schedule, "name"),
            format!(
                "{} ({})",
                text_of(schedule, "cron"),
                text_of(schedule, "timezone")
            ),
            text_of(schedule, "task"),
            text_of(schedule, "next_at"),
            cell("tick", &last["tick"]),
            last_task,
        ]);
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const AT: u64 = 1_765_000_000_123;

    #[test]
    fn times_are_local_and_durations_in_words() {
        let expect = Local
            .timestamp_millis_opt(AT as i64)
            .single()
            .expect("a time")
            .format("%Y-%m-%d %H:%M:%S")
            .to_string();
        assert_eq!(cell("created_at", &json!(AT)), expect);
        assert_eq!(cell("at", &json!(AT)), expect);
        assert_eq!(cell("timeout_ms", &json!(90_500)), "1m 30s 500ms");
        assert_eq!(cell("attempts", &json!(3)), "3");
        assert_eq!(cell("error", &Value::Null), "-");
        assert_eq!(cell("payload", &json!({"a": 1})), r#"{"a":1}"#);
        assert!(local_clock(AT).ends_with(".123"), "{}", local_clock(AT));
    }

    #[test]
    fn a_task_shows_its_fields_its_attempts_and_local_times() {
        let task = json!({
            "task_id": "t-1",
            "queue": "default",
            "task": "echo",
            "status": "SUCCEEDED",
            "attempts": 1,
            "max_attempts": 3,
            "created_at": AT,
            "result": {"a": 1},
            "log": "hello\n",
            "attempt_history": [
                {"attempt": 1, "outcome": "success", "started_at": AT, "duration_ms": 1500}
            ],
        });
        let text = render(View::Task, &task);
        for part in [
            "TASK ID",
            "t-1",
            "SUCCEEDED",
            "1 of 3",
            &local_time(AT),
            r#"{"a":1}"#,
            "LOG\nhello",
            "OUTCOME",
            "1s 500ms",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
        assert!(!text.contains(&AT.to_string()), "raw ms in:\n{text}");
    }

    #[test]
    fn a_task_shows_its_parent_and_its_children() {
        let task = json!({
            "task_id": "t-2",
            "status": "WAITING",
            "parent": {"queue": "orders", "task_id": "p-1"},
            "children": [
                {"task_id": "c-1", "queue": "kids", "task": "square", "status": "SUCCEEDED", "error": null},
                {"task_id": "c-2", "queue": "kids", "task": "square", "status": "FAILED", "error": "bad n"},
            ],
        });
        let text = render(View::Task, &task);
        for part in [
            "orders/p-1",
            "CHILD",
            "c-1",
            "c-2",
            "kids",
            "FAILED",
            "bad n",
            "WAITING",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
        assert!(
            !text.contains("\"task_id\""),
            "children as raw JSON in:\n{text}"
        );
    }

    #[test]
    fn a_page_has_a_row_per_task_and_the_next_cursor() {
        let page = json!({
            "queue": "q",
            "status": null,
            "tasks": [
                {"task_id": "a", "task": "echo", "status": "QUEUED", "attempts": 0, "max_attempts": 3, "created_at": AT},
                {"task_id": "b", "task": "sleep", "status": "RUNNING", "attempts": 1, "max_attempts": 3, "created_at": AT},
            ],
            "next_cursor": "5-0",
        });
        let text = render(View::TaskPage, &page);
        let rows: Vec<&str> = text.lines().collect();
        assert!(
            rows[0].contains("TASK ID") && rows[0].contains("STATUS"),
            "{text}"
        );
        assert!(rows[1].contains('a') && rows[1].contains("echo"), "{text}");
        assert!(
            rows[2].contains("sleep") && rows[2].contains("1 of 3"),
            "{text}"
        );
        assert!(text.ends_with("more: add --cursor 5-0\n"), "{text}");
        let empty = render(View::TaskPage, &json!({"tasks": [], "next_cursor": null}));
        assert_eq!(empty, "no tasks on this page\n");
    }

    #[test]
    fn queues_handlers_and_records_are_tables_too() {
        let queues = render(
            View::Queues,
            &json!({"queues": [{"queue": "default", "ready": 2, "running": 1, "delayed": 0, "dead_lettered": 0, "partitions": 1}]}),
        );
        assert!(
            queues.contains("DEAD LETTERED") && queues.contains("default"),
            "{queues}"
        );
        let one = render(View::Queues, &json!({"queue": "q1", "ready": 7}));
        assert!(one.contains("q1") && one.contains('7'), "{one}");
        let handlers = render(
            View::Handlers,
            &json!({
                "handlers": [{"task": "echo", "digest": "0123456789abcdef", "deployed_at": AT, "workers": {"running": 1, "total": 2}}],
                "workers": [{"id": "w1", "queues": ["default"], "loaded": {"echo": "x"}, "failed": {}, "seen_at": AT}],
            }),
        );
        for part in ["0123456789ab", "1 of 2", "w1", "default", "echo"] {
            assert!(
                handlers.contains(part),
                "{part:?} missing from:\n{handlers}"
            );
        }
        assert!(!handlers.contains("0123456789abc"), "{handlers}");
        let record = render(View::Record, &json!({"purged": 3, "waited_ms": 20}));
        assert!(
            record.contains("PURGED") && record.contains("20ms"),
            "{record}"
        );
    }
}
