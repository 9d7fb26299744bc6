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
    /// Queues this worker consumes, comma-separated, each with an optional
    /// weight: `high:6,default:3,low:1` (a queue without one weighs 1).
    /// While every queue has tasks, the worker's slots go to them in
    /// proportion to their weights; a queue with none gives its share to
    /// the others. The API accepts submissions to any valid queue name.
    #[arg(
        long,
        env = "DTQ_QUEUES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub queues: Vec<WeightedQueue>,

    /// Drain the queues in the order `--queues` names them: a queue's tasks
    /// start only while every queue before it is empty (weights are then
    /// ignored).
    #[arg(long, env = "DTQ_STRICT_PRIORITY")]
    pub strict_priority: bool,

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

/// A queue of `--queues` and its weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedQueue {
    /// The queue's name (checked by [`WorkerConfig::check`]).
    pub name: String,
    /// Its share of the worker's slots, relative to the other queues'.
    pub weight: u32,
}

/// The largest weight `--queues` takes.
pub(crate) const MAX_QUEUE_WEIGHT: u32 = 1_000;

impl std::str::FromStr for WeightedQueue {
    type Err = String;

    /// `name` (weight 1) or `name:weight`, a weight of 1 to
    /// [`MAX_QUEUE_WEIGHT`]. Queue names cannot hold `:`, so the last one
    /// splits.
    fn from_str(text: &str) -> Result<Self, String> {
        let Some((name, weight)) = text.rsplit_once(':') else {
            return Ok(WeightedQueue {
                name: text.to_owned(),
                weight: 1,
            });
        };
        match weight.parse::<u32>() {
            Ok(weight) if (1..=MAX_QUEUE_WEIGHT).contains(&weight) => Ok(WeightedQueue {
                name: name.to_owned(),
                weight,
            }),
            _ => Err(format!(
                "{text:?}: a weight is a whole number from 1 to {MAX_QUEUE_WEIGHT} \
                 (as in high:6,default:3,low:1)"
            )),
        }
    }
}

impl std::fmt::Display for WeightedQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.weight {
            1 => f.write_str(&self.name),
            w => write!(f, "{}:{w}", self.name),
        }
    }
}

impl WorkerConfig {
    /// The names of the queues this worker consumes, in `--queues` order.
    pub fn queue_names(&self) -> Vec<String> {
        self.queues.iter().map(|q| q.name.clone()).collect()
    }

    /// The weight `--queues` gives `queue` (1 if it names it without one,
    /// or not at all).
    pub fn weight_of(&self, queue: &str) -> u32 {
        self.queues
            .iter()
            .find(|q| q.name == queue)
            .map_or(1, |q| q.weight)
    }

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
        for (i, q) in self.queues.iter().enumerate() {
            crate::ingest::validate_queue_name(&q.name).map_err(|e| ConfigError::Queue {
                queue: q.name.clone(),
                reason: e.to_string(),
            })?;
            if self.queues[..i]
                .iter()
                .any(|earlier| earlier.name == q.name)
            {
                return Err(ConfigError::Queue {
                    queue: q.name.clone(),
                    reason: "named twice".into(),
                });
            }
        }
        at_least("--visibility-timeout-ms", 100, self.visibility_timeout_ms)
    }
}
