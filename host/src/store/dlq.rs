//! The dead-letter queue, `dtq:dlq:{q}` (task ids scored by when they were
//! dead-lettered): the listing of its tasks ([`Store::dead_letters`]),
//! requeue and purge, one task or many.
//!
//! Every bulk operation works in chunks of at most [`DLQ_CHUNK`] ids, one
//! script call each (`lua/requeue.lua`, `lua/dlq_purge.lua`), so that no
//! call holds Redis for long however large the DLQ is; each task is
//! requeued or purged atomically. Before a chunk's script, one pipelined
//! round trip reads each task's idempotency key (scripts must name every
//! key they touch, and a task's key never changes, so reading it first is
//! safe).
//!
//! **One key, one live task.** A requeue makes a task live again, and with
//! it the claim of its key: a task whose key now names another task (the
//! record expired and the key was submitted again, say) is not requeued
//! and stays dead-lettered ([`RequeueOutcome::KeyTaken`], with the other
//! task's id).
//!
//! **Records where submissions look.** A keyed submission looks for the
//! key's record in the partition the key routes to now. A task
//! dead-lettered before a raise of the partition count may live in
//! another one, and its record must stay beside it, in its slot, where the
//! completion, cancel and purge scripts change it atomically with the
//! task. On Redis Cluster no script can touch both slots, so the requeue
//! takes two steps, each atomic in its slot: first `lua/idem_forward.lua`
//! writes a *forward* in the key's home partition (refused if the key
//! names another task there), which sends keyed submissions and lookups to
//! the task's partition; then `lua/requeue.lua` requeues the task and
//! renews or recreates its record beside it (refused if the key names
//! another task there). Forward first: a submission that comes between the
//! steps already goes to the task's partition, and what it creates there
//! the second step sees. A forward whose requeue was then refused stays
//! (it still points where the key's record is, or will be, written) and
//! outlives the record by [`FORWARD_MARGIN_S`].
//!
//! A purge removes the id from the set, deletes the task hash, and deletes
//! the idempotency record if it still names the task: the key can then be
//! submitted afresh, as a new task. Each purged task gets a `PURGED` event.
//! Dead-lettered hashes have no TTL (see `lua/complete.lua`), so an entry
//! of the set never outlives its hash; the DLQ is bounded instead by the
//! workers' retention sweep (`worker/retention.rs`), which purges through
//! the same script.

use std::collections::HashMap;

use redis::Value;

use super::scripts::{Argv, ArgvLayout};
use super::{
    Code, QueueKeys, RequeueOutcome, Store, StoreError, TaskRecord, code_of, flag, from_value,
    logical_queue, partition_of_id, partition_queue,
};

/// `requeue.lua`'s ARGV by name; then, from `TASKS`, an id and a key
/// flag per task.
pub(super) static REQUEUE_ARGV: ArgvLayout = ArgvLayout {
    script: "requeue",
    prefix: "ARG_",
    first: 1,
    names: &["NOW", "IDEM_TTL", "EVENTS_MAX_LEN", "TASK_PREFIX"],
    rest: Some("TASKS"),
};

/// `idem_forward.lua`'s ARGV by name.
pub(super) static IDEM_FORWARD_ARGV: ArgvLayout = ArgvLayout {
    script: "idem_forward",
    prefix: "ARG_",
    first: 1,
    names: &["TASK_ID", "PARTITION", "TASK_PREFIX", "NOW", "TTL"],
    rest: None,
};

/// `dlq_purge.lua`'s ARGV by name; then, from `TASKS`, an id and a key
/// flag per task.
pub(super) static DLQ_PURGE_ARGV: ArgvLayout = ArgvLayout {
    script: "dlq_purge",
    prefix: "ARG_",
    first: 1,
    names: &["NOW", "EVENTS_MAX_LEN", "FLOOR", "LATEST"],
    rest: Some("TASKS"),
};

/// Most ids one requeue or purge script call takes.
pub const DLQ_CHUNK: usize = 100;

/// Most ids one bulk request may name (`{"ids": [...]}`).
pub const DLQ_MAX_IDS: usize = 1000;

/// How much longer than the idempotency TTL a forward lives: longer
/// than the record the requeue renews or recreates after writing it, by
/// far more than the API's Redis deadline between the two steps.
pub const FORWARD_MARGIN_S: u64 = 300;

/// What a bulk requeue did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BulkRequeue {
    /// Tasks that left the DLQ and are QUEUED again.
    pub requeued: u64,
    /// Ids that were not requeued: no such task, or not dead-lettered.
    pub not_dead_lettered: Vec<String>,
    /// Ids that were not requeued because their idempotency key names
    /// another task now; they stay dead-lettered.
    pub key_taken: Vec<KeyTaken>,
}

/// A dead-lettered task left in the DLQ: its key names another task.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyTaken {
    /// The dead-lettered task.
    pub id: String,
    /// The task its idempotency key names now.
    pub task_id: String,
}

impl BulkRequeue {
    fn add(&mut self, other: BulkRequeue) {
        self.requeued += other.requeued;
        self.not_dead_lettered.extend(other.not_dead_lettered);
        self.key_taken.extend(other.key_taken);
    }
}

/// What the requeue of one id came to.
enum Requeued {
    Yes,
    /// Not dead-lettered: the status found ("" for no task).
    No(String),
    /// The key names this other task.
    KeyTaken(String),
}

/// Which dead-lettered tasks a purge of the oldest takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeBound {
    /// Only tasks dead-lettered at or before this time (ms since epoch).
    pub latest: Option<u64>,
    /// Stop once the DLQ holds this many tasks.
    pub keep: Option<u64>,
}

/// The size of a queue's DLQ and the dead-letter time of its newest entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DlqExtent {
    /// Entries in the set.
    pub len: u64,
    /// When the newest was dead-lettered (ms since epoch).
    pub newest: Option<u64>,
}

impl Store {
    /// Dead-lettered tasks of `queue` (of every partition), oldest first,
    /// at most `limit`.
    pub async fn dead_letters(
        &self,
        queue: &str,
        limit: usize,
    ) -> Result<Vec<TaskRecord>, StoreError> {
        let names = self.partition_names(queue).await?;
        let mut ids: Vec<(f64, usize, String)> = Vec::new();
        let ranges = futures::future::try_join_all(names.iter().map(|name| {
            let keys = QueueKeys::new(name);
            async move {
                self.trip(
                    "dlq_ids",
                    redis::cmd("ZRANGE")
                        .arg(&keys.dlq)
                        .arg(0)
                        .arg(limit.saturating_sub(1) as i64)
                        .arg("WITHSCORES")
                        .query_async::<Vec<(String, f64)>>(&mut self.conn.clone()),
                )
                .await
            }
        }))
        .await?;
        for (partition, range) in ranges.into_iter().enumerate() {
            ids.extend(range.into_iter().map(|(id, at)| (at, partition, id)));
        }
        ids.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        ids.truncate(limit);
        // One pipeline per partition (a cluster pipeline stays in a slot);
        // the records then in the merged order.
        let mut by_partition: Vec<Vec<&str>> = vec![Vec::new(); names.len()];
        for (_, partition, id) in &ids {
            by_partition[*partition].push(id);
        }
        let hashes =
            futures::future::try_join_all(names.iter().zip(&by_partition).map(|(name, ids)| {
                let keys = QueueKeys::new(name);
                let mut pipe = redis::pipe();
                for id in ids {
                    pipe.hgetall(keys.task(id));
                }
                async move {
                    if ids.is_empty() {
                        return Ok(Vec::new());
                    }
                    self.trip("dlq_tasks", pipe.query_async(&mut self.conn.clone()))
                        .await
                }
            }))
            .await?;
        let mut hashes: Vec<_> = hashes
            .into_iter()
            .map(|h: Vec<HashMap<String, String>>| h.into_iter())
            .collect();
        ids.iter()
            .filter_map(|(_, partition, _)| hashes[*partition].next())
            .filter(|h| !h.is_empty())
            .map(TaskRecord::from_fields)
            .collect()
    }

    /// Requeue dead-lettered task `id` of `queue`.
    pub async fn requeue(
        &self,
        queue: &str,
        id: &str,
        now: u64,
    ) -> Result<RequeueOutcome, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let reply = self.requeue_chunk(&keys, &[id.to_owned()], now).await?;
        match reply.into_iter().next() {
            Some((_, Requeued::Yes)) => Ok(RequeueOutcome::Requeued),
            Some((_, Requeued::No(status))) if status.is_empty() => Ok(RequeueOutcome::NotFound),
            Some((_, Requeued::No(status))) => Ok(RequeueOutcome::NotDeadLettered(status.parse()?)),
            Some((_, Requeued::KeyTaken(task_id))) => Ok(RequeueOutcome::KeyTaken { task_id }),
            None => Err(StoreError::Protocol("requeue answered nothing".into())),
        }
    }

    /// Requeue the dead-lettered tasks `ids` of `queue`, [`DLQ_CHUNK`] per
    /// script call (each partition's ids in calls of their own).
    pub async fn requeue_many(
        &self,
        queue: &str,
        ids: &[String],
        now: u64,
    ) -> Result<BulkRequeue, StoreError> {
        let mut done = BulkRequeue::default();
        for (keys, ids) in by_partition(queue, ids) {
            for chunk in ids.chunks(DLQ_CHUNK) {
                done.add(bulk_of(self.requeue_chunk(&keys, chunk, now).await?));
            }
        }
        Ok(done)
    }

    /// Requeue the oldest chunk (at most [`DLQ_CHUNK`]) of each partition
    /// of `queue`'s dead-lettered tasks, those dead-lettered at or before
    /// `latest` when given. Returns what it did and how many ids it looked
    /// at: fewer than [`DLQ_CHUNK`] means none is left.
    pub async fn requeue_oldest(
        &self,
        queue: &str,
        latest: Option<u64>,
        now: u64,
    ) -> Result<(BulkRequeue, usize), StoreError> {
        let (mut done, mut looked) = (BulkRequeue::default(), 0);
        for name in self.partition_names(queue).await? {
            let keys = QueueKeys::new(&name);
            let ids = self.dlq_range(&keys, latest, DLQ_CHUNK).await?;
            if !ids.is_empty() {
                done.add(bulk_of(self.requeue_chunk(&keys, &ids, now).await?));
                looked += ids.len();
            }
        }
        Ok((done, looked))
    }

    /// Purge the dead-lettered tasks `ids` of `queue` (ids not in its DLQ
    /// are skipped); how many were purged.
    pub async fn purge_dead_letters(
        &self,
        queue: &str,
        ids: &[String],
        now: u64,
    ) -> Result<u64, StoreError> {
        let bound = PurgeBound {
            latest: None,
            keep: None,
        };
        let mut purged = 0;
        for (keys, ids) in by_partition(queue, ids) {
            for chunk in ids.chunks(DLQ_CHUNK) {
                purged += self.purge_chunk(&keys, chunk, bound, now).await?;
            }
        }
        Ok(purged)
    }

    /// Purge the oldest `count` (at most [`DLQ_CHUNK`]) of each partition
    /// of `queue`'s dead-lettered tasks within `bound` (whose `keep` then
    /// bounds each partition's DLQ: the workers' retention, which passes
    /// `keep`, sweeps one partition at a time). Returns how many it purged
    /// and how many ids it looked at: fewer than `count` means none is
    /// left within `bound.latest`.
    pub async fn purge_oldest(
        &self,
        queue: &str,
        bound: PurgeBound,
        count: usize,
        now: u64,
    ) -> Result<(u64, usize), StoreError> {
        let (mut purged, mut looked) = (0, 0);
        for name in self.partition_names(queue).await? {
            let keys = QueueKeys::new(&name);
            let ids = self
                .dlq_range(&keys, bound.latest, count.min(DLQ_CHUNK))
                .await?;
            if !ids.is_empty() {
                purged += self.purge_chunk(&keys, &ids, bound, now).await?;
                looked += ids.len();
            }
        }
        Ok((purged, looked))
    }

    /// How many tasks `queue`'s DLQ holds (over its partitions), and when
    /// the newest came.
    pub async fn dlq_extent(&self, queue: &str) -> Result<DlqExtent, StoreError> {
        let mut extent = DlqExtent::default();
        for name in self.partition_names(queue).await? {
            let part = self.partition_dlq_extent(&QueueKeys::new(&name)).await?;
            extent.len += part.len;
            extent.newest = extent.newest.max(part.newest);
        }
        Ok(extent)
    }

    /// [`Store::dlq_extent`] of one partition's key set.
    async fn partition_dlq_extent(&self, keys: &QueueKeys) -> Result<DlqExtent, StoreError> {
        let mut pipe = redis::pipe();
        pipe.zcard(&keys.dlq)
            .cmd("ZRANGE")
            .arg(&keys.dlq)
            .arg(-1)
            .arg(-1)
            .arg("WITHSCORES");
        let (len, newest): (u64, Vec<(String, f64)>) = self
            .trip("dlq_extent", pipe.query_async(&mut self.conn.clone()))
            .await?;
        Ok(DlqExtent {
            len,
            newest: newest.first().map(|(_, at)| *at as u64),
        })
    }

    /// The oldest `count` ids of the DLQ, dead-lettered at or before
    /// `latest` when given.
    async fn dlq_range(
        &self,
        keys: &QueueKeys,
        latest: Option<u64>,
        count: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(&keys.dlq);
        match latest {
            Some(at) => cmd
                .arg("-inf")
                .arg(at)
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(0)
                .arg(count),
            None => cmd.arg(0).arg(count.saturating_sub(1)),
        };
        Ok(self
            .trip("dlq_range", cmd.query_async(&mut self.conn.clone()))
            .await?)
    }

    /// The idempotency key of each of `ids`, in one pipelined round trip.
    async fn idempotency_keys(
        &self,
        keys: &QueueKeys,
        ids: &[String],
    ) -> Result<Vec<Option<String>>, StoreError> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.hget(keys.task(id), "idempotency_key");
        }
        Ok(self
            .trip("dlq_keys", pipe.query_async(&mut self.conn.clone()))
            .await?)
    }

    /// One `requeue` call for `ids` (of the partition `keys`), after the
    /// forwards of those whose key routes to another partition now: per
    /// id, what came of it.
    async fn requeue_chunk(
        &self,
        keys: &QueueKeys,
        ids: &[String],
        now: u64,
    ) -> Result<Vec<(String, Requeued)>, StoreError> {
        let idem = self.idempotency_keys(keys, ids).await?;
        let taken = self.forward_keys(keys, ids, &idem, now).await?;
        let mut inv = self.scripts.requeue.prepare_invoke();
        inv.key(&keys.dlq).key(&keys.stream).key(&keys.events);
        Argv::new(&mut inv, &REQUEUE_ARGV)
            .put("NOW", now)
            .put("IDEM_TTL", self.settings.idem_ttl_s)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .put("TASK_PREFIX", keys.task_prefix())
            .done();
        let mut sent = 0;
        for ((id, key), taken) in ids.iter().zip(&idem).zip(&taken) {
            if taken.is_none() {
                inv.key(keys.task(id))
                    .key(keys.idempotency(key.as_deref()))
                    .arg(id)
                    .arg(flag(key.is_some()));
                sent += 1;
            }
        }
        let reply: Vec<Value> = if sent == 0 {
            Vec::new()
        } else {
            self.trip("requeue", inv.invoke_async(&mut self.conn.clone()))
                .await?
        };
        let mut reply = reply.into_iter();
        let mut out = Vec::with_capacity(ids.len());
        for (id, taken) in ids.iter().zip(taken) {
            if let Some(other) = taken {
                out.push((id.clone(), Requeued::KeyTaken(other)));
                continue;
            }
            let code = code_of(reply.next())?;
            let value: String = from_value(reply.next())?;
            out.push(match code {
                Code::Ok => (id.clone(), Requeued::Yes),
                Code::NotInDlq => (id.clone(), Requeued::No(value)),
                Code::KeyTaken => (id.clone(), Requeued::KeyTaken(value)),
                other => return Err(super::unexpected("requeue", other)),
            });
        }
        Ok(out)
    }

    /// Write the forward of each of `ids` (of the partition `keys`, their
    /// idempotency keys `idem`) whose key routes to another partition now
    /// (`lua/idem_forward.lua`; see the module documentation). Per id, the
    /// task its key names instead when the forward was refused.
    async fn forward_keys(
        &self,
        keys: &QueueKeys,
        ids: &[String],
        idem: &[Option<String>],
        now: u64,
    ) -> Result<Vec<Option<String>>, StoreError> {
        let mut taken = vec![None; ids.len()];
        if idem.iter().all(Option::is_none) {
            return Ok(taken);
        }
        let queue = logical_queue(keys.queue());
        let part = self.partitioning(queue).await?;
        let ttl = self.settings.idem_ttl_s.saturating_add(FORWARD_MARGIN_S);
        for ((id, key), taken) in ids.iter().zip(idem).zip(&mut taken) {
            let Some(key) = key else { continue };
            let (home, partition) = (part.of_key(key), partition_of_id(id));
            if home == partition {
                continue;
            }
            let home = QueueKeys::new(&partition_queue(queue, home));
            let mut inv = self.scripts.idem_forward.prepare_invoke();
            inv.key(home.idempotency(Some(key)));
            Argv::new(&mut inv, &IDEM_FORWARD_ARGV)
                .put("TASK_ID", id)
                .put("PARTITION", partition)
                .put("TASK_PREFIX", home.task_prefix())
                .put("NOW", now)
                .put("TTL", ttl)
                .done();
            let reply: Vec<Value> = self
                .trip("idem_forward", inv.invoke_async(&mut self.conn.clone()))
                .await?;
            let mut reply = reply.into_iter();
            let code = code_of(reply.next())?;
            let other: String = from_value(reply.next())?;
            match code {
                Code::Ok => {}
                Code::KeyTaken => *taken = Some(other),
                other => return Err(super::unexpected("idem_forward", other)),
            }
        }
        Ok(taken)
    }

    /// One `dlq_purge` call for `ids` within `bound`; how many it purged.
    async fn purge_chunk(
        &self,
        keys: &QueueKeys,
        ids: &[String],
        bound: PurgeBound,
        now: u64,
    ) -> Result<u64, StoreError> {
        let idem = self.idempotency_keys(keys, ids).await?;
        let text = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        let mut inv = self.scripts.dlq_purge.prepare_invoke();
        inv.key(&keys.dlq).key(&keys.events);
        Argv::new(&mut inv, &DLQ_PURGE_ARGV)
            .put("NOW", now)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .put("FLOOR", text(bound.keep))
            .put("LATEST", text(bound.latest))
            .done();
        for (id, key) in ids.iter().zip(&idem) {
            inv.key(keys.task(id))
                .key(keys.idempotency(key.as_deref()))
                .key(keys.flow(id))
                .arg(id)
                .arg(flag(key.is_some()));
        }
        Ok(self
            .trip("dlq_purge", inv.invoke_async(&mut self.conn.clone()))
            .await?)
    }
}

/// `ids` of `queue` grouped by the partition each names, in first-seen
/// order.
fn by_partition(queue: &str, ids: &[String]) -> Vec<(QueueKeys, Vec<String>)> {
    let mut groups: Vec<(QueueKeys, Vec<String>)> = Vec::new();
    for id in ids {
        let keys = QueueKeys::of_task(queue, id);
        match groups.iter_mut().find(|(k, _)| *k == keys) {
            Some((_, group)) => group.push(id.clone()),
            None => groups.push((keys, vec![id.clone()])),
        }
    }
    groups
}

/// A requeue chunk's reply as a [`BulkRequeue`].
fn bulk_of(reply: Vec<(String, Requeued)>) -> BulkRequeue {
    let mut done = BulkRequeue::default();
    for (id, requeued) in reply {
        match requeued {
            Requeued::Yes => done.requeued += 1,
            Requeued::No(_) => done.not_dead_lettered.push(id),
            Requeued::KeyTaken(task_id) => done.key_taken.push(KeyTaken { id, task_id }),
        }
    }
    done
}
