//! Why a server could not start or stopped, and the exit code the README
//! promises for each.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::ConfigError;
use crate::deploy::RegistryError;
use crate::sandbox::SandboxError;
use crate::store::StoreError;
use crate::worker::WorkerError;

/// Why a server could not start, or stopped without being asked to.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A flag's value is unusable.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// The API tokens (`--tokens-file`, `DTQ_TOKENS`) cannot be read.
    #[error("invalid API tokens: {0}")]
    Tokens(String),
    /// The trusted keys (`--trusted-keys`) cannot be read.
    #[error("invalid trusted keys")]
    TrustedKeys(#[source] crate::deploy::SigningError),
    /// Redis did not answer.
    #[error("cannot reach Redis at {url}")]
    Redis {
        /// The configured URL.
        url: String,
        /// What the connection attempt got.
        #[source]
        source: StoreError,
    },
    /// The wasm engine or the artifact cache cannot be set up.
    #[error("cannot set up the sandbox")]
    Sandbox(#[source] SandboxError),
    /// The handlers directory does not exist.
    #[error(
        "handlers directory {} does not exist (--handlers, DTQ_HANDLERS)",
        .0.display()
    )]
    NoHandlersDir(PathBuf),
    /// The handler registry cannot be read.
    #[error("cannot read the handler registry")]
    Registry(#[source] RegistryError),
    /// The API's address cannot be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The API server failed, panicked, or returned before shutdown.
    #[error("the API server stopped: {0}")]
    Api(String),
    /// The worker failed, or returned before shutdown.
    #[error("the worker stopped")]
    Worker(#[source] WorkerError),
    /// The worker returned before shutdown, without an error.
    #[error("the worker stopped before shutdown")]
    WorkerReturned,
}

impl ServerError {
    /// The process exit code the README documents: 2 for a bad command line
    /// or configuration (the handlers directory included), 3 when Redis
    /// cannot be reached at start, 1 for a failure while running (cannot
    /// listen, the API or the worker stopped).
    pub fn exit_code(&self) -> u8 {
        match self {
            ServerError::Config(_)
            | ServerError::Tokens(_)
            | ServerError::TrustedKeys(_)
            | ServerError::NoHandlersDir(_)
            | ServerError::Worker(WorkerError::Config(_)) => 2,
            ServerError::Redis { .. } | ServerError::Registry(_) => 3,
            ServerError::Sandbox(_)
            | ServerError::Listen { .. }
            | ServerError::Api(_)
            | ServerError::Worker(_)
            | ServerError::WorkerReturned => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_documented_ones() {
        let config = ServerError::Config(ConfigError::NoQueue);
        assert_eq!(config.exit_code(), 2);
        assert_eq!(ServerError::NoHandlersDir("x".into()).exit_code(), 2);
        assert_eq!(ServerError::Tokens("bad".into()).exit_code(), 2);
        let listen = ServerError::Listen {
            addr: "127.0.0.1:1".parse().expect("an address"),
            source: std::io::ErrorKind::AddrInUse.into(),
        };
        assert_eq!(listen.exit_code(), 1);
        assert_eq!(ServerError::Api("x".into()).exit_code(), 1);
        // A worker that cannot start its guest runtime failed while
        // starting; its configuration is fine.
        let runtime = WorkerError::GuestRuntime(std::io::ErrorKind::OutOfMemory.into());
        assert_eq!(ServerError::Worker(runtime).exit_code(), 1);
        let redis = ServerError::Redis {
            url: "redis://x/".into(),
            source: StoreError::Redis(redis::RedisError::from(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))),
        };
        assert_eq!(redis.exit_code(), 3);
    }
}
