//! The `dtq` command's client side: each command a few calls of
//! [`dtq_host::client`], and the exit code each failure maps to.
//!
//! - [`args`]: the command line (clap);
//! - [`submit`]: `submit` (and `--wait`), `submit-batch`;
//! - [`queues`]: `status`, `tasks`, `cancel`, `queues`, `partitions`,
//!   `dlq`, `schedule`;
//! - [`deploy`]: `deploy` (a module or a manifest) and its rollout,
//!   `handlers`, `rollback`, `undeploy`, `keygen`;
//! - [`watch`]: the `watch` command;
//! - [`print`](mod@print): what goes to stdout, tables or JSON;
//! - [`table`]: the tables, for a person at a terminal.

pub(crate) mod args;
pub(crate) mod deploy;
pub(crate) mod print;
pub(crate) mod queues;
pub(crate) mod submit;
pub(crate) mod table;
pub(crate) mod watch;

use dtq_host::client::{Client, ClientError};
use reqwest::StatusCode;
use serde_json::Value;

use args::ClientArgs;

/// A failure with the exit code it maps to (see [`args::EXIT_CODES`]).
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) error: anyhow::Error,
    /// The server's answer to a refused request: printed to stdout before
    /// the error, so scripts can read its `details` (e.g. the in-flight
    /// task of a 409).
    pub(crate) answer: Option<Value>,
}

pub(crate) fn fail(code: u8, error: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code,
        error: error.into(),
        answer: None,
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        fail(1, e)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        fail(1, e)
    }
}

impl From<serde_json::Error> for Failure {
    fn from(e: serde_json::Error) -> Self {
        fail(1, e)
    }
}

/// 3 when the server cannot be reached (or answers 503: it or its Redis
/// is away), 2 for a name that cannot be sent, 1 for a refusal. The error
/// is said on one line, as the client words it.
impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        let code = match &e {
            ClientError::BadBase { .. } | ClientError::Unreachable { .. } => 3,
            ClientError::BadSegment(_) => 2,
            ClientError::Api { status, .. } if *status == StatusCode::SERVICE_UNAVAILABLE => 3,
            _ => 1,
        };
        Failure {
            code,
            answer: e.body().cloned(),
            error: anyhow::anyhow!("{e}"),
        }
    }
}

/// The client of the API the command names, with its token (the admin
/// token when no other is given).
pub(crate) fn client(args: ClientArgs) -> Result<Client, Failure> {
    Ok(Client::new(&args.api)?.with_token(args.token.or(args.admin_token)))
}

/// Resolves on the first SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}
