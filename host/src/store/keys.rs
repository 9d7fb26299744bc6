//! The Redis key layout, in one place.
//!
//! Every key of one queue carries the hash tag `{<queue>}`, so all the keys a
//! script touches live in one Redis Cluster slot and queues spread across
//! slots by name.
//!
//! A partitioned queue is several such key sets: partition 0 is the queue
//! itself (`{q}`), partition `i` the queue `q#i` (`{q#i}`, a slot of its
//! own; `#` is never in a queue's name). A task id says its partition: the
//! id of a task of partition `i > 0` ends in `.i` ([`partition_of_id`]).
//!
//! | key | type | holds |
//! |---|---|---|
//! | `dtq:idempotency:{q}:<key>` | string (JSON) | `{task_id, state, updated_at, fingerprint}`, TTL `DTQ_IDEM_TTL_S`; or a forward `{forward, task_id, updated_at}` to the partition that holds the key's task and record (written by a DLQ requeue after a raise, see `store::dlq`) |
//! | `dtq:task:{q}:<id>` | hash | the task record; a retention TTL once terminal, but none while dead-lettered (purged instead: `store/dlq.rs`); `attempt:<n>` fields archive earlier attempts (`store/task.rs`) |
//! | `dtq:stream:{q}` | stream, group [`GROUP`] | ready tasks (field `id`; a task whose message carries it also `run`, see `store/carried.rs`) |
//! | `dtq:delayed:{q}` | sorted set | scheduled tasks and retries, by due time (ms) |
//! | `dtq:dlq:{q}` | sorted set | dead-lettered task ids, by time (ms) |
//! | `dtq:events:{q}` | stream (capped) | lifecycle events (fields `task_id`, `status`, `attempt`, `at`), read by `GET /v1/queues/{q}/events` |
//! | `dtq:index:{q}` | stream | every task submitted within the task retention, in submission order (field `id`); written by `ingest.lua`, trimmed there by entry time (`MINID ~`), read newest first by the task listing (see `store::listing`) |
//! | `dtq:workers:{q}` | sorted set | consumer → its last heartbeat on the queue (ms, Redis's clock) |
//! | `dtq:clock:{q}` | hash | the queue's liveness clock: `last` tick and when it `resumed` after an outage (ms, Redis's clock) |
//! | `dtq:expiry:{q}` | sorted set | waiting tasks that have an expiry, by `expires_at` (ms); only those: added by `ingest.lua`, removed when the task starts (`start.lua`) or expires (`expire.lua`, the workers' sweep; an entry whose task ended another way is dropped when it comes due) |
//! | `dtq:schedules:{q}` | hash | periodic tasks: schedule name → its definition (JSON `{cron, task, payload, max_attempts, timeout_ms, updated_at}`) |
//! | `dtq:schedule-due:{q}` | sorted set | schedule name → its next tick (ms, UTC); advanced only by a compare-and-set on the tick fired (`schedule_advance.lua`) |
//! | `dtq:schedule-fired:{q}` | hash | schedule name → its last fired tick (JSON `{tick, task_id, fired_at, error}`) |
//! | `dtq:cancel:{q}` | pub/sub channel | cancel requests of the queue's running tasks (message: `<queue>\n<task id>`), published by `cancel.lua` (`SPUBLISH` on a cluster: the queue's shard only) |
//! | `dtq:partitions:{q}` | string | the queue's partition count, in every partition's slot; checked by `ingest.lua` (absent: 1) |
//! | `dtq:partition-history:{q}` | sorted set | partition counts a raise replaced → until when (ms) keyed records may still be in their partitions (partition 0 only; see `store::partitions`) |
//! | `dtq:rate:{q}` | hash | a rate-limited queue's window `w` (its number, by Redis's clock) and the starts `n` counted in it (`lua/include/admission.lua`) |
//! | `dtq:group:{q}:<group>` | sorted set | the tasks holding a slot of `<group>` under a group limit, by when admitted (`lua/include/admission.lua`) |
//! | `dtq:flow:{q}:<id>` | hash | task `<id>`'s flow (flows): its staged submissions not yet applied (its outbox), its children and which of them ended (`lua/include/flow.lua`); expires with its task |
//! | `dtq:flows:{q}` | sorted set | tasks whose flow has staged submissions or who wait for children, by when it last changed (ms): the sweep's work list (`flow.rs`) |
//! | `dtq:waiting:{q}` | sorted set | tasks WAITING for their children (flows), by when they began to wait (ms): the queue's `waiting` count (`lua/include/flow.lua`) |
//! | `dtq:settle:{q}` | sorted set | tasks with a parent that ended and whose parent may not have been told yet, by when they ended (ms) |
//! | [`LIMITS`] | hash | each queue's limits, JSON (`limits.rs`) |
//! | [`PAUSED`] | hash | paused queues: each name, and when it was paused (ms) (`pause.rs`) |
//! | [`QUEUES`] | set | names of queues that have seen a submission, at most `--max-queues` (`queue_register.lua`) |
//! | `dtq:guest:<namespace>:<key>` | any | the only keys a handler can reach (see `sandbox`) |
//! | `dtq:*:{registry}*` | | the handler registry: modules, active versions, history, fleet reports (see `deploy::Registry`) |

/// The consumer group every worker of every queue reads with.
pub const GROUP: &str = "dtq-workers";

/// A set of every queue name that has received a submission, for listing,
/// at most `--max-queues` of them. It is the one key without a queue's hash
/// tag; one script touches it, alone (`lua/queue_register.lua`).
pub const QUEUES: &str = "dtq:queues";

/// The limits of every queue that has some (a logical queue, all its
/// partitions): its name, and the limits as JSON ([`super::Limits`]).
pub const LIMITS: &str = "dtq:limits";

/// Every paused queue (a logical queue, all its partitions): its name, and
/// when it was paused (ms). Like [`QUEUES`], a key without a queue's hash
/// tag, so one read gives a worker the state of all its queues.
pub const PAUSED: &str = "dtq:paused";

/// What separates a queue's name from a partition's number in the name of
/// the partition's key set: `q#3`.
const PARTITION_SEP: char = '#';

/// The key-set name of partition `i` of `queue`: the queue itself for
/// partition 0, else `queue#i`.
pub fn partition_queue(queue: &str, i: u32) -> String {
    if i == 0 {
        queue.to_owned()
    } else {
        format!("{queue}{PARTITION_SEP}{i}")
    }
}

/// The queue a key-set name belongs to: `q` for `q#3` and for `q`.
pub fn logical_queue(name: &str) -> &str {
    name.split_once(PARTITION_SEP).map_or(name, |(q, _)| q)
}

/// The partition whose task has id `id`: the number after the last `.`
/// (a UUID has none), else 0.
pub fn partition_of_id(id: &str) -> u32 {
    id.rsplit_once('.')
        .and_then(|(_, i)| i.parse().ok())
        .unwrap_or(0)
}

/// The id of a task of partition `i` whose UUID is `uuid`.
pub fn partitioned_id(uuid: &str, i: u32) -> String {
    if i == 0 {
        uuid.to_owned()
    } else {
        format!("{uuid}.{i}")
    }
}

/// The names of one queue's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueKeys {
    queue: String,
    /// The ready stream, read by workers through [`GROUP`].
    pub stream: String,
    /// Scheduled tasks and retries waiting for their due time.
    pub delayed: String,
    /// Dead-lettered task ids.
    pub dlq: String,
    /// The capped lifecycle event stream.
    pub events: String,
    /// The submission index: one entry per task, added when it is
    /// created and trimmed by time, for listing tasks newest first.
    pub index: String,
    /// Each worker consuming the queue, scored by its last heartbeat (ms,
    /// Redis's clock): a worker is dead once this is older than the
    /// visibility timeout (see `lua/include/liveness.lua`).
    pub workers: String,
    /// The liveness clock: when a heartbeat or reclaim last ran on the
    /// queue, and when that resumed after a gap (an outage), so that no
    /// worker counts as dead before it could beat again.
    pub clock: String,
    /// Waiting tasks with an expiry, by when they expire: the workers'
    /// sweep expires them on time, even while nobody starts them.
    pub expiry: String,
    /// Periodic task definitions, by schedule name.
    pub schedules: String,
    /// Each schedule's next tick (ms): what the schedulers poll.
    pub schedule_due: String,
    /// Each schedule's last fired tick and the task it made.
    pub schedule_fired: String,
    /// The queue's partition count, as this partition's slot knows it.
    pub partitions: String,
    /// Partition counts replaced by a raise, each until when keyed records
    /// may still be in its partitions (kept in partition 0).
    pub partition_history: String,
    task_prefix: String,
    idem_prefix: String,
    cancel_channel: String,
}

impl QueueKeys {
    /// The keys of `queue`. The name must already be validated (see
    /// [`crate::ingest::validate_queue_name`]): it may not contain braces.
    pub fn new(queue: &str) -> Self {
        QueueKeys {
            queue: queue.to_owned(),
            stream: format!("dtq:stream:{{{queue}}}"),
            delayed: format!("dtq:delayed:{{{queue}}}"),
            dlq: format!("dtq:dlq:{{{queue}}}"),
            events: format!("dtq:events:{{{queue}}}"),
            index: format!("dtq:index:{{{queue}}}"),
            workers: format!("dtq:workers:{{{queue}}}"),
            clock: format!("dtq:clock:{{{queue}}}"),
            expiry: format!("dtq:expiry:{{{queue}}}"),
            schedules: format!("dtq:schedules:{{{queue}}}"),
            schedule_due: format!("dtq:schedule-due:{{{queue}}}"),
            schedule_fired: format!("dtq:schedule-fired:{{{queue}}}"),
            partitions: format!("dtq:partitions:{{{queue}}}"),
            partition_history: format!("dtq:partition-history:{{{queue}}}"),
            task_prefix: format!("dtq:task:{{{queue}}}:"),
            idem_prefix: format!("dtq:idempotency:{{{queue}}}:"),
            cancel_channel: format!("dtq:cancel:{{{queue}}}"),
        }
    }

    /// The key set of the partition that holds task `id` of `queue` (the
    /// queue's name, or any of its partitions' names).
    pub fn of_task(queue: &str, id: &str) -> Self {
        QueueKeys::new(&partition_queue(logical_queue(queue), partition_of_id(id)))
    }

    /// The name of this key set: the queue's, or its partition's (`q#i`).
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The pub/sub channel on which cancel requests of the queue's running
    /// tasks reach the workers; its messages are `<queue>\n<task id>`.
    pub fn cancel_channel(&self) -> &str {
        &self.cancel_channel
    }

    /// The hash of task `id`.
    pub fn task(&self, id: &str) -> String {
        format!("{}{id}", self.task_prefix)
    }

    /// The flow of task `id` (flows: its staged submissions and its
    /// children, see `lua/include/flow.lua`).
    pub fn flow(&self, id: &str) -> String {
        format!("dtq:flow:{{{}}}:{id}", self.queue)
    }

    /// The index of this key set's flows that have staged submissions or
    /// a waiting task, by when they last changed (ms): the sweeper's work
    /// list (`store/flow.rs`).
    pub fn flows(&self) -> String {
        format!("dtq:flows:{{{}}}", self.queue)
    }

    /// The tasks WAITING for their children, by when they began to wait
    /// (ms): the count of waiting parents.
    pub fn waiting(&self) -> String {
        format!("dtq:waiting:{{{}}}", self.queue)
    }

    /// The tasks with a parent that ended and whose parent may not have
    /// been told yet, by when they ended (ms).
    pub fn settle(&self) -> String {
        format!("dtq:settle:{{{}}}", self.queue)
    }

    /// The prefix of every task hash of this queue.
    pub fn task_prefix(&self) -> &str {
        &self.task_prefix
    }

    /// The rate limit's window of this key set: the window and the starts
    /// counted in it (`lua/include/admission.lua`).
    pub fn rate(&self) -> String {
        format!("dtq:rate:{{{}}}", self.queue)
    }

    /// The prefix of this key set's group sets: the running tasks of each
    /// group, `<prefix><group>` (`lua/include/admission.lua`).
    pub fn group_prefix(&self) -> String {
        format!("dtq:group:{{{}}}:", self.queue)
    }

    /// The idempotency record of `key`, or of no key: scripts take the record
    /// in KEYS even for keyless tasks (and ignore it), so the prefix stands in.
    pub fn idempotency(&self, key: Option<&str>) -> String {
        format!("{}{}", self.idem_prefix, key.unwrap_or(""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_queue_shares_its_hash_tag() {
        let k = QueueKeys::new("emails");
        for key in [
            k.stream.clone(),
            k.delayed.clone(),
            k.dlq.clone(),
            k.events.clone(),
            k.index.clone(),
            k.workers.clone(),
            k.clock.clone(),
            k.expiry.clone(),
            k.schedules.clone(),
            k.schedule_due.clone(),
            k.schedule_fired.clone(),
            k.task("t1"),
            k.idempotency(Some("abc")),
            k.cancel_channel().to_owned(),
            k.partitions.clone(),
            k.partition_history.clone(),
        ] {
            assert!(key.contains("{emails}"), "{key} lacks the hash tag");
        }
        assert_eq!(k.task("t1"), "dtq:task:{emails}:t1");
        assert_eq!(k.idempotency(Some("k")), "dtq:idempotency:{emails}:k");
    }

    #[test]
    fn a_task_id_names_its_partition() {
        let uuid = "0193a0a4-7c1e-7000-8000-000000000001";
        assert_eq!(partitioned_id(uuid, 0), uuid);
        assert_eq!(partition_of_id(uuid), 0);
        let id = partitioned_id(uuid, 3);
        assert_eq!(partition_of_id(&id), 3);
        assert_eq!(
            QueueKeys::of_task("emails", &id).stream,
            "dtq:stream:{emails#3}"
        );
        // From a partition's own name too (the worker knows only that).
        assert_eq!(
            QueueKeys::of_task("emails#3", &id),
            QueueKeys::of_task("emails", &id)
        );
        assert_eq!(QueueKeys::of_task("emails#3", uuid).queue(), "emails");
        assert_eq!(logical_queue("emails#3"), "emails");
        assert_eq!(logical_queue("emails"), "emails");
    }
}
