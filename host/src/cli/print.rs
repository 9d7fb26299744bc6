//! What the commands print on stdout: answers as pretty JSON, events as
//! JSON lines.

use std::io::Write as _;

use dtq_host::client::sse::SseEvent;
use serde::Serialize;
use serde_json::{Value, json};

use super::Failure;

/// `value` as pretty JSON, its objects' keys in order (as a
/// [`Value`] holds them), whatever type it was read as.
#[allow(clippy::print_stdout)]
pub(crate) fn print_json(value: &impl Serialize) -> Result<(), Failure> {
    let value = serde_json::to_value(value)?;
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// One event as a JSON line on stdout, flushed: its `id` (null for `gap`)
/// and `event`, and the fields of its data (or the data as `data`, when it
/// is not an object).
pub(crate) fn print_event_line(event: &SseEvent) -> std::io::Result<()> {
    let mut line = serde_json::Map::new();
    line.insert("id".into(), json!(event.id));
    line.insert("event".into(), json!(event.event));
    match serde_json::from_str::<Value>(&event.data) {
        Ok(Value::Object(fields)) => line.extend(fields),
        _ => {
            line.insert("data".into(), json!(event.data));
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", Value::Object(line))?;
    out.flush()
}
