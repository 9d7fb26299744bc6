//! Carried tasks: a task whose stream message carries what its first
//! attempt needs, so that a worker runs that attempt with no `start` script.
//!
//! `start` cost Redis about as much per task as the rest of a drained
//! task's life together: a read of the task hash, a write of RUNNING and a
//! RUNNING event. A task submitted to run now, without an expiry, is
//! written with its message carrying its name, payload and the settings of
//! an attempt (`ingest.lua`), and the hash naming that message (`msg_id`).
//! A worker reading it runs attempt 1 straight away ([`Store::start`] takes
//! it from the message); its completion writes what `start` would have
//! (`complete.lua`). Until then the hash says QUEUED with attempts 0, and
//! what says that the attempt runs is the message pending in the group:
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
//! What a task gives up by this: no RUNNING event for its first attempt
//! (unless the worker runs with `--events all`, which sends every
//! delivery through `start`), no `started_at` shown while the first attempt
//! runs (the completion writes it), and its payload held twice (hash and
//! message) while it waits.
//!
//! [`Store::start`]: super::Store::start

use super::entries::Fields;
use super::types::{Delivery, NewTask, StartedTask};

/// The hash fields a message carries, in the order `Store::ingest_call`
/// writes them right after `attempts` and `updated_at`: how many pairs for
/// `new`, 0 when its message carries none (a scheduled task, or one with
/// an expiry, whose `start` must check it).
pub(super) fn carried_fields(new: &NewTask) -> usize {
    if new.expires_at.is_some() || new.run_at > new.now {
        return 0;
    }
    // max_attempts, task, payload, then the optional ones.
    3 + usize::from(new.timeout_ms.is_some()) + usize::from(new.idempotency_key.is_some())
}

/// The task a message's fields carry, if they do (see [`carried_fields`]):
/// attempt 1 of task `id` of `queue`.
pub(super) fn carried_task(queue: &str, id: &str, fields: &mut Fields) -> Option<StartedTask> {
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
    })
}

/// The delivery of a message read fresh from `queue`'s group (never a
/// reclaimed one): `None` for a message without a task id, which is not
/// one of ours to run.
pub(super) fn fresh_delivery(queue: &str, msg_id: String, mut fields: Fields) -> Option<Delivery> {
    let task_id = fields.take("id")?;
    let carried = carried_task(queue, &task_id, &mut fields).map(Box::new);
    Some(Delivery {
        msg_id,
        task_id,
        carried,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_carries_a_task_only_with_its_name_and_payload() {
        let mut fields: Fields = [
            ("task", "echo"),
            ("payload", "{}"),
            ("max_attempts", "3"),
            ("timeout_ms", "500"),
        ]
        .into_iter()
        .collect();
        let task = carried_task("q", "t1", &mut fields.clone()).expect("carried");
        assert_eq!(
            (task.attempts, task.max_attempts, task.timeout_ms),
            (1, 3, Some(500))
        );
        assert_eq!(task.idempotency_key, None);
        fields.take("payload");
        assert!(carried_task("q", "t1", &mut fields).is_none());
    }
}
