//! `GET /v1/openapi.json`: the OpenAPI 3.1 document of the HTTP API,
//! generated from the code.
//!
//! # How a route gets into the document
//!
//! Each route handler carries `#[utoipa::path(...)]` (method, path,
//! parameters, request body, responses, security), and the router
//! registers it from that annotation: `.routes(routes!(module::handler))`
//! in `api::route_table` (utoipa-axum's `OpenApiRouter`). The method and
//! the path are written once, in the annotation, and both the router and
//! the document take them from there, so a documented route cannot be
//! served at another path or with another method than the document says.
//! Documenting a route that is registered with a plain
//! `.route(path, get(handler))` is two lines: the annotation on the
//! handler, and `.routes(routes!(handler))` in place of the `.route(...)`.
//!
//! A route still registered with a plain `.route(...)` is served but not
//! documented. `ApiRouter` records its path, and the API's tests probe
//! every method on every recorded path: a method that is served and not
//! in the document fails them, naming it. So the one route table in
//! `api::route_table` is what the router serves and what the check reads.
//!
//! # What the document holds
//!
//! The handlers build most bodies with `json!`; `schemas` gives each
//! body a type of its own that documents its fields, and the tests
//! validate real responses against them, with every documented object
//! closed to fields it does not list, so that a field added to a body
//! without its schema fails them. The error codes ([`ErrorCode`]) and task
//! statuses ([`TaskStatus`]) are enums built from their own `ALL` lists,
//! so they cannot drift. The errors every route may answer (401 and 403
//! on routes that take a token, 500, 503) are added to each operation
//! here (`add_common_responses`); the annotations list the route's own.
//!
//! The document needs no token: it describes the API's shape, not its
//! data, is the same for every deployment, and is what a client generator
//! or an API browser fetches before it has credentials.

use std::borrow::Cow;
use std::sync::LazyLock;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, KnownFormat, Object, ObjectBuilder, OpenApi as Document, Ref, RefOr, Required,
    ResponseBuilder, Schema, SchemaFormat, Type,
};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};

use super::Shared;
use super::error::ApiError;
use crate::base::ErrorCode;
use crate::store::TaskStatus;

/// The route of the document itself.
pub const OPENAPI_PATH: &str = "/v1/openapi.json";

/// The name of the bearer-token security scheme in the document.
pub(super) const BEARER: &str = "bearer";

/// The document's fixed part: what no route annotation gives.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "dtq",
        description = "A distributed task queue on Redis whose handlers run as sandboxed \
                       WebAssembly components. Every error has one body, `ErrorBody`; its \
                       `code` is one of `ErrorCode` and gives the status.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    components(schemas(ErrorBody, schemas::QueueEvent, schemas::EventGap)),
    modifiers(&BearerScheme),
    tags(
        (name = "tasks", description = "Submit, read, list, cancel and follow tasks"),
        (name = "queues", description = "Queue counts and dead letters"),
        (name = "handlers", description = "The handler registry: what the fleet runs"),
        (name = "service", description = "Health, metrics and this document"),
    )
)]
struct ApiDoc;

/// Adds the bearer-token scheme the operations' `security` names.
struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, doc: &mut Document) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some(
                "An API token, `Authorization: Bearer <token>`. Each token has scopes \
                 (`submit`, `read`, `cancel`, `admin`, `deploy`) and queues; each \
                 operation names the scope it needs (a `deploy` operation also takes \
                 `admin` on every queue). An operation without `security` takes no \
                 token on this server.",
            ))
            .build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme(BEARER, SecurityScheme::Http(scheme));
    }
}

/// The API's route table: an `OpenApiRouter` that also records the paths
/// of routes registered without an annotation (see the module docs).
pub(super) struct ApiRouter {
    router: OpenApiRouter<Shared>,
    undocumented: Vec<String>,
}

impl ApiRouter {
    /// An empty table, with the document's fixed part.
    pub(super) fn new() -> Self {
        ApiRouter {
            router: OpenApiRouter::with_openapi(ApiDoc::openapi()),
            undocumented: Vec::new(),
        }
    }

    /// Documented routes: `routes!(handler, ...)` of annotated handlers
    /// (one path, any methods).
    pub(super) fn routes(self, routes: UtoipaMethodRouter<Shared>) -> Self {
        ApiRouter {
            router: self.router.routes(routes),
            ..self
        }
    }

    /// An undocumented route, as `axum::Router::route`: served, and its
    /// path recorded for the check, which fails until it is annotated.
    /// Every route is annotated today; this is for one added the plain
    /// way, which is then served, and named by the check.
    #[allow(dead_code)]
    pub(super) fn route(mut self, path: &str, method_router: MethodRouter<Shared>) -> Self {
        self.undocumented.push(path.to_owned());
        ApiRouter {
            router: self.router.route(path, method_router),
            ..self
        }
    }

    /// Routes outside the API and its document (the web UI's pages and
    /// files), as `axum::Router::merge`: served, not checked.
    pub(super) fn merge(self, other: Router<Shared>) -> Self {
        ApiRouter {
            router: self.router.merge(other.into()),
            ..self
        }
    }

    /// The router, the document (as annotated: see [`document_for`]), and
    /// the paths of undocumented routes.
    pub(super) fn split(self) -> (Router<Shared>, Document, Vec<String>) {
        let (router, doc) = self.router.split_for_parts();
        (router, doc, self.undocumented)
    }
}

/// Who must show a token, as the tokens a server is given decide: the
/// document it serves gives each operation the `security` it has there, so
/// that a client (and a generator) knows whether to send one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenMode {
    /// Scoped tokens are configured: every operation but the document and
    /// the health check needs one.
    Scoped,
    /// No scoped token, an admin token (`--admin-token`): the API is open
    /// but for the admin and fleet operations, which need it.
    AdminOnly,
    /// No token at all: no operation takes one (the admin and fleet
    /// operations are disabled, 403 `ADMIN_DISABLED` to everyone).
    Open,
}

impl TokenMode {
    const ALL: [TokenMode; 3] = [TokenMode::Scoped, TokenMode::AdminOnly, TokenMode::Open];

    /// Whether an operation whose token needs `scopes` takes one in this
    /// mode.
    fn takes_token(self, scopes: &[String]) -> bool {
        match self {
            TokenMode::Scoped => !scopes.is_empty(),
            TokenMode::AdminOnly => is_admin(scopes),
            TokenMode::Open => false,
        }
    }
}

/// Whether an operation needing `scopes` is an admin or fleet operation:
/// disabled (403 `ADMIN_DISABLED`) while no token has either scope.
fn is_admin(scopes: &[String]) -> bool {
    scopes.iter().any(|s| s == "admin" || s == "deploy")
}

/// The OpenAPI document a server with scoped tokens serves at
/// [`OPENAPI_PATH`].
pub fn document() -> Document {
    document_for(TokenMode::Scoped)
}

/// The document a server in `mode` serves: the route table's, with each
/// operation's `security` as `mode` has it and the errors it may answer
/// there.
pub fn document_for(mode: TokenMode) -> Document {
    let mut doc = super::route_table().split().1;
    for (path, item) in doc.paths.paths.iter_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ];
        for operation in operations.into_iter().flatten() {
            // A path parameter is required (OpenAPI says so); one whose
            // schema comes from `schema_with` is not marked by the derive.
            for parameter in operation.parameters.iter_mut().flatten() {
                if parameter.parameter_in == ParameterIn::Path {
                    parameter.required = Required::True;
                }
            }
            let scopes = bearer_scopes(operation);
            if !mode.takes_token(&scopes) {
                operation.security = None;
            }
            add_common_responses(path, operation, mode, &scopes);
        }
    }
    if mode == TokenMode::Open
        && let Some(components) = doc.components.as_mut()
    {
        components.security_schemes.remove(BEARER);
    }
    doc
}

/// The paths of routes the API serves that are not in the document
/// (registered with a plain `.route(...)`), for the API's tests.
pub fn undocumented_paths() -> Vec<String> {
    super::route_table().split().2
}

/// The scopes an operation's annotation names for its bearer token
/// (`security(("bearer" = ["read"]))`); none for an operation that takes
/// no token.
fn bearer_scopes(operation: &Operation) -> Vec<String> {
    let requirements = serde_json::to_value(&operation.security).unwrap_or_default();
    requirements
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|requirement| requirement[BEARER].as_array())
        .flatten()
        .filter_map(|scope| scope.as_str().map(str::to_owned))
        .collect()
}

/// The document as each mode serves it: built once, as it depends on the
/// code and the mode only.
static DOCUMENTS: LazyLock<Vec<(TokenMode, Result<String, String>)>> = LazyLock::new(|| {
    TokenMode::ALL
        .into_iter()
        .map(|mode| {
            let json = document_for(mode).to_pretty_json();
            (mode, json.map_err(|e| e.to_string()))
        })
        .collect()
});

/// `GET /v1/openapi.json`.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "service",
    responses((status = 200, description = "This document (OpenAPI 3.1)", content_type = "application/json", body = Object)),
    security(()),
)]
pub(super) async fn serve_document(State(shared): State<Shared>) -> Result<Response, ApiError> {
    let mode = shared.auth.token_mode();
    let json = DOCUMENTS
        .iter()
        .find(|(m, _)| *m == mode)
        .map(|(_, json)| json)
        .ok_or_else(|| ApiError::internal(format!("no OpenAPI document for {mode:?}")))?
        .as_ref()
        .map_err(|e| ApiError::internal(format!("the OpenAPI document does not serialize: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], json.as_str()).into_response())
}

/// Adds to `operation` the errors any route may answer, unless its
/// annotation says more of them: 500 `INTERNAL_ERROR` everywhere; 401
/// where a token is taken, 403 where a scope is checked or the route may
/// be disabled; 503 `STORE_UNAVAILABLE` where a failing Redis fails the
/// request.
fn add_common_responses(path: &str, operation: &mut Operation, mode: TokenMode, scopes: &[String]) {
    if mode.takes_token(scopes) {
        add_error(
            operation,
            "401",
            "`UNAUTHORIZED`: no token, or an unknown one, was shown",
        );
    }
    if (mode == TokenMode::Scoped && !scopes.is_empty()) || is_admin(scopes) {
        add_error(
            operation,
            "403",
            "`FORBIDDEN`: the token lacks the scope or the queue; `ADMIN_DISABLED`: \
             an admin route and no admin token configured",
        );
    }
    // The document reads nothing; a scrape whose Redis read fails still
    // answers, with `dtq_redis_up 0`.
    if path != OPENAPI_PATH && path != "/metrics" {
        add_error(
            operation,
            "503",
            "`STORE_UNAVAILABLE`: Redis failed or did not answer within the API's deadline",
        );
    }
    add_error(
        operation,
        "500",
        "`INTERNAL_ERROR`: a bug (a handler panicked)",
    );
}

/// Adds the error response `status` to `operation` unless it has one.
fn add_error(operation: &mut Operation, status: &str, description: &str) {
    operation
        .responses
        .responses
        .entry(status.to_owned())
        .or_insert_with(|| {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name(ErrorBody::name())))
                        .build(),
                )
                .build()
                .into()
        });
}

/// The one error body: `{"error": {"code", "message", "details"}}`.
#[derive(ToSchema)]
#[allow(dead_code)] // Describes the JSON `ApiError` builds.
pub(super) struct ErrorBody {
    error: ErrorDetail,
}

/// What went wrong.
#[derive(ToSchema)]
#[allow(dead_code)] // Describes the JSON `ApiError` builds.
pub(super) struct ErrorDetail {
    /// Stable code; it gives the status.
    code: ErrorCode,
    /// What happened, for a person.
    message: String,
    /// Context for a program, e.g. the in-flight `task_id` of
    /// `IDEMPOTENCY_IN_PROGRESS`; `{}` when there is none.
    #[schema(value_type = Object)]
    details: serde_json::Map<String, serde_json::Value>,
}

impl PartialSchema for ErrorCode {
    fn schema() -> RefOr<Schema> {
        let table: String = ErrorCode::ALL
            .iter()
            .map(|code| format!("\n- `{code}`: {}", code.status().as_u16()))
            .collect();
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(ErrorCode::ALL.iter().map(|code| code.as_str())))
            .description(Some(format!(
                "The stable code of an error, and the status it is answered with \
                 (new codes may be added):{table}"
            )))
            .into()
    }
}

impl ToSchema for ErrorCode {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ErrorCode")
    }
}

impl PartialSchema for TaskStatus {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(TaskStatus::ALL.iter().map(|s| s.as_str())))
            .description(Some(
                "Where a task is in its life. SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED \
                 and EXPIRED are terminal (a dead-lettered task may be requeued). WAITING: \
                 it ran and waits for its children (flows), holding no slot.",
            ))
            .into()
    }
}

impl ToSchema for TaskStatus {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("TaskStatus")
    }
}

/// A deploy's body: the module's bytes.
pub(super) struct Module;

impl PartialSchema for Module {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .description(Some("A WebAssembly component's bytes"))
            .into()
    }
}

impl ToSchema for Module {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Module")
    }
}

/// A whole number, 0 to `u64::MAX`, as a query parameter the server reads
/// as `u64` (with no `int64` format, which would cap it at `i64::MAX`).
pub(super) fn whole_number() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(0))
        .maximum(Some(u64::MAX))
        .build()
}

/// What a queue, task or schedule name may be, as `ingest`'s and the
/// store's checks have it: 1 to 64 ASCII letters, digits, `_`, `.` or `-`.
pub(super) const NAME_PATTERN: &str = "^[A-Za-z0-9_.-]{1,64}$";

/// The schema of a name ([`NAME_PATTERN`]).
pub(super) fn name_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(NAME_PATTERN))
        .min_length(Some(1))
        .max_length(Some(crate::ingest::MAX_NAME_BYTES))
        .build()
}

/// The bodies the handlers build with `json!`, each as a type that
/// documents its fields. None is ever built: they exist for their schemas.
#[allow(dead_code)]
pub(super) mod schemas {
    use serde_json::Value;
    use utoipa::{IntoParams, ToSchema};

    use crate::store::TaskStatus;

    /// `{queue}` of a queue's routes.
    #[derive(IntoParams)]
    #[into_params(parameter_in = Path)]
    pub(in crate::api) struct QueuePath {
        /// The queue: 1 to 64 letters, digits, `_`, `.` or `-`.
        #[param(schema_with = super::name_schema, required = true)]
        queue: String,
    }

    /// `{queue}` and `{id}` of a task's routes.
    #[derive(IntoParams)]
    #[into_params(parameter_in = Path)]
    pub(in crate::api) struct TaskPath {
        /// The queue: 1 to 64 letters, digits, `_`, `.` or `-`.
        #[param(schema_with = super::name_schema, required = true)]
        queue: String,
        /// The task id, as the submission answered it.
        id: String,
    }

    /// `{task}` of the handler routes.
    #[derive(IntoParams)]
    #[into_params(parameter_in = Path)]
    pub(in crate::api) struct HandlerPath {
        /// The task name (the handler's): 1 to 64 letters, digits, `_`,
        /// `.` or `-`.
        #[param(schema_with = super::name_schema, required = true)]
        task: String,
    }

    /// A task, as `GET /v1/queues/{queue}/tasks/{id}` shows it.
    #[derive(ToSchema)]
    pub(in crate::api) struct Task {
        /// The task id (a UUIDv7: time-ordered).
        task_id: String,
        /// The queue it was submitted to.
        queue: String,
        /// The task name, which selects the handler.
        task: String,
        status: TaskStatus,
        /// Attempts started so far.
        attempts: u32,
        /// Attempts allowed before dead-lettering.
        max_attempts: u32,
        /// Deadline of one attempt, ms, when the submission set one.
        timeout_ms: Option<u64>,
        /// The submission's idempotency key.
        idempotency_key: Option<String>,
        /// The payload, as submitted.
        payload: Value,
        /// What the handler returned, once SUCCEEDED.
        result: Option<Value>,
        /// The last error.
        error: Option<String>,
        /// The last attempt's captured log.
        log: Option<String>,
        /// Submitted, ms since the Unix epoch.
        created_at: u64,
        /// Last changed, ms since the Unix epoch.
        updated_at: u64,
        /// Its last attempt started, ms since the Unix epoch.
        started_at: Option<u64>,
        /// It reached a terminal status, ms since the Unix epoch.
        finished_at: Option<u64>,
        /// It is due (scheduled tasks and retries), ms since the Unix epoch.
        run_at: Option<u64>,
        /// It expires if not started by then, ms since the Unix epoch.
        expires_at: Option<u64>,
        /// A cancel was requested while it ran.
        cancel_requested: bool,
        /// Its group, for the queue's `group_concurrency` limit.
        group: Option<String>,
        /// What holds it back while it waits SCHEDULED under a queue
        /// limit; null when nothing does.
        held: Option<Held>,
        /// SHA-256 of the module its last attempt ran.
        handler_digest: Option<String>,
        /// SHA-256 of the module each attempt ran, in order; `-` for an
        /// attempt whose worker died.
        attempt_digests: Vec<String>,
        /// The attempts it keeps (at most 20, the newest), oldest first.
        attempt_history: Vec<Attempt>,
        /// Its last attempt's progress, as the handler last reported it,
        /// while it runs and after; null when that attempt reported none.
        progress: Option<Progress>,
        /// The task that submitted it as a child (flows); null for none.
        parent: Option<TaskRef>,
        /// The children it submitted (flows), in submission order, each
        /// with its status now: in the answer of
        /// `GET /v1/queues/{queue}/tasks/{id}` (not in listings).
        children: Option<Vec<ChildTask>>,
    }

    /// A task named by its queue and id.
    #[derive(ToSchema)]
    pub(in crate::api) struct TaskRef {
        queue: String,
        task_id: String,
    }

    /// A child of a task (flows), as it is now.
    #[derive(ToSchema)]
    pub(in crate::api) struct ChildTask {
        /// Its id; empty for a child whose submission was refused.
        task_id: String,
        queue: String,
        task: String,
        /// A task status, `REFUSED` (its submission was refused when
        /// applied: `error` says why), or `MISSING` (its record is gone,
        /// past its retention).
        status: String,
        /// Why it failed, or why its submission was refused.
        error: Option<String>,
    }

    /// How far an attempt is, as its handler reported it.
    #[derive(ToSchema)]
    pub(in crate::api) struct Progress {
        /// 0 to 1.
        fraction: f64,
        /// The handler's message, at most 1024 bytes.
        message: String,
        /// When the handler reported it, ms since the Unix epoch.
        updated_at: u64,
    }

    /// Why and until when a queue limit holds a task back.
    #[derive(ToSchema)]
    pub(in crate::api) struct Held {
        /// `rate` (the queue's rate limit) or `group` (its group is at
        /// the queue's `group_concurrency`).
        by: String,
        /// When it is looked at again, ms since the Unix epoch.
        until: u64,
    }

    /// One attempt of a task.
    #[derive(ToSchema)]
    pub(in crate::api) struct Attempt {
        /// Its number, from 1; numbers keep rising across requeues.
        attempt: u32,
        /// How it ended: `success`, `fatal`, `retry`, `lost` (its worker
        /// died), `cancelled`, or `running` (not ended yet).
        outcome: String,
        error: Option<String>,
        /// Its captured log (an archived attempt's is cut at 8 KiB).
        log: Option<String>,
        started_at: Option<u64>,
        finished_at: Option<u64>,
        duration_ms: Option<u64>,
        /// SHA-256 of the module it ran.
        digest: Option<String>,
    }

    /// The body of `POST /v1/queues/{queue}/tasks` (`ingest::SubmitRequest`,
    /// with the bounds `ingest` holds each field to that do not depend on
    /// the server: `timeout_ms` is also held to the server's
    /// `--task-timeout-ms`, `expires_in_ms` must pass `delay_ms`, `run_at`
    /// may be at most 30 days ahead, and `task` must be deployed). Unknown
    /// fields are refused.
    #[derive(ToSchema)]
    #[serde(deny_unknown_fields)]
    pub(in crate::api) struct SubmitRequest {
        /// The task name, which selects the handler: a deployed one.
        #[schema(schema_with = super::name_schema)]
        task: String,
        /// Any JSON value; `null` when absent.
        payload: Option<Value>,
        /// The idempotency key: 1 to 255 bytes, no control characters (the
        /// `Idempotency-Key` header wins over it).
        #[schema(
            min_length = 1,
            max_length = 255,
            pattern = r"^[^\u0000-\u001F\u007F-\u009F]+$"
        )]
        idempotency_key: Option<String>,
        /// Attempts before dead-lettering (the handler's default, then the
        /// server's, when absent).
        #[schema(minimum = 1, maximum = 100)]
        max_attempts: Option<u32>,
        /// Deadline of one attempt, ms, at most the server's
        /// `--task-timeout-ms`.
        #[schema(minimum = 1)]
        timeout_ms: Option<u64>,
        /// Run no earlier than this many ms from now (at most 30 days).
        #[schema(minimum = 0, maximum = 2_592_000_000_u64)]
        delay_ms: Option<u64>,
        /// Expire if not started within this many ms (at most 60 days, and
        /// more than `delay_ms`).
        #[schema(minimum = 1, maximum = 5_184_000_000_u64)]
        expires_in_ms: Option<u64>,
        /// Run no earlier than this time. Not with `delay_ms`.
        #[schema(value_type = Option<crate::ingest::RunAt>)]
        run_at: Option<Value>,
    }

    /// The body of `POST /v1/queues/{queue}/tasks/batch`.
    #[derive(ToSchema)]
    #[serde(deny_unknown_fields)]
    pub(in crate::api) struct BatchRequest {
        /// 1 to 1000 submissions, each as `POST /v1/queues/{queue}/tasks`
        /// takes it (its key in `idempotency_key`).
        #[schema(min_items = 1, max_items = 1000)]
        tasks: Vec<SubmitRequest>,
    }

    /// The answer to a submission: the task (all of [`Task`]'s fields when
    /// its record is read back, which it is for a replay), and whether it
    /// is a replay.
    #[derive(ToSchema)]
    pub(in crate::api) struct Submitted {
        /// The task id; a replay's is the first submission's.
        task_id: String,
        queue: String,
        task: String,
        status: TaskStatus,
        /// Whether this is a replay of an earlier submission with the same
        /// idempotency key (200), rather than a new task (202).
        duplicate: bool,
        attempts: Option<u32>,
        max_attempts: Option<u32>,
        timeout_ms: Option<u64>,
        idempotency_key: Option<String>,
        payload: Option<Value>,
        result: Option<Value>,
        error: Option<String>,
        log: Option<String>,
        created_at: Option<u64>,
        updated_at: Option<u64>,
        started_at: Option<u64>,
        finished_at: Option<u64>,
        run_at: Option<u64>,
        expires_at: Option<u64>,
        cancel_requested: Option<bool>,
        group: Option<String>,
        held: Option<Held>,
        handler_digest: Option<String>,
        attempt_digests: Option<Vec<String>>,
        attempt_history: Option<Vec<Attempt>>,
        progress: Option<Progress>,
        /// A replayed task's parent (flows).
        parent: Option<TaskRef>,
    }

    /// A task as the listing shows it: without payload, result, error or
    /// log.
    #[derive(ToSchema)]
    pub(in crate::api) struct TaskSummary {
        task_id: String,
        queue: String,
        task: String,
        /// Its status when the page was read.
        status: TaskStatus,
        attempts: u32,
        max_attempts: u32,
        idempotency_key: Option<String>,
        created_at: u64,
        updated_at: u64,
        started_at: Option<u64>,
        finished_at: Option<u64>,
        run_at: Option<u64>,
        expires_at: Option<u64>,
        /// What holds it back while it waits SCHEDULED under a queue
        /// limit: `rate` or `group`; null when nothing does.
        held_by: Option<String>,
    }

    /// One page of a queue's tasks, newest first.
    #[derive(ToSchema)]
    pub(in crate::api) struct TaskPage {
        queue: String,
        /// The status asked for, if any.
        status: Option<TaskStatus>,
        /// The task name asked for, if any.
        task: Option<String>,
        /// May be short, even empty, while `next_cursor` is not null.
        tasks: Vec<TaskSummary>,
        /// Pass back as `cursor` for the next page; null at the end.
        next_cursor: Option<String>,
    }

    /// A queue's counts.
    #[derive(ToSchema)]
    pub(in crate::api) struct QueueStats {
        queue: String,
        /// In the ready stream, not yet delivered to a worker.
        ready: u64,
        /// Delivered and not acknowledged: running, or held by a dead
        /// worker until reclaimed.
        running: u64,
        /// Scheduled tasks and retries.
        delayed: u64,
        /// Parents WAITING for their children (flows): acknowledged,
        /// holding no slot, counted in none of the others.
        waiting: u64,
        /// Dead-lettered tasks.
        dead_lettered: u64,
        /// Partitions the queue is spread over; the counts are their sums.
        partitions: u32,
        /// Paused: it takes submissions, but no worker starts its tasks
        /// (`POST /v1/queues/{queue}/pause`, `.../resume`).
        paused: bool,
    }

    /// Every queue's counts (those the token may read).
    #[derive(ToSchema)]
    pub(in crate::api) struct QueueList {
        queues: Vec<QueueStats>,
    }

    /// A queue's dead-lettered tasks.
    #[derive(ToSchema)]
    pub(in crate::api) struct DeadLetters {
        queue: String,
        tasks: Vec<Task>,
    }

    /// The answer to a cancel: 200 `CANCELLED`, or 202 `RUNNING` with
    /// `cancel_requested` (its worker was asked to interrupt it).
    #[derive(ToSchema)]
    pub(in crate::api) struct Cancelled {
        task_id: String,
        queue: String,
        status: TaskStatus,
        cancel_requested: Option<bool>,
        /// Its children (flows) that had not ended, and theirs, cancelled
        /// with it (or asked to stop, when running).
        cancelled_children: Vec<String>,
    }

    /// The answer to a requeue: the task is `QUEUED` again.
    #[derive(ToSchema)]
    pub(in crate::api) struct Requeued {
        task_id: String,
        queue: String,
        status: TaskStatus,
    }

    /// Redis is reachable.
    #[derive(ToSchema)]
    pub(in crate::api) struct Health {
        /// `ok`.
        status: String,
    }

    /// The `data:` of a status event (`event:` is the new status).
    #[derive(ToSchema)]
    pub(in crate::api) struct QueueEvent {
        task_id: String,
        /// The task's name (its handler), read from its record when the
        /// event is sent; null once the record is gone (expired, purged).
        task: Option<String>,
        /// The task's new status; or `PROGRESS`, a progress report of its
        /// running attempt (with `--events all`).
        status: String,
        /// The attempt the event belongs to (0 before the first).
        attempt: Option<u64>,
        /// When it happened, ms since the Unix epoch.
        at: Option<u64>,
        /// A `PROGRESS` event's report; absent from the others.
        progress: Option<Progress>,
    }

    /// The `data:` of `event: gap`: the client resumed after an event
    /// older than the capped stream holds, and missed some.
    #[derive(ToSchema)]
    pub(in crate::api) struct EventGap {
        /// The id it resumed after.
        last_event_id: String,
        /// The oldest event left, where reading goes on from.
        oldest_id: Option<String>,
    }

    /// A handler's settings, set at deploy (the query of
    /// `PUT /v1/handlers/{task}`, and `settings` of its versions).
    #[derive(ToSchema, IntoParams)]
    #[into_params(parameter_in = Query)]
    pub(in crate::api) struct DeploySettings {
        /// The namespace of its kv keys and idempotency claims (default:
        /// the task name).
        namespace: Option<String>,
        /// Linear memory one call may use, MiB.
        memory_mib: Option<u64>,
        /// Deadline of one attempt, ms.
        timeout_ms: Option<u64>,
        /// Fuel per call (workers must meter fuel).
        fuel: Option<u64>,
        /// Attempts of a task whose submission does not set `max_attempts`.
        max_attempts: Option<u32>,
        /// kv bytes its namespace may hold in Redis, MiB (0: no budget).
        kv_quota_mib: Option<u64>,
        /// Hosts it may send HTTP requests to, comma-separated
        /// `scheme://host[:port]` patterns; none by default.
        allow_hosts: Option<String>,
        /// Queues it may submit tasks to (flows), comma-separated
        /// `QUEUE[:TASK...]`; none by default. Only the fleet operator's
        /// token may set it.
        submit_to: Option<String>,
    }

    /// What a registry change did.
    #[derive(ToSchema)]
    #[schema(rename_all = "lowercase")]
    pub(in crate::api) enum Action {
        Deploy,
        Rollback,
        Undeploy,
    }

    /// A task's active version (an undeploy has no version fields).
    #[derive(ToSchema)]
    pub(in crate::api) struct ActiveHandler {
        task: String,
        action: Action,
        /// When it became active, ms since the Unix epoch.
        deployed_at: u64,
        /// SHA-256 of the module, lowercase hex.
        digest: Option<String>,
        /// The module's size, bytes.
        size: Option<u64>,
        settings: Option<DeploySettings>,
        /// Identifies module and settings together; workers report it for
        /// each version they run.
        fingerprint: Option<String>,
        /// How many live workers run this version (the handler list only).
        workers: Option<WorkerCount>,
    }

    /// Live workers running a version, of those that run any.
    #[derive(ToSchema)]
    pub(in crate::api) struct WorkerCount {
        running: u64,
        total: u64,
    }

    /// Every deployed task's active version, and what each live worker
    /// runs.
    #[derive(ToSchema)]
    pub(in crate::api) struct HandlerList {
        handlers: Vec<ActiveHandler>,
        /// Each live worker's report: its queues, the versions it loaded,
        /// those it failed to load.
        workers: Vec<serde_json::Map<String, Value>>,
    }

    /// One change in a task's history.
    #[derive(ToSchema)]
    pub(in crate::api) struct HistoryEntry {
        action: Action,
        /// When, ms since the Unix epoch.
        at: u64,
        digest: Option<String>,
        size: Option<u64>,
        settings: Option<DeploySettings>,
        fingerprint: Option<String>,
    }

    /// A task's active version and its history, newest first.
    #[derive(ToSchema)]
    pub(in crate::api) struct HandlerHistory {
        task: String,
        active: Option<ActiveHandler>,
        history: Vec<HistoryEntry>,
    }

    /// The answer to a deploy: the active version, and what it replaced.
    #[derive(ToSchema)]
    pub(in crate::api) struct Deployed {
        task: String,
        action: Action,
        deployed_at: u64,
        digest: Option<String>,
        size: Option<u64>,
        settings: Option<DeploySettings>,
        fingerprint: Option<String>,
        /// The same module and settings were active already (200).
        unchanged: bool,
        /// The digest it replaced, if any.
        previous: Option<String>,
        /// Set when no live worker checked the settings: none is live, or
        /// (deployed with `force`) none can run them.
        warning: Option<String>,
    }

    /// The answer to an undeploy.
    #[derive(ToSchema)]
    pub(in crate::api) struct Undeployed {
        task: String,
        /// False when no version was active.
        undeployed: bool,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;
    use crate::deploy::DeploySettings;

    fn doc_json() -> Value {
        serde_json::to_value(document()).expect("the document serializes")
    }

    /// Every `{name}` of a path is a path parameter of each of its
    /// operations, and every path parameter is in the path.
    #[test]
    fn path_parameters_match_the_paths() {
        let doc = doc_json();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            let in_path: BTreeSet<&str> = path
                .split('/')
                .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
                .collect();
            for (method, operation) in item.as_object().expect("a path item") {
                let declared: BTreeSet<&str> = operation["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["in"] == "path")
                    .filter_map(|p| p["name"].as_str())
                    .collect();
                assert_eq!(declared, in_path, "{method} {path}");
            }
        }
    }

    /// The documented deploy settings are `DeploySettings`' fields.
    #[test]
    fn deploy_settings_are_documented() {
        let all = DeploySettings {
            namespace: Some(String::new()),
            memory_mib: Some(0),
            timeout_ms: Some(0),
            fuel: Some(0),
            max_attempts: Some(0),
            kv_quota_mib: Some(0),
            allow_hosts: Some(String::new()),
            submit_to: Some(String::new()),
        };
        let fields: BTreeSet<String> = serde_json::to_value(all)
            .expect("serializes")
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect();
        let doc = doc_json();
        let documented: BTreeSet<String> =
            doc["components"]["schemas"]["DeploySettings"]["properties"]
                .as_object()
                .expect("DeploySettings has properties")
                .keys()
                .cloned()
                .collect();
        assert_eq!(documented, fields);
        let params: BTreeSet<String> = doc["paths"]["/v1/handlers/{task}"]["put"]["parameters"]
            .as_array()
            .expect("deploy has parameters")
            .iter()
            .filter(|p| p["in"] == "query")
            .filter_map(|p| p["name"].as_str().map(str::to_owned))
            .collect();
        // The settings, and `force`, which is the deploy's, not a setting.
        let mut query = fields;
        query.insert("force".to_owned());
        assert_eq!(params, query);
    }

    #[test]
    fn error_codes_and_statuses_are_enums_of_their_texts() {
        let doc = doc_json();
        let schemas = &doc["components"]["schemas"];
        let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(schemas["ErrorCode"]["enum"], serde_json::json!(codes));
        let statuses: Vec<&str> = TaskStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(schemas["TaskStatus"]["enum"], serde_json::json!(statuses));
    }
}
