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

mod error;
mod supervise;

pub use error::ServerError;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{self, ApiState, DeployState, HandlerCheck};
use crate::config::Config;
use crate::deploy::{Catalog, Registry, Watcher};
use crate::metrics::Metrics;
use crate::sandbox::Sandbox;
use crate::store::Store;
use crate::worker;
use supervise::{either, supervise};

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

/// Run the `roles` of a server configured by `config` until `shutdown`
/// resolves: check the configuration, connect to Redis, load the handlers
/// (for a worker), listen on `--listen` (for the API), and serve.
pub async fn run(
    config: Config,
    roles: Roles,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let ran = match Server::prepare(config, roles).await {
        Ok(server) => server.serve(None, shutdown).await,
        Err(e) => Err(e),
    };
    // The spans of the last moments, sent before the process exits.
    crate::telemetry::shutdown().await;
    ran
}

/// A server ready to run: configuration checked, Redis connected, and the
/// handlers loaded (for a worker) or known (for the API). [`run`] in two
/// steps, for callers that reach into the store or the sandbox first, such
/// as the test harness (which loads its test guests too) or an embedding
/// that binds its own listener.
#[derive(Clone)]
pub struct Server {
    config: Config,
    roles: Roles,
    store: Store,
    /// The worker's sandbox, with its handlers.
    sandbox: Option<Sandbox>,
    /// Checks deployed modules: the worker's sandbox, or one of its own.
    checker: Sandbox,
    registry: Registry,
    catalog: Catalog,
    /// The process's one metrics registry: the worker records into it, the
    /// API (and `--metrics-listen`) serves it. Clones share it.
    metrics: Metrics,
    /// Held by the `serve` that runs the `--metrics-listen` listener: clones
    /// served at once (an API and a worker, as the test harness runs them)
    /// bind it once.
    metrics_listener: Arc<tokio::sync::Mutex<()>>,
    /// Keeps the handlers in step with the registry and the directory.
    /// Clones share it, and only one `serve` at a time runs it.
    watcher: Arc<tokio::sync::Mutex<Watcher>>,
}

impl Server {
    /// Check `config`, connect to Redis, and read what is deployed (from
    /// the registry, and the handlers directory if there is one): a worker
    /// loads it (a bad module is skipped and logged in one line; the good
    /// ones load), an API knows it.
    pub async fn prepare(config: Config, roles: Roles) -> Result<Server, ServerError> {
        config.check()?;
        let trusted_keys = config
            .deploy
            .trusted_keys()
            .map_err(ServerError::TrustedKeys)?;
        if let Some(dir) = &config.deploy.handlers
            && !dir.is_dir()
        {
            return Err(ServerError::NoHandlersDir(dir.clone()));
        }
        let redis = |source| ServerError::Redis {
            url: config.store.redis_url.clone(),
            source,
        };
        let store = Store::connect(&config.store.redis_url, config.store_settings())
            .await
            .map_err(redis)?;
        // Modules are large: their reads and writes get a connection, and a
        // timeout, of their own.
        let registry = Registry::new(
            store
                .dedicated_connection(REGISTRY_TIMEOUT)
                .await
                .map_err(redis)?,
        );
        let sandbox = match roles.worker {
            true => Some(new_sandbox(&config, &store, false)?),
            false => None,
        };
        let checker = match &sandbox {
            Some(sandbox) => sandbox.clone(),
            None => new_sandbox(&config, &store, true)?,
        };
        let catalog = Catalog::default();
        let metrics = Metrics::new(&store, catalog.clone());
        if let Some(sandbox) = &sandbox {
            metrics.set_sandbox(sandbox.clone());
        }
        let mut watcher = new_watcher(&config, &store, &registry, &catalog, sandbox.clone())
            .with_trusted_keys(trusted_keys);
        let started = Instant::now();
        watcher.sync().await.map_err(ServerError::Registry)?;
        let tasks = catalog.tasks();
        if tasks.is_empty() {
            warn!("no handlers: deploy one with `dtq deploy`, or give --handlers a directory");
        }
        info!(handlers = ?tasks, failed = watcher.failed().len(),
            elapsed_ms = started.elapsed().as_millis() as u64, "handlers known");
        Ok(Server {
            config,
            roles,
            store,
            sandbox,
            checker,
            registry,
            catalog,
            metrics,
            metrics_listener: Arc::default(),
            watcher: Arc::new(tokio::sync::Mutex::new(watcher)),
        })
    }

    /// The same server with other roles; a sandbox is made if a worker is
    /// asked for and there is none yet (it loads the handlers once served).
    pub fn with_roles(&self, roles: Roles) -> Result<Server, ServerError> {
        if !roles.worker || self.sandbox.is_some() {
            return Ok(Server {
                roles,
                ..self.clone()
            });
        }
        let sandbox = new_sandbox(&self.config, &self.store, false)?;
        self.metrics.set_sandbox(sandbox.clone());
        let watcher = new_watcher(
            &self.config,
            &self.store,
            &self.registry,
            &self.catalog,
            Some(sandbox.clone()),
        )
        .with_trusted_keys(
            self.config
                .deploy
                .trusted_keys()
                .map_err(ServerError::TrustedKeys)?,
        );
        Ok(Server {
            roles,
            checker: sandbox.clone(),
            sandbox: Some(sandbox),
            watcher: Arc::new(tokio::sync::Mutex::new(watcher)),
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

    /// The handler registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The process's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Serve until `shutdown` resolves, then stop both roles gracefully.
    /// The API is served on `listener`, or on `--listen` when it is
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
        let metrics = match (
            self.config.api.metrics_listen,
            self.metrics_listener.clone().try_lock_owned(),
        ) {
            (Some(addr), Ok(held)) => match self.start_metrics(addr, held, &stop).await {
                Ok(metrics) => Some(metrics),
                Err(e) => {
                    // The API may be serving already.
                    stop.cancel();
                    return Err(e);
                }
            },
            _ => None,
        };
        let http = either(api, metrics, stop.clone());
        // Another serve of a clone of this server may run the watcher
        // already; one is enough.
        let watching = self
            .watcher
            .clone()
            .try_lock_owned()
            .ok()
            .map(|mut watcher| {
                let stop = stop.clone();
                tokio::spawn(async move { watcher.run(stop).await })
            });
        // `prepare` and `with_roles` make the sandbox of every worker role.
        let worker = self.sandbox.filter(|_| self.roles.worker).map(|sandbox| {
            worker::run_with_metrics(
                self.store,
                sandbox,
                self.config.worker(),
                self.metrics.worker(),
                stop.clone().cancelled_owned(),
            )
        });
        let ended = supervise(http, worker, shutdown, stop.clone()).await;
        stop.cancel();
        if let Some(watching) = watching {
            let _ = watching.await;
        }
        ended
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
                let addr = self.config.api.listen;
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Listen { addr, source })?
            }
        };
        Ok(tokio::spawn(api::serve_with_metrics(
            listener,
            self.api_state(),
            settings,
            self.metrics.clone(),
            stop.clone().cancelled_owned(),
        )))
    }

    /// Bind `addr` and spawn the listener that serves `/metrics` alone
    /// (`--metrics-listen`), with the API's tokens and limits.
    async fn start_metrics(
        &self,
        addr: SocketAddr,
        held: tokio::sync::OwnedMutexGuard<()>,
        stop: &CancellationToken,
    ) -> Result<JoinHandle<std::io::Result<()>>, ServerError> {
        let settings = self.config.api_settings().map_err(ServerError::Tokens)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServerError::Listen { addr, source })?;
        let serve = api::serve_metrics(
            listener,
            self.api_state(),
            settings,
            self.metrics.clone(),
            stop.clone().cancelled_owned(),
        );
        Ok(tokio::spawn(async move {
            let served = serve.await;
            drop(held);
            served.map_err(|e| {
                std::io::Error::other(format!("the metrics listener on {addr} failed: {e}"))
            })
        }))
    }

    /// What the API's routes share.
    fn api_state(&self) -> ApiState {
        // What the registry or the directory has, or this process runs
        // (an embedding may load handlers of its own).
        let catalog = self.catalog.clone();
        let sandbox = self.sandbox.clone();
        let has_handler: HandlerCheck = Arc::new(move |task: &str| {
            catalog.has(task) || sandbox.as_ref().is_some_and(|s| s.has_handler(task))
        });
        ApiState {
            store: self.store.clone(),
            ingest: self.config.ingest_settings(),
            admin_token: self.config.api.admin_token.clone(),
            has_handler,
            catalog: self.catalog.clone(),
            deploy: DeployState {
                registry: self.registry.clone(),
                checker: self.checker.clone(),
                max_module_bytes: self.config.deploy.max_module_bytes(),
            },
        }
    }
}

/// Timeout of the registry's connection: a module may be tens of MiB.
const REGISTRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A sandbox for a worker, or (`checker`) one that only checks deployed
/// modules: the same engine settings, a pool of one slot.
fn new_sandbox(config: &Config, store: &Store, checker: bool) -> Result<Sandbox, ServerError> {
    let mut sandbox_config = config.sandbox_config();
    if checker {
        sandbox_config.max_concurrent_calls = 1;
    }
    Sandbox::new(sandbox_config, store.connection()).map_err(ServerError::Sandbox)
}

fn new_watcher(
    config: &Config,
    store: &Store,
    registry: &Registry,
    catalog: &Catalog,
    sandbox: Option<Sandbox>,
) -> Watcher {
    let queues = match sandbox {
        Some(_) => config.worker().queues,
        None => Vec::new(),
    };
    Watcher::new(
        registry.clone(),
        store.backend().clone(),
        catalog.clone(),
        sandbox,
        config.deploy.handlers.clone(),
        config.deploy.reload_interval(),
        queues,
    )
}

/// Log to stderr what `DTQ_LOG` (an `EnvFilter`, default `info`) lets
/// through, as text or (`json`) one JSON object per line. Does nothing if
/// the process already has a subscriber.
pub fn init_tracing(format: &str) {
    init_subscriber(format, None);
}

/// [`init_tracing`] with `config`'s `--log-format`, and, with an OTLP
/// endpoint (`--otlp-endpoint`), the export of the spans of
/// [`crate::telemetry`] (see there): what the `dtq` binary logs and traces.
/// Without an endpoint no tracing layer is installed at all. Must run
/// inside a Tokio runtime; [`run`] flushes the spans when it returns.
pub fn init_tracing_with(config: &Config) {
    // A bad endpoint is refused by the configuration's check, which `run`
    // makes before anything else.
    let traces = config.telemetry.settings().ok().flatten();
    init_subscriber(&config.log_format, traces.as_ref());
}

/// The process's subscriber: the logs as `format` says, and the traces
/// to `traces`, if given.
fn init_subscriber(format: &str, traces: Option<&crate::telemetry::Settings>) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _, fmt};

    let filter = EnvFilter::try_from_env("DTQ_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = fmt::layer().with_writer(std::io::stderr);
    let logs = match format {
        // timestamp, level, target, the event's fields (message included)
        // at the top, and the fields of the span it is in under `span`
        // (with `trace_id` inside a traced span).
        "json" => logs
            .with_ansi(false)
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_filter(filter)
            .boxed(),
        // Colour only for a person at a terminal, never into a file or a
        // pipe.
        _ => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter)
            .boxed(),
    };
    let (layer, exporter, mut failed) = match traces.map(crate::telemetry::start) {
        Some(Ok((layer, exporter))) => (Some(layer), Some(exporter), None),
        Some(Err(e)) => (None, None, Some(e)),
        None => (None, None, None),
    };
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(layer)
        .try_init()
        .is_ok();
    if let Some(exporter) = exporter {
        match installed {
            true => failed = crate::telemetry::activate(exporter).err(),
            false => failed = Some(crate::telemetry::TelemetryError::Started),
        }
    }
    if let Some(e) = failed {
        warn!(error = %e, "tracing is off");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
