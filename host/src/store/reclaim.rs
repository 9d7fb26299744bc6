//! Reclaiming the messages no live worker runs (`lua/reclaim.lua`): those
//! of workers that stopped beating, and a worker's own that sat idle past
//! the visibility timeout.

use std::time::Duration;

use redis::Value;

use super::scripts::{Argv, ArgvLayout};
use super::{Delivery, GROUP, QueueKeys, Store, StoreError, entries, from_value};

/// `reclaim.lua`'s ARGV by name.
pub(super) static RECLAIM_ARGV: ArgvLayout = ArgvLayout {
    script: "reclaim",
    prefix: "ARG_",
    first: 1,
    names: &["GROUP", "CONSUMER", "VISIBILITY", "LIMIT", "TASK_PREFIX"],
    rest: None,
};

/// What [`Store::reclaim`] claimed for a worker.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Messages of dead workers, now the caller's.
    pub dead: Vec<Delivery>,
    /// The caller's own messages that were idle longer than the visibility
    /// timeout: run those not held (never started), leave the others.
    pub own: Vec<Delivery>,
}

impl Store {
    /// Claim for `consumer` up to `count` messages of `queue` that no live
    /// worker runs: those of workers that have not beaten within
    /// `visibility` (see `lua/reclaim.lua`), and `consumer`'s own that were
    /// idle that long.
    pub async fn reclaim(
        &self,
        queue: &str,
        consumer: &str,
        visibility: Duration,
        count: usize,
    ) -> Result<Reclaimed, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.reclaim.prepare_invoke();
        inv.key(&keys.stream).key(&keys.workers).key(&keys.clock);
        Argv::new(&mut inv, &RECLAIM_ARGV)
            .put("GROUP", GROUP)
            .put("CONSUMER", consumer)
            .put("VISIBILITY", visibility.as_millis() as u64)
            .put("LIMIT", count)
            .put("TASK_PREFIX", keys.task_prefix())
            .done();
        let reply: Vec<Value> = self
            .trip("reclaim", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let mut reclaimed = Reclaimed::default();
        entries::parse(from_value(reply.next())?, None, &mut reclaimed.dead)?;
        entries::parse(from_value(reply.next())?, None, &mut reclaimed.own)?;
        Ok(reclaimed)
    }
}
