//! The store's flags: where Redis is, how long its records live, which
//! events it writes, how many queues it registers.

use clap::Args;

use crate::store::StoreSettings;

/// What the store is configured by.
#[derive(Debug, Clone, Args)]
pub struct StoreConfig {
    /// Redis URL; or the URLs of Redis Cluster nodes, comma-separated
    /// (any one node is enough; more are tried in order when the first is
    /// down), a node in cluster mode making the process speak Cluster; or
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/<master>`
    /// for a master behind Redis Sentinel, followed through a failover.
    #[arg(
        long = "redis",
        env = "DTQ_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/"
    )]
    pub redis_url: String,

    /// Queue names the fleet's registry (dtq:queues) may hold: a submission
    /// to a new queue past it gets 409 TOO_MANY_QUEUES. Any submitter may
    /// name a new queue, so the registry, and each process's per-queue
    /// maps, are bounded.
    #[arg(long, env = "DTQ_MAX_QUEUES", default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..))]
    pub max_queues: u64,

    /// TTL of idempotency records (s): the duplicate-submission window.
    #[arg(long, env = "DTQ_IDEM_TTL_S", default_value_t = 86_400)]
    pub idem_ttl_s: u64,

    /// How long terminal task records are kept (s).
    #[arg(long, env = "DTQ_TASK_RETENTION_S", default_value_t = 7 * 86_400)]
    pub task_retention_s: u64,

    /// Which lifecycle events the queues' event streams get (what live
    /// events, `dtq watch` and the dashboard's chart show). `terminal`:
    /// every status change but the RUNNING of a first attempt that runs
    /// from its stream message with no `start` script, as the first attempt
    /// of a task submitted to run now without an expiry does (status
    /// queries still show it RUNNING). `all`: every status change, every attempt through
    /// `start` (more Redis work per task), and the progress handlers
    /// report, as `PROGRESS` events (a few a second per reporting call). `none`: no events at all (the
    /// least Redis work; the events endpoint answers 409 EVENTS_OFF). Give
    /// the API servers and the workers the same value.
    #[arg(long, env = "DTQ_EVENTS", value_enum, default_value_t = Events::Terminal)]
    pub events: Events,
}

/// Which lifecycle events are written (`--events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Events {
    /// Every status change of every attempt, and progress reports.
    All,
    /// Every status change but a carried first attempt's RUNNING.
    Terminal,
    /// None.
    None,
}

impl StoreConfig {
    /// The store's settings.
    pub fn settings(&self) -> StoreSettings {
        StoreSettings {
            idem_ttl_s: self.idem_ttl_s,
            task_retention_s: self.task_retention_s,
            running_events: self.events == Events::All,
            max_queues: self.max_queues,
            events_max_len: match self.events {
                Events::None => 0,
                _ => StoreSettings::default().events_max_len,
            },
        }
    }
}
