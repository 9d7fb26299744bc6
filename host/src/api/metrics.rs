//! `GET /metrics`: the process's Prometheus registry ([`Metrics`]), with the
//! queue depths read from Redis at scrape time, under the API's Redis
//! deadline.
//!
//! The API serves it among its routes ([`serve_with_metrics`]); a process
//! without the API (`dtq worker`) can serve it alone on an address of its
//! own ([`serve_metrics`], `--metrics-listen`). Either way it needs the
//! `read` scope on every queue, since it shows every queue (open when no
//! token is configured, as the other read routes are), and a scrape whose
//! Redis read misses the deadline still answers, with `dtq_redis_up 0` and
//! no depths: the worker's own series matter most when Redis is in
//! trouble.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;

use super::auth::{Access, Scope};
use super::error::ApiError;
use super::openapi::ErrorBody;
use super::routes::{self, store_call};
use super::{ApiSettings, ApiState, Shared, router_with};
use crate::base::ErrorCode;
use crate::metrics::{CONTENT_TYPE, Metrics, read_depths};

/// `GET /metrics`.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "service",
    responses(
        (status = 200, description = "Prometheus metrics, OpenMetrics text (`application/openmetrics-text; version=1.0.0; charset=utf-8`)", content_type = "application/openmetrics-text", body = String),
        (status = 404, description = "`NOT_FOUND`: the server runs without metrics", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn scrape(
    State(shared): State<Shared>,
    metrics: Option<Extension<Metrics>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let access = shared.auth.authorize(&headers, Scope::Read, None)?;
    if access != Access::All {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "/metrics shows every queue: it needs a token with the read scope on all of them",
        ));
    }
    let Some(Extension(metrics)) = metrics else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "this server was started without metrics",
        ));
    };
    let store = shared.state.store.clone();
    let depths = match store_call(&shared, async move { read_depths(&store).await }).await {
        Ok(depths) => Some(depths),
        Err(e) => {
            tracing::warn!(error = %e.message, "/metrics: queue depths not read");
            None
        }
    };
    let text = metrics.render(depths.as_deref());
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response())
}

/// Serve the API with `/metrics` showing `metrics` (see
/// [`super::serve_with`]).
pub async fn serve_with_metrics(
    listener: TcpListener,
    state: ApiState,
    settings: ApiSettings,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router_with(state, &settings).layer(Extension(metrics));
    super::serve_router(listener, router, &settings, shutdown).await
}

/// Serve `/metrics` alone on `listener`, with the API's tokens and limits,
/// until `shutdown` resolves: for a process without the API. Every other
/// path is 404 `NOT_FOUND`.
pub async fn serve_metrics(
    listener: TcpListener,
    state: ApiState,
    settings: ApiSettings,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let shared = Shared {
        auth: Arc::new(super::auth::Auth::new(
            &settings.tokens,
            state.admin_token.as_deref(),
        )),
        state,
        limits: settings.limits,
        body_limit: 0,
        events: super::events::EventStreams::new(0),
        trusted_keys: None,
    };
    tracing::info!(
        addr = %listener.local_addr()?,
        open = settings.tokens.is_empty(),
        "metrics listening"
    );
    let router = Router::new()
        .route("/metrics", get(scrape))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(Extension(metrics))
        .layer(CatchPanicLayer::custom(routes::panicked))
        .with_state(shared);
    super::server::run(listener, router, settings.limits, shutdown).await
}
