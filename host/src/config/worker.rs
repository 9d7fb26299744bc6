//! A worker's flags: what it consumes, how many tasks it runs at once, when
//! it retries, reclaims, sweeps the dead letters and gives up waiting.

use std::time::Duration;

use clap::Args;

use super::{ConfigError, SubmitConfig, at_least};
use crate::ingest::IngestSettings;

/// What a worker runs by: its flags, and the submission flags its schedules
/// submit by.
#[derive(Debug, Clone, Args)]
pub struct WorkerConfig {
    /// Queues this worker consumes, comma-separated. The API accepts
    /// submissions to any valid queue name.
    #[arg(
        long,
        env = "DTQ_QUEUES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub queues: Vec<String>,

    /// Tasks this worker runs at once.
    #[arg(long, env = "DTQ_CONCURRENCY", default_value_t = 8)]
    pub concurrency: usize,

    /// A running task is reclaimed by another worker once its worker has
    /// not beaten for this long (ms, by Redis's clock); workers beat every
    /// third of it. After a Redis outage every worker gets this long again
    /// before any counts as dead, so only dead workers' tasks are reclaimed.
    #[arg(long, env = "DTQ_VISIBILITY_TIMEOUT_MS", default_value_t = 30_000)]
    pub visibility_timeout_ms: u64,

    /// How long a dead-lettered task is kept (s) before the workers'
    /// retention sweep purges it (task hash, DLQ entry and idempotency
    /// record); 0 keeps it until an admin requeues or purges it.
    #[arg(long, env = "DTQ_DLQ_RETENTION_S", default_value_t = 30 * 86_400)]
    pub dlq_retention_s: u64,

    /// Most dead-lettered tasks each queue keeps: past it the workers'
    /// retention sweep purges the oldest. 0 is unbounded.
    #[arg(long, env = "DTQ_DLQ_MAX", default_value_t = 100_000)]
    pub dlq_max: u64,

    /// First retry delay (ms); it doubles each attempt, with jitter.
    #[arg(long, env = "DTQ_RETRY_BASE_MS", default_value_t = 1_000)]
    pub retry_base_ms: u64,

    /// Longest retry delay (ms).
    #[arg(long, env = "DTQ_RETRY_MAX_MS", default_value_t = 300_000)]
    pub retry_max_ms: u64,

    /// How long a task may wait for a handler (ms): a worker with no
    /// handler for it gives it back (deferred, no attempt counted), and once
    /// it has waited this long in one spell it ends FAILED, its error naming
    /// the handler. 0 waits without bound.
    #[arg(long, env = "DTQ_DEFER_LIMIT_MS", default_value_t = 86_400_000)]
    pub defer_limit_ms: u64,

    /// On SIGTERM/SIGINT, how long running tasks may take to finish (ms)
    /// before the process exits and leaves them to be reclaimed.
    #[arg(long, env = "DTQ_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,

    /// The submission flags, which the schedules' tasks are held to: not
    /// flags of their own, [`super::Config::worker`] copies them in.
    #[arg(skip)]
    pub submit: SubmitConfig,
}

impl WorkerConfig {
    /// The settings the schedules submit with.
    pub fn ingest_settings(&self) -> IngestSettings {
        self.submit.settings()
    }

    /// The visibility timeout.
    pub fn visibility_timeout(&self) -> Duration {
        Duration::from_millis(self.visibility_timeout_ms)
    }

    /// Check the values clap cannot; [`WorkerConfig::check`] as text.
    pub fn validate(&self) -> Result<(), String> {
        self.check().map_err(|e| e.to_string())
    }

    /// Check the values clap cannot: the worker's, and the submission
    /// flags it holds.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.check_own()?;
        self.submit.check()
    }

    /// Check the worker's own flags.
    pub(super) fn check_own(&self) -> Result<(), ConfigError> {
        at_least("--concurrency", 1, self.concurrency as u64)?;
        if self.queues.is_empty() {
            return Err(ConfigError::NoQueue);
        }
        for q in &self.queues {
            crate::ingest::validate_queue_name(q).map_err(|e| ConfigError::Queue {
                queue: q.clone(),
                reason: e.to_string(),
            })?;
        }
        at_least("--visibility-timeout-ms", 100, self.visibility_timeout_ms)
    }
}
