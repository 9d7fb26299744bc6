//! The submission path's flags: what a submission may carry and what it
//! gets when it does not say. The API submits, and so do a worker's
//! schedules; the deadline and the payload limit also bound the sandbox.

use clap::Args;

use super::ConfigError;
use crate::ingest::IngestSettings;

/// `--max-queue-depth`'s default.
const MAX_QUEUE_DEPTH: u64 = 100_000;
/// `--max-attempts`'s default.
const MAX_ATTEMPTS: u32 = 3;
/// `--task-timeout-ms`'s default.
const TASK_TIMEOUT_MS: u64 = 30_000;
/// `--max-payload-bytes`'s default.
const MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// What submissions are held to.
#[derive(Debug, Clone, Args)]
pub struct SubmitConfig {
    /// Ready plus delayed tasks a queue may hold before submissions get 429
    /// QUEUE_FULL; 0 is unlimited.
    #[arg(long, env = "DTQ_MAX_QUEUE_DEPTH", default_value_t = MAX_QUEUE_DEPTH)]
    pub max_queue_depth: u64,

    /// Attempts of a task whose submission does not set `max_attempts`.
    #[arg(long, env = "DTQ_MAX_ATTEMPTS", default_value_t = MAX_ATTEMPTS)]
    pub max_attempts: u32,

    /// Deadline of one attempt (ms), unless the submission sets a shorter
    /// `timeout_ms`.
    #[arg(long, env = "DTQ_TASK_TIMEOUT_MS", default_value_t = TASK_TIMEOUT_MS)]
    pub task_timeout_ms: u64,

    /// Largest payload and result, bytes.
    #[arg(long, env = "DTQ_MAX_PAYLOAD_BYTES", default_value_t = MAX_PAYLOAD_BYTES)]
    pub max_payload_bytes: usize,
}

/// The flags' defaults, as parsing no flag and no variable gives them.
impl Default for SubmitConfig {
    fn default() -> SubmitConfig {
        SubmitConfig {
            max_queue_depth: MAX_QUEUE_DEPTH,
            max_attempts: MAX_ATTEMPTS,
            task_timeout_ms: TASK_TIMEOUT_MS,
            max_payload_bytes: MAX_PAYLOAD_BYTES,
        }
    }
}

impl SubmitConfig {
    /// The submission path's settings.
    pub fn settings(&self) -> IngestSettings {
        IngestSettings {
            max_payload_bytes: self.max_payload_bytes,
            max_queue_depth: self.max_queue_depth,
            default_max_attempts: self.max_attempts,
            max_timeout_ms: self.task_timeout_ms,
        }
    }

    /// Check the values clap cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        let max = crate::ingest::MAX_ATTEMPTS_LIMIT;
        if !(1..=max).contains(&self.max_attempts) {
            return Err(ConfigError::OutOfRange {
                flag: "--max-attempts",
                min: 1,
                max: max.into(),
            });
        }
        Ok(())
    }
}
