//! Cancelling a task (`lua/cancel.lua`): a waiting one at once, a running
//! one by asking its worker to interrupt it.

use redis::Value;

use super::scripts::{Argv, ArgvLayout};
use super::{
    CancelOutcome, Code, GROUP, QueueKeys, Store, StoreError, code_of, flag, from_value, unexpected,
};

/// `cancel.lua`'s ARGV by name.
pub(super) static CANCEL_ARGV: ArgvLayout = ArgvLayout {
    script: "cancel",
    prefix: "ARG_",
    first: 1,
    names: &[
        "TASK_ID",
        "NOW",
        "HAS_KEY",
        "RETENTION",
        "EVENTS_MAX_LEN",
        "CHANNEL",
        "MESSAGE",
        "PUBLISH",
        "GROUP",
    ],
    rest: None,
};

impl Store {
    /// The idempotency key task `id` was submitted with: the scripts that
    /// change a task outside the worker need its record's name in KEYS.
    async fn idempotency_key_of(
        &self,
        keys: &QueueKeys,
        id: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(self
            .trip(
                "idempotency_key",
                redis::cmd("HGET")
                    .arg(keys.task(id))
                    .arg("idempotency_key")
                    .query_async(&mut self.conn.clone()),
            )
            .await?)
    }

    /// Cancel task `id` of `queue`.
    pub async fn cancel(
        &self,
        queue: &str,
        id: &str,
        now: u64,
    ) -> Result<CancelOutcome, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let idem_key = self.idempotency_key_of(&keys, id).await?;
        let mut inv = self.scripts.cancel.prepare_invoke();
        inv.key(keys.task(id))
            .key(&keys.delayed)
            .key(&keys.events)
            .key(keys.idempotency(idem_key.as_deref()))
            .key(&keys.stream)
            .key(keys.settle())
            .key(keys.flow(id))
            .key(keys.flows())
            .key(keys.waiting());
        Argv::new(&mut inv, &CANCEL_ARGV)
            .put("TASK_ID", id)
            .put("NOW", now)
            .put("HAS_KEY", flag(idem_key.is_some()))
            .put("RETENTION", self.settings.task_retention_s)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .put("CHANNEL", keys.cancel_channel())
            .put("MESSAGE", format!("{}\n{id}", keys.queue()))
            .put("PUBLISH", self.conn.publish_command())
            .put("GROUP", GROUP)
            .done();
        let reply: Vec<Value> = self
            .trip("cancel", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let code = code_of(reply.next())?;
        Ok(match code {
            Code::Ok => CancelOutcome::Cancelled,
            Code::CancelRequested => CancelOutcome::Requested,
            Code::Terminal => CancelOutcome::Terminal(from_value::<String>(reply.next())?.parse()?),
            Code::NotFound => CancelOutcome::NotFound,
            other => return Err(unexpected("cancel", other)),
        })
    }
}
