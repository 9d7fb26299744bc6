//! Promoting delayed tasks whose time has come to the stream
//! (`lua/promote.lua`).

use super::scripts::{Argv, ArgvLayout};
use super::{QueueKeys, Store, StoreError};

/// `promote.lua`'s ARGV by name; then, from `TASK_IDS`, the ids to move.
pub(super) static PROMOTE_ARGV: ArgvLayout = ArgvLayout {
    script: "promote",
    prefix: "ARG_",
    first: 1,
    names: &["NOW", "EVENTS_MAX_LEN"],
    rest: Some("TASK_IDS"),
};

impl Store {
    /// Move up to `limit` due tasks of `queue` from the delayed set to the
    /// stream. Returns how many moved and the due time of the next waiting
    /// task, if any.
    pub async fn promote_due(
        &self,
        queue: &str,
        now: u64,
        limit: usize,
    ) -> Result<(u64, Option<u64>), StoreError> {
        let keys = QueueKeys::new(queue);
        let (ready, next) = self
            .due_members("promote_scan", &keys.delayed, now, limit)
            .await?;
        if ready.is_empty() {
            return Ok((0, next));
        }
        let ready: Vec<String> = ready.into_iter().map(|(id, _)| id).collect();
        let mut inv = self.scripts.promote.prepare_invoke();
        inv.key(&keys.delayed).key(&keys.stream).key(&keys.events);
        for id in &ready {
            inv.key(keys.task(id));
        }
        Argv::new(&mut inv, &PROMOTE_ARGV)
            .put("NOW", now)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .done();
        for id in &ready {
            inv.arg(id.as_str());
        }
        let moved: u64 = self
            .trip("promote", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok((moved, next))
    }
}
