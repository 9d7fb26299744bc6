//! Eager expiry: waiting tasks expire at their `expires_at`, whether or not
//! a worker reaches them.
//!
//! A task submitted with an expiry (`expires_in_ms`) is added to the
//! queue's expiry index, `dtq:expiry:{q}`, a sorted set by `expires_at`
//! (`lua/ingest.lua`; a task without an expiry is never in it and costs
//! nothing). `lua/start.lua` removes a task from it when it hands the task
//! to a worker, or finds it expired or already terminal. The workers sweep
//! the index ([`Store::expire_due`], the loop in `worker/expiry.rs`): each
//! due task still waiting (QUEUED, SCHEDULED, RETRYING) becomes EXPIRED in
//! `lua/expire.lua`, with the writes of the expiry `start` finds (the same
//! fields, event, idempotency state and retention), and out of the delayed
//! set and the stream, so the queue's depth drops at once.
//!
//! Entries of tasks that ended otherwise while waiting (cancelled) stay
//! until they come due and are dropped then; so do those of tasks whose
//! hash is gone. A task that started is out of the index for good: if it
//! then waits again (a retry, a deferral) past its expiry, `start.lua`
//! expires it when it comes up, as before.

use std::collections::HashMap;

use super::scripts::{Argv, ArgvLayout};
use super::{QueueKeys, Store, StoreError, flag};

/// `expire.lua`'s ARGV by name; then, from `TASKS`, an id and a key flag
/// per task.
pub(super) static EXPIRE_ARGV: ArgvLayout = ArgvLayout {
    script: "expire",
    prefix: "ARG_",
    first: 1,
    names: &["NOW", "RETENTION", "EVENTS_MAX_LEN", "DETAIL"],
    rest: Some("TASKS"),
};

/// The error of a task that expired before it started: the text of the
/// expiry `start` finds (`worker/executor.rs`).
pub const EXPIRED_ERROR: &str = "expired before it started";

impl Store {
    /// Expire up to `limit` tasks of `queue` whose expiry is at or before
    /// `now` and that still wait. Returns how many expired, and the next
    /// expiry after `now` in the index, if any (`Some(now)` when more than
    /// `limit` were due: the caller comes back at once).
    ///
    /// Two round trips when something is due (the due ids and their
    /// idempotency keys, then the script), one otherwise.
    pub async fn expire_due(
        &self,
        queue: &str,
        now: u64,
        limit: usize,
    ) -> Result<(u64, Option<u64>), StoreError> {
        let keys = QueueKeys::new(queue);
        let (ready, next) = self
            .due_members("expiry_scan", &keys.expiry, now, limit)
            .await?;
        if ready.is_empty() {
            return Ok((0, next));
        }
        let ready: Vec<String> = ready.into_iter().map(|(id, _)| id).collect();
        // Each task's idempotency record goes in KEYS, so its name is read
        // first; a task's key never changes.
        let mut pipe = redis::pipe();
        for id in &ready {
            pipe.hget(keys.task(id), "idempotency_key");
        }
        let idem: Vec<Option<String>> = self
            .trip("expiry_keys", pipe.query_async(&mut self.conn.clone()))
            .await?;
        let idem: HashMap<&str, Option<String>> =
            ready.iter().map(|id| id.as_str()).zip(idem).collect();

        let mut inv = self.scripts.expire.prepare_invoke();
        inv.key(&keys.expiry)
            .key(&keys.delayed)
            .key(&keys.stream)
            .key(&keys.events)
            .key(keys.settle());
        Argv::new(&mut inv, &EXPIRE_ARGV)
            .put("NOW", now)
            .put("RETENTION", self.settings.task_retention_s)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .put("DETAIL", EXPIRED_ERROR)
            .done();
        for id in &ready {
            let key = idem.get(id.as_str()).cloned().flatten();
            inv.key(keys.task(id))
                .key(keys.idempotency(key.as_deref()))
                .arg(id.as_str())
                .arg(flag(key.is_some()));
        }
        let expired: u64 = self
            .trip("expire", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok((expired, next))
    }
}
