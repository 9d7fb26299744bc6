//! Stream entries as a read delivers them (XREADGROUP, and XAUTOCLAIM in
//! `reclaim.lua`), parsed straight from the reply's values.
//!
//! This runs for every task a worker reads, so it builds no map: an
//! entry's fields are a handful of pairs, and finding one by scanning them
//! costs less than hashing; each name and value moves out of the reply's
//! buffer into a `String` without a copy.

use redis::Value;

use super::StoreError;
use super::carried::{self, Fields};
use super::types::Delivery;

/// The deliveries of an XREADGROUP reply for `queue`'s stream, read fresh
/// from its group (a message may carry its task, see `carried.rs`).
pub(crate) fn fresh_deliveries(queue: &str, reply: Value) -> Result<Vec<Delivery>, StoreError> {
    let mut out = Vec::new();
    for entries in streams_of(reply)? {
        parse(entries, Some(queue), &mut out)?;
    }
    Ok(out)
}

/// One page of a consumer's own pending messages, as `XREADGROUP … STREAMS
/// <stream> <id>` (an id, not `>`) reads them back.
#[derive(Debug, Default)]
pub struct OwnPending {
    /// The messages that name a task, as reclaimed ones: none carries its
    /// task, so each goes through `start`, which resumes an attempt it
    /// already counted for this consumer.
    pub deliveries: Vec<Delivery>,
    /// The id of the page's last entry, to read the next page after; `None`
    /// when the page is empty.
    pub last: Option<String>,
    /// Entries in the page, those without a body (deleted) included.
    pub entries: usize,
}

/// The page of pending messages an `XREADGROUP` with an id returned.
pub(crate) fn own_pending(reply: Value) -> Result<OwnPending, StoreError> {
    let mut page = OwnPending::default();
    for entries in streams_of(reply)? {
        if let Value::Array(list) = &entries {
            page.entries += list.len();
            if let Some(Value::Array(entry)) = list.last()
                && let Some(Value::BulkString(id)) = entry.first()
            {
                page.last = Some(String::from_utf8(id.clone()).map_err(|_| malformed("entry id"))?);
            }
        }
        parse(entries, None, &mut page.deliveries)?;
    }
    Ok(page)
}

/// The entries of each stream of an XREADGROUP reply: nil when nothing
/// was read, else `[[stream, entries]]` in RESP2, a map of stream to
/// entries in RESP3.
fn streams_of(reply: Value) -> Result<Vec<Value>, StoreError> {
    let streams = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(pairs) => pairs.into_iter().map(|(_, entries)| entries).collect(),
        Value::Array(streams) => streams
            .into_iter()
            .map(|stream| match stream {
                Value::Array(pair) => pair.into_iter().nth(1).ok_or_else(|| malformed("stream")),
                other => Err(malformed_value("stream", &other)),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => return Err(malformed_value("XREADGROUP reply", &other)),
    };
    Ok(streams)
}

/// Parse `[[id, [field, value, ...]], ...]` into deliveries: read fresh
/// from `queue`'s group when it is given, else reclaimed (never carried:
/// `start` runs those). An entry whose body was deleted (nil), or whose
/// fields name no task id, carries no task and is skipped; so is a field
/// whose name or value is not UTF-8 (nothing dtq writes).
pub(super) fn parse(
    entries: Value,
    fresh: Option<&str>,
    out: &mut Vec<Delivery>,
) -> Result<(), StoreError> {
    let entries = match entries {
        Value::Array(entries) => entries,
        Value::Nil => return Ok(()),
        other => return Err(malformed_value("entries", &other)),
    };
    out.reserve(entries.len());
    for entry in entries {
        let Value::Array(entry) = entry else {
            return Err(malformed_value("entry", &entry));
        };
        let mut entry = entry.into_iter();
        let msg_id = match entry.next() {
            Some(Value::BulkString(id)) => {
                String::from_utf8(id).map_err(|_| malformed("entry id"))?
            }
            Some(other) => return Err(malformed_value("entry id", &other)),
            None => return Err(malformed("entry")),
        };
        let fields = match entry.next() {
            Some(body) => fields(body)?,
            None => Fields::default(),
        };
        let delivery = match fresh {
            Some(queue) => carried::fresh_delivery(queue, msg_id, fields),
            None => carried::reclaimed_delivery(msg_id, fields),
        };
        out.extend(delivery);
    }
    Ok(())
}

/// The deliveries of a flat reply, read fresh from `queue`'s group: per
/// entry its id, the number of values of its fields, then those values
/// (`lua/read_admit.lua`). As [`parse`], an entry naming no task is
/// skipped, and so is a field whose name or value is not UTF-8.
pub(super) fn flat_deliveries(
    queue: &str,
    values: impl IntoIterator<Item = Value>,
) -> Result<Vec<Delivery>, StoreError> {
    let mut values = values.into_iter();
    let mut out = Vec::new();
    while let Some(id) = values.next() {
        let msg_id = text(id).ok_or_else(|| malformed("entry id"))?;
        // Two values per field: an odd count is no entry's.
        let count = match values.next() {
            Some(Value::Int(n)) if n >= 0 && n % 2 == 0 => n as usize,
            _ => return Err(malformed("field count")),
        };
        let body: Vec<Value> = values.by_ref().take(count).collect();
        if body.len() < count {
            return Err(malformed("entry fields"));
        }
        out.extend(carried::fresh_delivery(
            queue,
            msg_id,
            fields(Value::Array(body))?,
        ));
    }
    Ok(out)
}

/// An entry's body: `[field, value, ...]`, or nil for a deleted entry.
fn fields(body: Value) -> Result<Fields, StoreError> {
    let flat = match body {
        Value::Array(flat) => flat,
        Value::Nil => return Ok(Fields::default()),
        other => return Err(malformed_value("entry fields", &other)),
    };
    let mut pairs = Vec::with_capacity(flat.len() / 2);
    let mut flat = flat.into_iter();
    while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
        if let (Some(name), Some(value)) = (text(name), text(value)) {
            pairs.push((name, value));
        }
    }
    Ok(Fields::from(pairs))
}

/// A bulk or simple string's text, if it is UTF-8.
fn text(v: Value) -> Option<String> {
    match v {
        Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn malformed(what: &str) -> StoreError {
    StoreError::Protocol(format!("malformed stream {what} in a read's reply"))
}

/// The same, naming the kind of value found (not the value: it may be a
/// whole batch of entries).
fn malformed_value(what: &str, v: &Value) -> StoreError {
    let found = match v {
        Value::Nil => "nil",
        Value::Int(_) => "an integer",
        Value::BulkString(_) | Value::SimpleString(_) | Value::VerbatimString { .. } => "a string",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        _ => "another kind of value",
    };
    StoreError::Protocol(format!(
        "malformed stream {what} in a read's reply: found {found}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn entry(id: &str, fields: &[&str]) -> Value {
        Value::Array(vec![
            bulk(id),
            Value::Array(fields.iter().map(|f| bulk(f)).collect()),
        ])
    }

    /// What the read tests' entries give: task `t1` on `1-0`, carrying an
    /// `echo` of `{}` with 3 attempts, and `t2` on `2-0`, carrying nothing.
    fn assert_t1_carried_and_t2(read: &[Delivery]) {
        let ids: Vec<_> = read
            .iter()
            .map(|d| (d.msg_id.as_str(), d.task_id.as_str()))
            .collect();
        assert_eq!(ids, [("1-0", "t1"), ("2-0", "t2")]);
        let carried = read[0].carried.as_deref().expect("carried");
        assert_eq!(
            (carried.task.as_str(), carried.payload.as_str()),
            ("echo", "{}")
        );
        assert_eq!(carried.max_attempts, 3);
        assert!(read[1].carried.is_none());
    }

    #[test]
    fn a_read_gives_each_entrys_task_and_what_it_carries() {
        let entries = Value::Array(vec![
            entry("1-0", &["run", "t1\n3\n\n\necho\n{}"]),
            entry("2-0", &["id", "t2"]),
            // Deleted while pending: no body.
            Value::Array(vec![bulk("3-0"), Value::Nil]),
            // Not one of ours: no task id.
            entry("4-0", &["other", "x"]),
        ]);
        for reply in [
            Value::Array(vec![Value::Array(vec![
                bulk("dtq:stream:{q}"),
                entries.clone(),
            ])]),
            Value::Map(vec![(bulk("dtq:stream:{q}"), entries)]),
        ] {
            assert_t1_carried_and_t2(&fresh_deliveries("q", reply).expect("parsed"));
        }
        assert!(fresh_deliveries("q", Value::Nil).expect("nil").is_empty());
    }

    #[test]
    fn a_flat_reply_gives_the_same_deliveries_and_a_cut_one_is_an_error() {
        let count = |n: i64| Value::Int(n);
        let flat = vec![
            bulk("1-0"),
            count(2),
            bulk("run"),
            bulk("t1\n3\n\n\necho\n{}"),
            bulk("2-0"),
            count(2),
            bulk("id"),
            bulk("t2"),
            // Not one of ours: no task id.
            bulk("4-0"),
            count(2),
            bulk("other"),
            bulk("x"),
            bulk("5-0"),
            count(0),
        ];
        assert_t1_carried_and_t2(&flat_deliveries("q", flat.clone()).expect("parsed"));

        // Cut inside an entry's fields, or before its count: malformed.
        for cut in [3, 6, 9] {
            let err = flat_deliveries("q", flat[..cut].to_vec()).expect_err("cut");
            assert!(matches!(err, StoreError::Protocol(_)), "{cut}: {err}");
        }
        for bad in [
            vec![bulk("1-0"), count(1), bulk("id")],
            vec![bulk("1-0"), count(-2)],
            vec![bulk("1-0"), bulk("two")],
        ] {
            let err = flat_deliveries("q", bad.clone()).expect_err("a bad count");
            assert!(matches!(err, StoreError::Protocol(_)), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_reclaimed_entry_never_carries_its_task() {
        let mut out = Vec::new();
        let entries = Value::Array(vec![
            entry("1-0", &["run", "t1\n1\n\n\necho\n{}"]),
            // Written before the id led the `run` field.
            entry("2-0", &["id", "t2", "run", "1\n\n\necho\n{}"]),
        ]);
        parse(entries, None, &mut out).expect("parsed");
        let ids: Vec<_> = out.iter().map(|d| d.task_id.as_str()).collect();
        assert_eq!(ids, ["t1", "t2"]);
        assert!(out.iter().all(|d| d.carried.is_none()));
    }

    #[test]
    fn a_reply_of_another_shape_is_a_protocol_error() {
        for reply in [
            Value::Int(1),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![bulk("s"), Value::Int(2)])]),
            Value::Array(vec![Value::Array(vec![
                bulk("s"),
                Value::Array(vec![Value::Array(vec![Value::Int(3)])]),
            ])]),
        ] {
            assert!(
                matches!(fresh_deliveries("q", reply), Err(StoreError::Protocol(_))),
                "accepted"
            );
        }
    }

    #[test]
    fn a_field_is_found_and_taken_by_name() {
        let mut fields: Fields = [("id", "t1"), ("task", "echo"), ("payload", "{}")]
            .into_iter()
            .collect();
        assert_eq!(fields.get("task"), Some("echo"));
        assert_eq!(fields.take("id").as_deref(), Some("t1"));
        assert_eq!(fields.take("id"), None);
        assert_eq!(fields.get("payload"), Some("{}"));
        assert_eq!(fields.get("missing"), None);
    }
}
