//! dtq's Rust client: typed calls to the HTTP API, used by the `dtq`
//! command and by anyone driving dtq from Rust.
//!
//! One [`Client`] holds one connection pool, the API's base URL and the
//! token its requests carry. Every path is built from segments with
//! [`Url`], so a queue name or task id holding `/`, `%`, `?`, `#` or a
//! space stays one segment and cannot change which route is asked.
//!
//! Requests and answers use the server's own types where it has them
//! ([`SubmitRequest`], [`TaskStatus`](crate::store::TaskStatus),
//! [`BulkRequeue`], [`FleetReport`],
//! [`DeploySettings`]) and [`types`] where it builds its answer in the
//! route. A refusal is a [`ClientError::Api`] with the API's error body.
//!
//! # Layout
//!
//! - this file: the client, its errors, the routes;
//! - [`types`]: bodies and answers the server has no public type for;
//! - [`events`]: a queue's live events, followed across reconnections
//!   ([`Client::watch`]), and [`Client::wait`] for a task to end;
//! - [`sse`]: the Server-Sent Events reader under both.

pub mod events;
pub mod sse;
pub mod types;

use std::time::Duration;

use reqwest::{Method, RequestBuilder, Response, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::deploy::{DeploySettings, FleetReport};
use crate::ingest::SubmitRequest;
use crate::store::{BulkRequeue, Limits};
pub use events::Watch;
pub use types::*;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL is not one a path can be added to.
    #[error("{base:?} is not the base URL of an API: {why}")]
    BadBase {
        /// The URL as given.
        base: String,
        /// What is wrong with it.
        why: String,
    },
    /// `.` or `..` as a path segment: URL parsing takes them, even
    /// encoded, as path steps, so they cannot be sent (no queue or task is
    /// named so).
    #[error("{0:?} is not a queue name or a task id")]
    BadSegment(String),
    /// No answer: the server cannot be reached, or the request timed out.
    #[error("cannot reach {url}: {source}{}", unreachable_hint(.source))]
    Unreachable {
        /// The URL asked.
        url: Url,
        /// The transport's error.
        source: reqwest::Error,
    },
    /// The API refused the request with its error body.
    #[error("{code} ({status}): {message}")]
    Api {
        /// The HTTP status.
        status: StatusCode,
        /// The error code (`UNKNOWN_TASK`, ...; see `crate::base::ErrorCode`).
        code: String,
        /// The error message.
        message: String,
        /// The error's details (`null` when it has none).
        details: Value,
        /// The whole body, as sent.
        body: Value,
    },
    /// A refusal without an error body (a proxy's, say).
    #[error("HTTP {status} from {url}")]
    Http {
        /// The URL asked.
        url: Url,
        /// The HTTP status.
        status: StatusCode,
        /// The body, if it was JSON; `null` otherwise.
        body: Value,
    },
    /// A success whose body could not be read as the route's answer.
    #[error("reading the answer of {url}: {source}")]
    Answer {
        /// The URL asked.
        url: Url,
        /// Why it could not be read.
        source: reqwest::Error,
    },
    /// The event stream could not be read on.
    #[error(transparent)]
    Events(#[from] sse::SseError),
}

impl ClientError {
    /// The body the server answered a refusal with, if it answered.
    pub fn body(&self) -> Option<&Value> {
        match self {
            ClientError::Api { body, .. } | ClientError::Http { body, .. } => Some(body),
            _ => None,
        }
    }

    /// The HTTP status of a refusal.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } | ClientError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A client of one dtq API.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// The API's base: `/v1/...` is added to its path.
    base: Url,
    token: Option<String>,
    /// The deadline of a request, but for event streams (they last).
    timeout: Option<Duration>,
}

/// What to do about a request nothing answered.
fn unreachable_hint(source: &reqwest::Error) -> &'static str {
    if source.is_connect() {
        " (nothing accepts connections there: is a dtq API listening at that \
         address? `dtq` takes it from --api or DTQ_API)"
    } else if source.is_timeout() {
        " (no answer in time: the API or its Redis may be overloaded)"
    } else {
        ""
    }
}

impl Client {
    /// A client of the API at `base` (`http://127.0.0.1:8080`), without a
    /// token or a timeout.
    pub fn new(base: &str) -> Result<Client, ClientError> {
        let bad = |why: String| ClientError::BadBase {
            base: base.to_owned(),
            why,
        };
        let with_scheme = || {
            format!(
                "it needs http:// or https:// in front, e.g. http://{}",
                base.trim_start_matches('/')
            )
        };
        let url = match Url::parse(base) {
            Ok(url) => url,
            Err(_) if !base.contains("://") => return Err(bad(with_scheme())),
            Err(e) => return Err(bad(e.to_string())),
        };
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad(with_scheme()));
        }
        if url.cannot_be_a_base() {
            return Err(bad("it cannot have a path".into()));
        }
        let http = reqwest::Client::builder()
            .build()
            .map_err(|e| bad(format!("cannot set up the HTTP client: {e}")))?;
        Ok(Client {
            http,
            base: url,
            token: None,
            timeout: None,
        })
    }

    /// The same client, its requests carrying `token` as `Authorization:
    /// Bearer` (none if `None`).
    pub fn with_token(mut self, token: Option<String>) -> Client {
        self.token = token;
        self
    }

    /// The same client, each request (but event streams) given up after
    /// `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = Some(timeout);
        self
    }

    /// The API's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// The URL of `/v1/<segments>`, each segment percent-encoded as one.
    pub fn url(&self, segments: &[&str]) -> Result<Url, ClientError> {
        if let Some(step) = segments.iter().find(|s| matches!(**s, "." | "..")) {
            return Err(ClientError::BadSegment((*step).to_owned()));
        }
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| ClientError::BadBase {
                base: self.base.to_string(),
                why: "it cannot have a path".into(),
            })?
            .pop_if_empty()
            .push("v1")
            .extend(segments);
        Ok(url)
    }

    /// `POST /v1/queues/{queue}/tasks`: submit a task; `idempotency_key`
    /// goes in the `Idempotency-Key` header (which wins over the body's).
    pub async fn submit(
        &self,
        queue: &str,
        request: &SubmitRequest,
        idempotency_key: Option<&str>,
    ) -> Result<Submitted, ClientError> {
        let url = self.url(&["queues", queue, "tasks"])?;
        let mut req = self.http.post(url.clone()).json(request);
        if let Some(key) = idempotency_key {
            req = req.header("Idempotency-Key", key);
        }
        self.answer(req, url).await
    }

    /// `POST /v1/queues/{queue}/tasks/batch`: submit up to
    /// [`MAX_BATCH_ITEMS`](crate::ingest::MAX_BATCH_ITEMS) items, each a
    /// submission's body; one result per item.
    pub async fn submit_batch(
        &self,
        queue: &str,
        items: &[Value],
    ) -> Result<BatchResults, ClientError> {
        let url = self.url(&["queues", queue, "tasks", "batch"])?;
        let req = self
            .http
            .post(url.clone())
            .json(&BatchRequest { tasks: items });
        self.answer(req, url).await
    }

    /// `GET /v1/queues/{queue}/tasks/{id}`: the task's record.
    pub async fn task(&self, queue: &str, id: &str) -> Result<Task, ClientError> {
        self.call(Method::GET, &["queues", queue, "tasks", id], None::<&()>)
            .await
    }

    /// `POST /v1/queues/{queue}/tasks/{id}/cancel`.
    pub async fn cancel(&self, queue: &str, id: &str) -> Result<Task, ClientError> {
        let path = ["queues", queue, "tasks", id, "cancel"];
        self.call(Method::POST, &path, None::<&()>).await
    }

    /// `GET /v1/queues/{queue}/tasks`: a page of the queue's tasks, newest
    /// first, those `query` asks for (of a status, of a name, after a
    /// cursor). A filtered page may be short, even empty, while its
    /// `next_cursor` says there is more (the server reads a bounded number
    /// of tasks per request).
    pub async fn tasks(&self, queue: &str, query: &TaskQuery<'_>) -> Result<TaskPage, ClientError> {
        let mut url = self.url(&["queues", queue, "tasks"])?;
        let limit = query.limit.map(|n| n.to_string());
        let pairs = [
            ("status", query.status),
            ("task", query.task),
            ("limit", limit.as_deref()),
            ("cursor", query.cursor),
        ];
        add_query(&mut url, &pairs);
        self.answer(self.http.get(url.clone()), url).await
    }

    /// `GET /v1/queues`: every queue's counts.
    pub async fn queues(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, &["queues"], None::<&()>).await
    }

    /// `GET /v1/queues/{queue}`: one queue's counts.
    pub async fn queue(&self, queue: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["queues", queue], None::<&()>)
            .await
    }

    /// `PUT /v1/queues/{queue}/partitions`: raise the partition count.
    pub async fn raise_partitions(
        &self,
        queue: &str,
        count: u32,
    ) -> Result<Partitions, ClientError> {
        let body = PartitionsRequest { count };
        self.call(Method::PUT, &["queues", queue, "partitions"], Some(&body))
            .await
    }

    /// `POST /v1/queues/{queue}/pause` (`paused`) or `.../resume`: the
    /// queue's pause state, `{"queue", "paused", "changed"}`.
    pub async fn set_paused(&self, queue: &str, paused: bool) -> Result<Value, ClientError> {
        let action = if paused { "pause" } else { "resume" };
        self.call(Method::POST, &["queues", queue, action], None::<&()>)
            .await
    }

    /// `GET /v1/queues/{queue}/limits`: the queue's limits.
    pub async fn limits(&self, queue: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["queues", queue, "limits"], None::<&()>)
            .await
    }

    /// `PUT /v1/queues/{queue}/limits`: set the queue's limits (a limit
    /// `limits` leaves out is lifted); `DELETE` when it has none.
    pub async fn set_limits(&self, queue: &str, limits: &Limits) -> Result<Value, ClientError> {
        let path = ["queues", queue, "limits"];
        if limits.any() {
            self.call(Method::PUT, &path, Some(limits)).await
        } else {
            self.call(Method::DELETE, &path, None::<&()>).await
        }
    }

    /// `GET /v1/queues/{queue}/dlq`: the dead-lettered tasks.
    pub async fn dlq(&self, queue: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["queues", queue, "dlq"], None::<&()>)
            .await
    }

    /// `POST /v1/queues/{queue}/dlq/{id}/requeue`: one task back in the
    /// queue.
    pub async fn requeue(&self, queue: &str, id: &str) -> Result<Task, ClientError> {
        let path = ["queues", queue, "dlq", id, "requeue"];
        self.call(Method::POST, &path, None::<&()>).await
    }

    /// `POST /v1/queues/{queue}/dlq/requeue`: the selected tasks back in
    /// the queue (not [`DlqSelection::OlderThanMs`]).
    pub async fn requeue_many(
        &self,
        queue: &str,
        which: &DlqSelection,
    ) -> Result<BulkRequeue, ClientError> {
        let path = ["queues", queue, "dlq", "requeue"];
        self.call(Method::POST, &path, Some(which)).await
    }

    /// `DELETE /v1/queues/{queue}/dlq`: purge the selected tasks.
    pub async fn purge(&self, queue: &str, which: &DlqSelection) -> Result<Purged, ClientError> {
        self.call(Method::DELETE, &["queues", queue, "dlq"], Some(which))
            .await
    }

    /// `PUT /v1/queues/{queue}/schedules/{name}`: create or replace a
    /// schedule; the schedule as stored.
    pub async fn set_schedule(
        &self,
        queue: &str,
        name: &str,
        schedule: &ScheduleRequest,
    ) -> Result<Value, ClientError> {
        let path = ["queues", queue, "schedules", name];
        self.call(Method::PUT, &path, Some(schedule)).await
    }

    /// `GET /v1/queues/{queue}/schedules`.
    pub async fn schedules(&self, queue: &str) -> Result<Value, ClientError> {
        let path = ["queues", queue, "schedules"];
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// `DELETE /v1/queues/{queue}/schedules/{name}`.
    pub async fn delete_schedule(
        &self,
        queue: &str,
        name: &str,
    ) -> Result<ScheduleDeleted, ClientError> {
        let path = ["queues", queue, "schedules", name];
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// `GET /v1/handlers`: the deployed handlers and what each live
    /// worker runs.
    pub async fn handlers(&self) -> Result<HandlerList, ClientError> {
        self.call(Method::GET, &["handlers"], None::<&()>).await
    }

    /// The live workers that consume `queue`, from the fleet report of
    /// `GET /v1/handlers`: none means its tasks wait until one does.
    pub async fn consumers(&self, queue: &str) -> Result<Vec<FleetReport>, ClientError> {
        let workers = self.handlers().await?.workers;
        Ok(workers.into_iter().filter(|w| consumes(w, queue)).collect())
    }

    /// `GET /v1/handlers/{task}`: a task's active version and history.
    pub async fn handler_history(&self, task: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["handlers", task], None::<&()>)
            .await
    }

    /// `PUT /v1/handlers/{task}`: deploy module `wasm` with `settings`
    /// (as the query), `force` past the fleet's capacity check, signed by
    /// `signature` (the `Dtq-Signature` header) if given.
    pub async fn deploy(
        &self,
        task: &str,
        wasm: Vec<u8>,
        settings: &DeploySettings,
        force: bool,
        signature: Option<&str>,
    ) -> Result<Deployed, ClientError> {
        let url = self.url(&["handlers", task])?;
        let mut req = self.http.put(url.clone()).query(settings);
        if force {
            req = req.query(&[("force", "true")]);
        }
        req = req
            .header(reqwest::header::CONTENT_TYPE, "application/wasm")
            .body(wasm);
        if let Some(signature) = signature {
            req = req.header(crate::deploy::SIGNATURE_HEADER, signature);
        }
        self.answer(req, url).await
    }

    /// `POST /v1/handlers/{task}/rollback`.
    pub async fn rollback(&self, task: &str, to: Option<String>) -> Result<Value, ClientError> {
        let body = RollbackRequest { to };
        self.call(Method::POST, &["handlers", task, "rollback"], Some(&body))
            .await
    }

    /// `DELETE /v1/handlers/{task}`.
    pub async fn undeploy(&self, task: &str) -> Result<Undeployed, ClientError> {
        self.call(Method::DELETE, &["handlers", task], None::<&()>)
            .await
    }

    /// `method` on `/v1/<path>` with `body` as JSON, its answer read as `T`.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &[&str],
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let url = self.url(path)?;
        let mut req = self.http.request(method, url.clone());
        if let Some(body) = body {
            req = req.json(body);
        }
        self.answer(req, url).await
    }

    /// Send `req` (to `url`) and read its answer as `T`.
    async fn answer<T: DeserializeOwned>(
        &self,
        mut req: RequestBuilder,
        url: Url,
    ) -> Result<T, ClientError> {
        if let Some(timeout) = self.timeout {
            req = req.timeout(timeout);
        }
        let response = self.open(req, url.clone()).await?;
        response
            .json()
            .await
            .map_err(|source| ClientError::Answer { url, source })
    }

    /// Send `req` (to `url`) with the client's token; the response, its
    /// body unread, if it is a success; a refusal as [`ClientError::Api`]
    /// (or [`ClientError::Http`] when it has no error body) otherwise.
    async fn open(&self, req: RequestBuilder, url: Url) -> Result<Response, ClientError> {
        let response = match self.authorized(req).send().await {
            Ok(response) => response,
            Err(source) => return Err(ClientError::Unreachable { url, source }),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let error = &body["error"];
        match (error["code"].as_str(), error["message"].as_str()) {
            (Some(code), Some(message)) => Err(ClientError::Api {
                status,
                code: code.to_owned(),
                message: message.to_owned(),
                details: error["details"].clone(),
                body,
            }),
            _ => Err(ClientError::Http { url, status, body }),
        }
    }

    /// `req` with the client's token, if it has one.
    fn authorized(&self, req: RequestBuilder) -> RequestBuilder {
        match &self.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }
}

/// Whether `worker` consumes `queue`: it names it in its queues, alone or
/// with a weight (`queue:6`).
fn consumes(worker: &FleetReport, queue: &str) -> bool {
    worker.queues.iter().any(|q| {
        q == queue
            || q.strip_prefix(queue)
                .and_then(|rest| rest.strip_prefix(':'))
                .is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Add the pairs that have a value to `url`'s query.
fn add_query(url: &mut Url, pairs: &[(&str, Option<&str>)]) {
    if pairs.iter().all(|(_, value)| value.is_none()) {
        return;
    }
    let mut query = url.query_pairs_mut();
    for (name, value) in pairs {
        if let Some(value) = value {
            query.append_pair(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(base: &str) -> Client {
        Client::new(base).expect("a base URL")
    }

    #[test]
    fn each_name_is_one_path_segment() {
        let c = client("http://127.0.0.1:8080");
        let cases = [
            ("a/b", "a%2Fb"),
            ("a%2Fb", "a%252Fb"),
            ("a b", "a%20b"),
            ("a?b=1", "a%3Fb=1"),
            ("a#b", "a%23b"),
            ("a%", "a%25"),
            ("a\\b", "a%5Cb"),
            ("é-日本", "%C3%A9-%E6%97%A5%E6%9C%AC"),
        ];
        for (name, encoded) in cases {
            let url = c.url(&["queues", name, "tasks", name]).expect("a URL");
            assert_eq!(
                url.as_str(),
                format!("http://127.0.0.1:8080/v1/queues/{encoded}/tasks/{encoded}"),
                "{name:?}"
            );
            let segments: Vec<_> = url.path_segments().expect("a path").collect();
            assert_eq!(segments.len(), 5, "{name:?}: {segments:?}");
        }
    }

    #[test]
    fn dot_segments_are_refused() {
        let c = client("http://127.0.0.1:8080");
        for step in [".", ".."] {
            assert!(
                matches!(c.url(&["queues", "q", "tasks", step]), Err(ClientError::BadSegment(s)) if s == step),
                "{step:?}"
            );
        }
        assert!(c.url(&["queues", "q", "tasks", "..."]).is_ok());
    }

    #[test]
    fn the_base_keeps_its_path_with_or_without_a_slash() {
        for base in ["http://h:1/dtq", "http://h:1/dtq/"] {
            let url = client(base).url(&["queues"]).expect("a URL");
            assert_eq!(url.as_str(), "http://h:1/dtq/v1/queues", "{base}");
        }
        let url = client("http://h:1/").url(&["queues"]).expect("a URL");
        assert_eq!(url.as_str(), "http://h:1/v1/queues");
        assert!(matches!(
            Client::new("mailto:a@b"),
            Err(ClientError::BadBase { .. })
        ));
        assert!(matches!(
            Client::new("127.0.0.1:8080/x y"),
            Err(ClientError::BadBase { .. })
        ));
        // A base without its scheme is answered with the fix.
        for base in ["localhost:8080", "127.0.0.1:8080", "dtq.internal"] {
            let error = Client::new(base)
                .map(drop)
                .expect_err("refused")
                .to_string();
            assert!(
                error.contains(&format!("e.g. http://{base}")),
                "{base}: {error}"
            );
        }
    }

    #[tokio::test]
    async fn a_refused_connection_names_the_api_setting() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = listener.local_addr().expect("an address").port();
        drop(listener);
        let client = Client::new(&format!("http://127.0.0.1:{port}")).expect("a client");
        let error = client.task("q", "t").await.expect_err("nothing listens");
        let text = error.to_string();
        assert!(
            text.contains("is a dtq API listening") && text.contains("DTQ_API"),
            "{text}"
        );
    }

    #[test]
    fn query_values_are_encoded_and_absent_ones_left_out() {
        let mut url = client("http://h")
            .url(&["queues", "q", "tasks"])
            .expect("a URL");
        add_query(
            &mut url,
            &[
                ("status", Some("a&b=c d")),
                ("limit", None),
                ("cursor", Some("é")),
            ],
        );
        assert_eq!(
            url.as_str(),
            "http://h/v1/queues/q/tasks?status=a%26b%3Dc+d&cursor=%C3%A9"
        );
        let pairs: Vec<_> = url.query_pairs().collect();
        assert_eq!(pairs[0].1, "a&b=c d");
        let mut bare = client("http://h").url(&["queues"]).expect("a URL");
        add_query(&mut bare, &[("status", None)]);
        assert_eq!(bare.as_str(), "http://h/v1/queues");
    }

    #[test]
    fn a_worker_consumes_the_queues_it_names_weighted_or_not() {
        let worker = FleetReport {
            queues: vec!["default".into(), "high:6".into(), "a:b".into()],
            ..FleetReport::default()
        };
        for queue in ["default", "high", "high:6", "a:b"] {
            assert!(consumes(&worker, queue), "{queue}");
        }
        for queue in ["defaul", "a", "low", "high:"] {
            assert!(!consumes(&worker, queue), "{queue}");
        }
    }

    #[test]
    fn a_dlq_selection_is_the_body_the_api_takes() {
        let body = |s: DlqSelection| serde_json::to_value(s).expect("JSON");
        assert_eq!(
            body(DlqSelection::Ids(vec!["a".into()])),
            serde_json::json!({"ids": ["a"]})
        );
        assert_eq!(body(DlqSelection::All), serde_json::json!({"all": true}));
        assert_eq!(
            body(DlqSelection::OlderThanMs(5)),
            serde_json::json!({"older_than_ms": 5})
        );
    }
}
