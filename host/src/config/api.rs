//! The API's flags: where it listens, who may call it, and how much one
//! connection or request may take.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{ConfigError, at_least};
use crate::api::{ApiLimits, Tokens};

/// What the HTTP API (and the `--metrics-listen` listener) is configured by.
#[derive(Debug, Clone, Args)]
pub struct ApiConfig {
    /// Address the HTTP API listens on.
    #[arg(long, env = "DTQ_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Bearer token with the admin scope on every queue: the fleet's
    /// operator (DLQ, partitions, schedules, deploys). Without it, and
    /// without a token with the admin or deploy scope, the admin and fleet
    /// routes are disabled (403).
    #[arg(long, env = "DTQ_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

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

    /// Also serve `GET /metrics` (Prometheus) alone on this address, with
    /// the API's tokens (`read` scope) and limits: for a `dtq worker`, which
    /// has no API to scrape. Unset: only the API serves `/metrics`.
    #[arg(long, env = "DTQ_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

impl ApiConfig {
    /// The tokens of `--tokens-file` and `--tokens`; the file is read here.
    pub fn tokens(&self) -> Result<Tokens, String> {
        let mut tokens = match &self.tokens_file {
            Some(path) => Tokens::load(path).map_err(|e| e.to_string())?,
            None => Tokens::default(),
        };
        if let Some(text) = &self.tokens {
            tokens.extend(
                Tokens::parse_variable(text, "DTQ_TOKENS (--tokens)").map_err(|e| e.to_string())?,
            );
        }
        Ok(tokens)
    }

    /// The limits of connections and requests.
    pub fn limits(&self) -> ApiLimits {
        ApiLimits {
            header_timeout: Duration::from_millis(self.api_header_timeout_ms),
            body_timeout: Duration::from_millis(self.api_body_timeout_ms),
            max_connections: self.api_max_connections,
            redis_timeout: Duration::from_millis(self.api_redis_timeout_ms),
            max_event_streams: self.api_max_event_streams,
        }
    }

    /// Check the values clap cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        at_least("--api-header-timeout-ms", 1, self.api_header_timeout_ms)?;
        at_least("--api-body-timeout-ms", 1, self.api_body_timeout_ms)?;
        at_least("--api-redis-timeout-ms", 1, self.api_redis_timeout_ms)?;
        at_least("--api-max-connections", 1, self.api_max_connections as u64)
    }
}
