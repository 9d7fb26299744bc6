//! Flows: tasks a handler submits, and parents that wait for their
//! children.
//!
//! # Exactly once, across slots
//!
//! A handler's submissions are staged by the sandbox and written with its
//! attempt's completion (`complete.lua`, outcome `staged` or `wait`) into
//! the task's *flow*, `dtq:flow:{q}:<id>`, in the task's own slot: the
//! outbox. Nothing of a failed attempt reaches it. Each staged submission
//! is then applied by the ordinary submission (`ingest.lua`, in the target
//! queue's slot) under an idempotency key (the handler's, or one derived
//! from the parent and the submission's position), and recorded as applied
//! in the flow by [`Store::flow_record`] (`lua/flow_record.lua`, in the
//! parent's slot). A worker that dies between the two leaves the
//! submission in the outbox, and the queue's flows index
//! (`dtq:flows:{q}`) holds the parent until it is applied: the sweeper
//! (any worker of the queue) applies it again, and the key makes the
//! second application a replay of the first. No script spans two slots.
//!
//! # Waking a parent exactly once
//!
//! A child's hash names its parent (field `parent`, `<queue>/<id>`). When
//! a child ends, the script that ends it (`complete.lua`, `cancel.lua`,
//! `expire.lua`) adds it to its own slot's settle index
//! (`dtq:settle:{q}`); whoever ends it (the worker, at once) or the
//! sweeper (later, if that one died) then records the child as settled in
//! the parent's flow and drops the index entry. The record is a field per
//! child (`d:<child>`, set if absent) and a count of them, so telling a
//! parent twice counts once; the parent resumes (WAITING → QUEUED, in
//! `lua/include/flow.lua`) only in the step whose count meets the number
//! of its children with nothing staged, and only from WAITING: exactly
//! once. A waiting parent whose flow has not changed for a while is looked
//! at again by the sweeper, which reads its children's statuses and
//! records those that ended: a missed wake-up is repaired, not lost.

use std::sync::LazyLock;

use redis::Script;
use serde::{Deserialize, Serialize};

use super::scripts::{Argv, ArgvLayout, compose};
use super::{Conn, QueueKeys, Store, StoreError, TaskStatus};

/// How long a flow stays unchanged before the sweep looks at it (ms).
const FLOW_GRACE_MS: u64 = 10_000;

/// The longest gap between two looks at a flow that stays unchanged (ms).
const FLOW_LOOK_MAX_MS: u64 = 300_000;

/// When the sweep looks at a flow again after a look at `now`: as far off
/// as its task has been unchanged (`changed`, its `updated_at`), within
/// [`FLOW_GRACE_MS`] and [`FLOW_LOOK_MAX_MS`].
fn next_look(now: u64, changed: Option<u64>) -> u64 {
    let unchanged = changed.map_or(0, |at| now.saturating_sub(at));
    now + unchanged.clamp(FLOW_GRACE_MS, FLOW_LOOK_MAX_MS)
}

/// `flow_record.lua`'s ARGV by name.
pub(super) static FLOW_RECORD_ARGV: ArgvLayout = ArgvLayout {
    script: "flow_record",
    prefix: "ARG_",
    first: 1,
    names: &[
        "TASK_ID",
        "EID",
        "CHILD",
        "TERMINAL",
        "REFUSAL",
        "NOW",
        "EVENTS_MAX_LEN",
    ],
    rest: None,
};

/// `flow_record.lua`, after the fragments it uses.
static FLOW_RECORD: LazyLock<Script> = LazyLock::new(|| {
    compose(
        &[
            include_str!("lua/include/idem.lua"),
            include_str!("lua/include/flow.lua"),
        ],
        include_str!("lua/flow_record.lua"),
    )
});

/// `flow_stage.lua`'s ARGV by name.
pub(super) static FLOW_STAGE_ARGV: ArgvLayout = ArgvLayout {
    script: "flow_stage",
    prefix: "ARG_",
    first: 1,
    names: &["TASK_ID", "NOW"],
    rest: Some("ENTRIES"),
};

/// `flow_stage.lua`.
static FLOW_STAGE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/flow_stage.lua")));

/// Stage `entries` (JSON [`Staged`] submissions of an idempotent
/// operation, each naming its claim and owner) into the outbox of task
/// `id` of `queue`, before the operation commits: they apply once its
/// commit is known (see [`Store::claim_outcome`]), and hold the task's
/// flow unsettled until then.
pub async fn stage_outbox(
    conn: &Conn,
    queue: &str,
    id: &str,
    entries: &[String],
) -> Result<(), StoreError> {
    let keys = QueueKeys::of_task(queue, id);
    let mut inv = FLOW_STAGE.prepare_invoke();
    inv.key(keys.flow(id)).key(keys.flows());
    Argv::new(&mut inv, &FLOW_STAGE_ARGV)
        .put("TASK_ID", id)
        .put("NOW", crate::base::now_ms())
        .done();
    for entry in entries {
        inv.arg(entry.as_str());
    }
    let _: i64 = inv.invoke_async(&mut conn.clone()).await?;
    Ok(())
}

/// How many positions the flow of task `id` of `queue` has given (its
/// staged submissions and its children): where a run's derived
/// submission keys start (`sandbox/tasks.rs`).
pub async fn flow_positions(conn: &Conn, queue: &str, id: &str) -> Result<u64, StoreError> {
    let keys = QueueKeys::of_task(queue, id);
    let seq: Option<u64> = redis::cmd("HGET")
        .arg(keys.flow(id))
        .arg("seq")
        .query_async(&mut conn.clone())
        .await?;
    Ok(seq.unwrap_or(0))
}

/// Most entries of an index one sweep takes at once.
const SWEEP_BATCH: usize = 100;

/// A submission a handler staged, as the flow's outbox keeps it (JSON,
/// short names: a fan-out may stage thousands).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staged {
    /// The queue it goes to (a logical queue).
    #[serde(rename = "q")]
    pub queue: String,
    /// The task name.
    #[serde(rename = "t")]
    pub task: String,
    /// The payload, JSON text.
    #[serde(rename = "p")]
    pub payload: String,
    /// Its idempotency key: the handler's, or one derived from the parent
    /// and the position.
    #[serde(rename = "k")]
    pub key: String,
    /// The id it is submitted with (derived from the queue and the key).
    #[serde(rename = "i")]
    pub id: String,
    /// Delay before it may run, ms.
    #[serde(rename = "d", default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// Its attempts in all.
    #[serde(rename = "m", default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Its group, for a group limit.
    #[serde(rename = "g", default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Its parent, `<queue>/<id>`, when it is submitted as a child.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// For a submission staged inside an idempotent operation: the
    /// operation's claim (`dtq:claim:{<namespace>}:<key>`). The submission
    /// applies only if that claim was committed by [`Staged::owner`].
    #[serde(rename = "cl", default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// The owner token of the call that staged it inside an operation.
    #[serde(rename = "ow", default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// What became of the operation a submission was staged in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Committed by the call that staged it: the submission applies.
    Committed,
    /// Still open by that call: not known yet.
    Open,
    /// Not committed by that call (released, taken over, gone): the
    /// submission never applies.
    NotCommitted,
}

/// The reference to a task that flows store: `<queue>/<id>` (a queue's
/// name has no `/`).
pub fn task_ref(queue: &str, id: &str) -> String {
    format!("{queue}/{id}")
}

/// The queue and id of a [`task_ref`].
pub fn parse_task_ref(task_ref: &str) -> Option<(&str, &str)> {
    task_ref
        .split_once('/')
        .filter(|(q, id)| !q.is_empty() && !id.is_empty())
}

/// One child of a task, as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Child {
    /// Its id.
    pub task_id: String,
    /// Its queue.
    pub queue: String,
    /// Its task name ("" when its record is gone).
    pub task: String,
    /// Its status: a [`TaskStatus`], or `MISSING` when its record is gone
    /// (expired after its retention).
    pub status: String,
    /// Its result (JSON text), once it succeeded.
    pub result: Option<String>,
    /// Its error, once it failed (or its last, while it retries).
    pub error: Option<String>,
    /// Whether a cancel asked it to stop while it ran (the flag its
    /// worker's heartbeat reads); not shown.
    #[serde(skip)]
    pub cancel_requested: bool,
}

impl Child {
    /// Whether the child has ended (a record gone counts as ended).
    pub fn is_terminal(&self) -> bool {
        self.status
            .parse::<TaskStatus>()
            .map_or(true, TaskStatus::is_terminal)
    }
}

/// What a task's flow holds: its staged submissions not yet applied, by
/// their id in the outbox, and its children in submission order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowState {
    /// Staged submissions not applied yet: (outbox id, submission).
    pub staged: Vec<(String, Staged)>,
    /// The children recorded, `<queue>/<id>`, in submission order.
    pub children: Vec<String>,
    /// The children recorded as ended.
    pub settled: Vec<String>,
    /// The children whose submission was refused, with why.
    pub refused: Vec<(String, String)>,
}

/// Read the flow of task `id` of `queue` (one HGETALL).
async fn read_flow(conn: &Conn, queue: &str, id: &str) -> Result<FlowState, StoreError> {
    let keys = QueueKeys::of_task(queue, id);
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.flow(id))
        .query_async(&mut conn.clone())
        .await?;
    let mut state = FlowState::default();
    let mut children: Vec<(u64, String)> = Vec::new();
    for (field, value) in fields {
        if let Some(eid) = field.strip_prefix("s:") {
            let staged: Staged = serde_json::from_str(&value).map_err(|e| {
                StoreError::Corrupt(format!("staged submission {eid} of task {id}: {e}"))
            })?;
            state.staged.push((eid.to_owned(), staged));
        } else if let Some(child) = field.strip_prefix("c:") {
            children.push((value.parse().unwrap_or(u64::MAX), child.to_owned()));
        } else if let Some(child) = field.strip_prefix("d:") {
            state.settled.push(child.to_owned());
        } else if let Some(child) = field.strip_prefix("r:") {
            state.refused.push((child.to_owned(), value));
        }
    }
    children.sort();
    state.children = children.into_iter().map(|(_, c)| c).collect();
    state
        .staged
        .sort_by_key(|(eid, _)| eid.parse::<u64>().unwrap_or(u64::MAX));
    Ok(state)
}

/// The children of task `id` of `queue`, in submission order, each as it
/// is now: one read of the flow, then one of each child's record (one
/// pipeline; on a cluster, one read per child, all at once).
pub async fn children(conn: &Conn, queue: &str, id: &str) -> Result<Vec<Child>, StoreError> {
    let flow = read_flow(conn, queue, id).await?;
    let mut children = children_of(conn, &flow.children).await?;
    for (child, r) in children.iter_mut().zip(&flow.children) {
        if let Some((_, why)) = flow.refused.iter().find(|(refused, _)| refused == r) {
            child.status = REFUSED.to_owned();
            child.error = Some(why.clone());
        }
    }
    Ok(children)
}

/// The status a child whose submission was refused shows: it never runs.
pub const REFUSED: &str = "REFUSED";

/// The records of `refs` (`<queue>/<id>`), as [`Child`]ren, in order.
pub async fn children_of(conn: &Conn, refs: &[String]) -> Result<Vec<Child>, StoreError> {
    if refs.is_empty() {
        return Ok(Vec::new());
    }
    let cluster = matches!(conn, Conn::Cluster(_));
    const FIELDS: [&str; 5] = ["task", "status", "result", "error", "cancel_requested"];
    let mut cmds = Vec::with_capacity(refs.len());
    let mut parsed = Vec::with_capacity(refs.len());
    for r in refs {
        let (queue, id) = parse_task_ref(r)
            .ok_or_else(|| StoreError::Corrupt(format!("a flow names child {r:?}")))?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(QueueKeys::of_task(queue, id).task(id)).arg(&FIELDS);
        cmds.push(cmd);
        parsed.push((queue, id));
    }
    type Fields = Vec<Option<String>>;
    let replies: Vec<Fields> = if cluster {
        futures::future::try_join_all(
            cmds.iter()
                .map(|cmd| async move { cmd.query_async::<Fields>(&mut conn.clone()).await }),
        )
        .await?
    } else {
        let mut pipe = redis::pipe();
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        pipe.query_async(&mut conn.clone()).await?
    };
    Ok(parsed
        .into_iter()
        .zip(replies)
        .map(|((queue, id), fields)| {
            let mut fields = fields.into_iter();
            let mut next = || fields.next().flatten();
            let (task, status) = (next(), next());
            let (result, error) = (next(), next());
            Child {
                task_id: id.to_owned(),
                queue: super::logical_queue(queue).to_owned(),
                task: task.unwrap_or_default(),
                status: status.unwrap_or_else(|| "MISSING".to_owned()),
                result,
                error,
                cancel_requested: next().is_some_and(|flag| flag == "1"),
            }
        })
        .collect())
}

impl Store {
    /// Record in the flow of parent `id` of `queue` that staged submission
    /// `eid` was applied (as `child`, when it was a child) and that `child`
    /// has ended when `terminal`; resumes the parent if that settled its
    /// flow while it waits. Returns whether it resumed it.
    pub async fn flow_record(
        &self,
        queue: &str,
        id: &str,
        eid: Option<&str>,
        child: Option<&str>,
        terminal: bool,
    ) -> Result<bool, StoreError> {
        self.flow_record_refusal(queue, id, eid, child, terminal, "")
            .await
    }

    /// [`Store::flow_record`], for a child whose submission was refused
    /// (`refusal` says why; "" for one that was not).
    pub async fn flow_record_refusal(
        &self,
        queue: &str,
        id: &str,
        eid: Option<&str>,
        child: Option<&str>,
        terminal: bool,
        refusal: &str,
    ) -> Result<bool, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let mut inv = FLOW_RECORD.prepare_invoke();
        inv.key(keys.task(id))
            .key(keys.flow(id))
            .key(&keys.stream)
            .key(&keys.events)
            .key(keys.flows())
            .key(keys.waiting());
        Argv::new(&mut inv, &FLOW_RECORD_ARGV)
            .put("TASK_ID", id)
            .put("EID", eid.unwrap_or(""))
            .put("CHILD", child.unwrap_or(""))
            .put("TERMINAL", super::flag(terminal))
            .put("REFUSAL", refusal)
            .put("NOW", crate::base::now_ms())
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .done();
        let resumed: i64 = self
            .trip("flow_record", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        Ok(resumed == 1)
    }

    /// Tell the parent `parent` (`<queue>/<id>`) that its child `child_id`
    /// of `child_queue` has ended, then drop the child's entry in its
    /// settle index. Returns whether the parent resumed.
    pub async fn settle_child(
        &self,
        child_queue: &str,
        child_id: &str,
        parent: &str,
    ) -> Result<bool, StoreError> {
        let resumed = match parse_task_ref(parent) {
            Some((queue, id)) => {
                let child = task_ref(super::logical_queue(child_queue), child_id);
                self.flow_record(queue, id, None, Some(&child), true)
                    .await?
            }
            None => false,
        };
        let keys = QueueKeys::of_task(child_queue, child_id);
        let _: i64 = self
            .trip(
                "settle_done",
                redis::cmd("ZREM")
                    .arg(keys.settle())
                    .arg(child_id)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(resumed)
    }

    /// The flow of task `id` of `queue`.
    pub async fn flow(&self, queue: &str, id: &str) -> Result<FlowState, StoreError> {
        self.trip("flow", read_flow(&self.conn, queue, id)).await
    }

    /// When task `id` of `queue` was cancelled (ms since epoch: its
    /// `finished_at`, else its `updated_at`), or `None` when it is not
    /// CANCELLED (or gone). A cancelled task with neither time readable
    /// counts as cancelled long ago (0): its children are to be cancelled
    /// all the same, and a sweep must not stop at it.
    pub async fn cancelled_at(&self, queue: &str, id: &str) -> Result<Option<u64>, StoreError> {
        let keys = QueueKeys::of_task(queue, id);
        let (status, finished, updated): (Option<String>, Option<String>, Option<String>) = self
            .trip(
                "cancelled_at",
                redis::cmd("HMGET")
                    .arg(keys.task(id))
                    .arg("status")
                    .arg("finished_at")
                    .arg("updated_at")
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        if status.as_deref() != Some("CANCELLED") {
            return Ok(None);
        }
        let ms = |at: Option<String>| at.and_then(|at| at.parse().ok());
        Ok(Some(ms(finished).or_else(|| ms(updated)).unwrap_or(0)))
    }

    /// The children of task `id` of `queue`, as they are now.
    pub async fn children(&self, queue: &str, id: &str) -> Result<Vec<Child>, StoreError> {
        self.trip("children", children(&self.conn, queue, id)).await
    }

    /// The members of sorted set `index` scored before `before`: at most a
    /// sweep's batch, oldest first.
    async fn due(
        &self,
        operation: &'static str,
        index: &str,
        before: u64,
    ) -> Result<Vec<String>, StoreError> {
        Ok(self
            .trip(
                operation,
                redis::cmd("ZRANGE")
                    .arg(index)
                    .arg(0)
                    .arg(before)
                    .arg("BYSCORE")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(SWEEP_BATCH)
                    .query_async(&mut self.conn.clone()),
            )
            .await?)
    }

    /// Of the key set `queue`, the tasks whose parent may not have been
    /// told that they ended, ended before `before` (ms): at most a sweep's
    /// batch, with each one's parent (`None` when its record is gone).
    pub async fn settles_due(
        &self,
        queue: &str,
        before: u64,
    ) -> Result<Vec<(String, Option<String>)>, StoreError> {
        let keys = QueueKeys::new(queue);
        let ids = self.due("settles_due", &keys.settle(), before).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.hget(keys.task(id), "parent");
        }
        let parents: Vec<Option<String>> = self
            .trip("settles_due", pipe.query_async(&mut self.conn.clone()))
            .await?;
        Ok(ids.into_iter().zip(parents).collect())
    }

    /// Of the key set `queue`, the tasks whose flow has staged submissions
    /// or a waiting task and is due a look at `now` (ms): at most a
    /// sweep's batch. A flow is due 10 s after it last changed, or after
    /// the gap [`Store::flow_unchanged`] set. Each is touched (due again
    /// 10 s from now), so that another sweeper does not take it up at once.
    pub async fn flows_due(&self, queue: &str, now: u64) -> Result<Vec<String>, StoreError> {
        let keys = QueueKeys::new(queue);
        let ids = self
            .due(
                "flows_due",
                &keys.flows(),
                now.saturating_sub(FLOW_GRACE_MS),
            )
            .await?;
        if !ids.is_empty() {
            let mut touch = redis::cmd("ZADD");
            touch.arg(keys.flows()).arg("XX");
            for id in &ids {
                touch.arg(now).arg(id);
            }
            let _: i64 = self
                .trip("flows_due", touch.query_async(&mut self.conn.clone()))
                .await?;
        }
        Ok(ids)
    }

    /// A look at the flow of task `id` of `queue` at `now` found nothing to
    /// do (nothing staged, no child newly ended): put the next look as far
    /// off as the task has been unchanged (its `updated_at`: a parent
    /// waiting since its wait), at least 10 s, at most 5 minutes. So a
    /// parent waiting on slow children costs a read of them at 10, 20,
    /// 40 s... after its wait, then every 5 minutes, not every 10 s for as
    /// long as it waits. A flow no longer in the index is left out of it.
    pub async fn flow_unchanged(&self, queue: &str, id: &str, now: u64) -> Result<(), StoreError> {
        let keys = QueueKeys::new(queue);
        let changed: Option<u64> = self
            .trip(
                "flow_unchanged",
                redis::cmd("HGET")
                    .arg(keys.task(id))
                    .arg("updated_at")
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        let _: i64 = self
            .trip(
                "flow_unchanged",
                redis::cmd("ZADD")
                    .arg(keys.flows())
                    .arg("XX")
                    .arg(next_look(now, changed) - FLOW_GRACE_MS)
                    .arg(id)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(())
    }

    /// Whether the operation of claim `claim` was committed by `owner`.
    pub async fn claim_outcome(
        &self,
        claim: &str,
        owner: &str,
    ) -> Result<ClaimOutcome, StoreError> {
        let (state, found): (Option<String>, Option<String>) = self
            .trip(
                "claim_outcome",
                redis::cmd("HMGET")
                    .arg(claim)
                    .arg("state")
                    .arg("owner")
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(match (state.as_deref(), found.as_deref()) {
            (Some("done"), Some(o)) if o == owner => ClaimOutcome::Committed,
            (Some(_), Some(o)) if o == owner => ClaimOutcome::Open,
            _ => ClaimOutcome::NotCommitted,
        })
    }

    /// The records of `refs` (`<queue>/<id>`) as [`Child`]ren, in order.
    pub async fn children_of(&self, refs: &[String]) -> Result<Vec<Child>, StoreError> {
        self.trip("children", children_of(&self.conn, refs)).await
    }

    /// Cancel the children of task `id` of `queue` that have not ended,
    /// and theirs in turn (a child waiting for its own).
    pub async fn cancel_children(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<ChildrenCancelled, StoreError> {
        let mut cancelled = ChildrenCancelled::default();
        let mut parents = vec![(queue.to_owned(), id.to_owned())];
        // A flow is a tree; the bound stops a cycle written by hand.
        let mut budget = 100_000usize;
        while let Some((queue, id)) = parents.pop() {
            for child in self.children(&queue, &id).await? {
                if child.is_terminal() || budget == 0 {
                    continue;
                }
                budget -= 1;
                let now = crate::base::now_ms();
                let outcome = self.cancel(&child.queue, &child.task_id, now).await?;
                match outcome {
                    super::CancelOutcome::Cancelled | super::CancelOutcome::Requested => {
                        let asked_before =
                            child.cancel_requested && outcome == super::CancelOutcome::Requested;
                        cancelled.new += usize::from(!asked_before);
                        cancelled.ids.push(child.task_id.clone());
                        parents.push((child.queue, child.task_id));
                    }
                    super::CancelOutcome::Terminal(_) | super::CancelOutcome::NotFound => {}
                }
            }
        }
        Ok(cancelled)
    }
}

/// What [`Store::cancel_children`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChildrenCancelled {
    /// The ids of the children (and theirs) cancelled or asked to stop,
    /// each parent's in submission order.
    pub ids: Vec<String>,
    /// How many of them this call changed: all but the running ones a
    /// cancel had asked to stop before (asked again, in case their worker
    /// missed the message, but nothing new).
    pub new: usize,
}
