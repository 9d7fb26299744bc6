//! Finding a task by the idempotency key it was submitted with:
//! `GET /v1/queues/{q}/idempotency/{key}`.
//!
//! The key's record, `dtq:idempotency:{q}:<key>`, already names its task
//! (`ingest.lua` writes it, the completion and requeue scripts keep its
//! state), so the lookup is one GET (one more read of the queue's partition
//! count, and one GET per replaced count that moved the key within the TTL
//! after a raise) and writes nothing. The record lives
//! for `--idem-ttl-s` from the submission, so a key is found as long as
//! it still deduplicates; its task may have outlived it (a task hash
//! expires with the task retention once terminal) or not.

use serde::{Deserialize, Serialize};

use super::{QueueKeys, Store, StoreError, partition_queue};

/// An idempotency record as the lookup shows it: the task a key names and
/// where that submission stands. The record's payload fingerprint is left
/// out: it serves the dedup check, not a reader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdempotencyRecord {
    /// The task the key was submitted as.
    pub task_id: String,
    /// `processing`, `completed` or `failed` (see DESIGN, Completion).
    pub state: String,
    /// When the record last changed (ms), if it says.
    pub updated_at: Option<u64>,
}

/// The record as the scripts write it. Lua's cjson writes numbers as
/// doubles (`%.14g`), so the time is read as one.
#[derive(Deserialize)]
struct Stored {
    task_id: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    updated_at: Option<f64>,
    /// Set on a forward (`dlq.rs`): the key's record is in this partition.
    #[serde(default)]
    forward: Option<u32>,
}

impl From<Stored> for IdempotencyRecord {
    fn from(s: Stored) -> Self {
        IdempotencyRecord {
            task_id: s.task_id,
            state: s.state,
            updated_at: s.updated_at.map(|t| t as u64),
        }
    }
}

impl Store {
    /// The idempotency record of `key` in `queue`, if it has not expired:
    /// in the partition the key's hash gives it, or, within the TTL after a
    /// raise of the partition count, where a replaced count put it (see
    /// `partitions.rs`), or where a forward left by a DLQ requeue sends it
    /// (`dlq.rs`). `key` must already be validated
    /// ([`crate::ingest::validate_idempotency_key`]).
    pub async fn idempotency_record(
        &self,
        queue: &str,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let part = self.partitioning(queue).await?;
        let mut found = None;
        for partition in part.places_of_key(key, crate::base::now_ms()) {
            found = self.stored_record(queue, partition, key).await?;
            if found.is_some() {
                break;
            }
        }
        // A forward names the partition where the key's record is: one hop.
        if let Some(Stored {
            forward: Some(partition),
            ..
        }) = found
        {
            found = self.stored_record(queue, partition, key).await?;
        }
        Ok(found
            .filter(|s| s.forward.is_none())
            .map(IdempotencyRecord::from))
    }

    /// The record of `key` in partition `partition` of `queue`, parsed.
    async fn stored_record(
        &self,
        queue: &str,
        partition: u32,
        key: &str,
    ) -> Result<Option<Stored>, StoreError> {
        let keys = QueueKeys::new(&partition_queue(queue, partition));
        let raw: Option<String> = self
            .trip(
                "idempotency_record",
                redis::cmd("GET")
                    .arg(keys.idempotency(Some(key)))
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        raw.map(|text| {
            serde_json::from_str::<Stored>(&text)
                .map_err(|e| StoreError::Corrupt(format!("idempotency record of {key:?}: {e}")))
        })
        .transpose()
    }
}
