//! Tasks of a queue by status and task name, newest first: `GET
//! /v1/queues/{q}/tasks`.
//!
//! # The index
//!
//! `ingest.lua` appends every new task to the queue's submission index,
//! `dtq:index:{q}`, a stream whose entries (field `id`) are in submission
//! order by Redis's clock, and, once in [`INDEX_TRIM_EVERY`] submissions,
//! trims it in the same XADD (`MINID ~`) to the entries of the task
//! retention (`--task-retention-s`). That is the only write the listing
//! costs: one XADD per submission, nothing when a task changes status
//! (per-status sets kept by the scripts would cost two more commands at
//! every status change). A stream rather than a sorted set of ids: the
//! append costs Redis the same as a ZADD (the `redis_work` bench: about
//! 13,000 instructions either way, the trim's check about 5,000 more), its
//! entries are a few dozen bytes in listpack nodes instead of a skiplist
//! node and a dict entry each, and the trim by time is part of the append.
//!
//! A page reads the index newest first (XREVRANGE, exclusive of the
//! cursor, one entry more than it uses to tell whether the index goes on)
//! and then each entry's task summary (HMGET of a few fields, one
//! `task_read` script for the chunk, which also finds carried first
//! attempts running: see `carried.rs`), and keeps the tasks of the status and
//! the task name asked for: two round trips per chunk of entries. So the
//! status is the task's own, read at that moment, and a filtered page (by
//! status, by name, or both) costs what it scans, not
//! what it returns: a request reads at most [`LIST_SCAN_BUDGET`] index
//! entries (a chunk of at least 250 per pair of round trips when
//! filtered). When the budget runs out before the page is full, the page
//! is short (even empty) and `next_cursor` continues the scan;
//! `next_cursor` is `None` only when the index is exhausted.
//!
//! What the index does not show: a task submitted longer ago than the
//! retention (a task scheduled far ahead, a long retry, a dead-lettered
//! task, whose hash has no TTL) drops out of the listing while its record
//! lives on; `GET .../tasks/{id}` and the DLQ route still find it. Entries
//! whose hash is gone (expired, purged) are skipped.

use std::collections::HashMap;

use serde::Serialize;

use super::stream_id::{InvalidStreamId, StreamId};
use super::task::{finished_at, number};
use super::{MAX_PARTITIONS, QueueKeys, Store, StoreError, TaskStatus, from_value};

/// The most index entries one listing request reads (and task summaries
/// it fetches), whatever its filter: the bound on a request's Redis work.
pub const LIST_SCAN_BUDGET: usize = 2_000;

/// Entries a filtered request reads per round trip, at least: a rare
/// status would otherwise take many small ones.
const FILTERED_CHUNK: usize = 250;

/// The fields of a task hash a listing shows, in [`TaskSummary`]'s order.
const SUMMARY_FIELDS: [&str; 12] = [
    "status",
    "task",
    "attempts",
    "max_attempts",
    "idempotency_key",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "run_at",
    "expires_at",
    "held_by",
];

/// A task as a listing shows it: what it is and where it is, without its
/// payload, result, error or log (`GET .../tasks/{id}` has those), so a
/// page's size is bounded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TaskSummary {
    /// The task id.
    pub task_id: String,
    /// Its queue.
    pub queue: String,
    /// The task name.
    pub task: String,
    /// Its status when the page was read.
    pub status: TaskStatus,
    /// Attempts started.
    pub attempts: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// The submission's idempotency key.
    pub idempotency_key: Option<String>,
    /// Submitted (ms since epoch).
    pub created_at: u64,
    /// Last changed.
    pub updated_at: u64,
    /// Its last attempt started.
    pub started_at: Option<u64>,
    /// It reached a terminal status.
    pub finished_at: Option<u64>,
    /// It is due (scheduled tasks and retries).
    pub run_at: Option<u64>,
    /// It expires if not started by then.
    pub expires_at: Option<u64>,
    /// What holds it back while it waits SCHEDULED under a queue limit:
    /// `rate` or `group` (see `store::limits`).
    pub held_by: Option<String>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskPage {
    /// Tasks, newest first.
    pub tasks: Vec<TaskSummary>,
    /// Where the next page starts (the last index entry read); `None`
    /// once the index is exhausted.
    pub next_cursor: Option<ListCursor>,
}

/// A place in a queue's listing: an index entry of one partition.
///
/// The partitions' indexes are separate streams, so two of them can hold
/// the very same entry id (one server, one millisecond); entries are
/// ordered by id, then by partition, newest and highest first, and a page
/// ends between two entries of that order. Written `<ms>-<seq>` for
/// partition 0 (a queue that is not partitioned) and `<ms>-<seq>.<i>`
/// for partition `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ListCursor {
    /// The entry's id in its partition's index.
    pub entry: StreamId,
    /// The partition.
    pub partition: u32,
}

impl std::fmt::Display for ListCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.partition {
            0 => write!(f, "{}", self.entry),
            i => write!(f, "{}.{i}", self.entry),
        }
    }
}

impl std::str::FromStr for ListCursor {
    type Err = InvalidStreamId;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (entry, partition) = match text.split_once('.') {
            None => (text, 0),
            Some((entry, i)) => (
                entry,
                i.parse()
                    .ok()
                    .filter(|i| *i > 0)
                    .ok_or_else(|| InvalidStreamId(text.to_owned()))?,
            ),
        };
        Ok(ListCursor {
            entry: entry.parse()?,
            partition,
        })
    }
}

/// One submission in this many to a queue trims its index (counted per
/// process and queue: the first, then every this many). The trim's check
/// costs Redis about 40% of what the append does, and between two
/// trims the index holds only a few entries past the retention.
pub const INDEX_TRIM_EVERY: u64 = 16;

/// The oldest index entry `ingest.lua` keeps, ms: `now` minus the
/// retention.
fn index_min_ms(now: u64, retention_s: u64) -> u64 {
    now.saturating_sub(retention_s.saturating_mul(1_000))
}

impl Store {
    /// `ingest.lua`'s ARGV for the index trim of a submission to `queue`
    /// at `now`: the oldest entry to keep (ms) once in
    /// [`INDEX_TRIM_EVERY`] submissions, else `""` (no trim).
    pub(super) fn index_trim_bound(&self, queue: &str, now: u64) -> String {
        let trim = {
            let max = self
                .settings
                .max_queues
                .saturating_mul(u64::from(MAX_PARTITIONS));
            super::bounded(&self.index_trims, max, |counts| {
                let count = match counts.get_mut(queue) {
                    Some(count) => count,
                    None => counts.entry(queue.to_owned()).or_insert(0),
                };
                let trim = *count % INDEX_TRIM_EVERY == 0;
                *count = count.wrapping_add(1);
                trim
            })
        };
        if trim {
            index_min_ms(now, self.settings.task_retention_s).to_string()
        } else {
            String::new()
        }
    }

    /// Up to `limit` tasks of `queue` (of `status` and named `task`, each
    /// if given), newest first, starting after `cursor` (a previous page's
    /// `next_cursor`). Reads at most [`LIST_SCAN_BUDGET`] index entries per
    /// partition, whatever the filter; see the module documentation.
    pub async fn list_tasks(
        &self,
        queue: &str,
        status: Option<TaskStatus>,
        task: Option<&str>,
        limit: usize,
        cursor: Option<ListCursor>,
    ) -> Result<TaskPage, StoreError> {
        let filter = Filter { status, task };
        let names = self.partition_names(queue).await?;
        let limit = limit.clamp(1, LIST_SCAN_BUDGET);
        let pages = futures::future::try_join_all(names.iter().enumerate().map(|(i, name)| {
            // After `cursor` in the listing's order: this partition's
            // entries older than the cursor's, and also its entry with the
            // very same id when this partition comes after the cursor's.
            let upper = match cursor {
                None => "+".to_owned(),
                Some(c) if (i as u32) < c.partition => c.entry.to_string(),
                Some(c) => format!("({}", c.entry),
            };
            self.list_partition(queue, name, i as u32, filter, limit, upper)
        }))
        .await?;
        Ok(merge_pages(pages, limit))
    }

    /// [`Store::list_tasks`] of one partition's index (key set `name`):
    /// the page's tasks, each with its index entry, and the page's cursor.
    async fn list_partition(
        &self,
        queue: &str,
        name: &str,
        partition: u32,
        filter: Filter<'_>,
        limit: usize,
        mut upper: String,
    ) -> Result<PartitionPage, StoreError> {
        let keys = QueueKeys::new(name);
        let at = |entry: StreamId| ListCursor { entry, partition };
        let mut tasks = Vec::new();
        let mut scanned = 0;
        loop {
            let chunk = if filter.any() {
                limit.max(FILTERED_CHUNK)
            } else {
                limit - tasks.len()
            }
            .min(LIST_SCAN_BUDGET - scanned);
            // One entry more than the chunk, unread, tells whether the
            // index goes on, so that a listing ends on its last page rather
            // than with an empty one after it.
            let mut entries = self.index_before(&keys, &upper, chunk + 1).await?;
            let exhausted = entries.len() <= chunk;
            entries.truncate(chunk);
            let summaries = self.summaries(&keys, &entries).await?;
            let mut last = None;
            let count = entries.len();
            for (i, ((entry, task_id), summary)) in entries.into_iter().zip(summaries).enumerate() {
                scanned += 1;
                last = Some(entry);
                let Some(summary) = summary.filter(|s| filter.keeps(s)) else {
                    continue;
                };
                tasks.push((
                    at(entry),
                    TaskSummary {
                        task_id,
                        queue: queue.to_owned(),
                        ..summary
                    },
                ));
                if tasks.len() == limit {
                    let at_end = exhausted && i + 1 == count;
                    return Ok((tasks, last.filter(|_| !at_end).map(at)));
                }
            }
            match last {
                Some(last) if !exhausted && scanned < LIST_SCAN_BUDGET => {
                    upper = format!("({last}");
                }
                _ => {
                    return Ok((tasks, last.filter(|_| !exhausted).map(at)));
                }
            }
        }
    }

    /// Up to `count` index entries before `upper` (an XREVRANGE bound),
    /// newest first: each entry's id and its task id.
    async fn index_before(
        &self,
        keys: &QueueKeys,
        upper: &str,
        count: usize,
    ) -> Result<Vec<(StreamId, String)>, StoreError> {
        let entries: Vec<(String, Option<Vec<String>>)> = self
            .trip(
                "list_index",
                redis::cmd("XREVRANGE")
                    .arg(&keys.index)
                    .arg(upper)
                    .arg("-")
                    .arg("COUNT")
                    .arg(count)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        entries
            .into_iter()
            .map(|(id, body)| {
                let id: StreamId = id
                    .parse()
                    .map_err(|e: InvalidStreamId| StoreError::Protocol(e.to_string()))?;
                let task_id = body
                    .unwrap_or_default()
                    .chunks(2)
                    .find(|kv| kv.len() == 2 && kv[0] == "id")
                    .map(|kv| kv[1].clone())
                    .unwrap_or_default();
                Ok((id, task_id))
            })
            .collect()
    }

    /// The summary of each entry's task (`None` where its hash is gone), in
    /// one pipelined round trip. The summary's `task_id` and `queue` are
    /// left for the caller.
    async fn summaries(
        &self,
        keys: &QueueKeys,
        entries: &[(StreamId, String)],
    ) -> Result<Vec<Option<TaskSummary>>, StoreError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = entries.iter().map(|(_, id)| id.as_str()).collect();
        self.read_tasks(keys, &ids, &SUMMARY_FIELDS)
            .await?
            .into_iter()
            .map(|(values, runner)| {
                let mut found = summary(from_value(Some(values))?)?;
                if let Some(task) = found.as_mut().filter(|_| runner.is_some()) {
                    task.status = TaskStatus::Running;
                    task.attempts = 1;
                }
                Ok(found)
            })
            .collect()
    }
}

impl Store {
    /// The name of each task `(key set, task id)` (`None` where its record
    /// is gone), in one pipelined round trip of `HGET`s on one server; on a
    /// cluster, where a pipeline reaches one node, one per key set (a
    /// partition is one slot). For the task names of live events, which
    /// the events stream leaves out to stay compact.
    pub async fn task_names(
        &self,
        tasks: &[(&str, &str)],
    ) -> Result<Vec<Option<String>>, StoreError> {
        let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
        let cluster = self.backend.is_cluster();
        for (i, &(name, _)) in tasks.iter().enumerate() {
            match groups.iter_mut().find(|(n, _)| !cluster || *n == name) {
                Some((_, members)) => members.push(i),
                None => groups.push((name, vec![i])),
            }
        }
        let mut names = vec![None; tasks.len()];
        for (_, members) in groups {
            let mut pipe = redis::pipe();
            for &i in &members {
                let (name, id) = tasks[i];
                pipe.cmd("HGET")
                    .arg(QueueKeys::new(name).task(id))
                    .arg("task");
            }
            let found: Vec<Option<String>> = self
                .trip("task_names", pipe.query_async(&mut self.conn.clone()))
                .await?;
            for (i, name) in members.into_iter().zip(found) {
                names[i] = name.filter(|n| !n.is_empty());
            }
        }
        Ok(names)
    }
}

/// What a listing keeps: tasks of a status, of a name, or both.
#[derive(Debug, Clone, Copy)]
struct Filter<'a> {
    status: Option<TaskStatus>,
    task: Option<&'a str>,
}

impl Filter<'_> {
    /// Whether it leaves some tasks out (a page then reads larger chunks).
    fn any(&self) -> bool {
        self.status.is_some() || self.task.is_some()
    }

    /// Whether `summary` is one of the tasks asked for.
    fn keeps(&self, summary: &TaskSummary) -> bool {
        self.status.is_none_or(|s| s == summary.status)
            && self.task.is_none_or(|t| t == summary.task)
    }
}

/// One partition's page: its tasks, each with its place, newest first,
/// and where its scan stopped (`None`: its index is exhausted).
type PartitionPage = (Vec<(ListCursor, TaskSummary)>, Option<ListCursor>);

/// One page from the pages of a queue's partitions, each newest first with
/// the cursor where its scan stopped (`None`: its index is exhausted).
///
/// A partition that stopped at entry `c` has told nothing of what comes
/// after `c` in the listing's order ([`ListCursor`]), so the page keeps
/// only tasks at or before the first such stop, then the first `limit` of
/// those; the next page continues from the last task kept, or from that
/// stop.
fn merge_pages(pages: Vec<PartitionPage>, limit: usize) -> TaskPage {
    let stop = pages.iter().filter_map(|(_, stop)| *stop).max();
    let mut tasks: Vec<(ListCursor, TaskSummary)> = pages
        .into_iter()
        .flat_map(|(tasks, _)| tasks)
        .filter(|(at, _)| stop.is_none_or(|stop| *at >= stop))
        .collect();
    tasks.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let next_cursor = if tasks.len() > limit {
        tasks.truncate(limit);
        tasks.last().map(|(at, _)| *at)
    } else {
        stop
    };
    TaskPage {
        tasks: tasks.into_iter().map(|(_, task)| task).collect(),
        next_cursor,
    }
}

/// A summary from HMGET's values of [`SUMMARY_FIELDS`]; `None` when the
/// hash is gone (no status).
fn summary(values: Vec<Option<String>>) -> Result<Option<TaskSummary>, StoreError> {
    let mut fields: HashMap<&str, String> = SUMMARY_FIELDS
        .iter()
        .zip(values)
        .filter_map(|(name, value)| Some((*name, value.filter(|v| !v.is_empty())?)))
        .collect();
    let Some(status) = fields.remove("status") else {
        return Ok(None);
    };
    let mut take = |name: &str| fields.remove(name);
    let status: TaskStatus = status.parse()?;
    let updated_at = number(take("updated_at"), "updated_at")?.unwrap_or(0);
    let finished = number(take("finished_at"), "finished_at")?;
    Ok(Some(TaskSummary {
        task_id: String::new(),
        queue: String::new(),
        status,
        task: take("task").unwrap_or_default(),
        attempts: number(take("attempts"), "attempts")?.unwrap_or(0) as u32,
        max_attempts: number(take("max_attempts"), "max_attempts")?.unwrap_or(1) as u32,
        idempotency_key: take("idempotency_key"),
        created_at: number(take("created_at"), "created_at")?.unwrap_or(0),
        updated_at,
        started_at: number(take("started_at"), "started_at")?,
        finished_at: finished_at(status, finished, updated_at),
        run_at: number(take("run_at"), "run_at")?,
        expires_at: number(take("expires_at"), "expires_at")?,
        held_by: take("held_by").filter(|_| status == TaskStatus::Scheduled),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_keeps_the_retention() {
        assert_eq!(index_min_ms(10_000_000, 3_600), 10_000_000 - 3_600_000);
        assert_eq!(index_min_ms(1_000, 7 * 86_400), 0);
        assert_eq!(index_min_ms(1_000, u64::MAX), 0);
    }

    #[test]
    fn a_summary_needs_a_status() {
        let mut values: Vec<Option<String>> = vec![None; SUMMARY_FIELDS.len()];
        assert_eq!(summary(values.clone()).expect("parses"), None);
        values[0] = Some("RUNNING".into());
        values[1] = Some("echo".into());
        values[2] = Some("2".into());
        let got = summary(values.clone()).expect("parses").expect("a task");
        assert_eq!(
            (got.status, got.task.as_str(), got.attempts),
            (TaskStatus::Running, "echo", 2)
        );
        // A hold shows while the task waits SCHEDULED only.
        values[11] = Some("rate".into());
        assert_eq!(
            summary(values.clone())
                .expect("parses")
                .expect("a task")
                .held_by,
            None
        );
        values[0] = Some("SCHEDULED".into());
        let held = summary(values.clone()).expect("parses").expect("a task");
        assert_eq!(held.held_by.as_deref(), Some("rate"));
        values[0] = Some("NAPPING".into());
        assert!(summary(values).is_err());
    }
}
