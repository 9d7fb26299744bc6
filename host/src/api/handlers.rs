//! The routes of the handler registry: list, history, deploy, rollback,
//! undeploy. Changing what the fleet runs is running code on it, so every
//! change needs a deploy grant that covers the task and the settings the
//! version runs with, or admin on every queue (`auth.rs`); listing needs
//! `read`.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Query, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use utoipa::ToSchema;

use super::Shared;
use super::auth::Scope;
use super::error::ApiError;
use super::extract::ApiPath;
use super::openapi::ErrorBody;
use super::openapi::schemas::{
    ActiveHandler, DeploySettings as DeployQuery, Deployed, HandlerHistory, HandlerList,
    HandlerPath, Undeployed,
};
use crate::base::ErrorCode;
use crate::base::now_ms;
use crate::deploy::{
    DeploySettings, Entry, FleetReport, REPORT_LIVE_MS, RegistryError, SIGNATURE_HEADER, Version,
};
use crate::ingest::validate_task_name;

type ApiResult = Result<Response, ApiError>;

/// `{"task", "digest", "size", "deployed_at", "action", "settings"}` of an
/// active entry.
pub(crate) fn active_json(task: &str, entry: &Entry) -> Value {
    let mut value = entry_json(entry);
    if let Some(fields) = value.as_object_mut() {
        fields.remove("at");
    }
    value["task"] = json!(task);
    value["deployed_at"] = json!(entry.at);
    value
}

/// `{"action", "at", "digest", "size", "settings"}` of a history entry
/// (an undeploy has no version fields).
fn entry_json(entry: &Entry) -> Value {
    let mut value = json!({"action": entry.action, "at": entry.at});
    if let Some(v) = &entry.version {
        value["digest"] = json!(v.digest);
        value["size"] = json!(v.size);
        value["settings"] = json!(v.settings);
        value["fingerprint"] = json!(v.fingerprint);
    }
    value
}

/// Whether `worker` runs `entry`'s version of `task`: the same module with
/// the same settings. A worker too old to report fingerprints is judged by
/// the digest alone.
fn runs(worker: &FleetReport, task: &str, entry: &Entry) -> bool {
    let Some(version) = &entry.version else {
        return false;
    };
    match worker.fingerprints.get(task) {
        Some(fingerprint) => *fingerprint == version.fingerprint,
        None if worker.capacity.is_some() => false,
        None => worker.loaded.get(task) == Some(&version.digest),
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        let message = e.to_string();
        match e {
            RegistryError::Redis(e) => crate::store::StoreError::from(e).into(),
            RegistryError::UnknownTask(task) => {
                ApiError::new(ErrorCode::UnknownTask, message).with_details(json!({"task": task}))
            }
            RegistryError::UnknownVersion { task, digest } => {
                ApiError::new(ErrorCode::UnknownVersion, message)
                    .with_details(json!({"task": task, "digest": digest}))
            }
            RegistryError::NoEarlierVersion(task) => {
                ApiError::new(ErrorCode::NoEarlierVersion, message)
                    .with_details(json!({"task": task}))
            }
            RegistryError::Corrupt(_) => ApiError::internal(message),
        }
    }
}

/// `GET /v1/handlers`: each deployed task's active version, with how many
/// live workers run it, and what each live worker runs.
#[utoipa::path(
    operation_id = "list_handlers",
    get,
    path = "/v1/handlers",
    tag = "handlers",
    responses((status = 200, description = "Every deployed task's active version; what each live worker runs", body = HandlerList)),
    security(("bearer" = ["read"])),
)]
pub(super) async fn list(State(shared): State<Shared>, headers: HeaderMap) -> ApiResult {
    shared.auth.authorize(&headers, Scope::Read, None)?;
    let registry = &shared.state.deploy.registry;
    let (_, active) = registry.active().await?;
    let fleet = registry.fleet(REPORT_LIVE_MS).await?;
    let workers: Vec<_> = fleet.iter().filter(|r| !r.queues.is_empty()).collect();
    let mut handlers = Vec::new();
    for (task, entry) in active {
        let entry = entry?;
        let mut value = active_json(&task, &entry);
        let running = workers.iter().filter(|w| runs(w, &task, &entry)).count();
        value["workers"] = json!({"running": running, "total": workers.len()});
        handlers.push(value);
    }
    Ok(Json(json!({"handlers": handlers, "workers": workers})).into_response())
}

/// `GET /v1/handlers/{task}`: the active version and the history.
#[utoipa::path(
    get,
    path = "/v1/handlers/{task}",
    tag = "handlers",
    params(HandlerPath),
    responses(
        (status = 200, description = "The active version and the history, newest first", body = HandlerHistory),
        (status = 400, description = "`INVALID_TASK_NAME`; `UNKNOWN_TASK`: never deployed", body = ErrorBody),
    ),
    security(("bearer" = ["read"])),
)]
pub(super) async fn history(
    State(shared): State<Shared>,
    ApiPath(task): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult {
    shared.auth.authorize(&headers, Scope::Read, None)?;
    validate_task_name(&task)?;
    let (active, history) = shared.state.deploy.registry.history(&task).await?;
    if active.is_none() && history.is_empty() {
        return Err(RegistryError::UnknownTask(task).into());
    }
    let history: Vec<Value> = history.iter().map(entry_json).collect();
    Ok(Json(json!({
        "task": task,
        "active": active.map(|e| active_json(&task, &e)),
        "history": history,
    }))
    .into_response())
}

/// `PUT /v1/handlers/{task}`: the body is the module; the query holds the
/// settings (and `force=true`). Checked (it compiles, fits the handler
/// world, its imports are provided, its namespace is granted, and some live
/// worker can honour its settings) before it is stored: a refused module
/// never reaches a worker.
///
/// A refusal decided before the body is read (the token, the task name,
/// the settings, the workers) still reads the body, discarding it, up to
/// the module limit: answered early and closed, a client still sending
/// would see a reset connection instead of the answer.
#[utoipa::path(
    put,
    path = "/v1/handlers/{task}",
    tag = "handlers",
    params(
        HandlerPath,
        DeployQuery,
        ("force" = Option<bool>, Query, description = "Deploy even when no live worker can honour the settings (its tasks wait for one that can)"),
    ),
    request_body(content = super::openapi::Module, content_type = "application/wasm", description = "The component (`wasm32-wasip2`, the handler world)"),
    responses(
        (status = 201, description = "Deployed", body = Deployed),
        (status = 200, description = "The same module and settings were active already (`unchanged: true`)", body = Deployed),
        (status = 400, description = "`INVALID_TASK_NAME`, `INVALID_SETTINGS`, `INVALID_QUERY`", body = ErrorBody),
        (status = 408, description = "`REQUEST_TIMEOUT`", body = ErrorBody),
        (status = 403, description = "`FORBIDDEN`: no deploy grant covers the task, namespace, hosts or quota; `SIGNATURE_REQUIRED`, `SIGNATURE_INVALID` (`--trusted-keys`)", body = ErrorBody),
        (status = 409, description = "`NO_WORKER_CAN_RUN`: no live worker can honour the settings (each worker's reason in `details.workers`); `force=true` deploys anyway", body = ErrorBody),
        (status = 413, description = "`MODULE_TOO_LARGE`", body = ErrorBody),
        (status = 422, description = "`INVALID_MODULE`: it cannot run as a handler (the reason in the message)", body = ErrorBody),
    ),
    security(("bearer" = ["deploy"])),
)]
pub(super) async fn deploy(
    State(shared): State<Shared>,
    ApiPath(task): ApiPath<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let mut body = Some(body);
    let answer = check_and_store(&shared, task, query, &headers, &mut body).await;
    if answer.is_err()
        && let Some(body) = body.take()
    {
        discard(&shared, &headers, body).await;
    }
    answer
}

/// The deploy itself; `body` is taken once it is read.
async fn check_and_store(
    shared: &Shared,
    task: String,
    query: Option<String>,
    headers: &HeaderMap,
    body: &mut Option<Body>,
) -> ApiResult {
    let fleet = shared.auth.fleet(headers)?;
    validate_task_name(&task)?;
    let (settings, force) = deploy_query(query.as_deref())?;
    settings.check().map_err(|e| {
        ApiError::new(ErrorCode::InvalidSettings, e.to_string())
            .with_details(json!({"setting": e.setting}))
    })?;
    fleet.may_activate(&task, &settings)?;
    let warning = check_workers(shared, &task, &settings, force).await?;
    let deploy = &shared.state.deploy;
    let limit = deploy.max_module_bytes;
    let too_large = || {
        ApiError::new(
            ErrorCode::ModuleTooLarge,
            format!("the module is over the limit of {limit} bytes (--max-module-mib)"),
        )
        .with_details(json!({"limit": limit}))
    };
    let body = body.take().unwrap_or_default();
    let wasm = super::routes::read_limited(shared, headers, body, limit, too_large).await?;
    let signature = check_signature(shared, &task, &wasm, &settings, headers)?;

    let checker = deploy.checker.clone();
    let (t, w, s) = (task.clone(), wasm.clone(), settings.handler_settings());
    let checked = tokio::task::spawn_blocking(move || checker.check(&t, &w, &s))
        .await
        .map_err(|e| ApiError::internal(format!("the module check failed: {e}")))?;
    if let Err(e) = checked {
        let reason = e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        return Err(ApiError::new(ErrorCode::InvalidModule, reason)
            .with_details(json!({"task": task, "size": wasm.len()})));
    }

    let version = Version::signed(&wasm, settings, signature);
    let deployed = deploy
        .registry
        .deploy_version(&task, &wasm, version, now_ms())
        .await?;
    shared
        .state
        .catalog
        .note(&task, deployed.active.version.as_ref());
    let mut body = active_json(&task, &deployed.active);
    body["unchanged"] = json!(deployed.unchanged);
    body["previous"] = json!(
        deployed
            .previous
            .filter(|_| !deployed.unchanged)
            .and_then(|e| e.version)
            .map(|v| v.digest)
    );
    if let Some(warning) = warning {
        body["warning"] = json!(warning);
    }
    let status = if deployed.unchanged {
        StatusCode::OK
    } else {
        tracing::info!(task, digest = %body["digest"], "handler deployed");
        StatusCode::CREATED
    };
    Ok((status, Json(body)).into_response())
}

/// The settings of a deploy's query, and its `force`.
fn deploy_query(query: Option<&str>) -> Result<(DeploySettings, bool), ApiError> {
    let mut force = false;
    let mut rest = Vec::new();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("force", "true" | "1" | "") => force = true,
            ("force", "false" | "0") => force = false,
            ("force", other) => {
                return Err(ApiError::new(
                    ErrorCode::InvalidQuery,
                    format!("force: {other:?} is not true or false"),
                ));
            }
            _ => rest.push(pair),
        }
    }
    let uri: axum::http::Uri = format!("/?{}", rest.join("&"))
        .parse()
        .map_err(|e| ApiError::new(ErrorCode::InvalidQuery, format!("the query: {e}")))?;
    let Query(settings) = Query::<DeploySettings>::try_from_uri(&uri)?;
    Ok((settings, force))
}

/// Refuse settings no live worker can honour (`NO_WORKER_CAN_RUN`, each
/// worker's reason in `details.workers`), unless `force`. With no live
/// worker at all there is nobody to ask (deploying before starting the
/// workers is a normal order): accepted, with the warning returned.
async fn check_workers(
    shared: &Shared,
    task: &str,
    settings: &DeploySettings,
    force: bool,
) -> Result<Option<String>, ApiError> {
    let fleet = shared.state.deploy.registry.fleet(REPORT_LIVE_MS).await?;
    let workers: Vec<&FleetReport> = fleet.iter().filter(|r| !r.queues.is_empty()).collect();
    if workers.is_empty() {
        return Ok(Some(
            "no live worker: the settings are checked by each worker when it loads the handler"
                .into(),
        ));
    }
    let mut reasons = serde_json::Map::new();
    for worker in &workers {
        // A worker too old to report its capacity is taken to run it.
        match worker.capacity.and_then(|c| settings.unrunnable_on(&c)) {
            Some(reason) => reasons.insert(worker.id.clone(), json!(reason)),
            None => return Ok(None),
        };
    }
    if force {
        tracing::warn!(task, "deployed with force: no live worker can run it");
        return Ok(Some(format!(
            "no live worker can run it ({} refused it): its tasks wait for one that can",
            reasons.len()
        )));
    }
    Err(ApiError::new(
        ErrorCode::NoWorkerCanRun,
        format!(
            "no live worker can run {task} with these settings ({} refused it; see details); \
             deploy with force to store it anyway",
            reasons.len()
        ),
    )
    .with_details(json!({"task": task, "workers": reasons})))
}

/// Read what is left of a refused deploy's body, discarding it, within the
/// body timeout and the module limit; a body declared over the limit is
/// not read (the connection closes).
async fn discard(shared: &Shared, headers: &HeaderMap, body: Body) {
    use http_body_util::BodyExt as _;

    let limit = shared.state.deploy.max_module_bytes as u64;
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return;
    }
    let drain = async {
        let mut body = body;
        let mut read = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                read += data.len() as u64;
                if read > limit {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(shared.limits.body_timeout, drain).await;
}

/// With `--trusted-keys`, the deploy's `Dtq-Signature`, checked: 403
/// `SIGNATURE_REQUIRED` without one, `SIGNATURE_INVALID` for one no trusted
/// key made over this task, module and settings. Without trusted keys the
/// header is ignored, as before signing.
fn check_signature(
    shared: &Shared,
    task: &str,
    wasm: &[u8],
    settings: &DeploySettings,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    let Some(keys) = &shared.trusted_keys else {
        return Ok(None);
    };
    let signature = headers
        .get(SIGNATURE_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let digest = hex::encode(Sha256::digest(wasm));
    match keys.verify(task, &digest, settings, signature.as_deref()) {
        Ok(key) => {
            tracing::info!(task, key, "deploy signature verified");
            Ok(signature)
        }
        Err(e) => {
            let code = match e.is_missing() {
                true => ErrorCode::SignatureRequired,
                false => ErrorCode::SignatureInvalid,
            };
            Err(ApiError::new(code, e.to_string())
                .with_details(json!({"task": task, "digest": digest})))
        }
    }
}

/// The body of a rollback (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    /// The digest to return to; default: the newest different version.
    to: Option<String>,
}

/// `POST /v1/handlers/{task}/rollback`, optional body `{"to": digest}`.
#[utoipa::path(
    post,
    path = "/v1/handlers/{task}/rollback",
    tag = "handlers",
    params(HandlerPath),
    request_body(content = Option<RollbackRequest>, description = "`{\"to\": digest}`, or no body for the newest version that differs from the active one"),
    responses(
        (status = 200, description = "The version now active", body = ActiveHandler),
        (status = 400, description = "`INVALID_TASK_NAME`, `INVALID_REQUEST`; `UNKNOWN_TASK`: never deployed", body = ErrorBody),
        (status = 404, description = "`UNKNOWN_VERSION`", body = ErrorBody),
        (status = 409, description = "`NO_EARLIER_VERSION`", body = ErrorBody),
    ),
    security(("bearer" = ["deploy"])),
)]
pub(super) async fn rollback(
    State(shared): State<Shared>,
    ApiPath(task): ApiPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    let fleet = shared.auth.fleet(&headers)?;
    validate_task_name(&task)?;
    fleet.may_touch(&task)?;
    // `null`, as a client serializing "no body" may send, is no body.
    let request: RollbackRequest = if body.iter().all(u8::is_ascii_whitespace)
        || body.trim_ascii() == b"null"
    {
        RollbackRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("request body: {e}")))?
    };
    if !fleet.is_operator()
        && let Some(target) = rollback_target(&shared, &task, request.to.as_deref()).await?
    {
        fleet.may_activate(&task, &target.settings)?;
    }
    let entry = shared
        .state
        .deploy
        .registry
        .rollback(&task, request.to.as_deref(), now_ms())
        .await?;
    shared.state.catalog.note(&task, entry.version.as_ref());
    tracing::info!(task, "handler rolled back");
    Ok(Json(active_json(&task, &entry)).into_response())
}

/// The version a rollback of `task` to `to` would make active, as
/// `handler_rollback.lua` picks it: the newest entry with digest `to`, or
/// the newest whose module or settings differ from the active version's.
/// `None` when there is none (the rollback itself then answers why).
///
/// A rollback restores a version's settings with its module, so a limited
/// deploy grant must cover them as it would a deploy of them. The version
/// is read before the rollback runs: a deploy of the same task landing in
/// between could change which one it picks.
async fn rollback_target(
    shared: &Shared,
    task: &str,
    to: Option<&str>,
) -> Result<Option<Version>, ApiError> {
    let (active, history) = shared.state.deploy.registry.history(task).await?;
    let current = active.and_then(|e| e.version).map(|v| v.fingerprint);
    Ok(history
        .into_iter()
        .filter_map(|e| e.version)
        .find(|v| match to {
            Some(digest) => v.digest == digest,
            None => Some(&v.fingerprint) != current.as_ref(),
        }))
}

/// `DELETE /v1/handlers/{task}`.
#[utoipa::path(
    delete,
    path = "/v1/handlers/{task}",
    tag = "handlers",
    params(HandlerPath),
    responses(
        (status = 200, description = "Undeployed (`undeployed: false` when no version was active)", body = Undeployed),
        (status = 400, description = "`INVALID_TASK_NAME`", body = ErrorBody),
    ),
    security(("bearer" = ["deploy"])),
)]
pub(super) async fn undeploy(
    State(shared): State<Shared>,
    ApiPath(task): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult {
    let fleet = shared.auth.fleet(&headers)?;
    validate_task_name(&task)?;
    fleet.may_touch(&task)?;
    let undeployed = shared
        .state
        .deploy
        .registry
        .undeploy(&task, now_ms())
        .await?;
    if undeployed {
        shared.state.catalog.note(&task, None);
        tracing::info!(task, "handler undeployed");
    }
    Ok(Json(json!({"task": task, "undeployed": undeployed})).into_response())
}
