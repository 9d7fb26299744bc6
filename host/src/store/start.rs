//! Reading a queue and starting its deliveries: the consumer group
//! ([`Store::ensure_group`]), the blocking read of new messages
//! ([`Store::read`]), the `start` script that hands a batch to a worker
//! (`lua/start.lua`; a carried delivery starts with no round trip, see
//! `carried.rs`), and the heartbeat that keeps a worker's running attempts
//! (`lua/heartbeat.lua`).

use std::time::Duration;

use redis::Value;

use super::events::EVENTS_PER_ENTRY;
use super::scripts::{Argv, ArgvLayout};
use super::{
    Code, Conn, Delivery, GROUP, QueueKeys, StartDecision, StartedTask, Store, StoreError, code_of,
    fresh_deliveries, from_value, logical_queue, unexpected,
};

/// `heartbeat.lua`'s ARGV by name; then, from `ATTEMPTS`, a message id
/// and an attempt number per running attempt.
pub(super) static HEARTBEAT_ARGV: ArgvLayout = ArgvLayout {
    script: "heartbeat",
    prefix: "ARG_",
    first: 1,
    names: &["GROUP", "CONSUMER", "VISIBILITY"],
    rest: Some("ATTEMPTS"),
};

/// `start.lua`'s ARGV by name; then, from `DELIVERIES`, a message id and a
/// task id per delivery.
pub(super) static START_ARGV: ArgvLayout = ArgvLayout {
    script: "start",
    prefix: "ARG_",
    first: 1,
    names: &["GROUP", "NOW", "CONSUMER", "EVENTS_MAX_LEN", "QUEUE_NAME"],
    rest: Some("DELIVERIES"),
};

impl Store {
    /// Create the consumer group of `queue` (and its stream) if missing.
    pub async fn ensure_group(&self, queue: &str) -> Result<(), StoreError> {
        let keys = QueueKeys::new(queue);
        let created: Result<(), _> = self
            .trip(
                "ensure_group",
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&keys.stream)
                    .arg(GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut self.conn.clone()),
            )
            .await;
        match created {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Read up to `count` new messages of `queue` for `consumer`, blocking up
    /// to `block` when there are none. `conn` must be a dedicated connection
    /// (see [`Store::dedicated_connection`]).
    pub async fn read(
        &self,
        conn: &mut Conn,
        queue: &str,
        consumer: &str,
        count: usize,
        block: Duration,
    ) -> Result<Vec<Delivery>, StoreError> {
        let keys = QueueKeys::new(queue);
        let reply: Value = self
            .trip(
                "read",
                redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(GROUP)
                    .arg(consumer)
                    .arg("COUNT")
                    .arg(count)
                    .arg("BLOCK")
                    .arg(block.as_millis() as u64)
                    .arg("STREAMS")
                    .arg(&keys.stream)
                    .arg(">")
                    .query_async(conn),
            )
            .await?;
        fresh_deliveries(queue, reply)
    }

    /// Start a batch of deliveries of `queue`: a carried one (see
    /// `carried.rs`) runs as its message says, from `now`, with no script;
    /// the others in one `start` script call for the batch. With RUNNING
    /// events asked for (`--events all`), the carried ones' are written
    /// meanwhile, as one events entry for the batch (`running_events`),
    /// before any of them runs. Decisions in the order of `deliveries`;
    /// the carried tasks are taken out of them (moved into the decisions,
    /// not copied).
    pub async fn start(
        &self,
        queue: &str,
        consumer: &str,
        deliveries: &mut [Delivery],
        now: u64,
    ) -> Result<Vec<StartDecision>, StoreError> {
        let (carried, scripted): (Vec<&Delivery>, Vec<&Delivery>) =
            deliveries.iter().partition(|d| d.carried.is_some());
        let running: Vec<&str> = if self.settings.running_events {
            carried.iter().map(|d| d.task_id.as_str()).collect()
        } else {
            Vec::new()
        };
        let (started, ()) = tokio::try_join!(
            self.start_script(queue, consumer, &scripted, now),
            self.running_events(queue, &running, now),
        )?;
        let mut started = started.into_iter();
        deliveries
            .iter_mut()
            .map(|d| match d.carried.take() {
                Some(task) => Ok(StartDecision::Run(StartedTask {
                    carried_at: Some(now),
                    ..*task
                })),
                None => started
                    .next()
                    .ok_or_else(|| StoreError::Protocol("start answered too few decisions".into())),
            })
            .collect()
    }

    /// The RUNNING events of the carried first attempts of `tasks` of
    /// `queue`, begun at `now`: one round trip, an events entry per
    /// [`EVENTS_PER_ENTRY`] of them, a pair per event, as `start.lua`
    /// writes its batch's (`flushEvents`, `lua/include/idem.lua`). None
    /// with events off.
    async fn running_events(
        &self,
        queue: &str,
        tasks: &[&str],
        now: u64,
    ) -> Result<(), StoreError> {
        let max_len = self.settings.events_max_len;
        if tasks.is_empty() || max_len == 0 {
            return Ok(());
        }
        let events = QueueKeys::new(queue).events;
        let event = format!("RUNNING 1 {now}");
        let mut pipe = redis::pipe();
        for entry in tasks.chunks(EVENTS_PER_ENTRY) {
            let add = pipe
                .cmd("XADD")
                .arg(&events)
                .arg("MAXLEN")
                .arg("~")
                .arg(max_len)
                .arg("*");
            for id in entry {
                add.arg(*id).arg(&event);
            }
            add.ignore();
        }
        self.trip("running_events", pipe.query_async(&mut self.conn.clone()))
            .await
            .map_err(StoreError::from)
    }

    /// The `start` script for `deliveries` (one round trip for the batch).
    async fn start_script(
        &self,
        queue: &str,
        consumer: &str,
        deliveries: &[&Delivery],
        now: u64,
    ) -> Result<Vec<StartDecision>, StoreError> {
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.start.prepare_invoke();
        inv.key(&keys.stream)
            .key(&keys.events)
            .key(&keys.expiry)
            .key(&keys.dlq);
        for d in deliveries {
            inv.key(keys.task(&d.task_id));
        }
        Argv::new(&mut inv, &START_ARGV)
            .put("GROUP", GROUP)
            .put("NOW", now)
            .put("CONSUMER", consumer)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .put("QUEUE_NAME", logical_queue(queue))
            .done();
        for d in deliveries {
            inv.arg(&d.msg_id).arg(&d.task_id);
        }
        let reply: Vec<Value> = self
            .trip("start", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        let mut reply = reply.into_iter();
        let decisions = deliveries
            .iter()
            .map(|delivery| {
                let code = code_of(reply.next())?;
                match code {
                    Code::Skipped => return Ok(StartDecision::Skip(from_value(reply.next())?)),
                    Code::Corrupt => return Ok(StartDecision::Corrupt(from_value(reply.next())?)),
                    _ => {}
                }
                let task = StartedTask::from_reply(queue, &delivery.task_id, &mut reply)?;
                Ok(match code {
                    Code::Ok => StartDecision::Run(task),
                    Code::Expired => StartDecision::Expired(task),
                    Code::Exhausted => StartDecision::Exhausted(task),
                    other => return Err(unexpected("start", other)),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if reply.next().is_some() {
            return Err(StoreError::Protocol(format!(
                "start answered more than {} decisions",
                deliveries.len()
            )));
        }
        Ok(decisions)
    }

    /// Beat for `consumer` on `queue` (it is alive for `visibility` from
    /// now, by Redis's clock) and keep the messages of its running attempts,
    /// each a delivery and the attempt number `start` gave it. Returns one
    /// code per attempt, in order: [`Code::Ok`] (still this attempt's),
    /// [`Code::CancelRequested`] (and asked to cancel) or [`Code::Stale`]
    /// (the task was reclaimed elsewhere). See `lua/heartbeat.lua`.
    pub async fn heartbeat(
        &self,
        queue: &str,
        consumer: &str,
        visibility: Duration,
        running: &[(Delivery, u32)],
    ) -> Result<Vec<Code>, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.heartbeat.prepare_invoke();
        inv.key(&keys.stream).key(&keys.workers).key(&keys.clock);
        for (d, _) in running {
            inv.key(keys.task(&d.task_id));
        }
        Argv::new(&mut inv, &HEARTBEAT_ARGV)
            .put("GROUP", GROUP)
            .put("CONSUMER", consumer)
            .put("VISIBILITY", visibility.as_millis() as u64)
            .done();
        for (d, attempt) in running {
            inv.arg(&d.msg_id).arg(attempt);
        }
        let reply: Vec<i64> = self
            .trip("heartbeat", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        if reply.len() != running.len() {
            return Err(StoreError::Protocol(format!(
                "heartbeat answered {} codes for {} attempts",
                reply.len(),
                running.len()
            )));
        }
        reply
            .into_iter()
            .map(|n| match Code::from_i64(n) {
                Some(code @ (Code::Ok | Code::CancelRequested | Code::Stale)) => Ok(code),
                Some(other) => Err(unexpected("heartbeat", other)),
                None => Err(StoreError::Protocol(format!("unknown script code {n}"))),
            })
            .collect()
    }
}
