//! Cancelling a task (`lua/cancel.lua`): a waiting one at once, a running
//! one by asking its worker to interrupt it.

use redis::Value;

use super::{
    CancelOutcome, Code, GROUP, QueueKeys, Store, StoreError, code_of, flag, from_value, unexpected,
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
            .arg(id)
            .arg(now)
            .arg(flag(idem_key.is_some()))
            .arg(self.settings.task_retention_s)
            .arg(self.settings.events_max_len)
            .arg(keys.cancel_channel())
            .arg(format!("{}\n{id}", keys.queue()))
            .arg(self.conn.publish_command())
            .arg(GROUP);
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
