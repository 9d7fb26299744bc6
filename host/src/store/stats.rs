//! A queue's counts, summed over its partitions, and the registry of
//! queue names.

use std::collections::HashMap;

use redis::{FromRedisValue, Value};

use super::{GROUP, QUEUES, QueueKeys, QueueStats, Store, StoreError};

impl Store {
    /// Counts of `queue`: the sums over its partitions.
    pub async fn stats(&self, queue: &str) -> Result<QueueStats, StoreError> {
        let names = self.partition_names(queue).await?;
        let (parts, paused) = futures::future::try_join(
            futures::future::try_join_all(
                names
                    .iter()
                    .map(|name| self.partition_stats(QueueKeys::new(name))),
            ),
            self.paused_since(queue),
        )
        .await?;
        let mut stats = QueueStats {
            queue: queue.to_owned(),
            ready: 0,
            running: 0,
            delayed: 0,
            waiting: 0,
            dead_lettered: 0,
            partitions: names.len() as u32,
            paused: paused.is_some(),
        };
        for part in parts {
            stats.ready += part.ready;
            stats.running += part.running;
            stats.delayed += part.delayed;
            stats.waiting += part.waiting;
            stats.dead_lettered += part.dead_lettered;
        }
        Ok(stats)
    }

    /// Counts of one partition's key set.
    async fn partition_stats(&self, keys: QueueKeys) -> Result<QueueStats, StoreError> {
        // XPENDING fails with NOGROUP until a worker has read the queue, so
        // the group's count comes from XINFO GROUPS, which lists none then.
        let mut pipe = redis::pipe();
        pipe.xlen(&keys.stream)
            .zcard(&keys.delayed)
            .zcard(&keys.dlq)
            .zcard(keys.waiting())
            .exists(&keys.stream);
        let (len, delayed, dead_lettered, waiting, exists): (u64, u64, u64, u64, bool) = self
            .trip("stats", pipe.query_async(&mut self.conn.clone()))
            .await?;
        let mut running = 0;
        if exists {
            let groups: Vec<HashMap<String, Value>> = self
                .trip(
                    "stats_groups",
                    redis::cmd("XINFO")
                        .arg("GROUPS")
                        .arg(&keys.stream)
                        .query_async(&mut self.conn.clone()),
                )
                .await?;
            for group in groups {
                if group
                    .get("name")
                    .and_then(|n| String::from_redis_value_ref(n).ok())
                    .as_deref()
                    == Some(GROUP)
                {
                    running = group
                        .get("pending")
                        .map(u64::from_redis_value_ref)
                        .transpose()?
                        .unwrap_or(0);
                }
            }
        }
        Ok(QueueStats {
            queue: keys.queue().to_owned(),
            ready: len.saturating_sub(running),
            running,
            delayed,
            waiting,
            dead_lettered,
            partitions: 1,
            paused: false,
        })
    }

    /// Every queue that has received a submission, sorted.
    pub async fn queues(&self) -> Result<Vec<String>, StoreError> {
        let mut queues: Vec<String> = self
            .trip(
                "queues",
                redis::cmd("SMEMBERS")
                    .arg(QUEUES)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        queues.sort();
        Ok(queues)
    }
}
