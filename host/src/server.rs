//! The server: one composition of the store, the sandbox and its handlers,
//! the worker and the HTTP API, used by the `dtq` binary and by the test
//! harness alike.
//!
//! [`run`] takes its shutdown signal as a future, as `worker::run` and
//! `api::serve_with` do: when it resolves, the API stops accepting and the
//! worker drains, and `run` returns once both have stopped. If either ends
//! on its own first (an error, a panic, a loop that died), the other is
//! stopped the same way and `run` returns that error, so the process exits
//! and its supervisor restarts it instead of a half-server staying up.
//!
//! Every failure is a [`ServerError`], which knows the exit code the README
//! promises for it ([`ServerError::exit_code`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::api::{self, ApiState, HandlerCheck};
use crate::config::{Config, ConfigError};
use crate::sandbox::{Sandbox, SandboxError};
use crate::store::{Store, StoreError};
use crate::worker::{self, WorkerError};

/// What one server process runs: the API, a worker, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// Serve the HTTP API.
    pub api: bool,
    /// Run a worker on the configured queues.
    pub worker: bool,
}

impl Roles {
    /// `dtq serve`: the API and a worker.
    pub const SERVE: Roles = Roles {
        api: true,
        worker: true,
    };
    /// `dtq api`: the API only.
    pub const API: Roles = Roles {
        api: true,
        worker: false,
    };
    /// `dtq worker`: a worker only.
    pub const WORKER: Roles = Roles {
        api: false,
        worker: true,
    };
}

/// Why a server could not start, or stopped without being asked to.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A flag's value is unusable.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// The API tokens (`--tokens-file`, `DTQ_TOKENS`) cannot be read.
    #[error("invalid API tokens: {0}")]
    Tokens(String),
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
        "handlers directory {} does not exist (set --handlers or DTQ_HANDLERS)",
        .0.display()
    )]
    NoHandlersDir(PathBuf),
    /// The handlers directory cannot be listed.
    #[error("cannot read the handlers directory {}", dir.display())]
    HandlersDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: SandboxError,
    },
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
            | ServerError::NoHandlersDir(_)
            | ServerError::HandlersDir { .. }
            | ServerError::Worker(WorkerError::Config(_)) => 2,
            ServerError::Redis { .. } => 3,
            ServerError::Sandbox(_)
            | ServerError::Listen { .. }
            | ServerError::Api(_)
            | ServerError::Worker(_)
            | ServerError::WorkerReturned => 1,
        }
    }
}

/// Run the `roles` of a server configured by `config` until `shutdown`
/// resolves: check the configuration, connect to Redis, load the handlers
/// (for a worker), listen on `config.listen` (for the API), and serve.
pub async fn run(
    config: Config,
    roles: Roles,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    Server::prepare(config, roles)
        .await?
        .serve(None, shutdown)
        .await
}

/// A server ready to run: configuration checked, Redis connected, and (for
/// a worker) the handlers loaded. [`run`] in two steps, for callers that
/// reach into the store or the sandbox first, such as the test harness
/// (which loads its test guests too) or an embedding that binds its own
/// listener.
#[derive(Clone)]
pub struct Server {
    config: Config,
    roles: Roles,
    store: Store,
    sandbox: Option<Sandbox>,
}

impl Server {
    /// Check `config`, connect to Redis and, when `roles` has a worker,
    /// load the sandbox and the handlers directory (a bad file is skipped
    /// and logged in one line; the good ones load).
    pub async fn prepare(config: Config, roles: Roles) -> Result<Server, ServerError> {
        config.check()?;
        let store = Store::connect(&config.redis_url, config.store_settings())
            .await
            .map_err(|source| ServerError::Redis {
                url: config.redis_url.clone(),
                source,
            })?;
        let sandbox = if roles.worker {
            Some(load_sandbox(&config, &store)?)
        } else {
            None
        };
        Ok(Server {
            config,
            roles,
            store,
            sandbox,
        })
    }

    /// The same server with other roles; the handlers are loaded if a
    /// worker is asked for and they are not yet.
    pub fn with_roles(&self, roles: Roles) -> Result<Server, ServerError> {
        let sandbox = match (&self.sandbox, roles.worker) {
            (Some(sandbox), _) => Some(sandbox.clone()),
            (None, true) => Some(load_sandbox(&self.config, &self.store)?),
            (None, false) => None,
        };
        Ok(Server {
            roles,
            sandbox,
            ..self.clone()
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The sandbox with the handlers loaded, when the server has a worker
    /// (or had one when it was prepared).
    pub fn sandbox(&self) -> Option<&Sandbox> {
        self.sandbox.as_ref()
    }

    /// Serve until `shutdown` resolves, then stop both roles gracefully.
    /// The API is served on `listener`, or on `config.listen` when it is
    /// `None`; a server without the API role ignores it.
    pub async fn serve(
        self,
        listener: Option<TcpListener>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServerError> {
        let stop = CancellationToken::new();
        let api = match self.roles.api {
            true => Some(self.start_api(listener, &stop).await?),
            false => None,
        };
        // `prepare` and `with_roles` load the sandbox of every worker role.
        let worker = self.sandbox.filter(|_| self.roles.worker).map(|sandbox| {
            worker::run(
                self.store,
                sandbox,
                self.config,
                stop.clone().cancelled_owned(),
            )
        });
        supervise(api, worker, shutdown, stop).await
    }

    /// Bind (unless given a listener) and spawn the API.
    async fn start_api(
        &self,
        listener: Option<TcpListener>,
        stop: &CancellationToken,
    ) -> Result<JoinHandle<std::io::Result<()>>, ServerError> {
        let settings = self.config.api_settings().map_err(ServerError::Tokens)?;
        let listener = match listener {
            Some(listener) => listener,
            None => {
                let addr = self.config.listen;
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Listen { addr, source })?
            }
        };
        let has_handler: HandlerCheck = match &self.sandbox {
            Some(sandbox) => {
                let sandbox = sandbox.clone();
                Arc::new(move |task: &str| sandbox.has_handler(task))
            }
            // An API-only process checks the deployed files, so a module
            // copied into the directory is accepted without a restart.
            None => {
                let dir = self.config.handlers.clone();
                Arc::new(move |task: &str| dir.join(format!("{task}.wasm")).is_file())
            }
        };
        let state = ApiState {
            store: self.store.clone(),
            ingest: self.config.ingest_settings(),
            admin_token: self.config.admin_token.clone(),
            has_handler,
        };
        Ok(tokio::spawn(api::serve_with(
            listener,
            state,
            settings,
            stop.clone().cancelled_owned(),
        )))
    }
}

/// Wait for `shutdown` or for either role to end; then stop the other and
/// wait for it. The first role to end on its own is the error returned.
async fn supervise(
    api: Option<JoinHandle<std::io::Result<()>>>,
    worker: Option<impl Future<Output = Result<(), WorkerError>>>,
    shutdown: impl Future<Output = ()>,
    stop: CancellationToken,
) -> Result<(), ServerError> {
    let mut shutdown = pin!(shutdown);
    let mut worker = worker.map(Box::pin);
    let mut api = api;
    let mut failure = None;
    tokio::select! {
        () = &mut shutdown => info!("shutting down"),
        ended = async { api.as_mut().expect("guarded").await }, if api.is_some() => {
            api = None;
            failure = Some(api_failure(ended));
        }
        ended = async { worker.as_mut().expect("guarded").await }, if worker.is_some() => {
            worker = None;
            failure = Some(ended.map_or_else(ServerError::Worker, |()| ServerError::WorkerReturned));
        }
    }
    if let Some(e) = &failure {
        // Logged for whoever reads the log; the caller reports it too.
        warn!("stopping the server: {e}");
    }
    stop.cancel();
    if let Some(worker) = worker
        && let Err(e) = worker.await
    {
        keep_first(&mut failure, ServerError::Worker(e));
    }
    if let Some(api) = api {
        let ended = api.await;
        if !matches!(ended, Ok(Ok(()))) {
            keep_first(&mut failure, api_failure(ended));
        }
    }
    failure.map_or(Ok(()), Err)
}

/// The error of an API task that ended, however it ended.
fn api_failure(ended: Result<std::io::Result<()>, tokio::task::JoinError>) -> ServerError {
    ServerError::Api(match ended {
        Ok(Ok(())) => "it returned before shutdown".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Err(e) if e.is_panic() => format!("it panicked: {}", panic_message(e.into_panic())),
        Err(e) => e.to_string(),
    })
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(s) => *s,
        Err(panic) => match panic.downcast::<&'static str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "(no message)".to_owned(),
        },
    }
}

/// Keep the first failure; log the later ones, which would otherwise be
/// lost.
fn keep_first(failure: &mut Option<ServerError>, e: ServerError) {
    match failure {
        Some(_) => error!("also: {e}"),
        None => *failure = Some(e),
    }
}

/// The sandbox with the handlers directory loaded.
fn load_sandbox(config: &Config, store: &Store) -> Result<Sandbox, ServerError> {
    if !config.handlers.is_dir() {
        return Err(ServerError::NoHandlersDir(config.handlers.clone()));
    }
    let sandbox =
        Sandbox::new(config.sandbox_config(), store.connection()).map_err(ServerError::Sandbox)?;
    let started = Instant::now();
    let report = sandbox
        .load_dir(&config.handlers)
        .map_err(|source| ServerError::HandlersDir {
            dir: config.handlers.clone(),
            source,
        })?;
    // A bad module is one line in the log; the good ones run.
    for (file, error) in &report.failed {
        let error = error.to_string();
        let error = error.split_whitespace().collect::<Vec<_>>().join(" ");
        error!("handler skipped: {}: {error}", file.display());
    }
    if report.loaded.is_empty() {
        warn!(dir = %config.handlers.display(), "no <task>.wasm handlers loaded");
    }
    info!(handlers = ?report.loaded, skipped = report.failed.len(),
        elapsed_ms = started.elapsed().as_millis() as u64, "handlers loaded");
    Ok(sandbox)
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
        let redis = ServerError::Redis {
            url: "redis://x/".into(),
            source: StoreError::Redis(redis::RedisError::from(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))),
        };
        assert_eq!(redis.exit_code(), 3);
    }

    #[tokio::test]
    async fn a_bad_configuration_stops_before_reaching_redis() {
        let config = Config::from_args(["--concurrency", "0", "--redis", "redis://127.0.0.1:1/"])
            .expect("flags parse");
        let err = run(config, Roles::SERVE, std::future::pending())
            .await
            .expect_err("must fail");
        assert!(matches!(err, ServerError::Config(_)), "{err:?}");
        assert_eq!(err.exit_code(), 2);
    }
}
