//! The HTTP API (axum).
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/queues/{queue}/tasks` | submit (idempotency: `Idempotency-Key` header or `idempotency_key`) |
//! | `GET /v1/queues/{queue}/tasks/{id}` | a task: status, attempts, result, error, log, timestamps |
//! | `POST /v1/queues/{queue}/tasks/{id}/cancel` | cancel a waiting or running task |
//! | `GET /v1/queues` | every queue's counts |
//! | `GET /v1/queues/{queue}` | one queue's counts |
//! | `GET /v1/queues/{queue}/dlq` | dead-lettered tasks |
//! | `POST /v1/queues/{queue}/dlq/{id}/requeue` | requeue a dead-lettered task (admin) |
//! | `GET /healthz` | Redis reachable |
//!
//! Every error has one body: `{"error": {"code", "message", "details"}}`
//! ([`error::ApiError`]).

mod auth;
pub mod error;
mod routes;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::ingest::IngestSettings;
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
    /// The admin token; `None` disables the admin routes.
    pub admin_token: Option<String>,
    /// Whether a task name has a handler: submissions of unknown tasks are
    /// refused before anything is written.
    pub has_handler: HandlerCheck,
}

/// Slack over the payload limit for the rest of the submission body.
const BODY_OVERHEAD: usize = 64 * 1024;

/// The API's routes.
pub fn router(state: ApiState) -> Router {
    let body_limit = state.ingest.max_payload_bytes.saturating_mul(2) + BODY_OVERHEAD;
    Router::new()
        .route("/healthz", get(routes::healthz))
        .route("/v1/queues", get(routes::list_queues))
        .route("/v1/queues/{queue}", get(routes::queue_stats))
        .route("/v1/queues/{queue}/tasks", post(routes::submit))
        .route("/v1/queues/{queue}/tasks/{id}", get(routes::get_task))
        .route("/v1/queues/{queue}/tasks/{id}/cancel", post(routes::cancel))
        .route("/v1/queues/{queue}/dlq", get(routes::list_dlq))
        .route("/v1/queues/{queue}/dlq/{id}/requeue", post(routes::requeue))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Serve the API on `listener` until `shutdown` resolves; requests in flight
/// are finished first.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tracing::info!(addr = %listener.local_addr()?, "API listening");
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
