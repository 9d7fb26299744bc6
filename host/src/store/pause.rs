//! Pausing a queue: one field of [`PAUSED`] per paused queue.
//!
//! A paused queue still takes submissions, and its running tasks finish;
//! its workers start none of its tasks. The state is one hash for the whole
//! fleet, so a worker reads the state of all its queues in one round trip
//! (`worker/pause.rs` does so every [`PAUSE_POLL`]), and a worker that
//! starts during a pause reads it before its first fetch. Pausing names the
//! logical queue: every partition of it is paused.

use std::collections::HashSet;
use std::time::Duration;

use super::{PAUSED, Store, StoreError};

/// How often a worker reads which of its queues are paused: a pause or a
/// resume reaches every worker of the fleet within about this long.
pub const PAUSE_POLL: Duration = Duration::from_millis(250);

impl Store {
    /// Pause `queue` from `now` (ms). Whether it was running (a pause of a
    /// paused queue changes nothing, and keeps its first time).
    pub async fn pause(&self, queue: &str, now: u64) -> Result<bool, StoreError> {
        let set: bool = self
            .trip(
                "pause",
                redis::cmd("HSETNX")
                    .arg(PAUSED)
                    .arg(queue)
                    .arg(now)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(set)
    }

    /// Resume `queue`. Whether it was paused.
    pub async fn resume(&self, queue: &str) -> Result<bool, StoreError> {
        let removed: u32 = self
            .trip(
                "resume",
                redis::cmd("HDEL")
                    .arg(PAUSED)
                    .arg(queue)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(removed > 0)
    }

    /// Which of `queues` (logical names) are paused, in one round trip.
    pub async fn paused(&self, queues: &[String]) -> Result<HashSet<String>, StoreError> {
        if queues.is_empty() {
            return Ok(HashSet::new());
        }
        let since: Vec<Option<u64>> = self
            .trip(
                "paused",
                redis::cmd("HMGET")
                    .arg(PAUSED)
                    .arg(queues)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(queues
            .iter()
            .zip(since)
            .filter(|(_, since)| since.is_some())
            .map(|(queue, _)| queue.clone())
            .collect())
    }

    /// When `queue` was paused (ms), or `None` if it is not.
    pub async fn paused_since(&self, queue: &str) -> Result<Option<u64>, StoreError> {
        let since: Option<u64> = self
            .trip(
                "paused",
                redis::cmd("HGET")
                    .arg(PAUSED)
                    .arg(queue)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(since)
    }
}
