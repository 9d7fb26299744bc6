//! What every room uses and none owns: the clock, the API's error codes,
//! and the ids dtq makes. This module imports nothing of the crate's own,
//! so `api`, `ingest`, `worker`, `store`, `sandbox` and `deploy` can all
//! depend on it without a circle.

mod code;

pub use code::ErrorCode;

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, by this machine's clock. Scripts that
/// must agree across machines take Redis's `TIME` instead.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A new task id: a UUID v7, so ids sort by creation time (the listing and
/// `dtq tasks` read the time back from it).
pub fn new_task_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// A new unique token in 32 hex digits (a consumer name, a claim owner).
pub fn unique_token() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// The id of the task a handler submits to `queue` with idempotency key
/// `key` (flows): a UUID (version 8) made from the two, so that every run
/// of a handler that stages the same submission names the same task.
pub fn derived_task_id(queue: &str, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"dtq flow task\n")
        .chain_update(queue.as_bytes())
        .chain_update(b"\n")
        .chain_update(key.as_bytes())
        .finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}
