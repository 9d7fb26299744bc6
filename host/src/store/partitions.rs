//! Partitioned queues: one queue as several key sets, each in a slot of its
//! own, so that one busy queue spreads over the shards of a cluster.
//!
//! Partition 0 is the queue's own key set (`{q}`), partition `i` the set of
//! `q#i` (see `keys.rs`); a queue nobody partitioned has one partition and
//! is what it always was. The count lives in every partition's slot
//! (`dtq:partitions:{q#i}`, absent meaning 1).
//!
//! **Routing** (`submit/route.rs`). A submission with an idempotency key goes to the partition
//! of the key's hash ([`key_hash`] modulo the count), so the one-script
//! check-and-claim of the seed stays in one slot; one without a key goes
//! round-robin. The task id ends in `.i` for partition `i > 0`, so every
//! later call on the task (status, cancel, requeue) finds its slot from
//! the id alone. `ingest.lua` refuses a submission routed by another count
//! than its slot holds ([`Code::Repartitioned`](super::Code)); the
//! submitter reads the count again and routes again. A handler's
//! submission is routed when the sandbox stages it, so that the id the
//! handler is given names the partition; it is applied there, the
//! partition preferred over a count raised meanwhile while the key's
//! places still include it ([`place_of_key`](super::place_of_key)).
//!
//! **Raising the count** ([`Store::raise_partitions`]) writes the new count
//! into every partition's slot, partition 0's last, and records the
//! replaced count in partition 0 until the idempotency TTL has passed.
//! Submitters read the count from partition 0, so one that routes by the
//! new count finds it in every slot, and none can still write by the old
//! one. A raise whose process died half-way leaves slots that refuse
//! submissions routed by the old count while partition 0 still holds it; a
//! submitter refused that way for a while finishes the raise itself (each
//! write only ever sets a slot to the larger count, so any process may). A key whose partition changed keeps its record where it was: while
//! a replaced count is recorded, a keyed submission first looks for the
//! key's record in the partition each replaced count gives it, and if one
//! is there, submits there. So one key stays one task across a raise. The
//! count is never lowered: a lower count would strand the tasks and records
//! of the partitions it drops.

use super::scripts::{Argv, ArgvLayout};
use super::{Conn, QueueKeys, Store, StoreError};
use crate::store::keys::{logical_queue, partition_queue};

/// `partitions_raise.lua`'s ARGV by name.
pub(super) static PARTITIONS_RAISE_ARGV: ArgvLayout = ArgvLayout {
    script: "partitions_raise",
    prefix: "ARG_",
    first: 1,
    names: &["COUNT", "KEEPS_HISTORY", "LIVE_UNTIL", "NOW"],
    rest: None,
};

/// The most partitions a queue may have.
pub const MAX_PARTITIONS: u32 = 256;

/// A queue's partition count, and the counts it replaced whose keyed
/// records may still live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// Partitions now.
    pub count: u32,
    /// Counts replaced by raises, newest first, each with until when (ms
    /// since epoch) records of keys routed by it may still live.
    pub replaced: Vec<(u32, u64)>,
}

impl Default for Partitioning {
    fn default() -> Self {
        Partitioning {
            count: 1,
            replaced: Vec::new(),
        }
    }
}

impl Partitioning {
    /// The key-set name of every partition of `queue`, partition 0 first.
    pub fn names(&self, queue: &str) -> Vec<String> {
        (0..self.count).map(|i| partition_queue(queue, i)).collect()
    }

    /// The partition the count gives idempotency key `key`.
    pub fn of_key(&self, key: &str) -> u32 {
        (key_hash(key) % u64::from(self.count)) as u32
    }

    /// Where the record of `key` may be at `now`: its partition, then
    /// each other partition a replaced count still recorded gave it, newest
    /// count first, without repeats.
    pub fn places_of_key(&self, key: &str, now: u64) -> Vec<u32> {
        let mut places = vec![self.of_key(key)];
        for &(count, until) in &self.replaced {
            let old = (key_hash(key) % u64::from(count.max(1))) as u32;
            if until >= now && !places.contains(&old) {
                places.push(old);
            }
        }
        places
    }
}

/// The hash that places an idempotency key (64-bit FNV-1a: stable across
/// processes, versions and platforms, which the routing needs).
pub fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The partitioning of `queue` as Redis holds it now (partition 0's slot,
/// one round trip).
pub async fn read_partitioning(conn: &Conn, queue: &str) -> Result<Partitioning, StoreError> {
    let keys = QueueKeys::new(queue);
    let mut pipe = redis::pipe();
    pipe.get(&keys.partitions)
        .cmd("ZRANGE")
        .arg(&keys.partition_history)
        .arg("+inf")
        .arg(crate::base::now_ms())
        .arg("BYSCORE")
        .arg("REV")
        .arg("WITHSCORES");
    let (count, replaced): (Option<u32>, Vec<(u32, f64)>) =
        pipe.query_async(&mut conn.clone()).await?;
    Ok(Partitioning {
        count: count.unwrap_or(1).max(1),
        replaced: replaced
            .into_iter()
            .map(|(count, until)| (count, until as u64))
            .collect(),
    })
}

impl Store {
    /// The partitioning of `queue`, read from Redis (partition 0's slot,
    /// one round trip), and remembered for this process's submissions.
    pub async fn partitioning(&self, queue: &str) -> Result<Partitioning, StoreError> {
        let part = self
            .trip("partitions", read_partitioning(&self.conn, queue))
            .await?;
        super::bounded(&self.partitionings, self.settings.max_queues, |known| {
            known.insert(queue.to_owned(), part.clone())
        });
        Ok(part)
    }

    /// The key-set name of every partition of `queue` (read from Redis);
    /// a partition's own name (`q#i`) stands for itself alone.
    pub async fn partition_names(&self, queue: &str) -> Result<Vec<String>, StoreError> {
        if logical_queue(queue) != queue {
            return Ok(vec![queue.to_owned()]);
        }
        Ok(self.partitioning(queue).await?.names(queue))
    }

    /// Raise the partition count of `queue` to `count` (at most
    /// [`MAX_PARTITIONS`]); a count at or below the present one changes
    /// nothing. Returns the count in force after the call. See the module
    /// documentation for the order of the writes.
    pub async fn raise_partitions(
        &self,
        queue: &str,
        count: u32,
        now: u64,
    ) -> Result<u32, StoreError> {
        let count = count.min(MAX_PARTITIONS);
        let until = now.saturating_add(self.settings.idem_ttl_s.saturating_mul(1_000));
        let mut in_force = 1;
        for i in (0..count).rev() {
            let keys = QueueKeys::new(&partition_queue(queue, i));
            let mut inv = self.scripts.partitions_raise.prepare_invoke();
            inv.key(&keys.partitions).key(&keys.partition_history);
            Argv::new(&mut inv, &PARTITIONS_RAISE_ARGV)
                .put("COUNT", count)
                .put("KEEPS_HISTORY", if i == 0 { "1" } else { "0" })
                .put("LIVE_UNTIL", until)
                .put("NOW", now)
                .done();
            in_force = self
                .trip("raise_partitions", inv.invoke_async(&mut self.conn.clone()))
                .await?;
        }
        self.partitioning(queue).await?;
        Ok(in_force)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_spread_evenly_and_stably() {
        let part = Partitioning {
            count: 4,
            replaced: Vec::new(),
        };
        let mut counts = [0u32; 4];
        for i in 0..10_000 {
            counts[part.of_key(&format!("order-{i}")) as usize] += 1;
        }
        for c in counts {
            assert!((2_300..=2_700).contains(&c), "uneven spread: {counts:?}");
        }
        // The hash is part of the stored layout: it may never change.
        assert_eq!(key_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn a_key_is_looked_for_where_each_live_count_put_it() {
        let key = (0..)
            .map(|i| format!("k{i}"))
            .find(|k| key_hash(k) % 4 == 3)
            .expect("a key of partition 3 of 4, so 1 of 2 and 0 of 1");
        let part = Partitioning {
            count: 4,
            replaced: vec![(2, 1_000), (1, 500)],
        };
        let home = (key_hash(&key) % 4) as u32;
        let under_two = (key_hash(&key) % 2) as u32;
        assert_eq!(part.places_of_key(&key, 100), [home, under_two, 0]);
        // A count whose records have all expired is not looked at.
        assert_eq!(part.places_of_key(&key, 600), [home, under_two]);
        assert_eq!(part.places_of_key(&key, 2_000), [home]);
    }

    #[test]
    fn names_start_with_the_queue_itself() {
        let part = Partitioning {
            count: 3,
            replaced: Vec::new(),
        };
        assert_eq!(part.names("q"), ["q", "q#1", "q#2"]);
        assert_eq!(Partitioning::default().names("q"), ["q"]);
    }
}
