//! The fetch loop: one per worker, for all its queues.
//!
//! Each round takes the free execution slots, then reads the queues one
//! after another, without blocking, each for as many messages as slots are
//! still free, starting with a different queue each round so that busy
//! queues share the slots evenly. Only when a whole round found nothing does
//! the loop wait, on all the queues at once, for a new message, and it waits
//! holding no slot.
//!
//! Why not one `XREADGROUP … STREAMS q1 q2 … > > …` for the whole round:
//! its `COUNT` applies to each stream, so it can deliver up to `COUNT` times
//! the number of queues, more messages than there are free slots, and a
//! worker never holds more messages than it can run. Why not one blocking
//! read per queue (what this replaced): each held the free slots through its
//! whole block, so a worker consuming several idle queues and one busy one
//! ran the busy one a few tasks per block time (200 tasks with
//! `--concurrency 4` took 50 s instead of 0.2 s with four idle queues).
//!
//! Reading back: a read whose reply is lost on a broken connection may
//! still have delivered messages, which are then pending on this worker
//! though it never received them; so may a `start` or a reclaim whose reply
//! is lost. After such a failure ([`Shared::read_back`], or a read here
//! that failed) the next round first reads this worker's own pending
//! messages of each queue (`XREADGROUP` from id 0, page by page) and
//! dispatches those it does not hold; `start` resumes the attempt of one it
//! had already started (`start.lua`). So a delivery lost in transit runs at
//! once, as the attempt it was, instead of waiting a visibility timeout for
//! this worker's own reclaim.
//!
//! The wait is a plain `XREAD` (no group, so it delivers nothing: dropping it
//! at shutdown loses nothing) from each group's last delivered id, which
//! returns as soon as any queue has a message the group has not been given,
//! including one added between the last round and the wait. On a Redis
//! Cluster the streams of one call must share a slot, and each queue has a
//! slot of its own: the wait is then one `XREAD` per queue, each on a
//! connection of its own (a blocked command holds its connection), and the
//! first to return ends the wait.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Value;
use redis::streams::StreamInfoGroupsReply;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Backoff, MAX_BATCH, READ_BLOCK, Shared, supervise};
use crate::store::{Conn, Delivery, GROUP, QueueKeys, StoreError, fresh_deliveries, own_pending};

/// Pending messages read back per `XREADGROUP`.
const READ_BACK_PAGE: usize = 64;

/// Read new messages of every queue of the worker while slots are free,
/// until `stop`. Each batch is started and dispatched on a task of its own:
/// the next read does not wait for the last batch's `start` script.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let mut queues = shared.queues();
    let (mut streams, mut waits) = wait_groups(&shared, &queues);
    let mut wait_conns: Vec<Option<Conn>> = vec![None; waits.len()];
    // Queues whose own pending messages are to be read back.
    let mut unread = vec![false; queues.len()];
    let mut conn = None;
    let mut backoff = Backoff::default();
    let mut first = 0;
    while let Some(mut permits) = shared.take_slots(MAX_BATCH, &stop).await {
        // A raise of a partition count adds key sets to read.
        let current = shared.queues();
        if !Arc::ptr_eq(&current, &queues) {
            queues = current;
            (streams, waits) = wait_groups(&shared, &queues);
            wait_conns = vec![None; waits.len()];
            unread = vec![true; queues.len()];
            first %= queues.len();
        }
        if shared.read_back.swap(false, Ordering::AcqRel) {
            unread.fill(true);
        }
        if queues.iter().any(|q| supervise::injected("fetch", q)) {
            return;
        }
        let conn = match &mut conn {
            Some(conn) => conn,
            None => match shared
                .store
                .dedicated_connection(READ_BLOCK + Duration::from_secs(5))
                .await
            {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    warn!(error = %e, "cannot connect for reading; retrying");
                    drop(permits);
                    backoff.wait(&stop).await;
                    continue;
                }
            },
        };
        // One round: each queue once, from a different one each time.
        let mut found = false;
        let mut failed = false;
        for i in 0..queues.len() {
            if permits.is_empty() {
                break;
            }
            let at = (first + i) % queues.len();
            let (queue, stream) = (&queues[at], &streams[at]);
            if unread[at] {
                match read_back(&shared, conn, queue, stream, &mut permits).await {
                    Ok((done, dispatched)) => {
                        unread[at] = !done;
                        found |= dispatched;
                    }
                    Err(e) => {
                        failed = true;
                        warn!(queue, error = %e, "reading back pending messages failed; retrying");
                        continue;
                    }
                }
                if permits.is_empty() {
                    break;
                }
            }
            match read_now(conn, queue, stream, &shared.consumer, permits.len()).await {
                Ok(deliveries) if deliveries.is_empty() => {}
                Ok(deliveries) => {
                    found = true;
                    let batch = permits.split_off(permits.len() - deliveries.len());
                    let holds = shared.running.hold(&queue.as_str().into(), &deliveries);
                    spawn_dispatch(&shared, queue, deliveries, holds, batch);
                }
                Err(e) => {
                    failed = true;
                    // It may have delivered with its reply lost.
                    unread[at] = true;
                    if e.to_string().contains("NOGROUP") {
                        let _ = shared.store.ensure_group(queue).await;
                    }
                    warn!(queue, error = %e, "read failed; retrying");
                }
            }
        }
        first = (first + 1) % queues.len();
        drop(permits);
        if failed && !found {
            backoff.wait(&stop).await;
            continue;
        }
        backoff.reset();
        if found {
            continue;
        }
        // Nothing anywhere: wait, holding no slot, for something new.
        let waited = tokio::select! {
            waited = wait_any(&shared, conn, &mut wait_conns, &waits) => waited,
            () = stop.cancelled() => return,
        };
        if let Err(e) = waited {
            if e.to_string().contains("no such key") {
                for queue in queues.iter() {
                    let _ = shared.store.ensure_group(queue).await;
                }
            }
            warn!(error = %e, "waiting for new messages failed; retrying");
            backoff.wait(&stop).await;
        }
    }
}

/// Start and dispatch `deliveries` of `queue`, held already (before the
/// next read, so that reading back never takes them a second time), on a
/// task of their own.
fn spawn_dispatch(
    shared: &Arc<Shared>,
    queue: &str,
    deliveries: Vec<Delivery>,
    holds: Vec<super::Registration>,
    permits: Vec<OwnedSemaphorePermit>,
) {
    let shared2 = shared.clone();
    let queue = queue.to_owned();
    shared.tracker.spawn(async move {
        shared2
            .dispatch_held(&queue, deliveries, holds, permits)
            .await
    });
}

/// Read back this worker's own pending messages of `queue` (see the module
/// docs) and dispatch those it does not hold, one of `permits` each:
/// whether every pending message was looked at (else the permits ran out
/// first), and whether any was dispatched.
async fn read_back(
    shared: &Arc<Shared>,
    conn: &mut Conn,
    queue: &str,
    stream: &str,
    permits: &mut Vec<OwnedSemaphorePermit>,
) -> Result<(bool, bool), StoreError> {
    let mut from = "0".to_owned();
    let mut dispatched = false;
    loop {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(&shared.consumer)
            .arg("COUNT")
            .arg(READ_BACK_PAGE)
            .arg("STREAMS")
            .arg(stream)
            .arg(&from)
            .query_async(conn)
            .await?;
        let page = own_pending(reply)?;
        let Some(last) = page.last else {
            return Ok((true, dispatched));
        };
        let room = permits.len();
        let (deliveries, holds) = shared
            .running
            .hold_unheld(&queue.into(), page.deliveries, room);
        if !deliveries.is_empty() {
            dispatched = true;
            warn!(
                queue,
                count = deliveries.len(),
                "read back messages delivered here but never received or started"
            );
            let batch = permits.split_off(room - deliveries.len());
            spawn_dispatch(shared, queue, deliveries, holds, batch);
        }
        if permits.is_empty() {
            return Ok((false, dispatched));
        }
        if page.entries < READ_BACK_PAGE {
            return Ok((true, dispatched));
        }
        from = last;
    }
}

/// The stream of each of `queues`, and how the wait groups them: one call
/// for all on a single server; on a cluster, one per stream (each its own
/// slot).
fn wait_groups(shared: &Shared, queues: &[String]) -> (Vec<String>, Vec<Vec<String>>) {
    let streams: Vec<String> = queues.iter().map(|q| QueueKeys::new(q).stream).collect();
    let waits = if shared.store.backend().is_cluster() {
        streams.iter().map(|s| vec![s.clone()]).collect()
    } else {
        vec![streams.clone()]
    };
    (streams, waits)
}

/// Wait on every group of `waits` at once ([`wait_for_messages`]): on
/// `conn` when there is one group (a single server), else each on its own
/// connection of `wait_conns` (opened when missing), until the first
/// returns.
async fn wait_any(
    shared: &Shared,
    conn: &mut Conn,
    wait_conns: &mut [Option<Conn>],
    waits: &[Vec<String>],
) -> Result<(), StoreError> {
    if let [streams] = waits {
        return wait_for_messages(conn, streams, READ_BLOCK).await;
    }
    for slot in wait_conns.iter_mut().filter(|c| c.is_none()) {
        *slot = Some(
            shared
                .store
                .dedicated_connection(READ_BLOCK + Duration::from_secs(5))
                .await?,
        );
    }
    let calls = wait_conns.iter_mut().zip(waits).filter_map(|(c, streams)| {
        Some(Box::pin(wait_for_messages(
            c.as_mut()?,
            streams,
            READ_BLOCK,
        )))
    });
    let (first, _, _) = futures::future::select_all(calls).await;
    first
}

/// Read up to `count` new messages of `queue`'s `stream` for `consumer`,
/// without blocking. Not to be cancelled: the messages a read delivers are
/// pending on this consumer, and until reclaimed nobody else runs them.
async fn read_now(
    conn: &mut Conn,
    queue: &str,
    stream: &str,
    consumer: &str,
    count: usize,
) -> Result<Vec<Delivery>, StoreError> {
    let reply: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(conn)
        .await?;
    fresh_deliveries(queue, reply)
}

/// Wait until one of `streams` has a message its group has not delivered,
/// or `block` has passed; delivers nothing, so it may be dropped at any
/// time. All `streams` are waited on in one call: under Redis Cluster they
/// must share a slot.
pub(super) async fn wait_for_messages(
    conn: &mut Conn,
    streams: &[String],
    block: Duration,
) -> Result<(), StoreError> {
    let mut pipe = redis::pipe();
    for stream in streams {
        pipe.cmd("XINFO").arg("GROUPS").arg(stream);
    }
    let infos: Vec<StreamInfoGroupsReply> = pipe.query_async(conn).await?;
    let mut read = redis::cmd("XREAD");
    read.arg("COUNT")
        .arg(1)
        .arg("BLOCK")
        .arg(block.as_millis().max(1) as u64)
        .arg("STREAMS")
        .arg(streams);
    for info in &infos {
        let last = info
            .groups
            .iter()
            .find(|g| g.name == GROUP)
            .map_or("$", |g| g.last_delivered_id.as_str());
        read.arg(last);
    }
    let _: Value = read.query_async(conn).await?;
    Ok(())
}
