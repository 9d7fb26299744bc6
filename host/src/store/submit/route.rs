//! Routing a submission to its partition of the queue (see
//! `partitions.rs` for the layout and the raise of the count): by its
//! key's hash, round-robin without a key, to where a raise or a forward
//! left its key's records; and routing again when `ingest.lua` finds that
//! the count it was routed by is no longer the count.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::store::keys::{partition_queue, partitioned_id};
use crate::store::{Conn, NewTask, Partitioning, QueueKeys, Store, StoreError, lock};

/// How many times a submission is routed again after `ingest.lua` found
/// another partition count than it was routed by, pausing
/// [`REROUTE_PAUSE`] when the count read back has not changed (a raise is
/// still writing the partitions).
const REROUTES: u32 = 100;
const REROUTE_PAUSE: Duration = Duration::from_millis(20);

/// Tries after which a raise that has not reached partition 0 counts as
/// stopped half-way (about 100 ms of pauses, well within the API's Redis
/// deadline), and a submitter finishes it. Finishing a raise that was in
/// fact still running is harmless: both set each slot to the same count.
const FINISH_AFTER: u32 = 5;

impl Store {
    /// The partitioning this process last read for `queue`; read when it
    /// has none. Submissions route by it: `ingest.lua` tells when it is
    /// out of date.
    ///
    /// A process's first burst of submissions to a queue finds none known
    /// all at once: the first reads it and the others wait for that read
    /// behind the queue's gate, so that a burst costs one read, not one per
    /// submission in flight. A read that fails leaves the next waiter to
    /// read for itself.
    pub(super) async fn known_partitioning(&self, queue: &str) -> Result<Partitioning, StoreError> {
        let known = || lock(&self.partitionings).get(queue).cloned();
        if let Some(part) = known() {
            return Ok(part);
        }
        let gate =
            crate::store::bounded(&self.partition_reads, self.settings.max_queues, |reads| {
                Arc::clone(reads.entry(queue.to_owned()).or_default())
            });
        let _reading = gate.lock().await;
        if let Some(part) = known() {
            return Ok(part);
        }
        let read = self.partitioning(queue).await;
        // The gate is done with once the partitioning is known (or the read
        // failed); a waiter still holding it finds the answer behind it.
        let mut reads = lock(&self.partition_reads);
        if reads
            .get(queue)
            .is_some_and(|open| Arc::ptr_eq(open, &gate))
        {
            reads.remove(queue);
        }
        read
    }

    /// Route `new` by `part`: choose its partition and give it the id that
    /// says so. A keyed task goes where its key's record already is, else
    /// to `preferred` while `part` still places its key there (the
    /// partition a handler's submission was given when it was staged),
    /// else to its key's partition (see [`place_of_key`]); an unkeyed one
    /// goes round-robin. A submission `pinned` to a partition (a forward
    /// sent it there, see `dlq.rs`) goes there.
    pub(super) async fn route(
        &self,
        new: &mut NewTask,
        part: &Partitioning,
        pinned: Option<u32>,
        preferred: Option<u32>,
    ) -> Result<(), StoreError> {
        let partition = match (pinned, new.idempotency_key.as_deref()) {
            (Some(partition), _) => partition,
            (None, None) => {
                (self.spread.fetch_add(1, Ordering::Relaxed) % u64::from(part.count)) as u32
            }
            (None, Some(key)) => {
                let place = place_of_key(&self.conn, &new.queue, part, key, new.now, preferred);
                // No lookup is made unless a raise replaced a count.
                if part.replaced.is_empty() {
                    place.await?
                } else {
                    self.trip("route_lookup", place).await?
                }
            }
        };
        let uuid = new.id.split('.').next().unwrap_or_default().to_owned();
        new.id = partitioned_id(&uuid, partition);
        Ok(())
    }

    /// The partitioning of `queue` read again after `ingest.lua` refused a
    /// submission routed by `stale` (try `round`, from 0), the slot it ran
    /// in holding a count of `found`. When it reads back unchanged, a raise
    /// is still writing the partitions: pause first. When it still reads
    /// back unchanged after [`FINISH_AFTER`] tries, the raise stopped
    /// half-way (its process died): finish it, which any process may do,
    /// since a raise only ever sets each slot to the larger count.
    pub(super) async fn reread_partitioning(
        &self,
        queue: &str,
        stale: &Partitioning,
        found: u32,
        round: u32,
    ) -> Result<Partitioning, StoreError> {
        if round >= REROUTES {
            return Err(StoreError::Protocol(format!(
                "the partition count of queue {queue} kept changing over {REROUTES} tries"
            )));
        }
        let fresh = self.partitioning(queue).await?;
        if fresh != *stale {
            return Ok(fresh);
        }
        if round >= FINISH_AFTER && found > stale.count {
            tracing::warn!(
                queue,
                from = stale.count,
                to = found,
                "finishing a raise of the partition count that stopped half-way"
            );
            self.raise_partitions(queue, found, crate::base::now_ms())
                .await?;
            return self.partitioning(queue).await;
        }
        tokio::time::sleep(REROUTE_PAUSE).await;
        self.partitioning(queue).await
    }
}

/// The partition a submission with idempotency key `key` goes to in
/// `queue` by `part` at `now`: where the key's record already is, when a
/// replaced count put it in another of the key's places; else `preferred`,
/// when it is one of those places; else the key's partition by the count
/// now. One `EXISTS` per place looked at: none while no replaced count is
/// recorded. The sandbox gives a handler's submission its id by this when
/// it is staged (`sandbox/tasks.rs`), and the submission is routed by it
/// again, `preferred` there, when it is applied.
pub async fn place_of_key(
    conn: &Conn,
    queue: &str,
    part: &Partitioning,
    key: &str,
    now: u64,
    preferred: Option<u32>,
) -> Result<u32, StoreError> {
    let places = part.places_of_key(key, now);
    let chosen = preferred
        .filter(|p| places.contains(p))
        .unwrap_or(places[0]);
    for &other in places.iter().filter(|&&p| p != chosen) {
        let keys = QueueKeys::new(&partition_queue(queue, other));
        let exists: bool = redis::cmd("EXISTS")
            .arg(keys.idempotency(Some(key)))
            .query_async(&mut conn.clone())
            .await?;
        if exists {
            return Ok(other);
        }
    }
    Ok(chosen)
}
