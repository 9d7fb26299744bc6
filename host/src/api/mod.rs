//! The HTTP API: axum routes on a hyper server loop of our own.
//!
//! | route | scope | what |
//! |---|---|---|
//! | `POST /v1/queues/{queue}/tasks` | `submit` | submit (idempotency: `Idempotency-Key` header or `idempotency_key`) |
//! | `POST /v1/queues/{queue}/tasks/batch` | `submit` | submit up to [`crate::ingest::MAX_BATCH_ITEMS`] tasks: one result each, one Redis round trip (`api::batch`) |
//! | `GET /v1/queues/{queue}/tasks` | `read` | tasks newest first, by status and task name, paginated ([`Store::list_tasks`]) |
//! | `GET /v1/queues/{queue}/tasks/{id}` | `read` | a task: status, attempts, result, error, log, timestamps |
//! | `GET /v1/queues/{queue}/idempotency/{key}` | `read` | the task an idempotency key names (`api::lookup`) |
//! | `GET /v1/queues/{queue}/events` | `read` | lifecycle events, live, as Server-Sent Events ([`Store::read_events`]) |
//! | `POST /v1/queues/{queue}/tasks/{id}/cancel` | `cancel` | cancel a waiting or running task |
//! | `GET /v1/queues` | `read` | every queue's counts (those the token may read) |
//! | `GET /v1/queues/{queue}` | `read` | one queue's counts |
//! | `POST /v1/queues/{queue}/pause` | `admin` | pause the queue: it takes submissions, no worker starts its tasks (`api::pause`) |
//! | `POST /v1/queues/{queue}/resume` | `admin` | resume a paused queue |
//! | `PUT /v1/queues/{queue}/limits` | `admin` | set the queue's limits: `{"rate": {"limit", "per_ms"}, "group_concurrency"}` (`api::limits`) |
//! | `GET /v1/queues/{queue}/limits` | `read` | the queue's limits |
//! | `DELETE /v1/queues/{queue}/limits` | `admin` | lift the queue's limits |
//! | `PUT /v1/queues/{queue}/partitions` | `admin` on every queue | raise the queue's partition count (`api::partitions`) |
//! | `GET /v1/queues/{queue}/dlq` | `read` | dead-lettered tasks |
//! | `POST /v1/queues/{queue}/dlq/{id}/requeue` | `admin` | requeue a dead-lettered task |
//! | `PUT /v1/queues/{queue}/schedules/{name}` | `admin` on the queue, and a grant covering the task | set a periodic task: `{"cron", "task", "payload", "max_attempts", "timeout_ms"}`, UTC (`api::schedules`) |
//! | `GET /v1/queues/{queue}/schedules` | `read` | the queue's schedules, each with its next tick and last fired one |
//! | `DELETE /v1/queues/{queue}/schedules/{name}` | `admin` on the queue, and a grant covering its task | delete a schedule |
//! | `POST /v1/queues/{queue}/dlq/requeue` | `admin` | requeue dead-lettered tasks: `{"ids": [...]}` or `{"all": true}` (`api::dlq`) |
//! | `DELETE /v1/queues/{queue}/dlq` | `admin` | purge dead-lettered tasks: `{"ids": [...]}`, `{"all": true}` or `older_than_ms` (`api::dlq`) |
//! | `GET /v1/handlers` | `read` | each deployed task's active version and how many live workers run it; each live worker's handlers |
//! | `GET /v1/handlers/{task}` | `read` | a task's active version and history |
//! | `PUT /v1/handlers/{task}` | `deploy` covering task, namespace, hosts, quota; or `admin` on every queue | deploy: the body is the module (`application/wasm`), the query its settings, the `Dtq-Signature` header its signature (required with `--trusted-keys`) |
//! | `POST /v1/handlers/{task}/rollback` | as a deploy of the version restored | make an earlier version active (`{"to": digest}`, optional) |
//! | `DELETE /v1/handlers/{task}` | `deploy` covering the task; or `admin` on every queue | undeploy |
//! | `GET /healthz` | none | Redis reachable |
//! | `GET /v1/openapi.json` | none | the OpenAPI 3.1 document of these routes, generated from their handlers ([`openapi`]) |
//! | `GET /ui/` | none | the web dashboard, static files that call the routes above (`api::ui`) |
//! | `GET /metrics` | `read` (every queue) | Prometheus metrics ([`crate::metrics`]) |
//!
//! Every error has one body: `{"error": {"code", "message", "details"}}`
//! ([`error::ApiError`]), extractor rejections and unknown routes included.
//! Tokens and their scopes: [`Tokens`], [`Scope`]; what limits each route
//! (queues; tasks, namespaces, hosts and quota of the fleet routes) is
//! tabled in `auth.rs`. A queue's `admin` covers only that queue's things:
//! the handler routes, partitions and schedules of tasks it was not granted
//! answer it 403 `FORBIDDEN`.
//!
//! # Limits
//!
//! What each of [`ApiLimits`] stops, and where it is enforced:
//!
//! | limit | stops | by |
//! |---|---|---|
//! | header timeout | headers trickled a byte at a time (slowloris); idle connections, new or kept alive, hoarded | hyper's header-read timer |
//! | body timeout | a body trickled to hold a connection and its buffer | a deadline on reading the body |
//! | connection cap | connections piling up until the process runs out of file descriptors (and can no longer accept, reach Redis or open a module) | a semaphore before `accept` |
//! | Redis deadline | requests stalling for seconds while Redis is down or paused | a deadline on each request's store calls |
//! | body size | memory per request | a length limit on reading the body, a declared `Content-Length` checked first |
//! | event streams | subscribers piling up, each with a Redis connection of its own and an API connection | a semaphore taken before anything is opened; 503 `TOO_MANY_EVENT_STREAMS` past it |

mod auth;
mod batch;
mod dlq;
pub mod error;
mod events;
mod extract;
mod fleet;
mod handlers;
mod limits;
mod listing;
mod lookup;
mod metrics;
pub mod openapi;
mod partitions;
mod pause;
mod routes;
mod schedules;
mod server;
mod ui;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;
use utoipa_axum::routes;

pub use auth::{Scope, Tokens, TokensError};
pub use metrics::{serve_metrics, serve_with_metrics};

use crate::deploy::{Catalog, Registry, TrustedKeys};
use crate::ingest::IngestSettings;
use crate::sandbox::Sandbox;
use crate::store::Store;

/// Tells whether a handler is deployed for a task name.
pub type HandlerCheck = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// What the routes share.
#[derive(Clone)]
pub struct ApiState {
    /// The Redis side.
    pub store: Store,
    /// Submission limits and defaults.
    pub ingest: IngestSettings,
    /// The admin token (a token with the `admin` scope on every queue);
    /// `None`, and no scoped token with that scope, disables the admin
    /// routes.
    pub admin_token: Option<String>,
    /// Whether a task name has a handler: submissions of unknown tasks are
    /// refused before anything is written.
    pub has_handler: HandlerCheck,
    /// The deployed tasks, for their operator defaults (`max_attempts`).
    pub catalog: Catalog,
    /// What the handler routes need.
    pub deploy: DeployState,
}

/// What the handler routes need: the registry, and a sandbox to check a
/// module with before it is stored.
#[derive(Clone)]
pub struct DeployState {
    /// The handler registry.
    pub registry: Registry,
    /// Checks modules (compiles them, without running them).
    pub checker: Sandbox,
    /// Largest module accepted, bytes.
    pub max_module_bytes: usize,
}

/// Default page size of list routes (`?limit=`).
pub const DEFAULT_LIST_LIMIT: usize = 100;
/// Largest page size of list routes (`?limit=`); a larger one is refused
/// with 400 `INVALID_LIMIT`.
pub const MAX_LIST_LIMIT: usize = 1000;

/// The API's limits against slow, idle or numerous clients and a slow
/// Redis (the module documentation has the threat of each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// How long a connection may take to deliver a request's headers,
    /// counted from when it starts waiting for them: from the accept, and
    /// again from the end of each response. So it is the keep-alive idle
    /// timeout too: hyper runs one timer for both, and a connection that
    /// sends nothing is closed when it fires.
    pub header_timeout: Duration,
    /// How long a request may take to deliver its whole body; then it is
    /// answered 408 `REQUEST_TIMEOUT` and its connection closed.
    pub body_timeout: Duration,
    /// Connections served at once. Beyond it new connections are not
    /// accepted: they wait in the listen backlog until one closes, which
    /// the header timeout bounds for idle ones. The cap in force is at
    /// most half the process's soft file-descriptor limit
    /// (`RLIMIT_NOFILE`), so that accepting never fails for want of one.
    pub max_connections: usize,
    /// How long a request waits for Redis before it is answered 503
    /// `STORE_UNAVAILABLE`, instead of the store's own reconnect and
    /// response timeouts (seconds) while Redis is down.
    pub redis_timeout: Duration,
    /// Event streams (`GET /v1/queues/{q}/events`) served at once; past it
    /// a new one is answered 503 `TOO_MANY_EVENT_STREAMS`. Each holds a
    /// Redis connection of its own and one of the `max_connections`.
    pub max_event_streams: usize,
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            redis_timeout: Duration::from_secs(1),
            max_event_streams: 256,
        }
    }
}

/// How the API is served: its limits and its tokens.
#[derive(Debug, Clone, Default)]
pub struct ApiSettings {
    /// Limits against slow, idle or numerous clients and a slow Redis.
    pub limits: ApiLimits,
    /// Scoped API tokens; none: the API is open (except admin routes).
    pub tokens: Tokens,
    /// `--trusted-keys`: a deploy must be signed by one of them
    /// (`deploy::signing`); `None`, as before signing.
    pub trusted_keys: Option<TrustedKeys>,
}

/// What the handlers share: the state the server was given, the tokens to
/// check, the limits.
#[derive(Clone)]
struct Shared {
    state: ApiState,
    auth: Arc<auth::Auth>,
    limits: ApiLimits,
    /// Largest request body, bytes.
    body_limit: usize,
    /// The bound on concurrent event streams.
    events: events::EventStreams,
    /// The keys a deploy's signature must be by, if any.
    trusted_keys: Option<TrustedKeys>,
}

/// Slack over the payload limit for the rest of the submission body.
const BODY_OVERHEAD: usize = 64 * 1024;

/// The API's routes, with default settings: no scoped token (open, but for
/// the admin routes) and the default limits.
pub fn router(state: ApiState) -> Router {
    router_with(state, &ApiSettings::default())
}

/// The API's routes with `settings`.
pub fn router_with(state: ApiState, settings: &ApiSettings) -> Router {
    let body_limit = state.ingest.max_payload_bytes.saturating_mul(2) + BODY_OVERHEAD;
    let shared = Shared {
        auth: Arc::new(auth::Auth::new(
            &settings.tokens,
            state.admin_token.as_deref(),
        )),
        state,
        limits: settings.limits,
        body_limit,
        events: events::EventStreams::new(settings.limits.max_event_streams),
        trusted_keys: settings.trusted_keys.clone(),
    };
    let (router, _, _) = route_table().split();
    router
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(CatchPanicLayer::custom(routes::panicked))
        .with_state(shared)
}

/// The API's route table: what the router serves and what the OpenAPI
/// document ([`openapi`]) lists come from it. A route is registered from
/// its handler's `#[utoipa::path]` annotation with `.routes(routes!(h))`;
/// a plain `.route(path, get(h))` is served but not documented, which the
/// API's tests report.
fn route_table() -> openapi::ApiRouter {
    openapi::ApiRouter::new()
        .routes(routes!(routes::healthz))
        .routes(routes!(metrics::scrape))
        .routes(routes!(openapi::serve_document))
        .routes(routes!(routes::list_queues))
        .routes(routes!(routes::queue_stats))
        .routes(routes!(partitions::raise))
        .routes(routes!(pause::pause))
        .routes(routes!(pause::resume))
        .routes(routes!(limits::put, limits::get, limits::delete))
        .routes(routes!(routes::submit, listing::list))
        .routes(routes!(batch::submit))
        .routes(routes!(events::subscribe))
        .routes(routes!(routes::get_task))
        .routes(routes!(lookup::by_key))
        .routes(routes!(routes::cancel))
        .routes(routes!(routes::list_dlq, dlq::purge))
        .routes(routes!(dlq::requeue))
        .routes(routes!(routes::requeue))
        .routes(routes!(schedules::list))
        .routes(routes!(schedules::put, schedules::delete))
        .routes(routes!(handlers::list))
        .routes(routes!(
            handlers::history,
            handlers::deploy,
            handlers::undeploy
        ))
        .routes(routes!(handlers::rollback))
        .merge(ui::routes())
}

/// Serve the API on `listener` with default settings (see [`router`])
/// until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, ApiSettings::default(), shutdown).await
}

/// Serve the API on `listener` with `settings` until `shutdown` resolves;
/// then no connection is accepted, idle ones are closed, and requests in
/// flight are finished first (for at most the body timeout plus the Redis
/// deadline).
pub async fn serve_with(
    listener: TcpListener,
    state: ApiState,
    settings: ApiSettings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router_with(state, &settings);
    serve_router(listener, router, &settings, shutdown).await
}

/// Serve `router`, the API's (with layers of its own, maybe), as
/// [`serve_with`] does.
async fn serve_router(
    listener: TcpListener,
    router: Router,
    settings: &ApiSettings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if settings.tokens.is_empty() {
        tracing::warn!(
            "the API is open: no API token is configured (--tokens-file, DTQ_TOKENS_FILE, \
             DTQ_TOKENS), so anyone who reaches it can submit, read and cancel tasks; \
             configure tokens for anything but development"
        );
    } else {
        tracing::info!(tokens = settings.tokens.len(), "API tokens loaded");
    }
    // Event streams have no end of their own: they end when shutdown
    // begins, so that the graceful shutdown does not wait for them.
    let streams_stop = tokio_util::sync::CancellationToken::new();
    let router = router.layer(axum::Extension(events::StreamsStop(streams_stop.clone())));
    let shutdown = async move {
        shutdown.await;
        streams_stop.cancel();
    };
    server::run(listener, router, settings.limits, shutdown).await
}
