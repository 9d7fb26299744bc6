//! Configuration: one struct, from command-line flags and `DTQ_*`
//! environment variables. Each default is in the flag's help.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::api::{ApiLimits, ApiSettings, Tokens};
use crate::deploy::{SigningError, TrustedKeys};
use crate::ingest::IngestSettings;
use crate::sandbox::{AllowList, HandlerSettings, Limits, SandboxConfig};
use crate::store::StoreSettings;

/// Everything a `dtq` server process (API, worker, or both) is configured by.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Redis URL; or the URLs of Redis Cluster nodes, comma-separated
    /// (any one node is enough; more are tried in order when the first is
    /// down). A node in cluster mode makes the process speak Cluster.
    #[arg(
        long = "redis",
        env = "DTQ_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/"
    )]
    pub redis_url: String,

    /// Directory of handler modules, for development: `<task>.wasm` handles
    /// tasks named `<task>`. It is watched: a new or changed file is loaded
    /// without a restart, a bad one is logged and skipped. A handler
    /// deployed with `dtq deploy` wins over a file of the same name.
    /// Without it, the process runs what is deployed in Redis.
    #[arg(long = "handlers", env = "DTQ_HANDLERS")]
    pub handlers: Option<PathBuf>,

    /// How often the registry of deployed handlers and the handlers
    /// directory are checked for changes (ms), besides the notice every
    /// deploy publishes.
    #[arg(long, env = "DTQ_RELOAD_INTERVAL_MS", default_value_t = 1_000)]
    pub reload_interval_ms: u64,

    /// Largest module `dtq deploy` accepts, MiB.
    #[arg(long, env = "DTQ_MAX_MODULE_MIB", default_value_t = 64)]
    pub max_module_mib: u64,

    /// Address the HTTP API listens on.
    #[arg(long, env = "DTQ_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

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

    /// Queue names the fleet's registry (dtq:queues) may hold: a submission
    /// to a new queue past it gets 409 TOO_MANY_QUEUES. Any submitter may
    /// name a new queue, so the registry, and each process's per-queue
    /// maps, are bounded.
    #[arg(long, env = "DTQ_MAX_QUEUES", default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..))]
    pub max_queues: u64,

    /// Ready plus delayed tasks a queue may hold before submissions get 429
    /// QUEUE_FULL; 0 is unlimited.
    #[arg(long, env = "DTQ_MAX_QUEUE_DEPTH", default_value_t = 100_000)]
    pub max_queue_depth: u64,

    /// A running task is reclaimed by another worker once its worker has
    /// not beaten for this long (ms, by Redis's clock); workers beat every
    /// third of it. After a Redis outage every worker gets this long again
    /// before any counts as dead, so only dead workers' tasks are reclaimed.
    #[arg(long, env = "DTQ_VISIBILITY_TIMEOUT_MS", default_value_t = 30_000)]
    pub visibility_timeout_ms: u64,

    /// Bearer token with the admin scope on every queue: the fleet's
    /// operator (DLQ, partitions, schedules, deploys). Without it, and
    /// without a token with the admin or deploy scope, the admin and fleet
    /// routes are disabled (403).
    #[arg(long, env = "DTQ_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

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
    /// `start` (more Redis work per task). `none`: no events at all (the
    /// least Redis work; the events endpoint answers 409 EVENTS_OFF). Give
    /// the API servers and the workers the same value.
    #[arg(long, env = "DTQ_EVENTS", value_enum, default_value_t = Events::Terminal)]
    pub events: Events,

    /// How long a dead-lettered task is kept (s) before the workers'
    /// retention sweep purges it (task hash, DLQ entry and idempotency
    /// record); 0 keeps it until an admin requeues or purges it.
    #[arg(long, env = "DTQ_DLQ_RETENTION_S", default_value_t = 30 * 86_400)]
    pub dlq_retention_s: u64,

    /// Most dead-lettered tasks each queue keeps: past it the workers'
    /// retention sweep purges the oldest. 0 is unbounded.
    #[arg(long, env = "DTQ_DLQ_MAX", default_value_t = 100_000)]
    pub dlq_max: u64,

    /// Attempts of a task whose submission does not set `max_attempts`.
    #[arg(long, env = "DTQ_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,

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

    /// Deadline of one attempt (ms), unless the submission sets a shorter
    /// `timeout_ms`.
    #[arg(long, env = "DTQ_TASK_TIMEOUT_MS", default_value_t = 30_000)]
    pub task_timeout_ms: u64,

    /// Largest payload and result, bytes.
    #[arg(long, env = "DTQ_MAX_PAYLOAD_BYTES", default_value_t = 1 << 20)]
    pub max_payload_bytes: usize,

    /// Linear memory one handler call may use, MiB.
    #[arg(long, env = "DTQ_MEMORY_MIB", default_value_t = 64)]
    pub memory_mib: usize,

    /// Fuel (roughly, wasm instructions) per call; unset is unlimited (the
    /// deadline still applies).
    #[arg(long, env = "DTQ_FUEL")]
    pub fuel: Option<u64>,

    /// Where compiled handler modules are cached. Default:
    /// `$XDG_CACHE_HOME/dtq`, else `~/.cache/dtq`.
    #[arg(long, env = "DTQ_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    /// On SIGTERM/SIGINT, how long running tasks may take to finish (ms)
    /// before the process exits and leaves them to be reclaimed.
    #[arg(long, env = "DTQ_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,

    /// Run TASK's handler in namespace NS instead of its task name: its kv
    /// keys and idempotency claims live under NS, so handlers given one
    /// namespace share them. Repeatable, or comma-separated in the
    /// variable. A component that asks for a namespace
    /// (`handler!(f, namespace = "NS")`) is loaded only when given exactly
    /// that one here.
    #[arg(
        long = "namespace",
        env = "DTQ_NAMESPACES",
        value_name = "TASK=NS",
        value_delimiter = ',',
        value_parser = parse_namespace
    )]
    pub namespaces: Vec<(String, String)>,

    /// Bytes (MiB) each handler namespace may be charged in Redis: its kv
    /// keys and idempotency claims (names, values, kept results, plus a
    /// fixed overhead per key and per claim; see docs/sandbox.md). A write
    /// past it gets the error `quota-exceeded` and writes nothing, so no
    /// tenant can fill Redis. 0: no budget.
    #[arg(long, env = "DTQ_KV_QUOTA_MIB", default_value_t = 256)]
    pub kv_quota_mib: u64,

    /// A file holding the fleet's secret (at least 32 bytes, e.g. `head -c
    /// 32 /dev/urandom | base64`), which keys the Idempotency-Key handlers'
    /// requests carry downstream, so that no handler can compute another's.
    /// Give every process of the fleet the same file. Without it, dtq makes
    /// one once, in Redis.
    #[arg(long, env = "DTQ_FLEET_SECRET_FILE", value_name = "FILE")]
    pub fleet_secret_file: Option<PathBuf>,

    /// Let TASK's handler send HTTP requests to hosts matching PATTERN
    /// (`scheme://host[:port]`: `https://api.example.com`,
    /// `https://*.example.com`, `http://127.0.0.1:*`). Repeatable, or
    /// comma-separated in the variable. For handlers of the --handlers
    /// directory; a deployed handler has its own (`dtq deploy
    /// --allow-hosts`). Without one, a handler reaches no host.
    #[arg(
        long = "allow-host",
        env = "DTQ_ALLOW_HOSTS",
        value_name = "TASK=PATTERN",
        value_delimiter = ',',
        value_parser = parse_allow_host
    )]
    pub allow_hosts: Vec<(String, String)>,

    /// Longest an outbound HTTP request of a handler may take (ms); the
    /// task's remaining deadline caps it too.
    #[arg(long, env = "DTQ_HTTP_TIMEOUT_MS", default_value_t = 10_000)]
    pub http_timeout_ms: u64,

    /// Largest response body a handler's HTTP request may read, bytes.
    #[arg(long, env = "DTQ_HTTP_MAX_RESPONSE_BYTES", default_value_t = 4 << 20)]
    pub http_max_response_bytes: usize,

    /// HTTP requests one attempt of a handler may send.
    #[arg(long, env = "DTQ_HTTP_MAX_REQUESTS", default_value_t = 100)]
    pub http_max_requests: u64,

    /// API: how long a connection may take to send a request's headers,
    /// counted from the accept and again from the end of each response, so
    /// it is also the keep-alive idle timeout (ms).
    #[arg(long, env = "DTQ_API_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    pub api_header_timeout_ms: u64,

    /// API: how long a request may take to send its whole body (ms); then it
    /// gets 408 REQUEST_TIMEOUT and its connection is closed.
    #[arg(long, env = "DTQ_API_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub api_body_timeout_ms: u64,

    /// API: connections served at once; more wait until one closes. At most
    /// half the process's soft file-descriptor limit is used.
    #[arg(long, env = "DTQ_API_MAX_CONNECTIONS", default_value_t = 1024)]
    pub api_max_connections: usize,

    /// API: how long a request waits for Redis before it gets 503
    /// STORE_UNAVAILABLE (ms).
    #[arg(long, env = "DTQ_API_REDIS_TIMEOUT_MS", default_value_t = 1_000)]
    pub api_redis_timeout_ms: u64,

    /// API: event streams (GET /v1/queues/{q}/events) served at once; more
    /// get 503 TOO_MANY_EVENT_STREAMS. Each holds a Redis connection of its
    /// own and one of --api-max-connections. 0: none.
    #[arg(long, env = "DTQ_API_MAX_EVENT_STREAMS", default_value_t = 256)]
    pub api_max_event_streams: usize,

    /// API tokens with scopes, one `TOKEN SCOPES [QUEUES] [KEY=VALUE...]`
    /// per line (see the README). Without any (here or in DTQ_TOKENS) the API is open to
    /// anyone who reaches it, except the admin routes.
    #[arg(long, env = "DTQ_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,

    /// API tokens in the tokens-file format, entries separated by newlines
    /// or `;`. Prefer the variable or the file: a flag shows in `ps`.
    #[arg(long, env = "DTQ_TOKENS", hide_env_values = true)]
    pub tokens: Option<String>,

    /// Run signed modules only: a file of public keys, one
    /// `dtq-ed25519 <base64> <name>` line each (`dtq keygen` writes them).
    /// The API refuses a deploy no key signed, and every worker refuses to
    /// load a version no key signed. Unset: nothing is checked.
    #[arg(long, env = "DTQ_TRUSTED_KEYS")]
    pub trusted_keys: Option<PathBuf>,

    /// Also serve `GET /metrics` (Prometheus) alone on this address, with
    /// the API's tokens (`read` scope) and limits: for a `dtq worker`, which
    /// has no API to scrape. Unset: only the API serves `/metrics`.
    #[arg(long, env = "DTQ_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

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

/// `TASK=PATTERN`, the pattern checked.
fn parse_allow_host(text: &str) -> Result<(String, String), String> {
    let (task, pattern) = text
        .split_once('=')
        .filter(|(task, pattern)| !task.is_empty() && !pattern.is_empty())
        .ok_or_else(|| format!("{text:?} is not TASK=PATTERN"))?;
    AllowList::parse(pattern).map_err(|e| e.to_string())?;
    Ok((task.to_string(), pattern.to_string()))
}

/// `TASK=NS`.
fn parse_namespace(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((task, ns)) if !task.is_empty() && !ns.is_empty() => {
            Ok((task.to_string(), ns.to_string()))
        }
        _ => Err(format!("{text:?} is not TASK=NAMESPACE")),
    }
}

/// Which lifecycle events are written (`--events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Events {
    /// Every status change of every attempt.
    All,
    /// Every status change but a carried first attempt's RUNNING.
    Terminal,
    /// None.
    None,
}

impl Config {
    /// The store's settings.
    pub fn store_settings(&self) -> StoreSettings {
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

    /// The submission path's settings.
    pub fn ingest_settings(&self) -> IngestSettings {
        IngestSettings {
            max_payload_bytes: self.max_payload_bytes,
            max_queue_depth: self.max_queue_depth,
            default_max_attempts: self.max_attempts,
            max_timeout_ms: self.task_timeout_ms,
        }
    }

    /// The API's limits and tokens; the tokens file is read here.
    pub fn api_settings(&self) -> Result<ApiSettings, String> {
        let mut tokens = match &self.tokens_file {
            Some(path) => Tokens::load(path).map_err(|e| e.to_string())?,
            None => Tokens::default(),
        };
        if let Some(text) = &self.tokens {
            tokens.extend(
                Tokens::parse_variable(text, "DTQ_TOKENS (--tokens)").map_err(|e| e.to_string())?,
            );
        }
        Ok(ApiSettings {
            limits: ApiLimits {
                header_timeout: Duration::from_millis(self.api_header_timeout_ms),
                body_timeout: Duration::from_millis(self.api_body_timeout_ms),
                max_connections: self.api_max_connections,
                redis_timeout: Duration::from_millis(self.api_redis_timeout_ms),
                max_event_streams: self.api_max_event_streams,
            },
            tokens,
            trusted_keys: self.trusted_keys().map_err(|e| e.to_string())?,
        })
    }

    /// The keys of `--trusted-keys`, read; `None` without the flag.
    pub fn trusted_keys(&self) -> Result<Option<TrustedKeys>, SigningError> {
        self.trusted_keys
            .as_deref()
            .map(TrustedKeys::load)
            .transpose()
    }

    /// The largest module a deploy accepts, bytes.
    pub fn max_module_bytes(&self) -> usize {
        usize::try_from(self.max_module_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }

    /// How often handlers are checked for changes.
    pub fn reload_interval(&self) -> Duration {
        Duration::from_millis(self.reload_interval_ms)
    }

    /// The visibility timeout.
    pub fn visibility_timeout(&self) -> Duration {
        Duration::from_millis(self.visibility_timeout_ms)
    }

    /// The sandbox's configuration: limits from the flags, the artifact
    /// cache at `--cache-dir` or its default place, and one pool slot per
    /// execution slot.
    pub fn sandbox_config(&self) -> SandboxConfig {
        let limits = Limits {
            deadline: Duration::from_millis(self.task_timeout_ms),
            memory_bytes: self.memory_mib << 20,
            fuel: self.fuel,
            max_payload_bytes: self.max_payload_bytes,
            max_result_bytes: self.max_payload_bytes,
            // Room for a whole result or value, so their own limits answer.
            kv_quota_bytes: self.kv_quota_mib.saturating_mul(1 << 20),
            max_hostcall_bytes: Limits::default()
                .max_hostcall_bytes
                .max(self.max_payload_bytes.saturating_add(1 << 20)),
            http_timeout: Duration::from_millis(self.http_timeout_ms),
            max_http_response_bytes: self.http_max_response_bytes,
            max_http_requests: self.http_max_requests,
            ..Limits::default()
        };
        SandboxConfig {
            limits,
            cache_dir: self
                .cache_dir
                .clone()
                .or_else(SandboxConfig::default_cache_dir),
            max_concurrent_calls: self.concurrency as u32,
            handlers: self.handler_settings(),
            fleet_secret_file: self.fleet_secret_file.clone(),
            ..SandboxConfig::default()
        }
    }

    /// The settings of the handlers of the --handlers directory, from
    /// `--namespace` and `--allow-host`, by task.
    fn handler_settings(&self) -> std::collections::HashMap<String, HandlerSettings> {
        let mut settings: std::collections::HashMap<String, HandlerSettings> =
            std::collections::HashMap::new();
        for (task, namespace) in &self.namespaces {
            settings.entry(task.clone()).or_default().namespace = Some(namespace.clone());
        }
        for (task, pattern) in &self.allow_hosts {
            // Checked when parsed.
            if let Ok(list) = AllowList::parse(pattern) {
                settings
                    .entry(task.clone())
                    .or_default()
                    .allow_hosts
                    .extend(list);
            }
        }
        settings
    }

    /// Check the values clap cannot; [`Config::check`] as text.
    pub fn validate(&self) -> Result<(), String> {
        self.check().map_err(|e| e.to_string())
    }

    /// Check the values clap cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        let at_least = |flag, min, value| {
            if value < min {
                Err(ConfigError::TooSmall { flag, min })
            } else {
                Ok(())
            }
        };
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
        at_least("--visibility-timeout-ms", 100, self.visibility_timeout_ms)?;
        at_least("--reload-interval-ms", 10, self.reload_interval_ms)?;
        at_least("--http-timeout-ms", 1, self.http_timeout_ms)?;
        at_least("--max-module-mib", 1, self.max_module_mib)?;
        let max = crate::ingest::MAX_ATTEMPTS_LIMIT;
        if !(1..=max).contains(&self.max_attempts) {
            return Err(ConfigError::OutOfRange {
                flag: "--max-attempts",
                min: 1,
                max: max.into(),
            });
        }
        at_least("--api-header-timeout-ms", 1, self.api_header_timeout_ms)?;
        at_least("--api-body-timeout-ms", 1, self.api_body_timeout_ms)?;
        at_least("--api-redis-timeout-ms", 1, self.api_redis_timeout_ms)?;
        at_least("--api-max-connections", 1, self.api_max_connections as u64)
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
    /// A name in `--queues` is not a valid queue name.
    #[error("--queues: {queue:?}: {reason}")]
    Queue {
        /// The name.
        queue: String,
        /// Why it is refused.
        reason: String,
    },
}

impl Config {
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
