//! Reading tasks by id (`lua/task_read.lua`): a task's hash and, in the
//! same atomic step, whether a worker runs its carried first attempt
//! (`carried.rs`), for a status query ([`Store::task`]) and for the
//! listings (`listing.rs`).

use std::collections::HashMap;

use redis::Value;

use super::scripts::{Argv, ArgvLayout};
use super::{GROUP, QueueKeys, Store, StoreError, TaskRecord, TaskStatus, from_value};

/// `task_read.lua`'s ARGV by name; then, from `FIELDS`, the fields to read.
pub(super) static TASK_READ_ARGV: ArgvLayout = ArgvLayout {
    script: "task_read",
    prefix: "ARG_",
    first: 1,
    names: &["GROUP"],
    rest: Some("FIELDS"),
};

impl Store {
    /// The task `id` of `queue`, if its hash exists; RUNNING attempt 1
    /// while a worker runs its carried first attempt (`carried.rs`).
    pub async fn task(&self, queue: &str, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let Some((fields, runner)) = self.read_tasks(&keys, &[id], &[]).await?.pop() else {
            return Err(StoreError::Protocol("task_read answered nothing".into()));
        };
        let fields: HashMap<String, String> = from_value(Some(fields))?;
        if fields.is_empty() {
            return Ok(None);
        }
        let mut record = TaskRecord::from_fields(fields)?;
        if runner.is_some() {
            record.status = TaskStatus::Running;
            record.attempts = 1;
        }
        Ok(Some(record))
    }

    /// Tasks `ids` of one partition (`keys`), in one atomic step
    /// (`lua/task_read.lua`): each one's `fields` (the whole hash when
    /// empty), and the worker running its carried first attempt, if one
    /// does.
    pub(crate) async fn read_tasks(
        &self,
        keys: &QueueKeys,
        ids: &[&str],
        fields: &[&str],
    ) -> Result<Vec<(Value, Option<String>)>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.task_read.prepare_invoke();
        inv.key(&keys.stream);
        for id in ids {
            inv.key(keys.task(id));
        }
        Argv::new(&mut inv, &TASK_READ_ARGV)
            .put("GROUP", GROUP)
            .done()
            .arg(fields);
        let reply: Vec<Value> = self
            .trip("task", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        if reply.len() != 2 * ids.len() {
            return Err(StoreError::Protocol(format!(
                "task_read answered {} values for {} tasks",
                reply.len(),
                ids.len()
            )));
        }
        let mut reply = reply.into_iter();
        std::iter::from_fn(|| {
            let fields = reply.next()?;
            Some(from_value(reply.next()).map(|runner| (fields, runner)))
        })
        .collect()
    }
}
