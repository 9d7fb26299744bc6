//! The fetch loop: one per worker, for all its queues.
//!
//! Each round takes the free execution slots, shares them among the
//! queues by their weights (`--queues high:6,default:3,low:1`; 1 each
//! unless given), then reads each queue, without blocking, for its share.
//! The shares are dealt slot by slot by smooth weighted round-robin, whose
//! credits carry over from round to round: with every queue busy, the
//! slots go to the queues in proportion to their weights, even one slot a
//! round. A queue that had fewer messages than its share gives the rest
//! away: the slots left are dealt again among the queues that filled
//! theirs (and those not read yet), until the slots run out or every queue
//! came up short. Ties go to a different queue each round, so busy queues
//! of equal weight share the slots evenly. With `--strict-priority` every
//! slot goes to the first queue in `--queues` order that has messages.
//! Only when a whole round found nothing does the loop wait, on all the
//! queues at once, for a new message (`wait.rs`).
//!
//! A paused queue (`flow.rs`) is left out of the rounds and the wait
//! altogether; when the paused set changes, its pending messages are read
//! back, as after a raise of a partition count.
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
//! The wait is one blocking group read, `XREADGROUP … COUNT n BLOCK …
//! STREAMS q1 q2 … > > …`, holding the free slots, where `n` is the free
//! slots divided by the number of streams: it cannot deliver more than the
//! worker can run. Any message of any queue ends it, and it returns with
//! that message, dispatched at once: an idle worker wakes in one round
//! trip, and the payload crosses the wire once. It holds the slots only
//! while every queue is empty, so a busy queue is never held up by idle
//! ones: the round after the wait reads it with every free slot.
//!
//! When there are more streams than free slots, a `COUNT` of at least one
//! per stream could deliver more than the free slots: the wait is then a
//! plain `XREAD` (no group, so it delivers nothing, and it holds no slot)
//! from each group's last delivered id (`XINFO GROUPS`), which returns as
//! soon as any queue has a message the group has not been given, and the
//! next round reads it.
//!
//! On a Redis Cluster the streams of one call must share a slot, and each
//! queue (each partition) has a slot of its own. With one stream, the wait
//! is the group read; with several, it is the plain `XREAD` on each, each on
//! a connection of its own (a blocked command holds its connection), and
//! the first to return ends the wait. Not one blocking `XREADGROUP` per
//! stream: when the first returns, the others are still blocked on their
//! servers. Waiting for them would hold up the next round, and so a burst
//! on the first queue, for up to a block time; dropping them would not stop
//! the server, which could still deliver a message into a reply that is
//! never read.
//!
//! That is also why a stop does not drop the group read: it waits for it
//! to return (within the block time), and what it delivered runs in the
//! grace period beside the tasks already running, rather than pending on
//! a stopped worker until another reclaims it a visibility timeout later.
//!
//! A queue with limits (`flow.rs`) is read by a script that admits what
//! it reads in the same round trip ([`crate::store::Store::read_admitted`]):
//! a read then an `admit` kept each batch's slots idle for a second round
//! trip before it started: a drain under a limit that does not bind ran at
//! 0.77 of a free one's rate that way, 0.99 this way (`docs/queue-bench.md`,
//! "Limits that do not bind"). The wait's
//! blocking read cannot be a script; what it delivers is admitted on its
//! own, as are messages reclaimed or read back.
//!
//! Reading back: a read whose reply is lost on a broken connection may
//! still have delivered messages, which are then pending on this worker
//! though it never received them; so may a `start` or a reclaim whose reply
//! is lost. After such a failure ([`Shared::read_back`], or a read here
//! that failed, the wait's group read included) the next round first reads
//! this worker's own pending messages of each queue (`XREADGROUP` from id
//! 0, page by page) and dispatches those it does not hold; `start` resumes
//! the attempt of one it had already started (`start.lua`). So a delivery
//! lost in transit runs at once, as the attempt it was, instead of waiting
//! a visibility timeout for this worker's own reclaim.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Value;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::flow::Flow;
use super::shared::Admit;
use super::{Backoff, MAX_BATCH, READ_BLOCK, Shared, supervise, wait};
use crate::store::{
    Conn, Delivery, GROUP, PAUSE_POLL, ReadAdmitted, StoreError, fresh_deliveries, logical_queue,
    own_pending,
};

/// Pending messages read back per `XREADGROUP`.
const READ_BACK_PAGE: usize = 64;

/// Read new messages of every queue of the worker while slots are free,
/// until `stop`. Each batch is started and dispatched on a task of its own:
/// the next read does not wait for the last batch's `start` script.
pub(super) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let mut keys = Keys::new(&shared);
    let mut conn = None;
    let mut backoff = Backoff::default();
    while let Some(mut permits) = shared.take_slots(MAX_BATCH, &stop).await {
        keys.refresh(&shared);
        if keys.queues.iter().any(|q| supervise::injected("fetch", q)) {
            return;
        }
        if keys.queues.is_empty() {
            // Every queue is paused.
            drop(permits);
            tokio::select! {
                () = tokio::time::sleep(PAUSE_POLL) => continue,
                () = stop.cancelled() => return,
            }
        }
        let conn = match connected(&shared, &mut conn).await {
            Ok(conn) => conn,
            Err(e) => {
                warn!(error = %e, "cannot connect for reading; retrying");
                drop(permits);
                backoff.wait(&stop).await;
                continue;
            }
        };
        let Round {
            found,
            failed,
            dropped,
        } = round(&shared, conn, &mut keys, &mut permits).await;
        if failed && !found {
            drop(permits);
            backoff.wait_after(dropped, &stop).await;
            continue;
        }
        backoff.reset();
        if found {
            continue;
        }
        // Nothing anywhere: wait for something new.
        let waited = if wait::can_read_waiting(&keys.waits, permits.len()) {
            let waited =
                wait::read_waiting(&shared, conn, &keys.queues, &keys.streams, permits).await;
            // It may have delivered with its reply lost.
            if waited.is_err() {
                keys.unread.fill(true);
            }
            waited
        } else {
            drop(permits);
            tokio::select! {
                waited = wait::any(&shared, conn, &mut keys.wait_conns, &keys.waits) => waited,
                () = stop.cancelled() => return,
            }
        };
        if let Err(e) = waited {
            if matches!(server_code(&e), Some("NOGROUP" | "ERR")) {
                // A group, or its stream (`XINFO GROUPS` answers `ERR no
                // such key`), is gone: made again, and idempotent if not.
                for queue in keys.queues.iter() {
                    let _ = shared.store.ensure_group(queue).await;
                }
            }
            warn!(error = %e, "waiting for new messages failed; retrying");
            backoff.wait(&stop).await;
        }
    }
}

/// The key sets the fetch loop reads, and what it keeps of each between
/// rounds.
struct Keys {
    /// Every partition of every queue of the worker ([`Shared::queues`]),
    /// as last read.
    all: Arc<Vec<String>>,
    /// The queues' flow control ([`Shared::flow`]), as last read.
    flow: Arc<Flow>,
    /// The partitions of `all` whose queue is not paused: those read.
    queues: Vec<String>,
    /// The stream of each of `queues`.
    streams: Vec<String>,
    /// How the wait groups `streams`, one call each ([`wait::groups`]).
    waits: Vec<Vec<String>>,
    /// A connection for each of `waits` when there are several (a
    /// cluster); opened when first needed.
    wait_conns: Vec<Option<Conn>>,
    /// Queues whose own pending messages are to be read back.
    unread: Vec<bool>,
    /// The weight of each of `queues`: its queue's, shared evenly by the
    /// queue's partitions.
    weights: Vec<f64>,
    /// The smooth weighted round-robin's credit of each of `queues`.
    credit: Vec<f64>,
    /// Every slot to the first queue with messages (`--strict-priority`).
    strict: bool,
    /// The queue ties go to first in the next round.
    first: usize,
}

impl Keys {
    fn new(shared: &Shared) -> Keys {
        let all = shared.queues();
        let flow = shared.flow.borrow().clone();
        let queues: Vec<String> = all
            .iter()
            .filter(|q| !flow.paused.contains(logical_queue(q)))
            .cloned()
            .collect();
        let weights = queues
            .iter()
            .map(|q| {
                let queue = logical_queue(q);
                let parts = queues.iter().filter(|p| logical_queue(p) == queue).count();
                f64::from(shared.config.weight_of(queue)) / parts as f64
            })
            .collect();
        let (streams, waits) = wait::groups(shared, &queues);
        Keys {
            wait_conns: vec![None; waits.len()],
            unread: vec![false; queues.len()],
            credit: vec![0.0; queues.len()],
            weights,
            strict: shared.config.strict_priority,
            first: 0,
            all,
            flow,
            queues,
            streams,
            waits,
        }
    }

    /// Follow a raise of a partition count (key sets added, whose pending
    /// messages are read back), a pause or resume (the same: a resumed
    /// queue's messages delivered before its pause are read back), and a
    /// request to read back.
    fn refresh(&mut self, shared: &Shared) {
        let changed = !Arc::ptr_eq(&shared.queues(), &self.all)
            || !Arc::ptr_eq(&shared.flow.borrow(), &self.flow);
        if changed {
            let first = self.first;
            *self = Keys::new(shared);
            self.unread.fill(true);
            self.first = first % self.queues.len().max(1);
        }
        if shared.read_back.swap(false, Ordering::AcqRel) {
            self.unread.fill(true);
        }
    }

    /// Deal `free` slots among the queues not `short` (found with fewer
    /// messages than asked this round): each queue with a share, and its
    /// share, in reading order. See the module documentation.
    fn share(&mut self, free: usize, short: &[bool]) -> Vec<(usize, usize)> {
        let count = self.queues.len();
        if self.strict {
            return (0..count)
                .find(|&at| !short[at])
                .map(|at| vec![(at, free)])
                .unwrap_or_default();
        }
        let candidates: Vec<usize> = (0..count)
            .map(|i| (self.first + i) % count)
            .filter(|&at| !short[at])
            .collect();
        let Some(&head) = candidates.first() else {
            return Vec::new();
        };
        let total: f64 = candidates.iter().map(|&at| self.weights[at]).sum();
        let mut shares = vec![0; count];
        for _ in 0..free {
            let mut best = head;
            for &at in &candidates {
                self.credit[at] += self.weights[at];
                if self.credit[at] > self.credit[best] {
                    best = at;
                }
            }
            self.credit[best] -= total;
            shares[best] += 1;
        }
        candidates
            .into_iter()
            .filter(|&at| shares[at] > 0)
            .map(|at| (at, shares[at]))
            .collect()
    }
}

/// The fetch loop's connection, opened when missing.
async fn connected<'c>(
    shared: &Shared,
    conn: &'c mut Option<Conn>,
) -> Result<&'c mut Conn, StoreError> {
    Ok(match conn {
        Some(conn) => conn,
        None => conn.insert(
            shared
                .store
                .dedicated_connection(READ_BLOCK + Duration::from_secs(5))
                .await?,
        ),
    })
}

/// What a round found: whether it dispatched anything, and whether a read
/// failed.
struct Round {
    found: bool,
    failed: bool,
    /// A read failed on a connection found broken (see
    /// [`StoreError::is_connection_dropped`]).
    dropped: bool,
}

/// One round: the free slots dealt among the queues ([`Keys::share`]),
/// each queue read for its share (reading back first where
/// [`Keys::unread`] says so), and what is left dealt again among the
/// queues that filled theirs.
async fn round(
    shared: &Arc<Shared>,
    conn: &mut Conn,
    keys: &mut Keys,
    permits: &mut Vec<OwnedSemaphorePermit>,
) -> Round {
    let mut round = Round {
        found: false,
        failed: false,
        dropped: false,
    };
    let mut short = vec![false; keys.queues.len()];
    while !permits.is_empty() {
        let shares = keys.share(permits.len(), &short);
        if shares.is_empty() {
            break;
        }
        for (at, share) in shares {
            if permits.is_empty() {
                break;
            }
            let asked = share.min(permits.len());
            let filled = read_queue(shared, conn, keys, at, asked, permits, &mut round).await;
            short[at] |= !filled;
        }
    }
    keys.first = (keys.first + 1) % keys.queues.len().max(1);
    round
}

/// Read the queue `at` of `keys` for up to `asked` messages (after reading
/// back its pending ones if due) and dispatch them, one of `permits` each.
/// Whether it gave all that was asked, so may have more.
async fn read_queue(
    shared: &Arc<Shared>,
    conn: &mut Conn,
    keys: &mut Keys,
    at: usize,
    asked: usize,
    permits: &mut Vec<OwnedSemaphorePermit>,
    round: &mut Round,
) -> bool {
    let (queue, stream) = (&keys.queues[at], &keys.streams[at]);
    if keys.unread[at] {
        match read_back(shared, conn, queue, stream, permits).await {
            Ok((done, dispatched)) => {
                keys.unread[at] = !done;
                round.found |= dispatched;
            }
            Err(e) => {
                round.failed = true;
                round.dropped |= e.is_connection_dropped();
                // After a Redis restart (the group gone with its pending
                // messages), made again: nothing to read back.
                if server_code(&e) == Some("NOGROUP") {
                    let _ = shared.store.ensure_group(queue).await;
                }
                warn!(queue, error = %e, "reading back pending messages failed; retrying");
                return false;
            }
        }
        if permits.is_empty() {
            return true;
        }
    }
    let asked = asked.min(permits.len());
    match read_now(shared, conn, queue, stream, asked).await {
        Ok((ReadAdmitted { read, deliveries }, admit)) => {
            let filled = read >= asked;
            round.found |= read > 0;
            if !deliveries.is_empty() {
                let batch = permits.split_off(permits.len() - deliveries.len());
                let holds = shared.running.hold(&queue.as_str().into(), &deliveries);
                spawn_dispatch(shared, queue, deliveries, admit, holds, batch);
            }
            filled
        }
        Err(e) => {
            round.failed = true;
            round.dropped |= e.is_connection_dropped();
            // It may have delivered with its reply lost.
            keys.unread[at] = true;
            if server_code(&e) == Some("NOGROUP") {
                let _ = shared.store.ensure_group(queue).await;
            }
            warn!(queue, error = %e, "read failed; retrying");
            false
        }
    }
}

/// The code of the error Redis answered, if `e` is one (`NOGROUP`, say).
fn server_code(e: &StoreError) -> Option<&str> {
    match e {
        StoreError::Redis(e) => e.code(),
        _ => None,
    }
}

/// Start and dispatch `deliveries` of `queue`, held already (before the
/// next read, so that reading back never takes them a second time), on a
/// task of their own; admitted first if `admit` says it is due.
pub(super) fn spawn_dispatch(
    shared: &Arc<Shared>,
    queue: &str,
    deliveries: Vec<Delivery>,
    admit: Admit,
    holds: Vec<super::Registration>,
    permits: Vec<OwnedSemaphorePermit>,
) {
    let shared2 = shared.clone();
    let queue = queue.to_owned();
    shared.tracker.spawn(async move {
        shared2
            .dispatch_held(&queue, deliveries, admit, holds, permits)
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
            spawn_dispatch(shared, queue, deliveries, Admit::Due, holds, batch);
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

/// Read up to `count` new messages of `queue`'s `stream` for this worker,
/// without blocking: how many were read, those to start, and whether they
/// are admitted yet. A queue with limits is read by
/// [`crate::store::Store::read_admitted`], which admits what it reads in
/// the same round trip. Not to be cancelled: the messages a read delivers
/// are pending on this consumer, and until reclaimed nobody else runs them.
async fn read_now(
    shared: &Shared,
    conn: &mut Conn,
    queue: &str,
    stream: &str,
    count: usize,
) -> Result<(ReadAdmitted, Admit), StoreError> {
    if let Some((limits, partitions)) = shared.limits_of(queue) {
        let grace = shared.config.visibility_timeout();
        let read = shared
            .feed
            .read_admitted(
                conn,
                queue,
                &shared.consumer,
                count,
                &limits,
                partitions,
                grace,
                crate::base::now_ms(),
            )
            .await?;
        return Ok((read, Admit::Done));
    }
    let reply: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg(&shared.consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(conn)
        .await?;
    let deliveries = fresh_deliveries(queue, reply)?;
    let read = ReadAdmitted {
        read: deliveries.len(),
        deliveries,
    };
    Ok((read, Admit::Due))
}
