//! What the commands print on stdout: for a person at a terminal, tables
//! (`table.rs`); for a script (`--json`, `DTQ_JSON`, or stdout not a
//! terminal), answers as pretty JSON and events as JSON lines, as before
//! tables existed.

use std::io::{IsTerminal as _, Write as _};
use std::sync::OnceLock;

use dtq_host::client::sse::SseEvent;
use serde::Serialize;
use serde_json::{Value, json};

use super::Failure;
use super::table::{self, View};

/// How answers are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Pretty JSON, events as JSON lines: what scripts read.
    Json,
    /// Tables with local times, events as lines of text.
    Table,
}

/// The format of a run: JSON when asked for (`--json`) or when stdout is
/// not a terminal (a pipe, a file: a script reads it), tables otherwise.
pub(crate) fn choose(json: bool, stdout_is_terminal: bool) -> Format {
    if json || !stdout_is_terminal {
        Format::Json
    } else {
        Format::Table
    }
}

static FORMAT: OnceLock<Format> = OnceLock::new();

/// Set the format of this run once, from `--json` and stdout.
pub(crate) fn init(json: bool) {
    let _ = FORMAT.set(choose(json, std::io::stdout().is_terminal()));
}

/// The format of this run (JSON if [`init`] was not called).
pub(crate) fn format() -> Format {
    FORMAT.get().copied().unwrap_or(Format::Json)
}

/// `value`, an answer of the kind `view` says: a table, or pretty JSON
/// (see [`print_json`]).
#[allow(clippy::print_stdout)]
pub(crate) fn show(view: View, value: &impl Serialize) -> Result<(), Failure> {
    match format() {
        Format::Json => print_json(value),
        Format::Table => {
            let value = serde_json::to_value(value)?;
            print!("{}", table::render(view, &value));
            Ok(())
        }
    }
}

/// `value` as pretty JSON, its objects' keys in order (as a
/// [`Value`] holds them), whatever type it was read as.
#[allow(clippy::print_stdout)]
pub(crate) fn print_json(value: &impl Serialize) -> Result<(), Failure> {
    let value = serde_json::to_value(value)?;
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// One event on stdout, flushed: as a JSON line ([`event_json`]), or as
/// a line of text ([`event_text`]).
pub(crate) fn print_event_line(event: &SseEvent) -> std::io::Result<()> {
    let line = match format() {
        Format::Json => event_json(event).to_string(),
        Format::Table => event_text(event),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// An event as one JSON object: its `id` (null for `gap`) and `event`,
/// and the fields of its data (or the data as `data`, when it is not an
/// object).
pub(crate) fn event_json(event: &SseEvent) -> Value {
    let mut line = serde_json::Map::new();
    line.insert("id".into(), json!(event.id));
    line.insert("event".into(), json!(event.event));
    match serde_json::from_str::<Value>(&event.data) {
        Ok(Value::Object(fields)) => line.extend(fields),
        _ => {
            line.insert("data".into(), json!(event.data));
        }
    }
    Value::Object(line)
}

/// An event as a line for a person: `11:40:29.123  SUCCEEDED  echo
/// <task id>  attempt 1`, the time local.
pub(crate) fn event_text(event: &SseEvent) -> String {
    let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
    if event.event == "gap" {
        return format!(
            "events were missed: the stream no longer holds those after {} (reading on from {})",
            table::cell("", &data["last_event_id"]),
            table::cell("", &data["oldest_id"]),
        );
    }
    let at = data["at"]
        .as_u64()
        .map_or_else(|| "-".repeat(12), table::local_clock);
    let attempt = match data["attempt"].as_u64() {
        Some(n) if n > 0 => format!("  attempt {n}"),
        _ => String::new(),
    };
    format!(
        "{at}  {:<13}  {}  {}{attempt}",
        event.event,
        table::cell("task", &data["task"]),
        table::cell("task_id", &data["task_id"]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_unless_a_person_reads_the_terminal() {
        assert_eq!(choose(false, true), Format::Table);
        assert_eq!(choose(true, true), Format::Json);
        assert_eq!(choose(false, false), Format::Json);
        assert_eq!(choose(true, false), Format::Json);
    }

    #[test]
    fn an_event_line_has_the_task_name_and_a_local_time() {
        let event = SseEvent {
            event: "SUCCEEDED".into(),
            data: r#"{"task_id":"t-1","task":"echo","status":"SUCCEEDED","attempt":1,"at":1765000000123}"#
                .into(),
            id: Some("5-0".into()),
        };
        let line = event_json(&event);
        assert_eq!(line["task"], "echo");
        assert_eq!(line["id"], "5-0");
        assert_eq!(line["event"], "SUCCEEDED");
        let text = event_text(&event);
        assert!(
            text.starts_with(&table::local_clock(1_765_000_000_123)),
            "{text}"
        );
        for part in ["SUCCEEDED", "echo", "t-1", "attempt 1"] {
            assert!(text.contains(part), "{part:?} missing from {text:?}");
        }
    }
}
