//! Configuration, from command-line flags and `DTQ_*` environment
//! variables; each default is in the flag's help.
//!
//! Each room has its part, a group of flags of its own, and [`Config`]
//! composes them (clap flattens them into one command line):
//!
//! - [`StoreConfig`]: Redis, its records' lifetimes, its event streams.
//! - [`SubmitConfig`]: what a submission may carry, through the API or a
//!   schedule.
//! - [`WorkerConfig`]: the queues a worker consumes, its slots, retries,
//!   reclaim and dead-letter sweep.
//! - [`GuestConfig`]: what a handler call may use (the sandbox's limits).
//! - [`DeployConfig`]: the handlers directory, the reload, signed modules.
//! - [`ApiConfig`]: the listener, the tokens, the connection limits.
//! - [`TelemetryConfig`]: tracing's OTLP endpoint and service name.
//!
//! The server hands each room its part ([`Config::worker`],
//! [`Config::api_settings`], [`Config::sandbox_config`], ...).

mod api;
mod deploy;
mod sandbox;
mod store;
mod submit;
mod telemetry;
mod worker;

pub use api::ApiConfig;
pub use deploy::DeployConfig;
pub use sandbox::GuestConfig;
pub use store::{Events, StoreConfig};
pub use submit::SubmitConfig;
pub use telemetry::TelemetryConfig;
pub use worker::WorkerConfig;

use clap::Args;

use crate::api::ApiSettings;
use crate::ingest::IngestSettings;
use crate::sandbox::SandboxConfig;
use crate::store::StoreSettings;

/// Everything a `dtq` server process (API, worker, or both) is configured
/// by: each room's flags, and the log's format.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// The store's flags.
    #[command(flatten)]
    pub store: StoreConfig,

    /// The submission path's flags.
    #[command(flatten)]
    pub submit: SubmitConfig,

    /// The worker's flags; [`Config::worker`] gives them with the
    /// submission's, as the worker takes them.
    #[command(flatten)]
    worker: WorkerConfig,

    /// The sandbox's flags.
    #[command(flatten)]
    pub sandbox: GuestConfig,

    /// The handler registry's flags.
    #[command(flatten)]
    pub deploy: DeployConfig,

    /// The API's flags.
    #[command(flatten)]
    pub api: ApiConfig,

    /// Tracing's flags.
    #[command(flatten)]
    pub telemetry: TelemetryConfig,

    /// Log format on stderr: `text` (coloured only on a terminal) or `json`
    /// (one object per line: timestamp, level, target, message and the
    /// event's fields, and the fields of its span, such as task_id, queue
    /// and task). `DTQ_LOG` chooses what is logged (default `info`).
    #[arg(
        long,
        env = "DTQ_LOG_FORMAT",
        default_value = "text",
        value_parser = ["text", "json"]
    )]
    pub log_format: String,
}

impl Config {
    /// The worker's part: its flags, with the submission flags its
    /// schedules submit by.
    pub fn worker(&self) -> WorkerConfig {
        WorkerConfig {
            submit: self.submit.clone(),
            ..self.worker.clone()
        }
    }

    /// The store's settings.
    pub fn store_settings(&self) -> StoreSettings {
        self.store.settings()
    }

    /// The submission path's settings.
    pub fn ingest_settings(&self) -> IngestSettings {
        self.submit.settings()
    }

    /// The API's limits and tokens; the tokens file is read here.
    pub fn api_settings(&self) -> Result<ApiSettings, String> {
        Ok(ApiSettings {
            limits: self.api.limits(),
            tokens: self.api.tokens()?,
            trusted_keys: self.deploy.trusted_keys().map_err(|e| e.to_string())?,
        })
    }

    /// The sandbox's configuration: one pool slot per execution slot.
    pub fn sandbox_config(&self) -> SandboxConfig {
        let mut config = self
            .sandbox
            .sandbox_config(&self.submit, self.worker.concurrency);
        // Progress events are written with every event only: at a few a
        // second per running call, they would crowd status changes out
        // of the capped stream.
        let store = self.store_settings();
        if store.running_events {
            config.progress_events_max_len = store.events_max_len;
        }
        config
    }

    /// Check the values clap cannot; [`Config::check`] as text.
    pub fn validate(&self) -> Result<(), String> {
        self.check().map_err(|e| e.to_string())
    }

    /// Check the values clap cannot, every room's.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.worker.check_own()?;
        self.deploy.check()?;
        self.sandbox.check()?;
        self.submit.check()?;
        self.telemetry.check()?;
        self.api.check()
    }

    /// Parse a configuration from flags alone (plus `DTQ_*` variables), as
    /// the server subcommands do; for embedding and tests. A flag given
    /// twice takes its last value.
    pub fn from_args<I, T>(args: I) -> Result<Config, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::Parser;
        #[derive(Parser)]
        #[command(args_override_self = true)]
        struct Only {
            #[command(flatten)]
            config: Config,
        }
        let args = std::iter::once(std::ffi::OsString::from("dtq"))
            .chain(args.into_iter().map(Into::into));
        Ok(Only::try_parse_from(args)?.config)
    }
}

/// `Ok` when `value` is at least `min`, else [`ConfigError::TooSmall`].
fn at_least(flag: &'static str, min: u64, value: u64) -> Result<(), ConfigError> {
    if value < min {
        Err(ConfigError::TooSmall { flag, min })
    } else {
        Ok(())
    }
}

/// A configuration value clap accepted but dtq cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A number below its minimum.
    #[error("{flag} must be at least {min}")]
    TooSmall {
        /// The flag.
        flag: &'static str,
        /// Its smallest accepted value.
        min: u64,
    },
    /// A number outside its range.
    #[error("{flag} must be {min} to {max}")]
    OutOfRange {
        /// The flag.
        flag: &'static str,
        /// Its smallest accepted value.
        min: u64,
        /// Its largest accepted value.
        max: u64,
    },
    /// `--queues` is empty.
    #[error("--queues names no queue")]
    NoQueue,
    /// A value of the wrong form.
    #[error("{flag}: {reason}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// A name in `--queues` is not a valid queue name.
    #[error("--queues: {queue:?}: {reason}")]
    Queue {
        /// The name.
        queue: String,
        /// Why it is refused.
        reason: String,
    },
}
