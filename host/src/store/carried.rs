//! Carried tasks: a task whose stream message carries what its first
//! attempt needs, so that a worker runs that attempt with no `start` script.
//!
//! `start` cost Redis about as much per task as the rest of a drained
//! task's life together: a read of the task hash, a write of RUNNING and a
//! RUNNING event. A task submitted to run now, without an expiry or a
//! group, is
//! written with its message carrying its name, payload and the settings of
//! an attempt (`ingest.lua`), and the hash naming that message (`msg_id`).
//! They travel in the message's only field, `run` ([`run_head`]), with the
//! task's id as its first line: each name and value of a message is a
//! string of its own for Redis to store and send and for the worker to
//! parse (redis-rs's parser costs about 0.2 µs per value), so one field
//! instead of two (`id` and `run`), four or six makes every read cheaper.
//! A message that carries no task has the one field `id`.
//! A worker reading it runs attempt 1 straight away ([`Store::start`] takes
//! it from the message); its completion writes what `start` would have
//! (`complete.lua`). Until then the hash says QUEUED with attempts 0, and
//! what says that the attempt runs is the message pending in the group.
//!
//! That rule is stated once, in `lua/include/carried.lua`: `carriedFirst`
//! (the hash is QUEUED, no attempt counted, naming the message) and
//! `pendingConsumer` (who the message is pending on). The hash and the
//! group are two records of one fact because writing RUNNING is the very
//! round trip a carried task saves; every script that must know includes
//! that fragment rather than asking in a way of its own:
//!
//! - a status query or listing shows such a task RUNNING, attempt 1, from
//!   its hash and its message's place in the group read in one step
//!   (`task_read.lua`);
//! - a cancel finds it delivered and asks its worker to stop it, as for a
//!   RUNNING task (`cancel.lua`);
//! - its worker's heartbeat keeps the message (`heartbeat.lua`);
//! - a reclaim from a dead worker writes the attempt as `start` would have,
//!   then counts it lost (`reclaim.lua`); the next attempt goes through
//!   `start`, as every attempt after the first does.
//!
//! Older messages, `id` then `run` (without the id), or `id` then the
//! task in fields named as the hash's, are read as well. A worker older
//! than the `run` field that leads with the id finds no `id` in such a
//! message and leaves it pending, unrun; it is reclaimed once that worker
//! stops (after the visibility timeout), so during a rolling upgrade a task
//! submitted by an upgraded API and delivered to a worker not yet upgraded
//! waits for that worker to go. Upgrading the workers first avoids it.
//!
//! What a task gives up by this: no RUNNING event for its first attempt
//! (unless the worker runs with `--events all`: then the worker writes a
//! read batch's RUNNING events, one entry, before running it, see
//! [`Store::start`]), no `started_at` shown while the first attempt
//! runs (the completion writes it), and its payload held twice (hash and
//! message) while it waits. It is sent once: the host sends the field's
//! head and `ingest.lua` appends the payload it also writes to the hash.
//!
//! [`Store::start`]: super::Store::start

use super::types::{Delivery, NewTask, StartedTask};

/// The message field that carries a task: [`run_head`].
pub(super) const RUN: &str = "run";

/// The message field (and task hash field) that carries a traced
/// submission's W3C `traceparent`: beside `run`, only in a traced task's
/// message, so that the others cost nothing for it.
pub(super) const TRACEPARENT: &str = "traceparent";

/// One stream message's fields, in the order the stream holds them: what
/// `entries.rs` parses from a read's reply and the functions below read
/// the task from. Defined here, the reading side, so that the parser
/// depends on this file and not the other way round.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Fields(Vec<(String, String)>);

impl Fields {
    /// Take the value of field `name` out, if the entry has it.
    pub(super) fn take(&mut self, name: &str) -> Option<String> {
        let i = self.0.iter().position(|(n, _)| n == name)?;
        Some(self.0.swap_remove(i).1)
    }

    /// The value of field `name`, if the entry has it.
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find_map(|(n, v)| (n == name).then_some(v.as_str()))
    }
}

impl From<Vec<(String, String)>> for Fields {
    fn from(pairs: Vec<(String, String)>) -> Self {
        Fields(pairs)
    }
}

impl<N: Into<String>, V: Into<String>> FromIterator<(N, V)> for Fields {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(pairs: I) -> Self {
        Fields(
            pairs
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        )
    }
}

/// The head of the `run` field of `new`'s message, or `None` when its
/// message carries no task (a scheduled task, or one with an expiry, whose
/// `start` must check it). The field is this head followed by the payload,
/// which `ingest.lua` appends: the payload crosses the wire once, as a
/// field of the hash.
///
/// The field has six lines: the task id, max attempts, the attempt's
/// timeout (ms, empty for none), the idempotency key (empty for none), the
/// task name, then the payload, which runs to the end. The head is the
/// first five, each with its line break. None of them can hold a line
/// break (a generated id, numbers, a key without control characters, a
/// task name of letters, digits and `_.-`), so the payload needs no
/// escaping.
pub(super) fn run_head(new: &NewTask) -> Option<String> {
    // A grouped task is admitted by its hash (`lua/include/admission.lua`), so it goes
    // through `start` like any attempt after the first; so does a child
    // (flows), whose completion reads its parent from its hash.
    if new.expires_at.is_some()
        || new.run_at > new.now
        || new.group.is_some()
        || new.parent.is_some()
    {
        return None;
    }
    let timeout = new.timeout_ms.map(|t| t.to_string()).unwrap_or_default();
    let key = new.idempotency_key.as_deref().unwrap_or_default();
    Some(format!(
        "{}\n{}\n{timeout}\n{key}\n{}\n",
        new.id, new.max_attempts, new.task
    ))
}

/// The task id of a message's fields, and where the task begins in its
/// `run` field: its `id` field, taken out (an older message, whose `run`
/// holds the task alone), or else the first line of `run` (see
/// [`run_head`]).
fn task_id(fields: &mut Fields) -> Option<(String, usize)> {
    if let Some(id) = fields.take("id") {
        return Some((id, 0));
    }
    let run = fields.get(RUN)?;
    let end = run.find('\n').filter(|&end| end > 0)?;
    Some((run[..end].to_owned(), end + 1))
}

/// The task a message's fields carry, if they do: attempt 1 of task `id`
/// of `queue`, its `run` field read from byte `start` (past the id line
/// that leads it, see [`task_id`]).
pub(super) fn carried_task(
    queue: &str,
    id: &str,
    fields: &mut Fields,
    start: usize,
) -> Option<StartedTask> {
    let mut task = match fields.take(RUN) {
        Some(run) => unpack(queue, id, run, start),
        None => carried_pairs(queue, id, fields),
    }?;
    task.traceparent = fields.take(TRACEPARENT);
    Some(task)
}

/// The task of a `run` field from byte `start` on (see [`run_head`]);
/// `None` if it is not one.
fn unpack(queue: &str, id: &str, mut run: String, start: usize) -> Option<StartedTask> {
    let mut breaks = run
        .get(start..)?
        .match_indices('\n')
        .map(|(at, _)| start + at);
    let mut ends = [0; 4];
    for end in &mut ends {
        *end = breaks.next()?;
    }
    let [a, b, c, d] = ends;
    let max_attempts = run[start..a].parse().ok()?;
    let timeout_ms = match &run[a + 1..b] {
        "" => None,
        t => Some(t.parse().ok()?),
    };
    let idempotency_key = Some(&run[b + 1..c])
        .filter(|k| !k.is_empty())
        .map(str::to_owned);
    let task = run[c + 1..d].to_owned();
    // The payload is the rest: moved to the front of the field's own
    // buffer, which becomes it, rather than copied into a new one (once:
    // the id line goes with the head).
    run.drain(..=d);
    Some(StartedTask {
        id: id.to_owned(),
        queue: queue.to_owned(),
        task,
        payload: run,
        attempts: 1,
        max_attempts,
        timeout_ms,
        idempotency_key,
        cancel_requested: false,
        carried_at: None,
        traceparent: None,
    })
}

/// The task of a message written before the `run` field, whose task is in
/// fields of the hash's names (a fleet part-way through an upgrade).
fn carried_pairs(queue: &str, id: &str, fields: &mut Fields) -> Option<StartedTask> {
    let task = fields.take("task")?;
    let payload = fields.take("payload")?;
    Some(StartedTask {
        id: id.to_owned(),
        queue: queue.to_owned(),
        task,
        payload,
        attempts: 1,
        max_attempts: fields
            .get("max_attempts")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
        timeout_ms: fields.get("timeout_ms").and_then(|v| v.parse().ok()),
        idempotency_key: fields.take("idempotency_key").filter(|k| !k.is_empty()),
        cancel_requested: false,
        carried_at: None,
        traceparent: None,
    })
}

/// The delivery of a message read fresh from `queue`'s group (never a
/// reclaimed one): `None` for a message without a task id, which is not
/// one of ours to run.
pub(super) fn fresh_delivery(queue: &str, msg_id: String, mut fields: Fields) -> Option<Delivery> {
    let (task_id, start) = task_id(&mut fields)?;
    let carried = carried_task(queue, &task_id, &mut fields, start).map(Box::new);
    Some(Delivery {
        msg_id,
        task_id,
        carried,
    })
}

/// The delivery of a reclaimed message: its task id only (a reclaimed
/// message never carries its task: `start` runs it).
pub(super) fn reclaimed_delivery(msg_id: String, mut fields: Fields) -> Option<Delivery> {
    Some(Delivery {
        msg_id,
        task_id: task_id(&mut fields)?.0,
        carried: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_task(key: Option<&str>, timeout_ms: Option<u64>, payload: &str) -> NewTask {
        NewTask {
            id: "t1".into(),
            queue: "q".into(),
            task: "send_receipt".into(),
            payload: payload.into(),
            fingerprint: "f".into(),
            idempotency_key: key.map(str::to_owned),
            max_attempts: 3,
            timeout_ms,
            now: 1_000,
            run_at: 1_000,
            expires_at: None,
            group: None,
            traceparent: None,
            parent: None,
        }
    }

    /// The fields of `new`'s message, its `run` as `ingest.lua` joins it.
    fn run_fields(new: &NewTask) -> Fields {
        let head = run_head(new).expect("carried");
        [(RUN, format!("{head}{}", new.payload))]
            .into_iter()
            .collect()
    }

    #[test]
    fn a_run_field_carries_what_the_first_attempt_needs() {
        for (key, timeout) in [(None, None), (Some("order 7: ü"), Some(500))] {
            // The payload runs to the end of the field: line breaks in it
            // (never in JSON text, but a field may hold anything) stay.
            let new = new_task(key, timeout, "{\"a\":\"x\ny\n\n\"}");
            let delivery = fresh_delivery("q", "1-0".into(), run_fields(&new)).expect("ours");
            assert_eq!(delivery.task_id, "t1");
            let task = delivery.carried.expect("carried");
            assert_eq!(
                (task.id.as_str(), task.queue.as_str(), task.task.as_str()),
                ("t1", "q", "send_receipt")
            );
            assert_eq!(task.payload, new.payload);
            assert_eq!(
                (task.attempts, task.max_attempts, task.timeout_ms),
                (1, 3, timeout)
            );
            assert_eq!(task.idempotency_key.as_deref(), key);
            assert!(!task.cancel_requested && task.carried_at.is_none());
        }
    }

    #[test]
    fn only_a_task_that_runs_now_without_an_expiry_or_a_group_is_carried() {
        let now = new_task(None, None, "{}");
        assert!(run_head(&now).is_some());
        let later = NewTask {
            run_at: 2_000,
            ..new_task(None, None, "{}")
        };
        assert_eq!(run_head(&later), None);
        let expiring = NewTask {
            expires_at: Some(5_000),
            ..new_task(None, None, "{}")
        };
        assert_eq!(run_head(&expiring), None);
        let grouped = NewTask {
            group: Some("customer-7".into()),
            ..new_task(None, None, "{}")
        };
        assert_eq!(run_head(&grouped), None);
    }

    #[test]
    fn a_run_field_that_is_not_one_carries_nothing() {
        for run in [
            "",
            "3",
            "3\n\n\necho",
            "x\n\n\necho\n{}",
            "3\nsoon\n\necho\n{}",
        ] {
            let mut fields: Fields = [(RUN, run)].into_iter().collect();
            assert!(carried_task("q", "t1", &mut fields, 0).is_none(), "{run:?}");
        }
    }

    #[test]
    fn a_message_whose_run_field_follows_an_id_field_still_carries_its_task() {
        let new = new_task(Some("k"), Some(500), "{}");
        let head = run_head(&new).expect("carried");
        let older: Fields = [
            ("id", new.id.clone()),
            (
                RUN,
                head.strip_prefix("t1\n").expect("id first").to_owned() + "{}",
            ),
        ]
        .into_iter()
        .collect();
        let delivery = fresh_delivery("q", "1-0".into(), older).expect("ours");
        assert_eq!(delivery.task_id, "t1");
        let task = delivery.carried.expect("carried");
        assert_eq!(
            (task.task.as_str(), task.payload.as_str()),
            ("send_receipt", "{}")
        );
        assert_eq!((task.max_attempts, task.timeout_ms), (3, Some(500)));
        assert_eq!(task.idempotency_key.as_deref(), Some("k"));
    }

    #[test]
    fn a_message_without_a_task_id_is_not_ours() {
        for fields in [
            vec![("other", "x")],
            vec![(RUN, "no line break")],
            vec![(RUN, "\n3\n\n\necho\n{}")],
            vec![],
        ] {
            let fields: Fields = fields.into_iter().collect();
            assert!(fresh_delivery("q", "1-0".into(), fields.clone()).is_none());
            assert!(reclaimed_delivery("1-0".into(), fields).is_none());
        }
    }

    #[test]
    fn a_traced_message_carries_its_traceparent_beside_the_task() {
        let new = new_task(None, None, "{}");
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut fields = run_fields(&new);
        assert_eq!(
            fresh_delivery("q", "1-0".into(), fields.clone())
                .and_then(|d| d.carried)
                .map(|task| task.traceparent),
            Some(None)
        );
        fields.0.push((TRACEPARENT.into(), traceparent.into()));
        let task = fresh_delivery("q", "1-0".into(), fields)
            .and_then(|d| d.carried)
            .expect("carried");
        assert_eq!(task.traceparent.as_deref(), Some(traceparent));
        assert_eq!(task.payload, "{}");
    }

    #[test]
    fn a_message_written_before_the_run_field_still_carries_its_task() {
        let mut fields: Fields = [
            ("task", "echo"),
            ("payload", "{}"),
            ("max_attempts", "3"),
            ("timeout_ms", "500"),
        ]
        .into_iter()
        .collect();
        let task = carried_task("q", "t1", &mut fields.clone(), 0).expect("carried");
        assert_eq!(
            (task.attempts, task.max_attempts, task.timeout_ms),
            (1, 3, Some(500))
        );
        assert_eq!(task.idempotency_key, None);
        fields.take("payload");
        assert!(carried_task("q", "t1", &mut fields, 0).is_none());
    }
}
